"""What this process holds: the pool of segments it created, its live view of
each segment it uses, and the one lock over them.

Every module that allocates, attaches, expires or forks (_segments, _attach,
_expiry, _lifecycle) works on this state, under `lock`; nothing else keeps a
copy of it.
"""

import collections
import threading

from torchshm._lifetime import pool as _pool
from torchshm._native import _C


# Note [Work for the lock's holder]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A received segment's last view dies in whatever thread let go of it, and
# its callback must never wait for the lock (Thread.start() under the lock
# awaits a thread that may be the one collecting: both hung). Dropping the
# callback's work when the lock was busy lost the mapping cache's reuse
# whenever two threads met there (a pin_memory thread receiving while the
# main thread drops a batch; the expiry timer's tick): the next message
# mapped and faulted its pages afresh. So the callback queues its work and
# the lock's holder runs it at its last release. The queue is appended
# before the callback tries the lock, and read by the holder after it
# releases: whichever comes second sees the other, so no work is left
# behind while nobody holds the lock. One exception: the release after a
# fork, in the parent, leaves it to the next send or receive, which starts
# the expiry timer again anyway (no thread may start in that hook).
# _handles does the same by hand for its plain Lock (_dead, _locked,
# _drop_dead_if_free); it could take this class instead.


class DeferringLock:
    """A reentrant lock that runs work queued by defer() before its last
    release (Note [Work for the lock's holder])."""

    __slots__ = ("_lock", "_depth", "_deferred")

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0  # written only by the holder
        self._deferred = collections.deque()  # append and popleft are atomic

    def acquire(self, blocking=True):
        if not self._lock.acquire(blocking):
            return False
        self._depth += 1
        return True

    def release(self, run_deferred=True):
        """run_deferred=False leaves queued work to the next holder (after
        fork, where no thread may start: Note [Fork] in lifecycle.py)."""
        while True:
            if self._depth == 1 and run_deferred:
                self._run_deferred()
            self._depth -= 1
            self._lock.release()
            # Another holder now runs what is queued; else it is ours to run.
            if not run_deferred or self._depth or not self._deferred:
                return
            if not self.acquire(False):
                return

    def defer(self, work):
        """Runs `work()` under the lock: now if it is free, else at the
        holder's last release."""
        self._deferred.append(work)
        if self.acquire(False):
            self.release()

    def _run_deferred(self):
        while self._deferred:
            work = self._deferred.popleft()
            try:
                work()
            except Exception:  # noqa: BLE001 - work that failed is only not done
                pass  # (a mapping not cached); the holder's own work goes on

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


# Guards the pool, the mapping cache (_mappings) and the bookkeeping around
# the live views. Replaced in a forked child (another thread may have held
# it at fork): take it as _holdings.lock at each use, never keep it.
lock = DeferringLock()
# The segments this process created, reused once idle (pool.py).
pool = _pool.Pool()
# This process's live view of each segment, by name (Note [Live views] in
# csrc/lifetime/live.h): the sender's plan records the pooled segments it takes there
# too, without entering Python.
live = _C.live
# Set by the exit finalizer (_lifecycle): no thread may start after it.
exiting = False


def after_fork_in_child():
    """A fresh lock: threads do not survive fork, their holds may (and the
    work they queued is the parent's)."""
    global lock
    lock = DeferringLock()
