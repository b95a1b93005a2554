// The dense matrix-vector products over F32/F16/BF16/Q8_0/Q4_0 rows (K-quants: kquant_products.cu)
// (MatVecRows and the fused NormMatVec, NormMatVecRope, NormMatVecGated) with their kernels:
// warp-per-row and block-per-row over ggml rows, the split layout's float and int8 (quantized x)
// kernels, the register-held-x int8 kernel, and the repack of GGUF blocks into the split layout. It
// is one file of about 1,200 lines because MatVecLaunch instantiates every kernel template for each
// weight type.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <utility>

#include "gpu-worker/cuda/kernel_common.cuh"
#include "gpu-worker/cuda/kernels.h"
#include "gpu-worker/cuda/norm_rope.cuh"

namespace pinfer {
namespace cuda {
namespace {

// One warp per row (eight rows per block): the alternative to the block-per-row kernel below,
// chosen by row count (SetMatVecWarpRowsMin). With single-token specialisations of both, the
// block-per-row kernel measured as fast or faster on every decode shape of a 13B model on the
// H200 (docs/benchmarks.md, run 7), so it is the default and this kernel stays for tuning.
template <int E>
__device__ __forceinline__ float DotUnit(const float* w, const float* x) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < E; e += 4) {
    const float4 a = *reinterpret_cast<const float4*>(x + e);
    s += w[e] * a.x + w[e + 1] * a.y + w[e + 2] * a.z + w[e + 3] * a.w;
  }
  return s;
}

constexpr int kRowWarps = 8;

template <WType T, int NT>
__global__ void __launch_bounds__(kRowWarps* kWarp)
    MatVecWarpKernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t cols,
                     const int32_t* __restrict__ rows, int n_rows,
                     const int32_t* __restrict__ dev_count, const float* __restrict__ x, int n,
                     float* __restrict__ y, int ldy) {
  PdlStart();
  // NT: tokens per pass, a compile-time bound so that single-token decode keeps one
  // accumulator (fewer registers, more resident warps, more loads in flight).
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  const int i = blockIdx.x * kRowWarps + threadIdx.x / kWarp;
  if (i >= count) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t r = rows != nullptr ? rows[i] : i;
  const uint8_t* row = w + static_cast<size_t>(r) * row_bytes;
  constexpr int E = Unit<T>::kElems;
  const int64_t units = cols / E;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  // Four units per lane per iteration: four independent 16-byte loads in flight.
  int64_t u = lane;
  for (; u + 3 * kWarp < units; u += 4 * kWarp) {
    float w0[E], w1[E], w2[E], w3[E];
    LoadUnit<T>(row, u, w0);
    LoadUnit<T>(row, u + kWarp, w1);
    LoadUnit<T>(row, u + 2 * kWarp, w2);
    LoadUnit<T>(row, u + 3 * kWarp, w3);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n) {
        const float* xt = x + t * cols + u * E;
        acc[t] += DotUnit<E>(w0, xt) + DotUnit<E>(w1, xt + kWarp * E) +
                  DotUnit<E>(w2, xt + 2 * kWarp * E) + DotUnit<E>(w3, xt + 3 * kWarp * E);
      }
    }
  }
  for (; u < units; u += kWarp) {
    float w0[E];
    LoadUnit<T>(row, u, w0);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n) acc[t] += DotUnit<E>(w0, x + t * cols + u * E);
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

// ---------------------------------------------------------------------------------------------
// Row dot products: one block of 128 threads per row (a whole row is 2-27 KB), every token of the
// (small) batch sharing each weight load. One row per block rather than per warp keeps the last
// wave short: a layer's 5120-row matrix is about five waves of blocks instead of 1.2 waves of
// warps. Block formats are first copied into shared memory with 16-byte loads (their 18/34-byte
// blocks are only 2-byte aligned in global memory), then dequantized from there.

constexpr int kMvThreads = 128;

template <WType T, int NT>
__global__ void __launch_bounds__(kMvThreads)
    MatVecRowsKernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t cols,
                     const int32_t* __restrict__ rows, int n_rows,
                     const int32_t* __restrict__ dev_count, const float* __restrict__ x, int n,
                     float* __restrict__ y, int ldy, bool stage, bool prefetch) {
  extern __shared__ uint4 staged[];
  __shared__ float red[NT][kMvThreads / kWarp];
  PdlTrigger();
  if (prefetch && rows == nullptr && dev_count == nullptr && threadIdx.x == 0 &&
      row_bytes % 16 == 0) {
    PrefetchL2(w + static_cast<size_t>(blockIdx.x) * row_bytes, static_cast<uint32_t>(row_bytes));
  }
  PdlWait();
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  const int i = blockIdx.x;
  if (i >= count) return;
  const int64_t r = rows != nullptr ? rows[i] : i;
  const uint8_t* row = w + static_cast<size_t>(r) * row_bytes;
  constexpr int E = Unit<T>::kElems;
  const int64_t units = cols / E;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;

  if constexpr (kVec16<T>) {
    // Four independent 16-byte loads in flight per thread before their first use.
    int64_t u = threadIdx.x;
    for (; u + 3 * kMvThreads < units; u += 4 * kMvThreads) {
      float w0[E], w1[E], w2[E], w3[E];
      LoadUnit<T>(row, u, w0);
      LoadUnit<T>(row, u + kMvThreads, w1);
      LoadUnit<T>(row, u + 2 * kMvThreads, w2);
      LoadUnit<T>(row, u + 3 * kMvThreads, w3);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t < n) {
          const float* xt = x + t * cols + u * E;
          acc[t] += DotUnit<E>(w0, xt) + DotUnit<E>(w1, xt + kMvThreads * E) +
                    DotUnit<E>(w2, xt + 2 * kMvThreads * E) +
                    DotUnit<E>(w3, xt + 3 * kMvThreads * E);
        }
      }
    }
    for (; u < units; u += kMvThreads) {
      float w0[E];
      LoadUnit<T>(row, u, w0);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t < n) acc[t] += DotUnit<E>(w0, x + t * cols + u * E);
      }
    }
  } else {
    const uint8_t* base = row;
    if (stage) {
      const uint4* src = reinterpret_cast<const uint4*>(row);
      const int n16 = static_cast<int>(row_bytes / 16);
      for (int k = threadIdx.x; k < n16; k += kMvThreads) staged[k] = LoadStream(src + k);
      __syncthreads();
      base = reinterpret_cast<const uint8_t*>(staged);
    }
    for (int64_t u = threadIdx.x; u < units; u += kMvThreads) {
      float w0[E];
      if constexpr (T == WType::kQ8_0) {
        DequantQ8Block(base + u * 34, w0);
      } else {
        DequantQ4Block(base + u * 18, w0);
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t < n) acc[t] += DotUnit<E>(w0, x + t * cols + u * E);
      }
    }
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < n) {
      const float s = WarpSum(acc[t]);
      if (lane == 0) red[t][warp] = s;
    }
  }
  __syncthreads();
  if (threadIdx.x < n) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kMvThreads / kWarp; ++k) s += red[threadIdx.x][k];
    y[static_cast<int64_t>(threadIdx.x) * ldy + i] = s;
  }
}

