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
it to the datapipe its hook returns.

Names of 0.2 that clashed with `torchshm.allocating` (a context manager) and
`torchshm.worker_init_fn` (a DataLoader's hook) but took other arguments,
`allocating` and `worker_init_fn`, still work for one release, with a
DeprecationWarning naming the new one. For ParallelMapper, `torchshm.chain(your_fn,
allocate=True)` turns it on in the thread that maps.
"""

import warnings
from typing import Any, Optional, TypeVar

from torchshm import _dataloader, _share
from torchshm._dataloader import _register_in_worker
from torchshm._send import registry as _registry

T = TypeVar("T")

__all__ = ["in_workers", "register_in_worker", "to_shared", "with_allocator"]


def with_allocator(datapipe: Any, min_bytes: Optional[int] = None) -> Any:
    """An IterDataPipe whose items are made with the allocator on in the
    thread that iterates it (a worker's prefetch thread included): arrays the
    pipeline makes there are born shared and sent without a copy."""
    return _dataloader.AllocatingIterDataPipe(datapipe, min_bytes)


def register_in_worker(datapipe: T, worker_info: Any = None) -> T:
    """torchdata 0.6-0.9 `worker_init_fn(datapipe, worker_info)`: registers
    torchshm's reducers in the worker and returns the datapipe unchanged."""
    _register_in_worker()
    return datapipe


def to_shared(item: T) -> T:
    """Map function: the item with its arrays moved into shared memory.

    `datapipe.map(torchshm.torchdata.to_shared)` pays the copy inside the
    worker, in the pipeline, instead of in the queue's feeder thread; the
    send is then O(1), and a prefetch or shuffle buffer after it holds shared
    memory. Items that torchshm cannot share pass through as they are.
    """
    _register_in_worker()
    if not _registry.is_registered():  # TORCHSHM_DISABLE=1: leave items alone
        return item
    return _share.share(item)


def _registered(item):
    return item


def in_workers(datapipe: Any) -> Any:
    """`datapipe` followed by a no-op map whose function lives in torchshm, so
    that every process that unpickles the pipeline imports (and registers)
    torchshm: for reading services without a worker hook, such as torchdata
    0.5's PrototypeMultiProcessingReadingService."""
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
