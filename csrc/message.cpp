#include "message.h"

#include <frameobject.h>

#include <utility>

#include "errors.h"
#include "identity.h"
#include "numpy_api.h"
#include "segment.h"
#include "stats.h"

namespace torchshm {
namespace {

// Strong references, never released (as SenderHooks in plan.h).
struct Wire {
  PyObject* rebuild_ndarray = nullptr;
  PyObject* attach_segment = nullptr;
  PyObject* message_token = nullptr;
  PyObject* reduce_name = nullptr;  // "__reduce__", interned
};
Wire wire;

struct Channel {
  PyObject* writers = nullptr;     // code object -> finder(frame)
  PyObject* pipe_inode = nullptr;  // (finder, frame) -> inode or 0
  int max_depth = 0;               // a pickler's reduce runs a few frames below
};
Channel channel;

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

// The object a weak reference points to, or None.
py::object deref(const py::object& weak) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(weak.ptr(), &obj) < 0) throw py::error_already_set();
  return obj ? py::reinterpret_steal<py::object>(obj) : py::none();
#else
  return py::reinterpret_borrow<py::object>(PyWeakref_GetObject(weak.ptr()));
#endif
}

py::object weak_ref(const py::object& obj) {
  PyObject* weak = PyWeakref_NewRef(obj.ptr(), nullptr);
  if (weak == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(weak);
}

}  // namespace

py::object Message::share(py::handle self, py::handle array, bool copy) {
  Placement placed = plan.place(array, copy);
  if (placed.name.is_none()) return py::none();
  py::object segment_ref =
      ref(self, std::move(placed.owner), std::move(placed.name));
  return py::make_tuple(
      py::handle(wire.rebuild_ndarray),
      view_args(array, placed.offset, placed.strides, segment_ref));
}

py::object Message::ref(py::handle self, py::object owner, py::object name) {
  std::string key = name.cast<std::string>();
  auto found = refs_.find(key);
  if (found != refs_.end()) {
    py::object existing = deref(found->second);
    if (!existing.is_none()) return existing;
  }
  py::object made =
      py::cast(new SegmentRef{std::move(owner), std::move(name),
                              py::reinterpret_borrow<py::object>(self)},
               py::return_value_policy::take_ownership);
  refs_[std::move(key)] = weak_ref(made);
  return made;
}

py::object Message::token(py::handle self) {
  if (token_) {
    py::object token = deref(token_);
    if (!token.is_none()) return token;
  }
  TORCH_CHECK(wire.message_token != nullptr, "the wire is not configured");
  py::object token = py::reinterpret_borrow<py::object>(wire.message_token)(
      py::reinterpret_borrow<py::object>(self));
  token_ = weak_ref(token);
  return token;
}

py::tuple SegmentRef::reduce() const {
  View* view = view_of(THPVariable_Unpack(owner.ptr()));
  TORCH_CHECK(view != nullptr, "a segment reference without its segment");
  // Raising here would lose the message, so neither lookup may: an unknown
  // pipe only keeps the ticket alive longer (until the session ends), and no
  // ticket means the receiver loads as a second load does (Note [Segment
  // lifetime]), while our view keeps the segment until the message is
  // written.
  uint64_t channel_inode = 0;
  try {
    channel_inode = current_channel();
  } catch (const std::exception&) {
  }
  uint64_t ticket = 0;
  if (!view->segment->unlinked()) {
    // A writer to watch only where the write is known to return through
    // _channel.py's hook: a message that went another way keeps its ticket.
    try {
      const uint64_t writer = channel_inode ? self_id() : 0;
      ticket = view->segment->issue_ticket(channel_inode, writer);
      if (ticket != 0 && writer != 0)
        being_written.emplace_back(view->segment, ticket);
    } catch (const std::exception&) {
      // No ticket: the receiver loads as a second load does.
      view->segment->pin();
    }
    if (ticket == 0) count(kTicketsUnavailable);
  }
  return py::make_tuple(py::handle(wire.attach_segment),
                        py::make_tuple(py::str(view->segment->locator()),
                                       ticket, view->segment->generation()));
}

