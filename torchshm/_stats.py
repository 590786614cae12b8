"""Counters a user can read with torchshm.stats().

The counts are atomics in the native module (csrc/base/stats.h), so the sender
and receiver paths count without a lock or a call into Python; fallbacks,
keyed by a reason's text and rare, are counted here."""

import collections
import threading
from typing import Any, Dict

from torchshm._native import _C

COUNTERS = (
    "arrays_shared",  # copied into a fresh segment
    "bytes_copied",
    "arrays_resent",  # already in shared memory: sent without a copy
    "arrays_inline",  # below the threshold: pickled by value
    "arrays_received",
    "segments_created",
    "segments_attached",
    "segments_reused",  # a pooled segment reused by a sender (no fresh pages)
    "mappings_reused",  # a receiver reused a cached mapping (no page faults)
    "tickets_unavailable",  # every holder slot taken: sent without a ticket
    "allocations_shared",  # NumPy allocations born in a segment (allocating())
    "allocations_fallback",  # ...that shared memory could not take: NumPy's
    # A fork that went on while a joined torchshm thread was still listed
    # (Note [Threads at fork] in csrc/base/parallel.h).
    "fork_waits_timed_out",
    # An unchanged array sent again over its last snapshot: compared, not
    # copied (Note [Resending an unchanged array] in csrc/send/snapshots.h).
    "snapshots_resent",
    # A writable array of a snapshot that this process could not map
    # privately: copied (Note [Snapshots are mapped privately] in
    # csrc/lifetime/segment.h).
    "arrays_copied_on_receive",
    # A private mapping walked for the pages this process wrote before it
    # served another message: it took a page fault meanwhile (Note [Knowing
    # that nothing was written] in csrc/lifetime/private_mappings.h).
    "private_mappings_walked",
    # Torch storages moved into a segment in place (one copy), and storages
    # sent by reference (Note [Tensor storages] in csrc/send/tensors.h).
    "storages_moved",
    "storages_sent",
    # A new segment met a cap (memory, fds, the session table) and the pool
    # released its idle segments so that it fits (Note in segments.py).
    "pool_gave_way",
    # A storage over pages of a snapshot this process wrote, sent as a new
    # snapshot (Note [Tensor storages] in csrc/send/tensors.h).
    "storages_copied",
    # Segments a forked child could not be given a hold on: kept until the
    # session ends instead (Note [Fork] in _lifetime/lifecycle.py).
    "segments_pinned_at_fork",
    # Bytes of sent arrays whose pages became their snapshot's: the sender
    # keeps no second copy (Note [One copy of a sent array] in
    # csrc/send/one_copy.h).
    "bytes_one_copy",
)
if tuple(_C.COUNTER_NAMES) != COUNTERS:  # csrc/base/stats.h keeps the same order
    raise ImportError(
        f"torchshm: native counters {_C.COUNTER_NAMES} do not match {COUNTERS};"
        " rebuild torchshm"
    )
_INDEX = {name: i for i, name in enumerate(COUNTERS)}

_lock = threading.Lock()
_fallbacks = collections.Counter()


def add(name, n=1):
    _C.count(_INDEX[name], n)


def fallback(reason):
    with _lock:
        _fallbacks[reason] += 1


def stats() -> Dict[str, Any]:
    """A snapshot of this process's counters, with fallbacks by reason.

    The counts are this process's since it started (a forked child starts
    from zero) or since `reset_stats`, all threads together. Keys:
    ``arrays_shared`` (copied into shared memory to be sent),
    ``bytes_copied``, ``arrays_resent`` (in shared memory already: sent
    without a copy), ``snapshots_resent`` (an unchanged array sent again
    over its last snapshot), ``arrays_inline`` (pickled by value),
    ``arrays_received``, ``arrays_copied_on_receive``, ``segments_created``,
    ``segments_attached``, ``segments_reused``, ``mappings_reused``,
    ``private_mappings_walked``, ``tickets_unavailable``,
    ``allocations_shared`` and ``allocations_fallback`` (`allocating`),
    ``storages_moved``, ``storages_sent`` and ``storages_copied`` (torch
    tensors), ``pool_gave_way``, ``fork_waits_timed_out``,
    ``segments_pinned_at_fork``, ``bytes_one_copy`` (bytes of sent arrays
    whose pages became their snapshot's: one copy in memory), and
    ``fallbacks``: a dict
    {reason: count} of the times shared memory was not used (e.g.
    ``"out of memory"``).

    Returns
    -------
    dict
        {counter name: int}, plus ``"fallbacks"``: {reason (str): int}.
        A new dict each call: later sends do not change it.

    Raises
    ------
    Nothing
        It reads counters.

    See Also
    --------
    reset_stats

    Examples
    --------
    >>> torchshm.reset_stats()
    >>> a = torchshm.share(np.ones(1_000_000))
    >>> counts = torchshm.stats()
    >>> counts["arrays_shared"], counts["bytes_copied"], counts["fallbacks"]
    (1, 8000000, {})
    """
    result = dict(zip(COUNTERS, _C.counters()))
    with _lock:
        result["fallbacks"] = dict(_fallbacks)
    return result


def reset_stats() -> None:
    """Set every counter of `stats` to zero, and forget the fallbacks.

    Only this process's counters: other processes keep theirs.

    Returns
    -------
    None

    Raises
    ------
    Nothing
        It clears counters.

    See Also
    --------
    stats

    Examples
    --------
    >>> a = torchshm.share(np.ones(1_000_000))
    >>> torchshm.reset_stats()
    >>> torchshm.stats()["arrays_shared"]
    0
    """
    _C.reset_counters()
    with _lock:
        _fallbacks.clear()


def after_fork_in_child():
    """Counters describe this process: a forked child starts from zero (and
    with a fresh lock, which another thread may have held at fork time).
    Called by _lifecycle's fork protocol."""
    global _lock
    _lock = threading.Lock()
    _C.reset_counters()
    _fallbacks.clear()
