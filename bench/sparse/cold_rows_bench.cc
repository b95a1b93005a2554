// What one layer exchange's cold share costs the cpu-worker, on a model file and without the
// gpu-worker: the cpu-worker's own code (FfnRowStore's copy of the cold rows, PartialFfn::
// Accumulate on a compute pool, NewSimdOps) over a request of `neurons` cold neurons drawn at
// random from a layer's cold set, layer after layer, with `gap_us` of sleep between requests
// (the GPU's part of a layer, during which the pool polls for --spin-us and then sleeps). Through
// the service on the 70B shape the cpu-worker measured 0.21 ms an exchange for ~440 neurons
// (pinfer_worker_exchange_compute_seconds), where the CUDA bench's in-process cold side took
// 0.05 ms for ~390; this says whether the difference is in that code or around it.
//
// The cold set of every layer is its last `cold` neurons (a prepared file stores neurons hot
// first; synthetic_pwri's 70B file left ~24,400 of 28,672 cold in the exchanging layers). Only
// `layers` layers are copied, the last ones of the file, so that the rows' bytes exceed the
// last-level cache as a whole model's do. Per thread count: the median and p90 time of a
// request, the rows' bytes read a second at the median (gate rows of every listed neuron, up and
// down rows of those whose gate is positive), and the same request computed back to back with
// no gap (the pool awake). Besides the product's path (way "accumulate"), the same op on the same
// rows with the parts' partial sums left unsummed ("parts": CpuOps::SparseFfnTokenParts, as the
// CUDA bench's cold side leaves them for the GPU) and, in addition, every listed neuron's three
// rows computed ("silu": SiLU instead of the gate deciding, the CUDA bench's model). Prints a
// table and the command:
//
//   build/bench/sparse/cold_rows_bench model=FILE [threads=14,8,1] [neurons=442] [cold=24362]
//       [layers=8] [requests=600] [gap_us=150] [spin_us=200] [seed=1]
//       [ways=accumulate,parts,silu] [build_threads=14]
#include <sys/prctl.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "shared/engine/ops.h"
#include "shared/service/ffn_split.h"
#include "shared/service/log.h"
#include "shared/service/service_model.h"
#include "shared/shm/segment.h"
#include "shared/util/thread_pool.h"

namespace pinfer {
namespace {

uint64_t Now() { return shm::MonotonicNanos(); }

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> p = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    if (p.size() != 2) {
      std::fprintf(stderr, "arguments are key=value: %s\n", argv[i]);
      return 2;
    }
    kv[p[0]] = p[1];
  }
  auto num = [&](const char* k, int64_t def) {
    int64_t v = def;
    if (kv.count(k) && !absl::SimpleAtoi(kv[k], &v)) {
      std::fprintf(stderr, "%s must be an integer\n", k);
      std::exit(2);
    }
    return v;
  };
  if (!kv.count("model")) {
    std::fprintf(stderr, "usage: cold_rows_bench model=FILE [threads=14,8,1] [neurons=442] ...\n");
    return 2;
  }
  std::vector<int> threads;
  for (absl::string_view t : absl::StrSplit(kv.count("threads") ? kv["threads"] : "14,8,1", ',')) {
    int v;
    if (!absl::SimpleAtoi(t, &v) || v < 1) {
      std::fprintf(stderr, "threads: positive integers, comma-separated\n");
      return 2;
    }
    threads.push_back(v);
  }
  const std::vector<std::string> ways = absl::StrSplit(
      kv.count("ways") ? kv["ways"] : "accumulate,parts,silu", ',', absl::SkipEmpty());
  for (const std::string& w : ways) {
    if (w != "accumulate" && w != "parts" && w != "silu") {
      std::fprintf(stderr, "unknown way %s (accumulate, parts, silu)\n", w.c_str());
      return 2;
    }
  }
  const int neurons = static_cast<int>(num("neurons", 442));
  const int requests = static_cast<int>(std::max<int64_t>(1, num("requests", 600)));
  const int64_t gap_us = num("gap_us", 150), spin_us = num("spin_us", 200);

  // The gaps as asked: a sleeping thread's timer otherwise runs up to 50 us late (the default
  // timer slack), and a 150 us gap then outlasts the pool's 200 us spin (measured here: 167 against
  // 148 us a request, which was the sleep and not the rows).
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  auto loaded = LoadServiceModel(kv["model"]);
  if (!loaded.ok()) {
    std::fprintf(stderr, "cannot load %s: %s\n", kv["model"].c_str(),
                 loaded.status().ToString().c_str());
    return 1;
  }
  const Model& m = loaded->model();
  const int L = m.config.n_layers, F = m.config.ffn_size, H = m.config.hidden_size;
  const int cold = static_cast<int>(std::clamp<int64_t>(num("cold", 24362), 1, F));
  const int layers = static_cast<int>(std::clamp<int64_t>(num("layers", 8), 1, L));
  if (neurons > cold) {
    std::fprintf(stderr, "neurons (%d) must not exceed cold (%d)\n", neurons, cold);
    return 2;
  }
  std::vector<std::vector<int32_t>> sets(L);
  for (int l = L - layers; l < L; ++l) {
    for (int j = F - cold; j < F; ++j) sets[l].push_back(j);
  }
  // The copy as the cpu-worker makes it at start-up: on its compute pool's threads.
  const int build_threads = static_cast<int>(std::max<int64_t>(1, num("build_threads", 14)));
  const uint64_t t_build = Now();
  std::unique_ptr<FfnRowStore> built;  // the cold rows
  {
    ThreadPool build_pool(build_threads);
    auto store = FfnRowStore::Build(m, sets, build_threads > 1 ? &build_pool : nullptr);
    if (!store.ok()) {
      std::fprintf(stderr, "cannot build the rows: %s\n", store.status().ToString().c_str());
      return 1;
    }
    built = std::move(*store);
  }
  ReleaseMappedPages(m);
  std::printf(
      "model: %d layers, hidden %d, ffn %d, %s; %d layers of %d cold neurons copied "
      "(%.2f GB, %.2f GB of the process in huge pages) in %.2f s on %d thread(s)\n",
      L, H, F, std::string(DTypeName(m.layers[0].gate.dtype)).c_str(), layers, cold,
      built->bytes() / 1e9, HugePageBytes() / 1e9, (Now() - t_build) * 1e-9, build_threads);

