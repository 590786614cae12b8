#include "lifetime/pool.h"

#include <time.h>

#include <algorithm>
#include <limits>

#include "lifetime/identity.h"
#include "lifetime/views.h"

namespace torchshm {

double monotonic_seconds() {
  struct timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) +
         1e-9 * static_cast<double>(ts.tv_nsec);
}

namespace {

// No local view and no slot but the pool's own (slot 0): no system call.
bool quiet(const Segment& segment) {
  return segment.local_views() == 0 && segment.holders() == 1;
}

// Nothing but the pool holds it; clears dead holders' slots on the way.
bool idle(Segment& segment) {
  return segment.local_views() == 0 && !segment.has_live_holder(0);
}

}  // namespace

int64_t SegmentPool::size_class(int64_t nbytes) const {
  if (nbytes <= classes_.min_class) return classes_.min_class;
  const int bits = 64 - __builtin_clzll(static_cast<uint64_t>(nbytes - 1));
  const int64_t step =
      std::max(classes_.min_class, (int64_t{1} << bits) / classes_.steps);
  return (nbytes + step - 1) / step * step;
}

at::Tensor SegmentPool::take(int64_t nbytes, bool thorough) {
  const int64_t wanted = size_class(nbytes);
  const double largest = static_cast<double>(wanted) * classes_.max_waste;
  for (auto it = by_class_.lower_bound(wanted);
       it != by_class_.end() && static_cast<double>(it->first) <= largest;
       ++it) {
    Class& cls = it->second;
    const uint64_t events = pooled_last_views();
    if (!thorough && cls.all_busy_at == events) continue;
    bool all_busy = true;
    for (Entry& entry : cls.entries) {
      Segment& segment = *entry.segment;
      all_busy = all_busy && segment.local_views() > 0;
      if ((thorough || quiet(segment)) && segment.reserve_for_reuse(0)) {
        entry.last_use = monotonic_seconds();
        cls.all_busy_at = ~uint64_t{0};
        return view_tensor(entry.segment, -1, self_id());
      }
    }
    cls.all_busy_at = all_busy ? events : ~uint64_t{0};
  }
  return at::Tensor();
}

at::Tensor SegmentPool::admit(std::shared_ptr<Segment> segment) {
  TORCH_CHECK(get(segment->name()) == nullptr, "segment ", segment->name(),
              " is pooled already");
  nbytes_ += segment->capacity();
  segment->pooled.store(true);
  // Its view is made below: the class's memo (every entry busy) holds.
  by_class_[segment->capacity()].entries.push_back(
      Entry{segment, monotonic_seconds()});
  return view_tensor(std::move(segment), -1, self_id());
}

std::shared_ptr<Segment> SegmentPool::get(const std::string& name) const {
  for (const auto& [capacity, cls] : by_class_)
    for (const Entry& entry : cls.entries)
      if (entry.segment->name() == name) return entry.segment;
  return nullptr;
}

int64_t SegmentPool::drop(std::vector<Entry>& entries, size_t index) {
  std::shared_ptr<Segment> segment = std::move(entries[index].segment);
  entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(index));
  nbytes_ -= segment->capacity();
  segment->pooled.store(false);
  segment->release_slot(0, self_id());
  return segment->capacity();
}

int64_t SegmentPool::release_idle(double older_than) {
  const double now = monotonic_seconds();
  int64_t freed = 0;
  for (auto it = by_class_.begin(); it != by_class_.end();) {
    auto& entries = it->second.entries;
    for (size_t i = 0; i < entries.size();) {
      if (now - entries[i].last_use >= older_than && idle(*entries[i].segment))
        freed += drop(entries, i);
      else
        ++i;
    }
    it = entries.empty() ? by_class_.erase(it) : std::next(it);
  }
  return freed;
}

void SegmentPool::release_all() {
  for (auto& [capacity, cls] : by_class_)
    while (!cls.entries.empty()) drop(cls.entries, cls.entries.size() - 1);
  by_class_.clear();
}

double SegmentPool::oldest_quiet_use() const {
  double oldest = std::numeric_limits<double>::infinity();
  for (const auto& [capacity, cls] : by_class_)
    for (const Entry& entry : cls.entries)
      if (entry.segment->local_views() == 0)
        oldest = std::min(oldest, entry.last_use);
  return oldest;
}

void SegmentPool::forget() {
  for (auto& [capacity, cls] : by_class_)
    for (Entry& entry : cls.entries) entry.segment->pooled.store(false);
  by_class_.clear();
  nbytes_ = 0;
  fast_until = 0;
}

size_t SegmentPool::size() const {
  size_t n = 0;
  for (const auto& [capacity, cls] : by_class_) n += cls.entries.size();
  return n;
}

std::vector<std::string> SegmentPool::names() const {
  std::vector<std::string> out;
  for (const auto& [capacity, cls] : by_class_)
    for (const Entry& entry : cls.entries) out.push_back(entry.segment->name());
  return out;
}

}  // namespace torchshm
