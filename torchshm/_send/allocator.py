"""Arrays born in shared memory: NumPy allocates large arrays in pooled
segments, so sending them costs no copy at all (Note [Born shared] in
csrc/send/allocator.h for the mechanism).

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
from torchshm._lifetime import forks as _forks
from torchshm._lifetime import segments as _segments
from torchshm._native import _C


@contextlib.contextmanager
def allocating(min_bytes: Optional[int] = None) -> Iterator[None]:
    """Context manager: NumPy allocates large arrays in shared memory.

    Within the block, this thread's (or asyncio task's) NumPy allocations of
    at least `min_bytes` are born in shared memory: sending such an array
    passes a reference, no copy. NumPy keeps its memory handler in a context
    variable, so this is local to the thread or task (other threads, and new
    ones, keep NumPy's default); an array is always freed by the handler that
    allocated it, whatever is current by then.

    A born array is sent as it was, as any array is: what the sender (or a
    fork child, which gets its own copy-on-write pages) writes to it after a
    send reaches no receiver (Note [A plain send is as it was] in
    csrc/send/plan.h); `share` makes memory that every holder writes. When
    shared memory cannot take an allocation (a memory limit),
    NumPy's own memory is used instead, with one ``RuntimeWarning``, counted
    in ``stats()["allocations_fallback"]``.

    Parameters
    ----------
    min_bytes : int or None, optional
        Smallest allocation, in bytes, made in shared memory; at least 1.
        ``None`` (default): the sharing threshold (`get_threshold`, at
        least 1) at the time the block is entered.

    Returns
    -------
    contextlib.AbstractContextManager
        The ``with`` statement gets ``None``; the previous allocator is
        restored on exit.

    Raises
    ------
    ValueError
        On entry, if `min_bytes` is below 1 (or is text that is not an
        integer).
    TypeError
        On entry, if `min_bytes` is not a number.

    See Also
    --------
    set_allocator : the same from now on, e.g. in a worker's initializer.
    is_shared

    Examples
    --------
    >>> with torchshm.allocating():
    ...     a = np.ones(1_000_000)  # 8 MB, born in shared memory
    >>> torchshm.is_shared(a)
    True
    >>> torchshm.is_shared(np.ones(1_000_000))  # outside the block
    False
    >>> with torchshm.allocating(min_bytes=1 << 20):
    ...     small, large = np.ones(1_000), np.ones(1_000_000)
    >>> torchshm.is_shared(small), torchshm.is_shared(large)
    (False, True)
    """
    _forks.check_fork_hooks("torchshm.allocating()")
    previous = _C.swap_numpy_handler(_handler(min_bytes))
    try:
        yield
    finally:
        _C.swap_numpy_handler(previous)


def set_allocator(enabled: bool, min_bytes: Optional[int] = None) -> None:
    """Turn born-shared allocation on or off from now on, in this thread.

    `allocating` without the ``with`` block, for a worker's initializer: a
    DataLoader ``worker_init_fn``, a Pool ``initializer``, a torchdata worker
    hook (or ``torchshm.chain(fn, allocate=True)``, which calls this). Like
    `allocating` it is local to the current thread or asyncio task: a thread
    started later allocates with NumPy's default. Turning it on while it is
    already on without `min_bytes` keeps the current setting, so a map
    function may call this for every item.

    Parameters
    ----------
    enabled : bool
        ``True`` turns it on, ``False`` restores the allocator that was
        current before it was turned on.
    min_bytes : int or None, optional
        Smallest allocation, in bytes, made in shared memory; at least 1.
        ``None`` (default): the sharing threshold (`get_threshold`, at
        least 1), or, if it is on already, the current setting. Ignored when
        `enabled` is false.

    Returns
    -------
    None

    Raises
    ------
    ValueError
        If `min_bytes` is below 1 (or is text that is not an integer).
    TypeError
        If `min_bytes` is not a number.

    See Also
    --------
    allocating : the same for the length of a ``with`` block.
    torchshm.torchdata.with_allocator : on in whichever thread iterates a
        datapipe.

    Examples
    --------
    >>> torchshm.set_allocator(True)
    >>> torchshm.is_shared(np.ones(1_000_000))
    True
    >>> torchshm.set_allocator(False)
    >>> torchshm.is_shared(np.ones(1_000_000))
    False

    In the initializer of a Pool's workers, so that the arrays they return
    are sent without a copy:

    >>> import multiprocessing
    >>> ctx = multiprocessing.get_context("fork")
    >>> with ctx.Pool(2, initializer=torchshm.set_allocator, initargs=(True,)) as pool:
    ...     results = pool.map(np.ones, [1_000_000, 1_000_000])
    >>> [torchshm.is_shared(r) for r in results]
    [True, True]
    """
    current = _C.current_numpy_handler()
    fallback = _C.born_fallback(current)
    if enabled:
        _forks.check_fork_hooks("torchshm.set_allocator(True)")
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
AT_CAP_SECONDS = (
    _C.DECLINED_RETRY_SECONDS
)  # the slabs' wait too (csrc/lifetime/slabs.h)
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
    """The born handler's hook (Note [Born shared] in csrc/send/allocator.h):
    (segment tensor, reused) for a block of nbytes (a slab for small blocks:
    Note [Small blocks] in csrc/lifetime/slabs.h), or None to let NumPy allocate it.
    Never raises: an exception here would surface in whatever NumPy call
    allocated."""
    global _at_cap
    if _forks.forked_without_hooks():
        return None  # torchshm is off there (_lifetime/forks.py)
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
