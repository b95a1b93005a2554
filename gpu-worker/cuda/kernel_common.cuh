// Device helpers shared by every kernel file of the module (kernel_common.cuh is internal to
// gpu-worker/cuda/*.cu): warp reductions, programmatic dependent launch and Launch, streaming
// loads, the ggml block formats' dequantization, the split layout's block arithmetic, and the
// int8 products' quantization of x. Each .cu includes it once; everything here is inline or in an
// anonymous namespace, and the module's switches live in kernel_config.cu.
//
// The module's kernels (split by family across attention.cu, dense_products.cu, elementwise.cu,
// norm_rope.cu, sparse_gather.cu) implement the operators of kernels.h. Decode on a large model is
// a pass over the weights, so the row kernels are written for memory bandwidth: one warp per
// weight row, 16-byte loads in flight from every lane, the few tokens of a decode batch sharing
// each load. The block formats are read in ggml's layout so that weights go to the GPU exactly as
// they are stored.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "gpu-worker/cuda/kernels.h"

namespace pinfer {
namespace cuda {

// The module's comparison switches, defined and documented in kernel_config.cu.
extern bool g_q8x, g_prefetch, g_pdl, g_qx_balanced, g_norm_vec8, g_attn_online, g_attn_early,
    g_attn_late_trigger, g_qx_regs, g_qx_pipe, g_late_x_first, g_fused_norm, g_rope_product,
    g_gated_product, g_qx_early;
extern int g_warp_rows_min, g_qx_warps, g_qx_rows, g_norm_regs, g_k_warps, g_k_min_blocks;
// Multiprocessors of the current device (queried once).
int SmCount();
// MatVecRows and AccumulateRows over K-quant matrices (kquant_products.cu); the entry points
// check the shape and hand IsKQuant types here.
cudaError_t MatVecRowsK(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                        const int32_t* dev_count, const float* x, int n, float* y, int ldy,
                        cudaStream_t stream, const void* x_qx);
cudaError_t AccumulateRowsK(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                            const int32_t* dev_count, const float* a, int lda, int n, float* y,
                            cudaStream_t stream);

namespace {

constexpr int kWarp = 32;
constexpr int kMaxTok = 8;  // tokens sharing one pass over the weights in MatVecRows

__device__ __forceinline__ float H2F(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float Bf2F(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Programmatic dependent launch (see SetProgrammaticLaunch). Every kernel lets its successor in
// the stream launch at once (the successor's blocks take free multiprocessor slots during this
// kernel's last wave) and waits for its own predecessor's results before its first read of
// anything a predecessor may write and before its first write. Both are no-ops for a kernel
// launched without the attribute. Every block waits before it exits, so a kernel never completes
// before its predecessor, and dependencies stay transitive along the stream.
__device__ __forceinline__ void PdlTrigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void PdlWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void PdlStart() {
  PdlTrigger();
  PdlWait();
}
// Weights never change, so a kernel may fetch them into L2 before its predecessor is done: one
// bulk prefetch of `bytes` (a multiple of 16, 16-byte aligned) starting at p.
__device__ __forceinline__ void PrefetchL2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Launches a kernel, with the programmatic-serialization attribute when it is on and the stream
// is an explicit one (the legacy default stream keeps plain launches).
template <typename... P, typename... A>
cudaError_t Launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   A&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  bool pdl = g_pdl && stream != nullptr;
  if (pdl) {
    // Inside a stream capture the attribute becomes a programmatic graph edge, which only a
    // kernel node can have on its upstream side: after a copy, memset or event node (or as the
    // first node) the launch is a plain one.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaGraphNode_t* deps = nullptr;
    size_t n_deps = 0;
    if (cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &n_deps) !=
        cudaSuccess) {
      cudaGetLastError();
      pdl = false;
    } else if (status == cudaStreamCaptureStatusActive) {
      pdl = n_deps > 0;
      for (size_t i = 0; i < n_deps && pdl; ++i) {
        cudaGraphNodeType type;
        pdl =
            cudaGraphNodeGetType(deps[i], &type) == cudaSuccess && type == cudaGraphNodeTypeKernel;
      }
      cudaGetLastError();
    }
  }
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

// Streams weights past L1: each weight byte is read once per pass.
__device__ __forceinline__ uint4 LoadStream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void Unpack8Half(const uint4& v, float* w) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[2 * k] = H2F(static_cast<uint16_t>(u[k] & 0xffff));
    w[2 * k + 1] = H2F(static_cast<uint16_t>(u[k] >> 16));
  }
}
__device__ __forceinline__ void Unpack8Bf16(const uint4& v, float* w) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[2 * k] = __uint_as_float(u[k] << 16);
    w[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
  }
}

// One block of 32 quantized values, dequantized to fp32 (ggml layouts, see tensor.h).
// Q8_0: 34 bytes {fp16 d; int8 qs[32]}; Q4_0: 18 bytes {fp16 d; uint8 qs[16]}, element j in the
// low nibble of qs[j], element j+16 in the high nibble, value (q - 8) * d. Both are 2-byte
// aligned, so they are read as 16-bit words (from global memory, or from a shared-memory copy of
// the row that was filled with 16-byte loads).
__device__ __forceinline__ void DequantQ8Block(const uint8_t* blk, float* w) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(blk);
  const float d = H2F(p[0]);
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint16_t q = p[1 + k];
    w[2 * k] = d * static_cast<float>(static_cast<int8_t>(q & 0xff));
    w[2 * k + 1] = d * static_cast<float>(static_cast<int8_t>(q >> 8));
  }
}
__device__ __forceinline__ void DequantQ4Block(const uint8_t* blk, float* w) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(blk);
  const float d = H2F(p[0]);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint16_t q = p[1 + k];
    const int b0 = q & 0xff, b1 = q >> 8;
    w[2 * k] = d * static_cast<float>((b0 & 0x0f) - 8);
    w[2 * k + 1] = d * static_cast<float>((b1 & 0x0f) - 8);
    w[2 * k + 16] = d * static_cast<float>((b0 >> 4) - 8);
    w[2 * k + 17] = d * static_cast<float>((b1 >> 4) - 8);
  }
}

