"""SharedList and SharedDict: Python objects that every process of a node
reads from one copy in shared memory.

Note [Copy-on-read]
~~~~~~~~~~~~~~~~~~~
A list of Python objects in a Dataset is copied into every DataLoader
worker: pickled to spawn and forkserver workers, and, under fork, page by
page, because reading an object writes its reference count (and a garbage
collection writes its header) on the page that holds it (pytorch#13246).
So the items live here as bytes instead: each item written once, one after
the other, into one uint8 buffer, with an int64 array of offsets (item i is
buf[offsets[i]:offsets[i + 1]]). Raw bytes have no reference counts: reading
an item decodes a fresh copy of it and writes nothing to the buffer, and
both arrays live in torchshm shared memory, so a pickled SharedList is a
reference to them (O(1)) and every process maps the same pages.

The cost is a decode per read (Note [Item codec]): 0.39 us for a record of
two dozen objects, so reading every field of it costs 1.6x what it does
from a plain list (`python -m benchmarks.micro containers`, median of 5
runs; docs/guide/objects.md); and read-only semantics: a read returns a
copy, so mutating it changes nothing, and the container cannot be mutated
at all.

Note [Item codec]
~~~~~~~~~~~~~~~~~
Items used to be pickles, and pickle.loads was most of a read: reading every
field of a record of two dozen objects cost 4.3-4.5x reading it from a
plain list, 1.2-1.6 us of pickle.loads out of about 2 us. Pickle pays for
its generality on every call: an Unpickler and its memo per item, an
opcode loop, new key strings each read. Most dataset items are plain data:
None, bool, int, float, str, bytes, list, tuple, dict. So an item goes in
torchshm's own format (csrc/items/items.h, Note [Item format]) when that
represents it exactly, and _C.ItemReader, the base of SharedList, decodes
it from the buffer in the one C call that shared[i] makes: no memoryview
slice, no Python frame. Decoding the record takes 0.36 us (pickle.loads:
1.25 us), and that is what remains of the 1.6x: mostly CPython making the
record's two dozen new objects (perf puts about a third in the decoder's
own code), which a plain list's reader never does.

- Exactly means: only those types, not subclasses (a namedtuple, an
  OrderedDict, a str subclass, numpy scalars stay what they are only as
  pickles), ints that fit in 64 bits, no object twice in one item (pickle
  keeps a list held twice one list; the format would make two), nothing
  nested deeper than _C.ITEM_MAX_DEPTH (recursion included). Anything else,
  and any item holding a nested SharedList or SharedDict (Note [Nested
  containers]), goes as a pickle, whole; the reader tells the two apart by
  the first byte, so buffers written before the format (all pickles) read
  as they did.
- Dict keys: the first _TABLE_STRINGS distinct str keys of at most
  _TABLE_STRING_BYTES UTF-8 bytes go once into the container's string
  table (a third array, shared with the others), which each process reads
  once into interned str; an item names them by number, and a read returns
  the very same str objects (no allocation, hash cached), as do str values
  equal to one of them. Keys past the limit are written in full. str is
  immutable, so sharing those objects between reads changes nothing that
  == sees; containers are never shared: every read makes new ones.
- A buffer can come from another process: the reader checks every offset,
  length, count and table index, and a corrupted item is a ValueError that
  names it.

Encoding costs less than pickling (one C call per item, no memo); only
items the format refuses are encoded twice (tried, then pickled).
"""

import array
import collections.abc
import copyreg
import io
import pickle
import zlib
from typing import Any, Iterable, Iterator, Tuple

import numpy as np
import torch

from torchshm import _config, _keys
from torchshm._send import registry as _registry
from torchshm._native import _C

_crc32 = zlib.crc32
# Fixed, not pickle.HIGHEST_PROTOCOL: a SharedList pickled to a file by one
# Python must read in another.
PROTOCOL = 5
_REPR_ITEMS = 8
# The string table (Note [Item codec]): the first 4096 distinct dict keys of
# at most 64 UTF-8 bytes. Every process reads the whole table when it
# attaches (4096 such keys: well under a millisecond).
_TABLE_STRINGS = 4096
_TABLE_STRING_BYTES = 64


