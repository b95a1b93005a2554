// Attention over the KV cache: the block-per-(head, token) kernel with scores in shared memory,
// and the online-softmax kernel with every key's loads in flight (g_attn_online), with their
// launches (Attention, AttentionAt, MaxAttentionContext). A sliding window (Mistral) only moves
// the first key a query sees: keys lo..pos with lo = max(0, pos - window + 1).
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

// ---------------------------------------------------------------------------------------------
// Attention: one block per (head, token). Scores for every visible key live in shared memory;
// warps take keys in turn (a warp-wide dot product each), then the block takes the softmax and
// the weighted sum of values, with thread groups splitting the keys.

constexpr int kAttnThreads = 256;
constexpr int kAttnMaxSmemBytes = 200 * 1024;

__global__ void AttentionKernel(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, int pos0,
                                const int32_t* __restrict__ positions, int n_heads, int n_kv_heads,
                                int head_dim, int window, float* __restrict__ out, void* out_qx) {
  PdlStart();
  extern __shared__ float smem[];
  const int h = blockIdx.x, t = blockIdx.y;
  // With positions (device memory) the step is position-independent, so it can be replayed
  // from a CUDA graph.
  const int pos = (positions != nullptr ? positions[0] : pos0) + t;
  // keys lo..pos; scores[i] belongs to key lo + i
  const int lo = window > 0 ? max(0, pos - window + 1) : 0, len = pos + 1 - lo;
  k += static_cast<int64_t>(lo) * n_kv_heads * head_dim;
  v += static_cast<int64_t>(lo) * n_kv_heads * head_dim;
  const int kv_stride = n_kv_heads * head_dim;
  const int kvh = h / (n_heads / n_kv_heads);
  float* qs = smem;                    // [head_dim]
  float* red = qs + head_dim;          // [kAttnThreads] reductions, value partial sums
  float* scores = red + kAttnThreads;  // [len]
  const float* qh = q + (static_cast<int64_t>(t) * n_heads + h) * head_dim;
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) qs[i] = qh[i];
  __syncthreads();

  const float scale = 1.f / sqrtf(static_cast<float>(head_dim));
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int n_warps = blockDim.x / kWarp;
  float local_max = -INFINITY;
  for (int p = warp; p < len; p += n_warps) {
    const float* kp = k + static_cast<int64_t>(p) * kv_stride + kvh * head_dim;
    float dot = 0.f;
    for (int i = lane; i < head_dim; i += kWarp) dot += qs[i] * kp[i];
    dot = WarpSum(dot) * scale;
    if (lane == 0) scores[p] = dot;
    local_max = fmaxf(local_max, dot);
  }
  local_max = WarpMax(local_max);
  if (lane == 0) red[warp] = local_max;
  __syncthreads();
  float mx = -INFINITY;
  for (int w = 0; w < n_warps; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();

  float local_sum = 0.f;
  for (int p = threadIdx.x; p < len; p += blockDim.x) {
    const float e = expf(scores[p] - mx);
    scores[p] = e;
    local_sum += e;
  }
  local_sum = WarpSum(local_sum);
  if (lane == 0) red[warp] = local_sum;
  __syncthreads();
  float sum = 0.f;
  for (int w = 0; w < n_warps; ++w) sum += red[w];
  const float inv = 1.f / sum;
  __syncthreads();

  // groups of head_dim threads split the keys; their partial sums meet in `red`.
  const int groups = max(1, static_cast<int>(blockDim.x) / head_dim);
  const int g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
  float acc = 0.f;
  if (g < groups) {
    for (int p = g; p < len; p += groups) {
      acc += scores[p] * v[static_cast<int64_t>(p) * kv_stride + kvh * head_dim + d];
    }
    red[threadIdx.x] = acc;
  }
  __syncthreads();
  if (g == 0) {
    float total = 0.f;
    for (int gg = 0; gg < groups; ++gg) total += red[gg * head_dim + d];
    out[(static_cast<int64_t>(t) * n_heads + h) * head_dim + d] = total * inv;
    // (head_dim a multiple of 32 with out_qx: whole warps hold blocks of 32 outputs)
    if (out_qx != nullptr) {
      QuantizeBlockInWarp(total * inv, lane, (h * head_dim + d) / 32,
                          QxAt(out_qx, n_heads * head_dim, t));
    }
  }
}

