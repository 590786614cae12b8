#include "live.h"

#include <algorithm>

namespace torchshm {
namespace {

// The referent of a weak reference (a new reference), or None.
py::object referent(const py::object& weak) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(weak.ptr(), &obj) < 0) throw py::error_already_set();
  return obj ? py::reinterpret_steal<py::object>(obj) : py::none();
#else
  return py::reinterpret_borrow<py::object>(PyWeakref_GetObject(weak.ptr()));
#endif
}

}  // namespace

py::object LiveViews::get(const std::string& name) const {
  auto found = refs_.find(name);
  return found == refs_.end() ? py::none() : referent(found->second);
}

void LiveViews::remember(const std::string& name, py::handle owner,
                         py::handle callback) {
  PyObject* weak = PyWeakref_NewRef(
      owner.ptr(), callback.is_none() ? nullptr : callback.ptr());
  if (weak == nullptr) throw py::error_already_set();
  refs_[name] = py::reinterpret_steal<py::object>(weak);
  if (refs_.size() > prune_at_) {
    prune();
    prune_at_ = std::max<size_t>(64, 2 * refs_.size());
  }
}

void LiveViews::forget_if_dead(const std::string& name) {
  auto found = refs_.find(name);
  if (found != refs_.end() && referent(found->second).is_none())
    refs_.erase(found);
}

std::vector<py::object> LiveViews::owners() const {
  std::vector<py::object> out;
  for (const auto& [name, weak] : refs_) {
    py::object owner = referent(weak);
    if (!owner.is_none()) out.push_back(std::move(owner));
  }
  return out;
}

void LiveViews::prune() {
  for (auto it = refs_.begin(); it != refs_.end();) {
    if (referent(it->second).is_none())
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
