"""SharedList and SharedDict: parity with list and dict (properties against
the plain containers), O(1) pickling, workers under fork, spawn and
forkserver reading every item without writing a page, share(containers=True),
bad items and keys, empty, nested and huge containers."""

import collections
import gc
import pickle
import struct
from multiprocessing.reduction import ForkingPickler

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import torchshm
from torchshm import _containers
from torchshm._tools import doctor as _doctor
from torchshm._containers import _C
from tests import children
from tests import container_children as cc

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess

# Values as a dataset holds them. No NaN: an item is read back as a new
# object, and NaN equals only itself, so [nan] == [nan] holds for one list
# but not between a list and a SharedList (docs/guide/objects.md).
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
key_scalars = st.none() | st.integers() | st.text(max_size=6) | st.binary(max_size=6)
keys = key_scalars | st.tuples(key_scalars, key_scalars)
# Values that only pickle stores exactly (Note [Item codec]): an item that
# holds one goes as a pickle, whole, so containers mix both formats.
pickled_only = (
    st.integers(min_value=2**63)
    | st.integers(max_value=-(2**63) - 1)
    | st.frozensets(st.integers(-3, 3), max_size=2)
    | st.builds(cc.Point, st.tuples(st.integers(), st.text(max_size=2)))
    | st.builds(
        collections.OrderedDict, st.dictionaries(st.text(max_size=2), st.none())
    )
)
values = st.recursive(
    scalars | pickled_only,
    lambda inner: st.lists(inner, max_size=4)
    | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    | st.dictionaries(key_scalars, inner, max_size=3)
    # one object twice in an item: pickle keeps it one object
    | st.lists(inner, min_size=1, max_size=2).map(lambda shared: [shared, shared]),
    max_leaves=12,
)
# What a lookup may be asked: stored kinds, their numeric look-alikes (True,
# 1.0, numpy ints find the key 1 in a dict) and other hashables.
probes = (
    keys
    | st.booleans()
    | st.floats(allow_nan=False)
    | st.integers(-5, 5).map(np.int64)
    | st.integers(-5, 5).map(float)
    | st.frozensets(st.integers(), max_size=2)
    | st.tuples(st.integers(-3, 3).map(float), st.text(max_size=2))
)


def roundtrip(obj):
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


def pickled_size(obj):
    """Bytes of obj's ForkingPickler message. The message is loaded too: an
    unloaded one would hold its tickets until the session ends."""
    data = ForkingPickler.dumps(obj)
    ForkingPickler.loads(data)
    return len(data)


def outcome(fn, *args):
    """What a call returns or which exception type it raises."""
    try:
        return ("value", fn(*args))
    except Exception as exc:  # noqa: BLE001 - compared between containers
        return ("raises", type(exc))


# --- parity with list and dict ----------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(values, max_size=12),
    index=st.integers(-15, 15),
    cut=st.tuples(
        st.none() | st.integers(-15, 15),
        st.none() | st.integers(-15, 15),
        st.none() | st.integers(-4, 4).filter(bool),
    ),
    probe=values,
)
def test_list_parity(items, index, cut, probe):
    for shared in (torchshm.SharedList(items), roundtrip(torchshm.SharedList(items))):
        assert len(shared) == len(items)
        assert shared == items and items == shared and not shared != items
        assert list(shared) == items
        for i, item in enumerate(items):  # bool stays bool, tuple tuple...
            cc.exact(item, shared[i], f"item {i}")
        assert list(reversed(shared)) == list(reversed(items))
        assert outcome(shared.__getitem__, index) == outcome(items.__getitem__, index)
        sliced = shared[slice(*cut)]
        assert isinstance(sliced, torchshm.SharedList)
        assert sliced == items[slice(*cut)]
        assert (probe in shared) == (probe in items)
        assert shared.count(probe) == items.count(probe)
        assert outcome(shared.index, probe) == outcome(items.index, probe)
    assert (shared == items + [0]) is False


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(st.tuples(keys, values), max_size=12),
    probe=probes,
)
def test_dict_parity(pairs, probe):
    plain = dict(pairs)
    for shared in (torchshm.SharedDict(pairs), roundtrip(torchshm.SharedDict(plain))):
        assert len(shared) == len(plain)
        assert shared == plain and plain == shared
        assert list(shared) == list(plain)  # insertion order
        assert list(shared.keys()) == list(plain.keys())
        assert list(shared.values()) == list(plain.values())
        assert list(shared.items()) == list(plain.items())
        for key in plain:
            assert key in shared
            cc.exact(plain[key], shared[key], f"value of {key!r}")
        assert outcome(shared.__contains__, probe) == outcome(plain.__contains__, probe)
        assert outcome(shared.__getitem__, probe) == outcome(plain.__getitem__, probe)
        assert outcome(shared.get, probe, "none") == outcome(plain.get, probe, "none")
        assert shared.keys() == plain.keys()
    assert dict(shared) == plain


