"""What arrives by value that torchshm would have shared: one warning that
names the fix.

Note [Arrays that arrive by value]
A process sends with its own reducers: a spawn or forkserver worker that
never imported torchshm pickles every array by value, and nothing fails, it
is only slow (the first-hour mistake: torchshm imported inside main()). The
receiver is where that shows: while torchshm is registered here, every
message multiprocessing unpickles (Connection.recv, Queue.get: all go
through ForkingPickler.loads) of at least NOTICE_BYTES that names NumPy's
own rebuild of an array and no torchshm name came from a process whose
arrays did not go through torchshm. The first such message warns once. A
message that size costs milliseconds to pickle and send; the look costs a
scan of its bytes at memory speed (regular expressions search buffers
without a copy), and smaller messages are not looked at. A sender that fell
back to pickling (out of memory) warned already; its arrays look the same
here, and the warning says so. Arrays that a sender with torchshm pickles
by value by design (object elements) carry a torchshm name
(_reduction.rebuild_by_value): they are not taken for its absence.
"""

import re
from multiprocessing.reduction import ForkingPickler

from torchshm import _fallback

# What the warning tells a user to give the workers, by what starts them
# (tests/test_remedies.py runs each, under spawn and forkserver).
REMEDIES = {
    "DataLoader": "worker_init_fn=torchshm.worker_init_fn",
    "multiprocessing.Pool": "initializer=torchshm.worker_init_fn",
    "ProcessPoolExecutor": "initializer=torchshm.worker_init_fn",
}
# Below this a message is not looked at: what it could have saved is small.
NOTICE_BYTES = 1 << 20
_OURS = re.compile(rb"torchshm")
_NUMPY_BY_VALUE = re.compile(rb"_reconstruct|_frombuffer")
_original = None  # ForkingPickler's own "loads" attribute, while installed


def _loads_and_look(data, /, *args, **kwargs):
    """ForkingPickler.loads, looking first at a large message's bytes."""
    if len(data) >= NOTICE_BYTES:
        look(data)
    return _original(data, *args, **kwargs)


def look(data):
    """Warns once if `data` (a pickled message) carries NumPy arrays pickled
    by value and nothing of torchshm's."""
    if _NUMPY_BY_VALUE.search(data) is None or _OURS.search(data) is not None:
        return
    remedies = "; ".join(f"{where}({how})" for where, how in REMEDIES.items())
    _fallback.warn_once(
        ("arrivals", "by value"),
        f"torchshm: a {len(data) / 2**20:.0f} MiB message arrived with NumPy"
        " arrays pickled by value: the process that sent it did not send"
        " them through torchshm. Under spawn or forkserver a worker has"
        " torchshm only if it imports it: import torchshm at the top of the"
        f" main module (not only inside main()), or give its workers the hook:"
        f" {remedies} (torchshm.chain(fn) in its place keeps a hook of yours);"
        " or the sender fell back (its own warning says why)",
        stacklevel=3,
    )


def install():
    """Looks at what arrives from now on (register())."""
    global _original
    if _original is None:
        _original = ForkingPickler.__dict__["loads"]
        ForkingPickler.loads = staticmethod(_loads_and_look)


def uninstall():
    global _original
    if _original is not None:
        ForkingPickler.loads = _original
        _original = None
