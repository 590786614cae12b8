// The wire's native functions, the receiver's side (the counterpart of
// torchshm/_reduction.py, which names them in every pickle): an array
// rebuilt over its segment through the mapping its kind asks for, and the
// rebuilds of pickles of earlier versions.
#include "send/rebuild.h"

#include <string>
#include <vector>

#include "base/config.h"
#include "base/errors.h"
#include "base/gil.h"
#include "base/ndarray.h"
#include "base/numpy_api.h"
#include "base/stats.h"
#include "lifetime/segment.h"
#include "lifetime/views.h"

namespace torchshm {
namespace {

// An array over segment `owner` (a Python tensor; `tensor` is its
// at::Tensor) through the mapping its kind asks for (Note [Snapshots are
// mapped privately] in segment.h); over `owner` itself when it is not a
// segment's (torch's own storage):
// - over a message's private mapping (a snapshot's, from attach): there,
//   read-only or not;
// - a snapshot handed over otherwise (its shared view itself): over a
//   private mapping for it alone, if this process can make one;
// - shared memory: writable arrays over the shared mapping, read-only ones
//   over the segment's read-only (copy-on-write) mapping.
// Where the mapping needed cannot be made here, a private copy of the
// segment's bytes, with the array's flags.
py::object rebuild_over_mapping(py::handle owner, const at::Tensor& tensor,
                                int64_t offset, py::handle dtype,
                                const std::vector<int64_t>& shape,
                                const std::vector<int64_t>& strides,
                                bool writeable) {
  using Mapping = Segment::Mapping;
  View* view = view_of(tensor);
  auto over = [&](const at::Tensor& mapped) {
    return wrap_ndarray(mapped, offset, dtype, shape, strides, writeable);
  };
  if (view == nullptr || view->lease != nullptr) return over(tensor);
  const Mapping kind = view->segment->snapshot() ? Mapping::kPrivate
                       : writeable               ? Mapping::kShared
                                                 : Mapping::kReadOnly;
  const py::object mapped =
      mapped_object(owner, kind, config().policy.copy_threads);
  if (!mapped.is_none()) return over(unpack_tensor(mapped));
  const py::object source =
      wrap_ndarray(unpack_tensor(mapped_object(owner, Mapping::kShared)),
                   offset, dtype, shape, strides, false);
  PyObject* copy = PyArray_NewCopy(as_ndarray(source), NPY_KEEPORDER);
  if (copy == nullptr) throw py::error_already_set();
  if (!writeable)
    PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(copy),
                       NPY_ARRAY_WRITEABLE);
  count(kArraysCopiedOnReceive);
  return py::reinterpret_steal<py::object>(copy);
}

// --- the wire's native functions (named torchshm._reduction.<name>) -------

PyObject* rebuild_ndarray(PyObject* /*self*/, PyObject* const* args,
                          Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_Format(PyExc_TypeError,
                 "rebuild_ndarray expected 7 arguments (owner, offset, dtype, "
                 "shape, strides, writeable, subtype), got %zd",
                 nargs);
    return nullptr;
  }
  try {
    const at::Tensor owner = tensor_or_undefined(args[0]);
    if (!owner.defined())
      throw py::type_error("rebuild_ndarray expected a tensor as owner, got " +
                           std::string(py::str(py::type::handle_of(args[0]))));
    const int64_t offset = py::cast<int64_t>(py::handle(args[1]));
    const auto shape = py::cast<std::vector<int64_t>>(py::handle(args[3]));
    const auto strides = py::cast<std::vector<int64_t>>(py::handle(args[4]));
    const int writeable = PyObject_IsTrue(args[5]);
    if (writeable < 0) throw py::error_already_set();
    py::object array = rebuild_over_mapping(py::handle(args[0]), owner, offset,
                                            py::handle(args[2]), shape, strides,
                                            writeable != 0);
    count(kArraysReceived);
    if (args[6] == Py_None) return array.release().ptr();
    static PyObject* view_name = PyUnicode_InternFromString("view");
    return PyObject_CallMethodOneArg(array.ptr(), view_name, args[6]);
  } catch (abi::__forced_unwind&) {
    throw;  // a thread CPython ends: Note [The GIL at exit] in gil.h
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyObject* rebuild_inline(PyObject* /*self*/, PyObject* const* args,
                         Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError,
                    "rebuild_inline expected (token, reconstruct, args tuple, "
                    "state)");
    return nullptr;
  }
  PyObject* array = PyObject_Call(args[1], args[2], nullptr);
  if (array == nullptr) return nullptr;
  static PyObject* setstate = PyUnicode_InternFromString("__setstate__");
  PyObject* done = PyObject_CallMethodOneArg(array, setstate, args[3]);
  if (done == nullptr) {
    Py_DECREF(array);
    return nullptr;
  }
  Py_DECREF(done);
  return array;
}

PyObject* message_token(PyObject* /*self*/, PyObject* /*unused*/) {
  Py_RETURN_NONE;
}

PyMethodDef wire_defs[] = {
    {"rebuild_ndarray", reinterpret_cast<PyCFunction>(rebuild_ndarray),
     METH_FASTCALL,
     "Rebuilds an array over `owner`, the int8 tensor of its segment; "
     "`dtype` is a dtype or its .str, `subtype` None for a plain ndarray."},
    {"rebuild_inline", reinterpret_cast<PyCFunction>(rebuild_inline),
     METH_FASTCALL,
     "Rebuilds an array pickled by value (numpy's own reduce, after the "
     "token of its message)."},
    {"message_token", message_token, METH_NOARGS,
     "Unpickles a message's token: it carries nothing."},
};

PyObject* wire(int index) {
  static PyObject* functions[3] = {};
  if (functions[index] == nullptr) {
    py::str module("torchshm._reduction");
    functions[index] = PyCFunction_NewEx(&wire_defs[index], nullptr,
                                         module.ptr());  // never released
    if (functions[index] == nullptr) throw py::error_already_set();
  }
  return functions[index];
}

}  // namespace

py::object wire_function(const std::string& name) {
  for (int i = 0; i < 3; ++i)
    if (name == wire_defs[i].ml_name)
      return py::reinterpret_borrow<py::object>(wire(i));
  throw py::value_error("no wire function " + name);
}

py::handle rebuild_ndarray_function() { return wire(0); }

}  // namespace torchshm
