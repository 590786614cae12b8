"""The session reaper: unlinks a session's segments once its processes are gone.

Run by torchshm._session as `python -I -S _reaper.py SESSION`; it imports only
the standard library so that it starts in milliseconds. Every process of the
session holds one connection to it (inherited across fork, made anew after
spawn). When the last connection closes, and nobody connects during a short
grace period, it unlinks every /dev/shm/torchshm_SESSION_* that references
lost to SIGKILL or to never-received messages kept alive, then exits. At start
it also sweeps segments of older sessions whose reaper is gone (killed).
"""

import os
import selectors
import socket
import sys
import time

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "torchshm_"
GRACE_SECONDS = 2.0  # a receiver may still be connecting
STARTUP_SECONDS = 30.0  # the starter died before it connected


def address(session):
    return "\0torchshm-" + session


def sweep(session):
    prefix = f"{SEGMENT_PREFIX}{session}_"
    for name in _segment_names():
        if name.startswith(prefix):
            _unlink(name)


def sweep_orphans(own_session):
    """Sweeps sessions whose reaper is gone (it was killed before it swept)."""
    sessions = {name.split("_")[1] for name in _segment_names()}
    for session in sessions - {own_session}:
        if not session_alive(session):
            sweep(session)


def session_alive(session):
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(address(session))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _segment_names():
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [n for n in names if n.startswith(SEGMENT_PREFIX) and n.count("_") >= 3]


def _unlink(name):
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass


def serve(session, ready):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address(session))
    listener.listen(128)
    ready.write(b"1")
    ready.close()
    sweep_orphans(session)

    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    clients = 0
    idle_since = time.monotonic()
    limit = STARTUP_SECONDS
    while clients or time.monotonic() - idle_since < limit:
        for key, _ in selector.select(timeout=0.5):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                selector.register(conn, selectors.EVENT_READ)
                clients += 1
            elif not key.fileobj.recv(64):
                selector.unregister(key.fileobj)
                key.fileobj.close()
                clients -= 1
                if not clients:
                    idle_since, limit = time.monotonic(), GRACE_SECONDS
    listener.close()
    sweep(session)


def main():
    session = sys.argv[1]
    ready = os.fdopen(1, "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 2)
    serve(session, ready)
    # stdout was the ready pipe; point it somewhere harmless once closed.
    os.dup2(devnull, 1)


if __name__ == "__main__":
    main()
