// AVX-512 instantiation of kernels_simd.inc (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512vnni; chosen only on processors with all of them).
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
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
// W bytes p[0..W) as floats of (p[i] >> shift) & mask (the K-quants' bit fields).
inline V vload_u8_bits(const uint8_t* p, int shift, int mask) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(
      _mm512_and_si512(_mm512_srl_epi32(b, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask)));
}
// Both nibbles of W bytes as floats: lo = p[i] & 15, hi = p[i] >> 4.
inline void vload_u8_nibbles(const uint8_t* p, V* lo, V* hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
// exp(x), Cephes' expf: ~1 ulp, arguments clamped to [-87, 88.38] (results stay normal).
inline V vexp(V x) {
  x = _mm512_min_ps(_mm512_max_ps(x, vset1(-87.f)), vset1(88.3762626647949f));
  const V fx = _mm512_roundscale_ps(_mm512_mul_ps(x, vset1(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, vset1(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, vset1(-2.12194440e-4f), x);
  V y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vadd(vfma(y, _mm512_mul_ps(x, x), x), vset1(1.f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
// out[j] = a[j] * (the fp16 value in bits 16j..16j+15 of d) for j < 4, one conversion for all.
inline void scale4(const float* a, uint64_t d, float* out) {
  _mm_store_ps(
      out, _mm_mul_ps(_mm_load_ps(a), _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(d)))));
}
// One Q4_0 block's 32 values (q - 8) as two fp32 vectors. vpermps reads only the low four bits
// of each index, so the zero-extended bytes index a table of -8..7 directly (low nibbles) and
// after a shift by 4 (high nibbles): no masking, no offset, no int-to-float conversion.
inline void q4_vecs(const uint8_t* qs, V* out) {
  const __m512 values = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f,
                                       2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  out[0] = _mm512_permutexvar_ps(bytes, values);
  out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
}
// Unscaled dot of one Q4_0 block's values (q - 8) with 32 floats, unpacked in registers.
inline V q4_block_dot(const uint8_t* qs, const float* x) {
  V q[2];
  q4_vecs(qs, q);
  return vfma(q[1], vload(x + 16), _mm512_mul_ps(q[0], vload(x)));
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
  const __m256i p =
      _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
  return _mm256_cvtepi32_ps(p);
}
// The nibbles are 0..15 (unsigned, as VNNI wants); starting from -8 * sum(x) removes the offset.
inline F8 q4q8_block(const uint8_t* qs, const int8_t* x, const int32_t* s8) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i nib =
      _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                       _mm256_set1_epi8(0x0f));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p =
      _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s8)), nib, xv);
  return _mm256_cvtepi32_ps(p);
}
}  // namespace

#include "shared/engine/kernels_simd.inc"

namespace {
#ifndef PINFER_Q4_PREFETCH
#define PINFER_Q4_PREFETCH 2048
#endif
// Q4_0 rows against a Q8Vector two blocks per 512-bit step: the two blocks' nibbles are laid out
// in x's element order ([lo0, hi0, lo1, hi1] 128-bit lanes), so one VNNI dot, one conversion and
// one FMA serve both blocks and x, its Q4_0 offsets and its scales load contiguously. The
// software prefetch runs ahead of the hardware's, non-temporal so that the streamed weights do
// not push the KV cache out of L3: measured ~10% and ~7% faster here, while software prefetches
// made Q8_0 rows no faster and F16 rows much slower, so only the Q4_0 kernels have one.
float DotQ4x512(const void* row, const Q8Vector& x, int64_t n) {
  const BlockQ4_0* r = static_cast<const BlockQ4_0*>(row);
  const int64_t nb = n / 32;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  auto two_blocks = [&](int64_t b) {
    const __m256i q01 = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r[b].qs))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[b + 1].qs)), 1);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(q01), _mm256_srli_epi16(q01, 4), 1);
    z = _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), m4);
    const __m512i p =
        _mm512_dpbusd_epi32(_mm512_loadu_si512(x.s8 + b * 8), z, _mm512_loadu_si512(x.q + b * 32));
    const __m128i dw = _mm_insert_epi16(_mm_cvtsi32_si128(r[b].d), r[b + 1].d, 1);
    const __m128 sc =
        _mm_mul_ps(_mm_cvtph_ps(dw),
                   _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.d + b))));
    return _mm512_mul_ps(_mm512_permutexvar_ps(pair, _mm512_castps128_ps512(sc)),
                         _mm512_cvtepi32_ps(p));
  };
  int64_t b = 0;
  for (; b + 3 < nb; b += 4) {
    if (PINFER_Q4_PREFETCH > 0) {  // 72 bytes a step: two prefetches miss no cache line
      _mm_prefetch(reinterpret_cast<const char*>(r + b) + PINFER_Q4_PREFETCH, _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(r + b + 2) + PINFER_Q4_PREFETCH, _MM_HINT_NTA);
    }
    acc0 = _mm512_add_ps(acc0, two_blocks(b));
    acc1 = _mm512_add_ps(acc1, two_blocks(b + 2));
  }
  for (; b + 1 < nb; b += 2) acc0 = _mm512_add_ps(acc0, two_blocks(b));
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  if (b < nb)
    sum += f8sum(f8set1(half_to_float(r[b].d) * x.d[b]) *
                 q4q8_block(r[b].qs, x.q + b * 32, x.s8 + b * 8));
  return sum;
}
// DotRowsQ8xK's sums for K Q4_0 rows (the sparse FFN's gate and up rows), two blocks per 512-bit
// step in DotQ4x512's layout: the low half accumulates the even blocks and the high half the odd
// ones, exactly DotRowsQ8xK's acc0 and acc1 (the same fp32 products and FMAs, the same result),
// with ~40% fewer instructions. Up to eight scattered rows read together keep more loads in
// flight: with eight-neuron groups the sparse FFN token measured ~1.3x faster than with the
// 256-bit four-row kernel (ffn_bench's Q4_0 layer, one thread). VBMI unpacking was no faster.
template <int K>
void DotRowsQ4x512K(const uint8_t* const* rows, const Q8Vector& x, int64_t n, float* out) {
  const BlockQ4_0* r[K];
  __m512 acc[K];
  for (int j = 0; j < K; ++j) {
    r[j] = reinterpret_cast<const BlockQ4_0*>(rows[j]);
    acc[j] = _mm512_setzero_ps();
  }
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t nb = n / 32;
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    const __m512i xq = _mm512_loadu_si512(x.q + b * 32), xs = _mm512_loadu_si512(x.s8 + b * 8);
    const __m128 xd = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.d + b)));
    for (int j = 0; j < K; ++j) {
      const __m256i q01 = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r[j][b].qs))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[j][b + 1].qs)), 1);
      __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(q01), _mm256_srli_epi16(q01, 4), 1);
      z = _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), m4);
      const __m512i p = _mm512_dpbusd_epi32(xs, z, xq);
      const __m128i dw = _mm_insert_epi16(_mm_cvtsi32_si128(r[j][b].d), r[j][b + 1].d, 1);
      const __m128 sc = _mm_mul_ps(_mm_cvtph_ps(dw), xd);
      acc[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pair, _mm512_castps128_ps512(sc)),
                               _mm512_cvtepi32_ps(p), acc[j]);
    }
  }
  for (int j = 0; j < K; ++j) {
    F8 acc0 = _mm512_castps512_ps256(acc[j]);
    const F8 acc1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1));
    if (b < nb) {
      acc0 = f8fma(f8set1(half_to_float(r[j][b].d) * x.d[b]),
                   q4q8_block(r[j][b].qs, x.q + b * 32, x.s8 + b * 8), acc0);
    }
    out[j] = f8sum(f8add(acc0, acc1));
  }
}

