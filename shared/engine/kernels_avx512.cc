// AVX-512 instantiation of kernels_simd.inc (compiled with -mavx512f -mavx512bw -mavx512vl).
#include <immintrin.h>

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
  };
  return &k;
}

}  // namespace pinfer
