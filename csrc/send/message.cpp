#include "send/message.h"

#include <frameobject.h>

#include <array>
#include <atomic>
#include <utility>

#include "base/config.h"
#include "base/errors.h"
#include "base/gil.h"
#include "base/ndarray.h"
#include "base/numpy_api.h"
#include "base/python_compat.h"
#include "base/stats.h"
#include "lifetime/fork_guard.h"
#include "lifetime/identity.h"
#include "lifetime/live.h"
#include "lifetime/segment.h"
#include "lifetime/views.h"
#include "send/rebuild.h"

namespace torchshm {
namespace {

py::tuple int_tuple(const npy_intp* values, int n) {
  py::tuple out(n);
  for (int i = 0; i < n; ++i) out[i] = py::int_(values[i]);
  return out;
}

// Tickets of this thread's last message that are marked "being written"
// (see the Note): the segment, so that its mapping outlives the write.
thread_local std::vector<std::pair<std::shared_ptr<Segment>, uint64_t>>
    being_written;

void end_write(bool written) {
  for (auto& [segment, ticket] : being_written) {
    if (written)
      segment->mark_written(ticket);
    else
      segment->cancel_ticket(ticket);
  }
  being_written.clear();
}

// Whether one of multiprocessing's message writers (Hooks::writers) is on
// this thread's stack: then Connection._send_bytes writes what is being
// pickled, in this thread, once pickling is done (see the Note).
bool writer_on_stack() {
  const Hooks& hooks = config().hooks;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  for (int depth = 0; frame != nullptr && depth < hooks.max_depth; ++depth) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    bool found = false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(hooks.writers) && !found; ++i)
      found = PyTuple_GET_ITEM(hooks.writers, i) ==
              reinterpret_cast<PyObject*>(code);
    Py_DECREF(code);
    if (found) {
      Py_DECREF(frame);
      return true;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return false;
}

// A builtin dtype travels as its .str, which round-trips it exactly unless it
// has fields, a sub-array or metadata, and pickles in a fraction of the time
// of a dtype object. User-registered dtypes (num >= NPY_USERDEF) and
// new-style ones (num -1) have a .str that names only their bytes.
py::object wire_dtype_uncached(PyArray_Descr* descr) {
  py::handle d(reinterpret_cast<PyObject*>(descr));
  if (descr->type_num >= 0 && descr->type_num < NPY_USERDEF &&
      !PyDataType_HASFIELDS(descr) && !PyDataType_HASSUBARRAY(descr) &&
      d.attr("metadata").is_none())
    return d.attr("str");
  return py::reinterpret_borrow<py::object>(d);
}

// What view_args sends for `descr`. NumPy formats .str afresh at each read
// (a sprintf): for a message of many small arrays that was half of placing
// one. A dtype is immutable and the common ones are singletons, so the last
// few answers are kept, each with a reference to its dtype (its address
// cannot be reused while it is kept). Under the GIL.
py::object wire_dtype(PyArray_Descr* descr) {
  struct Known {
    py::object dtype, wire;
  };
  constexpr size_t kKept = 16;
  static auto* known = new std::array<Known, kKept>();  // outlives Python
  static size_t next = 0;
  auto* key = reinterpret_cast<PyObject*>(descr);
  for (const Known& k : *known)
    if (k.dtype.ptr() == key) return k.wire;
  py::object wire = wire_dtype_uncached(descr);
  (*known)[next] = Known{py::reinterpret_borrow<py::object>(key), wire};
  next = (next + 1) % kKept;
  return wire;
}

}  // namespace

py::tuple view_args(PyArrayObject* a, int64_t offset,
                    const std::vector<npy_intp>& strides, py::handle first) {
  py::object dtype = wire_dtype(PyArray_DESCR(a));
  const int nd = PyArray_NDIM(a);
  py::object subtype = Py_TYPE(a) == &PyArray_Type
                           ? py::none()
                           : py::reinterpret_borrow<py::object>(
                                 reinterpret_cast<PyObject*>(Py_TYPE(a)));
  py::tuple out(first ? 7 : 6);
  int i = 0;
  if (first) out[i++] = py::reinterpret_borrow<py::object>(first);
  out[i++] = py::int_(offset);
  out[i++] = std::move(dtype);
  out[i++] = int_tuple(PyArray_DIMS(a), nd);
  out[i++] =
      int_tuple(strides.empty() ? PyArray_STRIDES(a) : strides.data(), nd);
  out[i++] = py::bool_(PyArray_ISWRITEABLE(a));
  out[i++] = std::move(subtype);
  return out;
}

py::object Message::reduce_shared(py::handle self, PyArrayObject* array,
                                  const Placement& placed) {
  py::object segment_ref = ref(self, placed.owner, placed.name);
  return py::make_tuple(
      rebuild_ndarray_function(),
      view_args(array, placed.offset, placed.strides, segment_ref));
}

py::object Message::ref(py::handle self, py::object owner, py::object name) {
  std::string key = name.cast<std::string>();
  auto found = refs_.find(key);
  if (found != refs_.end()) {
    py::object existing = referent(found->second);
    if (!existing.is_none()) return existing;
  }
  py::object made =
      py::cast(new SegmentRef{py::reinterpret_borrow<py::object>(self),
                              std::move(owner), std::move(name)},
               py::return_value_policy::take_ownership);
  refs_[std::move(key)] = weak_ref(made);
  return made;
}

py::tuple SegmentRef::reduce() const {
  View* view = view_of(unpack_tensor(owner));
  TORCH_CHECK(view != nullptr, "a segment reference without its segment");
  // Raising here would lose the message: no ticket means the receiver loads
  // as a second load does (Note [Segment lifetime]), while our view keeps
  // the segment until the message is written.
  uint64_t ticket = 0;
  if (!view->segment->unlinked()) {
    try {
      // A writer to watch only where the write is known to go through
      // _send/channel.py's hook: a message that goes another way keeps its
      // ticket until the session ends.
      const uint64_t writer = writer_on_stack() ? self_id() : 0;
      ticket = view->segment->issue_ticket(0, writer);
      if (ticket != 0 && writer != 0)
        being_written.emplace_back(view->segment, ticket);
    } catch (const std::exception&) {
      view->segment->pin();
    }
    if (ticket == 0) count(kTicketsUnavailable);
  }
  return py::make_tuple(py::handle(config().hooks.attach_segment),
                        py::make_tuple(py::str(view->segment->locator()),
                                       ticket, view->segment->generation()));
}

namespace {
std::atomic<bool> exiting{false};
std::atomic<int64_t> messages_alive{0};
}  // namespace

void begin_exit() { exiting.store(true); }

// Note [Messages at exit]: once the exit hook began, a message no other
// thread had under way goes by value, unless the interpreter is finalizing
// (then a thread other than the main one sleeps: current_message). So does
// every message of a fork torchshm did not prepare (fork_guard.h).
bool sends_by_value() {
  if (forked_without_hooks()) return true;
  if (!exiting.load()) return false;
  return on_main_thread() || !interpreter_finalizing();
}
int64_t live_messages() { return messages_alive.load(); }
// Counted only off the main thread, which runs the exit hook itself (a
// message of its own that something keeps alive must not delay every exit).
OffMainThreadCount::OffMainThreadCount() : counted_(!on_main_thread()) {
  if (counted_) messages_alive.fetch_add(1);
}
OffMainThreadCount::~OffMainThreadCount() {
  if (counted_) messages_alive.fetch_sub(1);
}

py::object current_message() {
  static PyObject* key = PyUnicode_InternFromString("torchshm.message");
  PyObject* state = PyThreadState_GetDict();  // borrowed
  if (state == nullptr) throw std::runtime_error("no Python thread state");
  PyObject* weak = PyDict_GetItemWithError(state, key);  // borrowed
  if (weak != nullptr) {
    py::object message = referent(py::reinterpret_borrow<py::object>(weak));
    if (!message.is_none()) return message;
  } else if (PyErr_Occurred()) {
    throw py::error_already_set();
  }
  if (exiting.load() && !on_main_thread() && interpreter_finalizing()) {
    PyEval_SaveThread();  // Note [Messages at exit]
    sleep_until_exit();
  }
  // The previous message of this thread is done; if its tickets are still
  // "being written", it never was (see the Note).
  if (!being_written.empty()) end_write(false);
  py::object message =
      py::cast(new Message(), py::return_value_policy::take_ownership);
  if (PyDict_SetItem(state, key, weak_ref(message).ptr()) != 0)
    throw py::error_already_set();
  return message;
}

bool message_writing(uint64_t pipe_inode) {
  if (being_written.empty()) return false;
  if (pipe_inode != 0)
    for (auto& [segment, ticket] : being_written)
      segment->name_channel(ticket, pipe_inode);
  return true;
}

void message_written() {
  if (!being_written.empty()) end_write(true);
}

void message_not_written() {
  if (!being_written.empty()) end_write(false);
}

void forget_written_tickets() { being_written.clear(); }

namespace {

// Note [Counting a message's small arrays]
// Below the threshold, an array is pickled by value until its message has
// carried a threshold's worth of arrays of at least pack_min bytes (see the
// Note above); the count must last exactly as long as the message's pickling.
// numpy's own reduce is (_reconstruct, (type, (0,), b"b"), state), and the
// (0,) is a dummy shape that __setstate__ replaces. We pass a list [0]
// instead: numpy takes any sequence there, pickle memoizes the list, and so
// the pickler's memo holds it until the message is done. The thread keeps it
// too (in its thread-state dict, so it goes with the thread): while anything
// else holds it, this thread is still pickling the same message; once only
// the thread does, a new message starts and the count restarts. Every small
// array of the message carries the same list (written once, then a memo
// reference), and what goes on the wire is numpy's own form, a few bytes
// longer: no wrapper, no extra global, no extra call on load, and a receiver
// without torchshm reads it. (Earlier versions wrapped the reduce in
// rebuild_inline with a token, which cost ~10 us per message in
// benchmarks.micro below: rebuild_inline stays, for their pickles.)
struct SmallCount {
  PyObject* token = nullptr;  // borrowed: the thread-state dict owns it
  int64_t bytes = 0;
};
thread_local SmallCount small_count;

// This thread's small-array token for the message being pickled, with its
// count reset if a new message started.
PyObject* small_token() {
  static PyObject* key = PyUnicode_InternFromString("torchshm.small");
  PyObject* state = PyThreadState_GetDict();  // borrowed
  if (state == nullptr) throw std::runtime_error("no Python thread state");
  PyObject* token = PyDict_GetItemWithError(state, key);  // borrowed
  if (token == nullptr && PyErr_Occurred()) throw py::error_already_set();
  if (token != nullptr && token == small_count.token && Py_REFCNT(token) > 1)
    return token;  // the same message: its memo holds the token
  py::object fresh = py::reinterpret_steal<py::object>(
      Py_BuildValue("[i]", 0));  // numpy's dummy shape, as a list
  if (!fresh || PyDict_SetItem(state, key, fresh.ptr()) != 0)
    throw py::error_already_set();
  small_count = SmallCount{fresh.ptr(), 0};
  return fresh.ptr();
}

// numpy's reduce of `obj` with `token` as its dummy shape (see the Note), or
// null if numpy's reduce does not have the expected form (a subclass's own).
PyObject* reduce_with_token(PyObject* obj, PyObject* token) {
  static PyObject* reduce_name = PyUnicode_InternFromString("__reduce__");
  py::object reduced = py::reinterpret_steal<py::object>(
      PyObject_CallMethodNoArgs(obj, reduce_name));
  if (!reduced) throw py::error_already_set();
  PyObject* r = reduced.ptr();
  if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 3) return nullptr;
  PyObject* args = PyTuple_GET_ITEM(r, 1);
  if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != 3) return nullptr;
  PyObject* shape = PyTuple_GET_ITEM(args, 1);  // numpy's dummy (0,)
  if (!PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) != 1 ||
      !PyLong_CheckExact(PyTuple_GET_ITEM(shape, 0)) ||
      PyLong_AsLong(PyTuple_GET_ITEM(shape, 0)) != 0)
    return nullptr;
  return Py_BuildValue("(O(OOO)O)", PyTuple_GET_ITEM(r, 0),
                       PyTuple_GET_ITEM(args, 0), token,
                       PyTuple_GET_ITEM(args, 2), PyTuple_GET_ITEM(r, 2));
}

