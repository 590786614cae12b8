"""What a run left behind, seconds after it ended: keeper processes of its
torchshm session, files of that session in /dev/shm (the keeper's socket and
lock files), and processes still in the run's process session (the run was
its leader: zygote.py). The fuzzer never imports torchshm itself (it would
make a session of its own): the keeper's command line is read with
torchshm/_keeper/protocol.py, loaded from its file as scripts/soak.py does."""

import importlib.util
import os
import re
import signal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHM_DIR = "/dev/shm"


def _protocol():
    path = os.path.join(ROOT, "torchshm", "_keeper", "protocol.py")
    spec = importlib.util.spec_from_file_location("_fuzz_keeper_protocol", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_session_of_command = _protocol().session_of_command


def _pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def keepers(session):
    found = []
    if not session:
        return found
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if _session_of_command(argv) == session:
            found.append(pid)
    return found


def files(session):
    """Files under /dev/shm/torchshm* that name the session, by their name or
    (a lock file, "<pid> <session>") their contents."""
    found = []
    for top in os.listdir(SHM_DIR):
        if not top.startswith("torchshm"):
            continue
        for root, _, names in os.walk(os.path.join(SHM_DIR, top)):
            for name in names:
                path = os.path.join(root, name)
                if session in re.split(r"[-.:]", name) or _names(path, session):
                    found.append(path)
        if session in re.split(r"[-.:]", top):
            found.append(os.path.join(SHM_DIR, top))
    return found


def _names(path, session):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        words = os.pread(fd, 256, 0).decode("ascii", "replace").split()
    except OSError:
        return False
    finally:
        os.close(fd)
    return bool(words) and words[-1] == session


def processes(sid):
    """Processes of process session `sid` (field 6 of /proc/<pid>/stat)."""
    found = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(pid)
    return found


def left_behind(session, sid):
    """Descriptions of what is left; empty if nothing."""
    found = [f"keeper process {pid} of session {session}" for pid in keepers(session)]
    found += [f"file {path}" for path in files(session)] if session else []
    found += [f"process {pid} of the run's process session" for pid in processes(sid)]
    return found


def clean_up(session, sid):
    """Kills what a run left (once reported), so that the next runs start on
    a clean machine."""
    for pid in keepers(session) + processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
