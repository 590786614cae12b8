"""The device script's CPU half (scripts/device_check.py, benchmarks/gpu.py):
its arguments, its table, and the GPU scenario's checksums through the fake
CUDA runtime, end to end."""

import json
import subprocess
import sys

import pytest

from benchmarks import gpu
from tests.conftest import ROOT, script

# the same on every stack: the pip lane only (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.any_stack]


def test_the_arguments():
    device_check = script("device_check")
    args = device_check.parse_args(["out", "--fake", "--workers", "1,2"])
    assert (args.out, args.fake, args.workers, args.no_build) == (
        "out",
        True,
        "1,2",
        False,
    )
    args = gpu.parse_args(
        ["--out", "d", "--workers", "1,4,14", "--methods", "torch_pin"]
    )
    assert (args.workers, args.methods) == ([1, 4, 14], ["torch_pin"])
    assert gpu.parse_args(["--out", "d", "--fake"]).methods == ["device_loader"]
    with pytest.raises(SystemExit):
        gpu.parse_args(["--out", "d", "--methods", "nonsense"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--out", "d", "--workers", "one"])
    assert gpu.default_workers(16) == [1, 4, 14]
    assert gpu.default_workers(2) == [1]


def test_the_table_gives_each_method_its_ratio_to_torch():
    second = {"seconds": [0.5, 0.5], "cpu_per_batch": 0.002, "wrong": 0}
    runs = {
        ("torch_pin", 4): dict(second, seconds=[2.0, 2.0]),
        ("torchshm_pinned", 4): second,
        ("device_loader", 4): dict(second, wrong=3),
        ("torchshm_unpinned", 4): {"error": "RuntimeError: no CUDA"},
    }
    rows = gpu.summarize(runs, samples=2048)
    by_method = {r["method"]: r for r in rows}
    assert by_method["torchshm_pinned"]["gbps"] == pytest.approx(
        2048 * (1 << 20) / 0.5 / 1e9
    )
    text = gpu.table(rows)
    assert "| 4 | torchshm pinned |" in text and "| 4.00x |" in text
    assert "3 WRONG" in text
    assert "failed: RuntimeError: no CUDA" in text


def test_the_scenario_checksums_through_the_fake_runtime(tmp_path):
    run = subprocess.run(
        [sys.executable, "scripts/device_check.py", str(tmp_path), "--fake"]
        + ["--workers", "0,2", "--samples", "96"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert [(r["workers"], r["method"], r["checksums"]) for r in rows] == [
        (0, "device_loader", "all right"),
        (2, "device_loader", "all right"),
    ]
    summary = (tmp_path / "summary.md").read_text()
    assert "| scenario | ok |" in summary and "| build | skipped |" in summary