// Python's fall_back for a failure of the native path: numpy's reduce, and
// the one warning. Returns nullptr only for a non-Exception (KeyboardInterrupt
// and the like), which must propagate.
PyObject* fall_back(PyObject* obj) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
  PyObject* value = fetch_error();
  PyObject* out = call_hook(config().hooks.fall_back, obj, value);
  Py_XDECREF(value);
  return out;
}

// An array of at least inline_below bytes (`small`: its size if it is below
// the threshold, else -1). Never raises an Exception: a failure goes to
// Python's fall_back (a reducer that raises in a Queue's feeder thread loses
// the message).
PyObject* reduce_through_message(PyObject* obj, int64_t small) {
  try {
    const Config& c = config();
    if (small >= 0) {
      PyObject* token = small_token();
      if (small_count.bytes < c.policy.threshold) {
        if (PyObject* reduced = reduce_with_token(obj, token)) {
          small_count.bytes += small;
          count(kArraysInline);
          return reduced;
        }
        if (PyErr_Occurred()) throw py::error_already_set();
        count(kArraysInline);  // a reduce of another form: as it is
        static PyObject* reduce_name = PyUnicode_InternFromString("__reduce__");
        return PyObject_CallMethodNoArgs(obj, reduce_name);
      }
    }
    // reduce_ndarray checked it: from here on the array, never a handle.
    auto* array = reinterpret_cast<PyArrayObject*>(obj);
    py::object message = current_message();
    Message& m = message.cast<Message&>();
    Placement placed = m.plan.place(array);
    if (placed.kind == Placement::kTorchOwned) {
      py::tuple view = view_args(array, placed.offset);
      PyObject* answer =
          call_hook(c.hooks.reduce_torch_owned, placed.owner.ptr(), view.ptr());
      if (answer == nullptr) throw py::error_already_set();
      if (answer != Py_None) {
        count(kArraysResent);
        return answer;
      }
      Py_DECREF(answer);
      placed = m.plan.copy(array, placed);
    }
    return m.reduce_shared(message, array, placed).release().ptr();
  } catch (abi::__forced_unwind&) {
    throw;  // a thread CPython ends: Note [The GIL at exit] in gil.h
  } catch (...) {
    set_python_error(std::current_exception());
    return fall_back(obj);
  }
}

