"""Registration with multiprocessing's ForkingPickler (never copyreg, so that
pickle.dumps to a file stays by value)."""

import contextlib
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Iterator

import numpy as np

from torchshm import _config, _sender, _session

TYPES = (np.ndarray,) + _sender.SUBCLASSES
_lock = threading.Lock()
_previous = None  # the reducers we replaced, restored by unregister()


def register() -> None:
    """Sends eligible ndarrays through shared memory from now on (idempotent).

    Raises ValueError for a bad TORCHSHM_* environment variable here, in the
    caller's thread, rather than later inside a reducer (worker_init_fn calls
    this in each worker)."""
    global _previous
    _config.check_environment()
    _session.join()
    with _lock:
        if _previous is not None:
            return
        # ForkingPickler has no public way to read or remove a reducer.
        table = ForkingPickler._extra_reducers
        _previous = {t: table.get(t) for t in TYPES}
        for t in TYPES:
            ForkingPickler.register(t, _sender.REDUCER)


def unregister() -> None:
    """Restores plain pickling (or whatever reducer was registered before)."""
    global _previous
    with _lock:
        if _previous is None:
            return
        table = ForkingPickler._extra_reducers
        for t, reducer in _previous.items():
            if reducer is None:
                table.pop(t, None)
            else:
                table[t] = reducer
        _previous = None


def round_trip(obj):
    """`obj` pickled and unpickled through the registered reducers in this
    process: its eligible arrays come back in shared memory, one copy each."""
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


def is_registered() -> bool:
    return ForkingPickler._extra_reducers.get(np.ndarray) is _sender.REDUCER


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
