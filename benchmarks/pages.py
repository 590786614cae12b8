"""What a page costs: the mechanisms behind scenario 14 (a model to many
workers), one figure each, medians of `--rounds` (default 5).

    python -m benchmarks.pages            # fill, map, resend, stale
    python -m benchmarks.micro pages      # the same

- fill: n bytes into a fresh memfd, by pwrite() against memcpy into a fresh
  MAP_SHARED mapping, and against memcpy into one already faulted in (the
  pool's reuse); by size, to show the crossover. Beside them, torchshm's send
  of a fresh array into a fresh segment (both of the first two ways at once:
  Note [Filling a fresh segment] in csrc/lifetime/fresh_pages.cpp) and
  torch's share_memory_() of a tensor of the same bytes.
- map: a child maps 512 MiB of existing shmem pages read-only, MAP_PRIVATE and
  MAP_SHARED read-write and sums them (each mapping fresh: the page faults
  are the cost).
- resend: torchshm's ForkingPickler.dumps of a fresh 512 MiB array (a copy)
  against the same array sent again unchanged (a comparison with its
  snapshot: Note [Resending an unchanged array] in csrc/send/snapshots.h).
- stale: what workers read of an array changed between two calls, through
  joblib's `Parallel` (one context, auto-memmapping) and through torchshm (a
  pool's tasks): joblib knows an array by its identity and sends it once.
"""

import mmap
import os
import statistics
import sys
import time

import numpy as np

MIB = 1 << 20


def _median(fn, rounds):
    samples = []
    for _ in range(rounds):
        samples.append(fn())
    return statistics.median(samples)


FILLS = ("pwrite", "memcpy, fresh", "memcpy, mapped", "torchshm", "torch")


def _fresh_fill(nbytes, how, src):
    if how == "torchshm":
        return _torchshm_fresh_send(src)
    if how == "torch":
        return _torch_share(src)
    fd = os.memfd_create("torchshm-bench-pages", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        t0 = time.perf_counter()
        if how == "pwrite":
            view, done = memoryview(src).cast("B"), 0
            while done < nbytes:
                done += os.pwrite(fd, view[done:], done)
        else:
            with mmap.mmap(fd, nbytes) as m:
                dest = np.frombuffer(m, np.uint8)
                if how == "memcpy, mapped":  # fault every page in first
                    dest[:: mmap.PAGESIZE] = 1
                    t0 = time.perf_counter()
                dest[:] = src
                del dest
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _timed_dumps(array):
    """Seconds of torchshm's ForkingPickler.dumps of `array`."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torchshm  # noqa: F401 - its reducers pickle the array

    t0 = time.perf_counter()
    data = ForkingPickler.dumps(array)
    elapsed = time.perf_counter() - t0
    pickle.loads(data)  # claims the ticket, outside the clock
    return elapsed


def _torchshm_fresh_send(src):
    """torchshm's send of a copy of `src` (a new array: no snapshot to
    compare with) into a fresh segment (none pooled)."""
    import torchshm

    array = src.copy()
    torchshm.trim()
    return _timed_dumps(array)


def _torch_share(src):
    """torch's share_memory_() of a tensor over a copy of `src`."""
    import torch

    tensor = torch.from_numpy(src.copy())
    t0 = time.perf_counter()
    tensor.share_memory_()
    return time.perf_counter() - t0


def fill(sizes=(64 << 10, MIB, 16 * MIB, 128 * MIB, 512 * MIB), rounds=5):
    print(
        "fill a fresh memfd (s, median; the ways in turn, each round):"
        " " + " | ".join(FILLS)
    )
    for n in sizes:
        src = np.ones(n, np.uint8)
        samples = {how: [] for how in FILLS}
        for _ in range(rounds):
            for how in FILLS:
                samples[how].append(_fresh_fill(n, how, src))
        row = [statistics.median(samples[how]) for how in FILLS]
        print(
            f"  {n >> 10:>8} KiB  "
            + "  ".join(f"{t:.5f}" for t in row)
            + f"   torchshm/torch {row[3] / row[4]:.2f}"
            + f"   torchshm/pwrite {row[3] / row[0]:.2f}"
        )


def _map_and_sum(fd, nbytes, how):
    flags, prot = {
        "read-only": (mmap.MAP_SHARED, mmap.PROT_READ),
        "MAP_PRIVATE": (mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE),
        "MAP_SHARED read-write": (mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
    }[how]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a fresh address space: every page faults once
        t0 = time.perf_counter()
        with mmap.mmap(fd, nbytes, flags=flags, prot=prot) as m:
            np.frombuffer(m, np.uint64)[:: mmap.PAGESIZE // 8].sum()
            os.write(write, repr(time.perf_counter() - t0).encode())
        os._exit(0)
    os.close(write)
    elapsed = float(os.read(read, 64))
    os.close(read)
    os.waitpid(pid, 0)
    return elapsed


def map_kinds(nbytes=512 * MIB, rounds=5):
    fd = os.memfd_create("torchshm-bench-pages", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.pwrite(fd, np.ones(nbytes, np.uint8), 0)
        print(
            f"map {nbytes >> 20} MiB of existing shmem pages and read them"
            " (s, median):"
        )
        for how in ("read-only", "MAP_PRIVATE", "MAP_SHARED read-write"):
            t = _median(lambda: _map_and_sum(fd, nbytes, how), rounds)
            print(f"  {how:<22} {t:.4f}")
    finally:
        os.close(fd)


def resend(nbytes=512 * MIB, rounds=5):
    import torchshm

    first, again = [], []
    for _ in range(rounds):
        torchshm.trim()  # no pooled segment: the first send is a fresh one
        array = np.ones(nbytes // 8)
        first.append(_timed_dumps(array))
        again.append(_timed_dumps(array))
        del array
    stats = torchshm.stats()
    print(
        f"send {nbytes >> 20} MiB through torchshm (s, median): a fresh array"
        f" {statistics.median(first):.4f}, the same array again"
        f" {statistics.median(again):.4f}"
        f" (snapshots_resent {stats['snapshots_resent']})"
    )


def _first_element(array):
    return float(array[0])


def stale(nbytes=32 * MIB):
    """Prints what 2 workers read of a[0] before and after `a[0] = 7`."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import torchshm  # noqa: F401 - registers the reducers for the pool

    # Above joblib's max_nbytes (1 MB), and a segment of its own for torchshm:
    # the unchanged-resend path.
    array = np.zeros(nbytes // 8)
    seen = {}
    try:
        from joblib import Parallel, delayed

        with Parallel(n_jobs=2) as parallel:
            calls = [delayed(_first_element)(array) for _ in range(2)]
            before = parallel(calls)
            array[0] = 7
            seen["joblib Parallel"] = (before, parallel(calls))
        array[0] = 0
    except ImportError:
        print("stale: joblib is not installed; torchshm only")
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        before = list(pool.map(_first_element, [array] * 2))
        array[0] = 7
        seen["torchshm"] = (before, list(pool.map(_first_element, [array] * 2)))
    for who, (before, after) in seen.items():
        print(f"stale: {who}: workers read a[0] {before}, after a[0] = 7: {after}")


def main(only=()):
    rounds = 5
    if not only or "fill" in only:
        fill(rounds=rounds)
    if not only or "map" in only:
        map_kinds(rounds=rounds)
    if not only or "resend" in only:
        resend(rounds=rounds)
    if not only or "stale" in only:
        stale()


if __name__ == "__main__":
    main(sys.argv[1:])
