#include "lifetime/slabs.h"

#include <pthread.h>

#include <limits>
#include <memory>
#include <utility>

#include "lifetime/pool.h"
#include "lifetime/segment.h"
#include "lifetime/views.h"

namespace torchshm {

struct Slab {
  PyObject* owner;  // strong reference: the int8 tensor over the segment
  std::shared_ptr<Segment> segment;
  uint8_t* base;
  size_t capacity;
  size_t used = 0;         // bytes carved since the slab was opened or rewound
  int64_t live = 0;        // blocks alive
  bool dirty;              // bytes from before (a reused segment, a rewind)
  double empty_since = 0;  // when `live` last dropped to 0
};

namespace {

size_t aligned(size_t size) {
  const size_t n = size == 0 ? 1 : size;
  return (n + Slabs::kAlignment - 1) & ~(Slabs::kAlignment - 1);
}

void child_after_fork() { slabs().after_fork_in_child(); }

}  // namespace

Slabs& slabs() {
  // Never destroyed: blocks may be freed while the interpreter shuts down.
  static Slabs* instance = [] {
    ::pthread_atfork(nullptr, nullptr, &child_after_fork);
    return new Slabs();
  }();
  return *instance;
}

Slabs::Block Slabs::carve(size_t size) {
  if (forked_empty_ != nullptr) drop_forked_empty();
  const size_t n = aligned(size);
  Slab* slab = current_;
  if (slab == nullptr || slab->used + n > slab->capacity) return {};
  void* data = slab->base + slab->used;
  slab->used += n;
  ++slab->live;
  live_bytes_ += static_cast<int64_t>(n);
  return {data, slab, n, slab->dirty};
}

bool Slabs::may_open() const {
  if (declined_until_ != 0 && monotonic_seconds() < declined_until_)
    return false;
  return retired_bytes_ <= kRetiredFloor ||
         retired_bytes_ <= kRetiredRatio * live_bytes_;
}

void Slabs::declined() {
  declined_until_ = monotonic_seconds() + kRetrySeconds;
}

void Slabs::open(py::object owner, bool reused) {
  const at::Tensor& tensor = unpack_tensor(owner);
  View* view = view_of(tensor);
  TORCH_CHECK(view != nullptr, "torchshm: a slab must be a segment's view");
  auto* slab = new Slab{nullptr,
                        view->segment,
                        static_cast<uint8_t*>(tensor.data_ptr()),
                        static_cast<size_t>(tensor.numel()),
                        0,
                        0,
                        reused};
  slab->owner = owner.release().ptr();
  if (current_ != nullptr) retire(current_);
  current_ = slab;
}

void Slabs::release(Slab* slab, size_t capacity) {
  if (forked_empty_ != nullptr) drop_forked_empty();
  live_bytes_ -= static_cast<int64_t>(capacity);
  if (--slab->live > 0) return;
  if (slab != current_) {
    retired_bytes_ -= static_cast<int64_t>(slab->capacity);
    drop(slab);
  } else {
    // Rewound if nothing else can read it; else carving goes on past `used`,
    // bytes no block ever had. No wake-up here: a loop of temporaries empties
    // it every iteration. The expiry timer looks at it periodically while
    // there is one.
    rewind(slab);
    slab->empty_since = monotonic_seconds();
  }
}

double Slabs::empty_since() const {
  if (current_ == nullptr || current_->live > 0)
    return std::numeric_limits<double>::infinity();
  return current_->empty_since;
}

bool Slabs::has_current() const { return current_ != nullptr; }

int64_t Slabs::let_go_if_empty(double older_than) {
  if (forked_empty_ != nullptr) drop_forked_empty();
  if (monotonic_seconds() - empty_since() < older_than) return 0;
  const auto bytes = static_cast<int64_t>(current_->capacity);
  drop(std::exchange(current_, nullptr));
  return bytes;
}

PyObject* Slabs::owner(const Slab* slab) { return slab->owner; }

void Slabs::after_fork_in_child() {
  // The parent goes on carving the same slab: the child's blocks in it live
  // on, but the slab is retired here. Inside fork no Python code may run
  // (dropping the tensor could): an empty slab is dropped by the next call.
  if (current_ == nullptr) return;
  retired_bytes_ += static_cast<int64_t>(current_->capacity);
  if (current_->live == 0) forked_empty_ = current_;
  current_ = nullptr;
}

void Slabs::drop_forked_empty() {
  retired_bytes_ -= static_cast<int64_t>(forked_empty_->capacity);
  drop(std::exchange(forked_empty_, nullptr));
}

void Slabs::retire(Slab* slab) {
  if (slab->live == 0) {
    drop(slab);
  } else {
    retired_bytes_ += static_cast<int64_t>(slab->capacity);
  }
}

void Slabs::drop(Slab* slab) {
  declined_until_ = 0;  // a segment let go: the source may have room again
  Py_DECREF(slab->owner);
  delete slab;
}

// Whether nothing but this slab can read its bytes, so carving starts over
// (Note [Small blocks]): no Python reference to its tensor but the slab's
// (an array this process received over it holds one), no other tensor over
// its storage, no other local view, and by the pool's rule no other holder,
// no message in flight and no pin. Cheap checks first: no system call
// unless only slot 0 is taken.
bool Slabs::rewind(Slab* slab) {
  // Read before the tensor is unpacked: a second C++ reference to a tensor
  // holds its Python object too (seen on torch 2.14).
  if (Py_REFCNT(slab->owner) != 1) return false;
  // Its tensor's two references: the slab's Python tensor's, and this one.
  const at::Tensor tensor = unpack_tensor(slab->owner);
  Segment& segment = *slab->segment;
  if (tensor.use_count() != 2 || tensor.storage().use_count() != 1 ||
      segment.holders() != 1 || segment.unlinked() ||
      !segment.reserve_for_reuse(0, 1))
    return false;
  slab->used = 0;
  slab->dirty = true;
  return true;
}

}  // namespace torchshm
