"""10. Born in shared memory: arrays a worker makes, with the allocator on/off.

- A spawn DataLoader worker (1 worker, `batch_size=None`) whose `__getitem__`
  returns a fresh deep copy of scenario 2's xarray Dataset. The main process
  touches every page of each item, then drops it (a training loop) or keeps
  it (collecting, caching: no segment can be reused, every item needs fresh
  pages). Per item: the interval between consecutive items in the main
  process, worker's copy included.
- Rocklin's experiment: a fresh spawn child makes `np.arange(5e7)` and puts
  it on a Queue once; from before the arange to the parent having touched
  every page.

Reference columns: one in-memory deep copy of the sample (private memory, in
this process), and the fault-bound limit: creating and populating a fresh
/dev/shm segment of the sample's size (shmem huge pages are off on most hosts,
so that is 4 KiB page faults).
"""

import multiprocessing as mp
import resource
import statistics
import time

import numpy as np
import torch.utils.data

from benchmarks.report import Result
from benchmarks.scenarios.era5 import make_era5
from benchmarks.transports import (
    TIMEOUT,
    WorkerSetup,
    finish,
    identity,
    prepare,
    setup_sender,
    touch,
)
from torchshm._lifetime import segments as _segments

NAME = "born"
METHODS = ("pipe", "torch", "torchshm", "torchshm_born")
WARMUP = 2  # the first item builds the worker's dataset, the second fills its pool


class CopyingDataset(torch.utils.data.Dataset):
    """Item i: (the worker's minor page faults so far, a deep copy of the
    sample) prepared for `method`."""

    def __init__(self, method, shape, length):
        self.method, self.shape, self.length = method, shape, length
        self.base = None

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if self.base is None:
            self.base = make_era5(*self.shape)
        item = prepare(self.method, self.base.copy(deep=True))
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt, item


def through_worker(method, shape, items, keep):
    """(seconds between consecutive items, worker faults per item)."""
    loader = torch.utils.data.DataLoader(
        CopyingDataset(method, shape, items),
        batch_size=None,
        num_workers=1,
        collate_fn=identity,
        worker_init_fn=WorkerSetup(method),
        multiprocessing_context="spawn",
        timeout=TIMEOUT,
    )
    kept, stamps, faults = [], [], []
    for minflt, item in loader:
        touch(finish(method, item))
        stamps.append(time.perf_counter())
        faults.append(minflt)
        if keep:
            kept.append(item)
        del item
    del kept
    return np.diff(stamps).tolist(), np.diff(faults).tolist()


def rocklin_child(method, queue, done):
    setup_sender(method)
    t0 = time.perf_counter()
    array = np.arange(5 * 10**7)
    queue.put((t0, prepare(method, array)))
    done.get(timeout=TIMEOUT)  # torch's fd strategy needs the sender alive


def rocklin(method, n=5 * 10**7):
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=rocklin_child, args=(method, queue, done))
    child.start()
    t0, array = queue.get(timeout=TIMEOUT)
    touch(finish(method, array))
    seconds = time.perf_counter() - t0
    del array
    done.put(True)
    child.join(TIMEOUT)
    return seconds


def one_copy(shape, repeats=5):
    base = make_era5(*shape)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy = base.copy(deep=True)
        seconds.append(time.perf_counter() - start)
        del copy
    return statistics.median(seconds)


def fresh_pages(nbytes, repeats=3):
    """Creating a fresh, populated segment of nbytes (torchshm's own path)."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        segment = _segments._create(nbytes)
        seconds.append(time.perf_counter() - start)
        segment.unlink()
        del segment
    return statistics.median(seconds)


def run(quick, bar):
    shape, items, runs = ((10, 350, 700), 5, 2) if quick else ((100, 700, 1400), 8, 3)
    nbytes = int(np.prod(shape)) * 4
    result = Result(
        NAME,
        f"10. Born shared: a worker deep-copies a {nbytes / 1e6:.0f} MB xarray"
        " Dataset per item; a fresh child makes np.arange(5e7)",
        notes=[
            f"DataLoader rows: median [min-max] of items {WARMUP + 1}..{items};"
            " the worker's copy is included. 'faults/item': the worker's minor"
            " page faults per item (getrusage).",
            f"Rocklin row: {runs} fresh spawn children per method, make + send +"
            " the parent touching every page.",
            "'one copy': a deep copy of the sample in private memory here;"
            " 'fresh pages': creating and populating a fresh /dev/shm segment"
            " of the sample's size (the fault-bound limit when nothing can be"
            " reused).",
        ],
    )
    bar.reset(total=2 * len(METHODS) + len(METHODS) + 1)
    copy_s, fresh_s = one_copy(shape), fresh_pages(nbytes)
    bar.update()
    for keep, case in (
        (False, "main drops each item"),
        (True, "main keeps every item"),
    ):
        for method in METHODS:
            seconds, faults = through_worker(method, shape, items, keep)
            result.add(case, method, seconds, warmup=WARMUP - 1)
            if method.startswith("torchshm"):
                result.extra(
                    case, f"faults/item {method}", statistics.median(faults[WARMUP:])
                )
            bar.update()
        result.extra(case, "one copy (s)", copy_s)
        result.extra(case, "fresh pages (s)", fresh_s)
        born, plain = result.get(case, "torchshm_born"), result.get(case, "torchshm")
        result.extra(case, "torchshm / born", plain["median"] / born["median"])
        result.extra(case, "born / one copy", born["median"] / copy_s)
    case = "np.arange(5e7), fresh child"
    for method in METHODS:
        result.add(case, method, [rocklin(method) for _ in range(runs)], warmup=0)
        bar.update()
    result.extra(case, "fresh pages (s)", fresh_pages(5 * 10**7 * 8))
    return result