// Attention with every key's K and V rows in flight at once (g_attn_online): AttentionKernel's
// warps each wait on memory once per key for the scores and the value loop waits again (a
// decode step's keys come from DRAM: the 13B shape's KV cache is 80 MB at 48 positions), and
// taking the attention and RoPE kernels out of the whole Q4_0 decode step made it 0.44 ms (15%)
// shorter on the H200 (the ablation of commit 1c3c56a). Here one block per (head, token)
// again, a lane holds V = head_dim / 32 of the head's dimensions, and each warp takes keys
// warp, warp + 8, ... in batches of kAttnBatch whose K and V loads are all issued before the
// first is used; a warp keeps an online softmax (running max, sum and weighted values) over its
// keys, and the eight warps' states are merged at the end. Same values as the reference up to
// rounding (the exponentials are taken against running maxima instead of the final one).
constexpr int kAttnBatch = 8;
template <int V>
__device__ __forceinline__ void LoadHeadSlice(const float* p, float (&r)[V]) {
  if constexpr (V == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    r[0] = a.x, r[1] = a.y, r[2] = a.z, r[3] = a.w;
  } else if constexpr (V == 2) {
    const float2 a = *reinterpret_cast<const float2*>(p);
    r[0] = a.x, r[1] = a.y;
  } else {
    r[0] = *p;
  }
}
// The online softmax's step for one key whose score the whole warp holds.
template <int V>
__device__ __forceinline__ void OnlineSoftmaxStep(float dot, const float (&vr)[V], float* m,
                                                  float* sum, float (&acc)[V]) {
  const float nm = fmaxf(*m, dot);
  const float c = expf(*m - nm), e = expf(dot - nm);
  *sum = *sum * c + e;
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = acc[i] * c + e * vr[i];
  *m = nm;
}
template <int V>
__global__ void __launch_bounds__(kAttnThreads, 1)
    AttentionOnlineKernel(const float* __restrict__ q, const float* __restrict__ k,
                          const float* __restrict__ v, int pos0,
                          const int32_t* __restrict__ positions, int n_heads, int n_kv_heads,
                          int window, float* __restrict__ out, void* out_qx, bool early,
                          bool trigger_after_wait) {
  constexpr int hd = V * kWarp;
  constexpr int kWarps = kAttnThreads / kWarp;
  __shared__ float warp_max[kWarps], warp_sum[kWarps];
  __shared__ float warp_acc[kWarps][hd];
  if (!trigger_after_wait) PdlTrigger();
  const int h = blockIdx.x, t = blockIdx.y;
  // The positions come from the forward call's upload, a copy that ran before any kernel of it.
  const int first = positions != nullptr ? positions[0] : pos0;
  const int pos = first + t;
  const int q_dim = n_heads * hd;
  const int64_t kv_stride = static_cast<int64_t>(n_kv_heads) * hd;
  const int group = n_heads / n_kv_heads, kvh = h / group;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const float scale = 1.f / sqrtf(static_cast<float>(hd));
  const float* kh = k + kvh * hd + lane * V;
  const float* vh = v + kvh * hd + lane * V;
  const int len = pos + 1, lo = window > 0 ? max(0, pos - window + 1) : 0;
  // Keys past the end re-read the last one (loads stay unpredicated) and are skipped below.
  float kr[kAttnBatch][V], vr[kAttnBatch][V];
  auto load_batch = [&](int p0, int end) {
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      const int64_t p = min(p0 + b * kWarps, end - 1);
      LoadHeadSlice<V>(kh + p * kv_stride, kr[b]);
      LoadHeadSlice<V>(vh + p * kv_stride, vr[b]);
    }
  };
  // Keys before the call's first position were written by earlier calls, which finished before
  // its upload: with `early` the first batch's loads of those go out before the wait, while the
  // RoPE kernel that writes this call's keys still runs, and only its own keys load after.
  const int old = early ? min(first, len) : 0;
  const bool loaded_early = old > lo;
  if (loaded_early) load_batch(lo + warp, old);
  PdlWait();
  // Released here rather than at the start, the output projection's blocks load their first rows
  // (most of the matrix) after the q/k/v product's memory traffic has drained, not into it. Off
  // by default: its gain did not hold on other H200 machines (docs/benchmarks.md, run 31).
  if (trigger_after_wait) PdlTrigger();
  float qv[V];
  LoadHeadSlice<V>(q + (static_cast<int64_t>(t) * n_heads + h) * hd + lane * V, qv);
#pragma unroll
  for (int i = 0; i < V; ++i) qv[i] *= scale;
  float m = -INFINITY, sum = 0.f, acc[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.f;
  for (int p0 = lo + warp; p0 < len; p0 += kWarps * kAttnBatch) {
    if (p0 != lo + warp || !loaded_early) {
      load_batch(p0, len);
    } else {
#pragma unroll
      for (int b = 0; b < kAttnBatch; ++b) {
        const int64_t p = p0 + b * kWarps;
        if (p >= old && p < len) {
          LoadHeadSlice<V>(kh + p * kv_stride, kr[b]);
          LoadHeadSlice<V>(vh + p * kv_stride, vr[b]);
        }
      }
    }
    float dot[kAttnBatch];
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      dot[b] = 0.f;
#pragma unroll
      for (int i = 0; i < V; ++i) dot[b] += qv[i] * kr[b][i];
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int b = 0; b < kAttnBatch; ++b) dot[b] += __shfl_xor_sync(0xffffffffu, dot[b], o);
    }
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      if (p0 + b * kWarps < len) OnlineSoftmaxStep<V>(dot[b], vr[b], &m, &sum, acc);  // warp-wide
    }
  }
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum[warp] = sum;
  }
