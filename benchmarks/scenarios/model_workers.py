"""14. One large read-only model to a pool of spawn workers: wall time until
every worker has read it, and the copies of it the node holds.

The LensKit case ("one copy in memory, no matter how many workers"): the
parent holds a float64 model, 4 spawn workers each get it and sum it. Every
(method, round) runs in a fresh driver process (`python
benchmarks/scenarios/model_workers.py METHOD NBYTES WORKERS`: the file, so
that only the method's own modules are imported), so no pool, registration
or cached file carries over. The driver starts the method's pool and waits
until every worker is up (each has imported torch, whatever the method: see
_warm; untimed, reported as "pool start"), builds the model, then times from
handing the model over until every worker has summed it. Each worker then
holds it until the driver has read the PSS of every process: the model's
cost is the PSS they add above the same processes idle, in model sizes. The
parent's own model is one of them in every row: one shared copy beside it
makes 2.00.

Methods: a task argument through pickle, through torchshm (no `share()`), a
`ProcessPoolExecutor` initializer argument through torchshm (timed from
creating that pool, since the model goes with the workers' start; its pool
start is the same pool's without a model), `torchshm.share()` first (timed),
joblib's `Parallel` (auto-memmapping, where joblib is installed),
`multiprocessing.shared_memory` + pickle 5 by hand, a torch tensor after
`share_memory_()` (torch's default `file_descriptor` strategy) and Ray
(`ray.put` once, 4 tasks get it zero-copy from the node's object store; the
PSS of every process of the driver's tree counts, Ray's store included).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

NAME = "model_workers"
# Method names as benchmarks/transports.py labels them, plus two.
METHODS = (
    "pipe",
    "torchshm",
    "torchshm_initializer",
    "torchshm_shared",
    "joblib",
    "shm_pickle5",
    "torch",
    "ray",
)
DRIVER_TIMEOUT = 600
POLL = 0.002

# ------------------------------------------------------------ in the workers

_MODEL = None


def _warm(method, seconds):
    """Starts a worker as the method's pool would have it ready. Every
    method's workers import torch, as a worker of a torch pipeline has it:
    four workers' imports take 1.5 GB of fresh memory, and the memory a
    timed copy then finds is slower to fill (Ray's ray.put of the model
    right after its warm-up took 0.64-0.97 s with torch imported there,
    0.37-0.38 s without; torchshm's first send likewise), so a method whose
    workers import less would be timed on a quieter machine."""
    import torch  # noqa: F401

    if method.startswith("torchshm"):
        import torchshm  # noqa: F401
    time.sleep(seconds)
    return os.getpid()


def _init(method, model):
    global _MODEL
    _warm(method, 0)
    _MODEL = model


def _hold(model, folder):
    """Sums the model, says so, and holds it until the driver has measured."""
    total = sum(float(layer.sum()) for layer in _layers(model))
    open(os.path.join(folder, str(os.getpid())), "w").close()
    release = os.path.join(folder, "release")
    while not os.path.exists(release):
        time.sleep(POLL)
    return total


def _held(folder):
    return _hold(_MODEL, folder)


def _layers(model):
    """The model's arrays: one, or a list of layers."""
    if isinstance(model, list):
        return [_as_array(layer) for layer in model]
    return [_as_array(model)]


def _as_array(model):
    if isinstance(model, tuple):  # shared_memory + pickle 5
        global _SHM
        import pickle
        from multiprocessing import shared_memory

        name, payload = model
        try:  # the driver unlinks it, not this worker's tracker (3.13+)
            _SHM = shared_memory.SharedMemory(name=name, track=False)
        except TypeError:
            _SHM = shared_memory.SharedMemory(name=name)
        return pickle.loads(payload, buffers=[_SHM.buf])
    if type(model).__module__.startswith("torch"):
        return model.numpy()
    return model


# ------------------------------------------------------------ in the driver


def _pss(pid):
    """Proportional set size, as scenario 7 (memory) reads it."""
    import psutil

    return psutil.Process(pid).memory_full_info().pss


def _wait_markers(folder, n, deadline, waiter):
    while True:
        pids = [int(p) for p in os.listdir(folder) if p.isdigit()]
        if len(pids) >= n:
            return pids
        if not waiter.is_alive():  # a task failed: its error is in results
            raise RuntimeError(f"{len(pids)} of {n} workers summed the model")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pids)} of {n} workers summed the model")
        time.sleep(POLL)


def _executor(method, workers, initargs=None):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    if initargs is None:
        return ProcessPoolExecutor(workers, mp_context=ctx)
    return ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init, initargs=initargs
    )