// Block formats, four rows per block: the rows are staged in shared memory with 16-byte loads,
// and each thread keeps a 32-value slice of x in registers for all four rows. Reading x costs
// 128 bytes per 18-byte Q4_0 block, so without this reuse the kernel is bound by x, not weights.
constexpr int kQuantRows = 4;

template <WType T>
__global__ void __launch_bounds__(kMvThreads)
    MatVecQuantKernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t cols,
                      const int32_t* __restrict__ rows, int n_rows,
                      const int32_t* __restrict__ dev_count, const float* __restrict__ x, int n,
                      float* __restrict__ y, int ldy) {
  PdlStart();
  extern __shared__ uint4 staged[];
  __shared__ float red[kQuantRows][kMaxTok][kMvThreads / kWarp];
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  const int i0 = blockIdx.x * kQuantRows;
  if (i0 >= count) return;
  const int nr = min(kQuantRows, count - i0);
  const int n16 = static_cast<int>(row_bytes / 16);
  for (int r = 0; r < nr; ++r) {
    const int64_t rid = rows != nullptr ? rows[i0 + r] : i0 + r;
    const uint4* src = reinterpret_cast<const uint4*>(w + static_cast<size_t>(rid) * row_bytes);
    for (int k = threadIdx.x; k < n16; k += kMvThreads) staged[r * n16 + k] = LoadStream(src + k);
  }
  __syncthreads();
  constexpr int kUnitBytes = T == WType::kQ8_0 ? 34 : 18;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(staged);
  const int64_t units = cols / 32;
  float acc[kQuantRows][kMaxTok];
#pragma unroll
  for (int r = 0; r < kQuantRows; ++r) {
#pragma unroll
    for (int t = 0; t < kMaxTok; ++t) acc[r][t] = 0.f;
  }
  for (int64_t u = threadIdx.x; u < units; u += kMvThreads) {
#pragma unroll
    for (int t = 0; t < kMaxTok; ++t) {
      if (t >= n) break;
      float xs[32];
      const float4* xp = reinterpret_cast<const float4*>(x + t * cols + u * 32);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float4 v = xp[k];
        xs[4 * k] = v.x;
        xs[4 * k + 1] = v.y;
        xs[4 * k + 2] = v.z;
        xs[4 * k + 3] = v.w;
      }
#pragma unroll
      for (int r = 0; r < kQuantRows; ++r) {
        if (r < nr) {
          float wv[32];
          const uint8_t* blk = base + static_cast<size_t>(r) * n16 * 16 + u * kUnitBytes;
          if constexpr (T == WType::kQ8_0)
            DequantQ8Block(blk, wv);
          else
            DequantQ4Block(blk, wv);
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < 32; ++e) s += wv[e] * xs[e];
          acc[r][t] += s;
        }
      }
    }
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
#pragma unroll
  for (int r = 0; r < kQuantRows; ++r) {
#pragma unroll
    for (int t = 0; t < kMaxTok; ++t) {
      if (t < n && r < nr) {
        const float v = WarpSum(acc[r][t]);
        if (lane == 0) red[r][t][warp] = v;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < kQuantRows * kMaxTok) {
    const int r = threadIdx.x / kMaxTok, t = threadIdx.x % kMaxTok;
    if (r < nr && t < n) {
      float v = 0.f;
#pragma unroll
      for (int k = 0; k < kMvThreads / kWarp; ++k) v += red[r][t][k];
      y[static_cast<int64_t>(t) * ldy + i0 + r] = v;
    }
  }
}

// Matrix-vector over a split matrix: each warp takes kSplitRows rows and sweeps their blocks
// with its 32 lanes; a lane loads the 32 x values of a block once (from L1) and uses them for
// all of its rows, so x costs a quarter of its bytes per weight row. Two blocks per lane per
// iteration: 2 * kSplitRows independent 16-byte weight loads in flight for Q4_0.
constexpr int kSplitRows = 4;
constexpr int kSplitWarps = 4;

// One block of kSplitRows rows against the x values of that block for every token.
template <WType T, int NT>
__device__ __forceinline__ void SplitConsume(const uint4 (&q)[kSplitRows][kSplitBlockBytes<T> / 16],
                                             const float (&d)[kSplitRows],
                                             const float* __restrict__ x, int64_t cols, int b,
                                             int n, float (&acc)[kSplitRows][NT]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < n) {
      float xs[32];
      const float4* xp =
          reinterpret_cast<const float4*>(x + t * cols + static_cast<int64_t>(b) * 32);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float4 v = __ldg(xp + k);
        xs[4 * k] = v.x;
        xs[4 * k + 1] = v.y;
        xs[4 * k + 2] = v.z;
        xs[4 * k + 3] = v.w;
      }
#pragma unroll
      for (int r = 0; r < kSplitRows; ++r) {
        acc[r][t] = fmaf(d[r], SplitBlockDot<T>(q[r], xs), acc[r][t]);
      }
    }
  }
}

template <WType T, int NT>
__global__ void __launch_bounds__(kSplitWarps* kWarp)
    MatVecSplitKernel(const uint8_t* __restrict__ qs, const uint16_t* __restrict__ scales,
                      int64_t cols, const int32_t* __restrict__ rows, int n_rows,
                      const int32_t* __restrict__ dev_count, const float* __restrict__ x, int n,
                      float* __restrict__ y, int ldy, bool prefetch) {
  constexpr int QB = kSplitBlockBytes<T>;
  constexpr int QV = QB / 16;  // 16-byte vectors per block
  const int nblk = static_cast<int>(cols / 32);
  const size_t qrb = static_cast<size_t>(nblk) * QB;
  const int lane = threadIdx.x % kWarp;
  const int i0 = (blockIdx.x * kSplitWarps + threadIdx.x / kWarp) * kSplitRows;
  PdlTrigger();
  if (prefetch && rows == nullptr && dev_count == nullptr && lane < kSplitRows &&
      i0 + lane < n_rows) {
    PrefetchL2(qs + static_cast<size_t>(i0 + lane) * qrb, static_cast<uint32_t>(qrb));
  }
  PdlWait();
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  if (i0 >= count) return;
  const int nr = min(kSplitRows, count - i0);
  // Rows past the count repeat the last valid row (read, never written), so the loop is uniform.
  const uint8_t* rq[kSplitRows];
  const uint16_t* rs[kSplitRows];
#pragma unroll
  for (int r = 0; r < kSplitRows; ++r) {
    const int i = i0 + min(r, nr - 1);
    const int64_t rid = rows != nullptr ? rows[i] : i;
    rq[r] = qs + static_cast<size_t>(rid) * qrb;
    rs[r] = scales + static_cast<size_t>(rid) * nblk;
  }
  float acc[kSplitRows][NT];
#pragma unroll
  for (int r = 0; r < kSplitRows; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
  }
  int b = lane;
  for (; b + kWarp < nblk; b += 2 * kWarp) {
    uint4 q[2][kSplitRows][QV];
    float d[2][kSplitRows];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int r = 0; r < kSplitRows; ++r) {
        const uint4* src =
            reinterpret_cast<const uint4*>(rq[r] + static_cast<size_t>(b + h * kWarp) * QB);
#pragma unroll
        for (int v = 0; v < QV; ++v) q[h][r][v] = LoadStream(src + v);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int r = 0; r < kSplitRows; ++r) d[h][r] = H2F(rs[r][b + h * kWarp]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) SplitConsume<T, NT>(q[h], d[h], x, cols, b + h * kWarp, n, acc);
  }
  if (b < nblk) {
    uint4 q[kSplitRows][QV];
    float d[kSplitRows];
#pragma unroll
    for (int r = 0; r < kSplitRows; ++r) {
      const uint4* src = reinterpret_cast<const uint4*>(rq[r] + static_cast<size_t>(b) * QB);
#pragma unroll
      for (int v = 0; v < QV; ++v) q[r][v] = LoadStream(src + v);
      d[r] = H2F(rs[r][b]);
    }
    SplitConsume<T, NT>(q, d, x, cols, b, n, acc);
  }
