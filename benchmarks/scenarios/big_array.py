"""1. The seed experiment: a 400 MB np.arange sent child -> parent.

Reports the first send and the steady state (sends 2..N of a fresh array, as
DataLoader epochs produce), and the effective bandwidth of the steady state.
"""

import numpy as np

from benchmarks import peers
from benchmarks.report import Result
from benchmarks.transports import LABELS, METHODS, close_sender, sender

NAME = "big_array"
CASES = ("first send", "steady (sends 2..N)")


def make_arange(n):
    return np.arange(n)


def run(quick, bar):
    n, sends = (5 * 10**6, 4) if quick else (5 * 10**7, 8)
    nbytes = n * 8
    result = Result(
        NAME,
        f"1. np.arange({n:.0e}) ({nbytes / 1e6:.0f} MB) child -> parent",
        notes=[
            f"{sends} sends per method, each of a freshly built array; steady ="
            " median [min-max] of sends 2..N. The receiver reads every page.",
        ],
    )
    methods = METHODS + peers.methods(peers.SEND_METHODS + ("tensordict",))
    bar.reset(total=len(methods))
    for method in methods:
        seconds = peers.attempt(
            result,
            CASES,
            method,
            lambda: sender(method).measure(make_arange, (n,), sends),
        )
        # A first send takes fresh pages, whose cost on a VM depends on what
        # the machine holds: the next method's first send starts after this
        # method's memory went back (its sender's idle pool of 400 MB
        # segments, the mappings cached here), as the first method's did.
        close_sender(method)
        bar.update()
        if seconds is None:
            continue
        result.add("first send", method, seconds[:1], warmup=0)
        steady = result.add("steady (sends 2..N)", method, seconds)
        if method != "torchshm_shared":  # O(1): a bandwidth would mislead
            gbps = nbytes / steady["median"] / 1e9
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
