"""Child processes of tests/test_allocator.py (importable under spawn)."""

import numpy as np

import torchshm
from tests.conftest import TIMEOUT

MIN_BYTES = 1 << 16


def born_sender(inbox, outbox, n):
    """Makes an array with the allocator on (as a Pool initializer or a
    worker hook would turn it on), sends it, then writes to it."""
    torchshm.set_allocator(True, min_bytes=MIN_BYTES)
    before = torchshm.stats()
    a = np.arange(n, dtype=np.float64)
    outbox.put(a)
    assert inbox.get(timeout=TIMEOUT) == "write"
    a[:10] = -1.0  # after the send: the parent must not see this
    outbox.put(("written", bool((a[:10] == -1).all())))
    assert inbox.get(timeout=TIMEOUT) == "stats"
    after = torchshm.stats()
    outbox.put({k: after[k] - before[k] for k in after if k != "fallbacks"})


def holder(inbox, outbox):
    """Holds what it receives until told to drop it; reports its contents."""
    held = inbox.get(timeout=TIMEOUT)
    outbox.put(float(held.min()))
    assert inbox.get(timeout=TIMEOUT) == "check"
    outbox.put((float(held.min()), float(held.max())))
    assert inbox.get(timeout=TIMEOUT) == "drop"
    del held
    outbox.put("dropped")


def pool_make(n):
    """A Pool task: an array made in the worker, and whether it was born."""
    a = np.full(n, 7, dtype=np.int32)
    return a, torchshm.is_shared(a)


class BornItems:
    """A map-style dataset whose items say whether the worker made them in
    shared memory, and how many bytes its sends copied so far."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        a = np.full(200_000, i, dtype=np.float32)
        return a, torchshm.is_shared(a), torchshm.stats()["bytes_copied"]


def born_sample(i):
    """A torchdata map function: an array made in the worker, and whether the
    worker's allocator put it in shared memory."""
    a = np.full(200_000, i, dtype=np.float32)
    return i, a, torchshm.is_shared(a)


def write_inherited(inbox, outbox, array):
    """A forked child writes to a born array it inherited, and reads it."""
    array[:5] = 42.0
    outbox.put(("written", float(array[:10].max())))
    assert inbox.get(timeout=TIMEOUT) == "exit"


def small_born_sender(inbox, outbox, n):
    """Sends a small born array (threshold 0), then writes to it: the
    receiver got a copy (a block of a slab is never frozen)."""
    torchshm.set_threshold(0)
    torchshm.set_allocator(True, min_bytes=1)
    before = torchshm.stats()
    a = np.arange(n, dtype=np.float64)
    outbox.put(a)
    assert inbox.get(timeout=TIMEOUT) == "write"
    a[:10] = -1.0
    outbox.put("written")
    assert inbox.get(timeout=TIMEOUT) == "stats"
    after = torchshm.stats()
    outbox.put({k: after[k] - before[k] for k in after if k != "fallbacks"})


def echo(inbox, outbox):
    """Sends back what it receives, lets go of it, and says so."""
    torchshm.set_threshold(0)
    got = inbox.get(timeout=TIMEOUT)
    outbox.put(got)
    del got
    assert inbox.get(timeout=TIMEOUT) == "dropped?"
    outbox.put("dropped")


def carve_after_fork(inbox, outbox, n, count):
    """A forked child makes small born arrays while its parent does the
    same: neither may carve the other's bytes."""
    with torchshm.allocating(min_bytes=1):
        made = [np.full(n, 3.0) for _ in range(count)]
    outbox.put("made")
    assert inbox.get(timeout=TIMEOUT) == "check"
    outbox.put(all((a == 3.0).all() for a in made))


def small_born_send_then(outbox, n, then):
    """Sends a small born array, then exits ("exit") or waits to be killed."""
    import time

    torchshm.set_threshold(0)
    torchshm.set_allocator(True, min_bytes=1)
    outbox.put(np.arange(n, dtype=np.float64))
    if then == "wait":
        time.sleep(TIMEOUT)


def slab_then_idle(inbox, outbox):
    """Sends a small born array, lets go of it when told, then idles: its
    empty slab must go back on the expiry timer alone."""
    torchshm.set_threshold(0)
    torchshm.set_allocator(True, min_bytes=1)
    a = np.full(100, 5.0)
    outbox.put(a)
    assert inbox.get(timeout=TIMEOUT) == "drop"
    del a
    outbox.put("dropped")
    assert inbox.get(timeout=TIMEOUT) == "exit"
