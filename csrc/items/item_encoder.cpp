// ItemEncoder: a container's items into one buffer of entries (Note [Item
// format] in items.h), builtin values of exact types natively.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/numpy_api.h"
#include "base/python_compat.h"
#include "items/item_format.h"
#include "items/items.h"

namespace torchshm {
namespace {

void put_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(uint8_t(v) | 0x80);
    v >>= 7;
  }
  out.push_back(uint8_t(v));
}

void put_bytes(std::vector<uint8_t>& out, const void* data, size_t n) {
  put_varint(out, n);
  auto* p = static_cast<const uint8_t*>(data);
  out.insert(out.end(), p, p + n);
}

// The UTF-8 of an exact str, lone surrogates kept: a view of the str's own
// data when it is ASCII, else of `holder` (a new bytes object).
bool utf8_of(PyObject* s, const char** data, Py_ssize_t* n, PyObject** holder) {
  if (PyUnicode_IS_ASCII(s)) {
    *data = static_cast<const char*>(PyUnicode_DATA(s));
    *n = PyUnicode_GET_LENGTH(s);
    return true;
  }
  // Not PyUnicode_AsUTF8AndSize: it would keep a UTF-8 copy inside every
  // str of the caller's data.
  *holder = PyUnicode_AsEncodedString(s, "utf-8", "surrogatepass");
  if (*holder == nullptr) return false;
  *data = PyBytes_AS_STRING(*holder);
  *n = PyBytes_GET_SIZE(*holder);
  return true;
}

// ---------------------------------------------------------------- encoder

// One buffer of entries (items, or bytes the caller writes: keys, pickles),
// their offsets, and the string table.
struct EncoderState {
  std::vector<uint8_t> data;
  std::vector<int64_t> offsets{0};
  std::vector<uint8_t> table;
  PyObject* index = nullptr;  // str -> its number in the table
  Py_ssize_t max_strings = 0;
  Py_ssize_t max_string_bytes = 0;
  // Objects of the item being encoded that a decoder would make once per
  // occurrence: one seen twice means the item shares it, which only pickle
  // keeps (and recursion is such a case).
  std::vector<PyObject*> seen;

  ~EncoderState() { Py_XDECREF(index); }

  // 1: written; 0: not representable exactly (the caller pickles it);
  // -1: a Python error.
  int value(PyObject* o, int depth);
  int str(PyObject* s, bool is_key);
  int add(PyObject* item);
};

int EncoderState::str(PyObject* s, bool is_key) {
  if (PyDict_GET_SIZE(index) > 0) {
    PyObject* number = PyDict_GetItemWithError(index, s);
    if (number != nullptr) {
      data.push_back(kTableStr);
      put_varint(data, PyLong_AsSize_t(number));
      return 1;
    }
    if (PyErr_Occurred()) return -1;
  }
  const char* utf8;
  Py_ssize_t n;
  PyObject* holder = nullptr;
  if (!utf8_of(s, &utf8, &n, &holder)) return -1;
  Py_ssize_t count = PyDict_GET_SIZE(index);
  if (is_key && count < max_strings && n <= max_string_bytes) {
    PyObject* number = PyLong_FromSsize_t(count);
    int failed = number == nullptr || PyDict_SetItem(index, s, number) < 0;
    Py_XDECREF(number);
    if (failed) {
      Py_XDECREF(holder);
      return -1;
    }
    put_bytes(table, utf8, n);
    data.push_back(kTableStr);
    put_varint(data, count);
  } else {
    // "" and one-character latin-1 strings are shared singletons here and
    // when decoded; any other str comes back as a new object.
    if (PyUnicode_GET_LENGTH(s) > 1 ||
        PyUnicode_KIND(s) != PyUnicode_1BYTE_KIND)
      seen.push_back(s);
    data.push_back(kStr);
    put_bytes(data, utf8, n);
  }
  Py_XDECREF(holder);
  return 1;
}

