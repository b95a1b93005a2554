// AVX2 + FMA + F16C instantiation of kernels_simd.inc (compiled with -mavx2 -mfma -mf16c).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "shared/engine/row_kernels.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {
using V = __m256;
constexpr int W = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vload_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline V vload_bf16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline V vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
// W bytes p[0..W) as floats of (p[i] >> shift) & mask (the K-quants' bit fields).
inline V vload_u8_bits(const uint8_t* p, int shift, int mask) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srl_epi32(b, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask)));
}
// Both nibbles of W bytes as floats: lo = p[i] & 15, hi = p[i] >> 4.
inline void vload_u8_nibbles(const uint8_t* p, V* lo, V* hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
// exp(x), Cephes' expf: ~1 ulp, arguments clamped to [-87, 88.38] (results stay normal).
inline V vexp(V x) {
  x = _mm256_min_ps(_mm256_max_ps(x, vset1(-87.f)), vset1(88.3762626647949f));
  const V fx = _mm256_round_ps(_mm256_mul_ps(x, vset1(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, vset1(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, vset1(-2.12194440e-4f), x);
  V y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vadd(vfma(y, _mm256_mul_ps(x, x), x), vset1(1.f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
// out[j] = a[j] * (the fp16 value in bits 16j..16j+15 of d) for j < 4, one conversion for all.
inline void scale4(const float* a, uint64_t d, float* out) {
  _mm_store_ps(
      out, _mm_mul_ps(_mm_load_ps(a), _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(d)))));
}
// One Q4_0 block's 32 values (q - 8) as four fp32 vectors, unpacked in registers.
inline void q4_vecs(const uint8_t* qs, V* out) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, mask), eight);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), eight);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
// Unscaled dot of one Q4_0 block's values (q - 8) with 32 floats, as a vector of partial sums.
inline V q4_block_dot(const uint8_t* qs, const float* x) {
  V q[32 / W];
  q4_vecs(qs, q);
  V bs = vzero();
  for (int e = 0; e < 32 / W; ++e) bs = vfma(q[e], vload(x + e * W), bs);
  return bs;
}
// Quantized-activation block dots: maddubs (unsigned x signed pairs to int16, which cannot
// saturate here: |w| <= 128, |x| <= 127) then madd with ones to eight exact int32 partial sums.
using F8 = __m256;
inline F8 f8zero() { return _mm256_setzero_ps(); }
inline F8 f8set1(float a) { return _mm256_set1_ps(a); }
inline F8 f8add(F8 a, F8 b) { return _mm256_add_ps(a, b); }
inline F8 f8fma(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }
inline float f8sum(F8 v) { return vsum(v); }
inline F8 q8q8_block(const int8_t* w, const int8_t* x) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
inline F8 q4q8_block(const uint8_t* qs, const int8_t* x, const int32_t* s8) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i nib =
      _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                       _mm256_set1_epi8(0x0f));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(nib, xv), _mm256_set1_epi16(1));
  return _mm256_cvtepi32_ps(
      _mm256_add_epi32(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s8))));
}
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
// One Q4_K / Q5_K super-block against 256 Q8_K values: *isum = sum_j scale_j * (sub-block j's
// integer dot), *imin = sum_j min_j * (x's sum over sub-block j). Per 32 bytes of qs two
// sub-blocks (low and high nibbles); maddubs pairs the unsigned values (<= 31) with x
// (|x| <= 127) without saturating, madd applies the scale, which a byte shuffle broadcasts from
// the unpacked scales (no scalar-to-vector moves).
template <bool kHigh>
inline void q45k_block(const uint8_t* scales, const uint8_t* qs, const uint8_t* qh,
                       const int8_t* q8, const int16_t* bsums, int32_t* isum, int32_t* imin) {
  uint32_t words[4];
  KScalesAndMins(scales, words);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));
  const __m256i scale16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));
  const __m128i min16 = _mm_cvtepu8_epi16(_mm_srli_si128(packed, 8));
  const __m128i pair_sums =
      _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bsums)),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsums + 8)));
  __m128i m = _mm_madd_epi16(min16, pair_sums);
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xb1));
  *imin = _mm_cvtsi128_si32(m);
  const __m256i mask = _mm256_set1_epi8(0x0f);
  __m256i high = _mm256_setzero_si256();
  if constexpr (kHigh) high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  __m256i acc = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
    __m256i lo = _mm256_and_si256(v, mask);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    if constexpr (kHigh) {
      const __m256i one = _mm256_set1_epi8(1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
      hi = _mm256_or_si256(hi,
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 1), one), 4));
      high = _mm256_srli_epi16(high, 2);  // the next pair of sub-blocks' bits to bits 0 and 1
    }
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 64 * i));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 64 * i + 32));
    // 16-bit lane 2i (then 2i + 1) of scale16 in every lane.
    const __m256i s0 =
        _mm256_shuffle_epi8(scale16, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0404 * i)));
    const __m256i s1 =
        _mm256_shuffle_epi8(scale16, _mm256_set1_epi16(static_cast<int16_t>(0x0302 + 0x0404 * i)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s0));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s1));
  }
  *isum = hsum_i32(acc);
}
// One Q6_K super-block with the unsigned values q in 0..63: sum_g scale_g * (group g's dot).
// Each 32-value vector spans two groups of 16: the low 128-bit lane takes one scale, the high
// lane the next (maddubs cannot saturate: 2 * 63 * 127 < 32768).
inline int32_t q6k_dot(const BlockQ6_K& b, const int8_t* q8) {
  const __m256i mask = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
  const __m256i scale16 =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
  const __m256i lane_halves = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3,
                                               2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  __m256i acc = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
    __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
    const __m256i low[4] = {_mm256_and_si256(ql0, mask), _mm256_and_si256(ql1, mask),
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), mask),
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), mask)};
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_or_si256(low[k], _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
      qh = _mm256_srli_epi16(qh, 2);
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 128 * h + 32 * k));
      // Groups 8h + 2k and 8h + 2k + 1 share 32-bit word 4h + k of scale16: broadcast it, then
      // its first half to the low lane and its second to the high lane.
      const __m256i scale = _mm256_shuffle_epi8(
          _mm256_permutevar8x32_epi32(scale16, _mm256_set1_epi32(4 * h + k)), lane_halves);
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scale));
    }
  }
  return hsum_i32(acc);
}
}  // namespace

