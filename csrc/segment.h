// A named POSIX shared-memory segment with a cross-process reference count in
// its first 64 bytes, exposed to Python as an int8 torch tensor.
//
// Note [Segment lifetime]
// The count holds one reference per process mapping plus one per message in
// flight. The creator starts at 1; a sender takes one more for every message
// that names the segment (try_acquire); a receiver's attach inherits that
// in-flight reference; dropping a mapping releases its reference; whoever
// takes the count to 0 unlinks the name. Mappings survive unlinking, so no
// reader is ever cut off. The file descriptor is closed right after mmap: a
// live array costs a mapping, never an fd. A forked child inherits mappings but
// not references: only the process that took a reference releases it
// (owner_pid), and a child that re-sends an inherited segment must win
// try_acquire, which never revives a count that reached 0. References lost to
// SIGKILL or to messages never received are swept by the session reaper
// (torchshm/_reaper.py) once every process of the session is gone.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace torchshm {

class Segment {
 public:
  // Creates and maps a new segment with `capacity` data bytes. Space is
  // reserved up front so that a full tmpfs fails here with ENOSPC instead of
  // SIGBUS on first write.
  static std::shared_ptr<Segment> create(const std::string& name,
                                         int64_t capacity);
  // Maps an existing segment; the caller must own one reference (normally the
  // in-flight reference of the message that named it).
  static std::shared_ptr<Segment> attach(const std::string& name);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Takes one more reference unless the count already reached 0.
  bool try_acquire();
  // Drops one reference; unlinks the name when it was the last.
  void release();
  // Drops this process's own reference now, once (at exit: multiprocessing
  // children end with os._exit, so destructors never run). The mapping stays.
  void disown();

  uint8_t* data() const;
  int64_t capacity() const { return capacity_; }
  int64_t refcount() const;
  const std::string& name() const { return name_; }

 private:
  Segment(std::string name, void* base, size_t mapped_bytes,
          int64_t capacity);

  std::string name_;
  void* base_;
  size_t mapped_bytes_;
  int64_t capacity_;
  std::atomic<pid_t> owner_pid_;  // 0 once disowned
};

// An int8 tensor over the whole data area; its storage keeps the mapping alive.
at::Tensor segment_tensor(std::shared_ptr<Segment> segment);
// The segment behind a tensor's storage, or nullptr if it is not one of ours.
Segment* segment_of(const at::Tensor& tensor);

}  // namespace torchshm
