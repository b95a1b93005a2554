// Portable instantiation of kernels_simd.inc with one-lane "vectors": the fallback for processors
// without AVX2, and a third implementation the op tests check.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "shared/engine/row_kernels.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {
using V = float;
constexpr int W = 1;
inline V vzero() { return 0.f; }
inline V vset1(float a) { return a; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vadd(V a, V b) { return a + b; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline V vload_f16(const uint16_t* p) { return Fp16ToFp32(*p); }
inline V vload_bf16(const uint16_t* p) { return Bf16ToFp32(*p); }
inline V vload_i8(const int8_t* p) { return static_cast<float>(*p); }
inline float vsum(V v) { return v; }
inline V vsub(V a, V b) { return a - b; }
// (p[0] >> shift) & mask as a float (the K-quants' bit fields).
inline V vload_u8_bits(const uint8_t* p, int shift, int mask) {
  return static_cast<float>((*p >> shift) & mask);
}
// Both nibbles of p[0] as floats.
inline void vload_u8_nibbles(const uint8_t* p, V* lo, V* hi) {
  *lo = static_cast<float>(*p & 15);
  *hi = static_cast<float>(*p >> 4);
}
inline V vmul(V a, V b) { return a * b; }
inline V vdiv(V a, V b) { return a / b; }
inline V vexp(V x) { return std::exp(x); }
inline float half_to_float(uint16_t h) { return Fp16ToFp32(h); }
// out[j] = a[j] * (the fp16 value in bits 16j..16j+15 of d) for j < 4.
inline void scale4(const float* a, uint64_t d, float* out) {
  for (int j = 0; j < 4; ++j) out[j] = a[j] * Fp16ToFp32(static_cast<uint16_t>(d >> (16 * j)));
}
// One Q4_0 block's 32 values (q - 8), one "vector" each.
inline void q4_vecs(const uint8_t* qs, V* out) {
  for (int j = 0; j < 16; ++j) {
    out[j] = static_cast<float>((qs[j] & 0x0f) - 8);
    out[j + 16] = static_cast<float>((qs[j] >> 4) - 8);
  }
}
// Unscaled dot of one Q4_0 block's values (q - 8) with 32 floats, as a vector of partial sums.
inline V q4_block_dot(const uint8_t* qs, const float* x) {
  V q[32 / W];
  q4_vecs(qs, q);
  V bs = vzero();
  for (int e = 0; e < 32 / W; ++e) bs = vfma(q[e], vload(x + e * W), bs);
  return bs;
}
// Quantized-activation block dots: the whole block's integer sum as one "lane".
using F8 = float;
inline F8 f8zero() { return 0.f; }
inline F8 f8set1(float a) { return a; }
inline F8 f8add(F8 a, F8 b) { return a + b; }
inline F8 f8fma(F8 a, F8 b, F8 c) { return a * b + c; }
inline float f8sum(F8 v) { return v; }
inline F8 q8q8_block(const int8_t* w, const int8_t* x) {
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) s += w[i] * x[i];
  return static_cast<float>(s);
}
inline F8 q4q8_block(const uint8_t* qs, const int8_t* x, const int32_t*) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += ((qs[i] & 0x0f) - 8) * x[i] + ((qs[i] >> 4) - 8) * x[i + 16];
  return static_cast<float>(s);
}
// One Q4_K / Q5_K super-block against 256 Q8_K values: sum_j scale_j * (sub-block j's integer
// dot), the values q in 0..15 (with Q5_K's fifth bit 0..31).
template <bool kHigh>
inline int32_t q45k_dot(const uint8_t* qs, const uint8_t* qh, const int* sc, const int8_t* q8) {
  int32_t sum = 0;
  for (int i = 0; i < 4; ++i) {
    int32_t s0 = 0, s1 = 0;
    for (int l = 0; l < 32; ++l) {
      int q0 = qs[32 * i + l] & 0x0f, q1 = qs[32 * i + l] >> 4;
      if constexpr (kHigh) {
        q0 |= ((qh[l] >> (2 * i)) & 1) << 4;
        q1 |= ((qh[l] >> (2 * i + 1)) & 1) << 4;
      }
      s0 += q0 * q8[64 * i + l];
      s1 += q1 * q8[64 * i + 32 + l];
    }
    sum += sc[2 * i] * s0 + sc[2 * i + 1] * s1;
  }
  return sum;
}
// q45k_dot with the scales unpacked, and the mins' dot with x's 16-value sums.
template <bool kHigh>
inline void q45k_block(const uint8_t* scales, const uint8_t* qs, const uint8_t* qh,
                       const int8_t* q8, const int16_t* bsums, int32_t* isum, int32_t* imin) {
  int sc[8], m[8];
  for (int j = 0; j < 8; ++j) KScaleMin(scales, j, &sc[j], &m[j]);
  *isum = q45k_dot<kHigh>(qs, qh, sc, q8);
  *imin = 0;
  for (int j = 0; j < 8; ++j) *imin += m[j] * (bsums[2 * j] + bsums[2 * j + 1]);
}
// One Q6_K super-block against 256 Q8_K values with the unsigned values q in 0..63:
// sum_g scale_g * (group g's integer dot), the groups of 16.
inline int32_t q6k_dot(const BlockQ6_K& b, const int8_t* q8) {
  int32_t sum = 0;
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) {
      for (int half16 = 0; half16 < 2; ++half16) {
        int32_t s = 0;
        for (int l = 16 * half16; l < 16 * half16 + 16; ++l) {
          const uint8_t low = b.ql[64 * h + l + 32 * (k & 1)];
          const int q =
              (k < 2 ? (low & 0x0f) : (low >> 4)) | (((b.qh[32 * h + l] >> (2 * k)) & 3) << 4);
          s += q * q8[128 * h + 32 * k + l];
        }
        sum += b.scales[8 * h + 2 * k + half16] * s;
      }
    }
  }
  return sum;
}
}  // namespace

