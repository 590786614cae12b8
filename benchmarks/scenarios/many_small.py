"""5. Many small arrays in one message.

Below the threshold torchshm pickles an array inline until the message has
carried a threshold's worth of arrays of at least PACK_MIN (1 KiB), then
packs the rest into one shared chunk; `torchshm_always` (threshold 0) and one
torch tensor per array show what sharing every array costs.
"""

import numpy as np

from benchmarks import peers
from benchmarks.report import Result
from benchmarks.transports import METHODS, sender

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
            f" median [min-max] of sends 2..{sends}.",
        ],
    )
    bar.reset(total=len(methods))
    for method in methods:
        for n, nbytes in cases:
            label = f"{n} x {nbytes >> 10} KiB"
            seconds = peers.attempt(
                result,
                label,
                method,
                lambda: sender(method).measure(make_arrays, (n, nbytes), sends),
            )
            if seconds is not None:
                result.add(label, method, seconds)
        bar.update()
    peers.against_best(result)
    peers.note_versions(result, methods)
    return result
