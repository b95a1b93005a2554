// See ggml_dequant.h. The block layouts are ggml's (ggml-common.h): little-endian, fp16 scales.
#include "shared/model/ggml_dequant.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
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

void PutU16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// ggml's quantize_row_q5_0_ref for one block: the value of largest magnitude maps to -16.
void QuantQ5_0(const float* x, uint8_t* b) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -16;
  const float id = d ? 1.0f / d : 0.0f;
  PutU16(b, Fp32ToFp16(d));
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xi0 = static_cast<uint8_t>(
        std::min(31, static_cast<int>(static_cast<int8_t>(x[j] * id + 16.5f))));
    const uint8_t xi1 = static_cast<uint8_t>(
        std::min(31, static_cast<int>(static_cast<int8_t>(x[16 + j] * id + 16.5f))));
    b[6 + j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
    qh |= ((xi0 & 0x10u) >> 4) << j;
    qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
  }
  PutU32(b + 2, qh);
}

// ggml's quantize_row_q5_1_ref for one block: 32 levels from the block's min to its max.
void QuantQ5_1(const float* x, uint8_t* b) {
  float min = FLT_MAX, max = -FLT_MAX;
  for (int j = 0; j < 32; ++j) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
  const float d = (max - min) / ((1 << 5) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  PutU16(b, Fp32ToFp16(d));
  PutU16(b + 2, Fp32ToFp16(min));
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xi0 = static_cast<uint8_t>((x[j] - min) * id + 0.5f);
    const uint8_t xi1 = static_cast<uint8_t>((x[16 + j] - min) * id + 0.5f);
    b[8 + j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
    qh |= ((xi0 & 0x10u) >> 4) << j;
    qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
  }
  PutU32(b + 4, qh);
}

}  // namespace

absl::Status QuantizeGgmlRow(uint32_t type, const float* src, void* dst, int64_t n) {
  const GgmlType t = static_cast<GgmlType>(type);
  if (t == GgmlType::kQ5_0 || t == GgmlType::kQ5_1) {
    if (n % 32 != 0) return absl::InvalidArgumentError("rows must be whole 32-value blocks");
    uint8_t* out = static_cast<uint8_t*>(dst);
    const int size = FindGgmlTypeTraits(type)->type_size;
    for (int64_t i = 0; i < n / 32; ++i) {
      if (t == GgmlType::kQ5_0) {
        QuantQ5_0(src + 32 * i, out + size * i);
      } else {
        QuantQ5_1(src + 32 * i, out + size * i);
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<DType> dt = DTypeFromGgmlType(type);
  if (!dt.ok()) return dt.status();
  if (n % BlockElems(*dt) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows of ", n, " are not whole ", DTypeName(*dt), " blocks"));
  }
  QuantizeRow(*dt, src, dst, n);
  return absl::OkStatus();
}

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
