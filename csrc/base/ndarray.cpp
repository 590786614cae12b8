#include "base/ndarray.h"

#include <algorithm>
#include <cstring>

#include "base/gil.h"
#include "base/numpy_api.h"
#include "base/parallel.h"

namespace torchshm {

PyArrayObject* as_ndarray(py::handle obj) {
  TORCH_CHECK(PyArray_Check(obj.ptr()), "expected a numpy.ndarray, got ",
              std::string(py::str(py::type::handle_of(obj))));
  return reinterpret_cast<PyArrayObject*>(obj.ptr());
}

namespace {

// The bytes [lo, hi) a view reaches from its first element, computed with
// overflow checks: a crafted shape or stride must fail, never wrap around
// into a range that passes the bounds check.
std::pair<int64_t, int64_t> extent_of(int64_t itemsize,
                                      const std::vector<int64_t>& shape,
                                      const std::vector<int64_t>& strides) {
  int64_t lo = 0;
  int64_t hi = itemsize;
  TORCH_CHECK(itemsize >= 0, "expected a non-negative itemsize, got ",
              itemsize);
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK(shape[d] >= 0, "expected non-negative dimensions, got ",
                shape[d]);
    if (shape[d] == 0) return {0, 0};
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t reach = 0;
    int64_t& end = strides[d] < 0 ? lo : hi;
    TORCH_CHECK(!__builtin_mul_overflow(shape[d] - 1, strides[d], &reach) &&
                    !__builtin_add_overflow(end, reach, &end),
                "view of shape ", c10::IntArrayRef(shape), " and strides ",
                c10::IntArrayRef(strides), " spans more than 2**63 bytes");
  }
  return {lo, hi};
}

}  // namespace

std::pair<int64_t, int64_t> byte_extent(PyArrayObject* arr) {
  const int nd = PyArray_NDIM(arr);
  std::vector<int64_t> shape(PyArray_DIMS(arr), PyArray_DIMS(arr) + nd);
  std::vector<int64_t> strides(PyArray_STRIDES(arr), PyArray_STRIDES(arr) + nd);
  return extent_of(PyArray_ITEMSIZE(arr), shape, strides);
}

void copy_extent(py::handle array, const at::Tensor& dest, int64_t dest_offset,
                 int threads) {
  PyArrayObject* a = as_ndarray(array);
  const auto [lo, hi] = byte_extent(a);
  const int64_t n = hi - lo;
  TORCH_CHECK(dest.is_contiguous() && dest.scalar_type() == at::kChar,
              "expected a contiguous int8 tensor as destination");
  TORCH_CHECK(dest_offset >= 0 && dest_offset + n <= dest.numel(), "copy of ",
              n, " bytes at offset ", dest_offset,
              " overflows a destination of ", dest.numel(), " bytes");
  const auto* src = static_cast<const uint8_t*>(PyArray_DATA(a)) + lo;
  auto* dst = static_cast<uint8_t*>(dest.data_ptr()) + dest_offset;
  // The caller's reference keeps `array` alive while the GIL is released.
  GilReleased no_gil;  // Note [The GIL at exit] in gil.h
  copy_bytes(dst, src, n, threads);
}

py::object wrap_ndarray(const at::Tensor& owner, int64_t offset,
                        py::handle dtype, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& strides, bool writeable) {
  TORCH_CHECK(owner.is_contiguous() && owner.scalar_type() == at::kChar,
              "expected a contiguous int8 tensor as owner");
  TORCH_CHECK(shape.size() == strides.size() && shape.size() <= NPY_MAXDIMS,
              "expected shape and strides of one rank, got ", shape.size(),
              " and ", strides.size());
  PyArray_Descr* raw = nullptr;
  if (!PyArray_DescrConverter(dtype.ptr(), &raw)) throw py::error_already_set();
  // Owned here until PyArray_NewFromDescr steals it.
  py::object descr =
      py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(raw));
  // Segment bytes are never Python objects: the sender pickles such arrays
  // by value, so only a crafted message names one, and its items would be
  // read as pointers.
  TORCH_CHECK_TYPE(!PyDataType_REFCHK(raw), "dtype ",
                   std::string(py::repr(descr)),
                   " holds references to Python objects and cannot be "
                   "rebuilt over shared memory: expected a dtype of plain "
                   "bytes (torchshm sends object, StringDType and "
                   "structured-with-object arrays by value)");
  const auto [lo, hi] = extent_of(descr_itemsize(raw), shape, strides);
  // Checked for an empty view too: it reads nothing, but its data pointer is
  // where as_strided or a resize would read. As lo <= 0 <= hi, this also
  // keeps the offset itself within [0, size].
  int64_t first = 0;
  int64_t last = 0;
  TORCH_CHECK(!__builtin_add_overflow(offset, lo, &first) &&
                  !__builtin_add_overflow(offset, hi, &last) && first >= 0 &&
                  last <= owner.numel(),
              "view of bytes [", lo, ", ", hi, ") at offset ", offset,
              " reaches outside its storage of ", owner.numel(),
              " bytes: expected the offset and those bytes within [0, ",
              owner.numel(), "]");
  std::vector<npy_intp> dims(shape.begin(), shape.end());
  std::vector<npy_intp> steps(strides.begin(), strides.end());
  auto* data = static_cast<char*>(owner.data_ptr()) + offset;
  PyObject* arr = PyArray_NewFromDescr(
      &PyArray_Type, reinterpret_cast<PyArray_Descr*>(descr.release().ptr()),
      static_cast<int>(dims.size()), dims.data(), steps.data(), data,
      writeable ? NPY_ARRAY_WRITEABLE : 0, nullptr);
  if (arr == nullptr) throw py::error_already_set();
  py::object result = py::reinterpret_steal<py::object>(arr);
  py::object base = py::cast(owner);
  // SetBaseObject steals a reference to the base.
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(arr),
                            base.release().ptr()) != 0)
    throw py::error_already_set();
  PyArray_UpdateFlags(reinterpret_cast<PyArrayObject*>(arr),
                      NPY_ARRAY_UPDATE_ALL);
  return result;
}

}  // namespace torchshm
