"""The session keeper: holds an fd of every segment of its session, hands
them out, and closes each one once nothing holds it (Note [Segment lifetime]
in csrc/segment.h).

Run by torchshm._session as `python -I -S _keeper.py SESSION RUN_DIR LINGER`;
it imports only the standard library, so that it starts in milliseconds. It
listens on a Unix socket in the user's run directory under /dev/shm
(run_dir(): reachable from any network namespace that shares this /dev/shm,
and no other user can create a name in it), holds the session's lock file for
its whole life, and makes the session table (csrc/table.h): every process of
the session maps it.

What it does, and what that costs, so that it stays idle whatever is alive:
- A creator registers each new segment (its fd, one message, no reply); the
  keeper keeps the fd at fd_base + index, where any process of this user
  opens it through /proc, or hands it out over the socket.
- Once a second it reads the table's flag bytes (C speed) and looks only at
  flagged segments: one that someone found unheld is closed; the tickets of
  one with messages in flight are judged (a pipe closed everywhere for a
  whole scan, or a writer that died before its write returned).
- When a member's connection closes (a process died or exited), it looks at
  every segment once, shortly after; and, as a safety net for holders of
  other sessions, once a minute or less often (at most 1% of a core).
- When no member is connected, the session lingers while one may still join
  and read its messages: a live process of the session that has not joined
  (its lock file, or TORCHSHM_SESSION in its environment: a `subprocess`
  child that has not imported torchshm yet), or a message in flight on a
  pipe some process still holds open; at most LINGER seconds. Then the
  session's tickets die with it: it closes what no live process holds, waits
  for processes of other sessions to let go of the rest (a handle another
  rank loaded), and exits.
- It never waits on a client: replies are non-blocking (a client that does
  not read its replies is dropped), and an fd kept in reserve lets it answer
  "busy" to a connection it has no fd for. Every fd a request carries that
  it does not keep is closed.
It only ever touches files of its own user, in its run directory, and only
regular files and sockets: never through a link.

The layouts it reads are restated below from csrc/layout.h, which
tests/test_layout.py compares against the native module's _C.LAYOUT.
"""

import errno
import fcntl
import json
import mmap
import os
import re
import resource
import selectors
import socket
import stat
import struct
import sys
import time

SHM_DIR = "/dev/shm"
PREFIX = "torchshm-"
ENV_VAR = "TORCHSHM_SESSION"
RUN_DIR_NAMES = 16  # candidates for the run directory (run_dir)
GRACE_SECONDS = 2.0  # no member connected: one may still be joining
STARTUP_SECONDS = 30.0  # the starter died before it joined
SCAN_SECONDS = 1.0
DEATH_SWEEP_DELAY = 0.2  # coalesces the exits of a whole pool of workers
SLOW_SWEEP_SECONDS = 60.0  # holders of other sessions, missed flags
SWEEP_DUTY = 0.005  # the slow sweep takes at most this share of a core
ORPHAN_SCAN_SECONDS = 10.0
UNREGISTERED_SECONDS = 60.0  # an index claimed by a creator that died
NEW_LOCK_SECONDS = 60.0  # a process lock file still being created
MESSAGE_BYTES = 256
MAX_FDS = 2
DEFAULT_LINGER_SECONDS = 600.0
BUSY = b"B"  # the reply to a connection the keeper has no fd to serve

