// Which segment mappings a forked child inherits (Note [Forks torchshm did
// not prepare] in fork_guard.h).
#include "lifetime/fork_guard.h"

#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

// Linux 4.17; older headers lack the name.
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

namespace torchshm {
namespace {

struct Guard {
  std::mutex mutex;  // held across fork() by the forking thread
  std::unordered_map<void*, size_t> mappings;  // start -> bytes
  // The thread whose fork hook prepared the next fork, if any.
  bool prepared = false;
  pthread_t preparer{};
  bool inheriting = false;  // the fork under way lets the child inherit
};

std::atomic<uint64_t> epoch{0};
std::atomic<uint64_t> unprepared{0};

void advise_all(Guard& g, int advice) {
  for (const auto& [p, n] : g.mappings) ::madvise(p, n, advice);
}

Guard& guard();

void before_fork() {
  Guard& g = guard();
  g.mutex.lock();
  g.inheriting = g.prepared && ::pthread_equal(g.preparer, ::pthread_self());
  if (g.inheriting) advise_all(g, MADV_DOFORK);
}

void in_parent() {
  Guard& g = guard();
  if (g.inheriting)
    advise_all(g, MADV_DONTFORK);
  else
    unprepared.fetch_add(1);
  g.prepared = g.inheriting = false;
  g.mutex.unlock();
}

void in_child() {
  Guard& g = guard();
  if (g.inheriting) {
    advise_all(g, MADV_DONTFORK);  // this child's own forks
  } else {
    // None of them is here (DONTFORK). Their addresses stay reserved, never
    // readable: a read of inherited torchshm memory faults every time, and
    // no later mapping of this child (a large allocation) lands there to be
    // read in its place. A syscall each, as async-signal-safe as fork needs.
    for (const auto& [p, n] : g.mappings)
      ::mmap(p, n, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE,
             -1, 0);
    g.mappings.clear();
    epoch.fetch_add(1);
  }
  g.prepared = g.inheriting = false;
  // Only this thread is left, and it locked the mutex in before_fork.
  g.mutex.unlock();
}

Guard& guard() {
  // Never destroyed: mappings are let go during interpreter shutdown.
  static Guard* instance = [] {
    ::pthread_atfork(&before_fork, &in_parent, &in_child);
    return new Guard();
  }();
  return *instance;
}

}  // namespace

void track_mapping(void* p, size_t n) {
  Guard& g = guard();
  std::lock_guard<std::mutex> lock(g.mutex);
  ::madvise(p, n, MADV_DONTFORK);
  g.mappings[p] = n;
}

void unmap_tracked(void* p, size_t n) {
  Guard& g = guard();
  // Under the mutex: a fork must never advise an address unmapped, and
  // perhaps mapped again by someone else, meanwhile.
  std::lock_guard<std::mutex> lock(g.mutex);
  if (g.mappings.erase(p) == 0) return;
  ::munmap(p, n);
}

namespace {

// Linux 5.7 (5.13 for shared mappings); older headers lack the name.
#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

// Moves the mapping at [from, from + n) to `to`, replacing what is there.
void* move(void* from, size_t n, void* to, int extra = 0) {
  return ::mremap(from, n, n, MREMAP_MAYMOVE | MREMAP_FIXED | extra, to);
}

bool remap(void* p, size_t n, int flags, int fd, int64_t offset,
           bool dontfork) {
  // Mapped elsewhere first, then moved over the old range in one call: a
  // failure leaves the old mapping where it was (MAP_FIXED over it would
  // have removed it first).
  void* fresh = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, flags, fd,
                       static_cast<off_t>(offset));
  if (fresh == MAP_FAILED) return false;
  Guard& g = guard();
  // Under the mutex: no fork between the move and its advice.
  std::lock_guard<std::mutex> lock(g.mutex);
  if (move(fresh, n, p) == MAP_FAILED) {
    ::munmap(fresh, n);
    return false;
  }
  if (dontfork) ::madvise(p, n, MADV_DONTFORK);
  return true;
}

}  // namespace

bool remap_tracked(void* p, size_t n, int flags, int fd, int64_t offset) {
  return remap(p, n, flags, fd, offset, /*dontfork=*/true);
}

void* park_tracked(void* p, size_t n, int fd, int64_t offset) {
  void* fresh = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd,
                       static_cast<off_t>(offset));
  if (fresh == MAP_FAILED) return nullptr;
  // The parking place: an address range of our own to move the pages to.
  void* parked = ::mmap(nullptr, n, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (parked == MAP_FAILED) {
    ::munmap(fresh, n);
    return nullptr;
  }
  Guard& g = guard();
  // Under the mutex: no fork between the moves and their advice.
  std::lock_guard<std::mutex> lock(g.mutex);
  // Its page tables move (no page is unmapped or faulted); [p, p + n) stays
  // mapped, empty, so no other mapping can land there meanwhile.
  if (move(p, n, parked, MREMAP_DONTUNMAP) == MAP_FAILED) {
    ::munmap(fresh, n);
    ::munmap(parked, n);
    return nullptr;
  }
  if (move(fresh, n, p) == MAP_FAILED) {
    if (move(parked, n, p) == MAP_FAILED) ::munmap(parked, n);  // empty then
    ::munmap(fresh, n);
    return nullptr;
  }
  ::madvise(p, n, MADV_DONTFORK);
  ::madvise(parked, n, MADV_DONTFORK);
  g.mappings[parked] = n;
  return parked;
}

bool unpark_tracked(void* parked, void* p, size_t n) {
  Guard& g = guard();
  std::lock_guard<std::mutex> lock(g.mutex);
  if (g.mappings.count(parked) == 0 || move(parked, n, p) == MAP_FAILED)
    return false;
  g.mappings.erase(parked);  // moved: nothing is mapped there now
  ::madvise(p, n, MADV_DONTFORK);
  return true;
}

bool remap_untracked(void* p, size_t n, int fd, int64_t offset) {
  return remap(p, n, MAP_PRIVATE, fd, offset, /*dontfork=*/false);
}

uint64_t unprepared_forks() { return unprepared.load(); }

void prepared_fork() {
  Guard& g = guard();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.prepared = true;
  g.preparer = ::pthread_self();
}

void fork_done_in_parent() {
  Guard& g = guard();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.prepared = false;
}

uint64_t mapping_epoch() { return epoch.load(std::memory_order_relaxed); }

}  // namespace torchshm