void DotRowsQ4x512(const uint8_t* const* rows, int k, const Q8Vector& x, int64_t n, float* out) {
  for (int j = 0; j < k; j += 8) {
    WithRowCount<8>(std::min(8, k - j),
                    [&](auto kk) { DotRowsQ4x512K<decltype(kk)::value>(rows + j, x, n, out + j); });
  }
}

// The same with AVX-512 VBMI (Ice Lake, Zen 4 and later): one masked load takes both blocks
// (scales and nibbles), one byte permute lays the nibble bytes out as [qs0, qs0, qs1, qs1] and
// one variable shift moves the high nibbles down; the scales come from the same register.
// About half the instructions of DotQ4x512 per pair of blocks.
alignas(64) constexpr uint8_t kNibbleBytes[64] = {
    2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17,   // qs0: low nibbles
    2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17,   // qs0: high nibbles
    20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,   // qs1: low nibbles
    20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35};  // qs1: high nibbles

// acc + (blocks b and b + 1 of r against x), lanes as in DotQ4x512.
__attribute__((target("avx512vbmi"), always_inline)) inline __m512 Q4PairVbmi(const BlockQ4_0* r,
                                                                              const Q8Vector& x,
                                                                              int64_t b,
                                                                              __m512 acc) {
  const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0,
                                          0x0004000400040004, 0x0004000400040004, 0, 0);
  const __m512i scale_words = _mm512_zextsi128_si512(_mm_set_epi16(0, 0, 0, 0, 0, 0, 9, 0));
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  constexpr __mmask64 kTwoBlocks = (__mmask64{1} << 36) - 1;
  const __m512i raw = _mm512_maskz_loadu_epi8(kTwoBlocks, r + b);  // d0 qs0 d1 qs1
  const __m512i z = _mm512_and_si512(
      _mm512_srlv_epi16(_mm512_permutexvar_epi8(_mm512_load_si512(kNibbleBytes), raw), shifts),
      _mm512_set1_epi8(0x0f));
  const __m512i p =
      _mm512_dpbusd_epi32(_mm512_loadu_si512(x.s8 + b * 8), z, _mm512_loadu_si512(x.q + b * 32));
  const __m128i dw = _mm512_castsi512_si128(_mm512_permutexvar_epi16(scale_words, raw));
  const __m128 sc =
      _mm_mul_ps(_mm_cvtph_ps(dw),
                 _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.d + b))));
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(pair, _mm512_castps128_ps512(sc)),
                         _mm512_cvtepi32_ps(p), acc);
}

