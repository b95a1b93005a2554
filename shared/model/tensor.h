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

enum class DType : uint8_t { kF32, kF16, kBF16, kQ8_0, kQ4_0 };

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

absl::string_view DTypeName(DType t);
// name: "F32", "F16", "BF16", "Q8_0", "Q4_0".
absl::StatusOr<DType> DTypeFromName(absl::string_view name);

// Bytes used by `n` consecutive elements (n must be a multiple of 32 for quantized types).
size_t RowBytes(DType t, int64_t n);
bool IsQuantized(DType t);

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
  size_t nbytes() const { return RowBytes(dtype, cols()) * static_cast<size_t>(numel() / cols()); }
  size_t row_bytes() const { return RowBytes(dtype, cols()); }
  const uint8_t* row(int64_t r) const {
    return static_cast<const uint8_t*>(data) +
           static_cast<size_t>(r) * (row_stride != 0 ? row_stride : row_bytes());
  }
  bool empty() const { return data == nullptr; }
};

// Converts `n` elements of one row in any dtype to fp32.
void DequantizeRow(DType t, const void* src, float* dst, int64_t n);
// Quantizes/converts `n` fp32 values to dtype t (n a multiple of 32 for quantized types), ggml's
// reference rounding.
void QuantizeRow(DType t, const float* src, void* dst, int64_t n);

}  // namespace pinfer
