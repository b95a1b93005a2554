// What quantizing x costs the cold side. Q8_0 and Q4_0 rows multiply x quantized to Q8_0
// (llama.cpp's definition, shared/engine/ops.h), and each part of the sparse FFN op quantizes x
// for itself (a copy in each thread's own cache), so a layer's cold neurons pay for one
// quantization per thread. This times, on one thread, each instruction set's quantize_q8x on one
// hidden vector, and SparseFfnToken over n Q4_0 neurons whose rows sit in cache (as after the
// loads ahead of a decode layer) with the set's own quantizer against the scalar one, the two
// alternating call by call so that drift on a shared machine hits both.
//
// usage: quantize_bench [hidden=5120] [neurons=8,22,45] [calls=4000]
// Prints a Markdown table: medians in microseconds.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "shared/engine/ops.h"
#include "shared/engine/row_kernels.h"

namespace pinfer {
namespace {

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

template <typename Fn>
double Micros(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

int Main(int argc, char** argv) {
  int hidden = 5120, calls = 4000;
  std::vector<int> neurons = {8, 22, 45};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq),
                      value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    bool ok = true;
    if (key == "hidden") {
      ok = absl::SimpleAtoi(value, &hidden) && hidden > 0 && hidden % 32 == 0;
    } else if (key == "calls") {
      ok = absl::SimpleAtoi(value, &calls) && calls > 0;
    } else if (key == "neurons") {
      neurons.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        int n = 0;
        ok = ok && absl::SimpleAtoi(s, &n) && n > 0;
        neurons.push_back(n);
      }
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "usage: quantize_bench [hidden=5120] [neurons=8,22,45] [calls=4000]\n");
      return 2;
    }
  }
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> x(hidden), out(hidden);
  for (float& v : x) v = dist(rng);
  std::vector<int8_t> q(hidden);
  std::vector<float> d(hidden / 32);
  std::vector<int32_t> s8(hidden / 4);

  std::vector<const RowKernels*> sets = {RowKernelsScalar()};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && RowKernelsAvx2() != nullptr) {
    sets.push_back(RowKernelsAvx2());
  }
  if (BestRowKernels() != sets.back()) sets.push_back(BestRowKernels());  // AVX-512 where present

  std::printf("hidden %d, one thread, medians of %d calls\n\n", hidden, calls);
  std::printf(
      "| kernels | quantize_q8x | Q4_0 FFN token, n neurons in cache: scalar quantizer / own |\n");
  std::printf("|---|---|---|\n");
  for (const RowKernels* k : sets) {
    std::vector<double> tq;
    for (int c = 0; c < calls; ++c) {
      tq.push_back(
          Micros([&] { k->quantize_q8x(x.data(), hidden, q.data(), d.data(), s8.data()); }));
    }
    std::string token_cells;
    RowKernels with_scalar = *k;
    with_scalar.quantize_q8x = RowKernelsScalar()->quantize_q8x;
    const std::unique_ptr<CpuOps> ops[2] = {NewSimdOpsWithKernels(nullptr, &with_scalar),
                                            NewSimdOpsWithKernels(nullptr, k)};
    for (int n : neurons) {
      // Each neuron's gate, up and down rows side by side, as the cpu-worker stores them.
      const size_t rb = RowBytes(DType::kQ4_0, hidden);
      std::vector<uint8_t> bundles(3 * rb * n);
      for (size_t b = 0; b + sizeof(BlockQ4_0) <= bundles.size(); b += sizeof(BlockQ4_0)) {
        bundles[b] = 0x00;
        bundles[b + 1] = 0x20;  // d = 2^-7 as fp16: finite scales, random nibbles
        for (size_t i = 2; i < sizeof(BlockQ4_0); ++i) bundles[b + i] = rng() & 0xff;
      }
      TensorView gate, up, down_t;
      for (TensorView* v : {&gate, &up, &down_t}) {
        v->dtype = DType::kQ4_0;
        v->shape = {n, hidden};
        v->row_stride = 3 * rb;
      }
      gate.data = bundles.data();
      up.data = bundles.data() + rb;
      down_t.data = bundles.data() + 2 * rb;
      std::vector<int32_t> rows(n);
      for (int i = 0; i < n; ++i) rows[i] = i;
      std::vector<float> a(n);
      std::vector<double> t[2];
      for (int c = 0; c < calls; ++c) {
        for (int w = 0; w < 2; ++w) {
          std::fill(out.begin(), out.end(), 0.f);
          t[w].push_back(Micros([&] {
            ops[w]->SparseFfnToken(gate, up, down_t, rows.data(), n, Activation::kSilu, x.data(),
                                   nullptr, a.data(), out.data());
          }));
        }
      }
      char cell[96];
      std::snprintf(cell, sizeof(cell), "%s%d: %.2f / %.2f", token_cells.empty() ? "" : "; ", n,
                    Median(t[0]), Median(t[1]));
      token_cells += cell;
    }
    std::printf("| %s | %.2f | %s |\n", k->name, Median(tq), token_cells.c_str());
  }
  std::string list;
  for (int n : neurons) {
    if (!list.empty()) list += ',';
    list += std::to_string(n);
  }
  std::printf("\ncommand: quantize_bench hidden=%d neurons=%s calls=%d\n", hidden, list.c_str(),
              calls);
  return 0;
}

}  // namespace
}  // namespace pinfer

int main(int argc, char** argv) { return pinfer::Main(argc, argv); }
