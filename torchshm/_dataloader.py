"""PyTorch DataLoader integration: worker registration and NumPy collation.

Note [Registration in workers]
A worker sends with the reducers of its own process. Under fork it inherits
them; under spawn and forkserver it has them only if something it unpickles
imports torchshm. `worker_init_fn` is that something: the DataLoader pickles
it into every worker, unpickling it imports torchshm (which registers), and
calling it registers again in case the import happened earlier with the
reducers off. Under forkserver (Python 3.14's default on Linux) no hook is
needed while the fork server has not started when torchshm registers: it
joins the server's preload list (_registry._preload_in_forkserver).
So that importing torchshm is enough, a DataLoader whose workers start
while torchshm is registered in its process runs them with chain(its
worker_init_fn) for that iter() (_register_workers): its workers register
without the user's help (under fork they inherit it anyway), their batches
are born shared (Note [Batches born shared]), and the user's function
still runs. That is the DataLoader's own hook, used as the user would; a loader
that overrides _get_iterator (torchdata's StatefulDataLoader) is left as it
is, and torchshm warns there once (Note [Arrays that arrive by value] in
_send/arrivals.py).
A worker reads the settings (TORCHSHM_*) from the environment it inherited:
under forkserver, the fork server's, as it was when the server started. So
register(tensors=True) after the server started does not reach the workers;
chain(fn, tensors=True) carries the switch in the hook itself.

Note [Batches born shared]
A batch a collate function returns as NumPy (np.stack, xarray's or
pandas' to_numpy()), or a sample with batch_size=None, is made by NumPy in
the worker's private memory and copied into shared memory when it is sent:
two copies, where torch's default collate writes its tensors once into
shared memory. So a DataLoader worker allocates with torchshm's allocator
(set_allocator: arrays of at least the threshold are born in a segment,
smaller ones stay NumPy's): what it sends is in shared memory when it is
made, and goes by reference. The DataLoader's hook turns it on in every
worker (_register_workers), under every start method, and so do
worker_init_fn, chain (by default) and the reading services'
register_in_worker, in worker processes only (born_shared_here: a hook run
in the main process leaves it off). A hook the user built with chain(fn,
allocate=False) is left as it is. What it costs an array that never leaves
the worker: its allocation from the pool instead of NumPy's (`python -m
benchmarks --only born_cost`), an fd kept while it lives (numbered from 1024
up, so the worker's own sockets stay within select()'s reach: Note [Kept fds
above select's range] in csrc/lifetime/segment.h), and its memory counts as
shared until it is freed.

Note [One segment per batch]
`np.stack` into fresh memory and then a send copies each batch twice: once
to stack, once into shared memory at send time. `collate` plans every array
of the batch first, allocates one segment for all of them, and stacks
straight into it; the batch is then already shared memory and is sent by
reference (`is_shared`), so a batch costs one copy and one segment.
"""

import collections.abc
import functools
import multiprocessing as mp
import warnings
from typing import Any, Callable, Optional, Sequence, TypeVar

import numpy as np
import torch
from torch.utils.data import IterDataPipe

from torchshm import _compat, _config, _fallback
from torchshm._send import allocator as _allocator
from torchshm._send import registry as _registry
from torchshm._send import tensors as _tensors
from torchshm._lifetime import segments as _segments
from torchshm._native import _C

T = TypeVar("T")

# Every stacked array starts on a cache-line boundary of the batch segment.
_ALIGN = 64
BATCH_DIM = "batch"


