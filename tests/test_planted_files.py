"""What another local user can plant in /dev/shm (a world-writable
directory) does no harm. torchshm's names live in the user's own directory
there (_paths.run_dir: tests/test_corners.py plants over its names); the
files below are planted inside it as root would, to check the second line of
defence: no file of another user is opened through a link or truncated, no
planted name makes the dead look alive or keeps a keeper running, the pool
budget cannot be disabled, no name can be pre-empted, and a segment cannot
be truncated under its readers (Note [Segment lifetime] in csrc/lifetime/segment.h)."""

import errno
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import torchshm
from tests import conftest
from tests.conftest import TIMEOUT, segment_mappings, session_segments
from torchshm import _C
from torchshm._keeper import paths as _paths
from torchshm._keeper import protocol as _protocol
from torchshm._lifetime import session as _session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTHER_UID = 65534  # nobody

# The keeper's Python and the OS: the pip and Debian 13 lanes only (Note
# [What each lane runs] in tests/conftest.py).
pytestmark = [
    pytest.mark.python_os,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="planting another user's files needs root (chown)"
    ),
]


def dumps(obj):
    return bytes(ForkingPickler.dumps(obj))


def plant_file(path, content=b""):
    with open(path, "wb") as f:
        f.write(content)
    os.chown(path, OTHER_UID, OTHER_UID)


def plant_link(path, target):
    os.symlink(target, path)
    os.lchown(path, OTHER_UID, OTHER_UID)


def remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def run_python(code, env=None):
    return conftest.run_python(
        code, env=dict(env or os.environ, PYTHONPATH=ROOT), timeout=TIMEOUT
    )


# (a) A link under a name root creates: never followed, nothing truncated.


def test_a_link_under_the_session_lock_name_truncates_nothing(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    session = "ab" + os.urandom(5).hex()
    lock = _paths.session_lock_path(session)
    plant_link(lock, str(victim))
    try:
        env = dict(os.environ, TORCHSHM_SESSION=session)
        run = run_python("import torchshm; print(torchshm.is_registered())", env)
        assert run.returncode == 0, run.stderr
        # That session id is not usable, and founding another one would split
        # the session: torchshm stays off, and says so.
        assert run.stdout.strip() == "False"
        assert "stays off" in run.stderr
        assert victim.read_bytes() == b"precious"
        assert os.path.islink(lock)
    finally:
        remove(lock)


# (b) Planted files never make the dead look alive.


@pytest.mark.parametrize("kind", ["link", "foreign file", "fifo"])
def test_a_planted_lock_never_makes_a_dead_holder_alive(tmp_path, kind):
    received = pickle.loads(dumps(np.full(100_000, 3.0)))
    segment = _C.segment_of(_C.memory_owner(received))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # takes a slot of its own, says its id, dies
        os.close(r)
        held = pickle.loads(dumps(received))  # noqa: F841
        os.write(w, f"{_C.process_id():x}".encode())
        time.sleep(60)
        os._exit(0)
    os.close(w)
    dead = int(os.read(r, 64), 16)
    os.close(r)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    lock = _paths.process_lock_path(dead)
    remove(lock)  # swept, as a keeper does with a dead process's lock
    if kind == "link":
        target = tmp_path / "held-by-someone"
        target.write_bytes(b"")
        plant_link(lock, str(target))
    elif kind == "foreign file":
        plant_file(lock, f"1 {_session.session_id()}\n".encode())
    else:
        os.mkfifo(lock)
        os.chown(lock, OTHER_UID, OTHER_UID)
    try:
        answer = []
        ask = threading.Thread(target=lambda: answer.append(_C.holder_alive(dead)))
        ask.start()
        ask.join(TIMEOUT)  # a FIFO must not block the question
        assert answer == [False]
        assert not _paths.process_alive(dead)
        # Only this process and the pool hold the segment now.
        del received
        assert not segment.has_live_holder(0)
    finally:
        remove(lock)


def test_planted_locks_naming_a_session_do_not_keep_its_keeper_alive():
    session = "cd" + os.urandom(5).hex()
    keeper = subprocess.Popen(
        [sys.executable, "-I", "-S", _protocol.DAEMON, session, _paths.run_dir()]
        + ["600"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    planted = _paths.process_lock_path(int.from_bytes(os.urandom(7), "big"))
    try:
        assert keeper.stdout.read(1) == b"1"
        # A foreign "lock" claiming the session, held by someone.
        plant_file(planted, f"1 {session}\n".encode())
        holder = os.open(planted, os.O_RDONLY)
        import fcntl

        fcntl.flock(holder, fcntl.LOCK_SH)
        member = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        member.connect(_paths.socket_path(session))
        member.send(b"j 1")
        time.sleep(0.3)
        member.close()  # the session's only member leaves
        keeper.wait(TIMEOUT)
        assert keeper.returncode == 0
        os.close(holder)
    finally:
        if keeper.poll() is None:
            keeper.kill()
        keeper.stdout.close()
        remove(planted)


# (c) The pool budget lives in the keeper's table: no file to pre-create.


def test_the_pool_budget_cannot_be_disabled_by_a_planted_file():
    session = _session.session_id()
    old_name = os.path.join(_paths.SHM_DIR, f"torchshm-budget-{session}.shm")
    plant_file(old_name)
    try:
        table = _session.table()
        me = _C.process_id()
        assert table.budget_set(me, 12345)
        assert table.budget_total() >= 12345
    finally:
        table.budget_set(me, 0)
        remove(old_name)


# (d) No segment has a name to take first.


def test_nothing_of_a_segment_is_in_dev_shm_so_no_name_can_be_preempted():
    before = set(os.listdir(_paths.SHM_DIR))
    # Names of the kind earlier versions made, planted by someone else.
    session = _session.session_id()
    planted = [
        os.path.join(_paths.SHM_DIR, f"torchshm_{session}_{'0' * 16}_{n}")
        for n in range(4)
    ]
    for path in planted:
        plant_file(path)
    try:
        a = np.arange(1_000_000.0)
        received = pickle.loads(dumps(a))
        assert torchshm.is_shared(received)
        np.testing.assert_array_equal(received, a)
        new = (
            set(os.listdir(_paths.SHM_DIR))
            - before
            - {os.path.basename(p) for p in planted}
        )
        # Other processes of a busy machine (a second test run, torch's own
        # sharing) add files meanwhile: only names of this session, or of
        # the kind segments had, would be ours.
        ours = [n for n in new if session in n or n.startswith("torchshm_")]
        assert not ours, ours
        # The memory is a memfd's, named after this session.
        mapped = segment_mappings()
        assert any(f"/memfd:torchshm-segment:{session}:" in line for line in mapped)
    finally:
        for path in planted:
            remove(path)


# (e) A segment cannot be truncated: its readers never see SIGBUS.


def test_a_segment_cannot_be_truncated_under_its_readers():
    received = pickle.loads(dumps(np.full(100_000, 4.0)))
    segment = _C.segment_of(_C.memory_owner(received))
    assert segment.name in session_segments()
    fd = _session.fetch(segment.session, segment.uid, segment.index)
    try:
        for size in (0, 4096):
            with pytest.raises(PermissionError) as raised:
                os.ftruncate(fd, size)
            assert raised.value.errno == errno.EPERM
    finally:
        os.close(fd)
    assert (received == 4.0).all()