// ---------------------------------------------------------------------------------------------
// ggml's K-quant super-blocks (tensor.h's BlockQ4_K, BlockQ5_K, BlockQ6_K), 256 values each.

// Sub-block j's (0..7) 6-bit scale and min of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
__device__ __forceinline__ void KScaleMin(const uint8_t* scales, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
    *m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}
__device__ __forceinline__ uint16_t LoadU16(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}

// Element c of a K-quant row, as ggml's dequantize_row_q*_K computes it (fp32: d * scale * q -
// dmin * min, or d * scale * (q - 32)).
__device__ __forceinline__ float KQuantElem(WType t, const uint8_t* row, int64_t c) {
  const int e = static_cast<int>(c % 256);
  if (t == WType::kQ6_K) {
    const uint8_t* b = row + (c / 256) * 210;
    const int h = e / 128, k = (e % 128) / 32, l = e % 32;
    const uint8_t lq = b[64 * h + l + 32 * (k & 1)];
    const int lo = k < 2 ? (lq & 0x0f) : (lq >> 4);
    const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
    const float d = H2F(LoadU16(b + 208));
    return d * static_cast<float>(static_cast<int8_t>(b[192 + e / 16])) *
           static_cast<float>((lo | (hi << 4)) - 32);
  }
  const size_t bb = t == WType::kQ4_K ? 144 : 176;
  const uint8_t* b = row + (c / 256) * bb;
  const int j = e / 32, l = e % 32;  // sub-block j: low nibbles (j even) or high of qs chunk j/2
  int sc, m;
  KScaleMin(b + 4, j, &sc, &m);
  const uint8_t* qs = b + (t == WType::kQ4_K ? 16 : 48);
  int q = (j & 1) ? (qs[32 * (j / 2) + l] >> 4) : (qs[32 * (j / 2) + l] & 0x0f);
  if (t == WType::kQ5_K) q |= ((b[16 + l] >> j) & 1) << 4;
  const float d = H2F(LoadU16(b)), dmin = H2F(LoadU16(b + 2));
  return d * static_cast<float>(sc) * static_cast<float>(q) - dmin * static_cast<float>(m);
}

