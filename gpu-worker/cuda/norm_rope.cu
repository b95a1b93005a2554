// RMSNorm (alone or after a residual add) and RoPE (in place, into the KV cache, or as a table of
// cosines and sines): the per-token kernels of a layer outside its products. Their device helpers
// are in norm_rope.cuh, shared with the products that fold a norm or RoPE in.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "gpu-worker/cuda/kernel_common.cuh"
#include "gpu-worker/cuda/norm_rope.cuh"
#include "gpu-worker/cuda/kernels.h"

namespace pinfer {
namespace cuda {
namespace {

// Rows of up to kNormRegs * blockDim elements stay in registers: all of a thread's loads are
// issued before its first store and x is read once, so a block waits on memory about twice. A
// loop that loads, adds and stores element by element (out may alias d1, so the compiler keeps
// that order) waited once per element and pass: 8.5 us for one 5120-wide row with the Q8_0
// output on the H200 (Nsight Compute, commit 8cdb0e9). Longer rows loop; both
// paths compute the same values in the same order.

// One block per token: x (+= d1 (+ d2) with kResidual, written back) normalized into out, and
// optionally each token's rms.
template <bool kResidual>
__global__ void __launch_bounds__(1024)
    NormKernel(float* x, const float* d1, const float* d2, const float* __restrict__ weight,
               int dim, float eps, float* out, void* qx, float* __restrict__ rms_out,
               int max_regs) {
  PdlTrigger();
  // Each thread reads its elements of d1/d2 before writing the same elements of out, so out may
  // alias them.
  const int64_t row = static_cast<int64_t>(blockIdx.x) * dim;
  float* xt = x + row;
  const float* a = kResidual ? d1 + row : nullptr;
  const float* b = kResidual && d2 != nullptr ? d2 + row : nullptr;
  float* ot = out + row;
  const int B = blockDim.x;
  QxParts parts_storage;
  const QxParts* parts = nullptr;
  if (qx != nullptr) {
    parts_storage = QxAt(qx, dim, blockIdx.x);
    parts = &parts_storage;
  }
  auto input = [&](int i) {
    return !kResidual ? xt[i] : b != nullptr ? xt[i] + (a[i] + b[i]) : xt[i] + a[i];
  };
  float ss = 0.f, rms;
  if (dim <= max_regs * B) {
    // The weights never change: they load while the predecessor finishes.
    float v[kNormRegs], w[kNormRegs];
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k) {
      const int i = threadIdx.x + k * B;
      if (i < dim) w[k] = weight[i];
    }
    PdlWait();
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k) {
      const int i = threadIdx.x + k * B;
      if (i < dim) v[k] = input(i);
    }
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k) {
      const int i = threadIdx.x + k * B;
      if (i < dim) {
        if (kResidual) xt[i] = v[k];
        ss += v[k] * v[k];
      }
    }
    rms = sqrtf(BlockSum(ss) / dim + eps);
    const float scale = 1.f / rms;
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k) {
      const int i = threadIdx.x + k * B;
      if (i < dim) PutNormed(v[k], scale, w[k], i, ot, parts);
    }
  } else {
    PdlWait();
    for (int i = threadIdx.x; i < dim; i += B) {
      const float v = input(i);
      if (kResidual) xt[i] = v;
      ss += v * v;
    }
    rms = sqrtf(BlockSum(ss) / dim + eps);
    const float scale = 1.f / rms;
    for (int i = threadIdx.x; i < dim; i += B) PutNormed(xt[i], scale, weight[i], i, ot, parts);
  }
  if (rms_out != nullptr && threadIdx.x == 0) rms_out[blockIdx.x] = rms;
}

