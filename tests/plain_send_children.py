"""Children and driver scenarios for tests/test_plain_send.py (importable
under spawn and forkserver).

The children hold what they are sent or inherit and report summaries of it
on request (receive_from_atexit_sender reports once). The drivers run a
scenario in a process of their own (`python -c "from
tests.plain_send_children import main; main(argv)"`, with the environment
the test chose) and print one JSON object.
"""

import atexit
import ctypes
import gc
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import warnings
import zlib

import numpy as np
import torch.utils.data

import torchshm

# Longer than the test's own waits (tests/conftest.py's TIMEOUT), so that the
# test fails first; a child whose parent died raises queue.Empty and ends.
TIMEOUT = 120
# The drivers' own waits: the test's subprocess timeout is longer.
DRIVER_TIMEOUT = 60
SLAB_BLOCK = 32 << 10  # a slab block at TORCHSHM_THRESHOLD=16384 (up to 64 KiB)
RAW_BYTES = 4 << 20  # the raw fork's arrays and the child's new allocation
FILLER = 0x77  # what the raw fork child's new allocation holds


def summary(array):
    """[min, max, CRC-32 of the bytes]: what an array holds, comparable and
    JSON-able."""
    return [float(array.min()), float(array.max()), zlib.crc32(array)]


def hold(inbox, outbox):
    """Holds every array it receives and acks each with its summary; on
    ("fill", value) writes value into the last one and acks with its summary;
    on "look" reports the summaries of all it holds; on None ends."""
    held = []
    while (message := inbox.get(timeout=TIMEOUT)) is not None:
        if isinstance(message, np.ndarray):
            held.append(message)
            outbox.put(summary(message))
        elif message == "look":
            outbox.put([summary(a) for a in held])
        else:
            held[-1][...] = message[1]
            outbox.put(summary(held[-1]))


def keep_inherited(inbox, outbox, array, peer):
    """A fork child with an inherited array: on ("fill", value) writes it and
    reports its summary; on "send" puts it into `peer` (a receiver's inbox);
    on "look" reports its summary; on None ends."""
    while (message := inbox.get(timeout=TIMEOUT)) is not None:
        if message == "send":
            peer.put(array)
        elif message == "look":
            outbox.put(summary(array))
        else:
            array[...] = message[1]
            outbox.put(summary(array))


def send_back_beside_inherited(inbox, outbox, array):
    """A fork child with an inherited born array: receives the same array
    from its parent, sends both back in one message, and waits to end."""
    got = inbox.get(timeout=TIMEOUT)
    outbox.put((array, got, np.shares_memory(array, got)))
    assert inbox.get(timeout=TIMEOUT) is None


# ------------------------------------------------------- slab blocks reused


class RefilledBuffer(torch.utils.data.Dataset):
    """Item i is one 32 KiB buffer, made in the worker on its first item
    (born there: the DataLoader's workers allocate with torchshm's
    allocator), refilled with i + 1 for every item."""

    def __init__(self, n):
        self.n = n
        self.buffer = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.buffer is None:
            self.buffer = np.empty(SLAB_BLOCK, np.uint8)
        self.buffer[...] = i + 1
        return self.buffer


def dataloader_epoch(method, n="12"):
    """A DataLoader epoch over RefilledBuffer: each item's summary as it
    arrived and again once the epoch is over."""
    loader = torch.utils.data.DataLoader(
        RefilledBuffer(int(n)),
        batch_size=None,
        num_workers=1,
        multiprocessing_context=method,
        timeout=DRIVER_TIMEOUT,
        collate_fn=torchshm.convert,  # NumPy stays NumPy
    )
    items, arrived = [], []
    for item in loader:
        items.append(item)
        arrived.append(summary(item))
    return {"arrived": arrived, "after": [summary(a) for a in items]}


_reused = None  # refill()'s one array, per worker


def refill(value):
    """A Pool task: returns one module-level 32 KiB array, made on the first
    call (born: the initializer turned the allocator on), filled with
    `value`."""
    global _reused
    if _reused is None:
        _reused = np.empty(SLAB_BLOCK, np.uint8)
    _reused[...] = value
    return _reused


def pool_results(method, n="20"):
    """Pool(1) of born allocation, one result per message: each result's
    summary once all have arrived."""
    ctx = mp.get_context(method)
    with ctx.Pool(1, initializer=torchshm.set_allocator, initargs=(True,)) as pool:
        # chunksize=1: a chunk's results are one message, in which the same
        # array returned twice is pickled once, with or without torchshm.
        results = pool.map_async(refill, range(int(n)), chunksize=1).get(DRIVER_TIMEOUT)
    return {"after": [summary(a) for a in results]}


# ---------------------------------------------------------------- raw fork


def send_one(q, value):
    """Sends one RAW_BYTES array of `value` and ends."""
    q.put(np.full(RAW_BYTES, value, np.uint8))


