"""The keeper's command line and the words of its socket, spelled once for
both sides (the library's session.py and the keeper's daemon.py). A request
is ASCII words, a verb and its arguments, with up to MAX_FDS fds; so is a
reply. Standard library only (Note [The keeper's facts] in daemon.py)."""

import errno
import os
import socket
import struct

# The program the library runs (never imports).
DAEMON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "daemon.py")
DEFAULT_LINGER_SECONDS = 600.0
MESSAGE_BYTES = 256
MAX_FDS = 2

# Requests: verb and arguments; what the keeper answers.
JOIN = "J"  # J <holder hex>: a member; answers TABLE with the table's fd
REJOIN = "j"  # j <holder hex>: a member that maps the table (a forked child)
REGISTER = "R"  # R <index> <uid hex>, the segment's fd: no answer
FETCH = "F"  # F <index> <uid hex>: answers FOUND with the segment's and table's fds
CLOSE_RELEASED = "C"  # closes what was released, now (trim): answers CLOSED
STATUS = "S"  # answers REPORT with a memfd holding the session's report as JSON

# Replies.
TABLE = b"T"
FOUND = b"f 0"
NOT_FOUND = b"f %d" % errno.ENOENT  # the keeper holds no such segment
CLOSED = b"c"
REPORT = b"s"
BUSY = b"B"  # to a connection the keeper has no fd to serve


def request(verb, *words):
    return " ".join((verb,) + tuple(str(w) for w in words)).encode("ascii")


def join(holder, table_wanted=True):
    return request(JOIN if table_wanted else REJOIN, f"{holder:x}")


def register(index, uid):
    return request(REGISTER, index, f"{uid:x}")


def fetch(index, uid):
    return request(FETCH, index, f"{uid:x}")


def peer_creds(conn):
    """(pid, uid, gid) of the process at the other end of a Unix socket (pid
    0 in another PID namespace): the keeper admits only its own user, and
    the library checks that the keeper is of its user."""
    return struct.unpack(
        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    )


def command(python, session, run_dir, linger):
    """The keeper's command line: standard library only, in isolated mode;
    daemon.py's main() reads it."""
    return [python, "-I", "-S", DAEMON, session, run_dir, repr(float(linger))]


def session_of_command(argv):
    """The session a keeper's command line (as `command` makes it, a list of
    str) names, or None if it is not a keeper's."""
    for i, arg in enumerate(argv[:-1]):
        if os.path.basename(arg) == os.path.basename(DAEMON):
            return argv[i + 1]
    return None
