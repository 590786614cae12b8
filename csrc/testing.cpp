// _C.testing: mechanism that no torchshm module calls, for the tests and
// benchmarks to look at from outside.
#include "base/config.h"
#include "base/ndarray.h"
#include "bindings.h"
#include "lifetime/identity.h"
#include "send/allocator.h"
#include "send/message.h"
#include "send/plan.h"

namespace torchshm {

void add_testing_module(py::module_& m) {
  py::module_ testing = m.def_submodule(
      "testing", "Native internals for torchshm's tests and benchmarks.");
  testing.def("lock_path", &torchshm::lock_path, py::arg("id"));
  testing.def("born_owner", &torchshm::born_owner, py::arg("address"));
  testing.def(
      "byte_extent",
      [](py::handle array) { return byte_extent(as_ndarray(array)); },
      py::arg("array"));
  testing.def(
      "data_address",
      [](py::handle array) {
        return reinterpret_cast<int64_t>(PyArray_DATA(as_ndarray(array)));
      },
      py::arg("array"));
  testing.def("copy_extent", &torchshm::copy_extent, py::arg("array"),
              py::arg("dest"), py::arg("dest_offset"), py::arg("threads") = 1);
  testing.def(
      "place",
      [](py::handle array) -> py::tuple {
        torchshm::Message message;
        PyArrayObject* a = as_ndarray(array);
        torchshm::Placement p = message.plan.place(a);
        const char* kinds[] = {"segment", "torch_owned", "copied"};
        if (p.kind == torchshm::Placement::kTorchOwned)
          return py::make_tuple(kinds[p.kind], p.owner, p.offset);
        return py::make_tuple(kinds[p.kind], p.owner, p.name,
                              torchshm::view_args(a, p.offset, p.strides));
      },
      py::arg("array"),
      "Plan::place in a fresh message: (kind, owner, name, view args), or "
      "(\"torch_owned\", tensor, offset).");
  testing.def("hook_calls", &torchshm::hook_calls,
              "Calls from C++ into torchshm's Python hooks so far.");
  testing.def("reset_hook_calls", &torchshm::reset_hook_calls);
  testing.def(
      "sender_policy", [] { return config().policy; },
      "The policy the native side works by (a copy).");
}

}  // namespace torchshm