// NormKernel with eight consecutive elements a thread (blockDim = dim / 8, a multiple of 32, and
// 16-byte aligned rows; see NormVec8Fits): two 16-byte loads an input, and a block of 32 values
// quantized by four lanes with two shuffles a reduction instead of a warp with five. A single
// multiprocessor runs a norm, so its instruction count is its time: the element-a-lane kernel
// issued 28k warp instructions for one 5120-wide row with the Q8_0 output, 10 us (Nsight
// Compute, commit d37999c). Same values as NormKernel up to the order of the sum
// of squares.
template <bool kResidual>
__global__ void __launch_bounds__(1024)
    NormVec8Kernel(float* x, const float* d1, const float* d2, const float* __restrict__ weight,
                   int dim, float eps, float* out, void* qx, float* __restrict__ rms_out) {
  PdlTrigger();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * dim;
  const int e0 = threadIdx.x * 8;
  float w[8], v[8];
  Load8(weight + e0, w);
  PdlWait();
  // Each thread reads its elements of d1/d2 before writing the same elements of out, so out may
  // alias them.
  Load8(x + row + e0, v);
  if (kResidual) {
    float a[8];
    Load8(d1 + row + e0, a);
    if (d2 != nullptr) {
      float b[8];
      Load8(d2 + row + e0, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = v[k] + (a[k] + b[k]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = v[k] + a[k];
    }
    Store8(x + row + e0, v);
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
  const float rms = sqrtf(BlockSum(ss) / dim + eps);
  const float scale = 1.f / rms;
  float o[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = v[k] * scale * w[k];
  Store8(out + row + e0, o);
  if (qx != nullptr) QuantizeEight(o, e0, QxAt(qx, dim, blockIdx.x));
  if (rms_out != nullptr && threadIdx.x == 0) rms_out[blockIdx.x] = rms;
}

// ---------------------------------------------------------------------------------------------
// RoPE: one block per (token, head), one thread per rotated pair.

__global__ void RopeKernel(float* __restrict__ x, int n_heads, int head_dim,
                           const int32_t* __restrict__ positions,
                           const float* __restrict__ inv_freq, bool interleaved) {
  PdlStart();
  const int t = blockIdx.x / n_heads;
  float* v = x + static_cast<int64_t>(blockIdx.x) * head_dim;
  const int half = head_dim / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    // Same float expressions as the reference, with accurate (not fast-math) sin and cos.
    const float angle = static_cast<float>(positions[t]) * inv_freq[i];
    const float c = cosf(angle), s = sinf(angle);
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half;
    const float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
  }
}

__global__ void RopeTableKernel(const int32_t* __restrict__ positions,
                                const float* __restrict__ inv_freq, int half,
                                float2* __restrict__ cos_sin) {
  PdlWait();  // for the positions' writer (in a decode step, the copy just before)
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < half) cos_sin[i] = RopeCosSin(static_cast<float>(positions[0]), inv_freq[i]);
}

// q heads rotated into q, k heads rotated into the cache, v copied: one thread per rotated pair
// or copied value, blockIdx.y the token. (One block per token took 26 us per layer on the H200
// for a 13B shape, about a fifth of the whole Q4_0 decode step: accurate sin and cos for 5120
// pairs in 256 threads.)
__global__ void RopeQkvKernel(const float* __restrict__ qkv, int n_heads, int n_kv_heads,
                              int head_dim, const int32_t* __restrict__ positions,
                              const float* __restrict__ inv_freq, bool interleaved,
                              float* __restrict__ q, float* __restrict__ k_cache,
                              float* __restrict__ v_cache) {
  PdlStart();
  const int t = blockIdx.y;
  const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
  const float* src = qkv + static_cast<int64_t>(t) * (q_dim + 2 * kv_dim);
  float* qt = q + static_cast<int64_t>(t) * q_dim;
  float* kt = k_cache + static_cast<int64_t>(positions[t]) * kv_dim;
  float* vt = v_cache + static_cast<int64_t>(positions[t]) * kv_dim;
  const int half = head_dim / 2;
  const float pos = static_cast<float>(positions[t]);
  const int pairs = (n_heads + n_kv_heads) * half;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < pairs) {
    const int head = j / half, i = j % half;
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half;
    const float* in = src + head * head_dim;  // q heads, then k heads
    float* dst = head < n_heads ? qt + head * head_dim : kt + (head - n_heads) * head_dim;
    RotatePair(in[a], in[b], RopeCosSin(pos, inv_freq[i]), dst + a, dst + b);
  } else if (j - pairs < kv_dim) {
    vt[j - pairs] = src[q_dim + kv_dim + (j - pairs)];
  }
}

}  // namespace


