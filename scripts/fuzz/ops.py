"""What a program does to arrays, in whichever of its processes runs it: make,
view, write, describe (the records the two runs compare), and the targets that
Pool and DataLoader workers run. Imports torchshm, so only the program's own
processes import this module."""

import os
import zlib

import numpy as np
import torch
import torch.utils.data

import torchshm

# Note [Records]
# What a receiver records of an array: its type, dtype, shape, whether it is
# writeable and a CRC-32 of its bytes in C order. Not its strides nor whether
# it owns its memory: torchshm keeps a view's strides where pickling makes a
# contiguous copy, on purpose. CRC-32, not blake2b: every array is hashed again
# at every observation point, and zlib's CRC is four times faster (2 ms per 4
# MiB here); the fills below make any two writes differ in every element.

DTYPES = {
    "u1": np.dtype(np.uint8),
    "i4": np.dtype(np.int32),
    "f4": np.dtype(np.float32),
    "f8": np.dtype(np.float64),
    "rec": np.dtype([("i", "<i4"), ("f", "<f8")]),
}


def pattern(shape, dtype, fill):
    """Values that differ from those of any other `fill` in every element."""
    n = int(np.prod(shape, dtype=np.int64))
    base = np.arange(n, dtype=np.uint32) * np.uint32(2654435761)
    base += np.uint32((fill * 40503 + 1) & 0xFFFFFFFF)
    if dtype.names:
        out = np.empty(n, dtype)
        for i, field in enumerate(dtype.names):
            out[field] = (base ^ np.uint32(i * 0x9E3779B9)).astype(dtype[field])
        return out.reshape(shape)
    # uint8 keeps the low byte; fill * 40503 + 1 moves it for consecutive fills.
    return base.astype(dtype).reshape(shape)


def make(how, dtype, shape, order, fill, path=None):
    """A new array: NumPy's memory ("heap"), born in shared memory in a with
    block ("born") or between set_allocator calls ("born_global"), or a file
    mapping ("memmap", at `path`)."""
    dt = DTYPES[dtype]
    if how == "born":
        with torchshm.allocating():
            a = np.empty(shape, dt, order=order)
    elif how == "born_global":
        set_allocator(True)
        try:
            a = np.empty(shape, dt, order=order)
        finally:
            set_allocator(False)
    elif how == "memmap":
        a = np.memmap(path, dt, "w+", shape=tuple(shape), order=order)
    else:
        a = np.empty(shape, dt, order=order)
    a[...] = pattern(a.shape, dt, fill)
    return a


def set_allocator(enabled):
    """torchshm.set_allocator: it works with TORCHSHM_DISABLE=1 too (the
    allocator is not the reducers), and should it ever refuse there, the
    reference run allocates as NumPy does."""
    try:
        torchshm.set_allocator(enabled)
    except RuntimeError:
        if os.environ.get("TORCHSHM_DISABLE") != "1":
            raise


def view(a, how):
    if how == "step2":
        return a[::2]
    if how == "from1":
        return a[1:]
    if how == "rev":
        return a[::-1]
    if how == "T":
        return a.T
    if how == "field":
        return a["f"]
    if how == "reshape":  # of a C-contiguous array only: a view, never a copy
        return a.reshape(2, -1) if a.ndim == 1 else a.reshape(-1)
    raise ValueError(f"no view {how!r}")


def as_array(obj):
    return obj.numpy() if isinstance(obj, torch.Tensor) else obj


def write(obj, fill, part):
    """Writes every element ("all"), the first ("head") or every third row
    ("step3"); works on whatever shape a resize left."""
    a = as_array(obj)
    if a.size == 0:
        return
    if part == "head":
        a[(0,) * a.ndim] = pattern((1,), a.dtype, fill)[0]
        return
    target = a[::3] if part == "step3" else a
    target[...] = pattern(target.shape, a.dtype, fill)


def record(obj):
    """Note [Records]."""
    kind = "Tensor" if isinstance(obj, torch.Tensor) else type(obj).__name__
    a = as_array(obj)
    c = np.ascontiguousarray(a)
    crc = zlib.crc32(c.reshape(-1).view(np.uint8)) if c.size else 0
    shape = "x".join(map(str, a.shape)) or "()"
    return f"{kind} {a.dtype} {shape} w{int(a.flags.writeable)} {crc:08x}"


# ------------------------------------------------------- workers' targets

_buffer = None  # a Pool worker's reused array (one per worker process)


def pool_task(task):
    """A Pool worker's item: a fresh array, or the worker's one reused buffer
    refilled (what a sent array's later writes must never reach)."""
    global _buffer
    nbytes, fill, reuse = task
    if reuse:
        if _buffer is None or _buffer.nbytes != nbytes:
            _buffer = np.empty(nbytes // 4, np.float32)
        a = _buffer
    else:
        a = np.empty(nbytes // 4, np.float32)
    a[...] = pattern(a.shape, a.dtype, fill)
    return a


def identity(item):
    return item


class RefillDataset(torch.utils.data.Dataset):
    """Items of `nbytes`; with `reuse`, each worker refills one buffer for all
    its items. A worker's Queue pickles an item in its feeder thread after
    put() returns, so a refill could race with that in either run: item i
    waits for item i - workers (the worker's previous one) to have arrived
    (acks: one semaphore per worker, released by the loop that reads)."""

    def __init__(self, count, nbytes, fill, reuse, acks):
        self.count, self.nbytes, self.fill, self.reuse = count, nbytes, fill, reuse
        self.acks = acks
        self.buffer = None

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        if not self.reuse:
            a = np.empty(self.nbytes // 4, np.float32)
        else:
            workers = len(self.acks)  # none: a batch is a copy (np.stack)
            if (
                workers
                and i >= workers
                and not self.acks[i % workers].acquire(timeout=60)
            ):
                raise TimeoutError(f"item {i - workers} was not acknowledged")
            if self.buffer is None:
                self.buffer = np.empty(self.nbytes // 4, np.float32)
            a = self.buffer
        a[...] = pattern(a.shape, a.dtype, self.fill + i)
        return a


def atexit_send(queue, sizes, fill):
    """An atexit handler: puts fresh arrays into a Queue and waits for its
    feeder to write them (this runs after multiprocessing's and torchshm's
    exit hooks)."""
    for i, nbytes in enumerate(sizes):
        queue.put([("plain", make("heap", "u1", [nbytes], "C", fill + i))])
    queue.close()
    queue.join_thread()
