"""Child targets for test_lifetime.py (module top level: spawn imports them)."""

import os
import pickle
import sys
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

import torchshm
from torchshm import _C

TIMEOUT = 120  # longer than the tests' own: the parent fails first


def load_and_hold(data, outbox, release):
    """Loads message bytes, reports what it sees, and holds the result until
    `release` is set; then checks the data never changed under it."""
    array = pickle.loads(data)
    outbox.put((float(array[0]), float(array[-1]), torchshm.is_shared(array)))
    release.wait(60)
    outbox.put((float(array[0]), float(array[-1])))


def make_segments_and_wait(outbox, count, nbytes):
    """Creates `count` segments that only this process holds, reports their
    names, and waits to be killed."""
    held = [
        torchshm.share(np.full(nbytes // 8, i, dtype=np.float64)) for i in range(count)
    ]
    names = sorted({_C.segment_of(a.base).name for a in held})
    outbox.put(names)
    time.sleep(120)


def pool_square(x):
    return x * x


def copy_under_thread_limit(nbytes):
    """Run as an unprivileged user: caps this user's threads at what exists,
    so that no copy thread can start, then copies with 4 threads asked."""
    import resource

    import torch

    # Everything that may start a thread of its own (torch's OpenMP pool)
    # runs before the limit; then only torchshm's copy threads are asked for.
    torch.set_num_threads(1)
    src = np.arange(nbytes, dtype=np.uint8)
    dest = torch.zeros(nbytes, dtype=torch.int8)
    expected = dest.numpy().view(np.uint8)
    uid = os.getuid()
    tasks = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                st = os.stat(f"/proc/{pid}")
                if st.st_uid == uid:
                    tasks += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
    _C.testing.copy_extent(src, dest, 0, 4)
    ok = bool(np.array_equal(expected, src))
    print("ok" if ok else "mismatch", flush=True)


if __name__ == "__main__":
    copy_under_thread_limit(int(sys.argv[1]))


def send_and_idle(inbox, outbox, n):
    """Sends one fresh array (its pool keeps the segment once the parent
    drops it), then stays quiet until told to exit."""
    outbox.put(np.full(n, 4.0))
    inbox.get(timeout=120)


class Items:
    """A map-style dataset of fresh 1 MiB arrays."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return np.full(1 << 17, float(i))


def put_and_exit(queue, n):
    queue.put(np.full(n, 6.0))


def fanout_receiver(queue, outbox, start, pause, count):
    """Reads `count` (i, table) messages once `start` is set, `pause` seconds
    apart, dropping each after checking it: every message needs its own
    ticket (this process does not keep the table mapped)."""
    start.wait(120)
    got, bad = [], 0
    for _ in range(count):
        i, table = queue.get(timeout=120)
        tensor = isinstance(table, torch.Tensor)
        shared = table.is_shared() if tensor else torchshm.is_shared(table)
        bad += not (shared and table[i % len(table)] == i % len(table))
        got.append(i)
        del table
        if pause:
            time.sleep(pause)
    outbox.put((sorted(got), bad))


class _Stall:
    """Pickled after an array in the same message: says so, then never
    returns, so the message's ticket stays "being written" before its pipe
    is named (Note [One message, one snapshot] in csrc/send/message.h)."""

    def __init__(self, ready):
        self.ready = ready

    def __reduce__(self):
        self.ready.put("pickling")
        time.sleep(120)
        raise AssertionError("not killed")


def send_and_exit(conn, nbytes):
    conn.send(np.full(nbytes // 8, 1.0))


def create_and_wait(outbox, count, nbytes, with_messages):
    """Creates `count` segments one after the other (each registration is a
    message to the keeper, queued if it is stopped), reports their names (and
    a message naming each), and waits to be killed."""
    held = [
        torchshm.share(np.full(nbytes // 8, i, dtype=np.float64)) for i in range(count)
    ]
    names = [_C.segment_of(a.base).name for a in held]
    messages = [bytes(ForkingPickler.dumps(a)) for a in held] if with_messages else []
    outbox.put((names, messages))
    time.sleep(120)


def load_and_report(data, outbox):
    """Loads message bytes and reports the value it carries (or the error)."""
    try:
        array = pickle.loads(data)
        outbox.put(float(array[-1]))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outbox.put(repr(exc))


def send_stalled(conn, nbytes, ready):
    """Sends an array and a _Stall in one message: dies while pickling."""
    conn.send([np.full(nbytes // 8, 1.0), _Stall(ready)])


def send_then_wait(conn, nbytes, value, ready):
    """Sends one array through `conn` (blocking while its pipe is full), says
    so, and waits to be killed."""
    ready.put("sending")
    conn.send(np.full(nbytes // 8, float(value)))
    ready.put("sent")
    time.sleep(120)


def report_id_and_wait(inbox, outbox):
    """Says its torchshm process id (whose lock file says it lives) and waits."""
    outbox.put(_C.process_id())
    inbox.get(timeout=TIMEOUT)
