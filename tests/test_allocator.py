"""Arrays born in shared memory (GitHub issue 13): torchshm.allocating() and
set_allocator() put NumPy's large allocations in pooled segments, so sending
them copies nothing, and the pool never reuses memory a receiver holds."""

import asyncio
import gc
import multiprocessing as mp
import threading
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import torchshm
from tests import allocator_children, fault_children, isolated
from tests.allocator_children import MIN_BYTES
from tests.conftest import TIMEOUT, bounded, stats_delta
from torchshm import _C
from torchshm._lifetime import segments as _segments
from torchshm._compat import numpy_handler_name

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess

N = 100_000  # float64: 800 KB, well above MIN_BYTES


def roundtrip(obj):
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


def segment_of(array):
    """The segment name behind a born array (or the array it views)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    owner = _C.testing.born_owner(_C.testing.data_address(array))
    return None if owner is None else _segments.name_of(owner)


def test_large_allocations_are_born_shared_and_small_ones_are_not():
    before = torchshm.stats()
    with torchshm.allocating(min_bytes=MIN_BYTES):
        assert numpy_handler_name() == "torchshm_born"
        large, small = np.ones(N), np.ones(10)
        zeros, empty = np.zeros(N), np.empty((300, 300))
    outside = np.ones(N)
    assert numpy_handler_name() == "default_allocator"
    assert [torchshm.is_shared(a) for a in (large, zeros, empty)] == [True] * 3
    assert not torchshm.is_shared(small) and not torchshm.is_shared(outside)
    assert stats_delta(before)["allocations_shared"] == 3
    assert (large == 1).all() and (zeros == 0).all()


def test_sending_a_born_array_copies_nothing_and_sends_it_as_it_was():
    # Note [A born array is sent as it was] in csrc/lifetime/segment.h: the
    # segment is sent by reference, and the sender's mapping of it becomes
    # copy-on-write, so that its later writes reach no receiver.
    with torchshm.allocating(min_bytes=MIN_BYTES):
        a = np.arange(N, dtype=np.float64)
    view = a[10:50_000:3]
    before = torchshm.stats()
    got, got_view = roundtrip((a, view))
    delta = stats_delta(before)
    assert delta["bytes_copied"] == 0 and delta["arrays_shared"] == 0
    assert delta["arrays_resent"] == 2
    assert np.shares_memory(got_view, got) and torchshm.is_shared(got)
    assert np.array_equal(got_view, a[10:50_000:3])
    a[:20] = -1.0  # the sender writes after the send
    assert (got[:20] == np.arange(20)).all() and (a[:20] == -1).all()
    # Sent again: the written pages make it a new snapshot; unwritten, a
    # reference again.
    before = torchshm.stats()
    again = roundtrip(a)
    assert (again[:20] == -1).all() and stats_delta(before)["arrays_shared"] == 1
    del got, got_view, again


def test_a_born_array_sent_twice_unwritten_goes_by_reference_both_times():
    with torchshm.allocating(min_bytes=MIN_BYTES):
        a = np.arange(N, dtype=np.float64)
    first = roundtrip(a)
    before = torchshm.stats()
    second = roundtrip(a)
    delta = stats_delta(before)
    assert delta["bytes_copied"] == 0 and delta["arrays_resent"] == 1
    assert np.array_equal(first, second)
    del first, second


def test_a_frozen_segment_reused_by_the_pool_is_shared_again():
    """At its send a born array's segment is frozen (the sender's shared
    pages moved aside, a private mapping in their place); when the pool
    reuses it, they move back: what the next array born there holds is what
    its receivers read, not the earlier generation's bytes."""
    names = set()
    before = torchshm.stats()
    for value in range(4):
        with torchshm.allocating(min_bytes=MIN_BYTES):
            a = np.full(N, float(value))
        names.add(segment_of(a))
        got = roundtrip(a)
        a[:10] = -1.0  # after the send: the sender's own pages
        assert (got == value).all() and (a[:10] == -1).all()
        del a, got
    assert len(names) == 1 and stats_delta(before)["segments_reused"] == 3


