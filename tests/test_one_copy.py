"""One copy of a sent array in memory: the sender's pages become its
snapshot's (Note [One copy of a sent array] in csrc/send/one_copy.h)."""

import gc
import json
import mmap

import numpy as np
import pytest

import torchshm
from tests import one_copy_children as kids
from tests.conftest import run_python, stats_delta
from torchshm import _C
from torchshm._send import sender as _sender

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess

MIB = 1 << 20
# Large enough for a segment of its own and for glibc's mmap()ed chunks.
BIG = 64 * MIB


def model(nbytes=BIG, value=None, start=0):
    """A model's array in memory of its own, an mmap()ed chunk of glibc's, as
    a large array of a process that started lately is. This long-lived test
    process's heap may hold a free chunk large enough for it, and a block
    from there is copied as any heap block: such chunks are held meanwhile."""
    taken = []
    while not kids.own_chunk(probe := np.empty(nbytes, np.uint8)):
        taken.append(probe)
        assert len(taken) < 64, "no mmap()ed chunk from glibc's malloc"
    del probe
    if value is None:
        made = np.arange(start, start + nbytes // 8, dtype=np.float64)
    else:
        made = np.full(nbytes // 8, value, dtype=np.float64)
    assert kids.own_chunk(made)
    return made


def described(array):
    return kids.describe(array)


def test_a_model_sent_to_four_tasks_is_one_copy_in_memory(ctx, child):
    """256 MiB in two layers to 4 receivers that read every page: the PSS of
    sender + receivers grows by one model, not two (the sender's private
    copy beside the snapshot, as before)."""
    nbytes = 256 * MIB
    children = [child(ctx, kids.hold_and_report) for _ in range(4)]
    for c in children:  # each started and idle before the baseline
        c.send("look")
        assert c.receive() == []
    pids = [c.process.pid for c in children]
    before = sum(kids.pss_bytes(p) for p in pids) + kids.pss_bytes("self")
    layers = [model(nbytes // 2, start=i) for i in range(2)]
    sent_before = torchshm.stats()
    seen = []
    for c in children:  # one after another: see the Note on concurrent sends
        c.send(layers)
        seen.append(c.receive())
    after = sum(kids.pss_bytes(p) for p in pids) + kids.pss_bytes("self")
    delta = stats_delta(sent_before)
    expected = [described(layer) for layer in layers]
    assert all(s[1] == expected for s in seen)
    assert delta["bytes_copied"] == nbytes  # one snapshot for all four
    assert delta["bytes_one_copy"] >= nbytes - 2 * 4096 * len(layers)
    copies = (after - before) / nbytes
    assert copies < 1.25, f"{copies:.2f} copies of the model in memory"
    for c in children:
        c.send(None)
        assert c.close() == 0


def test_the_owner_writes_after_the_send_and_no_receiver_sees_it(ctx, child):
    sent = model()
    receiver = child(ctx, kids.hold_and_report)
    receiver.send(sent)
    _, first = receiver.receive()
    assert first == described(model())
    sent[:] = -1.0  # every page, the partial first and last ones too
    receiver.send("look")
    (again,) = receiver.receive()
    assert again == first
    assert float(sent.sum()) == -sent.size  # the owner reads its own writes
    receiver.send(sent)  # sent again: a new snapshot of what it holds now
    _, second = receiver.receive()
    assert second == described(sent)
    assert _C.one_copy_held() >= 1
    receiver.send(None)
    assert receiver.close() == 0


def test_a_resend_is_by_reference_until_any_page_is_written(child):
    """An unchanged array sent again names its snapshot (compared by the page
    table, its pages being the snapshot's); a write to one page in the
    middle, which no comparison of the partial first and last pages sees,
    makes a new snapshot."""
    sent = model()
    receiver = child(torchshm_ctx(), kids.hold_and_report)
    receiver.send(sent)
    assert receiver.receive()[1] == described(model())
    before = torchshm.stats()
    receiver.send(sent)
    assert receiver.receive()[1] == described(model())
    delta = stats_delta(before)
    assert (delta["snapshots_resent"], delta["bytes_copied"]) == (1, 0)
    sent[sent.size // 2] = -1.0
    receiver.send(sent)
    assert receiver.receive()[1] == described(sent)
    delta = stats_delta(before)
    assert (delta["snapshots_resent"], delta["bytes_copied"]) == (1, BIG)
    receiver.send("look")  # each held message as it was when sent
    assert receiver.receive() == [described(model())] * 2 + [described(sent)]
    receiver.send(None)
    assert receiver.close() == 0


def test_the_owner_frees_the_array_while_a_receiver_holds_it(ctx, child):
    sent = model()
    expected = described(sent)
    held = _C.one_copy_held()
    receiver = child(ctx, kids.hold_and_report)
    receiver.send(sent)
    assert receiver.receive()[1] == expected
    assert _C.one_copy_held() == held + 1
    del sent
    gc.collect()
    assert _C.one_copy_held() == held
    # New arrays of the same size meanwhile: the pool may not take the
    # segment the receiver holds.
    for value in (5.0, 6.0):
        receiver.send(model(value=value))
        assert receiver.receive()[1]["head"] == [value] * 4
    receiver.send("look")
    assert receiver.receive()[0] == expected
    receiver.send(None)
    assert receiver.close() == 0


def test_a_fork_after_the_send_keeps_the_array_as_it_was(child):
    """A child forked (prepared by torchshm) after the send inherits the
    sender's mapping of the snapshot, and a slot in it: the parent freeing
    the array and sending more of the same size reuses nothing under it."""
    import multiprocessing as mp

    fork = mp.get_context("fork")
    sent = model()
    expected = described(sent)
    receiver = child(fork, kids.hold_and_report)
    receiver.send(sent)
    receiver.receive()
    inherited = child(fork, kids.report_inherited, sent)
    receiver.send(None)
    assert receiver.close() == 0
    del sent
    gc.collect()
    other = child(fork, kids.hold_and_report)
    for value in (5.0, 6.0, 7.0):
        array = model(value=value)
        other.send(array)
        other.receive()
        del array
    other.send(None)
    assert other.close() == 0
    inherited.send("look")
    assert inherited.receive() == expected
    inherited.send(None)
    assert inherited.close() == 0


C_FORK = """
import ctypes, gc, json, os, sys
import numpy as np
import torchshm
from multiprocessing.reduction import ForkingPickler

n = 32 << 20
a = np.full(n // 8, 7.0)
msg = ForkingPickler.dumps(a)
b = ForkingPickler.loads(msg)
go_r, go_w = os.pipe()
out_r, out_w = os.pipe()
pid = None
if sys.argv[1] == "c_fork":
    pid = ctypes.PyDLL(None).fork()  # holds the GIL: no Python hook runs
    if pid == 0:
        os.read(go_r, 1)
        os.write(out_w, str(int((a != 7).sum())).encode())
        os._exit(0)
del a, b, msg
gc.collect()
before = torchshm.stats()["segments_reused"]
for value in range(3):  # the same size: the pool reuses what it may
    c = np.full(n // 8, float(value))
    d = ForkingPickler.loads(ForkingPickler.dumps(c))
    assert float(d[0]) == value
    del c, d
    gc.collect()
changed = None
if pid:
    os.write(go_w, b"1")
    changed = int(os.read(out_r, 64))
    os.waitpid(pid, 0)
print(json.dumps({"changed": changed,
                  "reused": torchshm.stats()["segments_reused"] - before,
                  "one_copy": torchshm.stats()["bytes_one_copy"]}))
"""


def test_a_fork_from_c_after_the_send_retires_the_snapshot():
    """A fork torchshm did not prepare gives the child no slot, but the
    sender's pages of the array are the snapshot's there too: the segment
    is never reused, so the child reads its array as it was."""
    # Without the fork the same sends reuse the freed snapshot's segment.
    plain = run_python(C_FORK, "none")
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["reused"] >= 1
    forked = run_python(C_FORK, "c_fork")
    assert forked.returncode == 0, forked.stderr
    result = json.loads(forked.stdout)
    assert result["one_copy"] > 0
    assert result["changed"] == 0, result


HEAP = """
import ctypes, json
import numpy as np
import torchshm
from multiprocessing.reduction import ForkingPickler

# glibc's heap for everything up to 512 MiB: no block is an mmap()ed chunk.
M_MMAP_THRESHOLD = -3
assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 512 << 20) == 1
a = np.arange((32 << 20) // 8, dtype=np.float64)
got = ForkingPickler.loads(ForkingPickler.dumps(a))
a[:] = -1
stats = torchshm.stats()
print(json.dumps({"one_copy": stats["bytes_one_copy"],
                  "copied": stats["bytes_copied"],
                  "intact": bool((got == np.arange(a.size)).all())}))
"""


def test_an_array_on_glibcs_heap_is_copied_as_before():
    run = run_python(HEAP)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result == {"one_copy": 0, "copied": 32 * MIB, "intact": True}


FRAGMENTED = """
import json
import numpy as np
import torchshm
from multiprocessing.reduction import ForkingPickler

a = np.ones(30 << 17)  # an mmap()ed chunk freed: glibc's threshold is 30 MiB
del a
kept = [np.ones(30 << 17) for _ in range(10)]  # on the heap now
after = np.ones(30 << 17)  # what they free stays in the middle of the heap
del kept  # 300 MiB free there: glibc serves a block up to that from it
model = np.arange((512 << 20) // 8, dtype=np.float64)  # larger: mmap()ed
got = ForkingPickler.loads(ForkingPickler.dumps(model))
print(json.dumps({"one_copy": torchshm.stats()["bytes_one_copy"],
                  "intact": bool((got == np.arange(model.size)).all())}))
"""


def test_glibc_is_known_in_a_fragmented_heap():
    """Whether malloc is glibc's is asked once per process, when the first
    large array is sent: a heap with a large free chunk then (a 64 MiB
    probe block came from it, without an mmap()ed chunk's header) must not
    turn one copy off for the process's life."""
    run = run_python(FRAGMENTED)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result == {"one_copy": 512 * MIB - 4096, "intact": True}


def test_mmap_backed_arrays_are_copied_and_keep_the_snapshot(tmp_path, child):
    anonymous = mmap.mmap(-1, BIG)
    over_mmap = np.frombuffer(anonymous, dtype=np.float64)
    over_mmap[:] = np.arange(over_mmap.size)
    path = tmp_path / "model.bin"
    on_file = np.memmap(path, dtype=np.float64, mode="w+", shape=(BIG // 8,))
    on_file[:] = np.arange(on_file.size)
    before = torchshm.stats()
    receiver = child(torchshm_ctx(), kids.hold_and_report)
    receiver.send(over_mmap)
    receiver.receive()
    receiver.send(on_file)
    receiver.receive()
    assert stats_delta(before)["bytes_one_copy"] == 0
    over_mmap[:] = -1
    on_file[:] = -1
    receiver.send("look")
    expected = described(model())
    assert receiver.receive() == [expected, expected]
    receiver.send(None)
    assert receiver.close() == 0
    del over_mmap, on_file
    anonymous.close()


def test_a_born_array_is_sent_without_a_copy_at_all(child):
    with torchshm.allocating():
        born = np.arange(BIG // 8, dtype=np.float64)
    before = torchshm.stats()
    receiver = child(torchshm_ctx(), kids.hold_and_report)
    receiver.send(born)
    assert receiver.receive()[1] == described(model())
    delta = stats_delta(before)
    assert delta["bytes_copied"] == 0 and delta["bytes_one_copy"] == 0
    receiver.send(None)
    assert receiver.close() == 0


def test_an_array_on_huge_pages_gives_them_back(child):
    """NumPy advises huge pages for arrays from 4 MiB up; after the send the
    sender's whole pages are the snapshot's, huge ones included."""
    sent = model()
    sent += 0  # every page written: the kernel backs them now
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
        transparent = "[never]" not in mode.read()
    huge_before = kids.mapped_kb(sent, "AnonHugePages")
    if transparent:
        assert huge_before > 0, "NumPy's huge-page advice was not taken"
    receiver = child(torchshm_ctx(), kids.hold_and_report)
    receiver.send(sent)
    assert receiver.receive()[1] == described(model())
    # At most the first and last partial pages stay anonymous.
    assert kids.mapped_kb(sent, "Anonymous") <= 8
    assert kids.mapped_kb(sent, "AnonHugePages") == 0
    assert described(sent) == described(model())
    sent[::512] = 3.0  # writes land on the sender's own pages again
    assert float(sent[512]) == 3.0
    receiver.send("look")
    assert receiver.receive() == [described(model())]
    receiver.send(None)
    assert receiver.close() == 0


def test_below_the_size_or_not_owning_its_data_is_copied_as_before():
    small = np.arange((_sender.ONE_COPY_MIN - 4096) // 8, dtype=np.float64)
    big = model()
    view = big[: big.size // 4]  # a quarter: only its span is copied
    before = torchshm.stats()
    from multiprocessing.reduction import ForkingPickler

    got = ForkingPickler.loads(ForkingPickler.dumps([small, view]))
    assert stats_delta(before)["bytes_one_copy"] == 0
    assert np.array_equal(got[0], small) and np.array_equal(got[1], view)


def torchshm_ctx():
    import multiprocessing as mp

    return mp.get_context("spawn")


@pytest.mark.parametrize("nbytes", [256 << 10, BIG], ids=["copied", "one copy"])
def test_a_sent_array_resizes_as_numpys_and_is_sent_as_it_is_then(child, nbytes):
    """Note [Knowing that a sent array is gone] in csrc/send/array_watch.h:
    no weak reference on the array, so resize(refcheck=False) works after a
    send, as it does without torchshm; what was sent stays as it was, and the
    next send carries the resized bytes."""

    def fresh():
        return model() if nbytes == BIG else np.arange(nbytes // 8, dtype=np.float64)

    sent = fresh()
    receiver = child(torchshm_ctx(), kids.hold_and_report)
    receiver.send(sent)
    assert receiver.receive()[1] == described(fresh())
    held = _C.one_copy_held()
    sent.resize(nbytes // 4, refcheck=False)  # moved: NumPy's realloc
    assert _C.one_copy_held() == held - (nbytes == BIG)
    sent[:] = 7.0
    sent.resize(nbytes // 8, refcheck=False)  # larger again: zeros added
    receiver.send(sent)
    assert receiver.receive()[1] == described(sent)
    receiver.send("look")
    assert receiver.receive() == [described(fresh()), described(sent)]
    receiver.send(None)
    assert receiver.close() == 0
