// A segment's private (copy-on-write) mappings and its read-only one (Note
// [Snapshots are mapped privately] in segment.h): made, lent, walked for
// the pages this process wrote (private_mappings.h) and lent again.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "base/pages.h"
#include "base/parallel.h"
#include "base/stats.h"
#include "lifetime/fork_guard.h"
#include "lifetime/private_mappings.h"
#include "lifetime/segment.h"

namespace torchshm {

namespace {

// Below this, one thread walks the page table (Segment::take_private).
constexpr int64_t kMinScanPerThread = 64 << 20;

}  // namespace

void Segment::mark_snapshot() { header()->snapshot.store(1); }

bool Segment::snapshot() const { return header()->snapshot.load() != 0; }

bool Segment::freeze_data() {
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  if (data_frozen_) return true;
  const int fd = fd_.load();
  // Note [A registered mapping stays as it is] (segment.h).
  if (fd < 0 || lost() || held_for_device_) return false;
  const auto n = static_cast<size_t>(capacity_);
  const auto at = static_cast<int64_t>(kHeaderBytes);
  // The shared mapping's pages are parked, mapped, for thaw_data: a
  // DataLoader worker's next batch then writes into them without a fault,
  // and neither side of the freeze tears down or faults in 8192 pages per
  // 32 MiB (2.1 ms against 0.23 ms a freeze and thaw, /tmp C program,
  // 2-core reference machine, busy). Else the mapping is replaced.
  parked_ = static_cast<uint8_t*>(park_tracked(data(), n, fd, at));
  if (parked_ == nullptr && !remap_tracked(data(), n, MAP_PRIVATE, fd, at))
    return false;
  data_frozen_ = true;
  mark_snapshot();
  return true;
}

bool Segment::hold_for_device() {
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  if (data_frozen_) return false;
  held_for_device_ = true;
  return true;
}

void Segment::release_for_device() {
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  held_for_device_ = false;
}

bool Segment::data_frozen() const {
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  return data_frozen_;
}

bool Segment::frozen_written(int64_t lo, int64_t hi) {
  if (!data_frozen() || hi <= lo) return false;
  const PageRange touched = pages_touched(lo, hi);
  const int64_t end = std::min<int64_t>(touched.last, capacity_);
  return written_pages(data() + touched.first, end - touched.first);
}

bool Segment::thaw_data() {
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  if (!data_frozen_) return true;
  const auto n = static_cast<size_t>(capacity_);
  if (parked_ != nullptr) {
    // Back where they were, mapped and writable (see freeze_data).
    const bool moved = unpark_tracked(parked_, data(), n);
    if (!moved) unmap_tracked(parked_, n);  // the file's pages: none lost
    parked_ = nullptr;
    if (moved) {
      data_frozen_ = false;
      return true;
    }
  }
  // Populated: the next generation is written into every page at once (a
  // DataLoader worker's next batch), and 8192 separate faults per 32 MiB
  // cost more than the batch's copy (np.stack batches: 140 -> 55 ms an
  // epoch of 512 MiB, 2 workers). Every data page is backed since the
  // segment was made (populate_pages), so this maps pages, allocates none.
  const int fd = fd_.load();
  if (fd < 0 || !remap_tracked(data(), n, MAP_SHARED | MAP_POPULATE, fd,
                               static_cast<int64_t>(kHeaderBytes)))
    return false;
  data_frozen_ = false;
  return true;
}

bool Segment::map_data_over(void* p, int64_t at, int64_t n) {
  const int fd = fd_.load();
  if (fd < 0 || lost() || at < 0 || n <= 0 || at + n > capacity_) return false;
  return remap_untracked(p, static_cast<size_t>(n), fd,
                         static_cast<int64_t>(kHeaderBytes) + at);
}

uint8_t* Segment::map_private(int fd) const {
  const size_t n = mapped_bytes_ - kHeaderBytes;
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd,
                   static_cast<off_t>(kHeaderBytes));
  if (p == MAP_FAILED) return nullptr;
  track_mapping(p, n);
  return static_cast<uint8_t*>(p);
}

