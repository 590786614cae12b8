"""The segment pool and mapping cache: reuse happens, and never at the cost of
data someone still reads; memory stays bounded."""

import gc
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import torchshm
from tests import children
from tests.conftest import TIMEOUT, session_segments
from torchshm._lifetime import holdings as _holdings

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_os]


def roundtrip(obj):
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


def test_repeated_sends_reuse_one_segment_and_one_mapping(ctx, no_leaks, child):
    rounds = 6
    c = child(ctx, children.send_fresh_each_round, rounds, 300_000)
    before = torchshm.stats()
    for i in range(rounds):
        received = c.receive()
        assert (received == i).all() and torchshm.is_shared(received)
        del received  # done with it: the sender may reuse the segment
        c.send("ack")
    sender = c.receive()
    assert c.close() == 0
    assert sender["segments_created"] == 1
    assert sender["segments_reused"] == rounds - 1
    assert torchshm.stats()["mappings_reused"] - before["mappings_reused"] == rounds - 1


def test_a_view_that_dies_while_another_thread_holds_the_lock_keeps_its_mapping(
    ctx, no_leaks, child
):
    # Its last view dies while another thread holds torchshm's lock (a
    # pin_memory thread receiving; the expiry timer's tick): the mapping is
    # still cached, and the next message reuses it (Note [Work for the
    # lock's holder] in torchshm/_lifetime/holdings.py).
    c = child(ctx, children.send_fresh_each_round, 2, 300_000)
    received = c.receive()
    held, done = threading.Event(), threading.Event()

    def hold_the_lock():
        with _holdings.lock:
            held.set()
            done.wait(TIMEOUT)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    assert held.wait(TIMEOUT)
    del received  # its keep() finds the lock busy
    done.set()
    holder.join(TIMEOUT)
    before = torchshm.stats()
    c.send("ack")
    again = c.receive()
    assert (again == 1).all()
    after = torchshm.stats()
    assert after["mappings_reused"] - before["mappings_reused"] == 1
    assert after["segments_attached"] == before["segments_attached"]
    del again
    c.send("ack")
    assert c.receive()["segments_reused"] == 1
    assert c.close() == 0


def test_a_segment_in_use_is_never_reused():
    a = np.full(100_000, 1.0)
    first = roundtrip(a)  # still alive: its segment is busy
    a[:] = 2.0
    second = roundtrip(a)
    assert (first == 1.0).all() and (second == 2.0).all()
    assert not np.shares_memory(first, second)


def test_a_dropped_segment_is_reused():
    roundtrip(np.ones(100_000))
    gc.collect()
    before = torchshm.stats()["segments_reused"]
    # Another array: the same one again would name its snapshot again
    # (Note [Resending an unchanged array] in csrc/send/snapshots.h).
    again = roundtrip(np.ones(100_000))
    assert torchshm.stats()["segments_reused"] == before + 1
    assert (again == 1).all()


def test_a_forked_child_keeps_reading_what_the_parent_released(no_leaks, child):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    shared = torchshm.share(np.full(200_000, 3.0))
    c = child(ctx, children.hold_inherited, shared)
    del shared
    gc.collect()
    for _ in range(5):  # the pool would reuse that segment if it were idle
        roundtrip(np.full(200_000, -1.0))
    c.send("check")
    assert c.receive() is True
    assert c.close() == 0


def test_many_small_arrays_pack_into_few_segments():
    arrays = [np.full(8192, i, dtype=np.float64) for i in range(1000)]  # 64 KiB
    before = torchshm.stats()
    received = roundtrip(arrays)
    created = torchshm.stats()["segments_created"] - before["segments_created"]
    reused = torchshm.stats()["segments_reused"] - before["segments_reused"]
    assert created + reused <= 5
    assert all((r == i).all() for i, r in enumerate(received))
    assert all(torchshm.is_shared(r) for r in received)


def test_pool_is_capped(monkeypatch):
    monkeypatch.setenv("TORCHSHM_POOL_BYTES", "2M")
    torchshm.trim()
    # Earlier tests may leave segments held by tickets of messages never
    # loaded (they live with the session): those cannot be trimmed.
    before = _holdings.pool.nbytes
    held = [roundtrip(np.zeros(300_000)) for _ in range(10)]  # 2.4 MB each
    assert _holdings.pool.nbytes <= max(before, 2 << 20)
    assert all((h == 0).all() for h in held)


def test_idle_segments_are_released(monkeypatch):
    torchshm.trim()
    roundtrip(np.zeros(500_000))
    gc.collect()
    pool = _holdings.pool.native
    idle = {
        name
        for name in pool.names()
        if pool.get(name).local_views == 0 and not pool.get(name).has_live_holder(0)
    }
    assert idle
    monkeypatch.setenv("TORCHSHM_POOL_IDLE_SECONDS", "0")
    _holdings.pool.schedule_thorough_scan()  # it runs once a second
    roundtrip(np.zeros(5_000_000))  # too big to reuse them; releases expired ones
    assert not idle & set(pool.names())
    assert not idle & {"/" + n for n in session_segments()}


def test_trim_gives_idle_memory_back():
    roundtrip(np.zeros(1_000_000))
    gc.collect()
    before = session_segments()
    assert torchshm.trim() > 0
    assert len(session_segments()) < len(before)


@pytest.mark.parametrize("nbytes", [1, 64 << 10, 3 << 20, 40 << 20])
def test_every_size_class_round_trips(nbytes):
    a = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    for _ in range(3):  # fresh, then reused
        received = roundtrip(a)
        np.testing.assert_array_equal(received, a)
        del received
        gc.collect()


def test_small_arrays_inline_until_the_message_carries_a_threshold_of_them():
    old = torchshm.get_threshold()
    torchshm.set_threshold(256 << 10)
    try:
        arrays = [np.full(8192, i, dtype=np.float64) for i in range(100)]  # 64 KiB
        received = roundtrip(arrays)
        inline = [not torchshm.is_shared(r) for r in received]
        assert inline == [True] * 4 + [False] * 96
        assert all((r == i).all() for i, r in enumerate(received))
        single = roundtrip(arrays[0])  # alone, a small array stays inline
        assert not torchshm.is_shared(single)
        tiny = roundtrip([np.zeros(100)] * 1000)  # under PACK_MIN: always inline
        assert not any(torchshm.is_shared(t) for t in tiny)
    finally:
        torchshm.set_threshold(old)


def test_terminated_pool_workers_leave_no_segments(ctx, no_leaks):
    # `with Pool(...)` ends its live workers with SIGTERM (Pool.terminate()),
    # while their pools still hold the segments their results went out in.
    with ctx.Pool(2) as pool:
        results = pool.map_async(children.make_array, [200_000] * 4, chunksize=1).get(
            TIMEOUT
        )
        assert all((r == 5.0).all() for r in results)
        del results
