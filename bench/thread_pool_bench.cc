// What a loop on the compute pool costs beyond its work, as the cpu-worker runs one per layer
// exchange: the caller idles `gap_us` (the GPU's part of the layer), then starts a loop of one
// chunk per thread, each busy for `work_us` (that thread's share of the cold rows). A gap longer
// than the pool's spin time finds the workers asleep, so the loop pays for waking them; the last
// worker to start shows how long that takes. Prints a table and the command:
//
//   build/bench/thread_pool_bench [threads=N,...] [gaps_us=0,100,1000] [spin_us=200]
//       [work_us=20] [loops=2000]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "shared/util/thread_pool.h"

namespace pinfer {
namespace {

uint64_t Now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void BusyUntil(uint64_t end) {
  while (Now() < end) {
  }
}

struct Row {
  double overhead_med = 0, overhead_p90 = 0, last_start_med = 0, last_start_p90 = 0;
};

double At(std::vector<double>& v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

Row Measure(ThreadPool& pool, int64_t gap_us, int64_t work_us, int loops) {
  const int n = pool.size();
  std::vector<std::atomic<uint64_t>> start(n);
  std::vector<double> overhead, last_start;
  for (int i = 0; i < loops + 10; ++i) {
    BusyUntil(Now() + gap_us * 1000);
    const uint64_t t0 = Now();
    pool.ParallelFor(n, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        const uint64_t s = Now();
        start[c].store(s, std::memory_order_relaxed);
        BusyUntil(s + work_us * 1000);
      }
    });
    const uint64_t t1 = Now();
    if (i < 10) continue;  // warm-up
    uint64_t last = t0;
    for (auto& s : start) last = std::max(last, s.load(std::memory_order_relaxed));
    overhead.push_back((t1 - t0) * 1e-3 - static_cast<double>(work_us));
    last_start.push_back((last - t0) * 1e-3);
  }
  return {At(overhead, 0.5), At(overhead, 0.9), At(last_start, 0.5), At(last_start, 0.9)};
}

bool ParseList(const std::string& s, std::vector<int64_t>* out) {
  out->clear();
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(p, &v) || v < 0) return false;
    out->push_back(v);
  }
  return !out->empty();
}

int Main(int argc, char** argv) {
  std::vector<int64_t> threads = {static_cast<int64_t>(std::thread::hardware_concurrency())},
                       gaps = {0, 100, 1000};
  int64_t spin_us = 200, work_us = 20, loops = 2000;
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    bool ok = kv.size() == 2;
    if (ok && kv[0] == "threads") {
      ok = ParseList(kv[1], &threads);
    } else if (ok && kv[0] == "gaps_us") {
      ok = ParseList(kv[1], &gaps);
    } else if (ok && (kv[0] == "spin_us" || kv[0] == "work_us" || kv[0] == "loops")) {
      int64_t* v = kv[0] == "spin_us" ? &spin_us : kv[0] == "work_us" ? &work_us : &loops;
      ok = absl::SimpleAtoi(kv[1], v) && *v >= 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "unknown or bad argument %s\n", argv[i]);
      return 2;
    }
  }
  if (loops < 1) {
    std::fprintf(stderr, "loops >= 1\n");
    return 2;
  }
  std::printf("thread_pool_bench threads=%s gaps_us=%s spin_us=%lld work_us=%lld loops=%lld\n",
              absl::StrJoin(threads, ",").c_str(), absl::StrJoin(gaps, ",").c_str(),
              static_cast<long long>(spin_us), static_cast<long long>(work_us),
              static_cast<long long>(loops));
  std::printf(
      "| threads | gap us | loop beyond its work, median us | p90 us | last worker started "
      "after, median us | p90 us |\n|---|---|---|---|---|---|\n");
  for (int64_t t : threads) {
    ThreadPool pool(static_cast<int>(std::max<int64_t>(t, 1)), std::chrono::microseconds(spin_us));
    for (int64_t gap : gaps) {
      const Row r = Measure(pool, gap, work_us, static_cast<int>(loops));
      std::printf("| %lld | %lld | %.1f | %.1f | %.1f | %.1f |\n", static_cast<long long>(t),
                  static_cast<long long>(gap), r.overhead_med, r.overhead_p90, r.last_start_med,
                  r.last_start_p90);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace pinfer

int main(int argc, char** argv) { return pinfer::Main(argc, argv); }
