"""The dtype x layout matrix, built deterministically (children rebuild it)."""

import numpy as np
from numpy.lib.stride_tricks import as_strided

DTYPES = {
    "bool": np.dtype(bool),
    "int8": np.dtype("i1"),
    "uint16": np.dtype("u2"),
    "int32_big_endian": np.dtype(">i4"),
    "int64": np.dtype("i8"),
    "float16": np.dtype("f2"),
    "float32": np.dtype("f4"),
    "float64_big_endian": np.dtype(">f8"),
    "complex128": np.dtype("c16"),
    "datetime64_ns": np.dtype("M8[ns]"),
    "datetime64_D": np.dtype("M8[D]"),
    "timedelta64_s": np.dtype("m8[s]"),
    "bytes_S7": np.dtype("S7"),
    "unicode_U5": np.dtype("<U5"),
    "void_V12": np.dtype("V12"),
    "structured_padded": np.dtype([("a", "u1"), ("b", "<f8"), ("c", "S3")], align=True),
    "structured_subarray": np.dtype([("x", ">i2", (2, 3)), ("y", "<f4")]),
}


def base_of(dtype, n=960, seed=0):
    raw = np.random.default_rng(seed).integers(0, 256, n * dtype.itemsize, np.uint8)
    return raw.view(dtype)


def _misaligned(dtype):
    raw = bytes(base_of(dtype, 120).tobytes())
    return np.frombuffer(b"\0" + raw, dtype=dtype, offset=1)


LAYOUTS = {
    "c_order_3d": lambda b: b[:120].reshape(4, 5, 6),
    "f_order": lambda b: np.asfortranarray(b[:120].reshape(4, 5, 6)),
    "transposed": lambda b: b[:120].reshape(4, 5, 6).transpose(2, 0, 1),
    "strided": lambda b: b[::3],
    "negative_strides": lambda b: b[::-1],
    "negative_2d": lambda b: b[:120].reshape(4, 5, 6)[:, ::-1, ::-2],
    "sparse": lambda b: b[::16],
    "zero_d": lambda b: b[5:6].reshape(()),
    "zero_size_odd_strides": lambda b: as_strided(b, (0, 7), (-24, 40)),
    "broadcast": lambda b: np.broadcast_to(b[3:4], (300, 400)),
    "read_only": lambda b: _read_only(b[:100]),
    "misaligned": lambda b: _misaligned(b.dtype),
}


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def matrix():
    """[(case id, array)] for every dtype x layout."""
    return [
        (f"{dn}-{ln}", layout(base_of(dtype)))
        for dn, dtype in DTYPES.items()
        for ln, layout in LAYOUTS.items()
    ]


def matrix_arrays():
    return [a for _, a in matrix()]


def assert_same_array(received, sent, keep_strides=True):
    """Same dtype (full descriptor), shape, bytes, flags; strides unless compacted."""
    assert type(received) is type(sent)
    assert received.dtype == sent.dtype and received.dtype.str == sent.dtype.str
    assert received.dtype.descr == sent.dtype.descr
    assert received.shape == sent.shape
    assert value_bytes(received) == value_bytes(sent)
    assert received.flags.writeable == sent.flags.writeable
    if not sent.size:
        return  # numpy's constructors zero an empty array's strides
    if keep_strides:
        assert received.strides == sent.strides
    else:  # compacted: dense, axes in the sender's memory order
        from torchshm import _C

        lo, hi = _C.testing.byte_extent(received)
        assert hi - lo == received.nbytes
        axes = [d for d in range(sent.ndim) if sent.shape[d] > 1]  # others: any stride
        assert sorted(axes, key=lambda d: abs(sent.strides[d])) == sorted(
            axes, key=lambda d: received.strides[d]
        )


def value_bytes(a):
    """The element bytes, without padding, nested structures' included: numpy
    copies do not keep padding (numpy 2.4's tobytes() of a strided structured
    array does not either)."""
    if a.dtype.names:
        return [value_bytes(a[name]) for name in a.dtype.names]
    return a.tobytes()


def is_sparse(a):
    """A view the reducer compacts instead of copying with its gaps."""
    from torchshm import _C
    from torchshm._send.sender import SPARSE_RATIO

    lo, hi = _C.testing.byte_extent(a)
    return hi - lo > SPARSE_RATIO * a.nbytes
