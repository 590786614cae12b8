"""The sender's policy: which ndarrays go through shared memory, and what
happens when one cannot.

The registered ForkingPickler reducer is native (`reduce_ndarray`, Note [One
message, one snapshot] in csrc/send/message.h): it decides by size and places
every array of at least min(threshold, PACK_MIN) bytes without entering
Python. It asks Python three things, at most one per array, through the hooks
below (Note [The seam] in _native.py): how to reduce an object or empty array
(`reduce_other`), whether torch's own sharing may carry memory a torch tensor
owns (`reduce_torch_owned`), and what to do after a failure (`fall_back`).
Object arrays of strings are packed into one buffer (Note [String columns]
in _strings.py). The numbers below are handed to the native side once, at
import, by torchshm/__init__.py.
"""

import threading
from typing import Any

import numpy as np
from torch.multiprocessing import get_sharing_strategy as sharing_strategy

from torchshm import _compat, _config, _fallback, _stats, _strings
from torchshm._lifetime import forks as _forks
from torchshm._lifetime import segments as _segments
from torchshm._compat import untyped_storage
from torchshm._native import _C
from torchshm._reduction import (
    rebuild_by_value,
    rebuild_empty,
    rebuild_ndarray_from_reduced_storage,
)

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
# on, packing them costs less than pickling. One message of 1000 arrays,
# child to parent (`python -m benchmarks --only many_small`, this 2-core
# machine, 2026-11-29, medians): at 1 KiB each 10.1 ms, 4 KiB 10.7 ms, 64 KiB
# 21.6 ms, against pipe + pickle's 14.6, 34.0 and 261 ms; with 16 KiB here
# before, 1-16 KiB arrays were never packed (4 KiB: 21-24 ms, a /tmp harness
# over benchmarks.transports, same day). Smaller arrays never count: at 512 B
# inline was as fast as packing (6.4-7.8 against 8.4-12.5 ms).
PACK_MIN = 1 << 10
# A sent array from ONE_COPY_MIN bytes up, alone in its malloc()'d memory,
# keeps one copy in memory: its pages become the snapshot's (Note [One copy
# of a sent array] in csrc/send/one_copy.h). From NumPy's own threshold for
# huge pages; below it an array is rarely in memory of its own (glibc's
# mmap threshold grows to the size of the largest freed block).
ONE_COPY_MIN = 4 << 20
CHUNK_START = 1 << 20
CHUNK_MAX = 64 << 20
ALIGNMENT = 64


# Object arrays this thread pickled by value (share() says so once).
_declined = threading.local()


def object_arrays_declined() -> int:
    """How many object arrays this thread has pickled by value so far."""
    return getattr(_declined, "count", 0)


def reduce_other(array):
    """The native reducer's hook for object and empty arrays (and anything
    else it is handed that is not an ndarray). Never raises: any failure
    pickles by value (see fall_back)."""
    try:
        if array.dtype.hasobject:
            packed = _strings.reduce_str_array(array)
            if packed is None:
                _stats.fallback("object dtype")
                _declined.count = object_arrays_declined() + 1
                return rebuild_by_value, array.__reduce__()
            return packed
        if isinstance(array, np.ndarray) and array.size == 0:
            _stats.add("arrays_inline")
            return rebuild_empty, _C.view_args(array, 0)
        return array.__reduce__()  # not an ndarray (a numpy scalar)
    except Exception as exc:  # noqa: BLE001 - raising here loses the message
        return fall_back(array, exc)


def reduce_by_value(array):
    """The native reducer's hook where no new message may use shared memory
    (after the exit hook, in the child of a fork torchshm did not prepare:
    Note [A plain send is as it was] in csrc/send/plan.h): numpy's own
    reduce under torchshm's name, so that the receiver does not blame a
    sender without torchshm (Note [Arrays that arrive by value] in
    arrivals.py). Raises only for memory such a child cannot read."""
    owner = _C.memory_owner(array)
    if owner is not None and _C.in_torchshm_memory(owner):
        _forks.check_fork_hooks("sending an array over inherited shared memory")
    if array.dtype.hasobject:
        return reduce_other(array)
    return rebuild_by_value, array.__reduce__()


def fall_back(array, exc):
    """numpy's own reduce of an array that shared memory could not take (what
    that means, and the one warning: torchshm._fallback). A reducer that
    raises in a Queue's feeder thread would lose the message."""
    _fallback.fall_back(exc, "sharing an array", "pickling it by value")
    return array.__reduce__()


def reduce_torch_owned(tensor, view):
    """The native reducer's one question about an array over memory that the
    torch tensor `tensor` owns and torchshm did not make: torch's own storage
    reduce, or None to copy it into shared memory like any other array.
    `view` is the array's rebuild arguments after the owner.

    Under file_descriptor (torch's default) the receiver fetches an fd from
    the live sender, and keeps it open: a sender that exits before the
    receiver unpickles loses the message, and a consumer under a low
    `ulimit -n` runs out. Only file_system has neither flaw. A failure here
    reaches fall_back through the native reducer."""
    storage = untyped_storage(tensor)
    if not (storage.is_shared() and sharing_strategy() == "file_system"):
        return None
    rebuild_storage, storage_args = _compat.forking_reducers()[type(storage)](storage)
    return rebuild_ndarray_from_reduced_storage, (rebuild_storage, storage_args) + view


# The reducer registered with ForkingPickler (see the module's docstring).
reduce_ndarray = _C.reduce_ndarray


def allocate(nbytes):
    """The native plan's hook for a segment the pool could not give it.
    Looked up at each call, so that the pool and budget policy stays
    _segments.allocate's (and a test may replace it). Unpopulated: the plan's
    writes make a fresh segment's pages (Segment::fill)."""
    return _segments.allocate(nbytes, populate=False)


def policy():
    """The numbers the native sender works by (Note [The seam])."""
    return dict(
        threshold=_config.get_threshold(),
        pack_min=PACK_MIN,
        sparse_ratio=SPARSE_RATIO,
        pack_limit=PACK_LIMIT,
        chunk_start=CHUNK_START,
        chunk_max=CHUNK_MAX,
        alignment=ALIGNMENT,
        copy_threads=_config.copy_threads(),
        one_copy_min=ONE_COPY_MIN,
    )


def is_shared(array: Any) -> bool:
    """Whether an array's memory is shared memory, sent without a copy.

    True for an array over a torchshm segment (received, from `share`, born
    in `allocating`, a `collate` batch) or over a torch tensor's shared
    storage (``share_memory_()``, ``torchshm.empty``): sending it passes a
    reference. False for ordinary memory, which a send copies (or pickles
    inline, below the threshold).

    Parameters
    ----------
    array : object
        The array to check; anything that is not a ``numpy.ndarray`` (a torch
        tensor included: use ``tensor.is_shared()``) gives False.

    Returns
    -------
    bool
        Whether its memory is torchshm or torch shared memory.

    Raises
    ------
    Nothing
        Any object is accepted.

    See Also
    --------
    share, allocating

    Examples
    --------
    >>> a = np.ones(1_000_000)
    >>> torchshm.is_shared(a)
    False
    >>> torchshm.is_shared(torchshm.share(a))
    True
    >>> import torch
    >>> torchshm.is_shared(torch.ones(10).share_memory_().numpy())
    True
    """
    owner = _C.memory_owner(array) if isinstance(array, np.ndarray) else None
    return owner is not None and (
        _segments.name_of(owner) is not None or untyped_storage(owner).is_shared()
    )
