"""15. Lifetimes: the producer SIGKILLed right after it sent a 64 MiB array.

For each method a fresh driver process (this file, as scenario 14: only the
method's own modules imported) is the receiver. The producer sends, is
SIGKILLed at once, and only then does the receiver take the message (for a
Pipe: after the producer is gone; Ray: the actor killed once its result is
in the store; Grain: its worker killed once the batch arrived; joblib: the
parent that dispatched to a loky worker killed, the worker receiving). 5 s
later the receiver reads the array and checks it; then it drops it, and the
driver exits. What each left behind is counted twice: 5 s after the
kill with the receiver holding (new names in /dev/shm and /tmp, and the
growth of the machine's Shmem), and 2 s after the driver exited (what
nobody will ever free, and the processes of the driver's session still
running then). Then those processes are killed and those names removed,
so that the benchmark itself leaves nothing behind.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

NAME = "lifetime"
METHODS = (
    "torchshm",
    "torch",
    "torch_fs",
    "shm_pickle5",
    "tensordict_memmap",
    "ray",
    "grain",
    "joblib",
)
PEERS = {"tensordict_memmap": "tensordict", "ray": "ray", "grain": "grain"}
PEERS["joblib"] = "joblib"
NBYTES = 64 << 20
VALUE = 7
WAIT = 5.0
DRIVER_TIMEOUT = 300


def make():
    return np.full(NBYTES // 8, VALUE, dtype=np.float64)


# ------------------------------------------------------- in the producer


def produce(method, conn, folder):
    """Sends one array over `conn` as `method` sends it, then dies."""
    array = make()
    if method == "torchshm":
        import torchshm  # noqa: F401 - registers its reducers

        payload = array
    elif method in ("torch", "torch_fs"):
        import torch
        import torch.multiprocessing

        if method == "torch_fs":
            torch.multiprocessing.set_sharing_strategy("file_system")
        payload = torch.from_numpy(array)
    elif method == "shm_pickle5":
        payload = _out_of_band(array)
    elif method == "tensordict_memmap":
        import torch
        from tensordict import TensorDict

        fields = {"x": torch.from_numpy(array)}
        payload = TensorDict(fields, batch_size=[]).memmap_(prefix=folder)
    conn.send(payload)
    os.kill(os.getpid(), signal.SIGKILL)


def _out_of_band(array):
    """The hand-written recipe (as transports.OutOfBand): pickle 5 with the
    buffer copied into a SharedMemory; the receiver attaches and unlinks."""
    import pickle
    from multiprocessing import shared_memory

    buffers = []
    data = pickle.dumps(array, protocol=5, buffer_callback=buffers.append)
    raw = buffers[0].raw()
    shm = shared_memory.SharedMemory(create=True, size=raw.nbytes)
    shm.buf[: raw.nbytes] = raw
    return ("shm_pickle5", shm.name, data)


_ATTACHED = []


def _attach(name, data):
    import pickle
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    shm.unlink()
    _ATTACHED.append(shm)
    return pickle.loads(data, buffers=[shm.buf])


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -------------------------------------------------------- in the driver


def _names(directory):
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def _shmem():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def snapshot():
    return {"shm": _names("/dev/shm"), "tmp": _names("/tmp"), "shmem": _shmem()}


def left(before):
    """What appeared since `before`: names in /dev/shm and /tmp, Shmem MiB."""
    now = snapshot()
    return {
        "shm": sorted(now["shm"] - before["shm"]),
        "tmp": sorted(now["tmp"] - before["tmp"]),
        "shmem_mib": round((now["shmem"] - before["shmem"]) / (1 << 20)),
    }


def _check(array):
    array = np.asarray(array)
    ok = array.shape == (NBYTES // 8,) and bool((array == VALUE).all())
    return "yes" if ok else "wrong data"


def through_pipe(method, folder):
    import multiprocessing as mp

    if method == "torchshm":
        import torchshm  # noqa: F401
    elif method in ("torch", "torch_fs", "tensordict_memmap"):
        import torch.multiprocessing  # noqa: F401 - torch's reducers
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe()
    producer = ctx.Process(target=produce, args=(method, sender, folder))
    producer.start()
    sender.close()
    producer.join(DRIVER_TIMEOUT)
    assert producer.exitcode == -signal.SIGKILL, producer.exitcode
    killed = time.monotonic()
    try:
        data = receiver.recv()
    except Exception as exc:  # noqa: BLE001 - what the receiver gets
        return killed, None, f"no: {type(exc).__name__}: {exc}"[:160]
    if method == "shm_pickle5":
        try:
            data = _attach(*data[1:])
        except Exception as exc:  # noqa: BLE001 - what the receiver gets
            return killed, None, f"no: {type(exc).__name__}: {exc}"[:160]
    if method == "tensordict_memmap":
        data = data["x"]
    if hasattr(data, "numpy"):
        data = data.numpy()
    return killed, data, None


def through_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Producer:
        def pid(self):
            return os.getpid()

        def send(self):
            return make()

    actor = Producer.remote()
    pid = ray.get(actor.pid.remote())
    ref = actor.send.remote()
    ray.wait([ref], timeout=DRIVER_TIMEOUT, fetch_local=False)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    return killed, ref, None


def through_grain():
    import grain
    import psutil

    class Source:
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return make()

    loader = grain.DataLoader(
        data_source=Source(),
        sampler=grain.samplers.IndexSampler(
            4, shard_options=grain.sharding.NoSharding(), shuffle=False, num_epochs=1
        ),
        operations=[grain.transforms.Batch(1)],
        worker_count=1,
    )
    batches = iter(loader)
    batch = next(batches)
    for child in psutil.Process().children(recursive=True):
        child.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    return killed, (batch, batches), None


def _joblib_producer(folder):
    """A joblib parent: dispatches the array to a loky worker and dies as
    soon as the worker has it."""
    import threading

    from joblib import Parallel, delayed

    def die_when_received():
        while not os.path.exists(os.path.join(folder, "got")):
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_when_received, daemon=True).start()
    # loky's workers import the task by module: this file, as a module.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import lifetime

    Parallel(n_jobs=2)([delayed(lifetime._joblib_worker)(make(), folder)])


def _joblib_worker(array, folder):
    open(os.path.join(folder, "got"), "w").close()
    time.sleep(WAIT)
    with open(os.path.join(folder, "read"), "w") as f:
        f.write(_check(array))


def through_joblib(folder):
    import multiprocessing as mp

    producer = mp.get_context("spawn").Process(target=_joblib_producer, args=(folder,))
    producer.start()
    producer.join(DRIVER_TIMEOUT)
    return time.monotonic(), None, None


def drive(method):
    """One run: {reads, held: left(...), dropped: left(...)}."""
    before = snapshot()
    folder = tempfile.mkdtemp(prefix="torchshm-lifetime-", dir="/tmp")
    before["tmp"].add(os.path.basename(folder))
    if method == "ray":
        killed, data, error = through_ray()
    elif method == "grain":
        killed, data, error = through_grain()
    elif method == "joblib":
        killed, data, error = through_joblib(folder)
    else:
        killed, data, error = through_pipe(method, folder)
    time.sleep(max(0.0, killed + WAIT - time.monotonic()))
    reads = error
    if reads is None:
        try:
            if method == "ray":
                import ray

                reads = _check(ray.get(data, timeout=60))
            elif method == "grain":
                reads = _check(data[0][0])
            elif method == "joblib":
                time.sleep(1.0)  # the worker's read is due WAIT after it got it
                marker = os.path.join(folder, "read")
                got = os.path.exists(os.path.join(folder, "got"))
                reads = (
                    open(marker).read()
                    if os.path.exists(marker)
                    else ("no: the worker exited" if got else "no: never received")
                )
            else:
                reads = _check(data)
        except Exception as exc:  # noqa: BLE001 - what the receiver gets
            reads = f"no: {type(exc).__name__}: {exc}"[:160]
    held = left(before)
    held["tmp"] += _inside(folder)
    del data
    return {"reads": reads, "held": held, "folder": folder}


def _inside(folder):
    """Files the method wrote in the producer's folder (tensordict's
    memmap prefix), named from /tmp."""
    found = []
    for parent, _, files in os.walk(folder):
        rel = os.path.relpath(parent, os.path.dirname(folder))
        found += [os.path.join(rel, f) for f in files if f not in ("got", "read")]
    return sorted(found) if found else []


def measure(method):
    """drive(method) in a fresh interpreter, and what it left after exit:
    names, Shmem, and processes of its session still running (a producer's
    workers that outlive it). The driver writes to files, not pipes: a
    process it leaves behind would hold a pipe open for good."""
    before = snapshot()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        driver = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), method],
            stdout=out,
            stderr=err,
            text=True,
            cwd=ROOT,
            start_new_session=True,  # what it leaves running is found by sid
        )
        try:
            driver.wait(DRIVER_TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill_session(driver.pid)
            raise
        out.seek(0), err.seek(0)
        if driver.returncode != 0:
            _kill_session(driver.pid)
            raise RuntimeError(f"{method} driver failed:\n{err.read()[-2000:]}")
        run = json.loads(out.read().strip().splitlines()[-1])
    time.sleep(2.0)
    after = left(before)
    after["processes"] = _kill_session(driver.pid)
    folder = os.path.basename(run["folder"])
    after["tmp"] = [n for n in after["tmp"] if n != folder] + _inside(run["folder"])
    run["exited"] = after
    _clean(run["folder"])
    for name in after["shm"]:  # what the peer left; the machine keeps nothing
        _clean(os.path.join("/dev/shm", name))
    return run


def _kill_session(sid):
    """The processes of session `sid` still running (counted, then
    SIGKILLed so that nothing outlives the benchmark)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == sid:
                found.append(proc)
        except OSError:
            continue
    for proc in found:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return len(found)


