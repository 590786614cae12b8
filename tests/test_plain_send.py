"""A plain send is as it was: an array pickled through multiprocessing
without torchshm.share() delivers the bytes it held at the send, and nothing
written afterwards by anyone (the sender, a fork child or the parent that
inherited the same memory, the next item refilled into a reused buffer)
reaches the receiver. share()'s results are shared on purpose, both ways.

Around it, what must not break a process: a fork that ran no Python hook
(its child reads right bytes or faults, never another array's; exits, sends
and says what is wrong), and sends from an atexit handler.

Where the test orders a write after a send, it waits for the receiver's
acknowledgement first (a Queue pickles in its feeder thread after put()
returns), so no outcome depends on timing; every wait is bounded.
"""

import contextlib
import json
import multiprocessing as mp
import os
import signal
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import torchshm
from tests import plain_send_children as kids
from tests.conftest import START_METHODS, TIMEOUT, Child, run_python

# Every test here starts processes: each gets the leak check
# (tests/conftest.py). No lane marker: every lane runs them.
pytestmark = pytest.mark.multiprocess

FORK = mp.get_context("fork")
N = 1 << 17  # float64: 1 MiB, a segment of its own
DRIVER = "import sys; from tests.plain_send_children import main; main(sys.argv[1:])"


def summary(value, n=N, dtype=np.float64):
    """What a receiver reports for an array of n `value`s."""
    return kids.summary(np.full(n, value, dtype))


def born(value):
    """A 1 MiB array of `value` born in shared memory."""
    with torchshm.allocating():
        array = np.full(N, value)
    assert torchshm.is_shared(array)
    return array


@contextlib.contextmanager
def children():
    """start(ctx, target, *args) -> a conftest.Child. On the way out every
    child still open is told to end (None) and joined, killed past TIMEOUT:
    a failed test does not wait for its children's own timeouts."""
    started = []

    def start(ctx, target, *args):
        started.append(Child(ctx, target, *args))
        return started[-1]

    try:
        yield start
    finally:
        for c in started:
            if c.inbox is not None:
                c.send(None)
                c.close()


def end(*started):
    """Tells each child to end; their exit codes."""
    for c in started:
        c.send(None)
    return [c.close() for c in started]


def scenario(name, *args, **env):
    """Runs a driver of tests/plain_send_children.py in a fresh interpreter,
    in a torchshm session of its own, with `env` added to the environment;
    the JSON it printed."""
    environ = dict(os.environ, **env)
    environ.pop("TORCHSHM_SESSION", None)
    run = run_python(DRIVER, name, *args, env=environ)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


# ------------------------------------------ 1-2. born memory across a fork
# Each scenario returns what was seen and the children's exit codes: its
# arrays and children are gone by the time the test asserts, so that a
# failure does not leave them to the leak check.


def fork_child_writes(ctx):
    with children() as start:
        receiver = start(ctx, kids.hold)
        a = born(1.0)
        child = start(FORK, kids.keep_inherited, a, None)
        receiver.send(a)
        seen = {"receiver at arrival": receiver.receive()}
        child.send(("fill", 2.0))  # the send is done: the receiver acked
        seen["child's own"] = child.receive()
        seen["parent's own"] = kids.summary(a)
        receiver.send("look")
        (seen["receiver after"],) = receiver.receive()
        return seen, end(receiver, child)


def test_a_fork_childs_write_after_the_parents_send_reaches_no_receiver(ctx):
    """A fork child's born memory is its own copy-on-write, as NumPy memory
    is: its write reaches neither the receiver nor its parent."""
    seen, exitcodes = fork_child_writes(ctx)
    assert seen == {
        "receiver at arrival": summary(1.0),
        "child's own": summary(2.0),
        "parent's own": summary(1.0),
        "receiver after": summary(1.0),
    }
    assert exitcodes == [0, 0]