def _tree():
    """The driver's descendants: Ray's workers, raylet (its object store)
    and daemons."""
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


def _start(method, workers):
    """A warm pool, its start time and its idle workers' PSS."""
    t0 = time.monotonic()
    if method == "ray":
        import ray

        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        warm = ray.remote(_warm)
        pids = ray.get([warm.remote(method, 0.5) for _ in range(workers)])
        started = time.monotonic() - t0 - 0.5
        assert len(set(pids)) == workers, "a Ray worker ran two warm-up tasks"
        return ray, started, sum(_pss(p) for p in _tree())
    if method == "joblib":
        from joblib import Parallel, delayed

        pool = Parallel(n_jobs=workers)
        pids = pool(delayed(_warm)(method, 0.5) for _ in range(workers))
    else:
        pool = _executor(method, workers)
        pids = list(pool.map(_warm, [method] * workers, [0.5] * workers))
    started = time.monotonic() - t0 - 0.5
    assert len(set(pids)) == workers, "a worker ran two warm-up tasks"
    return pool, started, sum(_pss(p) for p in set(pids))


def drive(method, nbytes, workers, layers=1):
    """One measurement: {wall, start, copies, bytes_copied} (run in a fresh
    process). With `layers` > 1 the model is a list of that many arrays."""
    import threading

    if method.startswith("torchshm"):
        import torchshm  # registers its reducers
    pool, started, idle_workers = _start(method, workers)
    if layers == 1:
        model = np.arange(nbytes // 8, dtype=np.float64)
    else:
        n = nbytes // layers // 8
        model = [np.arange(n, dtype=np.float64) + i for i in range(layers)]
    expected = sum(float(layer.sum()) for layer in _layers(model))
    before = _pss(os.getpid()) - nbytes + idle_workers
    folder = tempfile.mkdtemp(prefix="torchshm-bench-")
    results = []
    t0 = time.monotonic()
    if method == "torchshm_initializer":
        pool.shutdown()
        pool = _executor(method, workers, initargs=(method, model))
        futures = [pool.submit(_held, folder) for _ in range(workers)]
        done = lambda: results.extend(f.result() for f in futures)  # noqa: E731
    elif method == "joblib":
        from joblib import delayed

        def done():
            results.extend(pool(delayed(_hold)(model, folder) for _ in range(workers)))

    elif method == "ray":
        ref = pool.put(model)
        hold = pool.remote(_hold)
        futures = [hold.remote(ref, folder) for _ in range(workers)]
        done = lambda: results.extend(pool.get(futures))  # noqa: E731

    else:
        sent = model
        if method == "torchshm_shared":
            sent = torchshm.share(model)
        elif method == "torch":
            import torch

            sent = torch.from_numpy(model).share_memory_()
        elif method == "shm_pickle5":
            sent = _shm_pickle5(model)
        futures = [pool.submit(_hold, sent, folder) for _ in range(workers)]
        done = lambda: results.extend(f.result() for f in futures)  # noqa: E731
    waiter = threading.Thread(target=done, daemon=True)
    waiter.start()
    pids = _wait_markers(folder, workers, time.monotonic() + DRIVER_TIMEOUT, waiter)
    wall = time.monotonic() - t0
    measured = _tree() if method == "ray" else pids
    after = _pss(os.getpid()) + sum(_pss(p) for p in measured)
    open(os.path.join(folder, "release"), "w").close()
    waiter.join(DRIVER_TIMEOUT)
    assert results == [expected] * workers, (results, expected)
    shutil.rmtree(folder)  # every worker returned: none looks at it any more
    if method == "torchshm_initializer":
        started = _start_only(method, workers)
    for shm in _SHM_KEEP:
        shm.close()
        shm.unlink()
    copied = torchshm.stats()["bytes_copied"] if method.startswith("torchshm") else 0
    return {
        "wall": wall,
        "start": started,
        "copies": (after - before) / nbytes,
        "bytes_copied": copied / nbytes,
    }


def _start_only(method, workers):
    """How long the initializer's pool takes to start without a model."""
    t0 = time.monotonic()
    pool = _executor(method, workers, initargs=(method, None))
    list(pool.map(_warm, [method] * workers, [0.5] * workers))
    pool.shutdown()
    return time.monotonic() - t0 - 0.5


_SHM_KEEP = []


def _shm_pickle5(model):
    """The hand-written recipe: pickle 5 out-of-band buffers copied into one
    SharedMemory, its name and the pickle sent."""
    import pickle
    from multiprocessing import shared_memory

    buffers = []
    payload = pickle.dumps(model, protocol=5, buffer_callback=buffers.append)
    (buffer,) = buffers
    raw = buffer.raw()
    shm = shared_memory.SharedMemory(create=True, size=raw.nbytes)
    shm.buf[: raw.nbytes] = raw
    _SHM_KEEP.append(shm)  # unlinked by drive() once measured
    return shm.name, payload


def available(method):
    """Whether the method runs: the peers only when benchmarks/peers.py
    says so (installed and not turned off)."""
    from benchmarks import peers

    if method not in peers.PACKAGES:
        return True
    return peers.enabled()


def measure(method, nbytes, workers, layers=1):
    """Runs drive() in a fresh interpreter and returns its JSON."""
    # The file, not the module: importing the benchmarks package would import
    # torchshm (other scenarios do), and its reducers would then carry the
    # "pipe" and joblib rows too. A torchshm session of its own, as a
    # program the user starts has (and Ray's driver a cluster of its own),
    # not the runner's.
    env = dict(os.environ)
    env.pop("TORCHSHM_SESSION", None)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), method, str(nbytes)]
        + [str(workers), str(layers)],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT,
        check=False,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{method} driver failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick, bar):
    from benchmarks import peers
    from benchmarks.report import Result
    from benchmarks.transports import round_order

    nbytes, workers, rounds = ((64 << 20), 2, 1) if quick else ((1 << 30), 4, 5)
    # A model of many small layers beside the one large array: 64 of 4 MiB
    # (quick: 16 of 1 MiB); the methods that share it without a peer.
    layers, layer_bytes = (16, 1 << 20) if quick else (64, 4 << 20)
    methods = [m for m in METHODS if available(m)]
    layered_methods = ["pipe", "torchshm", "torchshm_shared"]
    title = (
        f"14. A {nbytes >> 20} MiB float64 model to {workers} spawn workers,"
        " each sums it: wall until every sum"
    )
    result = Result(NAME, title, notes=[__doc__.split("\n\n")[1].replace("\n", " ")])
    result.notes.append(
        f"{layers} x {layer_bytes >> 20} MiB: the model is a list of {layers}"
        " arrays. bytes copied: what the driver's torchshm copied, in model"
        " sizes (the first task's snapshot is one)."
    )
    bar.reset(total=(len(methods) + len(layered_methods)) * rounds)
    cases = [
        (f"{nbytes >> 20} MiB to {workers}", nbytes, 1, methods),
        (
            f"{layers} x {layer_bytes >> 20} MiB to {workers}",
            layers * layer_bytes,
            layers,
            layered_methods,
        ),
    ]
    samples = {(case, m): [] for case, _, _, ms in cases for m in ms}
    # One run per method per round, the methods in turn, in an order that
    # changes each round (round_order): a run leaves the memory it freed
    # (pipe + pickle's six copies, 6 GiB; Ray's store) to the next one, whose
    # first copy into fresh pages costs what this VM's memory then costs.
    # With torchshm always after the pipe (a fixed order) it read 1.13-1.57 s
    # in four rounds of five (median 1.36 s, joblib 0.73 s; --only
    # model_workers, 2026-12-07).
    for round_ in range(rounds):
        for case, size, parts, case_methods in cases:
            for method in round_order(case_methods, round_):
                if (case, method) not in result.failures:
                    run = peers.attempt(
                        result,
                        case,
                        method,
                        lambda: measure(method, size, workers, parts),
                    )
                    if run is not None:
                        samples[case, method].append(run)
                bar.update()
    result.summary["copies"] = {}
    for case, _, _, case_methods in cases:
        for method in case_methods:
            runs = samples[case, method]
            if not runs:
                continue
            result.add(case, method, [r["wall"] for r in runs], warmup=0)
            copies = statistics.median(r["copies"] for r in runs)
            start = statistics.median(r["start"] for r in runs)
            result.extra(case, f"{method}: copies", round(copies, 2))
            result.extra(case, f"{method}: pool start s", round(start, 2))
            if method.startswith("torchshm"):
                copied = statistics.median(r["bytes_copied"] for r in runs)
                result.extra(case, f"{method}: bytes copied", round(copied, 2))
            result.summary["copies"][f"{case}: {method}"] = copies
    result.summary["samples"] = {f"{c}: {m}": v for (c, m), v in samples.items()}
    peers.against_best(result)
    peers.note_versions(result, methods)
    return result


if __name__ == "__main__":
    assert "torchshm" not in sys.modules
    print(json.dumps(drive(*sys.argv[1:2], *map(int, sys.argv[2:5]))))
