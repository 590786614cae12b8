"""4. Per-item cost from 1 KiB to 512 MiB, and where sharing starts to pay.

`torchshm_always` (threshold 0) shares every array: the smallest size from
which it beats pipe + pickle at every larger size is the crossover, the
natural default for torchshm's threshold. `torchshm` (the default threshold)
must never be slower than pipe + pickle.

`pipe_again` is the same as `pipe` from a second sender process: the A/A
control. Each method sends from a process of its own, and on this 2-core VM
two identical senders differed by up to 4% (median of the round-robin), so a
torchshm / pipe ratio within the A/A spread of the same run is no
difference at all.
"""

import contextlib

import numpy as np

import torchshm
from benchmarks import peers
from benchmarks.report import Result, fmt
from benchmarks.transports import METHODS, pinned, round_order, sender

NAME = "per_item"
KIB, MIB = 1 << 10, 1 << 20
FULL_SIZES = [
    *(KIB * k for k in (1, 4, 16, 32, 64, 128, 256, 512, 768)),
    *(MIB * m for m in (1, 4, 16, 64, 256, 512)),
]
QUICK_SIZES = [KIB * k for k in (1, 16, 64, 128, 256)] + [MIB * m for m in (1, 16)]
RATIO = "torchshm / min(pipe, torch)"
# The peers up to here (issue 41 asks 4 KiB-1 MiB; scenario 1 has 400 MB):
# joblib pickles, and 10 rounds of 512 MiB would add minutes.
PEER_MAX = 16 * MIB


def make_bytes(nbytes):
    return np.full(nbytes, 1, dtype=np.uint8)


def size_label(nbytes):
    return fmt(nbytes, "B").replace(".00", "")


def run(quick, bar):
    sizes, budget, most = (QUICK_SIZES, 0.05, 50) if quick else (FULL_SIZES, 0.5, 300)
    ours = METHODS + ("torchshm_always", "pipe_again")
    rivals = peers.methods(peers.SEND_METHODS + ("tensordict",))
    result = Result(
        NAME,
        "4. Per item, one uint8 array child -> parent (ping-pong)",
        notes=[
            "Persistent processes, set-up excluded; each size is repeated for"
            f" ~{budget} s (at least 3, at most {most}) after one warm-up send.",
        ],
    )
    bar.reset(total=len(ours + rivals) * len(sizes))
    # Round-robin per size: every method gets a slice of its repetitions in
    # turn, so drift or a burst of load on this 2-core machine hits all alike
    # (sub-millisecond items are otherwise dominated by it).
    rounds = 3 if quick else 10
    pinned_below = torchshm.get_threshold()
    for nbytes in sizes:
        with pinned() if nbytes < pinned_below else contextlib.nullcontext():
            measure_size(result, nbytes, ours, rivals, budget, most, rounds, bar)
    summarize_crossover(result, sizes)
    result.notes.append(
        f"Below the threshold ({size_label(pinned_below)}) the receiver and each"
        " sender run pinned on two CPUs, the senders told they have one: where"
        " the scheduler put a sender decided a round trip of tens of"
        " microseconds (Note [Pinned ping-pong] in benchmarks/transports.py);"
        " Ray's and joblib's workers are not pinned."
    )
    peers.against_best(result)
    peers.note_versions(result, rivals)
    return result


def measure_size(result, nbytes, ours, rivals, budget, most, rounds, bar):
    """Every method's sends of one size, the methods in turn."""
    methods = ours + (rivals if nbytes <= PEER_MAX else ())
    counts, seconds = {}, {m: [] for m in methods}
    for method in methods:
        first = peers.attempt(
            result,
            size_label(nbytes),
            method,
            lambda: sender(method).measure(make_bytes, (nbytes,), 1),
        )
        if first is None:
            bar.update()
            continue
        counts[method] = max(rounds, min(most, int(budget / max(first[0], 1e-5))))
    # The order changes each round too (round_order), so that no method
    # always follows the same one (scenario 5: the method after a
    # 1000-tensor message paid for its clean-up).
    for round_ in range(rounds):
        for method in round_order(counts, round_):
            per_round = -(-counts[method] // rounds)
            seconds[method] += sender(method).measure(make_bytes, (nbytes,), per_round)
    for method in counts:
        result.add(size_label(nbytes), method, seconds[method], warmup=0)
        bar.update()


def summarize_crossover(result, sizes):
    labels = [size_label(n) for n in sizes]
    worst = 0.0
    for label in labels:
        shm = result.get(label, "torchshm")["median"]
        pipe = result.get(label, "pipe")["median"]
        torch = result.get(label, "torch")["median"]
        tensors = result.get(label, "torch_torchshm")["median"]
        result.extra(label, "tensor via torchshm / torch", tensors / torch)
        result.extra(label, "torchshm / pipe", shm / pipe)
        result.extra(label, RATIO, shm / min(pipe, torch))
        again = result.get(label, "pipe_again")["median"]
        result.extra(label, "A/A: pipe again / pipe", again / pipe)
        worst = max(worst, shm / pipe)
    # The crossover: the smallest size from which sharing wins at every size.
    crossover = None
    for nbytes, label in reversed(list(zip(sizes, labels))):
        if result.ratio(label, "torchshm_always") >= 1:
            break
        crossover = nbytes
    result.summary = {"crossover_bytes": crossover, "worst_torchshm_over_pipe": worst}
    result.notes.append(
        "Crossover (sharing every array beats pipe + pickle from here up): "
        + (size_label(crossover) if crossover else "none measured")
        + f". Worst torchshm / pipe at any size: {worst:.2f}."
    )
