// Splitting one large memory operation (a copy, populating pages) over a few
// threads, without ever failing because a thread could not start.
#pragma once

#include <algorithm>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace torchshm {

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
      pool.threads.emplace_back([=] { work(begin, len); });
    } catch (const std::system_error&) {
      mine_from = begin;
      break;
    }
  }
  work(0, std::min(chunk, n));
  if (mine_from < n) work(mine_from, n - mine_from);
}

}  // namespace torchshm
