"""Batches to the GPU from where they lie: torchshm's memory pinned in place
(Note [Pinned in place] in _lifetime/pins.py), copied on torchshm's own
stream in as few copies as the memory allows, and DataLoader's pin thread
copying nothing (Note [Which copies are safe])."""

import collections.abc
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from torchshm import _compat
from torchshm._cuda import runtime as _runtime
from torchshm._lifetime import pins as _pins
from torchshm._native import _C
from torchshm._send import registry as _registry

# Note [Which copies are safe]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A pinned segment's slot is released only once events, recorded after its
# last view here died, have completed on every stream a copy from it may have
# used (Note [Copies before reuse] in csrc/lifetime/views.h): torchshm's own
# copy streams, the current stream of the thread that polls, and the last
# streams made current through torch.cuda.set_stream or torch.cuda.stream()
# (runtime.py, STREAMS_REMEMBERED). So these idioms are safe, without the
# user's help:
# - torchshm.to_device(batch) and torchshm.device_loader(loader): torchshm
#   issues the copies on its own stream, and the caller's stream waits for
#   them;
# - DataLoader(pin_memory=True), whose pin thread then copies nothing,
#   followed by batch.to(device, non_blocking=True) on the current stream,
#   the batch dropped whenever;
# - a prefetcher that copies inside `with torch.cuda.stream(s):` and drops
#   the CPU batch inside or after the block.
# Not covered: a copy on a stream made current another way (from C++,
# torch.Stream's own context manager, torch.accelerator.set_stream), when
# the batch is dropped after that stream stopped being current: torchshm
# never saw it. Drop the batch inside the block, or use torchshm.to_device.
# A write into the CPU batch while a copy of it runs is the caller's race,
# as with any pinned memory.

# Note [Born batches pinned in place]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A batch born in a worker (np.stack, Note [Batches born shared] in
# _dataloader.py) arrives as a snapshot, mapped privately here (Note
# [Snapshots are mapped privately] in csrc/lifetime/segment.h), and a
# private mapping is never registered. Its bytes are also the segment's:
# nobody writes a snapshot's file until the pool reuses it, which waits for
# this process's slot, and that waits for the copies (Note [Copies before
# reuse]). So to_device copies such a leaf from the segment's shared mapping,
# registered, where this process wrote none of its pages (_C.shared_address);
# a page written here is its own and the leaf goes as pageable memory.
# torchshm.collate's batches and np.stack's then take the same path. The
# DataLoader's pin hook cannot: torch's pin_memory would return a tensor over
# the shared mapping, where a write would reach the other receivers.

# Extents of one segment this close are copied as one: launching a copy
# costs more than copying a gap this small (about 5 us at 50 GB/s).
MERGE_GAP = 256 << 10
# Where a device buffer places each extent: at the same offset modulo this as
# on the host, so that every leaf keeps its alignment.
ALIGNMENT = 256


def to_device(batch: Any, device: Any = "cuda", non_blocking: bool = True) -> Any:
    """Copy a batch's tensors and arrays to a GPU, from torchshm's memory
    pinned in place.

    Every CPU tensor and every NumPy array of a type torch knows, also
    inside dicts, lists, tuples and namedtuples, becomes a tensor on
    `device` with the same shape and strides; other objects stay as they
    are. Memory that a worker sent through torchshm is registered with CUDA
    once (pinned where it lies: no copy into pinned memory first), and all
    of a batch that lies in one segment goes as one copy. The copies run on
    torchshm's own stream, and the caller's current stream waits for them;
    the CPU batch may be dropped at once: its memory is not reused before
    the copies are done.

    Parameters
    ----------
    batch : object
        A tensor, an array, or a structure of them (as a DataLoader yields).
    device : torch.device or str, optional
        The GPU (default ``"cuda"``: the current one).
    non_blocking : bool, optional
        ``True`` (default): return once the copies are issued. ``False``:
        once they are done.

    Returns
    -------
    object
        The batch with its tensors and arrays on `device`.

    Raises
    ------
    RuntimeError
        CUDA is not available (as ``tensor.to("cuda")`` raises).

    See Also
    --------
    device_loader, collate

    Examples
    --------
    >>> batch = next(iter(loader))  # doctest: +SKIP
    >>> on_gpu = torchshm.to_device(batch)  # doctest: +SKIP
    """
    runtime = _runtime.active()
    device = runtime.device(device)
    _pins.poll()
    leaves, rebuild = _flatten(batch)
    hosts = [_host_tensor(leaf) for leaf in leaves]
    extents = _extents(leaves, hosts)
    stream = runtime.copy_stream(device)
    buffer = runtime.empty(max(1, sum(e.span for e in extents)), device, stream)
    moved = list(leaves)
    for extent in extents:
        runtime.copy(
            buffer[extent.offset : extent.offset + extent.nbytes], extent.source, stream
        )
        for index, host in extent.members:
            moved[index] = _on_device(buffer, extent, host)
    for index, host in enumerate(hosts):
        if host is not None and host.numel() == 0:
            moved[index] = (
                buffer[:0].view(host.dtype).as_strided(host.shape, host.stride())
            )
    event = runtime.record(stream)
    runtime.hand_over(event, buffer)
    if not non_blocking:
        runtime.wait(event)
    return rebuild(moved)


