// Which of this process's segment mappings a forked child inherits.
//
// Note [Forks torchshm did not prepare]
// A forked child inherits a view of every segment its parent maps, but a
// hold on none unless torchshm's fork hook gave it one (Note [Fork] in
// torchshm/_lifetime/lifecycle.py): without it the parent reuses memory the
// child still reads (its pool, a slab rewound, a sender's pool once the
// parent let go), and the child reads the parent's later bytes. The hook
// runs for os.fork() and multiprocessing; a fork() called from C (a C
// library, ctypes) runs no Python hook. So every mapping of segment memory
// (a segment's header and data, its private and read-only mappings) is made
// MADV_DONTFORK: a child inherits none of it unless the forking thread's
// hook prepared that fork (prepared_fork()); then, inside fork(), the
// pthread_atfork handlers here let every mapping be inherited for that fork
// alone, and mark them DONTFORK again on both sides. In the child of an
// unprepared fork, reading inherited torchshm memory faults (SIGSEGV)
// instead of reading what the parent writes later: the child's handler
// keeps each of those address ranges reserved (PROT_NONE), so no later
// mapping of the child (a large allocation) lands there and is read in its
// place. Nothing unmaps them or reads a lost segment's header
// (Segment::lost()), so dropping an inherited array or exiting is safe.
// torchshm is off in such a child and its children (forked_without_hooks):
// its sends pickle by value, and its calls raise one error that names the
// cause (torchshm/_lifetime/lifecycle.py, fork_hooks_missing). A child that
// execs, as nearly every fork from C does, loses nothing.
// Cost: one madvise per mapping made (a segment created or attached, a
// private or read-only mapping), against the tens of microseconds a mapping
// costs; per prepared fork, three madvise calls per mapping (the parent's
// two, the child's one), beside the fork's own copy of the page tables.
#pragma once

#include <cstddef>
#include <cstdint>

namespace torchshm {

// A new mapping of segment memory at [p, p + n): made DONTFORK, and
// remembered until unmap_tracked.
void track_mapping(void* p, size_t n);
// Unmaps [p, p + n) if this process maps it: not if a fork that torchshm
// did not prepare left it behind (the address may hold another mapping).
void unmap_tracked(void* p, size_t n);
// Replaces [p, p + n), part of a tracked mapping, by a read-write mapping of
// `fd` at `offset` with `flags` (MAP_SHARED or MAP_PRIVATE), DONTFORK as the
// rest; false, with the old mapping intact, where it cannot.
bool remap_tracked(void* p, size_t n, int flags, int fd, int64_t offset);
// Moves the pages of [p, p + n), part of a tracked shared mapping, to a new
// tracked mapping (their page tables move: no page is unmapped, none
// faults) and maps `fd` at `offset` privately at p instead: the new
// address, or nullptr (p as it was) where the kernel cannot (Linux 5.13 or
// later moves a shared mapping with MREMAP_DONTUNMAP).
void* park_tracked(void* p, size_t n, int fd, int64_t offset);
// Moves the pages park_tracked parked at `parked` back over [p, p + n),
// replacing the private mapping there; false (both as they were) where it
// cannot.
bool unpark_tracked(void* parked, void* p, size_t n);
// Replaces [p, p + n), memory that is not torchshm's (a sent array's pages:
// Note [One copy of a sent array] in send/one_copy.h), by a private
// read-write mapping of `fd` at `offset`, inherited by every fork and not
// tracked; false, with the old memory intact, where it cannot.
bool remap_untracked(void* p, size_t n, int fd, int64_t offset);
// How many forks this process made that torchshm did not prepare (a fork
// from C): their children hold no slot in anything.
uint64_t unprepared_forks();
// Called by the fork hook of the thread about to fork, once the child's
// holds are taken: that fork's child inherits every mapping.
void prepared_fork();
// The fork hook in the parent after fork (or a fork that failed).
void fork_done_in_parent();
// Bumped in the child of an unprepared fork: a mapping made in an earlier
// epoch is not in this process.
uint64_t mapping_epoch();
// Whether this process is (or descends from) the child of a fork torchshm
// did not prepare: its session, lock and slots are its parent's.
inline bool forked_without_hooks() { return mapping_epoch() != 0; }

}  // namespace torchshm
