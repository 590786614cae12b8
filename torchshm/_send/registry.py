"""Registration with multiprocessing's ForkingPickler (never copyreg, so that
pickle.dumps to a file stays by value): ndarrays, torch's untyped storages
(tensors.py), and pyarrow Buffers once pyarrow is imported (Note [Arrow
buffers] in arrow.py)."""

import contextlib
import threading
from multiprocessing import forkserver
from multiprocessing.reduction import ForkingPickler
from typing import Iterator, Optional

import numpy as np

from torchshm import _compat, _config, _fallback
from torchshm._lifetime import session as _session
from torchshm._native import _C
from torchshm._send import arrow as _arrow
from torchshm._send import channel as _channel
from torchshm._send import sender as _sender
from torchshm._send import tensors as _tensors

# The array types, and every type's reducer.
TYPES = (np.ndarray,) + _sender.SUBCLASSES
REDUCERS = {t: _sender.REDUCER for t in TYPES}
REDUCERS[_tensors.STORAGE] = _tensors.reduce_storage
_lock = threading.Lock()
_previous = None  # the reducers we replaced, restored by unregister()


def register(tensors: Optional[bool] = None) -> None:
    """Sends eligible ndarrays through shared memory from now on (idempotent).

    `tensors=True` turns the tensor switch on (as TORCHSHM_TENSORS=1 does, for
    this process and the ones it starts from now on): CPU tensors torch would
    move into /dev/shm go into torchshm's memory instead, and DataLoader
    batches are made there (README, "Tensors"); False turns it off; None
    reads TORCHSHM_TENSORS. Tensors made by torchshm.empty travel by
    reference either way.

    Raises ValueError for a bad TORCHSHM_* environment variable here, in the
    caller's thread, rather than later inside a reducer (worker_init_fn calls
    this in each worker). Where torchshm cannot run (no keeper answers, no
    directory to work in), it stays off with one warning naming the cause:
    arrays are pickled by value."""
    global _previous
    _config.check_environment()
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
    """Restores plain pickling (or whatever reducer was registered before)."""
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
        _previous = None


@contextlib.contextmanager
def sharing() -> Iterator[None]:
    """Sharing mode (torchshm.share): arrays copied inside the block become
    shared memory, written through by every holder, not snapshots (Note
    [Sender plan] in csrc/plan.h)."""
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
    return _compat.forking_reducers().get(np.ndarray) is _sender.REDUCER


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Pickles arrays by value inside the block (process-wide, not per thread)."""
    was = is_registered()
    unregister()
    try:
        yield
    finally:
        if was:
            register()