def test_calloc_of_reused_memory_is_zero():
    with torchshm.allocating(min_bytes=MIN_BYTES):
        dirty = np.full(N, 7.0)
        name = segment_of(dirty)
        del dirty
        before = torchshm.stats()
        clean = np.zeros(N)
    assert stats_delta(before)["segments_reused"] == 1
    assert segment_of(clean) == name and not clean.any()


def test_realloc_grows_in_place_or_moves_and_keeps_the_data():
    with torchshm.allocating(min_bytes=MIN_BYTES):
        a = np.arange(N, dtype=np.float64)
        name = segment_of(a)
        a.resize(N + 100, refcheck=False)  # fits the segment's size class
        assert segment_of(a) == name
        a.resize(4 * N, refcheck=False)  # does not: moved to another segment
        assert segment_of(a) not in (None, name)
        assert np.array_equal(a[:N], np.arange(N)) and not a[N:].any()
        a.resize(10, refcheck=False)
        assert np.array_equal(a, np.arange(10)) and torchshm.is_shared(a)
        grown = np.fromiter(range(N), dtype=np.int64)  # grows by realloc
    assert np.array_equal(grown, np.arange(N))
    assert np.array_equal(roundtrip(a), np.arange(10))


def test_the_handler_is_restored_on_exit_and_on_error():
    with pytest.raises(KeyError):
        with torchshm.allocating(min_bytes=MIN_BYTES):
            with torchshm.allocating(min_bytes=MIN_BYTES):
                assert torchshm._send.allocator.allocator_enabled()
            assert torchshm._send.allocator.allocator_enabled()
            raise KeyError
    assert numpy_handler_name() == "default_allocator"
    torchshm.set_allocator(True, min_bytes=MIN_BYTES)
    try:
        torchshm.set_allocator(True, min_bytes=MIN_BYTES)  # not stacked
        assert torchshm.is_shared(np.ones(N))
        # Again without min_bytes (a map function's hook, once per item).
        for _ in range(3):
            torchshm.set_allocator(True)
            assert torchshm.is_shared(np.ones(N))
    finally:
        torchshm.set_allocator(False)
    assert numpy_handler_name() == "default_allocator"
    assert not torchshm.is_shared(np.ones(N))


def test_min_bytes_must_be_positive_and_threshold_zero_still_works():
    with pytest.raises(ValueError, match="min_bytes must be at least 1"):
        with torchshm.allocating(min_bytes=0):
            pass
    assert numpy_handler_name() == "default_allocator"
    torchshm.set_threshold(0)
    with torchshm.allocating():
        assert torchshm.is_shared(np.ones(N))


def test_the_allocator_is_local_to_a_thread():
    seen = {}

    def other():
        seen["inside_block"] = torchshm.is_shared(np.ones(N))
        torchshm.set_allocator(True, min_bytes=MIN_BYTES)
        seen["own"] = torchshm.is_shared(np.ones(N))

    with torchshm.allocating(min_bytes=MIN_BYTES):
        thread = threading.Thread(target=other)
        thread.start()
        bounded(thread.join)
        assert torchshm.is_shared(np.ones(N))
    assert seen == {"inside_block": False, "own": True}
    assert not torchshm.is_shared(np.ones(N))


def test_the_allocator_is_local_to_an_asyncio_task():
    async def turned_on():
        torchshm.set_allocator(True, min_bytes=MIN_BYTES)
        await asyncio.sleep(0)
        return torchshm.is_shared(np.ones(N))

    async def left_alone():
        await asyncio.sleep(0)
        return torchshm.is_shared(np.ones(N))

    async def main():
        return await asyncio.gather(turned_on(), left_alone())

    assert asyncio.run(main()) == [True, False]
    assert numpy_handler_name() == "default_allocator"


