// Bindings only: the mechanism lives in segment.cpp and ndarray.cpp.
#define TORCHSHM_IMPORT_ARRAY
#include <torch/extension.h>

#include "ndarray.h"
#include "numpy_api.h"
#include "segment.h"

namespace {

torchshm::Segment& checked_segment(const at::Tensor& tensor) {
  torchshm::Segment* segment = torchshm::segment_of(tensor);
  TORCH_CHECK(segment != nullptr,
              "expected a tensor over a torchshm segment");
  return *segment;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  if (_import_array() < 0) throw py::error_already_set();
  m.doc() = "torchshm's native mechanism: segments, extents, copies, views.";
  m.attr("built_with_torch") = TORCHSHM_TORCH_VERSION;
  m.attr("built_with_numpy") = TORCHSHM_NUMPY_VERSION;

  m.def(
      "create_segment",
      [](const std::string& name, int64_t nbytes) {
        return torchshm::segment_tensor(
            torchshm::Segment::create(name, nbytes));
      },
      py::arg("name"), py::arg("nbytes"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "attach_segment",
      [](const std::string& name) {
        return torchshm::segment_tensor(torchshm::Segment::attach(name));
      },
      py::arg("name"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "segment_name",
      [](const at::Tensor& t) -> py::object {
        torchshm::Segment* segment = torchshm::segment_of(t);
        if (segment == nullptr) return py::none();
        return py::str(segment->name());
      },
      py::arg("tensor"));
  m.def(
      "try_acquire",
      [](const at::Tensor& t) { return checked_segment(t).try_acquire(); },
      py::arg("tensor"));
  m.def(
      "release", [](const at::Tensor& t) { checked_segment(t).release(); },
      py::arg("tensor"));
  m.def(
      "disown", [](const at::Tensor& t) { checked_segment(t).disown(); },
      py::arg("tensor"));
  m.def(
      "refcount",
      [](const at::Tensor& t) { return checked_segment(t).refcount(); },
      py::arg("tensor"));
  m.def("byte_extent", &torchshm::byte_extent, py::arg("array"));
  m.def("data_address", &torchshm::data_address, py::arg("array"));
  m.def("copy_extent", &torchshm::copy_extent, py::arg("array"),
        py::arg("dest"), py::arg("dest_offset"), py::arg("threads") = 1);
  m.def("wrap_ndarray", &torchshm::wrap_ndarray, py::arg("owner"),
        py::arg("offset"), py::arg("dtype"), py::arg("shape"),
        py::arg("strides"), py::arg("writeable"));
}
