"""SharedList and SharedDict: Python objects that every process of a node
reads from one copy in shared memory.

Note [Copy-on-read]
~~~~~~~~~~~~~~~~~~~
A list of Python objects in a Dataset is copied into every DataLoader
worker: pickled to spawn and forkserver workers, and, under fork, page by
page, because reading an object writes its reference count (and a garbage
collection writes its header) on the page that holds it (pytorch#13246).
So the items live here as bytes instead: each item pickled once, one after
the other, into one uint8 buffer, with an int64 array of offsets (item i is
buf[offsets[i]:offsets[i + 1]]). Raw bytes have no reference counts: reading
an item unpickles a fresh copy of it and writes nothing to the buffer, and
both arrays live in torchshm shared memory, so a pickled SharedList is a
reference to them (O(1)) and every process maps the same pages.

The cost is an unpickle per read (about a microsecond for a record of two
dozen objects: README, Python objects) and read-only semantics: a read
returns a copy, so mutating it changes nothing, and the container cannot be
mutated at all.
"""

import array
import collections.abc
import copyreg
import io
import operator
import pickle
import zlib
from typing import Any, Iterable, Iterator, Tuple

import numpy as np
import torch

from torchshm import _config, _keys, _registry

_crc32 = zlib.crc32
# Fixed, not pickle.HIGHEST_PROTOCOL: a SharedList pickled to a file by one
# Python must read in another.
PROTOCOL = 5
_REPR_ITEMS = 8


def _read_only(message: str):
    def refuse(self, *args, **kwargs):
        raise TypeError(message.format(type(self).__name__))

    return refuse


class _NotPlain(Exception):
    """An item holds an array or a tensor that sharing keeps as it is."""


def _nested_child(index):
    """Names a nested SharedList or SharedDict inside an item's pickle; only
    its container's unpickler can resolve it (see _ItemUnpickler)."""
    raise pickle.UnpicklingError(
        "this pickle is an item of a torchshm SharedList or SharedDict that"
        " holds a nested one: read it through its container"
    )


class _ItemPickler(pickle.Pickler):
    """Pickles the items of one container, one complete pickle per item.

    Note [Nested containers]: a SharedList or SharedDict inside an item is
    not copied into the buffer: it becomes a child of the container
    (pickled with it, by reference when shared) and the item's pickle names
    it by number. The dispatch table catches exactly those two types, so
    items without them pickle at pickle's own speed."""

    def __init__(self, out, children, plain_only):
        super().__init__(out, PROTOCOL)
        table = copyreg.dispatch_table.copy()
        table[SharedList] = table[SharedDict] = self._nested
        if plain_only:
            for kind in _registry.TYPES:
                table[kind] = self._small_array
            table[torch.Tensor] = self._refuse
        self.dispatch_table = table
        self.children = children
        self._numbers = {}
        self._threshold = _config.get_threshold()

    def _nested(self, container):
        number = self._numbers.get(id(container))
        if number is None:
            number = self._numbers[id(container)] = len(self.children)
            self.children.append(container)
        return _nested_child, (number,)

    def _small_array(self, arr):
        if arr.nbytes >= self._threshold and not arr.dtype.hasobject:
            raise _NotPlain
        return arr.__reduce_ex__(PROTOCOL)

    def _refuse(self, obj):
        raise _NotPlain


class _ItemUnpickler(pickle.Unpickler):
    """Reads an item of a container with children (Note [Nested containers])."""

    def __init__(self, data, children):
        super().__init__(io.BytesIO(data))
        self._children = children

    def find_class(self, module, name):
        if module == __name__ and name == "_nested_child":
            return self._children.__getitem__
        return super().find_class(module, name)


