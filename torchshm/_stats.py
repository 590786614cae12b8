"""Counters a user can read with torchshm.stats()."""

import collections
import os
import threading
from typing import Any, Dict

_lock = threading.Lock()
_counts = collections.Counter()
_fallbacks = collections.Counter()

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
    "allocations_fallback",  # ...that /dev/shm could not take: NumPy's memory
)


def add(name, n=1):
    with _lock:
        _counts[name] += n


def add_shared(nbytes):
    """One array copied into shared memory (one lock, on the hot path)."""
    with _lock:
        _counts["arrays_shared"] += 1
        _counts["bytes_copied"] += nbytes


def fallback(reason):
    with _lock:
        _fallbacks[reason] += 1


def stats() -> Dict[str, Any]:
    """A snapshot of this process's counters, with fallbacks by reason."""
    with _lock:
        result = {name: _counts[name] for name in COUNTERS}
        result["fallbacks"] = dict(_fallbacks)
    return result


def reset_stats() -> None:
    with _lock:
        _counts.clear()
        _fallbacks.clear()


def _after_fork_in_child():
    # Counters describe this process: a forked child starts from zero (and
    # with a fresh lock, which another thread may have held at fork time).
    global _lock
    _lock = threading.Lock()
    _counts.clear()
    _fallbacks.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
