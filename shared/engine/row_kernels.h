// Per-row SIMD kernels behind SimdOps, compiled once per instruction set (kernels_simd.inc is
// included by kernels_avx2.cc and kernels_avx512.cc with different compiler flags) and chosen at
// run time. A "row" is one stored weight row in any dtype; x and y are fp32. The exception is
// matmul_q8b, a whole tiled matrix product of many tokens for the quantized types.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>

#include "shared/model/tensor.h"

namespace pinfer {

// An activation vector x: [n] quantized to Q8_0 blocks of 32, the form in which Q8_0 and Q4_0
// weight rows multiply it (llama.cpp's definition of those matrix products; see ops.h).
struct Q8Vector {
  const int8_t* q;    // [n]: round-half-even(x / d_fp32), in -127..127
  const float* d;     // [n / 32]: d = max|x| / 127 of each block, rounded to fp16, as fp32
  const int32_t* s8;  // [n / 32 * 8]: -8 * (q[4k] + ... + q[4k + 3]), Q4_0's offset of 8
};

// An activation vector x: [n] quantized to Q8_K blocks of 256 as ggml's quantize_row_q8_K does
// it, the form in which Q4_K, Q5_K and Q6_K rows multiply it.
struct Q8KVector {
  const int8_t* q;       // [n]: min(127, round-half-even(x * (-127 / m))), m the block's value of
                         // largest magnitude
  const float* d;        // [n / 256]: 1 / (-127 / m), fp32 (0 for an all-zero block)
  const int16_t* bsums;  // [n / 16]: sums of 16 consecutive q
};

// n tokens' activations quantized for the tiled products of many tokens (RowKernels::matmul_q8b):
// Q8_0 blocks of 32 (for Q8_0 and Q4_0 rows) or Q8_K blocks of 256 (K-quant rows), each token
// quantized exactly as for one token (quantize_q8x / quantize_q8k). Tokens are interleaved in
// groups of kTokens, block by block, so that a tile of up to kTokens tokens reads one block of all
// of them at fixed offsets from one address: token t = kTokens * g + i has its block b at index
// (g * blocks + b) * kTokens + i of each array (the last group padded to kTokens).
struct Q8Batch {
  static constexpr int kTokens = 8;
  const int8_t* q;         // [groups, blocks, kTokens, block]: the quantized values
  const float* d;          // [groups, blocks, kTokens]: the blocks' scales
  const int32_t* offsets;  // [groups, blocks, kTokens, BatchOffsetsPerBlock]: see BatchOffsets
  int64_t blocks;          // per token: cols / 32 or cols / 256

