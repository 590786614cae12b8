// Small born blocks carved from shared slabs, so that a small array costs no
// segment, fd or table index of its own.
//
// Note [Small blocks]
// A memfd segment per allocation costs tens of microseconds (create, seal,
// register, map) and an fd and a table index while it lives: 5-170x what
// NumPy's own allocator costs below 64 KiB, and a cap of a quarter of the fd
// limit on the arrays alive. So the born handler (Note [Born shared] in
// allocator.h) carves allocations of up to kMaxBlock bytes from a slab: a
// segment of kSlabBytes that the Python source hands out like any other
// (pooled, counted, given way at a cap). Carving is a bump of an offset in
// C++, under the GIL, with no call into Python.
// - A message naming a block names the slab's segment and the block's
//   offset (Note [Sender plan]); the receiver holds a slot of the slab, as
//   of any born segment, and maps it MAP_SHARED (born memory is shared, not
//   a snapshot: no private copy-on-write page can mix two blocks' bytes).
// - A block's bytes are never handed out twice while anything may read
//   them. Freed blocks are not reused one by one: a slab is rewound to its
//   start (generation bumped, as the pool does) only when none of its
//   blocks is alive here and, by the pool's own rule, no slot but the
//   creator's names a holder and no message is in flight (a receiver that
//   holds any block holds the whole slab). The current slab that cannot be
//   rewound is carved on past its used bytes, which no block ever had: a
//   DataLoader worker's small batches, each held by the consumer, then
//   share one slab instead of taking one each. A retired slab is let go once
//   its last block dies, and the pool reuses or releases it like any other
//   segment.
// - A forked child inherits the blocks and the slabs' views, but never
//   carves or rewinds: its parent carves the same slabs.
// - An empty current slab is kept for the next block (a loop of
//   temporaries carves and rewinds it), and let go like an idle pooled
//   segment: by trim(), a cap, or the expiry timer after the pool's idle
//   time (it looks periodically while a slab is current: a wake-up per
//   emptying would cost a loop of temporaries a thread switch each).
// - Memory: a retired slab stays while any block of it lives, so a few
//   long-lived blocks can keep whole slabs. Retired slabs are bounded: past
//   kRetiredFloor bytes and kRetiredRatio times the bytes of live small
//   blocks, small allocations go to NumPy (counted as fallbacks) until
//   slabs are let go; so they do for a while after the source declined a
//   slab (kRetrySeconds).
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/torch_api.h"

namespace torchshm {

struct Slab;

class Slabs {
 public:
  static constexpr size_t kMaxBlock = 64 << 10;
  static constexpr size_t kSlabBytes = 1 << 20;
  // NumPy's own allocator (malloc) aligns to 16 bytes.
  static constexpr size_t kAlignment = 16;
  static constexpr int64_t kRetiredFloor = 64 << 20;
  static constexpr int64_t kRetiredRatio = 4;
  // After the source declined a slab (a cap, memory full), small blocks go
  // to NumPy without asking again for this long, or until a slab is let go:
  // a fallback then costs what NumPy's allocation costs, not a call into
  // Python (torchshm/_send/allocator.py uses the same wait for large
  // allocations: _C.DECLINED_RETRY_SECONDS).
  static constexpr double kRetrySeconds = 1.0;

  struct Block {
    void* data = nullptr;
    Slab* slab = nullptr;
    size_t capacity = 0;  // bytes usable from data
    bool dirty = false;   // may hold earlier bytes (a calloc clears it)
  };

  // A block from the current slab, or an empty one: open() a new slab first.
  Block carve(size_t size);
  // Whether a new slab may be opened: within the bound on retired slabs,
  // and not just declined.
  bool may_open() const;
  // The source declined a slab.
  void declined();
  // Makes `owner` (an int8 tensor over a whole segment from the source;
  // `reused`: its bytes are not fresh) the current slab.
  void open(py::object owner, bool reused);
  // One block of `slab` died (`capacity` as carved).
  void release(Slab* slab, size_t capacity);
  // When (monotonic seconds) the current slab's last block died, so that
  // the expiry timer lets it go like an idle pooled segment; infinity while
  // a block lives or there is none.
  double empty_since() const;
  bool has_current() const;
  // Lets go of the current slab if it has been empty for `older_than`
  // seconds (trim, a cap, the expiry timer); the bytes let go.
  int64_t let_go_if_empty(double older_than);
  // The tensor over the slab's segment (borrowed).
  static PyObject* owner(const Slab* slab);
  // The child of a fork: no slab inherited is carved or rewound.
  void after_fork_in_child();

 private:
  void retire(Slab* slab);
  void drop(Slab* slab);
  bool rewind(Slab* slab);
  void drop_forked_empty();

  Slab* current_ = nullptr;
  int64_t retired_bytes_ = 0;     // capacity of slabs kept only by their blocks
  int64_t live_bytes_ = 0;        // carved bytes of live blocks
  Slab* forked_empty_ = nullptr;  // inherited by fork with no block alive
  double declined_until_ = 0;     // monotonic seconds
};

// The process's slabs (guarded by the GIL, like the born registry).
Slabs& slabs();

}  // namespace torchshm
