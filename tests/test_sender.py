"""The native sender (csrc/send/plan.cpp): its fast reducer below the threshold,
the per-message plan, and counters as native atomics."""

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import torchshm
from tests.conftest import TIMEOUT, run_python, stats_delta, true_in_forked_child
from torchshm import _C, _fallback, _reduction
from torchshm._lifetime import segments as _segments
from torchshm._send import sender as _sender

SMALL = [
    np.arange(10),
    np.arange(12.0).reshape(3, 4)[:, ::2],  # not contiguous
    np.arange(24, dtype=">i4").reshape(2, 3, 4).transpose(2, 0, 1),
    np.zeros(3, dtype=[("a", "<i2"), ("b", "<f8")]),
    np.array(["ab", "cde"]),
    np.arange(6).reshape(2, 3).T,
    np.float32(1.5) * np.ones(()),  # 0-d
]


@pytest.fixture(autouse=True)
def default_threshold():
    """The suite runs with threshold 1 (tests/conftest.py); these tests are
    about the default's fast path (conftest restores the threshold)."""
    torchshm.set_threshold(torchshm._config.DEFAULT_THRESHOLD)


def through_pipe(obj):
    a, b = mp.Pipe()
    try:
        a.send(obj)
        assert b.poll(TIMEOUT)
        return b.recv()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("array", SMALL, ids=lambda a: f"{a.dtype}{a.shape}")
def test_reduce_ndarray_writes_the_bytes_numpy_writes(array):
    """Below the threshold the native reducer is numpy's own reduce: the
    pickled bytes are exactly those of plain pickling."""
    assert array.nbytes < torchshm.get_threshold()
    mine = ForkingPickler.dumps(array)
    with torchshm.disabled():
        plain = ForkingPickler.dumps(array)
    assert mine == plain
    assert _C.reduce_ndarray(array) == array.__reduce__()


def test_reduce_ndarray_counts_inline_arrays():
    arrays = [np.full(100, i) for i in range(50)]
    before = torchshm.stats()
    ForkingPickler.dumps(arrays)
    delta = stats_delta(before)
    assert delta["arrays_inline"] == 50 and delta["arrays_shared"] == 0


def test_threshold_changes_reach_the_fast_path():
    a = np.arange(512, dtype=np.uint8)
    torchshm.set_threshold(0)
    assert torchshm.is_shared(pickle.loads(ForkingPickler.dumps(a)))
    torchshm.set_threshold("1K")
    data = ForkingPickler.dumps(a)
    assert not torchshm.is_shared(pickle.loads(data))
    with torchshm.disabled():
        assert data == ForkingPickler.dumps(a)
    b = np.arange(2048, dtype=np.uint8)
    assert torchshm.is_shared(pickle.loads(ForkingPickler.dumps(b)))


def test_packing_still_starts_after_a_threshold_of_small_arrays():
    """PACK_MIN..threshold arrays go inline for a threshold's worth, then are
    packed into the message's chunk (Note [Counting a message's small
    arrays] in csrc/send/message.cpp)."""
    torchshm.set_threshold(4 * _sender.PACK_MIN)
    arrays = [np.full(_sender.PACK_MIN, i, np.uint8) for i in range(10)]
    before = torchshm.stats()
    received = pickle.loads(ForkingPickler.dumps(arrays))
    delta = stats_delta(before)
    assert delta["arrays_inline"] == 4 and delta["arrays_shared"] == 6
    assert [torchshm.is_shared(r) for r in received] == [False] * 4 + [True] * 6
    for r, a in zip(received, arrays):
        np.testing.assert_array_equal(r, a)


def test_the_count_of_small_arrays_restarts_with_each_message():
    torchshm.set_threshold(4 * _sender.PACK_MIN)
    arrays = [np.full(_sender.PACK_MIN, i, np.uint8) for i in range(3)]
    before = torchshm.stats()
    for _ in range(5):  # 15 arrays in all, but 3 per message
        received = pickle.loads(ForkingPickler.dumps(arrays))
        assert not any(torchshm.is_shared(r) for r in received)
    assert stats_delta(before)["arrays_inline"] == 15


