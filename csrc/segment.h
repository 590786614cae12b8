// A named POSIX shared-memory segment with a cross-process reference count in
// its first 64 bytes, and the int8 torch tensors ("views") that expose it.
//
// Note [Segment lifetime]
// The header counts references: one held by whoever created the segment (a
// sender's pool, or the first view), one per message in flight, one per
// receiving view. A sender takes an in-flight reference for every message that
// names the segment (try_acquire); the receiver's view adopts it; dropping a
// view releases its reference; whoever takes the count to 0 unlinks the name.
// A mapping (Segment) is separate from references (views): a receiver may keep
// an idle mapping cached so that a segment reused by the sender's pool is not
// faulted in again, without keeping the segment alive. A pool may overwrite a
// segment only when its count is 1 (its own) and it has no local views.
// The fd is closed right after mmap: a live array costs a mapping, never an fd.
// A forked child gets a reference for each view it inherits, taken in the
// parent before fork (torchshm/_segments.py), so a pool never reuses memory a
// child still reads. References lost to SIGKILL or to messages never received
// are swept by the session reaper (torchshm/_reaper.py) once every process of
// the session is gone.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace torchshm {

class Segment {
 public:
  // Creates and maps a new segment with `capacity` data bytes; its count
  // starts at 1, a reference the caller owns. Space is reserved up front so
  // that a full tmpfs fails here with ENOSPC instead of SIGBUS on first write.
  static std::shared_ptr<Segment> create(const std::string& name,
                                         int64_t capacity);
  // Maps an existing segment without taking a reference.
  static std::shared_ptr<Segment> attach(const std::string& name);

  ~Segment();  // unmaps; references are the views' business
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Takes one more reference unless the count already reached 0.
  bool try_acquire();
  // Drops one reference; unlinks the name when it was the last.
  void release();

  uint8_t* data() const;
  int64_t capacity() const { return capacity_; }
  int64_t refcount() const;
  int64_t local_views() const { return views_.load(); }
  const std::string& name() const { return name_; }

 private:
  friend struct View;
  Segment(std::string name, void* base, size_t mapped_bytes, int64_t capacity);

  std::string name_;
  void* base_;
  size_t mapped_bytes_;
  int64_t capacity_;
  std::atomic<int64_t> views_{0};
};

// One live view of a segment: the context of a tensor's storage. It keeps the
// mapping alive and may own one header reference, for the process ref_pid.
struct View {
  View(std::shared_ptr<Segment> segment, bool owns_reference);
  ~View();
  // Releases the reference now if this process owns it (at exit: children of
  // multiprocessing end with os._exit, so destructors never run).
  void disown();

  std::shared_ptr<Segment> segment;
  std::atomic<pid_t> ref_pid;  // 0: no reference
};

// An int8 tensor over the whole data area.
at::Tensor view_tensor(std::shared_ptr<Segment> segment, bool owns_reference);
// The view behind a tensor's storage, or nullptr if it is not one of ours.
View* view_of(const at::Tensor& tensor);

}  // namespace torchshm
