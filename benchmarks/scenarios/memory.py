"""7. Memory: N workers receiving one 1 GB model, total PSS.

An owner process builds the model (a dict of float32 arrays) and sends it to
N worker processes, which read every page and hold it. PSS splits each shared
page among the processes that map it, so the sum over owner + workers is the
memory the model really costs; it is reported as the increase over the same
processes before the model existed.
"""

import multiprocessing as mp

import numpy as np
import psutil

from benchmarks.report import Result
from benchmarks.transports import (
    METHODS,
    TIMEOUT,
    finish,
    prepare,
    setup_sender,
    touch,
)

NAME = "memory"


def make_model(nbytes, parts=8):
    return {
        f"layer{i}": np.full(nbytes // parts // 4, i, dtype=np.float32)
        for i in range(parts)
    }


def _owner(method, nbytes, links, control):
    setup_sender(method)
    control.send("ready")
    control.recv()
    model = prepare(method, make_model(nbytes))
    for link in links:
        link.send(model)
    control.send("sent")
    control.recv()  # stay alive: torch's fd strategy needs the sender


def _worker(method, link, control):
    control.send("ready")
    model = finish(method, link.recv())
    touch(model)
    control.send("held")
    control.recv()


def _recv(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no answer in {TIMEOUT} s")
    return conn.recv()


def pss_total(processes):
    return sum(psutil.Process(p.pid).memory_full_info().pss for p in processes)


def measure(method, nbytes, workers):
    """Bytes of PSS the model adds to owner + workers, summed."""
    # fork: starting 5 processes per method under spawn costs more than the
    # measurement; PSS is measured as an increase, so inherited pages cancel.
    ctx = mp.get_context("fork")
    processes, controls, owner_links = [], [], []
    try:
        for _ in range(workers):
            send_end, recv_end = ctx.Pipe()
            control, child = ctx.Pipe()
            processes.append(
                ctx.Process(target=_worker, args=(method, recv_end, child), daemon=True)
            )
            controls.append(control)
            owner_links.append(send_end)
        control, child = ctx.Pipe()
        processes.append(
            ctx.Process(
                target=_owner, args=(method, nbytes, owner_links, child), daemon=True
            )
        )
        controls.append(control)
        for p in processes:
            p.start()
        for c in controls:
            assert _recv(c) == "ready"
        before = pss_total(processes)
        controls[-1].send("go")
        for c in controls:
            _recv(c)  # "held" from workers, "sent" from the owner
        return pss_total(processes) - before
    finally:
        for c in controls:
            try:
                c.send("exit")
            except OSError:
                pass
        for p in processes:
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join()


def run(quick, bar):
    nbytes, workers = ((64 << 20), 2) if quick else ((1 << 30), 4)
    result = Result(
        NAME,
        f"7. {nbytes >> 20} MiB model sent to {workers} workers: extra PSS, total",
        unit="B",
        notes=[
            "Owner + workers, after every worker read every page; one run"
            " (memory is deterministic). Ideal: one copy of the model.",
        ],
    )
    bar.reset(total=len(METHODS))
    label = f"{workers} workers"
    for method in METHODS:
        result.add(label, method, [measure(method, nbytes, workers)], warmup=0)
        bar.update()
    copies = {m: result.get(label, m)["median"] / nbytes for m in METHODS}
    result.summary["model_copies"] = copies
    result.notes.append(
        "Model copies: " + ", ".join(f"{m} {c:.2f}" for m, c in copies.items())
    )
    return result
