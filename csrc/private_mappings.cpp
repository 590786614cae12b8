// A snapshot's private (copy-on-write) mappings and a segment's read-only
// one (Note [Snapshots are mapped privately] in segment.h), and finding the
// pages a process wrote through a private mapping (Note [Knowing that
// nothing was written] in private_mappings.h).
#include "private_mappings.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <utility>
#include <vector>

#include "fork_guard.h"
#include "parallel.h"
#include "segment.h"
#include "stats.h"
#include "views.h"

namespace torchshm {

namespace {

// Below this, one thread walks the page table (Segment::take_private).
constexpr int64_t kMinScanPerThread = 64 << 20;

// The PAGEMAP_SCAN ioctl of /proc/self/pagemap (Linux 6.7), spelled here:
// older kernel headers lack it.
struct PageRegion {
  uint64_t start, end, categories;
};
struct PagemapScan {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages,
      category_inverted, category_mask, category_anyof_mask, return_mask;
};
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PagemapScan);
constexpr uint64_t kPageIsFile = 1 << 2, kPageIsPresent = 1 << 3,
                   kPageIsSwapped = 1 << 4;

// Whether this kernel has PAGEMAP_SCAN; it answers ENOTTY or EINVAL once.
std::atomic<bool> pagemap_scan_works{true};

// Calls f(run, bytes) for each run of pages in [p, p + n) that this process
// wrote through a MAP_PRIVATE file mapping: the page table says such a page
// is present but no longer the file's, or swapped out (only anonymous pages
// swap). The kernel finds the runs (PAGEMAP_SCAN), or, before Linux 6.7,
// this reads a word per page of /proc/self/pagemap: 7-9 ms per 400 MB
// against 5-8 ms, 2-core reference machine. Without pagemap, the whole range
// counts as written. f returns false to stop.
template <typename F>
void for_each_written_run(uint8_t* p, size_t n, F f) {
  constexpr uint64_t kPresent = 1ULL << 63, kSwapped = 1ULL << 62,
                     kFile = 1ULL << 61;
  auto* first = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(p) &
                                           ~(kPageBytes - 1));
  const size_t pages = (p + n - first + kPageBytes - 1) / kPageBytes;
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    f(first, pages * kPageBytes);
    return;
  }
  const auto from = reinterpret_cast<uint64_t>(first);
  const uint64_t to = from + pages * kPageBytes;
  if (pagemap_scan_works.load()) {
    PageRegion runs[64];
    PagemapScan scan{};
    scan.size = sizeof(scan);
    scan.vec = reinterpret_cast<uint64_t>(runs);
    scan.vec_len = 64;
    // Not the file's, and present or swapped.
    scan.category_inverted = kPageIsFile;
    scan.category_mask = kPageIsFile;
    scan.category_anyof_mask = kPageIsPresent | kPageIsSwapped;
    scan.return_mask = kPageIsFile | kPageIsPresent | kPageIsSwapped;
    bool go_on = true;
    for (uint64_t at = from; at < to && go_on;) {
      scan.start = at;
      scan.end = to;
      const int got = ::ioctl(fd, kPagemapScan, &scan);
      if (got < 0) {
        if (errno == EINTR) continue;
        if (at == from && (errno == ENOTTY || errno == EINVAL)) {
          pagemap_scan_works.store(false);
          break;  // the word-per-page way below
        }
        go_on = f(reinterpret_cast<uint8_t*>(at), to - at);
        ::close(fd);
        return;
      }
      for (int i = 0; i < got && go_on; ++i)
        go_on = f(reinterpret_cast<uint8_t*>(runs[i].start),
                  runs[i].end - runs[i].start);
      at = scan.walk_end > at ? scan.walk_end : to;
    }
    if (pagemap_scan_works.load()) {
      ::close(fd);
      return;
    }
  }
  std::vector<uint64_t> entries(std::min<size_t>(pages, 1 << 16));
  uint8_t* run = nullptr;
  bool go_on = true;
  for (size_t done = 0; done < pages && go_on;) {
    const size_t want = std::min(entries.size(), pages - done);
    const off_t at = static_cast<off_t>((from / kPageBytes + done) * 8);
    const ssize_t got = ::pread(fd, entries.data(), want * 8, at);
    if (got <= 0) {  // unreadable: count the rest as written
      if (run == nullptr) run = first + done * kPageBytes;
      done = pages;
      break;
    }
    for (size_t i = 0; i < static_cast<size_t>(got) / 8 && go_on; ++i) {
      const uint64_t e = entries[i];
      const bool written = (e & kSwapped) || ((e & kPresent) && !(e & kFile));
      uint8_t* page = first + (done + i) * kPageBytes;
      if (written && run == nullptr) run = page;
      if (!written && run != nullptr) {
        go_on = f(run, static_cast<size_t>(page - run));
        run = nullptr;
      }
    }
    done += static_cast<size_t>(got) / 8;
  }
  ::close(fd);
  if (go_on && run != nullptr)
    f(run, static_cast<size_t>(first + pages * kPageBytes - run));
}

}  // namespace

void Segment::mark_snapshot() { header()->snapshot.store(1); }

bool Segment::snapshot() const { return header()->snapshot.load() != 0; }

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
                    for_each_written_run(data + begin, static_cast<size_t>(len),
                                         [](uint8_t* run, size_t bytes) {
                                           ::madvise(run, bytes, MADV_DONTNEED);
                                           return true;
                                         });
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

WriteWatch WriteWatch::now() {
  struct rusage usage;
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return WriteWatch{};
  return WriteWatch{::getpid(), usage.ru_minflt + usage.ru_majflt};
}

bool WriteWatch::unchanged() const {
  if (faults < 0) return false;
  const WriteWatch later = now();
  return later.pid == pid && later.faults == faults;
}

bool written_pages(uint8_t* p, int64_t n) {
  bool written = false;
  for_each_written_run(p, static_cast<size_t>(n), [&](uint8_t*, size_t) {
    written = true;
    return false;
  });
  return written;
}

bool written_privately(const View* view, int64_t lo, int64_t hi) {
  if (hi <= lo) return false;
  if (view->lease != nullptr) {
    const PrivateLease& lease = *view->lease;
    return !lease.lent.unchanged() && written_pages(lease.data + lo, hi - lo);
  }
  if (view->kind == Segment::Mapping::kReadOnly)
    return view->segment->readonly_written(lo, hi);
  return false;
}

}  // namespace torchshm
