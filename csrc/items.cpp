#include "items.h"

#include <algorithm>
#include <cstdarg>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "numpy_api.h"
#include "python_compat.h"

namespace torchshm {
namespace {

enum Tag : uint8_t {
  kNone = 'N',
  kTrue = 'T',
  kFalse = 'F',
  kInt = 'i',
  kFloat = 'f',
  kStr = 's',
  kTableStr = 'k',
  kBytes = 'y',
  kList = 'l',
  kTuple = 't',
  kDict = 'd',
};

uint64_t to_little_endian(uint64_t bits) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return __builtin_bswap64(bits);
#else
  return bits;
#endif
}

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

PyType_Spec encoder_spec = {"torchshm._C.ItemEncoder", sizeof(Encoder), 0,
                            Py_TPFLAGS_DEFAULT, encoder_slots};

// ---------------------------------------------------------------- decoder

// Reads one item's value; on failure returns nullptr with `problem` set
// (and maybe a Python error, which becomes the ValueError's cause).
struct Decoder {
  const uint8_t* p;
  const uint8_t* end;
  PyObject* strings;  // the string table: a tuple of str
  const char* problem = nullptr;
  const uint8_t* where = nullptr;

  PyObject* fail(const char* why, const uint8_t* at) {
    problem = why;
    where = at;
    return nullptr;
  }

  bool varint(uint64_t* out) {
    if (p < end && *p < 0x80) {  // most lengths and counts: one byte
      *out = *p++;
      return true;
    }
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && p < end; shift += 7) {
      uint8_t b = *p++;
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) {
        *out = v;
        return true;
      }
    }
    return false;
  }

  // A length or count of things of at least `unit` bytes each, which the
  // rest of the item must hold.
  bool size(uint64_t* n, uint64_t unit = 1) {
    const uint8_t* at = p;
    if (!varint(n)) return fail("a malformed length", at), false;
    if (*n > uint64_t(end - p) / unit)
      return fail("a length or count past the end of the item", at), false;
    return true;
  }

  PyObject* table_string(const uint8_t* at) {
    uint64_t i;
    if (!varint(&i)) return fail("a malformed string number", at);
    if (i >= uint64_t(PyTuple_GET_SIZE(strings)))
      return fail("a string number past the string table", at);
    return PyTuple_GET_ITEM(strings, i);  // borrowed
  }

  PyObject* value(int depth);

  // value(depth), with the usual elements of a list or tuple decoded here:
  // a run of floats (or ints) then costs a well-predicted branch each, not
  // a call and a jump through the switch.
  PyObject* element(int depth) {
    if (end - p >= 9 && *p == kFloat) {
      uint64_t bits;
      std::memcpy(&bits, p + 1, 8);
      bits = to_little_endian(bits);
      p += 9;
      double d;
      std::memcpy(&d, &bits, 8);
      return PyFloat_FromDouble(d);
    }
    if (end - p >= 2 && *p == kInt && p[1] < 0x80) {
      uint64_t n = p[1];
      p += 2;
      return PyLong_FromLongLong(int64_t(n >> 1) ^ -int64_t(n & 1));
    }
    return value(depth);
  }
  template <typename Make, typename Set>
  PyObject* sequence(int depth, Make make, Set set);
  PyObject* dict(int depth);
};

template <typename Make, typename Set>
PyObject* Decoder::sequence(int depth, Make make, Set set) {
  uint64_t n;
  if (!size(&n)) return nullptr;  // every element takes at least a byte
  PyObject* out = make(Py_ssize_t(n));
  if (out == nullptr) return nullptr;
  for (uint64_t i = 0; i < n; ++i) {
    PyObject* v = element(depth + 1);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    set(out, Py_ssize_t(i), v);
  }
  return out;
}

