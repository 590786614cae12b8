// Bindings only: the mechanism lives in segment.cpp and ndarray.cpp.
#define TORCHSHM_IMPORT_ARRAY
#include <torch/extension.h>

#include "ndarray.h"
#include "numpy_api.h"
#include "segment.h"

namespace {

using torchshm::Segment;
using torchshm::View;

View& checked_view(const at::Tensor& tensor) {
  View* view = torchshm::view_of(tensor);
  TORCH_CHECK(view != nullptr, "expected a tensor over a torchshm segment");
  return *view;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  if (_import_array() < 0) throw py::error_already_set();
  m.doc() = "torchshm's native mechanism: segments, extents, copies, views.";
  m.attr("built_with_torch") = TORCHSHM_TORCH_VERSION;
  m.attr("built_with_numpy") = TORCHSHM_NUMPY_VERSION;

  py::class_<Segment, std::shared_ptr<Segment>>(m, "Segment")
      .def_static("create", &Segment::create, py::arg("name"),
                  py::arg("capacity"), py::call_guard<py::gil_scoped_release>())
      .def_static("attach", &Segment::attach, py::arg("name"),
                  py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("name", &Segment::name)
      .def_property_readonly("capacity", &Segment::capacity)
      .def_property_readonly("refcount", &Segment::refcount)
      .def_property_readonly("local_views", &Segment::local_views)
      .def("try_acquire", &Segment::try_acquire)
      .def("release", &Segment::release)
      .def(
          "tensor",
          [](std::shared_ptr<Segment> self, bool owns_reference) {
            return torchshm::view_tensor(std::move(self), owns_reference);
          },
          py::arg("owns_reference"));

  m.def(
      "segment_of",
      [](const at::Tensor& t) -> std::shared_ptr<Segment> {
        View* view = torchshm::view_of(t);
        return view ? view->segment : nullptr;
      },
      py::arg("tensor"));
  m.def(
      "disown", [](const at::Tensor& t) { checked_view(t).disown(); },
      py::arg("tensor"));
  m.def(
      "claim_reference",
      [](const at::Tensor& t) { checked_view(t).ref_pid.store(::getpid()); },
      py::arg("tensor"),
      "Marks a view as owning a reference taken for this process (a forked "
      "child's inherited view).");
  m.def("byte_extent", &torchshm::byte_extent, py::arg("array"));
  m.def("data_address", &torchshm::data_address, py::arg("array"));
  m.def("copy_extent", &torchshm::copy_extent, py::arg("array"),
        py::arg("dest"), py::arg("dest_offset"), py::arg("threads") = 1);
  m.def("wrap_ndarray", &torchshm::wrap_ndarray, py::arg("owner"),
        py::arg("offset"), py::arg("dtype"), py::arg("shape"),
        py::arg("strides"), py::arg("writeable"));
}
