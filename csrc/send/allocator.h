// A NumPy memory handler (NEP 49) that places large allocations in torchshm
// segments, so that arrays are born in shared memory and sent by reference.
//
// Note [Born shared]
// A born handler is a "mem_handler" capsule with a size floor and a fallback
// handler (the one that was current when it was made). An allocation of at
// least the floor asks the Python source (the born_source hook, config.h:
// torchshm/_send/allocator.py, which asks the pool) for an int8 segment tensor;
// the registry below maps the data address to that tensor, and `free` drops it.
// So the segment's memory outlives the array exactly as long as some receiver
// holds its slot (Note [Segment lifetime]), and the pool reuses it only after
// that. Up to Slabs::kMaxBlock bytes, a block is carved from a slab instead,
// in C++, and the slab's tensor is its owner (Note [Small blocks] in
// slabs.h). Anything below the floor, anything the source declines (memory
// full: it returns None) and any allocation made while the source runs goes to
// the fallback.
//
// NumPy calls a handler with the GIL held; every entry point still takes it
// (PyGILState_Ensure is cheap when held) because the registry and the Python
// objects in it are guarded by the GIL alone: no mutex that a fork could
// leave locked in the child.
//
// realloc keeps a born block in place while it fits the segment and moves it
// otherwise; a fallback block stays with the fallback (realloc does not say
// how many bytes the old block holds, so it cannot be moved).
#pragma once

#include <cstdint>

#include "base/torch_api.h"
#include "lifetime/slabs.h"

namespace torchshm {

// A handler capsule placing allocations of at least `min_bytes` in segments
// and all others with `fallback`'s handler. A born fallback is unwrapped, so
// handlers never chain.
py::object make_born_handler(int64_t min_bytes, py::object fallback);

// The born handler's fallback capsule, or None if `handler` is not born.
py::object born_fallback(py::handle handler);

// NumPy's handler for the current context (contextvars), and setting it.
py::object current_numpy_handler();
py::object swap_numpy_handler(py::handle handler);  // returns the previous

// Whether `data` starts a born block that has a segment of its own (not a
// block of a slab).
bool born_whole_segment(const void* data);

// The segment tensor behind the born block starting at `address`, or None.
py::object born_owner(int64_t address);
// The same for the sender's plan: undefined when `data` is not a born block.
at::Tensor born_tensor(const void* data);

// A block of `size` bytes carved from a slab, a new slab taken from the born
// source if needed (tensors.h: small storages); an empty Block where none can
// be had (larger than Slabs::kMaxBlock, a cap, memory full). The caller owns
// it: Slabs::release once it is dead.
Slabs::Block carve_block(size_t size);

// Born blocks alive in this process.
int64_t born_blocks();

// Before a prepared fork: freezes every born segment that is not shared on
// purpose, so that parent and child each get copy-on-write memory as NumPy's
// own would be (Note [A plain send is as it was] in plan.h). The number that
// could not be frozen (the child shares them: their sends copy).
int64_t freeze_born_for_fork();

}  // namespace torchshm
