"""Registration and configuration: unregister() gives back a foreign reducer,
TORCHSHM_DISABLE at import, the version-mismatch ImportError, and a clear
error for a bad value of every environment variable torchshm reads."""

import ctypes
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import torchshm
from torchshm import _compat, _config
from tests import conftest
from tests.conftest import TIMEOUT

# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = pytest.mark.torch_os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(source, **env):
    """Runs `source` in a fresh interpreter with `env` added; the process."""
    return conftest.run_python(source, env=dict(os.environ, **env))


def run_json(source, **env):
    run = run_python(source, **env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


# --------------------------------------------------------------- registration


def test_unregister_gives_back_a_reducer_registered_before_torchshm():
    result = run_json(
        """
        import json, pickle
        from multiprocessing.reduction import ForkingPickler
        import numpy as np

        def foreign(a):
            return np.array, (a.tolist(),)

        ForkingPickler.register(np.ndarray, foreign)
        import torchshm
        from torchshm._send import sender as _sender

        table = ForkingPickler._extra_reducers
        out = {"took_over": table[np.ndarray] is _sender.reduce_ndarray}
        with torchshm.disabled():
            out["foreign_inside_disabled"] = table[np.ndarray] is foreign
        out["back_after_disabled"] = table[np.ndarray] is _sender.reduce_ndarray
        torchshm.unregister()
        out["foreign_back"] = table[np.ndarray] is foreign
        out["registered"] = torchshm.is_registered()
        # Subclasses had no reducer before torchshm: they have none again.
        out["memmap_reducer"] = repr(table.get(np.memmap))
        a = pickle.loads(ForkingPickler.dumps(np.arange(5.0)))
        out["by_foreign"] = not torchshm.is_shared(a) and a.tolist() == [
            0.0, 1.0, 2.0, 3.0, 4.0
        ]
        torchshm.register()
        out["again"] = table[np.ndarray] is _sender.reduce_ndarray
        torchshm.unregister()
        out["foreign_again"] = table[np.ndarray] is foreign
        print(json.dumps(out))
        """
    )
    assert result == {
        "took_over": True,
        "foreign_inside_disabled": True,
        "back_after_disabled": True,
        "foreign_back": True,
        "registered": False,
        "memmap_reducer": "None",
        "by_foreign": True,
        "again": True,
        "foreign_again": True,
    }


DISABLE_SCRIPT = """
    import json, pickle
    from multiprocessing import connection
    from multiprocessing.reduction import ForkingPickler
    import numpy as np
    send_bytes = connection.Connection._send_bytes
    import torchshm

    out = {"registered_at_import": torchshm.is_registered()}
    out["patched_at_import"] = connection.Connection._send_bytes is not send_bytes
    a = np.arange(1000.0)
    before = torchshm.stats()
    received = pickle.loads(ForkingPickler.dumps(a))
    out["by_value"] = bool(not torchshm.is_shared(received) and (received == a).all())
    after = torchshm.stats()
    out["arrays_shared"] = after["arrays_shared"] - before["arrays_shared"]
    torchshm.register()
    out["registered_later"] = torchshm.is_registered()
    out["patched_later"] = connection.Connection._send_bytes is not send_bytes
    received = pickle.loads(ForkingPickler.dumps(a))
    out["shared_later"] = bool(torchshm.is_shared(received) and (received == a).all())
    print(json.dumps(out))
"""


@pytest.mark.parametrize("value", ["1", "true", "YES", "True"])
def test_torchshm_disable_at_import(value):
    result = run_json(DISABLE_SCRIPT, TORCHSHM_DISABLE=value)
    assert result == {
        "registered_at_import": False,
        "patched_at_import": False,  # disabled: multiprocessing as it is
        "by_value": True,
        "arrays_shared": 0,
        "registered_later": True,
        "patched_later": True,
        "shared_later": True,
    }


@pytest.mark.parametrize("value", ["0", "false", "No", ""])
def test_torchshm_disable_off_registers_at_import(value):
    result = run_json(DISABLE_SCRIPT, TORCHSHM_DISABLE=value)
    assert result["registered_at_import"] and not result["by_value"]
    assert result["patched_at_import"] and result["arrays_shared"] == 1


def test_the_registry_fixture_restores_what_a_test_changed_1():
    # This test and the next: whichever runs second sees the state restored.
    assert torchshm.is_registered()
    assert torchshm.get_threshold() == _config.parse_size(
        os.environ["TORCHSHM_THRESHOLD"]
    )
    torchshm.unregister()
    torchshm.set_threshold(12345)


def test_the_registry_fixture_restores_what_a_test_changed_2():
    assert torchshm.is_registered()
    assert torchshm.get_threshold() == _config.parse_size(
        os.environ["TORCHSHM_THRESHOLD"]
    )
    ForkingPickler.register(np.ndarray, lambda a: (np.array, (a.tolist(),)))
    assert not torchshm.is_registered()


# ------------------------------------------------------------ version mismatch


def test_a_native_extension_built_for_another_torch_is_refused(monkeypatch):
    monkeypatch.setattr(torchshm._C, "built_with_torch", "1.7.1")
    with pytest.raises(ImportError) as info:
        _compat.check_native(torchshm._C)
    message = str(info.value)
    assert "built for torch 1.7.1" in message
    assert f"this process has torch {torch.__version__}" in message
    assert f"numpy {np.__version__}" in message
    assert _compat.REBUILD in message  # how to rebuild
    # Never "pip install ... torchshm" (no index has it), never without
    # --no-deps (pip would replace this torch with the newest).
    assert "--no-deps" in message and "install SOURCE" in message
    assert not re.search(r"(reinstall|isolation) torchshm\b", message)


def test_an_isolated_build_says_why_it_cannot_see_torch_and_numpy():
    # -S: no site-packages, as in pip's isolated build environment.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-S", "setup.py", "--name"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=root,
    )
    assert out.returncode == 1
    assert "isolated build environment holds neither" in out.stderr, out.stderr
    assert "pip install --no-build-isolation --no-deps ." in out.stderr


