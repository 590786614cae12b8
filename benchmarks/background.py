"""What torchshm costs while nothing happens: CPU of the session's keeper and
of every background thread, with many segments alive (issue 20).

    python -m benchmarks.background [--segments 10000] [--seconds 60]

A producer makes N arrays born in shared memory (one segment each, 300 KB:
above the threshold, so they are sent by reference) and sends them to a
consumer that keeps them all; then both sit idle while this script reads the
CPU time of the keeper, the producer and the consumer over --seconds. Then
the consumer drops everything and the producer frees its arrays: their
segments go back to its pool, idle (the pool's idle time is set above the
measurement, so that they stay), and the consumer keeps their mappings
cached; the same is measured again. The target: under 1% of a core for all
of it.

A control process holds as many bytes of plain NumPy arrays, without
torchshm, and sleeps: on a paravirtualized VM a process is charged CPU for
merely holding gigabytes (each wake-up of any of its threads costs tens of
milliseconds; 0.3 ms in a small process), and the control shows how much.
Each figure is read twice: from /proc/<pid>/stat (whole ticks, sampled) and
from /proc/<pid>/task/*/schedstat (the scheduler's exact runtime).
"""

import argparse
import multiprocessing as mp
import os
import time

import numpy as np

import torchshm
from torchshm._lifetime import session as _session

ARRAY_FLOATS = 37_500  # 300 KB
OURS = ("keeper", "producer", "consumer")


def cpu_seconds(pid):
    """(utime + stime from /proc/<pid>/stat, runtime from schedstat) of a
    process, all its threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    exact = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                exact += int(f.read().split()[0])
        except OSError:
            pass  # a thread that just ended
    return ticks, exact / 1e9


def producer(n, outbox, control):
    with torchshm.allocating(min_bytes=1):
        arrays = [np.full(ARRAY_FLOATS, float(i)) for i in range(n)]
    assert all(torchshm.is_shared(a) for a in arrays[:10])
    for i in range(0, n, 500):
        outbox.put(arrays[i : i + 500])
    outbox.put(None)
    control.get()  # idle, holding every array
    del arrays  # back to the pool, idle
    outbox.put("freed")
    control.get()


def consumer(inbox, report, control):
    kept = []
    for batch in iter(inbox.get, None):
        kept.extend(batch)
    report.put(("kept", len(kept), all(torchshm.is_shared(a) for a in kept)))
    control.get()  # idle, holding every array
    del kept, batch
    report.put(("dropped",))
    control.get()


def holder(n, queue):
    """The control: the same bytes as plain NumPy arrays, no torchshm."""
    arrays = [np.full(ARRAY_FLOATS, float(i)) for i in range(n)]
    queue.put("ready")
    queue.get()
    del arrays


def measure(pids, seconds):
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    return {
        name: tuple(a - b for a, b in zip(after[name], before[name])) for name in pids
    }


def table(rows, seconds):
    def cell(ticks, exact):
        return f"{100 * ticks / seconds:.2f}% ({100 * exact / seconds:.2f}%)"

    lines = [
        "| phase | keeper | producer | consumer | torchshm's three | control |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for phase, cpu in rows:
        cells = [cell(*cpu[k]) for k in OURS]
        cells.append(cell(*(sum(cpu[k][i] for k in OURS) for i in (0, 1))))
        cells.append(cell(*cpu["control"]))
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.background")
    parser.add_argument("--segments", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    # Idle pooled segments stay pooled while measured (the expiry's release
    # is work done once, not background cost).
    os.environ["TORCHSHM_POOL_IDLE_SECONDS"] = str(10 * args.seconds)
    ctx = mp.get_context("spawn")
    items, report = ctx.Queue(), ctx.Queue()
    to_producer, to_consumer, to_control = ctx.Queue(), ctx.Queue(), ctx.Queue()
    processes = {
        "producer": ctx.Process(
            target=producer, args=(args.segments, items, to_producer)
        ),
        "consumer": ctx.Process(target=consumer, args=(items, report, to_consumer)),
        "control": ctx.Process(target=holder, args=(args.segments, to_control)),
    }
    for p in processes.values():
        p.start()
    started = time.monotonic()
    _, count, shared = report.get(timeout=1800)
    assert to_control.get(timeout=600) == "ready"
    print(
        f"{count} arrays kept by the consumer (shared: {shared}),"
        f" sent in {time.monotonic() - started:.1f} s"
    )
    status = _session.status()
    print(f"keeper pid {status['pid']}: {len(status['segments'])} live segments")
    pids = {"keeper": status["pid"]}
    pids.update({name: p.pid for name, p in processes.items()})
    rows = [("all alive", measure(pids, args.seconds))]
    to_consumer.put("drop")
    report.get(timeout=600)
    to_producer.put("free")
    assert items.get(timeout=600) == "freed"
    time.sleep(2)  # the keeper closes what the consumer let go
    status = _session.status()
    print(f"after freeing: {len(status['segments'])} segments pooled, idle")
    rows.append(("idle in the pool", measure(pids, args.seconds)))
    print()
    print(
        f"CPU over {args.seconds:.0f} s, {args.segments} segments, share of one"
        " core: /proc/<pid>/stat (schedstat)"
    )
    print(table(rows, args.seconds))
    for queue in (to_producer, to_consumer, to_control):
        queue.put("exit")
    for p in processes.values():
        p.join(120)


if __name__ == "__main__":
    main()
