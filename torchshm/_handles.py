"""torchshm.dumps / loads / release: handles that any process of this user on
this node may load, any number of times, while their exporter keeps them.

A ForkingPickler message is meant to be loaded once (its tickets, Note
[Segment lifetime] in csrc/lifetime/segment.h): a second load is valid only while the
sender has not reused the memory. A handle is different: its exporter pins
every segment the handle names (it holds a view of each, so its pool never
reuses them and they are never unlinked) until the handle is released. So:

- dumps(obj) pickles obj with torchshm's reducers (fresh arrays are
  snapshotted once, shared ones go by reference) without tickets: every load
  takes a slot of its own and checks the segment's generation, which cannot
  change while the exporter pins it.
- The exporter keeps the pins while it keeps `obj` (weakref.finalize), or,
  when obj cannot be weakly referenced (a dict, a list), until
  release(handle) or its exit.
- Whether a handle is still valid is one word in a small "cell" segment of
  the exporter: a random token, set by dumps and cleared by release. A load
  checks that the exporter's process is alive and the token still there
  before it maps anything, so a load after release or exit fails with
  HandleError naming the exporter. Validity is the exporter's decision
  alone: other processes that loaded the handle keep their own data readable
  (their slots keep the memory), but do not make the handle valid again.
"""

import collections
import contextlib
import errno
import io
import os
import pickle
import reprlib
import secrets
import socket
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from torchshm import _reduction
from torchshm._lifetime import attach as _attach
from torchshm._lifetime import forks as _forks
from torchshm._send import registry as _registry
from torchshm._lifetime import segments as _segments
from torchshm._send import sender as _sender
from torchshm._lifetime import session as _session
from torchshm._native import _C

FORMAT = 1
_CELL_BYTES = 64 << 10  # one cell segment: 8192 handles of this process
_CELL_WORDS = _CELL_BYTES // 8
_lock = threading.Lock()
# Tokens whose objects died while another frame held _lock (_finalized).
_dead = collections.deque()
_cells = []  # [(int8 tensor over a cell segment, its words as uint64)]
_free = []  # (cell number, word index) pairs released for reuse
_exports = {}  # token -> _Export


class HandleError(OSError):
    """A `dumps` handle that cannot be loaded (an ``OSError``).

    Raised by `loads` (and `release`, for a malformed handle): its exporter
    released it or exited, or this process cannot reach the exporter's
    session (another host, or a container that does not share its
    ``/dev/shm``), or it is malformed. The message names the exporter (pid,
    host, torchshm process id, session). ``.errno`` says which:
    ``errno.ESTALE`` (released, or the exporter is gone), ``errno.ENOENT``
    (nothing by that name here), ``errno.EACCES``, ``errno.EINVAL`` or
    ``errno.ELOOP`` (not a torchshm segment of this user, or a header field
    of the wrong type or range: not made by this torchshm's `dumps`).

    Parameters
    ----------
    *args : int, str
        As for ``OSError``: torchshm raises it as ``HandleError(errno,
        message)``.
    **kwargs : dict
        Not accepted (``OSError`` takes no keyword arguments).

    See Also
    --------
    dumps, loads, release

    Examples
    --------
    >>> import errno
    >>> table = np.arange(1_000_000)
    >>> handle = torchshm.dumps(table)
    >>> torchshm.release(handle)
    True
    >>> try:
    ...     torchshm.loads(handle)
    ... except torchshm.HandleError as exc:
    ...     print(exc.errno == errno.ESTALE, "no longer valid" in str(exc))
    True True
    """


class _Export:
    __slots__ = ("pins", "cell", "index", "token", "finalizer")

    def __init__(self, pins, cell, index, token):
        self.pins, self.cell, self.index, self.token = pins, cell, index, token
        self.finalizer = None


