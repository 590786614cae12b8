"""A sending process's pool of segments, reused once every receiver is done.

Writing into fresh tmpfs pages runs at ~1.3 GB/s (page allocation and faults);
into already-mapped pages at memcpy speed. So a sender keeps the segments it
created and reuses one when no slot but its own names a live holder (see
Note [Segment lifetime] in csrc/lifetime/segment.h). The pool is capped; segments idle
for pool_idle_seconds() are released. Only policy lives here; the index is
native (csrc/lifetime/pool.h, Note [Segment pool]), so that the sender's plan can take
a pooled segment without entering Python. Its callers hold _holdings.lock
for everything that comes through here.
"""

import time

from torchshm import _config
from torchshm._lifetime import session as _session
from torchshm._native import _C

# Sizes round up to a multiple of 1/8 of the next power of two, and of 64 KiB
# (a segment's pages are mapped whole; smaller steps would only multiply
# classes): from 512 KiB up a class is less than 25% larger than what was
# asked, below that the 64 KiB step dominates (65 KiB gets 128 KiB, 129 KiB
# 192 KiB), and arrays of similar size share it. A take accepts a class up to
# 25% larger than the one wanted, so a pooled segment of 512 KiB or more may
# hold up to about 56% more memory than the array it carries.
_CLASSES = dict(min_class=64 << 10, steps=8, max_waste=1.25)
# Expired segments, and busy ones whose holders died, are looked for at most
# this often: the scan is O(pool) and must stay off the per-message path.
_THOROUGH_SCAN_SECONDS = 1.0


class SessionBudget:
    """What the session's live processes pool, in the session table that the
    keeper made (csrc/lifetime/table.h): each process records its own pool's size.
    Nobody else can name it, so nobody else can disable it."""

    def others(self, mine):
        """Bytes the session's other live processes pool."""
        return max(0, _session.table().budget_total() - mine)

    def record(self, nbytes):
        _session.table().budget_set(_C.process_id(), nbytes)


class Pool:
    """The policy around the native index (csrc/lifetime/pool.h, Note [Segment pool]):
    what to admit, when to release, and when the sender's plan may take
    without coming through here."""

    def __init__(self, budget=None):
        self.native = _C.SegmentPool(**_CLASSES)
        self._next_thorough_scan = 0.0
        self._fast = False  # whether the plan may take without Python
        self._budget = budget or SessionBudget()
        self._recorded = 0  # what the session table's budget says this pool holds

    @property
    def nbytes(self):
        return self.native.nbytes

    def __len__(self):
        return len(self.native)

    def size_class(self, nbytes):
        return self.native.size_class(nbytes)

    def take(self, nbytes):
        """A view over an idle pooled segment that fits nbytes without much
        waste, or None.

        Most calls look only at quiet segments (no system call). About once a
        second a thorough pass also asks whether the holders of busy ones
        still live, so that a receiver killed while holding a segment blocks
        its reuse for at most that long."""
        now = time.monotonic()
        thorough = now >= self._next_thorough_scan
        if thorough:
            self._next_thorough_scan = now + _THOROUGH_SCAN_SECONDS
            _session.check()  # a keeper that died is replaced within a second
            self.release_idle(older_than=_config.pool_idle_seconds())
        owner = self.native.take(nbytes, thorough)
        self._arm()
        return owner

    def admit(self, segment):
        """A view over a new segment: pooled (slot 0 is the pool's) if the
        session's pools stay within the cap, one budget for every process of
        the session; else the view owns slot 0."""
        cap = _config.pool_bytes()
        if not self._fits(segment.capacity, cap):
            self.release_idle()
            if not self._fits(segment.capacity, cap):
                return segment.tensor(0, _C.process_id()), False
        owner = self.native.admit(segment)
        self._record()
        return owner, True

    def schedule_thorough_scan(self):
        """Makes the next take thorough (it is due once a second)."""
        self._next_thorough_scan = 0.0
        self._arm()

    def enable_fast_take(self, enabled):
        """Whether the sender's plan may take pooled segments without calling
        allocate (only while the expiry timer runs: Note [Segment pool])."""
        self._fast = enabled
        self._arm()

    def _arm(self):
        self.native.fast_until = self._next_thorough_scan if self._fast else 0.0

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
        return self.native.get(name)

    def release_idle(self, older_than=0.0):
        """Drops idle segments unused for older_than seconds; returns bytes freed."""
        freed = self.native.release_idle(older_than)
        self._record()
        return freed

    def release_all(self):
        """Releases the pool's slot of every segment (this process is exiting)."""
        self.native.release_all()
        self._record()

    def forget(self):
        """Forgets every segment without releasing (a forked child: the
        slots belong to the parent's pool)."""
        self.native.forget()
        self._fast = False
        self._recorded = 0  # the parent's entry stays the parent's
