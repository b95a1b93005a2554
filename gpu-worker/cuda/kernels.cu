// CUDA implementations of the operators in kernels.h. Decode on a large model is a pass over the
// weights, so the row kernels are written for memory bandwidth: one warp per weight row, 16-byte
// loads in flight from every lane, the few tokens of a decode batch sharing each load. The block
// formats are read in ggml's layout so that weights go to the GPU exactly as they are stored.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <utility>

#include "gpu-worker/cuda/kernels.h"

namespace pinfer {
namespace cuda {
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

// A knob that is on unless its environment variable is set to 0 (the module's comparison
// switches, read once at load; the Set* functions below change them for tests and benches).
bool KnobOn(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr || e[0] != '0';
}
// A knob that is off unless its environment variable is set to 1.
bool KnobOff(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr && e[0] == '1';
}

bool g_q8x = KnobOn("PINFER_CUDA_Q8X");

// L2 prefetch of a dense matrix-vector kernel's rows before it waits for its predecessor (off;
// PINFER_CUDA_PREFETCH=1 turns it on). Measured on the H200 (docs/cuda-runs/final2): the whole
// F16 model on the GPU decodes at 117 tokens/s without it and 105 with it, in the same run.
bool g_prefetch = KnobOff("PINFER_CUDA_PREFETCH");

bool g_pdl = KnobOn("PINFER_CUDA_PDL");

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
// as long or up to 2% longer, docs/cuda-runs/session9-norm/ against session9-fused-rope/.)
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

// Rows of up to kNormRegs * blockDim elements stay in registers: all of a thread's loads are
// issued before its first store and x is read once, so a block waits on memory about twice. A
// loop that loads, adds and stores element by element (out may alias d1, so the compiler keeps
// that order) waited once per element and pass: 8.5 us for one 5120-wide row with the Q8_0
// output on the H200 (Nsight Compute, docs/cuda-runs/session7-norms/). Longer rows loop; both
// paths compute the same values in the same order.
constexpr int kNormRegs = 8;

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

__device__ __forceinline__ void Load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void Store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// NormKernel with eight consecutive elements a thread (blockDim = dim / 8, a multiple of 32, and
// 16-byte aligned rows; see NormVec8Fits): two 16-byte loads an input, and a block of 32 values
// quantized by four lanes with two shuffles a reduction instead of a warp with five. A single
// multiprocessor runs a norm, so its instruction count is its time: the element-a-lane kernel
// issued 28k warp instructions for one 5120-wide row with the Q8_0 output, 10 us (Nsight
// Compute, docs/cuda-runs/session9-norm/). Same values as NormKernel up to the order of the sum
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

// The norm done by the int8 product that consumes it (NormMatVec): x + d1 (+ d2), RMS-normed
// and scaled by weight, quantized by each block of the product into its shared copy of x. A
// norm kernel runs on one multiprocessor while the rest of the GPU waits for it (two a layer:
// 6.4 us a layer of the whole Q4_0 step on the H200, docs/cuda-runs/session12-ablation/); here
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

// ---------------------------------------------------------------------------------------------
// Attention: one block per (head, token). Scores for every visible key live in shared memory;
// warps take keys in turn (a warp-wide dot product each), then the block takes the softmax and
// the weighted sum of values, with thread groups splitting the keys.

constexpr int kAttnThreads = 256;
constexpr int kAttnMaxSmemBytes = 200 * 1024;

__global__ void AttentionKernel(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, int pos0,
                                const int32_t* __restrict__ positions, int n_heads, int n_kv_heads,
                                int head_dim, float* __restrict__ out, void* out_qx) {
  PdlStart();
  extern __shared__ float smem[];
  const int h = blockIdx.x, t = blockIdx.y;
  // With positions (device memory) the step is position-independent, so it can be replayed
  // from a CUDA graph.
  const int len = (positions != nullptr ? positions[0] : pos0) + t + 1;
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
// shorter on the H200 (docs/cuda-runs/session11-ablation/). Here one block per (head, token)
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
                          float* __restrict__ out, void* out_qx, bool early,
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
  const int len = pos + 1;
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
  if (old > 0) load_batch(warp, old);
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
  for (int p0 = warp; p0 < len; p0 += kWarps * kAttnBatch) {
    if (p0 != warp || old == 0) {
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
// Rows from which a 16-byte-type matrix takes the warp-per-row kernel (off by default).
int g_warp_rows_min = 1 << 30;
constexpr int kMaxStageBytes = 48 * 1024;

template <WType T>
constexpr bool kVec16 = T == WType::kF32 || T == WType::kF16 || T == WType::kBF16;

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
// Shape of the launch: kQxWarps warps per block (PINFER_CUDA_QX_WARPS: 4, 8 or 16), R rows per
// warp (PINFER_CUDA_QX_ROWS: 1, 2 or 4; 0 = the most rows per warp that still give every SM four
// blocks). Every block quantizes all of x before it streams its rows (unless its producer did),
// so more rows per block means less repeated work, while more rows per warp means more loads in
// flight per warp but more registers. Nsight Compute on the H200 found 16 x 2 latency-bound (58
// registers: two blocks, 32 warps an SM; no eligible warp in 53% of cycles, 61% of DRAM
// bandwidth); one row a warp compiled for 48 warps an SM (40 registers) took Q4_0 13B-shape
// decode with the whole model on the GPU from 265.6 to 287.1 tokens/s in one process (and
// 265.3 -> 290.8 on another host), where 64 warps (32 registers, spilling) fell to 215.2
// (docs/cuda-runs/session7-qx-occupancy/). Default 16 x 1. (Session 3's measurements, before
// producer-quantized x: 16 x 2 292 tokens/s, 8 x 4 272, 4 x 4 246; docs/cuda-runs/qx-shape/.)
int g_qx_warps = [] {
  const char* e = std::getenv("PINFER_CUDA_QX_WARPS");
  const int w = e != nullptr ? std::atoi(e) : 16;
  return w == 4 || w == 8 ? w : 16;
}();
int g_qx_rows = [] {
  const char* e = std::getenv("PINFER_CUDA_QX_ROWS");
  const int r = e != nullptr ? std::atoi(e) : 1;
  return r == 1 || r == 2 || r == 4 ? r : 0;
}();
// Wave balance (PINFER_CUDA_QX_SHAPE=balanced, the default; "fixed" keeps the shape above for
// every matrix). With 32 rows a block (the default before one row a warp), a 5120-row matrix is 160
// blocks on 132 SMs: a fifth of the SMs stream two blocks' rows while the rest idle after one, and
// Nsight Compute measured the Q4_0 output projection at 1.4 TB/s and the down projection at 2.0
// TB/s against 2.6-2.9 TB/s for the taller ones (docs/cuda-runs/session7-norms/). So a short matrix
// takes smaller blocks (QxBalancedShape).
bool g_qx_balanced = [] {
  const char* e = std::getenv("PINFER_CUDA_QX_SHAPE");
  return e == nullptr || std::strcmp(e, "fixed") != 0;
}();
// Norm rows held in registers up to this many elements a thread (PINFER_CUDA_NORM_LOOP=1: 0,
// the element-by-element loop, for comparison).
int g_norm_regs = [] {
  const char* e = std::getenv("PINFER_CUDA_NORM_LOOP");
  return e != nullptr && std::strcmp(e, "1") == 0 ? 0 : kNormRegs;
}();
// Norms with eight elements a thread where the row suits them (NormVec8Kernel;
// PINFER_CUDA_NORM_VEC8=0: NormKernel for every row, for comparison).
bool g_norm_vec8 = KnobOn("PINFER_CUDA_NORM_VEC8");
// Attention with an online softmax and every key's loads in flight (AttentionOnlineKernel) for
// head sizes of 32, 64 and 128 (PINFER_CUDA_ATTN_ONLINE=0: AttentionKernel, for comparison).
bool g_attn_online = KnobOn("PINFER_CUDA_ATTN_ONLINE");
// The online attention loads the first batch of keys from before the call ahead of its wait
// (PINFER_CUDA_ATTN_EARLY=0: after, for comparison).
bool g_attn_early = KnobOn("PINFER_CUDA_ATTN_EARLY");
// The decode attention lets the next kernel's blocks start at its own start (default), or after
// its wait for the q/k/v product with PINFER_CUDA_ATTN_LATE_TRIGGER=1: that gained 2.0-2.3% on
// the whole Q4_0 model in session 16's two H200 calls and lost 0.6% (10 of 11 pairs) in session
// 17's five (docs/benchmarks.md, runs 30 and 31), so the longer-measured placement stays.
bool g_attn_late_trigger = KnobOff("PINFER_CUDA_ATTN_LATE_TRIGGER");
// The int8 product with x in registers where the row suits it (MatVecQxRegsKernel;
// PINFER_CUDA_QX_REGS=0: MatVecSplitQ8xKernel for every row, for comparison).
bool g_qx_regs = KnobOn("PINFER_CUDA_QX_REGS");
// MatVecQxRegsKernel loads a step's weights before the previous step's sums
// (PINFER_CUDA_QX_PIPE=0: after, for comparison).
bool g_qx_pipe = KnobOn("PINFER_CUDA_QX_PIPE");
// A norm's product whose grid takes every resident slot has its last quarter of blocks load x
// before their first rows (PINFER_CUDA_LATE_X_FIRST=0: every block loads its rows first, for
// comparison; the values are the same bit for bit).
bool g_late_x_first = KnobOn("PINFER_CUDA_LATE_X_FIRST");
// Decode steps of dense layers fold their norms into the int8 products that consume them
// (NormMatVec; PINFER_CUDA_FUSED_NORM=0: never, for comparison).
bool g_fused_norm = KnobOn("PINFER_CUDA_FUSED_NORM");
// Decode steps of dense layers apply RoPE where the q/k/v product writes its rows
// (NormMatVecRope; PINFER_CUDA_ROPE_IN_PRODUCT=0: the RoPE kernel after it, for comparison).
bool g_rope_product = KnobOn("PINFER_CUDA_ROPE_IN_PRODUCT");
// Decode steps of dense layers apply the gated activation where the gate/up product writes its
// rows (NormMatVecGated; PINFER_CUDA_ACT_IN_PRODUCT=0: the activation kernel after it).
bool g_gated_product = KnobOn("PINFER_CUDA_ACT_IN_PRODUCT");
// A dense MatVecQxRegsKernel loads its first rows before it waits for its predecessor
// (PINFER_CUDA_QX_EARLY=0: after, for comparison).
bool g_qx_early = KnobOn("PINFER_CUDA_QX_EARLY");

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

int GridFor(int64_t count, int threads) {
  int64_t blocks = (count + threads - 1) / threads;
  if (blocks > 65535) blocks = 65535;
  return static_cast<int>(blocks < 1 ? 1 : blocks);
}

int SmCount() {
  static int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 132;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
    return n;
  }();
  return sms;
}

}  // namespace

void SetMatVecWarpRowsMin(int rows) { g_warp_rows_min = rows; }
int MatVecWarpRowsMin() { return g_warp_rows_min; }
void SetProgrammaticLaunch(bool on) { g_pdl = on; }
void SetQuantizedActivations(bool on) { g_q8x = on; }
void SetWeightPrefetch(bool on) { g_prefetch = on; }
void SetQuantWarps(int warps) { g_qx_warps = warps == 4 || warps == 8 ? warps : 16; }
void SetQuantRowsPerWarp(int rows) { g_qx_rows = rows == 1 || rows == 2 || rows == 4 ? rows : 0; }
void SetQuantShapeBalanced(bool on) { g_qx_balanced = on; }
void SetNormInRegisters(bool on) { g_norm_regs = on ? kNormRegs : 0; }
void SetNormVec8(bool on) { g_norm_vec8 = on; }
void SetQuantRegs(bool on) { g_qx_regs = on; }
void SetQuantEarlyLoad(bool on) { g_qx_early = on; }
void SetQuantPipeline(bool on) { g_qx_pipe = on; }
void SetLateBlocksLoadXFirst(bool on) { g_late_x_first = on; }
void SetFusedNorm(bool on) { g_fused_norm = on; }
void SetRopeInProduct(bool on) { g_rope_product = on; }
bool RopeInProduct() { return g_rope_product; }
void SetActivationInProduct(bool on) { g_gated_product = on; }
bool ActivationInProduct() { return g_gated_product; }
void SetAttentionEarlyLoad(bool on) { g_attn_early = on; }
void SetAttentionLateTrigger(bool on) { g_attn_late_trigger = on; }
void SetOnlineAttention(bool on) { g_attn_online = on; }
bool QuantizedActivations() { return g_q8x; }
bool ProgrammaticLaunch() { return g_pdl; }

size_t WRowBytes(WType t, int64_t cols) {
  switch (t) {
    case WType::kF32:
      return 4 * static_cast<size_t>(cols);
    case WType::kF16:
    case WType::kBF16:
      return 2 * static_cast<size_t>(cols);
    case WType::kQ8_0:
      return 34 * static_cast<size_t>(cols / 32);
    case WType::kQ4_0:
      return 18 * static_cast<size_t>(cols / 32);
  }
  return 0;
}

size_t QuantRowBytes(WType t, int64_t cols) {
  return t == WType::kQ4_0 ? static_cast<size_t>(cols / 2) : static_cast<size_t>(cols);
}

const char* WTypeName(WType t) {
  switch (t) {
    case WType::kF32:
      return "F32";
    case WType::kF16:
      return "F16";
    case WType::kBF16:
      return "BF16";
    case WType::kQ8_0:
      return "Q8_0";
    case WType::kQ4_0:
      return "Q4_0";
  }
  return "?";
}

cudaError_t CheckMatrixShape(const DeviceMatrix& w) {
  const int64_t unit = (w.type == WType::kF32)                             ? 4
                       : (w.type == WType::kF16 || w.type == WType::kBF16) ? 8
                                                                           : 32;
  if (w.cols <= 0 || w.cols % unit != 0 || w.rows < 0) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0) return cudaErrorMisalignedAddress;
  if (w.split() && w.type != WType::kQ8_0 && w.type != WType::kQ4_0) return cudaErrorInvalidValue;
  return cudaSuccess;
}

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

// Threads per block of the norms (one block per token): decode has a single token, so the block
// is the whole kernel; 256 threads took 20 us per norm for hidden 5120 on the H200 (two norms
// per layer: 40 us of a 120 us Q4_0 layer), a block of up to 1024 covers the row in a few passes.
namespace {
int NormThreads(int dim) { return dim >= 4096 ? 1024 : dim >= 1024 ? 512 : 256; }
}  // namespace

size_t QxBytes(int64_t cols) { return QxRegionBytes(cols); }

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

int MaxAttentionContext() { return (kAttnMaxSmemBytes / 4) - kAttnThreads - 256; }

namespace {
// AttentionOnlineKernel where it takes the head size; cudaErrorNotSupported otherwise.
cudaError_t LaunchOnlineAttention(const float* q, const float* k, const float* v, int n, int pos0,
                                  const int32_t* positions, int n_heads, int n_kv_heads,
                                  int head_dim, float* out, void* out_qx, cudaStream_t stream) {
  if (!g_attn_online) return cudaErrorNotSupported;
  const dim3 grid(n_heads, n);
  switch (head_dim) {
    case 128:
      return Launch(AttentionOnlineKernel<4>, grid, kAttnThreads, 0, stream, q, k, v, pos0,
                    positions, n_heads, n_kv_heads, out, out_qx, g_attn_early, g_attn_late_trigger);
    case 64:
      return Launch(AttentionOnlineKernel<2>, grid, kAttnThreads, 0, stream, q, k, v, pos0,
                    positions, n_heads, n_kv_heads, out, out_qx, g_attn_early, g_attn_late_trigger);
    case 32:
      return Launch(AttentionOnlineKernel<1>, grid, kAttnThreads, 0, stream, q, k, v, pos0,
                    positions, n_heads, n_kv_heads, out, out_qx, g_attn_early, g_attn_late_trigger);
    default:
      return cudaErrorNotSupported;
  }
}
}  // namespace

cudaError_t Attention(const float* q, const float* k, const float* v, int n, int pos0, int n_heads,
                      int n_kv_heads, int head_dim, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (head_dim > kAttnThreads || head_dim <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
      pos0 < 0) {
    return cudaErrorInvalidValue;
  }
  const int len = pos0 + n;
  if (len > MaxAttentionContext()) return cudaErrorInvalidValue;
  const int32_t* no_positions = nullptr;
  void* no_qx = nullptr;
  if (cudaError_t e = LaunchOnlineAttention(q, k, v, n, pos0, no_positions, n_heads, n_kv_heads,
                                            head_dim, out, no_qx, stream);
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
                no_positions, n_heads, n_kv_heads, head_dim, out, no_qx);
}

cudaError_t AttentionAt(const float* q, const float* k, const float* v, int n,
                        const int32_t* positions, int max_ctx, int n_heads, int n_kv_heads,
                        int head_dim, float* out, cudaStream_t stream, void* out_qx) {
  if (n <= 0) return cudaSuccess;
  if (head_dim > kAttnThreads || head_dim <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
      max_ctx > MaxAttentionContext() || (out_qx != nullptr && head_dim % 32 != 0)) {
    return cudaErrorInvalidValue;
  }
  if (cudaError_t e = LaunchOnlineAttention(q, k, v, n, 0, positions, n_heads, n_kv_heads, head_dim,
                                            out, out_qx, stream);
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
                positions, n_heads, n_kv_heads, head_dim, out, out_qx);
}

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

cudaError_t AccumulateRows(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                           const int32_t* dev_count, const float* a, int lda, int n, float* y,
                           cudaStream_t stream) {
  if (n_rows <= 0 || n <= 0) return cudaSuccess;
  cudaError_t e = CheckMatrixShape(w);
  if (e != cudaSuccess) return e;
  if (n > 65535) return cudaErrorInvalidValue;
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
  }
  return cudaErrorInvalidValue;
}

cudaError_t GatedActivation(ActKind act, float* gate, const float* up, int64_t count,
                            cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  return Launch(GatedActivationKernel, GridFor(count, 256), 256, 0, stream, act, gate, up, count);
}

cudaError_t GatherGatedActivation(ActKind act, const float* gate, int ldg, const int32_t* idx,
                                  int n_idx, const int32_t* dev_count, float* up, int ld, int n,
                                  cudaStream_t stream) {
  if (n_idx <= 0 || n <= 0) return cudaSuccess;
  if (n > 65535) return cudaErrorInvalidValue;
  return Launch(GatherGatedKernel, dim3(GridFor(n_idx, 256), n), 256, 0, stream, act, gate, ldg,
                idx, n_idx, dev_count, up, ld);
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

cudaError_t CompactActive(const float* v, int n, int ldv, const int32_t* map, int len,
                          float threshold, int32_t* idx, int32_t* count, cudaStream_t stream,
                          const float* scale, const float* threshold_shift, bool mark_unshifted) {
  return Launch(CompactActiveKernel, 1, kCompactThreads, 0, stream, v, n, ldv, map, len, threshold,
                scale, threshold_shift, mark_unshifted, idx, count);
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