#include "shared/engine/kernels_simd.inc"

namespace {
// Tiles for the batched quantized products (MatMulQ8B) in plain integer loops: 4 rows unpacked to
// signed int8 values (Q4_0 q - 8, Q6_K q - 32; Q4_K / Q5_K q as stored) with their scales, then
// per block each (row, token) pair's exact integer dot. The offsets of Q8Batch are not needed.
struct Tiles1 {
  static constexpr int kRows = 4;
  static constexpr int kTokens = 4;
  // Per block of 32 (Q8_0, Q4_0): the rows' values and their d. Per super-block (K types): the
  // rows' values, 16 scales (8 for Q4_K / Q5_K) and 8 mins, d and dmin.
  struct Q8Tile {
    int8_t v[kRows][32];
    float d[kRows];
  };
  struct KTile {
    int8_t v[kRows][256];
    int32_t scale[kRows][16], min[kRows][8];
    float d[kRows], dmin[kRows];
  };

  template <DType T>
  static int64_t PackedBytes(int64_t cols) {
    if constexpr (T == DType::kQ8_0 || T == DType::kQ4_0) return cols / 32 * sizeof(Q8Tile);
    return cols / 256 * sizeof(KTile);
  }

  template <DType T>
  static void Pack(const uint8_t* w, size_t stride, int nr, int64_t cols, uint8_t* out) {
    if constexpr (T == DType::kQ8_0 || T == DType::kQ4_0) {
      Q8Tile* tile = reinterpret_cast<Q8Tile*>(out);
      for (int64_t b = 0; b < cols / 32; ++b) {
        for (int r = 0; r < kRows; ++r) {
          Q8Tile& o = tile[b];
          if (r >= nr) {
            std::fill(o.v[r], o.v[r] + 32, int8_t{0});
            o.d[r] = 0;
            continue;
          }
          if constexpr (T == DType::kQ8_0) {
            const BlockQ8_0& blk = reinterpret_cast<const BlockQ8_0*>(w + r * stride)[b];
            std::copy(blk.qs, blk.qs + 32, o.v[r]);
            o.d[r] = Fp16ToFp32(blk.d);
          } else {
            const BlockQ4_0& blk = reinterpret_cast<const BlockQ4_0*>(w + r * stride)[b];
            for (int i = 0; i < 16; ++i) {
              o.v[r][i] = static_cast<int8_t>((blk.qs[i] & 0x0f) - 8);
              o.v[r][i + 16] = static_cast<int8_t>((blk.qs[i] >> 4) - 8);
            }
            o.d[r] = Fp16ToFp32(blk.d);
          }
        }
      }
    } else {
      KTile* tile = reinterpret_cast<KTile*>(out);
      for (int64_t sb = 0; sb < cols / 256; ++sb) {
        KTile& o = tile[sb];
        for (int r = 0; r < kRows; ++r) {
          std::fill(o.v[r], o.v[r] + 256, int8_t{0});
          std::fill(o.scale[r], o.scale[r] + 16, 0);
          std::fill(o.min[r], o.min[r] + 8, 0);
          o.d[r] = o.dmin[r] = 0;
          if (r >= nr) continue;
          const uint8_t* row = w + r * stride;
          if constexpr (T == DType::kQ6_K) {
            const BlockQ6_K& blk = reinterpret_cast<const BlockQ6_K*>(row)[sb];
            for (int i = 0; i < 256; ++i) {
              const int h = i / 128, q = (i % 128) / 32, l = i % 32;
              const uint8_t low = blk.ql[64 * h + 32 * (q & 1) + l];
              const int v =
                  (q < 2 ? low & 0x0f : low >> 4) | (((blk.qh[32 * h + l] >> (2 * q)) & 3) << 4);
              o.v[r][i] = static_cast<int8_t>(v - 32);
            }
            for (int g = 0; g < 16; ++g) o.scale[r][g] = blk.scales[g];
            o.d[r] = Fp16ToFp32(blk.d);
          } else {
            constexpr bool kQ5 = T == DType::kQ5_K;
            const uint8_t* b = row + sb * (kQ5 ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K));
            const BlockQ4_K& q4 = *reinterpret_cast<const BlockQ4_K*>(b);
            const BlockQ5_K& q5 = *reinterpret_cast<const BlockQ5_K*>(b);
            const uint8_t* qs = kQ5 ? q5.qs : q4.qs;
            for (int i = 0; i < 256; ++i) {
              const int j = i / 32, l = i % 32;
              const uint8_t byte = qs[32 * (j / 2) + l];
              int v = j % 2 == 0 ? byte & 0x0f : byte >> 4;
              if constexpr (kQ5) v |= ((q5.qh[l] >> j) & 1) << 4;
              o.v[r][i] = static_cast<int8_t>(v);
            }
            for (int j = 0; j < 8; ++j) KScaleMin(q4.scales, j, &o.scale[r][j], &o.min[r][j]);
            o.d[r] = Fp16ToFp32(q4.d);
            o.dmin[r] = Fp16ToFp32(q4.dmin);
          }
        }
      }
    }
  }

