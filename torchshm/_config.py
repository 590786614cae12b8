"""User-tunable policy: the size below which arrays are pickled inline, and
every environment variable torchshm reads (Note [Environment variables]).

Note [Default threshold]
Sharing has a fixed cost per message (a pooled segment, its name, a view on
each side: ~0.2 ms through a Queue); pickling costs ~0.5-1 ms per MiB through
a pipe. `python -m benchmarks --only per_item` measures both, round-robin. On
the 2-core reference machine four runs put the crossover at 256 KiB: sharing
every array cost 1.09-1.69x pipe + pickle at 128 KiB and 0.75-0.98x at
256 KiB. So arrays from 256 KiB up are shared; below, messages with
many arrays are still packed (see PACK_MIN in _send/sender.py).
"""

import difflib
import functools
import os
import re
import threading
import warnings
from typing import Union

from torchshm._keeper import paths as _paths
from torchshm._keeper import protocol as _protocol

DEFAULT_THRESHOLD = 256 * 1024
DEFAULT_POOL_IDLE_SECONDS = 30.0
DEFAULT_KEEPER_TIMEOUT = 5.0
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")

# Note [Environment variables]
# Every variable torchshm reads is in SETTINGS, with what it accepts. All of
# them are checked when torchshm is imported (this module's last line) and by
# register(), so a bad value is a ValueError in the importing or registering
# thread, naming the variable, the value and what is accepted. The threshold
# and TORCHSHM_DISABLE are read right there; the pool and cache settings are
# read again when used (so a process may change them), and that happens inside
# reducers, feeder threads and timers, where raising would lose a message or
# stop a timer: a value made bad after the check is reported there by one
# RuntimeWarning and the last good value (or the default) stays in force.
# An empty value counts as unset, as with Python's own PYTHON* variables.

# The largest size and number of seconds a setting takes: a size reaches C++
# as an int64, and seconds become deadlines that time and socket calls can
# hold (10**7 s is about four months).
MAX_SIZE = (1 << 63) - 1
MAX_SECONDS = 10**7
SIZE = (
    "a size in bytes: a non-negative integer below 2**63, optionally with K,"
    " M or G (binary units), e.g. 131072, 128K or 1M"
)
SECONDS = "a non-negative number of seconds, at most 1e7, e.g. 30 or 0.5"
TIMEOUT = "a positive number of seconds, at most 1e7, e.g. 5 or 0.5"
BOOLEAN = "one of 1, 0, true, false, yes, no (any case)"
SESSION = (
    f"{_paths.SESSION_RULE} (torchshm sets it for the processes of a session;"
    " unset it to start a new session)"
)


