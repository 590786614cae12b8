"""No message lost in the corners (issue 34): the keeper's death, a late
child, past every holder slot, a stopped or swamped keeper, requests that
carry fds, stale locators, planted names, calls after exit, an environment
where torchshm cannot run, and the session-id rule.

Each scenario runs in a torchshm session of its own (scripts started without
TORCHSHM_SESSION), so that killing or stopping its keeper disturbs no other
test; every wait is bounded.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from tests import isolated
from tests.conftest import TIMEOUT
from torchshm._keeper import paths as _paths

# The keeper's Python and the OS: the pip and Debian 13 lanes only (Note
# [What each lane runs] in tests/conftest.py).
pytestmark = pytest.mark.python_os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTHER_UID = 65534  # nobody

# Imported by every script below: a session of its own, and helpers.
PRELUDE = """
import json, os, signal, socket, subprocess, sys, time
from multiprocessing.reduction import ForkingPickler
import numpy as np
import torchshm
from torchshm import _C
from torchshm._lifetime import session as _session
from torchshm._keeper import paths as _paths

def report(**fields):
    print(json.dumps(fields), flush=True)

def load_all(reader, n):
    # n messages (i, array of i) from `reader`: True for each that loaded
    # whole, else the error it raised.
    loaded = []
    for _ in range(n):
        try:
            i, a = reader.recv()
            loaded.append(bool((a == i).all()))
        except Exception as exc:
            loaded.append(repr(exc)[:200])
    return loaded

