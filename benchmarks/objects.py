"""Micro-benchmarks of Python objects, in one process (issue 21):

    python -m benchmarks.micro containers strings

containers: the cost of reading one record of a SharedList against a plain
list, and where it goes (the method and finding the item's bytes, measured
on a SharedList of None; decoding the record), the same for items stored as
pickles (buffers written before torchshm's item format, and items it cannot
hold); writing a SharedList, both ways; SharedDict lookups against a dict.

strings: a 2,000,000-element object column of strings, pickled as numpy
does, packed like a SharedList (a pickle per string), and joined with NUL
into one UTF-8 buffer (what torchshm sends, Note [String columns] in
torchshm/_strings.py), for three shapes of column.
"""

import pickle
import time

import numpy as np

import torchshm
from benchmarks.scenarios.metadata import make_records, touch
from torchshm import _containers, _strings


def _best_per_item(fn, n, repeat=5):
    """Microseconds per item, best of `repeat` (noise on a shared machine
    only ever adds time)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / n * 1e6


def _time_round(fns, n, best):
    """Runs every fn once; keeps the best microseconds per item of each."""
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        us = (time.perf_counter() - start) / n * 1e6
        best[name] = min(best.get(name, us), us)


def _reads(container, n, fn=None):
    if fn is None:

        def run():
            for i in range(n):
                container[i]

    else:

        def run():
            for i in range(n):
                fn(container[i])

    return run


def _loads(pieces):
    def run():
        for piece in pieces:
            pickle.loads(piece)

    return run


def container_access(n=200_000, rounds=7):
    shared = torchshm.SharedList(make_records(n))
    nones = torchshm.SharedList([None] * n)  # items that take no decoding
    pickled = _pickled_list(make_records(n))
    buf, off = pickled._buf, pickled._offsets
    pieces = [buf[off[i] : off[i + 1]].tobytes() for i in range(n)]

    def iterate():
        for record in shared:
            pass

    shared_fns = {
        "SharedList[i]": _reads(shared, n),
        "  of which the method and finding the bytes (None items)": _reads(nones, n),
        "touch(SharedList[i]) (read every field)": _reads(shared, n, touch),
        "for record in SharedList": iterate,
        "pickled items: SharedList[i]": _reads(pickled, n),
        "  of which pickle.loads(item bytes)": _loads(pieces),
        "pickled items: touch(SharedList[i])": _reads(pickled, n, touch),
    }
    # Rounds alternate the SharedLists with a plain list that exists only
    # for its own round: a worker that reads a SharedList holds no plain
    # list, and a slow spell of the machine hits both sides alike.
    costs = {}
    for _ in range(rounds):
        _time_round(shared_fns, n, costs)
        records = list(make_records(n))
        # detectron2's layout before it moved to one numpy buffer: the same
        # pickles, each its own bytes object in a list.
        serialized = [pickle.dumps(r, _containers.PROTOCOL) for r in records]
        plain_fns = {
            "list[i]": _reads(records, n),
            "touch(list[i])": _reads(records, n, touch),
            "pickle.loads(list_of_bytes[i])": _loads(serialized),
            "writing: SharedList(records), per record": lambda: torchshm.SharedList(
                records
            ),
            "writing, pickled items, per record": lambda: _pickled_list(records),
        }
        _time_round(plain_fns, n, costs)
        records = serialized = plain_fns = None
    costs["  of which decoding the record"] = (
        costs["SharedList[i]"]
        - costs["  of which the method and finding the bytes (None items)"]
    )
    shared_fns = pieces = shared = nones = pickled = None

    records = list(make_records(n))
    table = torchshm.SharedDict((r["file_name"], r) for r in records)
    plain = {r["file_name"]: r for r in records}
    names = [r["file_name"] for r in records]

    def lookup():
        for name in names:
            table[name]

    def contains():
        for name in names:
            name in table

    def dict_lookup():
        for name in names:
            plain[name]

    dict_fns = {
        "SharedDict[file_name]": lookup,
        "  of which finding the key (file_name in SharedDict)": contains,
        "dict[file_name]": dict_lookup,
    }
    for _ in range(rounds):
        _time_round(dict_fns, n, costs)
    order = [
        "SharedList[i]",
        "  of which decoding the record",
        "  of which the method and finding the bytes (None items)",
        "touch(SharedList[i]) (read every field)",
        "for record in SharedList",
        "pickled items: SharedList[i]",
        "  of which pickle.loads(item bytes)",
        "pickled items: touch(SharedList[i])",
        "list[i]",
        "touch(list[i])",
        "pickle.loads(list_of_bytes[i])",
        "writing: SharedList(records), per record",
        "writing, pickled items, per record",
        "SharedDict[file_name]",
        "  of which finding the key (file_name in SharedDict)",
        "dict[file_name]",
    ]
    print(f"per record, {n:,} COCO-like records, best of {rounds} rounds:")
    for what in order:
        print(f"  {what:58s} {costs[what]:6.3f} us")
    plain_touch = costs["touch(list[i])"]
    touched = costs["touch(SharedList[i]) (read every field)"] / plain_touch
    pickled = costs["pickled items: touch(SharedList[i])"] / plain_touch
    decode = (
        costs["  of which decoding the record"]
        / costs["  of which pickle.loads(item bytes)"]
    )
    print(
        f"  reading every field, SharedList / list: {touched:.2f}x (pickled"
        f" items: {pickled:.2f}x); decoding a record / pickle.loads: {decode:.2f}x"
    )


def _pickled_list(records):
    """A SharedList whose every item is a pickle, as torchshm wrote them
    before its item format (and still writes items the format cannot
    hold)."""
    buf, offsets, children, strings = _containers._pack_list(
        records, _containers._Packer(codec=False), "SharedList"
    )
    # In shared memory, as SharedList(records) puts its buffers.
    buf, offsets, strings = _containers._share(buf, offsets, strings)
    return _containers.rebuild_shared_list(buf, offsets, children, strings)


def string_columns(n=2_000_000):
    columns = {
        "1000 values, an object each (astype(object))": (np.arange(n) % 1000)
        .astype(str)
        .astype(object),
        "all distinct (file names)": np.array(
            [f"{i:012d}.jpg" for i in range(n)], dtype=object
        ),
        "4 values, 4 objects repeated": np.array(["a1", "b2", "c3", "d4"], object)[
            np.arange(n) % 4
        ],
    }
    print(f"object column of {n:,} strings, send / receive, best of 3:")
    for name, column in columns.items():
        data = pickle.dumps(column, 5)
        picked = _strings.reduce_str_array(column)
        rows = {
            "pickle": (
                lambda: pickle.dumps(column, 5),
                lambda: pickle.loads(data),
            ),
            "a pickle per string (SharedList-like)": _per_string(column),
        }
        if picked is not None:
            rebuild, args = picked
            rows["NUL-joined UTF-8 (torchshm)"] = (
                lambda: _strings.reduce_str_array(column),
                lambda: rebuild(*args),
            )
        print(f"  {name}: torchshm {'packs' if picked else 'pickles'} it")
        for label, (send, receive) in rows.items():
            s = _best_per_item(send, 1, 3) / 1e3
            r = _best_per_item(receive, 1, 3) / 1e3
            print(f"    {label:40s} {s:7.0f} ms + {r:7.0f} ms = {s + r:7.0f} ms")


def _per_string(column):
    """Send and receive of a column packed like a SharedList's items as
    they were before the item format: a pickle each (what the row and
    Note [String columns] compare)."""

    def send():
        packer = _containers._Packer(codec=False)
        for i, item in enumerate(column):
            packer.add_object(item, f"item {i}", "micro")
        return packer.arrays()

    buf, offsets, _ = send()
    view, off = memoryview(buf), memoryview(offsets)

    def receive():
        out = np.empty(len(column), dtype=object)
        out[:] = [pickle.loads(view[off[i] : off[i + 1]]) for i in range(len(column))]
        return out

    return send, receive
