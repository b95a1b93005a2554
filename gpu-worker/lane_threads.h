// The threads behind the CUDA backend's decode lanes (--decode-lanes): a decode batch's
// sequences are dealt round-robin to the calling thread and one LaneThread per extra lane, so
// that each lane runs its share one after another while the lanes run at once. Kept apart from
// the CUDA backend, which needs a GPU, so that it is tested (and run under TSan) anywhere.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <utility>

#include "absl/status/status.h"

namespace pinfer::gpuworker {

// A thread that runs one job at a time: Start hands it a job, Wait returns the job's status.
// (std::mutex rather than absl::Mutex: Debian's Abseil is not built for ThreadSanitizer, which
// would not see its locks, and this class runs under TSan in scripts/test.sh.)
class LaneThread {
 public:
  LaneThread() : thread_([this] { Loop(); }) {}
  ~LaneThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  LaneThread(const LaneThread&) = delete;
  LaneThread& operator=(const LaneThread&) = delete;

  // Only after the previous job's Wait.
  void Start(std::function<absl::Status()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(job);
      done_ = false;
    }
    cv_.notify_all();
  }
  absl::Status Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return result_;
  }

 private:
  void Loop() {
    for (;;) {
      std::function<absl::Status()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || job_ != nullptr; });
        if (job_ == nullptr) return;  // stopping, nothing queued
        job = std::move(job_);
        job_ = nullptr;
      }
      absl::Status st = job();
      {
        std::lock_guard<std::mutex> lock(mu_);
        result_ = std::move(st);
        done_ = true;
      }
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  std::function<absl::Status()> job_;
  absl::Status result_;
  bool done_ = true;
  bool stop_ = false;
  std::thread thread_;  // last: it starts once the members above exist
};

// Runs run(lane, item) for items 0..n-1, dealt round-robin to min(n, 1 + threads.size()) lanes:
// lane 0 on the calling thread, lane g on threads[g - 1]; each lane takes its items in order and
// stops at its first error. Returns once every lane is done: OK, or the lowest lane's error.
inline absl::Status RunDealt(size_t n, std::span<const std::unique_ptr<LaneThread>> threads,
                             const std::function<absl::Status(size_t lane, size_t item)>& run) {
  const size_t lanes = std::min(n, 1 + threads.size());
  auto run_lane = [&run, n, lanes](size_t lane) {
    for (size_t i = lane; i < n; i += lanes) {
      absl::Status st = run(lane, i);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  };
  for (size_t g = 1; g < lanes; ++g) threads[g - 1]->Start([&run_lane, g] { return run_lane(g); });
  absl::Status st = run_lane(0);
  for (size_t g = 1; g < lanes; ++g) {
    absl::Status lane_st = threads[g - 1]->Wait();
    if (st.ok()) st = lane_st;
  }
  return st;
}

// Items run by lanes other than lane 0 (for the lane-steps metric).
inline size_t ItemsOffTheFirstLane(size_t n, size_t threads) {
  const size_t lanes = std::min(n, 1 + threads);
  return lanes == 0 ? 0 : n - (n + lanes - 1) / lanes;
}

}  // namespace pinfer::gpuworker
