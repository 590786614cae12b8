"""Child-process targets, at module top level: spawn and forkserver import them."""

import numpy as np

import torchshm

# Every wait here is bounded: a child whose parent failed or died raises
# queue.Empty and exits non-zero (the child fixture checks exit codes), never
# blocks forever. Longer than conftest.TIMEOUT, so the parent fails first.
TIMEOUT = 120


def echo(inbox, outbox):
    """Sends back whatever arrives, until None."""
    while (obj := inbox.get(timeout=TIMEOUT)) is not None:
        outbox.put(obj)


def fill_received(inbox, outbox):
    """Writes `value` into every array received, reports, and waits to be told
    to exit (so the parent checks the writes while the child still maps them)."""
    arrays, value = inbox.get(timeout=TIMEOUT)
    for a in arrays:
        a[...] = value
    outbox.put([torchshm.is_shared(a) for a in arrays])
    inbox.get(timeout=TIMEOUT)


def send_built(inbox, outbox, builder):
    """Builds arrays here, sends them, and exits right away."""
    from tests import cases

    outbox.put(getattr(cases, builder)())


def share_then_check(inbox, outbox):
    """Shares an array, sends it, waits for the parent to write 7s into it."""
    shared = torchshm.share(np.zeros((300, 400), dtype=np.float32)[:, ::-1])
    outbox.put(shared)
    inbox.get(timeout=TIMEOUT)
    outbox.put(bool((shared == 7).all()))


def alias_check(inbox, outbox):
    """Writes through one received view and reads through the others."""
    base, reversed_view, transposed = inbox.get(timeout=TIMEOUT)
    base[0, 0] = -1
    outbox.put(
        [reversed_view[-1, -1] == -1, transposed[0, 0] == -1, torchshm.is_shared(base)]
    )


def send_fresh_each_round(inbox, outbox, rounds, n):
    """Sends a fresh n-element array each round after the parent acks the last;
    finally reports its stats."""
    a = np.zeros(n)
    for i in range(rounds):
        a[:] = i
        outbox.put(a)
        inbox.get(timeout=TIMEOUT)
    outbox.put(torchshm.stats())


def hold_inherited(inbox, outbox, inherited):
    """A fork child keeps an inherited array while the parent reuses its pool."""
    inbox.get(timeout=TIMEOUT)  # the parent has dropped its copy and churned its pool
    outbox.put(bool((inherited == 3).all()))


def make_array(n):
    """A Pool task: a fresh array, sent back through the worker's pool."""
    return np.full(n, 5.0)
