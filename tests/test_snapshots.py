"""One snapshot for an unchanged array sent many times, mapped privately by
its receivers, read-only arrays too (Notes [Resending an unchanged array] in
csrc/send/snapshots.h and [Snapshots are mapped privately] in
csrc/lifetime/segment.h)."""

import gc
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import torchshm
from tests import snapshot_children as kids
from tests.conftest import stats_delta
from torchshm import _C
from torchshm._send import sender as _sender

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess

# A copy with a segment of its own: the sizes resends are remembered for.
BIG = _sender.PACK_LIMIT // 8 + 4096


def model(n=BIG):
    return np.arange(n, dtype=np.float64)


def test_an_unchanged_array_sent_to_many_receivers_is_one_snapshot(ctx, child):
    sent = model()
    before = torchshm.stats()
    children = [child(ctx, kids.describe_each) for _ in range(3)]
    seen = []
    for c in children:  # one after another: see the Note on concurrent sends
        c.send(sent)
        seen.append(c.receive())
    for c in children:
        c.send(None)
        assert c.close() == 0
    delta = stats_delta(before)
    assert len({s["segment"] for s in seen}) == 1, seen
    assert delta["arrays_shared"] == 1 and delta["snapshots_resent"] == 2
    assert all(s["head"] == [0, 1, 2, 3] and s["mapping"] == "rw-p" for s in seen)


def test_a_model_of_many_small_layers_is_one_copy_for_many_receivers(ctx, child):
    """Layers that share a message's chunk are resent as an array of a
    segment of its own is (Note [Resending an unchanged array] in
    csrc/send/snapshots.h): a model sent to 3 tasks is copied once."""
    layers = [np.arange(65_536.0) + i for i in range(16)]  # 512 KiB each
    before = torchshm.stats()
    children = [child(ctx, kids.describe_layers) for _ in range(3)]
    seen = []
    for c in children:  # one after another: see the Note on concurrent sends
        c.send(layers)
        seen.append(c.receive())
    delta = stats_delta(before)
    for c in children:
        c.send(None)
        assert c.close() == 0
    assert delta["snapshots_resent"] == 2 * len(layers)
    assert delta["bytes_copied"] == sum(layer.nbytes for layer in layers)
    for i, layer in enumerate(layers):
        assert len({s[i]["segment"] for s in seen}) == 1
        assert all(s[i]["head"] == layer[:4].tolist() for s in seen)


