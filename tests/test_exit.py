"""A process that exits while holding arrays whose sender still lives exits
promptly, whether the arrays are freed with a module's globals or with the
frame of an uncaught exception (nothing torchshm runs during interpreter
finalization may start a thread or block: Thread.start() then never
returns).

A hang never ends, so the bound only has to be finite: it is generous because
a receiver's life is mostly torch's. Quiet, the handle case runs 3.4-3.8 s
(two interpreters import torch) and exits in 0.45-0.6 s, as a bare
`import torch, numpy` process does; beside 16 other receivers and four busy
loops (load 15) the same took up to 44 s, 8-12 s of it in libtorch's static
destructors (gdb: c10::Dispatcher::deregisterDef_ under exit()), while
torchshm's own exit work stayed under 0.05 s. On a timeout the receiver's
Python stacks (faulthandler, SIGUSR1) go into the failure message."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import TIMEOUT

ROOT = __file__.rsplit("/tests/", 1)[0]

# The receiver script: gets an array from a sender that stays alive (a bare
# os.fork child, or another session's process exporting a handle), keeps it
# as the test asks, then ends.
SCRIPT = textwrap.dedent(
    """
    import faulthandler, signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import os, pickle, subprocess, sys, time
    import numpy as np
    import torchshm
    from multiprocessing.reduction import ForkingPickler

    sender, ending = sys.argv[1], sys.argv[2]
    if sender == "fork":
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the sender: sends, then lives on
            os.close(r)
            data = bytes(ForkingPickler.dumps(np.full(200_000, 7.0)))
            os.write(w, len(data).to_bytes(8, "little") + data)
            time.sleep(60)
            os._exit(0)
        os.close(w)
        n = int.from_bytes(os.read(r, 8), "little")
        data = b""
        while len(data) < n:
            data += os.read(r, n - len(data))
        received = pickle.loads(data)
    else:  # another session's process exports a handle and lives on
        env = dict(os.environ)
        env.pop("TORCHSHM_SESSION")
        exporter = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, time, numpy as np, torchshm;"
             "a = np.full(200_000, 7.0);"
             "sys.stdout.buffer.write(torchshm.dumps(a).hex().encode() + b'\\\\n');"
             "sys.stdout.flush(); time.sleep(60)"],
            stdout=subprocess.PIPE, env=env,
        )
        received = torchshm.loads(bytes.fromhex(exporter.stdout.readline().decode()))
        pid = exporter.pid
    assert torchshm.is_shared(received) and received[0] == 7.0
    print(pid, flush=True)
    HELD = received  # a module global, freed during finalization
    if ending == "exception":
        def crash(batch):
            raise RuntimeError("the training loop crashed")
        crash(received)  # its frame, in the traceback, holds the batch
    """
)


# See the module's docstring: finite, and far above a loaded machine's 44 s.
BOUND = 4 * TIMEOUT


def _wait_or_dump(proc, err):
    """Waits up to BOUND for the receiver; if it is still running, has it
    dump its Python stacks to `err` and fails with them."""
    try:
        proc.wait(timeout=BOUND)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.send_signal(signal.SIGUSR1)
    time.sleep(2)  # faulthandler writes from its signal handler
    pytest.fail(
        f"the receiver did not exit within {BOUND} s of its start; its stderr,"
        f" with its stacks at the deadline:\n{err.read_text()}"
    )


@pytest.mark.timeout(BOUND + 60)
@pytest.mark.parametrize("sender", ["fork", "handle"])
@pytest.mark.parametrize("ending", ["global", "exception"])
def test_a_receiver_exits_promptly_while_its_sender_lives(tmp_path, sender, ending):
    script = tmp_path / "receiver.py"
    script.write_text(SCRIPT)
    # Files, not pipes: the sender, alive on purpose, inherits them, and a
    # pipe would read as open until it exits.
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script), sender, ending],
            stdout=stdout,
            stderr=stderr,
            cwd=tmp_path,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
    try:
        _wait_or_dump(proc, err)  # a hang fails here
        assert proc.returncode == (1 if ending == "exception" else 0), err.read_text()
        if ending == "exception":
            assert "the training loop crashed" in err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        words = out.read_text().split()
        if words:
            try:
                os.kill(int(words[0]), signal.SIGKILL)  # the sender
            except ProcessLookupError:
                pass


# A daemon thread in torchshm's native work (the GIL released) when the main
# thread returns: CPython ends it when it asks for the GIL back, which must
# never abort the process (Note [The GIL at exit] in csrc/base/gil.h). Arrays
# only, in the steady state: torch's own bindings abort the same way
# (pytorch/pytorch#38228: a daemon thread sending tensors without torchshm
# aborted 9 exits in 10), and the first send of an array makes its segment
# through torch calls.
DAEMON_AT_EXIT = """
import itertools, sys, threading, time
import numpy as np
import torchshm
from multiprocessing.reduction import ForkingPickler

