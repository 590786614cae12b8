"""Processes for tests/test_handles.py and tests/test_distributed.py, each
started as its own program (`python -m tests.node_children ROLE ...`) so that
it is its own torchshm session, as separately launched ranks are.

Roles:
- exporter NBYTES HANDLE_FILE: dumps a table to HANDLE_FILE, then obeys
  stdin lines: "churn" (release the handle, drop the table, and send arrays
  of the same sizes to tempt its pool into reusing the memory), "exit".
- loader HANDLE_FILE NBYTES: loads the handle, checks it, then on stdin
  "check" checks it again and exits (dropping it).
- rank MODE NBYTES STATUS_DIR: one rank of a torch.distributed job (torchrun's
  environment contract); see rank_main.
"""

import gc
import json
import os
import sys
import time

import numpy as np

import torchshm
from torchshm._lifetime import session as _session


def table(nbytes, seed=7):
    """What every process expects: big, plus small arrays that go into a
    shared chunk."""
    return {
        "big": np.arange(nbytes // 8, dtype=np.int64) * 3 + seed,
        "small": [np.full(2000, i + seed, dtype=np.int32) for i in range(40)],
    }


def check(obj, nbytes, seed=7):
    big = obj["big"]
    n = nbytes // 8
    assert big.shape == (n,), big.shape
    # arange * 3 + seed, checked without a second table: sum and samples.
    assert int(big.sum(dtype=np.int64)) == 3 * n * (n - 1) // 2 + seed * n
    idx = np.linspace(0, n - 1, 1000).astype(np.int64)
    assert np.array_equal(big[idx], idx * 3 + seed)
    for i, small in enumerate(obj["small"]):
        assert small.shape == (2000,) and (small == i + seed).all(), i


def say(*words):
    print(*words, flush=True)


def exporter(nbytes, path):
    obj = table(nbytes)
    handle = torchshm.dumps(obj)
    with open(path + ".tmp", "wb") as f:
        f.write(handle)
    os.rename(path + ".tmp", path)
    say("ready", _session.session_id(), os.getpid())
    for line in sys.stdin:
        command = line.strip()
        if command == "churn":
            assert torchshm.release(handle)
            del obj
            gc.collect()
            from multiprocessing.reduction import ForkingPickler

            garbage = table(nbytes, seed=99)
            for _ in range(3):
                # Each message snapshots into the pool: a segment no live
                # holder names would be reused and overwritten here.
                ForkingPickler.dumps(garbage)
                gc.collect()
            say("churned")
        elif command == "exit":
            say("bye")
            return


def loader(path, nbytes):
    with open(path, "rb") as f:
        handle = f.read()
    obj = torchshm.loads(handle)
    check(obj, nbytes)
    assert torchshm.is_shared(obj["big"])
    say("loaded", _session.session_id(), os.getpid())
    for line in sys.stdin:
        if line.strip() == "check":
            check(obj, nbytes)
            del obj
            gc.collect()
            say("checked")
            return


def try_load(path):
    """Prints the error a late load gets (or 'loaded')."""
    with open(path, "rb") as f:
        handle = f.read()
    try:
        torchshm.loads(handle)
    except torchshm.HandleError as exc:
        say(json.dumps({"errno": exc.errno, "message": str(exc)}))
        return
    say(json.dumps({"errno": None}))


# --- ranks ---------------------------------------------------------------


class TableDataset:
    """Item i < workers: the sum of the whole table (each worker reads all of
    it); item i >= workers: waits until STATUS_DIR/go exists (the test
    measures memory meanwhile) and returns the worker's pid."""

    def __init__(self, table, workers, status_dir):
        self.table, self.workers, self.status_dir = table, workers, status_dir

    def __len__(self):
        return 2 * self.workers

    def __getitem__(self, i):
        if i < self.workers:
            return int(self.table.sum(dtype=np.int64)), os.getpid()
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(self.status_dir, "go")):
            assert time.monotonic() < deadline, "no go"
            time.sleep(0.05)
        return None, os.getpid()


def build_table(nbytes):
    return np.arange(nbytes // 8, dtype=np.int64)


def rank_main(mode, nbytes, status_dir):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import torchshm.distributed as tsd

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")

    def write(name, payload):
        path = os.path.join(status_dir, f"{name}.{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump(payload, f)
        os.rename(path + ".tmp", path)

    if mode == "share_on_node":
        t = tsd.share_on_node(build=lambda: build_table(nbytes))
    else:  # control: each rank its own copy, shared with its own workers only
        t = torchshm.share(build_table(nbytes))
    assert torchshm.is_shared(t)
    n = nbytes // 8
    expected = n * (n - 1) // 2
    assert int(t.sum(dtype=np.int64)) == expected
    workers = 2

    def epoch(table):  # a fresh set of spawned workers over the table
        return DataLoader(
            TableDataset(table, workers, status_dir),
            batch_size=None,
            num_workers=workers,
            multiprocessing_context="spawn",
            worker_init_fn=torchshm.worker_init_fn,
        )

    loader = epoch(t)
    sums, pids = [], set()
    it = iter(loader)
    for _ in range(workers):
        total, pid = next(it)
        sums.append(total)
        pids.add(pid)
    # Every worker read all of the table: ready to be measured.
    write(
        "ready",
        {
            "pid": os.getpid(),
            "workers": sorted(pids),
            "session": _session.session_id(),
        },
    )
    rest = list(it)
    del it, loader
    assert sums == [expected] * workers, sums
    assert int(t.sum(dtype=np.int64)) == expected
    if mode == "share_on_node":
        # A fresh epoch of workers (after a rank may have been killed): still
        # the whole table, whoever is gone. (The control only measures.)
        again = epoch(t)
        sums = [total for total, _ in again if total is not None]
        assert sums == [expected] * workers, sums
        del again
    write(
        "done",
        {
            "session": _session.session_id(),
            "sums_ok": True,
            "late": [p for _, p in rest],
        },
    )
    # No collective after the measurement: a rank may have been killed.
    del t
    gc.collect()


def main(argv):
    role = argv[0]
    if role == "exporter":
        exporter(int(argv[1]), argv[2])
    elif role == "loader":
        loader(argv[1], int(argv[2]))
    elif role == "try_load":
        try_load(argv[1])
    elif role == "rank":
        rank_main(argv[1], int(argv[2]), argv[3])
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main(sys.argv[1:])
