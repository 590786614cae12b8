"""torchshm.dumps / loads / release: handles loaded by many processes, each
its own torchshm session (tests/node_children.py)."""

import errno
import gc
import json
import os
import pickle
import random
import subprocess
import sys
import time

import numpy as np
import pytest

import torchshm
from tests.conftest import TIMEOUT
from torchshm import _handles
from torchshm._lifetime import session as _session

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_os]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NBYTES = 16 << 20
LOADERS = 8


def child_env():
    """Each child founds its own session, like a separately launched rank."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(_session.ENV_VAR, None)
    return env


def start(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.node_children", *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )


def read_line(proc, expect):
    line = proc.stdout.readline().split()
    assert line and line[0] == expect, (line, proc.stderr.read()[-3000:])
    return line


def tell(proc, command):
    proc.stdin.write(command + "\n")
    proc.stdin.flush()


def finish(proc):
    proc.stdin.close()
    try:
        rc = proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert rc == 0, err[-3000:]


def segments_of(sessions):
    return sorted(
        n
        for n in os.listdir("/dev/shm")
        if any(n.startswith(f"torchshm_{s}_") for s in sessions)
    )


def wait_gone(sessions, seconds=20):
    deadline = time.monotonic() + seconds
    while segments_of(sessions) and time.monotonic() < deadline:
        time.sleep(0.1)
    return segments_of(sessions)


def late_load(path):
    run = subprocess.run(
        [sys.executable, "-m", "tests.node_children", "try_load", path],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=TIMEOUT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("exporter_exits", ["first", "last"])
def test_one_handle_eight_loaders(tmp_path, exporter_exits):
    path = str(tmp_path / "handle")
    exporter = start("exporter", NBYTES, path)
    procs = [exporter]
    try:
        _, exporter_session, exporter_pid = read_line(exporter, "ready")
        sessions = {exporter_session}
        loaders = [start("loader", path, NBYTES) for _ in range(LOADERS)]
        procs += loaders
        for proc in loaders:  # all load concurrently, then report
            sessions.add(read_line(proc, "loaded")[1])
        assert len(sessions) == LOADERS + 1  # one session each

        if exporter_exits == "first":
            tell(exporter, "exit")
            read_line(exporter, "bye")
            finish(exporter)
            late = late_load(path)
            assert late["errno"] in (errno.ESTALE, errno.ENOENT), late
            assert f"pid {exporter_pid} " in late["message"], late
            assert "torchshm process id" in late["message"], late
        else:
            # Release the handle and send arrays of the same size: a pool
            # that reused any loader's memory would overwrite it.
            tell(exporter, "churn")
            read_line(exporter, "churned")
            late = late_load(path)
            assert late["errno"] == errno.ESTALE, late
            assert "released" in late["message"], late
            assert f"pid {exporter_pid} " in late["message"], late

        order = list(loaders)
        random.shuffle(order)
        for proc in order:
            tell(proc, "check")  # the data is still the exporter's
            read_line(proc, "checked")
            finish(proc)
        if exporter_exits == "last":
            tell(exporter, "exit")
            read_line(exporter, "bye")
            finish(exporter)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert wait_gone(sessions) == []


def test_a_released_handle_whose_cell_is_gone_says_released():
    # The exporter drops its cells with its last handle, and its pool may
    # free them at any time after (trim() does it now): the load must still
    # say "released", not "cannot be reached from this process".
    array = np.arange(100_000)
    handle = torchshm.dumps(array)
    assert torchshm.release(handle)
    torchshm.trim()
    with pytest.raises(torchshm.HandleError) as info:
        torchshm.loads(handle)
    assert info.value.errno == errno.ESTALE, info.value
    assert "released" in str(info.value)


def test_dumps_loads_in_process_and_release():
    obj = {"a": np.arange(100_000), "b": [np.ones(500), "text"], "c": 3}
    handle = torchshm.dumps(obj)
    assert isinstance(handle, bytes)
    first, second = torchshm.loads(handle), pickle.loads(handle)
    for got in (first, second):
        assert np.array_equal(got["a"], obj["a"]) and got["b"][1] == "text"
        assert torchshm.is_shared(got["a"])
    # A dict cannot be weakly referenced: the handle lives until release.
    assert torchshm.release(handle) is True
    assert torchshm.release(handle) is False
    with pytest.raises(torchshm.HandleError) as info:
        torchshm.loads(handle)
    assert info.value.errno == errno.ESTALE
    assert f"pid {os.getpid()} " in str(info.value)
    # Loaded objects keep their data.
    assert np.array_equal(first["a"], np.arange(100_000))


def test_a_handle_lives_as_long_as_its_array():
    array = np.arange(200_000, dtype=np.float64)
    handle = torchshm.dumps(array)
    array[:] = -1  # a snapshot: later changes are not seen
    assert torchshm.loads(handle)[5] == 5.0
    del array
    gc.collect()
    with pytest.raises(torchshm.HandleError, match="released"):
        torchshm.loads(handle)


def test_not_a_handle():
    with pytest.raises(ValueError):
        torchshm.loads(pickle.dumps({"x": 1}))
    with pytest.raises(ValueError):
        torchshm.release(b"garbage")


# Forged handles (GitHub issue 19): a handle's header comes from outside, so
# every field is checked before use. A forged one fails with HandleError
# naming the field; it never reads outside the cell, never loads on a token
# that only nearly matches, and never fails with a stray IndexError.

FIELDS = ("format", "exporter", "cell", "generation", "index", "token")


def header_of(handle):
    return dict(zip(FIELDS, _handles._peek(handle)[0]))


def forge(handle, **changes):
    """`handle` with some header fields replaced, pickled as dumps() does."""
    header, payload = _handles._peek(handle)
    fields = dict(zip(FIELDS, header), **changes)
    forged = _handles._HandleData(tuple(fields[f] for f in FIELDS), payload)
    return pickle.dumps(forged, protocol=pickle.HIGHEST_PROTOCOL)


def assert_refused(forged, errno_=errno.EINVAL, match=None):
    for load in (torchshm.loads, pickle.loads):
        with pytest.raises(torchshm.HandleError, match=match) as info:
            load(forged)
        assert info.value.errno == errno_, info.value


@pytest.fixture
def handle():
    """A live handle of a 1000-float array, released after the test."""
    array = np.arange(1000.0)
    data = torchshm.dumps(array)
    yield data
    assert torchshm.loads(data)[999] == 999.0  # forgeries left it intact
    assert torchshm.release(data)
    del array


def test_a_token_is_compared_exactly():
    # NumPy 1.x compares np.uint64 with a Python int as float64: a token that
    # differs from the real one below float64's precision used to match.
    array = np.arange(1000.0)
    for _ in range(20):  # a token below 2**54 has no such twin: try another
        handle = torchshm.dumps(array)
        token = header_of(handle)["token"]
        twins = [t for t in (token - 2, token + 2) if float(t) == float(token)]
        if twins:
            break
    try:
        assert twins
        forged = forge(handle, token=twins[0])
        assert_refused(forged, errno.ESTALE, "no longer valid")
        assert torchshm.loads(handle)[999] == 999.0
    finally:
        del array  # ends every handle of it


@pytest.mark.parametrize(
    "field,value",
    [
        ("format", 2),
        ("format", "1"),
        ("exporter", None),
        ("exporter", {"pid": 1}),
        ("exporter", "pid"),
        ("process_id", "00ff"),
        ("process_id", 2**64),
        ("process_id", -1),
        ("pid", "1"),
        ("host", 7),
        ("cell", 5),
        ("cell", ""),
        ("cell", "/etc/passwd"),
        ("cell", "/torchshm_a/../../x"),
        ("generation", -1),
        ("generation", "0"),
        ("generation", 2**64),
        ("generation", True),
        ("index", 0),
        ("index", -1),
        ("index", 10**9),
        ("index", 2**70),
        ("index", 1.0),
        ("index", True),
        ("token", 0),
        ("token", -1),
        ("token", 2**63),
        ("token", 1.0),
        ("token", "1"),
    ],
)
def test_every_malformed_field_is_a_handle_error(handle, field, value):
    header = header_of(handle)
    if field in ("process_id", "pid", "host"):
        value = dict(header["exporter"], **{field: value})
        field = "exporter"
    name = "exporter" if field == "exporter" else field
    assert_refused(forge(handle, **{field: value}), match=name)
    with pytest.raises(torchshm.HandleError, match=name):
        torchshm.release(forge(handle, **{field: value}))


def test_an_index_never_reads_another_handles_word(handle):
    other = np.arange(20.0)
    second = torchshm.dumps(other)
    # The other handle's word under this one's token; the word past the cell.
    assert_refused(forge(handle, index=header_of(second)["index"]), errno.ESTALE)
    assert_refused(forge(handle, index=(64 << 10) // 8), match="index")
    assert torchshm.loads(second).shape == (20,)


class Node:
    """Weakly referenceable, so that a handle of it lives as long as it."""

    def __init__(self, value):
        self.value, self.next = value, None


def test_a_handle_dropped_by_a_collection_under_the_handles_lock_never_hangs():
    """An exported object in a reference cycle is freed at whatever
    collection comes next, in whatever thread: also one that an allocation
    starts while that thread holds the handles' lock (dumps() makes a cell
    under it). The finalizer waited for that lock: the thread hung for good.
    It is dropped once the lock is let go instead."""
    import threading

    cycle = Node(np.arange(100_000.0))
    cycle.next = cycle
    handle = torchshm.dumps(cycle)
    del cycle
    done = threading.Event()

    def collect_under_the_lock():
        with _handles._lock:
            gc.collect()  # the finalizer runs here
        done.set()

    gc.disable()  # no collection before the one under the lock
    try:
        thread = threading.Thread(target=collect_under_the_lock, daemon=True)
        thread.start()
        assert done.wait(TIMEOUT / 4), "the finalizer waited for the lock"
    finally:
        gc.enable()
    assert torchshm.release(handle) is False  # dropped already