def test_no_receiver_sees_another_receivers_writes_nor_does_the_sender(ctx, child):
    sent = model()
    first = child(ctx, kids.receive_and_write, -1.0)
    first.send(sent)
    a = first.receive()
    assert first.receive() == "written"
    second = child(ctx, kids.receive_and_write, -2.0)
    second.send(sent)  # unchanged: the same snapshot again
    b = second.receive()
    assert b["segment"] == a["segment"]
    assert b["head"] == [0, 1, 2, 3] and b["tail"] == sent[-4:].tolist()
    assert second.receive() == "written"
    first.send("look")
    assert first.receive()["head"] == [-1.0] * 4  # its own write, kept
    second.send("look")
    assert second.receive()["head"] == [-2.0] * 4
    assert sent[:4].tolist() == [0, 1, 2, 3]
    # Sent a third time, to the first receiver, which wrote over its pages of
    # that snapshot and still holds them: it gets the snapshot's bytes, over
    # a private mapping of their own (it opens the segment again).
    first.send(sent)
    third = first.receive()
    assert third["head"] == [0, 1, 2, 3] and third["segment"] == a["segment"]
    assert third["mapping"] == "rw-p"
    first.send("look")
    assert first.receive()["head"] == [-1.0] * 4  # the first still its own
    copied = []
    for c in (first, second):
        c.send(None)
        copied.append(c.receive()["arrays_copied_on_receive"])
        assert c.close() == 0
    assert copied == [0, 0]


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_an_array_changed_between_sends_arrives_changed(where, ctx, child):
    sent = model()
    c = child(ctx, kids.describe_each)
    c.send(sent)
    first = c.receive()
    index = {"first": 0, "middle": len(sent) // 2, "last": -1}[where]
    sent[index] = -7.0
    before = torchshm.stats()
    c.send(sent)
    second = c.receive()
    c.send(None)
    assert c.close() == 0
    assert stats_delta(before)["snapshots_resent"] == 0
    probe = {"first": second["head"][0], "last": second["tail"][-1]}
    assert probe.get(where, -7.0) == -7.0
    assert first["head"][0] == 0 and first["tail"][-1] == len(sent) - 1
    if where == "middle":
        c = child(ctx, kids.describe_each)
        c.send(sent[index : index + 4])  # small: pickled, the same bytes
        assert c.receive()["head"][0] == -7.0
        c.send(None)
        assert c.close() == 0


@pytest.mark.spawn_one_case
@pytest.mark.parametrize("kind", ["snapshot", "shared", "small"])
def test_a_write_to_a_received_read_only_array_stays_in_its_process(kind, ctx, child):
    """NumPy's flag stays, but torch (and the int8 .base) can write a
    read-only array: that write is the writer's alone, never a crash, never
    seen by the sender or another receiver, nor (for a snapshot) by another
    message over the same bytes. pandas 3's .to_numpy() arrays are such."""
    sent = model(BIG if kind != "small" else 40_000)
    if kind == "shared":
        sent = torchshm.share(sent)
    sent.flags.writeable = False
    writer = child(ctx, kids.write_read_only)
    writer.send(sent)
    seen, written = writer.receive(), writer.receive()
    assert not seen["writeable"] and seen["segment"] is not None
    assert seen["head"] == [0, 1, 2, 3]
    assert written["head"] == [100, 0, 2, 3]  # its torch and .base writes
    assert not written["writeable"]
    other = child(ctx, kids.describe_each)
    other.send(sent)
    assert other.receive()["head"] == [0, 1, 2, 3]
    other.send(None)
    assert other.close() == 0
    assert sent[:4].tolist() == [0, 1, 2, 3]
    writer.send(sent)  # again, to the writer, while it holds the first
    again = writer.receive()
    assert not again["writeable"]
    assert again["segment"] == seen["segment"]  # shared, or the snapshot resent
    # A snapshot's messages are apart; one process's read-only arrays of
    # shared memory lie over one mapping: that process's view of it.
    assert again["head"] == ([100, 0, 2, 3] if kind == "shared" else [0, 1, 2, 3])
    writer.send(None)
    assert writer.close() == 0


def test_writable_arrays_map_privately_for_snapshots_and_shared_for_share(ctx, child):
    c = child(ctx, kids.describe_each)
    c.send(model())
    snapshot = c.receive()
    c.send(torchshm.share(model()))
    shared = c.receive()
    c.send(None)
    assert c.close() == 0
    assert snapshot["mapping"] == "rw-p" and shared["mapping"] == "rw-s"


def test_a_receiver_sends_on_a_reference_until_it_writes(ctx, child):
    sent = model()
    c = child(ctx, kids.send_on)
    c.send(sent)
    back = c.receive()  # over the same snapshot: nothing was written
    assert kids.segment_of(back) is not None
    assert back[:4].tolist() == [0, 1, 2, 3]
    before = torchshm.stats()
    c.send("write")
    written = c.receive()  # its page written: a new snapshot
    assert written[1] == -5.0 and written[2] == 2.0
    assert kids.segment_of(written) != kids.segment_of(back)
    assert back[1] == 1.0
    c.send("done")
    assert c.close() == 0
    assert stats_delta(before)["arrays_received"] == 1


def test_one_process_receiving_one_snapshot_twice_keeps_the_messages_apart():
    sent = model()
    message = ForkingPickler.dumps(sent)
    again = ForkingPickler.dumps(sent)
    before = torchshm.stats()
    first = ForkingPickler.loads(message)
    # While the first lives: a private mapping of its own (the creator has
    # the fd; a receiver would get a copy, as the test above shows).
    second = ForkingPickler.loads(again)
    first[:4] = -1.0
    assert second[:4].tolist() == [0, 1, 2, 3]
    name = kids.segment_of(first)
    assert kids.segment_of(second) == name
    assert stats_delta(before)["arrays_copied_on_receive"] == 0
    del first, second
    gc.collect()
    third = ForkingPickler.loads(ForkingPickler.dumps(sent))
    # The private mapping again, its written pages dropped.
    assert kids.segment_of(third) == name
    assert third[:4].tolist() == [0, 1, 2, 3]
    assert sent[:4].tolist() == [0, 1, 2, 3]


def test_share_of_a_received_snapshot_is_shared_memory():
    received = ForkingPickler.loads(ForkingPickler.dumps(model()))
    shared = torchshm.share(received)
    assert kids.segment_of(shared) != kids.segment_of(received)
    assert kids.mapping_of(shared) == "rw-s"
    again = torchshm.share(shared)  # already shared: the same memory
    assert np.shares_memory(again, shared)


def test_a_write_through_the_base_beyond_the_array_is_dropped_before_reuse():
    sent = model()
    first = ForkingPickler.loads(ForkingPickler.dumps(sent))
    base = first.base  # an int8 tensor over the whole private mapping
    name = kids.segment_of(first)
    assert base.numel() > sent.nbytes  # a segment's size class has a tail
    tail = int(base[-1])
    base[-1] = tail ^ 0x5A  # written where no array of the message lies
    del first, base
    gc.collect()
    again = ForkingPickler.loads(ForkingPickler.dumps(sent))  # the same snapshot
    assert kids.segment_of(again) == name
    assert int(again.base[-1]) == tail  # the segment's byte, not the old write


def test_a_receiver_caches_the_mapping_once_the_arrays_are_gone(ctx, child):
    # The arrays lie over a private mapping, not over the view that holds
    # the segment's slot: the cache must still wait for them.
    c = child(ctx, kids.cache_while_held)
    c.send(model())
    held, dropped = c.receive()
    c.send(None)
    assert c.close() == 0
    assert (held, dropped) == (False, True)


def test_the_sender_forgets_the_snapshots_of_arrays_that_died():
    # Note [A weak reference per sent array] in csrc/lifetime/live.cpp: each
    # copy is remembered under a weak reference whose callback forgets it.
    # 100 layers in the message's chunk and one in a segment of its own.
    before = _C.snapshots_remembered()
    layers = [np.full(1024, i, dtype=np.float64) for i in range(100)] + [model()]
    received = ForkingPickler.loads(ForkingPickler.dumps(layers))
    assert _C.snapshots_remembered() == before + 101
    del layers
    gc.collect()
    assert _C.snapshots_remembered() == before
    assert [int(a[0]) for a in received[:100]] == list(range(100))
    assert received[100][-1] == BIG - 1