def kill_keeper():
    pid = _session.keeper_pid()
    os.kill(pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read(
        ).rsplit(")", 1)[1].split()[0] not in "ZX":
        time.sleep(0.01)
"""


def script_env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT, **extra)
    env.pop("TORCHSHM_SESSION", None)
    return env


def run_script(body, *args, env=None, timeout=TIMEOUT, wrapper=()):
    """Runs PRELUDE + body in a fresh session; its JSON lines and the run.
    A file, not -c: spawn and forkserver children import its functions."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PRELUDE + textwrap.dedent(body))
    try:
        run = _run_file(f.name, args, env, timeout, wrapper)
    finally:
        os.unlink(f.name)
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    return lines, run


def _run_file(path, args, env, timeout, wrapper):
    return subprocess.run(
        [*wrapper, sys.executable, path, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env or script_env(),
        start_new_session=True,
    )


def only(lines, run):
    assert run.returncode == 0 and len(lines) == 1, (run.returncode, run.stderr)
    return lines[0]


def keeper_of(session):
    """Pids of the keeper processes of `session` still running."""
    return isolated.session_processes(-1, session)


def wait_keeper_gone(session, timeout=30):
    deadline = time.monotonic() + timeout
    while keeper_of(session) and time.monotonic() < deadline:
        time.sleep(0.1)
    return keeper_of(session)


# ------------------------------------------------ 1. the keeper's SIGKILL

KEEPER_KILLED = """
# A message in flight, the sender alive, the keeper killed: a new process of
# the session loads it.
nbytes = int(sys.argv[1])
message = bytes(ForkingPickler.dumps(np.full(nbytes // 8, 7.0)))
# The array is gone; only the message names its memory.
kill_keeper()
loader = subprocess.run(
    [sys.executable, "-c",
     "import sys, torchshm; from multiprocessing.reduction import ForkingPickler;"
     " a = ForkingPickler.loads(sys.stdin.buffer.read());"
     " print(int(a.size), float(a.sum()))"],
    input=message, capture_output=True, timeout=60)
out = loader.stdout.decode().split()
report(loaded=loader.returncode == 0 and out == [str(nbytes // 8),
       str(7.0 * (nbytes // 8))], stderr=loader.stderr.decode()[-500:])
"""


@pytest.mark.parametrize(
    "pool, nbytes",
    [(None, 1 << 20), ("0", 1 << 20), ("1M", 2 << 20)],
    ids=["default-pool", "pool-off", "past-the-pool-cap"],
)
def test_a_message_of_a_live_sender_survives_the_keepers_sigkill(pool, nbytes):
    env = script_env(**({"TORCHSHM_POOL_BYTES": pool} if pool else {}))
    result = only(*run_script(KEEPER_KILLED, str(nbytes), env=env))
    assert result["loaded"], result["stderr"]


KEEPER_KILLED_LOW_FDS = """
# 100 messages in a Queue under a soft fd limit of 256 (a quarter: 64
# segment fds), the keeper killed before the receiver reads.
import multiprocessing as mp, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
N = 100

def receive(q, go, out):
    go.wait()
    ok = 0
    for _ in range(N):
        try:
            i, a = q.get(timeout=30)
        except Exception as exc:
            out.put(repr(exc)); break
        ok += bool(a.shape == (32768,) and (a == i).all())
    out.put(ok)

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    q, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    child = ctx.Process(target=receive, args=(q, go, out))
    child.start()
    for i in range(N):
        q.put((i, np.full(32768, i, dtype=np.float64)))
    q.close(); q.join_thread()  # every message is in the pipe
    kill_keeper()
    go.set()
    received = out.get(timeout=120)
    child.join(30)
    report(received=received, soft=resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def test_messages_past_a_quarter_of_a_low_soft_fd_limit_survive_the_keepers_sigkill():
    lines, run = run_script(KEEPER_KILLED_LOW_FDS, timeout=180)
    result = only(lines, run)
    assert result["received"] == 100, run.stderr[-2000:]
    assert result["soft"] > 256  # raised towards the hard limit, as needed


SENDER_EXITS_AS_THE_KEEPER_DIES = """
# A sender's messages wait in a pipe and the sender exits; the keeper is
# SIGKILLed just before (`before`: the sender has not joined a new keeper
# yet, as its once-a-second check would) or inside the sender's exit hook,
# once the hook has let go of its pool (`during`: after a first look at its
# keeper, as a hook that looks first would). The hook's last look, right
# before its fds close, must see the death and hand the messages to a new
# keeper (Note [Handing over at exit] in torchshm/_lifetime/lifecycle.py).
import multiprocessing as mp
N = 8

def send(conn, bye, when):
    if when == "during":
        from torchshm._lifetime import segments

        let_go = segments.disown_all

        def let_go_then_kill_the_keeper():
            let_go()
            kill_keeper()

        segments.disown_all = let_go_then_kill_the_keeper
    for i in range(N):
        conn.send((i, np.full(1 << 17, i, dtype=np.float64)))
    bye.recv()  # then exits at once

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    when = sys.argv[2]
    reader, writer = ctx.Pipe(duplex=False)
    bye_reader, bye_writer = ctx.Pipe(duplex=False)
    _session.join()
    child = ctx.Process(target=send, args=(writer, bye_reader, when))
    child.start()
    writer.close()
    while not reader.poll(0.05) and child.exitcode is None:
        pass
    time.sleep(0.5)  # the N writes: a few microseconds each
    old = _session.keeper_pid()
    if when == "before":
        kill_keeper()
    bye_writer.send(None)
    child.join(60)
    loaded = load_all(reader, N)
    try:
        state = open(f"/proc/{old}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    report(loaded=loaded, exitcode=child.exitcode, keeper_killed=state in ("Z", "gone"))
"""


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_keeper_killed_as_its_sender_exits_is_replaced_before_the_senders_fds_close(
    method, when
):
    run = run_script(SENDER_EXITS_AS_THE_KEEPER_DIES, method, when, timeout=180)
    result = only(*run)
    assert result == {"loaded": [True] * 8, "exitcode": 0, "keeper_killed": True}


SENDER_REUSES_MEMORY_AFTER_THE_KEEPER_DIES = """
# A sender holds memory it made while the first keeper lived (a slab of
# born-shared blocks, registered with that keeper only, and never sent), and
# the keeper is SIGKILLed. The sender sends from that memory at once, joins a
# new keeper without creating anything new (so without registering anything
# through a new segment), sends more, and dies without its exit hook: its
# receiver, which never mapped that slab, loads every message.
import multiprocessing as mp
N = 16

def send(conn, ready, go):
    torchshm.set_threshold(0)
    torchshm.set_allocator(True, min_bytes=1)
    made = [np.full(16, -1) for _ in range(4)]  # a slab: blocks never sent
    old = _session.keeper_pid()
    ready.send(old)
    go.recv()  # the keeper is dead now
    for i in range(N // 2):
        conn.send((i, np.full(16, i)))
    deadline = time.monotonic() + 60
    while _session.keeper_with_everything() in (0, old):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    ready.send(_session.keeper_with_everything() not in (0, old))
    for i in range(N // 2, N):
        conn.send((i, np.full(16, i)))
    os._exit(0)  # as a SIGKILL: no exit hook hands anything over

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    reader, writer = ctx.Pipe(duplex=False)
    ready_reader, ready_writer = ctx.Pipe(duplex=False)
    go_reader, go_writer = ctx.Pipe(duplex=False)
    _session.join()
    child = ctx.Process(target=send, args=(writer, ready_writer, go_reader))
    child.start()
    assert ready_reader.recv() == _session.keeper_pid()
    kill_keeper()
    go_writer.send(None)
    rejoined = ready_reader.recv()
    child.join(60)
    loaded = load_all(reader, N)
    report(rejoined=rejoined, loaded=loaded, exitcode=child.exitcode)
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_sender_joins_a_new_keeper_with_what_it_made_before_without_making_more(
    method,
):
    run = run_script(SENDER_REUSES_MEMORY_AFTER_THE_KEEPER_DIES, method, timeout=180)
    result = only(*run)
    assert result == {"rejoined": True, "loaded": [True] * 16, "exitcode": 0}


KEEPER_DIES_AT_JOIN = """
# A keeper that takes the connection and dies before it answers the join (a
# SIGKILL between the two): the member tries once more, which starts its
# successor, instead of going on without torchshm.
import threading
session = "dead" + os.urandom(4).hex()
path = _paths.socket_path(session)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(path)
listener.listen(1)

def die_at_the_first_request():
    conn, _ = listener.accept()
    conn.recv(64)  # the join
    os.unlink(path)  # as a dead keeper's socket refuses
    listener.close()
    conn.close()

threading.Thread(target=die_at_the_first_request, daemon=True).start()
member = subprocess.run(
    [sys.executable, "-W", "error", "-c",
     "import json, numpy as np, torchshm;"
     " from torchshm._lifetime import session;"
     " session.join();"
     " a = torchshm.share(np.ones(1 << 17));"
     " print(json.dumps([session.session_id(), torchshm.is_shared(a)]))"],
    env=dict(os.environ, TORCHSHM_SESSION=session), capture_output=True,
    text=True, timeout=120)
report(joined=member.stdout.strip(), expected=json.dumps([session, True]),
       stderr=member.stderr[-1500:])
"""


def test_a_keeper_that_dies_between_connect_and_join_is_replaced():
    result = only(*run_script(KEEPER_DIES_AT_JOIN))
    assert result["joined"] == result["expected"], result["stderr"]
    # The keeper its member started ends with the session.
    assert not wait_keeper_gone(json.loads(result["expected"])[0])


# ------------------------------------------------ 2. a late child

LATE_CHILD = """
# The parent writes a message to a `subprocess` child's stdin and exits at
# once; the child imports torchshm only seconds later.
delay = sys.argv[1]
child_code = (
    "import sys, time; time.sleep(float(sys.argv[1]));"
    " import json, torchshm; from multiprocessing.reduction import ForkingPickler;"
    " a = ForkingPickler.loads(sys.stdin.buffer.read());"
    " print(json.dumps(dict(loaded=float(a.sum()))), flush=True)"
)
child = subprocess.Popen([sys.executable, "-c", child_code, delay],
                         stdin=subprocess.PIPE)
child.stdin.write(ForkingPickler.dumps(np.ones(1 << 17)))
child.stdin.close()
report(session=_session.session_id())
"""


def test_a_sender_may_exit_before_its_late_child_imports_torchshm():
    code = PRELUDE + textwrap.dedent(LATE_CHILD)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=script_env(),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)  # the child's line too
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(x) for x in out.splitlines()]
    session = lines[0]["session"]
    assert {"loaded": float(1 << 17)} in lines, err[-2000:]
    # Nothing left: the keeper ends the session once the child is gone.
    assert wait_keeper_gone(session) == []


# ------------------------------------------------ 3. pinned means pinned

PINNED_RECEIVER = """
import os, sys, time
import torchshm  # a member of the session before the sender exits
from multiprocessing.reduction import ForkingPickler
print("ready", flush=True)
blobs = [bytes.fromhex(line) for line in sys.stdin]
sender = int(sys.argv[1])
def alive(pid):  # not a zombie: the sender's parent reaps it only later
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
while alive(sender):
    time.sleep(0.05)
time.sleep(2)  # the keeper closes what was released within a second
ok = 0
for blob in blobs:
    try:
        ok += bool((ForkingPickler.loads(blob) == 3).all())
    except Exception as exc:
        print(repr(exc), file=sys.stderr)
print('{"loaded": %d}' % ok, flush=True)
"""

PINNED = """
# More messages name one segment than it has slots: the last ones carry no
# ticket and pin it. Their sender exits cleanly (letting go of its slot); a
# receiver of the session loads them afterwards.
receiver = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1], str(os.getpid())],
    stdin=subprocess.PIPE, text=True)
a = ForkingPickler.loads(ForkingPickler.dumps(np.full(1 << 17, 3.0)))  # shared
slots = _C.LAYOUT["SLOTS"]
messages = [bytes(ForkingPickler.dumps(a)) for _ in range(slots + 10)]
for m in messages[: slots - 1]:
    ForkingPickler.loads(m)  # this process holds it: the ticket is cancelled
receiver.stdin.write("".join(m.hex() + "\\n" for m in messages[slots:]))
receiver.stdin.close()
report(tail=len(messages[slots:]))
"""


def test_a_pinned_segment_stays_until_its_session_ends_whoever_lets_go():
    lines, run = run_script(PINNED, PINNED_RECEIVER, timeout=120)
    # The receiver prints after its sender (this script) exited: read on.
    assert run.returncode == 0, run.stderr[-2000:]
    assert {"tail": 10} in lines
    assert {"loaded": 10} in lines, run.stderr[-2000:]


# ------------------------------------------------ 9, 10, 11: never raise


def test_trim_and_release_never_raise_with_torchshm_disabled():
    lines, run = run_script(
        """
        import torchshm
        report(freed=torchshm.trim(), registered=torchshm.is_registered())
        """,
        env=script_env(TORCHSHM_DISABLE="1"),
    )
    assert only(lines, run) == {"freed": 0, "registered": False}


def test_trim_and_release_never_raise_after_torchshm_exits():
    lines, run = run_script(
        """
        from multiprocessing import util
        a = np.ones(1 << 18)
        handle = torchshm.dumps(a)
        torchshm.trim()
        def late():  # after torchshm's exit finalizer (exitpriority -100)
            report(freed=torchshm.trim(), released=torchshm.release(handle))
        util.Finalize(None, late, exitpriority=-200)
        """
    )
    result = only(lines, run)
    assert result["freed"] >= 0 and "Traceback" not in run.stderr, run.stderr


def test_a_session_id_with_underscore_and_dash_is_accepted():
    session = "my_run-" + os.urandom(3).hex()
    lines, run = run_script(
        "report(session=_session.session_id())",
        env=dict(script_env(), TORCHSHM_SESSION=session),
    )
    assert only(lines, run) == {"session": session}
    assert wait_keeper_gone(session) == []


@pytest.mark.parametrize("bad", ["a/b", "a b", "x" * 65, "ü"])
def test_a_bad_session_id_is_one_value_error_naming_the_rule(bad):
    lines, run = run_script("", env=dict(script_env(), TORCHSHM_SESSION=bad))
    assert run.returncode != 0
    assert "TORCHSHM_SESSION" in run.stderr and "letters, digits, _ or -" in (
        run.stderr
    )


# ------------------------------------------------ 5. a keeper that does not answer

STOPPED_KEEPER = """
# The keeper stopped: a new process starts with torchshm off (one warning),
# a sender that needs fresh segments pickles by value; nothing waits for ever,
# nothing is lost.
import warnings
N = 400
keeper = _session.keeper_pid()
os.kill(keeper, signal.SIGSTOP)
try:
    started = time.monotonic()
    fresh = subprocess.run(
        [sys.executable, "-c", "import torchshm; print(torchshm.is_registered())"],
        capture_output=True, text=True, timeout=60)
    joined_in = time.monotonic() - started
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        # Enough fresh segments to fill the keeper's socket (~280).
        blobs = [bytes(ForkingPickler.dumps(np.full(40000, i))) for i in range(N)]
        sent_in = time.monotonic() - started
finally:
    os.kill(keeper, signal.SIGCONT)
ok = sum(bool((ForkingPickler.loads(b) == i).all()) for i, b in enumerate(blobs))
stats = torchshm.stats()
report(fresh=fresh.stdout.strip(), fresh_warned="keeper" in fresh.stderr,
       joined_in=joined_in, sent_in=sent_in, ok=ok,
       warnings=[str(w.message) for w in caught], fallbacks=stats["fallbacks"])
"""


def test_a_stopped_keeper_stalls_nothing_for_ever():
    env = script_env(TORCHSHM_KEEPER_TIMEOUT="1", TORCHSHM_POOL_BYTES="0")
    result = only(*run_script(STOPPED_KEEPER, env=env, timeout=120))
    assert result["fresh"] == "False" and result["fresh_warned"], result
    assert result["ok"] == 400
    # A deadline now and then, not one per array.
    assert result["sent_in"] < 60, result
    assert any("keeper" in w for w in result["warnings"]), result


SWAMPED_KEEPER = """
# A client of this user sends requests and never reads the replies: the
# keeper drops it instead of waiting; other processes go on.
path = _paths.socket_path(_session.session_id())
rude = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
rude.connect(path)
rude.setblocking(False)
sent = 0
try:
    for _ in range(20000):
        rude.send(b"S")
        sent += 1
except OSError:
    pass
time.sleep(0.5)
started = time.monotonic()
other = subprocess.run(
    [sys.executable, "-c",
     "import torchshm, numpy as np; from multiprocessing.reduction import"
     " ForkingPickler as P; print(float(P.loads(P.dumps(np.ones(1 << 18))).sum()))"],
    capture_output=True, text=True, timeout=60)
fresh = [bytes(ForkingPickler.dumps(np.ones((1 << 15) + i))) for i in range(300)]
report(sent=sent, other=other.stdout.strip(), took=time.monotonic() - started,
       fds=len(os.listdir(f"/proc/{_session.keeper_pid()}/fd")))
"""


def test_a_client_that_never_reads_its_replies_is_dropped():
    result = only(*run_script(SWAMPED_KEEPER, timeout=120))
    assert result["other"] == str(float(1 << 18)), result
    assert result["took"] < 30


KEEPER_FD_LIMIT = """
# The keeper at its fd limit: a new process gets "busy" and starts with
# torchshm off, instead of waiting for ever.
keeper = _session.keeper_pid()
path = _paths.socket_path(_session.session_id())
open_now = len(os.listdir(f"/proc/{keeper}/fd"))
limit = open_now + 8
subprocess.run(["prlimit", f"--pid={keeper}", f"--nofile={limit}:{limit}"],
               check=True)
idle = []
for _ in range(12):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    idle.append(s)
time.sleep(0.5)
started = time.monotonic()
fresh = subprocess.run(
    [sys.executable, "-c", "import torchshm; print(torchshm.is_registered())"],
    capture_output=True, text=True, timeout=60)
report(fresh=fresh.stdout.strip(), took=time.monotonic() - started,
       warned="keeper" in fresh.stderr)
"""


@pytest.mark.skipif(
    not os.path.exists("/usr/bin/prlimit"), reason="prlimit (util-linux) is missing"
)
def test_a_keeper_at_its_fd_limit_answers_busy():
    env = script_env(TORCHSHM_KEEPER_TIMEOUT="30")
    result = only(*run_script(KEEPER_FD_LIMIT, env=env, timeout=120))
    assert result["fresh"] == "False" and result["warned"], result
    assert result["took"] < 25, result  # "busy", not the 30 s deadline


# ------------------------------------------------ 6. fds a request carries

FDS_CARRIED = """
keeper = _session.keeper_pid()
path = _paths.socket_path(_session.session_id())
def count():
    time.sleep(0.3)
    return len(os.listdir(f"/proc/{keeper}/fd"))
before = count()
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect(path)
for kind in (b"j 1", b"F 0 1", b"C", b"S", b"X", b"R 1"):
    for _ in range(50):
        r, w = os.pipe()
        socket.send_fds(conn, [kind], [r, w])
        os.close(r); os.close(w)
during = count()
conn.close()
report(before=before, during=during, after=count())
"""


def test_the_keeper_closes_every_fd_a_request_carried():
    result = only(*run_script(FDS_CARRIED))
    assert result["during"] <= result["before"] + 2, result
    assert result["after"] <= result["before"], result


# ------------------------------------------------ 7. a stale locator

STALE_LOCATOR = """
# A message names its creator's fd; the creator let go of the segment and
# that fd number now holds a database this process has a POSIX lock on.
# Loading the stale message fails, and the lock stays.
import fcntl
db = sys.argv[1]
a = np.full(1 << 17, 5.0)
message = bytes(ForkingPickler.dumps(a))
segment_fd = [s.fd for s in _C.segments_with_fd()][-1]
ForkingPickler.loads(message)  # claims the ticket: the message is now stale
del a
torchshm.trim()
time.sleep(1.5)  # the keeper closes its fd too
fd = os.open(db, os.O_RDWR)
if fd != segment_fd:
    os.dup2(fd, segment_fd); os.close(fd)
fcntl.lockf(segment_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
try:
    ForkingPickler.loads(message)
    error = None
except Exception as exc:
    error = type(exc).__name__
other = subprocess.run(
    [sys.executable, "-c",
     "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\\n"
     "try:\\n fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('taken')\\n"
     "except OSError: print('held')", db],
    capture_output=True, text=True, timeout=60)
report(error=error, lock=other.stdout.strip())
"""


def test_a_stale_locator_never_touches_another_file(tmp_path):
    db = tmp_path / "db"
    db.write_bytes(b"x" * 4096)
    result = only(*run_script(STALE_LOCATOR, str(db)))
    assert result["error"] is not None, result
    assert result["lock"] == "held", result


# ------------------------------------------------ 4, 8, 10: names and places


def test_no_other_user_can_create_a_name_in_the_run_directory():
    directory = _paths.run_dir()
    st = os.lstat(directory)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    assert os.path.dirname(_paths.socket_path("abc")) == directory
    assert os.path.dirname(_paths.session_lock_path("abc")) == directory
    assert os.path.dirname(_paths.process_lock_path(5)) == directory


needs_namespace = pytest.mark.skipif(
    isolated.NO_UNSHARE is not None, reason=str(isolated.NO_UNSHARE)
)

# A private /dev/shm for the scenario (root, a private mount namespace).
PRIVATE_SHM = (
    "unshare",
    "-m",
    "sh",
    "-c",
    'mount -t tmpfs -o size=64m,nr_inodes={inodes} tmpfs /dev/shm && exec "$@"',
    "sh",
)


def private_shm(inodes=100000):
    return tuple(x.format(inodes=inodes) for x in PRIVATE_SHM)


PLANTED_RUN_DIR = """
# Another user's directory (and file) under the run directory's first names:
# every process of the session passes over them to the same directory, and
# they find one keeper.
import multiprocessing as mp
def member(out):
    out.put((_paths.run_dir(), _session.session_id(), _session.keeper_pid()))
if __name__ == "__main__":
    results = []
    for method in ("fork", "spawn", "forkserver"):
        ctx = mp.get_context(method)
        out = ctx.Queue()
        p = ctx.Process(target=member, args=(out,))
        p.start()
        results.append(out.get(timeout=60))
        p.join(30)
    a = np.arange(1 << 16)
    back = ForkingPickler.loads(ForkingPickler.dumps(a))
    report(here=[_paths.run_dir(), _session.session_id(), _session.keeper_pid()],
           members=results, shared=bool(np.shares_memory(a, back) or
                                         torchshm.is_shared(back)))
"""


@needs_namespace
def test_a_planted_run_directory_is_passed_over_by_every_member():
    uid = os.geteuid()
    plant = (
        f"mkdir /dev/shm/torchshm-{uid} && chown {OTHER_UID} /dev/shm/torchshm-{uid}"
        f" && touch /dev/shm/torchshm-{uid}.1"
        f' && chown {OTHER_UID} /dev/shm/torchshm-{uid}.1 && exec "$@"'
    )
    wrapper = private_shm() + ("sh", "-c", plant, "sh")
    result = only(*run_script(PLANTED_RUN_DIR, wrapper=wrapper, timeout=180))
    here = result["here"]
    assert here[0] == f"/dev/shm/torchshm-{uid}.2"
    assert all(m == here for m in result["members"]), result


PLANTED_NAMES_COST = """
# 100,000 names of another user in /dev/shm cost an idle keeper nothing.
keeper = _session.keeper_pid()
def cpu():
    with open(f"/proc/{keeper}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
os.setegid(65534); os.seteuid(65534)
for i in range(100000):
    os.close(os.open(f"/dev/shm/torchshm-{i:016x}.lock", os.O_CREAT | os.O_WRONLY))
os.seteuid(0); os.setegid(0)
before = cpu()
time.sleep(12)  # an orphan scan (every 10 s) and a dozen idle ticks
report(cpu=cpu() - before)
"""


@needs_namespace
def test_names_another_user_plants_cost_an_idle_keeper_nothing():
    result = only(
        *run_script(PLANTED_NAMES_COST, wrapper=private_shm(200000), timeout=180)
    )
    # 0.1 s per 30 s is the bound the issue names; the old keeper spent
    # about a second per 30 s on them.
    assert result["cpu"] < 0.15, result


@needs_namespace
def test_import_without_inodes_in_dev_shm_leaves_torchshm_off_with_a_warning():
    fill = 'i=0; while touch /dev/shm/f$i 2>/dev/null; do i=$((i+1)); done; exec "$@"'
    wrapper = private_shm(64) + ("sh", "-c", fill, "sh")
    lines, run = run_script(
        """
        back = ForkingPickler.loads(ForkingPickler.dumps(np.ones(1 << 18)))
        report(registered=torchshm.is_registered(), same=float(back.sum()))
        """,
        wrapper=wrapper,
    )
    assert only(lines, run) == {"registered": False, "same": float(1 << 18)}
    assert "stays off" in run.stderr, run.stderr


@needs_namespace
def test_import_without_proc_leaves_torchshm_working_or_off_never_raising():
    wrapper = ("unshare", "-m", "sh", "-c", 'umount -l /proc && exec "$@"', "sh")
    lines, run = run_script(
        "report(same=float(ForkingPickler.loads(ForkingPickler.dumps("
        "np.ones(1 << 18))).sum()))",
        wrapper=wrapper,
    )
    assert only(lines, run) == {"same": float(1 << 18)}, run.stderr


# ------------------------------------------------ a receiver at its fd limit

RECEIVER_AT_ITS_FD_LIMIT = """
# A receiver whose soft fd limit leaves no fd free still loads what it is
# sent (through the creator's fd: the keeper is killed first).
import resource
message = bytes(ForkingPickler.dumps(np.full(1 << 17, 9.0)))
kill_keeper()
code = (
    "import os, resource, sys, torchshm\\n"
    "from multiprocessing.reduction import ForkingPickler\\n"
    "blob = sys.stdin.buffer.read()\\n"
    "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\\n"
    "used = len(os.listdir('/proc/self/fd')) - 1\\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (used, hard))\\n"
    "print(float(ForkingPickler.loads(blob).sum()))"
)
run = subprocess.run([sys.executable, "-c", code], input=message,
                     capture_output=True, timeout=60)
report(out=run.stdout.decode().strip(), err=run.stderr.decode()[-800:])
"""


def test_a_receiver_at_its_fd_limit_still_loads():
    result = only(*run_script(RECEIVER_AT_ITS_FD_LIMIT))
    assert result["out"] == str(9.0 * (1 << 17)), result["err"]
