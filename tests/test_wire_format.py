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

tests/data/containers_<N>.json hold SharedLists and SharedDicts pickled with
plain pickle (their buffers by value, as in a file): containers_1 by the
version that pickled every item, containers_2 by the first with torchshm's
item format (Note [Item format] in csrc/items/items.h), and a file for each later
item format. Written the same way:

    python -m tests.test_wire_format tests/data/containers_<N>.json
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
CONTAINERS = sorted(f for f in os.listdir(DATA) if f.startswith("containers_"))


def _save(path, record):
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def _stored_file(name):
    """The record of a stored file of tests/data."""
    with open(os.path.join(DATA, name)) as f:
        return json.load(f)


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
    _save(path, record)


@pytest.fixture(params=STORED)
def stored(request):
    return _stored_file(request.param)


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


def _container_cases():
    """(name, container) pairs whose plain pickles containers_*.json hold."""
    from tests import container_children as cc

    items = cc.mixed_items()
    keyed = {f"k{i}": item for i, item in enumerate(items)}
    keyed.update({7: "int key", b"b": None, None: (1,), ("t", 1): [2.5]})
    inner = torchshm.SharedList(cc.records(3))
    outer = [inner, {"inner": torchshm.SharedDict(a=cc.record(2))}, inner]
    return [
        ("list", torchshm.SharedList(items)),
        ("dict", torchshm.SharedDict(keyed)),
        ("nested", torchshm.SharedList(outer)),
    ]


def _plain(obj):
    """obj with every SharedList and SharedDict in it read out, tagged."""
    if isinstance(obj, torchshm.SharedList):
        return ("SharedList", [_plain(item) for item in obj])
    if isinstance(obj, torchshm.SharedDict):
        return ("SharedDict", [(key, _plain(value)) for key, value in obj.items()])
    if type(obj) is list:
        return [_plain(item) for item in obj]
    if type(obj) is dict:
        return {key: _plain(value) for key, value in obj.items()}
    return obj


def write_containers(path):
    record = {"torchshm": torchshm.__version__, "pickles": {}, "expected": {}}
    for name, container in _container_cases():
        record["pickles"][name] = pickle.dumps(container, 5).hex()
        record["expected"][name] = pickle.dumps(_plain(container), 5).hex()
    _save(path, record)


@pytest.fixture(params=CONTAINERS)
def stored_containers(request):
    return request.param, _stored_file(request.param)


@pytest.mark.parametrize("name", [n for n, _ in _container_cases()])
def test_containers_pickled_by_an_earlier_version_read_as_they_were(
    stored_containers, name
):
    from tests import container_children as cc

    stored_as, record = stored_containers
    container = _load(record["pickles"][name])
    cc.exact(_load(record["expected"][name]), _plain(container), stored_as)
    if name == "list":
        both = container[29]  # one list held twice in one item stays one list
        assert both["shared"] is both["again"]
    formats = set(cc.item_formats(container))
    if stored_as == "containers_1.json":  # written when every item was a pickle
        assert formats == {0x80}
    elif name == "list":  # later: items in the item format, and pickles
        assert formats == {0x80, 0x01}


if __name__ == "__main__":
    if os.path.basename(sys.argv[1]).startswith("containers_"):
        write_containers(sys.argv[1])
    else:
        write(sys.argv[1])
