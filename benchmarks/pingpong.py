"""One message's round trip, precisely enough to compare two builds.

    python -m benchmarks.pingpong [--size 512K] [--messages 400] [--start spawn]

A child sends a fresh uint8 array of --size through a Pipe and waits for an
ack; the parent reads one byte per page of it, drops it and acks. Seven
batches of --messages; the median batch's time per round trip is printed.
On this noisy shared machine a difference of a few microseconds shows only
when two builds alternate, several times, each run short:

    for i in 1 2 3 4 5 6; do for tree in A B; do
        (cd $tree && .venv/bin/python -m benchmarks.pingpong --size 512K); done; done

The per_item scenario covers every size and method; this one isolates the
per-message cost of torchshm's own path (sender copy, ticket, receive, the
view's death) for the A/B.
"""

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

import torchshm

UNITS = {"K": 1 << 10, "M": 1 << 20}
BATCHES = 7


def nbytes_of(text):
    unit = UNITS.get(text[-1:].upper(), 1)
    return int(text[:-1] if unit > 1 else text) * unit


def child(conn, nbytes):
    torchshm.register()
    while True:
        count = conn.recv()
        if count == 0:
            return
        for _ in range(count):
            conn.send(np.full(nbytes, 1, np.uint8))
            conn.recv_bytes()


def round_trip_us(nbytes, messages, start):
    ctx = mp.get_context(start)
    here, there = ctx.Pipe()
    proc = ctx.Process(target=child, args=(there, nbytes))
    proc.start()
    per_batch = []
    try:
        for _ in range(BATCHES):
            here.send(messages)
            t0 = time.perf_counter()
            for _ in range(messages):
                array = here.recv()
                int(array[::4096].sum())
                del array
                here.send_bytes(b"1")
            per_batch.append((time.perf_counter() - t0) / messages * 1e6)
        here.send(0)
    finally:
        proc.join(30)
    return statistics.median(per_batch), min(per_batch)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512K")
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--start", default="spawn", choices=mp.get_all_start_methods())
    args = parser.parse_args()
    median, best = round_trip_us(nbytes_of(args.size), args.messages, args.start)
    print(
        f"{args.size} {args.start}: {median:.1f} us per round trip"
        f" (median of {BATCHES} batches of {args.messages}; best {best:.1f})"
    )


if __name__ == "__main__":
    main()
