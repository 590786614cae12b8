"""What the keeper learns of this user's processes from /proc: which exist,
which pipes they hold open, and which were started into a session. Standard
library only (Note [The keeper's facts] in daemon.py)."""

import errno
import os

if __package__:  # the library's (or the tests') module
    from torchshm._keeper.paths import CANNOT_TELL, ENV_VAR
else:  # the keeper's: daemon.py put its directory on sys.path
    from paths import CANNOT_TELL, ENV_VAR


# What reading a process's /proc files fails with once it has exited: then it
# holds nothing, and is skipped. Any other error (EACCES: a process that made
# itself non-dumpable) means that what it holds cannot be seen.
GONE = (errno.ENOENT, errno.ESRCH)


def processes_of_this_user():
    """(pid, whether its /proc entry can be read) of every process of this
    user, or None without /proc (OSError where this process cannot list it:
    out of fds or memory). A process that made itself non-dumpable has a
    /proc entry of root's before Linux 4.11 (its uid is read from its
    status); since 4.11 the entry stays its owner's, and only its fd/ and
    environ become root's: callers find that out as they read them (GONE)."""
    uid = os.geteuid()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError as exc:
        if exc.errno in CANNOT_TELL:  # out of fds: /proc is there
            raise
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


def open_pipes(since=None):
    """Inodes of the pipes that processes of this user have open, or None if
    that cannot be known: no /proc, or a process of this user whose fds
    cannot be seen (non-dumpable), unless it started before `since` (clock
    ticks after boot, start_time()): what the session's messages travel on
    was made after the session began, and a process older than that holds
    such a pipe only if one was passed to it. Then no ticket is judged by its
    pipe."""
    try:
        processes, found = processes_of_this_user(), set()
    except OSError:
        return None  # out of fds: cannot be known now
    if processes is None:
        return None
    for pid, readable in processes:
        pipes = _pipes_of(pid) if readable else None
        if pipes is None and not _older(pid, since):
            return None
        found.update(pipes or ())
    return found


def _pipes_of(pid):
    """The pipe inodes process `pid` holds; an empty set if it is gone; None
    if its fds cannot be seen."""
    fd_dir, pipes = f"/proc/{pid}/fd", set()
    try:
        fds = os.listdir(fd_dir)
    except OSError as exc:
        return set() if exc.errno in GONE else None
    for fd in fds:
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError as exc:
            if exc.errno in GONE:
                continue  # closed meanwhile
            return None
        if link.startswith("pipe:["):
            pipes.add(int(link[6:-1]))
    return pipes


def session_in_environment(session, since=None):
    """Whether a live process of this user other than this one started with
    TORCHSHM_SESSION=session (a `subprocess` child that may still import
    torchshm and join). True for a process whose environment cannot be read
    (non-dumpable), unless it started before `since` (start_time()): a
    process older than the session cannot carry its id."""
    try:
        processes = processes_of_this_user()
    except OSError:
        return True  # out of fds: any process may have started with it
    if processes is None:
        return False  # no /proc: only lock files and members tell
    wanted, me = f"{ENV_VAR}={session}".encode(), os.getpid()
    for pid, readable in processes:
        if pid == me:
            continue
        try:
            if not readable:
                raise PermissionError(errno.EACCES, "root's /proc entry")
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    return True
        except OSError as exc:
            if exc.errno in GONE or _older(pid, since):
                continue
            return True  # it may have started with it
    return False


def _older(pid, since):
    """Whether process `pid` started before `since` (known: both given)."""
    started = start_time(pid) if since is not None else None
    return started is not None and started < since


def start_time(pid):
    """When a process started, in clock ticks after boot (/proc/<pid>/stat's
    22nd field), or None if that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None
