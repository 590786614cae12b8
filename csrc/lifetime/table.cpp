#include "lifetime/table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "base/errors.h"
#include "lifetime/identity.h"

namespace torchshm {

static_assert(std::atomic<uint8_t>::is_always_lock_free, "layout");

std::shared_ptr<SessionTable> SessionTable::map(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_errno(errno, "fstat of a session table");
  // Sealed against shrinking: nobody can truncate it under our mapping.
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || seals < 0 ||
      !(seals & F_SEAL_SHRINK) ||
      static_cast<size_t>(st.st_size) < kTableUidsOffset)
    throw_errno(EACCES,
                "refusing a session table that is not a sealed memfd of this "
                "user");
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* base =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw_errno(errno, "mmap of a session table");
  auto* h = static_cast<TableHeader*>(base);
  if (h->magic != kTableMagic || table_bytes(h->capacity) > bytes) {
    ::munmap(base, bytes);
    throw_errno(EINVAL, "not a torchshm session table");
  }
  return std::shared_ptr<SessionTable>(new SessionTable(base, bytes));
}

SessionTable::~SessionTable() { ::munmap(base_, bytes_); }

std::atomic<uint64_t>* SessionTable::uids() const {
  return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base_) +
                                                  kTableUidsOffset);
}

std::atomic<uint8_t>* SessionTable::flags() const {
  return reinterpret_cast<std::atomic<uint8_t>*>(
      static_cast<char*>(base_) + table_flags_offset(capacity()));
}

BudgetEntry* SessionTable::budget() const {
  return reinterpret_cast<BudgetEntry*>(static_cast<char*>(base_) +
                                        kTableBudgetOffset);
}

int SessionTable::claim(uint64_t uid) {
  const uint32_t n = capacity();
  const uint32_t start = header()->next.load() % (n ? n : 1);
  for (uint32_t k = 0; k < n; ++k) {
    const uint32_t i = (start + k) % n;
    uint64_t expected = 0;
    if (uids()[i].load() == 0 &&
        uids()[i].compare_exchange_strong(expected, uid)) {
      flags()[i].store(0);
      header()->next.store(i + 1);
      return static_cast<int>(i);
    }
  }
  return -1;
}

void SessionTable::unclaim(int index, uint64_t uid) {
  if (index < 0 || static_cast<uint32_t>(index) >= capacity()) return;
  uids()[index].compare_exchange_strong(uid, 0);
}

void SessionTable::flag(int index, uint8_t bits) {
  if (index < 0 || static_cast<uint32_t>(index) >= capacity()) return;
  // Set after the change it announces (a ticket, an unlink): the keeper
  // clears a flag before it looks, so either it sees the change or the flag
  // stays set for its next scan. A flag on an index reused since costs it
  // one look.
  flags()[index].fetch_or(bits);
}

bool SessionTable::budget_set(uint64_t holder, int64_t bytes) {
  BudgetEntry* e = budget();
  for (int i = 0; i < kBudgetEntries; ++i) {
    if (e[i].holder.load() == holder) {
      e[i].bytes.store(bytes);
      return true;
    }
  }
  if (bytes == 0) return true;
  for (int i = 0; i < kBudgetEntries; ++i) {
    uint64_t seen = e[i].holder.load();
    // A free entry, or a dead process's (its pool died with it).
    if ((seen == 0 || !holder_alive(seen)) &&
        e[i].holder.compare_exchange_strong(seen, holder)) {
      e[i].bytes.store(bytes);
      return true;
    }
  }
  return false;
}

int64_t SessionTable::budget_total() const {
  int64_t sum = 0;
  BudgetEntry* e = budget();
  for (int i = 0; i < kBudgetEntries; ++i) {
    const uint64_t holder = e[i].holder.load();
    if (holder != 0 && holder_alive(holder)) sum += e[i].bytes.load();
  }
  return sum;
}

}  // namespace torchshm