class _Packer:
    """Writes entries one after the other into one buffer; entry i is
    buf[offsets[i]:offsets[i + 1]]."""

    def __init__(self, plain_only=False):
        self._out = io.BytesIO()
        self._offsets = array.array("q", [0])
        self.children = []
        self._pickler = _ItemPickler(self._out, self.children, plain_only)

    def add_bytes(self, data) -> None:
        self._out.write(data)
        self._offsets.append(self._out.tell())

    def add_object(self, obj, where: str, container: str) -> None:
        try:
            self._pickler.dump(obj)
        except _NotPlain:
            raise
        except Exception as exc:
            raise TypeError(
                f"torchshm.{container}: {where} ({type(obj).__name__}) cannot be"
                f" pickled: {exc}. Every item is pickled once into shared"
                " memory: make it picklable, or leave it out"
            ) from exc
        finally:
            self._pickler.clear_memo()
        self._offsets.append(self._out.tell())

    def arrays(self) -> Tuple[np.ndarray, np.ndarray]:
        """(buffer, offsets): read-only views of what was written (they keep
        it alive), for _share to copy into shared memory once."""
        buf = np.frombuffer(self._out.getbuffer(), dtype=np.uint8)
        offsets = np.frombuffer(self._offsets, dtype=np.int64)
        return _frozen(buf), _frozen(offsets)


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _share(*arrays):
    """The arrays in shared memory (one message: one copy each), read-only.

    Without torchshm's reducers (TORCHSHM_DISABLE=1) they stay private: a
    fork still shares them without copy-on-read, other starts get a copy."""
    if _registry.is_registered():
        arrays = _registry.round_trip(arrays)
    return tuple(_frozen(a) for a in arrays)


def _check_array(container, what, arr, dtype, minimum=0):
    if not (
        isinstance(arr, np.ndarray)
        and arr.dtype == dtype
        and arr.ndim == 1
        and len(arr) >= minimum
    ):
        raise TypeError(
            f"torchshm: not a {container}'s {what}: expected a 1-D {dtype}"
            f" array of at least {minimum} elements, got {type(arr).__name__}"
            f" {getattr(arr, 'dtype', '')} {getattr(arr, 'shape', '')}"
        )


class SharedList(collections.abc.Sequence):
    """A read-only list whose items are pickled once into shared memory.

    `SharedList(iterable)` pickles each item (with pickle, protocol 5) into
    one byte buffer plus int64 offsets, both in torchshm shared memory.
    Indexing unpickles just that item (a fresh copy per read); len, `in`,
    iteration, slices (a SharedList over the same buffer), index, count and
    == (with lists and SharedLists) behave as for a list. Pickling it through
    a multiprocessing transport or torchshm.dumps sends a reference to its
    memory; under fork, workers read it without writing a page of it. With
    plain pickle (a file) its buffers are pickled by value.
    """

    __slots__ = (
        "_buf",
        "_offsets",
        "_children",
        "_view",
        "_off",
        "_n",
        "_load",
        "__weakref__",  # torchshm.dumps keeps a handle while its object lives
    )

    def __init__(self, iterable: Iterable[Any] = ()):
        buf, offsets, children = _pack_list(iterable, _Packer(), "SharedList")
        self._attach(*_share(buf, offsets), children)

    @classmethod
    def _from_arrays(cls, buf, offsets, children):
        self = cls.__new__(cls)
        self._attach(buf, offsets, children)
        return self

    def _attach(self, buf, offsets, children):
        self._buf, self._offsets, self._children = buf, offsets, children
        self._view = memoryview(buf)
        self._off = memoryview(offsets)
        self._n = len(offsets) - 1
        if children:
            self._load = lambda data: _ItemUnpickler(data, children).load()
        else:
            self._load = pickle.loads

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if type(index) is not int:
            if isinstance(index, slice):
                return self._slice(index)
            try:
                index = operator.index(index)
            except TypeError:
                raise TypeError(
                    "SharedList indices must be integers or slices, not"
                    f" {type(index).__name__}"
                ) from None
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError("SharedList index out of range")
        off = self._off
        return self._load(self._view[off[index] : off[index + 1]])

    def __iter__(self) -> Iterator[Any]:
        view, off, load = self._view, self._off, self._load
        start = off[0]
        for i in range(1, self._n + 1):
            end = off[i]
            yield load(view[start:end])
            start = end

    def _slice(self, which: slice) -> "SharedList":
        picked = range(self._n)[which]
        if picked.step == 1:
            # Offsets are absolute: a run of them indexes the same buffer.
            stop = max(picked.start, picked.stop)
            offsets = self._offsets[picked.start : stop + 1]
            return SharedList._from_arrays(self._buf, offsets, self._children)
        packer = _Packer()
        off = self._off
        for i in picked:
            packer.add_bytes(self._view[off[i] : off[i + 1]])
        buf, offsets = _share(*packer.arrays())
        return SharedList._from_arrays(buf, offsets, self._children)

    def __eq__(self, other):
        if not isinstance(other, (SharedList, list)):
            return NotImplemented
        if len(self) != len(other):
            return False
        return all(a is b or a == b for a, b in zip(self, other))

    __hash__ = None  # unhashable, like a list

    def __repr__(self) -> str:
        shown = [repr(item) for item in self[:_REPR_ITEMS]]
        if self._n > _REPR_ITEMS:
            shown.append(f"... ({self._n} items)")
        return f"SharedList([{', '.join(shown)}])"

    @property
    def nbytes(self) -> int:
        """Bytes of its buffer and offsets (a slice shares its parent's buffer)."""
        return self._buf.nbytes + self._offsets.nbytes

    def __reduce__(self):
        return rebuild_shared_list, (self._buf, self._offsets, self._children)

    _refuse = _read_only(
        "{} is read-only (its items live once, in shared memory): build a new"
        " one, e.g. torchshm.SharedList([*shared, item]), or copy it with"
        " list(shared)"
    )
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse


