// Knowing which pages of a private (copy-on-write) mapping of a segment's
// data this process wrote. The mappings themselves are Segment's
// (segment_private.cpp; Note [Snapshots are mapped privately] in segment.h).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace torchshm {

// Note [Knowing that nothing was written]
// A private mapping serves the next message only once the pages this
// process wrote in it are dropped (they are its own copies, no longer the
// segment's). Finding them walks the page table (PAGEMAP_SCAN, Linux 6.7+,
// else /proc/self/pagemap): 4-5 ms per 512 MiB present, 2-core reference
// machine, because telling a copied page from the file's reads each page's
// struct page. Two things keep that off the receiver's path:
// - The walk is skipped when it cannot find anything: a write through a
//   private mapping of a file always faults (its pages are the file's,
//   mapped read-only, until the kernel copies one), and the kernel counts
//   every fault a process takes, whatever thread takes it (getrusage: minor
//   plus major faults). So if the count is the same when its lease ends
//   as when the mapping was lent, in the same process, no page was
//   copied, provided none was copied before: a mapping is lent only fresh
//   or walked, so that holds. A pipeline's receiver usually faults
//   somewhere meanwhile (a DataLoader's main process did, every batch), a
//   ping-pong receiver does not.
// - Otherwise the walk runs on a thread of its own as the lease ends
//   (Segment::give_back_private), while the receiver goes on; the next
//   message over that segment waits for it only if it comes first. An ERA5
//   DataLoader epoch (benchmarks era5) cost 14% more with the walk on the
//   receiver's path; with it aside, within the run-to-run noise.
// What the count cannot see: another process writing this one's memory
// (process_vm_writev, /proc/<pid>/mem), which faults in the writer; one
// user's processes are not a boundary (docs/guide/failures.md, Limits).
// Soft-dirty bits would answer per page without the struct page, but kernels
// without CONFIG_MEM_SOFT_DIRTY (the reference machine's) never set them, and
// userfaultfd's write tracking turns off fault-around for the whole mapping
// (first reads 6x slower) and is refused in Docker's default seccomp.
struct WriteWatch {
  pid_t pid = 0;
  int64_t faults = -1;
  // This process's fault count now.
  static WriteWatch now();
  // Whether this process took no fault since `now()` made this one.
  bool unchanged() const;
};

// Whether this process wrote a page of [p, p + n) of a private mapping (its
// pages are its own copies there, no longer the segment's).
bool written_pages(uint8_t* p, int64_t n);

// Makes [p, p + n) of a private mapping read the file's pages again where
// this process wrote (MADV_DONTNEED on the runs it wrote).
void drop_written_pages(uint8_t* p, size_t n);

}  // namespace torchshm
