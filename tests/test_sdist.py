"""Installable as users install it: the sdist carries every source file and
installs with `pip install --no-build-isolation` into a fresh venv over the
system torch; the result imports and works from outside the source tree.

Slow (it compiles the extension): one test."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import torchshm

REPO = Path(__file__).resolve().parents[1]
# Build outputs and caches: never part of the sdist.
IGNORED_DIRS = {
    ".git",
    ".venv",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".ipynb_checkpoints",
    "results",  # benchmarks/results
}
IGNORED_FILES = {"_build_info.json"}
# What the sdist must carry (every file of these kinds in the checkout).
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".toml", ".in", ".md", ".ipynb", ".sh"}


def ignore(directory, names):
    return {
        n
        for n in names
        if n in IGNORED_DIRS
        or n in IGNORED_FILES
        or n.endswith((".so", ".pyc", ".egg-info"))
    }


def run(args, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert (
        proc.returncode == 0
    ), f"{args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.timeout(900)
def test_sdist_has_every_source_file_and_installs_into_a_fresh_venv(tmp_path):
    # A copy: building an sdist writes into the tree (egg-info, build info).
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=ignore, symlinks=True)
    expected = {
        str(p.relative_to(src))
        for p in src.rglob("*")
        if p.is_file() and p.suffix in SOURCE_SUFFIXES
    }
    dist = tmp_path / "dist"
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 1))
    env.pop("PYTHONPATH", None)
    if importlib.util.find_spec("build") is not None:
        # -x: Debian's torch pins dependencies (sympy) Debian ships other
        # versions of; the build needs only torch and numpy importable.
        cmd = ["-m", "build", "--sdist", "--no-isolation", "-x", "--outdir", str(dist)]
    else:  # python3-build missing: setuptools' own command
        cmd = ["setup.py", "-q", "sdist", "--dist-dir", str(dist)]
    run([sys.executable, *cmd], cwd=src, env=env, timeout=300)
    (sdist,) = dist.glob("torchshm-*.tar.gz")
    assert sdist.name == f"torchshm-{torchshm.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        top = f"torchshm-{torchshm.__version__}/"
        members = {m.name[len(top) :] for m in tar.getmembers() if m.isfile()}
    missing = sorted(expected - members)
    assert not missing, f"the sdist lacks {missing}"
    assert {"csrc/segment.h", "MANIFEST.in", "setup.py"} <= members
    assert not [m for m in members if m.endswith((".so", ".pyc"))]

    venv = tmp_path / "venv"
    # From inside a venv, `-m venv` still builds on the base interpreter.
    run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    python = venv / "bin" / "python"
    run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-build-isolation",
            "--no-deps",  # torch and numpy: the system's, whatever torch pins
            "--no-index",
            "--no-cache-dir",
            str(sdist),
        ],
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import importlib.metadata as m, json, torchshm;"
        "print(json.dumps([torchshm.__file__, torchshm.__version__,"
        " m.version('torchshm')]))"
    )
    path, version, metadata = json.loads(
        run([str(python), "-c", probe], cwd=elsewhere, env=env, timeout=120)
    )
    assert Path(path).is_relative_to(venv) and version == metadata
    assert version == torchshm.__version__
    # The installed package's diagnostic report, spawn round trip included.
    report = json.loads(
        run(
            [str(python), "-m", "torchshm", "--json"],
            cwd=elsewhere,
            env=env,
            timeout=300,
        )
    )
    assert report["torchshm_path"] == os.path.dirname(path)
    assert report["round_trip"]["ok"], report["round_trip"]
