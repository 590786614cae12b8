#include "send/plan.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <string>

#include "base/config.h"
#include "base/gil.h"
#include "base/ndarray.h"
#include "base/numpy_api.h"
#include "base/stats.h"
#include "lifetime/live.h"
#include "lifetime/pool.h"
#include "lifetime/segment.h"
#include "lifetime/views.h"
#include "send/allocator.h"
#include "send/one_copy.h"
#include "send/snapshots.h"

namespace torchshm {
namespace {

// A copy smaller than this keeps the GIL: handing it over and taking it back
// costs more than the memcpy (and may wake another thread for nothing).
// Larger ones let other threads run, the copy threads included.
constexpr int64_t kReleaseGilFrom = 64 << 10;

// Dense strides that keep the array's axis order (C, F or other).
std::vector<npy_intp> compact_strides(PyArrayObject* a) {
  const int nd = PyArray_NDIM(a);
  const npy_intp* strides = PyArray_STRIDES(a);
  const npy_intp* dims = PyArray_DIMS(a);
  std::vector<int> order(nd);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return std::abs(strides[x]) < std::abs(strides[y]);
  });
  std::vector<npy_intp> out(nd);
  npy_intp step = PyArray_ITEMSIZE(a);
  for (int axis : order) {
    out[axis] = step;
    step *= dims[axis];
  }
  return out;
}

thread_local bool sharing = false;

py::object segment_name(const at::Tensor& tensor) {
  View* view = view_of(tensor);
  if (view == nullptr) return py::none();
  return py::str(view->segment->name());
}

// An array's data pointer as an integer (offsets are differences of these).
int64_t address_of(PyArrayObject* array) {
  return reinterpret_cast<int64_t>(PyArray_DATA(array));
}

// A view over an idle pooled segment, taken without entering Python, or
// None: the pool is not armed (Note [Segment pool]) or has none idle.
py::object take_pooled(int64_t nbytes) {
  SegmentPool* pool = config().hooks.pool.get();
  if (!(monotonic_seconds() < pool->fast_until)) return py::none();
  at::Tensor tensor = pool->take(nbytes, /*thorough=*/false);
  if (!tensor.defined()) return py::none();
  py::object owner = py::cast(tensor);
  // As _lifetime/segments.py (allocate_block) records it (Note [Live views]).
  live_views().remember(view_of(tensor)->segment->name(), owner, py::none());
  count(kSegmentsReused);
  return owner;
}

}  // namespace

bool set_sharing(bool on) { return std::exchange(sharing, on); }

// Where an array's memory lives in a torchshm segment, if it does: the only
// place the sender decides "this memory is a segment"; everything after it
// works from the returned tensor (offsets are relative to its storage).
// Memory the NumPy allocator placed in a segment (Note [Born shared]) is
// owned by the array itself: the chain ends at `nearest`, with no base.
at::Tensor lookup_segment_owner(py::handle root, const at::Tensor& root_tensor,
                                PyArrayObject* nearest) {
  if (root_tensor.defined())
    return view_of(root_tensor) != nullptr ? root_tensor : at::Tensor();
  if (!root) return born_tensor(PyArray_DATA(nearest));
  return at::Tensor();
}

std::pair<py::handle, PyArrayObject*> base_chain(PyArrayObject* array) {
  PyArrayObject* nearest = array;
  py::handle root(reinterpret_cast<PyObject*>(PyArray_BASE(array)));
  while (root && PyArray_Check(root.ptr())) {
    nearest = reinterpret_cast<PyArrayObject*>(root.ptr());
    root = py::handle(reinterpret_cast<PyObject*>(PyArray_BASE(nearest)));
  }
  return {root, nearest};
}

py::handle buffer_key(py::handle root, PyArrayObject* nearest) {
  return root && root.ptr() != Py_None
             ? root
             : py::handle(reinterpret_cast<PyObject*>(nearest));
}

