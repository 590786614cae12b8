// The one exception type the mechanism throws for operating-system failures.
// It carries errno so that Python can decide by number, not by message text,
// which failures mean "fall back to pickling" (ENOSPC, EMFILE...) and which
// are bugs. module.cpp translates it to torchshm._C.SharedMemoryError, an
// OSError subclass whose .errno is `err`.
#pragma once

#include <cerrno>
#include <cstring>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

namespace torchshm {

class ShmError : public std::runtime_error {
 public:
  ShmError(int err, const std::string& what)
      : std::runtime_error(what), err_(err) {}
  int err() const { return err_; }

 private:
  int err_;
};

// Throws ShmError(err, "torchshm: <parts...>: <strerror(err)>").
template <typename... Parts>
[[noreturn]] void throw_errno(int err, const Parts&... parts) {
  std::ostringstream out;
  out << "torchshm: ";
  (out << ... << parts);
  out << ": " << std::strerror(err);
  throw ShmError(err, out.str());
}

// Sets the Python error for a C++ exception as the bindings translate it:
// ShmError as torchshm._C.SharedMemoryError(errno, message), a pending
// Python error as itself, c10's and pybind11's typed errors as their Python
// types, anything else as RuntimeError (module.cpp).
void set_python_error(std::exception_ptr error);

}  // namespace torchshm