def parent_writes_after_child_sent(ctx):
    with children() as start:
        receiver = start(ctx, kids.hold)
        a = born(1.0)
        child = start(FORK, kids.keep_inherited, a, receiver.inbox)
        child.send("send")
        seen = {"receiver at arrival": receiver.receive()}
        a[...] = 2.0  # the send is done: the receiver acked
        receiver.send("look")
        (seen["receiver after"],) = receiver.receive()
        child.send("look")
        seen["child's own"] = child.receive()
        return seen, end(receiver, child)


def test_the_parents_write_after_a_fork_child_sent_reaches_no_receiver(ctx):
    seen, exitcodes = parent_writes_after_child_sent(ctx)
    assert seen == {
        "receiver at arrival": summary(1.0),
        "receiver after": summary(1.0),
        "child's own": summary(1.0),
    }
    assert exitcodes == [0, 0]


def test_two_arrays_over_one_segment_through_two_mappings_arrive_as_two():
    # Found by `make fuzz` (seed 1474355747): the child's inherited born
    # array and the same bytes received back are two memories there, sent
    # in one message; the receiver, which rebuilds a message's references to
    # one segment over one mapping, got them as one.
    with children() as start:
        a = born(1.0)
        child = start(FORK, kids.send_back_beside_inherited, a)
        child.send(a)
        inherited, received, shared_there = child.receive()
        inherited[...] = 8.0
        seen = (shared_there, np.shares_memory(inherited, received))
        seen += (kids.summary(received), kids.summary(a))
        del inherited, received
        exitcode = end(child)
    assert seen == (False, False, summary(1.0), summary(1.0))
    assert exitcode == [0]


def test_a_share_results_read_only_array_and_its_writable_one_are_both_references():
    """share() maps a read-only array's bytes privately and the rest of its
    segment shared: two memories over different bytes, which a receiver's
    one mapping keeps apart. A pandas frame's index codes are such arrays."""
    kept = np.full(N, 2.0)
    kept.flags.writeable = False
    writable, read_only = torchshm.share((np.full(N, 1.0), kept))
    before = torchshm.stats()["bytes_copied"]
    got = ForkingPickler.loads(ForkingPickler.dumps((writable, read_only)))
    assert torchshm.stats()["bytes_copied"] == before
    assert [kids.summary(a) for a in got] == [summary(1.0), summary(2.0)]
    assert np.shares_memory(got[0], writable) and np.shares_memory(got[1], read_only)
    assert not got[1].flags.writeable


# ------------------------------------------------- 3. slab blocks reused

# Arrays of 16 KiB and more are born in the workers, 32 KiB ones carved
# from a slab (Note [Small blocks] in csrc/lifetime/slabs.h).
SLABS = {"TORCHSHM_THRESHOLD": "16384"}


def blocks(values):
    return [summary(v, kids.SLAB_BLOCK, np.uint8) for v in values]


@pytest.mark.parametrize("method", START_METHODS)
def test_a_dataloader_workers_refilled_buffer_arrives_as_each_item_was(method):
    """Each item as it arrived, not item i + 1: the worker's result queue
    pickles in its feeder thread while the worker refills the buffer, so
    what an item holds at its send may be a later item's, torchshm or not;
    after the send nothing changes it."""
    result = scenario("dataloader_epoch", method, "12", **SLABS)
    assert len(result["arrived"]) == 12
    assert result["after"] == result["arrived"]


@pytest.mark.parametrize("method", START_METHODS)
def test_a_pool_workers_reused_array_arrives_as_each_result_was(method):
    result = scenario("pool_results", method, "20", **SLABS)
    assert result == {"after": blocks(range(20))}


# ------------------------------------- 4. share() beside a plain send