def test_numeric_lookups_follow_dict_equality():
    plain = {1: "one", 0: "zero", (1, "a"): "tuple", "s": "str"}
    shared = torchshm.SharedDict(plain)
    for probe in (True, 1.0, np.int64(1), np.float32(1), 1 + 0j, False, (1.0, "a")):
        assert shared[probe] == plain[probe]
    for probe in (1.5, float("nan"), float("inf"), "1", b"s", (1, "b")):
        assert probe not in shared and probe not in plain
    assert shared[np.str_("s")] == "str"
    with pytest.raises(TypeError, match="unhashable"):
        shared[[1]]


def test_equality_with_other_types():
    shared = torchshm.SharedList([1, 2])
    assert shared != (1, 2) and [1, 2] != (1, 2)  # as for a list
    assert shared == torchshm.SharedList([1, 2])
    assert torchshm.SharedDict({"a": 1}) != [("a", 1)]
    with pytest.raises(TypeError, match="unhashable"):
        hash(shared)


@pytest.mark.parametrize("pickled", [False, True], ids=["item format", "pickle"])
def test_items_are_fresh_copies(pickled):
    record = {"boxes": [[1.5, 2.5]], "tags": {"a": 1}}
    # A set forces the pickle; the item format takes the record as it is.
    item = {**record, "set": {0}} if pickled else record
    shared = torchshm.SharedList([item])
    table = torchshm.SharedDict(k=item)
    for read in (lambda: shared[0], lambda: table["k"], lambda: list(shared)[0]):
        first, second = read(), read()
        assert first is not second and first["boxes"] is not second["boxes"]
        assert first["boxes"][0] is not second["boxes"][0]
        first["boxes"][0].append(3.5)
        first["tags"]["b"] = 2
        del first["boxes"]
        assert read() == item and second == item
    assert cc.item_formats(shared) == [0x80 if pickled else _C.ITEM_TAG]


# --- the item format (Note [Item codec]) ----------------------------------------

_held = [1, 2]
_text, _data, _pair, _empty = "held twice", b"twice", (1, 2), []
_loop = []
_loop.append(_loop)


def _nested(depth):
    """A list nested `depth` lists deep."""
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


# Exact builtins: the item format stores them.
NATIVE = [
    cc.record(7),
    None,
    True,
    False,
    0,
    -1,
    2**63 - 1,
    -(2**63),
    -0.0,
    float("-inf"),
    struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0],  # NaN payload 1
    "",
    "naïve ☃ \U0001f600",
    "lone \udc80 surrogate",
    b"",
    b"\x00\xff",
    (1, ("x", b"y"), ()),
    [[True, 1], [1.0, 1], (False, 0)],
    {1: "a", None: b"b", ("t", 2): 2.5, 2.5: [], False: {}, b"k": None},
    [{"x": 1, "y": 2}, {"x": 3, "y": 4}],  # the same key objects: the table's
    ["a", "a", "é", "é", b"z", b"z", (), ()],  # singletons in both processes
    [[], []],  # two lists
    _nested(_C.ITEM_MAX_DEPTH),
]
# Only pickle stores these exactly: the item goes as a pickle, whole.
PICKLED = [
    2**63,
    -(2**63) - 1,
    [1, 2**70],
    {3, 4},
    frozenset(),
    collections.OrderedDict(a=1),
    collections.defaultdict(list, b=[2]),
    cc.Point((1, 2)),
    cc.Pair(1, "b"),
    [cc.Text("sub")],
    {"k": cc.Text("sub")},
    {cc.Text("key"): 1},
    np.float32(2.5),
    [np.int64(3)],
    np.arange(3),
    {"held": _held, "again": _held},
    [_text, _text],
    [_data, _data],
    [_pair, _pair],
    [_empty, _empty],
    _nested(_C.ITEM_MAX_DEPTH + 1),
]


