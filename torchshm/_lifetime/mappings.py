"""A receiver's cache of mappings whose arrays it dropped: a segment that its
sender reuses arrives again without a fresh map and page faults. Bounded by
_config.mapping_cache_bytes(); call with _holdings.lock held.
"""

import collections
import time

# name -> Segment, oldest first.
_idle = collections.OrderedDict()
_idle_bytes = 0
_next_dead_scan = 0.0


def get(name):
    """The cached mapping of segment `name`, or None (it stays cached)."""
    return _idle.get(name)


def keep(name, segment, limit):
    """Caches a mapping whose last view died, then drops the oldest down to
    `limit` bytes."""
    global _idle_bytes
    _idle[name] = segment
    _idle_bytes += segment.capacity
    drop(limit)


def take(name):
    """The cached mapping of segment `name`, or None; it leaves the cache."""
    global _idle_bytes
    segment = _idle.pop(name, None)
    if segment is not None:
        _idle_bytes -= segment.capacity
    return segment


def drop(limit):
    """Unmaps idle mappings, oldest first, down to `limit` bytes. About once a
    second, mappings of segments that their senders freed go too (they pin
    memory nobody can name any more); the scan is O(cache), so not per call."""
    global _idle_bytes, _next_dead_scan
    now = time.monotonic()
    if limit == 0 or now >= _next_dead_scan:
        _next_dead_scan = now + 1.0
        for name in [n for n, s in _idle.items() if s.unlinked]:
            _idle_bytes -= _idle.pop(name).capacity
    while _idle_bytes > limit and _idle:
        _idle_bytes -= _idle.popitem(last=False)[1].capacity


def cached():
    """Whether any mapping is cached."""
    return bool(_idle)


def clear():
    """Forgets every mapping (a forked child: they are the parent's to keep)."""
    global _idle_bytes
    _idle.clear()
    _idle_bytes = 0
