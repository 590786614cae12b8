"""The allocation seam: where shared memory comes from and how receivers map it.

Every segment torchshm creates or maps goes through `allocate` and `attach`,
with one exception: the sender's plan takes idle pooled segments itself while
the pool is armed, and records them in _live as allocate does (Note [Segment
pool] in csrc/pool.h). A sender's segments come from its pool (_pool.py) and
are reused once idle; a receiver keeps the mappings of segments whose arrays
it dropped, so that a segment the sender reuses is not faulted in again. See
Note [Segment lifetime] in csrc/segment.h for the holder protocol.
"""

import collections
import errno
import itertools
import os
import threading
import time
import weakref
from multiprocessing import util

from torchshm import _config, _pool, _session, _stats
from torchshm._compat import load_native

_C = load_native()

_lock = threading.RLock()
_counter = itertools.count()
_pool_segments = _pool.Pool()
# name -> weak ref to this process's live view tensor: a segment arriving again
# reuses it, so arrays over it stay aliased (torch's shared_cache does the same).
_live = {}
# Mappings without live views, kept for reuse: name -> Segment, oldest first.
_idle_mappings = collections.OrderedDict()
_idle_bytes = 0
# The sender's plan takes pooled segments itself while the pool is armed
# (Note [Segment pool] in csrc/pool.h), and records their views in _live.
_C.configure_sender_pool(pool=_pool_segments.native, live=_live)


def allocate(nbytes):
    """An int8 tensor over at least `nbytes` of shared memory (use only the
    first nbytes). Raises SharedMemoryError if /dev/shm cannot hold it."""
    return allocate_block(nbytes)[0]


def allocate_block(nbytes):
    """(allocate(nbytes), whether the memory was used before: a fresh
    segment's bytes are zero, a reused one's are not)."""
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
        _live[name_of(owner)] = weakref.ref(owner)
        if pooled:
            _expiry.ensure()
    return owner, not fresh


def attach(name, ticket, generation):
    """The int8 tensor over segment `name`, claiming the message's ticket.

    A message loaded a second time finds its ticket claimed: it takes a slot
    of its own, valid only while the segment still holds the generation the
    message was written in (Note [Segment lifetime] in csrc/segment.h)."""
    _session.join()
    me = _C.process_id()
    with _lock:
        _expiry.resume()
        owner = _live_owner(name)
        if owner is not None:
            # This process holds the segment already: the ticket is spare.
            segment = _C.segment_of(owner)
            if ticket:
                segment.cancel_ticket(ticket)
            _check_generation(segment, generation)
            return owner
        segment = _pool_segments.get(name) or _take_idle_mapping(name)
        if segment is None:
            segment = _C.Segment.attach(name)
            _stats.add("segments_attached")
        else:
            _stats.add("mappings_reused")
        slot = segment.claim_ticket(ticket, me) if ticket else -1
        if slot < 0:
            slot = segment.take_slot(me)
            if slot < 0:
                raise _C.SharedMemoryError(
                    errno.EUSERS,
                    f"torchshm: every holder slot of segment {name} is taken",
                )
            try:
                _check_generation(segment, generation)
            except BaseException:
                segment.release_slot(slot, me)
                raise
        owner = segment.tensor(slot, me)
        _live[name] = weakref.ref(owner, _keeper(name, segment, slot))
        return owner


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


def _live_owner(name):
    ref = _live.get(name)
    return ref() if ref is not None else None


def name_of(tensor):
    """The segment behind a tensor, or None if it is not torchshm memory."""
    segment = _C.segment_of(tensor)
    return None if segment is None else segment.name


def trim() -> int:
    """Releases pooled segments and cached mappings that nothing uses now.

    Returns the bytes of /dev/shm the pool gave back."""
    with _lock:
        freed = _pool_segments.release_idle()
        _drop_idle_mappings(0)
        _prune_live()
    return freed