int EncoderState::value(PyObject* o, int depth) {
  if (depth >= kMaxDepth) return 0;
  PyTypeObject* type = Py_TYPE(o);
  if (o == Py_None) {
    data.push_back(kNone);
  } else if (o == Py_True) {
    data.push_back(kTrue);
  } else if (o == Py_False) {
    data.push_back(kFalse);
  } else if (type == &PyLong_Type) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow) return 0;
    if (v == -1 && PyErr_Occurred()) return -1;
    data.push_back(kInt);
    put_varint(data, (uint64_t(v) << 1) ^ uint64_t(v >> 63));
  } else if (type == &PyFloat_Type) {
    double d = PyFloat_AS_DOUBLE(o);
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    bits = to_little_endian(bits);
    data.push_back(kFloat);
    auto* p = reinterpret_cast<const uint8_t*>(&bits);
    data.insert(data.end(), p, p + 8);
  } else if (type == &PyUnicode_Type) {
    return str(o, false);
  } else if (type == &PyBytes_Type) {
    // b"" and one-byte bytes are singletons, as for str.
    if (PyBytes_GET_SIZE(o) > 1) seen.push_back(o);
    data.push_back(kBytes);
    put_bytes(data, PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
  } else if (type == &PyList_Type || type == &PyTuple_Type) {
    // A list is a new object even when empty; () is a singleton.
    if (type == &PyList_Type || Py_SIZE(o) > 0) seen.push_back(o);
    data.push_back(type == &PyList_Type ? kList : kTuple);
    put_varint(data, Py_SIZE(o));
    // No Python code runs while encoding (exact builtins only), so the list
    // cannot change under us.
    for (Py_ssize_t i = 0; i < Py_SIZE(o); ++i) {
      int r = value(PySequence_Fast_GET_ITEM(o, i), depth + 1);
      if (r != 1) return r;
    }
  } else if (type == &PyDict_Type) {
    seen.push_back(o);
    data.push_back(kDict);
    put_varint(data, PyDict_GET_SIZE(o));
    Py_ssize_t pos = 0;
    PyObject *key, *val;
    while (PyDict_Next(o, &pos, &key, &val)) {
      int r = Py_TYPE(key) == &PyUnicode_Type ? str(key, true)
                                              : value(key, depth + 1);
      if (r == 1) r = value(val, depth + 1);
      if (r != 1) return r;
    }
  } else {
    return 0;
  }
  return 1;
}

int EncoderState::add(PyObject* item) {
  size_t mark = data.size();
  seen.clear();
  data.push_back(kItemTag);
  int r = value(item, 0);
  if (r == 1) {
    std::sort(seen.begin(), seen.end());
    if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) r = 0;
  }
  seen.clear();
  if (r != 1) {
    // Table entries added meanwhile stay: keys that other items use too.
    data.resize(mark);
    return r;
  }
  offsets.push_back(int64_t(data.size()));
  return 1;
}

struct Encoder {
  PyObject ob_base;  // PyObject_HEAD
  EncoderState* state;
};

EncoderState* live_state(PyObject* self) {
  EncoderState* state = reinterpret_cast<Encoder*>(self)->state;
  if (state == nullptr)
    PyErr_SetString(PyExc_RuntimeError,
                    "torchshm: expected an ItemEncoder that is initialized "
                    "and not finished, got one that is not");
  return state;
}

bool entry_closed(EncoderState* state) {
  if (int64_t(state->data.size()) == state->offsets.back()) return true;
  PyErr_Format(PyExc_RuntimeError,
               "torchshm: expected the entry written so far (%zd bytes) to "
               "be ended first",
               Py_ssize_t(state->data.size() - state->offsets.back()));
  return false;
}

int encoder_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"max_strings", "max_string_bytes", nullptr};
  Py_ssize_t max_strings, max_string_bytes;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn:ItemEncoder",
                                   const_cast<char**>(names), &max_strings,
                                   &max_string_bytes))
    return -1;
  if (max_strings < 0 || max_string_bytes < 0) {
    PyErr_Format(PyExc_ValueError,
                 "torchshm: expected non-negative string table limits, got "
                 "%zd strings of %zd bytes",
                 max_strings, max_string_bytes);
    return -1;
  }
  PyObject* index = PyDict_New();
  if (index == nullptr) return -1;
  auto* encoder = reinterpret_cast<Encoder*>(self);
  delete encoder->state;
  encoder->state = new EncoderState();
  encoder->state->index = index;
  encoder->state->max_strings = max_strings;
  encoder->state->max_string_bytes = max_string_bytes;
  return 0;
}

