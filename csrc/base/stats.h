// The counters behind torchshm.stats(): relaxed atomics, so that the sender
// and receiver paths count without a lock and without a call into Python.
#pragma once

#include <atomic>
#include <cstdint>

namespace torchshm {

// In the order of torchshm/_stats.py's COUNTERS (which names them).
enum Counter : int {
  kArraysShared,
  kBytesCopied,
  kArraysResent,
  kArraysInline,
  kArraysReceived,
  kSegmentsCreated,
  kSegmentsAttached,
  kSegmentsReused,
  kMappingsReused,
  kTicketsUnavailable,
  kAllocationsShared,
  kAllocationsFallback,
  kForkWaitsTimedOut,
  kSnapshotsResent,
  kArraysCopiedOnReceive,
  kPrivateMappingsWalked,
  kStoragesMoved,
  kStoragesSent,
  kPoolGaveWay,
  kStoragesCopied,
  kSegmentsPinnedAtFork,
  kBytesOneCopy,
  kCounterCount,
};

extern std::atomic<int64_t> counters[kCounterCount];
// Their stats() keys, which torchshm/_stats.py checks against its own list.
extern const char* const kCounterNames[kCounterCount];

inline void count(Counter c, int64_t n = 1) {
  counters[c].fetch_add(n, std::memory_order_relaxed);
}

}  // namespace torchshm
