// The module's comparison switches (environment knobs read once at load, with the Set* functions
// that change them for tests and benches), the shared device count, and the host-side sizes and
// names of the weight formats. The kernels that read the switches are in the other .cu files of
// gpu-worker/cuda; kernel_common.cuh declares them.
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

}  // namespace

bool g_q8x = KnobOn("PINFER_CUDA_Q8X");

// L2 prefetch of a dense matrix-vector kernel's rows before it waits for its predecessor (off;
// PINFER_CUDA_PREFETCH=1 turns it on). Measured on the H200 (run 10, commit 4890231): the whole
// F16 model on the GPU decodes at 117 tokens/s without it and 105 with it, in the same run.
bool g_prefetch = KnobOff("PINFER_CUDA_PREFETCH");

bool g_pdl = KnobOn("PINFER_CUDA_PDL");

// Rows from which a 16-byte-type matrix takes the warp-per-row kernel (off by default).
int g_warp_rows_min = 1 << 30;

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
// (commit 8cdb0e9). Default 16 x 1. (Session 3's measurements, before
// producer-quantized x: 16 x 2 292 tokens/s, 8 x 4 272, 4 x 4 246; commit e1a2a37.)
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
// TB/s against 2.6-2.9 TB/s for the taller ones (commit 8cdb0e9). So a short matrix
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

// The K-quant matrix-vector product's launch shape (SetKMatVecShape); PINFER_CUDA_K_SHAPE=W or
// W,B sets it for a whole run (W warps a block, B blocks an SM by registers). Measured on the H100
// (docs/benchmarks.md, "CUDA: K-quant decode"): eight warps, five blocks. Unconstrained, the
// one-token kernel took 51-57 registers (four blocks an SM) and its 5120-row products ran in
// 1.2 waves; held to 48 it runs 5-10% faster (Q4_K 13B layer shapes 2150-2520 GB/s against
// 2050-2380), while six blocks (40 registers) gain on the widest matrices and lose on the others.
int g_k_warps = 8, g_k_min_blocks = 5;
const bool g_k_shape_env = [] {
  const char* e = std::getenv("PINFER_CUDA_K_SHAPE");
  if (e == nullptr) return false;
  const char* comma = std::strchr(e, ',');
  SetKMatVecShape(std::atoi(e), comma != nullptr ? std::atoi(comma + 1) : 5);
  return true;
}();

int SmCount() {
  static int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 132;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
    return n;
  }();
  return sms;
}

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
void SetKMatVecShape(int warps, int min_blocks) {
  g_k_warps = warps == 4 ? 4 : 8;
  g_k_min_blocks = min_blocks >= 4 && min_blocks <= 6 ? min_blocks : 1;
}
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
    case WType::kQ4_K:
      return 144 * static_cast<size_t>(cols / 256);
    case WType::kQ5_K:
      return 176 * static_cast<size_t>(cols / 256);
    case WType::kQ6_K:
      return 210 * static_cast<size_t>(cols / 256);
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
    case WType::kQ4_K:
      return "Q4_K";
    case WType::kQ5_K:
      return "Q5_K";
    case WType::kQ6_K:
      return "Q6_K";
  }
  return "?";
}

cudaError_t CheckMatrixShape(const DeviceMatrix& w) {
  const int64_t unit = (w.type == WType::kF32)                             ? 4
                       : (w.type == WType::kF16 || w.type == WType::kBF16) ? 8
                       : IsKQuant(w.type)                                  ? 256
                                                                           : 32;
  if (w.type < WType::kF32 || w.type > WType::kQ6_K) return cudaErrorInvalidValue;
  if (w.cols <= 0 || w.cols % unit != 0 || w.rows < 0) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0) return cudaErrorMisalignedAddress;
  if (w.split() && w.type != WType::kQ8_0 && w.type != WType::kQ4_0) return cudaErrorInvalidValue;
  return cudaSuccess;
}
}  // namespace cuda
}  // namespace pinfer
