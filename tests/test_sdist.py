"""Installable as users install it: the sdist carries every source file, a
wheel builds from it with `pip wheel --no-build-isolation`, as `make wheel`
builds one (labelled with the torch it is for: 0.1.0+torch2.14), and the
wheel installs into a fresh venv that already has torch (this environment's);
the result imports and works from outside the source tree.

It compiles the extension (half a minute on two cores, more beside the
suite), so the build runs in the background from the start of the session
(`start_build`, called by conftest when this test is selected; it is moved
to the end; under xdist the controller starts it for its workers) and the
test checks what it made."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import torchshm

# the same on every stack: the pip lane only (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = pytest.mark.any_stack

REPO = Path(__file__).resolve().parents[1]
# Build outputs and caches: never part of the sdist.
IGNORED_DIRS = {
    ".git",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".ipynb_checkpoints",
    "results",  # benchmarks/results
    "_build",  # docs/_build: `make docs` output
}
IGNORED_FILES = {"_build_info.json"}
# What the sdist must carry (every file of these kinds in the checkout).
SOURCE_SUFFIXES = {
    ".py",
    ".cpp",
    ".h",
    ".toml",
    ".in",
    ".md",
    ".ipynb",
    ".sh",
    ".txt",  # requirements/: the sdist's Makefile installs from them
    ".json",  # tests/data, docs/figures
}


def ignore(directory, names):
    return {
        n
        for n in names
        if n in IGNORED_DIRS
        or n in IGNORED_FILES
        or n.startswith(".venv")  # the lanes' venvs: .venv, .venv-newest, .venv-lock
        or n.endswith((".so", ".pyc", ".egg-info"))
    }


def run(args, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert (
        proc.returncode == 0
    ), f"{args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


# Per step of the background build, against hangs only: it runs beside the
# whole suite, and the test's own wait bounds it too.
BUILD_TIMEOUT = 1800


def build(work):
    """Copies the checkout, makes its sdist and installs it into a fresh venv,
    all under `work`; returns what the test checks (or raises)."""
    work = Path(work)
    # A copy: building an sdist writes into the tree (egg-info, build info).
    src = work / "src"
    shutil.copytree(REPO, src, ignore=ignore, symlinks=True)
    expected = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*")
        if p.is_file() and p.suffix in SOURCE_SUFFIXES
    )
    venv = work / "venv"
    # From inside a venv, `-m venv` still builds on the base interpreter.
    run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    python = venv / "bin" / "python"
    _sees_this_environment(python)
    has_build = importlib.util.find_spec("build") is not None
    if has_build and pip_installed_torch():
        # The pip lane (torch from PyPI, in a venv): the install guide's
        # sdist route, as written, in the fresh venv.
        dist = src / "dist"
        env = venv_env(venv)
        for line in guide_sdist_route():
            run(["bash", "-c", line], cwd=src, env=env, timeout=BUILD_TIMEOUT)
        (sdist,) = dist.glob("torchshm-*.tar.gz")
        (wheel,) = dist.glob("torchshm-*.whl")
    else:  # a Debian lane: its own Python's tools
        dist, env = work / "dist", build_env()
        if has_build:
            # -x: Debian's torch pins dependencies (sympy) Debian ships other
            # versions of; the build needs only torch and numpy importable.
            cmd = ["-m", "build", "--sdist", "--no-isolation", "-x"]
            cmd += ["--outdir", str(dist)]
        else:  # python3-build missing: setuptools' own command
            cmd = ["setup.py", "-q", "sdist", "--dist-dir", str(dist)]
        run([sys.executable, *cmd], cwd=src, env=env, timeout=BUILD_TIMEOUT)
        (sdist,) = dist.glob("torchshm-*.tar.gz")
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",  # as `make wheel` builds one, with the torch label
                "-q",
                "--no-build-isolation",
                "--no-deps",  # this environment's torch and numpy
                "--no-index",
                "--no-cache-dir",
                "--wheel-dir",
                str(dist),
                str(sdist),
            ],
            cwd=work,
            env=dict(env, TORCHSHM_TORCH_LABEL="1"),
            timeout=BUILD_TIMEOUT,
        )
        (wheel,) = dist.glob("torchshm-*.whl")
        run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
            + ["--no-cache-dir", str(wheel)],
            cwd=work,
            env=env,
            timeout=BUILD_TIMEOUT,
        )
    with tarfile.open(sdist) as tar:
        top = f"torchshm-{torchshm.__version__}/"
        members = sorted(m.name[len(top) :] for m in tar.getmembers() if m.isfile())
    return {
        "sdist": sdist.name,
        "wheel": wheel.name,
        "wheel_path": str(wheel),
        "expected": expected,
        "members": members,
        "python": str(python),
    }


def _sees_this_environment(python):
    """In a venv (the pip lane's), --system-site-packages shows the base
    interpreter's packages, not this venv's torch: a .pth line adds this
    environment's site-packages after the new venv's own, as a user's venv
    that already has torch (its .pth files, the editable torchshm's among
    them, are not read: Python reads those of site directories only)."""
    if sys.prefix == sys.base_prefix:
        return
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    inner = Path(run([str(python), "-c", purelib]).strip())
    (inner / "_outer_environment.pth").write_text(sysconfig.get_path("purelib") + "\n")


def pip_installed_torch():
    """Whether torch is pip's, in this venv (the pip and newest lanes), not
    Debian's (the Debian lanes' venvs see it through their system site
    packages: pip would resolve its pins, which Debian does not meet)."""
    return sys.prefix != sys.base_prefix and Path(torch.__file__).is_relative_to(
        sys.prefix
    )


def guide_sdist_route():
    """The shell lines of the install guide's sdist route (its block that
    runs `python -m build`), comments dropped."""
    text = (REPO / "docs" / "guide" / "install.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if "python -m build" in b]
    return [line.split(" #")[0].strip() for line in block.splitlines() if line.strip()]


def venv_env(venv):
    """The environment of a shell in which `venv` is active, without this
    machine's pip configuration (its constraint file caps torch below the
    one the venv sees)."""
    env = build_env()
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    env["VIRTUAL_ENV"] = str(venv)
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_CONSTRAINT="", PIP_NO_INPUT="1")
    return env


def torch_minor():
    """This torch's major.minor, as in '2.14' (of '2.14.1+cu130')."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def build_env():
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 1))
    env.pop("PYTHONPATH", None)
    return env


