"""torchshm: NumPy arrays between processes through torch shared memory.

`import torchshm` registers reducers with multiprocessing's ForkingPickler:
every non-object ndarray of at least get_threshold() bytes that a Queue, Pipe,
Pool or DataLoader sends travels through shared memory and is rebuilt on the
receiving side without a copy, and torch's CPU tensors go through the same
memory instead of /dev/shm (TORCHSHM_TENSORS=0, or register(tensors=False),
leaves them to torch). Set TORCHSHM_DISABLE=1 to import without registering.
"""

import torch  # noqa: F401  - loads libtorch before the extension

from torchshm._native import _C  # noqa: F401  - the seam (Note [The seam])
from torchshm import _config, _native, _reduction
from torchshm._lifetime import holdings as _holdings
from torchshm._lifetime import lifecycle as _lifecycle
from torchshm._lifetime import session as _session
from torchshm._send import allocator as _allocator
from torchshm._send import channel as _channel
from torchshm._send import sender as _sender
from torchshm._send.allocator import allocating, set_allocator
from torchshm._config import get_threshold, set_threshold
from torchshm._dataloader import (
    chain,
    collate,
    convert,
    worker_init_fn,
)
from torchshm._containers import SharedDict, SharedList
from torchshm._device import device_loader, to_device
from torchshm._handles import HandleError, dumps, loads, release
from torchshm._send.sender import is_shared
from torchshm._send.tensors import empty
from torchshm._send.registry import (
    disabled,
    is_registered,
    register,
    unregister,
)
from torchshm._share import share
from torchshm._lifetime.segments import trim
from torchshm._stats import reset_stats, stats
from torchshm import torchdata
from torchshm._version import __version__  # noqa: F401

__all__ = [
    "allocating",
    "chain",
    "collate",
    "convert",
    "device_loader",
    "disabled",
    "dumps",
    "empty",
    "get_threshold",
    "HandleError",
    "is_registered",
    "is_shared",
    "loads",
    "register",
    "release",
    "reset_stats",
    "set_allocator",
    "set_threshold",
    "share",
    "SharedDict",
    "SharedList",
    "stats",
    "to_device",
    "torchdata",
    "trim",
    "unregister",
    "worker_init_fn",
]

# Names of 0.1 that moved, kept for one release (PEP 562: the warning points
# at the user's line that uses the old name).
_MOVED = {
    "datapipe_worker_init_fn": (
        "torchshm.torchdata.register_in_worker, or torchshm.chain(fn) to chain"
        " yours",
        lambda: _deprecated_datapipe_worker_init_fn,
    ),
    "in_workers": ("torchshm.torchdata.in_workers", lambda: torchdata.in_workers),
    "share_memory": ("torchshm.torchdata.to_shared", lambda: torchdata.to_shared),
    "map_fn": ("torchshm.chain", lambda: chain),
}


def __getattr__(name):
    if name in _MOVED:
        import warnings

        new, target = _MOVED[name]
        warnings.warn(
            f"torchshm.{name} is deprecated: use {new}", DeprecationWarning, 2
        )
        return target()
    raise AttributeError(f"module 'torchshm' has no attribute {name!r}")


def _deprecated_datapipe_worker_init_fn(datapipe_or_fn, worker_info=None):
    """0.1's datapipe_worker_init_fn: a hook, or (given a function) a chain."""
    if worker_info is None and callable(datapipe_or_fn):
        return chain(datapipe_or_fn)
    return torchdata.register_in_worker(datapipe_or_fn, worker_info)


def _configure_native():
    """Note [The seam] (_native.py): the native side gets every number and
    every hook here, once, after every module is imported."""
    _native.configure(
        policy=_sender.policy(),
        hooks=dict(
            reduce_other=_sender.reduce_other,
            reduce_by_value=_sender.reduce_by_value,
            reduce_torch_owned=_sender.reduce_torch_owned,
            fall_back=_sender.fall_back,
            allocate=_sender.allocate,
            attach_segment=_reduction.attach_segment,
            born_source=_allocator.source,
        ),
        writers=_channel.WRITERS,
        max_depth=_channel.MAX_DEPTH,
        pool=_holdings.pool.native,
    )
    _config.on_threshold_change(_native.set_threshold)
    _session.set_up()
    _lifecycle.install()


_configure_native()
if not _config.registration_disabled():
    register()