// Element c of a row in any type (slow path: embeddings and conversions).
__device__ __forceinline__ float LoadElem(WType t, const uint8_t* row, int64_t c) {
  switch (t) {
    case WType::kF32:
      return reinterpret_cast<const float*>(row)[c];
    case WType::kF16:
      return H2F(reinterpret_cast<const uint16_t*>(row)[c]);
    case WType::kBF16:
      return Bf2F(reinterpret_cast<const uint16_t*>(row)[c]);
    case WType::kQ8_0: {
      const uint8_t* blk = row + (c / 32) * 34;
      const float d = H2F(*reinterpret_cast<const uint16_t*>(blk));
      return d * static_cast<float>(static_cast<int8_t>(blk[2 + c % 32]));
    }
    case WType::kQ4_0: {
      const uint8_t* blk = row + (c / 32) * 18;
      const float d = H2F(*reinterpret_cast<const uint16_t*>(blk));
      const int j = static_cast<int>(c % 32);
      const uint8_t q = blk[2 + (j & 15)];
      return d * static_cast<float>(((j < 16) ? (q & 0x0f) : (q >> 4)) - 8);
    }
    case WType::kQ4_K:
    case WType::kQ5_K:
    case WType::kQ6_K:
      return KQuantElem(t, row, c);
  }
  return 0.f;
}

// Element (r, c) of a split-layout matrix (slow path: embeddings and conversions).
__device__ __forceinline__ float LoadElemSplit(WType t, const uint8_t* qs, const uint16_t* scales,
                                               int64_t cols, int64_t r, int64_t c) {
  const int64_t nblk = cols / 32, b = c / 32;
  const int j = static_cast<int>(c % 32);
  const float d = H2F(scales[r * nblk + b]);
  if (t == WType::kQ8_0) {
    return d * static_cast<float>(static_cast<int8_t>(qs[r * cols + c]));
  }
  const uint8_t q = qs[r * (cols / 2) + b * 16 + (j & 15)];
  return d * static_cast<float>(((j < 16) ? (q & 0x0f) : (q >> 4)) - 8);
}

// Elements per "unit" a lane handles at once: a 16-byte vector or one quantized block.
template <WType T>
struct Unit;
template <>
struct Unit<WType::kF32> {
  static constexpr int kElems = 4;
};
template <>
struct Unit<WType::kF16> {
  static constexpr int kElems = 8;
};
template <>
struct Unit<WType::kBF16> {
  static constexpr int kElems = 8;
};
template <>
struct Unit<WType::kQ8_0> {
  static constexpr int kElems = 32;
};
template <>
struct Unit<WType::kQ4_0> {
  static constexpr int kElems = 32;
};

template <WType T>
__device__ __forceinline__ void LoadUnit(const uint8_t* row, int64_t u, float* w) {
  if constexpr (T == WType::kF32) {
    const uint4 v = LoadStream(reinterpret_cast<const uint4*>(row) + u);
    w[0] = __uint_as_float(v.x);
    w[1] = __uint_as_float(v.y);
    w[2] = __uint_as_float(v.z);
    w[3] = __uint_as_float(v.w);
  } else if constexpr (T == WType::kF16) {
    Unpack8Half(LoadStream(reinterpret_cast<const uint4*>(row) + u), w);
  } else if constexpr (T == WType::kBF16) {
    Unpack8Bf16(LoadStream(reinterpret_cast<const uint4*>(row) + u), w);
  } else if constexpr (T == WType::kQ8_0) {
    DequantQ8Block(row + u * 34, w);
  } else {
    DequantQ4Block(row + u * 18, w);
  }
}