// The same with AVX-512 VBMI (Ice Lake, Zen 4 and later): one masked load takes both blocks
// (scales and nibbles), one byte permute lays the nibble bytes out as [qs0, qs0, qs1, qs1] and
// one variable shift moves the high nibbles down; the scales come from the same register.
// About half the instructions of DotQ4x512 per pair of blocks.
__attribute__((target("avx512vbmi"))) float DotQ4x512Vbmi(const void* row, const Q8Vector& x,
                                                          int64_t n) {
  const BlockQ4_0* r = static_cast<const BlockQ4_0*>(row);
  const int64_t nb = n / 32;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 3 < nb; b += 4) {
    if (PINFER_Q4_PREFETCH > 0) {  // 72 bytes a step: two prefetches miss no cache line
      _mm_prefetch(reinterpret_cast<const char*>(r + b) + PINFER_Q4_PREFETCH, _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(r + b + 2) + PINFER_Q4_PREFETCH, _MM_HINT_NTA);
    }
    acc0 = Q4PairVbmi(r, x, b, acc0);
    acc1 = Q4PairVbmi(r, x, b + 2, acc1);
  }
  for (; b + 1 < nb; b += 2) acc0 = Q4PairVbmi(r, x, b, acc0);
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  if (b < nb) {
    sum += f8sum(f8set1(half_to_float(r[b].d) * x.d[b]) *
                 q4q8_block(r[b].qs, x.q + b * 32, x.s8 + b * 8));
  }
  return sum;
}
// QuantizeQ8x vectorised, bit for bit the same: the same fp32 products x * (1 / d) rounded half
// to even (the default MXCSR mode of vcvtps2dq), the same scalar scale arithmetic, and the 4-value
// sums from a VNNI dot with ones.
void QuantizeQ8x512(const float* x, int64_t n, int8_t* q, float* d, int32_t* s8) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < n / 32; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float dd = amax / 127.f;
    const float id = dd != 0.f ? 1.f / dd : 0.f;
    d[b] = Fp16ToFp32(Fp32ToFp16(dd));
    const __m512 vid = _mm512_set1_ps(id);
    const __m128i q0 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)));
    const __m128i q1 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid)));
    const __m256i qb = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), qb);
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), qb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s8 + b * 8),
                        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 3)));
  }
}
// ---- K-quant rows against one token (decode, sparse rows): dot_q8k, dot_rows_q8k ----
//
// Q4_K / Q5_K: a 512-bit vector holds the two sub-blocks that share 32 bytes of qs (low nibbles,
// then high), which are also 64 consecutive values of x; maddubs pairs them (no saturation:
// values <= 31, |x| <= 127) and VNNI's dpwssd applies each half's scale (one permute of the
// unpacked scales) and accumulates. Rather than reducing each super-block's sums to scalars (two
// horizontal reductions and scalar fp32 every 256 values, which held Q4_K_M decode at 0.87-0.92x
// llama.cpp's), its sixteen integer lanes are folded to four (exact, and still exactly
// convertible: each at most 16 * 2 * 7874 * 63 < 2^24), which d_w * d_x scales into a 128-bit
// fp32 accumulator and from which the mins' four lanes (sub-block mins times x's sums), scaled by
// dmin_w * d_x, come off at once; the row is reduced once at its end: ggml_vec_dot_q4_K_q8_K's
// definition in another fp32 summation order. (Sixteen fp32 lanes with the mins subtracted only
// at the end measured less accurate where the two sums nearly cancel.)
template <bool kHigh>
inline void Q45KAccumulate(const uint8_t* scales, const uint8_t* qs, const uint8_t* qh,
                           const int8_t* q8, const int16_t* bsums, float d, float dmin,
                           __m128* acc) {
  alignas(32) static constexpr uint8_t kHalf[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  uint32_t words[4];
  KScalesAndMins(scales, words);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));
  const __m512i scale16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(packed));
  const __m128i min16 = _mm_cvtepu8_epi16(_mm_srli_si128(packed, 8));
  const __m128i pair_sums =
      _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bsums)),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsums + 8)));
  const __m128i mins = _mm_madd_epi16(min16, pair_sums);
  const __m512i half =
      _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(kHalf)));
  const __m512i mask = _mm512_set1_epi8(0x0f);
  __m256i high = _mm256_setzero_si256();
  if constexpr (kHigh) high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  __m512i isum = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
    __m512i q = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), mask);
    if constexpr (kHigh) {
      const __m512i h =
          _mm512_inserti64x4(_mm512_castsi256_si512(high), _mm256_srli_epi16(high, 1), 1);
      q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(1)), 4));
      high = _mm256_srli_epi16(high, 2);
    }
    const __m512i x = _mm512_loadu_si512(q8 + 64 * i);
    const __m512i scale = _mm512_permutexvar_epi16(
        _mm512_add_epi16(half, _mm512_set1_epi16(static_cast<int16_t>(2 * i))), scale16);
    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q, x), scale);
  }
  const __m256i isum8 =
      _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
  const __m128i isum4 =
      _mm_add_epi32(_mm256_castsi256_si128(isum8), _mm256_extracti128_si256(isum8, 1));
  *acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isum4), _mm_set1_ps(d), *acc);
  *acc = _mm_fnmadd_ps(_mm_cvtepi32_ps(mins), _mm_set1_ps(dmin), *acc);
}

template <DType T>
inline void Q45KAccumulateBlock(const KBlock<T>& b, const Q8KVector& x, int64_t k, __m128* acc) {
  const float dx = x.d[k];
  const uint8_t* qh = nullptr;
  if constexpr (T == DType::kQ5_K) qh = b.qh;
  Q45KAccumulate<T == DType::kQ5_K>(b.scales, b.qs, qh, x.q + k * kSuperBlock, x.bsums + k * 16,
                                    half_to_float(b.d) * dx, half_to_float(b.dmin) * dx, acc);
}

