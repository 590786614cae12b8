"""The sender's policy: which ndarrays go through shared memory, and what
happens when one cannot.

The registered ForkingPickler reducer is native (`REDUCER`,
csrc/message.cpp): below min(threshold, PACK_MIN) it returns numpy's own
reduce, and from the threshold up it shares the array through the thread's
message, both without entering Python. Every other array (packed, empty,
object dtype, over torch memory) comes to `reduce_ndarray` here, and so does
every failure, to `fall_back`. Object arrays of strings are packed into one
buffer (Note [String columns] in _strings.py). The numbers below, and the threshold, are
pushed into the native side by `configure()` whenever they change.
"""

from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
from torch.multiprocessing import get_sharing_strategy as sharing_strategy

from torchshm import _config, _fallback, _segments, _stats, _strings
from torchshm._compat import load_native, untyped_storage
from torchshm._reduction import (
    rebuild_empty,
    rebuild_inline,
    rebuild_ndarray_from_reduced_storage,
)

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


def reduce_ndarray(array):
    """ForkingPickler reducer for what the native one leaves. Never raises:
    any failure pickles by value (see fall_back)."""
    try:
        return _reduce_through_shared_memory(array) or array.__reduce__()
    except Exception as exc:  # noqa: BLE001 - raising here loses the message
        return fall_back(array, exc)


def fall_back(array, exc):
    """numpy's own reduce of an array that shared memory could not take (what
    that means, and the one warning: torchshm._fallback). A reducer that
    raises in a Queue's feeder thread would lose the message."""
    _fallback.fall_back(exc, "sharing an array", "pickling it by value")
    return array.__reduce__()


# The reducer registered with ForkingPickler (see the module's docstring).
REDUCER = _C.reduce_ndarray


def _allocate(nbytes):
    # Looked up at each call, so that the pool and budget policy stays
    # _segments.allocate's (and a test may replace it).
    return _segments.allocate(nbytes)


def configure(threshold=None):
    """Pushes the policy numbers into the native sender (at import, and by
    _config whenever the threshold changes)."""
    if threshold is None:
        threshold = _config.get_threshold()
    _C.configure_sender(
        policy_reducer=reduce_ndarray,
        fall_back=fall_back,
        allocate=_allocate,
        inline_below=min(threshold, PACK_MIN),
        threshold=threshold,
        sparse_ratio=SPARSE_RATIO,
        pack_limit=PACK_LIMIT,
        chunk_start=CHUNK_START,
        chunk_max=CHUNK_MAX,
        alignment=ALIGNMENT,
        copy_threads=_config.copy_threads(),
    )


def is_shared(array: Any) -> bool:
    """Whether the array's memory is torch shared memory (sent without a copy)."""
    owner = _C.memory_owner(array) if isinstance(array, np.ndarray) else None
    return owner is not None and (
        _segments.name_of(owner) is not None or untyped_storage(owner).is_shared()
    )


def _reduce_through_shared_memory(array):
    if array.dtype.hasobject:
        packed = _strings.reduce_str_array(array)
        if packed is None:
            _stats.fallback("object dtype")
        return packed
    if array.size == 0:
        _stats.add("arrays_inline")
        return rebuild_empty, _C.view_args(array, 0)
    threshold = _config.get_threshold()
    if array.nbytes < threshold:
        return _reduce_small(array, threshold)
    return _share(array, _C.current_message())


def _reduce_small(array, threshold):
    """Inline, until the message carried a threshold's worth of such arrays."""
    if array.nbytes < PACK_MIN:
        _stats.add("arrays_inline")
        return None
    message = _C.current_message()
    if message.small_bytes >= threshold:
        return _share(array, message)
    message.small_bytes += array.nbytes
    _stats.add("arrays_inline")
    return (rebuild_inline, (message.token(),) + array.__reduce__())


def _share(array, message):
    """By reference if the memory is shared already, else a snapshot (the
    native plan decides which, and copies)."""
    return message.share(array) or _over_torch_storage(array, message)


def _over_torch_storage(array, message):
    """An array over a torch tensor's memory that torchshm did not make.

    Under file_descriptor (torch's default) the receiver fetches an fd from
    the live sender, and keeps it open: a sender that exits before the
    receiver unpickles loses the message, and a consumer under a low
    `ulimit -n` runs out. Only file_system has neither flaw; otherwise the
    array is snapshotted like any other."""
    tensor, _, offset = message.place(array)
    storage = untyped_storage(tensor)
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
        ) + _C.view_args(array, offset)
    return message.share(array, copy=True)


configure()
_config.on_threshold_change(configure)
