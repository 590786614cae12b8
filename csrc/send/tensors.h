// Torch storages in segments: a tensor's storage moved into one in place,
// and the one storage a process keeps per segment (Note [Tensor storages]).
#pragma once

#include <cstdint>

#include "base/torch_api.h"

namespace torchshm {

// Note [Tensor storages]
// A tensor sent with the tensor switch on (torchshm/_send/tensors.py) travels
// as a reference to a segment that holds its whole storage, at the segment's
// start: every storage over a segment starts at the segment's data, as every
// view's does (offsets stay relative to it, Note [Sender plan]); one of up to
// 64 KiB is a block of a slab instead (Note [Small storages]). Its storage
// gets there in one of two ways:
// - it was born there: torchshm.empty, or UntypedStorage._new_shared (the
//   default collate's batch) while the switch is on;
// - move_storage puts it there in place, as torch's share_memory_() does
//   with a /dev/shm file: the bytes are copied to a pooled segment and the
//   storage's data swapped for the segment's, so every tensor over that
//   storage, in this process and in every receiver, sees the same bytes.
// Either way the storage's data pointer is an alias view (views.h: owning no
// slot, keeping the pool's view alive), so the pool reuses the segment only
// once the storage is gone here and every receiver let go of it.
// A receiver makes one storage per segment (segment_storage): the same
// storage arriving twice is the same storage object, and views of it stay
// views, as torch's shared_cache does for its own. The sender's storage is
// in that cache too, so a tensor sent back to its sender is its own again.
// A storage over a snapshot (an array's .base a receiver sends on) is no
// shared memory: it travels as the snapshot's arrays do (Note [Snapshots
// are mapped privately] in segment.h). Sent by reference only while this
// process wrote none of its pages, else copied to a new snapshot
// (snapshot_storage: never moved, arrays lie over it); rebuilt over its
// message's private mapping, one storage per message, so that no receiver
// writes into what others read.
// Such storages cannot be resized (torch's own shared storages cannot
// either): their allocator is none.

// Note [Small storages]
// A segment per storage costs a small tensor 64 KiB of shared memory (the
// pool's smallest segment) and an fd while it lives: a batch's labels, a
// model's biases. So a storage of up to Slabs::kMaxBlock bytes is carved
// from a slab as a small array is (Note [Small blocks] in slabs.h), moved
// there or born there, and travels as (the slab's segment, its offset):
// the receiver holds a slot of the whole slab, maps it shared, and makes one
// storage per block (a second arrival of the block is the same storage).
// Such a storage's context is a BlockStorage, not a View: view_of does not
// know it, so an array over its bytes (tensor.numpy()) travels as a copy,
// like any memory that is not a segment's, and no offset computed against
// a View's data can go wrong. The sender's block goes back to its slab when
// its storage dies (under the GIL: the slabs are guarded by it; a storage
// freed by a thread without it takes it, and one freed while the
// interpreter finalizes from such a thread is left to the process's exit).
// Where no slab can be had (a cap, memory full), the storage takes a
// pooled segment of its own, as before.

// A storage of `nbytes` carved from a slab, as an int8 tensor over it;
// undefined where none can be had (larger than Slabs::kMaxBlock, no slab).
// Its bytes are not cleared.
at::Tensor carve_storage(int64_t nbytes);

// Moves `tensor`'s storage into a block carved from a slab, in place as
// move_storage does; false where none can be had (larger than
// Slabs::kMaxBlock, no slab).
bool move_storage_to_block(const at::Tensor& tensor);

// (the slab's segment tensor, the block's offset in it) for a storage over
// a block of a slab, or None.
py::object block_of(const at::Tensor& tensor);

// Whether `tensor`'s storage lies in torchshm's memory: a segment, or a
// block of a slab (what block_of answers without making its answer).
bool in_torchshm_memory(const at::Tensor& tensor);

// This process's storage over the `nbytes` at `offset` of the segment behind
// `owner` (a received slab): the live one if the block has one of that size,
// else a new one, remembered.
at::Tensor block_storage(const at::Tensor& owner, int64_t offset,
                         int64_t nbytes);

// Copies the bytes of `tensor`'s storage to the start of the segment behind
// `owner` (a pooled view, at least as large; Segment::fill, with up to
// `threads` threads) and points the storage there.
void move_storage(const at::Tensor& tensor, const at::Tensor& owner,
                  int threads);

// An int8 tensor over this process's storage of the first `nbytes` of the
// segment behind `owner`: the live one if the segment has one of that size,
// else a new one, remembered.
at::Tensor segment_storage(const at::Tensor& owner, int64_t nbytes);

// Copies the bytes of `tensor`'s storage (one over a segment that this
// process wrote privately: storage_written) to the start of the segment
// behind `owner` (a pooled view, at least as large), a snapshot from now on;
// `tensor` is left as it is (arrays may lie over it).
void snapshot_storage(const at::Tensor& tensor, const at::Tensor& owner,
                      int threads);

// Whether this process wrote a page of `tensor`'s storage where it lies
// over a private or read-only mapping of a segment (its bytes are then not
// the segment's: a reference would send the segment's instead).
bool storage_written(const at::Tensor& tensor);

// This thread's message's reference to the segment behind `owner` (a
// SegmentRef: pickling it issues the message's ticket).
py::object message_ref(py::handle owner);

}  // namespace torchshm
