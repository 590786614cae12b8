"""torchdata integration: `torchshm.torchdata`.

torchdata is never imported here: the helpers only call methods of the
datapipe they are given, so torchshm imports without torchdata and these
work with torchdata 0.5 to 0.11 (and torch's own datapipes).

- `MultiProcessingReadingService` 0.6-0.9 takes
  `worker_init_fn(datapipe, worker_info) -> datapipe`: pass
  `torchshm.torchdata.register_in_worker`, or `torchshm.chain(your_fn)` to
  run your own after registering.
- 0.5's `MultiProcessingReadingService` is the classic DataLoader: pass
  `torchshm.worker_init_fn`. 0.5's `PrototypeMultiProcessingReadingService`
  has no worker hook: `torchshm.torchdata.in_workers(datapipe)` makes the
  datapipe itself import torchshm wherever it is unpickled (see
  Note [Registration in workers] in _dataloader.py).
- `torchdata.stateful_dataloader.StatefulDataLoader` (0.8+) is a DataLoader:
  `worker_init_fn=torchshm.worker_init_fn`, `collate_fn=torchshm.collate`.
- `torchdata.nodes.ParallelMapper(..., method="process")` (0.10+) has no
  worker hook either, only the map function it pickles into each worker:
  `map_fn=torchshm.chain(your_fn)` registers there, then calls `your_fn`.

Born-shared allocation (torchshm.allocating) is local to a thread, and
0.6-0.9 workers iterate their datapipe in a prefetch thread, not in the
thread that ran the hook: `with_allocator(datapipe)` turns it on in
whichever thread iterates, and `torchshm.chain(hook, allocate=True)` applies
it to the datapipe its hook returns. For ParallelMapper,
`torchshm.chain(your_fn, allocate=True)` turns it on in the thread that maps.

Names of 0.2 that clashed with `torchshm.allocating` (a context manager) and
`torchshm.worker_init_fn` (a DataLoader's hook) but took other arguments,
`allocating` and `worker_init_fn`, still work for one release, with a
DeprecationWarning naming the new one (`with_allocator`,
`register_in_worker`).
"""

import warnings
from typing import Any, Optional, TypeVar

from torchshm import _dataloader, _share
from torchshm._dataloader import _register_in_worker
from torchshm._send import allocator as _allocator
from torchshm._send import registry as _registry

T = TypeVar("T")

__all__ = ["in_workers", "register_in_worker", "to_shared", "with_allocator"]


def with_allocator(datapipe: Any, min_bytes: Optional[int] = None) -> Any:
    """`datapipe`, iterated with born-shared allocation on in its thread.

    An IterDataPipe that turns NumPy's allocation in shared memory on (as
    ``torchshm.set_allocator(True, min_bytes)``) in whichever thread iterates
    it, a torchdata worker's prefetch thread included, then yields
    `datapipe`'s items: arrays the pipeline makes there are born shared and
    sent without a copy. The allocator stays on in that thread afterwards,
    as `torchshm.set_allocator` leaves it (what a worker wants; in your own
    thread, call ``torchshm.set_allocator(False)`` after). ``len()`` is
    `datapipe`'s.

    Parameters
    ----------
    datapipe : IterDataPipe
        The pipeline whose items to make with the allocator on.
    min_bytes : int or None, optional
        Smallest allocation, in bytes, made in shared memory; ``None``
        (default): the sharing threshold (see `torchshm.set_allocator`).

    Returns
    -------
    IterDataPipe
        A datapipe yielding `datapipe`'s items.

    Raises
    ------
    ValueError
        When iteration starts, if `min_bytes` is below 1 (or is text that is
        not an integer); building it raises nothing.
    TypeError
        When iteration starts, if `min_bytes` is not a number.

    See Also
    --------
    torchshm.set_allocator
    torchshm.chain : ``allocate=True`` applies this to the datapipe a hook
        returns.

    Examples
    --------
    >>> from torch.utils.data.datapipes.iter import IterableWrapper
    >>> arrays = IterableWrapper([1_000_000, 10]).map(np.ones)
    >>> pipe = torchshm.torchdata.with_allocator(arrays, min_bytes=1 << 20)
    >>> [torchshm.is_shared(a) for a in pipe]  # 8 MB born shared, 80 B not
    [True, False]
    >>> torchshm.set_allocator(False)  # it stays on in this thread otherwise
    """
    return _dataloader.AllocatingIterDataPipe(datapipe, min_bytes)


