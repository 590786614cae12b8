"""Round trips through ForkingPickler in one process: the full dtype x layout
matrix, views, snapshots and fallbacks (fast; test_multiprocess.py crosses
real process boundaries)."""

import errno
import pickle
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

import torchshm
from tests import cases
from tests.conftest import stats_delta
from torchshm import _fallback


def roundtrip(obj):
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


@pytest.mark.parametrize(
    "case,array", cases.matrix(), ids=[c for c, _ in cases.matrix()]
)
def test_matrix_roundtrip(case, array):
    received = roundtrip(array)
    cases.assert_same_array(received, array, keep_strides=not cases.is_sparse(array))
    if array.size:  # empty arrays travel inline, keeping dtype and strides
        assert torchshm.is_shared(received)
        assert not np.shares_memory(received, array)  # a snapshot, not the original


def test_whole_matrix_in_one_message():
    arrays = cases.matrix_arrays()
    for received, sent in zip(roundtrip(arrays), arrays):
        cases.assert_same_array(received, sent, keep_strides=not cases.is_sparse(sent))


def test_sender_memory_is_never_touched():
    a = np.arange(100_000, dtype=np.float64)
    pointer, base = a.__array_interface__["data"][0], a.base
    roundtrip(a)
    assert a.__array_interface__["data"][0] == pointer and a.base is base
    assert not torchshm.is_shared(a)


def test_views_of_one_base_arrive_aliased():
    base = np.arange(1_000_000, dtype=np.int64)
    views = (base, base[10:], base[::-1], base.reshape(1000, 1000).T, base[5:900])
    before = torchshm.stats()
    received = roundtrip(views)
    delta = stats_delta(before)
    assert delta["segments_created"] + delta["segments_reused"] == 1  # one copy
    assert delta["bytes_copied"] == base.nbytes
    for v in received[1:]:
        assert np.shares_memory(received[0], v)
    received[0][10] = -7  # write through one, read through the others
    assert received[1][0] == -7 and received[2][-11] == -7 and received[3][10, 0] == -7


def test_sibling_views_share_one_copy_without_their_base():
    base = np.arange(1_000_000, dtype=np.float32)
    before = torchshm.stats()
    a, b = roundtrip((base[:600_000], base[400_000:]))
    after = torchshm.stats()
    used = sum(after[k] - before[k] for k in ("segments_created", "segments_reused"))
    assert used == 1
    assert np.shares_memory(a, b)
    a[500_000] = -1
    assert b[100_000] == -1


def test_a_later_send_takes_a_new_snapshot():
    a = np.zeros(100_000)
    first = ForkingPickler.dumps(a)
    a[0] = 7
    second = ForkingPickler.dumps(a)
    assert ForkingPickler.loads(first)[0] == 0
    assert ForkingPickler.loads(second)[0] == 7


def test_a_small_view_of_a_large_base_copies_only_its_span():
    base = np.zeros(10_000_000, dtype=np.uint8)
    before = torchshm.stats()["bytes_copied"]
    roundtrip(base[1000:2000])
    assert torchshm.stats()["bytes_copied"] - before == 1000


def test_sparse_view_is_compacted_keeping_its_order():
    base = np.arange(4_000_000, dtype=np.float64).reshape(2000, 2000)
    view = base[::10, ::20].T  # F-ordered, sparse
    before = torchshm.stats()["bytes_copied"]
    received = roundtrip(view)
    assert torchshm.stats()["bytes_copied"] - before == view.nbytes
    np.testing.assert_array_equal(received, view)
    assert received.flags.f_contiguous


def test_broadcast_view_posing_as_terabytes_costs_its_bytes():
    view = np.broadcast_to(np.float64(3.5), (2**20, 2**20))  # 8 TiB logically
    before = torchshm.stats()["bytes_copied"]
    received = roundtrip(view)
    assert torchshm.stats()["bytes_copied"] - before == 8
    assert received.shape == view.shape and received.strides == (0, 0)
    assert received[123456, 654321] == 3.5


def test_resending_shared_memory_is_zero_copy_and_aliased():
    shared = torchshm.share(np.arange(1_000_000, dtype=np.int32))
    assert torchshm.is_shared(shared)
    before = torchshm.stats()
    again = roundtrip((shared, shared[::2]))
    after = torchshm.stats()
    assert after["bytes_copied"] == before["bytes_copied"]
    assert after["arrays_resent"] - before["arrays_resent"] == 2
    assert np.shares_memory(again[0], shared) and np.shares_memory(again[1], shared)


@pytest.fixture
def file_system_strategy():
    import torch.multiprocessing as tmp

    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(previous)


def test_views_of_a_torch_shared_tensor_go_without_a_copy(file_system_strategy):
    # Only under file_system: under file_descriptor the receiver would depend
    # on the sender staying alive (test_faults.py).
    import torch

    tensor = torch.arange(1_000_000, dtype=torch.float32).share_memory_()
    view = tensor.numpy()[100:]
    assert torchshm.is_shared(view)
    before = torchshm.stats()["bytes_copied"]
    received = roundtrip(view)
    assert torchshm.stats()["bytes_copied"] == before
    tensor[100] = -3
    assert received[0] == -3


def test_views_of_an_ordinary_tensor_are_copied_not_moved():
    import torch

    tensor = torch.arange(1_000_000, dtype=torch.float32)
    pointer = tensor.data_ptr()
    received = roundtrip(tensor.numpy())
    assert tensor.data_ptr() == pointer and not tensor.is_shared()
    np.testing.assert_array_equal(received, tensor.numpy())


