// Every constant of layout.h as a dict (_C.LAYOUT): the keeper's reads
// (torchshm/_keeper/layout.py) are checked against it field by field
// (tests/test_layout.py).
#include "bindings.h"
#include "lifetime/layout.h"

namespace torchshm {

py::dict layout_table() {
  py::dict layout;
  layout["SEGMENT_MAGIC"] = kSegmentMagic;
  layout["SLOTS"] = kSlots;
  layout["SLOT_BYTES"] = sizeof(Slot);
  layout["SLOTS_OFFSET"] = offsetof(SegmentHeader, slots);
  layout["SLOT_CHANNEL"] = offsetof(Slot, channel);
  layout["SLOT_WRITER"] = offsetof(Slot, writer);
  layout["SLOT_VERDICT"] = offsetof(Slot, verdict);
  layout["CAPACITY_OFFSET"] = offsetof(SegmentHeader, capacity);
  layout["CREATOR_OFFSET"] = offsetof(SegmentHeader, creator);
  layout["UID_OFFSET"] = offsetof(SegmentHeader, uid);
  layout["GENERATION_OFFSET"] = offsetof(SegmentHeader, generation);
  layout["UNLINKED_OFFSET"] = offsetof(SegmentHeader, unlinked);
  layout["SLOTS_USED_OFFSET"] = offsetof(SegmentHeader, slots_used);
  layout["PINNED_OFFSET"] = offsetof(SegmentHeader, pinned);
  layout["SNAPSHOT_OFFSET"] = offsetof(SegmentHeader, snapshot);
  layout["HEADER_BYTES"] = kHeaderBytes;
  layout["TICKET_BIT"] = kTicketBit;
  layout["WRITING_BIT"] = kWritingBit;
  layout["TICKET_SLOT_SHIFT"] = kTicketSlotShift;
  layout["TICKET_SLOT_MASK"] = kTicketSlotMask;
  layout["TABLE_MAGIC"] = kTableMagic;
  layout["TABLE_CAPACITY_OFFSET"] = offsetof(TableHeader, capacity);
  layout["TABLE_FD_BASE_OFFSET"] = offsetof(TableHeader, fd_base);
  layout["TABLE_BUDGET_OFFSET"] = kTableBudgetOffset;
  layout["BUDGET_ENTRIES"] = kBudgetEntries;
  layout["BUDGET_ENTRY_BYTES"] = sizeof(BudgetEntry);
  layout["TABLE_UIDS_OFFSET"] = kTableUidsOffset;
  layout["FLAG_TICKETS"] = kFlagTickets;
  layout["FLAG_RELEASED"] = kFlagReleased;
  return layout;
}

}  // namespace torchshm
