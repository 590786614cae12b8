"""Processes whose target returns while a non-daemon thread it started goes
on sending, receiving or holding arrays (Note [Exit after the threads] in
torchshm/_lifetime/lifecycle.py), and the parent's side of each case.

tests/test_exit_threads.py runs each case with torchshm, and as the control
with arrays in a fresh interpreter with TORCHSHM_DISABLE=1 (control()):
plain multiprocessing must give the same outcome, or the case tests Python
rather than torchshm."""

import json
import multiprocessing as mp
import pickle
import threading
from multiprocessing import util
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

import torchshm  # noqa: F401 - a spawn or forkserver child registers too

TIMEOUT = 60
NBYTES = 4 << 20
KINDS = ("array", "tensor")
CASES = ("hold", "send_pipe", "send_queue", "receive", "pool_hold", "pool_send")
SENDS = 5
# The parent's sends of other items of the same size while the thread holds
# one: a sender's pool reuses a segment as soon as nothing holds it.
CHURN = 20


def item(kind, value):
    if kind == "array":
        return np.full(NBYTES // 8, float(value))
    return torch.full((NBYTES // 8,), float(value), dtype=torch.float64)


def _bytes(x):
    return (x.numpy() if isinstance(x, torch.Tensor) else x).tobytes()


def _value(x):
    return float(x[0])


# --- the child's side: the target returns at once; its thread waits until
# the exit finalizers have run, then works.


def _later(work, *args):
    """Runs work(*args) in a non-daemon thread once the process has begun to
    exit: multiprocessing's exit finalizers reached priority -50, just above
    torchshm's exit hook (-100: Python up to 3.12 runs them as the target
    returns, and without Note [Exit after the threads] that hook has let go
    by the time the thread works), or the threads are about to be joined
    (the functions threading runs first; Python 3.13 runs the finalizers
    only after the join), whichever comes first."""
    exiting = threading.Event()
    util.Finalize(None, exiting.set, exitpriority=-50)
    threading._register_atexit(exiting.set)

    def run():
        if exiting.wait(TIMEOUT):
            work(*args)

    threading.Thread(target=run, daemon=False).start()


def _report_changes(conn, held, before):
    conn.send("ready")
    conn.recv()  # the parent has sent other items meanwhile
    now = np.frombuffer(_bytes(held), np.uint8)
    conn.send(int(np.count_nonzero(now != np.frombuffer(before, np.uint8))))


def hold(conn, kind):
    held = conn.recv()
    _later(_report_changes, conn, held, _bytes(held))


def _send_all(put, kind):
    for i in range(SENDS):
        put(item(kind, i))


def send_pipe(conn, kind):
    _later(_send_all, conn.send, kind)


def send_queue(queue, kind):
    _later(_send_all, queue.put, kind)


def _receive_all(conn):
    conn.send("ready")
    conn.send([_value(conn.recv()) for _ in range(SENDS)])


def receive(conn, kind):
    _later(_receive_all, conn)


_pool_conn = None


def _keep_conn(conn):
    """The Pool's initializer: the worker's end of the pipe (given to the
    worker as it starts: a Connection sent with a task would start
    multiprocessing's fd-sharing listener in the parent, an fd it keeps)."""
    global _pool_conn
    _pool_conn = conn


def pool_hold(held):
    """A Pool task that leaves a thread holding its argument; the worker
    exits when the pool closes."""
    _later(_report_changes, _pool_conn, held, _bytes(held))


def pool_send(kind):
    _later(_send_all, _pool_conn.send, kind)


# --- the parent's side


def _churn(kind):
    for _ in range(CHURN):
        pickle.loads(ForkingPickler.dumps(item(kind, 9)))


def _expect(conn, what):
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no {what} within {TIMEOUT} s")
    return conn.recv()


def _check_changes(conn, kind):
    assert _expect(conn, "ready") == "ready"
    _churn(kind)
    conn.send("check")
    return _expect(conn, "count of changed bytes")


def _delivered(get):
    """The values of what arrived, and the error that stopped it, if any."""
    got = []
    try:
        for _ in range(SENDS):
            got.append(_value(get()))
    except Exception as exc:  # noqa: BLE001 - what did arrive is the outcome
        got.append(repr(exc))
    return got


def _end(process):
    process.join(TIMEOUT)
    if process.exitcode is None:
        process.kill()
        process.join(TIMEOUT)
        return "hung"
    return process.exitcode


def _in_process(ctx, case, kind):
    mine, theirs = ctx.Pipe()
    queue = ctx.Queue() if case == "send_queue" else None
    target = globals()[case]
    process = ctx.Process(target=target, args=(queue or theirs, kind))
    process.start()
    theirs.close()
    outcome = {}
    try:
        if case == "hold":
            sent = item(kind, 1)
            mine.send(sent)
            del sent  # a tensor's segment goes back to the pool
            outcome["changed"] = _check_changes(mine, kind)
        elif case == "send_pipe":
            outcome["delivered"] = _delivered(lambda: _expect(mine, "item"))
        elif case == "send_queue":
            outcome["delivered"] = _delivered(lambda: queue.get(timeout=TIMEOUT))
        else:
            assert _expect(mine, "ready") == "ready"
            for i in range(SENDS):
                mine.send(item(kind, i))
            outcome["delivered"] = _expect(mine, "values received")
    finally:
        outcome["exitcode"] = _end(process)
        mine.close()
        if queue is not None:
            queue.close()
            queue.join_thread()
    return outcome


def _in_a_pool(ctx, case, kind):
    mine, theirs = ctx.Pipe()
    pool = ctx.Pool(1, initializer=_keep_conn, initargs=(theirs,))
    outcome = {}
    try:
        if case == "pool_hold":
            pool.apply(pool_hold, (item(kind, 1),))
            pool.close()  # the worker ends; its thread still holds the item
            outcome["changed"] = _check_changes(mine, kind)
        else:
            pool.apply(pool_send, (kind,))
            pool.close()
            outcome["delivered"] = _delivered(lambda: _expect(mine, "item"))
        joiner = threading.Thread(target=pool.join, daemon=True)
        joiner.start()
        joiner.join(TIMEOUT)
        outcome["exitcode"] = "hung" if joiner.is_alive() else 0
    finally:
        pool.terminate()
        mine.close()
        theirs.close()
    return outcome


def run_case(method, case, kind):
    """The outcome of one case: what the parent saw, and how the child
    ended (0, or "hung" if it was still running TIMEOUT s after)."""
    ctx = mp.get_context(method)
    if case.startswith("pool_"):
        return _in_a_pool(ctx, case, kind)
    return _in_process(ctx, case, kind)


def expected(case):
    """What plain multiprocessing gives every case, with either kind."""
    if case in ("hold", "pool_hold"):
        return {"changed": 0, "exitcode": 0}
    return {"delivered": [float(i) for i in range(SENDS)], "exitcode": 0}


def control(method):
    """Prints every case's outcome with arrays under one start method, as
    JSON. Not tensors: torch's own sharing is no baseline here. Under its
    default strategy (file_descriptor) the sender serves each storage's fd
    until it is read, so a child that ends first loses it
    (FileNotFoundError); under file_system a spawn child that sent one
    takes 60 s to exit."""
    outcomes = {case: run_case(method, case, "array") for case in CASES}
    print(json.dumps(outcomes))