inline float Q45KResult(__m128 acc) {
  __m128 s = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <DType T>
float DotQ8K45x512(const void* row, const Q8KVector& x, int64_t n) {
  const KBlock<T>* b = static_cast<const KBlock<T>*>(row);
  __m128 acc = _mm_setzero_ps();
  for (int64_t k = 0; k < n / kSuperBlock; ++k) Q45KAccumulateBlock<T>(b[k], x, k, &acc);
  return Q45KResult(acc);
}

// DotQ8K45x512 for k scattered rows, up to four read together super-block by super-block (see
// DotRowsQ8K); each row's sums formed as DotQ8K45x512 forms them, the same bits.
template <DType T>
void DotRowsQ8K45x512(const uint8_t* const* rows, int k, const Q8KVector& x, int64_t n,
                      float* out) {
  for (int j0 = 0; j0 < k; j0 += 4) {
    const int m = std::min(4, k - j0);
    __m128 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm_setzero_ps();
    for (int64_t blk = 0; blk < n / kSuperBlock; ++blk) {
      for (int j = 0; j < m; ++j) {
        Q45KAccumulateBlock<T>(reinterpret_cast<const KBlock<T>*>(rows[j0 + j])[blk], x, blk,
                               &acc[j]);
      }
    }
    for (int j = 0; j < m; ++j) out[j0 + j] = Q45KResult(acc[j]);
  }
}

// Q6_K rows against one token: a 512-bit vector holds 64 consecutive unsigned values q (0..63),
// four groups of 16 whose scales reach the four 128-bit quarters by one permute of the sixteen
// scales; maddubs (2 * 63 * 127 < 32768) and dpwssd with the scales accumulate. The offset of 32
// comes off in vector lanes (the scales' dot with x's 16-value sums by one madd) and the
// super-block's eight folded integer lanes are scaled by d_w * d_x into a 256-bit fp32
// accumulator; the row is reduced once at its end (ggml_vec_dot_q6_K_q8_K's definition in
// another fp32 summation order).
inline void Q6KAccumulate(const BlockQ6_K& b, const Q8KVector& x, int64_t k, __m256* acc) {
  alignas(32) static constexpr uint8_t kQuarter[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1,
                                                       1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                       2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
  const int8_t* q8 = x.q + k * kSuperBlock;
  const __m512i quarter =
      _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(kQuarter)));
  const __m256i scales =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
  const __m512i scales16 = _mm512_castsi256_si512(scales);
  const __m512i mask = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
  __m512i isum = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512(b.ql + 64 * h);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
    for (int p = 0; p < 2; ++p) {
      const __m512i low = _mm512_and_si512(p == 0 ? ql : _mm512_srli_epi16(ql, 4), mask);
      const __m256i h0 = _mm256_srli_epi16(qh, 4 * p);
      const __m512i hz =
          _mm512_inserti64x4(_mm512_castsi256_si512(h0), _mm256_srli_epi16(h0, 2), 1);
      const __m512i q = _mm512_or_si512(low, _mm512_slli_epi16(_mm512_and_si512(hz, three), 4));
      const __m512i xv = _mm512_loadu_si512(q8 + 128 * h + 64 * p);
      const __m512i scale = _mm512_permutexvar_epi16(
          _mm512_add_epi16(quarter, _mm512_set1_epi16(static_cast<int16_t>(8 * h + 4 * p))),
          scales16);
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q, xv), scale);
    }
  }
  const __m256i isum8 =
      _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
  const __m256i offset = _mm256_madd_epi16(
      scales, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums + k * 16)));
  const __m256i total = _mm256_sub_epi32(isum8, _mm256_slli_epi32(offset, 5));
  *acc =
      _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(half_to_float(b.d) * x.d[k]), *acc);
}

float DotQ8K6x512(const void* row, const Q8KVector& x, int64_t n) {
  const BlockQ6_K* b = static_cast<const BlockQ6_K*>(row);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < n / kSuperBlock; ++k) Q6KAccumulate(b[k], x, k, &acc);
  return f8sum(acc);
}

// DotQ8K6x512 for k scattered rows, up to four read together (the same bits per row).
void DotRowsQ8K6x512(const uint8_t* const* rows, int k, const Q8KVector& x, int64_t n, float* out) {
  for (int j0 = 0; j0 < k; j0 += 4) {
    const int m = std::min(4, k - j0);
    __m256 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < n / kSuperBlock; ++blk) {
      for (int j = 0; j < m; ++j) {
        Q6KAccumulate(reinterpret_cast<const BlockQ6_K*>(rows[j0 + j])[blk], x, blk, &acc[j]);
      }
    }
    for (int j = 0; j < m; ++j) out[j0 + j] = f8sum(acc[j]);
  }
}

// ---- Tiles for the batched quantized products (MatMulQ8B): 16 rows, one per 32-bit lane ----
//
// A packed vector holds the same four consecutive values of 16 rows (lane r: row r), so one
// vpdpbusd against four values of one token, broadcast from memory ({1to16}), adds four products
// to every row's sum at once and leaves each row's exact block dot in its own lane: no
// horizontal sums, and the scales of 16 rows (one vector) multiply one token's d. The weights are
// the unsigned operand (Q4_0, Q4_K, Q5_K, Q6_K values are unsigned; Q8_0 values are stored + 128)
// and x the signed one; the integer offsets this leaves (Q8_0's 128, Q4_0's 8, Q6_K's 32) are the
// per-token terms of BatchOffsets, which start each block's sum. Packing gathers the dwords of 16
// rows; it runs once per row group and chunk of tokens.
struct Tiles512 {
  static constexpr int kRows = 16;
  // Measured on the Zen 4 dev VM (engine_bench, prompt 128): 4 tokens a tile 6-9% faster than 8
  // for Q8_0 / Q4_0 and the same for the K types; 2 tokens 15-20% slower for the K types.
  static constexpr int kTokens = 4;
  static constexpr int64_t kQ8BlockBytes = 8 * 64 + 64;  // 8 value vectors, the 16 d_w
  // Per super-block: 64 value vectors, 8 scale vectors (16 for Q6_K), Q4_K / Q5_K's 4 min
  // vectors, d (and dmin).
  static constexpr int64_t kQ45KBytes = (64 + 8 + 4 + 2) * 64;
  static constexpr int64_t kQ6KBytes = (64 + 16 + 1) * 64;

