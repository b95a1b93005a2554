// See thread_pool.h.
#include "shared/util/thread_pool.h"

#include <algorithm>

namespace pinfer {

ThreadPool::ThreadPool(int n_threads, std::chrono::microseconds spin)
    : n_threads_(std::max(1, n_threads)), spin_(std::max(spin, std::chrono::microseconds(0))) {
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& t : workers_) t.join();
}

template <typename Ready>
bool ThreadPool::SpinUntil(Ready&& ready) const {
  if (spin_.count() == 0) return ready();
  const auto deadline = std::chrono::steady_clock::now() + spin_;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    // Reading the clock costs about as much as a few dozen polls.
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= deadline) return false;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

void ThreadPool::RunChunks(int index) {
  if (pinned_loop_) {
    (*fn_)(index, index + 1);
    return;
  }
  for (;;) {
    int64_t b = next_.fetch_add(chunk_);
    if (b >= n_) return;
    (*fn_)(b, std::min(n_, b + chunk_));
  }
}

void ThreadPool::WorkerLoop(int index) {
  uint32_t seen = 0;
  for (;;) {
    if (!SpinUntil([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      generation_.wait(seen, std::memory_order_acquire);  // returns once it differs
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_relaxed)) return;
    RunChunks(index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  // Several chunks per thread balance uneven rows (sparse work) without much overhead.
  int64_t chunk = std::max(grain, (n + 4 * n_threads_ - 1) / (4 * n_threads_));
  fn_ = &fn;
  n_ = n;
  chunk_ = chunk;
  pinned_loop_ = pinned_ && n == n_threads_ && chunk == 1;
  next_.store(0, std::memory_order_relaxed);
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();  // no system call while every worker is still polling
  RunChunks(0);
  if (SpinUntil([&] { return pending_.load(std::memory_order_acquire) == 0; })) return;
  for (int left; (left = pending_.load(std::memory_order_acquire)) != 0;) {
    pending_.wait(left, std::memory_order_acquire);
  }
}

}  // namespace pinfer