PyObject* Decoder::dict(int depth) {
  uint64_t n;
  if (!size(&n, 2)) return nullptr;  // a key and a value: 2 bytes or more
  PyObject* out = PyDict_New();
  if (out == nullptr) return nullptr;
  for (uint64_t i = 0; i < n; ++i) {
    const uint8_t* at = p;
    PyObject* key;
    if (p < end && *p == kTableStr) {  // the usual key: borrowed, no refcount
      ++p;
      key = table_string(at);
      Py_XINCREF(key);
    } else {
      key = value(depth + 1);
    }
    PyObject* v = key ? element(depth + 1) : nullptr;
    if (v == nullptr || PyDict_SetItem(out, key, v) < 0) {
      if (v != nullptr) fail("a dict key that is not hashable", at);
      Py_XDECREF(key);
      Py_XDECREF(v);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(key);
    Py_DECREF(v);
  }
  return out;
}

PyObject* Decoder::value(int depth) {
  const uint8_t* at = p;
  if (p == end) return fail("the item ends inside a value", at);
  if (depth >= kMaxDepth) return fail("values nested too deep", at);
  uint64_t n;
  switch (*p++) {
    case kNone:
      Py_RETURN_NONE;
    case kTrue:
      Py_RETURN_TRUE;
    case kFalse:
      Py_RETURN_FALSE;
    case kInt:
      if (!varint(&n)) return fail("a malformed int", at);
      return PyLong_FromLongLong(int64_t(n >> 1) ^ -int64_t(n & 1));
    case kFloat: {
      if (end - p < 8) return fail("a float past the end of the item", at);
      uint64_t bits;
      std::memcpy(&bits, p, 8);
      bits = to_little_endian(bits);
      p += 8;
      double d;
      std::memcpy(&d, &bits, 8);
      return PyFloat_FromDouble(d);
    }
    case kStr: {
      if (!size(&n)) return nullptr;
      const char* s = reinterpret_cast<const char*>(p);
      p += n;
      PyObject* out = PyUnicode_DecodeUTF8(s, Py_ssize_t(n), "surrogatepass");
      return out ? out : fail("a str that is not UTF-8", at);
    }
    case kTableStr: {
      PyObject* s = table_string(at);
      Py_XINCREF(s);
      return s;
    }
    case kBytes: {
      if (!size(&n)) return nullptr;
      const char* s = reinterpret_cast<const char*>(p);
      p += n;
      return PyBytes_FromStringAndSize(s, Py_ssize_t(n));
    }
    case kList:
      return sequence(depth, PyList_New,
                      [](PyObject* l, Py_ssize_t i, PyObject* v) {
                        PyList_SET_ITEM(l, i, v);
                      });
    case kTuple:
      return sequence(depth, PyTuple_New,
                      [](PyObject* t, Py_ssize_t i, PyObject* v) {
                        PyTuple_SET_ITEM(t, i, v);
                      });
    case kDict:
      return dict(depth);
  }
  return fail("an unknown value tag", at);
}

// Raises ValueError(message) for a corrupted entry; a pending error becomes
// its __cause__, except MemoryError, which stays as it is.
PyObject* raise_corrupted(const char* format, ...) {
  if (PyErr_ExceptionMatches(PyExc_MemoryError)) return nullptr;
  PyObject* cause = fetch_error();
  va_list args;
  va_start(args, format);
  PyErr_FormatV(PyExc_ValueError, format, args);
  va_end(args);
  if (cause != nullptr) {
    PyObject* error = fetch_error();
    PyException_SetCause(error, cause);  // steals cause
    restore_error(error);
  }
  return nullptr;
}

constexpr const char* kExpected =
    "expected an entry in torchshm's item format (was the buffer changed or "
    "cut?)";

struct Reader {
  PyObject ob_base;  // PyObject_HEAD
  Py_buffer buf;     // buf.obj is null until __init__
  Py_buffer offsets;
  const int64_t* off;
  Py_ssize_t entries;  // offsets - 1
  Py_ssize_t n;        // items: entries first, first + stride, ...
  Py_ssize_t stride;
  Py_ssize_t first;
  PyObject* strings;  // tuple of str
  PyObject* load;     // loads a pickled item from a memoryview
  PyObject* view;     // memoryview over buf, sliced for load
  PyObject* label;    // str naming an item in errors
};

PyObject* slice_name = nullptr;

void reader_release(Reader* r) {
  r->n = 0;
  r->entries = 0;
  r->off = nullptr;
  Py_CLEAR(r->strings);
  Py_CLEAR(r->load);
  Py_CLEAR(r->view);
  Py_CLEAR(r->label);
  if (r->buf.obj != nullptr) PyBuffer_Release(&r->buf);
  if (r->offsets.obj != nullptr) PyBuffer_Release(&r->offsets);
}

int reader_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"buffer", "offsets", "strings", "load",
                                "stride", "first",   "label",   nullptr};
  auto* r = reinterpret_cast<Reader*>(self);
  PyObject *buf, *offsets, *strings, *load, *label = nullptr;
  Py_ssize_t stride = 1, first = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!O|$nnU:ItemReader",
                                   const_cast<char**>(names), &buf, &offsets,
                                   &PyTuple_Type, &strings, &load, &stride,
                                   &first, &label))
    return -1;
  // Once only: a read in progress (the loader runs Python code) must never
  // see its buffer replaced.
  if (r->buf.obj != nullptr) {
    PyErr_SetString(PyExc_TypeError,
                    "torchshm: an ItemReader is initialized once only");
    return -1;
  }
  if (stride < 1 || first < 0) {
    PyErr_Format(PyExc_ValueError,
                 "torchshm: expected stride >= 1 and first >= 0, got %zd "
                 "and %zd",
                 stride, first);
    return -1;
  }
  if (!PyCallable_Check(load)) {
    PyErr_Format(PyExc_TypeError,
                 "torchshm: expected a callable load, got %.100s",
                 Py_TYPE(load)->tp_name);
    return -1;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(strings); ++i) {
    if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(strings, i))) {
      PyErr_Format(PyExc_TypeError,
                   "torchshm: expected a tuple of str as the string table, "
                   "got a %.100s at %zd",
                   Py_TYPE(PyTuple_GET_ITEM(strings, i))->tp_name, i);
      return -1;
    }
  }
  if (PyObject_GetBuffer(buf, &r->buf, PyBUF_SIMPLE) < 0) return -1;
  if (PyObject_GetBuffer(offsets, &r->offsets,
                         PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    reader_release(r);
    return -1;
  }
  const char* format = r->offsets.format ? r->offsets.format : "B";
  if (r->offsets.ndim != 1 || r->offsets.itemsize != 8 ||
      std::strchr("ql", format[format[0] == '<' || format[0] == '=']) ==
          nullptr ||
      r->offsets.shape[0] < 1) {
    PyErr_Format(PyExc_TypeError,
                 "torchshm: expected offsets as a 1-D int64 buffer of at "
                 "least one element, got format '%s', %d dimensions, "
                 "itemsize %zd",
                 format, r->offsets.ndim, r->offsets.itemsize);
    reader_release(r);
    return -1;
  }
  r->view = PyMemoryView_FromObject(buf);
  if (r->view == nullptr) {
    reader_release(r);
    return -1;
  }
  r->off = static_cast<const int64_t*>(r->offsets.buf);
  r->entries = r->offsets.shape[0] - 1;
  r->n = r->entries > first ? (r->entries - first + stride - 1) / stride : 0;
  r->stride = stride;
  r->first = first;
  Py_INCREF(strings);
  r->strings = strings;
  Py_INCREF(load);
  r->load = load;
  r->label = label ? label : PyUnicode_FromString("item");
  if (label != nullptr) Py_INCREF(label);
  if (r->label == nullptr) {
    reader_release(r);
    return -1;
  }
  return 0;
}

