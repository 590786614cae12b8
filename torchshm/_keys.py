"""SharedDict's keys: a byte encoding that is the same in every process, and
a static hash index over it, both kept in shared memory as plain arrays.

Note [SharedDict keys]
~~~~~~~~~~~~~~~~~~~~~~
A key index in shared memory cannot use Python's hash(): str and bytes
hashes are salted per process (a spawn worker would look in the wrong
bucket). So each key is encoded into bytes that are equal exactly when the
keys are equal, and the index hashes those bytes with zlib.crc32. That
needs an encoding that is injective and the same for equal keys, which
pickle is not (its output depends on object identity inside tuples), so:

    str   b"s" + UTF-8 (surrogates kept)      None   b"n"
    int   b"i" + little-endian two's complement, fewest bytes
    bytes b"b" + the bytes
    tuple b"t" + for each element: its length (8 bytes) + its encoding

A SharedDict accepts keys of exactly these types (no subclasses, no bool,
no float): for them dict equality and equality of encodings coincide, and
keys() gives back the very values that went in. A lookup follows dict's
numeric equality: True, 1.0, numpy.int64(1) and an IntEnum of value 1 all
find the key 1 (they are normalized to int before encoding); a str or bytes
subclass finds its plain value; any other hashable finds nothing.
"""

import numbers
from typing import Any, Optional, Tuple

import numpy as np

KEY_TYPES = "str, int, bytes, None, or a tuple of these"
_LEN = 8  # bytes of a tuple element's length prefix


class KeyTypeError(TypeError):
    """A key of a type that a SharedDict does not take."""


def _int_bytes(value: int) -> bytes:
    return value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)


def encode(key: Any) -> bytes:
    """The key's encoding; TypeError for a key a SharedDict does not take."""
    kind = type(key)
    if kind is str:
        return b"s" + key.encode("utf-8", "surrogatepass")
    if kind is int:
        return b"i" + _int_bytes(key)
    if kind is bytes:
        return b"b" + key
    if key is None:
        return b"n"
    if kind is tuple:
        parts = [encode(element) for element in key]
        return b"t" + b"".join(len(p).to_bytes(_LEN, "little") + p for p in parts)
    raise KeyTypeError(
        f"SharedDict keys must be {KEY_TYPES} (exact types), got"
        f" {kind.__name__} key {key!r}: convert it first, e.g. str(key) or int(key)"
    )


def _normalized(key: Any) -> Any:
    """The key of an accepted type that equals `key` as dict sees it, or
    raises LookupError when no accepted key can equal it."""
    kind = type(key)
    if kind is str or kind is int or kind is bytes or key is None:
        return key
    if kind is tuple:
        return tuple(_normalized(element) for element in key)
    if isinstance(key, numbers.Integral):  # bool, numpy integers, IntEnum
        return int(key)
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, bytes):
        return bytes(key)
    if isinstance(key, numbers.Number):  # float, numpy floats, Decimal, complex
        try:
            value = int(key.real if isinstance(key, numbers.Complex) else key)
        except (TypeError, ValueError, OverflowError):  # nan, inf
            raise LookupError from None
        if value == key:
            return value
    raise LookupError


def lookup(key: Any) -> Optional[bytes]:
    """The encoding to look `key` up by, or None when no stored key can
    equal it. Raises TypeError for an unhashable key, as dict does."""
    if type(key) is str:  # the common case, without the calls below
        return b"s" + key.encode("utf-8", "surrogatepass")
    try:
        return encode(_normalized(key))
    except (LookupError, TypeError):
        hash(key)  # unhashable: dict's TypeError
        return None


def decode(data) -> Any:
    """The key whose encoding is `data` (bytes or a memoryview)."""
    tag, body = data[0], data[1:]
    if tag == ord("s"):
        return str(body, "utf-8", "surrogatepass")
    if tag == ord("i"):
        return int.from_bytes(body, "little", signed=True)
    if tag == ord("b"):
        return bytes(body)
    if tag == ord("n"):
        return None
    if tag == ord("t"):
        elements, at = [], 0
        while at < len(body):
            size = int.from_bytes(body[at : at + _LEN], "little")
            at += _LEN
            elements.append(decode(body[at : at + size]))
            at += size
        return tuple(elements)
    raise ValueError(f"not a SharedDict key encoding (tag {tag})")


def build_index(hashes: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(starts, slots): the entries of bucket b are slots[starts[b]:starts[b+1]].

    A static table in two flat arrays, built with numpy in O(n log n): the
    number of buckets is the power of two at or above n, so a bucket holds
    one entry on average and a lookup compares about 1.5 keys."""
    buckets = 1 << max(0, len(hashes) - 1).bit_length()
    bucket = hashes.astype(np.int64) & (buckets - 1)
    slots = np.argsort(bucket, kind="stable").astype(np.int64)
    starts = np.zeros(buckets + 1, dtype=np.int64)
    np.cumsum(np.bincount(bucket, minlength=buckets), out=starts[1:])
    return starts, slots