  int64_t Index(int64_t t, int64_t b) const {
    return ((t / kTokens) * blocks + b) * kTokens + t % kTokens;
  }
};

// The integer terms each block of x contributes to the tiled kernels whatever the weights (one
// token's, per weight block of 32 or 256 values), so that the kernels start their integer sums
// from them instead of correcting every (row, token) pair:
//   Q8_0: -128 * (the block's sum of q): the SIMD tiles multiply Q8_0 weights stored + 128, the
//         unsigned operand VNNI wants;
//   Q4_0: -8 * (the block's sum): Q4_0's offset of 8;
//   Q4_K, Q5_K: four int32 per super-block, each two sub-blocks' sums of q as int16 (the low half
//         sub-block 2k, the high half 2k + 1), which the mins multiply;
//   Q6_K: -32 * (each 16-value sum): Q6_K's offset of 32, sixteen per super-block.
inline int BatchOffsetsPerBlock(DType t) {
  return t == DType::kQ6_K ? 16 : (t == DType::kQ4_K || t == DType::kQ5_K) ? 4 : 1;
}
// One token's offsets: q: [cols] its values, bsums: [cols / 16] its Q8_K 16-value sums (K types
// only), out: [cols / BlockElems(t), BatchOffsetsPerBlock(t)] with the stride `stride` from one
// block's entries to the next.
inline void BatchOffsets(DType t, const int8_t* q, const int16_t* bsums, int64_t cols,
                         int64_t stride, int32_t* out) {
  if (t == DType::kQ8_0 || t == DType::kQ4_0) {
    const int32_t scale = t == DType::kQ8_0 ? -128 : -8;
    for (int64_t b = 0; b < cols / 32; ++b) {
      int32_t s = 0;
      for (int i = 0; i < 32; ++i) s += q[32 * b + i];
      out[b * stride] = scale * s;
    }
    return;
  }
  for (int64_t b = 0; b < cols / 256; ++b) {
    const int16_t* bs = bsums + 16 * b;
    int32_t* o = out + b * stride;
    if (t == DType::kQ6_K) {
      for (int g = 0; g < 16; ++g) o[g] = -32 * bs[g];
    } else {
      for (int k = 0; k < 4; ++k) {
        const uint16_t lo = static_cast<uint16_t>(bs[4 * k] + bs[4 * k + 1]);
        const uint16_t hi = static_cast<uint16_t>(bs[4 * k + 2] + bs[4 * k + 3]);
        o[k] = static_cast<int32_t>(lo | (uint32_t{hi} << 16));
      }
    }
  }
}

struct RowKernels {
  const char* name;
  // Returns sum_i row[i] * x[i].
  float (*dot[kNumDTypes])(const void* row, const float* x, int64_t n);
  // y[i] += a * row[i].
  void (*axpy[kNumDTypes])(float a, const void* row, float* y, int64_t n);
  // Four fp32 rows against one x at once (shares the loads of x): out[j] = rows[j] . x.
  void (*dot4_f32)(const float* r0, const float* r1, const float* r2, const float* r3,
                   const float* x, int64_t n, float* out);
  // Four fp32 rows (stride ld) against four tokens (stride ld): out[t * 4 + j] = rows[j] . x[t].
  void (*dot4x4_f32)(const float* rows, const float* x, int64_t ld, int64_t n, float* out);
  float (*dot_f32)(const float* a, const float* b, int64_t n);
  void (*axpy_f32)(float a, const float* x, float* y, int64_t n);
  // A Q8_0 or Q4_0 row (null for the other dtypes) against a Q8Vector:
  // sum_b d_row[b] * d_x[b] * (exact integer dot of block b).
  float (*dot_q8x[kNumDTypes])(const void* row, const Q8Vector& x, int64_t n);
  // Quantizes x: [n] (n a multiple of 32) into the arrays of a Q8Vector.
  void (*quantize_q8x)(const float* x, int64_t n, int8_t* q, float* d, int32_t* s8);
  // gate[i] = silu(gate[i]) * up[i]; x[i] = exp(x[i] - m) returning the sum (softmax). Vector exp
  // within a few ulp of std::exp.
  void (*silu_mul)(float* gate, const float* up, int64_t n);
  float (*exp_sub_sum)(float* x, int64_t n, float m);
  // y[i] += sum_{j < k} a[j] * rows[j][i], each element's terms in row order: the same result as
  // k axpy calls, with y read and written once and the rows read together.
  void (*axpy_rows[kNumDTypes])(const float* a, const uint8_t* const* rows, int k, float* y,
                                int64_t n);
  // out[j] = rows[j] . x for j < k, the rows read together: F32/F16/BF16 rows against x (null
  // for the block types), Q8_0 / Q4_0 rows against x quantized (null for the others; each sum
  // formed exactly as dot_q8x forms it, the plain types' may round differently from dot's).
  void (*dot_rows[kNumDTypes])(const uint8_t* const* rows, int k, const float* x, int64_t n,
                               float* out);
  void (*dot_rows_q8x[kNumDTypes])(const uint8_t* const* rows, int k, const Q8Vector& x, int64_t n,
                                   float* out);
  // A Q4_K / Q5_K / Q6_K row (null for the other dtypes) against a Q8KVector, ggml's
  // ggml_vec_dot_q*_K_q8_K: per super-block d_row * d_x * (exact integer dot with the sub-block
  // scales) - dmin_row * d_x * (exact integer dot of the mins with the 16-value sums of x).
  float (*dot_q8k[kNumDTypes])(const void* row, const Q8KVector& x, int64_t n);
  // dot_q8k for k rows (each sum formed exactly as dot_q8k forms it).
  void (*dot_rows_q8k[kNumDTypes])(const uint8_t* const* rows, int k, const Q8KVector& x, int64_t n,
                                   float* out);
  // Quantizes x: [n] (n a multiple of 256) into the arrays of a Q8KVector.
  void (*quantize_q8k)(const float* x, int64_t n, int8_t* q, float* d, int16_t* bsums);
  // Batched products of a quantized matrix (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; null for the others):
  // rows: [n_rows] at w + r * stride, x: n tokens (Q8Batch), y[t * ldy + r] = row r . x[t],
  // each sum the definition dot_q8x / dot_q8k compute (up to fp32 summation order). Tiled: each
  // unpacked weight block serves a tile of tokens, each block of x a tile of rows.
  void (*matmul_q8b[kNumDTypes])(const uint8_t* w, size_t stride, int64_t n_rows, const Q8Batch& x,
                                 int n, int64_t cols, float* y, int64_t ldy);
};

// A Q4_K / Q5_K block's packed 12 bytes of scales and mins (tensor.h's KScaleMin) rearranged on
// 32-bit words, branch-free as the SIMD kernels want them: bytes 0-7 of `out` are sub-blocks
// 0-7's scales, bytes 8-15 their mins.
inline void KScalesAndMins(const uint8_t* packed, uint32_t out[4]) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  out[0] = w[0] & kLow6;                                          // scales 0-3
  out[1] = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);         // scales 4-7
  out[2] = w[1] & kLow6;                                          // mins 0-3
  out[3] = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4);  // mins 4-7
}

const RowKernels* RowKernelsScalar();
const RowKernels* RowKernelsAvx2();    // null when not compiled in
const RowKernels* RowKernelsAvx512();  // null when not compiled in; uses VBMI where present
// The AVX-512 set with (only where the CPU has AVX-512 VBMI) or without its VBMI kernels; tests
// run both.
const RowKernels* RowKernelsAvx512(bool vbmi);

// The best kernels this processor supports.
const RowKernels* BestRowKernels();

}  // namespace pinfer

namespace pinfer {
class CpuOps;
class ThreadPool;
// SimdOps on a specific kernel set (tests check every compiled-in instruction set).
std::unique_ptr<CpuOps> NewSimdOpsWithKernels(ThreadPool* pool, const RowKernels* kernels);
}  // namespace pinfer