def test_a_numpy_1_build_is_refused_under_numpy_2(monkeypatch):
    monkeypatch.setattr(torchshm._C, "built_with_numpy", "1.24.2")
    monkeypatch.setattr(_compat, "NUMPY_VERSION", (2, 1))
    with pytest.raises(ImportError, match=r"built for torch .* and numpy 1\.24\.2"):
        _compat.check_native(torchshm._C)


def test_a_numpy_2_build_runs_on_numpy_1(monkeypatch):
    monkeypatch.setattr(torchshm._C, "built_with_numpy", "2.0.0")
    monkeypatch.setattr(_compat, "NUMPY_VERSION", (1, 24))
    _compat.check_native(torchshm._C)  # no error


def test_an_extension_that_does_not_load_says_it_is_damaged_not_mismatched():
    # A fresh interpreter whose torchshm._C cannot be imported, built for
    # this very torch and numpy (its build record): the file is the cause,
    # not a version mismatch between identical versions.
    script = (
        "import sys\n"
        "sys.modules['torchshm._C'] = None\n"
        "try:\n"
        "    import torchshm\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT
    )
    built = _compat._build_info()
    message = " ".join(out.stdout.split())
    assert f"built for torch {built['torch']}" in message, out
    assert "which fit this process's torch" in message, out
    assert "missing, truncated or damaged" in message, out
    assert "but this process has" not in message, out
    assert " ".join(_compat.REBUILD.split()) in message


def test_an_extension_built_for_another_torch_that_does_not_load_names_both():
    built = {"torch": "1.0.0", "numpy": np.__version__}
    message = str(_compat.native_import_error(OSError("undefined symbol"), built))
    assert "built for torch 1.0.0" in message
    assert f"but this process has torch {torch.__version__}" in message
    assert "undefined symbol" in message


@pytest.mark.parametrize("text", ["[1, 2]", '"2.15"', "null", '{"torch": 2}', "{"])
def test_a_build_record_that_is_not_an_object_of_versions_counts_as_none(
    tmp_path, text
):
    path = tmp_path / "_build_info.json"
    path.write_text(text)
    assert _compat._build_info(str(path)) == {}
    message = str(_compat.native_import_error(OSError("gone"), {}))
    assert "without a build record" in message and "gone" in message


# ------------------------------------------------------- environment variables

