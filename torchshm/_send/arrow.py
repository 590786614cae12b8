"""pyarrow Buffers (Arrow-backed columns) through torchshm's array path.

Note [Arrow buffers]
~~~~~~~~~~~~~~~~~~~~
pandas 3 keeps its default `str` columns (when pyarrow is installed) and
every `pd.ArrowDtype` column in pyarrow arrays, and a pyarrow array pickles
its Buffers by value: a bytearray each, inside the message. reduce_buffer
sends a Buffer's bytes as a uint8 ndarray instead, which takes the path of
any other array (snapshotted into a segment at or above the threshold,
inline below it), and the receiver wraps that array with pyarrow.py_buffer,
without a copy: the Buffer holds the array, and the array its segment. The
rebuilt Buffer's address is remembered, weakly (_reduction.ARROW_BUFFERS),
so that sending it again (a share()d frame, a frame a worker passes on)
names the same memory instead of copying it.

A sender's own Arrow memory (an in-memory table: a `datasets.Dataset` sent
to each spawn worker) gets a new Buffer object at every pickle, which the
snapshot cache, keyed by the buffer's Python object, never saw before: each
send copied the whole table again. So the reducer tells the message which
memory the Buffer is (_C.resend_as): a key per (address, size), of the
last MEMORIES buffers sent. A resend of those bytes compares them with the
snapshot and names it again if they are equal (Note [Resending an unchanged
array] in csrc/send/snapshots.h); changed bytes, or memory freed and reused
by other bytes, are copied. Keys evicted forget their snapshots.

torchshm never imports pyarrow. watch() registers the reducer at once if
pyarrow is imported, or else when it is: a finder at the head of
sys.meta_path sees `import pyarrow` and calls back once the module has run
(then leaves sys.meta_path). Any failure falls back to pyarrow's own reduce
(a reducer that raises loses the message).
"""

import collections
import sys
import threading

import numpy as np

from torchshm import _fallback, _reduction
from torchshm._native import _C

MODULE = "pyarrow"
# How many Arrow buffers' memories a sender remembers (see the Note).
MEMORIES = 4096


class _Memory:
    """The key of one (address, size) of Arrow memory: weakly referenced by
    the snapshot cache, which forgets the entry when it is evicted."""

    __slots__ = ("__weakref__",)


_memories = collections.OrderedDict()
_memories_lock = threading.Lock()


def _memory(buffer):
    where = (buffer.address, buffer.size)
    with _memories_lock:
        key = _memories.get(where)
        if key is None:
            key = _memories[where] = _Memory()
            if len(_memories) > MEMORIES:
                _memories.popitem(last=False)
        else:
            _memories.move_to_end(where)
        return key


def buffer_type():
    """pyarrow.Buffer if pyarrow has been imported, else None."""
    return getattr(sys.modules.get(MODULE), "Buffer", None)


def reduce_buffer(buffer):
    """The ForkingPickler reducer of pyarrow.Buffer (see the Note)."""
    try:
        array = _reduction.ARROW_BUFFERS.get(buffer.address)
        if array is not None and buffer.size <= array.nbytes:
            array = array[: buffer.size]  # already shared: sent by reference
        else:
            array = np.frombuffer(buffer, dtype=np.uint8)
            if array.size:
                _C.resend_as(array, _memory(buffer))
        return _reduction.rebuild_arrow_buffer, (array,)
    except Exception as exc:  # noqa: BLE001 - raising here loses the message
        _fallback.fall_back(exc, "sharing an Arrow buffer", "pickling it by value")
        return buffer.__reduce_ex__(4)  # pyarrow's own, in band


class _Watch:
    """A sys.meta_path finder that calls `then()` once pyarrow is imported."""

    def __init__(self, then):
        self.then = then

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = getattr(spec.loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            self.stop()
            try:
                self.then()
            except Exception:  # noqa: BLE001 - never break the user's import
                pass

        try:
            spec.loader.exec_module = exec_module
        except AttributeError:  # a loader that takes no attribute: no watch
            pass
        return spec

    def stop(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


_watch = None


def watch(then):
    """Calls `then()` now if pyarrow is imported, else right after it is
    (once, whatever the number of calls)."""
    global _watch
    if buffer_type() is not None:
        then()
    elif _watch is None:
        _watch = _Watch(then)
        sys.meta_path.insert(0, _watch)
