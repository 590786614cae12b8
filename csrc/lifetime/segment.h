// A shared-memory segment: a sealed memfd whose first pages record who holds
// it, and the int8 torch tensors ("views") that expose its data.
//
// Note [Segment lifetime]
// Memory. A segment is an anonymous memfd, not a file in /dev/shm: its size
// is bounded by the memory the process may use (its cgroup), never by the
// /dev/shm mount (Docker and Kubernetes give that 64 MiB), it takes no room
// that torch's own tensor sharing needs, it has no name another user could
// take first, and F_SEAL_SHRINK/F_SEAL_GROW make truncating it (SIGBUS for
// every reader) impossible. The kernel frees it when its last fd and
// mapping go, so whatever dies, nothing outlives the processes using it.
//
// Who has an fd. The creator creates it and sends its fd to the session's
// keeper (torchshm/_keeper/daemon.py, one process per session), which
// keeps it at fd number fd_base + index, the segment's index in the session
// table (table.h). A receiver opens /proc/<keeper>/fd/<fd_base + index> (no
// round trip), or the creator's own fd the same way, or asks the keeper over
// its socket in /dev/shm (another PID namespace, a restarted keeper); it checks
// that what it opened is a sealed memfd of this user whose header carries
// the segment's random uid, maps it and closes the fd: a live array costs a
// mapping, never an fd. The creator keeps its fd while it keeps the segment
// and, once its last view is gone, while a message naming it is in flight
// (prune_in_flight), so that its messages survive a keeper's death. Those
// fds take numbers from FD_SETSIZE up (Note [Kept fds above select's
// range]) and count against the hard fd limit: the creator raises its soft
// limit as they need, and past a quarter of the hard limit it makes no new
// segment (its arrays are pickled by value, torchshm/_lifetime/segments.py).
// Cost of a first map (one-off, 2-core reference machine): ~18 us through
// /proc against ~15 us for shm_open of a /dev/shm file; ~25 us through the
// keeper's socket.
//
// Holders. Header: magic, capacity, creator id, uid, generation, flags, a
// watermark above which no slot was ever taken, and 16384 holder slots
// (only the pages of slots in use take memory). A slot holds one word: a
// process id (identity.h), or a ticket for one message in flight (layout.h:
// its slot, a random nonce and a "being written" bit). Beside it: the pipe
// the ticket's message was written to, the writer, and the keeper's
// verdict. Every change is one compare-and-swap on one word, so no death in
// the middle of an update can leave a count wrong: a slot names exactly who
// holds it, and a holder whose lock is gone is dead, whoever asks.
// - The creator takes slot 0: its pool's, or its view's when the pool is
//   full.
// - A sender issues a ticket when the pickler writes the segment's
//   reference, once per message. A ticket whose message a multiprocessing
//   writer is pickling carries the writer, marked "being written" until the
//   write has returned, and the pipe, named just before the write starts
//   (Note [One message, one snapshot] in message.h; _send/channel.py); a
//   message on this thread that starts while its predecessor's tickets are
//   still being written cancels them (that message was never written).
// - A receiver claims the ticket: one CAS turns the word into its own id,
//   and its view owns that slot. A process holding the segment already
//   cancels the ticket instead.
// - A second load of the same bytes finds its ticket gone; it takes a fresh
//   slot and checks the generation the message carried: if the pool reused
//   the memory meanwhile it fails with ESTALE naming the segment, never
//   seeing other data.
// - Before fork, the parent takes a slot for the child (under the child's
//   id, made in advance) in each segment it has a live view of.
// - Every slot taken (16384 messages in flight naming one segment, or
//   holders): the sender sends without a ticket and pins the segment, a
//   receiver maps it without a slot and pins it. A pinned segment is never
//   reused, and only its keeper closes it, when its session ends (whoever
//   lets go of a slot): no message is lost, whatever the fan-out; the price
//   is that its memory lives that long.
//
// Who may reuse or close:
// - Only the creator's pool overwrites a segment, and only when no view of
//   it is alive in its process, no slot but its own names a live holder and
//   it is not pinned; it bumps the generation, then looks again (seq_cst on
//   both sides, so a concurrent second load sees the new generation or is
//   seen).
// - Whoever releases a slot and finds no live holder left sets `unlinked`
//   and flags the index in the table; within a second the keeper closes its
//   fd. New loads then fail with ENOENT; arrays already loaded keep their
//   mappings, and their data.
//
// What each death leaves, and for how long:
// - A process that exits (multiprocessing's os._exit included) releases its
//   slots in an exit finalizer and removes its lock file: nothing is left.
//   A creator's fds close last, once it has seen a live keeper that has
//   every segment they keep (Note [Handing over at exit] in
//   torchshm/_lifetime/lifecycle.py).
// - A process killed by SIGKILL (or that skips finalizers) leaves slots
//   naming a dead id: the pool looks past them (once a second at most), and
//   the keeper, which sees the process's connection close, looks at every
//   segment of the session within a second and closes what only the dead
//   held. Holders from other sessions are looked at once a minute.
// - A ticket lives until claimed, or while its message can still be read:
//   the keeper judges the tickets of indices flagged in the table, and
//   writes a verdict once its pipe stayed closed in every process of this
//   user for a whole scan, or once its writer died before its write
//   returned (a half-written message nobody can read; judged at two scans a
//   second apart, so that a message written just before its writer's death
//   is still read). Tickets whose pipe is unknown (bytes sent another way)
//   live until the session ends.
// - A killed keeper: its fds close with it, but creators keep theirs (of
//   every segment a message in flight names), so their in-flight messages
//   still load while the sender lives. The next process that needs a
//   keeper starts one under the same session id; every member that created
//   segments notices at once (its expiry timer waits on its connection to
//   the keeper: Note [Expiry timer] in torchshm/_lifetime/expiry.py) and
//   registers them again, reused ones included. A keeper ends its session only
//   when no member is connected and no process of the session lives (their lock
//   files say so), so it never closes what live processes send. With no
//   member left, it lingers while a process that may still join started
//   with the session's id in its environment, or a ticket's pipe is still
//   open somewhere (at most TORCHSHM_SESSION_LINGER, 10 minutes): a sender
//   may exit before a `subprocess` child of its session has imported
//   torchshm. A message written to a file is the handles' job (below).
//
// Handles (torchshm.dumps / loads, torchshm/_handles.py) are messages meant
// to be loaded many times, by any process of this user on this node:
// - dumps pickles without tickets (ticket 0: every load is a "second load"
//   that takes its own slot and checks the generation) and pins every
//   segment the handle names: the exporter keeps a view of each, so its pool
//   never reuses them (the generation cannot change) and they are never
//   closed while it lives. A fresh array is snapshotted once, at dumps
//   (each load maps it privately: Note [Snapshots are mapped privately]).
// - The pins last while the exporter keeps the object (weakref.finalize),
//   or, for objects that cannot be weakly referenced, until
//   torchshm.release(handle) or its exit.
// - Validity is the exporter's alone: a random token in a word of a small
//   cell segment of the exporter, cleared by release. A load first checks
//   that the exporter's lock is held (holder_alive) and the token is still
//   there, then loads; a release racing with a load is caught by the
//   generation check or the segment being closed. A load after release or
//   exit fails with HandleError (ESTALE, or ENOENT where the exporter's
//   session cannot be reached) naming the exporter's pid, host and process
//   id; never other data.
// - Decision: a loaded object keeps its memory after the exporter exits or
//   releases. Its slot (and mapping) keep the data readable and the segment
//   out of any pool; new loads of the handle fail all the same, even while
//   other loaders keep the segment alive.
// - torchshm.distributed.share_on_node uses one handle per node for the
//   length of the call (released after a barrier); every rank then holds
//   its own slot. Each rank is its own session: when the owner rank's
//   session ends, its keeper closes what no live process holds. Ranks and
//   workers that mapped the table keep reading it; a later message naming a
//   segment that is closed (unlinked) is snapshotted instead: correct, but a
//   copy per message.
//
// Note [Snapshots are mapped privately]
// A sender's copy of an array (the plan's segments, Note [Sender plan] in
// plan.h) is a snapshot: the header says so for that generation, and nobody
// writes its bytes until the pool reuses it. So one snapshot can serve many
// messages (an unchanged array sent again: Note [Resending an unchanged
// array] in snapshots.h, or a receiver sending on what it received), and
// every process rebuilds an array over it through one of three mappings of
// the data, made once per segment and process:
// - arrays of a snapshot, read-only or writable: a MAP_PRIVATE mapping per
//   message. Reading it maps the segment's own pages (one copy in the
//   node, read faults as cheap as a read-only mapping's); the first write
//   to a page copies that page for this process alone (the kernel's
//   copy-on-write, no signal handler). So what a receiver writes is never
//   seen by the sender, another receiver, or another message, and a write
//   to a read-only array through another route (torch.from_numpy(a).add_(),
//   its .base: NumPy's flag cannot stop those) is no crash either: each
//   message that names a snapshot gets a private mapping of its own
//   (message_owner), the segment's idle one (whose written pages are
//   dropped first, MADV_DONTNEED: it reads the segment again) or, while
//   that one is in use, a new one from this process's fd (the creator's),
//   or from the segment opened again for an instant (a receiver keeps no
//   fd: _lifetime/attach.py). Only if that open fails are a message's
//   arrays copied (counted as arrays_copied_on_receive). A process
//   sending on a private array, or on a storage over one, sends a
//   reference only while no page of it was written (/proc/self/pagemap: a
//   written page is no longer the segment's), else a new snapshot.
// - writable arrays of shared memory (share(), handles of shared objects,
//   the allocator's born arrays): the MAP_SHARED mapping, as everyone sees it.
// - read-only arrays of shared memory: the segment's read-only mapping, a
//   MAP_PRIVATE one too, kept for the segment's life in this process. It
//   sees every other holder's writes (a page is the segment's until this
//   process writes it), and a write through another route stays this
//   process's. Pages this process wrote there are dropped when the segment
//   comes back in a new generation (the pool reused it: no array of the
//   old one is alive here then).
// A receiver maps a private one when it opens a segment (it has the fd
// then, and never keeps one); the creator maps them from its own fd when it
// needs them.
// Cost, 512 MiB of existing pages read once, 2-core reference machine
// (/tmp C program, medians of 3): PROT_READ 0.056 s, MAP_PRIVATE 0.058 s,
// MAP_SHARED read-write 0.059 s; writing every page of the private mapping
// 0.37 s (a fresh page each) against 0.21 s through the shared one.
#pragma once

