"""Children and probes for tests/test_one_copy.py (importable under spawn and
forkserver)."""

import ctypes
import mmap
import os
import re

import torchshm  # noqa: F401  (imported before any baseline is measured)


def pss_bytes(pid):
    """A process's proportional set size: each shared page split among the
    processes that map it."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"no Pss for {pid}")


def mapped_kb(array, field):
    """The sum of `field` (e.g. "Anonymous", "AnonHugePages") over the
    mappings that hold `array`'s bytes, in KiB, from /proc/self/smaps."""
    lo = array.__array_interface__["data"][0]
    hi = lo + array.nbytes
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                start, end = int(span[1], 16), int(span[2], 16)
                inside = start < hi and lo < end
            elif inside and line.startswith(field + ":"):
                total += int(line.split()[1])
    return total


def own_chunk(array):
    """Whether glibc's malloc mmap()ed `array`'s block for it alone: it starts
    16 bytes into a page, after a chunk header whose size word has the
    IS_MMAPPED bit (0x2)."""
    data = array.ctypes.data
    if data % mmap.PAGESIZE != 16:
        return False
    return ctypes.c_size_t.from_address(data - 8).value & 0x2 != 0


def hold_and_report(inbox, outbox):
    """Receives arrays, reads every page of each, reports (pid, sums of
    head, tail and all) and holds them; on "look", reports again; on None,
    lets go and ends."""
    held = []
    while (message := inbox.get()) is not None:
        if isinstance(message, str):  # "look"
            outbox.put([describe(a) for a in held])
            continue
        held.append(message)
        outbox.put((os.getpid(), describe(message)))
    del held


def describe(array):
    """Head, tail and sum of an array (or of each array of a list)."""
    if isinstance(array, list):
        return [describe(a) for a in array]
    return {
        "head": array[:4].tolist(),
        "tail": array[-4:].tolist(),
        "sum": float(array.sum()),
    }


def report_inherited(inbox, outbox, array):
    """A fork child given `array` by inheritance: describes it whenever it
    is told "look", until None."""
    while inbox.get() is not None:
        outbox.put(describe(array))