#pragma unroll
  for (int r = 0; r < kSplitRows; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n) {
        const float v = WarpSum(acc[r][t]);
        if (lane == 0 && r < nr) y[static_cast<int64_t>(t) * ldy + i0 + r] = v;
      }
    }
  }
}

// The same product with llama.cpp's definition (SetQuantizedActivations): x is quantized to Q8_0
// blocks in shared memory by each block of warps (d_x = fp16(max|x| / 127), q = round-half-even
// of x / d_x, computed with the same fp32 operations as the CPU reference), and each weight block
// contributes d_w * d_x * (an exact integer dot product, four products per dp4a). A Q4_0 nibble
// is used unsigned and its offset of 8 is taken out with the block's sum of q.
// The launch's shape (warps per block, rows per warp) and how it was chosen: kernel_config.cu.

template <WType T>
__device__ __forceinline__ int SplitBlockIntDot(const uint4* q, const int4* xw) {
  const int4 a = xw[0], b = xw[1];
  const int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  int s = 0;
  if constexpr (T == WType::kQ4_0) {
    const uint32_t w[4] = {q[0].x, q[0].y, q[0].z, q[0].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      s = __dp4a(static_cast<int>(w[k] & 0x0f0f0f0fu), x[k], s);
      s = __dp4a(static_cast<int>((w[k] >> 4) & 0x0f0f0f0fu), x[4 + k], s);
    }
  } else {
    const uint32_t w[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
#pragma unroll
    for (int k = 0; k < 8; ++k) s = __dp4a(static_cast<int>(w[k]), x[k], s);
  }
  return s;
}

// One row a warp fits in 40 registers without spilling, so it is compiled for 48 resident warps
// an SM; two or more rows a warp take 56-80 registers (32 warps at most).
template <WType T, int kQxWarps, int R>
__global__ void __launch_bounds__(kQxWarps* kWarp, R == 1 ? 48 / kQxWarps : 1)
    MatVecSplitQ8xKernel(const uint8_t* __restrict__ qs, const uint16_t* __restrict__ scales,
                         int64_t cols, const int32_t* __restrict__ rows, int n_rows,
                         const int32_t* __restrict__ dev_count, const float* __restrict__ x,
                         float* __restrict__ y, bool prefetch, const int8_t* __restrict__ pre) {
  extern __shared__ int4 xsh[];
  constexpr int QB = kSplitBlockBytes<T>;
  constexpr int QV = QB / 16;
  const int nblk = static_cast<int>(cols / 32);
  const size_t qrb = static_cast<size_t>(nblk) * QB;
  // x as int8 blocks: quantized by the producer (pre, see QxBytes) or here into shared memory.
  const QxParts xp =
      QxAt(pre != nullptr ? const_cast<int8_t*>(pre) : reinterpret_cast<int8_t*>(xsh), cols, 0);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int i0 = (blockIdx.x * kQxWarps + warp) * R;
  PdlTrigger();
  if (prefetch && rows == nullptr && dev_count == nullptr && lane < R && i0 + lane < n_rows) {
    PrefetchL2(qs + static_cast<size_t>(i0 + lane) * qrb, static_cast<uint32_t>(qrb));
  }
  PdlWait();
  if (pre == nullptr) QuantizeRowInBlock(x, cols, xp);
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  if (i0 >= count) return;
  const int nr = min(R, count - i0);
  const uint8_t* rq[R];
  const uint16_t* rs[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = i0 + min(r, nr - 1);
    const int64_t rid = rows != nullptr ? rows[i] : i;
    rq[r] = qs + static_cast<size_t>(rid) * qrb;
    rs[r] = scales + static_cast<size_t>(rid) * nblk;
  }
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  int b = lane;
  for (; b + kWarp < nblk; b += 2 * kWarp) {
    uint4 q[2][R][QV];
    float dw[2][R];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint4* src =
            reinterpret_cast<const uint4*>(rq[r] + static_cast<size_t>(b + h * kWarp) * QB);
#pragma unroll
        for (int v = 0; v < QV; ++v) q[h][r][v] = LoadStream(src + v);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int r = 0; r < R; ++r) dw[h][r] = H2F(rs[r][b + h * kWarp]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int bb = b + h * kWarp;
      const int4* xw = reinterpret_cast<const int4*>(xp.q + bb * 32);
      const float dx = xp.d[bb];
      const int off = T == WType::kQ4_0 ? 8 * xp.sum[bb] : 0;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[r] += dw[h][r] * dx * static_cast<float>(SplitBlockIntDot<T>(q[h][r], xw) - off);
      }
    }
  }
  if (b < nblk) {
    uint4 q[R][QV];
    float dw[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4* src = reinterpret_cast<const uint4*>(rq[r] + static_cast<size_t>(b) * QB);
#pragma unroll
      for (int v = 0; v < QV; ++v) q[r][v] = LoadStream(src + v);
      dw[r] = H2F(rs[r][b]);
    }
    const int4* xw = reinterpret_cast<const int4*>(xp.q + b * 32);
    const float dx = xp.d[b];
    const int off = T == WType::kQ4_0 ? 8 * xp.sum[b] : 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[r] += dw[r] * dx * static_cast<float>(SplitBlockIntDot<T>(q[r], xw) - off);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float v = WarpSum(acc[r]);
    if (lane == 0 && r < nr) y[i0 + r] = v;
  }
}

