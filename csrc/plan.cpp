#include "plan.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "allocator.h"
#include "ndarray.h"
#include "numpy_api.h"
#include "segment.h"
#include "stats.h"

namespace torchshm {
namespace {

struct Sender {
  // Strong references, never released: the policy lives as long as the
  // interpreter, and a reducer may run during its shutdown.
  PyObject* policy_reducer = nullptr;
  PyObject* allocate = nullptr;
  PyObject* reduce_name = nullptr;  // "__reduce__", interned
  SenderPolicy policy;
};
Sender sender;

inline PyArrayObject* as_array(py::handle obj) {
  return reinterpret_cast<PyArrayObject*>(obj.ptr());
}

inline int64_t address(py::handle array) {
  return reinterpret_cast<int64_t>(PyArray_DATA(as_array(array)));
}

py::tuple int_tuple(const npy_intp* values, int n) {
  py::tuple out(n);
  for (int i = 0; i < n; ++i) out[i] = py::int_(values[i]);
  return out;
}

// rebuild_ndarray's arguments after the owner: (offset, dtype, shape,
// strides, writeable, subtype). A builtin dtype travels as its .str, which
// round-trips it exactly unless it has fields, a sub-array or metadata, and
// pickles in a fraction of the time of a dtype object. User-registered dtypes
// (num >= NPY_USERDEF) and new-style ones (num -1) have a .str that names
// only their bytes.
py::tuple view_args(py::handle array, int64_t offset,
                    const npy_intp* strides = nullptr) {
  PyArrayObject* a = as_array(array);
  PyArray_Descr* descr = PyArray_DESCR(a);
  py::handle d(reinterpret_cast<PyObject*>(descr));
  py::object dtype = py::reinterpret_borrow<py::object>(d);
  if (descr->type_num >= 0 && descr->type_num < NPY_USERDEF &&
      !PyDataType_HASFIELDS(descr) && !PyDataType_HASSUBARRAY(descr) &&
      d.attr("metadata").is_none())
    dtype = d.attr("str");
  const int nd = PyArray_NDIM(a);
  py::object subtype =
      Py_TYPE(array.ptr()) == &PyArray_Type
          ? py::none()
          : py::reinterpret_borrow<py::object>(
                reinterpret_cast<PyObject*>(Py_TYPE(array.ptr())));
  return py::make_tuple(offset, std::move(dtype),
                        int_tuple(PyArray_DIMS(a), nd),
                        int_tuple(strides ? strides : PyArray_STRIDES(a), nd),
                        py::bool_(PyArray_ISWRITEABLE(a)), std::move(subtype));
}

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

py::object segment_name(const at::Tensor& tensor) {
  View* view = view_of(tensor);
  if (view == nullptr) return py::none();
  return py::str(view->segment->name());
}

}  // namespace

void configure_sender(py::object policy_reducer, py::object allocate,
                      const SenderPolicy& policy) {
  Py_XSETREF(sender.policy_reducer, policy_reducer.release().ptr());
  Py_XSETREF(sender.allocate, allocate.release().ptr());
  if (sender.reduce_name == nullptr)
    sender.reduce_name = PyUnicode_InternFromString("__reduce__");
  sender.policy = policy;
}

namespace {

// Small non-object arrays: numpy's own reduce, counted as inline. Every
// other array (shared, packed, empty, object dtype) goes to Python's policy
// reducer, which never raises (torchshm/_sender.py: reduce_ndarray).
PyObject* fast_reduce(PyObject* /*self*/, PyObject* obj) {
  if (sender.policy_reducer == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "torchshm: the sender is not configured (import torchshm)");
    return nullptr;
  }
  if (PyArray_Check(obj)) {
    auto* a = reinterpret_cast<PyArrayObject*>(obj);
    if (!PyDataType_REFCHK(PyArray_DESCR(a)) && PyArray_SIZE(a) > 0 &&
        PyArray_NBYTES(a) < sender.policy.inline_below) {
      count(kArraysInline);
      return PyObject_CallMethodNoArgs(obj, sender.reduce_name);
    }
  }
  return PyObject_CallOneArg(sender.policy_reducer, obj);
}

PyMethodDef fast_reduce_def = {
    "reduce_ndarray", fast_reduce, METH_O,
    "torchshm's ForkingPickler reducer for ndarrays: below the inline bound "
    "numpy's own reduce, else torchshm._sender.reduce_ndarray."};

}  // namespace

