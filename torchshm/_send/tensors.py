"""Torch tensors through torchshm's segments: the policy (the mechanism is
Note [Tensor storages] in csrc/send/tensors.h).

torch's own tensor reducer takes a tensor apart (its checks, its metadata,
Parameter, sparse and nested layouts, CUDA) and pickles its storage; torchshm
replaces only the reducer of the untyped storage, so everything torch decides
about tensors stays torch's. A storage in a torchshm segment (born there, moved
there before, or received) always travels as a reference to its segment, with
a ticket, like an array. With the tensor switch on (the default;
TORCHSHM_TENSORS=0 or torchshm.register(tensors=False) turns it off), a CPU
storage not shared yet is moved into a segment in place, where torch would
move it into a /dev/shm file, and UntypedStorage._new_shared (the default
collate's batch in a DataLoader worker) makes its storage in a pooled
segment.

Note [Tensors by default]
Most pipelines use the default collate, which turns NumPy samples into
tensor batches: with the switch off, importing torchshm did nothing for
them (their batches went through /dev/shm files, and failed in Docker's
64 MiB). torch's own test_multiprocessing.py and test_dataloader.py give
the same outcomes with torchshm imported in every process as without it, on
every lane (but for test_fs, which looks for torch's files in /dev/shm;
scripts/torch_suites.sh, docs/guide/tensors.md), so it is on unless
TORCHSHM_TENSORS=0. What differs from torch's path, as with
share_memory_(): a storage moves in place when it is first sent (an ndarray
made from the tensor before then no longer aliases it); a storage
_new_shared makes is not zeroed (torch's callers, the default collate and
checkpoint staging, overwrite every byte). A storage of up to 64 KiB is a
block of a slab (Note [Small storages] in csrc/send/tensors.h), larger ones a
pooled segment each. Storages torch shared itself
(share_memory_()) keep torch's path. Where shared memory fails, torch's own
path carries the storage, with one warning (torchshm._fallback); the reducer
never raises where torch's would not.
"""

import errno
import functools
import operator
import os
import threading
from typing import Optional, Sequence, Union

import torch

from torchshm import _compat, _config, _fallback
from torchshm._lifetime import forks as _forks
from torchshm._lifetime import segments as _segments
from torchshm._native import _C
from torchshm._reduction import rebuild_storage, rebuild_storage_block

STORAGE = torch.UntypedStorage
SWITCH = "TORCHSHM_TENSORS"
# On unless TORCHSHM_TENSORS=0: importing torchshm is enough for the default
# collate's batches too (Note [Tensors by default]).
DEFAULT = True

_enabled = False
# One move at a time: two feeder threads pickling one tensor must not both
# copy it (the second would read bytes the first freed).
_move_lock = threading.Lock()


def _after_fork_in_child():
    # A thread of the parent may have held it at fork: it never lets go here.
    global _move_lock
    _move_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
# torch's methods that the patches below wrap, while they are installed, and
# what UntypedStorage's own dictionary held under their names (None: inherited).
_originals = {}
_own = {}
_PATCHED = ("is_shared", "share_memory_", "_new_shared")


def enabled() -> bool:
    """Whether the tensor switch is on in this process."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turns the switch on or off here and, through the environment, in the
    processes started from now on (DataLoader workers make the batches)."""
    global _enabled
    _enabled = bool(on)
    os.environ[SWITCH] = "1" if on else "0"


def read_switch() -> None:
    """Takes the switch from the environment (at import and register())."""
    global _enabled
    _enabled = bool(_config.env_setting(SWITCH, DEFAULT))


def shared_view(storage) -> Optional[torch.Tensor]:
    """An int8 tensor over `storage` if torchshm's memory holds it (a
    segment, or a block of a slab), else None."""
    if storage.device.type != "cpu":
        return None
    view = _compat.int8_tensor_over(storage)
    return view if _C.in_torchshm_memory(view) else None


