"""Which pipe a message is being written to, so that its tickets can die
with the pipe (Note [Segment lifetime] in csrc/lifetime/segment.h).

A reducer is not told where its bytes go. multiprocessing writes every
message through a Connection, and the frames above the pickler say whether
one is: Connection.send (Pipe, Pool's queues), SimpleQueue.put, and the
feeder thread of Queue (`_feed`). WRITERS lists their code objects; the
native pickling side looks for one on the stack when it issues a ticket, and
marks the ticket "being written" by this process if it finds one (Note [One
message, one snapshot] in csrc/send/message.h).

Every multiprocessing write of a message ends in Connection._send_bytes, in
the thread that pickled it, so install() wraps that one method: before the
first byte goes out it names the pipe in the slots of the thread's tickets
(only pipes are named: both ends of a pipe share one inode, which is what the
keeper looks for in /proc/*/fd; a socket's two ends have two), after it
returns they are written, after it raises they are cancelled. With no ticket
pending, the wrapper costs one native call.
"""

import os
import stat

from torchshm import _compat
from torchshm._native import _C

# The frames that write a pickled message to a Connection (see above).
WRITERS = _compat.MESSAGE_WRITERS
# A pickler's reduce runs a few frames below the writer.
MAX_DEPTH = 12


def _pipe_inode(conn):
    try:
        fd = conn.fileno()
    except (AttributeError, OSError, ValueError):
        return 0
    # Asked for every message: the answer is kept on the Connection, whose
    # descriptor stays the same file until close() (then fileno() raises).
    known = getattr(conn, "_torchshm_pipe", None)
    if known is not None and known[0] == fd:
        return known[1]
    try:
        st = os.fstat(fd)
    except OSError:
        return 0
    inode = st.st_ino if stat.S_ISFIFO(st.st_mode) else 0
    try:
        conn._torchshm_pipe = (fd, inode)
    except AttributeError:  # a Connection-like object without a __dict__
        pass
    return inode


def _send_bytes_then_mark(self, buf, _send_bytes=_compat.connection_send_bytes()):
    """Connection._send_bytes, between the two ends of the write of the
    thread's message (see the module's docstring)."""
    if not _C.message_writing(_pipe_inode(self)):
        return _send_bytes(self, buf)
    try:
        _send_bytes(self, buf)
    except BaseException:
        _C.message_not_written()
        raise
    _C.message_written()


def install():
    """Wraps the method that writes every message (once, at the first
    register(): a process that never sends through torchshm keeps
    multiprocessing as it is)."""
    if _compat.connection_send_bytes() is not _send_bytes_then_mark:
        _compat.set_connection_send_bytes(_send_bytes_then_mark)
