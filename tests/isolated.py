"""Drivers in a torchshm session of their own, and what a session leaves behind.

A driver is `python -m tests.fault_children SCENARIO ...` started without
TORCHSHM_SESSION, so it founds a fresh session: every segment it or its
descendants create is named `torchshm_<session>_*`, and its reaper is the one
`_reaper.py <session>` process. The driver prints `session <id>` first, then
one JSON object per line. It runs in a new process session (setsid), so its
descendants are found by session id even after they are orphaned.
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM_DIR = "/dev/shm"
# The reaper sweeps 2 s after the last process of a session is gone; allow for
# orphans still finishing their work and a loaded machine.
GRACE = 30


class Driver:
    """One driver process; every wait is bounded and close() kills leftovers."""

    def __init__(self, *args, wrapper=(), timeout=120):
        env = dict(os.environ)
        env.pop("TORCHSHM_SESSION", None)
        env["PYTHONPATH"] = os.pathsep.join(
            [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        self.deadline = time.monotonic() + timeout
        self.session = None
        # A file, not a pipe: children writing tracebacks must never block.
        self.errors = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "tests.fault_children", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
            start_new_session=True,
        )
        first = self.readline()
        if not first.startswith("session "):
            self.fail(f"driver did not start: {first!r}")
        self.session = first.split()[1]

    def readline(self):
        """The next stdout line ('' at EOF); fails once the deadline passes."""
        remaining = self.deadline - time.monotonic()
        ready, _, _ = select.select([self.proc.stdout], [], [], max(remaining, 0))
        if not ready:
            self.fail("driver timed out")
        return self.proc.stdout.readline()

    def results(self):
        """Every JSON line until the driver exits, and its exit status."""
        lines = []
        while line := self.readline():
            lines.append(json.loads(line))
        self.proc.wait(max(self.deadline - time.monotonic(), 1))
        return lines, self.proc.returncode

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stderr(self):
        self.errors.seek(0)
        return self.errors.read()[-4000:]

    def fail(self, message):
        text = f"{message}\ndriver stderr:\n{self.stderr()}"
        self.close()
        raise AssertionError(text)

    def close(self):
        """Kills whatever the driver left running (a no-op after a clean run)."""
        pids = session_processes(self.proc.pid, self.session)
        if self.proc.poll() is None:
            pids.append(self.proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.proc.stdout.close()
        self.errors.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def session_segments(session):
    prefix = f"torchshm_{session}_"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def _stat(pid):
    """(state, session id) of a process, or None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[3]))


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return []


def session_processes(sid, session=None):
    """Live processes of process session `sid` (the driver's tree), plus the
    reaper of torchshm session `session` (it runs in a process session of its
    own)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        stat = _stat(pid)
        if stat is None:
            continue
        argv = _cmdline(pid)
        is_reaper = (
            session is not None
            and len(argv) >= 2
            and argv[-2].endswith(b"_reaper.py")
            and argv[-1] == session.encode()
        )
        if stat[1] == sid or is_reaper:
            found.append(pid)
    return found


def leftovers(driver, grace=GRACE, shm=True):
    """(segments, processes) of the driver's session once its processes, the
    reaper last, are gone, or after `grace` seconds. The segments are read as
    soon as the reaper has exited (it sweeps, then exits), so that a reaper
    of another session sweeping ours as an orphan later cannot hide a miss.
    shm=False skips /dev/shm (a driver in another mount namespace checks its
    own)."""
    deadline = time.monotonic() + grace
    while True:
        procs = session_processes(driver.proc.pid, driver.session)
        if not procs or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return (session_segments(driver.session) if shm else []), procs


def _unshare_skip_reason():
    if os.geteuid() != 0:
        return "mounting a private tmpfs on /dev/shm needs root"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "true"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        return f"unshare -m is not permitted here: {probe.stderr.strip()}"
    return None


# The Docker default: 64 MB. unshare makes the mount private to the driver's
# tree, which also holds its session reaper.
SMALL_SHM = (
    "unshare",
    "-m",
    "sh",
    "-c",
    'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"',
    "sh",
)
NO_UNSHARE = _unshare_skip_reason()
