"""The peers: other ways to move arrays between processes, each used as its
own documentation recommends, measured beside torchshm in the same run.

- ``ray``: a Ray actor builds the payload and returns it; Ray stores it in
  the node's object store (plasma, in /dev/shm) and ``ray.get`` maps its
  arrays read-only (pickle 5 out-of-band buffers; small objects inline).
- ``joblib``: ``Parallel(n_jobs=2)`` runs the builder in a loky worker; the
  result comes back pickled (joblib memmaps arguments, not results).
- ``grain``: Grain's ``DataLoader``: a batch goes through one
  ``SharedMemoryArray`` per array (/dev/shm), other elements are pickled.
- ``tensordict``: a ``TensorDict`` of the arrays' tensors after
  ``share_memory_()``, sent through the same Pipe (transports.py).
- ``torch_fs``: torch tensors under the ``file_system`` sharing strategy
  (transports.py).

`TORCHSHM_BENCH_PEERS=0` (``make bench PEERS=0``) turns them off; a peer
that cannot be imported or started shows its error in the table, never a
silently missing column.
"""

import functools
import importlib
import importlib.metadata
import os
import time

from benchmarks.transports import LABELS, TIMEOUT, touch

SETTING = "TORCHSHM_BENCH_PEERS"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# method -> the package it needs (torch_fs needs only torch).
PACKAGES = {
    "ray": "ray",
    "joblib": "joblib",
    "grain": "grain",
    "tensordict": "tensordict",
    "torch_fs": None,
}
# The peers that send any picklable object child -> parent (scenarios 1-5).
SEND_METHODS = ("ray", "joblib", "torch_fs")


def enabled():
    return os.environ.get(SETTING, "1") != "0"


def methods(candidates=SEND_METHODS):
    """The peer methods of `candidates` this run measures (none when off)."""
    return tuple(candidates) if enabled() else ()


@functools.lru_cache(maxsize=None)
def problem(method):
    """Why `method` cannot run here (its import error), or None."""
    package = PACKAGES.get(method)
    if package is None:
        return None
    try:
        importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - any import failure is the row's text
        return f"{package} cannot be imported: {type(exc).__name__}: {exc}"
    return None


def versions():
    """{package: version or why not} for every peer package."""
    found = {}
    for package in sorted({p for p in PACKAGES.values() if p}):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def attempt(result, cases, method, measure):
    """measure()'s samples, or None with the method's error in the table
    (every case of `cases`) where it cannot be imported or its run fails."""
    why = problem(method)
    if why is None:
        try:
            return measure()
        except Exception as exc:  # noqa: BLE001 - the table shows it
            why = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    for case in [cases] if isinstance(cases, str) else cases:
        result.fail(case, method, why)
    return None


def note_versions(result, used):
    """A note naming the versions and settings of the peers in `used`."""
    shown = [m for m in used if m in PACKAGES and enabled()]
    if not shown:
        return
    have = versions()
    parts = []
    for method in shown:
        package = PACKAGES[method]
        version = have.get(package, "") if package else "torch's own"
        parts.append(f"{method} {version} ({SETTINGS[method]})")
    result.notes.append("Peers: " + "; ".join(parts) + ".")


SETTINGS = {
    "ray": "a local ray.init(), default object store; an actor returns each"
    " payload, ray.get in the receiver (scenario 14: ray.put once, 4 tasks)",
    "joblib": "Parallel(n_jobs=2), loky backend, default max_nbytes=1M",
    "grain": "grain.DataLoader, IndexSampler, Batch; worker_buffer_size 1 per"
    " item, 2 per epoch",
    "tensordict": "TensorDict(...).share_memory_(), sent through the Pipe",
    "torch_fs": "torch.multiprocessing.set_sharing_strategy('file_system')",
}


# -- Ray ---------------------------------------------------------------------


def start_ray():
    """This process's local Ray instance (started once per scenario)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            # Ray's workers import the payload builders from this tree.
            runtime_env={"env_vars": {"PYTHONPATH": ROOT}},
        )
    return ray


class Producer:
    """The Ray actor: the persistent sender, as transports.Sender's child."""

    def send(self, make, args):
        obj = make(*args)
        return time.perf_counter(), obj

    def pid(self):
        return os.getpid()