def worker_init_fn(worker_id: Optional[int] = None) -> None:
    """DataLoader ``worker_init_fn`` (or pool initializer) that registers
    torchshm in each worker.

    ``DataLoader(..., worker_init_fn=torchshm.worker_init_fn)``, and as well
    ``multiprocessing.Pool(initializer=torchshm.worker_init_fn)`` or
    ``ProcessPoolExecutor(initializer=torchshm.worker_init_fn)``. A worker
    sends with its own process's reducers: under fork it inherits them, but
    under spawn and forkserver it has them only if something it unpickles
    imports torchshm. The DataLoader pickles this hook into every worker,
    which imports torchshm there, and calling it registers again in case
    the import happened with the reducers off. It registers nothing under
    ``TORCHSHM_DISABLE=1``. The worker reads ``TORCHSHM_*`` settings from the
    environment it inherited. To run your own function too, pass
    ``torchshm.chain(your_fn)``. The 0.1 form ``worker_init_fn(fn)`` still
    returns ``chain(fn)``, with a ``DeprecationWarning``.

    Parameters
    ----------
    worker_id : int, optional
        The worker's number, as the DataLoader passes it (unused); a pool
        calls an initializer without it.

    Returns
    -------
    None

    Raises
    ------
    ValueError
        A ``TORCHSHM_*`` environment variable of the worker has a bad value.

    See Also
    --------
    chain, collate, register

    Examples
    --------
    >>> from torch.utils.data import DataLoader
    >>> data = [np.full(100_000, i) for i in range(4)]
    >>> loader = DataLoader(
    ...     data,
    ...     batch_size=2,
    ...     num_workers=2,
    ...     worker_init_fn=torchshm.worker_init_fn,
    ...     collate_fn=torchshm.collate,
    ...     multiprocessing_context="fork",
    ... )
    >>> [(batch.shape, torchshm.is_shared(batch)) for batch in loader]
    [((2, 100000), True), ((2, 100000), True)]
    """
    if callable(worker_id):  # the 0.1 form, worker_init_fn(your_fn)
        warnings.warn(
            "torchshm.worker_init_fn(fn) is deprecated: use torchshm.chain(fn)",
            DeprecationWarning,
            stacklevel=2,
        )
        return chain(worker_id)
    _register_in_worker()
    if born_shared_here():
        _allocator.set_allocator(True)
    return None


class AllocatingIterDataPipe(IterDataPipe):
    """Its source, iterated with NumPy allocating large arrays in shared
    memory in the iterating thread (from then on, as set_allocator does):
    torchdata workers iterate in a prefetch thread, not the hook's."""

    def __init__(self, source_datapipe, min_bytes=None):
        self.source_datapipe, self.min_bytes = source_datapipe, min_bytes

    def __iter__(self):
        _allocator.set_allocator(True, self.min_bytes)
        yield from self.source_datapipe

    def __len__(self):
        return len(self.source_datapipe)


