"""The ways to move an object to another process, each implemented once.

Every method sends through the same multiprocessing Pipe (or DataLoader
queue); they differ only in how the *sending* process pickles:

- ``pipe``: plain pickling, torchshm unregistered in the sender.
- ``shm_pickle5``: pickle protocol 5 with out-of-band buffers copied into one
  ``multiprocessing.shared_memory.SharedMemory`` per message.
- ``torch``: arrays travel as ``torch.from_numpy`` tensors under torch's own
  reducers (default ``file_descriptor`` strategy, so the sender stays alive).
- ``torch_torchshm``: the same tensors with torchshm's tensor switch on
  (``register(tensors=True)``): their storages move into torchshm's memory.
- ``torchshm``: torchshm registered; every send snapshots into a new segment.
- ``torchshm_shared``: ``torchshm.share`` once (untimed), then O(1) sends.
- ``torchshm_always``: torchshm with threshold 0, to find the crossover.
- ``pipe_again``: ``pipe`` from a second sender process, the A/A control.
- Peers (benchmarks/peers.py): ``torch_fs`` (the tensors under torch's
  ``file_system`` strategy) and ``tensordict`` (a ``TensorDict`` after
  ``share_memory_()``) go through the same Pipe; ``ray`` and ``joblib`` have
  senders of their own with the same interface.

A method has three hooks: `setup_sender` (once per sending process),
`prepare` (per payload, in the sender, untimed) and `finish` (per payload, in
the receiver, timed), plus `release_received` after the receiver dropped it.
"""

import collections
import contextlib
import multiprocessing as mp
import os
import pickle
import random
import time
import warnings
from multiprocessing import shared_memory
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reducers
import torch.utils.data

import torchshm

METHODS = (
    "pipe",
    "shm_pickle5",
    "torch",
    "torch_torchshm",
    "torchshm",
    "torchshm_shared",
)
# The methods that send the arrays as torch tensors.
TENSOR_METHODS = ("torch", "torch_torchshm", "torch_fs", "tensordict")
LABELS = {
    "pipe": "pipe + pickle",
    "shm_pickle5": "shared_memory + pickle5",
    "torch": "torch tensor",
    "torch_torchshm": "tensor through torchshm",
    "torchshm": "torchshm",
    "torchshm_shared": "torchshm pre-shared",
    "torchshm_always": "torchshm, threshold 0",
    "pipe_again": "pipe + pickle, 2nd sender (A/A)",
    "torchshm_collate": "torchshm.collate",
    "torchshm_born": "torchshm, allocator on",
    "torchshm_initializer": "torchshm, initializer argument",
    "joblib": "joblib Parallel",
    "ray": "Ray",
    "grain": "Grain DataLoader",
    "tensordict": "tensordict share_memory_",
    "torch_fs": "torch tensor, file_system",
}
PAGE = 4096
# torchshm's fallbacks (pickled by value instead) in Sender children, by
# reason: a benchmark of torchshm that silently pickled would be a lie.
FALLBACKS = collections.Counter()
TIMEOUT = 600  # seconds: one 512 MiB pickle takes ~2 s, so this only catches hangs


# -- sender side ------------------------------------------------------------


def setup_sender(method):
    """Puts this (sending) process's ForkingPickler in the method's state."""
    if method.startswith("torchshm"):
        torchshm.register()
        if method == "torchshm_always":
            torchshm.set_threshold(0)
        if method == "torchshm_born":
            # Arrays this process makes are born in shared memory.
            torchshm.set_allocator(True)
    elif method == "torch_torchshm":
        torchshm.register(tensors=True)
    else:
        # The baselines must not be helped by torchshm's reducers.
        torchshm.unregister()
    if method == "torch_fs":
        torch.multiprocessing.set_sharing_strategy("file_system")
    if method in TENSOR_METHODS:
        # Arrays nested in other objects (DataFrame blocks, xarray variables)
        # become tensors too; top-level ones are converted in `prepare`.
        for t in (np.ndarray, np.memmap, np.recarray):
            ForkingPickler.register(t, _reduce_as_tensor)


def prepare(method, obj):
    """The payload as this method sends it (runs in the sender, untimed)."""
    if method == "torchshm_shared":
        return torchshm.share(obj)
    if method == "shm_pickle5":
        return OutOfBand(obj)
    if method == "tensordict":
        return SharedTensorDict(obj)
    if method in TENSOR_METHODS:
        return _map_arrays(obj, _as_tensor)
    return obj


