// FFN time per token, dense versus sparse, single thread, on one random-weight layer of a real
// model's shape (Llama-2-7B: hidden 4096, FFN 11008), for F16, Q8_0 and Q4_0 weights.
//
// Sparse = what PredictedSparseFfn does for one token: the predictor (fc1 -> ReLU -> fc2, F16, at
// the given ranks), gate rows of the selected neurons (MatMulRows), up rows of the same neurons
// and the rows of the transposed down projection (AccumulateRows). The selected set is drawn per
// token from a Zipf-skewed distribution: neuron j (in a random order) is active with probability
// min(1, c / (rank_j + 1)^s), s = 1, c chosen so that the expected active fraction is `active`
// (10% by default) — a few neurons fire on most tokens, most rarely, as profiled ReLU models show.
//
// usage: ffn_bench [hidden=4096] [ffn=11008] [active=0.1] [tokens=20] [ranks=0,256,1024]
//                  [dtypes=f16,q8_0,q4_0]
// Prints one JSON object per dtype.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "shared/engine/ops.h"
#include "shared/model/tensor.h"

using namespace pinfer;

namespace {

struct Matrix {
  TensorView view;
  std::vector<uint8_t> bytes;
};

Matrix RandomMatrix(int64_t rows, int64_t cols, DType dt, std::mt19937& rng, float scale) {
  Matrix m;
  m.view.dtype = dt;
  m.view.shape = {rows, cols};
  m.bytes.resize(m.view.nbytes());
  m.view.data = m.bytes.data();
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : row) v = d(rng);
    QuantizeRow(dt, row.data(), m.bytes.data() + r * m.view.row_bytes(), cols);
  }
  return m;
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
  std::vector<int> ranks = {0, 256, 1024};
  if (kv.count("ranks")) {
    ranks.clear();
    for (absl::string_view r : absl::StrSplit(kv["ranks"], ',')) {
      int v;
      if (absl::SimpleAtoi(r, &v)) ranks.push_back(v);
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
    auto dt = DTypeFromName(name == "f16" ? "F16" : name == "q8_0" ? "Q8_0" : "Q4_0");
    if (!dt.ok()) continue;
    std::fprintf(stderr, "%s: building random %d x %d weights...\n", name.c_str(), F, H);
    Matrix gate = RandomMatrix(F, H, *dt, rng, 0.02f);
    Matrix up = RandomMatrix(F, H, *dt, rng, 0.02f);
    Matrix down = RandomMatrix(H, F, *dt, rng, 0.02f);
    Matrix down_t = RandomMatrix(F, H, *dt, rng, 0.02f);  // same shape and dtype as a real down_t
    std::vector<float> x(H), g(F), up_v(F), out(H), a(F);
    std::normal_distribution<float> nd;
    for (float& v : x) v = nd(rng);

    // Dense: gate, up, activation, down (n = 1).
    std::vector<double> dense_ms;
    for (int t = 0; t < tokens; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      ops->MatMul(gate.view, x.data(), 1, g.data());
      ops->MatMul(up.view, x.data(), 1, up_v.data());
      ops->GatedActivation(Activation::kRelu, g.data(), up_v.data(), F);
      ops->MatMul(down.view, g.data(), 1, out.data());
      dense_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    // Sparse rows for each token's mask.
    std::vector<double> sparse_ms;
    for (int t = 0; t < tokens; ++t) {
      const std::vector<int32_t>& rows = masks[t];
      const int k = static_cast<int>(rows.size());
      const auto t0 = std::chrono::steady_clock::now();
      ops->MatMulRows(gate.view, rows.data(), k, x.data(), 1, g.data());
      ops->MatMulRows(up.view, rows.data(), k, x.data(), 1, up_v.data());
      for (int i = 0; i < k; ++i) a[i] = std::max(g[i], 0.f) * up_v[i] + 1e-3f;  // all used
      std::fill(out.begin(), out.end(), 0.f);
      ops->AccumulateRows(down_t.view, rows.data(), k, a.data(), 1, out.data());
      sparse_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    nlohmann::json j;
    j["dtype"] = name;
    j["hidden"] = H;
    j["ffn"] = F;
    j["active_fraction"] = mean_active;
    j["dense_ms_per_token"] = Median(dense_ms);
    j["sparse_rows_ms_per_token"] = Median(sparse_ms);
    j["speedup_rows_only"] = Median(dense_ms) / Median(sparse_ms);
    for (int r : ranks) {
      if (r == 0) continue;
      Matrix fc1 = RandomMatrix(r, H, DType::kF16, rng, 0.02f);
      Matrix fc2 = RandomMatrix(F, r, DType::kF16, rng, 0.02f);
      std::vector<float> h(r), s(F);
      std::vector<double> pred_ms;
      for (int t = 0; t < tokens; ++t) {
        const auto t0 = std::chrono::steady_clock::now();
        ops->MatMul(fc1.view, x.data(), 1, h.data());
        for (float& v : h) v = std::max(v, 0.f);
        ops->MatMul(fc2.view, h.data(), 1, s.data());
        pred_ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
      }
      const double total = Median(sparse_ms) + Median(pred_ms);
      j["predictor"].push_back({{"rank", r},
                                {"predictor_ms_per_token", Median(pred_ms)},
                                {"sparse_total_ms_per_token", total},
                                {"speedup", Median(dense_ms) / total}});
    }
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}