def chain(
    fn: Optional[Callable[..., T]],
    *,
    allocate: Optional[bool] = None,
    tensors: Optional[bool] = None,
) -> Callable[..., Optional[T]]:
    """A picklable hook that registers torchshm, then calls `fn`.

    Wherever the hook is called (a worker), it registers torchshm's reducers
    in that process (not under ``TORCHSHM_DISABLE=1``), then returns
    ``fn(*args)``. Use it as a DataLoader's ``worker_init_fn(worker_id)``,
    torchdata's ``worker_init_fn(datapipe, worker_info)``, or the map
    function of a process pool that has no other hook
    (``torchdata.nodes.ParallelMapper``, ``Pool.map``). Unpickling the hook
    in a spawn or forkserver worker imports torchshm there.

    Parameters
    ----------
    fn : callable or None
        Your hook or map function; ``None``: the hook only registers. Under
        spawn and forkserver it must be picklable (a module-level function).
    allocate : bool or None, optional
        Also turn on born-shared allocation (``set_allocator(True)``) in the
        calling thread first, and in the thread that iterates a datapipe
        `fn` returns (`torchshm.torchdata.with_allocator`): the arrays of at
        least the threshold that the worker makes are then sent without a
        copy (Note [Batches born shared]). ``None`` (default): where the
        hook runs in a worker process, not in the main process; ``True``:
        wherever it runs; ``False``: never (NumPy's allocator stays).
    tensors : bool or None, optional
        Turn the tensor switch on or off in the worker
        (``register(tensors=...)``); ``None`` (default) leaves it to the
        worker's environment (``TORCHSHM_TENSORS``). Carried in the hook, so
        it reaches workers of a fork server started before.

    Returns
    -------
    callable
        The hook: ``hook(*args)`` returns ``fn(*args)`` (``None`` if `fn` is
        ``None``; with `allocate`, a returned ``IterDataPipe`` is wrapped by
        `torchshm.torchdata.with_allocator`).

    Raises
    ------
    Nothing
        ``chain`` itself only builds the hook. Calling the hook raises
        ``ValueError`` for a bad ``TORCHSHM_*`` environment variable, and
        whatever `fn` raises.

    See Also
    --------
    worker_init_fn, set_allocator, torchshm.torchdata.register_in_worker

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> hook = torchshm.chain(torch.manual_seed)
    >>> hook
    torchshm.chain(<function manual_seed at 0x...>)
    >>> loader = DataLoader(
    ...     [np.full(100_000, i) for i in range(4)],
    ...     batch_size=2,
    ...     num_workers=2,
    ...     worker_init_fn=hook,  # torch.manual_seed(worker_id), registered
    ...     collate_fn=torchshm.collate,
    ...     multiprocessing_context="fork",
    ... )
    >>> [int(batch[:, 0].sum()) for batch in loader]
    [1, 5]

    Default-collated tensor batches made in torchshm's memory:

    >>> loader = DataLoader(
    ...     [np.ones(1_000)] * 4,
    ...     batch_size=2,
    ...     num_workers=2,
    ...     worker_init_fn=torchshm.chain(None, tensors=True),
    ...     multiprocessing_context="fork",
    ... )
    >>> [batch.is_shared() for batch in loader]
    [True, True]
    """
    return RegisterThenCall(fn, "torchshm.chain", allocate, tensors)


class RegisterThenCall:
    """A picklable hook that registers torchshm (and, if asked, turns on the
    allocator), then calls the user's `fn` with the hook's arguments."""

    allocate = False  # hooks pickled before allocate existed
    tensors = None  # ... and before tensors existed

    def __init__(self, fn, wrapper, allocate=None, tensors=None):
        self.fn, self.wrapper = fn, wrapper
        self.allocate, self.tensors = allocate, tensors

    def __call__(self, *args):
        _register_in_worker(self.tensors)
        allocate = born_shared_here() if self.allocate is None else self.allocate
        if allocate:
            _allocator.set_allocator(True)
        result = None if self.fn is None else self.fn(*args)
        if not allocate:
            return result
        # A torchdata hook returns the datapipe, which a worker may iterate
        # in another thread (its prefetcher): turn it on there too.
        if isinstance(result, IterDataPipe):
            result = AllocatingIterDataPipe(result)
        return result

    def __repr__(self):
        allocate = "" if self.allocate is None else f", allocate={self.allocate}"
        tensors = "" if self.tensors is None else f", tensors={self.tensors}"
        return f"{self.wrapper}({self.fn!r}{allocate}{tensors})"


def _register_workers(get_iterator):
    """DataLoader._get_iterator that gives its workers torchshm's hook:
    registration under spawn and forkserver (Note [Registration in
    workers]), born-shared arrays under every start method (Note [Batches
    born shared])."""

    @functools.wraps(get_iterator)
    def _get_iterator(self):
        hook = self.worker_init_fn
        if (
            self.num_workers == 0
            or isinstance(hook, RegisterThenCall)  # the user's own choice
            or hook is worker_init_fn
            or not _registry.is_registered()
        ):
            return get_iterator(self)
        self.worker_init_fn = RegisterThenCall(hook, "torchshm.chain")
        try:
            return get_iterator(self)
        finally:
            self.worker_init_fn = hook

    _get_iterator.torchshm_original = get_iterator
    return _get_iterator


