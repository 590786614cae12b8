// ndarray <-> byte ranges: the extent a view spans, copies into a segment with
// the GIL released, and rebuilding a view over a torch storage.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "base/numpy_api.h"
#include "base/torch_api.h"

namespace torchshm {

// The ndarray behind a handle (a subclass too); anything else is an error.
// Checked once, where a handle comes in: past it, code takes the array.
PyArrayObject* as_ndarray(py::handle obj);

// The bytes a view spans, as [lo, hi) offsets from its data pointer: lo <= 0
// when some stride is negative. A zero-size array spans nothing: (0, 0).
std::pair<int64_t, int64_t> byte_extent(PyArrayObject* array);

// Copies the bytes `array` spans into `dest` (a contiguous int8 tensor) at
// `dest_offset`. Runs without the GIL and splits large copies over `threads`.
void copy_extent(py::handle array, const at::Tensor& dest, int64_t dest_offset,
                 int threads);

// An ndarray over `owner` (a contiguous int8 tensor) whose first element is at
// byte `offset`; the array's base is `owner`, which keeps the memory alive.
// Every element the view can reach must lie inside `owner`.
py::object wrap_ndarray(const at::Tensor& owner, int64_t offset,
                        py::handle dtype, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& strides, bool writeable);

}  // namespace torchshm
