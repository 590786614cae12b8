#include "send/snapshots.h"

#include "base/gil.h"
#include "base/pages.h"
#include "lifetime/identity.h"
#include "lifetime/live.h"
#include "lifetime/private_mappings.h"
#include "lifetime/views.h"
#include "send/array_watch.h"
#include "send/one_copy.h"

namespace torchshm {

std::pair<py::object, int64_t> SnapshotCache::reuse(py::handle key, int64_t lo,
                                                    int64_t hi, int threads) {
  auto found = entries_.find(key.ptr());
  if (found == entries_.end()) return {py::none(), 0};
  const Entry& e = found->second;
  std::shared_ptr<Segment> segment = e.segment.lock();
  if (e.lo != lo || e.hi != hi || segment == nullptr ||
      segment->generation() != e.generation || !segment->snapshot() ||
      segment->unlinked())
    return {py::none(), 0};
  const int64_t at = e.at;
  // The view that keeps it: this process's live one, or a new one with a
  // slot of its own, so that no release elsewhere unlinks it before the
  // message's ticket is issued.
  py::object owner = live_views().get(segment->name());
  if (owner.is_none()) {
    const uint64_t me = self_id();
    const int slot = segment->take_slot(me);
    if (slot < 0) return {py::none(), 0};
    if (segment->unlinked() || segment->generation() != e.generation) {
      segment->release_slot(slot, me);
      return {py::none(), 0};
    }
    owner = py::cast(view_tensor(segment, slot, me));
    live_views().remember(segment->name(), owner, py::none());
  }
  // An array whose pages are this snapshot's (Note [One copy of a sent
  // array] in one_copy.h) equals it where it wrote none of them: only its
  // partial first and last pages are compared.
  const bool adopted = pages_adopted(key, *segment);
  bool same = false;
  {
    // `key` (the caller's array) keeps the bytes alive; `owner` the segment.
    GilReleased no_gil;  // Note [The GIL at exit] in gil.h
    auto equal = [&](int64_t from, int64_t to) {
      return segment->equals(at + (from - lo),
                             reinterpret_cast<const uint8_t*>(from), to - from,
                             threads);
    };
    const PageRange whole = pages_covered(lo, hi);
    if (adopted && whole.bytes() > 0) {
      same = equal(lo, whole.first) && equal(whole.last, hi) &&
             !written_pages(reinterpret_cast<uint8_t*>(whole.first),
                            whole.bytes());
    } else {
      same = equal(lo, hi);
    }
  }
  if (!same) {
    entries_.erase(key.ptr());
    return {py::none(), 0};
  }
  return {owner, at};
}

void SnapshotCache::remember(py::handle key, int64_t lo, int64_t hi,
                             const std::shared_ptr<Segment>& segment,
                             int64_t at) {
  py::object weak;
  try {
    weak = forget_when_gone(  // Note [Knowing that a sent array is gone]
        key, [](PyObject* dead) { snapshots().entries_.erase(dead); });
  } catch (const py::error_already_set&) {
    // No weak references to it (bytes, say): not remembered, the next send
    // copies.
    return;
  }
  entries_[key.ptr()] =
      Entry{std::move(weak), lo, hi, at, segment, segment->generation()};
}

void SnapshotCache::known_as(py::handle buffer, py::object key) {
  py::object watch = forget_when_gone(
      buffer, [](PyObject* dead) { snapshots().aliases_.erase(dead); });
  aliases_[buffer.ptr()] = Alias{std::move(watch), std::move(key)};
}

py::handle SnapshotCache::key_of(py::handle buffer) const {
  const auto found = aliases_.find(buffer.ptr());
  return found == aliases_.end() ? buffer : py::handle(found->second.key);
}

SnapshotCache& snapshots() {
  // Never destroyed: entries hold Python objects, and interpreter exit
  // tears Python down before static destructors run.
  static auto* cache = new SnapshotCache();
  return *cache;
}

}  // namespace torchshm