def _clean(path):
    import shutil

    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def _describe(found):
    parts = []
    for where in ("shm", "tmp"):
        if found[where]:
            names = ", ".join(found[where][:2]) + (
                " ..." if len(found[where]) > 2 else ""
            )
            where_name = "/dev/shm" if where == "shm" else "/tmp"
            parts.append(f"{len(found[where])} in {where_name} ({names})")
    parts.append(f"Shmem {found['shmem_mib']:+d} MiB")
    if found.get("processes"):
        parts.append(f"{found['processes']} processes still running")
    return "; ".join(parts)


def run(quick, bar):
    from benchmarks import peers
    from benchmarks.report import Result

    methods = [m for m in METHODS if m not in PEERS or peers.enabled()]
    result = Result(
        NAME,
        "15. The producer SIGKILLed right after it sent 64 MiB: does the receiver"
        " still read it, and what is left behind",
        notes=[" ".join(__doc__.split("\n\n")[1].split())],
    )
    bar.reset(total=len(methods))
    for method in methods:
        package = PEERS.get(method)
        why = peers.problem(package) if package else None
        if why is None:
            try:
                run_ = measure(method)
            except Exception as exc:  # noqa: BLE001 - the table shows it
                why = f"{type(exc).__name__}: {str(exc)[-300:]}"
        bar.update()
        if why is not None:  # the row says so; the notes say why
            result.extra(method, "reads after 5 s", "failed")
            result.notes.append(f"{method}: {why}")
            continue
        result.extra(method, "reads after 5 s", run_["reads"])
        result.extra(method, "left 5 s after the kill", _describe(run_["held"]))
        result.extra(
            method, "left after the receiver exited", _describe(run_["exited"])
        )
        result.summary[method] = run_
    return result


if __name__ == "__main__":
    print(json.dumps(drive(sys.argv[1])))
