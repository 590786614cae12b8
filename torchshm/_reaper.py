"""The session reaper: frees shared memory whose holders are gone.

Run by torchshm._session as `python -I -S _reaper.py SESSION`; it imports only
the standard library so that it starts in milliseconds, and reads segment
headers itself (the layout is in csrc/segment.h). Every process of the session
holds one connection to it. It holds the session's lock file for its whole
life: whoever shares this /dev/shm, in any network or PID namespace, can tell
that the session lives (Note [Segment lifetime] in csrc/segment.h).

Every second it looks at its session's segments and unlinks each one that no
live holder names: a process killed with SIGKILL frees what only it held
within about a second, while the rest of the session goes on. When the last
connection closes, and nobody connects during a short grace period, the
session's in-flight tickets die with it: it unlinks every segment that no
live process holds, waits for processes of other sessions to let go of the
rest (a handle another rank loaded), and exits. It also sweeps what dead
sessions of this user left: their segments nobody holds, and lock files of
dead processes. It only ever touches files of its own user.
"""

import errno
import fcntl
import mmap
import os
import resource
import selectors
import socket
import struct
import sys
import time

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "torchshm_"
LOCK_PREFIX = "torchshm-"
GRACE_SECONDS = 2.0  # a receiver may still be connecting
STARTUP_SECONDS = 30.0  # the starter died before it connected
SCAN_SECONDS = 1.0
ORPHAN_SCAN_SECONDS = 10.0
NEW_LOCK_SECONDS = 60.0  # a lock file still being created

# csrc/segment.h: the header's layout.
MAGIC = 0x336D687368637274
HEADER_BYTES = 8192
UNLINKED_OFFSET = 32
SLOTS = 336
SLOTS_OFFSET = 64
CHANNELS_OFFSET = SLOTS_OFFSET + 8 * SLOTS
VERDICTS_OFFSET = SLOTS_OFFSET + 16 * SLOTS
TICKET_BIT = 1 << 63


def address(session):
    return "\0torchshm-" + session


def process_lock_path(holder):
    return os.path.join(SHM_DIR, f"{LOCK_PREFIX}{holder:016x}.lock")


def session_lock_path(session):
    return os.path.join(SHM_DIR, f"{LOCK_PREFIX}session-{session}.lock")


def budget_path(session):
    return os.path.join(SHM_DIR, f"{LOCK_PREFIX}budget-{session}.shm")


def _lock_alive(path):
    """A lock file whose exclusive flock is held names a live holder."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to judge: never free memory on a guess
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def process_alive(holder):
    return _lock_alive(process_lock_path(holder))


def session_alive(session):
    return _lock_alive(session_lock_path(session))


def hold_session_lock(session):
    """Creates and locks the session's lock file (under a temporary name,
    renamed once locked); the descriptor must stay open. None if another
    reaper already holds it."""
    path = session_lock_path(session)
    tmp = os.path.join(SHM_DIR, f"{LOCK_PREFIX}new-{os.getpid()}-{session}.lock")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    if session_alive(session):
        os.unlink(tmp)
        os.close(fd)
        return None
    os.rename(tmp, path)
    return fd


def _own(st):
    return st.st_uid == os.geteuid()


def _segment_names(session=None):
    prefix = SEGMENT_PREFIX + (f"{session}_" if session else "")
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [n for n in names if n.startswith(prefix) and n.count("_") == 3]


def _creator_of(name):
    """The process id in torchshm_<session>_<16 hex digits>_<n>, or None for
    a name this version did not make (another torchshm version's: its own
    reaper judges it)."""
    parts = name.split("_")
    if len(parts) != 4 or len(parts[2]) != 16:
        return None
    try:
        return int(parts[2], 16)
    except ValueError:
        return None


class _Header:
    __slots__ = ("magic", "unlinked", "slots", "channels", "verdicts")


def _header_map(name):
    """A mapping of one of our segments' header, or None. Never cached: any
    mapping or descriptor of an unlinked segment would keep all its memory."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _own(st) or st.st_size < HEADER_BYTES:
            return None
        return mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _read_header(name):
    """The header of one of our segments, or None."""
    header = _header_map(name)
    if header is None:
        return None
    with header:
        h = _Header()
        h.magic = struct.unpack_from("<Q", header, 0)[0]
        h.unlinked = struct.unpack_from("<I", header, UNLINKED_OFFSET)[0]
        h.slots = struct.unpack_from(f"<{SLOTS}Q", header, SLOTS_OFFSET)
        h.channels = struct.unpack_from(f"<{SLOTS}Q", header, CHANNELS_OFFSET)
        h.verdicts = struct.unpack_from(f"<{SLOTS}Q", header, VERDICTS_OFFSET)
    return h


def _write_verdict(name, slot, word):
    """Records that ticket `word` in `slot` is dead (one aligned 8-byte
    store; the processes that share the segment clear the slot by CAS)."""
    header = _header_map(name)
    if header is not None:
        with header:
            at = VERDICTS_OFFSET + 8 * slot
            header[at : at + 8] = struct.pack("<Q", word)


def open_pipes():
    """Inodes of the pipes that processes of this user have open."""
    uid, found = os.geteuid(), set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if link.startswith("pipe:["):
                found.add(int(link[6:-1]))
    return found


