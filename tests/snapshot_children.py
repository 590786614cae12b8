"""Children for tests/test_snapshots.py (importable under spawn and
forkserver)."""


import torch

import torchshm
from torchshm import _C
from torchshm._lifetime import segments as _segments


def mapping_of(array):
    """The permissions of the mapping that holds `array`'s first byte, as
    /proc/self/maps writes them (e.g. "rw-p")."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    raise LookupError(f"no mapping holds {address:#x}")


def segment_of(array):
    """The segment `array` lies in; None for private memory (a copy)."""
    owner = _C.memory_owner(array)
    return None if owner is None else _segments.name_of(owner)


def describe(array):
    return {
        "segment": segment_of(array),
        "mapping": mapping_of(array),
        "writeable": bool(array.flags.writeable),
        "head": array[:4].tolist(),
        "tail": array[-4:].tolist(),
    }


def receive_and_write(inbox, outbox, value):
    """Receives an array, reports it, writes `value` into it, reports what it
    reads back after the parent says so; then receives arrays until None."""
    array = inbox.get()
    outbox.put(describe(array))
    array[:] = value
    outbox.put("written")
    while (message := inbox.get()) is not None:
        if isinstance(message, str):  # "look"
            outbox.put(describe(array))
        else:
            outbox.put(describe(message))
            del message
    del array
    outbox.put(torchshm.stats())


def send_on(inbox, outbox):
    """Receives an array, sends it back as it is, then after writing to it."""
    array = inbox.get()
    outbox.put(array)
    assert inbox.get() == "write"
    array[1] = -5.0
    outbox.put(array)
    assert inbox.get() == "done"
    del array


def write_read_only(inbox, outbox):
    """Receives a read-only float64 array and writes it as torch lets one:
    element 0 through torch.from_numpy, element 1 through its int8 .base;
    reports it before and after, then every array it receives until None
    (holding the first)."""
    import warnings

    array = inbox.get()
    outbox.put(describe(array))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not writable ... undefined behavior"
        torch.from_numpy(array)[0] += 100
    at = array.__array_interface__["data"][0] - array.base.data_ptr()
    array.base[at + 8 : at + 16] = 0  # element 1: 0.0
    outbox.put(describe(array))
    while (message := inbox.get()) is not None:
        outbox.put(describe(message))
        del message
    del array


def describe_each(inbox, outbox):
    """Reports every array it receives until None."""
    while (array := inbox.get()) is not None:
        outbox.put(describe(array))
        del array


def cache_while_held(inbox, outbox):
    """Receives an array and reports whether its mapping sits in the
    receiver's cache of idle mappings while the array lives, then after it
    is dropped."""
    import gc

    from torchshm._lifetime import holdings as _holdings
    from torchshm._lifetime import mappings as _mappings

    array = inbox.get()
    name = segment_of(array)
    with _holdings.lock:
        held = _mappings.get(name) is not None
    del array
    gc.collect()
    with _holdings.lock:
        dropped = _mappings.get(name) is not None
    outbox.put((held, dropped))
    assert inbox.get() is None


def describe_layers(inbox, outbox):
    """Reports every array of every list of arrays it receives, until None."""
    while (layers := inbox.get()) is not None:
        outbox.put([describe(a) for a in layers])
        del layers
