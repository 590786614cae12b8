"""Which pipe a message is being written to, so that its tickets can die
with the pipe (Note [Segment lifetime] in csrc/segment.h).

A reducer is not told where its bytes go. multiprocessing writes every
message through a Connection, and the frames above the pickler say which:
Connection.send (Pipe, Pool's queues), SimpleQueue.put, and the feeder
thread of Queue (`_feed`, which holds the writer's bound send_bytes). Only
pipes are named: both ends of a pipe share one inode, which is what the
reaper looks for in /proc/*/fd; a socket's two ends have two.

The frames are walked natively when a segment reference is written
(current_channel in csrc/message.cpp); which frames, and how each finds its
Connection, is decided here and handed over by configure().

A ticket for a message into a known pipe is marked "being written" until the
write returns (Note [Segment lifetime]): a writer killed in the middle leaves
a message nobody can read, and the keeper frees what only it held. Every
multiprocessing write of a message ends in Connection._send_bytes, in the
thread that pickled it, so configure() wraps that one method: after it
returns the thread's tickets are written, after it raises they are
cancelled. With no ticket pending, the wrapper costs one native call.
"""

import os
import stat
import threading
from multiprocessing import connection, queues

from torchshm._compat import load_native

_C = load_native()


def _feeder_writer(frame):
    # Not from the frame's locals: before Python 3.13, reading f_locals
    # stores a snapshot of them in the frame, and the feeder's frame lives as
    # long as its queue, so the snapshot would keep the object being sent
    # (its arrays, their memory) alive until the next message. The feeder
    # thread's own arguments hold the same send_bytes.
    args = getattr(threading.current_thread(), "_args", ())
    send_bytes = args[2] if len(args) > 2 else None
    return getattr(send_bytes, "__self__", None)


# code object -> how to find the Connection that frame writes to. Those two
# frames end when the send returns, and their f_locals snapshot with them.
_WRITERS = {
    connection.Connection.send.__code__: lambda f: f.f_locals.get("self"),
    queues.SimpleQueue.put.__code__: lambda f: getattr(
        f.f_locals.get("self"), "_writer", None
    ),
    queues.Queue._feed.__code__: _feeder_writer,
}
# A pickler's reduce runs a few frames below the writer.
_MAX_DEPTH = 12


def _pipe_inode_of(find, frame):
    """The inode of the pipe that `find` finds in a writer's frame, or 0."""
    return _pipe_inode(find(frame))


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


def _send_bytes_then_mark(self, buf, _send_bytes=connection.Connection._send_bytes):
    """Connection._send_bytes, then the end of the thread's message's write."""
    try:
        _send_bytes(self, buf)
    except BaseException:
        _C.message_not_written()
        raise
    _C.message_written()


def configure():
    """Hands the writer frames to the native walk, and wraps the method that
    writes every message (at import of _reduction, once)."""
    _C.configure_channel(
        writers=_WRITERS, pipe_inode=_pipe_inode_of, max_depth=_MAX_DEPTH
    )
    if connection.Connection._send_bytes is not _send_bytes_then_mark:
        connection.Connection._send_bytes = _send_bytes_then_mark
