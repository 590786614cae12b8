#include "base/parallel.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <string>
#include <thread>

#include "base/stats.h"

namespace torchshm {
namespace {

constexpr const char* kThreadNames[] = {kWorkerThreadName, kExpiryThreadName};

bool is_thread_name(const char* name) {
  return std::any_of(std::begin(kThreadNames), std::end(kThreadNames),
                     [&](const char* n) { return std::strcmp(n, name) == 0; });
}

// Whether /proc/self/task/<tid>/comm is one of kThreadNames. A task gone
// meanwhile is not.
bool is_torchshm_thread(const char* tid) {
  const std::string path = std::string("/proc/self/task/") + tid + "/comm";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char comm[32] = {};
  const ssize_t n = ::read(fd, comm, sizeof comm - 1);
  ::close(fd);
  if (n <= 0) return false;
  comm[comm[n - 1] == '\n' ? n - 1 : n] = '\0';
  return is_thread_name(comm);
}

// Whether /proc/self/task lists a torchshm thread. No /proc: nothing to wait
// for (and nothing that could count threads either).
bool any_listed() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return false;
  bool found = false;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.' && is_torchshm_thread(entry->d_name)) {
      found = true;
      break;
    }
  }
  ::closedir(dir);
  return found;
}

}  // namespace

void name_this_thread(const std::string& name) {
  TORCH_CHECK(is_thread_name(name.c_str()), "expected one of the thread names ",
              "that wait_threads_gone looks for (csrc/base/parallel.h), got ",
              name);
  ::pthread_setname_np(::pthread_self(), name.c_str());
}

bool wait_threads_gone(double timeout_seconds) {
  using Clock = std::chrono::steady_clock;
  const auto deadline =
      Clock::now() + std::chrono::duration<double>(timeout_seconds);
  // A joined thread needs only to be scheduled once more: look again soon,
  // then back off, so that a long wait costs little CPU.
  auto step = std::chrono::microseconds(50);
  while (any_listed()) {
    if (Clock::now() >= deadline) {
      count(kForkWaitsTimedOut);
      return false;
    }
    std::this_thread::sleep_for(step);
    step = std::min(step * 2, std::chrono::microseconds(5000));
  }
  return true;
}

namespace {

// Below this, one thread copies: starting threads costs more than it saves.
constexpr int64_t kMinBytesPerThread = 8 << 20;
// One memcpy call of a few hundred MiB takes glibc's largest-copy path, which
// ran at half speed here (a one-off measurement, 512 MiB: 72 ms as two calls,
// 38 ms in 64 MiB blocks); blocks of this size stay on the fast path
// (`python -m benchmarks.micro` measures the result).
constexpr int64_t kBlockBytes = 32 << 20;

}  // namespace

void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n, int threads) {
  parallel_chunks(n, threads, kMinBytesPerThread, 1,
                  [=](int64_t begin, int64_t len) {
                    for (int64_t done = 0; done < len; done += kBlockBytes)
                      std::memcpy(dst + begin + done, src + begin + done,
                                  std::min(kBlockBytes, len - done));
                  });
}

}  // namespace torchshm