// Threads per block of the norms (one block per token): decode has a single token, so the block
// is the whole kernel; 256 threads took 20 us per norm for hidden 5120 on the H200 (two norms
// per layer: 40 us of a 120 us Q4_0 layer), a block of up to 1024 covers the row in a few passes.
namespace {
int NormThreads(int dim) { return dim >= 4096 ? 1024 : dim >= 1024 ? 512 : 256; }
}  // namespace

namespace {
bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// Whether NormVec8Kernel takes the rows: whole warps of eight elements a thread, and 16-byte
// aligned pointers (rows then stay aligned: dim is a multiple of 256), the quantized output's
// too (QuantizeEight stores eight values at once; any other caller falls back, not faults).
bool NormVec8Fits(int dim, std::initializer_list<const void*> ptrs) {
  if (!g_norm_vec8 || dim % 256 != 0 || dim / 8 > 1024) return false;
  for (const void* p : ptrs) {
    if (p != nullptr && !Aligned16(p)) return false;
  }
  return true;
}
}  // namespace

cudaError_t RmsNorm(const float* x, const float* weight, int n, int dim, float eps, float* out,
                    cudaStream_t stream, void* out_qx) {
  if (n <= 0) return cudaSuccess;
  if (out_qx != nullptr && dim % 32 != 0) return cudaErrorInvalidValue;
  if (NormVec8Fits(dim, {x, weight, out, out_qx})) {
    return Launch(NormVec8Kernel<false>, n, dim / 8, 0, stream, const_cast<float*>(x),
                  static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), weight,
                  dim, eps, out, out_qx, static_cast<float*>(nullptr));
  }
  return Launch(NormKernel<false>, n, NormThreads(dim), 0, stream, const_cast<float*>(x),
                static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), weight, dim,
                eps, out, out_qx, static_cast<float*>(nullptr), g_norm_regs);
}

cudaError_t ResidualRmsNorm(float* x, const float* d1, const float* d2, const float* weight, int n,
                            int dim, float eps, float* out, cudaStream_t stream, void* out_qx,
                            float* rms_out) {
  if (n <= 0) return cudaSuccess;
  if (out_qx != nullptr && dim % 32 != 0) return cudaErrorInvalidValue;
  if (NormVec8Fits(dim, {x, d1, d2, weight, out, out_qx})) {
    return Launch(NormVec8Kernel<true>, n, dim / 8, 0, stream, x, d1, d2, weight, dim, eps, out,
                  out_qx, rms_out);
  }
  return Launch(NormKernel<true>, n, NormThreads(dim), 0, stream, x, d1, d2, weight, dim, eps, out,
                out_qx, rms_out, g_norm_regs);
}

cudaError_t RopeQkvToCache(const float* qkv, int n, int n_heads, int n_kv_heads, int head_dim,
                           const int32_t* positions, const float* inv_freq, bool interleaved,
                           float* q, float* k_cache, float* v_cache, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  const int work = (n_heads + n_kv_heads) * (head_dim / 2) + n_kv_heads * head_dim;
  return Launch(RopeQkvKernel, dim3((work + 255) / 256, n), 256, 0, stream, qkv, n_heads,
                n_kv_heads, head_dim, positions, inv_freq, interleaved, q, k_cache, v_cache);
}

cudaError_t RopeTable(const int32_t* positions, const float* inv_freq, int head_dim, float* cos_sin,
                      cudaStream_t stream) {
  if (head_dim <= 0 || head_dim % 2 != 0 || reinterpret_cast<uintptr_t>(cos_sin) % 8 != 0) {
    return cudaErrorInvalidValue;
  }
  const int half = head_dim / 2;
  return Launch(RopeTableKernel, (half + 127) / 128, 128, 0, stream, positions, inv_freq, half,
                reinterpret_cast<float2*>(cos_sin));
}

cudaError_t Rope(float* x, int n, int n_heads, int head_dim, const int32_t* positions,
                 const float* inv_freq, bool interleaved, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  const int threads = head_dim / 2 < 128 ? (head_dim / 2 + 31) / 32 * 32 : 128;
  return Launch(RopeKernel, n * n_heads, threads, 0, stream, x, n_heads, head_dim, positions,
                inv_freq, interleaved);
}

}  // namespace cuda
}  // namespace pinfer