  template <DType T>
  static int64_t PackedBytes(int64_t cols) {
    if constexpr (T == DType::kQ8_0 || T == DType::kQ4_0) return cols / 32 * kQ8BlockBytes;
    if constexpr (T == DType::kQ6_K) return cols / 256 * kQ6KBytes;
    return cols / 256 * kQ45KBytes;
  }

  static __m512i Load32Bcast(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  // Dword `offset` of each of the nr rows (zero in the lanes past them).
  static __m512i Gather(const uint8_t* w, __m512i index, __mmask16 rows, int64_t offset) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, index, w + offset, 1);
  }
  // The fp16 in the low (high) half of each lane as fp32.
  static __m512 LowHalf(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
  static __m512 HighHalf(__m512i v) { return LowHalf(_mm512_srli_epi32(v, 16)); }

  template <DType T>
  static void Pack(const uint8_t* w, size_t stride, int nr, int64_t cols, uint8_t* out) {
    const __m512i index =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(static_cast<int32_t>(stride)));
    const __mmask16 rows = static_cast<__mmask16>((1u << nr) - 1);
    const __m512i m4 = _mm512_set1_epi32(0x0f0f0f0f);
    __m512i* o = reinterpret_cast<__m512i*>(out);
    if constexpr (T == DType::kQ8_0 || T == DType::kQ4_0) {
      constexpr int64_t bytes = T == DType::kQ8_0 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
      for (int64_t b = 0; b < cols / 32; ++b, o += 9) {
        const int64_t base = b * bytes;
        if constexpr (T == DType::kQ8_0) {
          for (int k = 0; k < 8; ++k) {
            o[k] = _mm512_xor_si512(Gather(w, index, rows, base + 2 + 4 * k),
                                    _mm512_set1_epi32(static_cast<int32_t>(0x80808080)));
          }
        } else {  // values 4k..4k+3: low nibbles of dword k (k < 4), high nibbles (k >= 4)
          for (int k = 0; k < 4; ++k) {
            const __m512i v = Gather(w, index, rows, base + 2 + 4 * k);
            o[k] = _mm512_and_si512(v, m4);
            o[k + 4] = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
          }
        }
        _mm512_store_ps(o + 8, LowHalf(Gather(w, index, rows, base)));
      }
    } else if constexpr (T == DType::kQ6_K) {
      for (int64_t sb = 0; sb < cols / 256; ++sb, o += 81) {
        const int64_t base = sb * sizeof(BlockQ6_K);
        // Vector 32h + 8q + k: values 128h + 32q + 4k..4k+3 (group 8h + 2q + k / 4).
        for (int h = 0; h < 2; ++h) {
          for (int k = 0; k < 8; ++k) {
            const __m512i qh = Gather(w, index, rows, base + 128 + 32 * h + 4 * k);
            for (int q = 0; q < 2; ++q) {
              const __m512i ql = Gather(w, index, rows, base + 64 * h + 32 * q + 4 * k);
              for (int hi = 0; hi < 2; ++hi) {  // quarter q + 2 hi: low or high nibbles
                const int quarter = q + 2 * hi;
                const __m512i low = _mm512_and_si512(_mm512_srli_epi32(ql, 4 * hi), m4);
                const __m512i high =
                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * quarter),
                                                       _mm512_set1_epi32(0x03030303)),
                                      4);
                o[32 * h + 8 * quarter + k] = _mm512_or_si512(low, high);
              }
            }
          }
        }
        for (int i = 0; i < 4; ++i) {  // the int8 scales, sign-extended
          const __m512i s = Gather(w, index, rows, base + 192 + 4 * i);
          for (int j = 0; j < 4; ++j) {
            o[64 + 4 * i + j] = _mm512_srai_epi32(_mm512_slli_epi32(s, 24 - 8 * j), 24);
          }
        }
        _mm512_store_ps(o + 80, HighHalf(Gather(w, index, rows, base + 206)));
      }
    } else {
      constexpr bool kQ5 = T == DType::kQ5_K;
      constexpr int64_t bytes = kQ5 ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
      constexpr int64_t qs = kQ5 ? 48 : 16;
      for (int64_t sb = 0; sb < cols / 256; ++sb, o += 78) {
        const int64_t base = sb * bytes;
        // Vector 8j + k: values 4k..4k+3 of sub-block j.
        for (int p = 0; p < 4; ++p) {
          for (int k = 0; k < 8; ++k) {
            const __m512i v = Gather(w, index, rows, base + qs + 32 * p + 4 * k);
            o[8 * (2 * p) + k] = _mm512_and_si512(v, m4);
            o[8 * (2 * p + 1) + k] = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
          }
        }
        if constexpr (kQ5) {
          for (int k = 0; k < 8; ++k) {
            const __m512i h = Gather(w, index, rows, base + 16 + 4 * k);
            for (int j = 0; j < 8; ++j) {
              o[8 * j + k] = _mm512_or_si512(
                  o[8 * j + k],
                  _mm512_slli_epi32(
                      _mm512_and_si512(_mm512_srli_epi32(h, j), _mm512_set1_epi32(0x01010101)), 4));
            }
          }
        }
        // KScalesAndMins on 16 rows at once (it works on 32-bit words).
        const __m512i s0 = Gather(w, index, rows, base + 4), s1 = Gather(w, index, rows, base + 8),
                      s2 = Gather(w, index, rows, base + 12);
        const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low2 = _mm512_set1_epi32(0x03030303);
        const __m512i words[4] = {
            _mm512_and_si512(s0, low6),
            _mm512_or_si512(_mm512_and_si512(s2, m4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s0, 6), low2), 4)),
            _mm512_and_si512(s1, low6),
            _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32(s2, 4), m4),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, 6), low2), 4))};
        const __m512i byte = _mm512_set1_epi32(0xff);
        for (int j = 0; j < 8; ++j) {
          o[64 + j] = _mm512_and_si512(_mm512_srli_epi32(words[j / 4], 8 * (j % 4)), byte);
        }
        for (int k = 0; k < 4; ++k) {  // mins 2k (low half) and 2k + 1 (high half)
          const __m512i m = _mm512_srli_epi32(words[2 + k / 2], 16 * (k % 2));
          o[72 + k] = _mm512_or_si512(
              _mm512_and_si512(m, byte),
              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(m, 8), byte), 16));
        }
        const __m512i dd = Gather(w, index, rows, base);
        _mm512_store_ps(o + 76, LowHalf(dd));
        _mm512_store_ps(o + 77, HighHalf(dd));
      }
    }
  }

  // y[t * ldy + r] for the NT tokens t0.. (one group of Q8Batch) and the nr packed rows.
  template <DType T, int NT>
  static void Run(const uint8_t* packed, const Q8Batch& x, int64_t t0, int64_t cols, int nr,
                  float* y, int64_t ldy) {
    const __m512i* p = reinterpret_cast<const __m512i*>(packed);
    constexpr bool kQ8x = T == DType::kQ8_0 || T == DType::kQ4_0;
    constexpr int kBlock = kQ8x ? 32 : 256;
    constexpr int kOffsets = T == DType::kQ6_K ? 16 : kQ8x ? 1 : 4;
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x.blocks; ++b) {
      // Token t's block b: q + i * t, d[t], offsets + kOffsets * t.
      const int64_t i = x.Index(t0, b);
      const int8_t* xq = x.q + i * kBlock;
      const float* xd = x.d + i;
      const int32_t* xo = x.offsets + i * kOffsets;
      if constexpr (kQ8x) {
        __m512i wv[8];
        for (int k = 0; k < 8; ++k) wv[k] = _mm512_load_si512(p + k);
        const __m512 dw = _mm512_load_ps(p + 8);
        p += 9;
        for (int t = 0; t < NT; ++t) {
          __m512i s = _mm512_set1_epi32(xo[t]);
          for (int k = 0; k < 8; ++k) {
            s = _mm512_dpbusd_epi32(s, wv[k], Load32Bcast(xq + kBlock * t + 4 * k));
          }
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(xd[t])),
                                   acc[t]);
        }
      } else {
        constexpr int kGroups = T == DType::kQ6_K ? 16 : 8, kVecs = 64 / kGroups;
        __m512i isum[NT];
        for (int t = 0; t < NT; ++t) isum[t] = _mm512_setzero_si512();
        for (int g = 0; g < kGroups; ++g) {
          __m512i wv[kVecs];
          for (int k = 0; k < kVecs; ++k) wv[k] = _mm512_load_si512(p + kVecs * g + k);
          const __m512i scale = _mm512_load_si512(p + 64 + g);
          for (int t = 0; t < NT; ++t) {
            __m512i s = T == DType::kQ6_K ? _mm512_set1_epi32(xo[kOffsets * t + g])
                                          : _mm512_setzero_si512();
            for (int k = 0; k < kVecs; ++k) {
              s = _mm512_dpbusd_epi32(s, wv[k], Load32Bcast(xq + kBlock * t + 4 * (kVecs * g + k)));
            }
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s, scale));
          }
        }
        if constexpr (T == DType::kQ6_K) {
          const __m512 d = _mm512_load_ps(p + 80);
          p += 81;
          for (int t = 0; t < NT; ++t) {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xd[t])), acc[t]);
          }
        } else {
          const __m512 d = _mm512_load_ps(p + 76), dmin = _mm512_load_ps(p + 77);
          for (int t = 0; t < NT; ++t) {
            __m512i m = _mm512_setzero_si512();
            for (int k = 0; k < 4; ++k) {
              m = _mm512_dpwssd_epi32(m, _mm512_load_si512(p + 72 + k),
                                      _mm512_set1_epi32(xo[kOffsets * t + k]));
            }
            const __m512 dx = _mm512_set1_ps(xd[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dx), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dmin, dx), acc[t]);
          }
          p += 78;
        }
      }
    }
    const __mmask16 rows = static_cast<__mmask16>((1u << nr) - 1);
    for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + t * ldy, rows, acc[t]);
  }
};

