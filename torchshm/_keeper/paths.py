"""Where the keeper and the library find each other: this user's run
directory under /dev/shm, the session's socket and lock files in it, the
rule for a session id (part of those names), and the sweep of what dead
sessions left there. Standard library only: the keeper imports it as a
script does (Note [The keeper's facts] in daemon.py)."""

import errno
import fcntl
import os
import re
import stat
import time

SHM_DIR = "/dev/shm"
PREFIX = "torchshm-"
ENV_VAR = "TORCHSHM_SESSION"
RUN_DIR_NAMES = 16  # candidates for the run directory (run_dir)
NEW_LOCK_SECONDS = 60.0  # a process lock file still being created

# A session id is part of file names in /dev/shm: letters, digits, _ and -,
# never a path (secrets.token_hex makes them; TORCHSHM_SESSION may set one).
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
SESSION_RULE = "1 to 64 letters, digits, _ or -"


def valid_session(session):
    return isinstance(session, str) and SESSION_ID.fullmatch(session) is not None


_run_dir = None


def use_run_dir(path):
    """Takes `path` as the run directory (the keeper: its starter chose it,
    by the same rule)."""
    global _run_dir
    _run_dir = path


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
    return stat.S_ISDIR(st.st_mode) and owned(st) and not st.st_mode & 0o077


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


def owned(st):
    return st.st_uid == os.geteuid()


# An open() that failed with one of these says nothing about the file: this
# process is short of fds or memory (csrc/lifetime/identity.h, holder_alive).
CANNOT_TELL = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR})


def open_own_file(path, flags=os.O_RDONLY):
    """An fd of `path` if it is a regular file of this user, else None: never
    through a link, never blocking on a FIFO someone planted. Raises OSError
    (an errno of CANNOT_TELL) where the open failed for want of fds or
    memory."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in CANNOT_TELL:
            raise
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and owned(st):
        return fd
    os.close(fd)
    return None


def lock_held(path):
    """Whether someone holds the exclusive flock of a lock file of this user
    (a missing or foreign file: nobody; see csrc/lifetime/identity.h). Where this
    process cannot open it (out of fds: the keeper holds one per segment),
    held: the answer that keeps memory."""
    try:
        fd = open_own_file(path)
    except OSError:
        return True
    if fd is None:
        return False
    try:
        return held(fd)
    finally:
        os.close(fd)


def held(fd):
    """Whether someone holds the exclusive flock of the lock file open at
    `fd` (a shared one taken here goes with the fd's close)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True


def process_alive(holder):
    return lock_held(process_lock_path(holder))


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
        if not (stat.S_ISREG(st.st_mode) and owned(st)):
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


def lock_files():
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
    for name in lock_files():
        path = os.path.join(run_dir(), name)
        try:
            fd = open_own_file(path)
        except OSError:
            continue  # cannot tell now: the next sweep looks again
        if fd is None:
            continue
        # A process lock is created under a temporary name, then locked, then
        # renamed (csrc/lifetime/identity.cpp): a young one may not be locked yet.
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
                    remove_socket(socket_path(session))
            os.unlink(path)  # dead: nobody held its lock
        except OSError:
            pass
        finally:
            os.close(fd)


def remove_socket(path):
    try:
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and owned(st):
            os.unlink(path)
    except OSError:
        pass
