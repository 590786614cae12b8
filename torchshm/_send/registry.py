"""Registration with multiprocessing's ForkingPickler (never copyreg, so that
pickle.dumps to a file stays by value): ndarrays, torch's untyped storages
(tensors.py), and pyarrow Buffers once pyarrow is imported (Note [Arrow
buffers] in arrow.py)."""

import contextlib
import os
import threading
from multiprocessing import forkserver
from multiprocessing.reduction import ForkingPickler
from typing import Iterator, Optional

import numpy as np

from torchshm import _compat, _config, _fallback
from torchshm._lifetime import session as _session
from torchshm._native import _C
from torchshm._send import arrivals as _arrivals
from torchshm._send import arrow as _arrow
from torchshm._send import channel as _channel
from torchshm._send import sender as _sender
from torchshm._send import tensors as _tensors

# The array types, and every type's reducer.
TYPES = (np.ndarray,) + _sender.SUBCLASSES
REDUCERS = {t: _sender.reduce_ndarray for t in TYPES}
REDUCERS[_tensors.STORAGE] = _tensors.reduce_storage
_lock = threading.Lock()
_previous = None  # the reducers we replaced, restored by unregister()
# The disabled() blocks open in this process, as (pid, depth): the worker
# hooks and map functions that register torchshm (worker_init_fn, chain,
# torchdata.to_shared) leave it off inside one. By pid: a child forked inside
# the block is a process of its own, whose hook registers as usual.
_disabled_blocks = (0, 0)
# (install, uninstall) of what the wings above add while torchshm is
# registered (while_registered).
_while_registered = []


def while_registered(install, uninstall) -> None:
    """Has register() call `install` and unregister() `uninstall`, from now
    on (a wing above this one: the DataLoader's workers, _dataloader.py)."""
    _while_registered.append((install, uninstall))
    if is_registered():
        install()


def register(tensors: Optional[bool] = None) -> None:
    """Send eligible ndarrays through shared memory from now on.

    Registers torchshm's reducers with multiprocessing's ForkingPickler (the
    pickler of Queue, Pipe, Pool and DataLoader), never with copyreg:
    ``pickle.dumps`` stays by value. ``import torchshm`` calls it, unless
    ``TORCHSHM_DISABLE=1``. Idempotent, and process-wide (every thread).
    Where torchshm cannot run (no session keeper answers, no directory to
    work in) it stays off with one ``RuntimeWarning`` naming the cause, and
    arrays are pickled by value.

    Parameters
    ----------
    tensors : bool or None, optional
        The tensor switch. ``True`` (as ``TORCHSHM_TENSORS=1``, for this
        process and the ones it starts from now on): CPU tensors that torch
        would move into ``/dev/shm`` go into torchshm's memory instead, and
        DataLoader batches are made there. ``False`` turns it off (as
        ``TORCHSHM_TENSORS=0``). ``None`` (default) reads
        ``TORCHSHM_TENSORS``, which is on when unset. Tensors made by
        `torchshm.empty` travel by reference either way.

    Returns
    -------
    None

    Raises
    ------
    ValueError
        A ``TORCHSHM_*`` environment variable has a bad value: raised here,
        in the caller's thread, rather than later inside a reducer
        (`worker_init_fn` calls this in each worker).

    See Also
    --------
    unregister, disabled, is_registered

    Examples
    --------
    >>> torchshm.register()  # idempotent: the import already registered
    >>> torchshm.is_registered()
    True

    With the tensor switch on, a CPU tensor is moved into torchshm's memory
    when it is first sent:

    >>> import pickle, torch
    >>> from multiprocessing.reduction import ForkingPickler
    >>> torchshm.register(tensors=True)
    >>> t = torch.ones(100_000)
    >>> received = pickle.loads(ForkingPickler.dumps(t))
    >>> t.is_shared(), received.is_shared()
    (True, True)
    >>> torchshm.register(tensors=False)  # the switch off again
    """
    global _previous
    _config.check_environment()
    _config.warn_unknown_variables()
    if tensors is None:
        _tensors.read_switch()
    else:
        _tensors.set_enabled(tensors)
    try:
        _session.join()
    except _C.SharedMemoryError as exc:
        _fallback.fall_back(exc, "starting torchshm", "it stays off")
        return
    with _lock:
        if _previous is not None:
            return
        table = _compat.forking_reducers()
        _previous = {t: table.get(t) for t in REDUCERS}
        for t, reducer in REDUCERS.items():
            ForkingPickler.register(t, reducer)
        _tensors.install()
        _arrivals.install()
        for install, _ in _while_registered:
            install()
    # Only a process that sends patches multiprocessing: with
    # TORCHSHM_DISABLE=1 an import changes nothing of it.
    _channel.install()
    _arrow.watch(_register_arrow)
    _preload_in_forkserver()


def _register_arrow() -> None:
    """Adds the pyarrow.Buffer reducer to a registration (pyarrow is
    imported): _arrow.watch calls it, at once or at pyarrow's import."""
    buffer = _arrow.buffer_type()
    with _lock:
        if _previous is None or buffer is None or buffer in _previous:
            return
        _previous[buffer] = _compat.forking_reducers().get(buffer)
        ForkingPickler.register(buffer, _arrow.reduce_buffer)


