// See ggml_dequant.h. The block layouts are ggml's (ggml-common.h): little-endian, fp16 scales.
#include "shared/model/ggml_dequant.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {

uint16_t U16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t U32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// Q4_1: {d, m, qs[16]}; x = q * d + m, low nibbles first.
void DequantQ4_1(const uint8_t* b, float* y) {
  const float d = Fp16ToFp32(U16(b)), m = Fp16ToFp32(U16(b + 2));
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = (qs[j] & 0x0F) * d + m;
    y[j + 16] = (qs[j] >> 4) * d + m;
  }
}

// Q5_0: {d, qh (32 fifth bits), qs[16]}; x = (q - 16) * d.
void DequantQ5_0(const uint8_t* b, float* y) {
  const float d = Fp16ToFp32(U16(b));
  const uint32_t qh = U32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>(((qs[j] & 0x0F) | h0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | h1) - 16) * d;
  }
}

// Q5_1: {d, m, qh, qs[16]}; x = q * d + m.
void DequantQ5_1(const uint8_t* b, float* y) {
  const float d = Fp16ToFp32(U16(b)), m = Fp16ToFp32(U16(b + 2));
  const uint32_t qh = U32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>((qs[j] & 0x0F) | h0) * d + m;
    y[j + 16] = static_cast<float>((qs[j] >> 4) | h1) * d + m;
  }
}

}  // namespace

bool IsDequantizableGgmlType(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
      return true;
    default:
      return false;
  }
}

absl::Status DequantizeGgmlRow(uint32_t type, const void* src, float* dst, int64_t n) {
  if (auto dt = DTypeFromGgmlType(type); dt.ok()) {
    DequantizeRow(*dt, src, dst, n);
    return absl::OkStatus();
  }
  const GgmlTypeTraits* tr = FindGgmlTypeTraits(type);
  if (tr == nullptr || !IsDequantizableGgmlType(type)) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported tensor type ", GgmlTypeName(type)));
  }
  if (n % tr->block_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(n, " values are not whole ", tr->name, " blocks of ", tr->block_size));
  }
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n / tr->block_size; ++i, b += tr->type_size) {
    float* y = dst + i * tr->block_size;
    switch (static_cast<GgmlType>(type)) {
      case GgmlType::kQ4_1:
        DequantQ4_1(b, y);
        break;
      case GgmlType::kQ5_0:
        DequantQ5_0(b, y);
        break;
      default:
        DequantQ5_1(b, y);
        break;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorView> GgufTensorForEngine(
    const GgufFile& f, const std::string& name,
    std::vector<std::shared_ptr<std::vector<uint8_t>>>* owned) {
  const GgufTensorInfo* info = f.FindTensor(name);
  if (info == nullptr || !IsDequantizableGgmlType(info->type)) return f.GetTensor(name);
  TensorView t;
  t.name = info->name;
  t.dtype = DType::kF32;
  t.shape = info->shape();
  const int64_t cols = t.shape.empty() ? 1 : t.shape.back();
  auto buf = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(info->numel()) * 4);
  const GgmlTypeTraits* tr = FindGgmlTypeTraits(info->type);
  if (cols % tr->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": tensor '", name, "' rows of ", cols,
                                                   " are not whole ", tr->name, " blocks"));
  }
  const size_t row_bytes = static_cast<size_t>(cols / tr->block_size) * tr->type_size;
  float* out = reinterpret_cast<float*>(buf->data());
  for (int64_t r = 0; r < info->numel() / cols; ++r) {
    absl::Status st =
        DequantizeGgmlRow(info->type, info->data + r * row_bytes, out + r * cols, cols);
    if (!st.ok()) return st;
  }
  t.data = buf->data();
  owned->push_back(std::move(buf));
  return t;
}

}  // namespace pinfer
