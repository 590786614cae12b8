"""Every constant that crosses the seam or a file format, pinned.

The session keeper (torchshm/_keeper/daemon.py) is standard library only, so it
restates csrc/lifetime/layout.h; the lock files' names are made in C++
(csrc/lifetime/identity.cpp) and read in Python; thread and memfd names are given in
one language and looked for in the other. Each is compared here against the
native module, and the layout itself against the values this wire format
promised: a segment or table written by one torchshm is read by another
running at the same time (two versions in one session, a keeper started by
either), so changing any of them needs a new magic.
"""

import os
import re

import numpy as np
import pytest
from multiprocessing.reduction import ForkingPickler

import torchshm
from torchshm import _C, _stats
from torchshm._tools import doctor as _doctor
from torchshm._lifetime import segments as _segments
from torchshm._keeper import layout as _layout
from torchshm._keeper import paths as _paths

# csrc/lifetime/layout.h as of the "trchshm4" segment and "tshtabl1" table formats.
PINNED = {
    "SEGMENT_MAGIC": 0x346D687368637274,
    "SLOTS": 16384,
    "SLOT_BYTES": 32,
    "SLOTS_OFFSET": 64,
    "SLOT_CHANNEL": 8,
    "SLOT_WRITER": 16,
    "SLOT_VERDICT": 24,
    "CAPACITY_OFFSET": 8,
    "CREATOR_OFFSET": 16,
    "UID_OFFSET": 24,
    "GENERATION_OFFSET": 32,
    "UNLINKED_OFFSET": 40,
    "SLOTS_USED_OFFSET": 44,
    "PINNED_OFFSET": 48,
    "SNAPSHOT_OFFSET": 52,
    "HEADER_BYTES": 528384,
    "TICKET_BIT": 1 << 63,
    "WRITING_BIT": 1 << 62,
    "TICKET_SLOT_SHIFT": 46,
    "TICKET_SLOT_MASK": 0xFFFF,
    "TABLE_MAGIC": 0x316C626174687374,
    "TABLE_CAPACITY_OFFSET": 8,
    "TABLE_FD_BASE_OFFSET": 12,
    "TABLE_BUDGET_OFFSET": 64,
    "BUDGET_ENTRIES": 512,
    "BUDGET_ENTRY_BYTES": 16,
    "TABLE_UIDS_OFFSET": 64 + 512 * 16,
    "FLAG_TICKETS": 1,
    "FLAG_RELEASED": 2,
}


def test_the_native_layout_is_the_pinned_one():
    assert dict(_C.LAYOUT) == PINNED


def test_the_keeper_restates_the_layout_it_reads():
    restated = {k: getattr(_layout, k) for k in PINNED if hasattr(_layout, k)}
    # All but how a ticket names its slot, which only C++ decodes.
    assert set(PINNED) - set(restated) == {"TICKET_SLOT_SHIFT", "TICKET_SLOT_MASK"}
    assert restated == {k: _C.LAYOUT[k] for k in restated}


def test_the_keeper_reads_a_header_as_the_native_side_wrote_it():
    # The keeper's reads go through those names only (torchshm/_keeper/layout.py).
    owner = _segments.allocate(1 << 20)
    segment = _C.segment_of(owner)
    header = _layout.read_header(segment.fd)
    assert (header.uid, header.capacity) == (segment.uid, segment.capacity)
    assert (header.generation, header.pinned) == (segment.generation, 0)
    assert header.unlinked == 0 and header.snapshot == 0
    assert header.slots and header.slots[0][1] == _C.process_id()
    del owner


def test_the_native_sender_works_by_the_python_policy():
    # Note [The seam]: the numbers live in Python and are handed over once;
    # the native side keeps no copy of its own that could drift.
    from torchshm._send import sender as _sender

    native = _C.testing.sender_policy()
    assert {f: getattr(native, f) for f in _C.SenderPolicy.FIELDS} == _sender.policy()
    pool = torchshm._lifetime.holdings.pool.native
    classes = torchshm._lifetime.pool._CLASSES
    for n in (1, classes["min_class"], 3 * classes["min_class"] + 1, 5 << 20):
        assert pool.size_class(n) == _size_class(n, **classes)


def _size_class(nbytes, min_class, steps, max_waste):
    """The size class csrc/lifetime/pool.h describes: a multiple of 1/steps of the next
    power of two, and of min_class."""
    if nbytes <= min_class:
        return min_class
    power = 1 << (nbytes - 1).bit_length()
    step = max(power // steps, min_class)
    return -(-nbytes // step) * step


def test_lock_file_names_are_made_alike_in_both_languages():
    for holder in (1, 0xABCDEF, 2**63 - 1, 0x0123456789ABCDEF):
        assert _C.testing.lock_path(holder) == _paths.process_lock_path(holder)
    assert _paths.process_lock_path(5).startswith(_paths.run_dir() + "/")
    assert _paths.run_dir().startswith(_paths.SHM_DIR + "/")


def test_session_files_are_named_after_a_valid_session_only():
    session = torchshm._lifetime.session.session_id()
    assert _paths.valid_session(session)
    assert _paths.socket_path(session) == os.path.join(
        _paths.run_dir(), f"torchshm-{session}.sock"
    )
    for good in ("a_b", "run-1", "x" * 64):
        assert _paths.valid_session(good)
    for bad in ("", "../x", "a/b", "a b", "a.b", "x" * 65, None, 7):
        assert not _paths.valid_session(bad)


def test_counter_names_are_the_same_in_both_languages():
    assert tuple(_C.COUNTER_NAMES) == _stats.COUNTERS
    assert set(torchshm.stats()) >= set(_stats.COUNTERS)


def test_a_segment_mapping_carries_the_name_doctor_looks_for():
    torchshm.trim()
    array = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: above the threshold
    loaded = ForkingPickler.loads(ForkingPickler.dumps(array))
    assert torchshm.is_shared(loaded)
    with open("/proc/self/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    names = {f[5].strip() for f in fields if len(f) == 6}
    pattern = re.escape(_doctor.SEGMENT_MAPPING) + r"[A-Za-z0-9_-]+:\d+"
    assert any(re.match(pattern, n) for n in names), sorted(names)[:20]
    assert _doctor.segment_pss() > 0
    del loaded


def test_every_policy_field_is_given_by_name_or_the_policy_is_refused():
    from torchshm._send import sender as _sender

    given = _sender.policy()
    assert set(given) == set(_C.SenderPolicy.FIELDS)
    assert _C.SenderPolicy(**given).chunk_max == given["chunk_max"]
    for missing in given:
        partial = {k: v for k, v in given.items() if k != missing}
        with pytest.raises(RuntimeError, match=f"{missing} not given"):
            _C.SenderPolicy(**partial)
    with pytest.raises(RuntimeError, match="unknown sender policy field extra"):
        _C.SenderPolicy(**given, extra=1)