def test_an_allocating_datapipe_turns_it_on_in_the_thread_that_iterates():
    # torchdata 0.6-0.9 workers iterate in a prefetch thread, not the hook's.
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(3)).map(allocator_children.born_sample)
    hook = torchshm.chain(torchshm.torchdata.register_in_worker, allocate=True)
    got = []
    try:
        wrapped = hook(pipe, None)  # turns it on here too, as in a worker
    finally:
        torchshm.set_allocator(False)
    thread = threading.Thread(target=lambda: got.extend(wrapped))
    thread.start()
    bounded(thread.join)
    assert [(i, born) for i, _, born in got] == [(0, True), (1, True), (2, True)]
    assert numpy_handler_name() == "default_allocator"


def test_an_array_freed_after_its_block_goes_back_to_the_pool():
    with torchshm.allocating(min_bytes=MIN_BYTES):
        a = np.ones(N)
    name, blocks = segment_of(a), _C.born_blocks()
    del a
    gc.collect()
    assert _C.born_blocks() == blocks - 1
    with torchshm.allocating(min_bytes=MIN_BYTES):
        again = np.ones(N)
    assert segment_of(again) == name


def test_a_class_found_all_busy_is_looked_at_again_once_a_view_dies():
    # A take that finds every segment of a size class with a live view skips
    # that class until one dies (Note [Segment pool]): then it reuses it.
    with torchshm.allocating(min_bytes=MIN_BYTES):
        kept = [np.ones(N) for _ in range(4)]  # the last takes found all busy
        freed = segment_of(kept[1])
        del kept[1]
        gc.collect()
        before = torchshm.stats()
        again = np.ones(N)
    assert segment_of(again) == freed
    assert stats_delta(before)["segments_reused"] == 1


def test_a_born_array_crosses_processes_without_a_copy(ctx, child):
    c = child(ctx, allocator_children.born_sender, N)
    got = c.receive()
    assert np.array_equal(got, np.arange(N)) and torchshm.is_shared(got)
    c.send("write")
    assert c.receive() == ("written", True)
    assert (got[:10] == np.arange(10)).all(), "the sender wrote after the send"
    c.send("stats")
    sender = c.receive()
    assert sender["allocations_shared"] >= 1
    assert sender["bytes_copied"] == 0 and sender["arrays_resent"] == 1
    assert c.close() == 0


def test_free_with_a_live_receiver_does_not_let_the_pool_reuse(ctx, child):
    c = child(ctx, allocator_children.holder)
    with torchshm.allocating(min_bytes=MIN_BYTES):
        a = np.full(N, 1.0)
        held = segment_of(a)
        c.send(a)
        assert c.receive() == 1.0
        del a  # freed here; the child still holds it
        gc.collect()
        b = np.full(N, 2.0)
        assert segment_of(b) != held
        c.send("check")
        assert c.receive() == (1.0, 1.0)
        c.send("drop")
        assert c.receive() == "dropped"
        del b
        gc.collect()
        before = torchshm.stats()
        again = [np.empty(N), np.empty(N)]
        assert held in {segment_of(x) for x in again}
    delta = stats_delta(before)
    assert delta["segments_reused"] == 2 and delta["segments_created"] == 0
    assert c.close() == 0


def test_a_forked_child_writes_its_own_copy_of_a_born_array_and_holds_it(child):
    # Note [A plain send is as it was] in csrc/send/plan.h: as NumPy's memory.
    with torchshm.allocating(min_bytes=MIN_BYTES):
        a = np.zeros(N)
    name = segment_of(a)
    c = child(mp.get_context("fork"), allocator_children.write_inherited, a)
    assert c.receive() == ("written", 42.0)
    assert not a[:5].any(), "the child's write reached its parent"
    a[5:10] = 7.0  # the parent's own copy-on-write pages
    del a
    gc.collect()
    with torchshm.allocating(min_bytes=MIN_BYTES):
        b = np.zeros(N)
    assert segment_of(b) != name, "the pool reused what the child holds"
    c.send("exit")
    assert c.close() == 0