// ---------------------------------------------------------------------------------------------
// x quantized for the int8 matrix-vector product (QxBytes), one region per token: the values,
// then each block's scale, then each block's sum. (Measured and dropped: each block's first and
// last 16 values in separate halves, so that a warp's two 16-byte loads of x each cover 512
// contiguous bytes instead of 1 KB at half use, as Nsight Compute suggested; the products took
// as long or up to 2% longer, the runs of commits d37999c and e92d7b8.)
struct QxParts {
  int8_t* q;  // [cols]
  float* d;   // [cols / 32] the blocks' scales, rounded to fp16
  int* sum;   // [cols / 32] the sums of their int8 values (Q4_0's offset of 8 needs them)
};
__host__ __device__ __forceinline__ size_t QxRegionBytes(int64_t cols) {
  return (static_cast<size_t>(cols) + static_cast<size_t>(cols / 32) * 8 + 15) / 16 * 16;
}
__device__ __forceinline__ QxParts QxAt(void* region, int64_t cols, int token) {
  int8_t* q = static_cast<int8_t*>(region) + QxRegionBytes(cols) * token;
  float* d = reinterpret_cast<float*>(q + cols);
  return {q, d, reinterpret_cast<int*>(d + cols / 32)};
}
// act(gate) * up, wherever a gated activation is applied.
__device__ __forceinline__ float ApplyGated(ActKind act, float g, float u) {
  switch (act) {
    case ActKind::kSilu:
      return g / (1.f + expf(-g)) * u;
    case ActKind::kRelu:
      return (g > 0.f ? g : 0.f) * u;
    case ActKind::kDRelu:
      return (g > 0.f ? g : 0.f) * (u > 0.f ? u : 0.f);
  }
  return 0.f;
}

// A warp whose lanes hold the 32 consecutive values of block `blk` (lane l: value l) quantizes
// it. The operations are QuantizeEight's (max is exact in any order, the sum is an integer), so
// the product gets the same values whichever side quantized.
__device__ __forceinline__ void QuantizeBlockInWarp(float v, int lane, int64_t blk, QxParts out) {
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = amax / 127.f;
  const float inv = d != 0.f ? 1.f / d : 0.f;
  const int q = __float2int_rn(v * inv);
  out.q[blk * 32 + lane] = static_cast<int8_t>(q);
  int sum = q;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) {
    out.d[blk] = __half2float(__float2half_rn(d));
    out.sum[blk] = sum;
  }
}
// Four consecutive lanes quantize a block of 32, eight consecutive values each: v holds values
// e0 .. e0 + 7 (e0 a multiple of 8); all four lanes of the group take part.
__device__ __forceinline__ void QuantizeEight(const float (&v)[8], int64_t e0, QxParts out) {
  const unsigned group = 0xfu << ((threadIdx.x % kWarp) & ~3);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = fmaxf(amax, __shfl_xor_sync(group, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(group, amax, 2));
  const float d = amax / 127.f;
  const float inv = d != 0.f ? 1.f / d : 0.f;
  uint32_t packed[2] = {0u, 0u};
  int sum = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int q = __float2int_rn(v[i] * inv);
    sum += q;
    packed[i / 4] |= (static_cast<uint32_t>(q) & 0xffu) << (8 * (i % 4));
  }
  *reinterpret_cast<uint2*>(out.q + e0) = make_uint2(packed[0], packed[1]);
  sum += __shfl_xor_sync(group, sum, 1);
  sum += __shfl_xor_sync(group, sum, 2);
  if (e0 % 32 == 0) {
    out.d[e0 / 32] = __half2float(__float2half_rn(d));
    out.sum[e0 / 32] = sum;
  }
}

// The int8 products' own quantization of x (when its producer did not quantize it): the block's
// threads quantize x: [cols] into xp, eight values a thread per step, then meet at a barrier.
__device__ __forceinline__ void QuantizeRowInBlock(const float* __restrict__ x, int64_t cols,
                                                   QxParts xp) {
  for (int64_t e0 = threadIdx.x * 8; e0 < cols; e0 += blockDim.x * 8) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(x + e0));
    const float4 c = __ldg(reinterpret_cast<const float4*>(x + e0 + 4));
    const float v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
    QuantizeEight(v, e0, xp);
  }
  __syncthreads();
}

