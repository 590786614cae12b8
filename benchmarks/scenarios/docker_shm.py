"""12. Docker's 64 MiB /dev/shm: the DataLoader of issue 20 in a private
64 MiB /dev/shm, against the same run in an 8 GiB one.

Each run is a child (benchmarks/docker_loader.py) in a mount namespace of its
own with a tmpfs of that size on /dev/shm, as a container has; the two sizes
alternate, so that both see the same machine. Rows: torchshm.collate,
np.stack through torchshm's reducer, torch's default_collate (its tensors are
shared through /dev/shm) without and with torchshm's tensor switch, the same
for torch tensor samples, and plain pickling; then samples carrying a torch
tensor beside the array, with torchshm and with TORCHSHM_DISABLE=1.
Needs root (a mount namespace and a mount); without it, says so and skips.
"""

import json
import os
import shutil
import subprocess
import sys

from benchmarks import peers
from benchmarks.report import Result

NAME = "docker_shm"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = {"64 MiB /dev/shm": "64m", "8 GiB /dev/shm": "8g"}


def cannot_run():
    if os.geteuid() != 0:
        return "needs root (a private mount namespace with a tmpfs on /dev/shm)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        return "unshare -m is not permitted here"
    return None


def child(method, size, samples, epochs):
    """One run in a private /dev/shm of `size`: docker_loader's JSON."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TORCHSHM_SESSION", None)  # a session of its own, in that /dev/shm
    if method.endswith("_disabled"):
        env["TORCHSHM_DISABLE"] = "1"
    command = [
        "unshare",
        "-m",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"',
        "sh",
        sys.executable,
        "-m",
        "benchmarks.docker_loader",
        method,
        str(samples),
        str(epochs),
    ]
    try:
        run = subprocess.run(
            command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
        )
        out = run.stdout.strip().splitlines()
        if run.returncode == 0 and out:
            return json.loads(out[-1])
        error = f"exit status {run.returncode}: {run.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired:
        error = "timed out"
    return {"method": method, "completed": False, "error": error, "epochs": []}


def run(quick, bar):
    samples, epochs = (32, 2) if quick else (128, 4)
    repeats = {
        "torchshm_collate": 3,
        "torchshm": 3,
        "torch": 1,
        "torch_tensors": 2,
        "tensor_samples": 1,
        "tensor_samples_tensors": 2,
        "pipe": 1,
    }
    if peers.enabled():
        repeats["grain"] = 2
    if quick:
        repeats = dict.fromkeys(repeats, 1)
    result = Result(
        NAME,
        f"12. Docker's 64 MiB /dev/shm: DataLoader, {samples} samples of 2 MiB,"
        " batch 8, 4 spawn workers, prefetch 2",
        notes=[
            "Epoch time, median [min-max] of epochs 2.. over all runs (the first"
            " epoch starts the workers); the two /dev/shm sizes alternate."
            " torchshm's segments are memfds, so /dev/shm bounds only torch's"
            " own tensors (the 'torch' and 'tensor_samples' rows, and the"
            " tensors of the mixed rows); '_tensors' rows have the tensor"
            " switch on (TORCHSHM_TENSORS=1); 'grain' is Grain's own DataLoader"
            " (4 workers, Batch(8)), its batches SharedMemoryArrays in /dev/shm.",
        ],
    )
    why_not = cannot_run()
    if why_not:
        result.notes.append(f"Skipped: {why_not}.")
        return result
    bar.reset(total=2 * sum(repeats.values()) + 2)
    for method, count in repeats.items():
        runs = {label: [] for label in SIZES}
        for _ in range(count):
            for label, size in SIZES.items():
                runs[label].append(child(method, size, samples, epochs))
                bar.update()
        for label, done in runs.items():
            seconds = [s for r in done if r.get("completed") for s in r["epochs"][1:]]
            if seconds:
                result.add(method, label, seconds, warmup=0)
            completed = sum(bool(r.get("completed")) for r in done)
            result.extra(method, f"completed ({label})", f"{completed}/{len(done)}")
            warned = sorted({w for r in done for w in r.get("warnings", [])})
            if warned:
                result.notes.append(f"{method}, {label}: warned {warned}")
            for r in done:
                if not r.get("completed"):
                    if completed == 0:  # a failed run, marked in the figure
                        result.fail(method, label, f"{label}: {r.get('error')}")
                    else:
                        result.notes.append(f"{method}, {label}: {r.get('error')}")
                    break
        both = [result.get(method, label) for label in SIZES]
        if all(both):
            result.extra(
                method, "64 MiB / 8 GiB", both[0]["median"] / both[1]["median"]
            )
    for method in ("mixed_torchshm", "mixed_disabled"):
        r = child(method, SIZES["64 MiB /dev/shm"], samples, epochs)
        bar.update()
        label = "with torchshm" if method == "mixed_torchshm" else "TORCHSHM_DISABLE=1"
        case = f"array + tensor, {label}"
        if r.get("completed"):
            result.add(case, "64 MiB /dev/shm", r["epochs"][1:], warmup=0)
        result.extra(case, "batches (64 MiB)", r.get("batches", 0))
        if not r.get("completed"):
            result.notes.append(f"{case}: {r.get('error')}")
    peers.note_versions(result, list(repeats))
    result.summary = {
        "ratio_64mib_vs_8gib": {
            m: result.extras.get(m, {}).get("64 MiB / 8 GiB") for m in repeats
        }
    }
    return result
