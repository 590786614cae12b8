// The views of segments that tensors hold: a view keeps its segment's
// mapping alive and may own a holder slot (segment.h); the tensors, and the
// Python objects, made over them.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "base/torch_api.h"
#include "lifetime/private_mappings.h"
#include "lifetime/segment.h"

namespace torchshm {

// A private mapping of a segment's data lent to one message (Note [Snapshots
// are mapped privately] in segment.h): its view, and every storage rebuilt
// over it (tensors.h), share it. The last to go gives it back to the
// segment, which drops the pages this process wrote before lending it again.
struct PrivateLease {
  PrivateLease(std::shared_ptr<Segment> segment, uint8_t* data);
  ~PrivateLease();
  PrivateLease(const PrivateLease&) = delete;
  PrivateLease& operator=(const PrivateLease&) = delete;

  const std::shared_ptr<Segment> segment;
  uint8_t* const data;
  const WriteWatch lent;  // when it was lent
};

// One live view of a segment: the context of a tensor's storage. It keeps the
// mapping alive and may own one slot, for the process `pid`. A view over the
// read-only or private mapping owns no slot: it keeps the view that does
// alive through that view's storage (`keep`), never through a tensor: a
// tensor kept by C++ whose Python object dies is resurrected and owned by
// C++, and torch 1.13 frees it under a weak reference that finds it again.
struct View {
  View(std::shared_ptr<Segment> segment, int slot, uint64_t holder,
       Segment::Mapping kind = Segment::Mapping::kShared,
       at::Storage keep = at::Storage(),
       std::shared_ptr<PrivateLease> lease = nullptr);
  ~View();
  // Releases the slot now if this process owns it.
  void disown();
  // Hands the slot to the deferred releases instead, if its segment defers
  // them (Note [Copies before reuse]); whether it did.
  bool defer_release();
  // Takes over a slot taken for this process (a forked child's view).
  void adopt(int slot, uint64_t holder);
  // The view that owns this one's slot: itself, or its alias's `keep`'s.
  View& slot_owner();

  std::shared_ptr<Segment> segment;
  const Segment::Mapping kind;
  const at::Storage keep;  // the slot owner's storage, for an alias
  // The private mapping this view lies over (kind kPrivate).
  const std::shared_ptr<PrivateLease> lease;
  std::atomic<int> slot;  // -1: owns none
  std::atomic<uint64_t> holder;
  std::atomic<pid_t> pid;
};

// An int8 tensor over the whole data area; the view owns `slot` (or none: -1).
at::Tensor view_tensor(std::shared_ptr<Segment> segment, int slot,
                       uint64_t holder);
// The view behind a tensor's storage, or nullptr if it is not one of ours.
View* view_of(const at::Tensor& tensor);
View* view_of(const at::Storage& storage);
// The view behind a tensor's storage; raises if it is not one of ours.
View& checked_view(const at::Tensor& tensor);
// The storage of the view that owns the slot of `tensor`'s view: its alias's
// `keep`, or its own (raises if it is not one of ours).
at::Storage slot_owner_storage(const at::Tensor& tensor);
// A new int8 tensor over all of `storage` (a view's).
at::Tensor tensor_of(at::Storage storage);
// What a message's arrays are rebuilt over (Note [Snapshots are mapped
// privately]): for a snapshot, a view over a private mapping of its own if
// one can be had, else `owner` (a Python tensor over a segment).
py::object message_owner(py::handle owner, int threads);
// Whether this process wrote a page of bytes [lo, hi) of the private or
// read-only mapping behind `view` (those pages are its own now, not the
// segment's); false for a view of the shared mapping.
bool written_privately(const View* view, int64_t lo, int64_t hi);
// Where in the segment's shared mapping the bytes [address, address +
// nbytes) of `owner`'s private mapping (a snapshot's) lie, while they are
// the same bytes: this process wrote none of those pages and the segment is
// not frozen here; 0 otherwise. Note [Born batches pinned in place] in
// torchshm/_device.py.
uintptr_t shared_address(const at::Tensor& owner, uintptr_t address,
                         int64_t nbytes);
// A data pointer to the start of the mapping `owner` (a tensor view_of
// knows) lies over: its message's private mapping, else the shared one;
// its context is a new view owning no slot, keeping the slot owner's
// storage (and the private mapping) alive (Note [Tensor storages] in
// tensors.h).
at::DataPtr storage_alias(const at::Tensor& owner);
// storage_alias over the shared mapping, whatever `owner` lies over.
at::DataPtr shared_alias(const at::Tensor& owner);
// An int8 tensor over the whole data through mapping `kind`, keeping
// `owner` (a tensor view_of knows) alive: `owner` itself if it is that
// mapping's; undefined if that mapping cannot be made here.
// `threads` as in Segment::take_private.
at::Tensor mapped_tensor(const at::Tensor& owner, Segment::Mapping kind,
                         int threads = 1);
// mapped_tensor for a Python tensor `owner`, as a Python tensor (None where
// the mapping cannot be made). A new one holds `owner` as an attribute: the
// weak reference callback on `owner` (the receiver's last-view hook,
// _lifetime/attach.py: _on_last_view) then fires once the arrays over either
// are gone, as it does when they all lie over `owner`. A Python reference, not
// a C++ one: see View.
py::object mapped_object(py::handle owner, Segment::Mapping kind,
                         int threads = 1);

// The expiry timer of torchshm/_lifetime/expiry.py sleeps without a deadline
// while every pooled segment has a local view (none can expire). Armed with a
// pipe fd, the next pooled segment whose last local view dies writes one byte
// to it and disarms it: one wake-up per such sleep, no syscall per message
// otherwise. -1 disarms.
void wake_when_quiet(int fd);

// How many times, in any thread, the last local view of a pooled segment
// died: only that can make a segment of a size class the pool last found all
// busy quiet again (Note [Segment pool] in pool.h). The pool reads it; views
// never call the pool.
uint64_t pooled_last_views();

// Segments this process created that no view holds but a message in flight
// names (kept by the last view's destructor): prune_in_flight lets go of
// those whose messages were all read or found dead and returns how many are
// left; torchshm/_lifetime/expiry.py calls it while any are kept.
int64_t prune_in_flight();
int64_t in_flight_count();

// Note [Copies before reuse]
// A segment registered for the GPU (torchshm/_lifetime/pins.py) is read by
// asynchronous copies that this process issues, torch's or torchshm's, and
// none of them tells torchshm when it is done. So while a segment defers
// releases, a view's slot is not released when the view dies: it goes to a
// list that Python takes (take_deferred_releases), records events on every
// stream a copy may have used, and releases each slot once they completed.
// Until then the slot holds the segment, and its creator cannot reuse it.
// Only slots are deferred: the view's mapping may go (the registration keeps
// its own reference to the segment).
struct DeferredRelease {
  std::shared_ptr<Segment> segment;
  int slot;
  uint64_t holder;
};
// The releases deferred since the last call, oldest first.
std::vector<DeferredRelease> take_deferred_releases();
// A forked child: the list is its parent's (their slots name the parent).
void forget_deferred_releases();

}  // namespace torchshm
