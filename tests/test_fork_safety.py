"""A fork never lets a child read memory its parent reuses: the fork hook
gives the child its own hold on what it inherits, or, where it cannot (the
fd limit, no inode left in /dev/shm), the parent keeps that memory until
the session ends (Note [Fork] in torchshm/_lifetime/lifecycle.py); a fork()
from C, which runs no hook, leaves the child without torchshm's memory: it
faults where it would have read the parent's later bytes (Note [Forks
torchshm did not prepare] in csrc/lifetime/fork_guard.h)."""

import signal

import pytest

from tests import isolated
from tests.isolated import NO_UNSHARE

# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_os]

# /dev/shm with few inodes, in a private mount namespace.
FEW_INODES = (
    "unshare",
    "-m",
    "sh",
    "-c",
    'mount -t tmpfs -o size=256m,nr_inodes=4096 tmpfs /dev/shm && exec "$@"',
    "sh",
)


def _run(how, wrapper=()):
    with isolated.Driver(
        "fork_unprepared", how, wrapper=wrapper, module="tests.fork_children"
    ) as driver:
        lines, status = driver.results()
        assert status == 0, driver.stderr()
        (result,) = lines
        segments, processes = isolated.leftovers(driver, shm=not wrapper)
        assert not processes and not segments
        assert result["later_ok"] == [True, True, True]
        assert result["feeder_exitcode"] == 0
        return result


@pytest.mark.parametrize("how", ["fd_limit", "inodes"])
def test_a_fork_whose_hook_fails_keeps_what_the_child_reads(how):
    if how == "inodes" and NO_UNSHARE is not None:
        pytest.skip(NO_UNSHARE)
    result = _run(how, FEW_INODES if how == "inodes" else ())
    assert result["exitcode"] == 0 and result["signal"] == 0
    assert result["changed"] == [0, 0, 0], "the child read the parent's new bytes"
    # The slab, the born segment and the received one: kept, said once.
    assert result["pinned"] == 3
    (warning,) = [w for w in result["warnings"] if "forked child" in w]
    assert "kept until the session ends" in warning


def test_a_fork_from_c_leaves_the_child_nothing_to_misread():
    result = _run("c_fork")
    assert result["pinned"] == 0
    # Reading what it inherited faults; it never reads the parent's bytes.
    assert result["signal"] == signal.SIGSEGV, result
    assert result["changed"] is None
