// The sparse FFN's kernels: the down projection summed over an active set of rows
// (AccumulateRows, ggml and split rows), the gather of active neurons' gated activation, the
// ordered compaction of the active set, and the cold exchange's device side (the wait on a host
// flag, the sum of the CPU's parts read over PCIe, the share of a count).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "gpu-worker/cuda/kernel_common.cuh"
#include "gpu-worker/cuda/kernels.h"

namespace pinfer {
namespace cuda {
namespace {

// The sparse down projection over a split matrix: as AccumulateRowsKernel's 16-byte path, a
// thread owns one block of columns and sums the block's values over its rows, four rows at a
// time.
template <WType T>
__global__ void __launch_bounds__(128)
    AccumulateRowsSplitKernel(const uint8_t* __restrict__ qs, const uint16_t* __restrict__ scales,
                              int64_t cols, const int32_t* __restrict__ rows, int n_rows,
                              const int32_t* __restrict__ dev_count, const float* __restrict__ a,
                              int lda, int rows_per_split, float* __restrict__ y) {
  PdlStart();
  constexpr int QB = kSplitBlockBytes<T>;
  constexpr int QV = QB / 16;
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  const int i0 = blockIdx.y * rows_per_split;
  if (i0 >= count) return;
  const int i1 = min(count, i0 + rows_per_split);
  const int t = blockIdx.z;
  const int nblk = static_cast<int>(cols / 32);
  const size_t qrb = static_cast<size_t>(nblk) * QB;
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= nblk) return;
  const float* at = a + static_cast<int64_t>(t) * lda;
  float acc[32];
#pragma unroll
  for (int e = 0; e < 32; ++e) acc[e] = 0.f;
  bool any = false;
  auto row_id = [&](int i) -> int64_t { return rows != nullptr ? rows[i] : i; };
  auto load = [&](int64_t r, uint4(&q)[QV], float& d) {
#pragma unroll
    for (int v = 0; v < QV; ++v) {
      q[v] = LoadStream(reinterpret_cast<const uint4*>(qs + r * qrb + static_cast<size_t>(u) * QB) +
                        v);
    }
    d = H2F(scales[r * nblk + u]);
  };
  auto add = [&](const uint4(&q)[QV], float cd) {
    float w[32];
    SplitBlockValues<T>(q, cd, w);
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] += w[e];
  };
  int i = i0;
  for (; i + 3 < i1; i += 4) {
    const float c0 = at[i], c1 = at[i + 1], c2 = at[i + 2], c3 = at[i + 3];
    if (c0 == 0.f && c1 == 0.f && c2 == 0.f && c3 == 0.f) continue;
    any = true;
    uint4 q0[QV], q1[QV], q2[QV], q3[QV];
    float d0, d1, d2, d3;
    load(row_id(i), q0, d0);
    load(row_id(i + 1), q1, d1);
    load(row_id(i + 2), q2, d2);
    load(row_id(i + 3), q3, d3);
    add(q0, c0 * d0);
    add(q1, c1 * d1);
    add(q2, c2 * d2);
    add(q3, c3 * d3);
  }
  for (; i < i1; ++i) {
    const float c0 = at[i];
    if (c0 == 0.f) continue;
    any = true;
    uint4 q0[QV];
    float d0;
    load(row_id(i), q0, d0);
    add(q0, c0 * d0);
  }
  if (!any) return;
  float* yt = y + static_cast<int64_t>(t) * cols + static_cast<int64_t>(u) * 32;
#pragma unroll
  for (int e = 0; e < 32; ++e) atomicAdd(yt + e, acc[e]);
}
// ---------------------------------------------------------------------------------------------
// Row accumulation (sparse down projection): threads own column units, blocks along y split the
// active rows, blockIdx.z is the token. Each block sums its rows in registers and adds its
// partial result to y with one atomic per column; row splits are sized so that there are a few
// blocks per multiprocessor and few atomics. Block formats stage each row's segment (the block's
// 128 quant blocks, 16-byte aligned when the row is) in shared memory, two rows at a time.

constexpr int kAccThreads = 128;

template <WType T>
__global__ void __launch_bounds__(kAccThreads)
    AccumulateRowsKernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t cols,
                         const int32_t* __restrict__ rows, int n_rows,
                         const int32_t* __restrict__ dev_count, const float* __restrict__ a,
                         int lda, int rows_per_split, float* __restrict__ y, bool stage) {
  PdlStart();
  extern __shared__ uint4 seg[];
  const int count = dev_count != nullptr ? *dev_count : n_rows;
  const int i0 = blockIdx.y * rows_per_split;
  if (i0 >= count) return;
  const int i1 = min(count, i0 + rows_per_split);
  const int t = blockIdx.z;
  constexpr int E = Unit<T>::kElems;
  const int64_t units = cols / E;
  const int64_t u = static_cast<int64_t>(blockIdx.x) * kAccThreads + threadIdx.x;
  const bool valid = u < units;
  const float* at = a + static_cast<int64_t>(t) * lda;
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  bool any = false;
  auto row_of = [&](int i) -> const uint8_t* {
    const int64_t r = rows != nullptr ? rows[i] : i;
    return w + static_cast<size_t>(r) * row_bytes;
  };

  if constexpr (kVec16<T>) {
    if (!valid) return;
    int i = i0;
    // Four rows per iteration: four loads in flight.
    for (; i + 3 < i1; i += 4) {
      const float c0 = at[i], c1 = at[i + 1], c2 = at[i + 2], c3 = at[i + 3];
      if (c0 == 0.f && c1 == 0.f && c2 == 0.f && c3 == 0.f) continue;
      any = true;
      float w0[E], w1[E], w2[E], w3[E];
      LoadUnit<T>(row_of(i), u, w0);
      LoadUnit<T>(row_of(i + 1), u, w1);
      LoadUnit<T>(row_of(i + 2), u, w2);
      LoadUnit<T>(row_of(i + 3), u, w3);
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] += c0 * w0[e] + c1 * w1[e] + c2 * w2[e] + c3 * w3[e];
    }
    for (; i < i1; ++i) {
      const float c0 = at[i];
      if (c0 == 0.f) continue;
      any = true;
      float w0[E];
      LoadUnit<T>(row_of(i), u, w0);
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] += c0 * w0[e];
    }
  } else if (!stage) {
    if (!valid) return;
    for (int i = i0; i < i1; ++i) {
      const float c0 = at[i];
      if (c0 == 0.f) continue;
      any = true;
      float w0[E];
      LoadUnit<T>(row_of(i), u, w0);
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] += c0 * w0[e];
    }
  } else {
    // Every thread takes part in the copies (so no early return); coefficients are the same for
    // the whole block, so the skips are uniform and the barriers are reached by all.
    constexpr int kUnitBytes = T == WType::kQ8_0 ? 34 : 18;
    const size_t seg_off = static_cast<size_t>(blockIdx.x) * kAccThreads * kUnitBytes;
    const size_t avail = min(static_cast<size_t>(kAccThreads) * kUnitBytes, row_bytes - seg_off);
    const int n16 = static_cast<int>(avail / 16);
    const int seg16 = kAccThreads * kUnitBytes / 16;
    for (int i = i0; i < i1; i += 2) {
      const float c0 = at[i];
      const float c1 = i + 1 < i1 ? at[i + 1] : 0.f;
      if (c0 == 0.f && c1 == 0.f) continue;
      const uint4* s0 = reinterpret_cast<const uint4*>(row_of(i) + seg_off);
      const uint4* s1 = reinterpret_cast<const uint4*>(row_of(i + 1 < i1 ? i + 1 : i) + seg_off);
      __syncthreads();  // the previous pair has been read
      for (int k = threadIdx.x; k < n16; k += kAccThreads) {
        seg[k] = LoadStream(s0 + k);
        if (c1 != 0.f) seg[seg16 + k] = LoadStream(s1 + k);
      }
      __syncthreads();
      if (valid) {
        any = true;
        const uint8_t* b0 = reinterpret_cast<const uint8_t*>(seg) + threadIdx.x * kUnitBytes;
        float w0[E];
        if constexpr (T == WType::kQ8_0)
          DequantQ8Block(b0, w0);
        else
          DequantQ4Block(b0, w0);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] += c0 * w0[e];
        if (c1 != 0.f) {
          if constexpr (T == WType::kQ8_0) {
            DequantQ8Block(b0 + seg16 * 16, w0);
          } else {
            DequantQ4Block(b0 + seg16 * 16, w0);
          }
#pragma unroll
          for (int e = 0; e < E; ++e) acc[e] += c1 * w0[e];
        }
      }
    }
    if (!valid) return;
  }
  if (!any) return;
  float* yt = y + static_cast<int64_t>(t) * cols + u * E;