class SharedBuild:
    """A build in `work`, started elsewhere (an xdist worker's view of the
    build its controller started)."""

    def __init__(self, work):
        self.work = Path(work)

    def wait(self, timeout):
        return wait_for(self.work, timeout)

    def discard(self):
        pass  # its starter's


class BackgroundBuild(SharedBuild):
    """`build` in a process of its own, started before the other tests run:
    they spend much of their time waiting on children, so the compile mostly
    fills idle CPU. Not niced: on a loaded machine a niced compile starved
    past its time limit (pip install > 600 s beside three other suites)."""

    def __init__(self, work=None):
        super().__init__(work or tempfile.mkdtemp(prefix="torchshm-sdist-"))
        with open(self.work / "build.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(self.work)],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def discard(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


def wait_for(work, timeout):
    """What the build in `work` made (or its log, as the failure), by
    whichever process it runs in."""
    deadline = time.monotonic() + timeout
    while not (work / "result.json").exists():
        if (work / "failed").exists() or time.monotonic() > deadline:
            log = (work / "build.log").read_text()[-8000:]
            raise AssertionError(
                f"the sdist build failed or took > {timeout} s:\n{log}"
            )
        time.sleep(0.5)
    return json.loads((work / "result.json").read_text())


# Under xdist: the build directory the controller's workers share.
SHARED_BUILD = "TORCHSHM_SDIST_BUILD"
_build = None


def prepare_shared_build():
    """In the xdist controller, before its workers start (they inherit it)."""
    os.environ[SHARED_BUILD] = tempfile.mkdtemp(prefix="torchshm-sdist-")


def start_build():
    """Starts the background build (once per session); conftest calls it at
    collection, or the xdist controller once a worker has collected the test."""
    global _build
    if _build is None:
        shared = os.environ.get(SHARED_BUILD)
        if shared and os.environ.get("PYTEST_XDIST_WORKER"):
            _build = SharedBuild(shared)
        else:
            _build = BackgroundBuild(shared)
    return _build


def discard_build():
    if _build is not None:
        _build.discard()
    shared = os.environ.get(SHARED_BUILD)
    if shared and not os.environ.get("PYTEST_XDIST_WORKER"):
        # The controller's directory, even if no worker collected the test.
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.timeout(900)
def test_sdist_has_every_source_file_and_installs_into_a_fresh_venv(tmp_path):
    built = start_build().wait(timeout=840)
    # The sdist is unlabelled; the wheel names the torch it runs beside.
    assert built["sdist"] == f"torchshm-{torchshm.__version__}.tar.gz"
    labelled = f"{torchshm.__version__}+torch{torch_minor()}"
    assert built["wheel"].startswith(f"torchshm-{labelled}-cp")
    members = set(built["members"])
    missing = sorted(set(built["expected"]) - members)
    assert not missing, f"the sdist lacks {missing}"
    assert {"csrc/lifetime/segment.h", "MANIFEST.in", "setup.py"} <= members
    assert not [m for m in members if m.endswith((".so", ".pyc"))]

    python, env = built["python"], build_env()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import importlib.metadata as m, json, torchshm;"
        "print(json.dumps([torchshm.__file__, torchshm.__version__,"
        " m.version('torchshm')]))"
    )
    path, version, metadata = json.loads(
        run([python, "-c", probe], cwd=elsewhere, env=env, timeout=120)
    )
    assert Path(path).is_relative_to(Path(python).parents[1])
    assert version == torchshm.__version__ and metadata == labelled
    # The installed package's diagnostic report, spawn round trip included.
    report = json.loads(
        run(
            [python, "-m", "torchshm", "--json"],
            cwd=elsewhere,
            env=env,
            timeout=300,
        )
    )
    assert report["torchshm_path"] == os.path.dirname(path)
    assert report["round_trip"]["ok"], report["round_trip"]

    # The wheel requires the torch minor it was built for: pip refuses it
    # beside another (its extension would not import there), and takes it
    # beside any patch release of that minor.
    wheel = Path(built["wheel_path"])
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [
            # Older setuptools (Debian 12's) write "torch (==1.13.*)".
            re.sub(r"[\s()]", "", line.split(":", 1)[1])
            for line in archive.read(name).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    assert f"torch=={torch_minor()}.*" in requires, requires
    major, minor = (int(n) for n in torch_minor().split("."))
    other = f"{major}.{minor + 1}.0"
    refused = _dry_install(wheel, other, tmp_path)
    assert refused.returncode != 0
    assert f"torch=={torch_minor()}.*" in refused.stdout + refused.stderr
    assert _dry_install(wheel, f"{torch_minor()}.9", tmp_path).returncode == 0


def _dry_install(wheel, torch_version, tmp_path):
    """`pip install --dry-run` of `wheel` into a fresh venv whose only torch
    is a distribution's metadata of version `torch_version` (and numpy's,
    of this numpy's version)."""
    venv = tmp_path / f"torch-{torch_version}"
    run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    purelib = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    )
    # This numpy's version: a wheel built against NumPy 1 requires numpy<2.
    for name, version in (("torch", torch_version), ("numpy", np.__version__)):
        info = Path(purelib.strip()) / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
    # Not the machine's pip configuration (its constraints cap torch).
    env = dict(build_env(), PIP_CONFIG_FILE=os.devnull, PIP_CONSTRAINT="")
    return subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


if __name__ == "__main__":  # the background build: python test_sdist.py WORK
    work = Path(sys.argv[1])
    try:
        result = build(work)
    except BaseException:
        (work / "failed").touch()  # a waiter in another process reads the log
        raise
    # Renamed into place: waiters poll for it.
    (work / "result.tmp").write_text(json.dumps(result))
    (work / "result.tmp").rename(work / "result.json")
