"""Checks that need a CUDA device, on the real runtime: run by
scripts/device_check.py on a GPU machine (`pytest tests/device_checks.py`).
The suite never collects this file (pytest's default pattern finds test_*.py
only): on a CPU the same rules are held by tests/test_device.py through the
fake runtime.

To make a copy complete late, a kernel that only waits (torch.cuda._sleep)
runs before it on its stream: a segment reused before its copy completed
then shows as a wrong checksum."""

import multiprocessing as mp
import os

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import torchshm
from tests import device_children as dc
from tests.conftest import run_python
from torchshm._cuda import runtime as _runtime
from torchshm._lifetime import pins as _pins

pytestmark = pytest.mark.multiprocess

DEVICE = "cuda"
BATCH = 4
BATCHES = 64
# GPU cycles a stream waits before a copy (about 5 ms at 2 GHz).
LATE_CYCLES = 10_000_000


# CUDA's context holds fds for the process's life (42 on an H200): made at
# import, before the first test's leak baseline, so that none counts as leaked.
torch.zeros(1, device=DEVICE)


@pytest.fixture(autouse=True)
def cuda_context():
    """Nothing left pinned after a test."""
    yield
    torch.cuda.synchronize()
    _pins.release_all()
    assert _pins.pinned_bytes() == 0


def _loader(collate=None, workers=2, pin_memory=True):
    return tud.DataLoader(
        dc.Samples(BATCH * BATCHES),
        batch_size=BATCH,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin_memory,
        multiprocessing_context="fork",
    )


def _checked(sums):
    """Indices of the batches whose per-sample sums are not their samples'."""
    wrong = []
    for b, got in enumerate(sums):
        want = torch.tensor(
            [
                float(i) * dc.SHAPE[0] * dc.SHAPE[1]
                for i in range(b * BATCH, (b + 1) * BATCH)
            ],
            dtype=torch.float64,
        )
        if not torch.allclose(got.cpu(), want):
            wrong.append(b)
    return wrong


def test_the_real_runtime_is_in_use():
    assert _runtime.active().name == "cuda" and _runtime.active().in_use()


def test_a_received_batch_is_pinned_where_it_lies(ctx, child):
    c = child(ctx, dc.send_batches, 1)
    batch = c.receive()
    torchshm._device.pin_memory(batch)  # what DataLoader's pin thread calls
    x = torch.from_numpy(batch["x"])
    assert x.is_pinned()
    assert x.pin_memory().data_ptr() == x.data_ptr()  # no copy
    on_device = torchshm.to_device(batch)
    torch.cuda.synchronize()
    assert torch.equal(on_device["x"].cpu(), x)
    assert torch.equal(on_device["z"].cpu(), torch.from_numpy(batch["z"]))
    del batch, x
    c.send("next")
    assert c.close() == 0


@pytest.mark.parametrize("stream", ["current", "side"])
def test_pin_memory_batches_copied_late_stay_right(stream):
    # DataLoader's pin thread pins each batch in place (copies nothing);
    # the loop copies it behind a waiting kernel, then drops it: its worker
    # may reuse the segment only once the copy is done.
    side = torch.cuda.Stream() if stream == "side" else None
    sums = []
    for batch in _loader():
        x = batch["x"]
        assert x.is_pinned()
        assert torchshm.is_shared(x.numpy())  # the worker's segment: no copy
        if side is None:
            torch.cuda._sleep(LATE_CYCLES)
            on_device = x.to(DEVICE, non_blocking=True)
        else:
            with torch.cuda.stream(side):
                torch.cuda._sleep(LATE_CYCLES)
                on_device = x.to(DEVICE, non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)
        sums.append(on_device.reshape(BATCH, -1).sum(1, dtype=torch.float64))
        del batch, x  # dropped after the block
    assert _checked(sums) == []


@pytest.mark.parametrize("collate", ["torchshm.collate", "default"])
def test_device_loader_batches_copied_late_stay_right(collate):
    fn = torchshm.collate if collate == "torchshm.collate" else None
    sums = []
    for batch in torchshm.device_loader(_loader(fn, pin_memory=False), DEVICE):
        torch.cuda._sleep(LATE_CYCLES)  # its reader waits: copies pile up
        sums.append(batch["x"].reshape(BATCH, -1).sum(1, dtype=torch.float64))
    assert _checked(sums) == []
    assert _pins.pinned_bytes() > 0


def test_a_forked_child_writes_memory_the_parent_pinned(child):
    # facts section 15, rule 7: a child forked after the registration writes
    # into the pinned segment; the parent sees the write, and so does a copy.
    ctx = mp.get_context("fork")
    sender = child(ctx, dc.send_batches, 1)
    batch = sender.receive()
    torchshm.to_device(batch)
    assert _pins.pinned_bytes() > 0
    writer = ctx.Process(target=_write_ones, args=(batch["x"],))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    assert (batch["x"] == 1).all()
    on_device = torchshm.to_device(batch)
    torch.cuda.synchronize()
    assert bool((on_device["x"] == 1).all())
    del batch
    sender.send("next")
    assert sender.close() == 0


def _write_ones(array):
    array[...] = 1


def test_pinned_bytes_stay_under_the_bound(monkeypatch):
    monkeypatch.setenv("TORCHSHM_PIN_BYTES", str(2 << 20))
    sums = []
    for batch in torchshm.device_loader(_loader(torchshm.collate, pin_memory=False)):
        sums.append(batch["x"].reshape(BATCH, -1).sum(1, dtype=torch.float64))
        assert _pins.pinned_bytes() <= 2 << 20
    assert _checked(sums) == []


def test_a_process_that_pinned_exits_cleanly():
    # Its exit hook unregisters everything before CUDA's teardown.
    run = run_python(
        """
        import multiprocessing as mp
        import torch, torchshm
        from torchshm._lifetime import pins
        from tests import device_children as dc

        torch.zeros(1, device="cuda")
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=dc.send_batches, args=(inbox, outbox, 1))
        p.start()
        torchshm.to_device(outbox.get(timeout=60))
        assert pins.pinned_bytes() > 0
        inbox.put("done")
        p.join(60)
        print("ok")
        """,
        env={k: v for k, v in os.environ.items() if k != "TORCHSHM_SESSION"},
    )
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr[-3000:]
    assert "CUDA" not in run.stderr, run.stderr[-3000:]


def test_an_unpinned_copy_is_right_too():
    # Arrays of ordinary memory: pageable copies, as torch's.
    batch = {"a": np.arange(1000.0), "b": torch.arange(10)}
    on_device = torchshm.to_device(batch)
    torch.cuda.synchronize()
    assert torch.equal(on_device["a"].cpu(), torch.arange(1000.0, dtype=torch.float64))
    assert torch.equal(on_device["b"].cpu(), torch.arange(10))
