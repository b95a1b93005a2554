// Element-wise operators and conversions: gated activations and ReLU, residual adds, embedding
// lookup, dequantization to fp16 and the fp32 -> fp16 (and hi/lo split) conversions, and the
// greedy pick (argmax with its log-probability) over the logits.
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
// Element-wise.

__global__ void GatedActivationKernel(ActKind act, float* __restrict__ gate,
                                      const float* __restrict__ up, int64_t count) {
  PdlStart();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    gate[i] = ApplyGated(act, gate[i], up[i]);
  }
}

// With qx (width a multiple of 32) each warp's 32 consecutive outputs are also quantized.
__global__ void GatedActivationPackedKernel(ActKind act, const float* __restrict__ gu, int width,
                                            float* __restrict__ out, void* qx) {
  PdlStart();
  const int t = blockIdx.y;
  const float* g = gu + static_cast<int64_t>(t) * 2 * width;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) {
    const float v = ApplyGated(act, g[i], g[width + i]);
    out[static_cast<int64_t>(t) * width + i] = v;
    if (qx != nullptr) QuantizeBlockInWarp(v, threadIdx.x % kWarp, i / 32, QxAt(qx, width, t));
  }
}

__global__ void ReluKernel(float* __restrict__ x, int64_t count) {
  PdlStart();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = fmaxf(x[i], 0.f);
  }
}
// The greedy pick's running state: the largest logit so far, the first index holding it, and
// sum exp(l - max) over the logits seen (a logit equal to max adds exactly 1, so that infinite
// maxima give counts instead of inf - inf).
struct PickState {
  float max;
  float sum;
  int32_t index;
};

__device__ __forceinline__ void PickAdd(PickState& s, float l, int32_t i) {
  if (l != l) return;  // NaN: never picked, probability 0
  if (s.index == INT32_MAX) {
    s = {l, 1.f, i};
  } else if (l > s.max) {
    s.sum = s.sum * expf(s.max - l) + 1.f;
    s.max = l;
    s.index = i;
  } else {
    s.sum += l == s.max ? 1.f : expf(l - s.max);
  }
}

__device__ __forceinline__ PickState PickJoin(PickState a, PickState b) {
  if (b.max > a.max || (b.max == a.max && b.index < a.index)) {
    const PickState t = a;
    a = b;
    b = t;
  }
  // a holds the larger maximum (or the first index of an equal one).
  if (b.index != INT32_MAX) a.sum += b.max == a.max ? b.sum : b.sum * expf(b.max - a.max);
  return a;
}

constexpr int kPickThreads = 1024;

// One block: each thread folds a strided slice of the logits (four at a time when they are
// 16-byte aligned), then the warps and the block join their states.
__global__ void __launch_bounds__(kPickThreads)
    GreedyPickKernel(const float* __restrict__ logits, int vocab, int32_t* token, float* logprob) {
  PdlStart();
  PickState s = {-INFINITY, 0.f, INT32_MAX};
  int done = 0;
  if ((reinterpret_cast<uintptr_t>(logits) & 15) == 0) {
    const int quads = vocab / 4;
    const float4* l4 = reinterpret_cast<const float4*>(logits);
    for (int q = threadIdx.x; q < quads; q += blockDim.x) {
      const float4 v = l4[q];
      PickAdd(s, v.x, 4 * q);
      PickAdd(s, v.y, 4 * q + 1);
      PickAdd(s, v.z, 4 * q + 2);
      PickAdd(s, v.w, 4 * q + 3);
    }
    done = 4 * quads;
  }
  for (int i = done + threadIdx.x; i < vocab; i += blockDim.x) PickAdd(s, logits[i], i);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    PickState other;
    other.max = __shfl_xor_sync(0xffffffffu, s.max, o);
    other.sum = __shfl_xor_sync(0xffffffffu, s.sum, o);
    other.index = __shfl_xor_sync(0xffffffffu, s.index, o);
    s = PickJoin(s, other);
  }
  __shared__ PickState warps[kPickThreads / kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) warps[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x) / kWarp; ++w) s = PickJoin(s, warps[w]);
    const bool any = s.index != INT32_MAX;
    *token = any ? s.index : 0;
    *logprob = any ? -logf(s.sum) : NAN;
  }
}

__global__ void AddKernel(float* __restrict__ y, const float* __restrict__ x, int64_t count) {
  PdlStart();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

// y[t, i] += bias[i] for t < n, i < width: a bias row added to every token's output.
__global__ void AddRowBiasKernel(float* __restrict__ y, const float* __restrict__ bias, int64_t n,
                                 int64_t width) {
  PdlStart();
  const int64_t count = n * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += bias[i % width];
  }
}

__global__ void Add2Kernel(float* __restrict__ y, const float* __restrict__ x,
                           const float* __restrict__ z, int64_t count) {
  PdlStart();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += x[i] + z[i];
  }
}