# csrc/layout.h (tests/test_layout.py checks every value).
SEGMENT_MAGIC = 0x346D687368637274
SLOTS = 16384
SLOT_BYTES = 32
SLOTS_OFFSET = 64
SLOT_WRITER = 16
SLOT_VERDICT = 24
UID_OFFSET = 24
CAPACITY_OFFSET = 8
CREATOR_OFFSET = 16
GENERATION_OFFSET = 32
UNLINKED_OFFSET = 40
SLOTS_USED_OFFSET = 44
PINNED_OFFSET = 48
HEADER_BYTES = 528384
TICKET_BIT = 1 << 63
WRITING_BIT = 1 << 62
TABLE_MAGIC = 0x316C626174687374
TABLE_CAPACITY_OFFSET = 8
TABLE_FD_BASE_OFFSET = 12
TABLE_BUDGET_OFFSET = 64
BUDGET_ENTRIES = 512
BUDGET_ENTRY_BYTES = 16
TABLE_UIDS_OFFSET = TABLE_BUDGET_OFFSET + BUDGET_ENTRIES * BUDGET_ENTRY_BYTES
FLAG_TICKETS = 1
FLAG_RELEASED = 2
F_ADD_SEALS, F_GET_SEALS = 1033, 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW = 1, 2, 4
MAX_TABLE_CAPACITY = 1 << 16


# ------------------------------------------------------------------ paths

# A session id is part of file names in /dev/shm: letters, digits, _ and -,
# never a path (secrets.token_hex makes them; TORCHSHM_SESSION may set one).
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def valid_session(session):
    return isinstance(session, str) and SESSION_ID.fullmatch(session) is not None


_run_dir = None


def run_dir():
    """The directory of this user's sockets and lock files: the first of
    /dev/shm/torchshm-<uid>, torchshm-<uid>.1, ... that is a directory of this
    user that only it can enter, made if none is.

    /dev/shm is world-writable: another user can create a name there before
    us, but never one inside our directory, so no name of a session can be
    taken (a planted socket or lock would split a session, or stop its keeper
    from starting). A planted candidate is passed over, and every process of
    this user passes over the same ones, so the members of a session always
    find one keeper. Raises OSError naming what is in the way when every
    candidate is taken, or why none can be made (no /dev/shm, no inode left):
    torchshm then stays off."""
    global _run_dir
    if _run_dir is None:
        _run_dir = _find_run_dir()
    return _run_dir


def run_dir_candidates():
    base = os.path.join(SHM_DIR, f"{PREFIX}{os.geteuid()}")
    return [base] + [f"{base}.{k}" for k in range(1, RUN_DIR_NAMES)]


def is_run_dir(path):
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and _own(st) and not st.st_mode & 0o077


def _find_run_dir():
    candidates = run_dir_candidates()
    for path in candidates:  # one made before, even if an earlier name is free now
        if is_run_dir(path):
            return path
    for path in candidates:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if is_run_dir(path):  # another process of ours made it meanwhile
                return path
            continue
        os.chmod(path, 0o700)  # whatever the umask; ours, in a sticky directory
        return path
    raise OSError(
        errno.EEXIST,
        f"every name torchshm may use for its directory in {SHM_DIR} is taken"
        f" by another user ({candidates[0]} to {candidates[-1]})",
    )


def socket_path(session):
    return os.path.join(run_dir(), f"{PREFIX}{session}.sock")


def session_lock_path(session):
    return os.path.join(run_dir(), f"{PREFIX}session-{session}.lock")


def process_lock_path(holder):
    return os.path.join(run_dir(), f"{PREFIX}{holder:016x}.lock")


def _own(st):
    return st.st_uid == os.geteuid()


def _open_own_file(path, flags=os.O_RDONLY):
    """An fd of `path` if it is a regular file of this user, else None: never
    through a link, never blocking on a FIFO someone planted."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and _own(st):
        return fd
    os.close(fd)
    return None


def _lock_held(path):
    """Whether someone holds the exclusive flock of a lock file of this user
    (a missing or foreign file: nobody; see csrc/identity.h)."""
    fd = _open_own_file(path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def process_alive(holder):
    return _lock_held(process_lock_path(holder))


def session_alive(session):
    return _lock_held(session_lock_path(session))


def lock_session(session):
    """Takes the session's lock for the caller's life: its fd, or None if a
    live keeper holds it or the name is not ours to use. The file is created
    without O_TRUNC and never through a link; after the lock, the name must
    still be the file we locked (a sweeper may have removed it meanwhile)."""
    path = session_lock_path(session)
    for _ in range(10):
        try:
            fd = os.open(
                path,
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                0o600,
            )
        except OSError:
            return None  # a link, or another user's file: not ours to use
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and _own(st)):
            os.close(fd)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # a live keeper
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == st.st_ino
        except OSError:
            same = False
        if same:
            return fd
        os.close(fd)
    return None


# ------------------------------------------------------------------ headers


class Header:
    """What the keeper reads of a segment's header."""

    __slots__ = ("uid", "capacity", "creator", "generation", "unlinked")
    __slots__ += ("slots_used", "pinned", "slots")


