"""Real pandas and xarray objects through real processes under fork, spawn
and forkserver: equal on arrival, every numeric array in shared memory."""

import sys
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import torchshm
from tests import integration_children as ic
from tests.conftest import segment_mappings, stats_delta

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess


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


@pytest.mark.spawn_one_case
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


def arrow_buffers_sent(monkeypatch):
    """The sizes of the pyarrow Buffers this process pickles from now on
    (none if pyarrow was never imported)."""
    sizes = []
    pa = sys.modules.get("pyarrow")
    if pa is not None:
        reduce = ForkingPickler._extra_reducers[pa.Buffer]

        def recording(buffer):
            sizes.append(buffer.size)
            return reduce(buffer)

        monkeypatch.setitem(ForkingPickler._extra_reducers, pa.Buffer, recording)
    return sizes


def test_shared_frame_and_dataset_are_sent_without_a_copy(
    ctx, no_leaks, child, monkeypatch
):
    frame, dataset = torchshm.share((ic.make_frame(0), ic.make_dataset(0)))
    assert_all_shared(frame)
    assert_all_shared(dataset)
    arrow_sizes = arrow_buffers_sent(monkeypatch)
    before = torchshm.stats()
    received_frame, received_dataset = round_trip(child, ctx, (frame, dataset))
    # pandas pickles an Arrow-backed column (pandas 3's str) as new buffers,
    # combining its chunks at every pickle: those, and only those, are copied.
    assert stats_delta(before)["bytes_copied"] == sum(arrow_sizes)
    pd.testing.assert_frame_equal(received_frame, frame)
    xr.testing.assert_identical(received_dataset, dataset)
    # The child sent back the very memory it received.
    assert np.shares_memory(received_frame["f64"].values, frame["f64"].values)
    assert np.shares_memory(received_dataset["t2m"].values, dataset["t2m"].values)


# pandas 3: `str` columns (Arrow-backed when pyarrow is installed, else
# Python-backed), pd.ArrowDtype, and copy-on-write.


def str_dtype(storage):
    """pandas 3's `str` dtype on `storage`; pandas < 2.3 has no na_value, and
    its StringDtype (pd.NA for missing) stands in."""
    try:
        return pd.StringDtype(storage, na_value=np.nan)
    except TypeError:
        return pd.StringDtype(storage)


def make_pandas3_frame(arrow, n=64):
    """Every column kind a pandas 3 user has; Arrow-backed ones if `arrow`."""
    rng = np.random.default_rng(0)
    words = [None if i % 5 == 0 else f"w{i}-é" for i in range(n)]
    columns = {
        "inferred": words,  # the default: str on pandas 3, object before
        "str_python": pd.array(words, dtype=str_dtype("python")),
        "cat": pd.Categorical([None if i % 6 == 0 else "xyz"[i % 3] for i in range(n)]),
        "nullable": pd.array([None if i % 7 == 0 else i for i in range(n)], "Int64"),
        "when": pd.Series(
            pd.date_range("2024-03-30", periods=n, freq="h", tz="Europe/Paris")
        ).where(np.arange(n) % 4 != 0),
        "f64": np.where(np.arange(n) % 3 == 0, np.nan, rng.random(n)),
    }
    if arrow:
        import pyarrow as pa

        columns["str_arrow"] = pd.array(words, dtype=str_dtype("pyarrow"))
        ints = [None if i % 4 == 0 else i * 10 for i in range(n)]
        columns["arrow_int"] = pd.array(ints, dtype=pd.ArrowDtype(pa.int64()))
        columns["arrow_str"] = pd.array(words, dtype=pd.ArrowDtype(pa.string()))
    index = pd.MultiIndex.from_arrays(
        [[f"g{i // 8}" for i in range(n)], range(n)], names=["group", "step"]
    )
    return pd.DataFrame(columns, index=index)


