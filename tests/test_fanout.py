"""One shared object named by more messages in flight than anything else
holds (Note [Segment lifetime] in csrc/lifetime/segment.h): none is lost, whatever the
fan-out, and every slot comes back."""

import fcntl
import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

import torchshm
from tests import lifetime_children
from tests.conftest import TIMEOUT
from torchshm import _C
from torchshm._compat import int8_tensor_over, untyped_storage

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_os]

F_SETPIPE_SZ = 1031
IN_FLIGHT = 10_000
QUEUES = 4


def _roomy(queue):
    """A queue whose pipe holds 1 MiB: thousands of small messages wait in it
    pickled, each holding its ticket (a Queue pickles only what its pipe
    takes)."""
    fcntl.fcntl(queue._writer.fileno(), F_SETPIPE_SZ, 1 << 20)
    return queue


def shared_table(kind):
    """(a table in a segment, that segment): an array, or a tensor born there."""
    if kind == "array":
        table = torchshm.share(np.arange(100_000.0))
        return table, _C.segment_of(_C.memory_owner(table))
    table = torchshm.empty(100_000, dtype=torch.float64)
    table.copy_(torch.arange(100_000.0, dtype=torch.float64))
    return table, _C.segment_of(int8_tensor_over(untyped_storage(table)))


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("kind", ["array", "tensor"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_ten_thousand_messages_in_flight_naming_one_segment_all_arrive(method, kind):
    ctx = mp.get_context(method)
    table, segment = shared_table(kind)
    holders = segment.holders
    queues = [_roomy(ctx.Queue()) for _ in range(QUEUES)]
    outbox, start = ctx.Queue(), ctx.Event()
    per_queue = IN_FLIGHT // QUEUES
    # Two slow receivers and two fast ones, none reading before all is sent.
    pauses = [0.0005, 0.0, 0.0005, 0.0]
    receivers = [
        ctx.Process(
            target=lifetime_children.fanout_receiver,
            args=(q, outbox, start, pause, per_queue),
        )
        for q, pause in zip(queues, pauses)
    ]
    for p in receivers:
        p.start()
    try:
        for i in range(IN_FLIGHT):
            queues[i % QUEUES].put((i, table))
        # Every message pickled and in its pipe, holding a ticket.
        deadline = time.monotonic() + TIMEOUT
        while segment.holders < holders + IN_FLIGHT:
            assert time.monotonic() < deadline, segment.holders
            time.sleep(0.05)
        assert not segment.pinned  # 10,000 fit the slots
        start.set()
        results = [outbox.get(timeout=4 * TIMEOUT) for _ in receivers]
    finally:
        start.set()
        for p in receivers:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT)
    assert [p.exitcode for p in receivers] == [0] * QUEUES
    got = sorted(i for ids, _ in results for i in ids)
    assert got == list(range(IN_FLIGHT)), "a message was lost"
    assert sum(bad for _, bad in results) == 0
    # Every ticket was claimed, and every receiver let go.
    assert segment.holders == holders
    for q in queues:
        q.close()
        q.join_thread()