big = np.ones(8 << 20)  # 64 MiB: each send copies it, the GIL released
started = threading.Event()

def send_for_ever():
    # Past the first sends, which make the pool's segment in Python (torch
    # calls): from then on a send is torchshm's native copy alone.
    for sends in itertools.count(1):
        ForkingPickler.dumps(big)
        if sends == 3:
            started.set()

threading.Thread(target=send_for_ever, daemon=True).start()
started.wait()
time.sleep(float(sys.argv[1]))
print("main returns", flush=True)
"""


def own_session_env():
    """This environment without its session: a process of a session of its
    own, whose unread messages keep nothing of ours (a message not sent
    through a pipe keeps its memory until its session ends)."""
    return {k: v for k, v in os.environ.items() if k != "TORCHSHM_SESSION"}


def test_a_daemon_thread_copying_an_array_when_the_main_thread_returns_never_aborts():
    # Several moments, so that exits catch the thread mid-copy and waiting
    # for the GIL (before the fix 10 of 10 aborted; while the thread was
    # still unwound, 2 in 40 segfaulted in a catch-all that swallowed the
    # unwinding, and on Python 3.13 3 in 40 in a tensor's dealloc run by the
    # unwinding without the GIL).
    from tests.conftest import run_python

    for delay in ("0.05", "0.13", "0.31", "0.52"):
        run = run_python(DAEMON_AT_EXIT, delay, env=own_session_env())
        assert (run.returncode, run.stdout) == (0, "main returns\n"), run.stderr[-2000:]


# A thread that starts a message only once torchshm's exit hook has run (a
# finalizer below the hook's priority lets it go), while the main thread's
# next finalizer gives it time to finish, were it allowed to.
SEND_AFTER_THE_EXIT_HOOK = """
import threading, time
import numpy as np
import torchshm
from multiprocessing import util
from multiprocessing.reduction import ForkingPickler

big = np.ones(1 << 20)
go = threading.Event()

def send_late():
    go.wait()
    data = ForkingPickler.dumps(big)
    print("by value" if b"rebuild_by_value" in bytes(data) else "shared", flush=True)

threading.Thread(target=send_late, daemon=True).start()
ForkingPickler.dumps(big)  # the session, the pool: made before the exit
util.Finalize(None, go.set, exitpriority=-200)
util.Finalize(None, lambda: time.sleep(1.0), exitpriority=-300)
print("main returns", flush=True)
"""


def test_a_message_begun_once_the_exit_hook_has_run_goes_by_value():
    # Note [Messages at exit] in csrc/send/message.h: a message it shared
    # could drop a tensor during finalization, which torch's dealloc turns
    # into an abort; a thread that slept instead would hang an atexit
    # handler that joins it. So it is pickled by value, under torchshm's
    # name, and the exit goes on.
    from tests.conftest import run_python

    run = run_python(SEND_AFTER_THE_EXIT_HOOK, env=own_session_env())
    expected = (0, "main returns\nby value\n")
    assert (run.returncode, run.stdout) == expected, run.stderr[-2000:]