void resend_as(py::handle array, py::object key) {
  auto [root, nearest] = base_chain(as_ndarray(array));
  snapshots().known_as(buffer_key(root, nearest), std::move(key));
}

py::object memory_owner(py::handle array) {
  auto [root, nearest] = base_chain(as_ndarray(array));
  const at::Tensor root_tensor = tensor_or_undefined(root);
  if (root_tensor.defined()) return py::reinterpret_borrow<py::object>(root);
  const at::Tensor owner = lookup_segment_owner(root, root_tensor, nearest);
  return owner.defined() ? py::cast(owner) : py::none();
}

Placement Plan::place(PyArrayObject* array) {
  auto [root, nearest] = base_chain(array);
  // The bytes the array spans, found once: a reference records them
  // (names_one_memory), a copy copies them.
  std::optional<std::pair<int64_t, int64_t>> spans;
  auto extent = [&] {
    if (!spans) spans = byte_extent(array);
    return *spans;
  };
  const at::Tensor root_tensor = tensor_or_undefined(root);
  const at::Tensor owner = lookup_segment_owner(root, root_tensor, nearest);
  if (owner.defined()) {
    // A segment whose name is gone (its session ended) cannot be mapped
    // by a receiver: snapshot the array instead.
    View* view = view_of(owner);
    // Relative to the storage, not to `owner`, which may start at an
    // offset into it (a slice of a received array's base).
    const int64_t offset =
        address_of(array) -
        reinterpret_cast<int64_t>(owner.storage().data_ptr().get());
    // Pages of a private (or read-only) mapping that this process wrote
    // are its own, not the segment's: a reference would send the segment's
    // bytes instead.
    // Note [A plain send is as it was] (plan.h): a born array is frozen at
    // its first plain send while nobody else may write it, else copied; a
    // born array share() sends may be written by its receivers from then on.
    Segment& segment = *view->segment;
    const bool born = !root && !root_tensor.defined();
    if (born && sharing) segment.others_may_write();
    if (born && !sharing &&
        (!born_whole_segment(PyArray_DATA(nearest)) ||
         segment.may_be_written_by_others() || !segment.freeze_data()))
      return copy_view(array, extent(), root, nearest);
    auto written = [&] {
      if (view->kind == Segment::Mapping::kShared &&
          !view->segment->data_frozen())
        return false;
      const auto [lo, hi] = extent();
      if (view->kind == Segment::Mapping::kShared)
        return view->segment->frozen_written(offset + lo, offset + hi);
      return written_privately(view, offset + lo, offset + hi);
    };
    if (!view->segment->unlinked() && !(sharing && view->segment->snapshot()) &&
        !written() && names_one_memory(*view, owner, offset, extent)) {
      count(kArraysResent);
      py::object ref_owner = root_tensor.defined()
                                 ? py::reinterpret_borrow<py::object>(root)
                                 : py::cast(owner);
      return Placement{Placement::kSegment,
                       std::move(ref_owner),
                       py::str(view->segment->name()),
                       offset,
                       {},
                       root,
                       nearest};
    }
  } else if (root_tensor.defined()) {
    const int64_t offset =
        address_of(array) -
        reinterpret_cast<int64_t>(root_tensor.storage().data_ptr().get());
    return Placement{Placement::kTorchOwned,
                     py::reinterpret_borrow<py::object>(root),
                     py::none(),
                     offset,
                     {},
                     root,
                     nearest};
  }
  return copy_view(array, extent(), root, nearest);
}

bool Plan::names_one_memory(
    const View& view, const at::Tensor& owner, int64_t offset,
    const std::function<std::pair<int64_t, int64_t>()>& extent) {
  // Every shared mapping of a segment not frozen here is the one memory;
  // a private (or frozen) mapping is a memory of its own.
  const void* memory =
      view.kind == Segment::Mapping::kShared && !view.segment->data_frozen()
          ? nullptr
          : owner.storage().data_ptr().get();
  NamedBytes& named = named_[view.segment.get()];
  const auto [lo, hi] = extent();
  if (!named.ranges.empty() && memory != named.ranges.front().memory)
    named.one_memory = false;
  // Only a segment named through two memories needs the search.
  if (!named.one_memory)
    for (const Named& n : named.ranges)
      if (n.memory != memory && n.lo < offset + hi && offset + lo < n.hi)
        return false;
  named.ranges.push_back(Named{memory, offset + lo, offset + hi});
  return true;
}