def read_header(fd, with_slots=True):
    """A segment's header (slots: [(index, word, channel, writer, verdict)]
    of non-empty slots), or None if `fd` does not hold one."""
    try:
        head = os.pread(fd, SLOTS_OFFSET, 0)
    except OSError:
        return None
    if len(head) < SLOTS_OFFSET or struct.unpack_from("<Q", head)[0] != SEGMENT_MAGIC:
        return None
    h = Header()
    h.capacity, h.creator, h.uid, h.generation = struct.unpack_from("<qQQQ", head, 8)
    h.unlinked, h.slots_used, h.pinned = struct.unpack_from("<III", head, 40)
    h.slots = []
    used = min(h.slots_used, SLOTS)
    if with_slots and used:
        try:
            raw = os.pread(fd, used * SLOT_BYTES, SLOTS_OFFSET)
        except OSError:
            return None
        for i, slot in enumerate(struct.iter_unpack("<4Q", raw)):
            if slot[0]:
                h.slots.append((i,) + slot)
    return h


def _write(fd, offset, fmt, value):
    try:
        os.pwrite(fd, struct.pack(fmt, value), offset)
    except OSError:
        pass


def _ticket_id(word):
    return word & ~WRITING_BIT


def _is_segment_fd(fd, uid):
    """Whether `fd` is a sealed memfd of this user holding segment `uid`."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:
        return False
    if not (stat.S_ISREG(st.st_mode) and _own(st)) or not seals & F_SEAL_SHRINK:
        return False
    header = read_header(fd, with_slots=False)
    return header is not None and header.uid == uid


# ------------------------------------------------------------------ the table


def table_capacity():
    """(fd_base, capacity): segment fds live at fd_base + index, below the
    hard fd limit (raised to it first); member connections stay below."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    base = 4096 if hard >= 8192 else hard // 2
    return base, max(0, min(MAX_TABLE_CAPACITY, hard - base - 64))