// Q4_K / Q5_K axpys (the sparse FFN's transposed down rows): a row's term for a value q of a
// sub-block, a * (d * scale * q - dmin * min), is one of 16 numbers (Q5_K: 32), made for the
// row and sub-block with one FMA; vpermps (vpermt2ps for Q5_K's fifth bit) then fetches each
// value's term by its bits, as q4_vecs does for Q4_0, in place of masking, conversion, FMA and
// subtraction per vector. A super-block's y is taken 64 values (sub-blocks 2i and 2i + 1) at a
// time and stays in registers while up to eight rows add to it, in row order; the rows'
// coefficients times their scales and mins are worked out once per super-block. AxpyRowK45x512
// is the same with one row, so one call per row and one for all give the same bits.
// ffn_bench's in-cache axpy rates (hidden 5120, one thread, Zen 4): Q4_K 6.9 -> 9.9 GB/s, Q5_K
// 5.6 -> 7.6 (ForEachKVector's per-row passes before; Q4_0: 13.2); its sparse FFN token 1.49 ->
// 1.26 ms (Q4_K) and 2.05 -> 1.77 ms (Q5_K).
template <DType T>
void AxpyRowsK45x512(const float* a, const uint8_t* const* rows, int k, float* y, int64_t n) {
  static_assert(T == DType::kQ4_K || T == DType::kQ5_K);
  constexpr int kRows = 8;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.f));
  const __m512i bit4 = _mm512_set1_epi32(16);
  // Per row: a_j * d * scale for sub-blocks 0-7, then a_j * dmin * min.
  alignas(64) float ad[kRows][16];
  const KBlock<T>* b[kRows];
  for (int64_t sb = 0; sb < n / kSuperBlock; ++sb) {
    float* ys = y + sb * kSuperBlock;
    for (int j0 = 0; j0 < k; j0 += kRows) {
      const int kk = std::min(kRows, k - j0);
      for (int j = 0; j < kk; ++j) {
        b[j] = reinterpret_cast<const KBlock<T>*>(rows[j0 + j]) + sb;
        uint32_t packed[4];
        KScalesAndMins(b[j]->scales, packed);
        const __m512 sm = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed))));
        const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(b[j]->d)),
                                             _mm256_set1_ps(half_to_float(b[j]->dmin)), 1);
        _mm512_store_ps(ad[j], _mm512_mul_ps(_mm512_set1_ps(a[j0 + j]), _mm512_mul_ps(dd, sm)));
      }
      for (int i = 0; i < 4; ++i) {
        const __m512i rot0 = _mm512_set1_epi32((4 - 2 * i) & 31);
        const __m512i rot1 = _mm512_set1_epi32((3 - 2 * i) & 31);
        __m512 acc[4];  // values 64 i + 16 v: sub-block 2i (v = 0, 1), then 2i + 1 (v = 2, 3)
        for (int v = 0; v < 4; ++v) acc[v] = _mm512_loadu_ps(ys + 64 * i + 16 * v);
        for (int j = 0; j < kk; ++j) {
          const __m512 ad0 = _mm512_set1_ps(ad[j][2 * i]), am0 = _mm512_set1_ps(ad[j][8 + 2 * i]);
          const __m512 ad1 = _mm512_set1_ps(ad[j][2 * i + 1]);
          const __m512 am1 = _mm512_set1_ps(ad[j][9 + 2 * i]);
          const __m512 t0 = _mm512_fmsub_ps(ad0, iota, am0), t1 = _mm512_fmsub_ps(ad1, iota, am1);
          __m512 t0h, t1h;  // Q5_K: the terms of values 16..31
          if constexpr (T == DType::kQ5_K) {
            t0h = _mm512_fmsub_ps(ad0, iota16, am0);
            t1h = _mm512_fmsub_ps(ad1, iota16, am1);
          }
          for (int v = 0; v < 2; ++v) {
            const __m512i q = _mm512_cvtepu8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[j]->qs + 32 * i + 16 * v)));
            const __m512i hi = _mm512_srli_epi32(q, 4);
            if constexpr (T == DType::kQ5_K) {
              // Bit 2i (2i + 1) of qh[l] rotated to bit 4 of the index, selected into it by one
              // vpternlogd; vpermt2ps reads the low five bits only.
              const __m512i h = _mm512_cvtepu8_epi32(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[j]->qh + 16 * v)));
              const __m512i i0 =
                  _mm512_ternarylogic_epi32(_mm512_rolv_epi32(h, rot0), bit4, q, 0xE2);  // b?a:c
              const __m512i i1 =
                  _mm512_ternarylogic_epi32(_mm512_rolv_epi32(h, rot1), bit4, hi, 0xE2);
              acc[v] = _mm512_add_ps(acc[v], _mm512_permutex2var_ps(t0, i0, t0h));
              acc[2 + v] = _mm512_add_ps(acc[2 + v], _mm512_permutex2var_ps(t1, i1, t1h));
            } else {  // vpermps reads the index's low four bits: no mask for the low nibbles
              acc[v] = _mm512_add_ps(acc[v], _mm512_permutexvar_ps(q, t0));
              acc[2 + v] = _mm512_add_ps(acc[2 + v], _mm512_permutexvar_ps(hi, t1));
            }
          }
        }
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(ys + 64 * i + 16 * v, acc[v]);
      }
    }
  }
}