def test_items_take_the_item_format_only_when_it_is_exact():
    shared = torchshm.SharedList(NATIVE + PICKLED)
    formats = cc.item_formats(shared)
    assert formats == [_C.ITEM_TAG] * len(NATIVE) + [0x80] * len(PICKLED)
    for i, item in enumerate(NATIVE + PICKLED):
        cc.exact(item, shared[i], f"item {i}")
    table = torchshm.SharedDict({i: item for i, item in enumerate(NATIVE + PICKLED)})
    for i, item in enumerate(NATIVE + PICKLED):
        cc.exact(item, table[i], f"value {i}")
    assert _C.ITEM_TAG != pickle.dumps(None, 5)[0] == _C.PICKLE_TAG == 0x80


def test_an_object_held_twice_in_an_item_stays_one_object():
    held = {"held": _held, "again": _held}
    twice = [[_text, _text], [_data, _data], [_pair, _pair], [_empty, _empty]]
    shared = torchshm.SharedList([held, *twice, _loop])
    assert cc.item_formats(shared) == [0x80] * 6  # pickled: pickle keeps it one
    read = shared[0]
    assert read == held and read["held"] is read["again"]
    read["held"].append(3)
    assert read["again"] == [1, 2, 3]
    for i, value in enumerate(twice, 1):
        read = shared[i]
        assert read == value and read[0] is read[1]
    loop = shared[-1]
    assert loop[0] is loop


def test_table_strings_are_shared_str_objects():
    shared = torchshm.SharedList([cc.record(i) for i in range(3)])
    first, second = shared[0], shared[1]
    # A key comes back as the one interned str: no copy, hash kept.
    assert all(a is b for a, b in zip(first, second))
    assert next(iter(first)) is "id"  # noqa: F632 - the interned literal
    assert first["file_name"] is not shared[0]["file_name"]  # values are fresh


def test_construction_names_an_unpicklable_item_inside_a_plain_one():
    with pytest.raises(TypeError, match=r"SharedList: item 1 \(dict\) cannot be"):
        torchshm.SharedList([{"a": 1}, {"a": lambda: 0}])


# --- corrupted buffers: a clear ValueError, never a crash ----------------------


def _list_over(data, offsets=None, strings=b""):
    """A SharedList over raw bytes, as one that another process sent."""
    offsets = [0, len(data)] if offsets is None else offsets
    return _containers.rebuild_shared_list(
        np.frombuffer(bytes(data), np.uint8).copy(),
        np.array(offsets, np.int64),
        (),
        np.frombuffer(strings, np.uint8).copy(),
    )


BAD_ITEMS = {
    b"\x01": "ends inside a value",
    b"\x01i": "malformed int",
    b"\x01f\x00\x00": "float past the end",
    b"\x01s\x05ab": "past the end",
    b"\x01s\x03ab": "past the end",  # the length's own byte is not the str's
    b"\x01l\x02N": "past the end",
    b"\x01s\x02\xff\xfe": "not UTF-8",
    b"\x01s" + b"\xff" * 11: "malformed length",
    b"\x01y\xff\xff\xff\xff\xff\xff\xff\xff\x7f": "past the end",
    b"\x01l\xff\xff\xff\xff\xff\xff\xff\xff\x01": "past the end",
    b"\x01d\x02N": "past the end",
    b"\x01k\x01": "past the string table",
    b"\x01d\x01l\x00N": "not hashable",
    b"\x01NN": "bytes after the value",
    b"\x01Z": "unknown value tag",
    b"\x01" + b"l\x01" * 200 + b"N": "nested too deep",
    b"\x02N": "starts with byte 0x02",
}