def reduce_storage(storage):
    """The ForkingPickler reducer of torch's untyped storage (see the
    module's docstring)."""
    ours = False
    if _C.sends_by_value():  # Note [A plain send is as it was] in csrc/send/plan.h
        return _by_torch(storage)
    try:
        view = shared_view(storage)
        ours = view is not None
        if not ours:
            if not (_enabled and _movable(storage)):
                return _torch_reduce(storage)
            view = _move(storage)
        block = _C.block_of(view)
        if block is not None:
            owner, offset = block
            return _reference(rebuild_storage_block, owner, offset, storage.nbytes())
        if _C.storage_written(view):
            # This process wrote pages of a snapshot it received (an array's
            # .base): they are its own, not the segment's.
            view = _snapshot(view)
        return _reference(rebuild_storage, view, storage.nbytes())
    except Exception as exc:  # noqa: BLE001 - raising here loses the message
        _fallback.fall_back(
            exc, "sharing a tensor's storage", "torch's own sharing carries it"
        )
        # torch's own sharing moves a storage into its memory in place: never
        # one of torchshm's, which arrays may lie over (they would dangle).
        return _torch_reduce(storage.clone() if ours else storage)


def _by_torch(storage):
    """torch's own reduce, where torchshm makes no new message: after the exit
    hook, or in the child of a fork torchshm did not prepare (where memory
    of torchshm's it inherited cannot be read)."""
    if shared_view(storage) is None:
        return _torch_reduce(storage)
    _forks.check_fork_hooks("sending a tensor over shared memory")
    return _torch_reduce(storage.clone())


def _reference(rebuild, owner, *where):
    """(rebuild, (the message's reference to `owner`'s segment, *where))."""
    if _C.segment_of(owner).unlinked:
        raise _C.SharedMemoryError(
            errno.ENOENT,
            "torchshm: the storage's segment is closed (its session ended)",
        )
    return rebuild, (_C.message_ref(owner),) + where


def _snapshot(view):
    """A new snapshot holding the bytes of the storage `view` lies over
    (Note [Tensor storages] in csrc/send/tensors.h); that storage stays where it
    is."""
    owner = _segments.allocate(max(1, view.numel()), populate=False)
    _C.snapshot_storage(view, owner, _config.copy_threads())
    return owner


def _movable(storage):
    """A CPU storage with bytes that torch has not shared itself."""
    return (
        storage.device.type == "cpu"
        and storage.nbytes() > 0
        and not _originals["is_shared"](storage)
    )


def _move(storage):
    """Moves `storage` into torchshm's memory in place (torch's
    share_memory_(), into a block of a slab up to SMALL_BLOCK_MAX bytes,
    else a pooled segment); an int8 tensor over it."""
    with _move_lock:
        view = _compat.int8_tensor_over(storage)
        if _C.in_torchshm_memory(view):  # another thread's move came first
            return view
        if not _C.move_storage_to_block(view):  # a block of a slab if small
            owner = _segments.allocate(storage.nbytes(), populate=False)
            _C.move_storage(view, owner, _config.copy_threads())
    return view


def _torch_reduce(storage):
    from torch.multiprocessing import reductions

    return reductions.reduce_storage(storage)


def new_storage(nbytes: int):
    """A storage of `nbytes` in torchshm's memory: a block of a slab up to
    SMALL_BLOCK_MAX bytes, else a pooled segment (its bytes are not
    cleared: reused memory holds what was there). Raises SharedMemoryError
    if shared memory cannot hold it."""
    if nbytes > 0:
        carved = _C.carve_storage(nbytes)  # None unless small
        if carved is not None:
            return _compat.untyped_storage(carved)
    owner = _segments.allocate(max(1, nbytes))  # populated: torch writes it
    return _compat.untyped_storage(_C.segment_storage(owner, nbytes))


