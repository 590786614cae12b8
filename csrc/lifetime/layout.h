// The byte layouts that cross a process or language boundary: a segment's
// header and holder slots, the ticket word, and the session table. The
// session keeper (torchshm/_keeper/daemon.py, standard library only)
// restates them; module.cpp exports every constant here as _C.LAYOUT and
// tests/test_layout.py compares the two, field by field.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace torchshm {

// ---------------------------------------------------------------- segments
// A segment is a sealed memfd: [header + slots][data]. The data starts at
// kHeaderBytes (page-aligned). Slots are touched only when used: a segment
// named by few messages has one page of them in memory.

constexpr uint64_t kSegmentMagic = 0x346d687368637274ULL;  // "trchshm4"
constexpr int kSlots = 16384;

// One holder slot. `word` is 0 (free), a process id (identity.h) or a ticket
// (below). `channel`: the pipe inode a ticket's message went into (0 if
// unknown); `writer`: the process writing a ticket's message, while it
// writes; `verdict`: a ticket word (writing bit clear) the keeper found dead.
struct Slot {
  std::atomic<uint64_t> word;
  std::atomic<uint64_t> channel;
  std::atomic<uint64_t> writer;
  std::atomic<uint64_t> verdict;
};

struct SegmentHeader {
  uint64_t magic;                    // 0: written last at creation
  int64_t capacity;                  // 8: data bytes
  uint64_t creator;                  // 16: the creating process's id
  uint64_t uid;                      // 24: random, unique for ever
  std::atomic<uint64_t> generation;  // 32: bumped on every pool reuse
  std::atomic<uint32_t> unlinked;    // 40: no new process may attach
  std::atomic<uint32_t> slots_used;  // 44: no slot at or above was taken
  std::atomic<uint32_t> pinned;      // 48: never reused, kept to the end
  // 52: this generation's data is a snapshot (Note [Snapshots are mapped
  // privately] in segment.h). A receiver of a version before the field maps
  // it shared: its writes would reach the segment's other receivers.
  std::atomic<uint32_t> snapshot;
  uint32_t reserved[2];  // 56
  Slot slots[kSlots];    // 64
};

constexpr size_t kPageBytes = 4096;
constexpr size_t kHeaderBytes =
    (sizeof(SegmentHeader) + kPageBytes - 1) / kPageBytes * kPageBytes;

static_assert(offsetof(SegmentHeader, generation) == 32, "layout");
static_assert(offsetof(SegmentHeader, unlinked) == 40, "layout");
static_assert(offsetof(SegmentHeader, slots_used) == 44, "layout");
static_assert(offsetof(SegmentHeader, pinned) == 48, "layout");
static_assert(offsetof(SegmentHeader, snapshot) == 52, "layout");
static_assert(offsetof(SegmentHeader, slots) == 64, "layout");
static_assert(sizeof(Slot) == 32, "layout");
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "a cross-process slot must be lock-free");

// ---------------------------------------------------------------- tickets
// A ticket word: kTicketBit | kWritingBit (while its message is being
// written) | slot << kTicketSlotShift | a random nonce. The slot in the word
// lets a receiver claim it in O(1); the nonce makes a stale ticket never
// match a new one in the same slot.
constexpr uint64_t kTicketBit = 1ULL << 63;
constexpr uint64_t kWritingBit = 1ULL << 62;
constexpr int kTicketSlotShift = 46;
constexpr uint64_t kTicketSlotMask = 0xFFFFULL;
constexpr uint64_t kTicketNonceMask = (1ULL << kTicketSlotShift) - 1;
static_assert(kSlots <= static_cast<int>(kTicketSlotMask) + 1, "layout");

// ---------------------------------------------------------------- the table
// One per session, made by the keeper (a sealed memfd every member maps):
// the index of every live segment (the keeper holds its fd at fd_base +
// index, so any process of this user can open it through /proc), a byte of
// flags per index that tells the keeper where to look, and the session's
// pool budget. The keeper decides the capacity (it is bounded by its own fd
// limit).

constexpr uint64_t kTableMagic = 0x316c626174687374ULL;  // "tshtabl1"
constexpr int kBudgetEntries = 512;
// Flags: tickets with a known pipe were issued (the keeper judges them);
// someone found no live holder (the keeper closes its fd).
constexpr uint8_t kFlagTickets = 1;
constexpr uint8_t kFlagReleased = 2;

struct TableHeader {
  uint64_t magic;              // 0
  uint32_t capacity;           // 8: indices
  uint32_t fd_base;            // 12: the keeper's fd of index i: base + i
  std::atomic<uint32_t> next;  // 16: where the next claim starts looking
  uint32_t reserved[11];       // 20
};

struct BudgetEntry {
  std::atomic<uint64_t> holder;  // a process id, 0 if free
  std::atomic<int64_t> bytes;    // what its pool keeps
};

constexpr size_t kTableBudgetOffset = 64;
constexpr size_t kTableUidsOffset =
    kTableBudgetOffset + kBudgetEntries * sizeof(BudgetEntry);
// uids: uint64 per index (0: free); then flags: one byte per index.
constexpr size_t table_flags_offset(uint32_t capacity) {
  return kTableUidsOffset + 8 * static_cast<size_t>(capacity);
}
constexpr size_t table_bytes(uint32_t capacity) {
  return table_flags_offset(capacity) + capacity;
}
static_assert(sizeof(TableHeader) == kTableBudgetOffset, "layout");
static_assert(sizeof(BudgetEntry) == 16, "layout");

}  // namespace torchshm