template <DType T>
void AxpyRowK45x512(float a, const void* row, float* y, int64_t n) {
  const uint8_t* r = static_cast<const uint8_t*>(row);
  AxpyRowsK45x512<T>(&a, &r, 1, y, n);
}

// Q6_K axpys the same way, but its sub-blocks are 16 values, too few to amortize a table: the
// 6-bit values are put together in integers (the low nibble, and qh's two bits moved to bits 4-5
// and merged by one vpternlogd), offset by -32 and converted, one FMA per vector. y is taken 64
// values at a time (one ql offset l of a 128-value half: values 128 h + 32 k + l, k = 0..3).
// In-cache rate (as above): 6.4 -> 11.8 GB/s; the sparse FFN token 2.50 -> 1.98 ms.
void AxpyRowsK6x512(const float* a, const uint8_t* const* rows, int k, float* y, int64_t n) {
  constexpr int kRows = 8;
  const __m512i low4 = _mm512_set1_epi32(15), bits45 = _mm512_set1_epi32(0x30);
  const __m512i offset = _mm512_set1_epi32(32);
  alignas(64) float ad[kRows][16];  // a_j * d * scale per 16-value sub-block
  const BlockQ6_K* b[kRows];
  for (int64_t sb = 0; sb < n / kSuperBlock; ++sb) {
    float* ys = y + sb * kSuperBlock;
    for (int j0 = 0; j0 < k; j0 += kRows) {
      const int kk = std::min(kRows, k - j0);
      for (int j = 0; j < kk; ++j) {
        b[j] = reinterpret_cast<const BlockQ6_K*>(rows[j0 + j]) + sb;
        const __m512 sc = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[j]->scales))));
        _mm512_store_ps(ad[j],
                        _mm512_mul_ps(_mm512_set1_ps(a[j0 + j]),
                                      _mm512_mul_ps(_mm512_set1_ps(half_to_float(b[j]->d)), sc)));
      }
      for (int h = 0; h < 2; ++h) {
        for (int l = 0; l < 32; l += 16) {
          __m512 acc[4];
          for (int q = 0; q < 4; ++q) acc[q] = _mm512_loadu_ps(ys + 128 * h + 32 * q + l);
          for (int j = 0; j < kk; ++j) {
            auto load16 = [](const uint8_t* p) {
              return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
            };
            const __m512i ql0 = load16(b[j]->ql + 64 * h + l);
            const __m512i ql1 = load16(b[j]->ql + 64 * h + 32 + l);
            const __m512i qh = load16(b[j]->qh + 32 * h + l);
            // value k's low nibble and its two high bits (bits 2k, 2k + 1 of qh) at bits 4-5
            const __m512i lo[4] = {_mm512_and_si512(ql0, low4), _mm512_and_si512(ql1, low4),
                                   _mm512_srli_epi32(ql0, 4), _mm512_srli_epi32(ql1, 4)};
            const __m512i hb[4] = {_mm512_slli_epi32(qh, 4), _mm512_slli_epi32(qh, 2), qh,
                                   _mm512_srli_epi32(qh, 2)};
            for (int q = 0; q < 4; ++q) {
              const __m512i v = _mm512_ternarylogic_epi32(hb[q], bits45, lo[q], 0xEA);  // a&b | c
              const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(v, offset));
              acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(ad[j][8 * h + 2 * q + l / 16]), f, acc[q]);
            }
          }
          for (int q = 0; q < 4; ++q) _mm512_storeu_ps(ys + 128 * h + 32 * q + l, acc[q]);
        }
      }
    }
  }
}

