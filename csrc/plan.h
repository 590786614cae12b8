// The sender's side of a message in one native call per array: where the
// array's memory lives, whether this message already copied it, where a copy
// goes, and the copy itself (Note [Sender plan]).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace torchshm {

// Note [Sender plan]
// multiprocessing pickles each message with a fresh pickler; torchshm keeps
// one Plan per message (torchshm/_message.py). Plan::place answers, for one
// array at or above the threshold:
// 1. Where its memory lives: the base chain is walked here (root object,
//    nearest ndarray). Memory already in a torchshm segment (received,
//    shared, or born there: Note [Born shared] in allocator.h) is sent by
//    reference (offset relative to the segment's storage); a root that is a
//    torch tensor over memory torchshm did not make is handed back to Python,
//    which decides by torch's sharing strategy.
// 2. Whether this message already copied it: views of one buffer share one
//    copy, so aliasing survives the trip.
// 3. Where a copy goes: the message's chunk, or a segment of its own from
//    PACK_LIMIT up. Segments come from Python's allocate (the pool and
//    budget policy), called back only when a chunk is full.
// 4. The copy, with the GIL released (or a compacted copy of a sparse view).
// Python keeps every policy number and pushes them in (configure_sender);
// this code never reads the environment and never pickles. Tickets are not
// taken here: the pickler issues one per reference it writes (_SegmentRef in
// torchshm/_reduction.py, Note [Segment lifetime] in segment.h).

struct SenderPolicy {
  // Arrays below this many bytes are reduced by numpy's own __reduce__ in
  // fast_reduce, without entering Python: min(threshold, PACK_MIN).
  int64_t inline_below = 0;
  int64_t sparse_ratio = 2;
  int64_t pack_limit = 16 << 20;
  int64_t chunk_start = 1 << 20;
  int64_t chunk_max = 64 << 20;
  int64_t alignment = 64;
  int copy_threads = 1;
};

// Python's side of the sender: the policy reducer fast_reduce hands every
// other array to, the allocate callable, and the numbers.
void configure_sender(py::object policy_reducer, py::object allocate,
                      const SenderPolicy& policy);

// The ForkingPickler reducer (a plain C function, so that pickle's C
// implementation calls it with no Python frame in between).
py::object fast_reducer();

class Plan {
 public:
  // (owner, name, view args) for an array in a segment, `name` being its
  // segment's name and the view args rebuild_ndarray's after its owner; or
  // (root tensor, None, offset into its storage) for memory a torch tensor
  // owns that torchshm did not make (unless `copy` says: copy it anyway).
  py::tuple place(py::handle array, bool copy);

 private:
  struct Target {
    py::object owner;  // int8 tensor over a whole segment
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

  py::tuple copy_view(py::handle array, py::handle root, py::handle nearest);
  py::tuple copy_compacted(py::handle array);
  // A target and offset for nbytes: the chunk, or a segment of its own.
  std::pair<Target, int64_t> reserve(int64_t nbytes);

  std::unordered_map<PyObject*, Root> roots_;
  Target chunk_;
  int64_t chunk_used_ = 0;
};

// The tensor over the torchshm segment that holds an array's memory, or an
// undefined tensor (see the definition: the one place a second source of
// segment memory plugs in).
at::Tensor lookup_segment_owner(py::handle root, py::handle nearest);

// (ticket, generation) for one message naming the segment behind `tensor`,
// written to pipe `channel`; ticket 0 when every slot is taken; None if the
// segment is gone or the tensor is not over one.
py::object ticket_for(const at::Tensor& tensor, uint64_t channel);

}  // namespace torchshm