#pragma unroll
  for (int e = 0; e < E; ++e) atomicAdd(yt + e, acc[e]);
}

__global__ void GatherGatedKernel(ActKind act, const float* __restrict__ gate, int ldg,
                                  const int32_t* __restrict__ idx, int n_idx,
                                  const int32_t* __restrict__ dev_count, float* __restrict__ up,
                                  int ld) {
  PdlStart();
  const int count = dev_count != nullptr ? *dev_count : n_idx;
  const int t = blockIdx.y;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    float* u = up + static_cast<int64_t>(t) * ld + i;
    *u = ApplyGated(act, gate[static_cast<int64_t>(t) * ldg + idx[i]], *u);
  }
}

__global__ void ShareOfCountKernel(const int32_t* count, const int32_t* num, int den,
                                   int32_t* out) {
  PdlStart();
  if (threadIdx.x == 0) *out = static_cast<int32_t>(static_cast<int64_t>(*count) * *num / den);
}

// One thread polls the flag over PCIe; the sleep keeps the bus quiet while the host works.
__global__ void WaitHostFlagKernel(volatile int32_t* flag, int32_t* value_out) {
  int32_t v;
  while ((v = *flag) == 0) __nanosleep(256);
  *flag = 0;
  if (value_out != nullptr) *value_out = v;
  __threadfence_system();
}

