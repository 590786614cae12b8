"""Drivers in a torchshm session of their own, and what a session leaves behind.

A driver is `python -m tests.fault_children SCENARIO ...` (or another
module's `main`, `module=`) started without
TORCHSHM_SESSION, so it founds a fresh session: every segment it or its
descendants create is held by that session's keeper, the one
`daemon.py <session>` process (the keeper). The driver prints `session <id>` first, then
one JSON object per line. It runs in a new process session (setsid), so its
descendants are found by session id even after they are orphaned.
"""

import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from torchshm import _memory
from torchshm._lifetime import session as _session
from torchshm._keeper import protocol as _protocol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM_DIR = "/dev/shm"
# The keeper sweeps 2 s after the last process of a session is gone; allow for
# orphans still finishing their work and a loaded machine.
GRACE = 30


class Driver:
    """One driver process; every wait is bounded and close() kills leftovers."""

    def __init__(self, *args, wrapper=(), timeout=120, module="tests.fault_children"):
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
            [*wrapper, sys.executable, "-m", module, *args],
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


def session_report(session):
    """{name: the keeper's report} of a session's segments; empty once its
    keeper is gone (then nothing of it can be loaded, and its memory is freed
    as soon as the processes mapping it are gone)."""
    report = _session.status(session)
    if report is None:
        return {}
    return {f"torchshm:{session}:{s['uid']}": s for s in report["segments"]}


def session_segments(session):
    return sorted(session_report(session))


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


def keeper_session(argv):
    """The session a keeper's command line (bytes) names, or None if it is
    not a keeper's."""
    return _protocol.session_of_command([a.decode(errors="replace") for a in argv])


def session_processes(sid, session=None):
    """Live processes of process session `sid` (the driver's tree), plus the
    keeper of torchshm session `session` (it runs in a process session of its
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
        is_keeper = session is not None and keeper_session(argv) == session
        if stat[1] == sid or is_keeper:
            found.append(pid)
    return found


def leftovers(driver, grace=GRACE, shm=True):
    """(segments, processes) of the driver's session once its processes, the
    keeper last, are gone, or after `grace` seconds. A segment is left only
    while its keeper lives; shm=False skips asking (a driver in another mount
    namespace has its keeper's socket in its own /dev/shm)."""
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


def _memory_cgroup_parent():
    """(version, the directory of this process's memory cgroup) where a child
    cgroup can be made with a memory limit, or (None, why not)."""
    if os.geteuid() != 0:
        return None, "making a memory cgroup needs root"
    for version, directory in _memory._cgroup_dirs():
        if version == 1 and os.access(directory, os.W_OK):
            return 1, directory
    return None, "no writable cgroup v1 memory hierarchy (cgroup v2 needs delegation)"


NO_MEMORY_CGROUP = _memory_cgroup_parent()[0] is None and _memory_cgroup_parent()[1]


@contextlib.contextmanager
def memory_limited():
    """A wrapper command that runs its command in a fresh memory cgroup (its
    limit is the driver's to set: tests/fault_children.py), removed
    afterwards, once its processes are gone."""
    _version, parent = _memory_cgroup_parent()
    path = os.path.join(parent, f"torchshm-test-{secrets.token_hex(4)}")
    os.mkdir(path)
    try:
        yield (
            "sh",
            "-c",
            f'echo $$ > {path}/cgroup.procs && exec "$@"',
            "sh",
        )
    finally:
        deadline = time.monotonic() + GRACE
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