BAD_VALUES = [
    ("TORCHSHM_THRESHOLD", "12x", "a size in bytes"),
    ("TORCHSHM_THRESHOLD", "-1", "a size in bytes"),
    ("TORCHSHM_THRESHOLD", "1.5M", "a size in bytes"),
    ("TORCHSHM_POOL_BYTES", "lots", "a size in bytes"),
    ("TORCHSHM_POOL_BYTES", "4T", "a size in bytes"),
    ("TORCHSHM_MAPPING_CACHE_BYTES", "1 GB of it", "a size in bytes"),
    ("TORCHSHM_POOL_IDLE_SECONDS", "soon", "a non-negative number of seconds"),
    ("TORCHSHM_POOL_IDLE_SECONDS", "-1", "a non-negative number of seconds"),
    ("TORCHSHM_POOL_IDLE_SECONDS", "nan", "a non-negative number of seconds"),
    ("TORCHSHM_POOL_IDLE_SECONDS", "30s", "a non-negative number of seconds"),
    ("TORCHSHM_DISABLE", "maybe", "one of 1, 0, true, false, yes, no"),
    ("TORCHSHM_DISABLE", "2", "one of 1, 0, true, false, yes, no"),
    ("TORCHSHM_DISABLE", "on", "one of 1, 0, true, false, yes, no"),
    ("TORCHSHM_TENSORS", "maybe", "one of 1, 0, true, false, yes, no"),
    ("TORCHSHM_SESSION", "../etc", "1 to 64 letters, digits, _ or -"),
    ("TORCHSHM_SESSION", "a.b", "1 to 64 letters, digits, _ or -"),
    ("TORCHSHM_SESSION", "x" * 65, "1 to 64 letters, digits, _ or -"),
    ("TORCHSHM_THRESHOLD", str(1 << 63), "a size in bytes"),
    ("TORCHSHM_POOL_BYTES", "9999999999999G", "a size in bytes"),
    ("TORCHSHM_POOL_IDLE_SECONDS", "1e300", "a non-negative number of seconds"),
    ("TORCHSHM_KEEPER_TIMEOUT", "soon", "a positive number of seconds"),
    ("TORCHSHM_KEEPER_TIMEOUT", "0", "a positive number of seconds"),
    ("TORCHSHM_KEEPER_TIMEOUT", "1e300", "a positive number of seconds"),
    ("TORCHSHM_SESSION_LINGER", "-5", "a non-negative number of seconds"),
    ("TORCHSHM_PIN_BYTES", "all", "a size in bytes"),
]


def test_every_variable_torchshm_reads_is_checked():
    # Each name in torchshm's sources that looks like TORCHSHM_<NAME> and is
    # read from the environment is in SETTINGS (and so in BAD_VALUES).
    import re

    read = set()
    package = os.path.dirname(torchshm.__file__)
    for name in os.listdir(package):
        if name.endswith(".py"):
            with open(os.path.join(package, name)) as f:
                read |= set(re.findall(r"\"(TORCHSHM_[A-Z_]+)\"", f.read()))
    # The tools' own variables are named there only to be told apart.
    read -= _config.TOOL_VARIABLES
    assert read <= set(_config.SETTINGS), read - set(_config.SETTINGS)
    assert {name for name, _, _ in BAD_VALUES} == set(_config.SETTINGS)


