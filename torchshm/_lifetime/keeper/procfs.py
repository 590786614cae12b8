"""What the keeper learns of this user's processes from /proc: which exist,
which pipes they hold open, and which were started into a session. Standard
library only (Note [The keeper's facts] in daemon.py)."""

import os

if __package__:  # the library's (or the tests') module
    from torchshm._lifetime.keeper.paths import ENV_VAR
else:  # the keeper's: daemon.py put its directory on sys.path
    from paths import ENV_VAR


def processes_of_this_user():
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
    processes, found = processes_of_this_user(), set()
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
    processes = processes_of_this_user()
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