_LIST_READ_ONLY = (
    "{} is read-only (its items live once, in shared memory): build a new"
    " one, e.g. torchshm.SharedList([*shared, item]), or copy it with"
    " list(shared)"
)
_DICT_READ_ONLY = (
    "{} is read-only (its values live once, in shared memory): build a"
    " new one, e.g. torchshm.SharedDict({{**shared, key: value}}), or copy"
    " it with dict(shared)"
)


def _read_only(message: str, *mutators: str):
    """Class decorator: each of `mutators` raises TypeError(`message`), and
    is a function of its own with a docstring (the API reference lists the
    public ones)."""

    def decorate(cls):
        doc = f"Not supported: a {cls.__name__} is read-only, this raises TypeError."
        for name in mutators:

            def refuse(self, *args, **kwargs):
                raise TypeError(message.format(type(self).__name__))

            refuse.__name__, refuse.__qualname__ = name, f"{cls.__qualname__}.{name}"
            refuse.__doc__ = doc
            setattr(cls, name, refuse)
        return cls

    return decorate


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

    Note [Nested containers]

    A SharedList or SharedDict inside an item is
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
    buf[offsets[i]:offsets[i + 1]]. An object goes in the item format when
    it represents the object exactly (Note [Item codec]), else as a pickle;
    codec=False pickles every one (as torchshm did before the format)."""

    def __init__(self, plain_only=False, codec=True):
        strings = _TABLE_STRINGS if codec else 0
        self._encoder = _C.ItemEncoder(strings, _TABLE_STRING_BYTES)
        self._codec = codec
        self.children = []
        # The encoder is the pickler's file: a pickled item is written into
        # the same buffer.
        self._pickler = _ItemPickler(self._encoder, self.children, plain_only)

    def add_bytes(self, data) -> None:
        self._encoder.write(data)
        self._encoder.end_entry()

    def add_object(self, obj, where: str, container: str) -> None:
        if self._codec and self._encoder.add(obj):
            return
        try:
            self._pickler.dump(obj)
        except _NotPlain:
            raise
        except Exception as exc:
            raise TypeError(
                f"torchshm.{container}: {where} ({type(obj).__name__}) cannot be"
                f" pickled: {exc}. Every item is stored once in shared memory,"
                " as a pickle when torchshm's item format cannot hold it: make"
                " it picklable, or leave it out"
            ) from exc
        finally:
            self._pickler.clear_memo()
        self._encoder.end_entry()

    def arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(buffer, offsets, string table): read-only arrays that own what
        was written, for _share to copy into shared memory once. Once only."""
        return tuple(_frozen(a) for a in self._encoder.finish())


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


def _loader(children):
    """What reads a pickled item of a container with these children."""
    if children:
        return lambda data: _ItemUnpickler(data, children).load()
    return pickle.loads


def _no_strings():
    return _frozen(np.zeros(0, np.uint8))


