// The sender's side of a message in one native call per array: where the
// array's memory lives, whether this message already copied it, where a copy
// goes, and the copy itself (Note [Sender plan]).
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

#include "base/numpy_api.h"
#include "base/torch_api.h"
#include "lifetime/segment.h"

namespace torchshm {

struct View;

// Note [Sender plan]
// multiprocessing pickles each message with a fresh pickler; torchshm keeps
// one Plan per message (Message, message.h). Plan::place answers, for one
// array at or above the threshold, in one walk of its base chain (root
// object, nearest ndarray), with one of three tags:
// - kSegment: its memory is in a torchshm segment already (received,
//   shared, or born there: Note [Born shared] in allocator.h): sent by
//   reference, the offset relative to the segment's storage.
// - kTorchOwned: a torch tensor that torchshm did not make owns it. Whether
//   torch's own sharing may carry it is Python's decision (it depends on
//   torch's sharing strategy): the native reducer asks it, once, and on
//   "copy" calls Plan::copy with this placement, which walks nothing again.
// - kCopied: copied into shared memory by this message (or by an earlier
//   array of it: views of one buffer share one copy, so aliasing survives).
//   The copy goes into the message's chunk, or a segment of its own from
//   pack_limit up; segments come from the pool without entering Python
//   while it is armed (Note [Segment pool] in pool.h), else from Python's
//   allocate hook, both only when a chunk is full. The copy runs with the
//   GIL released (or compacts a sparse view), by pwrite into a fresh
//   segment (Segment::fill); a large array alone in its memory then maps
//   its pages over its copy (Note [One copy of a sent array] in
//   one_copy.h). Every such segment is a snapshot (Note
//   [Snapshots are mapped privately] in segment.h); a copy with a segment
//   of its own that an earlier message made of the same unchanged bytes is
//   not made again (Note [Resending an unchanged array] in snapshots.h).
//   share() works in sharing mode (set_sharing): its copies are shared
//   memory, never snapshots, and a snapshot it meets is copied.
// - kSegment also falls back to a copy when the array is over this process's
//   private pages of a snapshot that it wrote (they are not the segment's).
// Every number comes from the configuration (config.h); this code never reads
// the environment and never pickles. Tickets are not taken here: the pickler
// issues one per reference it writes (SegmentRef in message.h, Note
// [Segment lifetime] in segment.h).

// Note [A plain send is as it was]
// The rule every mechanism of the sender keeps: a plain send (anything
// multiprocessing pickles, share() aside) delivers the bytes as they were at
// the send, and nothing written afterwards reaches the receiver, whoever
// writes: the sender, its threads, its fork children, its parent, a process
// that holds the same memory through share(), a pool or slab reusing the
// block. share() (and memory made shared on purpose: its results where they
// arrive, handles of shared objects, a torch tensor's shared storage, which
// torch itself shares) is shared both ways and stays so. A mechanism that
// cannot prove the sender is the only process that may write the bytes a
// receiver maps copies them. How each keeps it:
// - A copy (kCopied) is a snapshot: nobody writes it until its pool reuses
//   it, which waits for every holder (Note [Segment lifetime] in segment.h).
// - Received snapshots are mapped privately, and a process sending on one
//   sends a reference only while it wrote none of its pages (Note
//   [Snapshots are mapped privately]).
// - A born array with a segment of its own is frozen at its first send
//   (Note [A born array is sent as it was] in segment.h): its creator's
//   mapping becomes private, so only if no other process maps it shared and
//   writable. So a prepared fork freezes every born segment first
//   (freeze_born_for_fork, allocator.h): parent and child then each write
//   their own copy-on-write pages over bytes nobody writes, as NumPy's own
//   memory gives a fork child, and either may send it by reference while it
//   wrote none of its pages (frozen_written). A born segment that share()
//   handed out, or whose freeze at a fork failed, may be written by others
//   (Segment::may_be_written_by_others): a plain send copies it.
// - A block of a slab (a small born array) is never frozen (its slab's other
//   blocks are shared memory): a plain send copies it, as it would an
//   array of NumPy's.
// - Two arrays over the same bytes of one segment through different
//   memories of this process (two messages' private mappings, a frozen born
//   array beside the same bytes received back) are two memories here, so
//   the second is copied: a receiver rebuilds a message's references to one
//   segment over one mapping, and they would arrive as one. Arrays over
//   different bytes (a read-only snapshot's private mapping beside the
//   shared one, as share() gives) are references both.
// - A fork torchshm did not prepare (Note [Forks torchshm did not prepare]
//   in fork_guard.h), or a message begun once the exit hook ran (Note
//   [Messages at exit] in message.h): arrays are pickled by value.
// What stays shared across a prepared fork: memory shared on purpose, and
// small born blocks (slabs also carry torch's small shared storages, which
// torch shares with a fork child): a fork child writing an inherited small
// born array writes its parent's; sends are as they were all the same.
// scripts/fuzz holds the library to this rule against TORCHSHM_DISABLE=1.

// Where one array goes.
struct Placement {
  enum Kind { kSegment, kTorchOwned, kCopied };
  Kind kind;
  // An int8 tensor over a whole segment (kSegment, kCopied), or the root
  // tensor that owns the memory (kTorchOwned).
  py::object owner;
  py::object name;                // the segment's name; None for kTorchOwned
  int64_t offset = 0;             // from the start of the owner's storage
  std::vector<npy_intp> strides;  // rebuilt with these (empty: its own)
  // The base chain, for Plan::copy after a kTorchOwned answer.
  py::handle root;
  PyArrayObject* nearest = nullptr;
};

class Plan {
 public:
  // Places one array (see the Note).
  Placement place(PyArrayObject* array);
  // Copies an array that place() answered kTorchOwned for.
  Placement copy(PyArrayObject* array, const Placement& torch_owned);

