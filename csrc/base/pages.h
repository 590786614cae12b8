// The machine's pages, and the whole pages of a byte range: those it
// touches (rounded out) or those it covers (rounded in).
#pragma once

#include <unistd.h>

#include <cstdint>

namespace torchshm {

inline int64_t page_bytes() {
  static const int64_t page = ::sysconf(_SC_PAGESIZE);
  return page;
}

// [first, last), both page-aligned.
struct PageRange {
  int64_t first;
  int64_t last;
  int64_t bytes() const { return last > first ? last - first : 0; }
};

// Every page that [lo, hi) touches.
inline PageRange pages_touched(int64_t lo, int64_t hi) {
  const int64_t page = page_bytes();
  return {lo / page * page, (hi + page - 1) / page * page};
}

// The pages that [lo, hi) covers whole (bytes() == 0: none).
inline PageRange pages_covered(int64_t lo, int64_t hi) {
  const int64_t page = page_bytes();
  return {(lo + page - 1) / page * page, hi / page * page};
}

}  // namespace torchshm