#include <c10/util/Exception.h>
#include <sys/select.h>
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "lifetime/layout.h"
#include "lifetime/private_mappings.h"
#include "lifetime/table.h"

namespace torchshm {

// Note [Kept fds above select's range]
// A creator's kept fds are one per born array a Dataset caches, one per
// copy that one copy keeps: at the lowest free numbers, they would push the
// process's own sockets and files past 1023, where select() raises
// ValueError (paramiko, pexpect, older drivers). So a kept fd takes a number
// from kKeptFdsFrom (FD_SETSIZE) up, and the first segment a process makes
// raises its soft limit past that where the hard limit allows
// (torchshm/_lifetime/segments.py): the process's own fds stay where they
// would be without torchshm. Under a hard limit of FD_SETSIZE or less, they
// take the lowest numbers, as any fd does. The cost: an fcntl and a close
// per segment made.
constexpr int kKeptFdsFrom = FD_SETSIZE;

class Segment : public std::enable_shared_from_this<Segment> {
 public:
  // Which mapping of the data an array is rebuilt over (Note [Snapshots are
  // mapped privately]).
  enum class Mapping : uint8_t { kShared, kReadOnly, kPrivate };

  // Creates a sealed memfd with `capacity` data bytes; slot 0 holds
  // `creator`, and its index is claimed in `table` (the creator's session's,
  // named `session`). With `populate`, every page is backed up front, by up
  // to `threads` threads, so that a memory limit fails here, not on first
  // write through the mapping; without it, the pages are made by fill()'s
  // writes, which fail with an error, never a signal. The fd stays open
  // (fd()) for the keeper's registration and receivers' /proc lookups until
  // close_fd() or destruction.
  static std::shared_ptr<Segment> create(const std::string& session,
                                         std::shared_ptr<SessionTable> table,
                                         int64_t capacity, uint64_t creator,
                                         int threads = 1, bool populate = true);
  // Maps the segment behind `fd` (the caller closes it) if it is segment
  // `uid` of `session`: a sealed memfd of this user with a header that names
  // that uid, not unlinked. ENOENT if it is gone, EACCES or EINVAL for
  // anything else.
  static std::shared_ptr<Segment> attach(int fd, const std::string& session,
                                         uint64_t uid);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Puts `holder` in a free slot; -1 if every slot is taken.
  int take_slot(uint64_t holder);
  // Frees `slot` if it still holds `holder`; unlinks the segment when no
  // live holder remains and it is not pinned.
  void release_slot(int slot, uint64_t holder);
  // A new ticket for a message written to pipe `channel` (an inode; 0 if
  // unknown) by process `writer` (0: no write to watch; else the ticket is
  // marked "being written" until mark_written). 0 if every slot is taken:
  // then the segment is pinned (see the Note).
  uint64_t issue_ticket(uint64_t channel, uint64_t writer);
  // Names the pipe a ticket's message is about to be written to (its
  // writer calls this before the first byte goes out: message.h).
  void name_channel(uint64_t ticket, uint64_t channel);
  // Turns `ticket` into `holder`; the slot, or -1 if the ticket is gone.
  int claim_ticket(uint64_t ticket, uint64_t holder);
  // Frees the ticket's slot; false if it was already claimed or never existed.
  bool cancel_ticket(uint64_t ticket);
  // Clears the ticket's "being written" bit (its message is in the pipe);
  // false if it was claimed or cancelled meanwhile.
  bool mark_written(uint64_t ticket);
  // For the creator's pool: true if nothing but `own_slot` holds the segment,
  // no local view but the caller's `own_views` is alive and it is not
  // pinned; then bumps the generation.
  bool reserve_for_reuse(int own_slot, int64_t own_views = 0);
  // Never reused from now on: a child of a fork torchshm did not prepare
  // may map it with no slot (Note [One copy of a sent array]).
  void retire() { retired_.store(true); }
  // Whether a slot holds a ticket the keeper has not found dead: a message
  // naming the segment that may still be read.
  bool has_ticket_in_flight() const;
  // Whether any slot other than `except_slot` names a live holder; clears
  // the slots of dead ones on the way.
  bool has_live_holder(int except_slot = -1);
  // Never reused, never closed before the session ends (see the Note).
  void pin();
  // Marks the segment unlinked (no new attach) and tells the keeper.
  void unlink();

