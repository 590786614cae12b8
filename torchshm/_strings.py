"""Object arrays of str (pandas string columns) sent as one UTF-8 buffer.

Note [String columns]
~~~~~~~~~~~~~~~~~~~~~
An object array pickles element by element, and pickling a str costs the
sender more than it costs the receiver to rebuild it (pickle records every
object in its memo). Measured on 2,000,000 strings
(`python -m benchmarks.micro strings`): pickle.dumps 0.7-0.8 s, loads
0.6-0.7 s; packing each string like a SharedList item (a pickle each) is
slower still on both sides (1.0-1.2 s each). Joining the strings with NUL
into one UTF-8 buffer, with the checks below, takes 0.2-0.4 s, and the
receiver's decode and split, which makes
the same 2,000,000 str objects that unpickling makes, takes about what
loads takes. The buffer travels as bytes inside the message, as the
pickled strings did: copying it into shared memory would save little
against the strings' own cost, and would make a share()d DataFrame cost a
copy at every send.

Only arrays whose elements are all exact str without NUL are packed (the
split could not tell a NUL inside a string from a separator, and str
subclasses would come back as str). Pickle sends an object held by several
elements once (its memo): a repeat costs it ~0.1 us a side against ~0.4 us
for a packed string, so packing pays only while at least half the elements
are distinct objects, which is counted exactly (sorting the elements' ids:
~0.1 s for 2,000,000; a sample cannot tell one string repeated by 1% of
the elements from every string repeated twice). Columns read by pandas'
CSV parser, which reuses one object per repeated value, stay on pickle's
path when their values repeat. The array arrives C- or Fortran-ordered as
numpy's own pickle returns it, writable, each element a new str.
"""

import numpy as np

SEPARATOR = "\0"
_OBJECT = np.dtype(object)


def reduce_str_array(array: np.ndarray):
    """(rebuild_str_array, args) for an object ndarray of strings that
    packing sends faster than pickle, else None."""
    if type(array) is not np.ndarray or array.dtype != _OBJECT or array.size == 0:
        return None
    order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    items = array.ravel(order).tolist()
    if set(map(type, items)) != {str}:
        return None
    ids = np.fromiter(map(id, items), dtype=np.intp, count=len(items))
    # Sorted and counted here: np.unique hashes since numpy 2.3, 13x slower
    # on 1,000,000 ids (0.68 s against 0.05 s), more than pickling them.
    ids.sort()
    if 2 * (1 + np.count_nonzero(ids[1:] != ids[:-1])) < len(items):
        return None  # mostly repeats: pickle's memo sends them for less
    text = SEPARATOR.join(items)
    if text.count(SEPARATOR) != len(items) - 1:
        return None
    data = text.encode("utf-8", "surrogatepass")
    return rebuild_str_array, (data, array.shape, order)


def rebuild_str_array(data, shape, order):
    """The object array of strings packed by reduce_str_array (its name
    never changes: pickles name it)."""
    items = str(data, "utf-8", "surrogatepass").split(SEPARATOR)
    out = np.empty(len(items), dtype=object)
    out[:] = items
    if out.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(
            f"torchshm: a packed string array of shape {shape} holds"
            f" {out.size} strings"
        )
    return out.reshape(shape, order=order)
