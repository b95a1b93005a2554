// Scratch: one thread's share of a layer's cold op, rows in cache, Q4_0 vs F16.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <algorithm>
#include <string>
#include "shared/engine/ops.h"
using namespace pinfer;
int main(int argc, char** argv) {
  const int H = 5120, K = argc > 1 ? atoi(argv[1]) : 22, reps = 5000;
  for (DType dt : {DType::kQ4_0, DType::kF16}) {
    const size_t rb = RowBytes(dt, H);
    std::vector<uint8_t> bundles(3 * rb * K);
    std::mt19937 rng(1);
    for (auto& b : bundles) b = rng() & 0x3f;  // small fp16 values / nibbles
    TensorView g, u, d;
    for (TensorView* v : {&g, &u, &d}) { v->dtype = dt; v->shape = {K, H}; v->row_stride = 3 * rb; }
    g.data = bundles.data(); u.data = bundles.data() + rb; d.data = bundles.data() + 2 * rb;
    std::vector<int32_t> rows(K); for (int i = 0; i < K; ++i) rows[i] = i;
    std::vector<float> x(H), a(K), out(H);
    for (auto& v : x) v = (rng() % 1000) * 1e-3f - 0.5f;
    auto ops = NewSimdOps(nullptr); static bool once = (std::printf("simd %s\n", std::string(SimdLevel()).c_str()), true); (void)once;
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      std::fill(out.begin(), out.end(), 0.f);
      auto t0 = std::chrono::steady_clock::now();
      ops->SparseFfnToken(g, u, d, rows.data(), K, Activation::kSilu, x.data(), nullptr, a.data(), out.data());
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    std::printf("%s: %d neurons in cache, one thread: median %.2f us (%.3f us a neuron, %.1f GB/s)\n",
                dt == DType::kQ4_0 ? "Q4_0" : "F16", K, t[t.size() / 2], t[t.size() / 2] / K,
                3.0 * rb * K / t[t.size() / 2] * 1e-3);
  }
}
