"""Faults (GitHub issue 5): senders that exit at once, SIGKILL anywhere, and
messages nobody receives. Each works, or the run leaves nothing behind."""

import random

import numpy as np
import pytest

import torchshm
from tests import fault_children, isolated
from tests.conftest import TIMEOUT, bounded

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
# The keeper's Python and the OS: the pip and Debian 13 lanes only (Note
# [What each lane runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.python_os]


@pytest.mark.parametrize("n", [1_000, 5_000_000])
def test_a_child_that_puts_and_returns(ctx, no_leaks, n):
    # The published experiment's shape (400 MB there, 40 MB here).
    q = ctx.Queue()
    p = ctx.Process(target=fault_children.put_and_return, args=(q, n))
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 0  # gone before anything is received
    received = q.get(timeout=TIMEOUT)
    np.testing.assert_array_equal(received, np.arange(n))
    assert torchshm.is_shared(received)
    del received
    q.close()
    q.join_thread()


@pytest.fixture
def file_descriptor_strategy():
    import torch.multiprocessing

    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")  # the default
    yield
    torch.multiprocessing.set_sharing_strategy(previous)


def test_a_torch_shared_array_from_a_child_that_returns(
    ctx, file_descriptor_strategy, no_leaks
):
    # torch's file_descriptor strategy would need the child alive to hand over
    # the fd (FileNotFoundError here); torchshm snapshots such arrays instead.
    q = ctx.Queue()
    p = ctx.Process(target=fault_children.put_tensor_view_and_return, args=(q, 10**6))
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 0
    received = q.get(timeout=TIMEOUT)
    np.testing.assert_array_equal(received, np.arange(1, 10**6))
    assert torchshm.is_shared(received)
    del received
    q.close()
    q.join_thread()


def test_pool_workers_that_exit_after_each_task(ctx, no_leaks):
    pool = ctx.Pool(2, maxtasksperchild=1)
    try:
        results = pool.map_async(fault_children.pool_array, range(4), chunksize=1).get(
            TIMEOUT
        )
    except BaseException:
        pool.terminate()
        raise
    finally:
        # Not `with Pool`: its terminate() SIGTERMs workers that may still be
        # exiting, and their pooled segments then live until the session ends.
        pool.close()
        bounded(pool.join)
    for seed, got in enumerate(results):
        np.testing.assert_array_equal(got, fault_children.pool_array(seed))
        assert torchshm.is_shared(got)
    del results, got


def _assert_nothing_left(driver):
    segments, processes = isolated.leftovers(driver)
    assert not processes, f"processes left after {isolated.GRACE} s: {processes}"
    assert not segments, f"segments left once the session ended: {segments}"


def test_sigkill_of_sender_receiver_or_parent_leaves_nothing():
    # 50 rounds in one driver; scripts/stress.py runs many more.
    with isolated.Driver("kill", "50", str(random.randrange(1 << 30))) as driver:
        lines, status = driver.results()
        assert status == 0, driver.stderr()
        totals = lines[-1]
        assert totals["rounds"] == 50 and totals["kills"] >= 10, totals
        assert totals["messages"] > 0
        assert totals["bad"] == 0, "a received array differed from the sent one"
        assert totals["errors"] == 0, driver.stderr()
        assert totals["lost"] == 0, [r for r in lines[:-1] if r["lost"]]
        assert totals["hung"] == 0, [r for r in lines[:-1] if r["hung"]]
        # Rounds that killed neither the sender nor the receiver freed their
        # segments by reference counting, without waiting for the reaper.
        assert totals["early_leftovers"] == 0
        # The driver, a long-lived session root, still runs: what its dead
        # children held is freed anyway.
        assert totals["live_leftovers"] == 0
        _assert_nothing_left(driver)


@pytest.mark.parametrize("after_rounds", [1, 3])
def test_sigkill_of_the_session_root_leaves_nothing(after_rounds):
    # The process that founded the session dies mid-run; its orphans finish
    # their round, and the reaper sweeps once the last of them is gone.
    with isolated.Driver("kill", "1000", str(random.randrange(1 << 30))) as driver:
        for _ in range(after_rounds):
            assert driver.readline(), driver.stderr()
        driver.kill()
        _assert_nothing_left(driver)


def test_messages_never_received_are_reclaimed_when_the_processes_are_gone():
    with isolated.Driver("unread") as driver:
        lines, status = driver.results()
        assert status == 0, driver.stderr()
        (result,) = lines
        assert result["exitcodes"] == [0, 0, -9]
        # While the session lives, the unread messages keep their segments...
        assert result["segments"] > 0
        # ...and once it is gone, they are swept.
        _assert_nothing_left(driver)


def test_a_killed_keeper_is_replaced_without_losing_a_message():
    with isolated.Driver("keeper_restart") as driver:
        lines, status = driver.results()
        assert status == 0, driver.stderr()
        (result,) = lines
        assert result["errors"] == []
        assert result["received"] == list(range(fault_children.RESTART_MESSAGES))
        assert result["bad"] == 0 and result["late_ok"]
        assert result["late_exitcode"] == 0 and result["sender_exitcode"] == 0
        # A new keeper served the live session to its end.
        assert result["keepers_after"] == 1
        _assert_nothing_left(driver)


@pytest.mark.parametrize("how", ["stopped", "fd_limit"])
def test_a_new_receiver_loads_from_a_live_sender_without_the_keeper(how):
    """A process that has not joined its session (its keeper SIGSTOPped, or
    at its fd limit) loads what a live sender sent, through the sender's fd,
    and joins at a later load."""
    with isolated.Driver("load_without_keeper", how) as driver:
        lines, status = driver.results()
        assert status == 0, driver.stderr()
        (result,) = lines
        first, second = result["first"], result["second"]
        assert first is not None, "the first load did not end"
        assert first["error"] is None and first["ok"] and first["shared"]
        assert not first["member"]
        assert second["error"] is None and second["ok"] and second["member"]
        assert result["exitcode"] == 0
        _assert_nothing_left(driver)