def parse_size(text):
    """Bytes from '131072', '128K', '1M' or '2G' (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", str(text), re.IGNORECASE)
    size = match and int(match.group(1)) * _UNITS[match.group(2).upper()]
    if not match or size > MAX_SIZE:
        raise ValueError(f"expected {SIZE}; got {text!r}")
    return size


def parse_seconds(text):
    value = float(text)
    if not 0 <= value <= MAX_SECONDS:  # nan fails too
        raise ValueError(f"expected {SECONDS}; got {text!r}")
    return value


def parse_timeout(text):
    """Seconds a request may wait: 0 would fail every one of them."""
    value = float(text)
    if not 0 < value <= MAX_SECONDS:
        raise ValueError(f"expected {TIMEOUT}; got {text!r}")
    return value


def parse_boolean(text):
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"expected {BOOLEAN}; got {text!r}")
    return word in _TRUE


def parse_session(text):
    # The keeper's rule: a session id is part of file names (_keeper/paths.py).
    if not _paths.valid_session(text):
        raise ValueError(f"expected {SESSION}; got {text!r}")
    return text


# name -> (parser, what it accepts)
SETTINGS = {
    "TORCHSHM_THRESHOLD": (parse_size, SIZE),
    "TORCHSHM_POOL_BYTES": (parse_size, SIZE),
    "TORCHSHM_POOL_IDLE_SECONDS": (parse_seconds, SECONDS),
    "TORCHSHM_MAPPING_CACHE_BYTES": (parse_size, SIZE),
    "TORCHSHM_DISABLE": (parse_boolean, BOOLEAN),
    "TORCHSHM_TENSORS": (parse_boolean, BOOLEAN),
    "TORCHSHM_SESSION": (parse_session, SESSION),
    "TORCHSHM_KEEPER_TIMEOUT": (parse_timeout, TIMEOUT),
    "TORCHSHM_SESSION_LINGER": (parse_seconds, SECONDS),
    "TORCHSHM_PIN_BYTES": (parse_size, SIZE),
}


# TORCHSHM_* variables of the project's own tools (the build, the suite, the
# benchmarks, the lanes): not settings, never taken for misspelled ones.
TOOL_VARIABLES = {
    "TORCHSHM_API_JSON",
    "TORCHSHM_BENCH_LOADER_START",
    "TORCHSHM_BENCH_PEERS",
    "TORCHSHM_BENCH_QUICK",
    "TORCHSHM_BENCH_RECORDS",
    "TORCHSHM_LANE_CACHE",
    "TORCHSHM_LANE_CHROOT",
    "TORCHSHM_LANE_COMMAND",
    "TORCHSHM_SDIST_BUILD",
    "TORCHSHM_SUITE_IMPORT",
    "TORCHSHM_SUITE_MIN_BYTES",
    "TORCHSHM_TEST_WORKER",
    "TORCHSHM_TORCH_LABEL",
    "TORCHSHM_VENDOR",
}
# What `python -m torchshm` calls each setting (_tools/report.py), which a
# user may take for its variable's name.
REPORT_NAMES = {
    "threshold": "TORCHSHM_THRESHOLD",
    "pool cap": "TORCHSHM_POOL_BYTES",
    "pool idle time": "TORCHSHM_POOL_IDLE_SECONDS",
    "mapping cache cap": "TORCHSHM_MAPPING_CACHE_BYTES",
    "GPU pin cap": "TORCHSHM_PIN_BYTES",
}
_unknown_warned = set()


def closest_setting(name):
    """The setting a misspelled `name` most likely meant, or None."""
    words = name[len("TORCHSHM_") :].lower().replace("_", " ")
    for shown, variable in REPORT_NAMES.items():
        if words == shown.lower():
            return variable
    suffixes = {n[len("TORCHSHM_") :]: n for n in SETTINGS}
    found = difflib.get_close_matches(name[len("TORCHSHM_") :], suffixes, n=1)
    return suffixes[found[0]] if found else None


def warn_unknown_variables():
    """One RuntimeWarning per TORCHSHM_* variable that is no setting (a
    misspelling would otherwise be ignored without a word), naming the
    closest one."""
    for name in sorted(os.environ):
        if (
            not name.startswith("TORCHSHM_")
            or name in SETTINGS
            or name in TOOL_VARIABLES
            or name in _unknown_warned
        ):
            continue
        _unknown_warned.add(name)
        meant = closest_setting(name)
        hint = f"; did you mean {meant}?" if meant else ""
        warnings.warn(
            f"torchshm: environment variable {name} is no torchshm setting and"
            f" is ignored{hint} (the settings: docs/guide/settings.md, or"
            " `python -m torchshm`)",
            RuntimeWarning,
            stacklevel=3,
        )


def env_setting(name, default=None):
    """The parsed value of environment variable `name` (one of SETTINGS), or
    `default` when it is unset or empty. A bad value raises ValueError naming
    the variable, the value and what is accepted."""
    text = os.environ.get(name, "")
    if not text:
        return default
    parse, accepted = SETTINGS[name]
    try:
        return parse(text)
    except ValueError:
        raise ValueError(
            f"torchshm: environment variable {name}={text!r} is not valid:"
            f" expected {accepted}"
        ) from None


def check_environment():
    """Raises one ValueError naming every torchshm environment variable whose
    value is bad (see Note [Environment variables])."""
    errors = []
    for name in SETTINGS:
        try:
            env_setting(name)
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise ValueError("\n".join(errors))


_last_good = {}  # name -> (text, value): what a bad value falls back to
_last_good_lock = threading.Lock()


def _env_setting_at_use(name, default):
    """env_setting() for reads inside reducers, feeder threads and timers:
    never raises (see Note [Environment variables])."""
    text = os.environ.get(name, "")
    with _last_good_lock:
        last = _last_good.get(name)
        if last is not None and last[0] == text:
            return last[1]
        try:
            value = env_setting(name, default)
        except ValueError as exc:
            kept = default if last is None else last[1]
            warnings.warn(f"{exc}; keeping {kept!r}", RuntimeWarning, stacklevel=3)
            value = kept
        _last_good[name] = (text, value)
        return value


def registration_disabled():
    """TORCHSHM_DISABLE=1 (or true/yes, any case): import, and workers, do not
    register. Any value other than 0/1/true/false/yes/no is a ValueError."""
    return env_setting("TORCHSHM_DISABLE", False)


check_environment()  # at import: see Note [Environment variables]
warn_unknown_variables()
_threshold = env_setting("TORCHSHM_THRESHOLD", DEFAULT_THRESHOLD)
# Called with the new value whenever it changes: the native sender keeps a
# copy for its fast path (_native.set_threshold), so this stays the one place
# that decides the threshold.
_threshold_watchers = []


def on_threshold_change(fn):
    _threshold_watchers.append(fn)


def get_threshold() -> int:
    """The sharing threshold: arrays with fewer bytes are pickled inline.

    Arrays of at least this many bytes are sent through shared memory;
    smaller ones are pickled by value with the message (unless a message
    carries many of them: they are then packed into one segment). Read from
    ``TORCHSHM_THRESHOLD`` at import (a size in bytes such as ``131072``,
    ``128K`` or ``1M``), else 262144 (256 KiB); changed by `set_threshold`.
    The value is this process's; it is also the default `min_bytes` of
    `allocating` and `set_allocator`.

    Returns
    -------
    int
        The threshold in bytes (0: every non-empty array is shared).

    Raises
    ------
    Nothing
        It returns the current value.

    See Also
    --------
    set_threshold

    Examples
    --------
    Without ``TORCHSHM_THRESHOLD``:

    >>> torchshm.get_threshold()  # doctest: +SKIP
    262144

    Whatever it is, an array of more bytes is shared:

    >>> a = np.zeros(torchshm.get_threshold() + 1, dtype=np.uint8)
    >>> torchshm.is_shared(torchshm.share(a))
    True
    """
    return _threshold


def set_threshold(nbytes: Union[int, str]) -> None:
    """Set the sharing threshold: arrays with fewer bytes are pickled inline.

    Takes effect at once for every thread of this process (and for
    children forked later); processes started by spawn or forkserver read
    ``TORCHSHM_THRESHOLD`` from their environment instead. It is also the
    default `min_bytes` of `allocating` and `set_allocator` from then on.

    Parameters
    ----------
    nbytes : int or str
        The new threshold in bytes: a non-negative int, or text such as
        ``"131072"``, ``"128K"``, ``"1M"`` or ``"2G"`` (binary units, any
        case). 0 shares every non-empty array.

    Returns
    -------
    None

    Raises
    ------
    ValueError
        A negative number, one of 2**63 or more, a bool, or text that is not
        a size.

    See Also
    --------
    get_threshold

    Examples
    --------
    >>> before = torchshm.get_threshold()
    >>> torchshm.set_threshold("1M")
    >>> torchshm.get_threshold()
    1048576
    >>> torchshm.set_threshold(before)
    """
    global _threshold
    value = nbytes if isinstance(nbytes, int) else parse_size(nbytes)
    if isinstance(value, bool) or not 0 <= value <= MAX_SIZE:
        raise ValueError(f"expected {SIZE}; got {nbytes!r}")
    _threshold = value
    for fn in _threshold_watchers:
        fn(value)


# `python -m benchmarks.micro` on the 2-core reference VM, 400 MB into mapped
# shared memory: 1 thread 43 ms, 2 threads 32 ms, 4 threads 33 ms.
# os.cpu_count() reads /sys (~13 us): computed once.
_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


def copy_threads():
    """Threads that split one large copy into shared memory, and populating
    a fresh segment's pages (`python -m benchmarks --only born` reports the
    latter as "fresh pages")."""
    return _COPY_THREADS


@functools.lru_cache(maxsize=None)
def _default_cap():
    """A quarter of the memory this process may have (its cgroup's limit, or
    the machine's), at most 4 GiB: the default for both caches. Not /dev/shm:
    segments are memfds (Note [Segment lifetime]). Read once: it is asked
    whenever a segment is made or a mapping goes idle."""
    from torchshm import _memory

    return min(_memory.total_memory() // 4, 4 << 30)


def pool_bytes():
    """Cap on the shared memory a session's senders keep pooled for reuse, all
    processes together (TORCHSHM_POOL_BYTES; default a quarter of the memory
    this process may have, at most 4 GiB; 0 turns pooling off)."""
    return _env_setting_at_use("TORCHSHM_POOL_BYTES", _default_cap())


def pool_idle_seconds():
    """A pooled segment unused this long is released (TORCHSHM_POOL_IDLE_SECONDS)."""
    return _env_setting_at_use("TORCHSHM_POOL_IDLE_SECONDS", DEFAULT_POOL_IDLE_SECONDS)


def mapping_cache_bytes():
    """Cap on idle mappings a receiver keeps so that segments reused by a
    sender's pool are not faulted in again (TORCHSHM_MAPPING_CACHE_BYTES)."""
    return _env_setting_at_use("TORCHSHM_MAPPING_CACHE_BYTES", _default_cap())


def keeper_timeout():
    """How long a process waits for its session's keeper to take a request or
    answer it (TORCHSHM_KEEPER_TIMEOUT); then it goes on without it."""
    return _env_setting_at_use("TORCHSHM_KEEPER_TIMEOUT", DEFAULT_KEEPER_TIMEOUT)


def session_linger():
    """How long a session with no member left stays while its messages may
    still be read (TORCHSHM_SESSION_LINGER; Note [Segment lifetime])."""
    return _env_setting_at_use(
        "TORCHSHM_SESSION_LINGER", _protocol.DEFAULT_LINGER_SECONDS
    )


def pin_bytes():
    """Cap on the shared memory this process keeps pinned for the GPU
    (TORCHSHM_PIN_BYTES; default a quarter of the memory this process may
    have, at most 4 GiB; 0 pins nothing: Note [Pinned in place] in
    _lifetime/pins.py)."""
    return _env_setting_at_use("TORCHSHM_PIN_BYTES", _default_cap())
