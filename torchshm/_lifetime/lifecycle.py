"""A process's life with shared memory: what fork gives a child (Note
[Fork]), and what an exit lets go of, once its threads are done (Note [Exit
after the threads]). install() hooks both in.
"""

import os
import threading
import time
from multiprocessing import util

from torchshm import _compat, _fallback, _stats
from torchshm._lifetime import expiry as _expiry
from torchshm._lifetime import forks as _forks
from torchshm._lifetime import holdings as _holdings
from torchshm._lifetime import mappings as _mappings
from torchshm._lifetime import pins as _pins
from torchshm._lifetime import segments as _segments
from torchshm._lifetime import session as _session
from torchshm._native import _C

# Note [Fork]
#
# A child inherits every view but none of the slots: those are
# the parent's, under the parent's id. Before fork the parent makes the
# child's id (and its lock, which the child inherits and keeps) and takes a
# slot for the child in every segment it has a live view of; afterwards the
# parent's pool could reuse a segment before the child claimed it. The child
# adopts those slots. A child that execs loses the lock (close-on-exec), so
# its slots name a dead process and are freed like any dead holder's.
# When that cannot be done (the lock file cannot be made: the fd limit, no
# inode left in /dev/shm; every slot of a segment taken; any other error),
# the segment goes unprotected no more: the parent pins it (never reused,
# never rewound, closed when the session ends; Note [Segment lifetime] in
# csrc/lifetime/segment.h), with one warning, and the child reads it safely. Only a
# fork this hook prepared lets the child inherit segment memory at all (Note
# [Forks torchshm did not prepare] in csrc/lifetime/fork_guard.h): a fork() from C
# runs no hook, and its child cannot read what it inherited.
_for_child = []


def _lock_with_timer_halted():
    """Takes the lock with the expiry thread joined. The thread takes the
    lock itself, so it is joined before the lock is taken; another thread may
    start it again in between (ensure() runs under the lock): then again.
    The lock is taken even if halt() raises: _after_fork_in_parent releases
    it."""
    while True:
        try:
            _expiry.timer.halt()
        finally:
            _holdings.lock.acquire()
        if not _expiry.timer.running():
            return
        _holdings.lock.release()


def _before_fork():
    if _forks.forked_without_hooks():
        return  # torchshm is off here: no thread, no holding of its own
    # No torchshm thread may be alive across fork (Python 3.12+ warns, and a
    # thread holding a lock would leave it held in the child): joined, and
    # gone from /proc/self/task (Note [Threads at fork] in csrc/base/parallel.h).
    _lock_with_timer_halted()
    try:
        _C.wait_threads_gone()
    except Exception:  # noqa: BLE001 - fork must go on; it may warn
        pass
    live = _holdings.live.owners()
    unprotected, why = _give_to_child(live)
    for owner in unprotected:
        _C.segment_of(owner).pin()
    if unprotected:
        _stats.add("segments_pinned_at_fork", len(unprotected))
        _warn_pinned(len(unprotected), why)
    # Note [A plain send is as it was] in csrc/send/plan.h: the child's born
    # memory is its own copy-on-write, as NumPy's would be.
    _C.freeze_born_for_fork()
    _C.prepared_fork()  # the child may inherit segment memory now


def _give_to_child(live):
    """Takes a slot for the child in each live segment (Note [Fork]); the
    owners it could not, and why."""
    if not live:
        return [], None
    try:
        child = _C.prepare_child()
    except Exception as exc:  # noqa: BLE001 - any failure: pinned instead
        return live, exc
    unprotected, why = [], None
    for owner in live:
        try:
            slot = _C.segment_of(owner).take_slot(child)
        except Exception as exc:  # noqa: BLE001
            slot, why = -1, exc
        if slot >= 0:
            _for_child.append((owner, slot))
        else:
            unprotected.append(owner)
            why = why or "every holder slot of a segment is taken"
    return unprotected, why