// Every part's load is issued before the first add (up to kPartsAtOnce), so a thread waits for
// one PCIe round trip per 16 parts, not one per part. __ldcv: the host rewrites these buffers
// every layer, so nothing may come from a cache.
// Loads of two or four floats, and blocks of 32 to 128 threads, were no faster on the H200: 16
// parts are 320 KB, ~6 us over PCIe at 55 GB/s in any shape, on top of the latency that one
// copied sum also pays (13-14 against 6.5-7.5 us a layer; docs/benchmarks.md, CUDA run 38).
constexpr int kPartsAtOnce = 16;

__global__ void SumPartsKernel(const float* __restrict__ parts, int64_t len,
                               const int32_t* __restrict__ count_dev, int count,
                               float* __restrict__ out) {
  PdlStart();
  const int n = count_dev != nullptr ? *count_dev : count;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < len;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int p0 = 0; p0 < n; p0 += kPartsAtOnce) {
      float v[kPartsAtOnce];
#pragma unroll
      for (int j = 0; j < kPartsAtOnce; ++j) {
        v[j] = p0 + j < n ? __ldcv(parts + (p0 + j) * len + i) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kPartsAtOnce; ++j) {
        if (p0 + j < n) s += v[j];
      }
    }
    out[i] = s;
  }
}

// ---------------------------------------------------------------------------------------------
// Ordered compaction in one block: each pass flags 1024 candidates, a block-wide prefix sum of
// the flags (warp ballots, then a scan of the 32 warp totals) gives each active one its slot.

constexpr int kCompactThreads = 1024;

__global__ void __launch_bounds__(kCompactThreads)
    CompactActiveKernel(const float* __restrict__ v, int n, int ldv,
                        const int32_t* __restrict__ map, int len, float threshold,
                        const float* __restrict__ scale, const float* __restrict__ shift,
                        bool mark_unshifted, int32_t* __restrict__ idx,
                        int32_t* __restrict__ count) {
  PdlStart();
  const float unshifted = threshold;
  if (shift != nullptr) threshold -= *shift;
  __shared__ int warp_totals[32];
  __shared__ int base;
  if (threadIdx.x == 0) base = 0;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int j0 = 0; j0 < len; j0 += kCompactThreads) {
    const int j = j0 + threadIdx.x;
    bool active = false, above = false;  // above: also over the unshifted threshold
    if (j < len) {
      const int g = map != nullptr ? map[j] : j;  // < 0: a map entry that serves nobody
      for (int t = 0; t < n && !(active && (above || !mark_unshifted)) && g >= 0; ++t) {
        const float s = v[static_cast<int64_t>(t) * ldv + g];
        const float x = scale != nullptr ? s * scale[t] : s;
        active = active || x > threshold;
        above = above || x > unshifted;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, active);
    if (lane == 0) warp_totals[warp] = __popc(ballot);
    __syncthreads();
    if (warp == 0) {
      int total = warp_totals[lane];
      int incl = total;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += other;
      }
      warp_totals[lane] = incl - total;  // exclusive prefix
    }
    __syncthreads();
    if (active) {
      const int slot = base + warp_totals[warp] + __popc(ballot & ((1u << lane) - 1u));
      idx[slot] =
          mark_unshifted && above ? static_cast<int32_t>(static_cast<uint32_t>(j) | kAboveBit) : j;
    }
    __syncthreads();
    if (threadIdx.x == kCompactThreads - 1) {
      base += warp_totals[warp] + __popc(ballot);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *count = base;
}

}  // namespace