// NormMatVecRope's row pairs of a stacked wqkv: pair j < (n_heads + n_kv_heads) * head_dim / 2
// is a rotated pair of a q or k head, the rest are the values two by two.
__device__ __forceinline__ int2 RopePairRows(const RopeOut& r, int j) {
  const int half = r.head_dim / 2, rotated = (r.n_heads + r.n_kv_heads) * half;
  if (j < rotated) {
    const int head = j / half, i = j % half;
    const int a = r.interleaved ? 2 * i : i, b = r.interleaved ? 2 * i + 1 : i + half;
    return make_int2(head * r.head_dim + a, head * r.head_dim + b);
  }
  const int v = (r.n_heads + r.n_kv_heads) * r.head_dim + 2 * (j - rotated);
  return make_int2(v, v + 1);
}
// Writes pair j's two product rows (x0, x1) where RopeQkvKernel would: rotated into q or the key
// cache, or as they are into the value cache, at position pos.
__device__ __forceinline__ void StoreRopePair(const RopeOut& r, int j, int pos, float x0,
                                              float x1) {
  const int half = r.head_dim / 2, rotated = (r.n_heads + r.n_kv_heads) * half;
  const int64_t kv_row = static_cast<int64_t>(pos) * r.n_kv_heads * r.head_dim;
  if (j < rotated) {
    const int head = j / half, i = j % half;
    const int a = r.interleaved ? 2 * i : i, b = r.interleaved ? 2 * i + 1 : i + half;
    float* dst = head < r.n_heads ? r.q + head * r.head_dim
                                  : r.k_cache + kv_row + (head - r.n_heads) * r.head_dim;
    RotatePair(x0, x1, reinterpret_cast<const float2*>(r.cos_sin)[i], dst + a, dst + b);
  } else {
    float* dst = r.v_cache + kv_row + 2 * (j - rotated);
    dst[0] = x0;
    dst[1] = x1;
  }
}

// What MatVecQxRegsKernel does with a step's two sums: writes them as rows of y (kOutRows), as a
// rotated pair of q / k or two values (kOutRope, NormMatVecRope), or as one neuron's gate and up
// (kOutGated, NormMatVecGated).
enum QxOut : int { kOutRows = 0, kOutRope = 1, kOutGated = 2 };
// kOutGated's destination: the activation [ffn] and its quantized copy, as GatedActivationPacked
// leaves them.
struct GatedOut {
  ActKind act = ActKind::kRelu;
  float* out = nullptr;
  void* qx = nullptr;
};

