"""What this process holds: the pool of segments it created, its live view of
each segment it uses, and the one lock over them.

Every module that allocates, attaches, expires or forks (_segments, _attach,
_expiry, _lifecycle) works on this state, under `lock`; nothing else keeps a
copy of it.
"""

import threading

from torchshm._lifetime import pool as _pool
from torchshm._native import _C

# Guards the pool, the mapping cache (_mappings) and the bookkeeping around
# the live views. Replaced in a forked child (another thread may have held
# it at fork): take it as _holdings.lock at each use, never keep it.
lock = threading.RLock()
# The segments this process created, reused once idle (pool.py).
pool = _pool.Pool()
# This process's live view of each segment, by name (Note [Live views] in
# csrc/lifetime/live.h): the sender's plan records the pooled segments it takes there
# too, without entering Python.
live = _C.live
# Set by the exit finalizer (_lifecycle): no thread may start after it.
exiting = False


def after_fork_in_child():
    """A fresh lock: threads do not survive fork, their holds may."""
    global lock
    lock = threading.RLock()
