"""Bad input (GitHub issue 5): every odd array arrives equal or falls back to
plain pickling, through the real transports, without hurting the feeder."""

import mmap
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import as_strided

import torchshm
from tests import cases, children, naive_receiver
from tests.fault_children import Tagged

TERABYTES = (2**38, 4)  # float64: 8 TiB that span 32 bytes
PADDED_SUBARRAY = np.dtype(
    [("x", ">i2", (2, 3)), ("pad", "u1"), ("y", "<f8"), ("s", "S3")], align=True
)
NESTED = np.dtype(
    [("inner", [("a", "u1"), ("b", ">f4", (2,))]), ("c", "<c8", (2, 2))], align=True
)


def _structured(dtype, n):
    return np.frombuffer(np.arange(n * dtype.itemsize, dtype=np.uint8), dtype=dtype)


def _object_of_arrays():
    base = np.arange(1000.0)
    obj = np.empty(3, dtype=object)
    obj[0], obj[1], obj[2] = base, base[::-1], "text"
    return obj


@pytest.fixture
def bad_inputs(tmp_path):
    """{case id: object}; files are kept open by the arrays over them."""
    path = tmp_path / "memmap.bin"
    mm = np.memmap(path, dtype=np.float32, mode="w+", shape=(200, 50))
    mm[:] = np.arange(10_000).reshape(200, 50)
    mm.flush()
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(4096, dtype=np.int32).tobytes())
    with open(raw, "r+b") as f:
        file_map = mmap.mmap(f.fileno(), 0)
    odd = as_strided(np.arange(10.0), (0, 7), (-24, 40))
    return {
        "object": np.array([1, "a", None, 2.5, {"k": 1}], dtype=object),
        "object_of_arrays": _object_of_arrays(),
        "containers_of_object": {
            "objects": [np.array([None, 1], dtype=object)] * 2,
            "numbers": (np.arange(100), np.array(["x", 3], dtype=object)),
        },
        "structured_with_object": np.array(
            [(1, "a"), (2, None)], dtype=[("i", "<i4"), ("o", "O")]
        ),
        "memmap": mm,
        "memmap_view": mm[::-3, 1::2],
        "memmap_read_only": np.memmap(path, dtype=np.float32, mode="r"),
        "recarray": np.rec.fromarrays([np.arange(50), np.arange(50.0)], names="a,b"),
        "masked": np.ma.masked_array(np.arange(100.0), mask=np.arange(100) % 3 == 0),
        "unknown_subclass": np.arange(120).reshape(10, 12).view(Tagged),
        "non_native": np.arange(1000, dtype=">f8").reshape(50, 20)[:, ::-1],
        "non_native_structured": _structured(np.dtype([("a", ">u4"), ("b", ">f2")]), 9),
        "misaligned": np.frombuffer(
            b"\0" + np.arange(100, dtype="<i8").tobytes(), dtype="<i8", offset=1
        ),
        "read_only_bytes": np.frombuffer(bytes(range(256)) * 8, dtype=np.uint16),
        "file_mmap": np.frombuffer(file_map, dtype=np.int32)[7:],
        "broadcast_terabytes": np.broadcast_to(np.arange(4.0), TERABYTES),
        "structured_subarray_padding": _structured(PADDED_SUBARRAY, 40),
        "structured_nested": _structured(NESTED, 30)[::-2],
        "zero_size_odd_strides": odd,
        "zero_size_structured": np.empty((3, 0, 2), dtype=PADDED_SUBARRAY),
        "zero_d": np.array(np.datetime64("2024-03-30T12:00", "ns")),
    }


def assert_arrives_equal(got, sent):
    if isinstance(sent, dict):
        assert got.keys() == sent.keys()
        for key in sent:
            assert_arrives_equal(got[key], sent[key])
    elif isinstance(sent, (list, tuple)):
        assert type(got) is type(sent) and len(got) == len(sent)
        for g, s in zip(got, sent):
            assert_arrives_equal(g, s)
    elif isinstance(sent, np.ma.MaskedArray):
        assert type(got) is type(sent)
        np.testing.assert_array_equal(got.data, sent.data)
        np.testing.assert_array_equal(got.mask, sent.mask)
    elif isinstance(sent, np.ndarray) and sent.dtype.hasobject:
        assert type(got) is type(sent) and got.dtype == sent.dtype
        assert got.shape == sent.shape
        for g, s in zip(got.ravel().tolist(), sent.ravel().tolist()):
            assert_arrives_equal(g, s)
    elif isinstance(sent, np.ndarray) and sent.shape == TERABYTES:
        assert got.shape == sent.shape and got.strides == sent.strides
        assert got.dtype == sent.dtype and not got.flags.writeable
        np.testing.assert_array_equal(got[[0, 12345678901, -1]], sent[[0, 1, -1]])
    elif isinstance(sent, np.ndarray):
        cases.assert_same_array(got, sent, keep_strides=not cases.is_sparse(sent))
    else:
        assert got == sent