class Table:
    """The session table (csrc/layout.h), made here."""

    def __init__(self, fd_base, capacity):
        self.fd_base, self.capacity = fd_base, capacity
        self.flags_offset = TABLE_UIDS_OFFSET + 8 * capacity
        size = self.flags_offset + capacity
        self.fd = os.memfd_create(
            "torchshm:table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        )
        os.ftruncate(self.fd, size)
        fcntl.fcntl(self.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED)
        struct.pack_into("<II", self.map, TABLE_CAPACITY_OFFSET, capacity, fd_base)
        struct.pack_into("<Q", self.map, 0, TABLE_MAGIC)  # last
        self.uids = memoryview(self.map)[TABLE_UIDS_OFFSET : self.flags_offset].cast(
            "Q"
        )

    def flagged(self):
        """Indices whose flag byte is set (a C-speed search)."""
        flags = memoryview(self.map)[self.flags_offset :]
        return [(m.start(), m.group()[0]) for m in re.finditer(rb"[^\x00]", flags)]

    def clear_flag(self, index):
        self.map[self.flags_offset + index] = 0

    def set_flag(self, index, bits):
        at = self.flags_offset + index
        self.map[at] = self.map[at] | bits

    def free(self, index, uid):
        if 0 <= index < self.capacity and self.uids[index] == uid:
            self.uids[index] = 0
            self.map[self.flags_offset + index] = 0


# ------------------------------------------------------------------ the keeper


class Entry:
    __slots__ = ("uid", "index", "fd", "creator")

    def __init__(self, uid, index, fd, creator):
        self.uid, self.index, self.fd, self.creator = uid, index, fd, creator


def _processes_of_this_user():
    """(pid, whether its /proc entry can be read) of every process of this
    user, or None without /proc. A process that made itself non-dumpable has a
    /proc entry of root's: a keeper that is not root cannot see its fds or
    environment (but reads its uid from its status)."""
    uid = os.geteuid()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    found = []
    for pid in pids:
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        if owner == uid:
            found.append((pid, True))
        elif owner == 0 and _status_uid(pid) == uid:
            found.append((pid, False))
    return found


def _status_uid(pid):
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[2])  # the effective uid
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_pipes():
    """Inodes of the pipes that processes of this user have open, or None if
    that cannot be known (no /proc, or a process of this user whose fds
    cannot be seen): then no ticket is judged by its pipe."""
    processes, found = _processes_of_this_user(), set()
    if processes is None or not all(readable for _, readable in processes):
        return None
    for pid, _ in processes:
        fd_dir = f"/proc/{pid}/fd"
        try:
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


def session_in_environment(session):
    """Whether a live process of this user other than this one started with
    TORCHSHM_SESSION=session (a `subprocess` child that may still import
    torchshm and join). True if that cannot be known for some process."""
    processes = _processes_of_this_user()
    if processes is None:
        return False  # no /proc: only lock files and members tell
    wanted, me = f"{ENV_VAR}={session}".encode(), os.getpid()
    for pid, readable in processes:
        if pid == me:
            continue
        if not readable:
            return True
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    return True
        except OSError:
            continue
    return False


