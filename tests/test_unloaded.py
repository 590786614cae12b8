"""`python -m torchshm` answers where the native extension cannot load (a
torch swapped under it, a wheel for another torch): the versions it was
built for and the ones installed, the error, and both remedies, instead of
the import's traceback (torchshm/_unloaded.py)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchshm

# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = pytest.mark.torch_os

PACKAGE = os.path.dirname(torchshm.__file__)


@pytest.fixture
def broken(tmp_path):
    """A copy of torchshm whose extension cannot load, built (it says) for
    torch 2.13.1 and numpy 2.4.6; the folder to run Python from."""
    copy = tmp_path / "torchshm"
    shutil.copytree(
        PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "_C.*.so")
    )
    (copy / f"_C{_extension_suffix()}").write_bytes(b"not a library")
    (copy / "_build_info.json").write_text('{"torch": "2.13.1", "numpy": "2.4.6"}')
    return tmp_path


def _extension_suffix():
    import sysconfig

    return sysconfig.get_config_var("EXT_SUFFIX")


def _run(folder, *args):
    env = dict(os.environ, PYTHONPATH=str(folder))
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=folder,
        env=env,
        timeout=120,
    )


def test_the_report_answers_without_the_extension(broken):
    run = _run(broken, "-m", "torchshm")
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stdout + run.stderr, run.stderr[-2000:]
    out = run.stdout
    assert "built for torch 2.13.1" in out
    assert f"torch    {torch.__version__} installed" in out
    assert f"numpy    {np.__version__} installed" in out
    assert "cannot load" in out
    minor = ".".join(torch.__version__.split(".")[:2])
    assert "--no-build-isolation" in out and f"wheel built for torch {minor}" in out


def test_the_report_as_json_and_the_doctor_too(broken):
    info = json.loads(_run(broken, "-m", "torchshm", "--json").stdout)
    assert info["torch"] == {"running": torch.__version__, "built_for": "2.13.1"}
    assert len(info["remedies"]) == 2
    doctor = _run(broken, "-m", "torchshm", "doctor")
    assert doctor.returncode == 1 and "Either remedy" in doctor.stdout


def test_an_import_still_fails_and_points_at_the_report(broken):
    run = _run(broken, "-c", "import torchshm")
    assert run.returncode != 0
    assert "ImportError" in run.stderr
    assert "built for torch 2.13.1" in run.stderr
    assert "python -m torchshm" in run.stderr


@pytest.mark.parametrize("isolated", [False, True])
def test_a_build_without_torch_names_the_cause(tmp_path, isolated):
    # setup.py imports torch and numpy: where they are missing it says why,
    # an isolated build (pip's, without --no-build-isolation) or an
    # environment that has no torch at all.
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True
    )
    path = "/tmp/pip-build-env-x/overlay/lib" if isolated else "/nowhere"
    run = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            f"import sys; sys.path.insert(0, {path!r});"
            " sys.argv = ['setup.py', '--name'];"
            " exec(compile(open('setup.py').read(), 'setup.py', 'exec'))",
        ],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(PACKAGE),
        timeout=120,
    )
    assert run.returncode == 1
    if isolated:
        assert "isolated build environment" in run.stderr
    else:
        assert "has no torch" in run.stderr and str(venv) in run.stderr
        assert "isolated" not in run.stderr
