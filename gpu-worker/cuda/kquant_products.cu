// The products over ggml's K-quant rows (Q4_K, Q5_K, Q6_K: super-blocks of 256 values, see
// shared/model/tensor.h): the dense and row-listed matrix-vector product that MatVecRows hands
// them to, and the sparse down projection's row accumulation (AccumulateRows). They are kept apart
// from dense_products.cu because a super-block is not a unit of the 32-value kernels there: its
// scales are per sub-block of 32 (Q4_K, Q5_K) or 16 (Q6_K) inside a 144-, 176- or 210-byte block.
//
// The product follows llama.cpp's CUDA definition (mmvq): x is quantized to int8 blocks of 32
// (the module's Qx format: d = fp16(max|x| / 127), q = round(x / d), and each block's sum), and
// each sub-block adds d_x * (d * scale * (integer dot) - dmin * min * (sum of x's integers)), four
// products per dp4a. The CPU engine quantizes x to Q8_K blocks of 256 instead, as ggml's CPU
// backend does, so the two agree to the rounding of x, which the op tests bound.
//
// Lanes: eight lanes share a super-block, each with 16 bytes of its quants (32 values of two
// sub-blocks in Q4_K and Q5_K, of two 16-value halves in Q6_K), so a warp takes four super-blocks
// a step. Q4_K and Q5_K blocks are 16-byte multiples and are read with 16-byte loads; Q6_K's
// 210-byte blocks are 2-byte aligned and are read in 16-bit words.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu-worker/cuda/kernel_common.cuh"
#include "gpu-worker/cuda/kernels.h"