def _warn_pinned(count, why):
    try:
        _fallback.warn_once(
            ("fork", "pinned"),
            f"torchshm: a forked child could not be given its own hold on"
            f" {count} segment(s) it inherited ({why}); they are kept until the"
            " session ends (never reused while the child may read them). If"
            " this repeats, raise the fd limit (ulimit -n) or free /dev/shm",
            stacklevel=3,
        )
    except Exception:  # noqa: BLE001 - warnings as errors must not stop fork
        pass


def _after_fork_in_parent():
    if _forks.forked_without_hooks():
        return
    _for_child.clear()
    _C.after_fork_in_parent()
    # Not restarted here: Python 3.13 counts threads for its fork warning
    # after these hooks ran. The next send or receive restarts it, and
    # does the work queued meanwhile (Note [Work for the lock's holder]).
    _holdings.lock.release(run_deferred=False)


def _after_fork_in_child():
    global _exit_deferred, _threads_joined
    if _forks.forked_without_hooks():
        return
    _exit_deferred = _threads_joined = False  # the parent's end, not ours
    _stats.after_fork_in_child()
    _holdings.after_fork_in_child()
    _expiry.after_fork_in_child()
    _C.after_fork_in_child()
    _C.forget_written_tickets()  # the parent's messages, not ours
    _C.forget_snapshots()  # the parent's copies
    _session.after_fork_in_child()
    # A view without a slot of this process's own protects nothing here: a
    # segment arriving again must be attached anew.
    _holdings.live.clear()
    if _for_child:
        me = _C.process_id()
        for owner, slot in _for_child:
            _C.adopt(owner, slot, me)
            _holdings.live.remember(_C.segment_of(owner).name, owner)
        _for_child.clear()
    _holdings.pool.forget()
    _mappings.clear()
    _pins.after_fork_in_child()


# Note [Exit after the threads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torchshm's exit work (_exit: no new message from another thread, Note
# [Messages at exit] in csrc/send/message.h; then letting go of every
# holding, the lock file and the session) must not run while a thread that
# Python will wait for still works: it would hand memory that thread holds
# back to its sender's pool (whose next message overwrites it), and put
# that thread to sleep at its next send, which the exit then waits for (a
# hang). So the work runs once the non-daemon threads have ended. How each
# way a process ends meets that rule:
# - A script (its main thread returns, raises, calls sys.exit, or takes
#   Ctrl-C): the interpreter joins the non-daemon threads
#   (threading._shutdown), then runs atexit's handlers, among them
#   multiprocessing's exit function and its finalizers, ours last
#   (_EXIT_PRIORITY, below a Queue's flush and join at -5).
# - A multiprocessing child, of any start method (a Process, a Pool or
#   ProcessPoolExecutor worker, a DataLoader worker): up to Python 3.12 its
#   bootstrap runs the finalizers as soon as the target returns and only
#   then joins the threads, which may still send, receive and hold arrays.
#   Our finalizer finds a non-daemon thread alive and defers: the
#   threading._shutdown that torchshm wraps runs, once the threads have
#   ended, the finalizers registered since (a Queue that a late thread
#   started is flushed and joined, as in a script) and then the exit work.
#   Python 3.13 joins a child's threads first and runs its finalizers at
#   its atexit, as a script does: nothing is deferred there.
# - Python stops waiting for a non-daemon thread (Ctrl-C during the join):
#   that thread is then treated as a daemon thread is for messages, and the
#   process keeps every holding until it is dead: the lock file's death
#   frees its slots (Note [Segment lifetime] in csrc/lifetime/segment.h),
#   as after SIGKILL. Nothing is taken from under a thread that may still
#   read it.
# - Daemon threads are not waited for, by Python or by torchshm: Note
#   [Messages at exit].
# - sys.exit in a thread other than the main one ends that thread alone.
# - os._exit, SIGKILL, a signal's default action: nothing runs; the process
#   and its threads are gone at once, and its slots die with its lock.
_EXIT_PRIORITY = -100


def _at_exit():
    # Below Queue's feeder-join finalizer (priority -5): pending messages are
    # pickled (and may take tickets) before this process lets go.
    util.Finalize(None, _exit, exitpriority=_EXIT_PRIORITY)