Placement Plan::copy(PyArrayObject* array, const Placement& torch_owned) {
  TORCH_CHECK(torch_owned.kind == Placement::kTorchOwned,
              "expected a placement of torch-owned memory to copy");
  return copy_view(array, byte_extent(array), torch_owned.root,
                   torch_owned.nearest);
}

Placement Plan::copy_view(PyArrayObject* array,
                          std::pair<int64_t, int64_t> extent, py::handle root,
                          PyArrayObject* nearest) {
  auto [lo, hi] = extent;
  const int64_t nbytes = PyArray_NBYTES(array);
  const SenderPolicy& policy = config().policy;
  if (hi - lo > policy.sparse_ratio * nbytes) return copy_compacted(array);
  const py::handle key = buffer_key(root, nearest);
  auto found = roots_.find(key.ptr());
  if (found == roots_.end()) {
    found = roots_
                .emplace(key.ptr(),
                         Root{py::reinterpret_borrow<py::object>(key), {}})
                .first;
  }
  Root& entry = found->second;
  int64_t start = address_of(array);
  for (const Copy& c : entry.copies) {
    if (c.lo <= start + lo && start + hi <= c.hi) {
      count(kArraysResent);
      return Placement{Placement::kCopied,
                       c.target.owner,
                       c.target.name,
                       c.at + start - c.lo,
                       {},
                       root,
                       nearest};
    }
  }
  // Copy the whole buffer when this view covers most of it, so that other
  // views of it in this message share the copy; else only this view's span.
  const auto [near_lo, near_hi] =
      nearest == array ? extent : byte_extent(nearest);
  const int64_t near_start = address_of(nearest);
  if (near_start + near_lo <= start + lo &&
      start + hi <= near_start + near_hi &&
      2 * (hi - lo) >= near_hi - near_lo) {
    lo = near_lo;
    hi = near_hi;
    start = near_start;
  }
  const int64_t n = hi - lo;
  const bool remembered = !sharing;
  const py::handle known_as = snapshots().key_of(key);
  if (remembered) {
    auto [owner, at] = snapshots().reuse(known_as, start + lo, start + hi,
                                         policy.copy_threads);
    if (!owner.is_none()) {
      const Target target = target_of(owner);
      count(kSnapshotsResent);
      entry.copies.push_back(Copy{start + lo, start + hi, at, target});
      const int64_t offset = at + address_of(array) - (start + lo);
      return Placement{Placement::kCopied,
                       target.owner,
                       target.name,
                       offset,
                       {},
                       root,
                       nearest};
    }
  }
  // Note [One copy of a sent array] in one_copy.h: a segment of its own,
  // its pages lined up with the array's.
  const int64_t page_at =
      sharing ? -1 : one_copy_offset(root, nearest, start + lo, n);
  auto [target, at] =
      page_at < 0 ? reserve(n) : std::pair{allocate(n + page_at), page_at};
  const auto* src = reinterpret_cast<const uint8_t*>(start + lo);
  {
    // The caller's reference keeps `array` (and so its base chain) alive.
    std::optional<GilReleased> no_gil;  // Note [The GIL at exit] in gil.h
    if (n >= kReleaseGilFrom) no_gil.emplace();
    target.segment->fill(at, src, n, policy.copy_threads);
  }
  count(kArraysShared);
  count(kBytesCopied, n);
  if (page_at >= 0)
    adopt_pages(nearest, target.owner, target.segment, at, start + lo, n);
  if (remembered)
    snapshots().remember(known_as, start + lo, start + hi, target.segment, at);
  entry.copies.push_back(Copy{start + lo, start + hi, at, target});
  const int64_t offset = at + address_of(array) - (start + lo);
  return Placement{
      Placement::kCopied, target.owner, target.name, offset, {}, root, nearest};
}