def arrow_buffers(chunked):
    """The pyarrow Buffers under a ChunkedArray (an Arrow-backed column's:
    series.array.__arrow_array__())."""
    return [b for c in chunked.chunks for b in c.buffers() if b is not None]


def in_segment(buffer):
    """Whether a pyarrow Buffer's bytes lie in a torchshm segment."""
    start = np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]
    for line in segment_mappings():
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low <= start and start + buffer.size <= high:
            return True
    return False


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("arrow", [False, True], ids=["numpy-backed", "arrow"])
def test_pandas3_column_kinds_arrive_equal(ctx, no_leaks, child, arrow):
    if arrow:
        pytest.importorskip("pyarrow")
    frame = make_pandas3_frame(arrow)
    got = round_trip(child, ctx, frame)
    assert_all_shared(got)
    pd.testing.assert_frame_equal(
        got,
        frame,
        check_exact=True,
        check_index_type=True,
        check_column_type=True,
        check_flags=True,
    )
    assert list(got.dtypes) == list(frame.dtypes)
    for name in frame:
        missing = frame[name].isna()
        assert missing.any(), name
        assert got[name].isna().equals(missing), name
    assert got.index.equals(frame.index) and got.index.names == frame.index.names
    if arrow:
        for name in ("str_arrow", "arrow_int", "arrow_str"):
            chunked = got[name].array.__arrow_array__()
            buffers = [b for b in arrow_buffers(chunked) if b.size]
            assert buffers and all(map(in_segment, buffers)), name


def test_arrow_buffers_of_a_shared_table_are_sent_by_reference(ctx, no_leaks, child):
    pa = pytest.importorskip("pyarrow")
    table = pa.table(
        {
            "n": pa.array([None if i % 3 == 0 else i for i in range(1000)]),
            "s": pa.array([f"s{i}" if i % 5 else None for i in range(1000)]),
        }
    )
    shared = torchshm.share(table)
    before = torchshm.stats()
    got = round_trip(child, ctx, shared)
    assert stats_delta(before)["bytes_copied"] == 0
    assert got.equals(table)
    for name in ("n", "s"):
        sent, received = (arrow_buffers(t.column(name)) for t in (shared, got))
        assert all(map(in_segment, received))
        for a, b in zip(sent, received):
            assert np.shares_memory(
                np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
            )


def hold_table(inbox, outbox, table):
    """A spawn worker's start: it receives the table in its arguments and
    keeps it, as a worker keeps its Dataset."""
    outbox.put(table.num_rows)
    inbox.get()


def test_an_unchanged_arrow_table_sent_to_six_spawn_workers_is_copied_once(
    no_leaks, child
):
    # A datasets.Dataset is an Arrow table in memory: each spawn worker's
    # start pickles it anew, and each pickle makes new Buffer objects.
    import multiprocessing as mp

    pa = pytest.importorskip("pyarrow")
    column = np.arange(3 << 20, dtype=np.int64)  # 24 MiB
    table = pa.table({"x": pa.array(column), "y": pa.array(column[::-1].copy())})
    before = torchshm.stats()
    workers = [child(mp.get_context("spawn"), hold_table, table) for _ in range(6)]
    assert [w.receive() for w in workers] == [table.num_rows] * 6
    copied = stats_delta(before)["bytes_copied"]
    for w in workers:
        w.send(None)
        assert w.close() == 0
    assert table.nbytes <= copied < 2 * table.nbytes


def test_an_arrow_table_whose_bytes_changed_is_copied_again():
    pa = pytest.importorskip("pyarrow")
    column = np.arange(1 << 18, dtype=np.int64)  # 2 MiB, over the memory
    table = pa.table({"x": pa.array(column)})  # of `column`: no copy
    first = ForkingPickler.loads(ForkingPickler.dumps(table))
    before = torchshm.stats()
    again = ForkingPickler.loads(ForkingPickler.dumps(table))
    assert stats_delta(before)["bytes_copied"] == 0
    column[:3] = -1
    before = torchshm.stats()
    changed = ForkingPickler.loads(ForkingPickler.dumps(table))
    assert stats_delta(before)["bytes_copied"] >= column.nbytes
    assert changed.column("x")[:3].to_pylist() == [-1, -1, -1]
    assert first.column("x")[:3].to_pylist() == again.column("x")[:3].to_pylist()
    assert first.column("x")[:3].to_pylist() == [0, 1, 2]


