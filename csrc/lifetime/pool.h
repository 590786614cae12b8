// The sender's pool of segments: the index, and taking one without a race.
//
// Note [Segment pool]
// A sender keeps the segments it created and reuses one once nothing but its
// pool holds it (Note [Segment lifetime] in segment.h). This is the
// mechanism; torchshm/_lifetime/pool.py is the policy: what to admit (the
// session's budget), when to release, the size classes, and when the
// once-a-second thorough pass is due.
// - Every operation is one call under the GIL, and `take` makes the taken
//   segment's view in the same call. A segment is free while no local view
//   is alive, so no other thread, Python or native, can take it twice.
// - `take` looks only at quiet segments (no local view, no slot but the
//   pool's: no system call), unless asked to be thorough: then it also asks
//   whether the holders of busy ones still live (clearing dead ones' slots),
//   which the policy does about once a second.
// - A size class whose every segment had a local view when `take` last
//   looked is not looked at again until a pooled segment's last local view
//   dies (a counter the views bump): only that can make one of them quiet.
//   So arrays kept alive, however many, cost a take O(classes), not
//   O(segments).
// - The sender's plan (Note [Sender plan]) takes a chunk from here without
//   entering Python while `fast_until` is in the future; Python sets it, and
//   resets it to 0 whenever its own bookkeeping must run first (a thorough
//   pass is due, the expiry timer is stopped, a fork is under way). The plan
//   then calls Python's allocate, which does that bookkeeping.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/torch_api.h"
#include "lifetime/segment.h"

namespace torchshm {

// Seconds on the clock Python's time.monotonic() reads.
double monotonic_seconds();

// Python's numbers (torchshm/_lifetime/pool.py), handed to the constructor.
struct PoolClasses {
  // Sizes round up to 1/steps of their power of two, from min_class up.
  int64_t min_class;
  int64_t steps;
  // take() accepts a class up to this much larger than the one wanted.
  double max_waste;
};

class SegmentPool {
 public:
  explicit SegmentPool(PoolClasses classes) : classes_(classes) {}

  int64_t size_class(int64_t nbytes) const;
  // A view (owning no slot) over an idle pooled segment that fits nbytes,
  // its generation bumped for reuse; undefined if none is idle.
  at::Tensor take(int64_t nbytes, bool thorough);
  // Pools a segment this process created (its slot 0 is the pool's) and
  // returns its first view, owning no slot.
  at::Tensor admit(std::shared_ptr<Segment> segment);
  std::shared_ptr<Segment> get(const std::string& name) const;
  // Releases segments idle for `older_than` seconds; the bytes freed.
  int64_t release_idle(double older_than);
  // When (monotonic seconds) the first segment with no local view was
  // last used: none can be released before that plus the idle time.
  // Infinity if every segment has a local view.
  double oldest_quiet_use() const;
  // Releases the pool's slot of every segment (this process is exiting).
  void release_all();
  // Forgets every segment without releasing (a forked child: the slots are
  // the parent's pool's).
  void forget();

  int64_t nbytes() const { return nbytes_; }
  size_t size() const;
  std::vector<std::string> names() const;

  // Until when (monotonic seconds) the plan may take without Python's
  // bookkeeping (see the Note).
  double fast_until = 0;

 private:
  struct Entry {
    std::shared_ptr<Segment> segment;
    double last_use;
  };
  int64_t drop(std::vector<Entry>& entries, size_t index);

  struct Class {
    std::vector<Entry> entries;
    // pooled_last_views() when a take last found every entry with a local view;
    // ~0 when it did not (see the Note).
    uint64_t all_busy_at = ~uint64_t{0};
  };

  PoolClasses classes_;
  std::map<int64_t, Class> by_class_;  // capacity -> entries
  int64_t nbytes_ = 0;
};

}  // namespace torchshm
