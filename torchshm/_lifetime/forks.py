"""The child of a fork torchshm did not prepare (a fork() called from C or
through ctypes: Note [Forks torchshm did not prepare] in
csrc/lifetime/fork_guard.h). Its session, lock and slots are its parent's and
the shared memory it inherited is not mapped there, so torchshm is off in it:
sends pickle by value, the exit hook does nothing, and a call that needs
shared memory raises the one error below."""

from torchshm._native import _C


def forked_without_hooks() -> bool:
    """Whether this process descends from a fork torchshm did not prepare."""
    return _C.forked_without_hooks()


def check_fork_hooks(what: str) -> None:
    """Raises RuntimeError, saying why and what to do, for `what` (what the
    caller was doing) in a child of a fork torchshm did not prepare."""
    if not _C.forked_without_hooks():
        return
    raise RuntimeError(
        f"torchshm: {what} in a process forked without torchshm's fork hooks"
        " (fork() called from C or through ctypes, not os.fork() or"
        " multiprocessing): the shared memory it inherited is not mapped here"
        " and torchshm is off in it. Fork with os.fork() or a multiprocessing"
        " start method, or exec a new program in such a child"
    )
