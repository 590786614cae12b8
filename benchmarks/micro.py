"""In-process micro-benchmarks behind figures quoted in torchshm's code comments.

    python -m benchmarks.micro

1. Copying into already-mapped shared memory with 1, 2 and 4 threads
   (`torchshm._config.copy_threads()` picks the default from this).
2. torchshm's overhead below the threshold: `ForkingPickler` round trips of
   one array with and without torchshm registered (the per-item scenario
   measures the same through processes, where noise hides microseconds).
"""

import time
import timeit
from multiprocessing.reduction import ForkingPickler

import numpy as np

import torchshm
from torchshm import _C, _segments

MIB = 1 << 20


def copy_speed(sizes=(256 * MIB, 400_000_000, 512 * MIB), threads=(1, 2, 4)):
    for nbytes in sizes:
        source = np.ones(nbytes, np.uint8)
        target = _segments.allocate(nbytes)
        _C.copy_extent(source, target, 0, 2)  # map and fault the pages in once
        for n in threads:
            best = min(
                _timed(lambda: _C.copy_extent(source, target, 0, n)) for _ in range(4)
            )
            print(
                f"copy {nbytes / MIB:6.0f} MiB, {n} thread(s): {best * 1e3:6.1f} ms"
                f" = {nbytes / best / 1e9:5.1f} GB/s"
            )


def inline_overhead(sizes_kib=(4, 32, 64, 128), number=5000):
    for kib in sizes_kib:
        array = np.ones(kib << 10, np.uint8)

        def round_trip():
            ForkingPickler.loads(ForkingPickler.dumps(array))

        with_torchshm = min(timeit.repeat(round_trip, number=number, repeat=5))
        with torchshm.disabled():
            plain = min(timeit.repeat(round_trip, number=number, repeat=5))
        print(
            f"round trip {kib:4d} KiB: torchshm {with_torchshm / number * 1e6:6.1f} us,"
            f" plain pickle {plain / number * 1e6:6.1f} us"
            f" (threshold {torchshm.get_threshold() >> 10} KiB)"
        )


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    copy_speed()
    inline_overhead()