@pytest.mark.parametrize("data", BAD_ITEMS, ids=[str(i) for i in range(len(BAD_ITEMS))])
def test_a_corrupted_item_is_a_value_error_naming_it(data):
    shared = _list_over(b"\x01N" + data, [0, 2, 2 + len(data)], strings=b"\x01a")
    assert shared[0] is None
    with pytest.raises(ValueError, match="SharedList item 1 is corrupted") as raised:
        shared[1]
    assert BAD_ITEMS[data] in str(raised.value)
    cause = {"not UTF-8": UnicodeDecodeError, "not hashable": TypeError}
    if BAD_ITEMS[data] in cause:  # what Python said, kept as the cause
        assert isinstance(raised.value.__cause__, cause[BAD_ITEMS[data]])
    with pytest.raises(ValueError, match="SharedList item 1 is corrupted"):
        list(shared)


@pytest.mark.parametrize("offsets", [[0, 9], [2, 1], [-1, 1], [0, 0], [0, 2**62]])
def test_offsets_outside_the_buffer_are_a_value_error(offsets):
    shared = _list_over(b"\x01N", offsets)
    with pytest.raises(ValueError, match=r"item 0 is corrupted: its offsets"):
        shared[0]


def test_a_corrupted_string_table_is_a_value_error():
    for table in (b"\x05ab", b"\x02\xff\xfe", b"\x80"):
        with pytest.raises(ValueError, match="string table is corrupted"):
            _list_over(b"\x01N", strings=table)


def test_every_cut_of_a_native_item_is_a_value_error():
    shared = torchshm.SharedList([NATIVE[0], NATIVE[-6]])
    item = shared._buf[: shared._offsets[1]].tobytes()
    for cut in range(1, len(item)):
        broken = _list_over(item[:cut], strings=shared._strings.tobytes())
        with pytest.raises(ValueError, match="item 0 is corrupted"):
            broken[0]


@settings(max_examples=300, deadline=None)
@given(
    item=st.sampled_from(range(len(NATIVE))),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
)
def test_garbled_native_items_decode_or_raise_value_error(item, flips):
    shared = torchshm.SharedList([NATIVE[item]])
    # Past the format byte: one garbled to 0x80 would make it a pickle.
    data = bytearray(shared._buf.tobytes())
    for where, byte in flips:
        data[1 + where % (len(data) - 1)] = byte
    garbled = _list_over(data, strings=shared._strings.tobytes())
    table = torchshm.SharedDict(k=NATIVE[item])
    value_at = int(table._offsets[1]) + 1
    data = bytearray(table._buf.tobytes())
    for where, byte in flips:
        data[value_at + where % (len(data) - value_at)] = byte
    garbled_table = _containers.rebuild_shared_dict(
        np.frombuffer(bytes(data), np.uint8).copy(),
        table._offsets,
        table._starts,
        table._slots,
        (),
        table._strings,
    )
    reads = {
        "SharedList item 0": garbled.__getitem__,
        "SharedDict value 0": garbled_table.get,
    }
    for name, read in reads.items():
        try:
            read(0 if name.startswith("SharedList") else "k")
        except ValueError as exc:
            assert f"{name} is corrupted" in str(exc)


def test_indices_of_other_types():
    shared = torchshm.SharedList("abc")
    assert shared[np.int64(1)] == "b"
    with pytest.raises(TypeError, match="integers or slices, not str"):
        shared["1"]


# --- read-only ---------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.append(1),
        lambda s: s.extend([1]),
        lambda s: s.insert(0, 1),
        lambda s: s.pop(),
        lambda s: s.remove(1),
        lambda s: s.clear(),
        lambda s: s.sort(),
        lambda s: s.reverse(),
        lambda s: s.__setitem__(0, 5),
        lambda s: s.__delitem__(0),
        lambda s: s.__iadd__([1]),
        lambda s: s.__imul__(2),
    ],
)
def test_list_mutation_says_how_to_build_a_new_one(mutate):
    shared = torchshm.SharedList([1, 2])
    with pytest.raises(TypeError, match=r"read-only.*SharedList\(\[\*shared, item\]\)"):
        mutate(shared)
    assert shared == [1, 2]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.__setitem__("a", 2),
        lambda d: d.__delitem__("a"),
        lambda d: d.pop("a"),
        lambda d: d.popitem(),
        lambda d: d.clear(),
        lambda d: d.update(b=1),
        lambda d: d.setdefault("b", 1),
        lambda d: d.__ior__({"b": 1}),
    ],
)
def test_dict_mutation_says_how_to_build_a_new_one(mutate):
    shared = torchshm.SharedDict(a=1)
    with pytest.raises(TypeError, match=r"read-only.*SharedDict\(\{\*\*shared"):
        mutate(shared)
    assert shared == {"a": 1}