namespace pinfer {
namespace cuda {
namespace {

// The product's launch shape (SetKMatVecShape): g_k_warps warps a block (at most 8).
constexpr int kKMaxThreads = 8 * 32;

template <WType T>
constexpr int kKBlockBytes = T == WType::kQ4_K   ? 144
                             : T == WType::kQ5_K ? 176
                                                 : 210;

// 16 bytes from a 2-byte aligned address.
__device__ __forceinline__ uint4 Load16Aligned2(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  uint32_t v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = static_cast<uint32_t>(__ldg(h + 2 * i)) |
           (static_cast<uint32_t>(__ldg(h + 2 * i + 1)) << 16);
  }
  return make_uint4(v[0], v[1], v[2], v[3]);
}

// Sub-block j's scale and min (get_scale_min_k4) from the scales' three words, j = 2i or 2i + 1.
__device__ __forceinline__ void ScaleMinWords(uint32_t s0, uint32_t s1, uint32_t s2, int j, int* sc,
                                              int* m) {
  if (j < 4) {
    *sc = (s0 >> (8 * j)) & 63;
    *m = (s1 >> (8 * j)) & 63;
  } else {
    const int sh = 8 * (j - 4);
    *sc = ((s2 >> sh) & 0x0f) | (((s0 >> (sh + 6)) & 3) << 4);
    *m = ((s2 >> (sh + 4)) & 0x0f) | (((s1 >> (sh + 6)) & 3) << 4);
  }
}

__device__ __forceinline__ int Dot16(const uint32_t (&w)[4], const int4& x) {
  int s = __dp4a(static_cast<int>(w[0]), x.x, 0);
  s = __dp4a(static_cast<int>(w[1]), x.y, s);
  s = __dp4a(static_cast<int>(w[2]), x.z, s);
  return __dp4a(static_cast<int>(w[3]), x.w, s);
}

// The raw bytes one lane loads of a super-block, decoded by DecodeKPart once they arrive, so
// that a step's loads (of every row a warp takes) are issued before the previous step is
// multiplied: Q4_K and Q5_K a = the 16-byte head (d, dmin, scales), b = the lane's 16 bytes of
// quants, c = Q5_K's 16 bytes of high bits; Q6_K a = ql, b = qh, e = its two scales and d.
struct KRaw {
  uint4 a, b, c;
  uint32_t e;
};

// Where a lane's values sit in the row: its two x blocks (of 32) and its first value within
// them (0 or 16). The same for every row, so a warp's rows share the loads of x.
struct KLanePos {
  int blk_a, blk_b, off;
};

template <WType T>
__device__ __forceinline__ KLanePos LanePos(int sb, int k) {
  if constexpr (T == WType::kQ6_K) {
    const int h = k / 4, c = (k / 2) % 2, m = k % 2;
    return {sb * 8 + 4 * h + c, sb * 8 + 4 * h + c + 2, 16 * m};
  } else {
    const int i = k / 2, m = k % 2;
    return {sb * 8 + 2 * i, sb * 8 + 2 * i + 1, 16 * m};
  }
}

template <WType T>
__device__ __forceinline__ KRaw LoadKRaw(const uint8_t* row, int sb, int k) {
  KRaw r;
  const uint8_t* b = row + static_cast<size_t>(sb) * kKBlockBytes<T>;
  if constexpr (T == WType::kQ6_K) {
    // k: h (half of 128) = k / 4, c = (k / 2) % 2, m = k % 2. ql bytes [64h + 32c + 16m, +16):
    // low nibbles are values 16m.. of sequence c, high nibbles of sequence c + 2; qh bytes
    // [32h + 16m, +16) carry their two high bits at bits 2c and 2c + 4.
    const int h = k / 4, c = (k / 2) % 2, m = k % 2;
    r.a = Load16Aligned2(b + 64 * h + 32 * c + 16 * m);
    r.b = Load16Aligned2(b + 128 + 32 * h + 16 * m);
    const uint8_t* sc = b + 192 + 8 * h + 2 * c + m;
    r.e = static_cast<uint32_t>(__ldg(sc)) | (static_cast<uint32_t>(__ldg(sc + 4)) << 8) |
          (static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(b + 208))) << 16);
  } else {
    // k: chunk i = k / 2 of qs (sub-blocks 2i in the low nibbles, 2i + 1 in the high), values
    // [16m, 16m + 16) of both, m = k % 2.
    const int i = k / 2, m = k % 2;
    constexpr int kQs = T == WType::kQ4_K ? 16 : 48;
    r.a = __ldg(reinterpret_cast<const uint4*>(b));
    r.b = __ldg(reinterpret_cast<const uint4*>(b + kQs + 32 * i + 16 * m));
    if constexpr (T == WType::kQ5_K) r.c = __ldg(reinterpret_cast<const uint4*>(b + 16 + 16 * m));
  }
  return r;
}

// What one lane holds of a super-block: its 16 bytes of quants turned into two sets of four
// words of (unsigned or signed) bytes, each set against 16 values of one x block, and the
// factors that scale the two integer dots.
struct KLanePart {
  uint32_t a[4], b[4];  // byte values of sub-blocks A and B
  float fa, fb;         // d * scale
  float ma, mb;         // dmin * min, applied by the off == 0 lane only (0 otherwise)
};

