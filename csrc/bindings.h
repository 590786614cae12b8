// Parts of the native module built outside module.cpp.
#pragma once

#include "base/torch_api.h"

namespace torchshm {

// Every constant of layout.h by name (_C.LAYOUT).
py::dict layout_table();
// Adds the `testing` submodule (testing.cpp) to `m`.
void add_testing_module(py::module_& m);

}  // namespace torchshm
