// Weight tensors as views into memory-mapped model files.
//
// A TensorView never owns memory: it points into a MappedFile (or another buffer kept alive by the
// Model). Shapes are row-major with the outermost dimension first, as in PyTorch: a linear layer's
// weight is [out_features, in_features], so one output neuron is one contiguous row. That is what
// makes activation sparsity cheap: skipping a neuron skips a row.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pinfer {

enum class DType : uint8_t { kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_K, kQ5_K, kQ6_K };
// How many dtypes there are (tables indexed by dtype).
inline constexpr int kNumDTypes = 8;

// Quantized formats, bit-compatible with ggml: blocks of 32 values along a row.
inline constexpr int kQuantBlock = 32;
struct BlockQ8_0 {
  uint16_t d;  // fp16 scale
  int8_t qs[32];
};
struct BlockQ4_0 {
  uint16_t d;  // fp16 scale
  // Element j in the low nibble of qs[j], element j+16 in the high nibble; value (q-8)*d.
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ4_0) == 18);

// ggml's K-quants: super-blocks of 256 values along a row (ggml-common.h's block_q4_K etc.).
inline constexpr int kSuperBlock = 256;
// Q4_K: eight sub-blocks of 32, each with a 6-bit scale and a 6-bit min packed in `scales`
// (sub-block j < 4: scales[j] & 63, scales[j + 4] & 63; j >= 4: the low nibbles of scales[j + 4]
// with the top two bits of scales[j - 4] as bits 4-5, and for the min the high nibble of
// scales[j + 4] with the top bits of scales[j]). Value d * scale_j * q - dmin * min_j, q the
// nibbles of qs: each 32 bytes hold sub-blocks 2i (low nibbles) and 2i + 1 (high nibbles).
struct BlockQ4_K {
  uint16_t d;     // fp16 scale of the scales
  uint16_t dmin;  // fp16 scale of the mins
  uint8_t scales[12];
  uint8_t qs[128];
};
// Q5_K: Q4_K plus a fifth bit: bit 2i of qh[l] is the high bit of value l of sub-block 2i, bit
// 2i + 1 that of value l of sub-block 2i + 1 (q in 0..31).
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
// Q6_K: sixteen sub-blocks of 16 with int8 scales; value d * scale * (q - 32), q in 0..63 from
// the four low bits in ql and two high bits in qh. Each half of 128 values: value l + 32k
// (l < 32, k < 4) takes ql[l + 32 (k & 1)] (low nibble for k < 2, high for k >= 2) and bits
// 2k..2k+1 of qh[l].
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
// Sub-block j's (0..7) 6-bit scale and min from a Q4_K / Q5_K `scales` array (ggml's
// get_scale_min_k4).
inline void KScaleMin(const uint8_t* scales, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = scales[j] & 63;
    *min = scales[j + 4] & 63;
  } else {
    *scale = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
    *min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);

absl::string_view DTypeName(DType t);
// name: "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K".
absl::StatusOr<DType> DTypeFromName(absl::string_view name);

// Bytes used by `n` consecutive elements (n must be a multiple of BlockElems(t)).
size_t RowBytes(DType t, int64_t n);
// Block types (Q8_0, Q4_0 and the K-quants): their rows multiply quantized activations.
bool IsQuantized(DType t);
// Q4_K, Q5_K, Q6_K: rows multiply activations quantized to Q8_K (256-value blocks).
bool IsKQuant(DType t);
// Elements per block: 1 for F32/F16/BF16, 32 for Q8_0/Q4_0, 256 for the K-quants.
int BlockElems(DType t);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // outermost first
  const void* data = nullptr;
  // Bytes from one row to the next; 0 = packed (row_bytes()). A strided view interleaves its rows
  // with another tensor's (FfnRowStore keeps a neuron's gate, up and down rows side by side); only
  // row() honours it, so it is for row-wise readers.
  size_t row_stride = 0;

  int64_t rows() const { return shape.size() == 1 ? 1 : shape[0]; }
  int64_t cols() const { return shape.back(); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  // A shape with a zero extent (legal in safetensors) holds no bytes.
  size_t nbytes() const {
    return cols() == 0 ? 0 : RowBytes(dtype, cols()) * static_cast<size_t>(numel() / cols());
  }
  size_t row_bytes() const { return RowBytes(dtype, cols()); }
  const uint8_t* row(int64_t r) const {
    return static_cast<const uint8_t*>(data) +
           static_cast<size_t>(r) * (row_stride != 0 ? row_stride : row_bytes());
  }
  bool empty() const { return data == nullptr; }
};

// Converts `n` elements of one row in any dtype to fp32.
void DequantizeRow(DType t, const void* src, float* dst, int64_t n);
// Quantizes/converts `n` fp32 values to dtype t (n a multiple of BlockElems(t)) with ggml's
// reference quantizers (for the K types, kquant_quantize.h), so the blocks equal llama.cpp's.
void QuantizeRow(DType t, const float* src, void* dst, int64_t n);

}  // namespace pinfer