// The int8 product with x held in registers (g_qx_regs). MatVecSplitQ8xKernel's lane l reads x's
// blocks l, l + 32, ... from L1 for every row, twice the bytes of the weights it multiplies them
// with, and Nsight Compute found those products with L1 their busiest unit and warps stalled on
// L1 loads two thirds of the time (docs/benchmarks.md, run 22). Here a row's blocks are split into
// S parts of at most KB * 32 blocks, one warp a part; each lane loads its blocks of x once, into
// registers, and the warps then stream rows (a grid sized to the resident blocks, each row slot
// taking rows i and i + stride per step for two rows' loads in flight), so the only loads per row
// are the weights and their scales. A block of kQxRegWarps warps holds kQxRegWarps / S row slots;
// with S > 1 the parts' sums meet in shared memory and are added in part order. With S = 1 the
// per-lane block order and arithmetic are MatVecSplitQ8xKernel's, so the result is the same bit
// for bit; with S > 1 it differs by summation order only (and is the same on every run). The
// weights' loads run ahead of what waits on them (docs/benchmarks.md, run 26): a dense product's
// first step before the wait for its predecessor, and each next step before the current one's
// sums cross the warp and the block. With kNorm every block computes x itself from the residual
// (NormQuantizeRowInBlock), and kOut says where a step's two sums go (docs/benchmarks.md, run 27:
// so the norm, RoPE and the activation need no kernels of their own in a dense decode layer).
constexpr int kQxRegWarps = 8;
// kOutGated: a block takes groups of 32 neurons, kQxRegWarps a step, so that the group's
// activations meet in the block and are quantized there.
constexpr int kGroupSteps = 32 / kQxRegWarps;
template <WType T, int KB, int S, bool kExact, bool kNorm, int kOut>
__global__ void __launch_bounds__(kQxRegWarps* kWarp, 2)
    MatVecQxRegsKernel(const uint8_t* __restrict__ qs, const uint16_t* __restrict__ scales,
                       int64_t cols, const int32_t* __restrict__ rows, int n_rows,
                       const int32_t* __restrict__ dev_count, const float* __restrict__ x,
                       float* __restrict__ y, const int8_t* __restrict__ pre, bool early, bool pipe,
                       int x_first_from, NormIn norm, RopeOut rope, GatedOut gated) {
  static_assert(kOut == kOutRows || (S == 1 && kNorm), "pairs ride on the norm's product");
  __shared__ float act_sh[2][32];  // kOutGated: [group parity][neuron of the group]
  extern __shared__ int4 xsh[];
  __shared__ float partial[2][2][kQxRegWarps];  // [step parity][row of the pair][warp]
  constexpr int QB = kSplitBlockBytes<T>;
  constexpr int QV = QB / 16;
  constexpr int kSlots = kQxRegWarps / S;
  const int nblk = static_cast<int>(cols / 32);
  const size_t qrb = static_cast<size_t>(nblk) * QB;
  const QxParts xp =
      QxAt(pre != nullptr ? const_cast<int8_t*>(pre) : reinterpret_cast<int8_t*>(xsh), cols, 0);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int slot = warp / S, part = warp % S;
  // This part's blocks: [b0, b1). Lanes past the part's end (unless every part is KB * 32
  // blocks, kExact) read its last block again and weigh it by dx = 0 (an exact +0 in the sum):
  // loads that are never predicated stay batched ahead of their use.
  const int part_blocks = (nblk + S - 1) / S;
  const int b0 = part * part_blocks, b1 = min(nblk, b0 + part_blocks);
  int blk[KB];
#pragma unroll
  for (int k = 0; k < KB; ++k)
    blk[k] = kExact ? b0 + lane + k * kWarp : min(b0 + lane + k * kWarp, b1 - 1);
  const int stride = gridDim.x * kSlots;
  const int base0 = blockIdx.x * kSlots + (S == 1 ? slot : 0);

  // Step t's two rows and their weights. kOutRows: rows i and i + stride of base(t) = base0 + 2t
  // stride; with S > 1 the trip count is the block's, so that every warp reaches the same
  // __syncthreads, and a slot past the count then reads a row that exists (the block's first) and
  // writes nothing. kOutRope: the count is of row pairs (RopePairRows), step t takes pair base0 +
  // t stride. kOutGated: the count is of neurons, step t takes neuron i of group blockIdx.x + (t /
  // kGroupSteps) gridDim.x, rows i (gate) and count + i (up).
  auto step_base = [&](int t) {
    if constexpr (kOut == kOutGated) {
      const int g = blockIdx.x + (t / kGroupSteps) * static_cast<int>(gridDim.x);
      return g * 32 + (t % kGroupSteps) * kQxRegWarps;
    } else {
      return base0 + t * (kOut == kOutRope ? 1 : 2) * stride;
    }
  };
  int i = 0, i1 = 0;
  bool has0 = false, has1 = false;
  uint4 q[2][KB][QV];
  float dw[2][KB];
  auto load_step = [&](int t, int count) {
    const int base = step_base(t);
    i = base + (S == 1 && kOut != kOutGated ? 0 : slot);
    i1 = i + stride;
    has0 = S == 1 || i < count;
    has1 = kOut != kOutRows || i1 < count;
    const int first = S == 1 ? i : min(blockIdx.x * kSlots, count - 1);
    int64_t rid[2];
    if constexpr (kOut == kOutRope) {
      const int2 pair = RopePairRows(rope, i);
      rid[0] = pair.x;
      rid[1] = pair.y;
    } else if constexpr (kOut == kOutGated) {
      rid[0] = i;
      rid[1] = count + i;
    } else {
      rid[0] = rows != nullptr ? rows[has0 ? i : first] : (has0 ? i : first);
      rid[1] = has1 ? (rows != nullptr ? rows[i1] : i1) : rid[0];
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint8_t* rq = qs + static_cast<size_t>(rid[u]) * qrb;
#pragma unroll
      for (int k = 0; k < KB; ++k) {
        const uint4* src = reinterpret_cast<const uint4*>(rq + blk[k] * QB);
#pragma unroll
        for (int v = 0; v < QV; ++v) q[u][k][v] = LoadStream(src + v);
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint16_t* rs = scales + static_cast<size_t>(rid[u]) * nblk;
#pragma unroll
      for (int k = 0; k < KB; ++k) dw[u][k] = H2F(rs[blk[k]]);
    }
  };

  PdlTrigger();
  // Weights never change: a dense product (no row list, no device count; the caller says so with
  // `early`) loads its first step's rows before the wait, so that they arrive while the
  // predecessor (a norm, the attention, the activation) still runs. Blocks from x_first_from on
  // load x first: see MatVecLaunch.
  const bool preloaded =
      early && step_base(0) < n_rows && static_cast<int>(blockIdx.x) < x_first_from;
  if (preloaded) load_step(0, n_rows);
  float nw[kNormChunks][8];
  if constexpr (kNorm) LoadNormWeights(norm, static_cast<int>(cols), nw);
  PdlWait();
  if constexpr (kNorm) {
    NormQuantizeRowInBlock(norm, static_cast<int>(cols), nw, xp);
  } else if (pre == nullptr) {
    QuantizeRowInBlock(x, cols, xp);
  }
  int4 xq[KB][2];  // this lane's blocks of x: [KB, 32 int8]
  float dx[KB];
  int off[KB];
#pragma unroll
  for (int k = 0; k < KB; ++k) {
    const int4* xw = reinterpret_cast<const int4*>(xp.q + blk[k] * 32);
    xq[k][0] = xw[0];
    xq[k][1] = xw[1];
    dx[k] = kExact || b0 + lane + k * kWarp < b1 ? xp.d[blk[k]] : 0.f;
    off[k] = T == WType::kQ4_0 ? 8 * xp.sum[blk[k]] : 0;
  }
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  const int pos = kOut == kOutRope ? rope.positions[0] : 0;
  bool loaded = preloaded;
  for (int step = 0; step_base(step) < count; ++step) {
    if (!loaded) load_step(step, count);
    loaded = false;
    float acc[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      acc[u] = 0.f;
#pragma unroll
      for (int k = 0; k < KB; ++k) {
        acc[u] +=
            dw[u][k] * dx[k] * static_cast<float>(SplitBlockIntDot<T>(q[u][k], xq[k]) - off[k]);
      }
    }
    // With `pipe`, the next step's weights load (into the registers this step has just used)
    // before this step's sums cross the warp and, with S > 1, the block's barrier, so that the
    // block keeps loads in flight through them. The trip count is the block's for S > 1.
    const int r0 = i, r1 = i1;
    const bool w0 = has0, w1 = has1;
    if (pipe && step_base(step + 1) < count) {
      load_step(step + 1, count);
      loaded = true;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) acc[u] = WarpSum(acc[u]);
    if constexpr (kOut == kOutRope) {
      if (lane == 0) StoreRopePair(rope, r0, pos, acc[0], acc[1]);
    } else if constexpr (kOut == kOutGated) {
      // The group's activations meet in shared memory (two parities: the next group's writes
      // never meet this one's reads), and its last step's barrier hands them to warp 0.
      const int parity = (step / kGroupSteps) & 1;
      if (lane == 0) act_sh[parity][r0 % 32] = ApplyGated(gated.act, acc[0], acc[1]);
      if (step % kGroupSteps == kGroupSteps - 1) {
        __syncthreads();
        if (warp == 0) {
          const float v = act_sh[parity][lane];
          const int g = r0 / 32;
          gated.out[g * 32 + lane] = v;
          QuantizeBlockInWarp(v, lane, g, QxAt(gated.qx, count, 0));
        }
      }
    } else if constexpr (S == 1) {
      if (lane == 0 && w0) y[r0] = acc[0];
      if (lane == 0 && w1) y[r1] = acc[1];
    } else {
      // Two parities of partial sums: a step's writes never meet the previous step's reads.
      if (lane == 0) {
        partial[step & 1][0][warp] = acc[0];
        partial[step & 1][1][warp] = acc[1];
      }
      __syncthreads();
      if (part == 0 && lane < 2 && (lane == 0 ? w0 : w1)) {
        float sum = 0.f;
#pragma unroll
        for (int p = 0; p < S; ++p) sum += partial[step & 1][lane][slot * S + p];
        y[lane == 0 ? r0 : r1] = sum;
      }
    }
  }
}

// GGUF blocks -> split layout, one thread per block. Row r of src goes to row row0 + r, or with
// index pairs to row pairs[2 * r + 1].
template <WType T>
__global__ void RepackSplitKernel(const uint8_t* __restrict__ src, int64_t rows, int64_t cols,
                                  uint8_t* __restrict__ qs, uint16_t* __restrict__ scales,
                                  int64_t row0, const int64_t* __restrict__ pairs) {
  PdlStart();
  constexpr int QB = kSplitBlockBytes<T>;
  constexpr int kSrcBytes = QB + 2;
  const int64_t nblk = cols / 32;
  const int64_t total = rows * nblk;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / nblk, b = i % nblk;
    const int64_t to = pairs != nullptr ? pairs[2 * r + 1] : row0 + r;
    const uint16_t* in = reinterpret_cast<const uint16_t*>(src + i * kSrcBytes);
    scales[to * nblk + b] = in[0];
    uint32_t* out = reinterpret_cast<uint32_t*>(qs + to * nblk * QB + b * QB);
#pragma unroll
    for (int k = 0; k < QB / 4; ++k) {
      out[k] = static_cast<uint32_t>(in[1 + 2 * k]) | (static_cast<uint32_t>(in[2 + 2 * k]) << 16);
    }
  }
}

}  // namespace

