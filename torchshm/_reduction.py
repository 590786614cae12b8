"""Reducers that send ndarrays through shared memory, and their rebuilds.

The rebuild functions' module and names are the wire format: old pickles name
them, so never rename or move them.

Note [One message, one snapshot]
multiprocessing pickles each message with a fresh ForkingPickler, whose memo
holds every object it pickled until the message is done. A reducer sees only
the array, so the per-message state (which buffers were already copied, which
segments already named) lives in a _Message that only the _SegmentRef objects
in that memo keep alive; the thread remembers it weakly. So within a message,
views of one buffer share one copy and one segment (aliasing survives), and
the next message starts afresh (a later send snapshots the array again).
"""

import errno
import threading
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.multiprocessing import get_sharing_strategy as sharing_strategy

from torchshm import _channel, _config, _segments, _stats
from torchshm._compat import int8_tensor_over, load_native, untyped_storage

_C = load_native()

# Subclasses torchshm rebuilds itself; every other subclass pickles as it would.
SUBCLASSES = (np.memmap, np.recarray)
# A view spanning more than this many times its bytes is compacted, not copied
# with its gaps (a[::100] of a large array copies 1% of it, not all of it).
SPARSE_RATIO = 2
# Copies smaller than PACK_LIMIT are packed into the message's chunk: one
# segment for many arrays, instead of a segment, mapping and ticket each.
# Chunks grow 4x from CHUNK_START to CHUNK_MAX: a message needs few segments
# (64 MB of small arrays: 4) and reserves at most 4x its last chunk's use.
PACK_LIMIT = 16 << 20
# Below the threshold an array is pickled inline, unless its message already
# carried a threshold's worth of arrays of at least PACK_MIN bytes: from then
# on, packing them costs less than pickling (1000 x 64 KiB: ~6x less).
PACK_MIN = 16 << 10
CHUNK_START = 1 << 20
CHUNK_MAX = 64 << 20
ALIGNMENT = 64
_NPY_USERDEF = 256


def reduce_ndarray(array):
    """ForkingPickler reducer. Never raises: any failure pickles by value.

    Failures that mean "shared memory cannot take this now" (a full /dev/shm,
    no fds left...) fall back with one warning per reason; anything else is a
    torchshm bug, which still falls back (a reducer that raises in a Queue's
    feeder thread loses the message) but says so."""
    try:
        return _reduce_through_shared_memory(array) or array.__reduce__()
    except _C.SharedMemoryError as exc:
        reason = _FALLBACK_REASONS.get(exc.errno)
        if reason is None:
            reason = f"shared-memory error: {errno.errorcode.get(exc.errno, exc.errno)}"
        _warn_once(
            f"torchshm: could not share an array ({exc}); pickling it by value", reason
        )
    except Exception as exc:  # noqa: BLE001 - raising here loses the message
        reason = f"internal error: {type(exc).__name__}"
        _warn_once(
            f"torchshm: unexpected {type(exc).__name__} while sharing an array"
            f" ({exc}); pickling it by value. Please report this as a bug.",
            reason,
        )
    _stats.fallback(reason)
    return array.__reduce__()


# errno -> the stats() key of a failure that means "fall back to pickling".
_FALLBACK_REASONS = {
    errno.ENOSPC: "no space in /dev/shm",
    errno.ENOMEM: "out of memory",
    errno.EMFILE: "too many open files",
    errno.ENFILE: "too many open files",
    errno.EACCES: "/dev/shm not writable",
    errno.EROFS: "/dev/shm not writable",
}


def rebuild_ndarray(owner, offset, dtype, shape, strides, writeable, subtype):
    """Rebuilds an array over `owner`, the int8 tensor of its segment.

    `dtype` is a dtype or its .str; `subtype` None means a plain ndarray."""
    array = _C.wrap_ndarray(owner, offset, dtype, shape, strides, writeable)
    _stats.add("arrays_received")
    return array if subtype is None else array.view(subtype)


def rebuild_ndarray_from_storage(storage, *view):
    """Rebuilds an array over a torch storage that torch itself shared."""
    return rebuild_ndarray(int8_tensor_over(storage), *view)


def rebuild_ndarray_from_reduced_storage(rebuild_storage, storage_args, *view):
    """Rebuilds an array over a storage that torch's own reducer sent."""
    return rebuild_ndarray_from_storage(rebuild_storage(*storage_args), *view)


def rebuild_empty(*view):
    """Rebuilds a zero-size array (numpy's own pickle drops its byte order)."""
    return rebuild_ndarray(torch.empty(0, dtype=torch.int8), *view)


def rebuild_inline(token, reconstruct, args, state):
    """Rebuilds an array pickled by value (numpy's own reduce, plus a token)."""
    array = reconstruct(*args)
    array.__setstate__(state)
    return array


def message_token():
    """Unpickles a _MessageToken: it carries nothing."""
    return None