def test_small_arrays_go_in_numpys_own_form():
    # Read by a process that never imports torchshm, as plain pickle reads
    # them: the message names nothing of torchshm's.
    arrays = [np.arange(i, i + 4096, dtype=np.float64) for i in range(3)]
    data = bytes(ForkingPickler.dumps(arrays))
    assert b"torchshm" not in data
    script = (
        "import pickle, sys; import numpy as np\n"
        "arrays = pickle.loads(sys.stdin.buffer.read())\n"
        "assert 'torchshm' not in sys.modules\n"
        "print(sum(float(a.sum()) for a in arrays))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], input=data, capture_output=True, timeout=TIMEOUT
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == sum(float(a.sum()) for a in arrays)


def test_views_of_one_buffer_share_one_copy_through_a_pipe():
    base = np.arange(200_000, dtype=np.float64)
    views = [base[1000:], base[:150_000], base[::-1], base[5:50_000].reshape(-1, 5)]
    before = torchshm.stats()
    received = through_pipe(views)
    delta = stats_delta(before)
    assert delta["arrays_shared"] == 1 and delta["arrays_resent"] == 3
    assert delta["bytes_copied"] == base.nbytes
    for r, v in zip(received, views):
        np.testing.assert_array_equal(r, v)
    for r in received[1:]:
        assert np.shares_memory(received[0], r)
    received[1][1000] = -1.0  # written through one view, read through another
    assert received[0][0] == -1.0 and received[2][-1001] == -1.0


def test_dtypes_alike_in_str_arrive_as_they_were_sent():
    """view_args keeps the wire form of the last dtypes it met
    (csrc/send/message.cpp): dtypes whose .str is the same but which differ
    (metadata, fields), and more distinct dtypes than it keeps, each arrive
    as they were sent, in one message and the next."""
    torchshm.set_threshold(0)
    dtypes = [
        np.dtype("<f8"),
        np.dtype("<f8", metadata={"unit": "m"}),
        np.dtype(">f8"),
        np.dtype([("a", "<f8")]),
        np.dtype("V8"),
    ] + [np.dtype("<f8", metadata={"k": i}) for i in range(40)]
    before = torchshm.stats()
    for _ in range(2):
        received = through_pipe([np.zeros(1024, dtype=d) for d in dtypes] * 2)
        for array, dtype in zip(received, dtypes * 2):
            assert (array.dtype, array.dtype.str) == (dtype, dtype.str)
            assert array.dtype.metadata == dtype.metadata
            assert array.dtype.fields == dtype.fields
    # Each message carries each array twice: one copy, named twice.
    assert stats_delta(before)["arrays_shared"] == 2 * len(dtypes)


FRESH_FILLS = """
import hashlib
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
import numpy as np
import torchshm

def digest(a):
    return torchshm.is_shared(a), hashlib.sha256(a).hexdigest()

data = np.random.default_rng(0).integers(0, 256, 48 << 20, dtype=np.uint8)
# (where in the page, bytes): within one 4 MiB chunk, and across several
# with the first and last pages shared with other bytes.
cuts = [(0, 3 << 20), (1, (8 << 20) + 1), (4095, (13 << 20) + 4095),
        (17, (40 << 20) + 17)]
with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
    for at, n in cuts:  # growing: each needs a fresh segment
        sent = data[at:at + n]
        shared, received = pool.submit(digest, sent).result()
        assert shared, (at, n)
        assert received == hashlib.sha256(sent).hexdigest(), (at, n)
stats = torchshm.stats()
assert stats["segments_created"] == len(cuts), stats
assert not stats["fallbacks"], stats
"""


def test_fresh_segments_arrive_whole_however_their_pages_were_made():
    """A fresh segment's pages are made by pwrite and by faults at once, in
    4 MiB chunks (Note [Filling a fresh segment] in
    csrc/lifetime/fresh_pages.cpp): every byte arrives, wherever the array
    starts in its page and however many chunks it spans."""
    done = run_python(FRESH_FILLS)
    assert done.returncode == 0, done.stderr


def test_the_next_message_copies_again():
    a = np.arange(100_000.0)
    first, second = through_pipe(a), through_pipe(a)
    assert not np.shares_memory(first, second)


def test_counters_count_sends_resends_and_receives():
    a = np.arange(100_000, dtype=np.int64)
    before = torchshm.stats()
    r = pickle.loads(ForkingPickler.dumps(a))
    delta = stats_delta(before)
    assert delta["arrays_shared"] == 1 and delta["bytes_copied"] == a.nbytes
    assert delta["arrays_received"] == 1 and delta["arrays_resent"] == 0
    before = torchshm.stats()
    again = pickle.loads(ForkingPickler.dumps(r[10:]))
    delta = stats_delta(before)
    assert delta["arrays_resent"] == 1 and delta["arrays_shared"] == 0
    assert delta["bytes_copied"] == 0 and delta["arrays_received"] == 1
    # The same snapshot, privately mapped for each message (Note [Snapshots
    # are mapped privately] in csrc/lifetime/segment.h).
    assert _segments.name_of(_C.memory_owner(again)) == _segments.name_of(
        _C.memory_owner(r)
    )
    again[0] = -1
    assert r[10] == 10


def test_reset_stats_zeroes_the_native_counters():
    pickle.loads(ForkingPickler.dumps(np.arange(100_000)))
    torchshm.reset_stats()
    counts = torchshm.stats()
    assert all(counts[k] == 0 for k in counts if k != "fallbacks")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_counts_from_zero():
    pickle.loads(ForkingPickler.dumps(np.arange(100_000)))
    assert torchshm.stats()["arrays_received"] > 0

    def counts_are_zero():
        counts = torchshm.stats()
        return all(counts[k] == 0 for k in counts if k != "fallbacks")

    assert true_in_forked_child(counts_are_zero)


def test_the_plan_answers_where_memory_lives():
    a = np.arange(100_000.0)
    kind, owner, name, args = _C.testing.place(a)
    assert kind == "copied"
    assert name.startswith("torchshm:") and args[0] % _sender.ALIGNMENT == 0
    again = _reduction.rebuild_ndarray(owner, *args)
    np.testing.assert_array_equal(again, a)
    # Memory in a segment is named, not copied: a view of it, in a new message.
    view = again[5:]
    kind2, owner2, name2, args2 = _C.testing.place(view)
    assert kind2 == "segment" and name2 == name and args2[0] == args[0] + 5 * 8
    # A torch tensor's own memory: tagged, for the policy's one question.
    import torch

    t = torch.arange(10_000, dtype=torch.float64)
    kind3, tensor, offset = _C.testing.place(t.numpy()[3:])
    assert kind3 == "torch_owned"
    assert tensor.data_ptr() == t.data_ptr() and offset == 24


def test_a_reducer_failure_inside_the_plan_still_delivers(monkeypatch):
    from torchshm._lifetime import segments as _segments

    def wrong(nbytes, **_):
        return np.zeros(nbytes, np.uint8)  # not a tensor: a torchshm bug

    # Nothing idle in the pool, so the send must allocate (pooled segments are
    # taken without calling allocate: Note [Segment pool]).
    torchshm.trim()
    monkeypatch.setattr(_segments, "allocate", wrong)
    monkeypatch.setattr(_fallback, "_warned", set())
    a = np.arange(100_000)
    with pytest.warns(RuntimeWarning, match="report this as a bug"):
        received = pickle.loads(ForkingPickler.dumps(a))
    np.testing.assert_array_equal(received, a)


def test_handles_write_references_without_tickets():
    a = np.arange(100_000.0)
    data = torchshm.dumps(a)
    try:
        loaded = [torchshm.loads(data) for _ in range(3)]
        for x in loaded:
            np.testing.assert_array_equal(x, a)
        # One snapshot, each load's own: a write to one is not in another.
        names = {_segments.name_of(_C.memory_owner(x)) for x in loaded}
        assert len(names) == 1 and None not in names
        loaded[0][0] = -1.0
        assert loaded[2][0] == 0.0
    finally:
        torchshm.release(data)
    assert _reduction.reference_without_ticket(object()) is None