# fmt: off
@_read_only(
    _LIST_READ_ONLY,
    "__setitem__", "__delitem__", "__iadd__", "__imul__",
    "append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
)
# fmt: on
class SharedList(_C.ItemReader, collections.abc.Sequence):
    """A read-only list whose items are stored once in shared memory.

    ``SharedList(iterable)`` writes each item into one byte buffer plus int64
    offsets, both in torchshm shared memory (unless smaller than the sharing
    threshold, `get_threshold`): in torchshm's item format when that
    represents the item exactly, else pickled (protocol 5). Indexing decodes
    just that item, a fresh copy per read: mutating it changes nothing
    stored. len, ``in``, iteration, slices (a SharedList over the same
    buffer), index, count and ``==`` (with lists and SharedLists) behave as
    for a list; it is unhashable, and every mutator raises ``TypeError``.
    Pickling it through a multiprocessing transport or `dumps` sends a
    reference to its memory; under fork, workers read it without writing a
    page of it (no copy-on-read). With plain ``pickle`` (a file) its buffers
    are pickled by value. A SharedList or SharedDict inside an item is
    stored by reference. Without torchshm's reducers (``TORCHSHM_DISABLE=1``)
    the buffers stay private: fork workers still read them without
    copy-on-read, other workers get a copy.

    Parameters
    ----------
    iterable : iterable, optional
        The items (default: none). Each must be picklable.

    Raises
    ------
    TypeError
        An item cannot be pickled (the message names its index); any
        mutation (``append``, ``shared[i] = x``, ``+=``...).

    See Also
    --------
    SharedDict
    share : ``containers=True`` converts a graph's large lists.

    Examples
    --------
    >>> shared = torchshm.SharedList([{"id": i, "tags": ["a", "b"]} for i in range(3)])
    >>> len(shared), shared[1]
    (3, {'id': 1, 'tags': ['a', 'b']})
    >>> shared[1]["id"] = 99  # changes a fresh copy, not what is stored
    >>> shared[1]["id"], shared[1:] == [shared[1], shared[2]]
    (1, True)
    >>> shared.append(4)
    Traceback (most recent call last):
        ...
    TypeError: SharedList is read-only (its items live once, in shared memory): ...

    Sent to another process, it is a reference to its memory, a few hundred
    bytes whatever its size:

    >>> import multiprocessing, pickle
    >>> from multiprocessing.reduction import ForkingPickler
    >>> big = torchshm.SharedList(range(100_000))
    >>> message = ForkingPickler.dumps(big)
    >>> len(message) < 1_000 < big.nbytes
    True
    >>> pickle.loads(message) == big
    True
    >>> with multiprocessing.get_context("fork").Pool(2) as pool:
    ...     pool.map(len, [big, big])
    [100000, 100000]
    """

    # shared[i] and len() are _C.ItemReader's: one C call (Note [Item codec]).
    __slots__ = (
        "_buf",
        "_offsets",
        "_strings",
        "_table",
        "_children",
        "__weakref__",  # torchshm.dumps keeps a handle while its object lives
    )

    def __init__(self, iterable: Iterable[Any] = ()):
        buf, offsets, children, strings = _pack_list(iterable, _Packer(), "SharedList")
        self._attach(*_share(buf, offsets, strings), children)

    @classmethod
    def _from_arrays(cls, buf, offsets, strings, children, table=None):
        self = cls.__new__(cls)
        self._attach(buf, offsets, strings, children, table)
        return self

    def _attach(self, buf, offsets, strings, children, table=None):
        # Read once per process (and shared by slices): interned str.
        if table is None:
            table = _C.read_strings(strings)
        # First: it refuses a second call, before anything here changed.
        _C.ItemReader.__init__(
            self, buf, offsets, table, _loader(children), label="SharedList item"
        )
        self._buf, self._offsets, self._children = buf, offsets, children
        self._strings, self._table = strings, table

    def __iter__(self) -> Iterator[Any]:
        return map(self.__getitem__, range(len(self)))

    def _slice(self, which: slice) -> "SharedList":
        """shared[a:b:c] (_C.ItemReader hands slices here)."""
        picked = range(len(self))[which]
        arrays = self._strings, self._children, self._table
        if picked.step == 1:
            # Offsets are absolute: a run of them indexes the same buffer.
            stop = max(picked.start, picked.stop)
            offsets = self._offsets[picked.start : stop + 1]
            return SharedList._from_arrays(self._buf, offsets, *arrays)
        packer = _Packer()
        view, off = memoryview(self._buf), memoryview(self._offsets)
        for i in picked:
            packer.add_bytes(view[off[i] : off[i + 1]])
        buf, offsets, _ = packer.arrays()  # the entries keep self's table
        return SharedList._from_arrays(*_share(buf, offsets), *arrays)

    def __eq__(self, other):
        if not isinstance(other, (SharedList, list)):
            return NotImplemented
        if len(self) != len(other):
            return False
        return all(a is b or a == b for a, b in zip(self, other))

    __hash__ = None  # unhashable, like a list

    def __repr__(self) -> str:
        shown = [repr(item) for item in self[:_REPR_ITEMS]]
        if len(self) > _REPR_ITEMS:
            shown.append(f"... ({len(self)} items)")
        return f"SharedList([{', '.join(shown)}])"

    @property
    def nbytes(self) -> int:
        """Bytes of its buffer, offsets and string table (a slice counts its
        parent's buffer, which it shares)."""
        return self._buf.nbytes + self._offsets.nbytes + self._strings.nbytes

    def __reduce__(self):
        return rebuild_shared_list, (
            self._buf,
            self._offsets,
            self._children,
            self._strings,
        )


