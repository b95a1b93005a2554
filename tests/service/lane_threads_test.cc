// The decode lanes' threads (gpu-worker/lane_threads.h), which the CUDA backend's DecodeBatch
// uses: every item runs once, on the lane the round-robin deal gives it, each lane in order and
// all lanes at once; a lane's error stops that lane only and comes back once every lane is done.
// Runs under TSan in scripts/test.sh.
#include "gpu-worker/lane_threads.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pinfer::gpuworker {
namespace {

std::vector<std::unique_ptr<LaneThread>> Threads(int n) {
  std::vector<std::unique_ptr<LaneThread>> t;
  for (int i = 0; i < n; ++i) t.push_back(std::make_unique<LaneThread>());
  return t;
}

TEST(LaneThreadsTest, EveryItemRunsOnceOnItsLaneInOrder) {
  auto threads = Threads(3);
  for (size_t n : {0, 1, 2, 3, 4, 5, 9, 17}) {
    SCOPED_TRACE(n);
    const size_t lanes = std::min<size_t>(n, 4);
    std::mutex mu;
    std::vector<int> runs(n, 0);
    std::vector<std::vector<size_t>> order(4);
    std::vector<std::thread::id> lane_thread(4);
    const std::thread::id caller = std::this_thread::get_id();
    absl::Status st = RunDealt(n, threads, [&](size_t lane, size_t item) {
      std::lock_guard<std::mutex> lock(mu);
      ++runs[item];
      order[lane].push_back(item);
      if (order[lane].size() == 1) {
        lane_thread[lane] = std::this_thread::get_id();
      } else {
        EXPECT_EQ(lane_thread[lane], std::this_thread::get_id()) << "lane " << lane;
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(runs[i], 1) << "item " << i;
    for (size_t lane = 0; lane < lanes; ++lane) {
      std::vector<size_t> want;
      for (size_t i = lane; i < n; i += lanes) want.push_back(i);
      EXPECT_EQ(order[lane], want) << "lane " << lane;
    }
    for (size_t lane = lanes; lane < 4; ++lane) EXPECT_TRUE(order[lane].empty());
    if (n > 0) {
      EXPECT_EQ(lane_thread[0], caller);
    }
    for (size_t lane = 1; lane < lanes; ++lane) EXPECT_NE(lane_thread[lane], caller);
    size_t off_first = 0;
    for (size_t lane = 1; lane < 4; ++lane) off_first += order[lane].size();
    EXPECT_EQ(ItemsOffTheFirstLane(n, 3), off_first);
  }
}

// Each lane's first item waits until every lane has started one: run one lane after another,
// this would never finish (the wait gives up after 10 s and fails the test instead).
TEST(LaneThreadsTest, LanesRunAtOnce) {
  auto threads = Threads(3);
  for (int round = 0; round < 50; ++round) {
    std::atomic<int> started{0};
    absl::Status st = RunDealt(8, threads, [&](size_t lane, size_t item) {
      if (item == lane) {
        started.fetch_add(1);
        const auto t0 = std::chrono::steady_clock::now();
        while (started.load() < 4) {
          if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(10)) {
            return absl::DeadlineExceededError("lanes did not run at once");
          }
          std::this_thread::yield();
        }
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << "round " << round << ": " << st;
  }
}

// A failing item stops its lane; the other lanes finish their items; the lowest failing lane's
// error comes back, and the threads take the next batch as usual.
TEST(LaneThreadsTest, ALanesErrorStopsThatLaneOnlyAndComesBackAfterAll) {
  auto threads = Threads(2);
  std::vector<std::atomic<int>> runs(9);
  absl::Status st = RunDealt(9, threads, [&](size_t lane, size_t item) {
    runs[item].fetch_add(1);
    if (item == 4) return absl::UnavailableError("cold side gone (lane 1, item 4)");
    if (item == 5) return absl::InternalError("lane 2, item 5");
    return absl::OkStatus();
  });
  EXPECT_EQ(st, absl::UnavailableError("cold side gone (lane 1, item 4)"));
  // Lane 0: 0, 3, 6; lane 1: 1, 4 (stops before 7); lane 2: 2, 5 (stops before 8).
  for (size_t i : {0, 1, 2, 3, 4, 5, 6}) EXPECT_EQ(runs[i].load(), 1) << "item " << i;
  EXPECT_EQ(runs[7].load(), 0);
  EXPECT_EQ(runs[8].load(), 0);
  // The first lane's error wins over later lanes'.
  st = RunDealt(3, threads, [&](size_t lane, size_t) {
    return lane == 0 ? absl::OkStatus() : absl::AbortedError(std::to_string(lane));
  });
  EXPECT_EQ(st, absl::AbortedError("1"));
  st = RunDealt(3, threads, [](size_t, size_t) { return absl::OkStatus(); });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace pinfer::gpuworker
