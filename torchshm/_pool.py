"""A sending process's pool of segments, reused once every receiver is done.

Writing into fresh tmpfs pages runs at ~1.3 GB/s (page allocation and faults);
into already-mapped pages at memcpy speed. So a sender keeps the segments it
created and reuses one when its count shows that only the pool holds it (see
Note [Segment lifetime] in csrc/segment.h). The pool is capped; segments idle
for pool_idle_seconds() are released. Only policy lives here: the caller
(_segments.py) holds the lock and does the mapping.
"""

import time

from torchshm import _config

# Sizes round up to 1/8 of their power of two: at most 12.5% of /dev/shm is
# reserved in vain, and arrays of similar size share a class.
_CLASS_STEPS = 8
_MIN_CLASS = 64 << 10


def size_class(nbytes):
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    step = max(_MIN_CLASS, (1 << (nbytes - 1).bit_length()) // _CLASS_STEPS)
    return -(-nbytes // step) * step


def _idle(segment):
    return segment.local_views == 0 and segment.refcount == 1


class Pool:
    def __init__(self):
        self.segments = {}  # name -> [Segment, last use]
        self.nbytes = 0

    def take(self, nbytes):
        """An idle pooled segment that fits nbytes without much waste, or None."""
        now = time.monotonic()
        self._release_expired(now)
        limit = size_class(nbytes) + size_class(nbytes) // 4
        best = None
        for entry in self.segments.values():
            segment = entry[0]
            if nbytes <= segment.capacity <= limit and _idle(segment):
                if best is None or segment.capacity < best[0].capacity:
                    best = entry
        if best is None:
            return None
        best[1] = now
        return best[0]

    def admit(self, segment):
        """Keeps a new segment (and its creator reference) if under the cap."""
        cap = _config.pool_bytes()
        if self.nbytes + segment.capacity > cap:
            self.release_idle()
            if self.nbytes + segment.capacity > cap:
                return False
        self.segments[segment.name] = [segment, time.monotonic()]
        self.nbytes += segment.capacity
        return True

    def get(self, name):
        entry = self.segments.get(name)
        return entry[0] if entry else None

    def release_idle(self, older_than=0.0):
        """Drops idle segments unused for older_than seconds; returns bytes freed."""
        now, freed = time.monotonic(), 0
        for name, (segment, last) in list(self.segments.items()):
            if now - last >= older_than and _idle(segment):
                freed += self._drop(name)
        return freed

    def release_all(self):
        """Drops every creator reference (this process is exiting)."""
        for name in list(self.segments):
            self._drop(name)

    def forget(self):
        """Forgets every segment without releasing (a forked child: the
        references belong to the parent's pool)."""
        self.segments.clear()
        self.nbytes = 0

    def _release_expired(self, now):
        if self.segments:
            self.release_idle(older_than=_config.pool_idle_seconds())

    def _drop(self, name):
        segment, _ = self.segments.pop(name)
        self.nbytes -= segment.capacity
        segment.release()
        return segment.capacity
