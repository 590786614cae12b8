"""In-process micro-benchmarks behind figures quoted in torchshm's code comments.

    python -m benchmarks.micro

1. Copying into already-mapped shared memory with 1, 2 and 4 threads
   (`torchshm._config.copy_threads()` picks the default from this).
2. torchshm's overhead below the threshold: `ForkingPickler` round trips of
   one array with and without torchshm registered (the per-item scenario
   measures the same through processes, where noise hides microseconds).
3. The sender path of a fresh array at the threshold (256 KiB): the time the
   reducer, and the whole dumps, take above the copy itself; and
   (`crossings`) the calls between Python and C++ per array, both ways, for
   each kind of memory the sender's plan tells apart.
4. Below the threshold through a Queue to another process: 20,000 x 1 KiB,
   one per message, and 1000 x 4 KiB in one message, against plain pickling
   in the same run (rounds alternate).
5. `containers` and `strings` (benchmarks/objects.py): reading a record of a
   SharedList against a plain list and where the time goes; string columns
   pickled, packed per string, and joined into one buffer.
"""

import multiprocessing as mp
import statistics
import sys
import threading
import time
import timeit
from multiprocessing.reduction import ForkingPickler

import numpy as np

import torchshm
from torchshm import _C
from torchshm._lifetime import segments as _segments

MIB = 1 << 20


def copy_speed(sizes=(256 * MIB, 400_000_000, 512 * MIB), threads=(1, 2, 4)):
    for nbytes in sizes:
        source = np.ones(nbytes, np.uint8)
        target = _segments.allocate(nbytes)
        _C.testing.copy_extent(source, target, 0, 2)  # map and fault the pages in once
        for n in threads:
            best = min(
                _timed(lambda: _C.testing.copy_extent(source, target, 0, n))
                for _ in range(4)
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


class _Crossings:
    """Counts calls from Python into the native module while active, in the
    thread that entered: module functions and classes through every torchshm
    module's `_C` name, and the methods and properties of its classes. Calls
    from native code (pickle's C implementation calling a native reducer) are
    not crossings."""

    def __init__(self):
        self.count = 0
        self._undo = []

    def __enter__(self):
        counter = self
        # Only this thread's: the expiry timer calls _C in its own.
        thread = threading.get_ident()

        def counted(fn):
            def call(*args, **kwargs):
                if threading.get_ident() == thread:
                    counter.count += 1
                return fn(*args, **kwargs)

            return call

        class Proxy:
            def __getattr__(self, name):
                value = getattr(_C, name)
                if callable(value) and not isinstance(value, type):
                    return counted(value)
                return value

        proxy = Proxy()
        for name, module in list(sys.modules.items()):
            if name.startswith("torchshm.") and getattr(module, "_C", None) is _C:
                self._undo.append((module, "_C", _C))
                module._C = proxy
        for cls in [v for v in vars(_C).values() if isinstance(v, type)]:
            if issubclass(cls, BaseException):
                continue
            for name, value in list(vars(cls).items()):
                if name.startswith("__") and name != "__init__":
                    continue
                if isinstance(value, property):
                    wrapped = property(counted(value.fget))
                elif isinstance(value, staticmethod):
                    wrapped = staticmethod(counted(value.__func__))
                elif callable(value):
                    wrapped = counted(value)
                else:
                    continue
                self._undo.append((cls, name, value))
                setattr(cls, name, wrapped)
        return self

    def __exit__(self, *exc):
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)