uint8_t* Segment::readonly_mapping(int threads) {
  {
    std::lock_guard<std::mutex> guard(mappings_mutex_);
    if (readonly_ != nullptr) {
      if (readonly_generation_ != generation()) {
        // The pool reused the segment: no array over the old generation is
        // alive here, and pages this process wrote must read the new one.
        if (!readonly_clean_.unchanged()) drop_written(readonly_, threads);
        readonly_generation_ = generation();
        readonly_clean_ = WriteWatch::now();
      }
      return readonly_;
    }
  }
  uint8_t* fresh = take_private(threads);  // clean: fresh or walked
  if (fresh == nullptr) return nullptr;
  {
    std::lock_guard<std::mutex> guard(mappings_mutex_);
    if (readonly_ == nullptr) {
      readonly_ = fresh;
      readonly_generation_ = generation();
      readonly_clean_ = WriteWatch::now();
      return fresh;
    }
  }
  give_back_private(fresh, /*written=*/false);  // another thread came first
  return readonly_mapping(threads);
}

bool Segment::readonly_written(int64_t lo, int64_t hi) {
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  if (readonly_ == nullptr || hi <= lo || readonly_clean_.unchanged())
    return false;
  return written_pages(readonly_ + lo, hi - lo);
}

void Segment::drop_written(uint8_t* data, int threads) {
  count(kPrivateMappingsWalked);
  // The mapping reads the segment's pages again where this process wrote
  // (MADV_DONTNEED on a private file mapping). All of it: a view's .base
  // tensor spans the whole data, not only its arrays.
  parallel_chunks(capacity_, threads, kMinScanPerThread, kPageBytes,
                  [&](int64_t begin, int64_t len) {
                    drop_written_pages(data + begin, static_cast<size_t>(len));
                  });
}

uint8_t* Segment::take_private(int threads) {
  uint8_t* idle = nullptr;
  bool written = false;
  {
    std::unique_lock<std::mutex> guard(mappings_mutex_);
    // This process's walk ends soon; a walk of another (the parent's, in a
    // forked child) never will here: that mapping is walked now instead.
    walked_.wait(guard, [&] {
      return walking_ == nullptr || walking_pid_ != ::getpid() ||
             idle_private_.load() != nullptr;
    });
    idle = idle_private_.exchange(nullptr);
    written = idle_written_;
    if (idle == nullptr && walking_ != nullptr) {
      idle = std::exchange(walking_, nullptr);
      written = true;
    }
  }
  if (idle != nullptr) {
    if (written) drop_written(idle, threads);
    return idle;
  }
  const int fd = fd_.load();
  return fd >= 0 ? map_private(fd) : nullptr;
}

bool Segment::private_ready() const {
  if (idle_private_.load() != nullptr || fd_.load() >= 0) return true;
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  return walking_ != nullptr;
}

void Segment::give_back_private(uint8_t* data, bool written) {
  uint8_t* walked = nullptr;
  {
    std::lock_guard<std::mutex> guard(mappings_mutex_);
    if (idle_private_.load() == nullptr && walking_ == nullptr) {
      if (!written) {
        idle_written_ = false;
        idle_private_.store(data);
        return;
      }
      walked = walking_ = std::exchange(data, nullptr);
      walking_pid_ = ::getpid();
    }
  }
  if (data != nullptr) {  // one mapping is kept, idle or being walked
    unmap_tracked(data, mapped_bytes_ - kHeaderBytes);
    return;
  }
  // Off the receiver's path: the next message over this segment waits for
  // the walk only if it comes before the walk is done. A thread named as
  // Note [Threads at fork] asks; where none can start, the walk runs here.
  const bool started =
      start_detached_worker([self = shared_from_this(), walked] {
        self->drop_written(walked, 1);
        self->walk_done(walked);
      });
  if (!started) {
    drop_written(walked, 1);
    walk_done(walked);
  }
}

void Segment::walk_done(uint8_t* data) {
  {
    std::lock_guard<std::mutex> guard(mappings_mutex_);
    if (walking_ != data) return;  // taken meanwhile (walked there too)
    walking_ = nullptr;
    if (idle_private_.load() == nullptr) {
      idle_written_ = false;
      idle_private_.store(data);
      data = nullptr;
    }
  }
  walked_.notify_all();
  if (data != nullptr) unmap_tracked(data, mapped_bytes_ - kHeaderBytes);
}

void Segment::adopt_private(Segment& other) {
  TORCH_CHECK(other.uid_ == uid_ && other.mapped_bytes_ == mapped_bytes_,
              "expected another mapping of segment ", name_, ", got ",
              other.name_);
  if (uint8_t* p = other.idle_private_.exchange(nullptr))
    give_back_private(p, /*written=*/false);
}

}  // namespace torchshm
