"""Driver scenarios for tests/test_fork_safety.py: a fork whose child the
parent could not give its holds (Note [Fork] in
torchshm/_lifetime/lifecycle.py), and a fork from C that runs no hook (Note
[Forks torchshm did not prepare] in csrc/lifetime/fork_guard.h).

`python -m tests.fork_children SCENARIO ARGS...` prints `session <id>`, then
one JSON object per line (tests/isolated.py's Driver).
"""

import ctypes
import errno
import gc
import json
import multiprocessing as mp
import os
import resource
import signal
import sys
import warnings

import numpy as np

import torchshm
from torchshm._lifetime import session as _session

TIMEOUT = 60
SMALL, BIG = 1024, 4 << 20  # a slab block, a segment of its own


def sender(q, ask):
    """Sends a BIG array of each value it is asked for, holding none."""
    while (value := ask.get(timeout=TIMEOUT)) is not None:
        q.put(np.full(BIG, value, dtype=np.uint8))


def arrays(value, q, ask):
    """A born slab block, a born array and a received one, all `value`."""
    with torchshm.allocating(min_bytes=1):
        small = np.full(SMALL, value, dtype=np.uint8)
        big = np.full(BIG, value, dtype=np.uint8)
    ask.put(value)
    received = q.get(timeout=TIMEOUT)
    return [small, big, received]


def fill_fds():
    """Fds of /dev/null until the fd limit: no fd number is left free."""
    made = []
    while True:
        try:
            made.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                raise
            return made


def fill_inodes(directory):
    """Empty files in `directory` until its file system has no inode left."""
    made = []
    while True:
        path = os.path.join(directory, f"ballast-{len(made)}")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made.append(path)


def fork_unprepared(how):
    """The parent holds three arrays of 7s, forks a child that keeps them,
    drops them and makes (and receives) three arrays of 9s, which reuse the
    memory that nothing protects; then the child counts the bytes of its
    arrays that are not 7. `how` makes the fork's hook fail ("fd_limit":
    EMFILE; "inodes": no inode left in /dev/shm) or skips it ("c_fork":
    fork() through ctypes)."""
    ctx = mp.get_context("fork")
    q, ask = ctx.Queue(), ctx.Queue()
    feeder = ctx.Process(target=sender, args=(q, ask))
    feeder.start()
    held = arrays(7, q, ask)
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    ballast, ballast_fds = [], []
    if how == "fd_limit":
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, limit[1]))
        ballast_fds = fill_fds()
    elif how == "inodes":
        ballast = fill_inodes("/dev/shm")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if how == "c_fork":
            pid = ctypes.PyDLL(None).fork()  # holds the GIL: no Python hook
        else:
            pid = os.fork()
    if pid == 0:
        os.read(go_r, 1)
        changed = [int((a != 7).sum()) for a in held]
        os.write(out_w, json.dumps(changed).encode())
        os._exit(0)
    os.close(out_w)  # EOF once the child is gone, whatever it wrote
    os.close(go_r)
    resource.setrlimit(resource.RLIMIT_NOFILE, limit)
    for fd in ballast_fds:
        os.close(fd)
    for path in ballast:
        os.unlink(path)
    pinned = torchshm.stats()["segments_pinned_at_fork"]
    del held
    gc.collect()
    later = arrays(9, q, ask)
    os.write(go_w, b"x")
    _, status = os.waitpid(pid, 0)
    report = os.read(out_r, 1 << 16)
    ask.put(None)
    feeder.join(TIMEOUT)
    yield {
        "changed": json.loads(report) if report else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
        "exitcode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "later_ok": [bool((a == 9).all()) for a in later],
        "pinned": pinned,
        "warnings": [str(w.message) for w in seen],
        "feeder_exitcode": feeder.exitcode,
    }


SCENARIOS = {"fork_unprepared": fork_unprepared}


def main(argv):
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    print("session", _session.session_id(), flush=True)
    for result in SCENARIOS[argv[0]](*argv[1:]):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
