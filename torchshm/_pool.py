"""A sending process's pool of segments, reused once every receiver is done.

Writing into fresh tmpfs pages runs at ~1.3 GB/s (page allocation and faults);
into already-mapped pages at memcpy speed. So a sender keeps the segments it
created and reuses one when no slot but its own names a live holder (see
Note [Segment lifetime] in csrc/segment.h). The pool is capped; segments idle
for pool_idle_seconds() are released. Only policy lives here: the caller
(_segments.py) holds the lock and does the mapping.
"""

import collections
import time

from torchshm import _config, _session
from torchshm._compat import load_native

_C = load_native()

# Sizes round up to 1/8 of their power of two: at most 12.5% of /dev/shm is
# reserved in vain, and arrays of similar size share a class.
_CLASS_STEPS = 8
_MIN_CLASS = 64 << 10


def size_class(nbytes):
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    step = max(_MIN_CLASS, (1 << (nbytes - 1).bit_length()) // _CLASS_STEPS)
    return -(-nbytes // step) * step


def _quiet(segment):
    """No local view and no slot but the pool's own (slot 0): cheap, no
    system call. Dead holders' slots are cleared by the periodic scan."""
    return segment.local_views == 0 and segment.holders == 1


def _idle(segment):
    """Nothing but the pool holds it; clears dead holders' slots on the way."""
    return segment.local_views == 0 and not segment.has_live_holder(0)


# Expired segments, and busy ones whose holders died, are looked for at most
# this often: the scan is O(pool) and must stay off the per-message path.
_THOROUGH_SCAN_SECONDS = 1.0


class SessionBudget:
    """What the session's live processes pool, in one small shared file
    (csrc/budget.h): each process records its own pool's size."""

    def __init__(self):
        self._budget = None

    def _file(self):
        if self._budget is None:
            path = f"/dev/shm/torchshm-budget-{_session.session_id()}.shm"
            self._budget = _C.Budget.open(path)
        return self._budget

    def others(self, mine):
        """Bytes the session's other live processes pool (0 if unknown)."""
        try:
            return max(0, self._file().total() - mine)
        except OSError:
            return 0

    def record(self, nbytes):
        try:
            self._file().set(_C.process_id(), nbytes)
        except OSError:
            pass


class Pool:
    def __init__(self, budget=None):
        self.segments = {}  # name -> [Segment, last use]
        self.by_class = collections.defaultdict(list)  # capacity -> [entry]
        self.nbytes = 0
        self._next_thorough_scan = 0.0
        self._budget = budget or SessionBudget()
        self._recorded = 0  # what the budget file says this pool holds

    def take(self, nbytes):
        """An idle pooled segment that fits nbytes without much waste, or None.

        Most calls look only at quiet segments (no system call). About once a
        second a thorough pass also asks whether the holders of busy ones
        still live, so that a receiver killed while holding a segment blocks
        its reuse for at most that long."""
        now = time.monotonic()
        thorough = now >= self._next_thorough_scan
        if thorough:
            self._next_thorough_scan = now + _THOROUGH_SCAN_SECONDS
            self.release_idle(older_than=_config.pool_idle_seconds())
        wanted = size_class(nbytes)
        # The fitting classes: this one, then slightly larger (<= 25% waste).
        for capacity in sorted(
            c for c in self.by_class if wanted <= c <= wanted * 1.25
        ):
            for entry in self.by_class[capacity]:
                segment = entry[0]
                if (thorough or _quiet(segment)) and segment.reserve_for_reuse(0):
                    entry[1] = now
                    return segment
        return None

    def admit(self, segment):
        """Keeps a new segment (and its slot 0) if the session's pools stay
        within the cap: one budget for every process of the session."""
        cap = _config.pool_bytes()
        if not self._fits(segment.capacity, cap):
            self.release_idle()
            if not self._fits(segment.capacity, cap):
                return False
        entry = [segment, time.monotonic()]
        self.segments[segment.name] = entry
        self.by_class[segment.capacity].append(entry)
        self.nbytes += segment.capacity
        self._record()
        return True

    def _fits(self, nbytes, cap):
        """Whether `nbytes` more fit the session's budget. Records the claim
        first and checks after, so that processes admitting at once may both
        back off, but never both get in."""
        wanted = self.nbytes + nbytes
        if wanted > cap:
            return False
        self._budget.record(wanted)
        if self._budget.others(wanted) + wanted <= cap:
            self._recorded = wanted
            return True
        self._budget.record(self._recorded)
        return False

    def _record(self):
        if self.nbytes != self._recorded:
            self._budget.record(self.nbytes)
            self._recorded = self.nbytes

    def get(self, name):
        entry = self.segments.get(name)
        return entry[0] if entry else None

    def release_idle(self, older_than=0.0):
        """Drops idle segments unused for older_than seconds; returns bytes freed."""
        now, freed = time.monotonic(), 0
        for name, (segment, last) in list(self.segments.items()):
            if now - last >= older_than and _idle(segment):
                freed += self._drop(name)
        self._record()
        return freed

    def release_all(self):
        """Releases the pool's slot of every segment (this process is exiting)."""
        for name in list(self.segments):
            self._drop(name)
        self._record()

    def forget(self):
        """Forgets every segment without releasing (a forked child: the
        slots belong to the parent's pool)."""
        self.segments.clear()
        self.by_class.clear()
        self.nbytes = 0
        self._recorded = 0  # the parent's entry stays the parent's

    def _drop(self, name):
        entry = self.segments.pop(name)
        segment = entry[0]
        siblings = self.by_class[segment.capacity]
        siblings.remove(entry)
        if not siblings:
            del self.by_class[segment.capacity]
        self.nbytes -= segment.capacity
        segment.release_slot(0, _C.process_id())
        return segment.capacity
