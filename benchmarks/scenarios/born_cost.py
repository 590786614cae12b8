"""16. What a born-shared allocation costs against NumPy's own (issue 38).

Arrays of 8 B to 16 MiB made with `np.full` (every byte written, as an array
is used) under `torchshm.allocating(min_bytes=1)` against the same with
NumPy's allocator: kept alive (all held until the end: nothing can be
reused) and churned (each freed before the next: the pool reuses). Then
100,000 live 1 KiB arrays under a hard fd limit of 20,000 (a creator keeps
an fd per live segment, up to a quarter of it): how many are born shared,
how many fall back, and the memory they add beside NumPy's own (private RSS
plus the machine's Shmem growth); what an allocation costs once that cap is
reached (it falls back to NumPy); and the memory that slabs kept by a few
live blocks hold (one 1 KiB array in 64 kept: bounded, Note [Small blocks]
in csrc/lifetime/slabs.h). Every (mode, case) runs in a fresh interpreter
(this file), so no pool carries over; medians of 3.
"""

import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

NAME = "born_cost"
KIB, MIB = 1 << 10, 1 << 20
SIZES = (8, 64, KIB, 8 * KIB, 64 * KIB, MIB, 16 * MIB)
QUICK_SIZES = (8, KIB, 64 * KIB, MIB)
MODES = ("numpy", "torchshm")
MANY, MANY_BYTES, MANY_NOFILE = 100_000, KIB, 20_000
# Half-freed slabs: SPARSE arrays of MANY_BYTES, one in SPARSE_KEPT kept.
SPARSE, SPARSE_KEPT = 200_000, 64
DRIVER_TIMEOUT = 600


def count_for(nbytes):
    return 2000 if nbytes <= 64 * KIB else (200 if nbytes <= MIB else 20)


def _shmem():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def _anon():
    """This process's private memory: its RSS counts the shared pages it maps
    too, which Shmem counts already."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def drive(mode, nbytes, count, kind):
    """Seconds per allocation (kind "kept" or "churned"), in this process;
    "many": the live-array figures."""
    if kind in ("many", "at_cap"):
        resource.setrlimit(resource.RLIMIT_NOFILE, (MANY_NOFILE, MANY_NOFILE))
    held = []
    if mode == "torchshm":
        import warnings

        import torchshm

        warnings.simplefilter("ignore")  # the fallback's one warning
        torchshm.set_allocator(True, min_bytes=1)
        np.full(1, 1, np.uint8)  # the session and keeper start here, untimed
        if kind == "at_cap":  # born arrays until one falls back, untimed
            while torchshm.stats()["allocations_fallback"] == 0:
                held.append(np.full(nbytes, 1, np.uint8))
    anon, shmem = _anon(), _shmem()
    t0 = time.perf_counter()
    if kind == "churned":
        for _ in range(count):
            np.full(nbytes, 1, np.uint8)  # freed at once
    elif kind == "sparse":
        for i in range(count):
            a = np.full(nbytes, 1, np.uint8)
            if i % SPARSE_KEPT == 0:
                held.append(a)
    else:
        for _ in range(count):
            held.append(np.full(nbytes, 1, np.uint8))
    seconds = (time.perf_counter() - t0) / count
    out = {"seconds": seconds}
    if kind in ("many", "sparse"):
        out["memory"] = (_anon() - anon) + (_shmem() - shmem)
        if mode == "torchshm":
            out["shared"] = sum(torchshm.is_shared(a) for a in held)
            out["fell_back"] = torchshm.stats()["allocations_fallback"]
    return out


def measure(mode, nbytes, count, kind):
    out = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            mode,
            str(nbytes),
            str(count),
            kind,
        ],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {kind} {nbytes} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick, bar):
    from benchmarks.report import Result, fmt

    sizes, rounds = (QUICK_SIZES, 1) if quick else (SIZES, 3)
    many = 10_000 if quick else MANY
    result = Result(
        NAME,
        "16. Born-shared allocation (allocating(min_bytes=1)) against NumPy's own",
        notes=[" ".join(__doc__.split("\n\n")[1].split())],
    )
    label = {"numpy": "NumPy's allocator", "torchshm": "torchshm, allocator on"}
    bar.reset(total=len(sizes) * 2 * len(MODES) * rounds + 4 + 2 * rounds)
    for nbytes in sizes:
        for kind in ("kept", "churned"):
            case = f"{fmt(nbytes, 'B').replace('.00', '')} {kind}"
            for mode in MODES:
                samples = []
                for _ in range(rounds):
                    samples.append(measure(mode, nbytes, count_for(nbytes), kind))
                    bar.update()
                result.add(case, label[mode], [s["seconds"] for s in samples], 0)
            ours = result.get(case, label["torchshm"])["median"]
            numpy = result.get(case, label["numpy"])["median"]
            result.extra(case, "torchshm / NumPy", ours / numpy)
    case = f"{MANY_BYTES} B at the cap (falls back)"
    for mode in MODES:
        samples = [measure(mode, MANY_BYTES, 2000, "at_cap") for _ in range(rounds)]
        result.add(case, label[mode], [s["seconds"] for s in samples], 0)
        bar.update()
    ours = result.get(case, label["torchshm"])["median"]
    result.extra(
        case, "torchshm / NumPy", ours / result.get(case, label["numpy"])["median"]
    )
    many_case = f"{many:,} live x {MANY_BYTES} B"
    _memory_case(
        result,
        bar,
        label,
        many_case,
        many,
        "many",
        lambda run_: {
            "born shared": run_["shared"],
            "fell back": many - run_["shared"],
        },
    )
    sparse = SPARSE // 10 if quick else SPARSE
    _memory_case(
        result,
        bar,
        label,
        f"{sparse:,} x {MANY_BYTES} B, 1 in {SPARSE_KEPT} kept",
        sparse,
        "sparse",
        lambda run_: {"allocations fell back": run_["fell_back"]},
    )
    return result


def _memory_case(result, bar, label, case, count, kind, extras):
    """One run per mode of a case of MANY_BYTES arrays that reports the
    memory they add; `extras(run)` gives torchshm's other columns."""
    from benchmarks.report import fmt

    for mode in MODES:
        run_ = measure(mode, MANY_BYTES, count, kind)
        bar.update()
        result.add(case, label[mode], [run_["seconds"]], 0)
        result.extra(case, f"memory added ({mode})", fmt(run_["memory"], "B"))
        if mode == "torchshm":
            for name, value in extras(run_).items():
                result.extra(case, name, value)


if __name__ == "__main__":
    print(json.dumps(drive(sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4])))
