"""torchshm.share(): move an object's arrays into shared memory once."""

from multiprocessing.reduction import ForkingPickler
from typing import TypeVar

from torchshm import _registry

T = TypeVar("T")


def share(obj: T) -> T:
    """An equivalent object whose eligible arrays live in shared memory.

    Works on an array or any picklable object graph (DataFrame, xarray
    Dataset, a model): it round-trips through torchshm's reducers in this
    process, so every later send of the result is O(1) whatever its size.
    Arrays below the threshold and object arrays stay ordinary.
    """
    if not _registry.is_registered():
        raise RuntimeError(
            "torchshm.share() needs torchshm's reducers: call torchshm.register()"
            " (it is off because of TORCHSHM_DISABLE=1 or torchshm.disabled())"
        )
    return ForkingPickler.loads(ForkingPickler.dumps(obj))
