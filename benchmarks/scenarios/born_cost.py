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
in csrc/lifetime/slabs.h). Last, a DataLoader worker's Dataset that caches
1 GiB of decoded 300 KiB samples, with the allocator on as the DataLoader
hook turns it on (arrays from the threshold up born shared): the memory it
adds (PSS), and, under the usual soft fd limit of 1024 (hard 20,000), the
highest fd a pipe it opens then gets and whether select() takes it (Note
[Kept fds above select's range] in csrc/lifetime/segment.h). Every (mode,
case) runs in a fresh interpreter (this file), so no pool carries over;
medians of 3.
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
# A worker's cache: CACHE_BYTES of CACHE_ITEM samples, the usual fd limits.
CACHE_BYTES, CACHE_ITEM, CACHE_NOFILE = 1 << 30, 300 * KIB, (1024, 20_000)


def count_for(nbytes):
    return 2000 if nbytes <= 64 * KIB else (200 if nbytes <= MIB else 20)


def _kib_field(path, field):
    """A `field: N kB` line of a /proc file, in bytes (0 if absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _shmem():
    return _kib_field("/proc/meminfo", "Shmem")


def _anon():
    """This process's private memory: its RSS counts the shared pages it maps
    too, which Shmem counts already."""
    return _kib_field("/proc/self/status", "RssAnon")


def _pss():
    return _kib_field("/proc/self/smaps_rollup", "Pss")


def _select_a_new_pipe():
    """(the fd a new pipe's read end gets, whether select() takes it)."""
    import select

    r, w = os.pipe()
    try:
        select.select([r], [], [], 0)
        return r, True
    except ValueError:
        return r, False
    finally:
        os.close(r)
        os.close(w)


def drive(mode, nbytes, count, kind):
    """Seconds per allocation (kind "kept" or "churned"), in this process;
    "many": the live-array figures; "cache": a worker's cache."""
    if kind in ("many", "at_cap"):
        resource.setrlimit(resource.RLIMIT_NOFILE, (MANY_NOFILE, MANY_NOFILE))
    if kind == "cache":
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        soft, cap = CACHE_NOFILE
        cap = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, cap))
    held = []
    if mode == "torchshm":
        import warnings

        import torchshm

        warnings.simplefilter("ignore")  # the fallback's one warning
        # A worker's hook turns it on at the threshold (the DataLoader's).
        torchshm.set_allocator(True, **({} if kind == "cache" else {"min_bytes": 1}))
        np.full(1, 1, np.uint8)  # the session and keeper start here, untimed
        if kind == "at_cap":  # born arrays until one falls back, untimed
            while torchshm.stats()["allocations_fallback"] == 0:
                held.append(np.full(nbytes, 1, np.uint8))
    anon, shmem, pss = _anon(), _shmem(), _pss()
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
    if kind == "cache":
        out["pss"] = _pss() - pss
        out["pipe fd"], out["select ok"] = _select_a_new_pipe()
        if mode == "torchshm":
            out["shared"] = sum(torchshm.is_shared(a) for a in held)
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
    bar.reset(total=len(sizes) * 2 * len(MODES) * rounds + 6 + 2 * rounds)
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
    _cache_case(result, bar, label, CACHE_BYTES // (8 if quick else 1), rounds)
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


def _cache_case(result, bar, label, nbytes, rounds):
    """A worker's cache of `nbytes` in CACHE_ITEM samples: seconds per
    sample, the PSS it adds, and what a pipe opened after it gets."""
    from benchmarks.report import fmt

    count = nbytes // CACHE_ITEM
    case = f"a worker caching {fmt(nbytes, 'B')} of {fmt(CACHE_ITEM, 'B')}"
    pss = {}
    for mode in MODES:
        samples = [measure(mode, CACHE_ITEM, count, "cache") for _ in range(rounds)]
        bar.update()
        result.add(case, label[mode], [s["seconds"] for s in samples], 0)
        pss[mode] = sorted(s["pss"] for s in samples)[len(samples) // 2]
        result.extra(case, f"PSS added ({mode})", fmt(pss[mode], "B"))
        result.extra(case, f"a new pipe's fd ({mode})", samples[-1]["pipe fd"])
        result.extra(
            case, f"select() takes it ({mode})", all(s["select ok"] for s in samples)
        )
        if mode == "torchshm":
            result.extra(case, "born shared", samples[-1]["shared"])
    result.extra(case, "PSS torchshm / NumPy", pss["torchshm"] / pss["numpy"])


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
