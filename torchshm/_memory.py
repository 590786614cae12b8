"""How much shared memory this process can really have.

torchshm's segments are memfds (Note [Segment lifetime] in csrc/lifetime/segment.h):
the /dev/shm mount does not bound them. Their pages are charged to the memory
cgroup of the process that touches them first, so a container's memory limit
does, as does the machine's memory. This module reads both (cgroup v2
`memory.max`/`memory.current`, v1 `memory.limit_in_bytes`/
`memory.usage_in_bytes`, and /proc/meminfo), for the pool's default size and
for a check before each new segment: a segment that would not fit fails with
ENOMEM, naming the limit and the fix, and the array is pickled instead
(torchshm._fallback), instead of the container's OOM killer stepping in.
"""

import errno
import os
import threading
import time

CGROUP_ROOT = "/sys/fs/cgroup"
# A new segment must leave this much of the limit free: the process needs
# memory of its own, and the page cache counted in `current` may not all be
# reclaimable.
MARGIN = 64 << 20
# The limits are read again at most this often (a file read each), unless a
# segment asks for a large part of what was seen.
REFRESH_SECONDS = 0.5


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except (OSError, ValueError):
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    # cgroup v1 reports "no limit" as a huge page-rounded number.
    return None if value >= 1 << 62 else value


def _read_stat(path, key):
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs():
    """(version, directory) of this process's memory cgroup and its
    ancestors, innermost first (a parent may have the tighter limit)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            version, mount = 2, CGROUP_ROOT
            if not os.path.exists(os.path.join(mount, "cgroup.controllers")):
                mount = os.path.join(CGROUP_ROOT, "unified")
        elif "memory" in controllers.split(","):
            version, mount = 1, os.path.join(CGROUP_ROOT, "memory")
        else:
            continue
        # Inside a cgroup namespace the path may not exist under the mount:
        # the mount's root is then this process's cgroup.
        path = path.strip("/")
        directory = os.path.join(mount, path) if path else mount
        if not os.path.isdir(directory):
            directory = mount
        while True:
            found.append((version, directory))
            if os.path.normpath(directory) == os.path.normpath(mount):
                break
            directory = os.path.dirname(directory)
    return found


def cgroup_limit():
    """(limit, usage net of reclaimable file pages, file) of the tightest
    memory cgroup limit over this process, or None if it has none."""
    best = None
    for version, directory in _cgroup_dirs():
        if version == 2:
            limit = _read_int(os.path.join(directory, "memory.max"))
            usage = _read_int(os.path.join(directory, "memory.current"))
            cache = _read_stat(os.path.join(directory, "memory.stat"), "inactive_file")
            where = os.path.join(directory, "memory.max")
        else:
            limit = _read_int(os.path.join(directory, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(directory, "memory.usage_in_bytes"))
            cache = _read_stat(
                os.path.join(directory, "memory.stat"), "total_inactive_file"
            )
            where = os.path.join(directory, "memory.limit_in_bytes")
        if limit is None or usage is None:
            continue
        usage = max(0, usage - cache)
        if best is None or limit - usage < best[0] - best[1]:
            best = (limit, usage, where)
    return best


# What bound() names when /proc/meminfo cannot be read: then nothing says how
# much memory is left, and no segment is made (check()).
UNKNOWN = "/proc/meminfo, which cannot be read (is /proc mounted?)"


def meminfo():
    """/proc/meminfo's fields in bytes (MemTotal, MemAvailable, Shmem...)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                value = rest.split()
                if value:
                    out[name] = int(value[0]) * (
                        1024 if rest.strip().endswith("kB") else 1
                    )
    except (OSError, ValueError):
        pass
    return out


def bound():
    """(bytes torchshm may still use, what bounds it: a text for messages,
    the limit in bytes)."""
    info = meminfo()
    if info:
        available = info.get("MemAvailable", info.get("MemFree", 0))
        best = (
            available,
            "the machine's available memory (MemAvailable)",
            info.get("MemTotal", 0),
        )
    else:
        best = (0, UNKNOWN, 0)
    cgroup = cgroup_limit()
    if cgroup is not None:
        limit, usage, where = cgroup
        if best[1] == UNKNOWN or limit - usage < best[0]:
            best = (max(0, limit - usage), f"the memory cgroup limit ({where})", limit)
    return best


def total_memory():
    """The memory this process can have at most: its cgroup limit or the
    machine's, whichever is smaller."""
    total = meminfo().get("MemTotal", 0)
    cgroup = cgroup_limit()
    return min(total, cgroup[0]) if cgroup is not None and total else total


_lock = threading.Lock()
_seen = (0.0, None)  # (when, bound())


def refresh():
    """Makes the next check read the limits anew (memory was given back)."""
    global _seen
    with _lock:
        _seen = (0.0, None)


def check(nbytes):
    """Raises SharedMemoryError(ENOMEM) naming the limit if a new segment of
    `nbytes` would not leave MARGIN of what this process may still use.

    This is the only guard: past a memory cgroup's limit the kernel does not
    fail a shared page with an error, its OOM killer ends the process
    (measured: MADV_POPULATE_WRITE and fallocate of a memfd both, in a 300
    MiB cgroup). Between two readings, what this process reserved since is
    subtracted, so that a burst of new segments cannot overshoot."""
    global _seen
    with _lock:
        when, seen = _seen
        now = time.monotonic()
        if seen is None or now - when > REFRESH_SECONDS or nbytes * 4 > seen[0]:
            seen = bound()
            when = now
        room, what, limit = seen
        fits = nbytes + MARGIN <= room
        _seen = (when, (room - nbytes if fits else room, what, limit))
    if fits:
        return
    from torchshm._native import _C

    if what == UNKNOWN:
        raise _C.SharedMemoryError(
            errno.ENODATA,
            f"torchshm: cannot tell whether {_size(nbytes)} of shared memory"
            f" would fit: {UNKNOWN}. Without /proc, torchshm cannot see the"
            " memory left (nor find segments and holders by it): mount /proc"
            " (mount -t proc proc /proc) where this process runs",
        )
    raise _C.SharedMemoryError(
        errno.ENOMEM,
        f"torchshm: no room for {_size(nbytes)} of shared memory: {_size(room)}"
        f" left under {what}, which is {_size(limit)}. Give the container more"
        " memory (docker run --memory, Kubernetes resources.limits.memory) or"
        " keep less in flight (a smaller batch, fewer prefetched batches,"
        " TORCHSHM_POOL_BYTES)",
    )


def _size(n):
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
