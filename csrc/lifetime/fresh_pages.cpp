#include "lifetime/fresh_pages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

#include "base/pages.h"
#include "base/parallel.h"
#include "lifetime/layout.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack the name
#endif

namespace torchshm {

namespace {

// Below this, one thread populates: starting threads costs more than it saves.
constexpr int64_t kMinPopulatePerThread = 16 << 20;

// What one worker of fill_fresh_pages takes at a time; a fill of less than
// two is one pwrite, by the calling thread.
constexpr size_t kFreshChunkBytes = 4 << 20;

// pwrite() of all n bytes; 0 or an errno.
int write_all(int fd, const uint8_t* src, size_t n, size_t offset) {
  for (size_t done = 0; done < n;) {
    const ssize_t w =
        ::pwrite(fd, src + done, n - done, static_cast<off_t>(offset + done));
    if (w > 0)
      done += static_cast<size_t>(w);
    else if (w < 0 && errno == EINTR)
      continue;
    else
      return w == 0 ? ENOSPC : errno;  // ENOSPC or ENOMEM: a memory limit
  }
  return 0;
}

}  // namespace

// Backs the pages now, so that a memory limit fails here with an error
// instead of later, on first write. MADV_POPULATE_WRITE faults the pages in
// as writes would, and several threads fault in parallel (a one-off
// measurement, 392 MB on 2 cores: fallocate + MAP_POPULATE 216 ms, one thread
// 229 ms, two 121 ms; `python -m benchmarks --only born` reports it as "fresh
// pages"). Kernels before 5.14 get posix_fallocate.
int populate_pages(int fd, uint8_t* file, size_t offset, size_t n,
                   int threads) {
  std::vector<int> errors(std::max(threads, 1) + 1, 0);
  std::atomic<int> next{0};
  uint8_t* start = file + offset;
  parallel_chunks(static_cast<int64_t>(n), threads, kMinPopulatePerThread,
                  kPageBytes, [&](int64_t begin, int64_t len) {
                    int& err = errors[next++];
                    if (::madvise(start + begin, len, MADV_POPULATE_WRITE) != 0)
                      err = errno;
                  });
  int err = 0;
  for (int e : errors) err = err ? err : e;
  if (err == EINVAL)
    return ::posix_fallocate(fd, static_cast<off_t>(offset),
                             static_cast<off_t>(n));
  // EFAULT: a page could not be backed (SIGBUS had it been a write).
  return err == EFAULT ? ENOMEM : err;
}

// Note [Filling a fresh segment]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A memfd's pages can be made by writing data into them in two ways, and
// neither is the faster everywhere:
// - pwrite(): the kernel makes each page and copies into it, without a fault
//   in this process and without zeroing it first; but the file's lock admits
//   one writer at a time, so a second thread only waits.
// - MADV_POPULATE_WRITE, then memcpy through the shared mapping: the pages
//   are zeroed and faulted in, each thread in parallel. Where faults are
//   dear (a VM with shadow page tables: 512 MiB took 1.5-1.8 s, against
//   0.11-0.13 s by pwrite, ../shared/notes/facts.md section 12) it loses.
// So both run at once: the calling thread pwrites, the others populate and
// copy, each taking the next 4 MiB chunk from one counter until none is
// left, and the faster way takes more of them. 512 MiB on 2 cores, the ways
// in turn (`python -m benchmarks.pages fill`, 2026-12-07): torchshm's send
// into a fresh segment 0.147 s, pwrite alone 0.191 s, one copy through a
// fresh mapping 0.419 s, torch's share_memory_ (fallocate, then its copy
// threads) 0.190 s. Both ways meet a memory limit as an error, never
// SIGBUS: pwrite fails with ENOSPC or ENOMEM, a populate with EFAULT, after
// which that worker writes its chunk, and every later one, with pwrite
// (which reports the error), as it does on a kernel without
// MADV_POPULATE_WRITE (EINVAL). Chunks are cut at multiples of 4 MiB of the
// file, so only a fill's first and last pages may hold other bytes: a
// populate never zeroes a page that exists, and the page lock orders a
// pwrite and a fault on the same new page.
int fill_fresh_pages(int fd, uint8_t* file, size_t offset, const uint8_t* src,
                     size_t n, int threads) {
  if (n == 0) return 0;
  const size_t end = offset + n;
  const size_t first = offset / kFreshChunkBytes;
  const size_t last = (end - 1) / kFreshChunkBytes;
  if (threads <= 1 || n < 2 * kFreshChunkBytes)
    return write_all(fd, src, n, offset);
  std::atomic<size_t> next{first};
  std::atomic<int> error{0};
  const int workers =
      static_cast<int>(std::min<size_t>(threads, last - first + 1));
  on_threads(workers, [&](int worker) {
    bool by_write = worker == 0;
    for (size_t k; error.load(std::memory_order_relaxed) == 0 &&
                   (k = next.fetch_add(1)) <= last;) {
      const size_t lo = std::max(offset, k * kFreshChunkBytes);
      const size_t hi = std::min(end, (k + 1) * kFreshChunkBytes);
      const uint8_t* from = src + (lo - offset);
      if (!by_write) {
        const PageRange pages = pages_touched(lo, hi);
        const int made =
            ::madvise(file + pages.first, pages.bytes(), MADV_POPULATE_WRITE);
        if (made == 0) {
          std::memcpy(file + lo, from, hi - lo);
          continue;
        }
        by_write = true;  // from here on (the Note)
      }
      if (const int err = write_all(fd, from, hi - lo, lo)) {
        int none = 0;
        error.compare_exchange_strong(none, err);
      }
    }
  });
  return error.load();
}

}  // namespace torchshm
