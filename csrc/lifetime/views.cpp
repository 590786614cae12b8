// The views that tensors over segments hold (their storage's context), and
// what a creator's last view leaves: segments kept for messages in flight.
#include "lifetime/views.h"

#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <utility>
#include <vector>

#include "lifetime/identity.h"

namespace torchshm {

namespace {

void delete_view(void* ctx) { delete static_cast<View*>(ctx); }

// How many pooled segments' last local views died (pooled_last_views).
std::atomic<uint64_t> last_views_of_pooled{0};

// The expiry timer's pipe while it sleeps without a deadline, else -1.
std::atomic<int> quiet_fd{-1};

// Segments this process created whose last view died while a message naming
// them was still unread: kept, with their fd, until none is (Note [Segment
// lifetime]: the keeper's death must not take them).
std::mutex in_flight_mutex;
std::vector<std::shared_ptr<Segment>> in_flight;

// Slots whose release waits for copies (Note [Copies before reuse]).
std::mutex deferred_mutex;
std::vector<DeferredRelease> deferred;

// Wakes the expiry timer if it sleeps without a deadline (wake_when_quiet).
void wake_quiet_timer() {
  const int fd = quiet_fd.exchange(-1);
  if (fd >= 0 && ::write(fd, "q", 1) < 0) {
    // A full pipe already wakes the timer.
  }
}

}  // namespace

PrivateLease::PrivateLease(std::shared_ptr<Segment> seg, uint8_t* data_)
    : segment(std::move(seg)), data(data_), lent(WriteWatch::now()) {}

PrivateLease::~PrivateLease() {
  if (!segment->lost()) segment->give_back_private(data, !lent.unchanged());
}

View::View(std::shared_ptr<Segment> seg, int slot_, uint64_t holder_,
           Segment::Mapping kind_, at::Storage keep_,
           std::shared_ptr<PrivateLease> lease_)
    : segment(std::move(seg)),
      kind(kind_),
      keep(std::move(keep_)),
      lease(std::move(lease_)),
      slot(slot_),
      holder(holder_),
      pid(current_pid()) {
  segment->views_.fetch_add(1);
}

View::~View() {
  // After a fork torchshm did not prepare, nothing of the segment is here:
  // no slot of this process's, no mapping to give back (fork_guard.h).
  if (segment->lost()) return;
  if (!defer_release()) disown();
  if (segment->views_.fetch_sub(1) != 1) return;
  if (segment->pooled.load()) {
    last_views_of_pooled.fetch_add(1);
  } else {
    // A creator's last view: its messages in flight keep it (and its fd).
    if (segment->fd() < 0 || segment->unlinked() ||
        !segment->has_ticket_in_flight())
      return;
    std::lock_guard<std::mutex> guard(in_flight_mutex);
    in_flight.push_back(segment);
  }
  wake_quiet_timer();
}

void View::disown() {
  // A forked child that never adopted (fork without torchshm's hooks) must
  // not release the parent's slot.
  if (pid.load() != current_pid()) return;
  const int s = slot.exchange(-1);
  if (s >= 0) segment->release_slot(s, holder.load());
}

bool View::defer_release() {
  if (!segment->defers_releases() || pid.load() != current_pid()) return false;
  const int s = slot.exchange(-1);
  if (s < 0) return true;
  std::lock_guard<std::mutex> guard(deferred_mutex);
  deferred.push_back({segment, s, holder.load()});
  return true;
}

void View::adopt(int slot_, uint64_t holder_) {
  holder.store(holder_);
  pid.store(current_pid());
  slot.store(slot_);
}

View& View::slot_owner() {
  View* owner = keep ? view_of(keep) : nullptr;
  return owner ? *owner : *this;
}

View* view_of(const at::Storage& storage) {
  if (!storage) return nullptr;
  return storage.data_ptr().cast_context<View>(&delete_view);
}

View* view_of(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return nullptr;
  return view_of(tensor.storage());
}

View& checked_view(const at::Tensor& tensor) {
  View* view = view_of(tensor);
  TORCH_CHECK(view != nullptr, "expected a tensor over a torchshm segment");
  return *view;
}

at::Storage slot_owner_storage(const at::Tensor& tensor) {
  const View& view = checked_view(tensor);
  return view.keep ? view.keep : tensor.storage();
}

at::Tensor tensor_of(at::Storage storage) {
  const int64_t n = static_cast<int64_t>(storage.nbytes());
  // What at::empty + set_ make, without two trips through the dispatcher
  // (one is made per message).
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
      caffe2::TypeMeta::Make<int8_t>());
  impl->set_sizes_contiguous({n});
  return at::Tensor(std::move(impl));
}

namespace {

at::Tensor tensor_over(View* view, uint8_t* data, int64_t n) {
  at::DataPtr ptr(data, view, &delete_view, at::Device(at::kCPU));
  return tensor_of(at::Storage(at::Storage::use_byte_size_t(), n,
                               std::move(ptr), /*allocator=*/nullptr,
                               /*resizable=*/false));
}

}  // namespace

at::Tensor view_tensor(std::shared_ptr<Segment> segment, int slot,
                       uint64_t holder) {
  const int64_t n = segment->capacity();
  uint8_t* data = segment->data();
  return tensor_over(new View(std::move(segment), slot, holder), data, n);
}

