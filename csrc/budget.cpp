#include "budget.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "errors.h"
#include "identity.h"

namespace torchshm {

struct Entry {
  std::atomic<uint64_t> holder;
  std::atomic<int64_t> bytes;
};

namespace {
constexpr int kEntries = 512;
constexpr size_t kBytes = kEntries * sizeof(Entry);
}  // namespace

std::shared_ptr<Budget> Budget::open(const std::string& path) {
  const int fd =
      ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) throw_errno(errno, "cannot open ", path);
  struct stat st;
  int err = 0;
  if (::fstat(fd, &st) != 0) {
    err = errno;
  } else if (st.st_uid != ::geteuid() || (st.st_mode & 0777) != 0600) {
    err = EACCES;
  } else if (st.st_size < static_cast<off_t>(kBytes) &&
             ::ftruncate(fd, kBytes) != 0) {
    err = errno;  // zero-filled: every entry free
  }
  void* base =
      err ? MAP_FAILED
          : ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (!err && base == MAP_FAILED) err = errno;
  ::close(fd);
  if (err) throw_errno(err, "cannot map the session budget ", path);
  return std::shared_ptr<Budget>(new Budget(base));
}

Budget::~Budget() { ::munmap(base_, kBytes); }

Entry* Budget::entries() const { return static_cast<Entry*>(base_); }

bool Budget::set(uint64_t holder, int64_t bytes) {
  Entry* e = entries();
  for (int i = 0; i < kEntries; ++i) {
    if (e[i].holder.load() == holder) {
      e[i].bytes.store(bytes);
      return true;
    }
  }
  if (bytes == 0) return true;
  for (int i = 0; i < kEntries; ++i) {
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

int64_t Budget::total() {
  int64_t sum = 0;
  Entry* e = entries();
  for (int i = 0; i < kEntries; ++i) {
    const uint64_t holder = e[i].holder.load();
    if (holder != 0 && holder_alive(holder)) sum += e[i].bytes.load();
  }
  return sum;
}

}  // namespace torchshm