def test_augmented_assignment_is_refused():
    shared = torchshm.SharedList([1])
    with pytest.raises(TypeError, match="read-only"):
        shared += [2]


# --- bad items, keys and arrays -------------------------------------------------


def test_unpicklable_item_is_named_by_index():
    with pytest.raises(TypeError, match=r"SharedList: item 2 \(function\) cannot be"):
        torchshm.SharedList([1, 2, lambda: 3])


def test_unpicklable_value_is_named_by_key():
    with pytest.raises(TypeError, match=r"the value of key 'bad' \(generator\)"):
        torchshm.SharedDict({"ok": 1, "bad": (i for i in range(2))})


@pytest.mark.parametrize("key", [1.5, True, frozenset(), (1, 2.0), np.int64(3)])
def test_keys_of_other_types_are_refused(key):
    with pytest.raises(TypeError, match="keys must be str, int, bytes, None"):
        torchshm.SharedDict({key: 1})


def test_arrays_that_are_not_a_container_are_refused():
    with pytest.raises(TypeError, match="SharedList's offsets"):
        _containers.rebuild_shared_list(np.zeros(4, np.uint8), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="inconsistent SharedDict"):
        _containers.rebuild_shared_dict(
            np.zeros(4, np.uint8), *(np.zeros(k, np.int64) for k in (3, 4, 1))
        )


# --- empty and nested ------------------------------------------------------------


@pytest.mark.parametrize("make", [torchshm.SharedList, torchshm.SharedDict])
def test_empty_containers(make):
    shared = make()
    empty = [] if make is torchshm.SharedList else {}
    assert len(shared) == 0 and list(shared) == [] and shared == empty
    for copy in (roundtrip(shared), pickle.loads(pickle.dumps(shared))):
        assert len(copy) == 0 and copy == empty
    assert "x" not in shared


def test_nested_containers_are_kept_by_reference():
    inner = torchshm.SharedList(cc.records(50))
    table = torchshm.SharedDict({"k": "v"})
    outer = torchshm.SharedList([inner, {"inner": table}, inner])
    got = outer[0]
    assert isinstance(got, torchshm.SharedList) and got == inner
    # The same shared pages, not a copy of them in the outer buffer.
    assert np.shares_memory(got._buf, inner._buf)
    assert outer.nbytes < inner.nbytes
    assert outer[1]["inner"]["k"] == "v"
    assert len(outer._children) == 2  # inner once, although held twice
    received = roundtrip(outer)
    assert received[2] == inner and np.shares_memory(received[2]._buf, inner._buf)
    # An item's raw pickle names its child by number: only the container reads it.
    raw = outer._buf[outer._offsets[0] : outer._offsets[1]].tobytes()
    with pytest.raises(pickle.UnpicklingError, match="through its container"):
        pickle.loads(raw)


def test_nested_in_a_dict():
    inner = torchshm.SharedDict({i: cc.record(i) for i in range(20)})
    outer = torchshm.SharedDict({"train": inner, "n": 20})
    assert outer["train"][3] == cc.record(3)
    assert pickle.loads(pickle.dumps(outer))["train"][19] == cc.record(19)


# --- pickling: O(1) with torchshm, by value with pickle --------------------------


def test_pickling_is_a_reference_whatever_the_size():
    small = torchshm.SharedList(cc.records(100))
    large = torchshm.SharedList(cc.records(20_000))
    assert torchshm.is_shared(large._buf) and torchshm.is_shared(large._offsets)
    assert abs(pickled_size(large) - pickled_size(small)) < 16  # digits of sizes
    assert pickled_size(large) < 1000 < large.nbytes // 1000
    received = roundtrip(large)
    assert np.shares_memory(received._buf, large._buf)
    assert received[12_345] == cc.record(12_345)
    # Plain pickle (files) carries the buffers by value.
    assert len(pickle.dumps(large)) > large._buf.nbytes
    assert pickle.loads(pickle.dumps(large)) == large


