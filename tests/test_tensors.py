"""Torch tensors through torchshm's memory (the tensor switch: TORCHSHM_TENSORS=1
or register(tensors=True)): rebuilt as torch rebuilds them, aliased both
ways, one storage per segment, torch's own path where torch keeps it, and
the lifetimes arrays have (Note [Tensor storages] in csrc/send/tensors.h)."""

import json
import multiprocessing as mp
import os
import pickle
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchshm
from tests import tensor_children as tc
from tests.conftest import TIMEOUT, open_fds, run_python, stats_delta
from tests.test_lifetime import kill_and_expect_memory_back
from torchshm._compat import untyped_storage
from torchshm._native import _C
from torchshm._send import tensors as _tensors

# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_os]


@pytest.fixture
def switch_on():
    torchshm.register(tensors=True)
    assert os.environ["TORCHSHM_TENSORS"] == "1"


def in_segment(tensor):
    return tc.segment_name(tensor) is not None


def variants():
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    leaf = torch.ones(5, 7, requires_grad=True)
    return {
        "contiguous": base,
        "transposed": base.t(),
        "offset_and_strides": base[1:, ::3],
        "bfloat16": torch.arange(40).to(torch.bfloat16),
        "bool": torch.arange(40) % 3 == 0,
        "complex64": torch.randn(30, dtype=torch.complex64),
        "int8_scalar": torch.tensor(3, dtype=torch.int8),
        "requires_grad": leaf,
        "parameter": torch.nn.Parameter(torch.randn(4, 4)),
        "empty": torch.empty(0, 3),
    }


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("name", list(variants()))
def test_a_tensor_arrives_as_torch_rebuilds_it_through_torchshm(
    ctx, child, switch_on, name
):
    sent = variants()[name]
    expected = sent.detach().clone()
    c = child(ctx, tc.echo)
    c.send(sent)
    back, seen = c.receive()  # the child's echo of the parent's own tensor
    assert seen["dtype"] == sent.dtype and seen["shape"] == tuple(sent.shape)
    assert seen["stride"] == sent.stride() and seen["offset"] == sent.storage_offset()
    assert seen["requires_grad"] == sent.requires_grad
    assert seen["type"] is type(sent)
    has_bytes = untyped_storage(sent).nbytes() > 0
    # Storages with bytes are moved into a segment in place, and arrive there.
    assert seen["segment"] == has_bytes == in_segment(sent)
    assert seen["shared"] == has_bytes
    torch.testing.assert_close(back.detach(), expected, rtol=0, atol=0)
    if has_bytes:  # the storage came home: it is the parent's own again
        assert untyped_storage(back).data_ptr() == untyped_storage(sent).data_ptr()
    c.send(None)


def test_writes_are_seen_both_ways(ctx, child, switch_on):
    tensor = torch.zeros(1 << 16)
    c = child(ctx, tc.write_and_wait)
    c.send(tensor)
    assert c.receive() == ("written", True)
    assert tensor[0] == 7 and tensor.is_shared()  # the child's write, here
    tensor[0] = 11
    c.send("look")
    assert c.receive() == 11.0  # ours, there


def test_one_storage_stays_one_storage_across_messages(ctx, child, switch_on):
    base = torch.arange(1000, dtype=torch.float32)
    c = child(ctx, tc.same_storage)
    c.send((base[10:], base))
    c.send((base[:5], None))
    same, same_as_whole, offset_kept = c.receive()
    assert same and same_as_whole and offset_kept


def test_a_sender_that_exits_right_after_put_still_delivers(ctx):
    outbox = ctx.Queue()
    p = ctx.Process(target=tc.send_and_exit, args=(outbox, 1 << 18))
    p.start()
    try:
        p.join(TIMEOUT)
        assert p.exitcode == 0
        got = outbox.get(timeout=TIMEOUT)
        assert torch.equal(got, torch.arange(1 << 18, dtype=torch.float64))
        assert in_segment(got)
        del got
    finally:
        if p.is_alive():
            p.kill()
            p.join(TIMEOUT)
        outbox.close()
        outbox.join_thread()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_consumer_under_ulimit_n_64_holds_1000_tensors(child, method, switch_on):
    # torch's file_descriptor path keeps an fd per live storage in the
    # receiver: it fails after ~50 ("received 0 items of ancdata").
    c = child(mp.get_context(method), tc.hold_many, 64)
    for i in range(1000):
        c.send(torch.full((1024,), i, dtype=torch.int32))
    c.send(None)
    result = c.outbox.get(timeout=4 * TIMEOUT)
    assert result == dict(received=1000, good=1000, fds=result.get("fds"))
    assert result["fds"] < 64


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_killed_sender_of_tensors_frees_their_memory_within_5_s(method):
    ctx = mp.get_context(method)
    outbox = ctx.Queue()
    p = ctx.Process(target=tc.send_tensors_and_wait, args=(outbox, 8, 400_000))
    p.start()
    try:
        # All held at once: a dropped one's segment may carry the next.
        got = [outbox.get(timeout=TIMEOUT) for _ in range(8)]
        assert [float(t[0]) for t in got] == [float(i) for i in range(8)]
        names = {tc.segment_name(t) for t in got}
        del got
        torchshm.trim()  # the mappings this process keeps for reuse
        assert None not in names and len(names) == 8
        kill_and_expect_memory_back(p, names)
    finally:
        if p.is_alive():
            p.kill()
        p.join(TIMEOUT)
        outbox.close()