class PeerSender:
    """transports.Sender's `measure` over a peer's own round trip: `fetch`
    returns (when the payload was ready, the payload) in this process."""

    def measure(self, make, args=(), count=1, holding=None):
        seconds = []
        for _ in range(count):
            t0, obj = self.fetch(make, args)
            touch(obj)
            seconds.append(time.perf_counter() - t0)
            if holding is not None:
                holding(obj)
            del obj
        return seconds


class RaySender(PeerSender):
    """A Ray actor as the persistent sender."""

    def __init__(self):
        ray = start_ray()
        self.actor = ray.remote(num_cpus=0)(Producer).remote()
        ray.get(self.actor.pid.remote(), timeout=TIMEOUT)

    def fetch(self, make, args):
        import ray

        return ray.get(self.actor.send.remote(make, args), timeout=TIMEOUT)

    def close(self):
        import ray

        if ray.is_initialized():
            ray.kill(self.actor)


# -- joblib ------------------------------------------------------------------


def stamped(make, args):
    """In a joblib worker: the payload, and when it was ready."""
    obj = make(*args)
    return time.perf_counter(), obj


class JoblibSender(PeerSender):
    """joblib's Parallel as the sender (loky workers, reused between calls
    as joblib does by default)."""

    def __init__(self):
        from joblib import Parallel, delayed

        self.parallel, self.delayed = Parallel(n_jobs=2), delayed
        self.parallel([delayed(os.getpid)() for _ in range(2)])  # workers up

    def fetch(self, make, args):
        ((t0, obj),) = self.parallel([self.delayed(stamped)(make, args)])
        return t0, obj

    def close(self):
        pass  # loky's reusable workers exit on their own when idle


SENDERS = {"ray": RaySender, "joblib": JoblibSender}


def close():
    """Shuts Ray down between scenarios: its daemons would otherwise use
    CPU under the scenarios that do not measure it."""
    if problem("ray") is None:
        import ray

        if ray.is_initialized():
            ray.shutdown()


# -- Grain -------------------------------------------------------------------


class TimedSource:
    """A Grain data source of `length` items `(t0, make(*args))`."""

    def __init__(self, make, args, length):
        self.make, self.args, self.length = make, args, length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        obj = self.make(*self.args)
        return time.perf_counter(), obj


def grain_loader(source, batch=None, workers=1, epochs=1, buffer=1):
    import grain

    sampler = grain.samplers.IndexSampler(
        len(source),
        shard_options=grain.sharding.NoSharding(),
        shuffle=False,
        num_epochs=epochs,
    )
    operations = [grain.transforms.Batch(batch)] if batch else []
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=operations,
        worker_count=workers,
        worker_buffer_size=buffer,
    )


def grain_items(make, args=(), count=1, rebuild=None):
    """Seconds per item of `make(*args)` through one Grain worker, from the
    worker's source returning it to the main process having read it
    (after `rebuild(obj)`, if given)."""
    seconds = []
    for t0, obj in grain_loader(TimedSource(make, args, count)):
        touch(rebuild(obj) if rebuild else obj)
        seconds.append(time.perf_counter() - t0)
        del obj
    return seconds


def grain_epochs(dataset, batch, workers, epochs):
    """Seconds per epoch of Grain's loader over `dataset` (epochs + 1 in one
    iterator, so its workers start once, as torch's persistent workers)."""
    per_epoch = len(dataset) // batch
    seconds, start = [], time.perf_counter()
    loader = grain_loader(dataset, batch, workers, epochs + 1, buffer=2)
    for i, batch_ in enumerate(loader, 1):
        touch(batch_)
        del batch_
        if i % per_epoch == 0:
            now = time.perf_counter()
            seconds.append(now - start)
            start = now
    return seconds


# -- torchshm against the best peer ------------------------------------------

# Every method that is not torchshm: plain pickling, the hand-written
# shared_memory recipe, torch's own tensors and the peers above.
RIVALS = (
    "pipe",
    "shm_pickle5",
    "torch",
    "torch_fs",
    "tensordict",
    "ray",
    "joblib",
    "grain",
)


def against_best(result, ours="torchshm"):
    """Per case: the fastest rival and `ours`' median over it (< 1: ahead)."""
    for case in result.cases():
        mine = result.get(case, ours)
        rivals = [
            (row["median"], method)
            for method in RIVALS
            if (row := result.get(case, method)) is not None
        ]
        if mine is None or not rivals:
            continue
        best, method = min(rivals)
        result.extra(case, "best peer", LABELS.get(method, method))
        result.extra(
            case, f"{LABELS.get(ours, ours)} / best peer", mine["median"] / best
        )
