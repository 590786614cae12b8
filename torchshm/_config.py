"""User-tunable policy: the size below which arrays are pickled inline.

Note [Default threshold]
Sharing has a fixed cost per message (a pooled segment, its name, a view on
each side: ~0.2 ms through a Queue); pickling costs ~0.5-1 ms per MiB through
a pipe. `python -m benchmarks --only per_item` measures both, round-robin. On
the 2-core reference machine four runs put the crossover at 256 KiB: sharing
every array cost 1.09-1.69x pipe + pickle at 128 KiB and 0.75-0.98x at
256 KiB. So arrays from 256 KiB up are shared; below, messages with
many arrays are still packed (see PACK_MIN in _reduction.py).
"""

import functools
import os
import re

DEFAULT_THRESHOLD = 256 * 1024
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    """Bytes from '131072', '128K', '1M' or '2G' (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(
            f"expected a size in bytes such as 131072, 128K or 1M, got {text!r}"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def registration_disabled():
    """TORCHSHM_DISABLE=1 (or true/yes): import, and workers, do not register."""
    return os.environ.get("TORCHSHM_DISABLE", "") in ("1", "true", "yes")


def _threshold_from_env():
    text = os.environ.get("TORCHSHM_THRESHOLD")
    return DEFAULT_THRESHOLD if text is None else parse_size(text)


_threshold = _threshold_from_env()


def get_threshold():
    """Arrays with fewer bytes than this are pickled inline, not shared."""
    return _threshold


def set_threshold(nbytes):
    """Sets the inline/shared crossover in bytes (an int or '128K'-style text)."""
    global _threshold
    value = nbytes if isinstance(nbytes, int) else parse_size(nbytes)
    if isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative number of bytes, got {nbytes!r}")
    _threshold = value


# `python -m benchmarks.micro` on the 2-core reference VM, 400 MB into mapped
# shared memory: 1 thread 43 ms, 2 threads 32 ms, 4 threads 33 ms.
# os.cpu_count() reads /sys (~13 us): computed once.
_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


def copy_threads():
    """Threads that split one large copy into shared memory."""
    return _COPY_THREADS


@functools.lru_cache(maxsize=None)
def _default_cap():
    """A quarter of /dev/shm, at most 4 GiB: the default for both caches.
    Read once: it is asked whenever a segment is made or a mapping goes idle."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return min(st.f_blocks * st.f_frsize // 4, 4 << 30)


def _bytes_from_env(name, default):
    text = os.environ.get(name)
    return default if text is None else parse_size(text)


def pool_bytes():
    """Cap on the shared memory a session's senders keep pooled for reuse, all
    processes together (TORCHSHM_POOL_BYTES; default a quarter of /dev/shm, at
    most 4 GiB; 0 turns pooling off)."""
    return _bytes_from_env("TORCHSHM_POOL_BYTES", _default_cap())


def pool_idle_seconds():
    """A pooled segment unused this long is released (TORCHSHM_POOL_IDLE_SECONDS)."""
    return float(os.environ.get("TORCHSHM_POOL_IDLE_SECONDS", "30"))


def mapping_cache_bytes():
    """Cap on idle mappings a receiver keeps so that segments reused by a
    sender's pool are not faulted in again (TORCHSHM_MAPPING_CACHE_BYTES)."""
    return _bytes_from_env("TORCHSHM_MAPPING_CACHE_BYTES", _default_cap())
