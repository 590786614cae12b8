"""Runs scenarios with a progress bar."""

import sys

from tqdm.auto import tqdm

from benchmarks.scenarios import select
from benchmarks.transports import FALLBACKS, close_senders


def run(names=("all",), quick=False, progress=True):
    """Runs the named scenarios (names, 1-7, "core" or "all"); returns their
    report.Result objects in suite order."""
    modules = select(names)
    results = []
    bar = tqdm(total=0, disable=not progress, file=sys.stderr, leave=False)
    try:
        for module in modules:
            bar.set_description(module.NAME)
            FALLBACKS.clear()
            try:
                result = module.run(quick, bar)
            finally:
                close_senders(peers_only=True)
            # Object arrays (strings, labels) are pickled by design; anything
            # else means torchshm's numbers are really pickling's.
            failures = {k: v for k, v in FALLBACKS.items() if k != "object dtype"}
            if failures:
                result.notes.append(
                    "WARNING: torchshm pickled by value instead of sharing"
                    f" (fallbacks by reason: {failures})"
                )
            results.append(result)
    finally:
        bar.close()
        close_senders()
    return results