def _mark_and_unlink(name):
    """Sets the header's `unlinked` flag (a process holding a cached mapping
    then knows it is dead), and removes the name."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not _own(st):
            return
        if st.st_size >= HEADER_BYTES:
            with mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED) as header:
                struct.pack_into("<I", header, UNLINKED_OFFSET, 1)
        # Smaller: its creator died before reserving the space.
        os.unlink(path)
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)


def _held(name, tickets_alive, alive=None):
    """Whether a live holder names the segment (True if unsure). `alive`
    memoizes process liveness within one scan."""
    alive = {} if alive is None else alive

    def holder_alive(holder):
        if holder not in alive:
            alive[holder] = process_alive(holder)
        return alive[holder]

    header = _read_header(name)
    creator = _creator_of(name)
    if header is None or header.magic != MAGIC:
        # Not yet initialized (its creator is still reserving space), another
        # user's, or another version's.
        if header is None and not os.path.exists(os.path.join(SHM_DIR, name)):
            return False
        return creator is None or holder_alive(creator)
    if header.unlinked:
        return False
    for word, verdict in zip(header.slots, header.verdicts):
        if word == 0:
            continue
        if word & TICKET_BIT:
            if tickets_alive and verdict != word:
                return True
        elif holder_alive(word):
            return True
    return False


class TicketJudge:
    """Finds tickets whose pipe is closed in every process of this user, and
    records the verdict once it stayed closed for a whole scan. Most tickets
    are claimed within milliseconds: only those already seen at the last
    scan are judged, so /proc is read only while some message waits."""

    def __init__(self):
        self.seen = set()  # (name, slot, word) of the last scan's tickets
        self.suspects = set()  # ... whose pipe was closed then

    def scan(self, session):
        tickets = {}
        for name in _segment_names(session):
            header = _read_header(name)
            if header is None or header.magic != MAGIC or header.unlinked:
                continue
            for slot, (word, channel, verdict) in enumerate(
                zip(header.slots, header.channels, header.verdicts)
            ):
                if word & TICKET_BIT and channel and verdict != word:
                    tickets[(name, slot, word)] = channel
        waiting = {key: c for key, c in tickets.items() if key in self.seen}
        self.seen = set(tickets)
        closed = set()
        if waiting:
            pipes = open_pipes()
            closed = {key for key, channel in waiting.items() if channel not in pipes}
        for name, slot, word in closed & self.suspects:
            _write_verdict(name, slot, word)
        self.suspects = closed


def release_dead(session, tickets_alive=True):
    """Unlinks the session's segments that no live holder names; returns how
    many are left."""
    names, alive, left = _segment_names(session), {}, 0
    for name in names:
        if _held(name, tickets_alive=tickets_alive, alive=alive):
            left += 1
        else:
            _mark_and_unlink(name)
    return left


def sweep_orphans(own_session):
    """Sweeps what dead sessions of this user left, and dead lock files."""
    sessions = {name.split("_")[1] for name in _segment_names()}
    for session in sessions - {own_session}:
        if not session_alive(session):
            for name in _segment_names(session):
                if not _held(name, tickets_alive=False):
                    _mark_and_unlink(name)
    _sweep_dead_locks()
    _sweep_dead_budgets(own_session)


def _sweep_dead_budgets(own_session):
    prefix = f"{LOCK_PREFIX}budget-"
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        session = name[len(prefix) : -len(".shm")]
        path = os.path.join(SHM_DIR, name)
        try:
            if session != own_session and _own(os.stat(path)):
                if not session_alive(session):
                    os.unlink(path)
        except OSError:
            pass


def _sweep_dead_locks():
    try:
        names = [
            n
            for n in os.listdir(SHM_DIR)
            if n.startswith(LOCK_PREFIX) and n.endswith(".lock")
        ]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            young = now - st.st_mtime < NEW_LOCK_SECONDS
            if not _own(st) or (name.startswith(f"{LOCK_PREFIX}new-") and young):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)  # dead: nobody held its lock
        except OSError:
            pass
        finally:
            os.close(fd)


def _peer_is_us(conn):
    """Only processes of this user may pin the reaper."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.geteuid()


def _raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(session, ready):
    _raise_fd_limit()
    session_lock = hold_session_lock(session)
    if session_lock is None:
        return  # another reaper serves this session (EOF tells the starter)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address(session))
    listener.listen(128)
    ready.write(b"1")
    ready.close()
    sweep_orphans(session)

    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    clients = 0
    judge = TicketJudge()
    idle_since = next_scan = next_orphan_scan = time.monotonic()
    limit = STARTUP_SECONDS
    while clients or time.monotonic() - idle_since < limit:
        for key, _ in selector.select(timeout=0.5):
            if key.fileobj is listener:
                try:
                    conn, _ = listener.accept()
                except OSError as exc:  # EMFILE and friends: try again later
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS):
                        time.sleep(0.1)
                    continue
                if not _peer_is_us(conn):
                    conn.close()
                    continue
                selector.register(conn, selectors.EVENT_READ)
                clients += 1
            else:
                try:
                    data = key.fileobj.recv(64)
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    clients -= 1
                    next_scan = time.monotonic()  # a process may have died
                    if not clients:
                        idle_since, limit = time.monotonic(), GRACE_SECONDS
        now = time.monotonic()
        if now >= next_scan:
            next_scan = now + SCAN_SECONDS
            judge.scan(session)
            release_dead(session)
        if now >= next_orphan_scan:
            next_orphan_scan = now + ORPHAN_SCAN_SECONDS
            sweep_orphans(session)
    listener.close()
    # The session is over and its tickets with it. Segments that processes
    # of other sessions still hold (a handle loaded by another rank) keep
    # their names until those let go or die: they stay loadable meanwhile.
    while release_dead(session, tickets_alive=False):
        time.sleep(SCAN_SECONDS)
    _sweep_dead_locks()
    for path in (budget_path(session), session_lock_path(session)):
        try:
            os.unlink(path)
        except OSError:
            pass
    os.close(session_lock)


def main():
    session = sys.argv[1]
    ready = os.fdopen(1, "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 2)
    serve(session, ready)
    # stdout was the ready pipe; point it somewhere harmless once closed.
    os.dup2(devnull, 1)


if __name__ == "__main__":
    main()