// Item i, 0 <= i < n.
PyObject* reader_item(Reader* r, Py_ssize_t i) {
  Py_ssize_t j = r->first + i * r->stride;
  int64_t start = r->off[j], stop = r->off[j + 1];
  if (start < 0 || stop <= start || stop > r->buf.len) {
    PyErr_Format(PyExc_ValueError,
                 "torchshm: %U %zd is corrupted: its offsets [%lld, %lld) "
                 "are not an entry of its %zd-byte buffer",
                 r->label, i, static_cast<long long>(start),
                 static_cast<long long>(stop), r->buf.len);
    return nullptr;
  }
  const uint8_t* item = static_cast<const uint8_t*>(r->buf.buf) + start;
  if (item[0] == kItemTag) {
    Decoder d{item + 1, item + (stop - start), r->strings};
    PyObject* v = d.value(0);
    if (v != nullptr && d.p != d.end) {
      Py_DECREF(v);
      v = d.fail("bytes after the value", d.p);
    }
    if (v == nullptr && d.problem != nullptr)
      return raise_corrupted(
          "torchshm: %U %zd is corrupted: %s at byte %zd of its %lld; %s",
          r->label, i, d.problem, Py_ssize_t(d.where - item),
          static_cast<long long>(stop - start), kExpected);
    return v;
  }
  if (item[0] == kPickleTag) {
    PyObject* data = PySequence_GetSlice(r->view, start, stop);
    if (data == nullptr) return nullptr;
    PyObject* v = PyObject_CallOneArg(r->load, data);
    Py_DECREF(data);
    return v;
  }
  PyErr_Format(PyExc_ValueError,
               "torchshm: %U %zd is corrupted: it starts with byte 0x%02x, "
               "expected 0x%02x (a pickle) or 0x%02x (torchshm's item format)",
               r->label, i, item[0], kPickleTag, kItemTag);
  return nullptr;
}