def device_loader(loader: Iterable, device: Any = "cuda") -> Iterator:
    """Iterate a loader's batches on a GPU, each through `to_device`.

    ``for batch in torchshm.device_loader(loader):`` is ``for batch in
    loader: batch = torchshm.to_device(batch, device)``: each batch's copies
    run on torchshm's stream while the caller's stream still works on the
    previous batch.

    Parameters
    ----------
    loader : iterable
        A DataLoader, or any iterable of batches.
    device : torch.device or str, optional
        The GPU (default ``"cuda"``: the current one).

    Returns
    -------
    iterator
        The batches, on `device`.

    Raises
    ------
    RuntimeError
        CUDA is not available (at the first batch).

    See Also
    --------
    to_device

    Examples
    --------
    >>> for batch in torchshm.device_loader(loader):  # doctest: +SKIP
    ...     loss = model(batch["x"])
    """
    for batch in loader:
        yield to_device(batch, device)


def pin_memory(*args, **kwargs):
    """DataLoader's pin function with torchshm's hook: the batch's memory
    that a worker sent through torchshm is pinned in place first, so torch's
    pin_memory() returns those tensors themselves (Note [Pinned in place])."""
    _pins.poll()
    leaves, _ = _flatten(args[0] if args else kwargs.get("data"))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
            continue
        under = _segment_under(leaf)
        if under is not None:
            _pins.pin(under[0])
    return pin_memory.torchshm_original(*args, **kwargs)


# --- a batch's leaves


def _flatten(batch):
    """(the tensors and arrays of `batch`, a function that puts new ones in
    their places), through dicts, lists, tuples and namedtuples."""
    leaves = []
    put = _walk(batch, leaves)
    return leaves, lambda new: put(iter(new))