def _raw_child(case, born, received, conn, out):
    """The child of a fork that ran no Python hook: reports lines on fd
    `out`, then ends (os._exit, or sys.exit for case "b")."""

    def report(**fields):
        os.write(out, (json.dumps(fields) + "\n").encode())

    if case == "a":
        # A new allocation as large as the inherited arrays, then reads of
        # them: the new one may land where their mappings were.
        filler = np.full(RAW_BYTES, FILLER, np.uint8)
        report(allocated=int(filler[0]))
        for name, array, value in (("born", born, 0x11), ("received", received, 0x22)):
            wrong, new = int((array != value).sum()), int((array == FILLER).sum())
            report(name=name, wrong=wrong, filler=new)
    elif case == "b":
        del received
        gc.collect()
        sys.exit(0)  # the interpreter's whole exit: atexit hooks, finalizers
    elif case == "c":
        conn.send(np.full(1 << 17, 3.0))  # 1 MiB of NumPy's own memory
    elif case == "d":
        try:
            torchshm.share(np.ones(10**6))
            report(raised=None)
        except Exception as exc:  # what it raises is under test
            report(raised=type(exc).__name__, message=str(exc))
    os._exit(0)


def _arrival(conn):
    """[size, summary] of the array that arrives on `conn`, or "EOF"."""
    try:
        got = conn.recv()
    except EOFError:  # the child is gone without sending
        return "EOF"
    return [int(got.size), summary(got)]


def raw_fork(case):
    """A process holding a born array (0x11) and a received one (0x22) forks
    through libc (no Python at-fork hook runs: PyDLL keeps the GIL, so no
    other thread of this process can hold it in the child); the child runs
    `case` of _raw_child. Returns its exit status (negative: the signal),
    its report lines and, for case "c", what arrived from it."""
    # Born first: its segment is mapped highest of the three, so the gap the
    # fork leaves tops out there, and mmap() places a new mapping at the top
    # of the highest gap that fits: the child's 4 MiB allocation lands over
    # the born array (the received one lies lower).
    with torchshm.allocating():
        born = np.full(RAW_BYTES, 0x11, np.uint8)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    sender = ctx.Process(target=send_one, args=(q, 0x22))
    sender.start()
    received = q.get(timeout=DRIVER_TIMEOUT)
    sender.join(DRIVER_TIMEOUT)
    # No child of multiprocessing's left alive: the raw child's exit must not
    # try to join its parent's children.
    assert sender.exitcode == 0, sender.exitcode
    q.close()
    q.join_thread()
    assert torchshm.is_shared(born) and torchshm.is_shared(received)
    conn_r, conn_w = ctx.Pipe(duplex=False)
    out_r, out_w = os.pipe()
    pid = ctypes.PyDLL(None).fork()
    if pid == 0:  # never returns
        _raw_child(case, born, received, conn_w, out_w)
    os.close(out_w)
    conn_w.close()  # EOF on conn_r once the child is gone
    arrived = None
    deadline = time.monotonic() + DRIVER_TIMEOUT
    status = None
    while status is None:
        if case == "c" and arrived is None and conn_r.poll(0.01):
            arrived = _arrival(conn_r)  # read while it sends: a pipe holds 64 KiB
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.01)
    if case == "c" and arrived is None and conn_r.poll(1):
        arrived = _arrival(conn_r)
    lines = b""
    while chunk := os.read(out_r, 1 << 16):
        lines += chunk
    os.close(out_r)
    return {
        "status": status,
        "lines": [json.loads(x) for x in lines.decode().splitlines()],
        "arrived": arrived,
    }


# ---------------------------------------------------------- atexit sender

ATEXIT_ARRAYS = 6


def send_at_exit(q):
    """Registers an atexit handler that puts ATEXIT_ARRAYS 1 MiB arrays into
    `q` and waits until they are in the pipe; then returns, so the handler
    runs once the child's exit has begun (after multiprocessing's and
    torchshm's exit hooks)."""

    def at_exit():
        for i in range(ATEXIT_ARRAYS):
            q.put(np.full(1 << 17, i, float))
        q.close()
        q.join_thread()

    atexit.register(at_exit)


def receive_from_atexit_sender(outbox, wait=45):
    """Starts a spawn child that sends from its atexit handler (send_at_exit)
    and reports what arrived within `wait` seconds, the RuntimeWarnings seen
    here meanwhile and the child's exit code. Not a daemon: it has a child."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=send_at_exit, args=(q,))
    child.start()
    arrived = []
    deadline = time.monotonic() + wait
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                for _ in range(ATEXIT_ARRAYS):
                    a = q.get(timeout=max(0.1, deadline - time.monotonic()))
                    arrived.append([int(a.size), summary(a)])
                    del a
            except queue.Empty:
                pass
        child.join(max(1.0, deadline - time.monotonic()))
    finally:
        if child.is_alive():
            child.kill()
            child.join(TIMEOUT)
    outbox.put(
        {
            "arrived": arrived,
            "warnings": [
                str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)
            ],
            "exitcode": child.exitcode,
        }
    )


SCENARIOS = {
    "dataloader_epoch": dataloader_epoch,
    "pool_results": pool_results,
    "raw_fork": raw_fork,
}


def main(argv):
    print(json.dumps(SCENARIOS[argv[0]](*argv[1:])), flush=True)
