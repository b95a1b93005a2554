// See tensor.h. These are the plain, scalar definitions of the storage formats; the optimised
// kernels in shared/engine are tested against them.
#include "absl/strings/string_view.h"
#include "shared/model/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "shared/util/half.h"

namespace pinfer {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kQ8_0: return "Q8_0";
    case DType::kQ4_0: return "Q4_0";
  }
  return "?";
}

absl::StatusOr<DType> DTypeFromName(absl::string_view name) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0}) {
    if (absl::EqualsIgnoreCase(name, DTypeName(t))) return t;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

bool IsQuantized(DType t) { return t == DType::kQ8_0 || t == DType::kQ4_0; }

size_t RowBytes(DType t, int64_t n) {
  switch (t) {
    case DType::kF32: return 4 * static_cast<size_t>(n);
    case DType::kF16:
    case DType::kBF16: return 2 * static_cast<size_t>(n);
    case DType::kQ8_0: return sizeof(BlockQ8_0) * static_cast<size_t>(n / kQuantBlock);
    case DType::kQ4_0: return sizeof(BlockQ4_0) * static_cast<size_t>(n / kQuantBlock);
  }
  return 0;
}

void DequantizeRow(DType t, const void* src, float* dst, int64_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, 4 * n);
      return;
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(s[i]);
      return;
    }
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFp32(s[i]);
      return;
    }
    case DType::kQ8_0: {
      const BlockQ8_0* b = static_cast<const BlockQ8_0*>(src);
      for (int64_t i = 0; i < n / kQuantBlock; ++i) {
        float d = Fp16ToFp32(b[i].d);
        for (int j = 0; j < 32; ++j) dst[i * 32 + j] = d * b[i].qs[j];
      }
      return;
    }
    case DType::kQ4_0: {
      const BlockQ4_0* b = static_cast<const BlockQ4_0*>(src);
      for (int64_t i = 0; i < n / kQuantBlock; ++i) {
        float d = Fp16ToFp32(b[i].d);
        for (int j = 0; j < 16; ++j) {
          dst[i * 32 + j] = d * ((b[i].qs[j] & 0x0f) - 8);
          dst[i * 32 + j + 16] = d * ((b[i].qs[j] >> 4) - 8);
        }
      }
      return;
    }
  }
}

void QuantizeRow(DType t, const float* src, void* dst, int64_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, 4 * n);
      return;
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = Fp32ToFp16(src[i]);
      return;
    }
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = Fp32ToBf16(src[i]);
      return;
    }
    case DType::kQ8_0: {
      BlockQ8_0* b = static_cast<BlockQ8_0*>(dst);
      for (int64_t i = 0; i < n / kQuantBlock; ++i) {
        const float* x = src + i * 32;
        float amax = 0;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
        float d = amax / 127.f;
        float id = d != 0 ? 1.f / d : 0.f;
        b[i].d = Fp32ToFp16(d);
        for (int j = 0; j < 32; ++j) b[i].qs[j] = static_cast<int8_t>(std::lround(x[j] * id));
      }
      return;
    }
    case DType::kQ4_0: {
      // ggml's rule: the value with the largest magnitude maps to -8.
      BlockQ4_0* b = static_cast<BlockQ4_0*>(dst);
      for (int64_t i = 0; i < n / kQuantBlock; ++i) {
        const float* x = src + i * 32;
        float amax = 0, max = 0;
        for (int j = 0; j < 32; ++j) {
          if (std::fabs(x[j]) > amax) {
            amax = std::fabs(x[j]);
            max = x[j];
          }
        }
        float d = max / -8.f;
        float id = d != 0 ? 1.f / d : 0.f;
        b[i].d = Fp32ToFp16(d);
        for (int j = 0; j < 16; ++j) {
          int q0 = std::min(15, static_cast<int>(x[j] * id + 8.5f));
          int q1 = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
          b[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
      }
      return;
    }
  }
}

}  // namespace pinfer