def _pack_list(items, packer, name):
    """(buffer, offsets, children) of a SharedList of `items`."""
    for i, item in enumerate(items):
        packer.add_object(item, f"item {i}", name)
    return (*packer.arrays(), tuple(packer.children))


def rebuild_shared_list(buf, offsets, children=()):
    """Unpickles a SharedList (its name never changes: pickles name it)."""
    _check_array("SharedList", "buffer", buf, np.uint8)
    _check_array("SharedList", "offsets", offsets, np.int64, 1)
    return SharedList._from_arrays(_frozen(buf), _frozen(offsets), tuple(children))


class SharedDict(collections.abc.Mapping):
    """A read-only dict whose values are pickled once into shared memory.

    Keys are str, int, bytes, None or tuples of these (Note [SharedDict
    keys] in _keys.py); `d[key]`, `in`, get, len, iteration, keys(),
    values(), items() and == behave as for a dict, in insertion order, with
    O(1) average lookup through a hash index that is in shared memory too.
    Reading a value unpickles just that value. Pickling it sends a reference
    to its memory, as for SharedList.
    """

    __slots__ = (
        "_buf",
        "_offsets",
        "_starts",
        "_slots",
        "_children",
        "_view",
        "_off",
        "_startv",
        "_slotv",
        "_mask",
        "_n",
        "_load",
        "__weakref__",
    )

    def __init__(self, mapping=(), **kwargs):
        source = mapping if type(mapping) is dict and not kwargs else None
        if source is None:
            source = dict(mapping, **kwargs)
        buf, offsets, starts, slots, children = _pack_dict(
            source, _Packer(), "SharedDict"
        )
        self._attach(*_share(buf, offsets, starts, slots), children)

    @classmethod
    def _from_arrays(cls, *arrays):
        self = cls.__new__(cls)
        self._attach(*arrays)
        return self

    def _attach(self, buf, offsets, starts, slots, children):
        self._buf, self._offsets = buf, offsets
        self._starts, self._slots, self._children = starts, slots, children
        self._view, self._off = memoryview(buf), memoryview(offsets)
        self._startv, self._slotv = memoryview(starts), memoryview(slots)
        self._mask = len(starts) - 2
        self._n = len(slots)
        if children:
            self._load = lambda data: _ItemUnpickler(data, children).load()
        else:
            self._load = pickle.loads

    def _find(self, key) -> int:
        """The entry number of `key`, or -1."""
        if type(key) is str:  # the common key, without a call
            encoded = b"s" + key.encode("utf-8", "surrogatepass")
        else:
            encoded = _keys.lookup(key)
            if encoded is None:
                return -1
        bucket = _crc32(encoded) & self._mask
        starts, slots, off = self._startv, self._slotv, self._off
        s, end = starts[bucket], starts[bucket + 1]
        while s < end:  # about 1.5 entries (Note [SharedDict keys])
            j = 2 * slots[s]
            if self._view[off[j] : off[j + 1]] == encoded:
                return j // 2
            s += 1
        return -1

    def _value(self, entry: int):
        j = 2 * entry + 1
        return self._load(self._view[self._off[j] : self._off[j + 1]])

    def __getitem__(self, key):
        entry = self._find(key)
        if entry < 0:
            raise KeyError(key)
        return self._value(entry)

    def get(self, key, default=None):
        entry = self._find(key)
        return default if entry < 0 else self._value(entry)

    def __contains__(self, key) -> bool:
        return self._find(key) >= 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Any]:
        view, off = self._view, self._off
        for j in range(0, 2 * self._n, 2):
            yield _keys.decode(view[off[j] : off[j + 1]])

    def _values(self) -> Iterator[Any]:
        view, off, load = self._view, self._off, self._load
        for j in range(1, 2 * self._n, 2):
            yield load(view[off[j] : off[j + 1]])

    def keys(self):
        return collections.abc.KeysView(self)

    def values(self):
        return _Values(self)

    def items(self):
        return _Items(self)

    def __repr__(self) -> str:
        shown = []
        for i, (key, value) in enumerate(self.items()):
            if i == _REPR_ITEMS:
                shown.append(f"... ({self._n} items)")
                break
            shown.append(f"{key!r}: {value!r}")
        return f"SharedDict({{{', '.join(shown)}}})"

    @property
    def nbytes(self) -> int:
        """Bytes of its buffer, offsets and key index."""
        arrays = (self._buf, self._offsets, self._starts, self._slots)
        return sum(a.nbytes for a in arrays)

    def __reduce__(self):
        return rebuild_shared_dict, (
            self._buf,
            self._offsets,
            self._starts,
            self._slots,
            self._children,
        )

    _refuse = _read_only(
        "{} is read-only (its values live once, in shared memory): build a"
        " new one, e.g. torchshm.SharedDict({{**shared, key: value}}), or copy"
        " it with dict(shared)"
    )
    __setitem__ = __delitem__ = __ior__ = _refuse
    pop = popitem = clear = update = setdefault = _refuse


