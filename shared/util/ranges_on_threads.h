// Runs fn(begin, end) over [0, n) in `threads` equal ranges, each on a thread of its own started
// for the call (the first on the calling thread), and returns once all are done. For one-off
// start-up copies in code that links none of pinfer's libraries, so has no ThreadPool (the CUDA
// module, loaded with dlopen: its pinned copy of the cold rows), where a pool kept for one call
// would be all its use: the copies read a file mapping whose page faults hold one thread to about
// 1 GB/s. A thread that cannot be started leaves its range to the caller.
#pragma once

#include <cstddef>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace pinfer {

template <typename Fn>
void RunRangesOnThreads(size_t n, int threads, const Fn& fn) {
  if (threads < 1) threads = 1;
  std::vector<std::thread> workers;
  std::vector<std::pair<size_t, size_t>> left;
  for (int t = 1; t < threads; ++t) {
    const size_t b = n * t / threads, e = n * (t + 1) / threads;
    if (b == e) continue;
    try {
      workers.emplace_back([&fn, b, e] { fn(b, e); });
    } catch (const std::system_error&) {
      left.emplace_back(b, e);
    }
  }
  if (n / threads > 0) fn(size_t{0}, n / threads);
  for (const auto& [b, e] : left) fn(b, e);
  for (std::thread& w : workers) w.join();
}

}  // namespace pinfer
