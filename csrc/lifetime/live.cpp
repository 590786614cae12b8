#include "lifetime/live.h"

#include <algorithm>

#include "base/errors.h"
#include "base/python_compat.h"
#include "lifetime/segment.h"
#include "lifetime/views.h"

namespace torchshm {

py::object referent(const py::object& weak) {
  bool failed = false;
  PyObject* obj = weak_referent(weak.ptr(), &failed);
  if (failed) throw py::error_already_set();
  return obj ? py::reinterpret_steal<py::object>(obj) : py::none();
}

py::object weak_ref(py::handle owner, py::handle callback) {
  PyObject* weak = PyWeakref_NewRef(
      owner.ptr(), callback.is_none() ? nullptr : callback.ptr());
  if (weak == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(weak);
}

// Note [A weak reference per sent array]
// The sender remembers every array it copies (send/snapshots.h) and every
// array whose pages it adopts (send/one_copy.h), each under a weak
// reference whose callback forgets it. Made as a py::cpp_function, that
// callback was a large part of placing a 1 KiB array in its message's
// chunk: pybind11 builds a function record and formats a signature string
// per function made. A builtin bound to a pair of ints (forget's address
// and the key's) costs three allocations.
namespace {

PyObject* call_forget(PyObject* bound, PyObject* /*weak*/) {
  auto* forget = reinterpret_cast<void (*)(PyObject*)>(
      PyLong_AsVoidPtr(PyTuple_GET_ITEM(bound, 0)));
  try {
    forget(
        static_cast<PyObject*>(PyLong_AsVoidPtr(PyTuple_GET_ITEM(bound, 1))));
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef forget_def = {"torchshm_forget", call_forget, METH_O,
                          "Forgets what torchshm remembered of a dead object."};

}  // namespace

py::object weak_ref_forgetting(py::handle owner, void (*forget)(PyObject*)) {
  py::object bound = py::reinterpret_steal<py::object>(
      Py_BuildValue("(NN)", PyLong_FromVoidPtr(reinterpret_cast<void*>(forget)),
                    PyLong_FromVoidPtr(owner.ptr())));
  if (!bound) throw py::error_already_set();
  py::object callback = py::reinterpret_steal<py::object>(
      PyCFunction_New(&forget_def, bound.ptr()));
  if (!callback) throw py::error_already_set();
  return weak_ref(owner, callback);
}

py::object LiveViews::live(const Entry& entry, bool* revived) {
  py::object owner = referent(entry.weak);
  if (!owner.is_none()) return owner;
  c10::intrusive_ptr<c10::StorageImpl> storage = entry.storage.lock();
  if (!storage) return py::none();
  if (revived != nullptr) *revived = true;
  return py::cast(tensor_of(at::Storage(std::move(storage))));
}

py::object LiveViews::get(const std::string& name) {
  auto found = refs_.find(name);
  if (found == refs_.end()) return py::none();
  bool revived = false;
  py::object owner = live(found->second, &revived);
  // Remembered, so that the next message over it is rebuilt over it too.
  if (revived) found->second.weak = weak_ref(owner, py::none());
  return owner;
}

void LiveViews::remember(const std::string& name, py::handle owner,
                         py::handle callback) {
  const at::Storage storage = slot_owner_storage(unpack_tensor(owner));
  refs_.insert_or_assign(
      name, Entry{weak_ref(owner, callback), storage.getWeakStorageImpl()});
  if (refs_.size() > prune_at_) {
    prune();
    prune_at_ = std::max<size_t>(64, 2 * refs_.size());
  }
}

void LiveViews::forget_if_dead(const std::string& name) {
  auto found = refs_.find(name);
  if (found != refs_.end() && live(found->second).is_none()) refs_.erase(found);
}

std::vector<py::object> LiveViews::owners() const {
  std::vector<py::object> out;
  for (const auto& [name, entry] : refs_) {
    py::object owner = live(entry);
    if (!owner.is_none()) out.push_back(std::move(owner));
  }
  return out;
}

void LiveViews::prune() {
  for (auto it = refs_.begin(); it != refs_.end();) {
    if (live(it->second).is_none())
      it = refs_.erase(it);
    else
      ++it;
  }
}

void LiveViews::clear() { refs_.clear(); }

LiveViews& live_views() {
  // Never destroyed: weak references must not be freed after the
  // interpreter is gone.
  static auto* views = new LiveViews();
  return *views;
}

}  // namespace torchshm