def sender_path(nbytes=256 << 10, number=2000):
    """_C crossings and time above the copy for a fresh array at the threshold.

    Every message is loaded back (in process) so that its ticket is claimed
    and its segment goes back to the pool, as a receiver would make it."""
    from torchshm import _config

    threads = _config.copy_threads()
    arrays = [np.full(nbytes, i, np.uint8) for i in range(8)]
    reducer = ForkingPickler._extra_reducers[np.ndarray]
    for a in arrays:  # warm the pool
        ForkingPickler.loads(ForkingPickler.dumps(a))

    target = _segments.allocate(nbytes)
    _C.testing.copy_extent(arrays[0], target, 0, threads)
    a = arrays[0]
    # Alternating repeats, so that drift on a shared machine hits both alike.
    copies, reduces = [], []
    for _ in range(11):
        copies.append(
            timeit.timeit(
                lambda: _C.testing.copy_extent(a, target, 0, threads), number=number
            )
        )
        reduces.append(timeit.timeit(lambda: reducer(a), number=number))
    copy, reduce_time = min(copies), min(reduces)
    round_trip = min(
        timeit.repeat(
            lambda: ForkingPickler.loads(ForkingPickler.dumps(a)),
            number=number,
            repeat=7,
        )
    )
    us = 1e6 / number

    def dumps_only():
        """dumps alone (reducer, ticket, pickling); each message is loaded
        outside the clock, so that its segment goes back to the pool."""
        spent = 0.0
        for _ in range(number):
            start = time.perf_counter()
            data = ForkingPickler.dumps(a)
            spent += time.perf_counter() - start
            ForkingPickler.loads(data)
        return spent

    dumps_time = min(dumps_only() for _ in range(7))
    # For scale: ForkingPickler's own cost per dumps, and plain pickling.
    empty = min(
        timeit.repeat(lambda: ForkingPickler.dumps(()), number=number, repeat=7)
    )
    with torchshm.disabled():
        plain = min(
            timeit.repeat(lambda: ForkingPickler.dumps(a), number=number, repeat=7)
        )
    print(
        f"sender, fresh {nbytes >> 10} KiB array: copy {copy * us:.2f} us,"
        f" reducer {reduce_time * us:.2f} us"
        f" (overhead above the copy {(reduce_time - copy) * us:.2f} us);"
        f" whole dumps {dumps_time * us:.2f} us (above the copy"
        f" {(dumps_time - copy) * us:.2f} us, ticket and pickling included);"
        f" dumps + loads in process {round_trip * us:.2f} us;"
        f" for scale, dumps of () {empty * us:.2f} us and plain pickling"
        f" of the array {plain * us:.2f} us"
    )

    # Per array in one message of 8 fresh arrays (the message holds a chunk
    # already for all but the first), against the same 8 copies alone.
    region = _segments.allocate(len(arrays) * nbytes)
    step = nbytes

    def copies():
        for i, x in enumerate(arrays):
            _C.testing.copy_extent(x, region, i * step, threads)

    def one_message():
        results = [reducer(x) for x in arrays]
        del results

    copies()
    per = len(arrays) * number // 8
    copies_time = min(timeit.repeat(copies, number=number // 8, repeat=7)) / per
    message_time = min(timeit.repeat(one_message, number=number // 8, repeat=7)) / per
    print(
        f"sender, {len(arrays)} fresh {nbytes >> 10} KiB arrays in one message,"
        f" per array: copy {copies_time * 1e6:.2f} us, reducer"
        f" {message_time * 1e6:.2f} us (overhead above the copy"
        f" {(message_time - copies_time) * 1e6:.2f} us)"
    )


def crossings(nbytes=256 << 10, n=8):
    """Calls between Python and C++ per array at or above the threshold, both
    ways (Note [The seam] in torchshm/_native.py), for each kind of memory
    the plan tells apart (Note [Sender plan]): ForkingPickler.dumps of a
    one-array message, and the same message sent through a Pipe (the
    transport's per-message calls, Note [One message, one snapshot])."""
    import torch
    from torch.multiprocessing import get_sharing_strategy, set_sharing_strategy

    def fresh(i):
        return np.full(nbytes, i, np.uint8)

    def received(i):
        return ForkingPickler.loads(ForkingPickler.dumps(fresh(i)))

    def torch_owned(i):
        return torch.full((nbytes,), i, dtype=torch.uint8).numpy()

    def torch_shared(i):
        return torch.full((nbytes,), i, dtype=torch.uint8).share_memory_().numpy()

    kinds = [
        ("fresh array (copied)", fresh, None),
        ("received array (in a segment: by reference)", received, None),
        ("over a torch tensor, file_descriptor (copied)", torch_owned, None),
        (
            "over a shared tensor, file_system (torch's reducer)",
            torch_shared,
            "file_system",
        ),
    ]
    print(f"crossings per array, {nbytes >> 10} KiB, mean of {n} one-array messages:")
    print(
        f"  {'memory':52s} {'dumps Py->C++':>13s} {'C++->Py':>8s}"
        f" {'Pipe.send Py->C++':>18s} {'C++->Py':>8s}"
    )
    previous = get_sharing_strategy()
    for label, make, strategy in kinds:
        if strategy:
            set_sharing_strategy(strategy)
        try:
            arrays = [make(i) for i in range(n)]
            ForkingPickler.loads(ForkingPickler.dumps(make(n)))  # warm the pool
            counts = [0, 0, 0, 0]
            reader, writer = mp.Pipe(duplex=False)
            for a in arrays:
                _C.testing.reset_hook_calls()
                with _Crossings() as c:
                    data = ForkingPickler.dumps(a)
                counts[0] += c.count
                counts[1] += _C.testing.hook_calls()
                if strategy is None:
                    ForkingPickler.loads(data)
                _C.testing.reset_hook_calls()
                with _Crossings() as c:
                    writer.send(a)
                counts[2] += c.count
                counts[3] += _C.testing.hook_calls()
                del data
                reader.recv()
            reader.close()
            writer.close()
        finally:
            set_sharing_strategy(previous)
        print(
            f"  {label:52s} {counts[0] / n:13.2f} {counts[1] / n:8.2f}"
            f" {counts[2] / n:18.2f} {counts[3] / n:8.2f}"
        )


def _drain(queue, done):
    import torchshm  # noqa: F401 - the receiver as a user's would be

    while True:
        count = queue.get()
        if count is None:
            return
        for _ in range(count):
            queue.get()
        done.put(True)


def below_threshold(rounds=21):
    """Ratios torchshm / plain pickling through a Queue, in one run."""
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_drain, args=(queue, done), daemon=True)
    child.start()
    try:
        cases = {
            "20000 x 1 KiB, one per message": (
                [np.full(1024, i % 256, np.uint8) for i in range(20_000)],
                False,
            ),
            "1000 x 4 KiB in one message": (
                [np.full(4096, i % 256, np.uint8) for i in range(1000)],
                True,
            ),
        }
        for label, (items, one_message) in cases.items():
            times = {"torchshm": [], "plain": []}

            def run():
                start = time.perf_counter()
                if one_message:
                    queue.put(1)
                    queue.put(items)
                else:
                    queue.put(len(items))
                    for item in items:
                        queue.put(item)
                done.get(timeout=600)
                return time.perf_counter() - start

            for r in range(rounds + 1):
                order = ("torchshm", "plain") if r % 2 else ("plain", "torchshm")
                for method in order:
                    if method == "plain":
                        with torchshm.disabled():
                            t = run()
                    else:
                        t = run()
                    if r:  # round 0 warms up
                        times[method].append(t)
            mine = statistics.median(times["torchshm"])
            plain = statistics.median(times["plain"])
            print(
                f"{label}: torchshm {mine * 1e3:.1f} ms, plain {plain * 1e3:.1f} ms,"
                f" ratio {mine / plain:.3f} (median of {rounds})"
            )
    finally:
        queue.put(None)
        child.join(30)
        if child.is_alive():
            child.kill()


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    only = sys.argv[1:]
    if not only or "copy" in only:
        copy_speed()
    if not only or "inline" in only:
        inline_overhead()
    if not only or "sender" in only:
        sender_path()
    if not only or "crossings" in only or "sender" in only:
        crossings()
    if not only or "below" in only:
        below_threshold()
    if not only or "containers" in only or "strings" in only:
        from benchmarks import objects

        if not only or "containers" in only:
            objects.container_access()
        if not only or "strings" in only:
            objects.string_columns()
    if not only or "pages" in only:
        from benchmarks import pages

        pages.main()
