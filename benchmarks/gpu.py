"""Batches to the GPU by worker count (the device script's scenario).

    python -m benchmarks.gpu --out DIR [--workers 1,4,14] [--samples 2048]
    python -m benchmarks.gpu --out DIR --fake   # on a CPU: the fake runtime

A DataLoader over 1 MiB float32 samples (views of a 16-sample pool: a
sample costs nothing to make), batch 32, persistent fork workers, each
batch copied to the GPU and checksummed there (the sum of every sample,
compared with the pool's at the end). Every (method, workers) runs in a
fresh interpreter, so that torch's own path never sees torchshm:

- torch pin_memory: no torchshm; the default collate, pin_memory=True
  (torch's pin thread copies each batch into pinned memory), then
  batch.to(device, non_blocking=True);
- torchshm unpinned: torchshm with TORCHSHM_PIN_BYTES=0; the default
  collate (batches made in torchshm's memory), batch.to(device,
  non_blocking=True) from pageable memory;
- torchshm pinned: the same with pin_memory=True: torchshm pins each batch
  where it lies, and the pin thread copies nothing;
- torchshm.device_loader: torchshm.collate NumPy batches, copied by
  torchshm.device_loader (pinned in place, one copy per batch).

Reported per epoch (median of the timed epochs after a warm-up one): GB/s of
samples to the GPU, the main process's CPU milliseconds per batch (its pin
thread included), and whether every checksum was right. Writes gpu.json and
gpu.md into DIR. With --fake (no GPU) only the torchshm.device_loader method
runs, through the fake CUDA runtime: the harness and its checksums are what
is exercised then (tests/test_device_script.py), not speed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPE = (256, 1024)  # 1 MiB of float32
BATCH = 32
POOL = 16
METHODS = ("torch_pin", "torchshm_unpinned", "torchshm_pinned", "device_loader")
NAMES = {
    "torch_pin": "torch pin_memory",
    "torchshm_unpinned": "torchshm unpinned",
    "torchshm_pinned": "torchshm pinned",
    "device_loader": "torchshm.device_loader",
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="folder for gpu.json and gpu.md")
    parser.add_argument(
        "--workers",
        type=_counts,
        default=None,
        help="worker counts, comma-separated (default: 1, 4 and the cores less 2)",
    )
    parser.add_argument("--samples", type=int, default=2048, help="per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs")
    parser.add_argument(
        "--methods",
        type=lambda text: text.split(","),
        default=list(METHODS),
        help="comma-separated: " + ", ".join(METHODS),
    )
    parser.add_argument(
        "--fake", action="store_true", help="the fake CUDA runtime, on a CPU"
    )
    args = parser.parse_args(argv)
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))}")
    if args.workers is None:
        args.workers = default_workers(os.cpu_count() or 1)
    if args.fake:
        args.methods = ["device_loader"]
    return args


def _counts(text):
    counts = [int(n) for n in text.split(",")]
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"expected counts such as 1,4,14; got {text}")
    return counts


def default_workers(cores):
    """1, 4 and the cores less 2 (the issue's counts), without repeats."""
    return sorted({1, min(4, max(1, cores - 2)), max(1, cores - 2)})


# --- one run, in a fresh interpreter


def expected_sums():
    """Each pool sample's sum, as the checksums compute it."""
    import torch

    pool = _pool()
    return torch.from_numpy(pool).reshape(POOL, -1).sum(1, dtype=torch.float64)


def _pool():
    import numpy as np

    return np.random.default_rng(0).random((POOL, *SHAPE), dtype=np.float32)


def one(method, workers, samples, epochs, fake=False):
    """Runs a method and returns its figures (see the module's docstring)."""
    if method == "torchshm_unpinned":
        os.environ["TORCHSHM_PIN_BYTES"] = "0"
    import torch
    import torch.utils.data as tud

    if method != "torch_pin":
        import torchshm
    if fake:
        from torchshm._cuda import fake as _fake
        from torchshm._cuda import runtime as _runtime

        runtime = _fake.FakeRuntime(delay=0.002)
        _runtime.install(runtime)  # for the whole run
        device = "cuda"
    else:
        runtime = None
        device = torch.device("cuda", torch.cuda.current_device())
        torch.zeros(1, device=device)  # the context, before the workers fork

    pool = _pool()

    class Samples(tud.Dataset):
        def __len__(self):
            return samples

        def __getitem__(self, i):
            return pool[i % POOL]

    numpy_batches = method == "device_loader"
    loader = tud.DataLoader(
        Samples(),
        batch_size=BATCH,
        num_workers=workers,
        collate_fn=torchshm.collate if numpy_batches else None,
        pin_memory=method in ("torch_pin", "torchshm_pinned"),
        multiprocessing_context="fork" if workers else None,
        persistent_workers=workers > 0,
    )

    def batches(loader):
        if numpy_batches:
            yield from torchshm.device_loader(loader, device)
        else:
            for batch in loader:
                yield batch.to(device, non_blocking=True)

    sums, seconds, cpu, count = [], [], 0.0, 0
    for epoch in range(epochs + 1):  # the first starts the workers
        start, used = time.perf_counter(), time.process_time()
        for batch in batches(loader):
            if runtime is not None:
                runtime.synchronize()  # the fake's device: copies done
            sums.append(batch.reshape(BATCH, -1).sum(1, dtype=torch.float64))
            count += epoch > 0
        if runtime is None:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if epoch > 0:
            cpu += time.process_time() - used
    want = expected_sums().to(sums[0].device)
    per_epoch = samples // BATCH
    wrong = 0
    for b, got in enumerate(sums):
        first = (b % per_epoch) * BATCH
        indices = [(first + k) % POOL for k in range(BATCH)]
        wrong += not torch.allclose(got, want[indices], rtol=1e-5)
    del loader
    if method == "torch_pin" and "torchshm" in sys.modules:
        raise RuntimeError("torch's own path ran with torchshm imported")
    figures = {
        "seconds": seconds[1:],
        "cpu_per_batch": cpu / max(count, 1),
        "batches": len(sums),
        "wrong": wrong,
    }
    if method != "torch_pin":
        from torchshm._lifetime import pins

        figures["pinned_bytes"] = pins.pinned_bytes()
    return figures


def measure(method, workers, samples, epochs, fake=False):
    """one() in a fresh interpreter; raises with its stderr if it fails."""
    # The file, not the module: importing the benchmarks package imports
    # torchshm (other scenarios do), whose reducers would then carry torch's.
    command = [sys.executable, os.path.abspath(__file__), "--one", method]
    command += [str(workers), str(samples), str(epochs)] + (["fake"] if fake else [])
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(run.stderr.strip()[-600:] or f"exit {run.returncode}")
    return json.loads(lines[-1])


# --- the table


def summarize(runs, samples):
    """Rows of the table from {(method, workers): figures or an error}."""
    epoch_bytes = samples * SHAPE[0] * SHAPE[1] * 4
    rows = []
    for (method, workers), got in sorted(runs.items(), key=lambda kv: kv[0][1]):
        if "error" in got:
            rows.append({"workers": workers, "method": method, "error": got["error"]})
            continue
        median = statistics.median(got["seconds"])
        rows.append(
            {
                "workers": workers,
                "method": method,
                "gbps": epoch_bytes / median / 1e9,
                "cpu_ms": got["cpu_per_batch"] * 1e3,
                "checksums": "all right"
                if got["wrong"] == 0
                else f"{got['wrong']} WRONG",
                "pinned_bytes": got.get("pinned_bytes"),
            }
        )
    return rows


def table(rows):
    """The rows as a markdown table, with each method's ratio to torch's."""
    torch_gbps = {
        r["workers"]: r["gbps"]
        for r in rows
        if r["method"] == "torch_pin" and "gbps" in r
    }
    lines = [
        "| workers | method | GB/s to the GPU | / torch pin_memory"
        " | main CPU ms per batch | checksums |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = NAMES[r["method"]]
        if "error" in r:
            lines.append(
                f"| {r['workers']} | {name} | failed: {r['error'][:120]} | | | |"
            )
            continue
        base = torch_gbps.get(r["workers"])
        ratio = f"{r['gbps'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['workers']} | {name} | {r['gbps']:.2f} | {ratio} | {r['cpu_ms']:.2f}"
            f" | {r['checksums']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    for workers in args.workers:
        for method in args.methods:
            try:
                runs[(method, workers)] = measure(
                    method, workers, args.samples, args.epochs, args.fake
                )
            except Exception as exc:  # noqa: BLE001 - the table shows it
                runs[(method, workers)] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"gpu: {method}, {workers} workers: done", flush=True)
    rows = summarize(runs, args.samples)
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump({"samples": args.samples, "batch": BATCH, "rows": rows}, f, indent=1)
    text = table(rows)
    with open(os.path.join(args.out, "gpu.md"), "w") as f:
        f.write(text)
    print(text)
    return 1 if any("error" in r or r["checksums"] != "all right" for r in rows) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        method_, workers_, samples_, epochs_ = sys.argv[2:6]
        figures_ = one(
            method_, int(workers_), int(samples_), int(epochs_), "fake" in sys.argv[6:]
        )
        print(json.dumps(figures_))
    else:
        sys.exit(main())
