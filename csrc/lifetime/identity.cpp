#include "lifetime/identity.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "base/errors.h"

namespace torchshm {
namespace {

struct Lock {
  uint64_t id = 0;
  int fd = -1;
};

// The user's run directory (torchshm/_keeper/daemon.py run_dir): set
// once, at import, before any lock is made or asked about; empty: none
// (torchshm off).
std::string directory;

std::mutex mutex;     // guards everything below
std::string session;  // written into lock files
Lock self;
Lock child;  // between prepare_child and the end of fork
// Processes found dead; ids are never reused, so the answer never changes.
std::unordered_set<uint64_t> dead;
constexpr size_t kDeadCacheMax = 1 << 14;
// Note [Alive answers are remembered briefly]
// Asking a lock file costs five system calls (open, fstat, geteuid, flock,
// close: ~8 us on a paravirtualized VM), and every received view asks twice
// when it dies (keep its mapping? last holder?), nearly always about the
// same live sender. So an alive answer stands for kAliveForNs. That is safe
// because "alive" is the answer that keeps memory everywhere it is asked (no
// unlink, no reuse, no budget entry taken, a cached mapping): a holder that
// died within that time is only found dead a little later, by the next ask or
// the keeper's scan. A dead answer is never cached for a time: it is final.
std::unordered_map<uint64_t, int64_t> alive_until;  // holder -> monotonic ns
constexpr int64_t kAliveForNs = 10 * 1000 * 1000;
constexpr size_t kAliveCacheMax = 1 << 10;

int64_t monotonic_ns() {
  struct timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::atomic<pid_t> cached_pid{0};
void refresh_pid() { cached_pid.store(::getpid(), std::memory_order_relaxed); }

void write_owner(int fd, pid_t pid);

// An open() that failed with this says nothing about the file.
bool cannot_tell(int err) {
  return err == EMFILE || err == ENFILE || err == ENOMEM || err == EINTR;
}

// Creates and locks a fresh lock file. It is created under a temporary name
// and renamed once locked: a sweeper that sees the final name unlocked may
// rightly delete it as dead.
Lock create_lock() {
  Lock lock;
  lock.id = random_id();
  if (directory.empty())
    throw_errno(ENOENT,
                "torchshm has no run directory (see the warning at import)");
  const std::string tmp =
      directory + "/torchshm-new-" + std::to_string(random_id()) + ".lock";
  lock.fd = ::open(tmp.c_str(),
                   O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (lock.fd < 0) throw_errno(errno, "cannot create ", tmp);
  if (::flock(lock.fd, LOCK_EX | LOCK_NB) != 0 ||
      ::rename(tmp.c_str(), lock_path(lock.id).c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ::close(lock.fd);
    throw_errno(err, "cannot lock ", tmp);
  }
  write_owner(lock.fd, ::getpid());
  return lock;
}

// "<pid> <session>\n": the pid for people reading /dev/shm, the session for
// the keeper (a restarted keeper ends its session only when no process of
// it lives). Ids are what the slot protocol uses.
void write_owner(int fd, pid_t pid) {
  const std::string text = std::to_string(pid) + " " + session + "\n";
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, text.data(), text.size(), 0) < 0) {
    // Informational for people; the keeper then sees no session and
    // counts on the member's connection instead.
  }
}

void close_lock(Lock& lock) {
  if (lock.fd >= 0) ::close(lock.fd);
  lock = Lock{};
}

}  // namespace

uint64_t random_id(bool ticket) {
  uint64_t value = 0;
  while ((value & ~kTicketBit) == 0) {
    if (::getrandom(&value, sizeof value, 0) != sizeof value)
      throw_errno(errno, "getrandom failed");
  }
  return ticket ? (value | kTicketBit) : (value & ~kTicketBit);
}

void set_lock_dir(const std::string& path) {
  if (directory.empty()) directory = path;
}

std::string lock_path(uint64_t id) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "/torchshm-%016llx.lock",
                static_cast<unsigned long long>(id));
  return directory + buf;
}

uint64_t self_id() {
  std::lock_guard<std::mutex> guard(mutex);
  if (self.id == 0) self = create_lock();
  return self.id;
}

void set_lock_session(const std::string& name) {
  std::lock_guard<std::mutex> guard(mutex);
  session = name;
  if (self.fd >= 0) write_owner(self.fd, ::getpid());
}

bool holder_alive(uint64_t holder) {
  if (holder == 0) return false;
  if (holder & kTicketBit) return true;
  {
    std::lock_guard<std::mutex> guard(mutex);
    if (holder == self.id || holder == child.id) return true;
    if (dead.count(holder)) return false;
    const auto it = alive_until.find(holder);
    if (it != alive_until.end() && monotonic_ns() < it->second) return true;
  }
  bool alive = false;
  // Only a regular file of this user can be a holder's lock: a symlink, a
  // FIFO (O_NONBLOCK: opening one must not block) or another user's file
  // planted under a dead holder's name must not make it look alive.
  const int fd = ::open(lock_path(holder).c_str(),
                        O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd >= 0) {
    struct stat st;
    // Our own shared lock, released by close, succeeds only if nobody holds
    // the owner's exclusive one.
    alive = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
            st.st_uid == ::geteuid() && ::flock(fd, LOCK_SH | LOCK_NB) != 0;
    ::close(fd);
  } else if (cannot_tell(errno)) {
    return true;  // this process is short of fds or memory, not the holder
  }
  std::lock_guard<std::mutex> guard(mutex);
  if (alive) {
    if (alive_until.size() >= kAliveCacheMax) alive_until.clear();
    alive_until[holder] = monotonic_ns() + kAliveForNs;
  } else {
    alive_until.erase(holder);
    if (dead.size() >= kDeadCacheMax) dead.clear();
    dead.insert(holder);
  }
  return alive;
}

uint64_t prepare_child() {
  std::lock_guard<std::mutex> guard(mutex);
  if (child.id == 0) child = create_lock();
  return child.id;
}

void after_fork_in_parent() {
  std::lock_guard<std::mutex> guard(mutex);
  close_lock(child);  // the child's descriptor keeps its lock
}

void after_fork_in_child() {
  // Another thread of the parent may have held the mutex at fork.
  new (&mutex) std::mutex();
  if (self.fd >= 0) ::close(self.fd);  // the parent's lock must die with it
  self = child;
  child = Lock{};
  dead.clear();
  alive_until.clear();
  if (self.fd >= 0) write_owner(self.fd, ::getpid());
}

void remove_own_lock() {
  std::lock_guard<std::mutex> guard(mutex);
  if (self.fd < 0) return;
  ::unlink(lock_path(self.id).c_str());
  // The id stays: a call after exit (an atexit hook's torchshm.release)
  // must not make a new lock file that nothing would remove.
  ::close(self.fd);
  self.fd = -1;
}

pid_t current_pid() {
  // Registered before the first answer is cached, so no fork can come
  // between the two.
  static const bool registered =
      (::pthread_atfork(nullptr, nullptr, &refresh_pid), refresh_pid(), true);
  (void)registered;
  return cached_pid.load(std::memory_order_relaxed);
}

}  // namespace torchshm