cudaError_t AccumulateRows(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                           const int32_t* dev_count, const float* a, int lda, int n, float* y,
                           cudaStream_t stream) {
  if (n_rows <= 0 || n <= 0) return cudaSuccess;
  cudaError_t e = CheckMatrixShape(w);
  if (e != cudaSuccess) return e;
  if (n > 65535) return cudaErrorInvalidValue;
  if (IsKQuant(w.type)) return AccumulateRowsK(w, rows, n_rows, dev_count, a, lda, n, y, stream);
  const auto* base = static_cast<const uint8_t*>(w.data);
  int64_t elems = 8;
  if (w.type == WType::kF32) elems = 4;
  if (w.type == WType::kQ8_0 || w.type == WType::kQ4_0) elems = 32;
  const int64_t units = w.cols / elems;
  const int col_blocks = static_cast<int>((units + kAccThreads - 1) / kAccThreads);
  // About 8 blocks per multiprocessor for the token, and at least 16 rows per block so that the
  // atomics stay a small fraction of the traffic.
  const int target = 8 * SmCount();
  int splits = target / col_blocks;
  if (splits < 1) splits = 1;
  int rows_per_split = (n_rows + splits - 1) / splits;
  if (rows_per_split < 16) rows_per_split = 16;
  splits = (n_rows + rows_per_split - 1) / rows_per_split;
  if (splits > 65535) {
    splits = 65535;
    rows_per_split = (n_rows + splits - 1) / splits;
  }
  const dim3 grid(col_blocks, splits, n);
  if (w.split()) {
    const auto* sc = static_cast<const uint16_t*>(w.scales);
    if (w.type == WType::kQ8_0) {
      return Launch(AccumulateRowsSplitKernel<WType::kQ8_0>, grid, kAccThreads, 0, stream, base, sc,
                    w.cols, rows, n_rows, dev_count, a, lda, rows_per_split, y);
    }
    return Launch(AccumulateRowsSplitKernel<WType::kQ4_0>, grid, kAccThreads, 0, stream, base, sc,
                  w.cols, rows, n_rows, dev_count, a, lda, rows_per_split, y);
  }
  const bool quant = w.type == WType::kQ8_0 || w.type == WType::kQ4_0;
  const bool stage = quant && w.row_bytes() % 16 == 0;
  const size_t smem = stage ? 2 * kAccThreads * (w.type == WType::kQ8_0 ? 34 : 18) : 0;
  switch (w.type) {
#define PINFER_LAUNCH(T)                                                                         \
  case T:                                                                                        \
    return Launch(AccumulateRowsKernel<T>, grid, kAccThreads, smem, stream, base, w.row_bytes(), \
                  w.cols, rows, n_rows, dev_count, a, lda, rows_per_split, y, stage);
    PINFER_LAUNCH(WType::kF32)
    PINFER_LAUNCH(WType::kF16)
    PINFER_LAUNCH(WType::kBF16)
    PINFER_LAUNCH(WType::kQ8_0)
    PINFER_LAUNCH(WType::kQ4_0)
#undef PINFER_LAUNCH
    default:
      break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t GatherGatedActivation(ActKind act, const float* gate, int ldg, const int32_t* idx,
                                  int n_idx, const int32_t* dev_count, float* up, int ld, int n,
                                  cudaStream_t stream) {
  if (n_idx <= 0 || n <= 0) return cudaSuccess;
  if (n > 65535) return cudaErrorInvalidValue;
  return Launch(GatherGatedKernel, dim3(GridFor(n_idx, 256), n), 256, 0, stream, act, gate, ldg,
                idx, n_idx, dev_count, up, ld);
}

cudaError_t ShareOfCount(const int32_t* count, const int32_t* num, int den, int32_t* out,
                         cudaStream_t stream) {
  return Launch(ShareOfCountKernel, 1, 32, 0, stream, count, num, den, out);
}

cudaError_t WaitHostFlag(int32_t* flag, cudaStream_t stream, int32_t* value_out) {
  if (flag == nullptr) return cudaErrorInvalidValue;
  return Launch(WaitHostFlagKernel, 1, 1, 0, stream, flag, value_out);
}

cudaError_t SumParts(const float* parts, int64_t len, const int32_t* count_dev, int count,
                     float* out, cudaStream_t stream) {
  if (parts == nullptr || out == nullptr || len < 0 || (count_dev == nullptr && count < 1)) {
    return cudaErrorInvalidValue;
  }
  if (len == 0) return cudaSuccess;
  return Launch(SumPartsKernel, GridFor(len, 256), 256, 0, stream, parts, len, count_dev, count,
                out);
}

cudaError_t CompactActive(const float* v, int n, int ldv, const int32_t* map, int len,
                          float threshold, int32_t* idx, int32_t* count, cudaStream_t stream,
                          const float* scale, const float* threshold_shift, bool mark_unshifted) {
  return Launch(CompactActiveKernel, 1, kCompactThreads, 0, stream, v, n, ldv, map, len, threshold,
                scale, threshold_shift, mark_unshifted, idx, count);
}

}  // namespace cuda
}  // namespace pinfer