class Keeper:
    def __init__(self, session, listener, linger=DEFAULT_LINGER_SECONDS):
        self.session = session
        self.listener = listener
        self.linger = linger
        # Kept for accept() at the fd limit (see accept).
        self.reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.table = Table(*table_capacity())
        self.by_uid = {}  # uid -> Entry
        self.by_index = {}  # index -> uid
        self.members = set()  # connections that joined the session
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        # Tickets judged at the last scan: (uid, slot, word) -> (channel,
        # writer); and those whose pipe was closed or writer dead then.
        self.seen = {}
        self.suspects = set()
        self.unregistered = {}  # index -> (uid, first seen) claimed, unknown
        now = time.monotonic()
        self.next_scan = now + SCAN_SECONDS
        self.death_sweep_at = None
        self.slow_sweep_at = now + SLOW_SWEEP_SECONDS
        self.next_orphan_scan = now
        self.idle_since = now
        self.idle_limit = STARTUP_SECONDS
        self.starter = os.getppid()
        self.alone_since = now  # no member connected since
        self.draining = False

    # ---- segments

    def register(self, index, uid, fd):
        if uid in self.by_uid or not _is_segment_fd(fd, uid):
            os.close(fd)
            return
        target = self.table.fd_base + index
        if 0 <= index < self.table.capacity and not _fd_in_use(target):
            os.dup2(fd, target, inheritable=False)
            os.close(fd)
            fd = target
        header = read_header(fd, with_slots=False)
        self.by_uid[uid] = Entry(uid, index, fd, header.creator if header else 0)
        self.by_index[index] = uid
        self.unregistered.pop(index, None)

    def close(self, entry):
        """Stops handing the segment out: marks it unlinked (a process holding
        a cached mapping then knows) and closes the keeper's fd."""
        _write(entry.fd, UNLINKED_OFFSET, "<I", 1)
        os.close(entry.fd)
        del self.by_uid[entry.uid]
        if self.by_index.get(entry.index) == entry.uid:
            del self.by_index[entry.index]
        self.table.free(entry.index, entry.uid)
        for key in [k for k in self.seen if k[0] == entry.uid]:
            del self.seen[key]

    def held(self, header, tickets_alive, alive):
        """Whether a live holder names the segment. `alive` memoizes process
        liveness within one pass."""
        if header.unlinked:
            return False
        if header.pinned and tickets_alive:
            return True  # kept until the session ends (see the Note)
        for _index, word, _channel, _writer, verdict in header.slots:
            if word & TICKET_BIT:
                if tickets_alive and verdict != _ticket_id(word):
                    return True
            else:
                if word not in alive:
                    alive[word] = process_alive(word)
                if alive[word]:
                    return True
        return False

    def sweep(self, tickets_alive=True):
        """Looks at every segment; closes those no live holder names."""
        alive = {}
        for entry in list(self.by_uid.values()):
            header = read_header(entry.fd)
            if header is None or not self.held(header, tickets_alive, alive):
                self.close_if_unheld(entry, tickets_alive, alive)
        return len(self.by_uid)

    def close_if_unheld(self, entry, tickets_alive, alive):
        """Closes a segment found unheld, after reading its header once more.
        One read can be torn: a holder that sends it on puts the message's
        ticket in a lower slot, then lets go of its own slot, and a read
        that copies the lower slot before the ticket and the higher one after
        the release sees neither. The ticket stays, so a second read sees it
        (the message in flight), unless no holder was left."""
        header = read_header(entry.fd)
        if header is not None and self.held(header, tickets_alive, alive):
            return
        self.close(entry)

    def forget_unregistered(self, now):
        """Frees indices claimed by creators that died before registering."""
        for index in range(self.table.capacity):
            uid = self.table.uids[index]
            if not uid or index in self.by_index:
                self.unregistered.pop(index, None)
                continue
            first = self.unregistered.setdefault(index, (uid, now))
            if first[0] != uid:
                self.unregistered[index] = (uid, now)
            elif now - first[1] >= UNREGISTERED_SECONDS:
                self.table.free(index, uid)
                del self.unregistered[index]

    def scan_flags(self):
        """Looks at the segments the table flags: closes the unheld, judges
        the tickets of messages in flight."""
        tickets, headers = {}, {}
        for index, bits in self.table.flagged():
            self.table.clear_flag(index)  # before looking (csrc/table.h)
            uid = self.by_index.get(index)
            if uid is None:
                # Claimed, but its registration not read yet: it may wait on
                # a connection not even accepted. Look again next scan, until
                # it comes or forget_unregistered frees the index.
                if self.table.uids[index]:
                    self.table.set_flag(index, bits)
                continue
            entry = self.by_uid[uid]
            header = read_header(entry.fd)
            if header is None:
                continue
            headers[uid] = (entry, header)
            # A ticket being written is judged by its writer, whose pipe may
            # not be named yet (it is, just before the write: csrc/message.h);
            # a written one by its pipe, if it has one.
            mine = {
                (uid, i, word): (channel, writer)
                for i, word, channel, writer, verdict in header.slots
                if word & TICKET_BIT
                and (channel or word & WRITING_BIT)
                and verdict != _ticket_id(word)
            }
            if mine:
                self.table.set_flag(index, FLAG_TICKETS)  # look again
                tickets.update(mine)
        self.judge(tickets, headers)
        alive = {}
        for entry, header in headers.values():
            if entry.uid in self.by_uid and not self.held(header, True, alive):
                self.close_if_unheld(entry, True, alive)

    def judge(self, tickets, headers):
        """Writes a verdict on each ticket seen at two scans in a row whose
        pipe was closed in every process of this user both times, or whose
        writer died before its write returned, both times (csrc/segment.h)."""
        waiting = {k: v for k, v in tickets.items() if self.seen.get(k) == v}
        self.seen = tickets
        dead = set()
        if waiting:
            pipes = open_pipes()
            for key, (channel, writer) in waiting.items():
                writing = key[2] & WRITING_BIT
                if (channel and pipes is not None and channel not in pipes) or (
                    writing and not process_alive(writer)
                ):
                    dead.add(key)
        for uid, slot, word in dead & self.suspects:
            entry, header = headers[uid]
            _write(
                entry.fd,
                SLOTS_OFFSET + slot * SLOT_BYTES + SLOT_VERDICT,
                "<Q",
                _ticket_id(word),
            )
            # The header read before the verdict must see it too.
            header.slots = [
                s[:4] + (_ticket_id(word),) if s[0] == slot and s[1] == word else s
                for s in header.slots
            ]
        self.suspects = dead

    # ---- requests

    def accept(self):
        try:
            conn, _ = self.listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self.refuse()
            return
        if not _peer_is_us(conn):
            conn.close()
            return
        conn.setblocking(False)  # never wait on a client (reply)
        self.selector.register(conn, selectors.EVENT_READ)

    def refuse(self):
        """At the fd limit: the reserved fd makes room to accept the waiting
        connection and answer "busy", so that it does not wait for ever (its
        process then goes on without torchshm)."""
        os.close(self.reserve)
        try:
            conn, _ = self.listener.accept()
            try:
                conn.setblocking(False)
                conn.send(BUSY)
            except OSError:
                pass
            conn.close()
        except OSError:
            pass
        finally:
            self.reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def serve(self, conn):
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, MESSAGE_BYTES, MAX_FDS)
        except BlockingIOError:
            return  # woken for nothing
        except OSError:
            data, fds = b"", []
        kept = None
        try:
            if not data:
                self.drop(conn)
            else:
                kept = self.request(conn, data.decode("ascii").split(), fds)
        except Exception:  # noqa: BLE001 - a bad request must not end the session
            pass
        finally:
            for fd in fds:
                if fd != kept:
                    _close(fd)

    def request(self, conn, words, fds):
        """Serves one request; returns the fd it carried that is kept (the
        caller closes the others)."""
        kind = words[0]
        if kind in ("J", "j"):  # join (J: send me the table)
            self.members.add(conn)
            if kind == "J":
                self.reply(conn, b"T", [self.table.fd])
        elif kind == "R":  # register: index, uid, and the segment's fd
            if len(fds) == 1:
                self.register(int(words[1]), int(words[2], 16), fds[0])
                return fds[0]
        elif kind == "F":  # fetch: index, uid
            entry = self.by_uid.get(int(words[2], 16))
            if entry is None:
                self.drain()  # its registration may be queued on another connection
                entry = self.by_uid.get(int(words[2], 16))
            if entry is None:
                self.reply(conn, b"f %d" % errno.ENOENT)
            else:
                self.reply(conn, b"f 0", [entry.fd, self.table.fd])
        elif kind == "C":  # close what was released, now (torchshm.trim)
            self.scan_flags()
            self.reply(conn, b"c")
        elif kind == "S":  # status, as JSON in a memfd
            report = self.status()
            fd = os.memfd_create("torchshm:status", os.MFD_CLOEXEC)
            try:
                os.write(fd, json.dumps(report).encode())
                self.reply(conn, b"s", [fd])
            finally:
                os.close(fd)
        return None

    def reply(self, conn, data, fds=()):
        """Sends without waiting: a client whose replies pile up unread (or
        that is gone) is dropped."""
        try:
            socket.send_fds(conn, [data], list(fds))
        except OSError:
            self.drop(conn)

    def drain(self):
        """Serves every connection with a request waiting, without blocking
        (not recursively: a fetch served here does not drain again)."""
        if self.draining:
            return
        self.draining = True
        try:
            self.serve_ready(0)
        finally:
            self.draining = False

    def serve_ready(self, timeout):
        for key, _ in self.selector.select(timeout=timeout):
            if key.fileobj is self.listener:
                self.accept()
            else:
                self.serve(key.fileobj)

    def drop(self, conn):
        try:
            self.selector.unregister(conn)
        except KeyError:
            return  # dropped already
        conn.close()
        if conn in self.members:
            self.members.discard(conn)
            # A member exited or died: look at everything, once, shortly.
            if self.death_sweep_at is None:
                self.death_sweep_at = time.monotonic() + DEATH_SWEEP_DELAY
            if not self.members:
                now = time.monotonic()
                self.idle_since, self.idle_limit = now, GRACE_SECONDS
                self.alone_since = now

    def status(self):
        segments = []
        for entry in self.by_uid.values():
            header = read_header(entry.fd)
            if header is None:
                continue
            try:
                used = os.fstat(entry.fd).st_blocks * 512
            except OSError:
                used = 0
            segments.append(
                {
                    "uid": f"{entry.uid:016x}",
                    "index": entry.index,
                    "capacity": header.capacity,
                    "bytes": used,
                    "creator": f"{header.creator:016x}",
                    "generation": header.generation,
                    "pinned": bool(header.pinned),
                    "unlinked": bool(header.unlinked),
                    "holders": [
                        f"{w:016x}"
                        for _, w, _, _, _ in header.slots
                        if not w & TICKET_BIT
                    ],
                    "tickets": sum(1 for s in header.slots if s[1] & TICKET_BIT),
                }
            )
        return {
            "session": self.session,
            "pid": os.getpid(),
            "members": len(self.members),
            "table_capacity": self.table.capacity,
            "segments": segments,
        }

    # ---- the loop

    def session_lives(self):
        """Whether the session has a member, or a live process whose lock file
        names it (a member that has not joined this keeper yet)."""
        if self.members:
            return True
        me = f" {self.session}"
        for name in _lock_files():
            if name.startswith(f"{PREFIX}session-"):
                continue
            path = os.path.join(run_dir(), name)
            fd = _open_own_file(path)
            if fd is None:
                continue
            try:
                text = os.pread(fd, 128, 0).decode("ascii", "replace").strip()
                if text.endswith(me):
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except OSError:
                        return True
            finally:
                os.close(fd)
        return False

    def may_still_be_read(self, now):
        """Whether, with no member left, the session's messages may still be
        read, for at most `linger` seconds: a process of the session that has
        not joined yet started with its id in its environment, or a message in
        flight is on a pipe some process still holds open."""
        if now - self.alone_since >= self.linger:
            return False
        if session_in_environment(self.session):
            return True
        channels = set()
        for entry in self.by_uid.values():
            header = read_header(entry.fd)
            if header is None:
                continue
            channels.update(
                channel
                for _i, word, channel, _writer, verdict in header.slots
                if word & TICKET_BIT and channel and verdict != _ticket_id(word)
            )
        if not channels:
            return False
        pipes = open_pipes()
        return pipes is None or not channels.isdisjoint(pipes)

    def run(self):
        """Serves until the session is over and nothing of it is held."""
        while True:
            self.serve_session()
            if self.wind_down():
                return

    def serve_session(self):
        """Returns once no member is connected and no process of the session
        lives."""
        while True:
            now = time.monotonic()
            if self.idle_limit == STARTUP_SECONDS and os.getppid() != self.starter:
                self.idle_limit = GRACE_SECONDS  # the starter died before joining
            if not self.members and now - self.idle_since >= self.idle_limit:
                if not (self.session_lives() or self.may_still_be_read(now)):
                    return
                self.idle_since, self.idle_limit = now, SCAN_SECONDS
            self.serve_ready(SCAN_SECONDS)
            now = time.monotonic()
            if now >= self.next_scan:
                self.next_scan = now + SCAN_SECONDS
                self.scan_flags()
            if self.death_sweep_at is not None and now >= self.death_sweep_at:
                self.death_sweep_at = None
                self.sweep()
            if now >= self.slow_sweep_at:
                started = time.monotonic()
                self.sweep()
                self.forget_unregistered(now)
                took = time.monotonic() - started
                self.slow_sweep_at = now + max(SLOW_SWEEP_SECONDS, took / SWEEP_DUTY)
            if now >= self.next_orphan_scan:
                self.next_orphan_scan = now + ORPHAN_SCAN_SECONDS
                sweep_orphans(self.session)

    def wind_down(self):
        """The session is over and its tickets with it: closes what no live
        process holds. Segments that processes of other sessions still hold
        (a handle another rank loaded) stay loadable until those let go or
        die. False if a process joined meanwhile (the session goes on)."""
        while self.sweep(tickets_alive=False):
            deadline = time.monotonic() + SCAN_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                self.serve_ready(left)
                if self.members:
                    self.idle_since = time.monotonic()
                    return False
        return True


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


