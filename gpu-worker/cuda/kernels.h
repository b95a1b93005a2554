// The CUDA operators of the gpu-worker, FlashInfer-style: plain functions over raw device
// pointers that enqueue work on a stream and return a cudaError_t. No framework types cross this
// header, so the op tests, the backend and the benchmark all call exactly the same launchers, and
// each one is checked against the CPU reference operators (shared/engine/ops.h) op by op.
//
// Conventions follow CpuOps: activations are fp32, row-major [tokens, features]; weights are
// row-major [out_features, in_features] in any stored type (the block formats are ggml's, see
// shared/model/tensor.h) and are converted to fp32 in registers; accumulation is fp32.
//
// Sparse operators take an optional list of row ids and an optional device-side row count, so
// that a predictor or compaction kernel can decide the active rows on the GPU and the following
// kernels read the count without a round trip to the host. Launch sizes come from the host-side
// upper bound; blocks past the device count exit at once.
//
// This header must stay C++17 (nvcc compiles it) and free of absl and cuBLAS.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pinfer {
namespace cuda {

// Numbering matches pinfer::DType (shared/model/tensor.h); tests static_assert this.
enum class WType : int {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kQ8_0 = 3,
  kQ4_0 = 4,
  kQ4_K = 5,
  kQ5_K = 6,
  kQ6_K = 7
};
// ggml's K-quant super-blocks (256 values: Q4_K 144 bytes, Q5_K 176, Q6_K 210), computed by their
// own kernels (kquant_products.cu); never in the split layout.
inline bool IsKQuant(WType t) {
  return t == WType::kQ4_K || t == WType::kQ5_K || t == WType::kQ6_K;
}

// Numbering matches pinfer::Activation (shared/model/config.h).
enum class ActKind : int { kSilu = 0, kRelu = 1, kDRelu = 2 };

// Bytes of `cols` consecutive elements (cols a multiple of 32 for the block formats, of 256 for
// the K-quants).
size_t WRowBytes(WType t, int64_t cols);
const char* WTypeName(WType t);

// A weight matrix in device memory.
//
// Block formats (Q8_0, Q4_0) come in two layouts. GGUF's: rows of 34- or 18-byte blocks {fp16 d;
// quants}, only 2-byte aligned. Split (scales != null), made on the GPU by RepackSplit: the quant
// bytes of every row contiguous at data ([rows, QuantRowBytes], each block's 32 or 16 bytes
// 16-byte aligned and in GGUF's order) and the fp16 scales at scales ([rows, cols / 32]); the
// same bytes in total, but every lane reads whole 16-byte vectors. The values are the same, so
// every operator gives the same results on either layout.
struct DeviceMatrix {
  WType type = WType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  const void* data = nullptr;
  const void* scales = nullptr;  // split layout of a block format (see above)
  bool split() const { return scales != nullptr; }
  size_t row_bytes() const { return WRowBytes(type, cols); }
  size_t bytes() const { return row_bytes() * static_cast<size_t>(rows); }
};

// Quant bytes per row of the split layout (cols / 2 for Q4_0, cols for Q8_0).
size_t QuantRowBytes(WType t, int64_t cols);

// Rewrites rows [row0, row0 + src.rows) of a split matrix from src (GGUF layout, same type and
// columns): dst.data and dst.scales must hold dst.rows rows. dst.data 16-byte aligned.
cudaError_t RepackSplit(const DeviceMatrix& src, const DeviceMatrix& dst, int64_t row0,
                        cudaStream_t stream);
// The same for scattered rows: row r of src goes to row pairs[2 * r + 1] of dst (device index
// pairs, as GatherRows takes them; each below dst.rows, which is the caller's to ensure).
cudaError_t RepackSplitRows(const DeviceMatrix& src, const DeviceMatrix& dst, const int64_t* pairs,
                            cudaStream_t stream);

// Programmatic dependent launch (Hopper): every kernel is launched so that it may start while
// its predecessor in the stream finishes (it waits for the predecessor's results with
// griddepcontrol.wait before touching them). On by default; PINFER_CUDA_PDL=0 or this call turns
// it off. With SetWeightPrefetch (PINFER_CUDA_PREFETCH=1; off by default, it measured slower)
// dense matrix-vector kernels also prefetch their rows into L2 before that wait. Not thread-safe.
void SetProgrammaticLaunch(bool on);
void SetWeightPrefetch(bool on);
bool ProgrammaticLaunch();

// Which product MatVecRows computes for split-layout block formats: llama.cpp's definition
// (default), where x is quantized to Q8_0 blocks (d = fp16(max|x| / 127), q = round(x / d)) and
// each block adds d_w * d_x * (integer dot), four products per dp4a, the definition of the
// engine's quantized MatMul when it multiplies int8 activations; or (PINFER_CUDA_Q8X=0 or this
// call) fp32 x against the exactly dequantized weights, 1.5x slower on the H200 (compute-bound:
// a byte permute, an add and an FMA per weight). GGUF-layout matrices always take fp32 x.
// Not thread-safe.
void SetQuantizedActivations(bool on);
// Warps per block of that kernel (4, 8 or 16 (default); PINFER_CUDA_QX_WARPS), a tuning knob.
void SetQuantWarps(int warps);
// Rows per warp of that kernel (1 (default), 2, 4; 0: chosen by the row count;
// PINFER_CUDA_QX_ROWS).
void SetQuantRowsPerWarp(int rows);
// Whether each launch of that kernel may take fewer rows a block so that the SMs' shares of a
// short matrix stay even (default; PINFER_CUDA_QX_SHAPE=fixed turns it off).
void SetQuantShapeBalanced(bool on);
// Whether the norms hold a row in registers (default) or loop element by element
// (PINFER_CUDA_NORM_LOOP=1), for comparison; the values are the same.
void SetNormInRegisters(bool on);
// Whether norms of rows that suit it (a multiple of 256 wide, up to 8192) run with eight
// elements a thread (default) or as above (PINFER_CUDA_NORM_VEC8=0), for comparison.
void SetNormVec8(bool on);
// Whether the int8 product holds x in registers (default; rows up to 20480 columns for Q4_0 and
// 16384 for Q8_0, wider ones split between two or four warps) or reads it from memory for every
// row (PINFER_CUDA_QX_REGS=0), for comparison. Rows a warp covers alone give the same values bit
// for bit; split rows differ by summation order.
void SetQuantRegs(bool on);
// Whether a dense product with x in registers loads its first rows before it waits for its
// predecessor in the stream (default) or after (PINFER_CUDA_QX_EARLY=0), for comparison; the
// values are the same bit for bit.
void SetQuantEarlyLoad(bool on);
// Whether the product with x in registers loads a step's weights before the previous step's
// sums cross the warp (and, for split rows, the block's barrier) (default) or after
// (PINFER_CUDA_QX_PIPE=0), for comparison; the values are the same bit for bit.
void SetQuantPipeline(bool on);
// Whether a norm's product whose grid takes every resident slot has its last quarter of blocks,
// which become resident after the predecessor's release, load x before their first rows (default)
// or load their rows first as the others do (PINFER_CUDA_LATE_X_FIRST=0), for comparison; the
// values are the same bit for bit.
void SetLateBlocksLoadXFirst(bool on);
// Whether attention of head sizes 32, 64 and 128 keeps an online softmax with every key's
// loads in flight (default) or stores every score first (PINFER_CUDA_ATTN_ONLINE=0), for
// comparison; the values agree up to rounding.
void SetOnlineAttention(bool on);
// Whether the online attention loads its first batch of keys from before the call (positions
// below the first token's) ahead of its wait for the RoPE kernel (default) or after
// (PINFER_CUDA_ATTN_EARLY=0), for comparison; the values are the same bit for bit.
void SetAttentionEarlyLoad(bool on);
// Whether the decode attention lets the next kernel's blocks start after its wait for its
// predecessor (PINFER_CUDA_ATTN_LATE_TRIGGER=1) or at its start (default), for comparison; only
// the timing differs, since every kernel waits for its predecessor before reading its output.
void SetAttentionLateTrigger(bool on);
bool QuantizedActivations();

// x quantized once, by the kernel that produces it, for the int8 product above, so that the
// product's blocks do not each quantize it again: per token QxBytes(cols) bytes (16-byte aligned
// when the buffer is), q: [cols] int8, then d: [cols / 32] fp32, then sums: [cols / 32] int32,
// the values the product would compute for itself (so the result is the same bit for bit).
// Producers take it as an optional extra output (dim a multiple of 32), MatVecRows as an
// optional input that it uses when it takes the int8 path and ignores otherwise.
size_t QxBytes(int64_t cols);

// Whether the matrix's column count suits the row kernels (16-byte loads, whole blocks).
cudaError_t CheckMatrixShape(const DeviceMatrix& w);

// out: [n, dim] = x * rsqrt(mean(x^2) + eps) * weight
cudaError_t RmsNorm(const float* x, const float* weight, int n, int dim, float eps, float* out,
                    cudaStream_t stream, void* out_qx = nullptr);

// The residual add fused with the next norm: x[t] += d1[t] (+ d2[t] when d2 is not null), then
// out = RmsNorm(x). out may alias d1 or d2. x, d1, d2, out: [n, dim]. rms_out (optional, [n]):
// each token's sqrt(mean(x^2) + eps), the factor PowerInfer's pre-norm predictor scores carry.
cudaError_t ResidualRmsNorm(float* x, const float* d1, const float* d2, const float* weight, int n,
                            int dim, float eps, float* out, cudaStream_t stream,
                            void* out_qx = nullptr, float* rms_out = nullptr);

// A decode step's norm fused into the int8 product that consumes it: y: [w.rows] = w *
// RmsNorm(x + d1 (+ d2)) * weight for one token, the sum of squares computed by every block of
// the product (no norm kernel, the normed row never stored); x + d1 + d2 goes to x_out when it is
// not null (it must not alias x, d1 or d2). d1, d2 may be null; every pointer 16-byte aligned.
// The values are the unfused pair's (ResidualRmsNorm with out_qx, then MatVecRows) up to the
// order of the sum of squares. cudaErrorNotSupported where the product does not hold x in
// registers in one warp a row (NormMatVecFits: split Q4_0 rows of a multiple of 32 up to 5120
// columns, Q8_0 up to 4096, with the int8 product and the knobs above at their defaults, and
// SetFusedNorm on): callers then run the pair.
bool NormMatVecFits(const DeviceMatrix& w);
cudaError_t NormMatVec(const DeviceMatrix& w, const float* x, const float* d1, const float* d2,
                       const float* weight, float eps, float* x_out, float* y, cudaStream_t stream);
// Whether NormMatVecFits may say yes (default) or never (PINFER_CUDA_FUSED_NORM=0), for
// comparison.
void SetFusedNorm(bool on);

// Where a decode step's q/k/v product (wqkv: rows of wq, wk, wv stacked) leaves its rows: q:
// [n_heads * head_dim] rotated, and row positions[0] of k_cache and v_cache ([ctx, kv_dim]) the
// rotated key and the value, as RopeQkvToCache leaves them.
struct RopeOut {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  const int32_t* positions = nullptr;  // device, [1]
  const float* cos_sin = nullptr;      // device, [head_dim / 2, 2]: RopeTable at positions[0]
  bool interleaved = false;            // pairs (2i, 2i+1) (GGUF); otherwise (i, i + head_dim/2)
  float* q = nullptr;
  float* k_cache = nullptr;
  float* v_cache = nullptr;
};
// NormMatVec over wqkv with RoPE and the cache write done where the product writes its rows: a
// warp's two rows of a step are a rotated pair (or two values), so no kernel of their own runs
// between the product and the attention. Bit for bit NormMatVec then RopeQkvToCache.
// cudaErrorInvalidValue where w's rows are not (n_heads + 2 n_kv_heads) * head_dim or head_dim is
// odd; cudaErrorNotSupported where NormMatVecFits says no or SetRopeInProduct is off.
cudaError_t NormMatVecRope(const DeviceMatrix& w, const float* x, const float* d1, const float* d2,
                           const float* weight, float eps, float* x_out, const RopeOut& rope,
                           cudaStream_t stream);
// Whether NormMatVecRope runs (default) or refuses (PINFER_CUDA_ROPE_IN_PRODUCT=0), for
// comparison.
void SetRopeInProduct(bool on);
bool RopeInProduct();

// NormMatVec over a stacked gate/up matrix (rows of gate, then up: [2 ffn, cols]) with the gated
// activation applied where the product writes its rows: out: [ffn] = act(gate) * up and out_qx
// its quantized copy (QxBytes(ffn)), as GatedActivationPacked leaves them, bit for bit; the
// stacked rows are never stored. A block takes groups of 32 neurons, a warp a neuron's two rows a
// step, so that a group's activations meet in the block and are quantized there, with no
// activation kernel between the product and the down projection. cudaErrorInvalidValue where
// ffn is not a multiple of 32 or an output is missing; cudaErrorNotSupported where NormMatVecFits
// says no or SetActivationInProduct is off.
cudaError_t NormMatVecGated(const DeviceMatrix& w, const float* x, const float* d1, const float* d2,
                            const float* weight, float eps, float* x_out, ActKind act, float* out,
                            void* out_qx, cudaStream_t stream);
// Whether NormMatVecGated runs (default) or refuses (PINFER_CUDA_ACT_IN_PRODUCT=0), for
// comparison.
void SetActivationInProduct(bool on);
bool ActivationInProduct();

// cos_sin: [head_dim / 2, 2] = the cosine and sine of RoPE's angles at positions[0], computed as
// the RoPE kernels compute them, for NormMatVecRope (one table a step, not a sine a row pair in
// the product, whose registers are all in use). cos_sin must be 8-byte aligned.
cudaError_t RopeTable(const int32_t* positions, const float* inv_freq, int head_dim, float* cos_sin,
                      cudaStream_t stream);

// Rotates x: [n, n_heads, head_dim] in place at positions[t] (device array). inv_freq: device
// [head_dim / 2]. interleaved: pairs (2i, 2i+1) (GGUF); otherwise (i, i + head_dim/2) (HF).
cudaError_t Rope(float* x, int n, int n_heads, int head_dim, const int32_t* positions,
                 const float* inv_freq, bool interleaved, cudaStream_t stream);

// The fused projection's tail: qkv: [n, q_dim + 2 kv_dim] (rows of wq, wk, wv stacked) ->
// q: [n, q_dim] rotated; rows positions[t] of k_cache, v_cache ([ctx, kv_dim], the sequence's
// cache) receive the rotated keys and the values.
cudaError_t RopeQkvToCache(const float* qkv, int n, int n_heads, int n_kv_heads, int head_dim,
                           const int32_t* positions, const float* inv_freq, bool interleaved,
                           float* q, float* k_cache, float* v_cache, cudaStream_t stream);

// Causal attention of n queries at positions pos0..pos0+n-1 over cache rows 0..pos (decode is
// n = 1, a prompt batch n > 1); with window > 0 (Mistral's sliding window) over rows
// max(0, pos - window + 1)..pos only, as CpuOps::Attention.
// q: [n, n_heads, hd]; k, v: [ctx, n_kv_heads, hd]; out: [n, n_heads, hd].
// head_dim <= 256, context up to MaxAttentionContext().
// With programmatic launch the kernel reads the first position (pos0 or positions[0]) and the
// cache rows before it ahead of its wait for the previous kernel in the stream
// (SetAttentionEarlyLoad): those must not be written by kernels still running before it (in the
// backend, each call's upload of its positions is a copy that waits for all earlier work).
cudaError_t Attention(const float* q, const float* k, const float* v, int n, int pos0, int n_heads,
                      int n_kv_heads, int head_dim, int window, float* out, cudaStream_t stream);
int MaxAttentionContext();
// The same with the first position read from positions[0] (device memory), so that a decode
// step does not depend on host values and can be captured in a CUDA graph; shared memory is
// sized for max_ctx.
// out_qx (optional; head_dim a multiple of 32): the output also quantized for the int8 product
// (QxBytes(n_heads * head_dim) per token), as the norms do.
cudaError_t AttentionAt(const float* q, const float* k, const float* v, int n,
                        const int32_t* positions, int max_ctx, int n_heads, int n_kv_heads,
                        int head_dim, int window, float* out, cudaStream_t stream,
                        void* out_qx = nullptr);

// y[t * ldy + i] = w.row(rows ? rows[i] : i) . x[t]   for i < count, t < n,
// count = dev_count ? *dev_count : n_rows (n_rows is the upper bound). x: [n, w.cols].
// Dense matrix-vector when rows is null; the sparse gate/up projection when it lists active rows.
// A dense product of a block-format matrix may read its first rows of w before it waits for the
// previous kernel in the stream (SetQuantEarlyLoad): w must not be written by kernels still
// running before it (the backend's weights are written once, before a synchronize).
cudaError_t MatVecRows(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                       const int32_t* dev_count, const float* x, int n, float* y, int ldy,
                       cudaStream_t stream, const void* x_qx = nullptr);

// Tuning knob (benchmarks): matrices of 16-byte types with at least this many rows use one warp
// per row, shorter ones one block per row. Not thread-safe; set before use.
void SetMatVecWarpRowsMin(int rows);
int MatVecWarpRowsMin();
// Tuning knob (benchmarks): the K-quant matrix-vector product's launch shape: warps a block (4 or
// 8) and how many blocks of 256 threads an SM must fit by the one-token kernel's registers (1: no
// limit, 4, 5 (default) or 6). The values are the same bit for bit in every shape.
void SetKMatVecShape(int warps, int min_blocks);

// y[t, :] += sum_i a[t * lda + i] * w.row(rows ? rows[i] : i)   for i < count, t < n.
// The sparse down projection: w is the transposed down matrix [ffn, hidden], so each active
// neuron is one contiguous row. Zero coefficients are skipped. y: [n, w.cols].
cudaError_t AccumulateRows(const DeviceMatrix& w, const int32_t* rows, int n_rows,
                           const int32_t* dev_count, const float* a, int lda, int n, float* y,
                           cudaStream_t stream);

// gate[i] = act(gate[i]) * up[i] over count elements (dReLU: relu(gate) * relu(up)).
cudaError_t GatedActivation(ActKind act, float* gate, const float* up, int64_t count,
                            cudaStream_t stream);
// The exact mode's activation of the active rows: up[t * ld + i] =
// act(gate[t * ldg + idx[i]]) * up[t * ld + i] for i < count (= dev_count ? *dev_count : n_idx),
// where gate holds every row's gate value and up only the listed rows'.
cudaError_t GatherGatedActivation(ActKind act, const float* gate, int ldg, const int32_t* idx,
                                  int n_idx, const int32_t* dev_count, float* up, int ld, int n,
                                  cudaStream_t stream);
// gu: [n, 2 * width] (gate rows then up rows of a stacked projection) -> out[t, i] =
// act(gu[t, i]) * gu[t, width + i]; out: [n, width].
cudaError_t GatedActivationPacked(ActKind act, const float* gu, int n, int width, float* out,
                                  cudaStream_t stream, void* out_qx = nullptr);
// x[i] = max(x[i], 0).
cudaError_t Relu(float* x, int64_t count, cudaStream_t stream);
// y[i] += x[i].
cudaError_t AddInPlace(float* y, const float* x, int64_t count, cudaStream_t stream);
// y[t, i] += bias[i] for t < n, i < width (Qwen2's q/k/v biases on the stacked projection).
// y: [n, width], bias: [width].
cudaError_t AddRowBias(float* y, const float* bias, int n, int64_t width, cudaStream_t stream);
// *out = *count * *num / den (integer division): the GPU's share of a list whose length only the
// device knows, computed the same way on the host for the rest of the list. num may be pinned
// host memory (read when the kernel runs).
cudaError_t ShareOfCount(const int32_t* count, const int32_t* num, int den, int32_t* out,
                         cudaStream_t stream);
// Holds the stream until the host sets *flag (pinned host memory) to non-zero, then clears it:
// work queued behind it waits for a result the host has not written yet, so a decode step's next
// layer can be queued before the current layer's cold contribution exists. Each set must be
// consumed by exactly one wait; the host must not set the flag again before this wait has run.
// value_out (device memory, may be null) receives the flag's value: a signal can carry a count.
cudaError_t WaitHostFlag(int32_t* flag, cudaStream_t stream, int32_t* value_out = nullptr);
// out: [len] = sum over p < count of parts[p * len + i], added in part order from zero: the cold
// side's per-thread partial sums, read from pinned host memory over PCIe, so that the CPU's
// threads need not exchange them (CpuOps::SparseFfnTokenParts). The count is *count_dev (device
// memory, e.g. WaitHostFlag's value) when count_dev is non-null, else `count`; at least 1.
cudaError_t SumParts(const float* parts, int64_t len, const int32_t* count_dev, int count,
                     float* out, cudaStream_t stream);
// The greedy token of logits: [vocab] without copying them to the host: *token = the first index
// of the largest logit (NaNs ignored, as GreedyToken in shared/engine/sampler.h) and *logprob =
// its log-probability under softmax(logits), the value the sampler reports for greedy requests
// (NaN logits count as probability 0). Every logit NaN (or vocab 0): token 0, logprob NaN. Both
// outputs are device memory.
cudaError_t GreedyPick(const float* logits, int vocab, int32_t* token, float* logprob,
                       cudaStream_t stream);
// y[i] += x[i] + z[i] (the residual plus the hot and cold FFN parts).
cudaError_t Add2InPlace(float* y, const float* x, const float* z, int64_t count,
                        cudaStream_t stream);

// out: [n, table.cols] = rows tokens[t] of the table, as fp32.
cudaError_t Embed(const DeviceMatrix& table, const int32_t* tokens, int n, float* out,
                  cudaStream_t stream);

// Ordered compaction of the active neurons: idx = { j < len : some t < n has
// v[t * ldv + (map ? map[j] : j)] > threshold } ascending, *count = |idx|. With map = the hot
// neurons' global ids it lists active hot rows by local index; with the cold ids, the cold ones.
// A negative map entry is never active (an empty cache slot, a cold neuron held by a slot).
// With scale ([n], device), token t's values are multiplied by scale[t] before the comparison.
// With threshold_shift (one float the device can read, e.g. pinned host memory, read when the
// kernel runs) the threshold is threshold - *threshold_shift; with mark_unshifted too, the ids
// of neurons also above the unshifted threshold have kAboveBit set (they read as negative), which
// tells the module's cold guess its first tier in the same pass.
constexpr uint32_t kAboveBit = 1u << 31;
cudaError_t CompactActive(const float* v, int n, int ldv, const int32_t* map, int len,
                          float threshold, int32_t* idx, int32_t* count, cudaStream_t stream,
                          const float* scale = nullptr, const float* threshold_shift = nullptr,
                          bool mark_unshifted = false);

// Converts a weight matrix to fp16 (for cuBLAS): out: [rows, cols] halves.
cudaError_t DequantizeToHalf(const DeviceMatrix& w, void* out, cudaStream_t stream);
// out[i] = (half)x[i].
cudaError_t FloatToHalf(const float* x, int64_t count, void* out, cudaStream_t stream);
// hi[i] = (half)x[i], lo[i] = (half)(x[i] - hi[i]).
cudaError_t FloatToHalfSplit(const float* x, int64_t count, void* hi, void* lo,
                             cudaStream_t stream);

}  // namespace cuda
}  // namespace pinfer