template <WType T>
__device__ __forceinline__ KLanePart DecodeKPart(const KRaw& r, int k) {
  KLanePart p;
  if constexpr (T == WType::kQ6_K) {
    const int c = (k / 2) % 2;
    const uint32_t l[4] = {r.a.x, r.a.y, r.a.z, r.a.w}, hh[4] = {r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t va = (l[i] & 0x0f0f0f0fu) | (((hh[i] >> (2 * c)) & 0x03030303u) << 4);
      const uint32_t vb =
          ((l[i] >> 4) & 0x0f0f0f0fu) | (((hh[i] >> (2 * c + 4)) & 0x03030303u) << 4);
      p.a[i] = __vsub4(va, 0x20202020u);  // q - 32 as signed bytes
      p.b[i] = __vsub4(vb, 0x20202020u);
    }
    const float d = H2F(static_cast<uint16_t>(r.e >> 16));
    p.fa = d * static_cast<float>(static_cast<int8_t>(r.e & 0xff));
    p.fb = d * static_cast<float>(static_cast<int8_t>((r.e >> 8) & 0xff));
    p.ma = p.mb = 0.f;
  } else {
    const int i = k / 2, m = k % 2;
    const uint32_t w[4] = {r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p.a[e] = w[e] & 0x0f0f0f0fu;
      p.b[e] = (w[e] >> 4) & 0x0f0f0f0fu;
    }
    if constexpr (T == WType::kQ5_K) {
      // Bit j of qh[l] is the fifth bit of value l of sub-block j.
      const uint32_t hw[4] = {r.c.x, r.c.y, r.c.z, r.c.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p.a[e] |= ((hw[e] >> (2 * i)) & 0x01010101u) << 4;
        p.b[e] |= ((hw[e] >> (2 * i + 1)) & 0x01010101u) << 4;
      }
    }
    const float d = H2F(static_cast<uint16_t>(r.a.x & 0xffff));
    const float dmin = H2F(static_cast<uint16_t>(r.a.x >> 16));
    int sa, mna, sbb, mnb;
    ScaleMinWords(r.a.y, r.a.z, r.a.w, 2 * i, &sa, &mna);
    ScaleMinWords(r.a.y, r.a.z, r.a.w, 2 * i + 1, &sbb, &mnb);
    p.fa = d * static_cast<float>(sa);
    p.fb = d * static_cast<float>(sbb);
    p.ma = m == 0 ? dmin * static_cast<float>(mna) : 0.f;
    p.mb = m == 0 ? dmin * static_cast<float>(mnb) : 0.f;
  }
  return p;
}

// The x values a lane multiplies in one step (one token): its 16 int8 of each of its two
// blocks, their scales and sums.
struct KLaneX {
  int4 xa, xb;
  float da, db;
  int sa, sb;
};

__device__ __forceinline__ KLaneX LoadKLaneX(const QxParts& xp, const KLanePos& pos) {
  return {*reinterpret_cast<const int4*>(xp.q + pos.blk_a * 32 + pos.off),
          *reinterpret_cast<const int4*>(xp.q + pos.blk_b * 32 + pos.off),
          xp.d[pos.blk_a],
          xp.d[pos.blk_b],
          xp.sum[pos.blk_a],
          xp.sum[pos.blk_b]};
}

// The lane's share of row . x for one token's quantized x.
__device__ __forceinline__ float KPartDot(const KLanePart& p, const KLaneX& x) {
  float s = x.da * (p.fa * static_cast<float>(Dot16(p.a, x.xa)));
  s += x.db * (p.fb * static_cast<float>(Dot16(p.b, x.xb)));
  if (p.ma != 0.f) s -= x.da * p.ma * static_cast<float>(x.sa);
  if (p.mb != 0.f) s -= x.db * p.mb * static_cast<float>(x.sb);
  return s;
}