  // Copies `n` bytes from `src` to data offset `at`, with up to `threads`
  // threads (the GIL released by the caller). A segment created without
  // populate and never reused has no pages yet: they are made as they are
  // written, by pwrite and by faults at once (Note [Filling a fresh segment]
  // in fresh_pages.cpp); otherwise its pages are mapped already and memcpy
  // runs at memory speed.
  void fill(int64_t at, const uint8_t* src, int64_t n, int threads);
  // Whether data bytes [at, at + n) equal `src` (GIL released by the caller).
  bool equals(int64_t at, const uint8_t* src, int64_t n, int threads) const;
  // Marks this generation's data a snapshot (Note [Snapshots are mapped
  // privately]); reuse by the pool clears it.
  void mark_snapshot();
  bool snapshot() const;
  // Note [A born array is sent as it was]
  // An array born in a segment (Note [Born shared] in send/allocator.h) and
  // sent, not share()d, must reach its receivers as it was at the send, as
  // any other sent array does: the sender may write into it afterwards
  // (a buffer a dataset reuses). So at its first send the creator's own
  // mapping of the data becomes private (copy-on-write: its later writes
  // are its own pages) and the generation a snapshot (receivers map it
  // privately too), with no copy: freeze_data(). A later send of it is by
  // reference while this process wrote none of its pages, else a new
  // snapshot (frozen_written). When the pool reuses the segment, no array
  // of this process is over it: thaw_data() maps the data shared again.
  // The shared mapping's pages are parked meanwhile, mapped, at an address
  // of their own, and moved back (page tables moved, no page faulted or
  // unmapped: a DataLoader worker's next batch writes at memory speed).
  // A block of a slab is never frozen (its slab's other blocks are shared
  // memory): small born arrays stay shared, as the allocator's page says.
  // False if it cannot (no fd, the mapping refused): then the caller copies.
  // Note [A plain send is as it was] in send/plan.h says when a freeze is
  // enough and when the sender copies instead.
  bool freeze_data();
  bool data_frozen() const;
  // Whether this process wrote a page of data bytes [lo, hi) since it froze.
  bool frozen_written(int64_t lo, int64_t hi);
  // Maps the data shared again (the pool reuses it); false if it cannot.
  bool thaw_data();
  // Note [A registered mapping stays as it is]
  // CUDA DMAs the pages it locked at registration (torchshm/_lifetime/
  // pins.py): a registered range remapped (a freeze: shared -> private)
  // would give the device stale bytes with no error, and registering a
  // private mapping breaks its copy-on-write on every page. So the GPU
  // registers the shared mapping only while it is not frozen
  // (hold_for_device), and a freeze refuses while it is held: the send
  // copies instead.
  bool hold_for_device();
  void release_for_device();
  // Another process may write this segment's data through a shared mapping
  // (it was share()d, or a fork child inherited it shared): a plain send of
  // it copies, never freezes (Note [A plain send is as it was]).
  void others_may_write() { others_may_write_.store(true); }
  bool may_be_written_by_others() const { return others_may_write_.load(); }
  // Maps data bytes [at, at + n) privately (copy-on-write) over [p, p + n),
  // memory that is not torchshm's, from this process's fd: the pages of an
  // array whose snapshot this is (Note [One copy of a sent array] in
  // send/one_copy.h). `p` and `at` page-aligned; false where it cannot.
  bool map_data_over(void* p, int64_t at, int64_t n);
  // A private mapping of the data for one view, with no page written:
  // the idle one, or a new one from this process's fd; nullptr if neither
  // (see the Note). give_back_private() takes it back when the view dies.
  // `threads` walk the page table of a reused one that may have been
  // written (Note [Knowing that nothing was written]).
  uint8_t* take_private(int threads);
  // Takes back a view's private mapping; `written`: this process may have
  // written a page of it, and a thread of its own walks it for those pages
  // (Note [Knowing that nothing was written]).
  void give_back_private(uint8_t* data, bool written);
  // Whether take_private() can give one more message a private mapping: one
  // is idle or being walked, or this process has the fd to make one.
  bool private_ready() const;
  // The read-only arrays' mapping (see the Note): made on first use from a
  // private mapping, cleaned of this process's writes when the segment
  // holds a new generation; nullptr if no private mapping can be had.
  uint8_t* readonly_mapping(int threads);
  // Whether this process wrote a page of data bytes [lo, hi) of the
  // read-only mapping (Note [Knowing that nothing was written] in
  // private_mappings.h).
  bool readonly_written(int64_t lo, int64_t hi);
  // False in the child of a fork torchshm did not prepare: none of this
  // segment's mappings is there (Note [Forks torchshm did not prepare] in
  // fork_guard.h), and nothing may touch them.
  bool lost() const;
  // Takes `other`'s idle private mapping (the same segment, attached anew
  // from a fresh fd) as this one's: a receiver, which keeps no fd, then has
  // a private mapping for one more message (Note [Snapshots are mapped
  // privately]).
  void adopt_private(Segment& other);