def test_bad_input_in_one_process(bad_inputs):
    before = torchshm.stats()
    with warnings.catch_warnings():
        # Deliberate fallbacks are silent; only a failure would warn.
        warnings.simplefilter("error", RuntimeWarning)
        for case, sent in bad_inputs.items():
            got = ForkingPickler.loads(ForkingPickler.dumps(sent))
            assert_arrives_equal(got, sent)
    after = torchshm.stats()
    # The five object arrays (the list holds one twice: pickled once) fall back
    # by design; nothing else failed inside the reducer.
    fallbacks = {
        k: after["fallbacks"][k] - before["fallbacks"].get(k, 0)
        for k in after["fallbacks"]
        if after["fallbacks"][k] != before["fallbacks"].get(k, 0)
    }
    assert fallbacks == {"object dtype": 5}
    # The terabyte broadcast cost its 32-byte span, not its nominal size.
    assert after["bytes_copied"] - before["bytes_copied"] < 10 << 20


def test_bad_input_through_a_child_and_back(ctx, bad_inputs, no_leaks, child):
    # Each goes alone through the parent's feeder thread and the child's: a
    # reducer that raised would drop it and break the order. (bad_inputs
    # before no_leaks: its files stay open until pytest drops it.)
    c = child(ctx, children.echo)
    for case, sent in bad_inputs.items():
        c.send((case, sent))
    c.send(("end", None))
    for case, sent in bad_inputs.items():
        got_case, got = c.receive()
        assert got_case == case
        assert_arrives_equal(got, sent)
    assert c.receive() == ("end", None)
    c.send(None)
    assert c.close() == 0


def test_a_receiver_that_never_imported_torchshm(no_leaks, child):
    import multiprocessing as mp

    arrays = [np.arange(1000.0), np.arange(12, dtype=">i4").reshape(3, 4)[:, ::-1]]
    c = child(mp.get_context("spawn"), naive_receiver.receive)
    c.send(arrays)
    result = c.receive()
    assert c.close() == 0
    assert not result["imported_before"] and result["imported_after"]
    assert result["arrays"] == [(a.dtype.str, a.shape, a.tobytes()) for a in arrays]


# Crafted messages (GitHub issue 19): a pickle can name torchshm's rebuild
# function with any arguments. Each must be refused with an error at load,
# before any array exists: a view reaching outside its storage, or a dtype
# whose items are pointers, crashes whoever touches it.

_OWNER_BYTES = 4096


class _Crafted:
    """Pickles as a call to the rebuild function with arguments made by hand."""

    def __init__(self, *view):
        self.view = view

    def __reduce__(self):
        from torchshm._reduction import rebuild_ndarray

        owner = torch.full((_OWNER_BYTES,), 0x41, dtype=torch.int8)
        return rebuild_ndarray, (owner,) + self.view + (True, None)


def _string_dtype():
    """NumPy 2's variable-width strings: an item points to a heap buffer."""
    string_dtype = getattr(getattr(np, "dtypes", None), "StringDType", None)
    if string_dtype is None:
        pytest.skip(f"NumPy {np.__version__} has no StringDType")
    return string_dtype()


@pytest.mark.parametrize(
    "offset,dtype,shape,strides",
    [
        # A zero-size dimension spans no bytes, but its offset still places
        # the data pointer: as_strided(received, (1,), (8,)) reads there.
        (2**46, "<f8", (0,), (8,)),
        (-8, "<f8", (0, 3), (24, 8)),
        (_OWNER_BYTES + 1, "<f8", (3, 0), (8, 8)),
        (2**62, "V0", (5,), (0,)),  # zero itemsize: no bytes either
        (-1, np.dtype([]), (2,), (0,)),
    ],
    ids=["empty_far", "empty_negative", "empty_past_end", "V0_far", "no_fields_neg"],
)
def test_crafted_offsets_are_refused(offset, dtype, shape, strides):
    with pytest.raises(RuntimeError, match="reaches outside its storage"):
        ForkingPickler.loads(
            ForkingPickler.dumps(_Crafted(offset, dtype, shape, strides))
        )


@pytest.mark.parametrize(
    "dtype",
    ["|O", [("i", "<i4"), ("o", "O")], [("a", "O", (2,))], ("O", (2,)), "string"],
    ids=["object", "structured_object", "subarray_object", "object_subarray", "T"],
)
def test_crafted_dtypes_with_references_are_refused(dtype):
    """Bytes from a segment are never Python objects (the sender pickles
    such arrays by value): read as pointers they crash the receiver."""
    dtype = _string_dtype() if dtype == "string" else np.dtype(dtype)
    shape, strides = (4,), (dtype.itemsize,)
    with pytest.raises(TypeError, match="holds references"):
        ForkingPickler.loads(ForkingPickler.dumps(_Crafted(0, dtype, shape, strides)))
    with pytest.raises(TypeError, match="holds references"):
        ForkingPickler.loads(ForkingPickler.dumps(_Crafted(0, dtype, (0,), strides)))


@pytest.mark.parametrize(
    "offset,dtype,shape,strides",
    [
        (0, "<f8", (0,), (8,)),
        (_OWNER_BYTES, "<f8", (0, 2), (16, 8)),  # one past the end, like NumPy's own
        (_OWNER_BYTES, "S0", (3,), (0,)),
        (_OWNER_BYTES - 8, "<f8", (1,), (8,)),
    ],
)
def test_crafted_views_inside_their_storage_still_load(offset, dtype, shape, strides):
    got = ForkingPickler.loads(
        ForkingPickler.dumps(_Crafted(offset, dtype, shape, strides))
    )
    assert got.shape == shape and got.dtype == np.dtype(dtype)
