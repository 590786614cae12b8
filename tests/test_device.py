"""Batches to the GPU through torchshm's pinned path, on a CPU: a fake CUDA
runtime (torchshm/_cuda/fake.py) keeps CUDA's rules, registration and
asynchronous copies that read their source late and out of order, so that
memory reused before its copy completed shows as a wrong checksum (Note
[Pinned in place] in torchshm/_lifetime/pins.py, Note [Copies before reuse]
in csrc/lifetime/views.h, Note [Which copies are safe] in
torchshm/_device.py)."""

import contextlib
import ctypes
import gc
import os
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import torchshm
from tests import device_children as dc
from tests.conftest import run_python
from torchshm import _device
from torchshm._cuda import fake as _fake
from torchshm._cuda import runtime as _runtime
from torchshm._lifetime import pins as _pins
from torchshm._native import _C

# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_os]

BATCH = 4
BATCHES = 24
# Long beside a batch's arrival: many batches arrive while a copy waits.
LATE = 0.25


@pytest.fixture
def fake_cuda():
    """The fake runtime in force; afterwards every registration must have
    been undone before its unmap, and nothing left registered."""
    fake = _fake.FakeRuntime(delay=LATE, seed=1)
    with _runtime.use(fake):
        try:
            yield fake
        finally:
            _pins.release_all()
    assert fake.check() == []
    assert fake.registered == {}


@pytest.fixture
def rule_off():
    """Note [Copies before reuse] switched off: what it prevents happens."""
    _pins.hold_until_copied = False
    try:
        yield
    finally:
        _pins.hold_until_copied = True


def _loader(collate, workers=2, n=BATCH * BATCHES):
    return tud.DataLoader(
        dc.Samples(n),
        batch_size=BATCH,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=True,
        multiprocessing_context="fork",
    )


def _wrong_batches(fake, device_batches):
    """Indices of the device batches whose bytes are not their samples'."""
    fake.synchronize()  # the test's reads wait for every copy
    wrong = []
    for b, batch in enumerate(device_batches):
        indices = list(range(b * BATCH, (b + 1) * BATCH))
        want = dc.expected(indices)
        if not (
            torch.equal(batch["x"], want["x"])
            and torch.equal(batch["y"].reshape(-1), want["y"])
        ):
            wrong.append(b)
    return wrong


COLLATES = {
    "torchshm.collate": torchshm.collate,
    "np.stack": dc.stack,
    "default": tud.default_collate,
}


