"""Object arrays of str (pandas string columns) travel packed into one UTF-8
buffer (Note [String columns] in torchshm/_strings.py): equal on arrival in
every shape and order; anything the packing cannot carry exactly stays on
pickle's path."""

import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pandas as pd
import pytest

import torchshm
from tests import integration_children as ic
from tests.conftest import stats_delta


def send(array):
    """(received, whether it went packed) through ForkingPickler."""
    data = ForkingPickler.dumps(array)
    return ForkingPickler.loads(data), b"rebuild_str_array" in bytes(data)


def distinct(n, make=lambda i: f"name-{i}-é"):
    return np.array([make(i) for i in range(n)], dtype=object)


def assert_same_objects(received, sent):
    """Equal to what numpy's own pickle gives: values, element types, shape,
    memory order, writable."""
    expected = pickle.loads(pickle.dumps(sent))
    assert received.dtype == object and received.shape == sent.shape
    assert received.flags.c_contiguous == expected.flags.c_contiguous
    assert received.flags.f_contiguous == expected.flags.f_contiguous
    assert received.flags.writeable
    assert [type(x) for x in received.ravel()] == [type(x) for x in sent.ravel()]
    assert received.tolist() == sent.tolist()


@pytest.mark.parametrize(
    "array",
    [
        distinct(5000),
        distinct(6000).reshape(2, 3000),
        np.asfortranarray(distinct(6000).reshape(3000, 2)),
        distinct(5000)[::-2],
        distinct(5000, lambda i: f"{i}" + "\U0001f600" * (i % 7) if i % 3 else ""),
        distinct(5000, lambda i: f"{i}\ud800"),  # a lone surrogate
    ],
    ids=["1-d", "2-d", "fortran", "strided", "empty-and-emoji", "surrogate"],
)
def test_string_arrays_arrive_equal_and_packed(array):
    received, packed = send(array)
    assert packed
    assert_same_objects(received, array)


@pytest.mark.parametrize(
    "array",
    [
        distinct(5000, lambda i: f"a\0{i}"),  # NUL inside: the split could not tell
        distinct(5000, lambda i: None if i == 7 else str(i)),
        distinct(5000, lambda i: np.str_(i)),  # a str subclass stays one
        distinct(5000, lambda i: float(i) if i % 2 else str(i)),
        np.array(["shared-a", "shared-b"], dtype=object)[np.arange(5000) % 2],
        np.empty(0, dtype=object),
    ],
    ids=["nul", "none", "str-subclass", "mixed", "repeated-objects", "empty"],
)
def test_what_packing_cannot_carry_is_pickled(array):
    received, packed = send(array)
    assert not packed
    assert_same_objects(received, array)


def test_repeated_objects_stay_shared_on_arrival():
    # Pickle's memo keeps one object per repeated element: the reason such
    # columns are not packed.
    array = np.array(["x-value", "y-value"], dtype=object)[np.arange(4000) % 2]
    received, _ = send(array)
    assert len({id(x) for x in received}) == 2


def test_plain_pickle_is_unchanged():
    assert b"torchshm" not in pickle.dumps(distinct(5000))


def test_a_packed_column_counts_no_fallback():
    before = torchshm.stats()
    send(distinct(5000))
    assert "object dtype" not in stats_delta(before)["fallbacks"]
    send(distinct(5000, lambda i: None))
    assert stats_delta(before)["fallbacks"]["object dtype"] == 1


def test_frame_with_string_columns_through_processes(ctx, child):
    n = 20_000
    frame = pd.DataFrame(
        {
            "path": [f"/data/images/{i:08d}.jpg" for i in range(n)],
            "label": np.array(["cat", "dog"], dtype=object)[np.arange(n) % 2],
            "x": np.arange(n, dtype=np.float64),
            "maybe": [None if i % 5 == 0 else f"v{i}" for i in range(n)],
        }
    )
    c = child(ctx, ic.echo)
    c.send(frame)
    received = c.receive()
    c.send(None)
    assert c.close() == 0
    pd.testing.assert_frame_equal(received, frame)
    assert torchshm.is_shared(received["x"].to_numpy())
