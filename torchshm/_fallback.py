"""The one place that decides what a failure to get shared memory means, and
says it once.

Shared memory can run out (a container's memory limit: torchshm._memory), fds
can run out, the kernel can refuse memfd_create (a seccomp profile). Each of
those is a SharedMemoryError with an errno: an expected failure, after which
the caller does without (the sender pickles the array by value, the NumPy
allocator uses NumPy's memory, collate stacks in ordinary memory), with one
RuntimeWarning per reason and per way of doing without, and a count in
stats()["fallbacks"]. Any other exception there is a torchshm bug: the caller
still does without (a reducer that raises in a Queue's feeder thread loses
the message), and the warning asks for a report.
"""

import errno
import threading
import warnings

from torchshm import _stats
from torchshm._native import _C

# errno -> the stats()["fallbacks"] key of an expected failure.
REASONS = {
    errno.ENOMEM: "out of memory",
    errno.ENOSPC: "out of memory",
    errno.EMFILE: "too many open files",
    errno.ENFILE: "too many open files",
    errno.EACCES: "shared memory not permitted",
    errno.EPERM: "shared memory not permitted",
    errno.ENOSYS: "shared memory not permitted",
    errno.ETIMEDOUT: "session keeper not answering",
    errno.EHOSTDOWN: "no session keeper",
    errno.ENODATA: "no /proc",  # torchshm._memory.UNKNOWN
}

_lock = threading.Lock()
_warned = set()


def reason(exc):
    """(the reason's text, whether the failure is an expected one)."""
    if isinstance(exc, _C.SharedMemoryError):
        code = exc.errno
        return (
            REASONS.get(code)
            or f"shared-memory error: {errno.errorcode.get(code, code)}",
            True,
        )
    return f"internal error: {type(exc).__name__}", False


def fall_back(exc, doing, instead, stacklevel=3):
    """Records that `doing` failed with `exc` and the caller does `instead`:
    one warning per (reason, instead), and the reason counted. Returns the
    reason."""
    why, expected = reason(exc)
    if expected:
        message = f"torchshm: {doing} failed ({exc}); {instead}"
    else:
        message = (
            f"torchshm: unexpected {type(exc).__name__} while {doing} ({exc});"
            f" {instead}. Please report this as a bug."
        )
    _stats.fallback(why)
    warn_once((why, instead), message, stacklevel + 1)
    return why


def warn_once(key, message, stacklevel=2):
    """A RuntimeWarning the first time `key` is seen in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