def test_past_its_fd_share_the_sender_falls_back_to_torch_once(child, ctx):
    # A hard limit of 256: torchshm keeps at most 64 segment fds; torch's
    # path needs two fds per storage while a receiver fetches it.
    count = 80
    c = child(ctx, tc.send_under_fd_limit, count, 256)
    got = [c.receive() for _ in range(count)]
    c.send("received")
    fallbacks = c.receive()
    assert [float(t[0]) for t in got] == [float(i) for i in range(count)]
    through = sum(map(in_segment, got))
    assert 0 < through < count  # torchshm's first, then torch's
    assert fallbacks == {"too many open files": count - through}
    del got
    c.send("done")


# Small storages: blocks of slabs (Note [Small storages] in csrc/send/tensors.h) --


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("nbytes", [4, 4096, 64 << 10])
def test_a_small_storage_is_a_block_of_a_slab_shared_both_ways(
    ctx, child, switch_on, nbytes
):
    tensors = [torch.full((nbytes // 4,), i, dtype=torch.int32) for i in range(300)]
    fds = open_fds()
    c = child(ctx, tc.hold_small)
    c.send(tensors)
    seen = c.receive()
    assert seen["good"] == seen["ours"] == 300
    # A slab holds many: no segment, so no fd, per storage, here or there
    # (the child's pipes and sentinel take a few).
    slabs = -(-300 * nbytes // torchshm._C.SLAB_BYTES) + 1
    assert len(open_fds() - fds) <= slabs + 8
    assert seen["fds"] < 40
    assert all(_C.block_of(_tensors.shared_view(untyped_storage(t))) for t in tensors)
    assert c.receive() == "written"
    assert tensors[0][0] == 99  # the child's write, here: one memory
    assert all(bool((t == i).all()) for i, t in enumerate(tensors) if i)
    c.send("go")


def test_small_storages_a_consumer_keeps_share_their_senders_slab(ctx, child):
    # A DataLoader's labels: each batch's block dies in its worker once sent,
    # while the main process keeps the batch. The worker carves on in the
    # same slab (Note [Small blocks] in csrc/lifetime/slabs.h), not a slab per batch.
    count = 64
    c = child(ctx, tc.send_small_one_by_one, count)
    kept = []
    for _ in range(count):
        kept.append(c.receive())
        c.send("next")
    assert [float(t[0]) for t in kept] == [float(i) for i in range(count)]
    assert len({tc.segment_name(t) for t in kept}) == 1
    c.send("go")


def test_many_small_storages_cost_a_slab_not_a_segment_each(switch_on):
    before = torchshm.stats()
    tensors = [torch.ones(1024) for _ in range(1000)]  # 4 KiB each
    pickle.loads(ForkingPickler.dumps(tensors))  # moves them (and reads the tickets)
    after = stats_delta(before)
    assert after["storages_moved"] == 1000
    assert after["segments_created"] + after["segments_reused"] <= 8
    # 4 MiB of bytes: a few 1 MiB slabs, not 1000 segments of 64 KiB. (The
    # segments' own sizes: Shmem moves with every process of the machine.)
    slabs = {}
    for t in tensors:
        owner, _ = _C.block_of(_tensors.shared_view(untyped_storage(t)))
        slabs[_C.segment_of(owner).name] = _C.segment_of(owner).capacity
    assert sum(slabs.values()) < 32 << 20
    assert all(t.is_shared() for t in tensors)


def test_new_shared_carves_small_storages_and_they_travel(switch_on):
    storage = torch.UntypedStorage._new_shared(256)
    assert storage.is_shared() and _C.block_of(_tensors.shared_view(storage))
    tensor = torch.empty(0, dtype=torch.int64).set_(storage)
    tensor.copy_(torch.arange(32))
    back = pickle.loads(ForkingPickler.dumps(tensor))
    # In one process the block's storage is found again: the same memory.
    assert untyped_storage(back).data_ptr() == storage.data_ptr()
    torch.testing.assert_close(back, torch.arange(32))


def test_an_array_over_a_small_storage_arrives_with_its_bytes(ctx, child, switch_on):
    tensor = torch.arange(100, dtype=torch.float32)
    c = child(ctx, tc.echo)
    c.send(tensor)  # moves the storage into a block
    c.receive()
    array = tensor.numpy()[10:20]  # an array over the block, at an offset
    c.send(array)
    back, _ = c.receive()
    np.testing.assert_array_equal(back, np.arange(10, 20, dtype=np.float32))
    c.send(None)


def test_a_forked_child_frees_inherited_small_storages_and_carves_its_own(
    child, switch_on
):
    inherited = torch.full((16,), 3.0)
    pickle.loads(ForkingPickler.dumps(inherited))  # moved into a block
    c = child(mp.get_context("fork"), tc.free_inherited_and_send)
    c.send(inherited)
    got = c.receive()
    assert torch.equal(got, torch.full((32,), 5.0)) and got.is_shared()
    assert torch.equal(inherited, torch.full((16,), 3.0))
    c.send("go")


# In this process: what stays torch's, and the switch itself -----------------


def round_trip(obj):
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


@pytest.mark.parametrize(
    "switch, torch_shared", [(False, False), (True, True)], ids=["off", "torch_shared"]
)
def test_torchs_path_carries_what_the_switch_leaves_to_torch(
    child, switch, torch_shared
):
    c = child(mp.get_context("spawn"), tc.torchs_path, switch, torch_shared)
    seen = c.receive()
    assert seen == dict(
        in_segment=False,
        back_in_segment=False,
        shared=True,  # torch shared it, in /dev/shm
        equal=True,
        moved=not torch_shared,  # torch moved it, unless it had already
    )


def test_torch_refuses_what_it_refuses(switch_on):
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="Cowardly refusing"):
        ForkingPickler.dumps(leaf * 2)


def test_a_moved_storage_is_shared_and_share_memory_keeps_it(switch_on):
    tensor = torch.arange(100.0)
    view = tensor[10:20]
    round_trip(tensor)
    assert in_segment(tensor) and in_segment(view)  # every view moved with it
    assert torch.equal(view, torch.arange(10.0, 20.0))
    where = untyped_storage(tensor).data_ptr()
    assert tensor.is_shared() and tensor.share_memory_() is tensor
    assert untyped_storage(tensor).data_ptr() == where
    with pytest.raises(RuntimeError, match="not resizable"):
        tensor.resize_(1000)


def test_torchshm_empty_goes_by_reference_without_the_switch():
    torchshm.register(tensors=False)
    tensor = torchshm.empty(3, 4, dtype=torch.float16)
    assert tensor.shape == (3, 4) and tensor.dtype == torch.float16
    assert in_segment(tensor) and tensor.is_shared()
    before = torchshm.stats()
    back = round_trip(tensor)
    delta = stats_delta(before)
    assert delta["storages_sent"] == 1 and delta["storages_moved"] == 0
    assert untyped_storage(back).data_ptr() == untyped_storage(tensor).data_ptr()
    assert torchshm.empty((2, 2), requires_grad=True).requires_grad


def test_torchshm_empty_takes_sizes_as_torch_empty_does_and_names_bad_ones():
    assert torchshm.empty(np.int64(3), 2).shape == (3, 2)
    assert torchshm.empty(torch.Size([2, 5])).shape == (2, 5)
    assert torchshm.empty([]).shape == ()
    for bad in [(2.5,), ((2, 2.5),), ("3",)]:
        with pytest.raises(TypeError, match=r"size must be ints or one sequence"):
            torchshm.empty(*bad)


def test_new_shared_makes_torchshm_storages_only_while_the_switch_is_on():
    torchshm.register(tensors=False)
    assert not in_segment(torch.empty(0).set_(torch.UntypedStorage._new_shared(64)))
    torchshm.register(tensors=True)
    storage = torch.UntypedStorage._new_shared(64)
    assert storage.nbytes() == 64 and storage.is_shared()
    assert in_segment(torch.empty(0).set_(storage))


def test_unregister_gives_torch_its_methods_back():
    def patched():
        storage = torch.UntypedStorage
        return (
            storage.is_shared is _tensors._is_shared,
            storage.share_memory_ is _tensors._share_memory_,
            storage._new_shared.__func__ is _tensors._new_shared,
        )

    assert patched() == (True, True, True)
    torchshm.unregister()
    assert patched() == (False, False, False)
    torchshm.register()
    assert patched() == (True, True, True)


def test_the_switch_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHSHM_TENSORS", "yes")
    torchshm.register()
    assert _tensors.enabled()
    monkeypatch.setenv("TORCHSHM_TENSORS", "maybe")
    with pytest.raises(ValueError, match="TORCHSHM_TENSORS"):
        torchshm.register()


@pytest.mark.parametrize("setting", [None, "0"])
def test_import_alone_sends_tensors_through_torchshm_unless_turned_off(setting):
    """Note [Tensors by default]: in a fresh interpreter with no setting, a
    tensor and the default collate's batch go through torchshm's memory;
    TORCHSHM_TENSORS=0 leaves them to torch."""
    code = (
        "import json, pickle, torch, torchshm\n"
        "from multiprocessing.reduction import ForkingPickler\n"
        "from torch.utils.data import default_collate\n"
        "from tests import tensor_children as tc\n"
        "t = torch.arange(100_000.0)\n"
        "got = pickle.loads(ForkingPickler.dumps(t))\n"
        "batch = torch.UntypedStorage._new_shared(1 << 20)\n"
        "print(json.dumps([tc.segment_name(got) is not None, torch.equal(got, t),"
        " tc.segment_name(torch.empty(0).set_(batch)) is not None]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHSHM_TENSORS"}
    if setting is not None:
        env["TORCHSHM_TENSORS"] = setting
    run = run_python(code, env=env, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    through_torchshm, equal, batch_in_segment = json.loads(run.stdout)
    assert equal
    assert through_torchshm == batch_in_segment == (setting is None)


# DataLoader: the default collate ----------------------------------------------


class Samples(Dataset):
    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if self.kind == "numpy":
            return np.full(4096, i, dtype=np.float32)
        return torch.full((4096,), float(i))


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_default_collate_batches_are_made_in_torchshm_memory(ctx, switch_on, kind):
    loader = DataLoader(
        Samples(kind),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=ctx,
        timeout=TIMEOUT,
        # A fork server started before the switch was set has its
        # environment without it: the hook carries it.
        worker_init_fn=torchshm.chain(None, tensors=True),
        pin_memory=True,  # a no-op warning without an accelerator: it still runs
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "pin_memory", UserWarning)
        batches = list(loader)
    assert len(batches) == 4
    for b, batch in enumerate(batches):
        assert batch.shape == (4, 4096) and batch.is_shared() and in_segment(batch)
        assert batch[:, 0].tolist() == [float(4 * b + i) for i in range(4)]


def test_a_pickle_to_a_file_stays_by_value(switch_on):
    tensor = torch.arange(10.0)
    assert torch.equal(pickle.loads(pickle.dumps(tensor)), tensor)
    assert not in_segment(tensor)


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("switch", [False, True])
@pytest.mark.parametrize("forwarder_writes", [True, False])
def test_a_received_arrays_base_sent_on_carries_its_bytes_and_no_one_elses(
    ctx, child, switch, forwarder_writes
):
    """The int8 tensor under a received array (its .base) sent on is no
    window into the snapshot: the next receiver gets the forwarder's bytes
    (its writes included), and its own writes reach nobody who holds that
    snapshot, nor the forwarder (Note [Tensor storages] in csrc/send/tensors.h)."""
    torchshm.register(tensors=switch)
    sent = np.full(1 << 20, 7, dtype=np.uint8)
    holder = child(ctx, tc.forward_base, switch, None)  # never writes
    holder.send(sent)
    holder.receive()
    forwarder = child(ctx, tc.forward_base, switch, 111 if forwarder_writes else None)
    forwarder.send(sent)
    base, at = forwarder.receive()
    expected = 111 if forwarder_writes else 7
    assert int(base[at]) == expected
    assert torchshm.is_shared(base.numpy())  # by reference, or a new snapshot
    writer = child(ctx, tc.write_received_tensor, switch)
    writer.send((base, at, 55))
    assert writer.receive() == (expected, 55)
    assert int(base[at]) == expected  # the writer's write is its own
    holder.send("go")
    assert holder.receive() == 7  # the snapshot it holds never changed
    forwarder.send("go")
    assert forwarder.receive() == expected
    writer.send("go")
    assert sent[0] == 7
    for c in (holder, forwarder, writer):
        assert c.close() == 0
