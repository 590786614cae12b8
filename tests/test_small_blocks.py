"""Small born arrays carved from shared slabs (issue 38, Note [Small blocks]
in csrc/lifetime/slabs.h): no segment each, sent by reference like any born array, and
no byte handed out twice while anything may still read it."""

import gc
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

import torchshm
from tests import allocator_children
from tests.conftest import TIMEOUT, session_segments, stats_delta
from tests.test_allocator import roundtrip, segment_of
from tests.test_lifetime import wait_until
from torchshm import _C

pytestmark = pytest.mark.multiprocess

SMALL = 100  # float64: 800 B, a small block
PER_SLAB = _C.SLAB_BYTES // (SMALL * 8)


def extents(arrays):
    return sorted(
        (_C.testing.data_address(a), _C.testing.data_address(a) + a.nbytes)
        for a in arrays
    )


def test_small_arrays_share_a_slab_and_never_overlap():
    before = torchshm.stats()
    with torchshm.allocating(min_bytes=1):
        arrays = [np.full(k, k % 251, np.uint8) for k in range(1, 400)]
        largest = np.full(_C.SMALL_BLOCK_MAX, 9, np.uint8)
    names = {segment_of(a) for a in arrays}
    assert len(names) == 1 and None not in names
    assert segment_of(largest) is not None
    delta = stats_delta(before)
    assert delta["segments_created"] + delta["segments_reused"] <= 2
    spans = extents(arrays)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(a.ctypes.data % 16 == 0 for a in arrays), "NumPy's alignment"
    assert all((a == k % 251).all() for k, a in enumerate(arrays, 1))


def test_churned_small_arrays_rewind_one_slab_and_calloc_is_zero():
    with torchshm.allocating(min_bytes=1):
        a = np.full(SMALL, 1.0)
        name = segment_of(a)
        del a
        before = torchshm.stats()
        names = set()
        for i in range(3 * PER_SLAB):
            a = np.full(SMALL, float(i))
            names.add(segment_of(a))
            del a  # the slab's only block: it starts over
        zeros = np.zeros(SMALL)
    assert names == {name} and segment_of(zeros) == name and not zeros.any()
    delta = stats_delta(before)
    assert delta["segments_created"] == delta["segments_reused"] == 0


def test_a_loop_of_temporaries_cycles_two_slabs():
    # `a = f()` makes the next array while the last one lives: the slab
    # fills, the next one opens, and the first goes back to the pool.
    torchshm.trim()  # no idle segment of earlier tests to be taken instead
    with torchshm.allocating(min_bytes=1):
        a = np.full(SMALL, 0.0)
        before = torchshm.stats()
        names = set()
        for i in range(5 * PER_SLAB):
            a = np.full(SMALL, float(i))
            names.add(segment_of(a))
    assert len(names) <= 3 and (a == 5 * PER_SLAB - 1).all()
    assert stats_delta(before)["segments_created"] <= 1


def test_realloc_of_a_small_block_moves_and_keeps_the_data():
    with torchshm.allocating(min_bytes=1):
        a = np.arange(10, dtype=np.int64)
        a.resize(1000, refcheck=False)  # a larger small block
        assert np.array_equal(a[:10], np.arange(10)) and not a[10:].any()
        a.resize(_C.SMALL_BLOCK_MAX, refcheck=False)  # a segment of its own
        assert np.array_equal(a[:10], np.arange(10)) and not a[10:].any()
        a.resize(3, refcheck=False)
    assert torchshm.is_shared(a) and np.array_equal(roundtrip(a), np.arange(3))


def test_a_small_born_array_is_sent_as_it_was(ctx, child):
    # Note [A plain send is as it was] in csrc/send/plan.h: a block of a slab
    # is never frozen, so its plain send copies it.
    c = child(ctx, allocator_children.small_born_sender, SMALL)
    got = c.receive()
    assert np.array_equal(got, np.arange(SMALL)) and torchshm.is_shared(got)
    c.send("write")
    assert c.receive() == "written"
    assert np.array_equal(got, np.arange(SMALL)), "a later write reached it"
    c.send("stats")
    sender = c.receive()
    assert sender["bytes_copied"] == SMALL * 8 and sender["arrays_resent"] == 0
    assert c.close() == 0


def test_a_block_a_receiver_holds_is_never_carved_again(ctx, child):
    torchshm.set_threshold(0)
    c = child(ctx, allocator_children.holder)
    with torchshm.allocating(min_bytes=1):
        a = np.full(SMALL, 1.0)
        (held,) = extents([a])
        # share(): a plain send would copy the block (Note [A plain send is
        # as it was] in csrc/send/plan.h).
        c.send(torchshm.share(a))
        assert c.receive() == 1.0
        del a  # the slab's only block: freed here, held there
        gc.collect()
        # The slab is carved on past that block (Note [Small blocks]), never
        # over it.
        others = [np.full(SMALL, 2.0) for _ in range(2 * PER_SLAB)]
        c.send("check")
        assert c.receive() == (1.0, 1.0)
        assert all(end <= held[0] or held[1] <= start for start, end in extents(others))
        c.send("drop")
        assert c.receive() == "dropped"
    assert all((o == 2.0).all() for o in others)
    assert c.close() == 0


