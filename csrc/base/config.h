// What Python hands the native side, once: every policy number and every
// Python hook (Note [The seam] in torchshm/_native.py).
#pragma once

#include <Python.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace torchshm {

class SegmentPool;

// The sender's numbers (torchshm/_send/sender.py and _config.py say why each
// is what it is), spelled once: the struct, its check, its binding
// (_C.SenderPolicy, whose FIELDS Python must give, every one) come from this
// list. Arrays from `threshold` bytes up are shared; below, pickled inline
// until their message carried `threshold` bytes of arrays of at least
// `pack_min`. A view spanning more than `sparse_ratio` times its bytes is
// compacted. Copies from `pack_limit` up get a segment of their own; smaller
// ones share the message's chunk, which grows from `chunk_start` to
// `chunk_max`, each copy aligned to `alignment`; large copies are split over
// `copy_threads`. A copy of a whole allocation from `one_copy_min` up
// becomes its owner's memory too (0: never; Note [One copy of a sent array]
// in send/one_copy.h). FIELD(type, name, lowest valid value).
#define TORCHSHM_SENDER_POLICY(FIELD) \
  FIELD(int64_t, threshold, 0)        \
  FIELD(int64_t, pack_min, 0)         \
  FIELD(int64_t, sparse_ratio, 1)     \
  FIELD(int64_t, pack_limit, 0)       \
  FIELD(int64_t, chunk_start, 1)      \
  FIELD(int64_t, chunk_max, 1)        \
  FIELD(int64_t, alignment, 1)        \
  FIELD(int, copy_threads, 1)         \
  FIELD(int64_t, one_copy_min, 0)

struct SenderPolicy {
#define TORCHSHM_DECLARE(type, name, lowest) type name;
  TORCHSHM_SENDER_POLICY(TORCHSHM_DECLARE)
#undef TORCHSHM_DECLARE

  // Below this the native reducer returns numpy's own reduce.
  int64_t inline_below() const { return std::min(threshold, pack_min); }
};

// Python's side of the mechanism, the only Python of torchshm's that the
// native code calls, spelled once like the policy: each HOOK(name) is a
// callable Python hands over by that name.
// - reduce_other: (array) -> reduce value, for every array the native
//   reducer leaves: object dtype, empty. Never raises.
// - reduce_torch_owned: (tensor, view args) -> reduce value, or None to
//   copy: the one question about memory a torch tensor owns that torchshm
//   did not make.
// - fall_back: (array, exception) -> numpy's reduce, with the one warning.
// - allocate: nbytes -> segment tensor, when the pool has none idle or is
//   not armed.
// - attach_segment: (locator, ticket, generation) -> the segment's tensor
//   (the wire's rebuild of a SegmentRef).
// - born_source: nbytes -> (segment tensor, reused) or None: born-shared
//   memory.
#define TORCHSHM_HOOKS(HOOK) \
  HOOK(reduce_other)         \
  HOOK(reduce_by_value)      \
  HOOK(reduce_torch_owned)   \
  HOOK(fall_back)            \
  HOOK(allocate)             \
  HOOK(attach_segment)       \
  HOOK(born_source)

// Strong references, never released: the policy lives as long as the
// interpreter, and a reducer may run during its shutdown.
struct Hooks {
#define TORCHSHM_DECLARE(name) PyObject* name;
  TORCHSHM_HOOKS(TORCHSHM_DECLARE)
#undef TORCHSHM_DECLARE
  // Code objects of the frames that write a pickled message to a
  // Connection (torchshm/_send/channel.py), and how far up to look for one.
  PyObject* writers;
  int max_depth;
  // The sender's pool (pool.h), taken from without entering Python.
  std::shared_ptr<SegmentPool> pool;
};

struct Config {
  SenderPolicy policy;
  Hooks hooks;
};

// Sets everything, once; a second call is an error (import configures).
void configure(const Config& config);
// The one number that changes at run time (torchshm.set_threshold).
void set_threshold(int64_t threshold);
bool configured();
// The configuration; throws (a reducer then falls back) if there is none.
const Config& config();

// Calls a hook: every call from C++ into torchshm's Python goes through here
// and is counted (the crossings micro-benchmark reads the count). Returns a
// new reference, or nullptr with the Python error set.
PyObject* call_hook(PyObject* hook, PyObject* arg);
PyObject* call_hook(PyObject* hook, PyObject* arg1, PyObject* arg2);
PyObject* call_hook(PyObject* hook, PyObject* arg1, PyObject* arg2,
                    PyObject* arg3);
int64_t hook_calls();
void reset_hook_calls();

}  // namespace torchshm
