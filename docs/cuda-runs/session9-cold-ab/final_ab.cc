// Temporary A/B harness: SparseFfnToken on bundled rows (ffn_bench's setup), variants alternating.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "shared/engine/ops.h"
#include "shared/engine/row_kernels.h"
#include "shared/model/tensor.h"
#include "shared/service/ffn_split.h"
#include "shared/util/aligned_buffer.h"

using namespace pinfer;
void* OrigMakeOps();
const char* OrigName(void* ops);
int OrigSparse(void* ops, const void* gate, const void* up, const void* down_t, const int32_t* rows,
               int n, const float* x, float* a, float* out);

struct Matrix {
  TensorView view;
  AlignedBytes storage;
};
Matrix RandomMatrix(int64_t rows, int64_t cols, DType dt, std::mt19937& rng, float scale) {
  Matrix m;
  m.view.dtype = dt;
  m.view.shape = {rows, cols};
  m.storage = AllocateAligned(m.view.nbytes());
  m.view.data = m.storage.get();
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : row) v = d(rng);
    QuantizeRow(dt, row.data(), m.storage.get() + r * m.view.row_bytes(), cols);
  }
  return m;
}
static std::vector<uint8_t> junk(96u << 20, 1);
void Flush() {
  uint8_t acc = 0;
  for (size_t i = 0; i < junk.size(); i += 64) acc ^= junk[i];
  asm volatile("" : : "r"(acc));
}
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Variant {
  int bits, pf_bytes, pf_hint;
};

int main(int argc, char** argv) {
  // usage: ab dtype rounds v1 v2 ... (each v: bits[:pfbytes[:hint]]); flush via env NOFLUSH
  const std::string dts = argc > 1 ? argv[1] : "Q4_0";
  const int rounds = argc > 2 ? atoi(argv[2]) : 3;
  std::vector<Variant> vars;
  for (int i = 3; i < argc; ++i) {
    Variant v{0, 0, 1};
    sscanf(argv[i], "%d:%d:%d", &v.bits, &v.pf_bytes, &v.pf_hint);
    vars.push_back(v);
  }
  if (vars.empty()) vars = {{0, 0, 1}, {3, 0, 1}};
  const bool flush = getenv("NOFLUSH") == nullptr;
  const int H = 4096, F = 11008, tokens = 15;
  const double active = 0.1;
  void* orig = OrigMakeOps();
  auto ops = getenv("AVX2") ? NewSimdOpsWithKernels(nullptr, RowKernelsAvx2()) : NewSimdOps(nullptr);
  std::mt19937 rng(42);
  std::vector<int> perm(F);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<double> base(F), prob(F);
  for (int k = 0; k < F; ++k) base[k] = 1.0 / (k + 1);
  double lo = 0, hi = 1e6;
  for (int it = 0; it < 100; ++it) {
    const double c = (lo + hi) / 2;
    double mean = 0;
    for (double b : base) mean += std::min(1.0, c * b);
    (mean / F < active ? lo : hi) = c;
  }
  for (int k = 0; k < F; ++k) prob[perm[k]] = std::min(1.0, lo * base[k]);
  std::vector<std::vector<int32_t>> masks(tokens);
  std::uniform_real_distribution<double> u01;
  for (auto& m : masks)
    for (int j = 0; j < F; ++j)
      if (u01(rng) < prob[j]) m.push_back(j);
  DType dt = *DTypeFromName(dts);
  Matrix gate = RandomMatrix(F, H, dt, rng, 0.02f), up = RandomMatrix(F, H, dt, rng, 0.02f),
         down_t = RandomMatrix(F, H, dt, rng, 0.02f);
  std::vector<float> x(H);
  std::normal_distribution<float> nd;
  for (float& v : x) v = nd(rng);
  std::vector<int32_t> all(F);
  std::iota(all.begin(), all.end(), 0);
  const NeuronBundles bundles = BundleRows(gate.view, up.view, down_t.view, all);
  const size_t nv = vars.size();
  std::vector<std::vector<double>> ms(nv);
  std::vector<std::vector<float>> ref_out(tokens), ref_a(tokens);
  std::vector<float> out(H), a(F);
  int mismatches = 0;
  for (int r = 0; r < rounds; ++r) {
    for (int t = 0; t < tokens; ++t) {
      for (size_t i = 0; i < nv; ++i) {
        const size_t v = (i + r + t) % nv;
        std::fill(out.begin(), out.end(), 0.f);
        if (flush) Flush();
        const auto t0 = std::chrono::steady_clock::now();
        if (vars[v].bits == 0) {
          OrigSparse(orig, &bundles.gate, &bundles.up, &bundles.down_t, masks[t].data(),
                     static_cast<int>(masks[t].size()), x.data(), a.data(), out.data());
        } else {
          ops->SparseFfnToken(bundles.gate, bundles.up, bundles.down_t, masks[t].data(),
                              static_cast<int>(masks[t].size()), Activation::kSilu, x.data(),
                              nullptr, a.data(), out.data());
        }
        ms[v].push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
        if (ref_out[t].empty()) {
          ref_out[t] = out;
          ref_a[t] = a;
        } else if (memcmp(ref_out[t].data(), out.data(), H * 4) ||
                   memcmp(ref_a[t].data(), a.data(), masks[t].size() * 4)) {
          ++mismatches;
        }
      }
    }
  }
  double bytes = 0;
  for (auto& m : masks) bytes += 3.0 * m.size() * gate.view.row_bytes();
  bytes /= tokens;
  for (size_t v = 0; v < nv; ++v) {
    const double med = Median(ms[v]);
    printf("%s %s  median %.4f ms  %.2f GB/s\n", dts.c_str(), vars[v].bits ? "new " : "orig", med, bytes / med / 1e6);
  }
  printf("mismatches: %d (kernels: original %s, new %s)\n", mismatches, OrigName(orig),
         std::string(ops->name()).c_str());
  return 0;
}
