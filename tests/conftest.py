"""Shared fixtures: start methods, bounded child runs, and the leak checker."""

import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

# Every array of at least one byte is shared, so small test arrays exercise the
# shared path; set before torchshm is imported so that children inherit it.
os.environ.setdefault("TORCHSHM_THRESHOLD", "1")

import pytest  # noqa: E402

import torchshm  # noqa: E402
from torchshm import _session  # noqa: E402

START_METHODS = ("fork", "spawn", "forkserver")
TIMEOUT = 60


@pytest.fixture(scope="session", autouse=True)
def warm_start_methods():
    # The forkserver and the resource tracker keep fds open for the whole run;
    # start them before any test counts fds.
    for method in START_METHODS:
        ctx = mp.get_context(method)
        p = ctx.Process(target=os.getpid)
        p.start()
        p.join(TIMEOUT)


@pytest.fixture(params=START_METHODS)
def ctx(request):
    return mp.get_context(request.param)


def session_segments():
    prefix = f"torchshm_{_session.session_id()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def open_fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_leaks():
    """Fails a test that leaves a segment or an fd behind once its processes
    are gone (after a short grace period for exiting children). The pool keeps
    idle segments on purpose; trim() hands them back before counting."""
    gc.collect()
    torchshm.trim()
    segments, fds = session_segments(), len(open_fds())
    yield
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        torchshm.trim()
        extra_segments = session_segments() - segments
        extra_fds = len(open_fds()) - fds
        if (not extra_segments and extra_fds <= 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not extra_segments, f"segments left behind: {sorted(extra_segments)}"
    assert extra_fds <= 0, f"{extra_fds} fds left open"


def run_script(tmp_path, source, *args):
    """Runs `source` as a user's main script (its own process, so its own
    imports); returns what it printed as JSON."""
    script = tmp_path / "train.py"
    script.write_text(source)
    run = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


class Child:
    """A child process with an inbox and an outbox; every wait is bounded."""

    def __init__(self, ctx, target, *args):
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=target, args=(self.inbox, self.outbox) + args, daemon=True
        )
        self.process.start()

    def send(self, obj):
        self.inbox.put(obj)

    def receive(self):
        return self.outbox.get(timeout=TIMEOUT)

    def close(self):
        self.process.join(TIMEOUT)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(TIMEOUT)
        exitcode = self.process.exitcode
        for q in (self.inbox, self.outbox):
            q.close()
            q.join_thread()
        # A queue closes its write end only when freed.
        self.inbox = self.outbox = None
        self.process.close()
        return exitcode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def child():
    children = []

    def start(ctx, target, *args):
        c = Child(ctx, target, *args)
        children.append(c)
        return c

    yield start
    for c in children:
        if c.inbox is not None:
            c.close()


__all__ = ["torchshm", "Child", "session_segments", "open_fds"]
