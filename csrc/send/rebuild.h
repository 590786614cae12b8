// The wire's native functions, the receiver's side (rebuild.cpp).
#pragma once

#include <string>

#include "base/torch_api.h"

namespace torchshm {

// The wire's native rebuild functions, named torchshm._reduction.<name>:
// rebuild_ndarray(owner, offset, dtype, shape, strides, writeable, subtype),
// and, for pickles of earlier versions, rebuild_inline(token, reconstruct,
// args, state) and message_token().
py::object wire_function(const std::string& name);

// rebuild_ndarray, as every message names it (the sender's reduce).
py::handle rebuild_ndarray_function();

}  // namespace torchshm