PyObject* reader_subscript(PyObject* self, PyObject* key) {
  auto* r = reinterpret_cast<Reader*>(self);
  if (!PyLong_CheckExact(key)) {
    if (PySlice_Check(key))
      return PyObject_CallMethodOneArg(self, slice_name, key);
    if (!PyIndex_Check(key)) {
      PyErr_Format(PyExc_TypeError,
                   "%.100s indices must be integers or slices, not %.100s",
                   Py_TYPE(self)->tp_name, Py_TYPE(key)->tp_name);
      return nullptr;
    }
  }
  Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
  if (i == -1 && PyErr_Occurred()) return nullptr;
  if (i < 0) i += r->n;
  if (i < 0 || i >= r->n) {
    PyErr_Format(PyExc_IndexError, "%.100s index out of range",
                 Py_TYPE(self)->tp_name);
    return nullptr;
  }
  return reader_item(r, i);
}

Py_ssize_t reader_length(PyObject* self) {
  return reinterpret_cast<Reader*>(self)->n;
}

int reader_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* r = reinterpret_cast<Reader*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(r->strings);
  Py_VISIT(r->load);
  Py_VISIT(r->view);
  Py_VISIT(r->buf.obj);
  Py_VISIT(r->offsets.obj);
  return 0;
}

int reader_clear(PyObject* self) {
  reader_release(reinterpret_cast<Reader*>(self));
  return 0;
}

void reader_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  reader_release(reinterpret_cast<Reader*>(self));
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot reader_slots[] = {
    {Py_tp_doc,
     const_cast<char*>(
         "ItemReader(buffer, offsets, strings, load, *, stride=1, first=0, "
         "label='item'): reader[i] decodes entry first + i * stride "
         "(Note [Item format]); pickled entries go to load(memoryview). A "
         "slice calls self._slice(slice).")},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_init, reinterpret_cast<void*>(reader_init)},
    {Py_tp_dealloc, reinterpret_cast<void*>(reader_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(reader_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(reader_clear)},
    {Py_mp_subscript, reinterpret_cast<void*>(reader_subscript)},
    {Py_mp_length, reinterpret_cast<void*>(reader_length)},
    {Py_sq_length, reinterpret_cast<void*>(reader_length)},
    {0, nullptr}};

PyType_Spec reader_spec = {
    "torchshm._C.ItemReader", sizeof(Reader), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    reader_slots};

// The string table's entries as interned str, in order.
PyObject* read_strings(PyObject*, PyObject* table) {
  Py_buffer view;
  if (PyObject_GetBuffer(table, &view, PyBUF_SIMPLE) < 0) return nullptr;
  const auto* begin = static_cast<const uint8_t*>(view.buf);
  Decoder d{begin, begin + view.len, nullptr};
  PyObject* out = PyList_New(0);
  while (out != nullptr && d.p < d.end) {
    const uint8_t* at = d.p;
    uint64_t n;
    PyObject* s = nullptr;
    if (d.size(&n)) {
      s = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(d.p),
                               Py_ssize_t(n), "surrogatepass");
      d.p += n;
      if (s == nullptr) d.fail("a str that is not UTF-8", at);
    }
    if (s != nullptr) PyUnicode_InternInPlace(&s);
    if (s == nullptr || PyList_Append(out, s) < 0) {
      Py_CLEAR(out);
      if (d.problem != nullptr)
        raise_corrupted(
            "torchshm: a container's string table is corrupted: %s at byte "
            "%zd of its %zd; %s",
            d.problem, Py_ssize_t(d.where - begin), view.len, kExpected);
    }
    Py_XDECREF(s);
  }
  PyBuffer_Release(&view);
  if (out == nullptr) return nullptr;
  PyObject* strings = PyList_AsTuple(out);
  Py_DECREF(out);
  return strings;
}

PyMethodDef functions[] = {
    {"read_strings", read_strings, METH_O,
     "A container's string table (a uint8 buffer) as a tuple of interned "
     "str (Note [Item format])."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

int add_item_codec(PyObject* module) {
  slice_name = PyUnicode_InternFromString("_slice");
  if (slice_name == nullptr) return -1;
  for (auto [name, spec] : {std::pair{"ItemEncoder", &encoder_spec},
                            std::pair{"ItemReader", &reader_spec}}) {
    PyObject* type = PyType_FromSpec(spec);
    int added = PyModule_AddObjectRef(module, name, type);
    Py_XDECREF(type);
    if (added < 0) return -1;
  }
  if (PyModule_AddFunctions(module, functions) < 0 ||
      PyModule_AddIntConstant(module, "ITEM_TAG", kItemTag) < 0 ||
      PyModule_AddIntConstant(module, "PICKLE_TAG", kPickleTag) < 0 ||
      PyModule_AddIntConstant(module, "ITEM_MAX_DEPTH", kMaxDepth) < 0)
    return -1;
  return 0;
}

}  // namespace torchshm