void AxpyRowK6x512(float a, const void* row, float* y, int64_t n) {
  const uint8_t* r = static_cast<const uint8_t*>(row);
  AxpyRowsK6x512(&a, &r, 1, y, n);
}
}  // namespace

#define PINFER_K_AXPY_512 AxpyRowK45x512<DType::kQ4_K>, AxpyRowK45x512<DType::kQ5_K>, AxpyRowK6x512
#define PINFER_K_AXPY_ROWS_512 \
  AxpyRowsK45x512<DType::kQ4_K>, AxpyRowsK45x512<DType::kQ5_K>, AxpyRowsK6x512

// PINFER_K_Q8K with the vector-accumulating Q4_K, Q5_K and Q6_K kernels above.
// clang-format off
#define PINFER_K_Q8K_512                                                                     \
  {nullptr, nullptr, nullptr, nullptr, nullptr, DotQ8K45x512<DType::kQ4_K>,                 \
   DotQ8K45x512<DType::kQ5_K>, DotQ8K6x512},                                                 \
  {nullptr, nullptr, nullptr, nullptr, nullptr, DotRowsQ8K45x512<DType::kQ4_K>,             \
   DotRowsQ8K45x512<DType::kQ5_K>, DotRowsQ8K6x512}
// clang-format on

const RowKernels* RowKernelsAvx512(bool vbmi) {
  static const RowKernels with_vbmi = {
      "avx512",
      {DotRowF32, DotRowF16, DotRowBF16, DotRowQ8, DotRowQ4, PINFER_K_DOT},
      {AxpyRowF32, AxpyRowF16, AxpyRowBF16, AxpyRowQ8, AxpyRowQ4, PINFER_K_AXPY_512},
      Dot4F32,
      Dot4x4F32,
      DotF32,
      AxpyF32,
      {nullptr, nullptr, nullptr, DotQ8x<BlockQ8_0, Q8BlockDot>, DotQ4x512Vbmi},
      QuantizeQ8x512,
      SiluMul,
      ExpSubSum,
      PINFER_AXPY_ROWS_WITH(PINFER_K_AXPY_ROWS_512),
      PINFER_DOT_ROWS(DotRowsQ4x512),
      PINFER_K_Q8K_512,
      QuantizeQ8K,
      PINFER_MATMUL_Q8B(Tiles512),
  };
  static const RowKernels without_vbmi = {
      "avx512-novbmi",
      {DotRowF32, DotRowF16, DotRowBF16, DotRowQ8, DotRowQ4, PINFER_K_DOT},
      {AxpyRowF32, AxpyRowF16, AxpyRowBF16, AxpyRowQ8, AxpyRowQ4, PINFER_K_AXPY_512},
      Dot4F32,
      Dot4x4F32,
      DotF32,
      AxpyF32,
      {nullptr, nullptr, nullptr, DotQ8x<BlockQ8_0, Q8BlockDot>, DotQ4x512},
      QuantizeQ8x512,
      SiluMul,
      ExpSubSum,
      PINFER_AXPY_ROWS_WITH(PINFER_K_AXPY_ROWS_512),
      PINFER_DOT_ROWS(DotRowsQ4x512),
      PINFER_K_Q8K_512,
      QuantizeQ8K,
      PINFER_MATMUL_Q8B(Tiles512),
  };
  return vbmi ? &with_vbmi : &without_vbmi;
}

const RowKernels* RowKernelsAvx512() {
  static const RowKernels* k = [] {
    __builtin_cpu_init();
    return RowKernelsAvx512(__builtin_cpu_supports("avx512vbmi"));
  }();
  return k;
}

}  // namespace pinfer
