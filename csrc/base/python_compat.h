// The CPython calls that differ between the Pythons torchshm runs on
// (3.9-3.13), each behind one name: the rest of csrc/ never tests
// PY_VERSION_HEX.
#pragma once

#include <Python.h>

namespace torchshm {

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

// The object a weak reference points to (a new reference), or nullptr if it
// is dead; nullptr with an error set if `weak` is not a weak reference.
// PyWeakref_GetObject is deprecated from 3.13 (a borrowed reference).
inline PyObject* weak_referent(PyObject* weak, bool* failed) {
  *failed = false;
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(weak, &obj) < 0) *failed = true;
  return obj;
#else
  PyObject* obj = PyWeakref_GetObject(weak);
  if (obj == nullptr) {
    *failed = true;
    return nullptr;
  }
  return obj == Py_None ? nullptr : Py_NewRef(obj);
#endif
}

// Whether the interpreter has begun to finalize (a thread other than the
// finalizing one that takes the GIL now is ended: Note [The GIL at exit] in
// gil.h). Public from 3.13.
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

}  // namespace torchshm
