"""5. Many small arrays in one message.

Below the threshold torchshm pickles an array inline until the message has
carried a threshold's worth of arrays of at least PACK_MIN (1 KiB), then
packs the rest into one shared chunk; `torchshm_always` (threshold 0) and one
torch tensor per array show what sharing every array costs.
"""

import numpy as np

from benchmarks import peers
from benchmarks.report import Result
from benchmarks.transports import METHODS, round_order, sender

NAME = "many_small"


def make_arrays(count, nbytes):
    return [np.full(nbytes // 8, i, dtype=np.float64) for i in range(count)]


def run(quick, bar):
    count, sends = (200, 4) if quick else (1000, 8)
    cases = [(count, 1 << 10), (count, 4 << 10), (count, 64 << 10)]
    methods = (
        METHODS
        + ("torchshm_always",)
        + peers.methods(peers.SEND_METHODS + ("tensordict",))
    )
    result = Result(
        NAME,
        "5. Many small arrays in one message (a list), child -> parent",
        notes=[
            "torch tensor = one torch.from_numpy tensor per array;"
            f" median [min-max] of sends 2..{sends}, the methods in turn"
            " (a send of each case per method per round).",
        ],
    )
    bar.reset(total=len(methods) * sends)
    labels = [(f"{n} x {nbytes >> 10} KiB", n, nbytes) for n, nbytes in cases]
    seconds = {(m, label): [] for m in methods for label, _, _ in labels}
    # Round-robin, one send of each case per method per round (the first is
    # the warm-up): a message of 10-20 ms read twice as slow from one minute
    # to the next on this VM, and a method measured in one block took
    # whichever state the machine was in (torchshm 8.5 ms in one run, 17.6 ms
    # in the next, the pipe 9.9 and 14.6 ms). The order changes each round
    # (round_order): what a heavy method leaves to clean up (1000 tensors'
    # storages) falls on a different next method each time.
    for round_ in range(sends):
        for method in round_order(methods, round_):
            for label, n, nbytes in labels:
                if (method, label) not in seconds:
                    continue
                sample = peers.attempt(
                    result,
                    label,
                    method,
                    lambda: sender(method).measure(make_arrays, (n, nbytes), 1),
                )
                if sample is None:  # its error is the row's text
                    del seconds[method, label]
                else:
                    seconds[method, label] += sample
            bar.update()
    for (method, label), samples in seconds.items():
        result.add(label, method, samples)
    peers.against_best(result)
    peers.note_versions(result, methods)
    return result
