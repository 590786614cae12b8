"""torchdata integration: registration in reading-service workers, and a map
function that moves items into shared memory inside the worker.

torchdata is never imported here: the helpers only call methods of the
datapipe they are given, so torchshm imports without torchdata and these
work with torchdata 0.5 to 0.11 (and torch's own datapipes).

- `MultiProcessingReadingService` 0.6-0.9 takes
  `worker_init_fn(datapipe, worker_info) -> datapipe`: pass
  `torchshm.datapipe_worker_init_fn` (or wrap your own function with it).
- 0.5's `MultiProcessingReadingService` is the classic DataLoader: pass
  `torchshm.worker_init_fn`. 0.5's `PrototypeMultiProcessingReadingService`
  has no worker hook: `torchshm.in_workers(datapipe)` makes the datapipe
  itself import torchshm wherever it is unpickled (see
  Note [Registration in workers] in _dataloader.py).
- `torchdata.stateful_dataloader.StatefulDataLoader` (0.8+) is a DataLoader:
  `worker_init_fn=torchshm.worker_init_fn`, `collate_fn=torchshm.collate`.
- `torchdata.nodes.ParallelMapper(..., method="process")` (0.10+) has no
  worker hook either, only the map function it pickles into each worker:
  `map_fn=torchshm.map_fn(your_fn)` registers there, then calls `your_fn`.
"""

from torchshm import _registry, _share
from torchshm._dataloader import RegisterThenCall, _register_in_worker


def datapipe_worker_init_fn(datapipe_or_fn, worker_info=None):
    """torchdata 0.6-0.9 `worker_init_fn` that registers torchshm's reducers.

    `MultiProcessingReadingService(worker_init_fn=torchshm.datapipe_worker_init_fn)`
    registers and returns the datapipe unchanged;
    `worker_init_fn=torchshm.datapipe_worker_init_fn(fn)` registers, then
    returns `fn(datapipe, worker_info)`.
    """
    if worker_info is None and callable(datapipe_or_fn):
        return RegisterThenCall(datapipe_or_fn, "torchshm.datapipe_worker_init_fn")
    _register_in_worker()
    return datapipe_or_fn


def map_fn(fn):
    """A picklable map function that registers torchshm in the process that
    runs it, then returns `fn(item)`.

    For `torchdata.nodes.ParallelMapper(..., method="process")` and other
    process pools whose only hook is the function they run: its workers
    unpickle it (importing torchshm, which registers) and call it, so their
    results travel through shared memory under spawn and forkserver too.
    """
    return RegisterThenCall(fn, "torchshm.map_fn")


def share_memory(item):
    """Map function: the item with its arrays moved into shared memory.

    `datapipe.map(torchshm.share_memory)` pays the copy inside the worker, in
    the pipeline, instead of in the queue's feeder thread; the send is then
    O(1), and a prefetch or shuffle buffer after it holds shared memory.
    Items that torchshm cannot share pass through as they are.
    """
    _register_in_worker()
    if not _registry.is_registered():  # TORCHSHM_DISABLE=1: leave items alone
        return item
    return _share.share(item)


def _registered(item):
    return item


def in_workers(datapipe):
    """`datapipe` followed by a no-op map whose function lives in torchshm, so
    that every process that unpickles the pipeline imports (and registers)
    torchshm: for reading services without a worker hook, such as torchdata
    0.5's PrototypeMultiProcessingReadingService."""
    return datapipe.map(_registered)