// y[t * ldy + i] = row(rows ? rows[i] : i) . x[t] for i < count, t < n (n <= NT), one row a warp.
// x comes quantized (x_qx, QxRegionBytes(cols) a token), copied into shared memory, or is
// quantized here into shared memory: the block's rows read it from there. Each lane keeps its
// next super-block's raw loads in flight while it decodes and multiplies the current one (decoding
// at the load, as the first version did, made every step wait for its own loads: 50% of the copy
// bandwidth for a whole Q4_K model against 68%), and a dense product (no row list, no device
// count) issues its first loads before it waits for its predecessor (weights never change while
// a product may run). MB: blocks an SM must fit by registers (__launch_bounds__).
template <WType T, int NT, int MB>
__global__ void __launch_bounds__(kKMaxThreads, MB)
    MatVecKKernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t cols,
                  const int32_t* __restrict__ rows, int n_rows,
                  const int32_t* __restrict__ dev_count, const float* __restrict__ x,
                  const int8_t* __restrict__ x_qx, int n, float* __restrict__ y, int ldy) {
  extern __shared__ uint4 smem_qx[];
  PdlTrigger();
  const int lane = threadIdx.x % kWarp, k = lane % 8;
  const int i = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int nb = static_cast<int>(cols / 256);
  int sb = lane / 8;
  KRaw next;
  bool loaded = false;
  if (rows == nullptr && dev_count == nullptr && i < n_rows && sb < nb) {
    next = LoadKRaw<T>(w + static_cast<size_t>(i) * row_bytes, sb, k);
    loaded = true;
  }
  PdlWait();
  auto* region = reinterpret_cast<int8_t*>(smem_qx);
  if (x_qx == nullptr) {
    for (int t = 0; t < n; ++t) QuantizeRowInBlock(x + t * cols, cols, QxAt(region, cols, t));
  } else {
    const int64_t n16 = static_cast<int64_t>(QxRegionBytes(cols) / 16) * n;
    const uint4* src = reinterpret_cast<const uint4*>(x_qx);
    for (int64_t j = threadIdx.x; j < n16; j += blockDim.x) smem_qx[j] = __ldg(src + j);
    __syncthreads();
  }
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  if (i >= count) return;
  const uint8_t* row = w + static_cast<size_t>(rows != nullptr ? rows[i] : i) * row_bytes;
  if (!loaded && sb < nb) next = LoadKRaw<T>(row, sb, k);
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  for (; sb < nb; sb += 4) {
    const KRaw cur = next;
    if (sb + 4 < nb) next = LoadKRaw<T>(row, sb + 4, k);
    const KLanePart p = DecodeKPart<T>(cur, k);
    const KLanePos pos = LanePos<T>(sb, k);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n) acc[t] += KPartDot(p, LoadKLaneX(QxAt(region, cols, t), pos));
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < n) {
      const float v = WarpSum(acc[t]);
      if (lane == 0) y[static_cast<int64_t>(t) * ldy + i] = v;
    }
  }
}

// The 32 values of sub-unit u (a block of 32 columns) of a K-quant row, as KQuantElem gives them.
template <WType T>
__device__ __forceinline__ void KUnitValues(const uint8_t* row, int64_t u, float* v) {
  const int64_t sb = u / 8;
  const int j = static_cast<int>(u % 8);
  const uint8_t* b = row + sb * kKBlockBytes<T>;
  if constexpr (T == WType::kQ6_K) {
    // Unit j: half h = j / 4, sequence k = j % 4 (values 32k.. of the half).
    const int h = j / 4, k = j % 4;
    const uint8_t* ql = b + 64 * h + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const float d = H2F(__ldg(reinterpret_cast<const unsigned short*>(b + 208)));
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + 2 * k);
    const float f0 = d * static_cast<float>(sc[0]), f1 = d * static_cast<float>(sc[1]);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint4 lq = Load16Aligned2(ql + 16 * half);
      const uint4 hq = Load16Aligned2(qh + 16 * half);
      const uint32_t lw[4] = {lq.x, lq.y, lq.z, lq.w}, hw[4] = {hq.x, hq.y, hq.z, hq.w};
      const float f = half == 0 ? f0 : f1;
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const uint32_t lb = (lw[e / 4] >> (8 * (e % 4))) & 0xff;
        const uint32_t hb = (hw[e / 4] >> (8 * (e % 4))) & 0xff;
        const int lo = k < 2 ? static_cast<int>(lb & 0x0f) : static_cast<int>(lb >> 4);
        const int hi = static_cast<int>((hb >> (2 * k)) & 3);
        v[16 * half + e] = f * static_cast<float>((lo | (hi << 4)) - 32);
      }
    }
  } else {
    const uint4 head = __ldg(reinterpret_cast<const uint4*>(b));
    int sc, m;
    ScaleMinWords(head.y, head.z, head.w, j, &sc, &m);
    const float f = H2F(static_cast<uint16_t>(head.x & 0xffff)) * static_cast<float>(sc);
    const float mn = H2F(static_cast<uint16_t>(head.x >> 16)) * static_cast<float>(m);
    constexpr int kQs = T == WType::kQ4_K ? 16 : 48;
    const uint4* qs = reinterpret_cast<const uint4*>(b + kQs + 32 * (j / 2));
    const uint4* qh = reinterpret_cast<const uint4*>(b + 16);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint4 q = __ldg(qs + half);
      const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
      uint32_t hw[4] = {0u, 0u, 0u, 0u};
      if constexpr (T == WType::kQ5_K) {
        const uint4 hv = __ldg(qh + half);
        hw[0] = hv.x;
        hw[1] = hv.y;
        hw[2] = hv.z;
        hw[3] = hv.w;
      }
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const uint32_t byte = (qw[e / 4] >> (8 * (e % 4))) & 0xff;
        int q4 = (j & 1) ? static_cast<int>(byte >> 4) : static_cast<int>(byte & 0x0f);
        if constexpr (T == WType::kQ5_K)
          q4 |= static_cast<int>((hw[e / 4] >> (8 * (e % 4) + j)) & 1) << 4;
        v[16 * half + e] = f * static_cast<float>(q4) - mn;
      }
    }
  }
}