namespace {

at::DataPtr alias_over(const View& view, const at::Tensor& owner, bool shared) {
  const std::shared_ptr<Segment>& segment = view.segment;
  const bool leased = !shared && view.lease != nullptr;
  uint8_t* data = leased ? view.lease->data : segment->data();
  return at::DataPtr(
      data,
      new View(segment, -1, 0,
               leased ? Segment::Mapping::kPrivate : Segment::Mapping::kShared,
               slot_owner_storage(owner), leased ? view.lease : nullptr),
      &delete_view, at::Device(at::kCPU));
}

}  // namespace

at::DataPtr storage_alias(const at::Tensor& owner) {
  return alias_over(checked_view(owner), owner, /*shared=*/false);
}

at::DataPtr shared_alias(const at::Tensor& owner) {
  return alias_over(checked_view(owner), owner, /*shared=*/true);
}

at::Tensor mapped_tensor(const at::Tensor& owner, Segment::Mapping kind,
                         int threads) {
  View* view = &checked_view(owner);
  if (view->kind == kind) return owner;
  const at::Storage keep = slot_owner_storage(owner);
  if (kind == Segment::Mapping::kShared) return tensor_of(keep);
  const auto& segment = view->segment;
  if (kind == Segment::Mapping::kReadOnly) {
    uint8_t* data = segment->readonly_mapping(threads);
    if (data == nullptr) return at::Tensor();
    return tensor_over(new View(segment, -1, 0, kind, keep), data,
                       segment->capacity());
  }
  uint8_t* mine = segment->take_private(threads);
  if (mine == nullptr) return at::Tensor();
  auto lease = std::make_shared<PrivateLease>(segment, mine);
  return tensor_over(new View(segment, -1, 0, kind, keep, std::move(lease)),
                     mine, segment->capacity());
}

py::object mapped_object(py::handle owner, Segment::Mapping kind, int threads) {
  const at::Tensor& tensor = unpack_tensor(owner);
  const at::Tensor mapped = mapped_tensor(tensor, kind, threads);
  if (!mapped.defined()) return py::none();
  if (mapped.unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl())
    return py::reinterpret_borrow<py::object>(owner);
  py::object alias = py::cast(mapped);
  static const py::str kOwner("_torchshm_owner");
  alias.attr(kOwner) = owner;
  return alias;
}

py::object message_owner(py::handle owner, int threads) {
  View* view = &checked_view(unpack_tensor(owner));
  if (view->segment->snapshot()) {
    py::object mine = mapped_object(owner, Segment::Mapping::kPrivate, threads);
    if (!mine.is_none()) return mine;
  }
  return py::reinterpret_borrow<py::object>(owner);
}

void wake_when_quiet(int fd) { quiet_fd.store(fd); }

int64_t prune_in_flight() {
  std::vector<std::shared_ptr<Segment>> done;  // destroyed outside the lock
  std::lock_guard<std::mutex> guard(in_flight_mutex);
  auto still = std::partition(
      in_flight.begin(), in_flight.end(), [](const auto& segment) {
        return !segment->unlinked() && segment->has_ticket_in_flight();
      });
  done.assign(std::make_move_iterator(still),
              std::make_move_iterator(in_flight.end()));
  in_flight.erase(still, in_flight.end());
  return static_cast<int64_t>(in_flight.size());
}

uint64_t pooled_last_views() { return last_views_of_pooled.load(); }

int64_t in_flight_count() {
  std::lock_guard<std::mutex> guard(in_flight_mutex);
  return static_cast<int64_t>(in_flight.size());
}

bool written_privately(const View* view, int64_t lo, int64_t hi) {
  if (hi <= lo) return false;
  if (view->lease != nullptr) {
    const PrivateLease& lease = *view->lease;
    return !lease.lent.unchanged() && written_pages(lease.data + lo, hi - lo);
  }
  if (view->kind == Segment::Mapping::kReadOnly)
    return view->segment->readonly_written(lo, hi);
  return false;
}

uintptr_t shared_address(const at::Tensor& owner, uintptr_t address,
                         int64_t nbytes) {
  const View* view = view_of(owner);
  if (view == nullptr || view->lease == nullptr || nbytes < 0) return 0;
  const Segment& segment = *view->segment;
  const auto start = reinterpret_cast<uintptr_t>(view->lease->data);
  if (address < start || segment.lost() || segment.data_frozen()) return 0;
  const auto lo = static_cast<int64_t>(address - start);
  if (lo > segment.capacity() - nbytes) return 0;
  if (written_privately(view, lo, lo + nbytes)) return 0;
  return reinterpret_cast<uintptr_t>(segment.data()) + lo;
}

std::vector<DeferredRelease> take_deferred_releases() {
  std::lock_guard<std::mutex> guard(deferred_mutex);
  std::vector<DeferredRelease> taken;
  taken.swap(deferred);
  return taken;
}

void forget_deferred_releases() {
  // Another thread of the parent may have held the mutex at fork.
  new (&deferred_mutex) std::mutex();
  // The parent's segments: the child's copies of them must not release
  // anything (their slots name the parent), so the entries are dropped
  // without their destructors' work beyond the reference counts.
  deferred.clear();
}

}  // namespace torchshm
