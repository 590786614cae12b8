// One copy of a sent array in memory: the sender's pages become its
// snapshot's.
//
// Note [One copy of a sent array]
// A sent array, not share()d, reaches its receivers as it was at the send:
// its bytes are copied into a snapshot segment (Note [Sender plan]). The
// sender's own pages stayed where they were, so a model sent to workers
// cost two copies in memory, where a torch tensor's storage moves into
// shared memory in place (one). Now, after the copy, the sender's whole
// pages of the array are mapped over the snapshot, privately
// (copy-on-write): reading them reads the snapshot's pages, the sender's
// anonymous pages are freed, and a page the sender writes later becomes its
// own again (the kernel copies it), so no receiver ever sees a write made
// after the send. The first and last partial pages stay the sender's.
// Only where the memory is the array's alone and the allocator's behaviour
// is known:
// - an ndarray that owns its data (no base) from NumPy's default handler
//   (or the born handler's fallback to it: a declined allocation), whose
//   whole allocation was copied;
// - malloc is glibc's (not a preloaded jemalloc or tcmalloc: glibc's own
//   count of bytes in use, mallinfo2, grows by a probe block) and the block
//   is one of its mmap()ed chunks (its header says so: large blocks, from
//   glibc's mmap threshold up, unless a free chunk of its heap is large
//   enough, which after many frees it may be; then the block is copied as
//   any heap block): free() unmaps the whole chunk, so the
//   mapping dies with the array, and realloc() of a chunk that is no longer
//   one mapping fails over to malloc + copy + unmap (resize() works: the
//   array is watched through its handler, not weakly referenced, Note
//   [Knowing that a sent array is gone] in array_watch.h);
// - at least ONE_COPY_MIN bytes (torchshm/_send/sender.py): the copy gets a
//   segment of its own, placed at the array's offset within a page so that
//   pages line up.
// Everything else is copied as before (heap blocks of glibc's arenas, whose
// freed pages glibc may hand out again while our mapping is over them;
// mmap-backed arrays; torch-owned memory, which torch's own path moves).
// Lifetime: the segment's first view is held while the array lives (its
// watch drops it, before NumPy frees or moves the data), so the pool
// never rewrites a snapshot under the sender's pages, and a fork torchshm
// prepares gives the child a slot in it like any live view. A send of the
// array after a write maps its pages over the new snapshot, and the old one
// is let go. A fork torchshm did not prepare (from C) inherits the mapping
// with no slot: a segment held across one is retired (never reused),
// instead of made DONTFORK as torchshm's own mappings are (the child would
// lose its own array's pages).
// What this costs the sender: a write after the send faults and copies a
// page (a fresh buffer reused every send is best born shared, Note [Born
// shared], or share()d); a mapping and at most two more VMAs per array
// (kMaxHeld arrays at once, then copies as before). A write by another
// thread of the sender while the array is being sent was already a race
// for the receiver; now it may be lost in the sender too.
#pragma once

#include <cstdint>

#include "base/numpy_api.h"
#include "base/torch_api.h"
#include "lifetime/segment.h"

namespace torchshm {

// Where in its segment a copy of bytes [src, src + n) of `nearest` (base
// chain end `root`) must start, within its first page, for its pages to
// become the owner's: src's offset in its page; -1 if they cannot (see the
// Note).
int64_t one_copy_offset(py::handle root, PyArrayObject* nearest, int64_t src,
                        int64_t n);

// After the copy of [src, src + n) to data offset `at` of `segment` (whose
// first view is `view`): maps the whole pages of it over the segment,
// privately, and holds `view` while `nearest` lives. Does nothing where the
// mapping fails (the copy stands).
void adopt_pages(PyArrayObject* nearest, const py::object& view,
                 const std::shared_ptr<Segment>& segment, int64_t at,
                 int64_t src, int64_t n);

// Whether adopt_pages mapped the whole pages of array `key` over
// `segment`, a segment of its own that holds that array's copy alone: each
// of them is the snapshot's page unless this process wrote it since
// (written_pages in lifetime/private_mappings.h). Under the GIL.
bool pages_adopted(py::handle key, const Segment& segment);

// How many arrays hold a snapshot so (tests and the doctor).
int64_t one_copy_held();

}  // namespace torchshm
