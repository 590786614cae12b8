// Which pages of a private mapping this process wrote (Note [Knowing that
// nothing was written] in private_mappings.h): the page table, read through
// PAGEMAP_SCAN or /proc/self/pagemap, and the process's fault count.
#include "lifetime/private_mappings.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <vector>

#include "lifetime/layout.h"

namespace torchshm {

namespace {

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

void drop_written_pages(uint8_t* p, size_t n) {
  for_each_written_run(p, n, [](uint8_t* run, size_t bytes) {
    ::madvise(run, bytes, MADV_DONTNEED);
    return true;
  });
}

}  // namespace torchshm
