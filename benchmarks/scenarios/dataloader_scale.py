"""17. DataLoader throughput by worker count: 1 MiB samples, batch 32.

Where users are: a DataLoader over NumPy samples with persistent fork
workers, its main process reading one float per page of every batch (a
training step that looked at its batch). Worker counts from 1 up to the
machine's cores less one (1 and 2 on a 2-core machine, up to 14 on a 16-core
one). Each (method, workers) runs in a fresh interpreter, so that "torch"
never sees torchshm, the methods in turn, three rounds:

- torch: the default collate without torchshm (its batches through torch's
  own /dev/shm files);
- default via torchshm: the default collate with torchshm's tensor switch on
  (TORCHSHM_TENSORS=1): its batches are made in pooled torchshm segments;
- torchshm.collate: NumPy batches stacked into one torchshm segment each;
- np.stack + torchshm: NumPy batches stacked in the worker, snapshotted;
- torch again: "torch" once more, the A/A control.

Beside the epoch time, GB/s of samples and the main process's CPU time per
batch. Copies to the GPU are not measured here: that needs CUDA.
"""

import json
import os
import statistics
import subprocess
import sys
import time

NAME = "dataloader_scale"
SHAPE = (256, 1024)  # 1 MiB of float32
BATCH = 32
ROUNDS = 3
# torch_again: torch's default collate once more, the A/A control (a ratio
# within its spread of 1 is no difference).
METHODS = ("torch", "torch_torchshm", "torchshm_collate", "torchshm", "torch_again")
TORCH_ALONE = ("torch", "torch_again")  # never import torchshm
GBPS_NAMES = {
    "torch": "torch",
    "torch_again": "torch again (A/A)",
    "torch_torchshm": "default via torchshm",
    "torchshm_collate": "torchshm.collate",
    "torchshm": "np.stack + torchshm",
}


def worker_counts(cores):
    """1 up to the cores less one, at least 2."""
    top = max(2, cores - 1)
    return [n for n in (1, 2, 4, 8, 14) if n <= top]


def one(method, workers, samples, epochs):
    """Runs in a fresh interpreter (see the module's docstring): one JSON
    line, the epochs' seconds and the main process's CPU seconds."""
    if method == "torch_torchshm":
        os.environ["TORCHSHM_TENSORS"] = "1"
    import numpy as np
    import torch.utils.data as tud

    collate = {m: tud.default_collate for m in TORCH_ALONE + ("torch_torchshm",)}
    if method not in TORCH_ALONE:
        import torchshm

        collate["torchshm_collate"] = torchshm.collate
        collate["torchshm"] = np.stack

    class Samples(tud.Dataset):
        """Views of a 16-sample pool: __getitem__ costs nothing."""

        def __init__(self):
            self.pool = np.random.default_rng(0).random((16, *SHAPE), dtype=np.float32)

        def __len__(self):
            return samples

        def __getitem__(self, i):
            return self.pool[i % 16]

    loader = tud.DataLoader(
        Samples(),
        batch_size=BATCH,
        num_workers=workers,
        collate_fn=collate[method],
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    seconds, cpu, batches = [], 0.0, 0
    for epoch in range(epochs + 1):  # the first starts the workers: warm-up
        start, used = time.perf_counter(), time.process_time()
        for batch in loader:
            flat = np.asarray(batch).reshape(-1)
            float(flat[::1024].sum())  # one float per 4 KiB page
            del batch, flat
            batches += epoch > 0
        seconds.append(time.perf_counter() - start)
        if epoch > 0:
            cpu += time.process_time() - used
    del loader
    figures = {"seconds": seconds, "cpu_per_batch": cpu / max(batches, 1)}
    figures["torchshm_imported"] = "torchshm" in sys.modules
    print(json.dumps(figures))


def measure(method, workers, samples, epochs):
    """one() in a fresh interpreter; raises with its stderr if it fails."""
    # The file, not the module: importing the benchmarks package imports
    # torchshm (other scenarios do), whose reducers would then carry "torch".
    run = subprocess.run(
        [sys.executable, os.path.abspath(__file__), method, str(workers)]
        + [str(samples), str(epochs)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(run.stderr.strip()[-300:] or f"exit {run.returncode}")
    figures = json.loads(lines[-1])
    if method in TORCH_ALONE and figures["torchshm_imported"]:
        raise RuntimeError("torch's own path ran with torchshm imported")
    return figures


def run(quick, bar):
    from benchmarks.report import Result

    samples, epochs, rounds = (128, 2, 1) if quick else (1024, 4, ROUNDS)
    counts = worker_counts(os.cpu_count() or 1)
    epoch_bytes = samples * SHAPE[0] * SHAPE[1] * 4
    result = Result(
        NAME,
        f"17. DataLoader by worker count, {samples} samples of 1 MiB, batch {BATCH}",
        notes=[
            "Epoch time, persistent fork workers, the main process reading one"
            f" float per page; median [min-max] of epochs 2..{epochs + 1} of"
            f" {rounds} round(s), each method in a fresh interpreter per round, the"
            " methods in turn. GB/s of samples per epoch; main"
            " CPU: the main process's CPU milliseconds per batch.",
            "To the GPU: not measured here (no CUDA).",
        ],
    )
    bar.reset(total=len(METHODS) * len(counts) * rounds)
    for workers in counts:
        case = f"{workers} worker{'s' if workers > 1 else ''}"
        seconds, cpu = {m: [] for m in METHODS}, {m: [] for m in METHODS}
        # Round-robin: each method's interpreter in turn, `rounds` times, so
        # that the machine's drift (on 2 cores, torch alone took 250-301 ms
        # an epoch in three runs in a row) hits every method alike.
        for _ in range(rounds):
            for method in METHODS:
                if (case, method) not in result.failures:
                    try:
                        got = measure(method, workers, samples, epochs)
                    except Exception as exc:  # noqa: BLE001 - the table shows it
                        result.fail(case, method, f"{type(exc).__name__}: {exc}")
                    else:
                        seconds[method] += got["seconds"][1:]  # less its warm-up
                        cpu[method].append(got["cpu_per_batch"])
                bar.update()
        for method in METHODS:
            if (case, method) in result.failures:
                continue
            row = result.add(case, method, seconds[method], warmup=0)
            name = GBPS_NAMES[method]
            result.extra(case, f"GB/s {name}", epoch_bytes / row["median"] / 1e9)
            main_cpu = statistics.median(cpu[method]) * 1e3
            result.extra(case, f"main CPU ms {name}", main_cpu)
        torch_row = result.get(case, "torch")
        for method in METHODS[1:]:
            row = result.get(case, method)
            if torch_row and row:
                result.extra(
                    case,
                    f"{GBPS_NAMES[method]} / torch",
                    row["median"] / torch_row["median"],
                )
    return result


if __name__ == "__main__":
    method_, workers_, samples_, epochs_ = sys.argv[1:5]
    one(method_, int(workers_), int(samples_), int(epochs_))
