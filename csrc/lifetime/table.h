// A process's mapping of a session table (layout.h): segment indices, the
// flags that tell the keeper where to look, and the session's pool budget.
//
// The keeper (torchshm/_keeper/daemon.py) makes the table and hands
// its fd to every process that joins the session; a process that attaches a
// segment of another session gets that session's table with the segment's fd.
// Entries are changed by one atomic operation each, so a process killed in the
// middle of a change leaves nothing half-done: an index claimed by a creator
// that died before registering is freed by the keeper, and a budget entry of
// a dead process stops counting as soon as its lock is gone (identity.h).
#pragma once

#include <cstdint>
#include <memory>

#include "lifetime/layout.h"

namespace torchshm {

class SessionTable {
 public:
  // Maps the table behind `fd` (the caller keeps the fd and closes it).
  // Refuses anything that is not a sealed memfd of this user holding a table.
  static std::shared_ptr<SessionTable> map(int fd);
  ~SessionTable();
  SessionTable(const SessionTable&) = delete;
  SessionTable& operator=(const SessionTable&) = delete;

  uint32_t capacity() const { return header()->capacity; }
  uint32_t fd_base() const { return header()->fd_base; }

  // A free index, now naming `uid`; -1 if every index is taken.
  int claim(uint64_t uid);
  // Gives back an index claimed for `uid` that was never registered (its
  // segment could not be made).
  void unclaim(int index, uint64_t uid);
  // Sets flag bits on an index (layout.h); out of range is a no-op.
  void flag(int index, uint8_t bits);

  // The pool budget: records that `holder` pools `bytes` (false if every
  // entry is taken by a live process), and what live processes pool.
  bool budget_set(uint64_t holder, int64_t bytes);
  int64_t budget_total() const;

 private:
  SessionTable(void* base, size_t bytes) : base_(base), bytes_(bytes) {}
  TableHeader* header() const { return static_cast<TableHeader*>(base_); }
  std::atomic<uint64_t>* uids() const;
  std::atomic<uint8_t>* flags() const;
  BudgetEntry* budget() const;

  void* base_;
  size_t bytes_;
};

}  // namespace torchshm
