"""A receiver that never imports torchshm itself (a spawn target: its process
starts without it, and only unpickling a message brings it in)."""

import sys


def receive(inbox, outbox):
    before = "torchshm" in sys.modules
    arrays = inbox.get(timeout=60)
    outbox.put(
        {
            "imported_before": before,
            "imported_after": "torchshm" in sys.modules,
            "arrays": [(a.dtype.str, a.shape, a.tobytes()) for a in arrays],
        }
    )