void encoder_dealloc(PyObject* self) {
  delete reinterpret_cast<Encoder*>(self)->state;
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyObject* encoder_add(PyObject* self, PyObject* item) {
  EncoderState* state = live_state(self);
  if (state == nullptr || !entry_closed(state)) return nullptr;
  int r = state->add(item);
  if (r < 0) return nullptr;
  return PyBool_FromLong(r);
}

PyObject* encoder_write(PyObject* self, PyObject* data) {
  EncoderState* state = live_state(self);
  if (state == nullptr) return nullptr;
  Py_buffer view;
  if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return nullptr;
  auto* p = static_cast<const uint8_t*>(view.buf);
  state->data.insert(state->data.end(), p, p + view.len);
  Py_ssize_t n = view.len;
  PyBuffer_Release(&view);
  return PyLong_FromSsize_t(n);
}

PyObject* encoder_end_entry(PyObject* self, PyObject*) {
  EncoderState* state = live_state(self);
  if (state == nullptr) return nullptr;
  state->offsets.push_back(int64_t(state->data.size()));
  Py_RETURN_NONE;
}

// A 1-D array that owns `v`'s memory (through a capsule, its base).
template <typename T>
PyObject* array_of(std::vector<T>&& v, int typenum) {
  npy_intp n = npy_intp(v.size());
  if (n == 0) return PyArray_SimpleNew(1, &n, typenum);
  auto* owned = new std::vector<T>(std::move(v));
  PyObject* capsule = PyCapsule_New(owned, nullptr, [](PyObject* c) {
    delete static_cast<std::vector<T>*>(PyCapsule_GetPointer(c, nullptr));
  });
  if (capsule == nullptr) {
    delete owned;
    return nullptr;
  }
  PyObject* array = PyArray_SimpleNewFromData(1, &n, typenum, owned->data());
  if (array == nullptr ||
      PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(array), capsule) <
          0) {
    Py_XDECREF(array);
    Py_DECREF(capsule);
    return nullptr;
  }
  return array;
}

PyObject* encoder_finish(PyObject* self, PyObject*) {
  EncoderState* state = live_state(self);
  if (state == nullptr || !entry_closed(state)) return nullptr;
  PyObject* buf = array_of(std::move(state->data), NPY_UINT8);
  PyObject* offsets = array_of(std::move(state->offsets), NPY_INT64);
  PyObject* table = array_of(std::move(state->table), NPY_UINT8);
  delete state;
  reinterpret_cast<Encoder*>(self)->state = nullptr;
  if (buf == nullptr || offsets == nullptr || table == nullptr) {
    Py_XDECREF(buf);
    Py_XDECREF(offsets);
    Py_XDECREF(table);
    return nullptr;
  }
  return Py_BuildValue("(NNN)", buf, offsets, table);
}

PyMethodDef encoder_methods[] = {
    {"add", encoder_add, METH_O,
     "Writes `item` as one entry if the format represents it exactly: "
     "True; else writes nothing: False."},
    {"write", encoder_write, METH_O,
     "Appends bytes to the current entry (a pickler's file)."},
    {"end_entry", encoder_end_entry, METH_NOARGS,
     "Ends the entry that write() filled."},
    {"finish", encoder_finish, METH_NOARGS,
     "(buffer, offsets, string table) as numpy arrays; the encoder is "
     "spent."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot encoder_slots[] = {
    {Py_tp_doc,
     const_cast<char*>("ItemEncoder(max_strings, max_string_bytes): writes a "
                       "container's entries (Note [Item format]).")},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_init, reinterpret_cast<void*>(encoder_init)},
    {Py_tp_dealloc, reinterpret_cast<void*>(encoder_dealloc)},
    {Py_tp_methods, encoder_methods},
    {0, nullptr}};

}  // namespace

PyType_Spec item_encoder_spec = {"torchshm._C.ItemEncoder", sizeof(Encoder), 0,
                                 Py_TPFLAGS_DEFAULT, encoder_slots};

}  // namespace torchshm