namespace {

cudaError_t LaunchRepackSplit(const DeviceMatrix& src, const DeviceMatrix& dst, int64_t row0,
                              const int64_t* pairs, cudaStream_t stream) {
  const int64_t total = src.rows * (src.cols / 32);
  if (total <= 0) return cudaSuccess;
  auto* qs = static_cast<uint8_t*>(const_cast<void*>(dst.data));
  auto* sc = static_cast<uint16_t*>(const_cast<void*>(dst.scales));
  const auto* in = static_cast<const uint8_t*>(src.data);
  if (src.type == WType::kQ8_0) {
    return Launch(RepackSplitKernel<WType::kQ8_0>, GridFor(total, 256), 256, 0, stream, in,
                  src.rows, src.cols, qs, sc, row0, pairs);
  }
  return Launch(RepackSplitKernel<WType::kQ4_0>, GridFor(total, 256), 256, 0, stream, in, src.rows,
                src.cols, qs, sc, row0, pairs);
}

bool RepackShapesFit(const DeviceMatrix& src, const DeviceMatrix& dst) {
  return (src.type == WType::kQ8_0 || src.type == WType::kQ4_0) && src.type == dst.type &&
         src.cols == dst.cols && src.cols % 32 == 0 && !src.split() && dst.split() &&
         reinterpret_cast<uintptr_t>(dst.data) % 16 == 0;
}

}  // namespace

cudaError_t RepackSplit(const DeviceMatrix& src, const DeviceMatrix& dst, int64_t row0,
                        cudaStream_t stream) {
  if (!RepackShapesFit(src, dst) || row0 < 0 || row0 + src.rows > dst.rows) {
    return cudaErrorInvalidValue;
  }
  return LaunchRepackSplit(src, dst, row0, nullptr, stream);
}

cudaError_t RepackSplitRows(const DeviceMatrix& src, const DeviceMatrix& dst, const int64_t* pairs,
                            cudaStream_t stream) {
  if (!RepackShapesFit(src, dst) || pairs == nullptr) return cudaErrorInvalidValue;
  return LaunchRepackSplit(src, dst, 0, pairs, stream);
}

size_t QxBytes(int64_t cols) { return QxRegionBytes(cols); }

