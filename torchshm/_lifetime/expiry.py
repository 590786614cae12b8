"""The expiry timer: gives idle shared memory back (Note [Expiry timer])."""

import os
import sys
import threading
import time

from torchshm import _config
from torchshm._lifetime import fds as _fds
from torchshm._lifetime import holdings as _holdings
from torchshm._lifetime import mappings as _mappings
from torchshm._lifetime import session as _session
from torchshm._native import _C

# Note [Expiry timer]
# The timer gives idle memory back: pooled segments unused for
# pool_idle_seconds(), and cached mappings of segments that died. It wakes
# only when something can have changed:
# - at the moment the oldest pooled segment with no local view can expire
#   (oldest_quiet_use + idle); none earlier can;
# - while every pooled segment has a local view, never: the first one whose
#   last local view dies writes a byte to a pipe (wake_when_quiet in
#   csrc/lifetime/segment.h), once per such sleep;
# - while a segment past its time is still held by another process, or
#   mappings are cached, every quarter of the idle time, at most
#   EXPIRY_PERIOD_MAX apart;
# - while segments this process created are kept for messages in flight
#   (prune_in_flight in csrc/lifetime/segment.h), every IN_FLIGHT_PERIOD, to let go
#   of those whose messages were read. The first one kept wakes it like a
#   quiet segment; it runs while this process has segments of its own
#   outside its pool, asleep until one is kept.
# - when its keeper's connection reads as closed: the keeper died, and this
#   process joins the next one at once, handing it every segment it created
#   (session.check()), what its messages in flight name included. A sender
#   that only reuses what it made (a slab, its pool) registers nothing new
#   and would otherwise not notice before it exits, and if it died first
#   (SIGKILL) its unread messages would die with it although a keeper lived.
#   While another thread waits for a reply on that connection (which makes
#   it readable), it looks again every KEEPER_BUSY_PERIOD instead.
# A wake-up is cheap on bare metal, but on a paravirtualized VM every
# wake-up of a process holding gigabytes costs tens of milliseconds of CPU
# (measured here: 15-50 ms for a plain time.sleep(1) with 3 GB of numpy
# arrays held, 0.3 ms without): `python -m benchmarks.background` measures it.
EXPIRY_PERIOD_MAX = 10.0
IN_FLIGHT_PERIOD = 1.0
KEEPER_BUSY_PERIOD = 0.05


def _make_quiet_pipe():
    """The timer's wake-up pipe: made at import (and in a forked child) and
    never closed while the process lives, so that a view that took its fd
    number can never write into a file that reused it."""
    r, w = os.pipe()
    os.set_blocking(r, False)  # drained without waiting
    os.set_blocking(w, False)  # a full pipe wakes the timer all the same
    return r, w


_quiet_pipe = _make_quiet_pipe()


class _Expiry:
    """The expiry timer (Note [Expiry timer]). A sender that goes quiet
    releases its pool within the idle time (plus a quarter of it, at most
    EXPIRY_PERIOD_MAX) without sending again. The thread runs only while
    there is something to watch, and never across fork (Note [Fork] in
    lifecycle.py): a fork stops it, and the next send or receive starts it
    again (a process that forks and then never touches torchshm keeps its
    pool until exit, within the session's budget)."""

    def __init__(self):
        self._thread = None
        self._stop = threading.Event()

    def ensure(self):
        """Starts the thread if it is not running (call with the lock held).
        Never once this process is exiting: during interpreter finalization
        Thread.start() does not return (an array freed then, with a module's
        globals, would hang the exit)."""
        if _holdings.exiting or sys.is_finalizing():
            return
        if self._thread is None:
            self._stop.clear()
            thread = threading.Thread(
                target=self._run, name="torchshm-expiry", daemon=True
            )
            thread.start()
            # Published only once started: halt() runs without the lock (at
            # fork, in another thread) and cannot join an unstarted thread.
            self._thread = thread
        # The plan may take pooled segments without allocate's bookkeeping
        # (resume() above) only while this timer runs.
        _holdings.pool.enable_fast_take(True)

    def halt(self):
        _holdings.pool.enable_fast_take(False)
        thread = self._thread
        if thread is not None:
            self._stop.set()
            _C.wake_when_quiet(-1)
            try:
                os.write(_quiet_pipe[1], b"s")
            except BlockingIOError:
                pass  # full: the thread wakes anyway
            thread.join()
            self._thread = None

    def running(self):
        return self._thread is not None

    def needed(self):
        return bool(
            len(_holdings.pool)
            or _mappings.cached()
            or _C.open_creator_fds() > len(_holdings.pool)
            or _C.in_flight_count()
        )

    def resume(self):
        """Restarts the timer after a fork stopped it (call with the lock held)."""
        if self._thread is None and self.needed():
            self.ensure()

    def _next_wait(self, idle):
        """Seconds until the next look, or None: until woken (see the Note).
        Armed before it looks, so that a segment going quiet meanwhile wakes
        it."""
        _C.wake_when_quiet(_quiet_pipe[1])
        with _holdings.lock:
            # An empty slab is let go like an idle pooled segment.
            oldest = min(
                _holdings.pool.native.oldest_quiet_use(), _C.slab_empty_since()
            )
            mappings = _mappings.cached()
        period = max(0.05, min(EXPIRY_PERIOD_MAX, idle / 4))
        wait = None if mappings is False else period
        if _C.in_flight_count():
            wait = IN_FLIGHT_PERIOD if wait is None else min(wait, IN_FLIGHT_PERIOD)
        if oldest != float("inf"):
            _C.wake_when_quiet(-1)
            due = oldest + idle - time.monotonic()
            until = due if due > 0 else period
            wait = until if wait is None else min(wait, until)
        if _C.has_current_slab():  # it goes empty without waking us
            wait = period if wait is None else min(wait, period)
        return wait

    def _run(self):
        _C.name_this_thread(_C.EXPIRY_THREAD_NAME)  # Note [Threads at fork]
        r = _quiet_pipe[0]
        keeper = _session.connection_fd()  # None: not joined
        busy = False  # another thread waits for a reply on that connection
        while True:
            idle = _config.pool_idle_seconds()
            wait = self._next_wait(idle)
            watched = (r,) if keeper is None or busy else (r, keeper)
            if busy:  # it reads as ready without news: look again soon
                wait = (
                    KEEPER_BUSY_PERIOD
                    if wait is None
                    else min(wait, KEEPER_BUSY_PERIOD)
                )
            _fds.readable(*watched, timeout=wait)  # fds past 1024: poll
            _C.wake_when_quiet(-1)
            try:
                os.read(r, 4096)  # nonblocking: drains the wake-ups
            except BlockingIOError:
                pass
            if self._stop.is_set():
                return
            # First: a keeper that died takes no message with it while this
            # process lives to give them to the next one.
            busy = not _session.check()
            keeper = _session.connection_fd()
            _C.prune_in_flight()
            with _holdings.lock:
                _C.release_empty_slab(idle)
                _holdings.pool.release_idle(older_than=idle)
                _mappings.drop(_config.mapping_cache_bytes())
                if not self.needed():
                    _holdings.pool.enable_fast_take(False)
                    self._thread = None
                    return


timer = _Expiry()


def after_fork_in_child():
    """Threads do not survive fork, and the parent's wake-ups are not ours:
    a new timer (not running) and a new pipe."""
    global timer, _quiet_pipe
    timer = _Expiry()
    for fd in _quiet_pipe:
        os.close(fd)
    _quiet_pipe = _make_quiet_pipe()
