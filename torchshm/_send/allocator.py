"""Arrays born in shared memory: NumPy allocates large arrays in pooled
segments, so sending them costs no copy at all (Note [Born shared] in
csrc/allocator.h for the mechanism).

NumPy keeps its memory handler in a context variable, so turning this on is
local to a thread or an asyncio task (a new thread starts with NumPy's
default), and an array is always freed by the handler that allocated it,
whatever is current by then.
"""

import contextlib
import errno
import time
from typing import Iterator, Optional

from torchshm import _config, _fallback, _stats
from torchshm._lifetime import segments as _segments
from torchshm._native import _C


@contextlib.contextmanager
def allocating(min_bytes: Optional[int] = None) -> Iterator[None]:
    """Within the block, this thread's (or task's) NumPy allocations of at
    least `min_bytes` (default: the sharing threshold) are born in shared
    memory: sending such an array passes a reference, no copy.

    A born array is shared like a torch tensor after share_memory_(): what
    the sender writes to it after sending, receivers that still hold it see.
    When shared memory cannot take an allocation (a memory limit), NumPy's
    own memory is used (one warning, counted in
    stats()["allocations_fallback"])."""
    previous = _C.swap_numpy_handler(_handler(min_bytes))
    try:
        yield
    finally:
        _C.swap_numpy_handler(previous)


def set_allocator(enabled: bool, min_bytes: Optional[int] = None) -> None:
    """Turns born-shared allocation on or off for the current thread or task
    from now on, e.g. in a worker's initializer: a DataLoader worker_init_fn,
    a Pool initializer, a torchdata worker hook (see README). Turning it on
    again without `min_bytes` keeps the current setting (a map function may
    call this per item)."""
    current = _C.current_numpy_handler()
    fallback = _C.born_fallback(current)
    if enabled:
        if fallback is None or min_bytes is not None:
            _C.swap_numpy_handler(_handler(min_bytes))
    elif fallback is not None:
        _C.swap_numpy_handler(fallback)


def allocator_enabled() -> bool:
    """Whether NumPy allocates in shared memory in this thread or task."""
    return _C.born_fallback(_C.current_numpy_handler()) is not None


def _handler(min_bytes):
    if min_bytes is None:
        # Threshold 0 means "share every array", not "allocate empty ones".
        min_bytes = max(1, _config.get_threshold())
    min_bytes = int(min_bytes)
    if min_bytes < 1:
        raise ValueError(f"min_bytes must be at least 1, got {min_bytes}")
    return _C.make_born_handler(min_bytes, _C.current_numpy_handler())


# At a cap on the number of segments (this process's fds, the session
# table's indices: EMFILE) with no idle segment to give way
# (segments.allocate_block), every further allocation would walk the pool
# and the session table again only to fall back (tens of microseconds,
# growing with what is held). Until this process frees a born block or a
# segment fd, or AT_CAP_SECONDS pass (a cap another process's frees lift),
# allocations go straight to NumPy.
AT_CAP_SECONDS = _C.DECLINED_RETRY_SECONDS  # the slabs' wait too (csrc/slabs.h)
_at_cap = None  # (until, what was held): (monotonic seconds, _held())


def _held():
    return _C.born_blocks(), _C.open_creator_fds()


def _still_at_cap():
    global _at_cap
    if _at_cap is None:
        return False
    until, held = _at_cap
    now = _held()
    if time.monotonic() < until and all(n >= h for n, h in zip(now, held)):
        return True
    _at_cap = None
    return False


def source(nbytes):
    """The born handler's hook (Note [Born shared] in csrc/allocator.h):
    (segment tensor, reused) for a block of nbytes (a slab for small blocks:
    Note [Small blocks] in csrc/slabs.h), or None to let NumPy allocate it.
    Never raises: an exception here would surface in whatever NumPy call
    allocated."""
    global _at_cap
    if nbytes > _segments.MAX_SEGMENT_BYTES:
        return None  # no memory holds it: NumPy's own MemoryError says so
    if _still_at_cap():
        _stats.add("allocations_fallback")
        return None
    try:
        block = _segments.allocate_block(nbytes)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        if getattr(exc, "errno", None) == errno.EMFILE:  # a count, not a size
            _at_cap = (time.monotonic() + AT_CAP_SECONDS, _held())
        _stats.add("allocations_fallback")
        _fallback.fall_back(
            exc,
            f"allocating {nbytes} bytes in shared memory",
            "NumPy allocates in its own memory instead",
        )
        return None
    return block  # counted as allocations_shared by the handler