def test_pool_initializer_recipe(ctx):
    with ctx.Pool(2, initializer=torchshm.set_allocator, initargs=(True,)) as pool:
        results = pool.map(allocator_children.pool_make, [N] * 4)
        pool.close()
        bounded(pool.join)
    assert all(born for _, born in results)
    assert all((a == 7).all() and torchshm.is_shared(a) for a, _ in results)


def test_dataloader_recipe():
    from torch.utils.data import DataLoader

    loader = DataLoader(
        allocator_children.BornItems(),
        batch_size=None,
        num_workers=1,
        collate_fn=torchshm.convert,
        worker_init_fn=torchshm.chain(torchshm.worker_init_fn, allocate=True),
        multiprocessing_context="spawn",
        timeout=TIMEOUT,
    )
    items = list(loader)
    assert [int(a[0]) for a, _, _ in items] == [0, 1, 2, 3]
    assert all(born for _, born, _ in items)
    assert all(copied == 0 for _, _, copied in items)
    assert all(torchshm.is_shared(a) for a, _, _ in items)


@pytest.mark.skipif(isolated.NO_UNSHARE is not None, reason=str(isolated.NO_UNSHARE))
def test_more_born_arrays_than_a_64_mib_dev_shm_holds_are_all_shared():
    # Segments are memfds: Docker's 64 MiB /dev/shm bounds nothing (the
    # fallback under a real memory limit: test_limits.py).
    with isolated.Driver("born_full", wrapper=isolated.SMALL_SHM) as driver:
        lines, status = driver.results()
        assert status == 0, driver.stderr()
        (result,) = lines
    shared = result["shared"]
    assert shared == [True] * fault_children.BORN_ITEMS
    assert result["allocations"] == {
        "allocations_shared": fault_children.BORN_ITEMS,
        "allocations_fallback": 0,
    }
    assert result["exitcode"] == 0 and result["equal"] == [True] * len(shared)
    assert result["warnings"] == []


def test_after_freeing_at_the_cap_the_next_large_array_is_born_and_sent_shared():
    # Issue 38: the pool gives way. Born arrays fill this process's cap on
    # segment fds (a quarter of a real hard limit); freed, they are idle
    # pooled segments of another size class. The next large array releases
    # them and is born shared at once, not only after trim() or 30 s idle.
    with isolated.Driver("born_at_the_cap") as driver:
        lines, status = driver.results()
        assert status == 0, driver.stderr()
        (result,) = lines
    cap = fault_children.CAP_NOFILE // 4
    assert cap // 2 < result["shared_at_cap"] <= cap, result
    assert result["fell_back"] == 1, result
    (warning,) = result["warned_at_cap"]
    assert "segment fds" in warning and "NumPy allocates" in warning, warning
    assert result["big_shared"] and result["gave_way"] == 1, result
    assert result["big_by_reference"] == 1 and result["big_copied"] == 0, result
    assert result["big_equal"] and result["later_warnings"] == [], result


def test_an_allocation_no_memory_could_hold_is_numpys_memory_error():
    # Its size plus a segment header used to overflow into a negative
    # capacity and a warning that asked for a bug report.
    before = torchshm.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of torchshm's
        with torchshm.allocating():
            with pytest.raises(MemoryError):
                np.empty(2**63 - 1, np.uint8)
    delta = stats_delta(before)
    assert delta["allocations_shared"] == delta["allocations_fallback"] == 0


def test_multiprocessing_context_is_unchanged():
    # Guard for the tests above: none leaves the allocator on.
    assert numpy_handler_name() == "default_allocator"
    assert mp.current_process().name == "MainProcess"