py::object current_message() {
  static PyObject* key = PyUnicode_InternFromString("torchshm.message");
  PyObject* state = PyThreadState_GetDict();  // borrowed
  if (state == nullptr) throw std::runtime_error("no Python thread state");
  PyObject* weak = PyDict_GetItemWithError(state, key);  // borrowed
  if (weak != nullptr) {
    py::object message = deref(py::reinterpret_borrow<py::object>(weak));
    if (!message.is_none()) return message;
  } else if (PyErr_Occurred()) {
    throw py::error_already_set();
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

void message_written() {
  if (!being_written.empty()) end_write(true);
}

void message_not_written() {
  if (!being_written.empty()) end_write(false);
}

void forget_written_tickets() { being_written.clear(); }

uint64_t current_channel() {
  if (channel.writers == nullptr) return 0;
  PyFrameObject* top = PyEval_GetFrame();  // borrowed
  Py_XINCREF(top);
  py::object frame =
      py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(top));
  for (int depth = 0; frame && depth < channel.max_depth; ++depth) {
    auto* f = reinterpret_cast<PyFrameObject*>(frame.ptr());
    py::object code = py::reinterpret_steal<py::object>(
        reinterpret_cast<PyObject*>(PyFrame_GetCode(f)));
    PyObject* find = PyDict_GetItemWithError(channel.writers, code.ptr());
    if (find != nullptr)
      return py::reinterpret_borrow<py::object>(channel.pipe_inode)(
                 py::handle(find), frame)
          .cast<uint64_t>();
    if (PyErr_Occurred()) throw py::error_already_set();
    frame = py::reinterpret_steal<py::object>(
        reinterpret_cast<PyObject*>(PyFrame_GetBack(f)));
  }
  return 0;
}

void configure_wire(py::object rebuild_ndarray, py::object attach_segment,
                    py::object message_token) {
  Py_XSETREF(wire.rebuild_ndarray, rebuild_ndarray.release().ptr());
  Py_XSETREF(wire.attach_segment, attach_segment.release().ptr());
  Py_XSETREF(wire.message_token, message_token.release().ptr());
  if (wire.reduce_name == nullptr)
    wire.reduce_name = PyUnicode_InternFromString("__reduce__");
}

void configure_channel(py::object writers, py::object pipe_inode,
                       int max_depth) {
  TORCH_CHECK(PyDict_Check(writers.ptr()), "expected a dict of writers");
  Py_XSETREF(channel.writers, writers.release().ptr());
  Py_XSETREF(channel.pipe_inode, pipe_inode.release().ptr());
  channel.max_depth = max_depth;
}

namespace {

// An array at or above the threshold, through the thread's message. Never
// raises an Exception: a failure goes to Python's fall_back (a reducer that
// raises in a Queue's feeder thread loses the message).
PyObject* share_natively(PyObject* obj) {
  const SenderHooks& hooks = sender_hooks();
  try {
    py::object message = current_message();
    py::object reduced = message.cast<Message&>().share(message, obj, false);
    if (!reduced.is_none()) return reduced.release().ptr();
  } catch (...) {
    set_python_error(std::current_exception());
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != nullptr) PyException_SetTraceback(value, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    PyObject* out =
        PyObject_CallFunctionObjArgs(hooks.fall_back, obj, value, nullptr);
    Py_XDECREF(value);
    return out;
  }
  // Memory a torch tensor owns that torchshm did not make: Python decides.
  return PyObject_CallOneArg(hooks.policy_reducer, obj);
}

// Small non-object arrays: numpy's own reduce, counted as inline. Arrays at
// or above the threshold: shared without entering Python. Every other array
// (packed, empty, object dtype, over torch memory) goes to Python's policy
// reducer, which never raises (torchshm/_sender.py: reduce_ndarray).
PyObject* fast_reduce(PyObject* /*self*/, PyObject* obj) {
  const SenderHooks& hooks = sender_hooks();
  if (hooks.policy_reducer == nullptr || wire.rebuild_ndarray == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "torchshm: the sender is not configured (import torchshm)");
    return nullptr;
  }
  if (PyArray_Check(obj)) {
    auto* a = reinterpret_cast<PyArrayObject*>(obj);
    if (!PyDataType_REFCHK(PyArray_DESCR(a)) && PyArray_SIZE(a) > 0) {
      const SenderPolicy& policy = sender_policy();
      const int64_t nbytes = PyArray_NBYTES(a);
      if (nbytes < policy.inline_below) {
        count(kArraysInline);
        return PyObject_CallMethodNoArgs(obj, wire.reduce_name);
      }
      if (nbytes >= policy.threshold) return share_natively(obj);
    }
  }
  return PyObject_CallOneArg(hooks.policy_reducer, obj);
}

PyMethodDef fast_reduce_def = {
    "reduce_ndarray", fast_reduce, METH_O,
    "torchshm's ForkingPickler reducer for ndarrays: below the inline bound "
    "numpy's own reduce, from the threshold up shared natively, else "
    "torchshm._sender.reduce_ndarray."};

}  // namespace

py::object fast_reducer() {
  PyObject* fn = PyCFunction_NewEx(&fast_reduce_def, nullptr, nullptr);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

}  // namespace torchshm