def _install_worker_registration():
    current = _compat.dataloader_get_iterator()
    if not hasattr(current, "torchshm_original"):
        _compat.set_dataloader_get_iterator(_register_workers(current))


def _uninstall_worker_registration():
    current = _compat.dataloader_get_iterator()
    if hasattr(current, "torchshm_original"):
        _compat.set_dataloader_get_iterator(current.torchshm_original)


_registry.while_registered(_install_worker_registration, _uninstall_worker_registration)


def born_shared_here():
    """Whether a worker hook turns the allocator on in this process (Note
    [Batches born shared]): in a worker (a multiprocessing child) where
    torchshm is registered; not where a hook runs in the main process (a
    thread-based mapper, a test)."""
    return mp.parent_process() is not None and _registry.is_registered()


def _register_in_worker(tensors=None):
    # Not inside the caller's own `with torchshm.disabled()` (a hook or map
    # function run in the main process, num_workers=0).
    if not _config.registration_disabled() and not _registry.in_disabled_block():
        _registry.register(tensors)


def convert(sample: T) -> T:
    """DataLoader ``collate_fn`` for ``batch_size=None``: the sample as it is.

    The DataLoader's default converts NumPy arrays into tensors; this keeps
    them ndarrays (sent through shared memory). A top-level function, unlike
    a lambda, pickles under spawn and forkserver.

    Parameters
    ----------
    sample : object
        One sample, as the dataset returned it.

    Returns
    -------
    object
        `sample`, unchanged.

    Raises
    ------
    Nothing
        It returns its argument.

    See Also
    --------
    collate : for batches.

    Examples
    --------
    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader([np.ones(3)], batch_size=None, collate_fn=torchshm.convert)
    >>> next(iter(loader))
    array([1., 1., 1.])
    """
    return sample


def collate(batch: Sequence[Any]) -> Any:
    """DataLoader ``collate_fn`` that builds NumPy batches in shared memory.

    Stacks the samples' ndarrays along a new first axis, also inside dicts,
    tuples, lists and namedtuples (as ``default_collate`` does, without
    making tensors); arrays of different dtypes are promoted. Every array of
    the batch is stacked straight into one shared-memory segment (one copy,
    no second copy at send time), which is then sent by reference; a batch
    below the threshold (`get_threshold`), or without torchshm registered,
    is stacked in ordinary memory, as is one that shared memory cannot take
    (with one ``RuntimeWarning``). xarray DataArrays and Datasets get a
    leading ``"batch"`` dimension: data variables are stacked, coordinates
    equal in every sample are kept once and differing ones are stacked
    (``xarray.concat`` with ``coords="different"``); dimension coordinates
    must agree across samples. Torch tensors are stacked into one tensor as
    ``default_collate`` stacks them, born in shared memory (`empty`) when
    the batch is at least the threshold. Python and NumPy scalars become
    1-D arrays; other objects (strings, DataFrames, object arrays) are
    returned as a list. The first sample decides the structure.

    Parameters
    ----------
    batch : sequence
        The samples, a non-empty list (as the DataLoader passes it).

    Returns
    -------
    object
        The batch: an ndarray, or the samples' structure with stacked
        arrays in it.

    Raises
    ------
    TypeError
        `batch` is not a non-empty sequence (with ``batch_size=None`` use
        `convert`).
    ValueError
        Arrays (or tensors) of different shapes, sequences of different
        lengths, or mappings with different keys in one batch; xarray
        samples whose dimension coordinates differ.

    See Also
    --------
    convert, worker_init_fn, is_shared

    Examples
    --------
    >>> batch = torchshm.collate([np.zeros((256, 256)), np.ones((256, 256))])
    >>> batch.shape, torchshm.is_shared(batch)  # 1 MiB, stacked in a segment
    ((2, 256, 256), True)
    >>> torchshm.collate([{"x": np.arange(3), "y": 0}, {"x": np.arange(3), "y": 1}])
    {'x': array([[0, 1, 2],
           [0, 1, 2]]), 'y': array([0, 1])}
    """
    if not isinstance(batch, collections.abc.Sequence) or not len(batch):
        raise TypeError(
            "torchshm.collate expected a non-empty list of samples, got"
            f" {type(batch).__name__}; with batch_size=None use"
            " collate_fn=torchshm.convert"
        )
    jobs = []
    build = _plan(list(batch), jobs)
    return build(_stack_all(jobs))