def _pack_list(items, packer, name):
    """(buffer, offsets, children, string table) of a SharedList of `items`:
    rebuild_shared_list's arguments."""
    for i, item in enumerate(items):
        packer.add_object(item, f"item {i}", name)
    buf, offsets, strings = packer.arrays()
    return buf, offsets, tuple(packer.children), strings


def rebuild_shared_list(buf, offsets, children=(), strings=None):
    """Unpickles a SharedList (its name never changes: pickles name it).
    Pickles from before the item format have no string table."""
    _check_array("SharedList", "buffer", buf, np.uint8)
    _check_array("SharedList", "offsets", offsets, np.int64, 1)
    if strings is None:
        strings = _no_strings()
    _check_array("SharedList", "string table", strings, np.uint8)
    arrays = (_frozen(a) for a in (buf, offsets, strings))
    return SharedList._from_arrays(*arrays, tuple(children))


# fmt: off
@_read_only(
    _DICT_READ_ONLY,
    "__setitem__", "__delitem__", "__ior__",
    "pop", "popitem", "clear", "update", "setdefault",
)
# fmt: on
class SharedDict(collections.abc.Mapping):
    """A read-only dict whose values are stored once in shared memory.

    Built like a dict, from a mapping or (key, value) pairs and keyword
    arguments. Keys are str, int, bytes, None or tuples of these, of exactly
    these types (no bool, no float, no subclasses); a lookup follows dict's
    numeric equality (``True``, ``1.0`` and ``numpy.int64(1)`` find the key
    ``1``). ``d[key]``, ``in``, get, len, iteration, keys(), values(),
    items() and ``==`` behave as for a dict, in insertion order, with O(1)
    average lookup through a hash index that is in shared memory too.
    Reading a value decodes just that value, a fresh copy per read (as
    `SharedList` reads an item); every mutator raises ``TypeError``.
    Pickling it sends a reference to its memory, as for `SharedList`.

    Parameters
    ----------
    mapping : mapping or iterable of pairs, optional
        The entries, as ``dict(mapping)`` takes them (default: none).
    **kwargs : object
        More entries, keyed by name, as for ``dict``.

    Raises
    ------
    TypeError
        A key of another type (a bool, a float, a frozenset...), a value that cannot
        be pickled (the message names its key), `mapping` that ``dict()``
        does not take; any mutation (``d[k] = v``, ``update``...).

    See Also
    --------
    SharedList
    share : ``containers=True`` converts a graph's large dicts.

    Examples
    --------
    >>> labels = torchshm.SharedDict({"cat": [0, 1], "dog": [2]}, bird=[])
    >>> labels["cat"], labels.get("fish"), len(labels)
    ([0, 1], None, 3)
    >>> list(labels.items())
    [('cat', [0, 1]), ('dog', [2]), ('bird', [])]
    >>> labels == {"cat": [0, 1], "dog": [2], "bird": []}
    True
    >>> labels["fish"] = [3]
    Traceback (most recent call last):
        ...
    TypeError: SharedDict is read-only (its values live once, in shared memory): ...
    """

    __slots__ = (
        "_buf",
        "_offsets",
        "_starts",
        "_slots",
        "_strings",
        "_children",
        "_view",
        "_off",
        "_startv",
        "_slotv",
        "_mask",
        "_n",
        "_reader",
        "__weakref__",
    )

    def __init__(self, mapping=(), **kwargs):
        source = mapping if type(mapping) is dict and not kwargs else None
        if source is None:
            source = dict(mapping, **kwargs)
        buf, offsets, starts, slots, children, strings = _pack_dict(
            source, _Packer(), "SharedDict"
        )
        buf, offsets, starts, slots, strings = _share(
            buf, offsets, starts, slots, strings
        )
        self._attach(buf, offsets, starts, slots, children, strings)

    @classmethod
    def _from_arrays(cls, *arrays):
        self = cls.__new__(cls)
        self._attach(*arrays)
        return self

    def _attach(self, buf, offsets, starts, slots, children, strings):
        self._buf, self._offsets = buf, offsets
        self._starts, self._slots, self._children = starts, slots, children
        self._strings = strings
        self._view, self._off = memoryview(buf), memoryview(offsets)
        self._startv, self._slotv = memoryview(starts), memoryview(slots)
        self._mask = len(starts) - 2
        self._n = len(slots)
        # Entry j's value is buffer entry 2j + 1 (its key encoding is 2j).
        self._reader = _C.ItemReader(
            buf,
            offsets,
            _C.read_strings(strings),
            _loader(children),
            stride=2,
            first=1,
            label="SharedDict value",
        )

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
        return self._reader[entry]

    def __getitem__(self, key):
        entry = self._find(key)
        if entry < 0:
            raise KeyError(key)
        return self._value(entry)

    def get(self, key, default=None):
        """The value for `key` (a fresh copy) if `key` is in it, else `default`."""
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
        return map(self._reader.__getitem__, range(self._n))

    def keys(self):
        """A set-like view of its keys, in insertion order (as ``dict.keys``)."""
        return collections.abc.KeysView(self)

    def values(self):
        """A view of its values, in insertion order, each read a fresh copy."""
        return _Values(self)

    def items(self):
        """A set-like view of its (key, value) pairs, in insertion order."""
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
        """Bytes of its buffer, offsets, key index and string table."""
        arrays = (self._buf, self._offsets, self._starts, self._slots, self._strings)
        return sum(a.nbytes for a in arrays)

    def __reduce__(self):
        return rebuild_shared_dict, (
            self._buf,
            self._offsets,
            self._starts,
            self._slots,
            self._children,
            self._strings,
        )