py::object fast_reducer() {
  PyObject* fn = PyCFunction_NewEx(&fast_reduce_def, nullptr, nullptr);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

// Where an array's memory lives in a torchshm segment, if it does: the only
// place the sender decides "this memory is a segment"; everything after it
// works from the returned tensor (offsets are relative to its storage).
// Memory the NumPy allocator placed in a segment (Note [Born shared]) is
// owned by the array itself: the chain ends at `nearest`, with no base.
at::Tensor lookup_segment_owner(py::handle root, py::handle nearest) {
  if (root && THPVariable_Check(root.ptr())) {
    const at::Tensor& tensor = THPVariable_Unpack(root.ptr());
    if (view_of(tensor) != nullptr) return tensor;
  }
  if (!root) return born_tensor(PyArray_DATA(as_array(nearest)));
  return at::Tensor();
}

py::tuple Plan::place(py::handle array, bool copy) {
  TORCH_CHECK(PyArray_Check(array.ptr()), "expected a numpy.ndarray, got ",
              std::string(py::str(py::type::handle_of(array))));
  // The base chain: the object owning the memory, the ndarray nearest to it.
  py::handle nearest = array;
  py::handle root(reinterpret_cast<PyObject*>(PyArray_BASE(as_array(array))));
  while (root && PyArray_Check(root.ptr())) {
    nearest = root;
    root =
        py::handle(reinterpret_cast<PyObject*>(PyArray_BASE(as_array(root))));
  }
  if (!copy) {
    const at::Tensor owner = lookup_segment_owner(root, nearest);
    if (owner.defined()) {
      // A segment whose name is gone (its session ended) cannot be mapped
      // by a receiver: snapshot the array instead.
      View* view = view_of(owner);
      if (!view->segment->unlinked()) {
        // Relative to the storage, not to `owner`, which may start at an
        // offset into it (a slice of a received array's base).
        const int64_t offset =
            address(array) -
            reinterpret_cast<int64_t>(owner.storage().data_ptr().get());
        count(kArraysResent);
        py::object ref_owner =
            root && root.ptr() != Py_None && THPVariable_Check(root.ptr())
                ? py::reinterpret_borrow<py::object>(root)
                : py::cast(owner);
        return py::make_tuple(std::move(ref_owner),
                              py::str(view->segment->name()),
                              view_args(array, offset));
      }
    } else if (root && THPVariable_Check(root.ptr())) {
      const at::Tensor& tensor = THPVariable_Unpack(root.ptr());
      const int64_t offset =
          address(array) -
          reinterpret_cast<int64_t>(tensor.storage().data_ptr().get());
      return py::make_tuple(py::reinterpret_borrow<py::object>(root),
                            py::none(), offset);
    }
  }
  return copy_view(array, root, nearest);
}

py::tuple Plan::copy_view(py::handle array, py::handle root,
                          py::handle nearest) {
  PyArrayObject* a = as_array(array);
  auto [lo, hi] = byte_extent(array);
  const int64_t nbytes = PyArray_NBYTES(a);
  if (hi - lo > sender.policy.sparse_ratio * nbytes)
    return copy_compacted(array);
  py::handle key = root && root.ptr() != Py_None ? root : nearest;
  auto found = roots_.find(key.ptr());
  if (found == roots_.end()) {
    found = roots_
                .emplace(key.ptr(),
                         Root{py::reinterpret_borrow<py::object>(key), {}})
                .first;
  }
  Root& entry = found->second;
  int64_t start = address(array);
  for (const Copy& c : entry.copies) {
    if (c.lo <= start + lo && start + hi <= c.hi) {
      count(kArraysResent);
      return py::make_tuple(c.target.owner, c.target.name,
                            view_args(array, c.at + start - c.lo));
    }
  }
  // Copy the whole buffer when this view covers most of it, so that other
  // views of it in this message share the copy; else only this view's span.
  py::handle source = array;
  const auto [near_lo, near_hi] = byte_extent(nearest);
  const int64_t near_start = address(nearest);
  if (near_start + near_lo <= start + lo &&
      start + hi <= near_start + near_hi &&
      2 * (hi - lo) >= near_hi - near_lo) {
    source = nearest;
    lo = near_lo;
    hi = near_hi;
    start = near_start;
  }
  const int64_t n = hi - lo;
  auto [target, at] = reserve(n);
  const auto* src = reinterpret_cast<const uint8_t*>(start + lo);
  {
    // The caller's reference keeps `array` (and so `source`) alive.
    py::gil_scoped_release no_gil;
    copy_bytes(target.data + at, src, n, sender.policy.copy_threads);
  }
  count(kArraysShared);
  count(kBytesCopied, n);
  entry.copies.push_back(Copy{start + lo, start + hi, at, target});
  const int64_t offset = at + address(array) - (start + lo);
  return py::make_tuple(target.owner, target.name, view_args(array, offset));
}

py::tuple Plan::copy_compacted(py::handle array) {
  PyArrayObject* a = as_array(array);
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
  if (PyArray_CopyInto(as_array(dest), as_array(source)) != 0)
    throw py::error_already_set();
  count(kArraysShared);
  count(kBytesCopied, nbytes);
  return py::make_tuple(target.owner, target.name,
                        view_args(array, at, strides.data()));
}

std::pair<Plan::Target, int64_t> Plan::reserve(int64_t nbytes) {
  const SenderPolicy& p = sender.policy;
  auto allocate = [](int64_t n) {
    TORCH_CHECK(sender.allocate != nullptr, "the sender is not configured");
    py::object owner = py::reinterpret_borrow<py::object>(sender.allocate)(n);
    TORCH_CHECK(THPVariable_Check(owner.ptr()),
                "expected allocate() to return a tensor, got ",
                std::string(py::str(py::type::handle_of(owner))));
    const at::Tensor& tensor = THPVariable_Unpack(owner.ptr());
    Target t{owner, segment_name(tensor),
             static_cast<uint8_t*>(tensor.data_ptr()), tensor.numel()};
    TORCH_CHECK(!t.name.is_none() && t.size >= n,
                "expected allocate() to return a segment tensor of at least ",
                n, " bytes");
    return t;
  };
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

py::object ticket_for(const at::Tensor& tensor, uint64_t channel) {
  View* view = view_of(tensor);
  if (view == nullptr || view->segment->unlinked()) return py::none();
  const uint64_t ticket = view->segment->issue_ticket(channel);
  if (ticket == 0) count(kTicketsUnavailable);
  return py::make_tuple(ticket, view->segment->generation());
}

}  // namespace torchshm