def make_cow_frame():
    return pd.DataFrame(
        {
            "x": np.arange(100.0),
            "n": np.arange(100),
            "s": [f"v{i}" for i in range(100)],
            "nullable": pd.array(range(100), dtype="Int64"),
        }
    )


def test_writes_after_a_round_trip_stay_on_their_side(ctx, no_leaks, child):
    frame = make_cow_frame()
    expected = frame.copy(deep=True)
    got = round_trip(child, ctx, frame)
    for name in ("x", "n"):
        # pandas 3 hands out read-only views (.values, .to_numpy()) of a
        # frame's arrays; the receiver's are as the sender's.
        for sent, received in (
            (frame[name].values, got[name].values),
            (frame[name].to_numpy(), got[name].to_numpy()),
        ):
            assert received.flags.writeable == sent.flags.writeable, name
    got.loc[0, "x"] = -1.0
    got.loc[1, "s"] = "changed"
    got.loc[2, "nullable"] = None
    got["n"] = -got["n"]
    pd.testing.assert_frame_equal(frame, expected)
    expected = got.copy(deep=True)
    frame.loc[3, "x"] = -3.0
    frame.loc[4, "s"] = "changed"
    frame["n"] = 0
    pd.testing.assert_frame_equal(got, expected)
    assert got.loc[0, "x"] == -1.0 and got.loc[3, "x"] == 3.0


def test_writes_to_a_shared_frame_are_seen_by_both_sides(ctx, no_leaks, child):
    shared = torchshm.share(make_cow_frame())
    got = round_trip(child, ctx, shared)
    assert np.shares_memory(got["x"].to_numpy(), shared["x"].to_numpy())
    got.loc[0, "x"] = -1.0
    assert shared.loc[0, "x"] == -1.0
    shared.loc[1, "x"] = -2.0
    assert got.loc[1, "x"] == -2.0


def test_pyarrow_is_not_imported_and_its_buffers_register_at_its_import():
    pytest.importorskip("pyarrow")
    from tests.test_config import run_json

    found = run_json(
        """
        import json, sys
        from multiprocessing.reduction import ForkingPickler
        import torchshm
        before = "pyarrow" in sys.modules
        import pyarrow
        reducer = ForkingPickler._extra_reducers.get(pyarrow.Buffer)
        watching = [f for f in sys.meta_path
                    if type(f).__module__ == "torchshm._send.arrow"]
        torchshm.unregister()
        gone = pyarrow.Buffer not in ForkingPickler._extra_reducers
        torchshm.register()
        print(json.dumps([before, reducer is torchshm._send.arrow.reduce_buffer,
                          len(watching), gone,
                          pyarrow.Buffer in ForkingPickler._extra_reducers]))
        """
    )
    assert found == [False, True, 0, True, True]


def test_a_failing_arrow_buffer_is_pickled_by_value(monkeypatch):
    pa = pytest.importorskip("pyarrow")
    from torchshm import _reduction

    class Broken:
        def get(self, address):
            raise LookupError("broken")

    monkeypatch.setattr(_reduction, "ARROW_BUFFERS", Broken())
    array = pa.array([f"s{i}" if i % 3 else None for i in range(5000)])
    before = torchshm.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # once per process
        got = ForkingPickler.loads(ForkingPickler.dumps(array))
    assert got.equals(array)
    assert stats_delta(before)["fallbacks"] == {"internal error: LookupError": 3}
