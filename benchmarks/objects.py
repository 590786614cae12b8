"""Micro-benchmarks of Python objects, in one process (issue 21):

    python -m benchmarks.micro containers strings

containers: the cost of reading one record of a SharedList against a plain
list, and where it goes (offsets and the buffer slice, unpickling, the
method around them); SharedDict lookups against a dict.

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


def container_access(n=200_000):
    # The SharedList first, while no plain list of records lives in this
    # process: a worker that reads a SharedList holds none either.
    shared = torchshm.SharedList(make_records(n))
    view, off = shared._view, shared._off
    pieces = [view[off[i] : off[i + 1]] for i in range(n)]

    def index():
        for i in range(n):
            shared[i]

    def index_touch():
        for i in range(n):
            touch(shared[i])

    def iterate():
        for record in shared:
            pass

    def unpickle():
        for piece in pieces:
            pickle.loads(piece)

    def slices():
        for i in range(n):
            view[off[i] : off[i + 1]]

    costs = {
        "SharedList[i]": _best_per_item(index, n),
        "  of which pickle.loads(item bytes)": _best_per_item(unpickle, n),
        "  of which offsets and buffer slice": _best_per_item(slices, n),
    }
    costs["  of which the method call and checks"] = (
        costs["SharedList[i]"]
        - costs["  of which pickle.loads(item bytes)"]
        - costs["  of which offsets and buffer slice"]
    )
    costs["touch(SharedList[i]) (read every field)"] = _best_per_item(index_touch, n)
    costs["for record in SharedList"] = _best_per_item(iterate, n)
    pieces = shared = None  # free them before the plain list is built
    records = list(make_records(n))

    def plain_index():
        for i in range(n):
            records[i]

    def plain_touch():
        for i in range(n):
            touch(records[i])

    # detectron2's layout before it moved to one numpy buffer: the same
    # pickles, each its own bytes object in a list.
    serialized = [pickle.dumps(r, _containers.PROTOCOL) for r in records]

    def serialized_loads():
        for i in range(n):
            pickle.loads(serialized[i])

    costs["list[i]"] = _best_per_item(plain_index, n)
    costs["touch(list[i])"] = _best_per_item(plain_touch, n)
    costs["pickle.loads(list_of_bytes[i])"] = _best_per_item(serialized_loads, n)
    serialized = None

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

    costs["SharedDict[file_name]"] = _best_per_item(lookup, n)
    costs["  of which finding the key (file_name in SharedDict)"] = _best_per_item(
        contains, n
    )
    costs["dict[file_name]"] = _best_per_item(dict_lookup, n)
    print(f"per record, {n:,} COCO-like records, best of 5:")
    for what, us in costs.items():
        print(f"  {what:55s} {us:6.3f} us")
    serialized_ratio = costs["SharedList[i]"] / costs["pickle.loads(list_of_bytes[i])"]
    touched_ratio = (
        costs["touch(SharedList[i]) (read every field)"] / costs["touch(list[i])"]
    )
    print(
        f"  SharedList[i] / pickle.loads(list_of_bytes[i]): {serialized_ratio:.1f}x;"
        f" reading every field, SharedList / list: {touched_ratio:.1f}x"
    )


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
    """Send and receive of a column packed like a SharedList's items."""

    def send():
        packer = _containers._Packer()
        for i, item in enumerate(column):
            packer.add_object(item, f"item {i}", "micro")
        return packer.arrays()

    buf, offsets = send()
    view, off = memoryview(buf), memoryview(offsets)

    def receive():
        out = np.empty(len(column), dtype=object)
        out[:] = [pickle.loads(view[off[i] : off[i + 1]]) for i in range(len(column))]
        return out

    return send, receive
