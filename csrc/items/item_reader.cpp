// ItemReader: one item decoded straight from a container's shared buffer in
// one C call, every offset and length bounds-checked (Note [Item format] in
// items.h); read_strings, the string table.
#include <cstdarg>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/errors.h"
#include "base/python_compat.h"
#include "items/item_format.h"
#include "items/items.h"

namespace torchshm {
namespace {

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
    static PyObject* slice_name = PyUnicode_InternFromString("_slice");
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

}  // namespace

PyType_Spec item_reader_spec = {
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

}  // namespace torchshm
