// The cost of one layer's handoff between the workers, without either side's compute: the
// gpu-worker's wait for a cpu-worker answer beyond the answer's own compute time, for each
// polling time of the two ends (--exchange-spin-us). A forked child plays the cpu-worker (its
// handler busy-waits `compute_us`, standing for the cold rows); the parent plays the gpu-worker,
// busy for `gap_us` before each post (a layer's attention and hot rows), then waits. Both spin
// times are set alike, as the workers' flags would be. With threads=N (N > 1) the child computes
// as the cpu-worker does, on a pool of N threads polling pool_spin_us (--threads, --spin-us):
// one chunk of compute_us per thread, so the pool's wake-up is part of the handoff. Prints a
// table and the command:
//
//   build/bench/exchange_bench [hidden=8192] [layers=66] [steps=100] [gap_us=100]
//       [compute_us=50] [spins=0,20,200,1000] [threads=1] [pool_spin_us=200]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "shared/shm/activation_channel.h"
#include "shared/shm/segment.h"
#include "shared/shm/wait.h"
#include "shared/util/thread_pool.h"

namespace pinfer::shm {
namespace {

void BusyFor(uint64_t ns) {
  const uint64_t end = MonotonicNanos() + ns;
  while (MonotonicNanos() < end) {
  }
}

struct Result {
  double median_us = 0, p90_us = 0;
};

// One child per spin time, so that each row starts from a fresh pair.
Result RunPair(const Geometry& g, int steps, uint64_t gap_ns, uint64_t compute_ns, int64_t spin_ns,
               int threads, int64_t pool_spin_us) {
  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, g);
  if (!seg.ok()) {
    std::fprintf(stderr, "%s\n", seg.status().ToString().c_str());
    std::exit(1);
  }
  ChannelOptions co;
  co.spin_ns = spin_ns;
  const pid_t pid = ::fork();
  if (pid == 0) {
    auto att = Segment::Attach(name, g);
    if (!att.ok()) ::_exit(3);
    ExchangeServer s(std::move(*att), co);
    ThreadPool pool(threads, std::chrono::microseconds(pool_spin_us));
    s.MarkReady(0);
    std::atomic<bool> stop{false};
    (void)s.Serve(
        [&](int, const float*, int, const uint64_t*, float* out) -> absl::StatusOr<uint64_t> {
          pool.ParallelFor(threads, 1, [&](int64_t b, int64_t e) {
            for (int64_t c = b; c < e; ++c) BusyFor(compute_ns);
          });
          out[0] = 1.f;
          return 1;
        },
        stop);
    ::_exit(0);
  }
  ExchangeClient client(std::move(*seg), co);
  while (!client.PeerReady()) BusyFor(1'000'000);
  std::vector<float> x(g.hidden, 0.5f), out(g.hidden);
  std::vector<double> overhead_us;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < g.n_layers; ++layer) {
      BusyFor(gap_ns);
      const uint64_t t0 = MonotonicNanos();
      auto seq = client.Post(layer, x.data(), 1, nullptr);
      if (!seq.ok() || !client.AwaitAndAdd(*seq, 1, out.data(), nullptr).ok()) {
        std::fprintf(stderr, "exchange failed\n");
        std::exit(1);
      }
      const uint64_t t1 = MonotonicNanos();
      if (step > 0) overhead_us.push_back((t1 - t0 - compute_ns) * 1e-3);  // step 0 warms up
    }
  }
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  std::sort(overhead_us.begin(), overhead_us.end());
  return {overhead_us[overhead_us.size() / 2], overhead_us[overhead_us.size() * 9 / 10]};
}

int Main(int argc, char** argv) {
  int64_t hidden = 8192, layers = 66, steps = 100, gap_us = 100, compute_us = 50, threads = 1,
          pool_spin_us = 200;
  std::string spins = "0,20,200,1000";
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    int64_t* target = kv[0] == "hidden"         ? &hidden
                      : kv[0] == "layers"       ? &layers
                      : kv[0] == "steps"        ? &steps
                      : kv[0] == "gap_us"       ? &gap_us
                      : kv[0] == "compute_us"   ? &compute_us
                      : kv[0] == "threads"      ? &threads
                      : kv[0] == "pool_spin_us" ? &pool_spin_us
                                                : nullptr;
    if (kv.size() == 2 && kv[0] == "spins") {
      spins = kv[1];
    } else if (kv.size() != 2 || target == nullptr || !absl::SimpleAtoi(kv[1], target)) {
      std::fprintf(stderr, "unknown or bad argument %s\n", argv[i]);
      return 2;
    }
  }
  if (steps < 2 || layers < 1 || hidden < 1 || threads < 1 || pool_spin_us < 0) {
    std::fprintf(stderr, "steps >= 2, layers >= 1, hidden >= 1, threads >= 1, pool_spin_us >= 0\n");
    return 2;
  }
  Geometry g;
  g.n_layers = static_cast<int>(layers);
  g.hidden = static_cast<int>(hidden);
  g.ffn = 64;
  g.max_tokens = 1;
  g.fingerprint = 0xbe7c;
  std::printf(
      "exchange_bench hidden=%lld layers=%lld steps=%lld gap_us=%lld compute_us=%lld "
      "spins=%s threads=%lld pool_spin_us=%lld\n",
      static_cast<long long>(hidden), static_cast<long long>(layers), static_cast<long long>(steps),
      static_cast<long long>(gap_us), static_cast<long long>(compute_us), spins.c_str(),
      static_cast<long long>(threads), static_cast<long long>(pool_spin_us));
  std::printf(
      "| spin us (both ends) | handoff median us | p90 us | per token of %lld layers, ms |\n",
      static_cast<long long>(layers));
  std::printf("|---|---|---|---|\n");
  for (absl::string_view s : absl::StrSplit(spins, ',')) {
    int64_t spin_us = 0;
    if (!absl::SimpleAtoi(s, &spin_us) || spin_us < 0) {
      std::fprintf(stderr, "bad spin %s\n", std::string(s).c_str());
      return 2;
    }
    const Result r = RunPair(g, static_cast<int>(steps), gap_us * 1000, compute_us * 1000,
                             spin_us * 1000, static_cast<int>(threads), pool_spin_us);
    std::printf("| %lld | %.1f | %.1f | %.2f |\n", static_cast<long long>(spin_us), r.median_us,
                r.p90_us, r.median_us * layers * 1e-3);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace pinfer::shm

int main(int argc, char** argv) { return pinfer::shm::Main(argc, argv); }