def test_object_arrays_fall_back_to_pickling():
    a = np.array([{"x": 1}, "text", None, 3.5], dtype=object)
    before = torchshm.stats()["fallbacks"].get("object dtype", 0)
    received = roundtrip(a)
    assert list(received) == list(a)
    assert torchshm.stats()["fallbacks"]["object dtype"] == before + 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.ma.masked_array(np.arange(10.0), mask=[0, 1] * 5),
        lambda: np.matrix(np.arange(6).reshape(2, 3)),
        lambda: np.rec.fromarrays([np.arange(5), np.arange(5.0)], names="a,b"),
    ],
    ids=["masked", "matrix", "recarray"],
)
def test_subclasses_arrive_equal_and_keep_their_type(make):
    a = make()
    received = roundtrip(a)
    assert type(received) is type(a)
    assert received.dtype == a.dtype
    np.testing.assert_array_equal(np.asarray(received), np.asarray(a))
    if isinstance(a, np.ma.MaskedArray):
        np.testing.assert_array_equal(received.mask, a.mask)


def test_memmap_arrives_as_memmap_over_shared_memory(tmp_path):
    path = tmp_path / "data.bin"
    mm = np.memmap(path, dtype=np.float32, mode="w+", shape=(1000, 100))
    mm[:] = np.arange(100_000).reshape(1000, 100)
    received = roundtrip(mm)
    assert isinstance(received, np.memmap)
    np.testing.assert_array_equal(received, mm)
    assert torchshm.is_shared(received)


def test_below_threshold_is_pickled_inline():
    old = torchshm.get_threshold()
    torchshm.set_threshold("1M")
    try:
        before = torchshm.stats()
        received = roundtrip(np.zeros(1000))
        after = torchshm.stats()
        assert after["arrays_inline"] == before["arrays_inline"] + 1
        assert not torchshm.is_shared(received)
    finally:
        torchshm.set_threshold(old)


def test_plain_pickle_stays_by_value():
    a = np.arange(1_000_000)
    data = pickle.dumps(a)
    assert len(data) > a.nbytes and b"torchshm" not in data
    assert not torchshm.is_shared(pickle.loads(data))


def test_which_failures_mean_fall_back_is_decided_by_errno():
    """Never by the error's text (torchshm._fallback): every SharedMemoryError
    is an expected failure, anything else a bug. A real limit that makes a
    send fall back is in test_limits.py."""

    error = torchshm._C.SharedMemoryError
    assert _fallback.reason(error(errno.ENOMEM, "no words")) == ("out of memory", True)
    assert _fallback.reason(error(errno.EMFILE, "")) == ("too many open files", True)
    assert _fallback.reason(error(errno.EUSERS, "")) == (
        "shared-memory error: EUSERS",
        True,
    )
    assert _fallback.reason(RuntimeError("No space left on device")) == (
        "internal error: RuntimeError",
        False,
    )


def test_an_unexpected_error_still_delivers_and_says_it_is_a_bug(monkeypatch):
    from torchshm._lifetime import segments as _segments

    def broken(nbytes, **_):
        raise RuntimeError("No space left on device")  # text must not matter

    # Nothing idle in the pool, so the send must allocate (pooled segments are
    # taken without calling allocate: Note [Segment pool]).
    torchshm.trim()
    monkeypatch.setattr(_segments, "allocate", broken)
    monkeypatch.setattr(_fallback, "_warned", set())
    a = np.arange(100_000)
    before = torchshm.stats()
    with pytest.warns(RuntimeWarning, match="report this as a bug"):
        received = roundtrip(a)
    np.testing.assert_array_equal(received, a)
    delta = stats_delta(before)
    assert delta["fallbacks"] == {"internal error: RuntimeError": 1}


def test_share_says_once_that_an_object_array_stays_ordinary(monkeypatch):
    monkeypatch.setattr(_fallback, "_warned", set())
    model = {"weights": np.arange(100_000.0), "tags": np.array([1, "a", None] * 10)}
    with pytest.warns(RuntimeWarning, match="SharedList") as seen:
        shared = torchshm.share(model)
        torchshm.share(model)
    assert len([w for w in seen if "object arrays" in str(w.message)]) == 1
    assert torchshm.is_shared(shared["weights"])
    assert not torchshm.is_shared(shared["tags"])
    assert list(shared["tags"]) == list(model["tags"])


def test_share_of_strings_and_numbers_is_silent(monkeypatch):
    monkeypatch.setattr(_fallback, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = torchshm.share({"x": np.arange(1000.0), "s": np.array(["a"] * 100)})
    assert torchshm.is_shared(shared["x"])


dtypes = st.sampled_from(list(cases.DTYPES.values()))


@settings(max_examples=150, deadline=None)
@given(
    dtype=dtypes,
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4),
    steps=st.lists(st.sampled_from([-3, -2, -1, 1, 2, 3]), min_size=4, max_size=4),
    transpose=st.booleans(),
)
def test_random_layouts_roundtrip(dtype, shape, steps, transpose):
    n = int(np.prod([s * 3 for s in shape])) if shape else 1
    base = cases.base_of(dtype, max(n, 1))[:n].reshape([s * 3 for s in shape] or ())
    view = base[tuple(slice(None, None, steps[i]) for i in range(len(shape))) + (...,)]
    view = view.T if transpose else view
    received = roundtrip(view)
    cases.assert_same_array(received, view, keep_strides=not cases.is_sparse(view))


def test_zero_size_with_odd_strides():
    a = as_strided(np.zeros(4), (0, 5), (-8, 800))
    received = roundtrip(a)
    assert received.shape == (0, 5) and received.dtype == a.dtype
