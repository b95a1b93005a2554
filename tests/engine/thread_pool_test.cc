// The thread pool covers every index exactly once, for any size and grain, and can be reused
// many times in a row, with and without a spin time; RunOnEach runs every index at once on its
// own thread, so a LoopBarrier inside it holds (run under ThreadSanitizer in CI).
#include "shared/util/thread_pool.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pinfer {
namespace {

TEST(ThreadPoolTest, EveryIndexExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 7, 100, 1001}) {
      for (int64_t grain : {1, 3, 64}) {
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, grain, [&](int64_t b, int64_t e) {
          EXPECT_LE(0, b);
          EXPECT_LE(e, n);
          for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
      }
    }
  }
}

TEST(ThreadPoolTest, ManyConsecutiveLoops) {
  ThreadPool pool(3);
  std::atomic<int64_t> sum{0};
  for (int rep = 0; rep < 2000; ++rep) {
    pool.ParallelFor(50, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sum.fetch_add(i);
    });
  }
  EXPECT_EQ(sum.load(), 2000 * (49 * 50 / 2));
}

// A spinning pool: loops back to back stay awake; after a pause longer than the spin time the
// workers and the caller have gone to sleep and must be woken, and nothing is lost either way.
TEST(ThreadPoolTest, SpinningPoolCoversEveryIndexAwakeAndAfterSleeping) {
  for (int threads : {2, 4}) {
    ThreadPool pool(threads, std::chrono::microseconds(200));
    EXPECT_EQ(pool.spin(), std::chrono::microseconds(200));
    for (int rep = 0; rep < 300; ++rep) {
      const int64_t n = 1 + rep % 97;
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "rep " << rep << " i " << i;
      // Every 50th loop, a pause well past the spin time: everyone sleeps before the next loop.
      if (rep % 50 == 49) std::this_thread::sleep_for(std::chrono::milliseconds(3));
    }
  }
}

// A slow worker: the caller's spin runs out while the loop is still going, and it sleeps until the
// last chunk is done.
TEST(ThreadPoolTest, CallerSleepsThroughALoopLongerThanItsSpin) {
  ThreadPool pool(3, std::chrono::microseconds(50));
  std::atomic<int> done{0};
  for (int rep = 0; rep < 5; ++rep) {
    pool.ParallelFor(3, 1, [&](int64_t b, int64_t e) {
      if (b == 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      done.fetch_add(static_cast<int>(e - b));
    });
    EXPECT_EQ(done.load(), 3 * (rep + 1));
  }
}

// Each call of a RunOnEach loop writes its slot, meets the others at a barrier and then reads
// every slot: a call that ran before another had written (or two indices on one thread, which
// would never pass the barrier) fails or hangs. More threads than this machine's cores too: the
// barrier's waiters yield to the calls still working.
TEST(ThreadPoolTest, RunOnEachRunsEveryIndexAtOnceOnItsOwnThread) {
  for (int threads : {1, 2, 4, 8}) {
    for (int spin_us : {0, 200}) {
      ThreadPool pool(threads, std::chrono::microseconds(spin_us));
      for (int rep = 0; rep < 200; ++rep) {
        std::vector<int> slot(threads, -1);
        std::vector<std::thread::id> who(threads);
        std::vector<int> seen_sum(threads, 0);
        LoopBarrier written(threads);
        pool.RunOnEach([&](int i) {
          if (i < 0 || i >= threads) std::abort();  // returning would leave the others waiting
          slot[i] = rep + i;
          who[i] = std::this_thread::get_id();
          written.ArriveAndWait();
          for (int j = 0; j < threads; ++j) seen_sum[i] += slot[j];
        });
        const int want = threads * rep + threads * (threads - 1) / 2;
        for (int i = 0; i < threads; ++i) ASSERT_EQ(seen_sum[i], want) << "rep " << rep;
        EXPECT_EQ(std::set<std::thread::id>(who.begin(), who.end()).size(),
                  static_cast<size_t>(threads));
        EXPECT_EQ(who[0], std::this_thread::get_id());  // the caller runs index 0
      }
      // The pool still runs ordinary loops after RunOnEach, and the other way round.
      std::atomic<int64_t> sum{0};
      pool.ParallelFor(100, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) sum.fetch_add(i);
      });
      EXPECT_EQ(sum.load(), 99 * 100 / 2);
    }
  }
}

}  // namespace
}  // namespace pinfer