def test_handles_load_a_reference():
    table = torchshm.SharedDict({r["file_name"]: r for r in cc.records(2000)})
    handle = torchshm.dumps(table)
    assert len(handle) < 4000
    loaded = torchshm.loads(handle)
    assert np.shares_memory(loaded._buf, table._buf)
    assert loaded["000000001999.jpg"] == cc.record(1999)
    # The handle lives as long as the exported SharedDict (weakly referenced).
    del table, loaded
    gc.collect()
    with pytest.raises(torchshm.HandleError):
        torchshm.loads(handle)


def test_buffers_are_read_only():
    shared = torchshm.SharedList([1])
    for arr in (shared._buf, shared._offsets, roundtrip(shared)._buf):
        assert not arr.flags.writeable


def test_without_the_reducers_the_buffers_stay_private():
    with torchshm.disabled():
        shared = torchshm.SharedList(cc.records(10))
    assert not torchshm.is_shared(shared._buf)
    assert shared[9] == cc.record(9)


# --- workers: fork, spawn, forkserver ---------------------------------------------


def test_workers_read_every_item_without_writing_a_page(ctx, child):
    items = cc.records(3000)
    containers = {
        "list": torchshm.SharedList(items),
        "dict": torchshm.SharedDict({r["file_name"]: r for r in items}),
        # both item formats, and values only pickle keeps
        "mixed": torchshm.SharedList(cc.mixed_items() * 20),
    }
    for name, shared in containers.items():
        # The parent reads every item, so every page of the buffer is mapped
        # here too: a page only the child mapped would count as private.
        if isinstance(shared, torchshm.SharedList):
            expected = list(shared)
        else:
            expected = list(shared.items())
            expected += [(key, shared[key]) for key in shared]
        c = child(ctx, cc.read_every_item, shared)
        report = c.receive()
        c.send("done")
        assert c.close() == 0
        assert report["len"] == len(shared) and report["shared"]
        assert report["checksum"] == cc.checksum(expected)
        (mapping,) = report["mappings"]
        assert _doctor.SEGMENT_MAPPING in mapping["path"]
        # The buffer is read-only: its copy-on-write mapping (Note [Snapshots
        # are mapped privately] in csrc/lifetime/segment.h), from which reading copies
        # no page.
        assert mapping["perms"] == "rw-p"
        assert mapping["private_dirty_kb"] == 0, mapping


def test_forked_readers_dirty_no_pages_unlike_a_plain_list(child):
    """The copy-on-read problem itself: a forked child reading a plain list of
    records writes (so copies) the pages of every record; reading the same
    records from a SharedList copies none."""
    ctx = torch.multiprocessing.get_context("fork")
    items = cc.records(40_000)  # ~45 MB of Python objects
    growth = {}
    for name, container in (("list", items), ("shared", torchshm.SharedList(items))):
        c = child(ctx, cc.dirty_growth, container)
        growth[name] = c.receive()
        assert c.close() == 0
    assert growth["list"] > 16 * 1024, growth  # kB: most of the records' pages
    assert growth["shared"] < growth["list"] / 10, growth


def test_nested_in_workers(ctx, child):
    inner = torchshm.SharedList(["a", "b"])
    outer = torchshm.SharedList([inner, {"inner": torchshm.SharedDict(k=7)}])
    c = child(ctx, cc.read_nested, outer)
    assert c.receive() == [["a", "b"], 7, True]
    assert c.close() == 0


# --- share(containers=True) -------------------------------------------------------


def test_share_converts_lists_and_dicts_only_when_asked():
    dataset = cc.MetadataDataset(1500)
    plain = torchshm.share(dataset)
    assert type(plain.records) is list and type(plain.by_name) is dict

    shared = torchshm.share(dataset, containers=True)
    assert isinstance(shared.records, torchshm.SharedList)
    assert isinstance(shared.by_name, torchshm.SharedDict)
    assert shared.records == dataset.records and shared.by_name == dataset.by_name
    assert torchshm.is_shared(shared.records._buf)
    assert type(shared.classes) is list  # fewer than min_items
    assert torchshm.is_shared(shared.image_sizes)  # arrays shared as before
    assert pickled_size(shared) < 8000  # every part a reference
    assert shared[7] == {"id": 7, "same": True, "kind": "SharedList", "shared": True}

    smaller = torchshm.share(dataset, containers=True, min_items=2)
    assert isinstance(smaller.classes, torchshm.SharedList)


