"""One DataLoader run for scenario 12 (benchmarks/scenarios/docker_shm.py),
in whatever /dev/shm this process sees; prints one JSON line.

    python -m benchmarks.docker_loader METHOD SAMPLES EPOCHS [hold]

The DataLoader of issue 20: a Dataset of 2 MiB float32 samples, batch_size 8,
4 spawn workers, prefetch_factor 2, persistent workers. METHOD picks the
collate function, whether workers register torchshm, the samples (NumPy
arrays; torch tensors; or "mixed": an array and a small tensor, so that
torch's own sharing in /dev/shm runs beside torchshm's) and whether the
tensor switch is on (TORCHSHM_TENSORS: torch's tensors through torchshm's
memory instead of /dev/shm). With "hold", the main process keeps every batch
of an epoch until its end, so that all of them are in shared memory at once
(whether batches in flight overflow a small /dev/shm otherwise depends on how
fast the main process consumes them). METHOD "grain" is Grain's own
DataLoader over the same samples (4 workers, Batch(8), worker_buffer_size 2):
its batches go through /dev/shm as SharedMemoryArrays.
"""

import json
import multiprocessing
import os
import sys
import time
import warnings

import numpy as np
import torch
import torch.utils.data

import torchshm
from benchmarks.transports import SENDER_PRELOAD

SAMPLE_FLOATS = (2 << 20) // 4  # 2 MiB of float32
TENSOR_FLOATS = (256 << 10) // 4  # 256 KiB: torch's share per sample
BATCH = 8
WORKERS = 4
# How the workers start: spawn, as issue 20's loader did. The suite runs
# most of its loaders with forkserver (TORCHSHM_BENCH_LOADER_START): each
# spawn worker imports torch itself, 4 of them 10 s of CPU a run.
START = os.environ.get("TORCHSHM_BENCH_LOADER_START", "spawn")
if START == "forkserver":  # what the benchmarks' senders preload
    multiprocessing.set_forkserver_preload(SENDER_PRELOAD)
TIMEOUT = 60  # a batch lost in a worker's feeder thread would hang the loop


class Samples(torch.utils.data.Dataset):
    def __init__(self, length, kind):
        self.length, self.kind = length, kind

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if self.kind == "tensor":
            return torch.full((SAMPLE_FLOATS,), float(index))
        x = np.full(SAMPLE_FLOATS, float(index), dtype=np.float32)
        if self.kind == "numpy":
            return x
        return {"x": x, "t": torch.full((TENSOR_FLOATS,), float(index))}


def stack(samples):
    return np.stack(samples)


def stack_mixed(samples):
    return {
        "x": np.stack([s["x"] for s in samples]),
        "t": torch.stack([s["t"] for s in samples]),
    }


# method -> (collate_fn, workers register torchshm, samples, tensor switch:
# None leaves it as the environment says, on unless TORCHSHM_TENSORS=0);
# collate_fn None: torch's default_collate, which makes torch tensors.
METHODS = {
    "torchshm_collate": (torchshm.collate, True, "numpy", False),
    "torchshm": (stack, True, "numpy", False),
    "torch": (None, False, "numpy", False),
    "torch_tensors": (None, True, "numpy", True),
    "torch_default": (None, True, "numpy", None),
    "torch_switch_off": (None, True, "numpy", False),
    "tensor_samples": (None, False, "tensor", False),
    "tensor_samples_tensors": (None, True, "tensor", True),
    "tensor_samples_default": (None, True, "tensor", None),
    "pipe": (stack, False, "numpy", False),
    "mixed_torchshm": (stack_mixed, True, "mixed", False),
    "mixed_disabled": (stack_mixed, False, "mixed", False),
}


def sample_values(batch):
    """Each sample's first value: its index."""
    x = batch["x"] if isinstance(batch, dict) else batch
    return [float(sample[0]) for sample in x]


def epochs_of(loader, samples, epochs, hold, result):
    """Times `epochs + 1` epochs of `loader()` (an epoch's batches) into
    result: "completed", or the error that stopped it. "bad" counts samples
    missing, repeated or wrong in an epoch (in any order: Grain's workers
    batch their own records)."""
    try:
        for _ in range(epochs + 1):  # the first starts the workers
            start = time.perf_counter()
            held, seen = [], []
            for batch in loader():
                result["batches"] += 1
                seen += sample_values(batch)
                if hold:
                    held.append(batch)
                del batch
            result["epochs"].append(time.perf_counter() - start)
            expected = [float(i) for i in range(samples)]
            result["bad"] += sum(a != b for a, b in zip(sorted(seen), expected))
            result["bad"] += abs(len(seen) - samples)
            del held
        result["completed"] = True
    except Exception as exc:  # noqa: BLE001 - the row says what failed
        result["completed"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def run_grain(samples, epochs, hold):
    """Grain's loader: all epochs in one iterator (its workers start once)."""
    from benchmarks import peers

    torchshm.unregister()
    dataset = Samples(samples, "numpy")
    batches = iter(peers.grain_loader(dataset, BATCH, WORKERS, epochs + 1, buffer=2))
    per_epoch = samples // BATCH
    result = {"method": "grain", "epochs": [], "batches": 0, "bad": 0}
    epochs_of(
        lambda: (next(batches) for _ in range(per_epoch)), samples, epochs, hold, result
    )
    result["warnings"] = []
    return result


def run(method, samples, epochs, hold=False):
    if method == "grain":
        return run_grain(samples, epochs, hold)
    collate, register, kind, tensors = METHODS[method]
    if not register:
        torchshm.unregister()
        # The workers import this module, and so torchshm: the
        # environment they inherit keeps it from registering there.
        os.environ["TORCHSHM_DISABLE"] = "1"
    elif tensors is not None:
        torchshm.register(tensors=tensors)  # the workers inherit the switch
    loader = torch.utils.data.DataLoader(
        Samples(samples, kind),
        batch_size=BATCH,
        num_workers=WORKERS,
        prefetch_factor=2,
        persistent_workers=True,
        multiprocessing_context=START,
        worker_init_fn=torchshm.worker_init_fn if register else None,
        collate_fn=collate,
        timeout=TIMEOUT,
    )
    result = {"method": method, "epochs": [], "batches": 0, "bad": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epoch = loader.__iter__  # each call: an epoch's batches
        try:
            epochs_of(epoch, samples, epochs, hold, result)
        finally:
            del loader, epoch  # shuts the persistent workers down
    result["warnings"] = [
        str(w.message)[:300] for w in caught if "torchshm" in str(w.message)
    ]
    return result


if __name__ == "__main__":
    hold = sys.argv[4:] == ["hold"]
    print(json.dumps(run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), hold)))
