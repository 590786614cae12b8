"""How a receiver maps the segment a message names, claiming its ticket, and
keeps the mapping for reuse once its arrays are gone (_mappings). See Note
[Segment lifetime] in csrc/lifetime/segment.h for the holder protocol, and for where a
receiver finds a segment's fd (_open).
"""

import errno
import functools
import os
import sys
import time

from torchshm import _config, _stats
from torchshm._lifetime import expiry as _expiry
from torchshm._lifetime import fds as _fds
from torchshm._lifetime import forks as _forks
from torchshm._lifetime import holdings as _holdings
from torchshm._keeper import paths as _paths
from torchshm._lifetime import mappings as _mappings
from torchshm._lifetime import pins as _pins
from torchshm._lifetime import session as _session
from torchshm._native import _C


def attach(locator, ticket, generation):
    """The int8 tensor over the segment `locator` names (Segment.locator),
    claiming the message's ticket.

    A message loaded a second time finds its ticket claimed: it takes a slot
    of its own, valid only while the segment still holds the generation the
    message was written in (Note [Segment lifetime] in csrc/lifetime/segment.h)."""
    _forks.check_fork_hooks("receiving an array through shared memory")
    name, where = parse_locator(locator)
    _pins.poll()  # Note [Pinned in place]
    _join_to_load()
    me = _C.process_id()
    with _holdings.lock:
        _expiry.timer.resume()
        owner = _holdings.live.get(name)
        if owner is not None:
            # This process holds the segment already: the ticket is spare.
            segment = _C.segment_of(owner)
            if ticket:
                segment.cancel_ticket(ticket)
            _check_generation(segment, generation)
            _ensure_private_mapping(segment, where)
            return _C.message_owner(owner, _config.copy_threads())
        segment = _holdings.pool.get(name) or _mappings.take(name) or _pins.mapped(name)
        if segment is None:
            segment = _open(*where)
            _stats.add("segments_attached")
        else:
            _stats.add("mappings_reused")
            _ensure_private_mapping(segment, where)
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
        _holdings.live.remember(name, owner, _on_last_view(name, segment, slot))
        return _C.message_owner(owner, _config.copy_threads())


def _join_to_load():
    """Joins this process's session before its first load, if it can. A
    keeper that cannot take it in (stopped, swamped, at its fd limit) does
    not stop a load that the segment's creator can serve: the creator keeps
    the fd of every segment a message in flight names, and _open finds it
    through /proc without the keeper; only if it cannot does _open wait for
    the keeper (_session.KEEPER_PATIENCE). Joining is tried again at the next load."""
    try:
        _session.join()
    except _C.SharedMemoryError:
        pass


def _ensure_private_mapping(segment, where):
    """Gives a snapshot this process maps already one more private mapping
    if it has none idle (its arrays of an earlier message live, or its
    sender reused the segment as a snapshot since): a receiver keeps no fd,
    so it opens the segment again for an instant (Note [Snapshots are
    mapped privately] in csrc/lifetime/segment.h). If that fails, the message still
    loads: its writable arrays are copied (arrays_copied_on_receive)."""
    if not segment.snapshot or segment.private_ready:
        return
    try:
        segment.adopt_private(_open(*where))
    except OSError:
        pass


# A pooled segment's locator comes back in every message that reuses it.
@functools.lru_cache(maxsize=1024)
def parse_locator(locator):
    """(name, (session, uid, index, creator pid, creator fd)) of a
    Segment.locator: torchshm:<session>:<uid hex>:<index>:<pid>:<fd>."""
    try:
        tag, session, uid, index, pid, fd = locator.split(":")
        if tag != "torchshm" or not _paths.valid_session(session):
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
    own = session == _session.joined()
    table = _session.joined_table() if own else _session.foreign_table(session)
    places = []
    keeper = _session.keeper_pid(session)
    if keeper and table is not None and 0 <= index < table.capacity:
        places.append(f"/proc/{keeper}/fd/{table.fd_base + index}")
    if creator_pid > 0 and creator_fd >= 0:
        places.append(f"/proc/{creator_pid}/fd/{creator_fd}")
    for path in places:
        fd = _open_segment_fd(path)
        if fd is None:
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
        # The keeper is the last place: a load that fails loses its message,
        # so a keeper that does not answer in time (a new one, taking its
        # members' segments on a loaded machine) is asked again.
        deadline = time.monotonic() + _session.KEEPER_PATIENCE
        if _session.joined() is None:  # not a member yet (_join_to_load)
            _session.join(patience=_session.KEEPER_PATIENCE)
        patience = max(0.0, deadline - time.monotonic())
        fd = _session.fetch(session, uid, index, patience=patience)
        try:
            segment = _C.Segment.attach(fd, session, uid)
        finally:
            os.close(fd)
        own = session == _session.joined()  # fetch() joins its own session
        table = _session.joined_table() if own else _session.foreign_table(session)
    segment.rebind(table, index)  # so that its flags reach its keeper
    return segment


# What a segment's fd links to (csrc/lifetime/segment.cpp names its memfds).
SEGMENT_LINK = "/memfd:torchshm-segment:"


def _open_segment_fd(path):
    """An fd of the memfd at `path` (/proc/<pid>/fd/<n>), or None if that fd
    number holds something else now (a stale locator). Looks before it opens
    (an O_PATH fd, and the name of what it points to), then reopens that very
    file: opening, then closing, another file would drop every POSIX lock
    this process holds on it, and a terminal could become its controlling
    one."""
    try:
        probe = _open_at_limit(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EMFILE:
            raise  # at the hard limit: say so, not "gone"
        return None  # no such process or fd (or not ours)
    try:
        here = f"/proc/self/fd/{probe}"
        if not os.readlink(here).startswith(SEGMENT_LINK):
            return None
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        return _open_at_limit(here, flags)
    except OSError as exc:
        if exc.errno == errno.EMFILE:
            raise
        return None
    finally:
        os.close(probe)


def _open_at_limit(path, flags):
    """os.open, raising the soft fd limit once if it is reached: a receiver
    at its limit must still load what it was sent (an fd for an instant)."""
    try:
        return os.open(path, flags)
    except OSError as exc:
        if exc.errno != errno.EMFILE or not _fds.raise_soft_limit():
            raise
    return os.open(path, flags)


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


def _on_last_view(name, segment, slot):
    """When a received segment's last view dies, keep its mapping for reuse,
    unless nobody else holds it: then the view's release (which runs right
    after this callback) unlinks it, and a cached mapping would only pin its
    pages."""

    def keep_under_lock():
        if _holdings.exiting or sys.is_finalizing():
            return
        _holdings.live.forget_if_dead(name)
        if (
            not segment.unlinked
            and _mappings.get(name) is None
            and segment.has_live_holder(slot)
        ):
            _mappings.keep(name, segment, _config.mapping_cache_bytes())
            _expiry.timer.ensure()

    def keep(_):
        # Before the lock: at interpreter exit a daemon thread may have died
        # holding it (_lifecycle's exit), and keeping a mapping then is
        # pointless.
        if _holdings.exiting or sys.is_finalizing():
            return
        # Never waits for the lock: this runs in whatever thread let go of
        # the last view, which may be one the lock's holder awaits. A busy
        # lock's holder keeps the mapping at its release instead (Note
        # [Work for the lock's holder] in holdings.py); by then the view's
        # slot is released, which the checks above allow for.
        _holdings.lock.defer(keep_under_lock)

    return keep