  uint8_t* data() const;
  int64_t capacity() const { return capacity_; }
  uint64_t generation() const;
  bool unlinked() const;
  bool pinned() const;
  int64_t holders() const;  // non-empty slots, live or not
  int64_t local_views() const { return views_.load(); }
  uint64_t uid() const { return uid_; }
  const std::string& session() const { return session_; }
  // torchshm:<session>:<uid>: what every process calls this segment.
  const std::string& name() const { return name_; }
  // name:<index>:<creator pid>:<creator fd>: where a receiver finds it.
  std::string locator() const;

  // Whether this process created it (a forked child did not).
  bool created_here() const;
  // Whether a view's slot waits for copies before it is released (Note
  // [Copies before reuse] in views.h).
  bool defers_releases() const { return defers_releases_.load(); }
  void defer_releases(bool on) { defers_releases_.store(on); }

  int fd() const { return fd_.load(); }
  void close_fd();
  int index() const { return index_.load(); }
  // The table that names this segment, and its index there (a restarted
  // keeper's table when the segment is registered again).
  void rebind(std::shared_ptr<SessionTable> table, int index);
  std::shared_ptr<SessionTable> table() const;

 private:
  friend struct View;
  Segment(std::string session, uint64_t uid, void* base, size_t mapped_bytes,
          int64_t capacity, int fd, pid_t creator_pid);
  SegmentHeader* header() const;
  int scan_end() const;
  // Maps the data MAP_PRIVATE from `fd`; nullptr on failure.
  uint8_t* map_private(int fd) const;
  Slot* ticket_slot(uint64_t ticket) const;