def attach_segment(name, ticket=0, generation=0):
    """Unpickles a _SegmentRef: maps the segment and claims the message's
    ticket (once per message; see Note [Segment lifetime])."""
    return _segments.attach(name, ticket, generation)


def is_shared(array: Any) -> bool:
    """Whether the array's memory is torch shared memory (sent without a copy)."""
    owner = _owner_of(array) if isinstance(array, np.ndarray) else None
    return isinstance(owner, torch.Tensor) and (
        _segments.name_of(owner) is not None or untyped_storage(owner).is_shared()
    )


class _Message:
    __slots__ = (
        "copies",
        "refs",
        "chunk",
        "chunk_used",
        "small_bytes",
        "token",
        "__weakref__",
    )

    def __init__(self):
        self.chunk, self.chunk_used = None, 0
        self.small_bytes = 0  # below-threshold bytes pickled inline so far
        self.token = lambda: None  # weak ref to this message's _MessageToken
        # id(buffer root) -> (root, [copies]): the root is held so
        # that its id cannot be reused by another object within this message.
        # Refs are held weakly: a cycle would keep the message alive past its
        # pickler, and a later message would reuse a stale snapshot.
        self.copies = {}
        # segment name -> _SegmentRef, made on first use: a message of small
        # inline arrays never needs one (and it costs microseconds to build).
        self.refs = None


