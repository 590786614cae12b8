"""torchdata, for real: runs tests/torchdata_cases.py in a fresh process per
torchdata version and checks that the API groups that version has ran.

The torchdata used is the installed one (the pip lane's 0.11.0, whose API
groups must all run), else the unmodified sources in
../shared/vendor (next to the clone; TORCHSHM_VENDOR overrides) that fit this
torch: 0.5.1 on torch 1.x, 0.9.0 and 0.11.0 on torch 2.x, each put on
PYTHONPATH in its own process (so that spawned workers find it too). Skips,
naming the reason, when neither is available.
"""

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
VENDOR = Path(os.environ.get("TORCHSHM_VENDOR", REPO.parent / "shared" / "vendor"))
TORCH_MAJOR = int(re.match(r"\d+", torch.__version__).group())
# The vendored versions that run on this torch (see ../shared/vendor/README.md).
VENDORED = ["0.5.1"] if TORCH_MAJOR < 2 else ["0.9.0", "0.11.0"]
# The API groups (test name prefixes in torchdata_cases.py) each must run.
GROUPS = {
    "0.5.1": {"reading_service", "prototype"},
    "0.9.0": {"reading_service", "stateful"},
    "0.11.0": {"stateful", "nodes"},
}


def installed_version():
    """The installed torchdata's version as GROUPS names it ('0.11.0' for
    PyPI's 0.11.0+cpu), or None."""
    if importlib.util.find_spec("torchdata") is None:
        return None
    return importlib.metadata.version("torchdata").split("+")[0]


def sources():
    """(version, directory to put on PYTHONPATH or None), or a skip reason."""
    installed = installed_version()
    if installed is not None:  # the pip lane's
        return [(installed, None)], None
    found = [
        (v, VENDOR / f"torchdata-{v}")
        for v in VENDORED
        if (VENDOR / f"torchdata-{v}" / "torchdata").is_dir()
    ]
    if found:
        return found, None
    return [], (
        f"torchdata is not installed and {VENDOR} has no"
        f" {' or '.join('torchdata-' + v for v in VENDORED)} for torch"
        f" {torch.__version__} (a clone without ../shared/vendor)"
    )


SOURCES, SKIP = sources()


def results(junit):
    """{test name: 'passed' | 'skipped' | 'failed'} from a JUnit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        out[case.get("name")] = outcome
    return out


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    "version, path", SOURCES or [(None, None)], ids=[v for v, _ in SOURCES] or None
)
def test_torchdata(tmp_path, version, path):
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(path), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p]
        )
    junit = tmp_path / "junit.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfEs",
            f"--junitxml={junit}",
            "tests/torchdata_cases.py",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1150,
    )
    output = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, f"torchdata {version} cases failed:\n{output}"
    outcomes = results(junit)
    if path is not None:  # the vendored copy was the one imported
        probe = subprocess.run(
            [sys.executable, "-c", "import torchdata; print(torchdata.__file__)"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert probe.stdout.startswith(str(path)), probe.stdout + probe.stderr
    ran = {name for name, outcome in outcomes.items() if outcome == "passed"}
    assert ran, f"no torchdata case ran:\n{output}"
    # A version not listed (a newer install): whatever it has; one case ran.
    for group in GROUPS.get(version, ()):
        tests = {n: o for n, o in outcomes.items() if n.startswith(f"test_{group}_")}
        assert tests and set(tests.values()) == {
            "passed"
        }, f"torchdata {version}: every {group} case must run, got {tests}\n{output}"
