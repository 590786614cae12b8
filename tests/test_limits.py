"""Limits: file descriptors, a small /dev/shm, a memory limit, threads."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import torchshm
from tests import fault_children, isolated
from tests.isolated import NO_MEMORY_CGROUP, NO_UNSHARE, SMALL_SHM
from tests.conftest import TIMEOUT

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_os]


def test_a_consumer_under_ulimit_n_64_keeps_500_arrays(no_leaks, child):
    # A live array costs a mapping, never an fd (torch's fd strategy fails
    # after ~50 items here). spawn: the child starts with few fds open.
    messages, limit, keep_every = 2000, 64, 20  # keeps 100 messages x 5 arrays
    c = child(
        mp.get_context("spawn"), fault_children.fd_limited_consumer, limit, keep_every
    )
    for i in range(messages):
        c.send((i, [fault_children.fd_array(i, k) for k in range(5)]))
    c.send(None)
    result = c.receive()
    assert c.close() == 0
    assert result["received"] == messages and result["bad"] == 0
    assert result["kept"] == 500 and result["kept_ok"] and result["kept_shared"]
    assert result["open_fds"] < limit


@pytest.mark.skipif(NO_UNSHARE is not None, reason=str(NO_UNSHARE))
@pytest.mark.skipif(bool(NO_MEMORY_CGROUP), reason=str(NO_MEMORY_CGROUP))
def test_a_memory_limit_falls_back_without_loss_or_oom_kill():
    """In Docker's 64 MiB /dev/shm and a memory cgroup: /dev/shm bounds
    nothing, the cgroup's limit does, and reaching it pickles by value, with
    one warning that names the limit, never an OOM kill or a lost item."""
    with isolated.memory_limited() as cgroup:
        with isolated.Driver(
            "memory_limit", str(128 << 20), wrapper=cgroup + SMALL_SHM
        ) as driver:
            lines, status = driver.results()
            assert status == 0, driver.stderr()
            (result,) = lines
            assert result["exitcodes"] == [0, 0], "a child died (-9: the OOM killer)"
            items = fault_children.LIMIT_ITEMS + 1
            assert result["order"] == list(range(items)), "an item was lost"
            assert all(result["equal"])
            shared = result["shared"]
            # What fit was shared (far more than a 64 MiB /dev/shm holds would
            # allow with its other users); the rest fell back...
            assert shared[0] and shared.count(False) >= 1, shared
            assert result["fallbacks"] == {"out of memory": shared.count(False)}
            # ...with one warning that names the limit and the fix.
            (warning,) = result["warnings"]
            assert "pickling it by value" in warning
            assert "memory cgroup limit" in warning and "--memory" in warning
            # Memory freed is usable again.
            assert shared[-1]
            # collate and the allocator do without, with data intact.
            assert result["ballast_fell_back"]
            assert not result["collate_shared"] and result["collate_equal"]
            assert not result["born_shared"] and result["born_sum"] == 1 << 18
            assert any(
                "stacking it in ordinary memory" in w
                for w in result["collate_warnings"]
            )
            assert any("NumPy allocates" in w for w in result["collate_warnings"])
            assert result["shm_used"] < 1 << 20  # nothing of torchshm in /dev/shm
            _, processes = isolated.leftovers(driver, shm=False)
            assert (
                not processes
            ), f"processes left after {isolated.GRACE} s: {processes}"


@pytest.mark.skipif(NO_UNSHARE is not None, reason=str(NO_UNSHARE))
def test_idle_senders_leave_all_of_a_64_mib_dev_shm_to_torch():
    with isolated.Driver("idle_senders", wrapper=SMALL_SHM) as driver:
        lines, status = driver.results()
        assert status == 0, driver.stderr()
        (result,) = lines
        assert result["exitcodes"] == [0, 0, 0]
        # The session's pools are memfds: none of /dev/shm.
        assert result["idle_used"] < 1 << 20, result
        assert result["torch_exitcode"] == 0, "torch's share_memory_ died (-7: SIGBUS)"
        assert result["torch_sum"] == fault_children.TORCH_SHARE_BYTES // 4


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue"])
def test_eight_threads_send_overlapping_views_to_a_prefetch_thread(ctx, no_leaks, kind):
    # A Queue pickles in its feeder thread; a SimpleQueue in each sending
    # thread, so there eight reducers run at once.
    bases = fault_children.thread_bases()
    originals = [b.copy() for b in bases]
    shared = torchshm.share(np.arange(50_000, dtype=np.float32))
    inbox, outbox = getattr(ctx, kind)(), ctx.Queue()
    prefetchers, per_thread = 2, 20
    receiver = ctx.Process(
        target=fault_children.prefetch_receiver,
        args=(inbox, outbox, shared, prefetchers),
        daemon=True,
    )
    receiver.start()

    def send(thread):
        for j in range(per_thread):
            views = fault_children.thread_views(bases, shared, thread, j)
            inbox.put(((thread, j), views))

    threads = [threading.Thread(target=send, args=(t,)) for t in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        for _ in range(prefetchers):
            inbox.put(None)
        result = outbox.get(timeout=TIMEOUT)
    finally:
        receiver.join(TIMEOUT)
        if receiver.is_alive():
            receiver.kill()
            receiver.join(TIMEOUT)
    assert receiver.exitcode == 0
    assert result == {"received": 8 * per_thread, "bad": 0, "unshared": 0}
    for base, original in zip(bases, originals):  # the receiver wrote to copies
        np.testing.assert_array_equal(base, original)
    for q in (inbox, outbox):
        q.close()
        if kind == "Queue" or q is outbox:
            q.join_thread()


def _loader_in_small_shm(
    method, samples=32, env=None, hold=False, may_hang=False, start="forkserver"
):
    """benchmarks/docker_loader.py's JSON for one run in a private 64 MiB
    /dev/shm (the DataLoader of issue 20: 4 workers, 2 MiB samples), its
    workers started by `start`: forkserver but in one case, since spawn's
    workers each import torch (10 s of CPU a run).
    With `may_hang` (torch alone), a loader that printed its result and does
    not exit within EXIT_GRACE (torch's DataLoader, on Debian 13's torch 2.6,
    once a worker died of the full /dev/shm) is killed: its result stands."""
    env = dict(env or os.environ, PYTHONPATH=isolated.ROOT)
    env.pop("TORCHSHM_SESSION", None)
    env["TORCHSHM_THRESHOLD"] = "256K"  # the default, not the suite's
    env["TORCHSHM_BENCH_LOADER_START"] = start
    proc = subprocess.Popen(
        [*SMALL_SHM, sys.executable, "-m", "benchmarks.docker_loader", method]
        + [str(samples), "1"]
        + (["hold"] if hold else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=isolated.ROOT,
        env=env,
        start_new_session=True,
    )
    out, err = [], []
    readers = [
        threading.Thread(target=lambda f=f, into=into: into.extend(f), daemon=True)
        for f, into in ((proc.stdout, out), (proc.stderr, err))
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 10 * TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            if may_hang and any(line.startswith("{") for line in out):
                deadline = min(deadline, time.monotonic() + EXIT_GRACE)
            time.sleep(0.1)
    finally:
        # On a time limit (this one or the test's), killing the loader alone
        # left its 4 spawn workers and their keeper running for good.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        for reader in readers:
            reader.join(TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()
    lines = [line for line in out if line.startswith("{")]
    assert lines and (may_hang or proc.returncode == 0), "".join(err)[-3000:]
    return json.loads(lines[-1])


EXIT_GRACE = 30  # seconds a loader that printed its result may take to exit


# One loader run starts 5 interpreters (4 spawn workers): 14-20 s on a quiet
# machine, past the suite's 120 s default with three suites beside it. A hang
# fails sooner, inside it: the DataLoader's timeout is 60 s per batch.
LOADER_TEST_TIMEOUT = 8 * TIMEOUT


@pytest.mark.skipif(NO_UNSHARE is not None, reason=str(NO_UNSHARE))
@pytest.mark.timeout(LOADER_TEST_TIMEOUT)
@pytest.mark.parametrize("method", ["torchshm_collate", "torchshm"])
def test_a_dataloader_in_a_64_mib_dev_shm_completes_without_a_warning(method):
    # One case with spawn workers, as issue 20's loader started them.
    start = "spawn" if method == "torchshm" else "forkserver"
    result = _loader_in_small_shm(method, start=start)
    assert result["completed"], result.get("error")
    assert result["batches"] == 2 * 32 // 8 and result["bad"] == 0
    assert result["warnings"] == []


@pytest.mark.skipif(NO_UNSHARE is not None, reason=str(NO_UNSHARE))
@pytest.mark.timeout(3 * LOADER_TEST_TIMEOUT)  # three loader runs
@pytest.mark.parametrize("samples", ["numpy", "tensor"])
def test_the_default_collate_in_a_64_mib_dev_shm_completes_with_torchshm_imported(
    samples,
):
    # torch writes every batch of the default collate into /dev/shm. Held
    # together (48 samples: 6 batches of 16 MiB) they cannot fit 64 MiB;
    # with torchshm imported (its tensor switch on by default) they are made
    # in torchshm's memfds. (Not held, whether torch's batches in flight
    # overflow depends on the timing.)
    runs = {
        "numpy": ("torch", "torch_default", "torch_switch_off"),
        "tensor": ("tensor_samples", "tensor_samples_default", None),
    }[samples]
    env = {k: v for k, v in os.environ.items() if k != "TORCHSHM_TENSORS"}
    for method in (runs[0], runs[2]):
        if method is not None:  # torch alone, and torchshm's switch off
            without = _loader_in_small_shm(
                method, samples=48, env=env, hold=True, may_hang=True
            )
            assert not without["completed"] and without["batches"] < 2 * 48 // 8
    default = _loader_in_small_shm(runs[1], samples=48, env=env, hold=True)
    assert default["completed"], default.get("error")
    assert default["batches"] == 2 * 48 // 8 and default["bad"] == 0
    assert default["warnings"] == []


@pytest.mark.skipif(NO_UNSHARE is not None, reason=str(NO_UNSHARE))
@pytest.mark.timeout(2 * LOADER_TEST_TIMEOUT)  # two loader runs
def test_torchshm_leaves_torch_its_room_in_a_64_mib_dev_shm():
    # Samples carry an array and a torch tensor: torch shares the tensors
    # through /dev/shm; torchshm must not make that fail.
    disabled = _loader_in_small_shm(
        "mixed_disabled", env=dict(os.environ, TORCHSHM_DISABLE="1")
    )
    enabled = _loader_in_small_shm("mixed_torchshm")
    assert enabled["batches"] == disabled["batches"] == 2 * 32 // 8
    assert enabled["completed"] and disabled["completed"]
    assert enabled["bad"] == disabled["bad"] == 0


@pytest.mark.skipif(NO_UNSHARE is not None, reason=str(NO_UNSHARE))
@pytest.mark.parametrize("switch", ["0", "1"])
def test_the_doctor_names_the_tensor_switch_where_dev_shm_is_small(switch):
    env = dict(os.environ, PYTHONPATH=isolated.ROOT, TORCHSHM_TENSORS=switch)
    env.pop("TORCHSHM_SESSION", None)
    run = subprocess.run(
        [*SMALL_SHM, sys.executable, "-m", "torchshm", "doctor"],
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT,
        cwd=isolated.ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())  # lines are wrapped
    assert "/dev/shm is 64.0 MiB" in text or "/dev/shm is 64 MiB" in text, text
    assert "TORCHSHM_TENSORS=0" in text  # the way out of the default
    assert f"the tensor switch is {'on' if switch == '1' else 'off'} here" in text


# A mount namespace whose /proc is an empty tmpfs: no process, no meminfo.
NO_PROC = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh")


@pytest.mark.skipif(NO_UNSHARE is not None, reason=str(NO_UNSHARE))
def test_without_proc_the_fallback_names_proc():
    code = (
        "import json, pickle, warnings, numpy as np, torchshm\n"
        "from multiprocessing.reduction import ForkingPickler\n"
        "a = np.arange(1 << 20)\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    b = pickle.loads(ForkingPickler.dumps(a))\n"
        "assert (b == a).all() and not torchshm.is_shared(b)\n"
        "fallbacks = torchshm.stats()['fallbacks']\n"
        "print('RESULT', json.dumps([fallbacks, [str(w.message) for w in seen]]))\n"
    )
    env = dict(os.environ, PYTHONPATH=isolated.ROOT)
    env.pop("TORCHSHM_SESSION", None)
    run = subprocess.run(
        [*NO_PROC, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT,
        cwd=isolated.ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    # Other lines may come from the stack (without /proc, Debian 13's torch
    # 2.6 prints "UCX ERROR failed to get boot id"): the marked line is ours.
    results = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, (run.stdout, run.stderr)
    fallbacks, messages = json.loads(results[0][len("RESULT ") :])
    assert fallbacks == {"no /proc": 1}, (run.stdout, run.stderr)
    warnings = " ".join(messages)
    assert "/proc/meminfo" in warnings and "mount -t proc" in warnings
    assert "MemAvailable" not in warnings