  template <DType T, int NT>
  static void Run(const uint8_t* packed, const Q8Batch& x, int64_t t0, int64_t cols, int nr,
                  float* y, int64_t ldy) {
    (void)cols;
    float acc[NT][kRows] = {};
    for (int64_t b = 0; b < x.blocks; ++b) {
      const int64_t i = x.Index(t0, b);
      if constexpr (T == DType::kQ8_0 || T == DType::kQ4_0) {
        const Q8Tile& o = reinterpret_cast<const Q8Tile*>(packed)[b];
        for (int t = 0; t < NT; ++t) {
          const int8_t* xq = x.q + (i + t) * 32;
          for (int r = 0; r < kRows; ++r) {
            int32_t s = 0;
            for (int l = 0; l < 32; ++l) s += o.v[r][l] * xq[l];
            acc[t][r] += o.d[r] * x.d[i + t] * static_cast<float>(s);
          }
        }
      } else {
        const KTile& o = reinterpret_cast<const KTile*>(packed)[b];
        constexpr int kGroup = T == DType::kQ6_K ? 16 : 32;
        for (int t = 0; t < NT; ++t) {
          const int8_t* xq = x.q + (i + t) * 256;
          for (int r = 0; r < kRows; ++r) {
            int32_t isum = 0, imin = 0;
            for (int g = 0; g < 256 / kGroup; ++g) {
              int32_t s = 0, sx = 0;
              for (int l = g * kGroup; l < (g + 1) * kGroup; ++l) {
                s += o.v[r][l] * xq[l];
                sx += xq[l];
              }
              isum += o.scale[r][g] * s;
              if constexpr (T != DType::kQ6_K) imin += o.min[r][g] * sx;
            }
            acc[t][r] += o.d[r] * x.d[i + t] * static_cast<float>(isum) -
                         o.dmin[r] * x.d[i + t] * static_cast<float>(imin);
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      for (int r = 0; r < nr; ++r) y[t * ldy + r] = acc[t][r];
    }
  }
};
}  // namespace

const RowKernels* RowKernelsScalar() {
  static const RowKernels k = {
      "scalar",
      {DotRowF32, DotRowF16, DotRowBF16, DotRowQ8, DotRowQ4, PINFER_K_DOT},
      {AxpyRowF32, AxpyRowF16, AxpyRowBF16, AxpyRowQ8, AxpyRowQ4, PINFER_K_AXPY},
      Dot4F32,
      Dot4x4F32,
      DotF32,
      AxpyF32,
      {nullptr, nullptr, nullptr, DotQ8x<BlockQ8_0, Q8BlockDot>, DotQ8x<BlockQ4_0, Q4BlockDot>},
      QuantizeQ8x,
      SiluMul,
      ExpSubSum,
      PINFER_AXPY_ROWS,
      PINFER_DOT_ROWS((DotRowsQ8x<BlockQ4_0, Q4BlockDot>)),
      PINFER_K_Q8K,
      QuantizeQ8K,
      PINFER_MATMUL_Q8B(Tiles1),
  };
  return &k;
}

const RowKernels* BestRowKernels() {
  static const RowKernels* best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        RowKernelsAvx512() != nullptr) {
      return RowKernelsAvx512();
    }
    // Every AVX2 processor also has F16C (clang's builtin cannot ask for it by name).
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        RowKernelsAvx2() != nullptr) {
      return RowKernelsAvx2();
    }
    return RowKernelsScalar();
  }();
  return best;
}

}  // namespace pinfer
