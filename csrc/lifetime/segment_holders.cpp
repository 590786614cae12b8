// A segment's holder slots and the tickets of its messages in flight (Note
// [Segment lifetime] in segment.h): every change one compare-and-swap.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "lifetime/identity.h"
#include "lifetime/segment.h"

namespace torchshm {

// No slot at or above the watermark was ever taken, so scans stop there
// (most segments only ever use a few low slots). take_slot raises it before
// its CAS, both seq_cst: a scan that loads it and then the slots misses only
// slots taken after the scan began, as a scan of every slot would.
int Segment::scan_end() const {
  return static_cast<int>(
      std::min<uint32_t>(header()->slots_used.load(), kSlots));
}

int Segment::take_slot(uint64_t holder) {
  SegmentHeader* h = header();
  for (int i = 0; i < kSlots; ++i) {
    if (h->slots[i].word.load() != 0) continue;
    uint32_t used = h->slots_used.load();
    const uint32_t wanted = static_cast<uint32_t>(i) + 1;
    while (used < wanted &&
           !h->slots_used.compare_exchange_weak(used, wanted)) {
    }
    // A ticket names its own slot (layout.h).
    const uint64_t word =
        holder & kTicketBit
            ? (holder & ~(kTicketSlotMask << kTicketSlotShift)) |
                  (static_cast<uint64_t>(i) << kTicketSlotShift)
            : holder;
    uint64_t expected = 0;
    if (h->slots[i].word.compare_exchange_strong(expected, word)) return i;
  }
  return -1;
}

void Segment::release_slot(int slot, uint64_t holder) {
  if (slot < 0 || slot >= kSlots) return;
  uint64_t expected = holder;
  if (!header()->slots[slot].word.compare_exchange_strong(expected, 0)) return;
  // A pinned segment may be named by messages that hold no slot: only the
  // keeper closes it, when its session ends. A scan can be torn (a holder
  // sending it on puts the message's ticket in a lower slot, then lets go of
  // its own, higher one, while the scan passes between them): the ticket
  // stays, so a second scan finds it.
  if (!pinned() && !has_live_holder() && !has_live_holder()) unlink();
}

uint64_t Segment::issue_ticket(uint64_t channel, uint64_t writer) {
  const uint64_t nonce = random_id() & kTicketNonceMask;
  const uint64_t wanted =
      kTicketBit | (writer ? kWritingBit : 0) | (nonce ? nonce : 1);
  const int slot = take_slot(wanted);
  if (slot < 0) {
    pin();
    return 0;
  }
  Slot& s = header()->slots[slot];
  const uint64_t ticket = s.word.load();
  // A reader may see the previous ticket's channel or writer for an
  // instant; the keeper judges a ticket only after seeing the same word at
  // two scans.
  s.channel.store(channel);
  s.writer.store(writer);
  // After the ticket: the keeper clears a flag before it looks (table.h).
  if (channel != 0 || writer != 0) {
    if (auto table = this->table()) table->flag(index(), kFlagTickets);
  }
  return ticket;
}

void Segment::name_channel(uint64_t ticket, uint64_t channel) {
  Slot* s = ticket_slot(ticket);
  // Only the writer calls this, before its message's first byte is written:
  // nobody can have claimed the ticket, so the slot is still this ticket's.
  if (s == nullptr || s->word.load() != ticket) return;
  s->channel.store(channel);
  if (auto table = this->table()) table->flag(index(), kFlagTickets);
}

Slot* Segment::ticket_slot(uint64_t ticket) const {
  if (!(ticket & kTicketBit)) return nullptr;
  const uint64_t slot = (ticket >> kTicketSlotShift) & kTicketSlotMask;
  return slot < static_cast<uint64_t>(kSlots) ? &header()->slots[slot]
                                              : nullptr;
}

int Segment::claim_ticket(uint64_t ticket, uint64_t holder) {
  Slot* s = ticket_slot(ticket);
  if (s == nullptr) return -1;
  const uint64_t id = ticket & ~kWritingBit;
  // A ticket the keeper found dead is not claimed: the load goes the way
  // of a second load (a fresh slot and the generation check).
  if (s->verdict.load() == id) return -1;
  uint64_t word = s->word.load();
  while ((word & ~kWritingBit) == id) {
    if (s->word.compare_exchange_weak(word, holder))
      return static_cast<int>(s - header()->slots);
  }
  return -1;
}

bool Segment::cancel_ticket(uint64_t ticket) {
  Slot* s = ticket_slot(ticket);
  if (s == nullptr) return false;
  const uint64_t id = ticket & ~kWritingBit;
  uint64_t word = s->word.load();
  while ((word & ~kWritingBit) == id) {
    if (s->word.compare_exchange_weak(word, 0)) return true;
  }
  return false;
}

bool Segment::mark_written(uint64_t ticket) {
  Slot* s = ticket_slot(ticket);
  if (s == nullptr) return false;
  uint64_t expected = ticket | kWritingBit;
  return s->word.compare_exchange_strong(expected, ticket & ~kWritingBit);
}

bool Segment::has_live_holder(int except_slot) {
  Slot* slots = header()->slots;
  for (int i = 0, end = scan_end(); i < end; ++i) {
    uint64_t word = slots[i].word.load();
    if (i == except_slot || word == 0) continue;
    // A ticket the keeper found dead (its pipe is closed everywhere, or its
    // writer died mid-write). A receiver that claimed it first turned the
    // word into its own id, so this CAS then fails and the receiver keeps
    // its slot.
    const bool dead_ticket =
        (word & kTicketBit) && slots[i].verdict.load() == (word & ~kWritingBit);
    if (!dead_ticket && holder_alive(word)) return true;
    slots[i].word.compare_exchange_strong(word, 0);  // a dead holder's slot
  }
  return false;
}

bool Segment::has_ticket_in_flight() const {
  const Slot* slots = header()->slots;
  for (int i = 0, end = scan_end(); i < end; ++i) {
    const uint64_t word = slots[i].word.load();
    if ((word & kTicketBit) && slots[i].verdict.load() != (word & ~kWritingBit))
      return true;
  }
  return false;
}

bool Segment::reserve_for_reuse(int own_slot, int64_t own_views) {
  if (retired_.load() || views_.load() != own_views || pinned() ||
      has_live_holder(own_slot))
    return false;
  // A frozen creator's mapping is shared again before anyone writes the
  // next generation (Note [A born array is sent as it was]).
  if (!thaw_data()) return false;
  header()->generation.fetch_add(1);
  header()->snapshot.store(0);  // whoever takes it next says what it is
  return !has_live_holder(own_slot) && !pinned();
}

int64_t Segment::holders() const {
  int64_t n = 0;
  for (int i = 0, end = scan_end(); i < end; ++i)
    n += header()->slots[i].word.load() != 0;
  return n;
}

}  // namespace torchshm
