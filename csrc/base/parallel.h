// Splitting one large memory operation (a copy, populating pages) over a few
// threads, without ever failing because a thread could not start.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace torchshm {

// Note [Threads at fork]
// ~~~~~~~~~~~~~~~~~~~~~~
// No torchshm thread may be alive at a fork (Python 3.12+ warns when
// /proc/self/stat counts more than one thread; a thread forked mid-work
// leaves its locks held in the child). Joining is not enough: pthread_join
// returns when the kernel clears the thread id, and Python's Thread.join
// when the thread state is released, both before the task leaves the thread
// group, and on a busy machine it stays listed in /proc/self/task for a
// while. So every thread torchshm starts names itself "torchshm-<role>"
// first thing (the copy and populate workers here, the expiry timer in
// torchshm/_lifetime/expiry.py), and the before-fork hook, once it has joined
// the timer, waits (bounded) until no thread so named is listed. By name, not
// by thread id: it also finds a timer that ended on its own a moment ago, and a
// recycled id is never waited for. The wait is there, once per fork, rather
// than after every join: a fork is when it matters, and copies pay only the
// one system call that names each worker. A wait that reaches its bound lets
// the fork go on and counts fork_waits_timed_out.

// The names torchshm gives its threads, in full: a user's thread whose name
// merely starts alike (a thread inherits its creator's name, the main thread
// the executable's) is never waited for.
constexpr char kWorkerThreadName[] = "torchshm-worker";
constexpr char kExpiryThreadName[] = "torchshm-expiry";

// Names the calling thread `name`, one of the names above.
void name_this_thread(const std::string& name);

// Waits, at most `timeout_seconds`, until /proc/self/task lists no thread
// named by name_this_thread. True if none was left in time; if one was,
// counts fork_waits_timed_out and returns false. Never throws.
bool wait_threads_gone(double timeout_seconds);

// Calls work(begin, length) on consecutive chunks covering [0, n): chunk
// boundaries are multiples of `align`, at most `threads` chunks, each of at
// least `min_per_thread` bytes. The calling thread takes the first chunk and
// any chunk whose thread could not start (e.g. under a pids limit); every
// started thread is joined before this returns, on every path.
template <typename Work>
void parallel_chunks(int64_t n, int threads, int64_t min_per_thread,
                     int64_t align, Work work) {
  const int64_t useful = std::max<int64_t>(1, n / min_per_thread);
  const int64_t workers = std::min<int64_t>(std::max(threads, 1), useful);
  int64_t chunk = (n + workers - 1) / workers;
  chunk = (chunk + align - 1) / align * align;
  // A std::thread destroyed while joinable calls std::terminate.
  struct Joiner {
    std::vector<std::thread> threads;
    ~Joiner() {
      for (auto& t : threads) t.join();
    }
  } pool;
  int64_t mine_from = n;
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t begin = w * chunk;
    const int64_t len = std::min(chunk, n - begin);
    if (len <= 0) break;
    try {
      pool.threads.emplace_back([=] {
        ::pthread_setname_np(::pthread_self(), kWorkerThreadName);
        work(begin, len);
      });
    } catch (const std::system_error&) {
      mine_from = begin;
      break;
    }
  }
  work(0, std::min(chunk, n));
  if (mine_from < n) work(mine_from, n - mine_from);
}

// Calls work(i) for each i in [0, threads): i = 0 on the calling thread,
// every other on a thread of its own (on the calling thread, after its own,
// where that thread could not start). For work that shares itself out, each
// call taking chunks from one counter, rather than a fixed part.
template <typename Work>
void on_threads(int threads, Work work) {
  const int64_t n = std::max(threads, 1);
  parallel_chunks(n, threads, 1, 1, [&](int64_t first, int64_t count) {
    for (int64_t i = first; i < first + count; ++i) work(static_cast<int>(i));
  });
}

// Runs work() on a detached thread that bears kWorkerThreadName from its
// first instant, so that a fork's wait finds it even before it runs: a
// thread inherits its creator's name, and the creator wears that name for
// the moment it starts it. False if no thread could start (then nothing
// ran).
template <typename Work>
bool start_detached_worker(Work work) {
  char mine[16] = {};
  const bool named =
      ::pthread_getname_np(::pthread_self(), mine, sizeof mine) == 0 &&
      ::pthread_setname_np(::pthread_self(), kWorkerThreadName) == 0;
  bool started = true;
  try {
    std::thread(std::move(work)).detach();
  } catch (const std::system_error&) {
    started = false;
  }
  if (named) ::pthread_setname_np(::pthread_self(), mine);
  return started;
}

// Copies n bytes, split over `threads` when large. Call without the GIL.
void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n, int threads);

}  // namespace torchshm
