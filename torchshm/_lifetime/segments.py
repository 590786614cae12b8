"""The allocation path: where this process's shared memory comes from.

Every segment torchshm creates goes through `allocate`, with one exception:
the sender's plan takes idle pooled segments itself while the pool is armed,
and records them in the live table as allocate does (Note [Segment pool] in
csrc/lifetime/pool.h). A sender's segments come from its pool (pool.py) and are
reused once idle. Receivers map segments through attach.py; what the
process holds is in holdings.py, the timer that gives idle memory back in
expiry.py, fork and exit in lifecycle.py.
"""

import errno

from torchshm import _config, _memory, _stats
from torchshm._lifetime import expiry as _expiry
from torchshm._lifetime import fds as _fds
from torchshm._lifetime import holdings as _holdings
from torchshm._lifetime import mappings as _mappings
from torchshm._lifetime import pins as _pins
from torchshm._lifetime import session as _session
from torchshm._native import _C

# A segment is never larger than this (a size class of anything larger
# would overflow; no machine has the memory anyway).
MAX_SEGMENT_BYTES = 1 << 56
# A creator keeps its own fd of each segment it holds, and of each that a
# message in flight names (Note [Segment lifetime] in csrc/lifetime/segment.h): up to
# this share of its hard fd limit, raising its soft limit as they need. Past
# it, no new segment is made (the sender pickles by value) rather than one
# whose messages a keeper's death could lose.
CREATOR_FD_SHARE = 0.25


def allocate(nbytes, populate=True):
    """An int8 tensor over at least `nbytes` of shared memory (use only the
    first nbytes). Raises SharedMemoryError if memory cannot hold it (the
    cgroup's or the machine's: segments are memfds, not /dev/shm files).
    Without `populate`, a fresh segment's pages are made by the sender's
    writes into it (csrc/lifetime/segment.h, Segment::fill), not up front."""
    return allocate_block(nbytes, populate)[0]


def allocate_block(nbytes, populate=True):
    """(allocate(nbytes, populate), whether the memory was used before: a
    fresh segment's bytes are zero, a reused one's are not).

    A pool that gives way: a new segment that meets a cap (the memory left,
    this process's fds, the session table's indices) first has the pool
    release its idle segments, the keeper close them, and tries again; only
    then does the caller fall back. Idle segments of other sizes would
    otherwise keep every new array out of shared memory until trim() or the
    idle timer."""
    if not 0 <= nbytes <= MAX_SEGMENT_BYTES:
        raise _C.SharedMemoryError(
            errno.ENOMEM, f"torchshm: no segment can hold {nbytes} bytes"
        )
    try:
        return _allocate_block(nbytes, populate)
    except _C.SharedMemoryError:
        if not _give_way():
            raise
    _stats.add("pool_gave_way")
    return _allocate_block(nbytes, populate)


def _give_way():
    """Releases every idle pooled segment and has the keeper close them (and
    free their table indices) before it returns; whether any was idle."""
    with _holdings.lock:
        freed = _C.release_empty_slab(0.0) + _holdings.pool.release_idle()
    if not freed:
        return False
    _C.prune_in_flight()
    _session.close_released()
    _memory.refresh()
    return True


def _allocate_block(nbytes, populate):
    pool = _holdings.pool
    with _holdings.lock:
        _expiry.timer.resume()
        owner = pool.take(nbytes)
        fresh = owner is None
        if fresh:
            segment = _create(pool.size_class(nbytes), populate)
            owner, pooled = pool.admit(segment)
        else:
            pooled = True
            _stats.add("segments_reused")
        _holdings.live.remember(name_of(owner), owner)
        if pooled or fresh:  # a fresh segment may be kept in flight
            _expiry.timer.ensure()
    return owner, not fresh


def name_of(tensor):
    """The segment behind a tensor, or None if it is not torchshm memory."""
    segment = _C.segment_of(tensor)
    return None if segment is None else segment.name


def trim() -> int:
    """Hand idle pooled shared memory back now.

    Releases the pooled segments and cached mappings of this process that
    nothing uses now, and has the session's keeper close them before it
    returns, instead of waiting for the idle timer
    (``TORCHSHM_POOL_IDLE_SECONDS``, 30 s by default). Memory that arrays,
    tensors or messages in flight still use is kept. Only this process's
    pool: other processes trim their own.

    Returns
    -------
    int
        The bytes of shared memory the pool gave back.

    Raises
    ------
    Nothing
        A keeper that does not answer closes the segments when it can.

    See Also
    --------
    stats

    Examples
    --------
    >>> a = torchshm.share(np.ones(1_000_000))
    >>> del a  # its 8 MB segment is idle in the pool now
    >>> torchshm.trim() > 0
    True
    """
    _pins.poll()  # slots whose copies are done
    with _holdings.lock:
        _C.release_empty_slab(0.0)  # back to the pool, released below
        freed = _holdings.pool.release_idle()
        _mappings.drop(0)
        _holdings.live.prune()
    _C.prune_in_flight()  # segments kept for messages that were read since
    _session.close_released()
    return freed


def disown_all():
    """Releases this process's slots now; its mappings stay valid.

    multiprocessing children end with os._exit, so no destructor would ever
    release them (a dead process's slots are freed by whoever meets them, but
    an orderly exit should not leave that work behind)."""
    with _holdings.lock:
        for owner in _holdings.live.owners():
            _C.disown(owner)
        _holdings.pool.release_all()


def _create(capacity, populate=True):
    _memory.check(capacity)
    _reserve_creator_fd()
    me = _C.process_id()
    segment = _C.Segment.create(
        _session.session_id(),
        _session.table(),
        capacity,
        me,
        _config.copy_threads(),
        populate,
    )
    _session.register_segment(segment)  # if the keeper does not take it: no segment
    _stats.add("segments_created")
    return segment


def _reserve_creator_fd():
    """Makes room for one more creator fd within CREATOR_FD_SHARE of the fd
    limit, raising the soft limit towards the hard one; raises
    SharedMemoryError(EMFILE) past the hard limit's share. Its fd takes a
    number from KEPT_FDS_FROM up: the first one raises the soft limit past
    that where the hard limit allows (Note [Kept fds above select's range]
    in csrc/lifetime/segment.h)."""
    soft, hard = _fds.limits()
    if soft <= _C.KEPT_FDS_FROM < hard:
        _fds.raise_soft_limit(2 * _C.KEPT_FDS_FROM)
        soft, hard = _fds.limits()
    if _C.open_creator_fds() + 1 <= CREATOR_FD_SHARE * soft:
        return
    _C.prune_in_flight()  # those whose messages were read since
    wanted = _C.open_creator_fds() + 1
    if wanted > CREATOR_FD_SHARE * hard:
        raise _C.SharedMemoryError(
            errno.EMFILE,
            f"torchshm: this process keeps {wanted - 1} segment fds, a quarter"
            f" of its hard fd limit ({hard}); raise `ulimit -Hn`",
        )
    if wanted > CREATOR_FD_SHARE * soft:
        _fds.raise_soft_limit(int(wanted / CREATOR_FD_SHARE) + 1)