def disown_all():
    """Releases this process's slots now; its mappings stay valid.

    multiprocessing children end with os._exit, so no destructor would ever
    release them (a dead process's slots are freed by whoever meets them, but
    an orderly exit should not leave that work behind)."""
    with _lock:
        owners = [ref() for ref in _live.values()]
        for owner in owners:
            if owner is not None:
                _C.disown(owner)
        _pool_segments.release_all()


def _create(capacity):
    me = _C.process_id()
    name = f"{_session.segment_prefix()}{me:016x}_{next(_counter)}"
    segment = _C.Segment.create(name, capacity, me, _config.copy_threads())
    _stats.add("segments_created")
    return segment


def _keeper(name, segment, slot):
    """When a received segment's last view dies, keep its mapping for reuse,
    unless nobody else holds it: then the view's release (which runs right
    after this callback) unlinks it, and a cached mapping would only pin its
    pages."""

    def keep(_):
        global _idle_bytes
        with _lock:
            if _live.get(name) is not None and _live[name]() is None:
                del _live[name]
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


def _prune_live():
    for name in [n for n, r in _live.items() if r() is None]:
        del _live[name]


class _Expiry:
    """Gives idle memory back on a timer: pooled segments unused for
    pool_idle_seconds(), and cached mappings of segments that died. A sender
    that goes quiet so releases within the idle time (plus a quarter of it,
    at most a second) without sending again. The thread runs only while
    there is something to watch, and never across fork (Note [Fork]): a
    fork stops it, and the next send or receive starts it again (a process
    that forks and then never touches torchshm keeps its pool until exit,
    within the session's budget)."""

    def __init__(self):
        self._thread = None
        self._stop = threading.Event()

    def ensure(self):
        """Starts the thread if it is not running (call with _lock held)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="torchshm-expiry", daemon=True
            )
            self._thread.start()
        # The plan may take pooled segments without allocate's bookkeeping
        # (resume() above) only while this timer runs.
        _pool_segments.enable_fast_take(True)

    def halt(self):
        _pool_segments.enable_fast_take(False)
        thread = self._thread
        if thread is not None:
            self._stop.set()
            thread.join()
            self._thread = None

    def needed(self):
        return bool(len(_pool_segments) or _idle_mappings)

    def resume(self):
        """Restarts the timer after a fork stopped it (call with _lock held)."""
        if self._thread is None and self.needed():
            self.ensure()

    def _run(self):
        _C.name_this_thread(_C.EXPIRY_THREAD_NAME)  # Note [Threads at fork]
        while True:
            idle = _config.pool_idle_seconds()
            if self._stop.wait(max(0.05, min(1.0, idle / 4))):
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


def _before_fork():
    # No torchshm thread may be alive across fork (Python 3.12+ warns, and a
    # thread holding a lock would leave it held in the child): joined, and
    # gone from /proc/self/task (Note [Threads at fork] in csrc/parallel.h).
    _expiry.halt()
    _C.wait_threads_gone()
    _lock.acquire()
    try:
        live = [o for o in (ref() for ref in _live.values()) if o is not None]
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
    global _lock, _idle_bytes, _expiry
    _lock = threading.RLock()  # another thread may have held it at fork
    _expiry = _Expiry()  # threads do not survive fork
    _C.after_fork_in_child()
    adopted = {}
    if _for_child:
        me = _C.process_id()
        for owner, slot in _for_child:
            _C.adopt(owner, slot, me)
            adopted[_C.segment_of(owner).name] = weakref.ref(owner)
        _for_child.clear()
    # A view without a slot of this process's own protects nothing here: a
    # segment arriving again must be attached anew.
    _live.clear()
    _live.update(adopted)
    _pool_segments.forget()
    _idle_mappings.clear()
    _idle_bytes = 0


def _at_exit():
    # Below Queue's feeder-join finalizer (priority -5): pending messages are
    # pickled (and may take tickets) before this process lets go.
    util.Finalize(None, _exit, exitpriority=-100)


def _exit():
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