Placement Plan::copy_compacted(PyArrayObject* a) {
  std::vector<npy_intp> strides = compact_strides(a);
  const int64_t nbytes = PyArray_NBYTES(a);
  auto [target, at] = reserve(nbytes);
  // Raw elements through a void view: padding bytes too, no per-field copy.
  const std::string raw = "V" + std::to_string(PyArray_ITEMSIZE(a));
  PyArray_Descr* src_descr = nullptr;
  PyArray_Descr* dst_descr = nullptr;
  py::str raw_name(raw);
  if (!PyArray_DescrConverter(raw_name.ptr(), &src_descr))
    throw py::error_already_set();
  if (!PyArray_DescrConverter(raw_name.ptr(), &dst_descr)) {
    Py_DECREF(src_descr);
    throw py::error_already_set();
  }
  // Both calls steal their descr.
  py::object source = py::reinterpret_steal<py::object>(
      PyArray_View(a, src_descr, &PyArray_Type));
  if (!source) {
    Py_DECREF(dst_descr);
    throw py::error_already_set();
  }
  py::object dest = py::reinterpret_steal<py::object>(PyArray_NewFromDescr(
      &PyArray_Type, dst_descr, PyArray_NDIM(a), PyArray_DIMS(a),
      strides.data(), target.data + at, NPY_ARRAY_WRITEABLE, nullptr));
  if (!dest) throw py::error_already_set();
  if (PyArray_CopyInto(reinterpret_cast<PyArrayObject*>(dest.ptr()),
                       reinterpret_cast<PyArrayObject*>(source.ptr())) != 0)
    throw py::error_already_set();
  count(kArraysShared);
  count(kBytesCopied, nbytes);
  return Placement{Placement::kCopied, target.owner, target.name, at,
                   std::move(strides), py::handle(), nullptr};
}

Plan::Target Plan::target_of(const py::object& owner) {
  const at::Tensor tensor = tensor_or_undefined(owner);
  TORCH_CHECK(tensor.defined(), "expected allocate() to return a tensor, got ",
              std::string(py::str(py::type::handle_of(owner))));
  View* view = view_of(tensor);
  py::object name = segment_name(tensor);
  return Target{owner, view ? view->segment : nullptr, std::move(name),
                static_cast<uint8_t*>(tensor.data_ptr()), tensor.numel()};
}

Plan::Target Plan::allocate(int64_t n) {
  py::object owner = take_pooled(n);
  if (owner.is_none()) {
    py::int_ wanted(n);
    owner = py::reinterpret_steal<py::object>(
        call_hook(config().hooks.allocate, wanted.ptr()));
    if (!owner) throw py::error_already_set();
  }
  Target t = target_of(owner);
  TORCH_CHECK(t.segment != nullptr && t.size >= n,
              "expected allocate() to return a segment tensor of at least ", n,
              " bytes");
  // Before any message names it (Note [Snapshots are mapped privately]).
  if (!sharing) t.segment->mark_snapshot();
  return t;
}

std::pair<Plan::Target, int64_t> Plan::reserve(int64_t nbytes) {
  const SenderPolicy& p = config().policy;
  if (nbytes >= p.pack_limit) return {allocate(nbytes), 0};
  if (!chunk_.owner || chunk_used_ + nbytes > chunk_.size) {
    const int64_t size =
        !chunk_.owner ? p.chunk_start : std::min(4 * chunk_.size, p.chunk_max);
    chunk_ = allocate(std::max(size, nbytes));
    chunk_used_ = 0;
  }
  const int64_t at = chunk_used_;
  chunk_used_ = (at + nbytes + p.alignment - 1) / p.alignment * p.alignment;
  return {chunk_, at};
}

}  // namespace torchshm
