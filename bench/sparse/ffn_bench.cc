// FFN time per token, dense versus sparse, single thread, on one random-weight layer of a real
// model's shape (Llama-2-7B: hidden 4096, FFN 11008), for F16, Q8_0, Q4_0 weights (and any
// other type pinfer computes: q4_k, q5_k, q6_k).
//
// Sparse = what the cpu-worker does for one token: the predictor (fc1 -> ReLU -> fc2, F16 or
// Q8_0 (`prepare --predictor-type`), at the given ranks), then CpuOps::SparseFfnToken over the
// selected neurons (gate row, up row and row of the transposed down projection of each, back to
// back), with each neuron's three rows side by side as FfnRowStore keeps them. For comparison the
// same op over three separate matrices (as PredictedSparseFfn reads a model file), and the same
// work as three row passes (MatMulRows gate, MatMulRows up, AccumulateRows down), what pinfer did
// before the fused op. The selected set is drawn per token from a Zipf-skewed distribution:
// neuron j (in a random order) is active with probability min(1, c / (rank_j + 1)), c chosen so
// that the expected active fraction is `active` (10% by default): a few neurons fire on most
// tokens, most rarely, as profiled ReLU models show.
//
// Between timed tokens the bench reads flush_mib MiB of other memory (96 by default; flush=0
// turns it off), as the other layers of a real model would, so neither path finds the previous
// token's rows in the caches. It must exceed the last-level cache: server parts have 300 MiB.
//
// usage: ffn_bench [hidden=4096] [ffn=11008] [active=0.1] [tokens=20] [ranks=0,256,1024]
//                  [dtypes=f16,q8_0,q4_0] [pred_dtypes=f16,q8_0] [flush=1] [flush_mib=96]
// Prints one JSON object per dtype.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "shared/engine/ops.h"
#include "shared/model/tensor.h"
#include "shared/service/ffn_split.h"
#include "shared/util/aligned_buffer.h"

using namespace pinfer;

namespace {

struct Matrix {
  TensorView view;
  AlignedBytes storage;
  const uint8_t* data() const { return static_cast<const uint8_t*>(view.data); }
  size_t size() const { return view.nbytes(); }
};

Matrix RandomMatrix(int64_t rows, int64_t cols, DType dt, std::mt19937& rng, float scale) {
  Matrix m;
  m.view.dtype = dt;
  m.view.shape = {rows, cols};
  // Aligned like the cpu-worker's row store (FfnRowStore).
  m.storage = AllocateAligned(m.view.nbytes());
  uint8_t* base = m.storage.get();
  m.view.data = base;
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : row) v = d(rng);
    QuantizeRow(dt, row.data(), base + r * m.view.row_bytes(), cols);
  }
  return m;
}

// Reads a buffer larger than the last-level cache (the caches then hold none of the weights).
size_t g_flush_bytes = 96u << 20;
void FlushCaches() {
  static std::vector<uint8_t> junk(g_flush_bytes, 1);
  uint8_t acc = 0;
  for (size_t i = 0; i < junk.size(); i += 64) acc ^= junk[i];
  asm volatile("" : : "r"(acc));  // keeps the reads
}