__global__ void EmbedKernel(WType type, const uint8_t* __restrict__ table,
                            const uint16_t* __restrict__ scales, size_t row_bytes, int64_t cols,
                            const int32_t* __restrict__ tokens, float* __restrict__ out) {
  PdlStart();
  const int t = blockIdx.y;
  const uint8_t* row = table + static_cast<size_t>(tokens[t]) * row_bytes;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[static_cast<int64_t>(t) * cols + c] =
        scales != nullptr ? LoadElemSplit(type, table, scales, cols, tokens[t], c)
                          : LoadElem(type, row, c);
  }
}

__global__ void DequantizeToHalfKernel(WType type, const uint8_t* __restrict__ w,
                                       const uint16_t* __restrict__ scales, size_t row_bytes,
                                       int64_t rows, int64_t cols, __half* __restrict__ out) {
  PdlStart();
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    out[i] = __float2half_rn(scales != nullptr
                                 ? LoadElemSplit(type, w, scales, cols, r, c)
                                 : LoadElem(type, w + static_cast<size_t>(r) * row_bytes, c));
  }
}

__global__ void FloatToHalfKernel(const float* __restrict__ x, int64_t count,
                                  __half* __restrict__ out) {
  PdlStart();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2half_rn(x[i]);
  }
}

__global__ void FloatToHalfSplitKernel(const float* __restrict__ x, int64_t count,
                                       __half* __restrict__ hi, __half* __restrict__ lo) {
  PdlStart();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const __half h = __float2half_rn(x[i]);
    hi[i] = h;
    lo[i] = __float2half_rn(x[i] - __half2float(h));
  }
}
}  // namespace

cudaError_t GatedActivation(ActKind act, float* gate, const float* up, int64_t count,
                            cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  return Launch(GatedActivationKernel, GridFor(count, 256), 256, 0, stream, act, gate, up, count);
}

cudaError_t GatedActivationPacked(ActKind act, const float* gu, int n, int width, float* out,
                                  cudaStream_t stream, void* out_qx) {
  if (n <= 0 || width <= 0) return cudaSuccess;
  if (n > 65535 || (out_qx != nullptr && width % 32 != 0)) return cudaErrorInvalidValue;
  return Launch(GatedActivationPackedKernel, dim3(GridFor(width, 256), n), 256, 0, stream, act, gu,
                width, out, out_qx);
}

cudaError_t Relu(float* x, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  return Launch(ReluKernel, GridFor(count, 256), 256, 0, stream, x, count);
}

cudaError_t GreedyPick(const float* logits, int vocab, int32_t* token, float* logprob,
                       cudaStream_t stream) {
  if (logits == nullptr || token == nullptr || logprob == nullptr || vocab < 0) {
    return cudaErrorInvalidValue;
  }
  return Launch(GreedyPickKernel, 1, kPickThreads, 0, stream, logits, vocab, token, logprob);
}

cudaError_t AddInPlace(float* y, const float* x, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  return Launch(AddKernel, GridFor(count, 256), 256, 0, stream, y, x, count);
}

cudaError_t AddRowBias(float* y, const float* bias, int n, int64_t width, cudaStream_t stream) {
  if (n <= 0 || width <= 0) return cudaSuccess;
  return Launch(AddRowBiasKernel, GridFor(static_cast<int64_t>(n) * width, 256), 256, 0, stream, y,
                bias, static_cast<int64_t>(n), width);
}

cudaError_t Add2InPlace(float* y, const float* x, const float* z, int64_t count,
                        cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  return Launch(Add2Kernel, GridFor(count, 256), 256, 0, stream, y, x, z, count);
}

cudaError_t Embed(const DeviceMatrix& table, const int32_t* tokens, int n, float* out,
                  cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (n > 65535) return cudaErrorInvalidValue;
  const int bx = static_cast<int>((table.cols + 255) / 256);
  return Launch(EmbedKernel, dim3(bx, n), 256, 0, stream, table.type,
                static_cast<const uint8_t*>(table.data), static_cast<const uint16_t*>(table.scales),
                table.row_bytes(), table.cols, tokens, out);
}

cudaError_t DequantizeToHalf(const DeviceMatrix& w, void* out, cudaStream_t stream) {
  const int64_t total = w.rows * w.cols;
  if (total <= 0) return cudaSuccess;
  return Launch(DequantizeToHalfKernel, GridFor(total, 256), 256, 0, stream, w.type,
                static_cast<const uint8_t*>(w.data), static_cast<const uint16_t*>(w.scales),
                w.row_bytes(), w.rows, w.cols, static_cast<__half*>(out));
}

cudaError_t FloatToHalf(const float* x, int64_t count, void* out, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  return Launch(FloatToHalfKernel, GridFor(count, 256), 256, 0, stream, x, count,
                static_cast<__half*>(out));
}

cudaError_t FloatToHalfSplit(const float* x, int64_t count, void* hi, void* lo,
                             cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  return Launch(FloatToHalfSplitKernel, GridFor(count, 256), 256, 0, stream, x, count,
                static_cast<__half*>(hi), static_cast<__half*>(lo));
}

}  // namespace cuda
}  // namespace pinfer