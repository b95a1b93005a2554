// The CPU operator set of the forward pass, ggml-style: one interface, a plain scalar reference
// (ReferenceOps) that defines the results, and an optimised implementation (SimdOps: AVX2 /
// AVX-512 chosen at run time, threaded) that tests compare against the reference op by op.
//
// Conventions: activations are fp32, row-major [tokens, features]. Weights are TensorViews in any
// stored dtype, [out_features, in_features]; accumulation is fp32. F32/F16/BF16 rows are
// converted to fp32 on the fly. Q8_0 and Q4_0 rows are multiplied as llama.cpp multiplies them:
// each activation vector is quantized to Q8_0 blocks (d = max|x| / 127 as fp16, q = round(x / d))
// and every block contributes d_w * d_x * (exact integer dot), so quantized models compute what
// llama.cpp computes, with integer SIMD. Q4_K, Q5_K and Q6_K rows (ggml's super-blocks of 256)
// multiply x quantized to Q8_K as ggml's quantize_row_q8_K does it (per 256 values d = max / -127
// in fp32, q = round(x / d), with the 16-value sums of q), each super-block contributing
// d_w * d_x * (exact integer dot with its sub-block scales) - dmin_w * d_x * (exact integer dot
// of its sub-block mins with those sums), as ggml_vec_dot_q*_K_q8_K does. (AccumulateRows keeps
// fp32 coefficients and converts K rows to fp32 a super-block at a time.) A quantized MatMul of
// many tokens (prompt processing) forms the same products with tiled integer kernels (rows by
// tokens), equal to the one-token products up to fp32 summation order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/strings/string_view.h"
#include "shared/model/config.h"
#include "shared/model/tensor.h"
#include "shared/util/thread_pool.h"

namespace pinfer {

// The first neuron of part c when a list of n_rows neurons is split into `parts` equal parts.
inline int SparseFfnPartBegin(int n_rows, int parts, int c) {
  return static_cast<int>(static_cast<int64_t>(n_rows) * c / parts);
}

class CpuOps {
 public:
  virtual ~CpuOps() = default;
  virtual absl::string_view name() const = 0;

  // y: [n, w.rows()] = x: [n, w.cols()] @ w^T
  virtual void MatMul(const TensorView& w, const float* x, int n, float* y) const = 0;
  // Only the listed rows of w: y: [n, n_rows], y[t, i] = w.row(rows[i]) . x[t].
  virtual void MatMulRows(const TensorView& w, const int32_t* rows, int n_rows, const float* x,
                          int n, float* y) const = 0;
  // y: [n, w.cols()] += sum_i a[t, i] * w.row(rows[i]); a: [n, n_rows]. Zero coefficients are
  // skipped, which is how a transposed down projection touches only active neurons.
  virtual void AccumulateRows(const TensorView& w, const int32_t* rows, int n_rows, const float* a,
                              int n, float* y) const = 0;
  // One token's FFN over the listed neurons, fused so that each neuron's gate, up and down rows
  // are read back to back while out stays in cache (three separate row passes re-stream out and
  // restart the hardware prefetchers three times). For each i, with j = rows[i]:
  //   g = gate_values != null ? gate_values[i] : gate.row(j) . x
  //   a[i] = act(g, up.row(j) . x); for ReLU and dReLU the up row is skipped when g <= 0 (a = 0)
  //   out: [down_t.cols()] += a[i] * down_t.row(j)
  // The products are MatMulRows' and AccumulateRows' (equal to them up to fp32 summation order;
  // the SIMD version sums fixed chunks of neurons in order, the same for any thread count).
  // Returns how many up rows were computed.
  virtual int SparseFfnToken(const TensorView& gate, const TensorView& up, const TensorView& down_t,
                             const int32_t* rows, int n_rows, Activation act, const float* x,
                             const float* gate_values, float* a, float* out) const = 0;
  // SparseFfnToken with the last step left to the caller: writes *n_parts (1..max_parts) partial
  // sums [*n_parts, down_t.cols()] to parts (overwritten) whose sum in part order, from zero, is
  // SparseFfnToken's out from zero: bit for bit when max_parts is at least the op's thread count,
  // up to fp32 summation order when fewer parts regroup the neurons. A GPU that takes the cold
  // rows' contribution adds them up itself, so the CPU's threads skip exchanging their partials
  // (docs/sparse.md). This default computes one part.
  virtual int SparseFfnTokenParts(const TensorView& gate, const TensorView& up,
                                  const TensorView& down_t, const int32_t* rows, int n_rows,
                                  Activation act, const float* x, const float* gate_values,
                                  float* a, float* parts, int max_parts, int* n_parts) const {
    (void)max_parts;
    std::fill(parts, parts + down_t.cols(), 0.f);
    *n_parts = 1;
    return SparseFfnToken(gate, up, down_t, rows, n_rows, act, x, gate_values, a, parts);
  }
  // How many parts SparseFfnToken and SparseFfnTokenParts (with max_parts at least that many)
  // split a list of n_rows neurons into; part c is [SparseFfnPartBegin(n_rows, parts, c),
  // SparseFfnPartBegin(n_rows, parts, c + 1)). With the pool's chunks pinned and as many parts as
  // pool threads, part c runs on pool thread c every time, so code that loads rows ahead of the
  // op (PartialFfn::Prefetch) loads each part's rows into the caches that will read them.
  virtual int SparseFfnParts(int n_rows) const {
    (void)n_rows;
    return 1;
  }
  // out: [n, dim] = x * rsqrt(mean(x^2) + eps) * weight
  virtual void RmsNorm(const float* x, const float* weight, int n, int dim, float eps,
                       float* out) const = 0;
  // Rotates x: [n, n_heads, head_dim] in place at positions[t]. inv_freq: [head_dim / 2].
  // interleaved: pairs (2i, 2i+1) (GGUF layout); otherwise (i, i + head_dim/2) (Hugging Face).
  virtual void Rope(float* x, int n, int n_heads, int head_dim, const int32_t* positions,
                    const float* inv_freq, bool interleaved) const = 0;
  // Causal attention of n new queries at positions pos0..pos0+n-1 over the cache rows 0..pos,
  // or with window > 0 (Mistral's sliding window) only the rows j with pos - window < j <= pos.
  // q: [n, n_heads, hd]; k, v: [ctx, n_kv_heads, hd] (ctx >= pos0 + n); out: [n, n_heads, hd].
  virtual void Attention(const float* q, const float* k, const float* v, int n, int pos0,
                         int n_heads, int n_kv_heads, int head_dim, int window,
                         float* out) const = 0;
  // Attention over every earlier position (no window).
  void Attention(const float* q, const float* k, const float* v, int n, int pos0, int n_heads,
                 int n_kv_heads, int head_dim, float* out) const {
    Attention(q, k, v, n, pos0, n_heads, n_kv_heads, head_dim, /*window=*/0, out);
  }
  // gate[i] = act(gate[i]) * up[i] (dReLU: relu(gate) * relu(up)).
  virtual void GatedActivation(Activation act, float* gate, const float* up, int64_t n) const = 0;
};

std::unique_ptr<CpuOps> NewReferenceOps();
// Picks the widest SIMD the processor supports; `pool` may be null (single thread).
std::unique_ptr<CpuOps> NewSimdOps(ThreadPool* pool);
// Name of the SIMD level NewSimdOps would use: "avx512", "avx2" or "scalar".
absl::string_view SimdLevel();

}  // namespace pinfer