@pytest.mark.parametrize("name, value, accepted", BAD_VALUES)
def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(
    monkeypatch, name, value, accepted
):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        _config.check_environment()
    message = str(info.value)
    assert name in message and repr(value) in message and accepted in message
    with pytest.raises(ValueError, match=name):
        _config.env_setting(name)


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("TORCHSHM_THRESHOLD", "128K", 128 << 10),
        ("TORCHSHM_POOL_BYTES", "2MiB", 2 << 20),
        ("TORCHSHM_MAPPING_CACHE_BYTES", "0", 0),
        ("TORCHSHM_POOL_IDLE_SECONDS", "0.5", 0.5),
        ("TORCHSHM_DISABLE", " TRUE ", True),
        ("TORCHSHM_DISABLE", "no", False),
        ("TORCHSHM_DISABLE", "", "unset"),  # empty counts as unset
        ("TORCHSHM_SESSION", "0123abcdef01", "0123abcdef01"),
    ],
)
def test_good_values_parse(monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    _config.check_environment()
    assert _config.env_setting(name, "unset") == expected


def test_a_bad_value_fails_the_import_naming_every_bad_variable():
    run = run_python(
        "import torchshm",
        TORCHSHM_THRESHOLD="big",
        TORCHSHM_POOL_IDLE_SECONDS="forever",
        TORCHSHM_DISABLE="nope",
    )
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()
    assert any(line.startswith("ValueError: ") for line in last), run.stderr
    for text in ("TORCHSHM_THRESHOLD='big'", "TORCHSHM_POOL_IDLE_SECONDS='forever'"):
        assert text in run.stderr
    assert "TORCHSHM_DISABLE='nope'" in run.stderr


def test_register_checks_the_environment_in_the_callers_thread(monkeypatch):
    torchshm.unregister()
    monkeypatch.setenv("TORCHSHM_POOL_BYTES", "many")
    with pytest.raises(ValueError, match="TORCHSHM_POOL_BYTES='many'"):
        torchshm.register()
    assert not torchshm.is_registered()
    with pytest.raises(ValueError, match="TORCHSHM_POOL_BYTES='many'"):
        torchshm.worker_init_fn(0)  # a DataLoader worker's registration


def test_a_value_made_bad_after_import_never_raises_inside_a_reducer(monkeypatch):
    # Read inside the reducer (the pool cap) and the expiry timer: a warning
    # and the last good value, never an exception that would lose a message.
    monkeypatch.setattr(_config, "_last_good", {})
    good = _config.pool_bytes()
    monkeypatch.setenv("TORCHSHM_POOL_BYTES", "all of it")
    monkeypatch.setenv("TORCHSHM_MAPPING_CACHE_BYTES", "-3")
    monkeypatch.setenv("TORCHSHM_POOL_IDLE_SECONDS", "later")
    with pytest.warns(RuntimeWarning, match="TORCHSHM_POOL_BYTES='all of it'"):
        assert _config.pool_bytes() == good
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _config.pool_idle_seconds() == _config.DEFAULT_POOL_IDLE_SECONDS
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        sent = np.arange(300_000.0)
        before = torchshm.stats()
        q.put(sent)  # pickled by the feeder thread
        received = q.get(timeout=TIMEOUT)
        q.close()
        q.join_thread()
        assert torchshm.is_shared(received) and (received == sent).all()
        assert torchshm.stats()["fallbacks"] == before["fallbacks"]
        del received  # its mapping goes idle while the value is still bad
    # Warned once per bad value, not once per read.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config.pool_bytes()


def test_the_threshold_is_read_at_import():
    result = run_json(
        "import json, torchshm; print(json.dumps(torchshm.get_threshold()))",
        TORCHSHM_THRESHOLD="1M",
    )
    assert result == 1 << 20


# ------------------------------------------------------------ one C++ runtime

CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")


@pytest.mark.parametrize(
    "flags,own",
    [
        ([], False),
        # Python loads extension modules (torch's libstdc++ with them) into
        # local scopes, so nothing interposes a static copy's functions.
        (["-static-libstdc++"], True),
        # What the GPU machines' compiler wrapper and Ubuntu's Python link.
        (["-static-libstdc++", "-Wl,-Bsymbolic-functions"], True),
    ],
    ids=["shared", "static", "static-bsymbolic"],
)
def test_a_library_knows_whether_it_runs_a_cxx_runtime_of_its_own(flags, own, tmp_path):
    # The detection of csrc/base/cxx_runtime.h, built into a small library as the
    # module is, loaded into this process (which holds torch's libstdc++).
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("needs g++, the compiler torchshm's module is built with")
    source = tmp_path / "probe.cpp"
    source.write_text(
        '#include "base/cxx_runtime.h"\n'
        'extern "C" int probe() { return torchshm::own_cxx_runtime(); }\n'
    )
    library = tmp_path / "probe.so"
    subprocess.run(
        [cxx, "-std=c++17", "-shared", "-fPIC", "-I", CSRC, str(source)]
        + ["-o", str(library)]
        + flags,
        check=True,
        timeout=120,
    )
    # A static copy's functions are interposed by a libstdc++ already in
    # the process's global scope (torch 2.15 puts it there): then even the
    # plain static build runs the shared runtime's std::terminate.
    if flags == ["-static-libstdc++"] and _global_cxx_runtime():
        own = False
    assert ctypes.CDLL(str(library)).probe() == int(own)


def _global_cxx_runtime():
    try:
        ctypes.CDLL(None)._ZSt9terminatev
        return True
    except AttributeError:
        return False


def test_this_module_shares_torchs_cxx_runtime():
    assert torchshm._C.own_cxx_runtime is False


def test_a_module_with_a_cxx_runtime_of_its_own_is_refused(monkeypatch):
    monkeypatch.setattr(torchshm._C, "own_cxx_runtime", True)
    with pytest.raises(ImportError, match="C\\+\\+ runtime of its own") as info:
        _compat.check_native(torchshm._C)
    assert "CXX=" in str(info.value)  # how to rebuild


@pytest.mark.parametrize("value", [-1, 1 << 63, True, "8E"])
def test_set_threshold_refuses_what_no_size_is_with_what_it_accepts(value):
    before = torchshm.get_threshold()
    with pytest.raises(ValueError, match="a size in bytes"):
        torchshm.set_threshold(value)
    assert torchshm.get_threshold() == before
