"""The allocation seam: where shared memory comes from and how receivers map it.

Every segment torchshm creates or maps goes through `allocate` and `attach`,
with one exception: the sender's plan takes idle pooled segments itself while
the pool is armed, and records them in _live as allocate does (Note [Segment
pool] in csrc/pool.h). A sender's segments come from its pool (_pool.py) and
are reused once idle; a receiver keeps the mappings of segments whose arrays
it dropped, so that a segment the sender reuses is not faulted in again. See
Note [Segment lifetime] in csrc/segment.h for the holder protocol, and for
where a receiver finds a segment's fd (_open).
"""

import collections
import errno
import functools
import os
import select
import sys
import threading
import time
from multiprocessing import util

from torchshm import _config, _keeper, _memory, _pool, _session, _stats
from torchshm._native import _C

# A segment is never larger than this (a size class of anything larger
# would overflow; no machine has the memory anyway).
MAX_SEGMENT_BYTES = 1 << 56
# A creator keeps its own fd of each segment (Note [Segment lifetime]) while
# it holds fewer than this share of its fd limit; beyond, the keeper's is the
# only one.
CREATOR_FD_SHARE = 0.25

_lock = threading.RLock()
_pool_segments = _pool.Pool()
_exiting = False  # set by the exit finalizer: no thread may start after it
# This process's live view of each segment, by name (Note [Live views] in
# csrc/live.h): the sender's plan records the pooled segments it takes there
# too, without entering Python.
_live = _C.live
# Mappings without live views, kept for reuse: name -> Segment, oldest first.
_idle_mappings = collections.OrderedDict()
_idle_bytes = 0


def sender_pool():
    """This process's pool of segments (_pool.Pool)."""
    return _pool_segments


def allocate(nbytes):
    """An int8 tensor over at least `nbytes` of shared memory (use only the
    first nbytes). Raises SharedMemoryError if /dev/shm cannot hold it."""
    return allocate_block(nbytes)[0]


def allocate_block(nbytes):
    """(allocate(nbytes), whether the memory was used before: a fresh
    segment's bytes are zero, a reused one's are not)."""
    if not 0 <= nbytes <= MAX_SEGMENT_BYTES:
        raise _C.SharedMemoryError(
            errno.ENOMEM, f"torchshm: no segment can hold {nbytes} bytes"
        )
    with _lock:
        _expiry.resume()
        owner = _pool_segments.take(nbytes)
        fresh = owner is None
        if fresh:
            segment = _create(_pool_segments.size_class(nbytes))
            owner, pooled = _pool_segments.admit(segment)
        else:
            pooled = True
            _stats.add("segments_reused")
        _live.remember(name_of(owner), owner)
        if pooled:
            _expiry.ensure()
    return owner, not fresh


def attach(locator, ticket, generation):
    """The int8 tensor over the segment `locator` names (Segment.locator),
    claiming the message's ticket.

    A message loaded a second time finds its ticket claimed: it takes a slot
    of its own, valid only while the segment still holds the generation the
    message was written in (Note [Segment lifetime] in csrc/segment.h)."""
    _session.join()
    name, where = parse_locator(locator)
    me = _C.process_id()
    with _lock:
        _expiry.resume()
        owner = _live.get(name)
        if owner is not None:
            # This process holds the segment already: the ticket is spare.
            segment = _C.segment_of(owner)
            if ticket:
                segment.cancel_ticket(ticket)
            _check_generation(segment, generation)
            return owner
        segment = _pool_segments.get(name) or _take_idle_mapping(name)
        if segment is None:
            segment = _open(*where)
            _stats.add("segments_attached")
        else:
            _stats.add("mappings_reused")
        slot = segment.claim_ticket(ticket, me) if ticket else -1
        if slot < 0:
            slot = segment.take_slot(me)
            if slot < 0:
                # Every slot taken: hold it by the mapping alone, which a
                # pinned segment keeps valid (Note [Segment lifetime]).
                segment.pin()
            try:
                _check_generation(segment, generation)
            except BaseException:
                segment.release_slot(slot, me)
                raise
        owner = segment.tensor(slot, me)
        _live.remember(name, owner, _on_last_view(name, segment, slot))
        return owner


