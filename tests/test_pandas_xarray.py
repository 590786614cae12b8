"""Real pandas and xarray objects through real processes under fork, spawn
and forkserver: equal on arrival, every numeric array in shared memory."""

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import torchshm
from tests import integration_children as ic
from tests.conftest import stats_delta


def assert_all_shared(obj):
    arrays = ic.arrays_in(obj)
    assert arrays, "expected numeric arrays inside the object"
    unshared = [(a.dtype, a.shape) for a in arrays if not torchshm.is_shared(a)]
    assert not unshared, f"arrays not in shared memory: {unshared}"


def round_trip(child, ctx, obj):
    c = child(ctx, ic.echo)
    c.send(obj)
    received = c.receive()
    c.send(None)
    assert c.close() == 0
    return received


def test_frame_with_every_column_kind(ctx, no_leaks, child):
    frame = ic.make_frame(3)
    series = frame["when"]
    got_frame, got_series = round_trip(child, ctx, (frame, series))
    # Checked before any comparison: pandas builds caches lazily, in plain memory.
    assert_all_shared(got_frame)
    assert_all_shared(got_series)
    pd.testing.assert_frame_equal(got_frame, frame)
    pd.testing.assert_series_equal(got_series, series)
    assert isinstance(got_frame.index, pd.MultiIndex)
    assert str(got_frame["when"].dt.tz) == "Europe/Paris"
    assert got_frame["nullable"].isna().sum() == frame["nullable"].isna().sum()


@pytest.mark.parametrize("kind", ["dataset", "dataarray"])
def test_xarray_with_coordinates_and_negative_steps(ctx, no_leaks, child, kind):
    sent = ic.make_sample(kind, 2)
    received = round_trip(child, ctx, sent)
    assert_all_shared(received)
    xr.testing.assert_identical(received, sent)
    # isel(lat=slice(None, None, -1)) made negative strides; they survive.
    data, sent_data = (x["t2m"] if kind == "dataset" else x for x in (received, sent))
    assert data.values.strides == sent_data.values.strides
    assert min(data.values.strides) < 0
    assert received.coords["lat"].values[0] > received.coords["lat"].values[-1]


def test_scalar_and_string_coordinates_are_shared(ctx, no_leaks, child):
    sent = ic.make_dataset(1)
    received = round_trip(child, ctx, sent)
    xr.testing.assert_identical(received, sent)
    assert received.coords["level"].values.shape == ()
    assert received.coords["station"].dtype.kind == "U"
    for name in ("level", "station", "height"):
        assert torchshm.is_shared(received.coords[name].values), name


def test_shared_frame_and_dataset_are_sent_without_a_copy(ctx, no_leaks, child):
    frame, dataset = torchshm.share((ic.make_frame(0), ic.make_dataset(0)))
    assert_all_shared(frame)
    assert_all_shared(dataset)
    before = torchshm.stats()
    received_frame, received_dataset = round_trip(child, ctx, (frame, dataset))
    assert stats_delta(before)["bytes_copied"] == 0
    pd.testing.assert_frame_equal(received_frame, frame)
    xr.testing.assert_identical(received_dataset, dataset)
    # The child sent back the very memory it received.
    assert np.shares_memory(received_frame["f64"].values, frame["f64"].values)
    assert np.shares_memory(received_dataset["t2m"].values, dataset["t2m"].values)