def test_share_keeps_lists_that_hold_arrays_or_tensors():
    big = [np.full(100_000, i, dtype=np.float32) for i in range(3)]
    holder = {
        "arrays": big * 400,
        "float_keys": {float(i): i for i in range(1200)},
        "small_arrays": [np.zeros(2)] * 1200,
    }
    torchshm.set_threshold(1 << 18)
    shared = torchshm.share(holder, containers=True)
    assert type(shared["arrays"]) is list and torchshm.is_shared(shared["arrays"][0])
    assert type(shared["float_keys"]) is dict
    assert isinstance(shared["small_arrays"], torchshm.SharedList)
    assert np.array_equal(shared["small_arrays"][5], np.zeros(2))
    # Tensors are torch's to share (decided without pickling one here: torch
    # would start its fd-passing machinery in this process).
    assert _containers.reduce_converted([torch.zeros(2)] * 1200, 1000) is None


def test_share_names_the_unpicklable_item():
    data = {"records": [1] * 1500 + [lambda: 0]}
    with pytest.raises(TypeError, match=r"torchshm.share: item 1500 \(function\)"):
        torchshm.share(data, containers=True)
    with pytest.raises(ValueError, match="min_items"):
        torchshm.share(data, containers=True, min_items=-1)


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("containers", [False, True])
def test_a_child_writes_what_share_made_and_the_parent_sees_it(ctx, child, containers):
    """share(containers=True) shares as share() does: arrays written through
    by every holder, not snapshots that each holder writes privately."""
    model = {"w": np.zeros(300_000), "names": [str(i) for i in range(1500)]}
    shared = torchshm.share(model, containers=containers)
    assert isinstance(shared["names"], torchshm.SharedList) == containers
    c = child(ctx, children.fill_received)
    c.send(([shared["w"]], 9.0))
    assert c.receive() == [True]
    assert (shared["w"] == 9.0).all()
    c.send("exit")
    assert c.close() == 0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shared_dataset_in_dataloader_workers(method):
    dataset = torchshm.share(cc.MetadataDataset(2000), containers=True)
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        multiprocessing_context=method,
        worker_init_fn=torchshm.worker_init_fn,
        sampler=range(0, 2000, 97),
        timeout=cc.TIMEOUT,
    )
    got = list(loader)
    assert [g["id"] for g in got] == list(range(0, 2000, 97))
    assert all(g["same"] and g["shared"] and g["kind"] == "SharedList" for g in got)


# --- huge: more than 2 GiB of items ----------------------------------------------

HUGE_ITEM = 750 << 20  # 3 items: 2.2 GiB, past any 32-bit offset


def _room_for(nbytes):
    # Segments are memfds: memory, not /dev/shm, bounds them.
    return psutil.virtual_memory().available > 3 * nbytes


@pytest.mark.timeout(600)
@pytest.mark.skipif(not _room_for(3 * HUGE_ITEM), reason="needs ~7 GiB of memory")
def test_huge_items_past_2_gib(child):
    def items():  # built one at a time: the test holds < 6 GB at its peak
        for i in range(3):
            yield bytes([i + 1]) * HUGE_ITEM

    huge = torchshm.SharedList(items())
    try:
        gc.collect()
        assert huge._offsets[-1] > 2**31 and len(huge) == 3
        assert torchshm.is_shared(huge._buf)
        # The first item and, by a negative index, the last (past 2**31);
        # each read decodes a fresh 750 MiB copy.
        for i in (0, -1):
            item = huge[i]
            assert len(item) == HUGE_ITEM and item[:1] == item[-1:] == bytes(
                [i % 3 + 1]
            )
            del item
        assert len(huge[1:]) == 2 and huge[1:]._offsets[0] > 2**29
        assert pickled_size(huge) < 1000
        ctx = torch.multiprocessing.get_context("fork")
        c = child(ctx, cc.read_last_huge, huge)
        assert c.receive() == (HUGE_ITEM, b"\x03", b"\x03")
        assert c.close() == 0
    finally:
        del huge
        gc.collect()
        torchshm.trim()
