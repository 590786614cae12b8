"""9. DataLoader start: 4 spawn workers over a large xarray Dataset.

Under spawn (and forkserver) every worker gets the DataLoader's dataset
pickled (PyTorch #139792): with a Dataset of a few GiB, starting the workers
costs seconds per worker and a copy each. Timed from iter(loader) until each
of the 4 workers has returned its first (tiny) item:

- plain: pickled by value (torchshm.disabled());
- torchshm: the reducers on, the dataset not shared: each worker's start
  snapshots it into fresh shared memory;
- torchshm.share: `torchshm.share(dataset)` once before constructing the
  DataLoader (its own time is a separate column): each start is O(1).
"""

import time

import psutil
from torch.utils.data import DataLoader

import torchshm
from benchmarks.report import Result
from benchmarks.scenarios.era5 import make_era5

NAME = "dataloader_start"
WORKERS = 4
METHODS = ("plain", "torchshm", "torchshm.share")


class XarrayDataset:
    """Item i: one value of time step i (the workers' start dominates)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return self.ds.sizes["time"]

    def __getitem__(self, i):
        return float(self.ds["t2m"].values[i, 0, 0])


def make_dataset(nbytes):
    """An ERA5-like dataset (scenario 2's) of about nbytes."""
    lat, lon = 512, 1024
    return make_era5(max(1, nbytes // (lat * lon * 4)), lat, lon)


def start_time(ds):
    """Seconds from iter(loader) until every worker returned an item."""
    loader = DataLoader(
        XarrayDataset(ds),
        batch_size=None,
        num_workers=WORKERS,
        multiprocessing_context="spawn",
        worker_init_fn=torchshm.worker_init_fn,
    )
    start = time.perf_counter()
    it = iter(loader)
    for _ in range(WORKERS):  # index i goes to worker i % WORKERS
        next(it)
    elapsed = time.perf_counter() - start
    it._shutdown_workers()
    del it, loader
    return elapsed


def run(quick, bar):
    nbytes = (64 << 20) if quick else (2 << 30)
    # plain holds a copy per worker plus the pickle in flight: ~7 copies.
    available = psutil.virtual_memory().available
    scaled = nbytes * 7 > available
    if scaled:
        nbytes = available // 7 // (64 << 20) * (64 << 20)
    repeats = 1 if quick else 2
    ds = make_dataset(nbytes)
    size = ds.nbytes
    result = Result(
        NAME,
        f"9. DataLoader start, {WORKERS} spawn workers over a"
        f" {size / 2**30:.2f} GiB xarray Dataset",
        notes=[
            "From iter(loader) until each worker returned its first item;"
            f" median [min-max] of {repeats} run(s). The workers' own start"
            " (a Python with torch, numpy, xarray) is in every column.",
        ]
        + (
            [f"Scaled down from 2 GiB: only {available / 2**30:.1f} GiB free."]
            if scaled
            else []
        ),
    )
    bar.reset(total=len(METHODS) * repeats)
    case = f"{size / 2**30:.2f} GiB"
    for method in METHODS:
        samples = []
        for _ in range(repeats):
            if method == "plain":
                with torchshm.disabled():
                    samples.append(start_time(ds))
            elif method == "torchshm":
                samples.append(start_time(ds))
            else:
                begin = time.perf_counter()
                shared = torchshm.share(ds)
                result.extra(case, "share() s", round(time.perf_counter() - begin, 2))
                samples.append(start_time(shared))
                del shared
            torchshm.trim()
            bar.update()
        result.add(case, method, samples, warmup=0)
    times = {m: result.get(case, m)["median"] for m in METHODS}
    result.summary["start_s"] = times
    result.notes.append(
        "Speed-up of torchshm.share over plain:"
        f" {times['plain'] / times['torchshm.share']:.1f}x"
    )
    return result
