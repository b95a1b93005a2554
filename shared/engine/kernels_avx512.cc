// AVX-512 instantiation of kernels_simd.inc (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512vnni; chosen only on processors with all of them).
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "shared/engine/row_kernels.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {
using V = __m512;
constexpr int W = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V vload_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline V vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline void unpack_q4(const uint8_t* qs, int8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_sub_epi8(_mm_and_si128(v, mask), eight));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), eight));
}
// Unscaled dot of one Q4_0 block's values (q - 8) with 32 floats, unpacked in registers.
inline V q4_block_dot(const uint8_t* qs, const float* x) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, mask), eight);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), eight);
  const V a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), vload(x));
  return vfma(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), vload(x + 16), a);
}
// Quantized-activation block dots on 256-bit vectors (AVX-512VL + VNNI): eight int32 partial
// sums of four products each, exact, converted to fp32.
using F8 = __m256;
inline F8 f8zero() { return _mm256_setzero_ps(); }
inline F8 f8set1(float a) { return _mm256_set1_ps(a); }
inline F8 f8add(F8 a, F8 b) { return _mm256_add_ps(a, b); }
inline F8 f8fma(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }
inline float f8sum(F8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Signed x signed through VNNI's unsigned x signed: |w| times x with w's sign.
inline F8 q8q8_block(const int8_t* w, const int8_t* x) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(wv),
                                        _mm256_sign_epi8(xv, wv));
  return _mm256_cvtepi32_ps(p);
}
// The nibbles are 0..15 (unsigned, as VNNI wants); starting from -8 * sum(x) removes the offset.
inline F8 q4q8_block(const uint8_t* qs, const int8_t* x, const int32_t* s8) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i nib = _mm256_and_si256(
      _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
      _mm256_set1_epi8(0x0f));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p =
      _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s8)), nib, xv);
  return _mm256_cvtepi32_ps(p);
}
}  // namespace

#include "shared/engine/kernels_simd.inc"

const RowKernels* RowKernelsAvx512() {
  static const RowKernels k = {
      "avx512",
      {DotRowF32, DotRowF16, DotRowBF16, DotRowQ8, DotRowQ4},
      {AxpyRowF32, AxpyRowF16, AxpyRowBF16, AxpyRowQ8, AxpyRowQ4},
      Dot4F32,
      Dot4x4F32,
      DotF32,
      AxpyF32,
      {nullptr, nullptr, nullptr, DotQ8x<BlockQ8_0, Q8BlockDot>, DotQ8x<BlockQ4_0, Q4BlockDot>},
      QuantizeQ8x,
  };
  return &k;
}

}  // namespace pinfer
