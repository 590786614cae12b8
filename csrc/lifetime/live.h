// This process's live views, by segment name (Note [Live views]).
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "base/torch_api.h"

namespace torchshm {

// The object a weak reference points to, or None if it is dead.
py::object referent(const py::object& weak);
// A weak reference to `owner`, calling `callback` (None: nothing) when it dies.
py::object weak_ref(py::handle owner, py::handle callback = py::none());
// A weak reference to `owner` that calls `forget(owner's address)` when it
// dies (an exception forget throws is reported as unraisable). For tables keyed
// by an object's address, one entry per sent array: its callback is a plain
// builtin bound to the address, where a py::cpp_function formats its signature
// each time it is made (Note [A weak reference per sent array] in live.cpp).
py::object weak_ref_forgetting(py::handle owner, void (*forget)(PyObject*));

// Note [Live views]
// A process keeps one view tensor per segment it uses: a segment arriving
// again is rebuilt over the same view, so arrays over it stay aliased (torch's
// shared_cache does the same), and before fork the parent takes a slot for
// the child in every segment it has a live view of (Note [Fork] in
// torchshm/_lifetime/lifecycle.py). The table holds weak references: a view
// dies with its last array. Both languages write it: Python when it allocates
// or attaches, the sender's plan when it takes a pooled segment without
// entering Python (Note [Segment pool]). So it lives here, and every
// operation is one native call under the GIL that runs no Python code: no
// thread ever sees it half-changed, and Python iterates snapshots (owners()),
// never the table.
// An entry also holds the slot-owning view's storage weakly: arrays may live
// on over aliases of it (read-only and private mappings, segment.h) after
// the view's own tensor died, and they hold the segment as much as it did.
// Then get() and owners() give a new tensor over that storage.
class LiveViews {
 public:
  // The live view of segment `name`, or None.
  py::object get(const std::string& name);
  // Records `owner` as the view of `name`; `callback` (or None) runs when
  // it dies. Dead entries are dropped whenever the table doubled since the
  // last pass, so it stays within twice the live views.
  void remember(const std::string& name, py::handle owner, py::handle callback);
  // Drops `name` if its view is dead.
  void forget_if_dead(const std::string& name);
  // The live views, a snapshot.
  std::vector<py::object> owners() const;
  // Drops every dead entry.
  void prune();
  void clear();
  size_t size() const { return refs_.size(); }

 private:
  struct Entry {
    py::object weak;  // the tensor remembered last
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  // A live tensor of `entry`, or None; `revived` says it is a new one.
  static py::object live(const Entry& entry, bool* revived = nullptr);
  std::unordered_map<std::string, Entry> refs_;
  size_t prune_at_ = 64;
};

LiveViews& live_views();

}  // namespace torchshm
