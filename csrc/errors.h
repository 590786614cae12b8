// The one exception type the mechanism throws for operating-system failures.
// It carries errno so that Python can decide by number, not by message text,
// which failures mean "fall back to pickling" (ENOSPC, EMFILE...) and which
// are bugs. module.cpp translates it to torchshm._C.SharedMemoryError, an
// OSError subclass whose .errno is `err`.
#pragma once

#include <Python.h>

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

// The pending exception, normalized, with its traceback (nullptr if none);
// the error indicator is cleared. PyErr_Fetch is deprecated from 3.12.
inline PyObject* fetch_error() {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type, *error, *trace;
  PyErr_Fetch(&type, &error, &trace);
  if (type == nullptr) return nullptr;
  PyErr_NormalizeException(&type, &error, &trace);
  if (trace != nullptr) PyException_SetTraceback(error, trace);
  Py_DECREF(type);
  Py_XDECREF(trace);
  return error;
#endif
}

// Raises `error` (a reference stolen); nullptr clears the error indicator.
inline void restore_error(PyObject* error) {
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(error);
#else
  if (error == nullptr) return PyErr_Clear();
  PyErr_Restore(Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(error))), error,
                PyException_GetTraceback(error));
#endif
}

}  // namespace torchshm