def share_beside_a_plain_send(ctx):
    with children() as start:
        shared_to, plain_to = start(ctx, kids.hold), start(ctx, kids.hold)
        a = born(1.0)
        b = torchshm.share(a)
        shared_to.send(b)
        plain_to.send(a)
        seen = {"arrivals": [shared_to.receive(), plain_to.receive()]}
        shared_to.send(("fill", 7.0))
        seen["shared receiver's write"] = shared_to.receive()
        seen["sender's share() result"] = kids.summary(b)
        plain_to.send("look")
        (seen["plain receiver"],) = plain_to.receive()
        b[...] = 5.0
        shared_to.send("look")
        (seen["shared receiver after the sender's write"],) = shared_to.receive()
        plain_to.send("look")
        (seen["plain receiver at the end"],) = plain_to.receive()
        return seen, end(shared_to, plain_to)


def test_share_is_shared_both_ways_and_a_plain_send_of_the_same_memory_is_not(
    ctx,
):
    seen, exitcodes = share_beside_a_plain_send(ctx)
    assert seen == {
        "arrivals": [summary(1.0), summary(1.0)],
        "shared receiver's write": summary(7.0),
        "sender's share() result": summary(7.0),
        "plain receiver": summary(1.0),
        "shared receiver after the sender's write": summary(5.0),
        "plain receiver at the end": summary(1.0),
    }
    assert exitcodes == [0, 0]


# ------------------------------------------ 5. a fork that ran no hook


def raw_fork(case):
    return scenario("raw_fork", case)


def test_a_raw_fork_child_reads_its_inherited_arrays_right_or_faults():
    """After a new allocation as large as they are, which may land where
    their mappings were: right bytes, or SIGSEGV, never the new bytes."""
    result = raw_fork("a")
    lines = result["lines"]
    assert lines[:1] == [{"allocated": kids.FILLER}], result
    reads = lines[1:]
    assert all(r["wrong"] == 0 for r in reads), result  # 0x77 bytes or others
    if result["status"] != -signal.SIGSEGV:
        assert result["status"] == 0 and len(reads) == 2, result


def test_a_raw_fork_child_drops_a_received_array_and_exits_cleanly():
    """Its exit runs the interpreter's whole shutdown, torchshm's exit hook
    included, over memory it does not map."""
    result = raw_fork("b")
    assert result["status"] == 0, result


def test_a_raw_fork_childs_send_of_a_heap_array_arrives():
    result = raw_fork("c")
    assert result["status"] == 0, result
    assert result["arrived"] == [N, summary(3.0)], result


def test_share_in_a_raw_fork_child_says_what_went_wrong():
    result = raw_fork("d")
    assert result["status"] == 0, result
    (line,) = result["lines"]
    assert line["raised"] == "RuntimeError", result
    message = line["message"]
    assert "fork" in message.lower(), result
    # ... and what to do instead.
    assert any(w in message for w in ("os.fork", "multiprocessing", "exec")), result


# ------------------------------------------------- 6. an atexit sender


def receive_from_an_atexit_sender():
    forkserver = mp.get_context("forkserver")
    outbox = forkserver.Queue()
    receiver = forkserver.Process(
        target=kids.receive_from_atexit_sender, args=(outbox,)
    )
    receiver.start()
    try:
        result = outbox.get(timeout=TIMEOUT)  # it waits 45 s at most
        receiver.join(TIMEOUT)
    finally:
        if receiver.is_alive():
            receiver.kill()
            receiver.join(TIMEOUT)
        outbox.close()
        outbox.join_thread()
    exitcode = receiver.exitcode
    receiver.close()
    return result, exitcode


def test_arrays_sent_from_an_atexit_handler_arrive():
    """A spawn child's atexit handler runs after multiprocessing's and
    torchshm's exit hooks; what it sends arrives, and the receiver does not
    blame the sender for lacking torchshm. The receiver is a forkserver
    child: its torchshm is fresh, so that warning (given once per process)
    has not been given yet, and its torch is the fork server's."""
    result, exitcode = receive_from_an_atexit_sender()
    expected = [[N, summary(float(i))] for i in range(kids.ATEXIT_ARRAYS)]
    assert result["arrived"] == expected, result
    assert result["exitcode"] == 0, result
    blame = [w for w in result["warnings"] if "import" in w]
    assert not blame, result
    assert exitcode == 0