# How long the exit hook waits for other threads' messages under way.
_MESSAGES_AT_EXIT_SECONDS = 2.0
# Note [Handing over at exit]
# What this process sent and nobody has loaded yet lives, once its fds
# close, only in its session's keeper (Note [Segment lifetime] in
# csrc/lifetime/segment.h). So the exit hook keeps every fd it created open
# (a reference to each segment) while it lets go of its slots and its pool:
# a segment that nothing else holds is let go of then, and its fd closes.
# If any is still held (a message in flight names it), the hook looks at
# its keeper last (_session.hand_over): a keeper that died meanwhile, even
# during this hook, is replaced and given them all, and where none answers
# it waits as long as a receiver would (_session.KEEPER_PATIENCE). Only
# then do those fds close. A keeper killed after that look takes those
# messages with it, as any holder's death does; handed_over_at says when
# the look was (the soak, scripts/soak.py, tells the two apart by it).
handed_over_at = None  # monotonic time of the last look; None: not made

# Note [Exit after the threads]: _exit found a thread to wait for before the
# threads were joined; whether they have been joined since.
_exit_deferred = False
_threads_joined = False


def _threads_python_waits_for():
    """Live non-daemon threads other than this one and the main one."""
    me, main = threading.current_thread(), threading.main_thread()
    return [
        t
        for t in threading.enumerate()
        if t is not me and t is not main and not t.daemon and t.is_alive()
    ]


def _exit():
    global _exit_deferred, handed_over_at
    if _forks.forked_without_hooks():
        return  # the session, lock and slots here are the parent's
    keep_holdings = False
    if _threads_python_waits_for():
        if not _threads_joined:
            _exit_deferred = True  # Note [Exit after the threads]
            return
        keep_holdings = True  # Python stopped waiting for them
    # Note [Messages at exit] in csrc/send/message.h: no other thread starts a
    # message from here on, and those under way end before finalization.
    _C.begin_exit()
    deadline = time.monotonic() + _MESSAGES_AT_EXIT_SECONDS
    while _C.live_messages() and time.monotonic() < deadline:
        time.sleep(0.001)
    # Note [Handing over at exit]: kept open until the keeper is seen alive.
    fds_kept = _C.segments_with_fd()
    _holdings.exiting = True
    # The timer is a daemon thread: left running into interpreter
    # finalization, it is stopped wherever it is, perhaps holding the lock,
    # and a weakref callback that takes the lock later (an array freed with a
    # module's globals) would wait for ever. So it ends here, joined;
    # ensure() starts no other once `exiting` is set.
    _expiry.timer.halt()
    if not keep_holdings:
        # Before CUDA's own teardown, after every copy (Note [Pinned in place]).
        _pins.release_all()
        _segments.disown_all()
    # What nothing holds any more was let go of: unlinked, its fd closed.
    held = [segment for segment in fds_kept if segment.fd >= 0]
    del fds_kept
    if held:
        handed_over_at = _session.hand_over(_session.KEEPER_PATIENCE)
        del held
    if keep_holdings:
        return
    _C.remove_own_lock()
    _session.leave()


def _join_threads_then_exit(join=_compat.threading_shutdown()):
    """threading._shutdown, then the exit work it made wait (Note [Exit after
    the threads])."""
    global _exit_deferred, _threads_joined
    try:
        join()
    finally:
        _threads_joined = True
        if _exit_deferred:
            _exit_deferred = False
            # multiprocessing's exit function has run; what was registered
            # since runs now, in its order, with ours where it would be.
            _compat.run_finalizers(_EXIT_PRIORITY)
            _exit()
            _compat.run_finalizers()


class _Token:
    """multiprocessing.util.register_after_fork needs a weak-referenceable object."""


_token = _Token()


def install():
    """Hooks the fork protocol and the exit finalizer in (once, from
    torchshm/__init__.py)."""
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
    # A child's bootstrap clears inherited finalizers, then runs after-fork
    # hooks.
    util.register_after_fork(_token, lambda _: _at_exit())
    _at_exit()
    _compat.set_threading_shutdown(_join_threads_then_exit)