def _fd_in_use(fd):
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
        return True
    except OSError:
        return False


def _peer_is_us(conn):
    """Only processes of this user may join, register or fetch."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.geteuid()


def _lock_files():
    try:
        return [
            n
            for n in os.listdir(run_dir())
            if n.startswith(PREFIX) and n.endswith(".lock")
        ]
    except OSError:
        return []


def sweep_orphans(own_session):
    """Removes what dead processes and sessions of this user left in /dev/shm:
    lock files nobody holds, and the sockets of dead sessions (under their
    session lock, so that a keeper starting for one is never disturbed)."""
    now = time.time()
    for name in _lock_files():
        path = os.path.join(run_dir(), name)
        fd = _open_own_file(path)
        if fd is None:
            continue
        # A process lock is created under a temporary name, then locked, then
        # renamed (csrc/identity.cpp): a young one may not be locked yet.
        if name.startswith(f"{PREFIX}new-") and now - os.fstat(fd).st_mtime < (
            NEW_LOCK_SECONDS
        ):
            os.close(fd)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # alive
        try:
            if name.startswith(f"{PREFIX}session-"):
                session = name[len(f"{PREFIX}session-") : -len(".lock")]
                if session != own_session:
                    _remove_socket(socket_path(session))
            os.unlink(path)  # dead: nobody held its lock
        except OSError:
            pass
        finally:
            os.close(fd)


def _remove_socket(path):
    try:
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and _own(st):
            os.unlink(path)
    except OSError:
        pass


def _raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def listen(session):
    """The session's listening socket, under its lock; None if another keeper
    serves the session (or the names are not ours to use)."""
    lock = lock_session(session)
    if lock is None:
        return None, None
    path = socket_path(session)
    _remove_socket(path)  # a dead keeper's: we hold the session's lock
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)  # only we can enter run_dir(): no chmod needed
        listener.listen(128)
    except OSError:
        listener.close()
        os.close(lock)
        return None, None
    return listener, lock


def serve(session, ready, linger=DEFAULT_LINGER_SECONDS):
    _raise_fd_limit()
    listener, lock = listen(session)
    if listener is None:
        return  # another keeper serves this session (EOF tells the starter)
    keeper = Keeper(session, listener, linger)
    ready.write(b"1")
    ready.close()
    try:
        keeper.run()
    finally:
        _remove_socket(socket_path(session))
        try:
            os.unlink(session_lock_path(session))
        except OSError:
            pass
        os.close(lock)
        # What processes of the session killed since the last scan left (and
        # any other dead session's socket): no keeper may be left to do it.
        sweep_orphans(session)


def main():
    global _run_dir
    session, directory, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ready = os.fdopen(1, "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 2)
    if not is_run_dir(directory):
        return  # EOF tells the starter
    _run_dir = directory  # the starter's choice: the same rule, made once
    serve(session, ready, linger)
    # stdout was the ready pipe; point it somewhere harmless once closed.
    os.dup2(devnull, 1)


if __name__ == "__main__":
    main()