// See the Note: by size, natively; object and empty arrays go to Python's
// reduce_other, which never raises (torchshm/_send/sender.py).
PyObject* reduce_ndarray(PyObject* /*self*/, PyObject* obj) {
  static PyObject* reduce_name = PyUnicode_InternFromString("__reduce__");
  if (!configured()) {
    PyErr_SetString(PyExc_RuntimeError,
                    "torchshm: the sender is not configured (import torchshm)");
    return nullptr;
  }
  const Config& c = config();
  if (PyArray_Check(obj)) {
    auto* a = reinterpret_cast<PyArrayObject*>(obj);
    if (sends_by_value()) return call_hook(c.hooks.reduce_by_value, obj);
    if (!PyDataType_REFCHK(PyArray_DESCR(a)) && PyArray_SIZE(a) > 0) {
      const int64_t nbytes = PyArray_NBYTES(a);
      if (nbytes < c.policy.inline_below()) {
        count(kArraysInline);
        return PyObject_CallMethodNoArgs(obj, reduce_name);
      }
      return reduce_through_message(obj,
                                    nbytes < c.policy.threshold ? nbytes : -1);
    }
  }
  return call_hook(c.hooks.reduce_other, obj);
}

PyMethodDef fast_reduce_def = {
    "reduce_ndarray", reduce_ndarray, METH_O,
    "torchshm's ForkingPickler reducer for ndarrays (Note [One message, one "
    "snapshot] in csrc/send/message.h)."};

}  // namespace

py::object reduce_ndarray_function() {
  PyObject* fn = PyCFunction_NewEx(&fast_reduce_def, nullptr, nullptr);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

}  // namespace torchshm