def _preload_in_forkserver():
    """Note [Registration in workers] (_dataloader.py): a forkserver worker
    registers only if the fork server imported torchshm. forkserver is
    Python 3.14's default start method on Linux, so a script that imports
    torchshm only inside main() would otherwise send by value from every
    DataLoader or Pool worker. The server starts on first use and imports
    its preload list then: torchshm joins that list, which keeps what the
    user put there. A server already running is left as it is."""
    modules = _compat.forkserver_preload()
    if modules is not None and "torchshm" not in modules:
        forkserver.set_forkserver_preload([*modules, "torchshm"])


def unregister() -> None:
    """Stop sending arrays through shared memory: restore plain pickling.

    Puts back whatever ForkingPickler reducers were registered before
    `register` (plain pickling, usually), and torch's own storage methods.
    Process-wide and idempotent. It does not reach processes already
    started, nor workers that register themselves (`worker_init_fn`).
    `disabled` does the same for the length of a ``with`` block.

    Returns
    -------
    None

    Raises
    ------
    Nothing
        It only restores the previous reducers.

    See Also
    --------
    register, disabled, is_registered

    Examples
    --------
    >>> torchshm.unregister()
    >>> torchshm.is_registered()
    False
    >>> torchshm.register()  # on again
    >>> torchshm.is_registered()
    True
    """
    global _previous
    with _lock:
        if _previous is None:
            return
        table = _compat.forking_reducers()
        for t, reducer in _previous.items():
            if reducer is None:
                table.pop(t, None)
            else:
                table[t] = reducer
        _tensors.uninstall()
        _arrivals.uninstall()
        for _, uninstall in _while_registered:
            uninstall()
        _previous = None


@contextlib.contextmanager
def sharing() -> Iterator[None]:
    """Sharing mode (torchshm.share): arrays copied inside the block become
    shared memory, written through by every holder, not snapshots (Note
    [Sender plan] in csrc/send/plan.h)."""
    was = _C.set_sharing(True)
    try:
        yield
    finally:
        _C.set_sharing(was)


def round_trip(obj):
    """`obj` pickled and unpickled through the registered reducers in this
    process: its eligible arrays come back in shared memory, one copy each."""
    with sharing():
        data = ForkingPickler.dumps(obj)
    return ForkingPickler.loads(data)


def is_registered() -> bool:
    """Whether torchshm's reducers are registered in this process.

    True after `register` (which ``import torchshm`` calls unless
    ``TORCHSHM_DISABLE=1``), False after `unregister`, inside `disabled`,
    where torchshm could not start (see `register`), or where another
    library replaced the ndarray reducer since.

    Returns
    -------
    bool
        Whether ForkingPickler sends ndarrays with torchshm's reducer.

    Raises
    ------
    Nothing
        It only looks the reducer up.

    See Also
    --------
    register, unregister, disabled

    Examples
    --------
    >>> torchshm.is_registered()
    True
    >>> with torchshm.disabled():
    ...     torchshm.is_registered()
    False
    """
    return _compat.forking_reducers().get(np.ndarray) is _sender.reduce_ndarray


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Context manager: pickle arrays by value inside the block.

    `unregister` on entry and, if torchshm was registered, `register` on
    exit. Process-wide, not per thread: every thread of the process sends
    by value meanwhile. `share` raises ``RuntimeError`` inside the block,
    and the hooks that register torchshm (`worker_init_fn`, `chain`,
    ``torchdata.to_shared``) leave it off when they run in this process; a
    child forked inside the block is a process of its own, whose hook
    registers as usual.

    Returns
    -------
    contextlib.AbstractContextManager
        The ``with`` statement gets ``None``.

    Raises
    ------
    ValueError
        On exit, if a ``TORCHSHM_*`` environment variable was given a bad
        value in the meantime (`register` checks them).

    See Also
    --------
    unregister, register

    Examples
    --------
    >>> from multiprocessing.reduction import ForkingPickler
    >>> a = np.ones(1_000_000)
    >>> with torchshm.disabled():
    ...     by_value = ForkingPickler.dumps(a)
    >>> len(by_value) > a.nbytes  # the 8 MB themselves
    True
    >>> torchshm.is_registered()  # registered again after the block
    True
    """
    global _disabled_blocks
    was = is_registered()
    with _lock:
        pid, depth = _disabled_blocks
        _disabled_blocks = (os.getpid(), (depth if pid == os.getpid() else 0) + 1)
    unregister()
    try:
        yield
    finally:
        with _lock:
            pid, depth = _disabled_blocks
            _disabled_blocks = (pid, depth - 1)
        if was:
            register()


def in_disabled_block() -> bool:
    """Whether this process is inside a `disabled` block (its worker hooks
    then leave torchshm off)."""
    pid, depth = _disabled_blocks
    return depth > 0 and pid == os.getpid()
