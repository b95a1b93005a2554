// A small fixed-size thread pool for data-parallel loops. The calling thread takes part in every
// loop, so a pool of size 1 runs everything inline with no synchronisation at all.
//
// Waking a sleeping thread costs tens of microseconds, which is a visible share of a decode step
// that runs two short loops per layer (the cpu-worker's cold rows: 80 loops per token of a 40-layer
// model). A pool made with a spin time keeps its workers polling for that long after each loop,
// and the caller polling for the loop's end, before either falls back to sleeping: loops that
// follow each other closely never sleep, an idle pool does.
//
// Sleepers wait on the loop counter itself (std::atomic::wait, a futex on Linux), not on a
// condition variable: a condition variable's notify_all wakes every worker only for each to
// take its mutex in turn, so with many threads the last one starts a chain of wake-ups late.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace pinfer {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads, std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  std::chrono::microseconds spin() const { return spin_; }
  // Calls fn(begin, end) over disjoint chunks covering [0, n), chunks of at least `grain`.
  // Returns when all chunks are done. Not reentrant.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
  // With pinned chunks, a loop of exactly size() chunks of one index each gives index i to the
  // same thread every time (0: the caller), so that data one loop leaves in a core's caches is
  // there for the next loop's same index. Other loops are unaffected.
  void set_pinned_chunks(bool on) { pinned_ = on; }

 private:
  void WorkerLoop(int index);
  void RunChunks(int index);
  // Polls `ready` for up to spin_; whether it became true.
  template <typename Ready>
  bool SpinUntil(Ready&& ready) const;

  const int n_threads_;
  const std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  // Set before the last advance of generation_, so a worker that sees that advance sees it.
  std::atomic<bool> stop_{false};
  // The three fields that threads write during a loop sit on cache lines of their own, so that
  // claiming a chunk (next_) or finishing (pending_) does not take the line away from the
  // workers polling generation_. (On the H200 host the empty loop took 2.4-3.0 us this way and
  // 2.7-5.1 us with one shared line, within that host's noise: docs/benchmarks.md, CUDA run 38.)
  //
  // One advance per loop (32 bits, the futex word; only changes are compared, so it may wrap).
  // The loop's fields beside it are written before it advances (release) and read after a worker
  // sees the new value (acquire), and stay unchanged during the loop.
  alignas(64) std::atomic<uint32_t> generation_{0};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 0;
  bool pinned_ = false, pinned_loop_ = false;
  // The next unclaimed index.
  alignas(64) std::atomic<int64_t> next_{0};
  // Workers still in the current loop; the last one to finish wakes the caller if it sleeps.
  // (alignas also rounds the pool's size up to whole lines, so nothing after it shares this one.)
  alignas(64) std::atomic<int> pending_{0};
};

}  // namespace pinfer
