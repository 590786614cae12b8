"""torchshm.share(): move an object's arrays (and, when asked, its lists and
dicts of Python objects) into shared memory once."""

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import TypeVar

from torchshm import _containers, _fallback
from torchshm._lifetime import forks as _forks
from torchshm._send import registry as _registry
from torchshm._send import sender as _sender

T = TypeVar("T")

# Note [Which containers share() converts]
#
# Below about a thousand items a
# list costs a worker less than a hundred KiB however it is copied, against
# the tens of MiB of the worker's own interpreter; converting it would only
# add a decode per read and change its type for nothing.
CONTAINER_MIN_ITEMS = 1000


def share(
    obj: T, *, containers: bool = False, min_items: int = CONTAINER_MIN_ITEMS
) -> T:
    """An equivalent object whose eligible arrays live in shared memory.

    Works on an array or any picklable object graph (a DataFrame, an xarray
    Dataset, a model): it round-trips through torchshm's reducers in this
    process, one copy per array, so every later send of the result is O(1)
    whatever its size. Arrays below the threshold (`get_threshold`) and
    object arrays stay ordinary (an object array that is not strings with
    one ``RuntimeWarning`` naming `SharedList`); `obj` itself is not
    changed.

    With ``containers=True``, every list and dict in the graph (a Dataset's
    attributes included) with at least `min_items` items of plain Python
    objects becomes a read-only `SharedList` or `SharedDict`: its items are
    stored once in shared memory, so workers neither copy them nor write
    their pages (the copy-on-read problem). A list or dict stays as it is
    when its items hold an array at or above the threshold or a tensor
    (those are shared as they are), or, for a dict, when a key is not a
    str, int, bytes, None or a tuple of these. Tuples, sets and subclasses
    of list and dict are walked through, never converted.

    Parameters
    ----------
    obj : object
        What to share: anything ForkingPickler can pickle.
    containers : bool, optional
        Also convert large lists and dicts (default ``False``).
    min_items : int, optional
        With ``containers=True``, the fewest items a list or dict needs to be
        converted (default 1000: a smaller one costs a worker little
        however it is copied). Not checked without `containers`.

    Returns
    -------
    object
        An object of the same type (but for converted containers), whose
        arrays of at least the threshold live in shared memory.

    Raises
    ------
    RuntimeError
        torchshm's reducers are not registered (``TORCHSHM_DISABLE=1``,
        `unregister`, or inside `disabled`).
    ValueError
        With ``containers=True``, `min_items` is not an int >= 0.
    TypeError
        With ``containers=True``, an item of a list or dict to convert cannot
        be pickled (the message names its index or key).
    Exception
        Whatever pickling `obj` raises (``TypeError``,
        ``pickle.PicklingError``, ``AttributeError``...) for an object that
        cannot be pickled. Running out of shared memory is not an error: the
        array stays ordinary, with one ``RuntimeWarning``.

    See Also
    --------
    is_shared, SharedList, SharedDict, dumps

    Examples
    --------
    >>> a = torchshm.share(np.ones(1_000_000))
    >>> torchshm.is_shared(a)
    True
    >>> import pandas as pd
    >>> df = torchshm.share(pd.DataFrame({"x": np.arange(100_000.0)}))
    >>> torchshm.is_shared(df["x"].to_numpy())
    True

    Large lists of Python objects become SharedLists:

    >>> records = [{"id": i, "label": str(i)} for i in range(2_000)]
    >>> data = torchshm.share({"records": records}, containers=True)
    >>> data["records"]
    SharedList([{'id': 0, 'label': '0'}, {'id': 1, 'label': '1'}, ...])
    >>> data["records"][5]
    {'id': 5, 'label': '5'}
    """
    _forks.check_fork_hooks("torchshm.share()")
    if not _registry.is_registered():
        raise RuntimeError(
            "torchshm.share() needs torchshm's reducers: call torchshm.register()"
            " (it is off because of TORCHSHM_DISABLE=1 or torchshm.disabled())"
        )
    declined = _sender.object_arrays_declined()
    if not containers:
        shared = _registry.round_trip(obj)
    else:
        if type(min_items) is not int or min_items < 0:
            raise ValueError(f"min_items must be an int >= 0, got {min_items!r}")
        out = io.BytesIO()
        with _registry.sharing():  # as round_trip: shared, not snapshots
            _ContainerPickler(out, min_items).dump(obj)
        shared = _ContainerUnpickler(io.BytesIO(out.getbuffer())).load()
    if _sender.object_arrays_declined() > declined:
        _fallback.warn_once(
            ("share", "object arrays"),
            "torchshm.share(): object arrays (NumPy arrays of Python objects)"
            " stay in ordinary memory, copied into every process they are"
            " sent to: keep such items in a torchshm.SharedList (or"
            " share(obj, containers=True) for lists and dicts)",
            stacklevel=2,
        )
    return shared


class _ContainerPickler(ForkingPickler):
    """ForkingPickler (torchshm's reducers) that turns large lists and dicts
    into SharedLists and SharedDicts.

    Pickle offers no reducer hook for list and dict (reducer_override never
    sees them), so a converted one is saved as a persistent id: the rebuild
    function and its fresh arrays, which this pickler then shares like any
    array, for _ContainerUnpickler to rebuild. persistent_id sees an object
    each time it is referenced: a list held twice is converted once."""

    def __init__(self, out, min_items):
        super().__init__(out)
        self._min_items = min_items
        self._converted = {}  # id -> (the list or dict, its persistent id)

    def persistent_id(self, obj):
        kind = type(obj)
        if kind is not list and kind is not dict:
            return None
        known = self._converted.get(id(obj))
        if known is None:
            known = obj, _containers.reduce_converted(obj, self._min_items)
            self._converted[id(obj)] = known
        return known[1]


class _ContainerUnpickler(pickle.Unpickler):
    def __init__(self, data):
        super().__init__(data)
        self._rebuilt = {}  # id(persistent id) -> its container

    def persistent_load(self, pid):
        # The same persistent id object comes back for every reference to it.
        rebuilt = self._rebuilt.get(id(pid))
        if rebuilt is None:
            rebuild, args = pid
            if rebuild not in _containers.REBUILDS:
                raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
            rebuilt = self._rebuilt[id(pid)] = pid, rebuild(*args)
        return rebuilt[1]