def test_an_array_received_back_keeps_its_block(ctx, child):
    # The creator rebuilds what comes back over the slab's own tensor: no
    # receiver's slot holds it then, only that reference.
    torchshm.set_threshold(0)
    c = child(ctx, allocator_children.echo)
    with torchshm.allocating(min_bytes=1):
        a = np.full(SMALL, 1.0)
        c.send(torchshm.share(a))  # a plain send would copy the block
        back = c.receive()
        c.send("dropped?")
        assert c.receive() == "dropped"
        assert np.shares_memory(back, a)
        del a
        gc.collect()
        others = [np.full(SMALL, 2.0) for _ in range(2 * PER_SLAB)]
    assert (back == 1.0).all(), "a block was carved over an array still read"
    assert all((o == 2.0).all() for o in others)
    assert c.close() == 0


def test_a_forked_child_never_carves_its_parents_slab(child):
    with torchshm.allocating(min_bytes=1):
        mine = np.full(SMALL, 1.0)  # the parent's slab is current at fork
    c = child(mp.get_context("fork"), allocator_children.carve_after_fork, SMALL, 1000)
    assert c.receive() == "made"
    with torchshm.allocating(min_bytes=1):
        more = [np.full(SMALL, 2.0) for _ in range(1000)]
    c.send("check")
    assert c.receive() is True, "the child's blocks were overwritten"
    assert (mine == 1.0).all() and all((m == 2.0).all() for m in more)
    assert c.close() == 0


def test_slabs_kept_by_a_few_blocks_are_bounded_then_fall_back():
    # One block in 512 outlives the rest: each slab stays for two blocks.
    floor = _C.RETIRED_SLABS_FLOOR
    before = torchshm.stats()
    kept = []
    with torchshm.allocating(min_bytes=1):
        for i in range((floor // _C.SLAB_BYTES + 8) * _C.SLAB_BYTES // 1024):
            a = np.empty(1024, np.uint8)
            if i % 512 == 0:
                kept.append(a)
    delta = stats_delta(before)
    assert delta["allocations_fallback"] > 0
    # The retired slabs passed the floor by one slab at most; and the
    # current one (a pooled slab may be of a larger class).
    capacities = {
        segment_of(a): _C.segment_of(_C.testing.born_owner(a.ctypes.data)).capacity
        for a in kept
        if torchshm.is_shared(a)
    }
    assert floor < sum(capacities.values()) <= floor + 2 * max(capacities.values())
    del kept, a
    gc.collect()
    with torchshm.allocating(min_bytes=1):
        again = np.empty(1024, np.uint8)
    assert torchshm.is_shared(again), "slabs let go: small blocks are shared again"


@pytest.mark.parametrize("then", ["exit", "wait"])
def test_a_small_block_outlives_a_sender_that_exits_or_is_killed(ctx, then):
    outbox = ctx.Queue()
    p = ctx.Process(
        target=allocator_children.small_born_send_then, args=(outbox, SMALL, then)
    )
    p.start()
    try:
        got = outbox.get(timeout=TIMEOUT)
        if then == "wait":
            os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
        assert p.exitcode == (0 if then == "exit" else -signal.SIGKILL)
        assert torchshm.is_shared(got) and np.array_equal(got, np.arange(SMALL))
    finally:
        if p.is_alive():
            p.kill()
        p.join(TIMEOUT)
        outbox.close()


def test_a_block_sent_to_many_is_never_carved_while_one_holds_it(child):
    torchshm.set_threshold(0)
    ctx = mp.get_context("forkserver")
    holders = [child(ctx, allocator_children.holder) for _ in range(3)]
    with torchshm.allocating(min_bytes=1):
        a = np.full(SMALL, 1.0)
        for c in holders:
            c.send(a)
        assert [c.receive() for c in holders] == [1.0] * 3
        del a
        gc.collect()
        for c in holders[:2]:  # one still holds it
            c.send("check")
            assert c.receive() == (1.0, 1.0)
            c.send("drop")
            assert c.receive() == "dropped"
        others = [np.full(SMALL, 2.0) for _ in range(2 * PER_SLAB)]
        holders[2].send("check")
        assert holders[2].receive() == (1.0, 1.0)
        holders[2].send("drop")
        assert holders[2].receive() == "dropped"
    assert all((o == 2.0).all() for o in others)
    assert all(c.close() == 0 for c in holders)


def test_an_empty_slab_goes_back_on_the_idle_timer(monkeypatch, child):
    monkeypatch.setenv("TORCHSHM_POOL_IDLE_SECONDS", "1")
    c = child(mp.get_context("spawn"), allocator_children.slab_then_idle)
    received = c.receive()
    name = _C.segment_of(_C.memory_owner(received)).name
    del received
    gc.collect()
    c.send("drop")
    assert c.receive() == "dropped"
    # The child does nothing more: its timer lets go of the empty slab, then
    # releases the idle segment, and the keeper closes it.
    assert wait_until(lambda: name not in session_segments(), 1 + 4)
    assert c.process.is_alive()
    c.send("exit")
    assert c.close() == 0
