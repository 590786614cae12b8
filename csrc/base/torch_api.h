// The slice of torch's C++ API that csrc/ uses: tensors and storages
// (ATen/core), and pybind11 with torch's casters (at::Tensor to and from
// torch.Tensor; `py` is pybind11).
//
// Not <torch/extension.h>, which is all of torch's C++ API (autograd, nn,
// optim, data): parsing it took 26 s and 1.4 GB per file against 6 s and
// 0.4 GB for these (setup.py's translation_units says what the build costs).
// Files that use no tensor or Python object include <c10/util/Exception.h>
// for TORCH_CHECK alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

namespace torchshm {

// The at::Tensor of `obj` if it is a torch.Tensor (or a subclass); an
// undefined one for anything else, or no object. Through torch's caster,
// whose load is THPVariable_Check and THPVariable_Unpack out of line in
// libtorch_python: torch's Python variable header would add 7 s of parse to
// the build. Each call takes a new reference (on torch 2.14 one that holds
// the Python object too): read a tensor once, then use what it returned.
inline at::Tensor tensor_or_undefined(py::handle obj) {
  if (!obj) return at::Tensor();
  py::detail::make_caster<at::Tensor> caster;
  return caster.load(obj, /*convert=*/false)
             ? py::detail::cast_op<at::Tensor>(std::move(caster))
             : at::Tensor();
}

// The at::Tensor of a torch.Tensor object (a new reference to its
// TensorImpl: use_count() counts it); a TypeError for anything else.
inline at::Tensor unpack_tensor(py::handle obj) {
  at::Tensor tensor = tensor_or_undefined(obj);
  TORCH_CHECK_TYPE(tensor.defined(), "expected a torch.Tensor, got ",
                   Py_TYPE(obj.ptr())->tp_name);
  return tensor;
}

}  // namespace torchshm