class _Values(collections.abc.ValuesView):
    __slots__ = ()

    def __iter__(self):
        return self._mapping._values()


class _Items(collections.abc.ItemsView):
    __slots__ = ()

    def __iter__(self):
        return zip(iter(self._mapping), self._mapping._values())


def _pack_dict(source: dict, packer: _Packer, name: str):
    """(buffer, offsets, starts, slots, children, string table) of a
    SharedDict of `source` (rebuild_shared_dict's arguments): entry j's key
    encoding is entry 2j of the buffer, its value entry 2j + 1; starts and
    slots are the key index."""
    hashes = array.array("Q")
    for key, value in source.items():
        encoded = _keys.encode(key)
        hashes.append(zlib.crc32(encoded))
        packer.add_bytes(encoded)
        packer.add_object(value, f"the value of key {key!r}", name)
    starts, slots = _keys.build_index(np.frombuffer(hashes, dtype=np.uint64))
    buf, offsets, strings = packer.arrays()
    return buf, offsets, starts, slots, tuple(packer.children), strings


def rebuild_shared_dict(buf, offsets, starts, slots, children=(), strings=None):
    """Unpickles a SharedDict (its name never changes: pickles name it).
    Pickles from before the item format have no string table."""
    if strings is None:
        strings = _no_strings()
    _check_array("SharedDict", "buffer", buf, np.uint8)
    _check_array("SharedDict", "offsets", offsets, np.int64, 1)
    _check_array("SharedDict", "buckets", starts, np.int64, 2)
    _check_array("SharedDict", "slots", slots, np.int64)
    _check_array("SharedDict", "string table", strings, np.uint8)
    buckets = len(starts) - 1
    if len(offsets) != 2 * len(slots) + 1 or buckets & (buckets - 1):
        raise ValueError(
            f"torchshm: inconsistent SharedDict arrays: {len(offsets)} offsets,"
            f" {len(slots)} entries, {buckets} buckets"
        )
    buf, offsets, starts, slots, strings = (
        _frozen(a) for a in (buf, offsets, starts, slots, strings)
    )
    return SharedDict._from_arrays(
        buf, offsets, starts, slots, tuple(children), strings
    )


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