#include "shared/engine/kernels_simd.inc"

namespace {
// QuantizeQ8x vectorised, bit for bit the same: the same fp32 products x * (1 / d) rounded half
// to even (the default MXCSR mode of vcvtps2dq), the same scalar scale arithmetic, and the
// 4-value sums by two pairwise-adding multiplies with ones. The scalar loop was a quarter of a
// Q4_0 sparse FFN token on one AVX2 core (22 neurons with their rows in cache, perf), since every
// part of the op quantizes x for itself.
void QuantizeQ8x256(const float* x, int64_t n, int8_t* q, float* d, int32_t* s8) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* xb = x + b * 32;
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8),
                 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    const __m256 m =
        _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float dd = amax / 127.f;
    const float id = dd != 0.f ? 1.f / dd : 0.f;
    d[b] = Fp16ToFp32(Fp32ToFp16(dd));
    const __m256 vid = _mm256_set1_ps(id);
    // 32 int32 -> 32 int8 (|q| <= 127, so the saturating packs change nothing), then the
    // dwords put back in element order (packs works within 128-bit lanes).
    const __m256i i01 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v0, vid)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid)));
    const __m256i i23 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v2, vid)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid)));
    const __m256i qb = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i01, i23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), qb);
    const __m256i sums =
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), qb), _mm256_set1_epi16(1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s8 + b * 8),
                        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 3)));
  }
}
// ---- Tiles for the batched quantized products (MatMulQ8B): 8 rows, one per 32-bit lane ----
//
// Tiles512's layout on 256-bit vectors (see kernels_avx512.cc): a packed vector holds the same
// four values of 8 rows, and maddubs against four values of one token broadcast to every lane
// gives each row's products in its own lane, as 16-bit pair sums. Blocks of values <= 15 add
// eight of them in 16 bits (8 * 2 * 15 * 127 < 32768), Q5_K's <= 31 four, Q6_K's <= 63 two,
// before a madd with ones widens them; the rest is Tiles512's. Q8_0's signed values take the
// sign trick (|w| times x with w's sign: 2 * 128 * 127 < 32768) and no offset.
struct Tiles256 {
  static constexpr int kRows = 8;
  static constexpr int kTokens = 4;
  static constexpr int64_t kQ8BlockBytes = (16 + 1) * 32;  // |w| and w (Q8_0) or 8 values, d_w
  static constexpr int64_t kQ45KBytes = (64 + 8 + 4 + 2) * 32;
  static constexpr int64_t kQ6KBytes = (64 + 16 + 1) * 32;

