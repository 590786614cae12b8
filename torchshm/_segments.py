"""The allocation seam: where shared memory comes from and how receivers map it.

Every segment torchshm creates or maps goes through `allocate` and `attach`;
a pooled allocator replaces them without touching the reduction policy. See
Note [Segment lifetime] in csrc/segment.h for the reference-count protocol.
"""

import itertools
import os
import threading
import weakref
from multiprocessing import util

from torchshm import _session, _stats
from torchshm._compat import load_native

_C = load_native()

_lock = threading.Lock()
_counter = itertools.count()
# This process's mappings by segment name, so that a segment arriving again
# maps once and arrays over it stay aliased (torch's shared_cache does the same).
_mapped = {}


def allocate(nbytes):
    """A new segment of `nbytes` as an int8 tensor; raises RuntimeError if
    /dev/shm cannot hold it."""
    name = f"{_session.segment_prefix()}{next(_counter)}"
    owner = _C.create_segment(name, nbytes)
    _stats.add("segments_created")
    with _lock:
        _remember(name, owner)
    return owner


def attach(name):
    """The int8 tensor over segment `name`, taking over one in-flight reference."""
    _session.join()
    with _lock:
        ref = _mapped.get(name)
        owner = ref() if ref is not None else None
        if owner is not None:
            _C.release(owner)  # already mapped here: the message's reference is spare
            return owner
        owner = _C.attach_segment(name)
        _stats.add("segments_attached")
        _remember(name, owner)
        return owner


def name_of(tensor):
    """The segment behind a tensor, or None if it is not torchshm memory."""
    return _C.segment_name(tensor)


def acquire(tensor):
    """Takes an in-flight reference for a message; False if the segment died."""
    return _C.try_acquire(tensor)


def _remember(name, owner):
    if len(_mapped) > 64 and len(_mapped) & 63 == 0:
        for key in [k for k, r in _mapped.items() if r() is None]:
            del _mapped[key]
    _mapped[name] = weakref.ref(owner)


def disown_all():
    """Drops this process's references now; its mappings stay valid.

    multiprocessing children end with os._exit, so no destructor would ever
    release them and their segments would live until the session ends.
    """
    with _lock:
        owners = [ref() for ref in _mapped.values()]
    for owner in owners:
        if owner is not None:
            _C.disown(owner)


def _at_exit():
    # Below Queue's feeder-join finalizer (priority -5): pending messages are
    # pickled (and may take references) before ours are dropped.
    util.Finalize(None, disown_all, exitpriority=-100)


def _after_fork_in_child():
    # The lock may have been held by another thread at fork time.
    global _lock
    _lock = threading.Lock()


class _Token:
    """multiprocessing.util.register_after_fork needs a weak-referenceable object."""


_token = _Token()
os.register_at_fork(after_in_child=_after_fork_in_child)
# A child's bootstrap clears inherited finalizers, then runs after-fork hooks.
util.register_after_fork(_token, lambda _: _at_exit())
_at_exit()
