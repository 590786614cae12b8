"""Arrays through real processes under fork, spawn and forkserver: equality,
zero-copy in both directions, aliasing, and nothing left behind."""

import numpy as np
import pytest

import torchshm
from tests import cases, children

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess


def test_matrix_round_trip_through_a_child(ctx, no_leaks, child):
    arrays = cases.matrix_arrays()
    c = child(ctx, children.echo)
    c.send(arrays)
    received = c.receive()
    c.send(None)
    assert c.close() == 0
    for got, sent in zip(received, arrays):
        cases.assert_same_array(got, sent, keep_strides=not cases.is_sparse(sent))
        assert torchshm.is_shared(got) or got.size == 0


def test_sender_exits_right_after_sending(ctx, no_leaks, child):
    c = child(ctx, children.send_built, "matrix_arrays")
    c.process.join(60)  # gone before anything is received
    assert c.process.exitcode == 0
    received = c.receive()
    for got, sent in zip(received, cases.matrix_arrays()):
        cases.assert_same_array(got, sent, keep_strides=not cases.is_sparse(sent))
    assert c.close() == 0


def test_child_writes_are_seen_by_the_parent(ctx, no_leaks, child):
    base = np.arange(600_000, dtype=np.float64).reshape(600, 1000)
    arrays = [
        torchshm.share(base),
        torchshm.share(base[::-1, ::2]),
        torchshm.share(np.asfortranarray(base[:100])),
        torchshm.share(base.astype(">i4")),
    ]
    c = child(ctx, children.fill_received)
    c.send((arrays, 9))
    assert c.receive() == [True] * len(arrays)
    for a in arrays:
        assert (a == 9).all()
    c.send("exit")
    assert c.close() == 0


def test_parent_writes_are_seen_by_the_child(ctx, no_leaks, child):
    c = child(ctx, children.share_then_check)
    received = c.receive()
    assert torchshm.is_shared(received)
    received[...] = 7
    c.send("check")
    assert c.receive() is True
    assert c.close() == 0


def test_views_of_one_base_stay_aliased_in_the_child(ctx, no_leaks, child):
    base = np.zeros((500, 400))
    c = child(ctx, children.alias_check)
    c.send((base, base[::-1, ::-1], base.T))
    assert c.receive() == [True, True, True]
    assert base[0, 0] == 0  # the sender's own array is never written
    assert c.close() == 0


def test_shared_memory_comes_back_as_the_same_memory(ctx, no_leaks, child):
    shared = torchshm.share(np.arange(1_000_000, dtype=np.int64))
    c = child(ctx, children.echo)
    c.send([shared, shared[::-2]])
    back = c.receive()
    c.send(None)
    assert c.close() == 0
    assert np.shares_memory(back[0], shared) and np.shares_memory(back[1], shared)
    back[1][0] = -5
    assert shared[-1] == -5
