"""`python -m torchshm`: the diagnostic report for bug reports."""

import json
import multiprocessing as mp
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchshm
from torchshm import _config
from torchshm._native import _C

# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = pytest.mark.torch_os

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
    assert (
        "pool idle time     TORCHSHM_POOL_IDLE_SECONDS    30.0 seconds  [default]"
        in out
    )
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


def test_the_report_names_every_settings_variable_set_or_not():
    # A user who reads "pool cap" there sets TORCHSHM_POOL_BYTES, not
    # TORCHSHM_POOL_CAP.
    status, out, err = report("--no-check")
    assert status == 0, err
    for name, variable in _config.REPORT_NAMES.items():
        assert re.search(rf"^  {name} +{variable} ", out, re.M), (name, out)


def test_a_misspelled_setting_is_named_with_the_one_it_meant():
    run = subprocess.run(
        [sys.executable, "-c", "import torchshm"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=dict(
            os.environ,
            TORCHSHM_POOL_CAP="1G",  # the report's "pool cap"
            TORCHSHM_THRESHHOLD="1M",
            TORCHSHM_BENCH_PEERS="0",  # a tool's own: no setting, no warning
        ),
    )
    assert run.returncode == 0, run.stderr
    warned = re.findall(r"variable (\w+) is no torchshm setting.*?(\w+)\?", run.stderr)
    assert warned == [
        ("TORCHSHM_POOL_CAP", "TORCHSHM_POOL_BYTES"),
        ("TORCHSHM_THRESHHOLD", "TORCHSHM_THRESHOLD"),
    ], run.stderr


def _hold(inbox, outbox):
    held = inbox.get(timeout=TIMEOUT)
    outbox.put("holding")
    inbox.get(timeout=TIMEOUT)
    del held


@pytest.mark.multiprocess
def test_ls_names_each_holder_by_its_pid_and_command():
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_hold, args=(inbox, outbox))
    child.start()
    try:
        shared = torchshm.share(np.ones(1 << 20))
        uid = _C.segment_of(_C.memory_owner(shared)).name.rsplit(":", 1)[1]
        inbox.put(shared)
        assert outbox.get(timeout=TIMEOUT) == "holding"
        status, out, err = report("ls")
        assert status == 0, err
        (row,) = [line for line in out.splitlines() if uid in line]
        assert f"pid {os.getpid()} (" in row.split("held by:")[0]  # its creator
        assert f"pid {child.pid} (" in row.split("held by:")[1]
    finally:
        inbox.put("done")
        child.join(TIMEOUT)
    assert child.exitcode == 0


def test_ls_writes_a_holders_control_characters_as_escapes():
    from torchshm._tools import doctor

    line = doctor._process({"holder": "h", "pid": 7, "command": "x \x1b[2J\x07y"})
    assert line == "pid 7 (x \\x1b[2J\\x07y)"
    assert not any(not c.isprintable() for c in line)
