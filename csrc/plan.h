// The sender's side of a message in one native call per array: where the
// array's memory lives, whether this message already copied it, where a copy
// goes, and the copy itself (Note [Sender plan]).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "numpy_api.h"
#include "pool.h"

namespace torchshm {

// Note [Sender plan]
// multiprocessing pickles each message with a fresh pickler; torchshm keeps
// one Plan per message (Message, message.h). Plan::place answers, for one
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
//    PACK_LIMIT up. Segments come from the pool without entering Python
//    while the pool is armed (Note [Segment pool] in pool.h), else from
//    Python's allocate (the pool's bookkeeping and the budget policy); both
//    only when a chunk is full.
// 4. The copy, with the GIL released (or a compacted copy of a sparse view).
// Python keeps every policy number and pushes them in (configure_sender);
// this code never reads the environment and never pickles. Tickets are not
// taken here: the pickler issues one per reference it writes (SegmentRef in
// message.h, Note [Segment lifetime] in segment.h).

struct SenderPolicy {
  // Arrays below this many bytes are reduced by numpy's own __reduce__ in
  // the native reducer, without entering Python: min(threshold, PACK_MIN).
  int64_t inline_below = 0;
  // Arrays from this many bytes up are shared by the native reducer
  // (message.h).
  int64_t threshold = 0;
  int64_t sparse_ratio = 2;
  int64_t pack_limit = 16 << 20;
  int64_t chunk_start = 1 << 20;
  int64_t chunk_max = 64 << 20;
  int64_t alignment = 64;
  int copy_threads = 1;
};

// Python's side of the sender, pushed in by torchshm/_sender.py and
// torchshm/_segments.py (strong references, never released: the policy lives
// as long as the interpreter, and a reducer may run during its shutdown).
struct SenderHooks {
  PyObject* policy_reducer = nullptr;  // every array the native path leaves
  PyObject* fall_back = nullptr;       // (array, exception) -> numpy's reduce
  PyObject* allocate = nullptr;        // nbytes -> segment tensor (slow path)
  std::shared_ptr<SegmentPool> pool;   // taken from directly while armed
  PyObject* live = nullptr;  // _segments._live: name -> weak ref to a view
};

void configure_sender(py::object policy_reducer, py::object fall_back,
                      py::object allocate, const SenderPolicy& policy);
void configure_sender_pool(std::shared_ptr<SegmentPool> pool, py::object live);
const SenderPolicy& sender_policy();
const SenderHooks& sender_hooks();

// Where one array goes: its owner (an int8 tensor over a whole segment, or
// the root tensor of memory torchshm did not make), the segment's name (None
// for the latter), its offset from the owner's storage, and the strides it
// is rebuilt with (empty: its own).
struct Placement {
  py::object owner;
  py::object name;
  int64_t offset = 0;
  std::vector<npy_intp> strides;
};

class Plan {
 public:
  // Places one array (see the Note); with `copy`, memory a torch tensor
  // owns that torchshm did not make is copied too.
  Placement place(py::handle array, bool copy);

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

  Placement copy_view(py::handle array, py::handle root, py::handle nearest);
  Placement copy_compacted(py::handle array);
  // A target and offset for nbytes: the chunk, or a segment of its own.
  std::pair<Target, int64_t> reserve(int64_t nbytes);

  std::unordered_map<PyObject*, Root> roots_;
  Target chunk_;
  int64_t chunk_used_ = 0;
};

// rebuild_ndarray's arguments after the owner: (offset, dtype, shape,
// strides, writeable, subtype), with `first` in front when given. The one
// place that decides how a dtype travels (see the definition).
py::tuple view_args(py::handle array, int64_t offset,
                    const std::vector<npy_intp>& strides = {},
                    py::handle first = py::handle());

// The end of an array's base chain: (the object owning its memory, or null;
// the ndarray nearest to it).
std::pair<py::handle, py::handle> base_chain(py::handle array);

// The tensor owning an array's memory, or None: its torchshm segment's view
// (received, shared or born there) or the root torch tensor of memory
// torchshm did not make (torchshm.is_shared asks).
py::object memory_owner(py::handle array);

// The tensor over the torchshm segment that holds an array's memory, or an
// undefined tensor (see the definition: the one place a second source of
// segment memory plugs in).
at::Tensor lookup_segment_owner(py::handle root, py::handle nearest);

}  // namespace torchshm