# A pooled segment's locator comes back in every message that reuses it.
@functools.lru_cache(maxsize=1024)
def parse_locator(locator):
    """(name, (session, uid, index, creator pid, creator fd)) of a
    Segment.locator: torchshm:<session>:<uid hex>:<index>:<pid>:<fd>."""
    try:
        tag, session, uid, index, pid, fd = locator.split(":")
        if tag != "torchshm" or not _keeper.valid_session(session):
            raise ValueError(tag)
        where = (session, int(uid, 16), int(index), int(pid), int(fd))
    except ValueError:
        raise _C.SharedMemoryError(
            errno.EINVAL, f"torchshm: {locator!r} does not name a segment"
        ) from None
    return f"{tag}:{session}:{uid}", where


def _open(session, uid, index, creator_pid, creator_fd):
    """Maps segment `uid` of `session`, from the first place that has it: the
    keeper's fd (through /proc: no round trip), the creator's, or the
    keeper's socket (another PID namespace; a keeper that restarted)."""
    own = session == _session.session_id()
    table = _session.table() if own else _session.foreign_table(session)
    places = []
    keeper = _session.keeper_pid(session)
    if keeper and table is not None and 0 <= index < table.capacity:
        places.append(f"/proc/{keeper}/fd/{table.fd_base + index}")
    if creator_pid > 0 and creator_fd >= 0:
        places.append(f"/proc/{creator_pid}/fd/{creator_fd}")
    for path in places:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            segment = _C.Segment.attach(fd, session, uid)
        except _C.SharedMemoryError as exc:
            if exc.errno == errno.ENOENT:
                raise  # it is there, and closed: nowhere else has it either
            continue  # that fd number now holds something else
        finally:
            os.close(fd)
        break
    else:
        fd = _session.fetch(session, uid, index)
        try:
            segment = _C.Segment.attach(fd, session, uid)
        finally:
            os.close(fd)
        table = _session.table() if own else _session.foreign_table(session)
    segment.rebind(table, index)  # so that its flags reach its keeper
    return segment


def _check_generation(segment, generation):
    if segment.generation != generation:
        raise _C.SharedMemoryError(
            errno.ESTALE,
            f"torchshm: segment {segment.name} no longer holds this message"
            f" (written in generation {generation}, now {segment.generation}):"
            " it was loaded before and its sender has reused the memory since."
            " Load a message once, or keep its first load alive while loading"
            " it again",
        )


def name_of(tensor):
    """The segment behind a tensor, or None if it is not torchshm memory."""
    segment = _C.segment_of(tensor)
    return None if segment is None else segment.name


def trim() -> int:
    """Releases pooled segments and cached mappings that nothing uses now.

    Returns the bytes of shared memory the pool gave back."""
    with _lock:
        freed = _pool_segments.release_idle()
        _drop_idle_mappings(0)
        _live.prune()
    _session.close_released()
    return freed


def disown_all():
    """Releases this process's slots now; its mappings stay valid.

    multiprocessing children end with os._exit, so no destructor would ever
    release them (a dead process's slots are freed by whoever meets them, but
    an orderly exit should not leave that work behind)."""
    with _lock:
        for owner in _live.owners():
            _C.disown(owner)
        _pool_segments.release_all()


def _create(capacity):
    _memory.check(capacity)
    me = _C.process_id()
    segment = _C.Segment.create(
        _session.session_id(), _session.table(), capacity, me, _config.copy_threads()
    )
    _session.register(segment)
    if _C.open_creator_fds() > CREATOR_FD_SHARE * _fd_limit():
        segment.close_fd()
    _stats.add("segments_created")
    return segment


def _fd_limit():
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _on_last_view(name, segment, slot):
    """When a received segment's last view dies, keep its mapping for reuse,
    unless nobody else holds it: then the view's release (which runs right
    after this callback) unlinks it, and a cached mapping would only pin its
    pages."""

    def keep(_):
        global _idle_bytes
        # Before the lock: at interpreter exit a daemon thread may have died
        # holding it (see _exit), and keeping a mapping then is pointless.
        if _exiting or sys.is_finalizing():
            return
        with _lock:
            _live.forget_if_dead(name)
            if (
                not segment.unlinked
                and name not in _idle_mappings
                and segment.has_live_holder(slot)
            ):
                _idle_mappings[name] = segment
                _idle_bytes += segment.capacity
                _drop_idle_mappings(_config.mapping_cache_bytes())
                _expiry.ensure()

    return keep