def register_in_worker(datapipe: T, worker_info: Any = None) -> T:
    """torchdata 0.6-0.9 ``worker_init_fn``: registers torchshm in the worker.

    Pass it as ``MultiProcessingReadingService(worker_init_fn=...)``: it
    registers torchshm's reducers in the worker (not under
    ``TORCHSHM_DISABLE=1``) and turns born-shared allocation on for the
    worker's pipeline (Note [Batches born shared] in _dataloader.py): an
    ``IterDataPipe`` comes back as `with_allocator` of it, which yields the
    same items; a map-style one unchanged. To run your own hook too, pass
    ``torchshm.chain(your_fn)`` instead.

    Parameters
    ----------
    datapipe : IterDataPipe or MapDataPipe
        The worker's datapipe, as the reading service passes it.
    worker_info : object, optional
        The reading service's worker info (unused).

    Returns
    -------
    IterDataPipe or MapDataPipe
        `datapipe`'s items, made with the allocator on.

    Raises
    ------
    ValueError
        A ``TORCHSHM_*`` environment variable of the worker has a bad value.

    See Also
    --------
    in_workers, torchshm.chain, torchshm.worker_init_fn

    Examples
    --------
    With torchdata 0.6-0.9::

        from torchdata.dataloader2 import (
            DataLoader2, MultiProcessingReadingService)
        rs = MultiProcessingReadingService(
            num_workers=2, worker_init_fn=torchshm.torchdata.register_in_worker)
        loader = DataLoader2(datapipe, reading_service=rs)

    In the main process (no worker) it only registers:

    >>> from torch.utils.data.datapipes.iter import IterableWrapper
    >>> pipe = IterableWrapper(range(3))
    >>> torchshm.torchdata.register_in_worker(pipe, None) is pipe
    True
    """
    _register_in_worker()
    if not _dataloader.born_shared_here():
        return datapipe
    # Note [Batches born shared] in _dataloader.py; a map-style datapipe is
    # read in the thread that called this.
    _allocator.set_allocator(True)
    if isinstance(datapipe, _dataloader.IterDataPipe):
        return with_allocator(datapipe)
    return datapipe


def to_shared(item: T) -> T:
    """Map function: the item with its arrays moved into shared memory.

    ``datapipe.map(torchshm.torchdata.to_shared)`` pays the copy inside the
    worker, in the pipeline, instead of in the queue's feeder thread; the
    send is then O(1), and a prefetch or shuffle buffer after it holds
    shared memory. It registers torchshm in the process that runs it (so it
    needs no worker hook) and calls `torchshm.share`; arrays that torchshm
    does not share (below the threshold, object arrays) stay as they are,
    and with ``TORCHSHM_DISABLE=1``, or inside the caller's
    `torchshm.disabled` block, the item is returned unchanged.

    Parameters
    ----------
    item : object
        One item of the datapipe: an array, or any picklable object holding
        arrays.

    Returns
    -------
    object
        An equivalent item whose eligible arrays are in shared memory.

    Raises
    ------
    ValueError
        A ``TORCHSHM_*`` environment variable has a bad value.
    Exception
        Whatever pickling `item` raises, for an item that cannot be pickled.

    See Also
    --------
    torchshm.share, with_allocator

    Examples
    --------
    >>> from torch.utils.data.datapipes.iter import IterableWrapper
    >>> pipe = IterableWrapper([np.ones(1_000_000)])
    >>> pipe = pipe.map(torchshm.torchdata.to_shared)
    >>> [torchshm.is_shared(a) for a in pipe]
    [True]
    """
    _register_in_worker()
    if not _registry.is_registered():  # TORCHSHM_DISABLE=1: leave items alone
        return item
    return _share.share(item)


def _registered(item):
    return item


def in_workers(datapipe: Any) -> Any:
    """`datapipe`, made to import torchshm wherever it is unpickled.

    Appends a no-op map whose function lives in torchshm, so that every
    process that unpickles the pipeline imports (and so registers)
    torchshm: for reading services without a worker hook, such as torchdata
    0.5's ``PrototypeMultiProcessingReadingService``. Items pass through
    unchanged.

    Parameters
    ----------
    datapipe : IterDataPipe or MapDataPipe
        Any datapipe with a ``.map`` method.

    Returns
    -------
    IterDataPipe or MapDataPipe
        ``datapipe.map(...)`` of a function that returns its item.

    Raises
    ------
    AttributeError
        `datapipe` has no ``.map`` method.

    See Also
    --------
    register_in_worker, to_shared

    Examples
    --------
    >>> from torch.utils.data.datapipes.iter import IterableWrapper
    >>> pipe = torchshm.torchdata.in_workers(IterableWrapper(range(3)))
    >>> list(pipe)
    [0, 1, 2]
    """
    return datapipe.map(_registered)


# The clashing names of 0.2 (see the module's docstring), for one release.
_RENAMED = {"allocating": "with_allocator", "worker_init_fn": "register_in_worker"}


def __getattr__(name):
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"torchshm.torchdata.{name} is deprecated: use"
            f" torchshm.torchdata.{new} (torchshm.{name} is another function)",
            DeprecationWarning,
            2,
        )
        return globals()[new]
    raise AttributeError(f"module 'torchshm.torchdata' has no attribute {name!r}")
