"""The allocation seam: where shared memory comes from and how receivers map it.

Every segment torchshm creates or maps goes through `allocate` and `attach`.
A sender's segments come from its pool (_pool.py) and are reused once idle; a
receiver keeps the mappings of segments whose arrays it dropped, so that a
segment the sender reuses is not faulted in again. See Note [Segment
lifetime] in csrc/segment.h for the reference-count protocol.
"""

import collections
import itertools
import multiprocessing
import os
import signal
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


def allocate(nbytes):
    """An int8 tensor over at least `nbytes` of shared memory (use only the
    first nbytes). Raises RuntimeError if /dev/shm cannot hold it."""
    with _lock:
        segment = _pool_segments.take(nbytes)
        pooled = segment is not None
        if segment is None:
            segment = _create(_pool.size_class(nbytes))
            pooled = _pool_segments.admit(segment)
        else:
            _stats.add("segments_reused")
        # A pooled segment's reference is the pool's; otherwise the view's.
        owner = segment.tensor(owns_reference=not pooled)
        _live[segment.name] = weakref.ref(owner)
    return owner


def attach(name):
    """The int8 tensor over segment `name`, taking over one in-flight reference."""
    _session.join()
    with _lock:
        ref = _live.get(name)
        owner = ref() if ref is not None else None
        if owner is not None:
            # This process already holds the segment: the message's reference
            # is spare.
            _C.segment_of(owner).release()
            return owner
        segment = _pool_segments.get(name) or _take_idle_mapping(name)
        if segment is None:
            segment = _C.Segment.attach(name)
            _stats.add("segments_attached")
        else:
            _stats.add("mappings_reused")
        owner = segment.tensor(owns_reference=True)
        _live[name] = weakref.ref(owner, _keeper(name, segment))
        return owner


def name_of(tensor):
    """The segment behind a tensor, or None if it is not torchshm memory."""
    segment = _C.segment_of(tensor)
    return None if segment is None else segment.name


def acquire(tensor):
    """Takes an in-flight reference for a message; False if the segment died."""
    return _C.segment_of(tensor).try_acquire()


def trim():
    """Releases pooled segments and cached mappings that nothing uses now.

    Returns the bytes of /dev/shm the pool gave back."""
    with _lock:
        freed = _pool_segments.release_idle()
        _drop_idle_mappings(0)
        _prune_live()
    return freed


def disown_all():
    """Drops this process's references now; its mappings stay valid.

    multiprocessing children end with os._exit, so no destructor would ever
    release them and their segments would live until the session ends.
    """
    with _lock:
        owners = [ref() for ref in _live.values()]
        for owner in owners:
            if owner is not None:
                _C.disown(owner)
        _pool_segments.release_all()


def _create(capacity):
    name = f"{_session.segment_prefix()}{next(_counter)}"
    segment = _C.Segment.create(name, capacity)
    _stats.add("segments_created")
    return segment


def _keeper(name, segment):
    """When a received segment's last view dies, keep its mapping for reuse."""

    def keep(_):
        global _idle_bytes
        with _lock:
            if _live.get(name) is not None and _live[name]() is None:
                del _live[name]
            if segment.refcount > 0 and name not in _idle_mappings:
                _idle_mappings[name] = segment
                _idle_bytes += segment.capacity
                _drop_idle_mappings(_config.mapping_cache_bytes())

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
        for name in [n for n, s in _idle_mappings.items() if s.refcount == 0]:
            _idle_bytes -= _idle_mappings.pop(name).capacity
    while _idle_bytes > limit and _idle_mappings:
        _idle_bytes -= _idle_mappings.popitem(last=False)[1].capacity


def _prune_live():
    for name in [n for n, r in _live.items() if r() is None]:
        del _live[name]


# Note [Fork]: a child inherits every view but no reference. References for
# its live views are taken in the parent before fork (afterwards the parent's
# pool could reuse a segment before the child claims it); the child claims
# them and forgets the parent's pool and idle mappings.
_for_child = []


def _before_fork():
    _lock.acquire()
    for ref in list(_live.values()):
        owner = ref()
        if owner is not None and _C.segment_of(owner).try_acquire():
            _for_child.append(owner)


def _after_fork_in_parent():
    _for_child.clear()
    _lock.release()


def _after_fork_in_child():
    global _lock, _idle_bytes
    _lock = threading.RLock()  # another thread may have held it at fork
    for owner in _for_child:
        _C.claim_reference(owner)
    _for_child.clear()
    _pool_segments.forget()
    _idle_mappings.clear()
    _idle_bytes = 0


def _at_exit():
    # Below Queue's feeder-join finalizer (priority -5): pending messages are
    # pickled (and may take references) before ours are dropped.
    util.Finalize(None, disown_all, exitpriority=-100)
    if multiprocessing.parent_process() is not None:
        _release_on_sigterm()


def _release_on_sigterm():
    """Pool.terminate() (and `with Pool(...)`) ends workers with SIGTERM,
    which skips exit finalizers: release the references, then die as before.
    Only where SIGTERM still has its default action (the application may
    handle it), and only the main thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def release_and_die(signum, frame):
        disown_all()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, release_and_die)


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