def _plan(samples, jobs):
    """Records the stacks `samples` need in `jobs`; returns a function that
    builds the batch from the stacked arrays (in the order of `jobs`)."""
    first = samples[0]
    if isinstance(first, np.ndarray) and not first.dtype.hasobject:
        return _plan_stack(samples, jobs)
    if isinstance(first, torch.Tensor):
        return _plan_tensors(samples)
    if isinstance(first, (bool, int, float, complex, np.generic)):
        # Small: a plain array, pickled inline.
        values = np.asarray(samples)
        return lambda stacked: values
    if _is_xarray(first):
        return _plan_xarray(samples, jobs)
    if isinstance(first, collections.abc.Mapping):
        _check_same_keys(samples)
        parts = {k: _plan([s[k] for s in samples], jobs) for k in first}
        return lambda stacked: _rebuild_mapping(first, parts, stacked)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        parts = [_plan(list(f), jobs) for f in _transpose(samples)]
        return lambda stacked: type(first)(*(p(stacked) for p in parts))
    if isinstance(first, (tuple, list)):
        parts = [_plan(list(f), jobs) for f in _transpose(samples)]
        kind = type(first) if type(first) in (tuple, list) else list
        return lambda stacked: kind(p(stacked) for p in parts)
    return lambda stacked: list(samples)


def _plan_stack(samples, jobs):
    shape, dtype = samples[0].shape, samples[0].dtype
    for s in samples:
        if not isinstance(s, np.ndarray) or s.shape != shape:
            raise ValueError(
                "torchshm.collate expected arrays of one shape in a batch, got"
                f" {shape} and {getattr(s, 'shape', type(s).__name__)}; pad or"
                " crop samples to one shape, or batch them yourself"
            )
        if s.dtype != dtype:  # promote only on a mismatch: it makes byte order native
            dtype = np.promote_types(dtype, s.dtype)
    index = len(jobs)
    jobs.append((samples, dtype))
    return lambda stacked: stacked[index]


def _plan_tensors(samples):
    """Torch tensors are stacked as the default collate stacks them, into a
    tensor born in shared memory (torchshm.empty) when it is big enough to
    be shared, so that it is sent by reference."""
    shape = samples[0].shape
    for s in samples:
        if not isinstance(s, torch.Tensor) or s.shape != shape:
            raise ValueError(
                "torchshm.collate expected tensors of one shape in a batch, got"
                f" {tuple(shape)} and"
                f" {tuple(getattr(s, 'shape', ())) or type(s).__name__}; pad or"
                " crop samples to one shape, or batch them yourself"
            )
    return lambda stacked: _stack_tensors(samples)


def _stack_tensors(samples):
    first = samples[0]
    out = None
    if first.device.type == "cpu":
        dtype = functools.reduce(torch.promote_types, (s.dtype for s in samples))
        out = _in_shared_memory(
            len(samples) * first.numel() * first.element_size(),
            lambda: _tensors.empty(len(samples), *first.shape, dtype=dtype),
        )
    return torch.stack(list(samples), 0, out=out)


def _in_shared_memory(nbytes, allocate):
    """allocate() where a batch of `nbytes` is worth sharing (at least the
    threshold, with torchshm registered), else None: the batch goes in
    ordinary memory (to be pickled inline), as it does, with one warning,
    where allocate() fails."""
    if nbytes < _config.get_threshold() or not _registry.is_registered():
        return None
    try:
        return allocate()
    except Exception as exc:  # noqa: BLE001 - a batch in plain memory instead
        _fallback.fall_back(
            exc,
            "collating a batch in shared memory",
            "stacking it in ordinary memory",
        )
        return None