namespace {

// The wave-balanced launch shape of the int8 product (g_qx_balanced): the configured shape, or
// the same rows a warp with half or a quarter of the warps a block, whichever comes first whose
// busiest SM streams at most 1/0.85 of the average rows (the most balanced one if none does).
void QxBalancedShape(int n_rows, int* warps, int* rows_per_warp) {
  const int sms = SmCount();
  const double avg = static_cast<double>(n_rows) / sms;
  double best = -1;
  int best_warps = *warps;
  for (int w = *warps; w >= 4; w /= 2) {
    const int rpb = w * *rows_per_warp;
    const int blocks = (n_rows + rpb - 1) / rpb;
    const double balance = avg / (static_cast<double>((blocks + sms - 1) / sms) * rpb);
    if (balance > best + 1e-9) {
      best = balance;
      best_warps = w;
      if (balance >= 0.85) break;
    }
  }
  *warps = best_warps;
}

// Whether MatVecLaunch takes MatVecQxRegsKernel for a split matrix of kb blocks a lane.
bool QxRegsFits(const DeviceMatrix& w, int64_t kb, int max_kb, size_t qx_smem) {
  return w.split() && g_q8x && g_qx_regs && !g_prefetch && w.cols % 32 == 0 && kb <= max_kb &&
         qx_smem <= 48 * 1024;
}

// One launch of the matrix-vector kernels for nt <= kMaxTok tokens.
template <WType T>
cudaError_t MatVecLaunch(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                         const int32_t* dev_count, const float* xt, int nt, float* yt, int ldy,
                         cudaStream_t stream, const int8_t* qx, const NormIn* norm = nullptr,
                         const RopeOut* rope = nullptr, const GatedOut* gated = nullptr) {
  const auto* base = static_cast<const uint8_t*>(w.data);
  constexpr bool quant = T == WType::kQ8_0 || T == WType::kQ4_0;
  if constexpr (quant) {
    const size_t qx_smem =
        qx != nullptr ? 0 : static_cast<size_t>(w.cols) + static_cast<size_t>(w.cols / 32) * 8;
    // x in registers: the fewest parts a row (1, 2 or 4) whose blocks fit five a lane (Q8_0,
    // whose weight blocks take twice the registers: four, as five spill).
    constexpr int kMaxKb = T == WType::kQ8_0 ? 4 : 5;
    const int64_t nblk = w.cols / 32;
    int parts = 1;
    while (parts < 4 && (nblk + parts - 1) / parts > kMaxKb * kWarp) parts *= 2;
    const int64_t kb = ((nblk + parts - 1) / parts + kWarp - 1) / kWarp;
    if (QxRegsFits(w, kb, kMaxKb, qx_smem) && (norm == nullptr || (nt == 1 && parts == 1))) {
      const auto* sc = static_cast<const uint16_t*>(w.scales);
      const bool exact = nblk == parts * kb * kWarp;
      auto pick_kb = [&](auto parts_c, auto exact_c, auto norm_c, auto out_c) {
        constexpr int P = decltype(parts_c)::value;
        constexpr bool E = decltype(exact_c)::value, N = decltype(norm_c)::value;
        constexpr int R = decltype(out_c)::value;
        return kb == 1                  ? MatVecQxRegsKernel<T, 1, P, E, N, R>
               : kb == 2                ? MatVecQxRegsKernel<T, 2, P, E, N, R>
               : kb == 3                ? MatVecQxRegsKernel<T, 3, P, E, N, R>
               : kb == 4 || kMaxKb == 4 ? MatVecQxRegsKernel<T, 4, P, E, N, R>
                                        : MatVecQxRegsKernel<T, kMaxKb, P, E, N, R>;
      };
      auto pick = [&](auto parts_c, auto norm_c, auto out_c) {
        return exact ? pick_kb(parts_c, std::true_type(), norm_c, out_c)
                     : pick_kb(parts_c, std::false_type(), norm_c, out_c);
      };
      using One = std::integral_constant<int, 1>;
      using No = std::false_type;
      using Yes = std::true_type;
      using Rows = std::integral_constant<int, kOutRows>;
      // (The norm's product is one part a row: NormMatVecFits; the pairs come with the norm.)
      auto kernel = rope != nullptr ? pick(One(), Yes(), std::integral_constant<int, kOutRope>())
                    : gated != nullptr
                        ? pick(One(), Yes(), std::integral_constant<int, kOutGated>())
                    : norm != nullptr ? pick(One(), Yes(), Rows())
                    : parts == 1      ? pick(One(), No(), Rows())
                    : parts == 2      ? pick(std::integral_constant<int, 2>(), No(), Rows())
                                      : pick(std::integral_constant<int, 4>(), No(), Rows());
      const int slots = kQxRegWarps / parts;
      // As many blocks as stay resident (each warp strides over the rows), fewer for short
      // matrices.
      static std::mutex mu;
      static std::map<std::pair<const void*, size_t>, int> resident;
      int capacity = 0;
      {
        std::lock_guard<std::mutex> lock(mu);
        const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), qx_smem);
        auto it = resident.find(key);
        if (it == resident.end()) {
          int per_sm = 0;
          cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
              &per_sm, kernel, kQxRegWarps * kWarp, qx_smem);
          if (e != cudaSuccess) return e;
          it = resident.emplace(key, std::max(1, per_sm) * SmCount()).first;
        }
        capacity = it->second;
      }
      // A step of a slot takes two rows (one pair of RoPE's, one neuron's gate and up).
      const int per_step = rope != nullptr || gated != nullptr ? slots : 2 * slots;
      int blocks = std::max(1, std::min(capacity, (n_rows + per_step - 1) / per_step));
      if (gated != nullptr) {
        // Whole groups of 32 neurons a block, as evenly as the groups allow.
        const int groups = n_rows / 32;
        const int rounds = (groups + capacity - 1) / capacity;
        blocks = (groups + rounds - 1) / rounds;
      }
      // A norm's product whose grid takes every resident slot becomes resident only as its
      // predecessor's blocks leave, so its last blocks start after the release. Their first rows,
      // loaded on arrival, then sit in the memory system's queues ahead of every block's loads of
      // x and the residual, which the norm waits on. So the last quarter loads x first
      // (docs/benchmarks.md, run 30: the q/k/v product after the down product, 0.5-2.3%; the
      // gate/up product's grid leaves slots free, so its blocks are resident early).
      const int x_first_from =
          norm != nullptr && g_late_x_first && blocks == capacity ? blocks - blocks / 4 : blocks;
      for (int t = 0; t < nt; ++t) {
        cudaError_t e =
            Launch(kernel, blocks, kQxRegWarps * kWarp, qx_smem, stream, base, sc, w.cols, rows,
                   n_rows, dev_count, xt + t * w.cols, yt + static_cast<int64_t>(t) * ldy,
                   qx != nullptr ? qx + QxRegionBytes(w.cols) * t : nullptr,
                   g_qx_early && rows == nullptr && dev_count == nullptr, g_qx_pipe, x_first_from,
                   norm != nullptr ? *norm : NormIn{}, rope != nullptr ? *rope : RopeOut{},
                   gated != nullptr ? *gated : GatedOut{});
        if (e != cudaSuccess) return e;
      }
      return cudaSuccess;
    }
    if (norm != nullptr || rope != nullptr || gated != nullptr) return cudaErrorNotSupported;
    if (w.split() && g_q8x && qx_smem <= 48 * 1024) {
      // One launch per token (the batches here are at most kMaxTok tokens).
      const auto* sc = static_cast<const uint16_t*>(w.scales);
      int r = g_qx_rows, warps = g_qx_warps;
      if (r == 0) {
        r = 4;
        while (r > 1 && (n_rows + r * warps - 1) / (r * warps) < 4 * SmCount()) r /= 2;
      }
      if (g_qx_balanced) QxBalancedShape(n_rows, &warps, &r);
      const int rows_per_block = r * warps;
      const int blocks = (n_rows + rows_per_block - 1) / rows_per_block;
      auto pick = [&](auto w) {
        constexpr int W = decltype(w)::value;
        return r == 1   ? MatVecSplitQ8xKernel<T, W, 1>
               : r == 2 ? MatVecSplitQ8xKernel<T, W, 2>
                        : MatVecSplitQ8xKernel<T, W, 4>;
      };
      auto kernel = warps == 4    ? pick(std::integral_constant<int, 4>())
                    : warps == 16 ? pick(std::integral_constant<int, 16>())
                                  : pick(std::integral_constant<int, 8>());
      for (int t = 0; t < nt; ++t) {
        cudaError_t e =
            Launch(kernel, blocks, warps * kWarp, qx_smem, stream, base, sc, w.cols, rows, n_rows,
                   dev_count, xt + t * w.cols, yt + static_cast<int64_t>(t) * ldy, g_prefetch,
                   qx != nullptr ? qx + QxRegionBytes(w.cols) * t : nullptr);
        if (e != cudaSuccess) return e;
      }
      return cudaSuccess;
    }
    if (w.split()) {
      const auto* sc = static_cast<const uint16_t*>(w.scales);
      const int rows_per_block = kSplitRows * kSplitWarps;
      const int blocks = (n_rows + rows_per_block - 1) / rows_per_block;
      if (nt == 1) {
        return Launch(MatVecSplitKernel<T, 1>, blocks, kSplitWarps * kWarp, 0, stream, base, sc,
                      w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy, g_prefetch);
      }
      return Launch(MatVecSplitKernel<T, kMaxTok>, blocks, kSplitWarps * kWarp, 0, stream, base, sc,
                    w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy, g_prefetch);
    }
    const bool stage = w.row_bytes() % 16 == 0 && w.row_bytes() <= kMaxStageBytes;
    // Four rows per block when four rows fit the shared-memory stage.
    if (stage && kQuantRows * w.row_bytes() <= kMaxStageBytes) {
      const int blocks = (n_rows + kQuantRows - 1) / kQuantRows;
      return Launch(MatVecQuantKernel<T>, blocks, kMvThreads, kQuantRows * w.row_bytes(), stream,
                    base, w.row_bytes(), w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy);
    }
    const size_t smem = stage ? w.row_bytes() : 0;
    if (nt == 1) {
      return Launch(MatVecRowsKernel<T, 1>, n_rows, kMvThreads, smem, stream, base, w.row_bytes(),
                    w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy, stage, g_prefetch);
    }
    return Launch(MatVecRowsKernel<T, kMaxTok>, n_rows, kMvThreads, smem, stream, base,
                  w.row_bytes(), w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy, stage,
                  g_prefetch);
  } else {
    // One warp per row for tall matrices when asked for (see MatVecWarpKernel), and always for
    // short rows: a block of kMvThreads would leave most of its threads idle on a row a warp
    // covers in two loads a lane (a predictor's fc2, [ffn, rank]: 20 us against about 3 for
    // 13824 x 256 F16 on the H200).
    if (n_rows >= g_warp_rows_min || w.cols / Unit<T>::kElems <= 2 * kWarp) {
      const int blocks = (n_rows + kRowWarps - 1) / kRowWarps;
      if (nt == 1) {
        return Launch(MatVecWarpKernel<T, 1>, blocks, kRowWarps * kWarp, 0, stream, base,
                      w.row_bytes(), w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy);
      }
      return Launch(MatVecWarpKernel<T, kMaxTok>, blocks, kRowWarps * kWarp, 0, stream, base,
                    w.row_bytes(), w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy);
    }
    const bool no_stage = false;
    if (nt == 1) {
      return Launch(MatVecRowsKernel<T, 1>, n_rows, kMvThreads, 0, stream, base, w.row_bytes(),
                    w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy, no_stage, g_prefetch);
    }
    return Launch(MatVecRowsKernel<T, kMaxTok>, n_rows, kMvThreads, 0, stream, base, w.row_bytes(),
                  w.cols, rows, n_rows, dev_count, xt, nt, yt, ldy, no_stage, g_prefetch);
  }
}

}  // namespace