  // Requests: a layer (round robin over the copied ones) and `neurons` distinct cold ids.
  const int words = (F + 63) / 64;
  std::mt19937_64 rng(static_cast<uint64_t>(num("seed", 1)));
  std::vector<std::vector<uint64_t>> masks(requests, std::vector<uint64_t>(words, 0));
  std::vector<int32_t> ids(cold);
  for (int r = 0; r < requests; ++r) {
    for (int j = 0; j < cold; ++j) ids[j] = F - cold + j;
    for (int i = 0; i < neurons; ++i) {  // a partial Fisher-Yates shuffle
      std::swap(ids[i], ids[i + std::uniform_int_distribution<int>(0, cold - 1 - i)(rng)]);
      masks[r][ids[i] >> 6] |= uint64_t{1} << (ids[i] & 63);
    }
  }
  std::vector<float> x(H), out(H);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& v : x) v = nd(rng);
  const FfnRowStore::Layer& l0 = built->layer(L - 1);
  const double gate_b = static_cast<double>(l0.gate.row_bytes()),
               updown_b = static_cast<double>(l0.up.row_bytes() + l0.down_t.row_bytes());

  std::printf(
      "\n| threads | way | gap us | request median us | p90 us | active of %d | GB/s at the "
      "median | back to back, median us |\n|---|---|---|---|---|---|---|---|\n",
      neurons);
  for (int t : threads) {
    for (const std::string& way : ways) {
      ThreadPool pool(t, std::chrono::microseconds(spin_us));
      std::unique_ptr<CpuOps> ops = NewSimdOps(&pool);
      PartialFfn ffn(*built, m.config.activation, *ops);
      std::vector<int32_t> sel;
      std::vector<float> coef(cold), parts(static_cast<size_t>(t) * H);
      const Activation act = way == "silu" ? Activation::kSilu : m.config.activation;
      auto run = [&](int r) -> uint64_t {
        const int layer = L - layers + r % layers;
        if (way == "accumulate") {
          std::fill(out.begin(), out.end(), 0.f);
          return ffn.Accumulate(layer, x.data(), 1, masks[r % requests].data(), words, out.data());
        }
        const FfnRowStore::Layer& fl = built->layer(layer);
        sel.clear();
        fl.Select(masks[r % requests].data(), &sel);  // r % requests: the warm-up's layers
        int n_parts = 0;
        ops->SparseFfnTokenParts(fl.gate, fl.up, fl.down_t, sel.data(),
                                 static_cast<int>(sel.size()), act, x.data(), nullptr, coef.data(),
                                 parts.data(), t, &n_parts);
        uint64_t nz = 0;
        for (size_t i = 0; i < sel.size(); ++i) nz += coef[i] != 0;
        return act == Activation::kSilu ? sel.size() : nz;
      };
      for (int r = 0; r < layers; ++r) run(r);  // warm: each layer's scratch, the pool's threads
      std::vector<double> gapped, packed;
      uint64_t active = 0;
      const timespec gap{0, static_cast<long>(gap_us * 1000)};
      for (int r = 0; r < requests; ++r) {
        if (gap_us > 0) nanosleep(&gap, nullptr);
        const uint64_t t0 = Now();
        active += run(r);
        gapped.push_back((Now() - t0) * 1e-3);
      }
      for (int r = 0; r < requests; ++r) {
        const uint64_t t0 = Now();
        run(r);
        packed.push_back((Now() - t0) * 1e-3);
      }
      const double med = Quantile(gapped, 0.5);
      const double live = static_cast<double>(active) / requests;
      const double bytes = neurons * gate_b + live * updown_b;
      std::printf("| %d | %s | %lld | %.1f | %.1f | %.1f | %.1f | %.1f |\n", t, way.c_str(),
                  static_cast<long long>(gap_us), med, Quantile(gapped, 0.9), live,
                  bytes / (med * 1e3), Quantile(packed, 0.5));
    }
  }
  std::printf("\ncommand:");
  for (int i = 0; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n");
  return 0;
}

}  // namespace
}  // namespace pinfer

int main(int argc, char** argv) { return pinfer::Main(argc, argv); }
