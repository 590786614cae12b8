"""Session membership: every process that may hold torchshm memory.

A session is the process tree of the first process that imported torchshm. Its
id travels in the environment (spawn and forkserver children inherit it) and
names every segment, so the session reaper (_reaper.py) can free what a dead
process held while the session goes on, and sweep what unreceived messages
left behind once the whole tree is gone. A process that inherits the id but
cannot reach the session's reaper (another network namespace) while the
session still lives, as its lock file shows, founds a session of its own.
"""

import os
import secrets
import socket
import subprocess
import sys
import threading

from torchshm import _reaper
from torchshm._compat import load_native

ENV_VAR = "TORCHSHM_SESSION"
_lock = threading.Lock()
_connection = None  # kept open for the process's lifetime; fork children share it
_session = None


def session_id():
    join()
    return _session


def segment_prefix():
    """The start of every segment name of this session."""
    return f"/{_reaper.SEGMENT_PREFIX}{session_id()}_"


def join():
    """Connects this process to its session's reaper, starting one if needed."""
    global _connection, _session
    if _connection is not None:
        return
    with _lock:
        if _connection is not None:
            return
        session = os.environ.get(ENV_VAR)
        conn = _connect(session) if session else None
        if conn is None and session and _reaper.session_alive(session):
            # Alive, but its reaper is out of reach (another network
            # namespace over the same /dev/shm): never share its name.
            session = None
        if conn is None:
            # First process of the tree, or its reaper was killed: start one.
            session = session or secrets.token_hex(6)
            _start_reaper(session)
            conn = _connect(session)
            if conn is None:
                raise RuntimeError(
                    f"torchshm: the session reaper for {session} did not start;"
                    " shared memory would not be cleaned up, so torchshm stays off"
                )
        os.environ[ENV_VAR] = session
        _session, _connection = session, conn
        # This process's id and lock: made now, not inside the first send.
        load_native().process_id()


def leave():
    """Closes this process's connection to the reaper (it is exiting)."""
    global _connection
    conn, _connection = _connection, None
    if conn is not None:
        conn.close()


def _connect(session):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_reaper.address(session))
    except OSError:
        conn.close()
        return None
    return conn


def _start_reaper(session):
    # A new process session: a Ctrl-C to the foreground group must not kill the
    # reaper before it sweeps.
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", _reaper.__file__, session],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # One byte once it listens; EOF if it failed.
    proc.stdout.read(1)
    proc.stdout.close()
    # The reaper outlives us by design; drop the Popen so Python does not warn
    # that a child is still running when this object is collected.
    proc.returncode = 0
