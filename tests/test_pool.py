"""The native pool index (csrc/lifetime/pool.h, Note [Segment pool]) and the sender's
take from it without Python: a segment is never handed out twice, reuse
waits for every holder, and the Python bookkeeping runs whenever it is due."""

import os
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import torchshm
from tests.conftest import stats_delta, true_in_forked_child
from torchshm import _C
from torchshm._lifetime import holdings as _holdings
from torchshm._lifetime import pool as _pool
from torchshm._lifetime import segments as _segments

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess

KIB = 1 << 10


class _NoBudget:
    """A budget nobody else shares (the session's belongs to the real pool)."""

    def others(self, mine):
        return 0

    def record(self, nbytes):
        pass


@pytest.fixture
def pool():
    """A pool of its own, and every segment it made released afterwards."""
    made = _pool.Pool(budget=_NoBudget())
    yield made
    made.release_all()


def new_segment(pool, nbytes):
    return _segments._create(pool.size_class(nbytes))


def test_size_classes_round_up_to_an_eighth_of_their_power_of_two(pool):
    assert pool.size_class(1) == 64 * KIB
    assert pool.size_class(64 * KIB) == 64 * KIB
    assert pool.size_class(64 * KIB + 1) == 128 * KIB
    assert pool.size_class(1 << 20) == 1 << 20
    assert pool.size_class((1 << 20) + 1) == (1 << 20) + 256 * KIB
    for n in (100_000, 3_000_001, 400_000_000):
        c = pool.size_class(n)
        assert n <= c < n * 1.125 + 64 * KIB


def test_a_segment_is_never_taken_while_a_view_of_it_lives(pool):
    first, pooled = pool.admit(new_segment(pool, 100 * KIB))
    assert pooled
    assert pool.take(100 * KIB) is None  # `first` is alive
    name = _segments.name_of(first)
    generation = _C.segment_of(first).generation
    del first
    again = pool.take(100 * KIB)
    assert _segments.name_of(again) == name
    assert _C.segment_of(again).generation == generation + 1
    assert pool.take(100 * KIB) is None


def test_a_segment_another_holder_names_is_not_taken_until_it_lets_go(pool):
    owner, _ = pool.admit(new_segment(pool, 100 * KIB))
    segment = _C.segment_of(owner)
    del owner
    ticket = segment.issue_ticket()
    assert pool.take(100 * KIB) is None
    assert segment.cancel_ticket(ticket)
    assert pool.take(100 * KIB) is not None


def test_only_fitting_classes_are_taken(pool):
    owner, _ = pool.admit(new_segment(pool, 1 << 20))
    del owner
    assert pool.take(600 * KIB) is None  # would waste more than 25%
    assert pool.take(2 << 20) is None  # too small
    assert pool.take(900 * KIB) is not None


def test_release_idle_keeps_recent_and_busy_segments(pool):
    busy, _ = pool.admit(new_segment(pool, 100 * KIB))
    idle, _ = pool.admit(new_segment(pool, 200 * KIB))
    idle_name = _segments.name_of(idle)
    del idle
    assert pool.release_idle(older_than=3600) == 0
    assert pool.release_idle() == pool.size_class(200 * KIB)
    assert pool.native.names() == [_segments.name_of(busy)]
    assert not os.path.exists("/dev/shm" + idle_name)


def test_a_slot_taken_high_up_is_still_seen(pool):
    """Scans stop at the highest slot ever taken (the header's watermark)."""
    owner, _ = pool.admit(new_segment(pool, 100 * KIB))
    segment = _C.segment_of(owner)
    me = _C.process_id()
    slots = [segment.take_slot(me) for _ in range(_C.LAYOUT["SLOTS"] - 1)]
    assert slots == list(range(1, _C.LAYOUT["SLOTS"]))
    for slot in slots[:-1]:
        segment.release_slot(slot, me)
    assert segment.holders == 2 and segment.has_live_holder(0)
    del owner
    assert pool.take(100 * KIB) is None
    segment.release_slot(slots[-1], me)
    assert segment.holders == 1 and not segment.has_live_holder(0)
    assert pool.take(100 * KIB) is not None


def test_steady_sends_take_pooled_segments_without_calling_allocate(monkeypatch):
    a = np.arange(100_000.0)
    ForkingPickler.loads(ForkingPickler.dumps(a))  # a pooled segment, idle again
    calls = []
    allocate = _segments.allocate
    monkeypatch.setattr(
        _segments, "allocate", lambda n, **kw: calls.append(n) or allocate(n, **kw)
    )
    _holdings.pool.enable_fast_take(True)
    before = torchshm.stats()
    for i in range(5):
        a[:] = i
        received = ForkingPickler.loads(ForkingPickler.dumps(a))
        assert (received == i).all()
        del received
    delta = stats_delta(before)
    assert calls == [] and delta["segments_reused"] == 5
    assert delta["segments_created"] == 0


def test_bookkeeping_that_is_due_goes_through_python(monkeypatch):
    def a():  # a new array each time: a resent one names its snapshot again
        return np.arange(100_000.0)

    ForkingPickler.loads(ForkingPickler.dumps(a()))
    calls = []
    allocate = _segments.allocate
    monkeypatch.setattr(
        _segments, "allocate", lambda n, **kw: calls.append(n) or allocate(n, **kw)
    )
    _holdings.pool.schedule_thorough_scan()
    ForkingPickler.loads(ForkingPickler.dumps(a()))
    assert len(calls) == 1  # the thorough pass ran in Python...
    ForkingPickler.loads(ForkingPickler.dumps(a()))
    assert len(calls) == 1  # ...and re-armed the native take
    _holdings.pool.enable_fast_take(False)  # as a stopped timer does
    try:
        ForkingPickler.loads(ForkingPickler.dumps(a()))
        assert len(calls) == 2
    finally:
        _holdings.pool.enable_fast_take(True)


def test_the_pool_is_disarmed_across_fork():
    a = np.arange(100_000.0)
    ForkingPickler.loads(ForkingPickler.dumps(a))

    def disarmed_and_right():
        native = _holdings.pool.native
        ok = native.fast_until == 0 and len(native) == 0
        return ok and (ForkingPickler.loads(ForkingPickler.dumps(a)) == a).all()

    assert true_in_forked_child(disarmed_and_right)
    # The parent's timer stopped for the fork: its next send re-arms through
    # Python, and keeps the data right.
    assert _holdings.pool.native.fast_until == 0
    np.testing.assert_array_equal(ForkingPickler.loads(ForkingPickler.dumps(a)), a)
    assert _holdings.pool.native.fast_until > 0


def test_threads_sending_at_once_never_share_a_segment():
    """Four threads send and load in turn, taking pooled segments natively,
    while a fifth trims the pool: every load holds its own thread's bytes
    (the copy releases the GIL, so the threads interleave inside sends)."""
    stop = threading.Event()
    failures = []

    def send(t):
        try:
            for i in range(300):
                value = t * 1000 + i
                sent = np.full(20_000 + 997 * t, value, np.float64)
                received = ForkingPickler.loads(ForkingPickler.dumps(sent))
                if not (received == value).all():
                    failures.append((t, i))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    def trim():
        while not stop.is_set():
            torchshm.trim()

    trimmer = threading.Thread(target=trim)
    senders = [threading.Thread(target=send, args=(t,)) for t in range(4)]
    trimmer.start()
    for s in senders:
        s.start()
    for s in senders:
        s.join(120)
    stop.set()
    trimmer.join(60)
    assert not failures
    assert not any(s.is_alive() for s in senders)
