// The session's budget of pooled shared memory: one small file per session,
// /dev/shm/torchshm-budget-<session>.shm, with an entry per pooling process
// (its id and the bytes its pool keeps). A process writes only its own entry;
// the total counts live processes only, so a SIGKILLed process's pool stops
// counting as soon as its lock is gone (identity.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace torchshm {

class Budget {
 public:
  // Opens (creating if needed) the budget file at `path`.
  static std::shared_ptr<Budget> open(const std::string& path);
  ~Budget();
  Budget(const Budget&) = delete;
  Budget& operator=(const Budget&) = delete;

  // Records that `holder` pools `bytes`; false if every entry is taken by a
  // live process (the caller then pools nothing more).
  bool set(uint64_t holder, int64_t bytes);
  // Bytes pooled by the session's live processes.
  int64_t total();

 private:
  explicit Budget(void* base) : base_(base) {}
  struct Entry* entries() const;
  void* base_;
};

}  // namespace torchshm