// Reads k rows of `bytes` each, 256 bytes of each in turn, without arithmetic beyond a sum:
// what the memory system alone allows for that access pattern.
uint64_t ReadRows(const uint8_t* const* rows, int k, size_t bytes) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (size_t c = 0; c + 256 <= bytes; c += 256) {
    for (int j = 0; j < k; ++j) {
      const uint8_t* p = rows[j] + c;
      for (size_t o = 0; o < 256; o += 32) {
        uint64_t v[4];
        std::memcpy(v, p + o, 32);
        a0 += v[0];
        a1 += v[1];
        a2 += v[2];
        a3 += v[3];
      }
    }
  }
  return a0 ^ a1 ^ a2 ^ a3;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> p = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    kv[p[0]] = p.size() > 1 ? p[1] : "";
  }
  auto num = [&](const std::string& k, double def) {
    double v = def;
    if (kv.count(k)) (void)absl::SimpleAtod(kv[k], &v);
    return v;
  };
  const int H = static_cast<int>(num("hidden", 4096)), F = static_cast<int>(num("ffn", 11008));
  const double active = num("active", 0.1);
  const int tokens = static_cast<int>(num("tokens", 20));
  const bool flush = num("flush", 1) != 0;
  g_flush_bytes = static_cast<size_t>(num("flush_mib", 96)) << 20;
  std::vector<int> ranks = {0, 256, 1024};
  if (kv.count("ranks")) {
    ranks.clear();
    for (absl::string_view r : absl::StrSplit(kv["ranks"], ',')) {
      int v;
      if (absl::SimpleAtoi(r, &v)) ranks.push_back(v);
    }
  }
  std::vector<DType> pred_types = {DType::kF16, DType::kQ8_0};
  if (kv.count("pred_dtypes")) {
    pred_types.clear();
    for (absl::string_view t : absl::StrSplit(kv["pred_dtypes"], ',')) {
      if (t != "f16" && t != "q8_0") {
        std::fprintf(stderr, "pred_dtypes: f16 or q8_0, not %s\n", std::string(t).c_str());
        return 2;
      }
      pred_types.push_back(t == "q8_0" ? DType::kQ8_0 : DType::kF16);
    }
  }
  std::vector<std::string> dtypes = {"f16", "q8_0", "q4_0"};
  if (kv.count("dtypes")) dtypes = absl::StrSplit(kv["dtypes"], ',');

  auto ops = NewSimdOps(nullptr);  // single thread
  std::mt19937 rng(42);

  // Zipf-skewed activation probabilities over a random neuron order.
  std::vector<int> perm(F);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<double> base(F), prob(F);
  for (int k = 0; k < F; ++k) base[k] = 1.0 / (k + 1);
  double lo = 0, hi = 1e6;
  for (int it = 0; it < 100; ++it) {  // c such that mean(min(1, c * base)) = active
    const double c = (lo + hi) / 2;
    double mean = 0;
    for (double b : base) mean += std::min(1.0, c * b);
    (mean / F < active ? lo : hi) = c;
  }
  for (int k = 0; k < F; ++k) prob[perm[k]] = std::min(1.0, lo * base[k]);
  std::vector<std::vector<int32_t>> masks(tokens);
  std::uniform_real_distribution<double> u01;
  double mean_active = 0;
  for (auto& m : masks) {
    for (int j = 0; j < F; ++j) {
      if (u01(rng) < prob[j]) m.push_back(j);
    }
    mean_active += static_cast<double>(m.size()) / F / tokens;
  }

  for (const std::string& name : dtypes) {
    auto dt = DTypeFromName(absl::AsciiStrToUpper(name));
    if (!dt.ok()) {
      std::fprintf(stderr, "dtypes: %s\n", std::string(dt.status().message()).c_str());
      return 1;
    }
    std::fprintf(stderr, "%s: building random %d x %d weights...\n", name.c_str(), F, H);
    Matrix gate = RandomMatrix(F, H, *dt, rng, 0.02f);
    Matrix up = RandomMatrix(F, H, *dt, rng, 0.02f);
    Matrix down = RandomMatrix(H, F, *dt, rng, 0.02f);
    Matrix down_t = RandomMatrix(F, H, *dt, rng, 0.02f);  // same shape and dtype as a real down_t
    std::vector<float> x(H), g(F), up_v(F), out(H), a(F);
    std::normal_distribution<float> nd;
    for (float& v : x) v = nd(rng);

    // Median milliseconds of fn(token) over the tokens, each started with cold caches.
    auto time_tokens = [&](const std::function<void(int)>& fn) {
      std::vector<double> ms;
      for (int t = 0; t < tokens; ++t) {
        if (flush) FlushCaches();
        const auto t0 = std::chrono::steady_clock::now();
        fn(t);
        ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
      }
      return Median(ms);
    };
    // Dense: gate, up, activation, down (n = 1).
    const double dense = time_tokens([&](int) {
      ops->MatMul(gate.view, x.data(), 1, g.data());
      ops->MatMul(up.view, x.data(), 1, up_v.data());
      ops->GatedActivation(Activation::kRelu, g.data(), up_v.data(), F);
      ops->MatMul(down.view, g.data(), 1, out.data());
    });
    // Sparse, fused, over the three matrices. The masks stand for the truly active neurons, so
    // every selected neuron must run its up and down rows: SiLU never skips one (ReLU would skip
    // the half whose random gate is negative and flatter the result).
    const double separate_matrices = time_tokens([&](int t) {
      std::fill(out.begin(), out.end(), 0.f);
      ops->SparseFfnToken(gate.view, up.view, down_t.view, masks[t].data(),
                          static_cast<int>(masks[t].size()), Activation::kSilu, x.data(), nullptr,
                          a.data(), out.data());
    });
    // The same with each neuron's gate, up and down rows side by side in one bundle (the
    // cpu-worker's row store layout): one contiguous read per neuron instead of three.
    std::vector<int32_t> all(F);
    std::iota(all.begin(), all.end(), 0);
    const NeuronBundles bundles = BundleRows(gate.view, up.view, down_t.view, all);
    const double bundled = time_tokens([&](int t) {
      std::fill(out.begin(), out.end(), 0.f);
      ops->SparseFfnToken(bundles.gate, bundles.up, bundles.down_t, masks[t].data(),
                          static_cast<int>(masks[t].size()), Activation::kSilu, x.data(), nullptr,
                          a.data(), out.data());
    });
    // Sparse as three row passes.
    const double three_passes = time_tokens([&](int t) {
      const std::vector<int32_t>& rows = masks[t];
      const int k = static_cast<int>(rows.size());
      ops->MatMulRows(gate.view, rows.data(), k, x.data(), 1, g.data());
      ops->MatMulRows(up.view, rows.data(), k, x.data(), 1, up_v.data());
      ops->GatedActivation(Activation::kSilu, g.data(), up_v.data(), k);
      std::fill(out.begin(), out.end(), 0.f);
      ops->AccumulateRows(down_t.view, rows.data(), k, g.data(), 1, out.data());
    });
    // The row kernels' arithmetic alone: the first 64 selected rows over and over, in L2 (GB/s of
    // weights, median of 200 passes): gate/up rows against x, and the down projection's sum of
    // rows.
    double cache_dot = 0, cache_axpy = 0;
    {
      const std::vector<int32_t> hot(masks[0].begin(),
                                     masks[0].begin() + std::min<size_t>(64, masks[0].size()));
      const int k = static_cast<int>(hot.size());
      std::vector<float> coef(k, 0.5f), acc(H, 0.f), dots(k);
      auto in_cache = [&](const std::function<void()>& fn) {
        std::vector<double> s;
        for (int rep = 0; rep < 200; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          fn();
          s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        return static_cast<double>(k) * gate.view.row_bytes() / Median(s) / 1e9;
      };
      cache_dot =
          in_cache([&] { ops->MatMulRows(gate.view, hot.data(), k, x.data(), 1, dots.data()); });
      cache_axpy = in_cache(
          [&] { ops->AccumulateRows(down_t.view, hot.data(), k, coef.data(), 1, acc.data()); });
    }
    // The memory system's ceiling: the same rows only read, one at a time and four at a time,
    // against reading the dense matrices front to back (GB/s).
    const size_t rb = gate.view.row_bytes();
    auto read_rate = [&](int group) {
      size_t bytes = 0;
      for (const auto& m : masks) bytes += 3 * m.size() * rb;
      const double ms = time_tokens([&](int t) {
        uint64_t acc = 0;
        const std::vector<int32_t>& rows = masks[t];
        for (const Matrix* w : {&gate, &up, &down_t}) {
          for (size_t i = 0; i < rows.size(); i += group) {
            const uint8_t* p[4];
            const int k = static_cast<int>(std::min<size_t>(group, rows.size() - i));
            for (int q = 0; q < k; ++q) p[q] = w->view.row(rows[i + q]);
            acc ^= ReadRows(p, k, rb);
          }
        }
        asm volatile("" : : "r"(acc));
      });
      return bytes / static_cast<double>(tokens) / ms / 1e6;
    };
    const double dense_read_ms = time_tokens([&](int) {
      uint64_t acc = 0;
      for (const Matrix* w : {&gate, &up, &down}) {
        const uint8_t* p = w->data();
        acc ^= ReadRows(&p, 1, w->size());
      }
      asm volatile("" : : "r"(acc));
    });
    nlohmann::json j;
    j["in_cache_gbps"] = {{"dot_rows", cache_dot}, {"axpy_rows", cache_axpy}};
    j["read_gbps"] = {{"sequential", 3.0 * gate.size() / dense_read_ms / 1e6},
                      {"random_rows_one_at_a_time", read_rate(1)},
                      {"random_rows_four_at_a_time", read_rate(4)}};
    j["dtype"] = name;
    j["hidden"] = H;
    j["ffn"] = F;
    j["active_fraction"] = mean_active;
    j["flush_mib"] = flush ? static_cast<double>(g_flush_bytes >> 20) : 0.0;
    j["dense_ms_per_token"] = dense;
    j["sparse_ms_per_token"] = bundled;
    j["speedup_rows_only"] = dense / bundled;
    j["separate_matrices_ms_per_token"] = separate_matrices;
    j["separate_matrices_speedup"] = dense / separate_matrices;
    j["three_passes_ms_per_token"] = three_passes;
    j["three_passes_speedup"] = dense / three_passes;
    for (int r : ranks) {
      if (r == 0) continue;
      for (DType pt : pred_types) {
        Matrix fc1 = RandomMatrix(r, H, pt, rng, 0.02f);
        Matrix fc2 = RandomMatrix(F, r, pt, rng, 0.02f);
        std::vector<float> h(r), s(F);
        const double pred = time_tokens([&](int) {
          ops->MatMul(fc1.view, x.data(), 1, h.data());
          for (float& v : h) v = std::max(v, 0.f);
          ops->MatMul(fc2.view, h.data(), 1, s.data());
        });
        const double total = bundled + pred;
        j["predictor"].push_back({{"rank", r},
                                  {"dtype", std::string(DTypeName(pt))},
                                  {"predictor_ms_per_token", pred},
                                  {"sparse_total_ms_per_token", total},
                                  {"speedup", dense / total}});
      }
    }
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}