class _Values(collections.abc.ValuesView):
    __slots__ = ()

    def __iter__(self):
        return self._mapping._values()


class _Items(collections.abc.ItemsView):
    __slots__ = ()

    def __iter__(self):
        return zip(iter(self._mapping), self._mapping._values())


def _pack_dict(source: dict, packer: _Packer, name: str):
    """(buffer, offsets, starts, slots, children) of a SharedDict of
    `source`: entry j's key encoding is entry 2j of the buffer, its pickled
    value entry 2j + 1; starts and slots are the key index."""
    hashes = array.array("Q")
    for key, value in source.items():
        encoded = _keys.encode(key)
        hashes.append(zlib.crc32(encoded))
        packer.add_bytes(encoded)
        packer.add_object(value, f"the value of key {key!r}", name)
    starts, slots = _keys.build_index(np.frombuffer(hashes, dtype=np.uint64))
    return (*packer.arrays(), starts, slots, tuple(packer.children))


def rebuild_shared_dict(buf, offsets, starts, slots, children=()):
    """Unpickles a SharedDict (its name never changes: pickles name it)."""
    _check_array("SharedDict", "buffer", buf, np.uint8)
    _check_array("SharedDict", "offsets", offsets, np.int64, 1)
    _check_array("SharedDict", "buckets", starts, np.int64, 2)
    _check_array("SharedDict", "slots", slots, np.int64)
    buckets = len(starts) - 1
    if len(offsets) != 2 * len(slots) + 1 or buckets & (buckets - 1):
        raise ValueError(
            f"torchshm: inconsistent SharedDict arrays: {len(offsets)} offsets,"
            f" {len(slots)} entries, {buckets} buckets"
        )
    arrays = (_frozen(a) for a in (buf, offsets, starts, slots))
    return SharedDict._from_arrays(*arrays, tuple(children))


REBUILDS = (rebuild_shared_list, rebuild_shared_dict)


def reduce_converted(obj, min_items: int):
    """For share(containers=True): the reduce value of a SharedList or
    SharedDict of the list or dict `obj`, over fresh arrays that the
    caller's pickler then shares; None to leave `obj` as it is (fewer than
    min_items items, a key a SharedDict does not take, or items holding an
    array or tensor that sharing keeps as it is)."""
    if len(obj) < min_items:
        return None
    packer = _Packer(plain_only=True)
    try:
        if type(obj) is dict:
            return rebuild_shared_dict, _pack_dict(obj, packer, "share")
        return rebuild_shared_list, _pack_list(obj, packer, "share")
    except (_NotPlain, _keys.KeyTypeError):
        return None