#pragma unroll
  for (int i = 0; i < V; ++i) warp_acc[warp][lane * V + i] = acc[i];
  __syncthreads();
  if (threadIdx.x < hd) {
    // A warp that had no key holds m = -inf, sum = 0 and weighs exp(-inf) = 0.
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, warp_max[w]);
    float total = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = expf(warp_max[w] - mx);
      total += warp_sum[w] * f;
      o += warp_acc[w][threadIdx.x] * f;
    }
    const float y = o / total;
    out[(static_cast<int64_t>(t) * n_heads + h) * hd + threadIdx.x] = y;
    // Whole warps of the head's 32-aligned outputs quantize a block each for the int8 product.
    if (out_qx != nullptr) {
      QuantizeBlockInWarp(y, lane, (h * hd + threadIdx.x) / 32, QxAt(out_qx, q_dim, t));
    }
  }
}

}  // namespace

int MaxAttentionContext() { return (kAttnMaxSmemBytes / 4) - kAttnThreads - 256; }

namespace {
// AttentionOnlineKernel where it takes the head size; cudaErrorNotSupported otherwise.
cudaError_t LaunchOnlineAttention(const float* q, const float* k, const float* v, int n, int pos0,
                                  const int32_t* positions, int n_heads, int n_kv_heads,
                                  int head_dim, int window, float* out, void* out_qx,
                                  cudaStream_t stream) {
  if (!g_attn_online) return cudaErrorNotSupported;
  const dim3 grid(n_heads, n);
  switch (head_dim) {
    case 128:
      return Launch(AttentionOnlineKernel<4>, grid, kAttnThreads, 0, stream, q, k, v, pos0,
                    positions, n_heads, n_kv_heads, window, out, out_qx, g_attn_early,
                    g_attn_late_trigger);
    case 64:
      return Launch(AttentionOnlineKernel<2>, grid, kAttnThreads, 0, stream, q, k, v, pos0,
                    positions, n_heads, n_kv_heads, window, out, out_qx, g_attn_early,
                    g_attn_late_trigger);
    case 32:
      return Launch(AttentionOnlineKernel<1>, grid, kAttnThreads, 0, stream, q, k, v, pos0,
                    positions, n_heads, n_kv_heads, window, out, out_qx, g_attn_early,
                    g_attn_late_trigger);
    default:
      return cudaErrorNotSupported;
  }
}
}  // namespace

cudaError_t Attention(const float* q, const float* k, const float* v, int n, int pos0, int n_heads,
                      int n_kv_heads, int head_dim, int window, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (head_dim > kAttnThreads || head_dim <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
      pos0 < 0 || window < 0) {
    return cudaErrorInvalidValue;
  }
  const int len = pos0 + n;
  if (len > MaxAttentionContext()) return cudaErrorInvalidValue;
  const int32_t* no_positions = nullptr;
  void* no_qx = nullptr;
  if (cudaError_t e = LaunchOnlineAttention(q, k, v, n, pos0, no_positions, n_heads, n_kv_heads,
                                            head_dim, window, out, no_qx, stream);
      e != cudaErrorNotSupported) {
    return e;
  }
  const size_t smem = (static_cast<size_t>(head_dim) + kAttnThreads + len) * sizeof(float);
  if (smem > 48 * 1024) {
    // Above 48 KB a kernel needs an explicit opt-in (per device; cheap to repeat).
    cudaError_t e = cudaFuncSetAttribute(
        AttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmemBytes);
    if (e != cudaSuccess) return e;
  }
  return Launch(AttentionKernel, dim3(n_heads, n), kAttnThreads, smem, stream, q, k, v, pos0,
                no_positions, n_heads, n_kv_heads, head_dim, window, out, no_qx);
}

cudaError_t AttentionAt(const float* q, const float* k, const float* v, int n,
                        const int32_t* positions, int max_ctx, int n_heads, int n_kv_heads,
                        int head_dim, int window, float* out, cudaStream_t stream, void* out_qx) {
  if (n <= 0) return cudaSuccess;
  if (head_dim > kAttnThreads || head_dim <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
      window < 0 || max_ctx > MaxAttentionContext() || (out_qx != nullptr && head_dim % 32 != 0)) {
    return cudaErrorInvalidValue;
  }
  if (cudaError_t e = LaunchOnlineAttention(q, k, v, n, 0, positions, n_heads, n_kv_heads, head_dim,
                                            window, out, out_qx, stream);
      e != cudaErrorNotSupported) {
    return e;
  }
  const size_t smem = (static_cast<size_t>(head_dim) + kAttnThreads + max_ctx) * sizeof(float);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(
        AttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmemBytes);
    if (e != cudaSuccess) return e;
  }
  return Launch(AttentionKernel, dim3(n_heads, n), kAttnThreads, smem, stream, q, k, v, 0,
                positions, n_heads, n_kv_heads, head_dim, window, out, out_qx);
}

}  // namespace cuda
}  // namespace pinfer