def _take_idle_mapping(name):
    global _idle_bytes
    segment = _idle_mappings.pop(name, None)
    if segment is not None:
        _idle_bytes -= segment.capacity
    return segment


_next_dead_scan = 0.0


def _drop_idle_mappings(limit):
    """Unmaps idle mappings, oldest first, down to `limit` bytes. About once a
    second, mappings of segments that their senders freed go too (they pin
    memory nobody can name any more); the scan is O(cache), so not per call."""
    global _idle_bytes, _next_dead_scan
    now = time.monotonic()
    if limit == 0 or now >= _next_dead_scan:
        _next_dead_scan = now + 1.0
        for name in [n for n, s in _idle_mappings.items() if s.unlinked]:
            _idle_bytes -= _idle_mappings.pop(name).capacity
    while _idle_bytes > limit and _idle_mappings:
        _idle_bytes -= _idle_mappings.popitem(last=False)[1].capacity


# Note [Expiry timer]
# The timer gives idle memory back: pooled segments unused for
# pool_idle_seconds(), and cached mappings of segments that died. It wakes
# only when something can have changed:
# - at the moment the oldest pooled segment with no local view can expire
#   (oldest_quiet_use + idle); none earlier can;
# - while every pooled segment has a local view, never: the first one whose
#   last local view dies writes a byte to a pipe (wake_when_quiet in
#   csrc/segment.h), once per such sleep;
# - while a segment past its time is still held by another process, or
#   mappings are cached, every quarter of the idle time, at most
#   EXPIRY_PERIOD_MAX apart.
# A wake-up is cheap on bare metal, but on a paravirtualized VM every
# wake-up of a process holding gigabytes costs tens of milliseconds of CPU
# (measured here: 15-50 ms for a plain time.sleep(1) with 3 GB of numpy
# arrays held, 0.3 ms without): `python -m benchmarks.background` measures it.
EXPIRY_PERIOD_MAX = 10.0


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
    there is something to watch, and never across fork (Note [Fork]): a
    fork stops it, and the next send or receive starts it again (a process
    that forks and then never touches torchshm keeps its pool until exit,
    within the session's budget)."""

    def __init__(self):
        self._thread = None
        self._stop = threading.Event()

    def ensure(self):
        """Starts the thread if it is not running (call with _lock held).
        Never once this process is exiting: during interpreter finalization
        Thread.start() does not return (an array freed then, with a module's
        globals, would hang the exit)."""
        if _exiting or sys.is_finalizing():
            return
        if self._thread is None:
            self._stop.clear()
            thread = threading.Thread(
                target=self._run, name="torchshm-expiry", daemon=True
            )
            thread.start()
            # Published only once started: halt() runs without _lock (at
            # fork, in another thread) and cannot join an unstarted thread.
            self._thread = thread
        # The plan may take pooled segments without allocate's bookkeeping
        # (resume() above) only while this timer runs.
        _pool_segments.enable_fast_take(True)

    def halt(self):
        _pool_segments.enable_fast_take(False)
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
        return bool(len(_pool_segments) or _idle_mappings)

    def resume(self):
        """Restarts the timer after a fork stopped it (call with _lock held)."""
        if self._thread is None and self.needed():
            self.ensure()

    def _next_wait(self, idle):
        """Seconds until the next look, or None: until woken (see the Note).
        Armed before it looks, so that a segment going quiet meanwhile wakes
        it."""
        _C.wake_when_quiet(_quiet_pipe[1])
        with _lock:
            oldest = _pool_segments.native.oldest_quiet_use()
            mappings = bool(_idle_mappings)
        period = max(0.05, min(EXPIRY_PERIOD_MAX, idle / 4))
        wait = None if mappings is False else period
        if oldest != float("inf"):
            _C.wake_when_quiet(-1)
            due = oldest + idle - time.monotonic()
            until = due if due > 0 else period
            wait = until if wait is None else min(wait, until)
        return wait

    def _run(self):
        _C.name_this_thread(_C.EXPIRY_THREAD_NAME)  # Note [Threads at fork]
        r = _quiet_pipe[0]
        while True:
            idle = _config.pool_idle_seconds()
            select.select([r], [], [], self._next_wait(idle))
            _C.wake_when_quiet(-1)
            try:
                os.read(r, 4096)  # nonblocking: drains the wake-ups
            except BlockingIOError:
                pass
            if self._stop.is_set():
                return
            with _lock:
                _pool_segments.release_idle(older_than=idle)
                _drop_idle_mappings(_config.mapping_cache_bytes())
                if not self.needed():
                    _pool_segments.enable_fast_take(False)
                    self._thread = None
                    return


_expiry = _Expiry()


# Note [Fork]: a child inherits every view but none of the slots: those are
# the parent's, under the parent's id. Before fork the parent makes the
# child's id (and its lock, which the child inherits and keeps) and takes a
# slot for the child in every segment it has a live view of; afterwards the
# parent's pool could reuse a segment before the child claimed it. The child
# adopts those slots. A child that execs loses the lock (close-on-exec), so
# its slots name a dead process and are freed like any dead holder's.
_for_child = []


def _lock_with_timer_halted():
    """Takes _lock with the expiry thread joined. The thread takes _lock
    itself, so it is joined before the lock is taken; another thread may
    start it again in between (ensure() runs under _lock): then again.
    _lock is taken even if halt() raises: _after_fork_in_parent releases it."""
    while True:
        try:
            _expiry.halt()
        finally:
            _lock.acquire()
        if not _expiry.running():
            return
        _lock.release()


def _before_fork():
    # No torchshm thread may be alive across fork (Python 3.12+ warns, and a
    # thread holding a lock would leave it held in the child): joined, and
    # gone from /proc/self/task (Note [Threads at fork] in csrc/parallel.h).
    _lock_with_timer_halted()
    try:
        _C.wait_threads_gone()
        live = _live.owners()
        if not live:
            return
        child = _C.prepare_child()
        for owner in live:
            slot = _C.segment_of(owner).take_slot(child)
            if slot >= 0:
                _for_child.append((owner, slot))
    except Exception:  # noqa: BLE001 - fork must go on; the child just holds less
        pass


def _after_fork_in_parent():
    _for_child.clear()
    _C.after_fork_in_parent()
    # Not restarted here: Python 3.13 counts threads for its fork warning
    # after these hooks ran. The next send or receive restarts it.
    _lock.release()


def _after_fork_in_child():
    global _lock, _idle_bytes, _expiry, _quiet_pipe
    _lock = threading.RLock()  # another thread may have held it at fork
    _expiry = _Expiry()  # threads do not survive fork
    for fd in _quiet_pipe:  # the parent's: its wake-ups are not ours
        os.close(fd)
    _quiet_pipe = _make_quiet_pipe()
    _C.after_fork_in_child()
    _C.forget_written_tickets()  # the parent's messages, not ours
    _session.after_fork_in_child()
    # A view without a slot of this process's own protects nothing here: a
    # segment arriving again must be attached anew.
    _live.clear()
    if _for_child:
        me = _C.process_id()
        for owner, slot in _for_child:
            _C.adopt(owner, slot, me)
            _live.remember(_C.segment_of(owner).name, owner)
        _for_child.clear()
    _pool_segments.forget()
    _idle_mappings.clear()
    _idle_bytes = 0


def _at_exit():
    # Below Queue's feeder-join finalizer (priority -5): pending messages are
    # pickled (and may take tickets) before this process lets go.
    util.Finalize(None, _exit, exitpriority=-100)


def _exit():
    global _exiting
    _exiting = True
    # The timer is a daemon thread: left running into interpreter
    # finalization, it is stopped wherever it is, perhaps holding _lock, and
    # a weakref callback that takes _lock later (an array freed with a
    # module's globals) would wait for ever. So it ends here, joined;
    # ensure() starts no other once _exiting is set.
    _expiry.halt()
    disown_all()
    _C.remove_own_lock()
    _session.leave()


class _Token:
    """multiprocessing.util.register_after_fork needs a weak-referenceable object."""


_token = _Token()
os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
# A child's bootstrap clears inherited finalizers, then runs after-fork hooks.
util.register_after_fork(_token, lambda _: _at_exit())
_at_exit()
