"""What the keeper reads and writes of a segment's header and makes of the
session table: csrc/lifetime/layout.h restated, field by field. Every read and write
goes through the named offsets below, never a literal, and
tests/test_layout.py holds each name against the native module's
_C.LAYOUT: an offset changed on one side only fails a test. Standard
library only (Note [The keeper's facts] in daemon.py)."""

import fcntl
import mmap
import os
import re
import resource
import stat
import struct

if __package__:  # the library's (or the tests') module
    from torchshm._keeper.paths import owned
else:  # the keeper's: daemon.py put its directory on sys.path
    from paths import owned

# csrc/lifetime/layout.h, SegmentHeader ("trchshm4"): the fields the keeper uses.
SEGMENT_MAGIC = 0x346D687368637274
CAPACITY_OFFSET = 8
CREATOR_OFFSET = 16
UID_OFFSET = 24
GENERATION_OFFSET = 32
UNLINKED_OFFSET = 40
SLOTS_USED_OFFSET = 44
PINNED_OFFSET = 48
SNAPSHOT_OFFSET = 52
SLOTS_OFFSET = 64
HEADER_BYTES = 528384
# Slot: the holder word at its start, then these.
SLOTS = 16384
SLOT_BYTES = 32
SLOT_CHANNEL = 8
SLOT_WRITER = 16
SLOT_VERDICT = 24
TICKET_BIT = 1 << 63
WRITING_BIT = 1 << 62
# csrc/lifetime/layout.h, the session table ("tshtabl1").
TABLE_MAGIC = 0x316C626174687374
TABLE_CAPACITY_OFFSET = 8
TABLE_FD_BASE_OFFSET = 12
TABLE_BUDGET_OFFSET = 64
BUDGET_ENTRIES = 512
BUDGET_ENTRY_BYTES = 16
TABLE_UIDS_OFFSET = TABLE_BUDGET_OFFSET + BUDGET_ENTRIES * BUDGET_ENTRY_BYTES
FLAG_TICKETS = 1
FLAG_RELEASED = 2
MAX_TABLE_CAPACITY = 1 << 16

F_ADD_SEALS, F_GET_SEALS = 1033, 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW = 1, 2, 4


def _record(size, fields):
    """A struct.Struct reading `fields` ((offset, code) pairs, little-endian)
    out of `size` bytes: the offsets place them, padding fills the gaps."""
    parts, at = ["<"], 0
    for offset, code in sorted(fields):
        if offset < at:
            raise ValueError(f"field at {offset} overlaps the one before it")
        parts.append(f"{offset - at}x{code}" if offset > at else code)
        at = offset + struct.calcsize("<" + code)
    parts.append(f"{size - at}x")
    return struct.Struct("".join(parts))


_HEADER = _record(
    SLOTS_OFFSET,
    [
        (0, "Q"),
        (CAPACITY_OFFSET, "q"),
        (CREATOR_OFFSET, "Q"),
        (UID_OFFSET, "Q"),
        (GENERATION_OFFSET, "Q"),
        (UNLINKED_OFFSET, "I"),
        (SLOTS_USED_OFFSET, "I"),
        (PINNED_OFFSET, "I"),
        (SNAPSHOT_OFFSET, "I"),
    ],
)
_SLOT = _record(
    SLOT_BYTES, [(0, "Q"), (SLOT_CHANNEL, "Q"), (SLOT_WRITER, "Q"), (SLOT_VERDICT, "Q")]
)


class Header:
    """What the keeper reads of a segment's header."""

    __slots__ = ("uid", "capacity", "creator", "generation", "unlinked")
    __slots__ += ("slots_used", "pinned", "snapshot", "slots")


def read_header(fd, with_slots=True):
    """A segment's header (slots: [(index, word, channel, writer, verdict)]
    of non-empty slots), or None if `fd` does not hold one."""
    try:
        head = os.pread(fd, SLOTS_OFFSET, 0)
    except OSError:
        return None
    if len(head) < SLOTS_OFFSET:
        return None
    h = Header()
    magic, h.capacity, h.creator, h.uid, h.generation, *rest = _HEADER.unpack(head)
    if magic != SEGMENT_MAGIC:
        return None
    h.unlinked, h.slots_used, h.pinned, h.snapshot = rest
    h.slots = []
    used = min(h.slots_used, SLOTS)
    if with_slots and used:
        try:
            raw = os.pread(fd, used * SLOT_BYTES, SLOTS_OFFSET)
        except OSError:
            return None
        for i, slot in enumerate(_SLOT.iter_unpack(raw)):
            if slot[0]:
                h.slots.append((i,) + slot)
    return h


def _write(fd, offset, fmt, value):
    try:
        os.pwrite(fd, struct.pack(fmt, value), offset)
    except OSError:
        pass


def mark_unlinked(fd):
    """Says in the header that no new process may attach."""
    _write(fd, UNLINKED_OFFSET, "<I", 1)


def write_verdict(fd, slot, ticket):
    """Gives slot `slot`'s ticket its verdict (its id: the ticket is dead)."""
    _write(fd, SLOTS_OFFSET + slot * SLOT_BYTES + SLOT_VERDICT, "<Q", ticket)


def ticket_id(word):
    return word & ~WRITING_BIT


def is_segment_fd(fd, uid):
    """Whether `fd` is a sealed memfd of this user holding segment `uid`."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:
        return False
    if not (stat.S_ISREG(st.st_mode) and owned(st)) or not seals & F_SEAL_SHRINK:
        return False
    header = read_header(fd, with_slots=False)
    return header is not None and header.uid == uid


def table_capacity():
    """(fd_base, capacity): segment fds live at fd_base + index, below the
    hard fd limit (raised to it first); member connections stay below."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    base = 4096 if hard >= 8192 else hard // 2
    return base, max(0, min(MAX_TABLE_CAPACITY, hard - base - 64))


class Table:
    """The session table (csrc/lifetime/layout.h), made here."""

    def __init__(self, fd_base, capacity):
        self.fd_base, self.capacity = fd_base, capacity
        self.flags_offset = TABLE_UIDS_OFFSET + 8 * capacity
        size = self.flags_offset + capacity
        self.fd = os.memfd_create(
            "torchshm:table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        )
        os.ftruncate(self.fd, size)
        fcntl.fcntl(self.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED)
        struct.pack_into("<I", self.map, TABLE_CAPACITY_OFFSET, capacity)
        struct.pack_into("<I", self.map, TABLE_FD_BASE_OFFSET, fd_base)
        struct.pack_into("<Q", self.map, 0, TABLE_MAGIC)  # last
        self.uids = memoryview(self.map)[TABLE_UIDS_OFFSET : self.flags_offset].cast(
            "Q"
        )

    def flagged(self):
        """Indices whose flag byte is set (a C-speed search)."""
        flags = memoryview(self.map)[self.flags_offset :]
        return [(m.start(), m.group()[0]) for m in re.finditer(rb"[^\x00]", flags)]

    def clear_flag(self, index):
        self.map[self.flags_offset + index] = 0

    def set_flag(self, index, bits):
        at = self.flags_offset + index
        self.map[at] = self.map[at] | bits

    def free(self, index, uid):
        if 0 <= index < self.capacity and self.uids[index] == uid:
            self.uids[index] = 0
            self.map[self.flags_offset + index] = 0