def _place(message, nbytes):
    """(segment tensor, offset) where this message copies nbytes."""
    if nbytes >= PACK_LIMIT:
        return _segments.allocate(nbytes), 0
    chunk = message.chunk
    if chunk is None or message.chunk_used + nbytes > chunk.numel():
        size = CHUNK_START if chunk is None else min(4 * chunk.numel(), CHUNK_MAX)
        message.chunk, message.chunk_used = _segments.allocate(max(size, nbytes)), 0
    offset = message.chunk_used
    message.chunk_used = -(-(offset + nbytes) // ALIGNMENT) * ALIGNMENT
    return message.chunk, offset


class _MessageToken:
    """Keeps a message's state alive through arrays pickled inline (the
    pickler's memo holds it, as it holds _SegmentRefs)."""

    __slots__ = ("message", "__weakref__")

    def __init__(self, message):
        self.message = message

    def __reduce__(self):
        return message_token, ()


def _token_for(message):
    token = message.token()
    if token is None:
        token = _MessageToken(message)
        message.token = weakref.ref(token)
    return token


class _SegmentRef:
    """A segment named by one message. The message's ticket is issued when
    the pickler writes it, so every byte string that names the segment has a
    ticket of its own, even when a nested dumps on this thread shares this
    object with an outer message."""

    __slots__ = ("owner", "name", "message", "__weakref__")

    def __init__(self, owner, name, message):
        self.owner, self.name, self.message = owner, name, message

    def __reduce__(self):
        try:
            held = _segments.ticket_for(self.owner, _channel.current())
        except Exception:  # noqa: BLE001 - raising here loses the message
            held = None
        # No ticket (every slot taken): the receiver holds the segment for as
        # long as its generation is unchanged; our view keeps it so until the
        # message is written.
        ticket, generation = held or (0, _C.segment_of(self.owner).generation)
        return attach_segment, (self.name, ticket, generation)


_thread = threading.local()


def _current_message():
    message = getattr(_thread, "message", lambda: None)()
    if message is None:
        message = _Message()
        _thread.message = weakref.ref(message)
    return message


def _ref_for(message, owner):
    """The message's reference to a segment; None if the segment's name is
    gone (its session ended), so that receivers could not map it."""
    segment = _C.segment_of(owner)
    if segment.unlinked:
        return None
    if message.refs is None:
        message.refs = weakref.WeakValueDictionary()
    ref = message.refs.get(segment.name)
    if ref is None:
        ref = message.refs[segment.name] = _SegmentRef(owner, segment.name, message)
    return ref


def _reduce_through_shared_memory(array):
    if array.dtype.hasobject:
        _stats.fallback("object dtype")
        return None
    if array.size == 0:
        _stats.add("arrays_inline")
        return rebuild_empty, _view_args(array, 0)
    threshold = _config.get_threshold()
    if array.nbytes < threshold:
        return _reduce_small(array, threshold)
    return _reduce_shared_view(array) or _reduce_copy(array)


def _reduce_small(array, threshold):
    """Inline, until the message carried a threshold's worth of such arrays."""
    if array.nbytes < PACK_MIN:
        _stats.add("arrays_inline")
        return None
    message = _current_message()
    if message.small_bytes >= threshold:
        return _reduce_shared_view(array) or _reduce_copy(array)
    message.small_bytes += array.nbytes
    _stats.add("arrays_inline")
    return (rebuild_inline, (_token_for(message),) + array.__reduce__())


def _view_args(array, offset, strides=None):
    dtype = array.dtype
    # A builtin dtype's .str round-trips it exactly unless it has fields, a
    # sub-array or metadata; a str pickles in a fraction of the time a dtype
    # object does. User-registered dtypes (num >= NPY_USERDEF, 256) and
    # new-style ones (num -1) have a .str that names only their bytes.
    if (
        0 <= dtype.num < _NPY_USERDEF
        and dtype.fields is None
        and dtype.subdtype is None
        and dtype.metadata is None
    ):
        dtype = dtype.str
    return (
        offset,
        dtype,
        array.shape,
        array.strides if strides is None else strides,
        array.flags.writeable,
        None if type(array) is np.ndarray else type(array),
    )


def _reduce_shared_view(array):
    """An array over memory that is already shared: send it without a copy."""
    owner = _owner_of(array)
    if not isinstance(owner, torch.Tensor):
        return None
    storage = untyped_storage(owner)
    # Relative to the storage, not to `owner`, which may start at an offset
    # into it (a slice of a received array's base).
    offset = _C.data_address(array) - storage.data_ptr()
    if _segments.name_of(owner) is not None:
        ref = _ref_for(_current_message(), owner)
        if ref is None:
            return None
        _stats.add("arrays_resent")
        return rebuild_ndarray, (ref,) + _view_args(array, offset)
    # Under file_descriptor (torch's default) the receiver fetches an fd from
    # the live sender, and keeps it open: a sender that exits before the
    # receiver unpickles loses the message, and a consumer under a low
    # `ulimit -n` runs out. Only file_system has neither flaw; otherwise the
    # array is snapshotted like any other.
    if storage.is_shared() and sharing_strategy() == "file_system":
        # torch's own storage reducer, called here so that its failures stay
        # inside reduce_ndarray's guard.
        rebuild_storage, storage_args = ForkingPickler._extra_reducers[type(storage)](
            storage
        )
        _stats.add("arrays_resent")
        return rebuild_ndarray_from_reduced_storage, (
            rebuild_storage,
            storage_args,
        ) + _view_args(array, offset)
    return None


def _reduce_copy(array):
    """Snapshots the bytes the view spans into a segment (see the Note)."""
    lo, hi = _C.byte_extent(array)
    if hi - lo > SPARSE_RATIO * array.nbytes:
        return _reduce_compacted(array)
    message = _current_message()
    root, nearest = _root_of(array)
    key = id(root if root is not None else nearest)
    root_entry = message.copies.setdefault(key, (root, []))
    start = _C.data_address(array)
    # Entries: bytes [copy_lo, copy_hi) of the buffer were copied to `at`.
    for copy_lo, copy_hi, at, weak_ref in root_entry[1]:
        ref = weak_ref()
        if ref is not None and copy_lo <= start + lo and start + hi <= copy_hi:
            _stats.add("arrays_resent")
            return rebuild_ndarray, (ref,) + _view_args(array, at + start - copy_lo)

    # Copy the whole buffer when this view covers most of it, so that other
    # views of it in this message share the copy; else only this view's span.
    source = array
    near_lo, near_hi = _C.byte_extent(nearest)
    near_start = _C.data_address(nearest)
    if (
        near_start + near_lo <= start + lo
        and start + hi <= near_start + near_hi
        and 2 * (hi - lo) >= near_hi - near_lo
    ):
        source, lo, hi, start = nearest, near_lo, near_hi, near_start
    owner, at = _place(message, hi - lo)
    _C.copy_extent(source, owner, at, _config.copy_threads())
    _stats.add_shared(hi - lo)
    ref = _ref_for(message, owner)
    root_entry[1].append((start + lo, start + hi, at, weakref.ref(ref)))
    offset = at + _C.data_address(array) - (start + lo)
    return rebuild_ndarray, (ref,) + _view_args(array, offset)


def _reduce_compacted(array):
    strides = _compact_strides(array)
    message = _current_message()
    owner, at = _place(message, array.nbytes)
    # Raw elements through a void view: padding bytes too, no per-field copy.
    raw = np.dtype((np.void, array.itemsize))
    target = _C.wrap_ndarray(owner, at, raw, array.shape, strides, True)
    np.copyto(target, array.view(raw), casting="no")
    _stats.add_shared(array.nbytes)
    ref = _ref_for(message, owner)
    return rebuild_ndarray, (ref,) + _view_args(array, at, strides)


def _compact_strides(array):
    """Dense strides that keep the array's axis order (C, F or other)."""
    order = sorted(range(array.ndim), key=lambda d: abs(array.strides[d]))
    strides, step = [0] * array.ndim, array.itemsize
    for axis in order:
        strides[axis] = step
        step *= array.shape[axis]
    return tuple(strides)


def _owner_of(array):
    """What owns the array's memory: a tensor for shared memory (received,
    shared, or born in a segment: Note [Born shared] in csrc/allocator.h)."""
    root, nearest = _root_of(array)
    if root is None:
        return _C.born_owner(_C.data_address(nearest))
    return root


def _root_of(array):
    """(the object owning the array's memory, the ndarray nearest to it)."""
    nearest, base = array, array.base
    while isinstance(base, np.ndarray):
        nearest, base = base, base.base
    return base, nearest


_warned = set()


def _warn_once(message, key):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
