"""6. DataLoader epoch throughput with NumPy samples, 1-N workers.

The collate function is what differs: `np.stack` (sent by pipe + pickle,
shared_memory + pickle5 or torchshm), torch's default collate (stacks into
torch shared memory inside the worker; with torchshm's tensor switch on, into
a pooled torchshm segment) and `torchshm.collate` (stacks into one torchshm
segment per batch, so the send is O(1)). Beside them, Grain's own DataLoader
over the same samples (its Batch stacks into a SharedMemoryArray in the
worker; all epochs in one iterator, so that its workers start once too).
"""

import time

import numpy as np
import torch.utils.data

import torchshm
from benchmarks import peers
from benchmarks.report import Result
from benchmarks.transports import (
    OutOfBand,
    WorkerSetup,
    finish,
    release_received,
    touch,
)

NAME = "dataloader"


class Samples(torch.utils.data.Dataset):
    """`length` float32 samples of `shape`, views of a small pool (like a
    memory-mapped dataset): __getitem__ itself costs nothing."""

    def __init__(self, length, shape):
        self.length = length
        self.pool = np.random.default_rng(0).random((16, *shape), dtype=np.float32)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.pool[index % len(self.pool)]


def stack(samples):
    return np.stack(samples)


def stack_out_of_band(samples):
    return OutOfBand(np.stack(samples))


COLLATES = {
    "pipe": stack,
    "shm_pickle5": stack_out_of_band,
    "torch": torch.utils.data.default_collate,
    "torch_torchshm": torch.utils.data.default_collate,
    "torchshm": stack,
}
if hasattr(torchshm, "collate"):
    COLLATES["torchshm_collate"] = torchshm.collate


GBPS_NAMES = {
    "torch": "default",
    "torch_torchshm": "default via torchshm",
    "torchshm_collate": "torchshm.collate",
    "grain": "Grain",
}


def epoch_seconds(method, workers, dataset, batch, epochs):
    if method == "grain":
        return peers.grain_epochs(dataset, batch, workers, epochs)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        num_workers=workers,
        collate_fn=COLLATES[method],
        worker_init_fn=WorkerSetup(method),
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    seconds = []
    for _ in range(epochs + 1):  # the first epoch starts the workers: warm-up
        start = time.perf_counter()
        for batch_ in loader:
            touch(finish(method, batch_))
            del batch_
            release_received()
        seconds.append(time.perf_counter() - start)
    del loader  # shuts the persistent workers down
    return seconds


def run(quick, bar):
    if quick:
        length, shape, batch, epochs, worker_counts = 64, (64, 1024), 16, 2, (1, 2)
    else:
        length, shape, batch, epochs, worker_counts = 512, (256, 1024), 32, 4, (1, 2, 4)
    sample_mib = np.prod(shape) * 4 / (1 << 20)
    epoch_bytes = length * np.prod(shape) * 4
    result = Result(
        NAME,
        f"6. DataLoader epoch, {length} samples of {sample_mib:g} MiB,"
        f" batch {batch}",
        notes=[
            "Epoch time; the main process reads every page of every batch."
            f" Median [min-max] of epochs 2..{epochs + 1} (epoch 1 starts the"
            " persistent workers). Columns: the collate_fn and how its batch"
            " is sent (torch tensor = default_collate).",
        ],
    )
    if "torchshm_collate" not in COLLATES:
        result.notes.append("torchshm.collate is not available in this build.")
    dataset = Samples(length, shape)
    methods = list(COLLATES) + list(peers.methods(("grain",)))
    bar.reset(total=len(methods) * len(worker_counts))
    for workers in worker_counts:
        label = f"{workers} worker{'s' if workers > 1 else ''}"
        for method in methods:
            seconds = peers.attempt(
                result,
                label,
                method,
                lambda: epoch_seconds(method, workers, dataset, batch, epochs),
            )
            bar.update()
            if seconds is None:
                continue
            row = result.add(label, method, seconds)
            if method in GBPS_NAMES:
                gbps = epoch_bytes / row["median"] / 1e9
                result.extra(label, f"GB/s {GBPS_NAMES[method]}", gbps)
        tensors = result.get(label, "torch_torchshm")
        collate = result.get(label, "torchshm_collate")
        if tensors and collate:
            result.extra(
                label,
                "default via torchshm / torchshm.collate",
                tensors["median"] / collate["median"],
            )
    peers.against_best(result, ours="torchshm_collate")
    peers.note_versions(result, methods)
    return result