// Rows of up to kNormRegs * blockDim elements stay in registers (see norm_rope.cuh).
constexpr int kNormRegs = 8;

// ---------------------------------------------------------------------------------------------
// Split layout (DeviceMatrix::scales): quants and scales in separate arrays, so that every lane
// reads aligned 16-byte vectors. A quant is turned into a float exactly with one byte permute and
// one add: the byte goes into the low mantissa of 2^23 (0x4B0000qq = 2^23 + q), and subtracting
// 2^23 + 8 (Q4_0) or 2^23 + 128 (Q8_0, after flipping the sign bit) leaves the signed value.

__device__ __forceinline__ float ByteAsFloat(uint32_t v, int b, float bias) {
  return __int_as_float(static_cast<int>(__byte_perm(v, 0x4B000000u, 0x7540u + b))) - bias;
}

// Quant bytes of one 32-value block in the split layout.
template <WType T>
constexpr int kSplitBlockBytes = T == WType::kQ4_0 ? 16 : 32;

// sum_e (q_e - offset) * x[e] over one block, x: 32 floats in registers.
template <WType T>
__device__ __forceinline__ float SplitBlockDot(const uint4* q, const float* x) {
  float s0 = 0.f, s1 = 0.f;
  if constexpr (T == WType::kQ4_0) {
    // Byte k: value k in the low nibble, value k + 16 in the high nibble (GGUF's order).
    const uint32_t w[4] = {q[0].x, q[0].y, q[0].z, q[0].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo = w[k] & 0x0f0f0f0fu, hi = (w[k] >> 4) & 0x0f0f0f0fu;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        s0 = fmaf(ByteAsFloat(lo, b, 8388616.f), x[4 * k + b], s0);
        s1 = fmaf(ByteAsFloat(hi, b, 8388616.f), x[16 + 4 * k + b], s1);
      }
    }
  } else {
    const uint32_t w[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t u = w[k] ^ 0x80808080u;  // int8 -> int8 + 128 as an unsigned byte
#pragma unroll
      for (int b = 0; b < 4; b += 2) {
        s0 = fmaf(ByteAsFloat(u, b, 8388736.f), x[4 * k + b], s0);
        s1 = fmaf(ByteAsFloat(u, b + 1, 8388736.f), x[4 * k + b + 1], s1);
      }
    }
  }
  return s0 + s1;
}

// The 32 dequantized values of one block.
template <WType T>
__device__ __forceinline__ void SplitBlockValues(const uint4* q, float d, float* w) {
  if constexpr (T == WType::kQ4_0) {
    const uint32_t v[4] = {q[0].x, q[0].y, q[0].z, q[0].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo = v[k] & 0x0f0f0f0fu, hi = (v[k] >> 4) & 0x0f0f0f0fu;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        w[4 * k + b] = d * ByteAsFloat(lo, b, 8388616.f);
        w[16 + 4 * k + b] = d * ByteAsFloat(hi, b, 8388616.f);
      }
    }
  } else {
    const uint32_t v[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t u = v[k] ^ 0x80808080u;
#pragma unroll
      for (int b = 0; b < 4; ++b) w[4 * k + b] = d * ByteAsFloat(u, b, 8388736.f);
    }
  }
}

// Types read as 16-byte vectors, and the most shared memory a kernel stages rows in.
template <WType T>
constexpr bool kVec16 = T == WType::kF32 || T == WType::kF16 || T == WType::kBF16;
constexpr int kMaxStageBytes = 48 * 1024;

inline int GridFor(int64_t count, int threads) {
  int64_t blocks = (count + threads - 1) / threads;
  if (blocks > 65535) blocks = 65535;
  return static_cast<int>(blocks < 1 ? 1 : blocks);
}

}  // namespace
}  // namespace cuda
}  // namespace pinfer
