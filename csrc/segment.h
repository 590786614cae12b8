// A named POSIX shared-memory segment whose first page records who holds it,
// and the int8 torch tensors ("views") that expose its data.
//
// Note [Segment lifetime]
// Header: magic, capacity, a generation, an `unlinked` flag and 504 holder
// slots. A slot holds one holder word (identity.h): a process id, or a ticket
// (kTicketBit | nonce) for one message in flight. Every change is one
// compare-and-swap on one slot, so there is no count that a death in the
// middle of an update could leave wrong: a slot names exactly who holds it,
// and a holder whose lock is gone is dead, whoever asks.
//
// - Creating a segment takes slot 0 for the creator (its pool, or its view).
// - A sender names a segment in a message by issuing a ticket into a free
//   slot when the pickler writes the reference (one per message carrying it).
// - A receiver claims the ticket: one CAS turns the ticket word into its own
//   process id. A message loaded a second time finds its ticket gone; it
//   takes a fresh slot of its own and then checks the generation the message
//   carried. If the pool reused the memory meanwhile the load fails with an
//   error naming the segment; it never sees other data.
// - The creator's pool may overwrite a segment only when no view of it is
//   alive in the pool's process and no slot but its own names a live holder;
//   it bumps the generation, then looks again (seq_cst on both sides, so a
//   concurrent second load either sees the new generation or is seen).
// - Dropping the last view of a process releases its slot; whoever finds no
//   live holder left sets `unlinked` and unlinks the name. A mapping stays
//   valid after unlink: arrays already loaded keep reading their data.
// - Death: a SIGKILLed process's slots name a dead id. Anyone who meets them
//   clears them (the pool when it looks for a segment to reuse, a releasing
//   process, and the session reaper, which scans its session's segments every
//   second and unlinks those with no live holder: torchshm/_reaper.py).
//   Tickets die with their session; the reaper unlinks what is left.
// - Names are /torchshm_<session>_<process id>_<n>: unique for the machine's
//   lifetime, so a cached mapping can never be mistaken for a new segment.
// The fd is closed right after mmap: a live array costs a mapping, never an
// fd.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace torchshm {

constexpr size_t kHeaderBytes = 4096;  // one page: data stays page-aligned
constexpr int kSlots = 504;

class Segment {
 public:
  // Creates and maps a new segment with `capacity` data bytes; slot 0 holds
  // `creator`. Space is reserved up front so that a full tmpfs fails here
  // with ENOSPC instead of SIGBUS on first write.
  static std::shared_ptr<Segment> create(const std::string& name,
                                         int64_t capacity, uint64_t creator);
  // Maps an existing segment without taking a slot. Refuses a file that is
  // not a regular file of this user with mode 0600, or not a torchshm segment.
  static std::shared_ptr<Segment> attach(const std::string& name);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Puts `holder` in a free slot; -1 if every slot is taken.
  int take_slot(uint64_t holder);
  // Frees `slot` if it still holds `holder`; unlinks the segment when no live
  // holder remains.
  void release_slot(int slot, uint64_t holder);
  // A new ticket in a free slot; 0 if every slot is taken.
  uint64_t issue_ticket();
  // Turns `ticket` into `holder`; the slot, or -1 if the ticket is gone.
  int claim_ticket(uint64_t ticket, uint64_t holder);
  // Frees the ticket's slot; false if it was already claimed or never existed.
  bool cancel_ticket(uint64_t ticket);
  // For the creator's pool: true if nothing but `own_slot` holds the segment
  // and no local view is alive; then bumps the generation (see the Note).
  bool reserve_for_reuse(int own_slot);
  // Whether any slot other than `except_slot` names a live holder; clears
  // the slots of dead ones on the way.
  bool has_live_holder(int except_slot = -1);
  // Marks the segment unlinked and removes its name (idempotent).
  void unlink();

  uint8_t* data() const;
  int64_t capacity() const { return capacity_; }
  uint64_t generation() const;
  bool unlinked() const;
  int64_t holders() const;  // non-empty slots, live or not
  int64_t local_views() const { return views_.load(); }
  const std::string& name() const { return name_; }

 private:
  friend struct View;
  Segment(std::string name, void* base, size_t mapped_bytes, int64_t capacity);
  struct Header* header() const;

  std::string name_;
  void* base_;
  size_t mapped_bytes_;
  int64_t capacity_;
  std::atomic<int64_t> views_{0};
};

// One live view of a segment: the context of a tensor's storage. It keeps the
// mapping alive and may own one slot, for the process `pid`.
struct View {
  View(std::shared_ptr<Segment> segment, int slot, uint64_t holder);
  ~View();
  // Releases the slot now if this process owns it.
  void disown();
  // Takes over a slot taken for this process (a forked child's view).
  void adopt(int slot, uint64_t holder);

  std::shared_ptr<Segment> segment;
  std::atomic<int> slot;  // -1: owns none
  std::atomic<uint64_t> holder;
  std::atomic<pid_t> pid;
};

// An int8 tensor over the whole data area; the view owns `slot` (or none: -1).
at::Tensor view_tensor(std::shared_ptr<Segment> segment, int slot,
                       uint64_t holder);
// The view behind a tensor's storage, or nullptr if it is not one of ours.
View* view_of(const at::Tensor& tensor);

}  // namespace torchshm
