"""torchshm leaves no thread alive across fork.

Python 3.12+ warns "This process is multi-threaded, use of fork() may lead to
deadlocks in the child" when a process forks with more than one OS thread
(it counts /proc/self/stat's threads, not only Python's). torchshm's threads
are the ones that split a large copy into shared memory (csrc/base/ndarray.cpp)
or populate a fresh segment (csrc/lifetime/segment.cpp), joined before the send
returns, and the expiry timer that gives idle memory back
(torchshm/_lifetime/expiry.py), which torchshm's own before-fork hook stops and the
next send or receive restarts (not the after-fork hook: Python 3.13 counts
threads after those hooks). A joined thread is still listed for a moment
(pthread_join and Thread.join return before the task leaves the thread
group), long enough on a busy machine to be counted: the hook also waits
until they are gone (Note [Threads at fork] in csrc/base/parallel.h). So at the
fork, and right after it, a process that sent and received large arrays has
the threads it had before, every time: the test forks right after sending,
many times over. The warnings seen in the suite's fork tests come from other
threads: a multiprocessing.Queue's feeder thread (alive until the queue is
closed) and torch's intra-op thread pool, both in the test process itself.
"""

import json
import subprocess
import sys
import textwrap

from tests.conftest import TIMEOUT

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, warnings

    ROUNDS = int(sys.argv[1])

    def tasks():  # "tid name state" of each thread that /proc/self/task lists
        listed = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
                name, state = stat[stat.index("(") + 1 :].rsplit(") ", 1)
                listed.append(f"{tid} {name} {state[0]}")
            except OSError:  # gone since it was listed
                listed.append(f"{tid} gone")
        return listed


    def threads():  # the thread ids
        return sorted(os.listdir("/proc/self/task"))


    # Before-fork hooks run in reverse order of registration: this one runs
    # after torchshm's, right before the fork itself.
    at_fork, after_fork = [], []
    os.register_at_fork(before=lambda: at_fork.append(tasks()))
    import numpy as np
    import torchshm
    from multiprocessing.reduction import ForkingPickler
    from torchshm import _config


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
    big = np.arange(4_000_000)  # 32 MB: split between the copy threads
    rounds = []
    # Each round restarts the expiry timer and copies, then forks at once:
    # every fork is a chance to catch a thread of torchshm's that lingers.
    for _ in range(ROUNDS):
        received = ForkingPickler.loads(ForkingPickler.dumps(big))
        batch = torchshm.collate([big[:2_000_000], big[2_000_000:]])
        shared = torchshm.is_shared(received) and torchshm.is_shared(batch)
        del received, batch
        caught = fork()
        rounds.append({
            "shared": shared,
            "at_fork": [task.split()[0] for task in at_fork[-1]],
            "listed_at_fork": at_fork[-1],
            "after_fork": after_fork[-1],
            "warnings": caught,
        })
    print(json.dumps({
        "copy_threads": _config.copy_threads(),
        "before": before,
        "python_threads": [t.name for t in threading.enumerate()],
        "fork_waits_timed_out": torchshm.stats()["fork_waits_timed_out"],
        "rounds": rounds,
    }))
    """
)


def run_script(tmp_path, script, *args, warnings="error::DeprecationWarning"):
    path = tmp_path / "script.py"
    path.write_text(script)
    run = subprocess.run(
        [sys.executable, "-W", warnings, str(path), *args],
        capture_output=True,
        text=True,
        timeout=4 * TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_no_torchshm_thread_is_alive_at_fork(tmp_path):
    result = run_script(tmp_path, SCRIPT, "60")
    summary = {k: v for k, v in result.items() if k != "rounds"}
    before = set(result["before"])
    for n, r in enumerate(result["rounds"]):
        assert r["shared"], (n, r)
        # A torchshm thread alive at the fork would be forked mid-whatever-it-does.
        # Only threads that were there before torchshm sent anything: a thread
        # of torch's own may end meanwhile (torch 2.14 starts one at import).
        assert set(r["at_fork"]) <= before, (n, r, summary)
        assert set(r["after_fork"]) <= before, (n, r, summary)
        if len(before) == 1:  # nothing else started a thread: no warning
            assert r["warnings"] == [], (n, r, summary)


BOUND = textwrap.dedent(
    """
    import json, numpy as np, torchshm
    from multiprocessing.reduction import ForkingPickler
    from torchshm import _C
    from torchshm._lifetime import expiry as _expiry

    received = ForkingPickler.loads(ForkingPickler.dumps(np.arange(100_000)))
    # The expiry timer runs (there is a pooled segment to watch): a wait for
    # torchshm's threads reaches its bound, and says so.
    running = _expiry.timer.running()
    timed_out = not _C.wait_threads_gone(0.05)
    counted = torchshm.stats()["fork_waits_timed_out"]
    _expiry.timer.halt()
    print(json.dumps([running, timed_out, counted, _C.wait_threads_gone(10.0)]))
    """
)


def test_a_wait_that_reaches_its_bound_is_counted(tmp_path):
    assert run_script(tmp_path, BOUND) == [True, True, 1, True]


RACE = textwrap.dedent(
    """
    import json, os, pickle, sys, threading, time
    import numpy as np
    from multiprocessing.reduction import ForkingPickler
    import torchshm

    # A Pool's worker handler forks new workers from one thread while its
    # result handler receives arrays in another, (re)starting the expiry
    # timer: the fork hooks must stop it without losing the lock pairing.
    failures = []
    sys.unraisablehook = lambda u: failures.append(
        f"{u.exc_type.__name__}: {u.exc_value} ({getattr(u.object, '__name__', '')})")
    stop = threading.Event()

    def receive_arrays():
        while not stop.is_set():
            got = pickle.loads(ForkingPickler.dumps(np.full(50_000, 1.0)))
            assert (got == 1.0).all()
            del got

    thread = threading.Thread(target=receive_arrays)
    thread.start()
    forks, statuses, end = 0, set(), time.monotonic() + float(sys.argv[1])
    while forks < 200 and time.monotonic() < end and not failures:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        statuses.add(os.waitpid(pid, 0)[1])
        forks += 1
    stop.set()
    thread.join()
    print(json.dumps({"forks": forks, "statuses": sorted(statuses),
                      "failures": failures[:4]}))
    """
)


def test_a_fork_while_another_thread_restarts_the_timer(tmp_path):
    # Before the fix: "cannot join thread before it is started" in the
    # before-fork hook within a few forks; the child then held no slot for
    # its views, and the after-fork hook released a lock it never took.
    # The script forks with its own thread alive: Python 3.12+ warns.
    result = run_script(tmp_path, RACE, "8", warnings="ignore::DeprecationWarning")
    assert result["failures"] == [], result
    assert result["forks"] > 0 and result["statuses"] == [0], result
