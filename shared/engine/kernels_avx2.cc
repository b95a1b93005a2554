// AVX2 + FMA + F16C instantiation of kernels_simd.inc (compiled with -mavx2 -mfma -mf16c).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

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
  };
  return &k;
}

}  // namespace pinfer