  template <DType T>
  static int64_t PackedBytes(int64_t cols) {
    if constexpr (T == DType::kQ8_0 || T == DType::kQ4_0) return cols / 32 * kQ8BlockBytes;
    if constexpr (T == DType::kQ6_K) return cols / 256 * kQ6KBytes;
    return cols / 256 * kQ45KBytes;
  }

  static __m256i Load32Bcast(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static __m256i Gather(const uint8_t* w, __m256i index, __m256i rows, int64_t offset) {
    return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(),
                                       reinterpret_cast<const int*>(w + offset), index, rows, 1);
  }
  static __m256 LowHalf(__m256i v) {
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
    return _mm256_cvtph_ps(packed);
  }
  static __m256 HighHalf(__m256i v) { return LowHalf(_mm256_srli_epi32(v, 16)); }
  static __m256i And(__m256i a, uint32_t m) {
    return _mm256_and_si256(a, _mm256_set1_epi32(static_cast<int32_t>(m)));
  }

  template <DType T>
  static void Pack(const uint8_t* w, size_t stride, int nr, int64_t cols, uint8_t* out) {
    const __m256i index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                             _mm256_set1_epi32(static_cast<int32_t>(stride)));
    const __m256i rows =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i* o = reinterpret_cast<__m256i*>(out);
    if constexpr (T == DType::kQ8_0) {
      for (int64_t b = 0; b < cols / 32; ++b, o += 17) {
        const int64_t base = b * sizeof(BlockQ8_0);
        for (int k = 0; k < 8; ++k) {
          const __m256i v = Gather(w, index, rows, base + 2 + 4 * k);
          o[k] = _mm256_sign_epi8(v, v);
          o[8 + k] = v;
        }
        _mm256_store_ps(reinterpret_cast<float*>(o + 16), LowHalf(Gather(w, index, rows, base)));
      }
    } else if constexpr (T == DType::kQ4_0) {
      for (int64_t b = 0; b < cols / 32; ++b, o += 17) {
        const int64_t base = b * sizeof(BlockQ4_0);
        for (int k = 0; k < 4; ++k) {
          const __m256i v = Gather(w, index, rows, base + 2 + 4 * k);
          o[k] = And(v, 0x0f0f0f0f);
          o[k + 4] = And(_mm256_srli_epi32(v, 4), 0x0f0f0f0f);
        }
        _mm256_store_ps(reinterpret_cast<float*>(o + 16), LowHalf(Gather(w, index, rows, base)));
      }
    } else if constexpr (T == DType::kQ6_K) {
      for (int64_t sb = 0; sb < cols / 256; ++sb, o += 81) {
        const int64_t base = sb * sizeof(BlockQ6_K);
        for (int h = 0; h < 2; ++h) {
          for (int k = 0; k < 8; ++k) {
            const __m256i qh = Gather(w, index, rows, base + 128 + 32 * h + 4 * k);
            for (int q = 0; q < 2; ++q) {
              const __m256i ql = Gather(w, index, rows, base + 64 * h + 32 * q + 4 * k);
              for (int hi = 0; hi < 2; ++hi) {
                const int quarter = q + 2 * hi;
                const __m256i low = And(_mm256_srli_epi32(ql, 4 * hi), 0x0f0f0f0f);
                const __m256i high =
                    _mm256_slli_epi32(And(_mm256_srli_epi32(qh, 2 * quarter), 0x03030303), 4);
                o[32 * h + 8 * quarter + k] = _mm256_or_si256(low, high);
              }
            }
          }
        }
        for (int i = 0; i < 4; ++i) {
          const __m256i s = Gather(w, index, rows, base + 192 + 4 * i);
          for (int j = 0; j < 4; ++j) {
            o[64 + 4 * i + j] = _mm256_srai_epi32(_mm256_slli_epi32(s, 24 - 8 * j), 24);
          }
        }
        _mm256_store_ps(reinterpret_cast<float*>(o + 80),
                        HighHalf(Gather(w, index, rows, base + 206)));
      }
    } else {
      constexpr bool kQ5 = T == DType::kQ5_K;
      constexpr int64_t bytes = kQ5 ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
      constexpr int64_t qs = kQ5 ? 48 : 16;
      for (int64_t sb = 0; sb < cols / 256; ++sb, o += 78) {
        const int64_t base = sb * bytes;
        for (int p = 0; p < 4; ++p) {
          for (int k = 0; k < 8; ++k) {
            const __m256i v = Gather(w, index, rows, base + qs + 32 * p + 4 * k);
            o[8 * (2 * p) + k] = And(v, 0x0f0f0f0f);
            o[8 * (2 * p + 1) + k] = And(_mm256_srli_epi32(v, 4), 0x0f0f0f0f);
          }
        }
        if constexpr (kQ5) {
          for (int k = 0; k < 8; ++k) {
            const __m256i h = Gather(w, index, rows, base + 16 + 4 * k);
            for (int j = 0; j < 8; ++j) {
              o[8 * j + k] = _mm256_or_si256(
                  o[8 * j + k], _mm256_slli_epi32(And(_mm256_srli_epi32(h, j), 0x01010101), 4));
            }
          }
        }
        const __m256i s0 = Gather(w, index, rows, base + 4), s1 = Gather(w, index, rows, base + 8),
                      s2 = Gather(w, index, rows, base + 12);
        const __m256i words[4] = {
            And(s0, 0x3f3f3f3f),
            _mm256_or_si256(And(s2, 0x0f0f0f0f),
                            _mm256_slli_epi32(And(_mm256_srli_epi32(s0, 6), 0x03030303), 4)),
            And(s1, 0x3f3f3f3f),
            _mm256_or_si256(And(_mm256_srli_epi32(s2, 4), 0x0f0f0f0f),
                            _mm256_slli_epi32(And(_mm256_srli_epi32(s1, 6), 0x03030303), 4))};
        for (int j = 0; j < 8; ++j) {
          o[64 + j] = And(_mm256_srli_epi32(words[j / 4], 8 * (j % 4)), 0xff);
        }
        for (int k = 0; k < 4; ++k) {
          const __m256i m = _mm256_srli_epi32(words[2 + k / 2], 16 * (k % 2));
          o[72 + k] = _mm256_or_si256(And(m, 0xff),
                                      _mm256_slli_epi32(And(_mm256_srli_epi32(m, 8), 0xff), 16));
        }
        const __m256i dd = Gather(w, index, rows, base);
        _mm256_store_ps(reinterpret_cast<float*>(o + 76), LowHalf(dd));
        _mm256_store_ps(reinterpret_cast<float*>(o + 77), HighHalf(dd));
      }
    }
  }

  // The exact integer dot of kVecs packed vectors (values <= kMax) with a token's values at xq,
  // added to s.
  template <int kVecs, int kMax>
  static __m256i Dot(const __m256i* wv, const int8_t* xq, __m256i s) {
    constexpr int kChunk = 32767 / (2 * kMax * 127);  // maddubs sums that fit 16 bits
    const __m256i ones = _mm256_set1_epi16(1);
    for (int k0 = 0; k0 < kVecs; k0 += kChunk) {
      __m256i p = _mm256_maddubs_epi16(_mm256_load_si256(wv + k0), Load32Bcast(xq + 4 * k0));
      for (int k = k0 + 1; k < k0 + kChunk && k < kVecs; ++k) {
        p = _mm256_add_epi16(
            p, _mm256_maddubs_epi16(_mm256_load_si256(wv + k), Load32Bcast(xq + 4 * k)));
      }
      s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
  }

  template <DType T, int NT>
  static void Run(const uint8_t* packed, const Q8Batch& x, int64_t t0, int64_t cols, int nr,
                  float* y, int64_t ldy) {
    const __m256i* p = reinterpret_cast<const __m256i*>(packed);
    constexpr bool kQ8x = T == DType::kQ8_0 || T == DType::kQ4_0;
    constexpr int kBlock = kQ8x ? 32 : 256;
    constexpr int kOffsets = T == DType::kQ6_K ? 16 : kQ8x ? 1 : 4;
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.blocks; ++b) {
      const int64_t i = x.Index(t0, b);
      const int8_t* xq = x.q + i * kBlock;
      const float* xd = x.d + i;
      const int32_t* xo = x.offsets + i * kOffsets;
      if constexpr (kQ8x) {
        const __m256 dw = _mm256_load_ps(reinterpret_cast<const float*>(p + 16));
        for (int t = 0; t < NT; ++t) {
          __m256i s;
          if constexpr (T == DType::kQ8_0) {
            s = _mm256_setzero_si256();
            const __m256i ones = _mm256_set1_epi16(1);
            for (int k = 0; k < 8; ++k) {
              const __m256i xs = _mm256_sign_epi8(Load32Bcast(xq + kBlock * t + 4 * k),
                                                  _mm256_load_si256(p + 8 + k));
              s = _mm256_add_epi32(
                  s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_load_si256(p + k), xs), ones));
            }
          } else {
            s = Dot<8, 15>(p, xq + kBlock * t, _mm256_set1_epi32(xo[t]));
          }
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(xd[t])),
                                   acc[t]);
        }
        p += 17;
      } else {
        constexpr int kGroups = T == DType::kQ6_K ? 16 : 8, kVecs = 64 / kGroups;
        constexpr int kMax = T == DType::kQ6_K ? 63 : T == DType::kQ5_K ? 31 : 15;
        __m256i isum[NT];
        for (int t = 0; t < NT; ++t) isum[t] = _mm256_setzero_si256();
        for (int g = 0; g < kGroups; ++g) {
          const __m256i scale = _mm256_load_si256(p + 64 + g);
          for (int t = 0; t < NT; ++t) {
            const __m256i s0 = T == DType::kQ6_K ? _mm256_set1_epi32(xo[kOffsets * t + g])
                                                 : _mm256_setzero_si256();
            const __m256i s = Dot<kVecs, kMax>(p + kVecs * g, xq + kBlock * t + 4 * kVecs * g, s0);
            isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(s, scale));
          }
        }
        const __m256 d =
            _mm256_load_ps(reinterpret_cast<const float*>(p + (T == DType::kQ6_K ? 80 : 76)));
        if constexpr (T == DType::kQ6_K) {
          for (int t = 0; t < NT; ++t) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]),
                                     _mm256_mul_ps(d, _mm256_set1_ps(xd[t])), acc[t]);
          }
          p += 81;
        } else {
          const __m256 dmin = _mm256_load_ps(reinterpret_cast<const float*>(p + 77));
          for (int t = 0; t < NT; ++t) {
            __m256i m = _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k) {
              m = _mm256_add_epi32(m, _mm256_madd_epi16(_mm256_load_si256(p + 72 + k),
                                                        _mm256_set1_epi32(xo[kOffsets * t + k])));
            }
            const __m256 dx = _mm256_set1_ps(xd[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, dx), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, dx), acc[t]);
          }
          p += 78;
        }
      }
    }
    const __m256i rows =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int t = 0; t < NT; ++t) _mm256_maskstore_ps(y + t * ldy, rows, acc[t]);
  }
};
}  // namespace

const RowKernels* RowKernelsAvx2() {
  static const RowKernels k = {
      "avx2",
      {DotRowF32, DotRowF16, DotRowBF16, DotRowQ8, DotRowQ4, PINFER_K_DOT},
      {AxpyRowF32, AxpyRowF16, AxpyRowBF16, AxpyRowQ8, AxpyRowQ4, PINFER_K_AXPY},
      Dot4F32,
      Dot4x4F32,
      DotF32,
      AxpyF32,
      {nullptr, nullptr, nullptr, DotQ8x<BlockQ8_0, Q8BlockDot>, DotQ8x<BlockQ4_0, Q4BlockDot>},
      QuantizeQ8x256,
      SiluMul,
      ExpSubSum,
      PINFER_AXPY_ROWS,
      PINFER_DOT_ROWS((DotRowsQ8x<BlockQ4_0, Q4BlockDot>)),
      PINFER_K_Q8K,
      QuantizeQ8K,
      PINFER_MATMUL_Q8B(Tiles256),
  };
  return &k;
}

}  // namespace pinfer