class SharedTensorDict:
    """The payload as a TensorDict of its tensors, put in shared memory by
    ``share_memory_()`` when it is pickled (so the copy is timed, as torch's
    own sharing in its reducer is): an array is key "x", a list of arrays
    keys "0".."n-1"."""

    def __init__(self, obj):
        if isinstance(obj, np.ndarray):
            self.fields = {"x": obj}
        elif isinstance(obj, list) and all(isinstance(a, np.ndarray) for a in obj):
            self.fields = {str(i): a for i, a in enumerate(obj)}
        else:
            raise TypeError(f"no TensorDict for a {type(obj).__name__} payload")

    def __reduce__(self):
        from tensordict import TensorDict

        tensors = {k: torch.from_numpy(a) for k, a in self.fields.items()}
        return _identity, (TensorDict(tensors, batch_size=[]).share_memory_(),)


def _identity(obj):
    return obj


def _from_tensordict(td):
    if "x" in td.keys():
        return td["x"].numpy()
    return [td[str(i)].numpy() for i in range(len(td.keys()))]


def _as_tensor(array):
    """torch.from_numpy(array), or the array where torch refuses it
    (object/datetime/string dtypes, negative strides, byte-swapped)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only arrays warn
            return torch.from_numpy(array)
    except (TypeError, ValueError, RuntimeError):
        return array


def _reduce_as_tensor(array):
    tensor = _as_tensor(array) if type(array) is np.ndarray else array
    if tensor is array:
        return array.__reduce__()
    return _tensor_to_numpy, (tensor,)


def _tensor_to_numpy(tensor):
    return tensor.numpy()


def _map_arrays(obj, fn):
    """fn applied to the ndarrays/tensors of a (nested) list, tuple or dict."""
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_arrays(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_arrays(v, fn) for k, v in obj.items()}
    return obj


class OutOfBand:
    """Pickles `obj` with protocol 5 and its buffers in one SharedMemory.

    What a careful user writes with the standard library alone: the pickle
    stream carries only metadata and the segment's name; the receiver maps
    the segment and unpickles with `buffers=` (zero-copy on that side).
    """

    def __init__(self, obj):
        self.obj = obj

    def __reduce__(self):
        buffers = []
        data = pickle.dumps(self.obj, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        sizes = [v.nbytes for v in views]
        shm = shared_memory.SharedMemory(create=True, size=max(1, sum(sizes)))
        offset = 0
        for view, size in zip(views, sizes):
            shm.buf[offset : offset + size] = view
            offset += size
        del view
        shm.close()
        return _load_out_of_band, (data, shm.name, sizes)


# SharedMemory objects whose buffers the receiver still uses; closing one while
# an array views it raises BufferError, so they are closed after the payload.
_attached = []


def _load_out_of_band(data, name, sizes):
    shm = shared_memory.SharedMemory(name=name)
    shm.unlink()  # the mapping stays valid; nothing is left if we die
    _attached.append(shm)
    buffers, offset = [], 0
    for size in sizes:
        buffers.append(shm.buf[offset : offset + size])
        offset += size
    return pickle.loads(data, buffers=buffers)


# -- receiver side ----------------------------------------------------------


def finish(method, obj):
    """The received payload as the application uses it: NumPy arrays."""
    if method == "tensordict":
        return _from_tensordict(obj)
    if method in TENSOR_METHODS:
        return _map_arrays(obj, lambda t: t.numpy() if torch.is_tensor(t) else t)
    return obj


def release_received():
    """Unmaps what `finish`ed payloads left mapped (call after dropping them)."""
    still = []
    for shm in _attached:
        try:
            shm.close()
        except BufferError:
            still.append(shm)
    _attached[:] = still


def touch(obj):
    """Reads one byte per page of every array in `obj`, as a consumer would:
    a zero-copy receiver pays its page faults here, not in the transport."""
    for array in _arrays_in(obj):
        if array.dtype.hasobject or array.size == 0:
            continue
        if array.flags.c_contiguous or array.flags.f_contiguous:
            flat = array.ravel(order="K").view(np.uint8)
            int(flat[::PAGE].sum())
        else:
            array.sum()


def _is_arrow_backed(values):
    """Whether `values` is a pandas array over pyarrow memory (other pandas
    arrays have __arrow_array__ too, which converts them)."""
    dtype = getattr(values, "dtype", None)
    return type(dtype).__name__ == "ArrowDtype" or str(
        getattr(dtype, "storage", "")
    ).startswith("pyarrow")


def _arrays_in(obj):
    if isinstance(obj, np.ndarray):
        yield obj
    elif torch.is_tensor(obj):
        yield obj.numpy()
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _arrays_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _arrays_in(x)
    elif _is_arrow_backed(obj):  # pandas 3's str, pd.ArrowDtype: Arrow buffers
        for chunk in obj.__arrow_array__().chunks:
            for buffer in chunk.buffers():
                if buffer is not None:
                    yield np.frombuffer(buffer, np.uint8)
    elif hasattr(obj, "variables"):  # xarray Dataset / DataArray
        for var in obj.variables.values():
            yield from _arrays_in(var.values)
    elif hasattr(obj, "columns") and hasattr(obj, "iloc"):  # pandas DataFrame
        for _, column in obj.items():
            values = column.values
            yield from _arrays_in(getattr(values, "codes", values))


# -- a persistent sender ----------------------------------------------------


class Sender:
    """A child process that builds payloads and sends them back one at a time.

    The child starts once per method and is reused for every size, so process
    start-up and the transport's set-up (imports, torch's fd listener) are not
    measured. Each send is a ping-pong: the child builds the payload, takes
    `t0` on the shared monotonic clock, sends; the parent receives, rebuilds,
    touches every page, takes `t1`, acks; only then is the next payload built,
    so consecutive items never compete for the two cores.
    """

    def __init__(self, method, context=None):
        ctx = mp.get_context(context or SENDER_CONTEXT)
        self.method = method
        self.cpus = None  # where its threads are pinned (None: anywhere)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, method), name=f"sender-{method}", daemon=True
        )
        self.process.start()
        child.close()
        if method == "tensordict":  # its import is set-up, not the first send
            import tensordict  # noqa: F401
        self._recv()  # ready: imports done, transport set up

    def measure(self, make, args=(), count=1, holding=None):
        """Seconds per send of `make(*args)`, one per send, first send first.
        `holding(obj)`, if given, runs on each received payload after its
        clock stopped (e.g. to read the receiver's memory while it holds it)."""
        if self.cpus != _pinning.senders:
            self.conn.send(("pin", _pinning.senders))
            self._recv()
            self.cpus = _pinning.senders
        self.conn.send((make, args, count))
        seconds = []
        for _ in range(count):
            t0, obj = self._recv()
            touch(finish(self.method, obj))
            seconds.append(time.perf_counter() - t0)
            if holding is not None:
                holding(obj)
            del obj
            release_received()
            self.conn.send(True)
        FALLBACKS.update(self._recv()[1])
        return seconds

    def _recv(self):
        if not self.conn.poll(TIMEOUT):
            raise TimeoutError(f"{self.method} sender sent nothing in {TIMEOUT} s")
        try:
            message = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(
                f"the {self.method} sender died (exit code {self.process.exitcode})"
            ) from None
        if isinstance(message, BaseException):
            raise RuntimeError(f"{self.method} sender failed") from message
        return message

    def close(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(30)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(conn, method):
    setup_sender(method)
    conn.send(True)
    for command in iter(conn.recv, None):
        try:
            if command[0] == "pin":
                _pin_threads(command[1])
                conn.send(True)
                continue
            make, args, count = command
            payload = None
            for _ in range(count):
                # A fresh payload per send (as DataLoader epochs produce), except
                # pre-shared: shared once, then sent again and again.
                if payload is None or method != "torchshm_shared":
                    payload = None  # free the previous one before building
                    payload = prepare(method, make(*args))
                conn.send((time.perf_counter(), payload))
                conn.recv()
            del payload
            conn.send(("done", torchshm.stats()["fallbacks"]))
            torchshm.reset_stats()
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send(exc)


# -- round-robin ------------------------------------------------------------


def round_order(methods, round_):
    """The order of `methods` in round `round_` of a round-robin: shuffled,
    the same for the same round in every run. Turning one order (round r
    starting at its r-th method) keeps each method behind the same one in
    every round but one, so what a method leaves behind (the memory the pipe's
    six copies of a model freed, a 1000-tensor message's storages) fell on
    the same next method every time: in scenario 14 torchshm ran right after
    the pipe in four rounds of five."""
    order = list(methods)
    random.Random(round_).shuffle(order)
    return order


# -- pinned ping-pong ---------------------------------------------------------

# Note [Pinned ping-pong]
# A message of a few KiB makes its round trip in 40-80 us on 2 cores, and
# where the scheduler put the sender decided it: a sender on the receiver's
# CPU takes 38-42 us, one on the other 68-82 us (each pinned so, 1 KiB),
# and a process keeps its place for its life, so more rounds do not average
# it out. In one run pipe + pickle read 39.6 us, its A/A twin 37.6 and
# torchshm 70.0, three processes sending the same bytes the same way (1 KiB;
# 10 rounds of 20 sends, the methods in turn); pinned (the receiver's thread
# on one CPU, each sender's threads on another), the same run read 68.3,
# 68.8 and 69.6 us. A pinned sender is told it has one CPU: torch's
# intra-op pool otherwise splits a 128 KiB copy over two threads there, and
# its sends took 7.2 ms instead of 0.6-0.7 (told, 0.69). Senders follow the
# pinning at their next measure (Sender.measure); Ray's and joblib's
# workers are theirs, not pinned.


class _Pinning:
    receiver = None  # the CPU set of this process's receiving thread
    senders = None  # the CPU set of every Sender's threads


_pinning = _Pinning()
_unpinned = None  # in a sender: (CPU set, torch threads) before pinning


@contextlib.contextmanager
def pinned():
    """Within: this thread on one CPU and every Sender's threads on another
    (Note [Pinned ping-pong]); nothing on a machine with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or _pinning.senders is not None:
        yield
        return
    before = os.sched_getaffinity(0)
    _pinning.receiver, _pinning.senders = {cpus[0]}, {cpus[1]}
    os.sched_setaffinity(0, _pinning.receiver)
    try:
        yield
    finally:
        _pinning.receiver = _pinning.senders = None
        os.sched_setaffinity(0, before)


def _pin_threads(cpus):
    """In a sender: every thread of this process on `cpus`, and torch told
    how many it has; None puts them back as they were."""
    global _unpinned
    if cpus is None:
        if _unpinned is None:
            return
        cpus, threads = _unpinned
        _unpinned = None
    else:
        if _unpinned is None:
            _unpinned = (os.sched_getaffinity(0), torch.get_num_threads())
        threads = len(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
    torch.set_num_threads(threads)


# Senders fork from a forkserver that imported torch once. Their start is
# not measured, but a spawned sender pays torch's import again: 5-6 senders
# per run took 9-11 s against 5-6 s (`python -m benchmarks --quick` start).
# Nothing of torchshm is preloaded: each sender imports and sets it up itself.
SENDER_CONTEXT = "forkserver"
SENDER_PRELOAD = ["numpy", "torch", "torch.utils.data"]

_senders = {}


def sender(method):
    """The persistent Sender for `method`, started on first use and shared by
    all scenarios of a run."""
    from benchmarks import peers  # peers imports this module

    if method in peers.SENDERS:
        if method not in _senders:
            _senders[method] = peers.SENDERS[method]()
        return _senders[method]
    # Takes effect only if this process has not started its forkserver.
    mp.set_forkserver_preload(SENDER_PRELOAD)
    if method not in _senders or not _senders[method].process.is_alive():
        _senders[method] = Sender(method)
    return _senders[method]


def close_sender(method):
    """Ends `method`'s sender (the next use starts another) and hands back
    the memory this process kept mapped from it, so that the next method's
    first send finds the machine as this one found it. Ray shuts down too:
    its object store keeps the pages a killed actor filled, and a new
    actor's first send over them took 111-188 ms against 238 ms fresh."""
    from benchmarks import peers  # peers imports this module

    if method in _senders:
        _senders.pop(method).close()
    if method == "ray":
        peers.close()
    torchshm.trim()


def close_senders(peers_only=False):
    """Closes the senders (only the peers' between scenarios: Ray's daemons
    would otherwise use CPU under scenarios that do not measure it)."""
    from benchmarks import peers

    for method in list(_senders):
        if not peers_only or method in peers.SENDERS:
            _senders.pop(method).close()
    peers.close()


# -- through a DataLoader worker --------------------------------------------


class TimedDataset(torch.utils.data.Dataset):
    """Items `(t0, payload)`: `make(*args)` prepared for `method`, stamped
    when the worker hands it to the DataLoader (before it is pickled)."""

    def __init__(self, method, make, args, length):
        self.method, self.make, self.args, self.length = method, make, args, length
        self._shared = None

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if self.method == "torchshm_shared":
            if self._shared is None:
                self._shared = prepare(self.method, self.make(*self.args))
            payload = self._shared
        else:
            payload = prepare(self.method, self.make(*self.args))
        return time.perf_counter(), payload


class WorkerSetup:
    """A picklable DataLoader worker_init_fn that calls setup_sender(method)."""

    def __init__(self, method):
        self.method = method

    def __call__(self, worker_id):
        setup_sender(self.method)


def identity(item):
    return item


def measure_dataloader(method, make, args=(), count=1, context="fork"):
    """Seconds per item of `make(*args)` through one DataLoader worker."""
    loader = torch.utils.data.DataLoader(
        TimedDataset(method, make, args, count),
        batch_size=None,
        num_workers=1,
        collate_fn=identity,
        worker_init_fn=WorkerSetup(method),
        multiprocessing_context=context,
        # One item in flight: the worker builds item i+1 while the main
        # process touches item i, but never sends two at once.
        prefetch_factor=1,
        timeout=TIMEOUT,
    )
    seconds = []
    for t0, obj in loader:
        touch(finish(method, obj))
        seconds.append(time.perf_counter() - t0)
        del obj
        release_received()
    return seconds
