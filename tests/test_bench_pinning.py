"""`make bench`'s pinned ping-pong (Note [Pinned ping-pong] in
benchmarks/transports.py): within `pinned()` the receiving thread runs on one
CPU and every thread of every sender on another; after it, both are back
where they were."""

import os

import pytest

from benchmarks import transports
from benchmarks.scenarios.per_item import make_bytes

# the same on every stack: the pip lane only (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.any_stack]


def parse_cpus(text):
    """{0, 1, 4, 5} of "0-1,4-5"."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def allowed(pid):
    """The CPUs each thread of `pid` may run on."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as status:
            for line in status:
                if line.startswith("Cpus_allowed_list:"):
                    found.append(parse_cpus(line.split(":")[1].strip()))
    return found


def test_pinned_puts_the_receiver_and_every_sender_thread_apart_then_back():
    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)
    with transports.Sender("pipe") as sender:
        free = allowed(sender.process.pid)
        with transports.pinned():
            assert len(sender.measure(make_bytes, (1024,), 3)) == 3
            threads = allowed(sender.process.pid)
            if len(cpus) >= 2:
                assert os.sched_getaffinity(0) == {cpus[0]}
                assert threads == [{cpus[1]}] * len(threads)
            else:  # one CPU: nothing to put apart
                assert (os.sched_getaffinity(0), threads) == (mine, free)
        assert os.sched_getaffinity(0) == mine
        assert len(sender.measure(make_bytes, (1024,), 1)) == 1  # follows
        assert all(cpus == free[0] for cpus in allowed(sender.process.pid))
