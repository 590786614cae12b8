"""Messages pickled by an earlier torchshm load in this one: the wire format
(torchshm/_reduction.py) promises to stay.

tests/data/wire_format_1.json holds messages and a handle written by the
first version of this format, in a process whose session has since ended;
wire_format_1_counted.json the same from the last version that wrapped a
counted inline array (16 KiB up to the threshold) in rebuild_inline with a
message token (commit 639ea58); later versions send it in numpy's own form.
Arrays carried in the message itself load as they were; arrays whose segment
is gone fail with a clear OSError (ENOENT) that names the segment, and the
handle with HandleError, never a TypeError from arguments that moved. A new
wire format adds a file here; old files stay, and every later version must
keep loading them. To write this version's file (once, for a new format):

    python -m tests.test_wire_format tests/data/wire_format_<N>.json
"""

import errno
import json
import os
import pickle
import sys
import warnings

import numpy as np
import pytest

import torchshm

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
STORED = sorted(f for f in os.listdir(DATA) if f.startswith("wire_format_"))


def _cases():
    """(name, object) pairs whose pickles the stored files hold."""
    base = np.arange(24, dtype="<i4").reshape(4, 6)  # numpy drops ">" here
    return [
        ("empty", np.empty((0, 3), dtype=">i2")),
        ("inline_view", base[1:, ::2]),
        ("inline_fortran", np.asfortranarray(np.arange(6, dtype="<f8").reshape(2, 3))),
        ("inline_structured", np.zeros(3, dtype=[("a", "<i2"), ("b", "S3")])),
        # 32 KiB: counted towards the message's small bytes (PACK_MIN up).
        ("inline_counted", np.arange(8192, dtype="<f8").reshape(64, 128)[:, ::2]),
        ("shared", np.full(1 << 17, 7.0)),  # 1 MiB: above the threshold
    ]


def write(path):
    from multiprocessing.reduction import ForkingPickler

    record = {"torchshm": torchshm.__version__, "messages": {}, "expected": {}}
    for name, value in _cases():
        record["messages"][name] = bytes(ForkingPickler.dumps(value)).hex()
        record["expected"][name] = {
            "dtype": value.dtype.descr if value.dtype.names else value.dtype.str,
            "shape": list(value.shape),
            "bytes": np.ascontiguousarray(value).tobytes().hex()
            if value.nbytes <= 64 << 10
            else None,
            "f_contiguous": bool(value.flags.f_contiguous),
        }
    record["handle"] = torchshm.dumps({"x": np.full(1 << 17, 3.0)}).hex()
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


@pytest.fixture(params=STORED)
def stored(request):
    with open(os.path.join(DATA, request.param)) as f:
        return json.load(f)


def _load(hexed):
    with warnings.catch_warnings():
        # NumPy 2 loads NumPy 1's module names (numpy.core) with a warning.
        warnings.simplefilter("ignore", DeprecationWarning)
        return pickle.loads(bytes.fromhex(hexed))


def test_arrays_carried_in_a_stored_message_load_as_they_were(stored):
    names = [n for n in stored["messages"] if n != "shared"]
    assert len(names) >= 4, names
    for name in names:
        array = _load(stored["messages"][name])
        expected = stored["expected"][name]
        descr = array.dtype.descr if array.dtype.names else array.dtype.str
        assert json.loads(json.dumps(descr)) == expected["dtype"], name
        assert list(array.shape) == expected["shape"], name
        assert np.ascontiguousarray(array).tobytes().hex() == expected["bytes"], name
        assert bool(array.flags.f_contiguous) == expected["f_contiguous"], name


def test_a_stored_message_whose_segment_is_gone_fails_clearly(stored):
    with pytest.raises(OSError) as raised:
        _load(stored["messages"]["shared"])
    assert raised.value.errno == errno.ENOENT
    assert "is gone" in str(raised.value)


def test_a_stored_handle_whose_exporter_is_gone_is_a_handle_error(stored):
    with pytest.raises(torchshm.HandleError) as raised:
        torchshm.loads(bytes.fromhex(stored["handle"]))
    assert raised.value.errno in (errno.ESTALE, errno.ENOENT)


if __name__ == "__main__":
    write(sys.argv[1])