def _exporter():
    """Who exports, as handles and error messages name it."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "process_id": _C.process_id(),
        "session": _session.session_id(),
    }


def _describe(exporter):
    return (
        f"pid {exporter['pid']} on {exporter['host']}"
        f" (torchshm process id {exporter['process_id']:016x},"
        f" session {exporter['session']})"
    )


class _HandlePickler(ForkingPickler):
    """ForkingPickler with torchshm's reducers whatever the registration, that
    names segments without tickets and remembers which it named."""

    def __init__(self, file):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        for t in _registry.TYPES:
            self.dispatch_table[t] = _sender.reduce_ndarray
        self.pins = {}  # segment name -> the tensor over it that we hold

    def reducer_override(self, obj):
        found = _reduction.reference_without_ticket(obj)
        if found is None:
            return NotImplemented
        owner, reduced = found
        self.pins.setdefault(obj.name, owner)
        return reduced


def _new_cell():
    """(cell number, word index) of a free word, allocating a cell segment
    when every word is taken. Call with _lock held."""
    if _free:
        return _free.pop()
    owner = _segments.allocate(_CELL_BYTES)
    words = owner.numpy()[:_CELL_BYTES].view(np.uint64)
    words[:] = 0
    _cells.append((owner, words))
    number = len(_cells) - 1
    # Word 0 of each cell stays unused: an index is never 0.
    _free.extend((number, i) for i in range(len(words) - 1, 0, -1))
    return _free.pop()


def dumps(obj: Any) -> bytes:
    """A handle: bytes that `loads` turns into an equivalent of `obj`.

    Any process of this user on this node may load the handle, any number of
    times, over any channel (a file, a socket, a Queue), for as long as this
    process keeps `obj` alive (if it can be weakly referenced; else, e.g. a
    dict or a list, until `release` or exit). Arrays are snapshotted now
    (arrays already in shared memory are not copied again): later changes to
    a fresh `obj` are not seen by loaders, while changes to an object made
    by `share` are. Unlike a ForkingPickler message, which is meant to be
    loaded once, the handle pins its memory until it is released. torch
    tensors inside `obj` follow torch's own sharing rules (under the default
    ``file_descriptor`` strategy a tensor can be loaded only once, while its
    sender lives): convert them to numpy or share them as arrays.

    Parameters
    ----------
    obj : object
        What to export: anything ForkingPickler can pickle.

    Returns
    -------
    bytes
        The handle (a pickle: `loads`, or ``pickle.loads``, loads it).

    Raises
    ------
    OSError
        torchshm's ``SharedMemoryError``: torchshm cannot run here (no
        session keeper answers, no directory to work in), or shared memory
        cannot hold the handle's small bookkeeping segment.
    Exception
        Whatever pickling `obj` raises (``TypeError``,
        ``pickle.PicklingError``...) for an object that cannot be pickled.

    See Also
    --------
    loads, release, share, torchshm.distributed.share_on_node

    Examples
    --------
    >>> table = np.arange(1_000_000)
    >>> handle = torchshm.dumps(table)  # valid while `table` lives
    >>> type(handle)
    <class 'bytes'>
    >>> copy = torchshm.loads(handle)  # in this process, or any other
    >>> np.array_equal(copy, table), torchshm.is_shared(copy)
    (True, True)
    >>> torchshm.release(handle)
    True
    """
    _forks.check_fork_hooks("torchshm.dumps()")
    _session.join()
    buffer = io.BytesIO()
    pickler = _HandlePickler(buffer)
    pickler.dump(obj)
    payload = buffer.getvalue()
    pins = list(pickler.pins.values())
    del pickler
    token = secrets.randbits(63) | 1
    with _locked():
        number, index = _new_cell()
        cell_owner, words = _cells[number]
        export = _Export(pins, number, index, token)
        _exports[token] = export
        words[index] = token
    cell = _C.segment_of(cell_owner)
    try:
        export.finalizer = weakref.finalize(obj, _finalized, token)
        export.finalizer.atexit = False
    except TypeError:
        pass  # not weakly referenceable: until release() or exit
    header = (FORMAT, _exporter(), cell.locator, cell.generation, index, token)
    return pickle.dumps(_HandleData(header, payload), protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    """The object a `dumps` handle names, over the exporter's shared memory.

    Works in any process of the exporter's user on its node, any number of
    times, while the handle is valid (see `dumps`). The loaded object keeps
    its data readable after the handle is released or its exporter exits;
    only new loads fail then. ``pickle.loads(data)`` loads a handle too
    (also inside another pickle), without the ``ValueError`` check.

    Parameters
    ----------
    data : bytes
        A handle made by `dumps`, unchanged.

    Returns
    -------
    object
        An equivalent of the exported object; its arrays are over the
        exporter's shared memory.

    Raises
    ------
    HandleError
        The handle was released or its exporter exited (``errno.ESTALE``),
        its shared memory cannot be reached from here (``errno.ENOENT``:
        another host or container, or the session ended), or a header field
        was altered (``errno.EINVAL``); the message names the exporter or
        the field.
    ValueError
        `data` is not a handle at all.
    OSError
        torchshm cannot run here, or mapping the memory failed otherwise
        (torchshm's ``SharedMemoryError``, e.g. out of memory).

    See Also
    --------
    dumps, release, HandleError

    Examples
    --------
    >>> table = np.arange(1_000_000)
    >>> handle = torchshm.dumps(table)
    >>> first, second = torchshm.loads(handle), torchshm.loads(handle)
    >>> int(first[-1]), int(second[-1])
    (999999, 999999)
    >>> torchshm.loads(b"not a handle")
    Traceback (most recent call last):
        ...
    ValueError: torchshm.loads: not a torchshm.dumps() handle
    >>> torchshm.release(handle)
    True
    """
    _forks.check_fork_hooks("torchshm.loads()")
    handle = _peek(data)
    if handle is None:
        raise ValueError("torchshm.loads: not a torchshm.dumps() handle")
    return _load(*handle)


def release(data: bytes) -> bool:
    """End a handle made by this process: later loads of it fail.

    The memory it pinned goes back to the pool once every loader dropped it
    (objects already loaded keep their data). Only the exporting process
    can release a handle; a handle also ends when its exported object is
    freed (if it can be weakly referenced) or its exporter exits.

    Parameters
    ----------
    data : bytes
        A handle made by `dumps`.

    Returns
    -------
    bool
        True if this process exported it and it was live; False otherwise
        (another process's handle, or released already).

    Raises
    ------
    ValueError
        `data` is not a handle at all.
    HandleError
        A header field of the handle was altered (``errno.EINVAL``).

    See Also
    --------
    dumps, loads

    Examples
    --------
    >>> records = {"ids": np.arange(1_000_000)}  # a dict: kept until release
    >>> handle = torchshm.dumps(records)
    >>> torchshm.release(handle)
    True
    >>> torchshm.release(handle)  # released already
    False
    """
    handle = _peek(data)
    if handle is None:
        raise ValueError("torchshm.release: not a torchshm.dumps() handle")
    _fmt, exporter, _cell, _generation, _index, token = _fields(*handle)
    if exporter["process_id"] != _C.process_id():
        return False
    return _drop(token)


def _drop(token):
    with _locked():
        export = _drop_locked(token)
    if export is None:
        return False
    if export.finalizer is not None:
        export.finalizer.detach()
    return True


def _finalized(token):
    """An exported object died. Its finalizer runs at any collection, in
    whatever thread: also one that holds _lock (an allocation under it
    starts a collection), so it never waits for the lock: the holder drops
    the token as it lets go (_locked)."""
    _dead.append(token)
    _drop_dead_if_free()


@contextlib.contextmanager
def _locked():
    """_lock, with the tokens of objects that died while another frame held
    it dropped first, and those that died meanwhile before it is let go (and
    after, for one that died as it was let go)."""
    with _lock:
        _drop_dead()
        yield
        _drop_dead()
    _drop_dead_if_free()


def _drop_dead_if_free():
    """Drops the queued tokens if _lock is free now (never waits for it)."""
    while _dead and _lock.acquire(blocking=False):
        try:
            _drop_dead()
        finally:
            _lock.release()


def _drop_dead():
    while _dead:
        _drop_locked(_dead.popleft())


def _drop_locked(token):
    """Frees the export of `token` (None if there is none). Call with _lock
    held."""
    export = _exports.pop(token, None)
    if export is None:
        return None
    words = _cells[export.cell][1]
    words[export.index] = 0
    _free.append((export.cell, export.index))
    export.pins = None
    if not _exports:
        # No handle left: the cells go too (nothing outlives its use).
        _cells.clear()
        _free.clear()
    return export


class _HandleData:
    """What a handle's bytes hold; unpickling one loads it, so a handle also
    works with pickle.loads and inside other pickles."""

    __slots__ = ("header", "payload")

    def __init__(self, header, payload):
        self.header, self.payload = header, payload

    def __reduce__(self):
        return load_handle, (self.header, self.payload)


def load_handle(header, payload):
    """Unpickles a handle: loads it (the wire format names this function)."""
    return _load(header, payload)


class _Peeker(pickle.Unpickler):
    """Reads a handle's header and payload without loading it."""

    def find_class(self, module, name):
        if (module, name) == (__name__, "load_handle"):
            return lambda header, payload: (header, payload)
        raise pickle.UnpicklingError(f"not a torchshm handle ({module}.{name})")


def _peek(data):
    """(header, payload) if `data` is a handle's pickle, else None. The
    fields are checked by _fields, so that a forged handle is a HandleError
    (a ValueError says only that the bytes are not a handle at all)."""
    try:
        handle = _Peeker(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - any malformed input: not a handle
        return None
    if not (isinstance(handle, tuple) and len(handle) == 2):
        return None
    return handle


def _malformed(field, expected, got):
    return HandleError(
        errno.EINVAL,
        f"torchshm: malformed handle: its {field} is {reprlib.repr(got)}, expected"
        f" {expected}; a handle must be the unchanged bytes of torchshm.dumps()"
        f" (handle format {FORMAT})",
    )


def _is_locator(text):
    try:
        _attach.parse_locator(text)
    except OSError:
        return False
    return True


def _int_in(value, low, high):
    """An int (not a bool, not a float that equals one) in [low, high)."""
    return type(value) is int and low <= value < high


def _fields(header, payload):
    """The header's fields, each checked for type and range before anything
    uses it: a handle comes from outside, and a field of the wrong kind must
    not index, format or compare its way into another handle's word."""
    if not (isinstance(header, tuple) and len(header) == 6):
        raise _malformed("header", "a tuple of 6 fields", header)
    fmt, exporter, cell_name, generation, index, token = header
    if not _int_in(fmt, FORMAT, FORMAT + 1):
        raise _malformed("format", f"{FORMAT}, the format this torchshm reads", fmt)
    expected = {"pid": int, "host": str, "process_id": int, "session": str}
    if not (
        type(exporter) is dict
        and all(type(exporter.get(k)) is t for k, t in expected.items())
        and _int_in(exporter["pid"], 1, 2**31)
        # A process id, never a ticket (which holder_alive takes as alive).
        and _int_in(exporter["process_id"], 1, _C.LAYOUT["TICKET_BIT"])
    ):
        raise _malformed(
            "exporter",
            "a dict of pid (a positive int), host (str), process_id (an int in"
            " [1, 2**63)) and session (str)",
            exporter,
        )
    if not (type(cell_name) is str and _is_locator(cell_name)):
        raise _malformed(
            "cell", "a segment locator torchshm:<session>:<uid>:<...>", cell_name
        )
    if not _int_in(generation, 0, 2**64):
        raise _malformed("generation", "an int in [0, 2**64)", generation)
    if not _int_in(index, 1, _CELL_WORDS):  # word 0 is never used
        raise _malformed("index", f"an int in [1, {_CELL_WORDS})", index)
    if not _int_in(token, 1, 2**63):
        raise _malformed("token", "an int in [1, 2**63)", token)
    if type(payload) is not bytes:
        raise _malformed("payload", "bytes", payload)
    return fmt, exporter, cell_name, generation, index, token


def _load(header, payload):
    _fmt, exporter, cell_name, cell_generation, index, token = _fields(header, payload)
    who = _describe(exporter)
    _session.join()
    try:
        cell = _attach.attach(cell_name, 0, cell_generation)
    except OSError as exc:
        # A live exporter drops its cells when its last handle goes, and its
        # pool may free them any time after: gone then means released.
        if exc.errno == errno.ENOENT and _C.holder_alive(exporter["process_id"]):
            raise _released(who) from None
        if exc.errno == errno.ENOENT:
            raise HandleError(
                errno.ENOENT,
                f"torchshm: handle exported by {who} cannot be loaded here:"
                f" its shared memory cannot be reached from this process (the"
                f" exporter's session ended, or this is another host, or a"
                f" container that does not share its /dev/shm; this is pid"
                f" {os.getpid()} on {socket.gethostname()})",
            ) from None
        if exc.errno == errno.ESTALE:
            raise _released(who) from None
        if exc.errno in (errno.EINVAL, errno.EACCES, errno.ELOOP):
            raise HandleError(
                exc.errno,
                f"torchshm: handle exported by {who} names cell {cell_name},"
                f" which is not a torchshm segment of this user ({exc})",
            ) from exc
        raise
    word = cell.numpy()[index * 8 : index * 8 + 8]
    # As a Python int: NumPy 1.x compares np.uint64 with an int through
    # float64, which cannot tell tokens apart in their low bits.
    stored = int(word.view(np.uint64)[0]) if word.size == 8 else None
    del cell, word
    if stored is None:  # a segment smaller than a cell: not one
        raise _malformed("index", f"a word inside cell {cell_name}", index)
    valid = stored == token
    if not _C.holder_alive(exporter["process_id"]):
        raise HandleError(
            errno.ESTALE,
            f"torchshm: handle exported by {who} is no longer valid: the"
            " exporter has exited (objects loaded before keep their data;"
            " ask a live process to export it again)",
        )
    if not valid:
        raise _released(who)
    try:
        return pickle.loads(payload)
    except OSError as exc:
        # The exporter released it between the check and the load: the
        # segment's generation or name says so (never other data).
        if exc.errno in (errno.ESTALE, errno.ENOENT):
            raise _released(who) from exc
        raise


def _released(who):
    return HandleError(
        errno.ESTALE,
        f"torchshm: handle exported by {who} is no longer valid: the exporter"
        " released it (torchshm.release, or the exported object was freed)",
    )
