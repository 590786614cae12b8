"""torchshm leaves no thread alive across fork.

Python 3.12+ warns "This process is multi-threaded, use of fork() may lead to
deadlocks in the child" when a process forks with more than one OS thread
(it counts /proc/self/stat's threads, not only Python's). torchshm's threads
are the ones that split a large copy into shared memory (csrc/ndarray.cpp),
joined before the send returns, and the expiry timer that gives idle memory
back (torchshm/_segments.py), which torchshm's own before-fork hook stops and
the next send or receive restarts (not the after-fork hook: Python 3.13
counts threads after those hooks). So at the fork, and right after it, a
process that sent and received large arrays has the threads it had before.
The warnings seen in the suite's fork tests come from other threads: a
multiprocessing.Queue's feeder thread (alive until the queue is closed) and
torch's intra-op thread pool, both in the test process itself.
"""

import json
import subprocess
import sys
import textwrap

from tests.conftest import TIMEOUT

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, warnings

    # Before-fork hooks run in reverse order of registration: this one runs
    # after torchshm's, right before the fork itself.
    at_fork, after_fork = [], []
    os.register_at_fork(
        before=lambda: at_fork.append(len(os.listdir("/proc/self/task")))
    )
    import numpy as np
    import torchshm
    from multiprocessing.reduction import ForkingPickler
    from torchshm import _config


    def threads():
        return len(os.listdir("/proc/self/task"))


    def fork():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            # Python 3.13 counts threads for its warning after the after-fork
            # hooks: none of torchshm's may have started again by then.
            after_fork.append(threads())
            os.waitpid(pid, 0)
        return [str(w.message) for w in caught]


    before = threads()
    big = np.arange(50_000_000)  # 400 MB: split between the copy threads
    received = ForkingPickler.loads(ForkingPickler.dumps(big))
    batch = torchshm.collate([big[:10_000_000], big[10_000_000:20_000_000]])
    print(json.dumps({
        "copy_threads": _config.copy_threads(),
        "shared": torchshm.is_shared(received) and torchshm.is_shared(batch),
        "before": before,
        "python_threads": [t.name for t in threading.enumerate()],
        "warnings": fork(),
        "at_fork": at_fork[-1],
        "after_fork": after_fork[-1],
    }))
    """
)


def test_no_torchshm_thread_is_alive_at_fork(tmp_path):
    script = tmp_path / "fork_after_send.py"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", str(script)],
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["shared"]
    # A torchshm thread alive at the fork would be forked mid-whatever-it-does.
    assert result["at_fork"] == result["before"], result
    assert result["after_fork"] == result["before"], result
    if result["before"] == 1:  # nothing else started a thread: no warning
        assert result["warnings"] == [], result