constexpr int kKAccThreads = 128;

// y[t, :] += sum_i a[t * lda + i] * row(rows ? rows[i] : i): a thread owns 32 columns (one
// sub-unit), blocks along y split the rows, blockIdx.z is the token; each block adds its partial
// sums with one atomic a column, as AccumulateRowsKernel does.
template <WType T>
__global__ void __launch_bounds__(kKAccThreads)
    AccumulateRowsKKernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t cols,
                          const int32_t* __restrict__ rows, int n_rows,
                          const int32_t* __restrict__ dev_count, const float* __restrict__ a,
                          int lda, int rows_per_split, float* __restrict__ y) {
  PdlStart();
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  const int i0 = blockIdx.y * rows_per_split;
  if (i0 >= count) return;
  const int i1 = min(count, i0 + rows_per_split);
  const int t = blockIdx.z;
  const int64_t u = static_cast<int64_t>(blockIdx.x) * kKAccThreads + threadIdx.x;
  if (u >= cols / 32) return;
  const float* at = a + static_cast<int64_t>(t) * lda;
  float acc[32];
#pragma unroll
  for (int e = 0; e < 32; ++e) acc[e] = 0.f;
  bool any = false;
  for (int i = i0; i < i1; ++i) {
    const float c = at[i];
    if (c == 0.f) continue;
    any = true;
    const int64_t r = rows != nullptr ? rows[i] : i;
    float v[32];
    KUnitValues<T>(w + static_cast<size_t>(r) * row_bytes, u, v);
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] += c * v[e];
  }
  if (!any) return;
  float* yt = y + static_cast<int64_t>(t) * cols + u * 32;
#pragma unroll
  for (int e = 0; e < 32; ++e) atomicAdd(yt + e, acc[e]);
}

// The kernel for a launch: one token or up to kMaxTok, and for one token the blocks an SM must
// fit by registers (several tokens keep their accumulators unconstrained).
template <WType T, int MB>
auto MatVecKFor(int nt) {
  return nt == 1 ? MatVecKKernel<T, 1, MB> : MatVecKKernel<T, kMaxTok, 1>;
}
template <WType T>
auto MatVecKFor(int nt, int min_blocks) {
  switch (min_blocks) {
    case 4:
      return MatVecKFor<T, 4>(nt);
    case 5:
      return MatVecKFor<T, 5>(nt);
    case 6:
      return MatVecKFor<T, 6>(nt);
    default:
      return MatVecKFor<T, 1>(nt);
  }
}