def _walk(obj, leaves):
    """Appends `obj`'s leaves to `leaves`; a function that rebuilds `obj`
    from an iterator of new leaves. (A module function, not a closure that
    calls itself: that would be a cycle keeping the leaves, and so their
    segments' slots, until the garbage collector runs.)"""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        leaves.append(obj)
        return next
    if isinstance(obj, collections.abc.Mapping):
        parts = {k: _walk(v, leaves) for k, v in obj.items()}
        return lambda it: _same_mapping(obj, {k: p(it) for k, p in parts.items()})
    if isinstance(obj, (list, tuple)):
        parts = [_walk(v, leaves) for v in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return lambda it: type(obj)(*(p(it) for p in parts))
        return lambda it: type(obj)(p(it) for p in parts)
    return lambda it: obj


def _same_mapping(template, items):
    try:
        return type(template)(items)
    except TypeError:  # a mapping type that takes no dict
        return items


def _host_tensor(leaf):
    """A CPU tensor over `leaf`'s memory (a copy for an array torch cannot
    view: negative strides, another byte order), or None for what stays as
    it is (another device's tensor, a dtype torch has no type for)."""
    if isinstance(leaf, torch.Tensor):
        return leaf if leaf.device.type == "cpu" else None
    dtype = _torch_dtype(leaf.dtype)
    if dtype is None:
        return None
    if not leaf.dtype.isnative or any(s < 0 for s in leaf.strides):
        return torch.from_numpy(
            np.ascontiguousarray(leaf, dtype=leaf.dtype.newbyteorder("="))
        )
    # Over the array's own bytes, whoever owns them (torch.from_numpy would
    # warn about a read-only one); the caller keeps `leaf` meanwhile.
    size = leaf.itemsize
    flat = _bytes_at(leaf.ctypes.data, max(_array_span(leaf), size)).view(dtype)
    return flat.as_strided(leaf.shape, [s // size for s in leaf.strides])


_TORCH_DTYPES = {}


def _torch_dtype(dtype):
    """torch's type for a NumPy dtype, or None."""
    if dtype not in _TORCH_DTYPES:
        try:
            found = torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype
        except TypeError:
            found = None
        _TORCH_DTYPES[dtype] = found
    return _TORCH_DTYPES[dtype]


def _array_span(array):
    """Bytes from an array's first element (lowest address) to past its
    last, for non-negative strides."""
    if array.size == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(array.shape, array.strides)) + array.itemsize


def _span(host):
    """Bytes from a tensor's first element to past its last."""
    if host.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(host.shape, host.stride()))
    return (last + 1) * host.element_size()


def _segment_under(leaf, private_too=False):
    """The segment whose shared mapping holds all of `leaf`'s bytes (a
    tensor or an array), and how far from the leaf's address they lie
    there; None (ordinary memory, a read-only mapping, a private one unless
    `private_too`: Note [Born batches pinned in place])."""
    if isinstance(leaf, torch.Tensor):
        owner = leaf
        lo, span = leaf.data_ptr(), _span(leaf)
    else:
        owner = _C.memory_owner(leaf)
        if owner is None or any(s < 0 for s in leaf.strides):
            return None
        lo, span = leaf.ctypes.data, _array_span(leaf)
    segment = _C.segment_of(owner)
    if segment is None:
        block = _C.block_of(owner)  # a small storage, in a slab
        segment = None if block is None else _C.segment_of(block[0])
    if segment is None:
        return None
    if segment.address <= lo and lo + span <= segment.address + segment.capacity:
        return segment, 0
    shared = _C.shared_address(owner, lo, span) if private_too else 0
    return (segment, shared - lo) if shared else None


class _Extent:
    """Host bytes [lo, lo + nbytes) copied as one, from `source` (a uint8
    tensor over them) to buffer offset `offset`; `members`: (leaf index,
    host tensor) of the leaves in it."""

    __slots__ = ("lo", "nbytes", "source", "members", "offset", "span")

    def __init__(self, lo, nbytes, members, source=None):
        self.lo, self.nbytes, self.members = lo, nbytes, members
        self.source = source
        self.offset = self.span = 0


def _extents(leaves, hosts):
    """The copies a batch needs: one per run of nearby leaves in one pinned
    segment, one per other leaf; placed in one buffer."""
    extents, by_segment = [], {}
    for index, (leaf, host) in enumerate(zip(leaves, hosts)):
        if host is None or host.numel() == 0:
            continue
        under = _segment_under(leaf, private_too=True)
        aligned = host.data_ptr() % host.element_size() == 0
        if under is not None and aligned and _pins.pin(under[0]):
            segment, shift = under
            if shift:  # the same bytes, in the shared mapping
                flat = _bytes_at(host.data_ptr() + shift, _span(host))
                host = flat.view(host.dtype).as_strided(host.shape, host.stride())
            by_segment.setdefault(segment.address, []).append((index, host))
            continue
        # Pageable memory (or torch's own pinned memory): copied from the
        # leaf itself, which torch then knows (its pinned allocator records
        # the copy), contiguous.
        host = hosts[index] = host.contiguous()
        source = host.reshape(-1).view(torch.uint8)
        extents.append(
            _Extent(host.data_ptr(), source.numel(), [(index, host)], source)
        )
    for members in by_segment.values():
        members.sort(key=lambda m: m[1].data_ptr())
        run = None
        for index, host in members:
            lo, hi = host.data_ptr(), host.data_ptr() + _span(host)
            if run is not None and lo <= run.lo + run.nbytes + MERGE_GAP:
                run.nbytes = max(run.nbytes, hi - run.lo)
                run.members.append((index, host))
                continue
            run = _Extent(lo, hi - lo, [(index, host)])
            extents.append(run)
    cursor = 0
    for extent in extents:
        if extent.source is None:  # pinned: kept mapped by its registration
            extent.source = _bytes_at(extent.lo, extent.nbytes)
        start = (cursor + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        extent.offset = start + extent.lo % ALIGNMENT
        extent.span = extent.offset + extent.nbytes - cursor
        cursor = extent.offset + extent.nbytes
    return extents


def _bytes_at(address, nbytes):
    """A uint8 CPU tensor over host bytes [address, address + nbytes) of a
    pinned segment (its registration keeps them mapped)."""
    array = np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(address)
    )
    return torch.from_numpy(array)


def _on_device(buffer, extent, host):
    """`host`'s tensor in `buffer`, where `extent` put its bytes."""
    at = extent.offset + host.data_ptr() - extent.lo
    size = host.element_size()
    flat = buffer[at : at + (_span(host) + size - 1) // size * size].view(host.dtype)
    return flat.as_strided(host.shape, host.stride(), flat.storage_offset())


def _install_pin_hook():
    current = _compat.dataloader_pin_memory()
    if not hasattr(current, "torchshm_original"):
        pin_memory.torchshm_original = current
        _compat.set_dataloader_pin_memory(pin_memory)
    _runtime.track_streams()


def _uninstall_pin_hook():
    current = _compat.dataloader_pin_memory()
    if hasattr(current, "torchshm_original"):
        _compat.set_dataloader_pin_memory(current.torchshm_original)
    _runtime.untrack_streams()


_registry.while_registered(_install_pin_hook, _uninstall_pin_hook)