def empty(
    *size: Union[int, Sequence[int]],
    dtype: Optional[torch.dtype] = None,
    requires_grad: bool = False,
) -> torch.Tensor:
    """A tensor born in shared memory, like ``torch.empty`` (CPU, contiguous).

    It is sent by reference, without a copy, whether or not the tensor
    switch (``TORCHSHM_TENSORS``, ``register(tensors=True)``) is on: what the
    sender writes to it after sending, receivers see. Its bytes are not
    cleared (a reused pooled segment holds what was there).

    Parameters
    ----------
    *size : int or sequence of int
        The shape, as separate ints or one sequence (``empty(2, 3)`` or
        ``empty((2, 3))``); none makes a 0-d tensor.
    dtype : torch.dtype or None, optional
        Element type; ``None`` (default): ``torch.get_default_dtype()``.
    requires_grad : bool, optional
        Whether autograd records operations on it (default ``False``).

    Returns
    -------
    torch.Tensor
        A CPU tensor of that shape over a torchshm segment;
        ``tensor.is_shared()`` is true.

    Raises
    ------
    OSError
        torchshm's ``SharedMemoryError`` (an ``OSError`` subclass) if shared
        memory cannot hold it: no fallback to ordinary memory here.
    TypeError
        A size that is not an int or a sequence of ints.
    RuntimeError
        A negative size, or ``requires_grad=True`` with a dtype that is not
        floating point or complex (torch's own check).

    See Also
    --------
    register, allocating

    Examples
    --------
    >>> import pickle, torch
    >>> from multiprocessing.reduction import ForkingPickler
    >>> batch = torchshm.empty(64, 3, 32, 32, dtype=torch.uint8)
    >>> batch.shape, batch.is_shared()
    (torch.Size([64, 3, 32, 32]), True)
    >>> received = pickle.loads(ForkingPickler.dumps(batch))  # by reference
    >>> _ = batch.fill_(7)  # written after sending: the receiver sees it
    >>> int(received[0, 0, 0, 0])
    7
    """
    shape = _shape(size)
    dtype = dtype or torch.get_default_dtype()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    storage = new_storage(shape.numel() * itemsize)
    tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    return tensor.requires_grad_(requires_grad)


def _shape(size):
    """torch.Size of empty()'s sizes: ints (anything with __index__), or one
    sequence of them, as torch.empty takes."""
    if len(size) == 1 and not hasattr(size[0], "__index__"):
        size = size[0]
    try:
        return torch.Size([operator.index(s) for s in size])
    except TypeError:
        raise TypeError(
            f"torchshm.empty(): size must be ints or one sequence of ints, got"
            f" {size!r}"
        ) from None


def _is_shared(storage):
    return shared_view(storage) is not None or _originals["is_shared"](storage)


def _share_memory_(storage, *args, **kwargs):
    if shared_view(storage) is not None:
        return storage  # shared already: a move would detach the receivers
    return _originals["share_memory_"](storage, *args, **kwargs)


def _new_shared(cls, size, *, device="cpu"):
    if _enabled and torch.device(device).type == "cpu" and size > 0:
        try:
            return new_storage(size)
        except Exception as exc:  # noqa: BLE001 - torch's way still works
            _fallback.fall_back(
                exc, f"allocating {size} bytes in shared memory", "torch allocates it"
            )
    return _originals["_new_shared"](size, device=device)


def install() -> None:
    """Wraps torch's storage methods so that torchshm's storages behave as
    torch's shared ones do: is_shared() is true, share_memory_() keeps them
    where they are, and _new_shared makes them while the switch is on.
    Idempotent; uninstall() restores torch's."""
    if _originals:
        return
    for name in _PATCHED:
        _originals[name] = getattr(STORAGE, name)
        _own[name] = STORAGE.__dict__.get(name)
    STORAGE.is_shared = functools.wraps(_originals["is_shared"])(_is_shared)
    STORAGE.share_memory_ = functools.wraps(_originals["share_memory_"])(_share_memory_)
    STORAGE._new_shared = classmethod(_new_shared)


def uninstall() -> None:
    for name in list(_originals):
        if _own[name] is None:
            delattr(STORAGE, name)
        else:
            setattr(STORAGE, name, _own[name])
        del _originals[name], _own[name]