@pytest.mark.parametrize("collate", COLLATES)
def test_dataloader_batches_stay_right_when_their_copies_complete_late(
    fake_cuda, collate
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pin_memory without CUDA
        held = list(torchshm.device_loader(_loader(COLLATES[collate])))
    assert len(held) == BATCHES
    assert _wrong_batches(fake_cuda, held) == []
    assert fake_cuda.calls["register"] > 0  # pinned in place
    assert fake_cuda.calls["copy"] >= BATCHES


@pytest.mark.parametrize("mapping_cache", ["default", "none"])
def test_a_segment_is_registered_once_for_all_the_batches_it_carries(
    fake_cuda, monkeypatch, mapping_cache
):
    # Two epochs of persistent workers: the second one's batches come in the
    # segments of the first (the workers' pools), mapped and pinned already:
    # also when the receiver's mapping cache keeps none of them (full, or its
    # lock busy when a last view died: what a busy CI machine did once).
    if mapping_cache == "none":
        monkeypatch.setenv("TORCHSHM_MAPPING_CACHE_BYTES", "0")
    fake_cuda.delay = 0.001
    loader = tud.DataLoader(
        dc.Samples(BATCH * BATCHES),
        batch_size=BATCH,
        num_workers=2,
        collate_fn=torchshm.collate,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    segments, held = set(), []
    try:
        _two_epochs(loader, segments, held)
    finally:
        del loader  # the persistent workers end with their iterator
        gc.collect()
    assert fake_cuda.calls["register"] == len(segments) < BATCHES
    assert _wrong_batches(fake_cuda, held[BATCHES:]) == []


def _two_epochs(loader, segments, held):
    for _ in range(2):
        for batch in loader:
            # Every leaf's segment: with TORCHSHM_THRESHOLD=1 (the suite's)
            # the labels are born shared too, in the worker's small blocks,
            # which a plain send copies into the message's snapshot (Note [A
            # plain send is as it was] in csrc/send/plan.h): the message's
            # chunk, pinned in place as well (Note [Born batches pinned in
            # place] in torchshm/_device.py).
            for leaf in batch.values():
                segments.add(_C.segment_of(_C.memory_owner(leaf)).name)
            held.append(torchshm.to_device(batch))


@pytest.mark.parametrize("collate", COLLATES)
def test_without_holding_slots_until_copied_the_same_batches_go_wrong(
    fake_cuda, rule_off, collate
):
    # The control: Note [Copies before reuse] is what keeps them right.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        held = list(torchshm.device_loader(_loader(COLLATES[collate])))
    assert _wrong_batches(fake_cuda, held) != []


def test_a_batch_in_one_segment_goes_as_one_copy(fake_cuda, ctx, child):
    c = child(ctx, dc.send_batches, 1)
    batch = c.receive()  # a dict of two arrays in one segment
    on_device = torchshm.to_device(batch)
    assert fake_cuda.calls["copy"] == 1
    assert len(fake_cuda.registered) == 1
    del batch
    c.send("next")
    assert c.close() == 0
    fake_cuda.synchronize()
    want = [dc.wide_sample(i) for i in (0, 1)]
    for key in ("x", "z"):
        assert torch.equal(
            on_device[key], torch.from_numpy(np.stack([w[key] for w in want]))
        )


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("stream", ["current", "side"])
def test_a_copy_torchshm_did_not_issue_holds_the_batch_too(
    fake_cuda, ctx, child, stream
):
    # What batch.to(device, non_blocking=True) does after DataLoader's pin
    # thread pinned the batch: torch's copy, on the current stream or on a
    # side stream the caller made current (torch.cuda.stream(s)); the batch
    # is dropped after the block. The sender then reuses its segment.
    c = child(ctx, dc.send_batches, 3)
    batch = c.receive()
    torchshm._device.pin_memory(batch)  # what the pin thread does
    assert len(fake_cuda.registered) == 1
    dst = torch.empty(dc.SHAPE[0] * dc.SHAPE[1] * 2, dtype=torch.float32)
    src = torch.from_numpy(batch["x"]).reshape(-1)
    if stream == "side":
        with fake_cuda.stream(_fake.FakeStream("side")):
            fake_cuda.user_copy(dst, src)
    else:
        fake_cuda.user_copy(dst, src)
    del batch, src
    for _ in range(2):  # the sender reuses its segment for these
        c.send("next")
        c.receive()
    c.send("next")
    assert c.close() == 0
    fake_cuda.synchronize()
    assert torch.equal(dst.reshape(2, *dc.SHAPE), dc.expected([0, 1])["x"])


def test_pinned_bytes_stay_under_the_bound(fake_cuda, monkeypatch):
    monkeypatch.setenv("TORCHSHM_PIN_BYTES", str(1 << 20))  # under two batches
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = list(torchshm.device_loader(_loader(torchshm.collate)))
    assert _wrong_batches(fake_cuda, held) == []
    assert _pins.pinned_bytes() <= 1 << 20
    bound = [w for w in caught if "TORCHSHM_PIN_BYTES" in str(w.message)]
    assert len(bound) <= 1


def test_dead_segments_are_unregistered_before_their_mappings_go(fake_cuda, ctx, child):
    c = child(ctx, dc.send_batches, 2)
    for _ in range(2):
        torchshm.to_device(c.receive())
        c.send("next")
    assert c.close() == 0  # its pool is gone: what it sent dies with our views
    fake_cuda.synchronize()
    deadline = 50
    while fake_cuda.registered and deadline:
        torchshm.trim()  # polls: dead idle segments are unpinned
        deadline -= 1
        import time

        time.sleep(0.1)
    assert fake_cuda.registered == {}
    assert fake_cuda.check() == []


def test_the_real_runtime_does_nothing_without_a_device():
    # The pip stack's torch is a CUDA build that finds no driver here: no
    # context, nothing pinned, and not a word.
    run = run_python(
        """
        import warnings
        warnings.simplefilter("error")
        import numpy as np, torch
        import torchshm
        from torchshm._cuda import runtime
        from torchshm._lifetime import pins
        assert runtime.active().name == "cuda"
        assert not runtime.active().in_use()
        batch = torchshm.share(np.ones(1 << 20))
        torchshm._device.pin_memory(batch)
        assert pins.pinned_bytes() == 0
        print("ok")
        """
    )
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr[-2000:]


def test_the_pin_hook_is_in_place_while_registered():
    from torch.utils.data._utils import pin_memory as torch_pin

    assert torch_pin.pin_memory is torchshm._device.pin_memory
    torchshm.unregister()
    try:
        assert torch_pin.pin_memory is not torchshm._device.pin_memory
    finally:
        torchshm.register()
    assert torch_pin.pin_memory is torchshm._device.pin_memory


def test_arrays_of_every_layout_arrive_as_they_were(fake_cuda):
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    batch = {
        "strided": base[::2, 1::3],
        "reversed": base[::-1],
        "swapped": base.astype(">i4"),
        "bool": base > 30,
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(2.5, np.float32),
        "tensor": torch.arange(12).reshape(3, 4).t(),
        "text": "kept",
        "objects": np.array(["a", None], dtype=object),
    }
    moved = torchshm.to_device(batch)
    fake_cuda.synchronize()
    for key in ("strided", "reversed", "swapped", "bool", "empty", "scalar"):
        assert isinstance(moved[key], torch.Tensor), key
        np.testing.assert_array_equal(moved[key].numpy(), batch[key], err_msg=key)
    assert torch.equal(moved["tensor"], batch["tensor"])
    assert moved["text"] == "kept" and moved["objects"] is batch["objects"]


def test_a_forked_child_makes_no_cuda_call(fake_cuda, child, tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    sender = child(ctx, dc.send_batches, 1)
    batch = sender.receive()
    torchshm.to_device(batch)
    assert fake_cuda.registered
    log = tmp_path / "calls"
    # The child inherits the registration and the fake; it exits as usual
    # (torchshm's exit hook included) and reports the fake's violations.
    p = ctx.Process(target=_report_violations, args=(fake_cuda, str(log)))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert log.read_text() == "[]"
    del batch
    sender.send("next")
    assert sender.close() == 0


def _report_violations(fake, path):
    from multiprocessing import util

    def report():
        with open(path, "w") as f:
            f.write(repr(fake.violations))

    util.Finalize(None, report, exitpriority=-1000)  # after torchshm's exit


def test_a_process_unregisters_everything_before_it_exits(tmp_path):
    # A process that pinned a received batch: torchshm's exit hook undoes
    # every registration (before CUDA's teardown, and before any unmap).
    run = run_python(
        """
        import multiprocessing as mp, sys
        from multiprocessing import util
        import torchshm
        from torchshm._cuda import fake, runtime
        from tests import device_children as dc

        f = fake.FakeRuntime()
        runtime.install(f)  # for the whole process, its exit included
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=dc.send_batches, args=(inbox, outbox, 1))
        p.start()
        batch = outbox.get(timeout=60)
        torchshm.to_device(batch)
        assert f.registered
        def report():
            print(len(f.registered), f.check(), f.calls["unregister"])
        util.Finalize(None, report, exitpriority=-1000)  # after torchshm's
        inbox.put("done")
        p.join(60)
        """,
        env={k: v for k, v in os.environ.items() if k != "TORCHSHM_SESSION"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["0", "[]", "1"], run.stdout


# --- born batches, and a registered mapping that stays as it is (Note [Born
# batches pinned in place] in torchshm/_device.py, Note [A registered mapping
# stays as it is] in csrc/lifetime/segment.h)


@pytest.mark.parametrize("collate", ["torchshm.collate", "np.stack"])
def test_np_stack_batches_go_the_pinned_path_as_collates_do(fake_cuda, collate):
    # np.stack's arrive as snapshots mapped privately; their bytes are
    # copied from the segment's shared mapping, registered.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pin_memory without CUDA
        held = list(torchshm.device_loader(_loader(COLLATES[collate])))
    assert _wrong_batches(fake_cuda, held) == []
    assert fake_cuda.calls["register"] > 0
    assert fake_cuda.pageable_bytes == 0


def test_a_received_batch_written_here_goes_as_pageable_memory(fake_cuda, ctx, child):
    # A page the receiver wrote in its private mapping is its own: the
    # shared mapping no longer has those bytes.
    c = child(ctx, dc.send_born_batch)
    batch = c.receive()
    batch["x"][0, 0, :4] = -1.0
    on_device = torchshm.to_device(batch)
    fake_cuda.synchronize()
    assert torch.equal(on_device["x"], torch.from_numpy(batch["x"]))
    assert fake_cuda.pageable_bytes >= batch["x"].nbytes
    del batch
    c.send(None)
    assert c.close() == 0


def test_a_frozen_born_array_is_never_registered(fake_cuda):
    # A fork child sees its parent's born segment frozen (a private
    # mapping): here, the creator's own after a send.
    with torchshm.allocating():
        a = np.full(1 << 18, 3.0)
    received = ForkingPickler.loads(ForkingPickler.dumps(a))  # frozen at a send
    segment = _C.segment_of(_C.memory_owner(a))
    frozen, held = segment.data_frozen, segment.hold_for_device()
    del a, received, segment
    torchshm.trim()
    assert frozen and not held


def test_a_held_born_array_is_copied_at_its_send_not_frozen(fake_cuda):
    with torchshm.allocating():
        a = np.full(1 << 18, 3.0)
    segment = _C.segment_of(_C.memory_owner(a))
    assert segment.hold_for_device()
    before = torchshm.stats()["bytes_copied"]
    received = ForkingPickler.loads(ForkingPickler.dumps(a))
    copied = torchshm.stats()["bytes_copied"] - before
    frozen = segment.data_frozen
    segment.release_for_device()
    assert np.array_equal(received, a)
    del a, received, segment
    torchshm.trim()
    assert copied >= 1 << 21 and not frozen


def test_a_fork_child_does_not_register_its_inherited_born_array(tmp_path):
    run = run_python(
        """
        import os, sys
        import numpy as np
        import torchshm
        from torchshm._cuda import fake, runtime
        with torchshm.allocating():
            a = np.full(1 << 18, 3.0)
        pid = os.fork()  # a prepared fork: the born segment is frozen
        if pid == 0:
            f = fake.FakeRuntime(delay=0.01)  # the child's own runtime
            with runtime.use(f):
                moved = torchshm.to_device({"a": a})
                f.synchronize()
                ok = bool((moved["a"].numpy() == 3.0).all())
                print(ok, f.calls["register"], f.check(), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        """
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "True 0 []\n", run.stderr[-2000:]


@contextlib.contextmanager
def _memfd_mapping(flags, prot=None):
    """The address of 4 pages of a new memfd mapped with `flags` (mmap's),
    and the fd."""
    import mmap

    nbytes = 4 * _fake.PAGE
    fd = os.memfd_create("fake-rule")
    try:
        os.ftruncate(fd, nbytes)
        prot = mmap.PROT_READ | mmap.PROT_WRITE if prot is None else prot
        m = mmap.mmap(fd, nbytes, flags, prot)
        yield np.frombuffer(m, np.uint8).ctypes.data, fd
    finally:
        os.close(fd)


def test_the_fake_sees_a_registered_range_remapped_shared_to_private():
    import mmap

    fake = _fake.FakeRuntime()
    with _memfd_mapping(mmap.MAP_SHARED) as (address, fd):
        fake.register(address, 4 * _fake.PAGE)
        assert fake.check() == []
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3
        libc.mmap.argtypes += [ctypes.c_long]
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | 0x10
        assert libc.mmap(address, 4 * _fake.PAGE, prot, flags, fd, 0) == address
        assert [v for v in fake.check() if "remapped" in v]


def test_the_fake_sees_a_private_mapping_of_a_file_registered():
    import mmap

    fake = _fake.FakeRuntime()
    with _memfd_mapping(mmap.MAP_PRIVATE) as (address, _):
        fake.register(address, 4 * _fake.PAGE)
        assert [v for v in fake.violations if "private mapping" in v]
        fake.unregister(address)


# --- the fake's other rules, each with what the library does under it


def test_the_fake_refuses_a_read_only_range():
    import mmap

    fake = _fake.FakeRuntime()
    with _memfd_mapping(mmap.MAP_SHARED, mmap.PROT_READ) as (address, _):
        with pytest.raises(_runtime.CudaError) as refused:
            fake.register(address, 4 * _fake.PAGE)
    assert refused.value.code == _fake.INVALID_VALUE
    assert fake.registered == {}


def test_past_the_locked_memory_limit_batches_go_pageable_and_arrive_right():
    fake = _fake.FakeRuntime(delay=LATE, seed=2, lockable=1 << 20)
    with _runtime.use(fake):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                held = list(torchshm.device_loader(_loader(torchshm.collate)))
            assert _wrong_batches(fake, held) == []
        finally:
            _pins.release_all()
    assert fake.pageable_bytes > 0
    refused = [w for w in caught if "pinning shared memory" in str(w.message)]
    assert len(refused) == 1
    assert fake.check() == [] and fake.registered == {}


def test_the_fake_sees_an_unregister_while_a_copy_from_the_range_is_pending():
    import mmap

    fake = _fake.FakeRuntime(delay=10.0)
    with _memfd_mapping(mmap.MAP_SHARED) as (address, _):
        fake.register(address, 4 * _fake.PAGE)
        stream = fake.copy_stream(torch.device("cpu", 0))
        page = _device._bytes_at(address, _fake.PAGE)
        fake.copy(torch.empty(_fake.PAGE, dtype=torch.uint8), page, stream)
        fake.unregister(address)
        assert [v for v in fake.violations if "pending" in v]
        fake.synchronize()


def test_unpinning_waits_for_the_copies_that_read_the_segment(fake_cuda, monkeypatch):
    # The bound unpins idle segments while their batches' copies may still
    # be pending; the fake_cuda fixture fails on an unregister under one.
    monkeypatch.setenv("TORCHSHM_PIN_BYTES", str(1 << 20))
    fake_cuda.delay = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        held = list(torchshm.device_loader(_loader(torchshm.collate)))
    assert fake_cuda.calls["unregister"] > 0
    assert _wrong_batches(fake_cuda, held) == []


@pytest.mark.parametrize("hand_over", ["done", "skipped"])
def test_a_batch_is_read_on_the_callers_stream_after_its_copy(
    fake_cuda, child, monkeypatch, hand_over
):
    # to_device makes the caller's stream wait for torchshm's copies; a
    # library that skipped that would let a kernel read uncopied bytes.
    import multiprocessing as mp

    if hand_over == "skipped":
        monkeypatch.setattr(fake_cuda, "hand_over", lambda event, buffer: None)
    fake_cuda.delay = 10.0  # no copy completes by itself
    c = child(mp.get_context("fork"), dc.send_batches, 1)
    batch = c.receive()
    want = torch.from_numpy(batch["x"].copy())
    on_device = torchshm.to_device(batch)
    fake_cuda.consume(on_device["x"])
    late = [v for v in fake_cuda.violations if "never waited" in v]
    fake_cuda.violations.clear()
    fake_cuda.synchronize()
    del batch
    c.send("next")
    assert c.close() == 0
    assert bool(late) == (hand_over == "skipped")
    assert torch.equal(on_device["x"], want)
