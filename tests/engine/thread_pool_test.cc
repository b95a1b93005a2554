// The thread pool covers every index exactly once, for any size and grain, and can be reused
// many times in a row, with and without a spin time (run under ThreadSanitizer in CI).
#include "shared/util/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "shared/util/ranges_on_threads.h"

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

// With pinned chunks, a loop of size() single-index chunks runs index i on the same thread every
// time, index 0 on the caller; loops of another size still cover every index once.
// RunRangesOnThreads (the CUDA module's pinned copy): every index once, on min(n, threads)
// threads, the first range on the caller's, for counts below, at and above the thread count.
TEST(ThreadPoolTest, RangesOnThreadsCoverEveryIndexOnce) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{16}, size_t{1000}, size_t{4099}}) {
    for (int threads : {1, 3, 16}) {
      std::vector<std::atomic<int>> hits(n);
      std::vector<std::thread::id> ids(n);
      RunRangesOnThreads(n, threads, [&](size_t b, size_t e) {
        ASSERT_LE(b, e);
        ASSERT_LE(e, n);
        for (size_t i = b; i < e; ++i) {
          hits[i].fetch_add(1);
          ids[i] = std::this_thread::get_id();
        }
      });
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(hits[i].load(), 1) << n << " " << threads << " " << i;
      std::vector<std::thread::id> distinct;
      for (const std::thread::id& id : ids) {
        if (std::find(distinct.begin(), distinct.end(), id) == distinct.end())
          distinct.push_back(id);
      }
      EXPECT_EQ(distinct.size(), std::min<size_t>(n, threads)) << n << " " << threads;
      if (n >= static_cast<size_t>(threads)) {
        EXPECT_EQ(ids[0], std::this_thread::get_id());  // the first range is the caller's
      }
    }
  }
}

TEST(ThreadPoolTest, PinnedChunksKeepEachIndexOnOneThread) {
  for (auto spin : {std::chrono::microseconds(0), std::chrono::microseconds(200)}) {
    ThreadPool pool(4, spin);
    pool.set_pinned_chunks(true);
    std::vector<std::thread::id> first(4);
    for (int rep = 0; rep < 200; ++rep) {
      std::vector<std::thread::id> who(4);
      std::vector<std::atomic<int>> hits(4);
      pool.ParallelFor(4, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          who[i] = std::this_thread::get_id();
          hits[i].fetch_add(1);
        }
      });
      for (int i = 0; i < 4; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
      if (rep == 0) first = who;
      ASSERT_EQ(who, first) << "rep " << rep;
      ASSERT_EQ(who[0], std::this_thread::get_id());
      std::vector<std::atomic<int>> more(9);
      pool.ParallelFor(9, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) more[i].fetch_add(1);
      });
      for (int i = 0; i < 9; ++i) ASSERT_EQ(more[i].load(), 1) << i;
    }
    // Four different threads.
    for (int i = 0; i < 4; ++i)
      for (int j = i + 1; j < 4; ++j) EXPECT_NE(first[i], first[j]);
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

}  // namespace
}  // namespace pinfer
