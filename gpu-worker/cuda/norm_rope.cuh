// Device helpers of the norms and RoPE that both their own kernels (norm_rope.cu) and the int8
// products that fold them in (dense_products.cu: NormMatVec, NormMatVecRope) use, so that the two
// give the same bits.
#pragma once
#include "gpu-worker/cuda/kernel_common.cuh"

namespace pinfer {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// RMSNorm: one block per token.

// Every thread gets the block's sum (blockDim a multiple of 32, at most 1024).
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float partial[32];
  v = WarpSum(v);
  if (threadIdx.x % kWarp == 0) partial[threadIdx.x / kWarp] = v;
  __syncthreads();
  if (threadIdx.x < kWarp) {
    float p = threadIdx.x < blockDim.x / kWarp ? partial[threadIdx.x] : 0.f;
    p = WarpSum(p);
    if (threadIdx.x == 0) partial[0] = p;
  }
  __syncthreads();
  return partial[0];
}

// The norms' output, out = x * scale * weight; with qx every warp's 32 consecutive elements
// (blockDim and dim are multiples of 32) are also quantized.
__device__ __forceinline__ void PutNormed(float v, float scale, float w, int i, float* ot,
                                          const QxParts* parts) {
  const float o = v * scale * w;
  ot[i] = o;
  if (parts != nullptr) QuantizeBlockInWarp(o, threadIdx.x % kWarp, i / 32, *parts);
}

__device__ __forceinline__ void Load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void Store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// The norm done by the int8 product that consumes it (NormMatVec): x + d1 (+ d2), RMS-normed
// and scaled by weight, quantized by each block of the product into its shared copy of x. A
// norm kernel runs on one multiprocessor while the rest of the GPU waits for it (two a layer:
// 6.4 us a layer of the whole Q4_0 step on the H200, commit c4e9912); here
// every block of the product computes the same sum of squares over the row (20 KB from L2 for
// a 5120-wide row) while its first rows of weights, loaded before its wait, are on their way.
struct NormIn {
  const float* x;       // [cols] the residual
  const float* d1;      // [cols] added to it, or null
  const float* d2;      // [cols] added too, or null
  const float* weight;  // [cols] the norm's weight; null: no norm (x is the product's input)
  float eps;
  float* x_out;  // [cols] receives x + d1 + d2 (block 0 writes it), or null; aliases none of them
};
constexpr int kNormChunks = 3;  // rows up to kNormChunks * 8 * blockDim elements
// The norm's weights never change: they load before the wait for the predecessor.
__device__ __forceinline__ void LoadNormWeights(const NormIn& in, int cols,
                                                float (&w)[kNormChunks][8]) {
#pragma unroll
  for (int c = 0; c < kNormChunks; ++c) {
    const int e0 = (threadIdx.x + c * blockDim.x) * 8;
    if (e0 < cols) Load8(in.weight + e0, w[c]);
  }
}
__device__ __forceinline__ void NormQuantizeRowInBlock(const NormIn& in, int cols,
                                                       const float (&w)[kNormChunks][8],
                                                       QxParts xp) {
  float v[kNormChunks][8];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kNormChunks; ++c) {
    const int e0 = (threadIdx.x + c * blockDim.x) * 8;
    if (e0 < cols) {
      Load8(in.x + e0, v[c]);
      if (in.d1 != nullptr) {
        float a[8];
        Load8(in.d1 + e0, a);
        if (in.d2 != nullptr) {
          float b[8];
          Load8(in.d2 + e0, b);
#pragma unroll
          for (int k = 0; k < 8; ++k) v[c][k] = v[c][k] + (a[k] + b[k]);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) v[c][k] = v[c][k] + a[k];
        }
      }
      if (in.x_out != nullptr && blockIdx.x == 0) Store8(in.x_out + e0, v[c]);
#pragma unroll
      for (int k = 0; k < 8; ++k) ss += v[c][k] * v[c][k];
    }
  }
  const float scale = 1.f / sqrtf(BlockSum(ss) / cols + in.eps);
#pragma unroll
  for (int c = 0; c < kNormChunks; ++c) {
    const int e0 = (threadIdx.x + c * blockDim.x) * 8;
    // A group of four lanes covers one aligned block of 32 (cols is a multiple of 32), so the
    // group quantizes together or not at all.
    if (e0 < cols) {
      float o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = v[c][k] * scale * w[c][k];
      QuantizeEight(o, e0, xp);
    }
  }
  __syncthreads();
}

// One rotated pair and its angle's cosine and sine, the same arithmetic wherever RoPE is applied
// to a product's rows (RopeQkvKernel, and NormMatVecRope's product with RopeTable's values), so
// the two give the same bits. The rounding is spelled out: left to itself the compiler contracted
// x0 * c - x1 * s into a different fused multiply-add in the two kernels (the H200's op test saw
// them differ in the last bit).
__device__ __forceinline__ float2 RopeCosSin(float pos, float inv_freq) {
  const float angle = __fmul_rn(pos, inv_freq);
  return make_float2(cosf(angle), sinf(angle));
}
__device__ __forceinline__ void RotatePair(float x0, float x1, float2 cs, float* a, float* b) {
  *a = __fmaf_rn(x0, cs.x, -__fmul_rn(x1, cs.y));
  *b = __fmaf_rn(x0, cs.y, __fmul_rn(x1, cs.x));
}

}  // namespace
}  // namespace cuda
}  // namespace pinfer