cudaError_t MatVecRows(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                       const int32_t* dev_count, const float* x, int n, float* y, int ldy,
                       cudaStream_t stream, const void* x_qx) {
  if (n_rows <= 0 || n <= 0) return cudaSuccess;
  cudaError_t e = CheckMatrixShape(w);
  if (e != cudaSuccess) return e;
  if (IsKQuant(w.type)) return MatVecRowsK(w, rows, n_rows, dev_count, x, n, y, ldy, stream, x_qx);
  for (int t0 = 0; t0 < n; t0 += kMaxTok) {
    const int nt = n - t0 < kMaxTok ? n - t0 : kMaxTok;
    const float* xt = x + static_cast<int64_t>(t0) * w.cols;
    float* yt = y + static_cast<int64_t>(t0) * ldy;
    const int8_t* qt = x_qx != nullptr ? static_cast<const int8_t*>(x_qx) +
                                             QxRegionBytes(w.cols) * static_cast<size_t>(t0)
                                       : nullptr;
    switch (w.type) {
      case WType::kF32:
        e = MatVecLaunch<WType::kF32>(w, rows, n_rows, dev_count, xt, nt, yt, ldy, stream, qt);
        break;
      case WType::kF16:
        e = MatVecLaunch<WType::kF16>(w, rows, n_rows, dev_count, xt, nt, yt, ldy, stream, qt);
        break;
      case WType::kBF16:
        e = MatVecLaunch<WType::kBF16>(w, rows, n_rows, dev_count, xt, nt, yt, ldy, stream, qt);
        break;
      case WType::kQ8_0:
        e = MatVecLaunch<WType::kQ8_0>(w, rows, n_rows, dev_count, xt, nt, yt, ldy, stream, qt);
        break;
      case WType::kQ4_0:
        e = MatVecLaunch<WType::kQ4_0>(w, rows, n_rows, dev_count, xt, nt, yt, ldy, stream, qt);
        break;
      default:
        return cudaErrorInvalidValue;
    }
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

bool NormMatVecFits(const DeviceMatrix& w) {
  // The norm keeps kNormChunks chunks of eight a thread in registers.
  if (!g_fused_norm || w.cols % 32 != 0 || w.cols > kNormChunks * 8 * kQxRegWarps * kWarp) {
    return false;
  }
  // As MatVecLaunch decides, with x quantized into shared memory by the product.
  const int max_kb = w.type == WType::kQ8_0 ? 4 : 5;
  const int64_t nblk = w.cols / 32;
  const size_t own = static_cast<size_t>(w.cols) + static_cast<size_t>(nblk) * 8;
  const int64_t kb = (nblk + kWarp - 1) / kWarp;  // one part a row
  return (w.type == WType::kQ4_0 || w.type == WType::kQ8_0) && QxRegsFits(w, kb, max_kb, own);
}

namespace {
// NormIn's pointers as the fused-norm products need them: x and the weight given, every pointer
// 16-byte aligned, x_out aliasing none of the inputs.
bool NormArgsValid(const float* x, const float* d1, const float* d2, const float* weight,
                   const float* x_out) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return x != nullptr && weight != nullptr && aligned(x) && aligned(d1) && aligned(d2) &&
         aligned(weight) && aligned(x_out) &&
         (x_out == nullptr || (x_out != x && x_out != d1 && x_out != d2));
}
}  // namespace

cudaError_t NormMatVec(const DeviceMatrix& w, const float* x, const float* d1, const float* d2,
                       const float* weight, float eps, float* x_out, float* y,
                       cudaStream_t stream) {
  if (!NormMatVecFits(w)) return cudaErrorNotSupported;
  if (!NormArgsValid(x, d1, d2, weight, x_out)) return cudaErrorInvalidValue;
  if (w.rows <= 0) return cudaSuccess;
  const NormIn norm{x, d1, d2, weight, eps, x_out};
  const int n_rows = static_cast<int>(w.rows);
  return w.type == WType::kQ4_0 ? MatVecLaunch<WType::kQ4_0>(w, nullptr, n_rows, nullptr, x, 1, y,
                                                             n_rows, stream, nullptr, &norm)
                                : MatVecLaunch<WType::kQ8_0>(w, nullptr, n_rows, nullptr, x, 1, y,
                                                             n_rows, stream, nullptr, &norm);
}

cudaError_t NormMatVecRope(const DeviceMatrix& w, const float* x, const float* d1, const float* d2,
                           const float* weight, float eps, float* x_out, const RopeOut& rope,
                           cudaStream_t stream) {
  if (!g_rope_product || !NormMatVecFits(w)) return cudaErrorNotSupported;
  if (!NormArgsValid(x, d1, d2, weight, x_out)) return cudaErrorInvalidValue;
  if (rope.n_heads <= 0 || rope.n_kv_heads <= 0 || rope.head_dim <= 0 || rope.head_dim % 2 != 0 ||
      w.rows != static_cast<int64_t>(rope.n_heads + 2 * rope.n_kv_heads) * rope.head_dim ||
      rope.positions == nullptr || rope.cos_sin == nullptr || rope.q == nullptr ||
      rope.k_cache == nullptr || rope.v_cache == nullptr) {
    return cudaErrorInvalidValue;
  }
  const NormIn norm{x, d1, d2, weight, eps, x_out};
  const int pairs = static_cast<int>(w.rows / 2);
  return w.type == WType::kQ4_0
             ? MatVecLaunch<WType::kQ4_0>(w, nullptr, pairs, nullptr, x, 1, nullptr, pairs, stream,
                                          nullptr, &norm, &rope)
             : MatVecLaunch<WType::kQ8_0>(w, nullptr, pairs, nullptr, x, 1, nullptr, pairs, stream,
                                          nullptr, &norm, &rope);
}

cudaError_t NormMatVecGated(const DeviceMatrix& w, const float* x, const float* d1, const float* d2,
                            const float* weight, float eps, float* x_out, ActKind act, float* out,
                            void* out_qx, cudaStream_t stream) {
  if (!g_gated_product || !NormMatVecFits(w)) return cudaErrorNotSupported;
  if (!NormArgsValid(x, d1, d2, weight, x_out)) return cudaErrorInvalidValue;
  if (w.rows <= 0 || w.rows % 64 != 0 || out == nullptr || out_qx == nullptr) {
    return cudaErrorInvalidValue;
  }
  const NormIn norm{x, d1, d2, weight, eps, x_out};
  GatedOut gated;
  gated.act = act;
  gated.out = out;
  gated.qx = out_qx;
  const int ffn = static_cast<int>(w.rows / 2);
  return w.type == WType::kQ4_0
             ? MatVecLaunch<WType::kQ4_0>(w, nullptr, ffn, nullptr, x, 1, nullptr, ffn, stream,
                                          nullptr, &norm, nullptr, &gated)
             : MatVecLaunch<WType::kQ8_0>(w, nullptr, ffn, nullptr, x, 1, nullptr, ffn, stream,
                                          nullptr, &norm, nullptr, &gated);
}

}  // namespace cuda
}  // namespace pinfer