  std::string session_;
  uint64_t uid_;
  std::string name_;
  void* base_;
  size_t mapped_bytes_;
  int64_t capacity_;
  std::atomic<int> fd_;
  pid_t creator_pid_;  // this process's pid when it created the segment
  std::atomic<int> index_{-1};
  std::shared_ptr<SessionTable> table_;  // guarded by std::atomic_load/store
  std::atomic<int64_t> views_{0};
  std::atomic<bool> defers_releases_{false};
  std::atomic<bool> retired_{false};
  std::atomic<bool> others_may_write_{false};
  std::atomic<uint8_t*> idle_private_{nullptr};  // set under mappings_mutex_
  bool idle_written_ = false;  // of idle_private_: the mutex's
  // A private mapping a thread of process walking_pid_ walks for written
  // pages; it becomes the idle one (walked_ is notified). The mutex's.
  uint8_t* walking_ = nullptr;
  pid_t walking_pid_ = 0;
  std::condition_variable walked_;
  // Drops the pages this process wrote in private mapping `data`, with up
  // to `threads` threads.
  void drop_written(uint8_t* data, int threads);
  // The walk of `data` is done: it becomes the idle mapping.
  void walk_done(uint8_t* data);
  // The read-only mapping (the mutex's): the generation it was cleaned for,
  // and this process's fault count then.
  uint8_t* readonly_ = nullptr;
  uint64_t readonly_generation_ = 0;
  WriteWatch readonly_clean_;
  mutable std::mutex mappings_mutex_;
  bool write_fill_ = false;       // created without populate: fill_fresh_pages
  bool data_frozen_ = false;      // freeze_data(); the mutex's
  bool held_for_device_ = false;  // hold_for_device(); the mutex's
  // While frozen: the shared mapping's pages, moved aside (park_tracked in
  // fork_guard.h) for thaw_data to move back. The mutex's.
  uint8_t* parked_ = nullptr;
  const uint64_t epoch_;  // mapping_epoch() when its mappings were made

 public:
  // Set while a pool of this process keeps the segment (pool.h): its last
  // local view dying may wake the pool's expiry timer (wake_when_quiet).
  std::atomic<bool> pooled{false};
};

// Segments this process created that still hold their fd (to register them
// with a restarted keeper), and how many fds those are.
std::vector<std::shared_ptr<Segment>> segments_with_fd();
int64_t open_creator_fds();

}  // namespace torchshm