 private:
  struct Target {
    py::object owner;  // int8 tensor over a whole segment
    std::shared_ptr<Segment> segment;
    py::object name;
    uint8_t* data = nullptr;
    int64_t size = 0;
  };
  struct Copy {
    int64_t lo, hi, at;  // buffer bytes [lo, hi) went to `at` in `target`
    Target target;
  };
  struct Root {
    py::object keep;  // holds the key's object, so its id is not reused
    std::vector<Copy> copies;
  };

  static Target target_of(const py::object& owner);
  // `extent`: byte_extent(array), found once by place().
  Placement copy_view(PyArrayObject* array, std::pair<int64_t, int64_t> extent,
                      py::handle root, PyArrayObject* nearest);
  Placement copy_compacted(PyArrayObject* array);
  // A target and offset for nbytes: the chunk, or a segment of its own.
  std::pair<Target, int64_t> reserve(int64_t nbytes);
  // A segment of its own for n bytes: the pool's, or Python's allocate.
  static Target allocate(int64_t n);

  std::unordered_map<PyObject*, Root> roots_;
  // Whether a reference to `offset` + extent() of `view`'s segment, through
  // `owner`'s mapping, overlaps no bytes this message named through another
  // memory (see the Note); if so, records it.
  bool names_one_memory(
      const View& view, const at::Tensor& owner, int64_t offset,
      const std::function<std::pair<int64_t, int64_t>()>& extent);

  // The bytes of each segment this message named by reference, and the
  // memory (the mapping, nullptr for the shared one) each was read through.
  struct Named {
    const void* memory;
    int64_t lo, hi;
  };
  struct NamedBytes {
    std::vector<Named> ranges;
    bool one_memory = true;
  };
  std::unordered_map<const Segment*, NamedBytes> named_;
  Target chunk_;
  int64_t chunk_used_ = 0;
};

// Sharing mode for this thread (share()'s round trip: see the Note); returns
// the previous mode.
bool set_sharing(bool on);

// The end of an array's base chain: (the object owning its memory, or null;
// the ndarray nearest to it).
std::pair<py::handle, PyArrayObject*> base_chain(PyArrayObject* array);

// The tensor owning an array's memory, or None: its torchshm segment's view
// (received, shared or born there) or the root torch tensor of memory
// torchshm did not make (torchshm.is_shared asks).
py::object memory_owner(py::handle array);
// What a buffer is known by, in a message's copies and the snapshot cache:
// its base chain's root object, or the nearest ndarray if the chain ends in
// none.
py::handle buffer_key(py::handle root, PyArrayObject* nearest);
// The snapshot cache knows `array`'s buffer as `key` while it lives
// (SnapshotCache::known_as: torchshm/_send/arrow.py).
void resend_as(py::handle array, py::object key);

// The tensor over the torchshm segment that holds an array's memory, or an
// undefined tensor (see the definition: the one place a second source of
// segment memory plugs in), from base_chain's root and the tensor it is, if
// it is one (tensor_or_undefined(root), read once by the caller).
at::Tensor lookup_segment_owner(py::handle root, const at::Tensor& root_tensor,
                                PyArrayObject* nearest);

}  // namespace torchshm
