"""This process's fd limit: raised, never above the hard limit, when
torchshm needs more fds than the soft limit leaves (a sender keeping its
segments for messages in flight, a receiver opening one segment at its
limit). A soft limit is a default that every process may raise up to its
hard limit; failing a message instead would lose it."""

import resource
import select

# An unlimited hard limit counts as this many fds.
UNLIMITED_FDS = 1 << 20


def limits():
    """(soft, hard) with an unlimited hard limit counted as UNLIMITED_FDS."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, _counted(hard)


def _counted(hard):
    return UNLIMITED_FDS if hard == resource.RLIM_INFINITY else hard


def raise_soft_limit(at_least=0):
    """Raises the soft limit to at least `at_least` and at least doubles it,
    up to the hard limit. False if it is at the hard limit already."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = _counted(hard)
    if soft >= ceiling:
        return False
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (min(ceiling, max(2 * soft, at_least)), hard)
    )
    return True


def readable(*streams, timeout):
    """Whether one of `streams` (sockets, files or fds) has something to read
    (EOF included) within `timeout` seconds (None: waits for it). poll, not
    select: a process that holds many segments has fds above select's 1024
    (its soft limit raised for them), where select raises ValueError."""
    poller = select.poll()
    for stream in streams:
        poller.register(stream, select.POLLIN)
    return bool(poller.poll(None if timeout is None else int(timeout * 1000)))
