"""Child targets and datasets for test_shared_containers, at module top
level so that spawn and forkserver children import them. Every wait is
bounded (see tests/children.py)."""

import collections
import gc
import random
import struct
import zlib

import numpy as np
import torch.utils.data

import torchshm
from torchshm._tools import doctor as _doctor

TIMEOUT = 120


def record(i, rng=None):
    """A COCO-like annotation record: an id, a file name, 4 boxes, a category."""
    rng = rng or random.Random(i)
    return {
        "id": i,
        "file_name": f"{i:012d}.jpg",
        "boxes": [[rng.random() * 640, rng.random() * 480, 20.0, 30.5] for _ in "abcd"],
        "category": i % 80,
    }


def records(n):
    return [record(i) for i in range(n)]


def checksum(items):
    """A digest of the pickled items (equal items, equal digest)."""
    import pickle

    digest = 0
    for item in items:
        digest = zlib.crc32(pickle.dumps(item, 5), digest)
    return digest


def mappings_over(arr):
    """The /proc/self/smaps entries (perms, path, Private_Dirty kB) of the
    mappings that hold `arr`'s memory."""
    lo = arr.__array_interface__["data"][0]
    hi = lo + arr.nbytes
    found, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                current = None
                if start < hi and lo < end:
                    current = {"perms": head[1], "path": " ".join(head[5:])}
                    found.append(current)
            elif current is not None and head[0] == "Private_Dirty:":
                current["private_dirty_kb"] = int(head[1])
    return found


def private_dirty_kb():
    """kB of pages this process copied: Private_Dirty of every mapping but
    torchshm's segments (/proc/self/smaps). A segment's pages count as
    Private_Dirty while only this process maps them (one whose other
    mappers, its parent among them, let go), though nothing was copied."""
    total, in_segment = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                in_segment = _doctor.SEGMENT_MAPPING in line
            elif head and head[0] == "Private_Dirty:" and not in_segment:
                total += int(head[1])
    return total


def read_every_item(inbox, outbox, container):
    """Reads every item (values too, for a dict), then reports a checksum,
    whether the buffers are shared memory, and the smaps entries over them."""
    if isinstance(container, torchshm.SharedDict):
        items = list(container.items())
        items += [(key, container[key]) for key in container]
    else:
        items = list(container)
    outbox.put(
        {
            "checksum": checksum(items),
            "len": len(container),
            "shared": torchshm.is_shared(container._buf),
            "mappings": mappings_over(container._buf),
        }
    )
    inbox.get(timeout=TIMEOUT)  # the parent has read our report


def dirty_growth(inbox, outbox, container):
    """kB of private dirty pages that reading every item adds to this
    (forked) process. The collector is off: a collection writes the header
    of every tracked object it inherited, a cost SharedList also avoids but
    that would hide what reading alone does."""
    gc.disable()
    before = private_dirty_kb()
    total = 0.0
    for item in container:
        total += item["id"] + item["category"] + len(item["file_name"])
        for box in item["boxes"]:
            total += sum(box)
    outbox.put(private_dirty_kb() - before)


def read_nested(inbox, outbox, outer):
    inner = outer[0]
    outbox.put([list(inner), outer[1]["inner"]["k"], torchshm.is_shared(inner._buf)])


def read_last_huge(inbox, outbox, huge):
    last = huge[len(huge) - 1]
    outbox.put((len(last), last[:1], last[-1:]))


class MetadataDataset(torch.utils.data.Dataset):
    """A dataset of records, by position and by file name, plus a few class
    names (too few to convert) and a large array (shared as an array)."""

    def __init__(self, n):
        self.records = records(n)
        self.by_name = {r["file_name"]: r for r in self.records}
        self.classes = ["cat", "dog"]
        self.image_sizes = np.full((n, 2), 640, dtype=np.int64)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        same = self.by_name[r["file_name"]] == r
        return {
            "id": r["id"],
            "same": same,
            "kind": type(self.records).__name__,
            "shared": torchshm.is_shared(getattr(self.records, "_buf", None)),
        }


def exact(a, b, where="item"):
    """Asserts that b is a, value for value and type for type: bool is not
    int, tuple is not list, and floats compare by their bits (-0.0, NaN
    payloads)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if type(a) is float:
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} {b!r}"
    elif type(a) in (list, tuple):
        assert len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            exact(x, y, f"{where}[{i}]")
    elif type(a) is np.ndarray:
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{where}: {a!r} {b!r}"
    elif type(a) is dict:
        assert len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, ((ka, va), (kb, vb)) in enumerate(zip(a.items(), b.items())):
            exact(ka, kb, f"{where} key {i}")
            exact(va, vb, f"{where}[{ka!r}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


class Point(tuple):
    """A tuple subclass (as a namedtuple is): pickled, never flattened."""


class Text(str):
    """A str subclass: pickled, so that it reads back as a Text."""


Pair = collections.namedtuple("Pair", "a b")


def item_formats(container):
    """The first byte of each item (of each value, for a SharedDict): the
    item format's tag or 0x80, a pickle (Note [Item format], csrc/items/items.h)."""
    step = 2 if isinstance(container, torchshm.SharedDict) else 1
    starts = container._offsets[step - 1 : -1 : step]
    return [int(container._buf[start]) for start in starts]


def mixed_items():
    """Items of every kind a SharedList holds: builtins of exact types, and
    values only pickle represents exactly (subclasses, big ints, sets,
    objects held twice, numpy values). Deterministic: stored test data
    (tests/data/containers_*.json) is checked against it."""
    shared_list = [1, 2]
    return [
        record(1),
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**63,
        -(2**70),
        1.5,
        -0.0,
        float("inf"),
        struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0],  # NaN, payload 1
        "",
        "a",
        "naïve ☃ \U0001f600",
        "lone \ud800 surrogate",
        b"",
        b"\x00\xff" * 3,
        (1, (2, "x"), ()),
        [],
        {},
        {1: "int key", None: [b"z"], ("t", 2): {"k": (True, 0.25)}, 2.5: False},
        [[True, 1], [1.0, 1]],
        {3, 4},
        collections.OrderedDict(a=1),
        collections.defaultdict(list, b=[2]),
        Point((1, 2)),
        {"shared": shared_list, "again": shared_list},
        np.float32(2.5),
        np.arange(3),
    ]