def _stack_all(jobs):
    """np.stack of every job, into one segment when the batch is big enough
    to be shared (else into ordinary memory: it will be pickled inline)."""
    layout, total = [], 0
    for samples, dtype in jobs:
        shape = (len(samples),) + samples[0].shape
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        layout.append((total, shape, nbytes))
        total += -(-nbytes // _ALIGN) * _ALIGN
    owner = (
        _in_shared_memory(total, lambda: _segments.allocate(total)) if total else None
    )
    if owner is None:
        return [np.stack(s).astype(d, copy=False) for s, d in jobs]
    stacked = []
    for (samples, dtype), (offset, shape, _) in zip(jobs, layout):
        strides = _c_strides(shape, dtype.itemsize)
        out = _C.wrap_ndarray(owner, offset, dtype, shape, strides, True)
        np.stack(samples, out=out, casting="same_kind")
        stacked.append(out)
    return stacked


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _transpose(samples):
    lengths = {len(s) for s in samples}
    if len(lengths) != 1:
        raise ValueError(
            "torchshm.collate expected sequences of one length in a batch, got"
            f" lengths {sorted(lengths)}"
        )
    return zip(*samples)


def _check_same_keys(samples):
    keys = set(samples[0])
    for s in samples[1:]:
        if set(s) != keys:
            raise ValueError(
                "torchshm.collate expected mappings with the same keys in a"
                f" batch, got {sorted(map(str, keys))} and {sorted(map(str, s))}"
            )


def _rebuild_mapping(first, parts, stacked):
    values = {k: p(stacked) for k, p in parts.items()}
    try:
        return type(first)(values)
    except TypeError:  # a Mapping that cannot be built from a dict
        return values


def _is_xarray(obj):
    # Without importing xarray: torchshm does not depend on it.
    return type(obj).__module__.startswith("xarray.") and type(obj).__name__ in (
        "DataArray",
        "Dataset",
    )


def _plan_xarray(samples, jobs):
    import xarray as xr

    is_array = isinstance(samples[0], xr.DataArray)
    datasets = [_as_dataset(s) if is_array else s for s in samples]
    names = list(datasets[0].data_vars)
    parts = {
        name: _plan_stack([np.asarray(d[name].variable.values) for d in datasets], jobs)
        for name in names
    }
    # Coordinates are small: xarray's own concat gives them its usual meaning.
    # join="exact": the default outer join would pad every sample with NaN to
    # the union of their labels, and "override" would relabel them silently.
    try:
        coords = xr.concat(
            [d.drop_vars(names) for d in datasets],
            dim=BATCH_DIM,
            coords="different",
            compat="equals",
            join="exact",
            combine_attrs="override",
        )
    except ValueError as exc:
        raise ValueError(
            "torchshm.collate expected xarray samples with equal dimension"
            f" coordinates in a batch ({exc}); drop or rename the coordinates"
            " that differ (ds.drop_vars(name)), or use batch_size=None"
        ) from exc

    def build(stacked):
        first = datasets[0]
        result = coords.assign(
            {
                name: (
                    (BATCH_DIM,) + first[name].dims,
                    part(stacked),
                    first[name].attrs,
                )
                for name, part in parts.items()
            }
        )
        for name in names:
            result[name].encoding = dict(first[name].encoding)
        return _from_dataset(result, samples[0]) if is_array else result

    return build


# A DataArray travels as a one-variable Dataset under this name.
_DATA = "__torchshm_data__"


def _as_dataset(array):
    return array.to_dataset(name=_DATA, promote_attrs=True)


def _from_dataset(dataset, template):
    result = dataset[_DATA]
    result.name = template.name
    result.attrs = dict(template.attrs)
    return result