template <WType T>
cudaError_t LaunchMatVecK(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                          const int32_t* dev_count, const float* x, int n, float* y, int ldy,
                          cudaStream_t stream, const int8_t* x_qx) {
  const size_t region = QxRegionBytes(w.cols);
  // As many tokens a launch as their quantized x fits shared memory.
  constexpr size_t kMaxSmem = 96 * 1024;
  int per_launch = static_cast<int>(kMaxSmem / region);
  if (per_launch > kMaxTok) per_launch = kMaxTok;
  if (per_launch < 1) return cudaErrorInvalidValue;  // a row wider than ~86k columns
  static bool attr_set = false;                      // per instantiation
  if (!attr_set) {
    for (int nt : {1, kMaxTok}) {
      for (int mb : {1, 4, 5, 6}) {
        const cudaError_t e =
            cudaFuncSetAttribute(MatVecKFor<T>(nt, mb), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(kMaxSmem));
        if (e != cudaSuccess) return e;
      }
    }
    attr_set = true;
  }
  const int blocks = (n_rows + g_k_warps - 1) / g_k_warps;
  for (int t0 = 0; t0 < n; t0 += per_launch) {
    const int nt = n - t0 < per_launch ? n - t0 : per_launch;
    const int8_t* qt = x_qx != nullptr ? x_qx + region * static_cast<size_t>(t0) : nullptr;
    const size_t smem = region * static_cast<size_t>(nt);
    const float* xt = x + static_cast<int64_t>(t0) * w.cols;
    float* yt = y + static_cast<int64_t>(t0) * ldy;
    const cudaError_t e = Launch(MatVecKFor<T>(nt, g_k_min_blocks), blocks, g_k_warps * kWarp, smem,
                                 stream, static_cast<const uint8_t*>(w.data), w.row_bytes(), w.cols,
                                 rows, n_rows, dev_count, xt, qt, nt, yt, ldy);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <WType T>
cudaError_t LaunchAccumulateK(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                              const int32_t* dev_count, const float* a, int lda, int n, float* y,
                              cudaStream_t stream) {
  const int64_t units = w.cols / 32;
  const int col_blocks = static_cast<int>((units + kKAccThreads - 1) / kKAccThreads);
  // A few blocks per multiprocessor for the token and at least 16 rows a block (few atomics).
  int splits = 8 * SmCount() / col_blocks;
  if (splits < 1) splits = 1;
  int rows_per_split = (n_rows + splits - 1) / splits;
  if (rows_per_split < 16) rows_per_split = 16;
  splits = (n_rows + rows_per_split - 1) / rows_per_split;
  if (splits > 65535) {
    splits = 65535;
    rows_per_split = (n_rows + splits - 1) / splits;
  }
  return Launch(AccumulateRowsKKernel<T>, dim3(col_blocks, splits, n), kKAccThreads, 0, stream,
                static_cast<const uint8_t*>(w.data), w.row_bytes(), w.cols, rows, n_rows, dev_count,
                a, lda, rows_per_split, y);
}

}  // namespace

cudaError_t MatVecRowsK(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                        const int32_t* dev_count, const float* x, int n, float* y, int ldy,
                        cudaStream_t stream, const void* x_qx) {
  const auto* q = static_cast<const int8_t*>(x_qx);
  switch (w.type) {
    case WType::kQ4_K:
      return LaunchMatVecK<WType::kQ4_K>(w, rows, n_rows, dev_count, x, n, y, ldy, stream, q);
    case WType::kQ5_K:
      return LaunchMatVecK<WType::kQ5_K>(w, rows, n_rows, dev_count, x, n, y, ldy, stream, q);
    case WType::kQ6_K:
      return LaunchMatVecK<WType::kQ6_K>(w, rows, n_rows, dev_count, x, n, y, ldy, stream, q);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t AccumulateRowsK(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                            const int32_t* dev_count, const float* a, int lda, int n, float* y,
                            cudaStream_t stream) {
  switch (w.type) {
    case WType::kQ4_K:
      return LaunchAccumulateK<WType::kQ4_K>(w, rows, n_rows, dev_count, a, lda, n, y, stream);
    case WType::kQ5_K:
      return LaunchAccumulateK<WType::kQ5_K>(w, rows, n_rows, dev_count, a, lda, n, y, stream);
    case WType::kQ6_K:
      return LaunchAccumulateK<WType::kQ6_K>(w, rows, n_rows, dev_count, a, lda, n, y, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace pinfer
