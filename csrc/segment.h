// A named POSIX shared-memory segment whose first pages record who holds it,
// and the int8 torch tensors ("views") that expose its data.
//
// Note [Segment lifetime]
// Header: magic, capacity, the creator's id, a generation, an `unlinked` flag,
// a watermark above which no slot was ever taken (scans stop there), and 336
// holder slots. A slot holds one holder word (identity.h): a process
// id, or a ticket (kTicketBit | nonce) for one message in flight. Beside each
// slot: the pipe a ticket's message was written to (its inode, 0 if unknown)
// and the reaper's verdict (a ticket word it found dead). Every change is one
// compare-and-swap on one slot, so there is no count that a death in the
// middle of an update could leave wrong: a slot names exactly who holds it,
// and a holder whose lock is gone is dead, whoever asks.
//
// Who holds which slot:
// - The creator takes slot 0 when it creates the segment: its pool's, or its
//   view's when the pool is full.
// - A sender issues a ticket into a free slot when the pickler writes the
//   segment's reference, once per message (so a dumps nested in another gets
//   its own). With every slot taken it sends no ticket: the receiver then
//   loads as a second load does (below).
// - A receiver claims the ticket: one CAS turns the ticket word into its own
//   id, and its view owns that slot. A process already holding the segment
//   cancels the ticket instead.
// - A second load of the same bytes finds its ticket gone; it takes a fresh
//   slot and then checks the generation the message carried. If the pool
//   reused the memory meanwhile it fails with ESTALE naming the segment; it
//   never sees other data.
// - Before fork, the parent takes a slot for the child (under the child's id,
//   made in advance) in each segment it has a live view of.
//
// Who may reuse or unlink:
// - Only the creator's pool overwrites a segment, and only when no view of
//   it is alive in its process and no slot but its own names a live holder;
//   it bumps the generation, then looks again (seq_cst on both sides, so a
//   concurrent second load either sees the new generation or is seen).
// - Whoever releases a slot and finds no live holder left sets `unlinked`
//   and unlinks the name; so does the session reaper (torchshm/_reaper.py)
//   for segments of its session that no live holder names, and for all that
//   is left when the session ends. A mapping stays valid after unlink: arrays
//   already loaded keep reading their data; new loads fail with ENOENT.
//
// What each death leaves, and for how long:
// - A process that exits (multiprocessing's os._exit included) releases its
//   slots in an exit finalizer and removes its lock file: nothing is left.
// - A process killed by SIGKILL (or that skips finalizers) leaves slots
//   naming a dead id: the pool looks past them and clears them (once a
//   second at most), and the reaper unlinks what only the dead held within
//   about a second. A forked child that execs loses its lock at exec: same.
// - A ticket lives while its session does, or, when its message went into a
//   pipe, only while some process of this user still has that pipe open:
//   the reaper writes the ticket's word into its verdict slot once the pipe
//   stayed closed everywhere for a whole scan, and from then on the ticket
//   counts as dead (a receiver that claimed it first keeps it, since its
//   claim changed the word). So a killed sender's messages stay loadable
//   while they can still be read, and an epoch cut short frees its prefetched
//   batches within seconds.
// - A killed reaper: its session lock is free, so another session's reaper
//   treats the session as dead and unlinks its segments that no live process
//   holds (in-flight tickets included: such a message fails on load with
//   ENOENT). Processes keep what they hold.
// - Names are /torchshm_<session>_<process id>_<n>: unique for the machine's
//   lifetime, so a cached mapping can never be mistaken for a new segment.
//
// Handles (torchshm.dumps / loads, torchshm/_handles.py) are messages meant
// to be loaded many times, by any process of this user on this node:
// - dumps pickles without tickets (ticket 0: every load is a "second load"
//   that takes its own slot and checks the generation) and pins every
//   segment the handle names: the exporter keeps a view of each, so its pool
//   never reuses them (the generation cannot change) and they are never
//   unlinked while it lives. A fresh array is snapshotted once, at dumps.
// - The pins last while the exporter keeps the object (weakref.finalize),
//   or, for objects that cannot be weakly referenced, until
//   torchshm.release(handle) or its exit.
// - Validity is the exporter's alone: a random token in a word of a small
//   cell segment of the exporter, cleared by release. A load first checks
//   that the exporter's lock is held (holder_alive) and the token is still
//   there, then loads; a release racing with a load is caught by the
//   generation check or the name's absence. A load after release or exit
//   fails with HandleError (ESTALE, or ENOENT where the names are gone or
//   this process sees another /dev/shm) naming the exporter's pid, host and
//   process id; never other data.
// - Decision: a loaded object keeps its memory after the exporter exits or
//   releases. Its slot (and mapping) keep the data readable and the segment
//   out of any pool; new loads of the handle fail all the same, even while
//   other loaders keep the segment alive.
// - torchshm.distributed.share_on_node uses one handle per node for the
//   length of the call (released after a barrier); every rank then holds
//   its own slot. Each rank is its own session: when the owner rank's
//   session ends (it exits, or is killed, with its workers), its reaper
//   unlinks the names. Ranks and workers that mapped the table keep reading
//   it; a later message naming it (a new epoch's spawn workers) finds it
//   `unlinked` and is snapshotted instead: correct, but a copy per message.
// The fd is closed right after mmap: a live array costs a mapping, never an
// fd.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace torchshm {

constexpr size_t kHeaderBytes = 8192;  // two pages: data stays page-aligned
constexpr int kSlots = 336;

class Segment {
 public:
  // Creates and maps a new segment with `capacity` data bytes; slot 0 holds
  // `creator`. Every page is backed up front, by up to `threads` threads, so
  // that a full tmpfs fails here with ENOSPC instead of SIGBUS on first write.
  static std::shared_ptr<Segment> create(const std::string& name,
                                         int64_t capacity, uint64_t creator,
                                         int threads = 1);
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
  // A new ticket in a free slot for a message written to pipe `channel`
  // (an inode; 0 if unknown); 0 if every slot is taken.
  uint64_t issue_ticket(uint64_t channel = 0);
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
  int scan_end() const;

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
