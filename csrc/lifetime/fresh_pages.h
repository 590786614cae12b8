// Making a fresh memfd's pages: all of them at once (a segment that must
// fail now, not on first write), or by writing data into them.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace torchshm {

// Backs bytes [offset, offset + n) of `fd`, mapped MAP_SHARED at `file`
// (its offset 0), with up to `threads` threads; 0 or an errno (ENOMEM for a
// memory limit, never SIGBUS).
int populate_pages(int fd, uint8_t* file, size_t offset, size_t n, int threads);

// Writes src[0, n) to bytes [offset, offset + n) of `fd`, mapped MAP_SHARED
// at `file`, whose pages there were never made (Note [Filling a fresh
// segment]); 0 or an errno (ENOSPC or ENOMEM at a memory limit, never
// SIGBUS). Call without the GIL.
int fill_fresh_pages(int fd, uint8_t* file, size_t offset, const uint8_t* src,
                     size_t n, int threads);

}  // namespace torchshm
