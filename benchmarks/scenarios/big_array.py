"""1. The seed experiment: a 400 MB np.arange sent child -> parent.

Reports the first send and the steady state (sends 2..N of a fresh array, as
DataLoader epochs produce), and the effective bandwidth of the steady state.
"""

import numpy as np

from benchmarks import peers
from benchmarks.report import Result
from benchmarks.transports import LABELS, METHODS, close_sender, round_order, sender

NAME = "big_array"
CASES = ("first send", "steady (sends 2..N)")


def make_arange(n):
    return np.arange(n)


def run(quick, bar):
    n, sends, firsts = (5 * 10**6, 4, 2) if quick else (5 * 10**7, 12, 5)
    nbytes = n * 8
    result = Result(
        NAME,
        f"1. np.arange({n:.0e}) ({nbytes / 1e6:.0f} MB) child -> parent",
        notes=[
            f"{sends} sends per method, each of a freshly built array; steady ="
            " median [min-max] of sends 2..N. The receiver reads every page.",
            f"First send: median [min-max] of {firsts} first sends, each from a"
            " fresh sender, the methods in a new order each round.",
        ],
    )
    methods = METHODS + peers.methods(peers.SEND_METHODS + ("tensordict",))
    bar.reset(total=len(methods) * firsts)
    first, steady = {m: [] for m in methods}, {}
    # Round-robin: every method's first send meets the machine in each of its
    # states in turn, and its steady sends come from the first round. The
    # order changes each round (round_order), so that no method always
    # follows the same one.
    for round_ in range(firsts):
        order = round_order(methods, round_)
        for method in [m for m in order if m in steady or not round_]:
            seconds = peers.attempt(
                result,
                CASES,
                method,
                lambda: sender(method).measure(
                    make_arange, (n,), sends if not round_ else 1
                ),
            )
            # A first send takes fresh pages, whose cost on a VM depends on
            # what the machine holds: the next method's first send starts
            # after this method's memory went back (its sender's idle pool
            # of 400 MB segments, the mappings cached here).
            close_sender(method)
            bar.update()
            if seconds is None:
                steady.pop(method, None)  # its error is the row's text
                continue
            first[method].append(seconds[0])
            if not round_:
                steady[method] = seconds
    for method, seconds in steady.items():
        result.add("first send", method, first[method], warmup=0)
        row = result.add("steady (sends 2..N)", method, seconds)
        if method != "torchshm_shared":  # O(1): a bandwidth would mislead
            gbps = nbytes / row["median"] / 1e9
            result.extra("steady (sends 2..N)", f"GB/s {LABELS[method]}", gbps)
    tensors = result.get("steady (sends 2..N)", "torch_torchshm")
    arrays = result.get("steady (sends 2..N)", "torchshm")
    if tensors and arrays:
        result.extra(
            "steady (sends 2..N)",
            "tensor via torchshm / torchshm",
            tensors["median"] / arrays["median"],
        )
    peers.against_best(result)
    peers.note_versions(result, methods)
    return result
