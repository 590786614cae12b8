"""`python -m torchshm`: the diagnostic report for bug reports."""

import json
import os
import subprocess
import sys

import numpy as np
import torch

import torchshm

TIMEOUT = 300


def report(*args, **env):
    run = subprocess.run(
        [sys.executable, "-m", "torchshm", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=dict(os.environ, **env),
    )
    return run.returncode, run.stdout, run.stderr


def test_report_names_versions_settings_and_a_working_spawn_round_trip():
    status, out, err = report(TORCHSHM_POOL_BYTES="64M")
    assert status == 0, out + err
    assert f"torchshm {torchshm.__version__}" in out
    assert f"torch    {torch.__version__} running" in out
    assert f"numpy    {np.__version__} running" in out
    assert f"Python   {sys.version.split()[0]}" in out
    assert "/dev/shm " in out and " free" in out
    assert "[env TORCHSHM_POOL_BYTES=64M]" in out
    assert "pool idle time     30.0 seconds  [default]" in out
    assert "reducers registered" in out
    assert "spawn round trip ok" in out, out


def test_json_report_says_where_each_setting_came_from():
    status, out, err = report(
        "--json", "--no-check", TORCHSHM_THRESHOLD="1M", TORCHSHM_DISABLE="1"
    )
    assert status == 0, err
    info = json.loads(out)
    from torchshm import _C

    assert info["torch"] == {
        "running": torch.__version__,
        "built_for": _C.built_with_torch,
    }
    assert info["numpy"]["built_for"] == _C.built_with_numpy
    settings = {s["name"]: s for s in info["settings"]}
    assert settings["threshold"]["value"] == 1 << 20
    assert settings["threshold"]["source"] == "env TORCHSHM_THRESHOLD=1M"
    assert settings["pool cap"]["source"].startswith("default")
    assert info["registered"] is False
    assert info["registration_source"] == "env TORCHSHM_DISABLE=1"
    assert info["dev_shm"]["size"] >= info["dev_shm"]["free"] > 0
    assert "round_trip" not in info
