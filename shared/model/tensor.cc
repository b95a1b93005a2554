// See tensor.h. These are the plain, scalar definitions of the storage formats; the optimised
// kernels in shared/engine are tested against them.
#include "shared/model/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "shared/model/kquant_quantize.h"
#include "shared/util/half.h"

namespace pinfer {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kQ8_0:
      return "Q8_0";
    case DType::kQ4_0:
      return "Q4_0";
    case DType::kQ4_K:
      return "Q4_K";
    case DType::kQ5_K:
      return "Q5_K";
    case DType::kQ6_K:
      return "Q6_K";
  }
  return "?";
}

absl::StatusOr<DType> DTypeFromName(absl::string_view name) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_K,
                  DType::kQ5_K, DType::kQ6_K}) {
    if (absl::EqualsIgnoreCase(name, DTypeName(t))) return t;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

bool IsQuantized(DType t) { return t == DType::kQ8_0 || t == DType::kQ4_0 || IsKQuant(t); }

bool IsKQuant(DType t) { return t == DType::kQ4_K || t == DType::kQ5_K || t == DType::kQ6_K; }

int BlockElems(DType t) {
  if (IsKQuant(t)) return kSuperBlock;
  return IsQuantized(t) ? kQuantBlock : 1;
}

size_t RowBytes(DType t, int64_t n) {
  switch (t) {
    case DType::kF32:
      return 4 * static_cast<size_t>(n);
    case DType::kF16:
    case DType::kBF16:
      return 2 * static_cast<size_t>(n);
    case DType::kQ8_0:
      return sizeof(BlockQ8_0) * static_cast<size_t>(n / kQuantBlock);
    case DType::kQ4_0:
      return sizeof(BlockQ4_0) * static_cast<size_t>(n / kQuantBlock);
    case DType::kQ4_K:
      return sizeof(BlockQ4_K) * static_cast<size_t>(n / kSuperBlock);
    case DType::kQ5_K:
      return sizeof(BlockQ5_K) * static_cast<size_t>(n / kSuperBlock);
    case DType::kQ6_K:
      return sizeof(BlockQ6_K) * static_cast<size_t>(n / kSuperBlock);
  }
  return 0;
}

namespace {

// ggml's dequantize_row_q4_K / q5_K: d * scale_j as one fp32 factor, then factor * q - dmin *
// min_j. Q4_K passes qh == null.
void DequantQ4Q5K(uint16_t d16, uint16_t dmin16, const uint8_t* scales, const uint8_t* qh,
                  const uint8_t* qs, float* y) {
  const float d = Fp16ToFp32(d16), dmin = Fp16ToFp32(dmin16);
  for (int i = 0; i < 4; ++i) {  // 64 values: sub-blocks 2i (low nibbles) and 2i + 1 (high)
    int sc0, m0, sc1, m1;
    KScaleMin(scales, 2 * i, &sc0, &m0);
    KScaleMin(scales, 2 * i + 1, &sc1, &m1);
    const float d0 = d * sc0, d1 = d * sc1, min0 = dmin * m0, min1 = dmin * m1;
    for (int l = 0; l < 32; ++l) {
      int q0 = qs[32 * i + l] & 0x0f, q1 = qs[32 * i + l] >> 4;
      if (qh != nullptr) {
        q0 += ((qh[l] >> (2 * i)) & 1) << 4;
        q1 += ((qh[l] >> (2 * i + 1)) & 1) << 4;
      }
      y[64 * i + l] = d0 * q0 - min0;
      y[64 * i + 32 + l] = d1 * q1 - min1;
    }
  }
}

// Q6_K value v (0..255) of a block, q - 32.
int Q6KValue(const BlockQ6_K& b, int v) {
  const int h = v / 128, l = v % 32, k = (v % 128) / 32;
  const uint8_t low = b.ql[64 * h + l + 32 * (k & 1)];
  const int lo = k < 2 ? (low & 0x0f) : (low >> 4);
  return (lo | (((b.qh[32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
}

}  // namespace

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
    case DType::kQ4_K: {
      const BlockQ4_K* b = static_cast<const BlockQ4_K*>(src);
      for (int64_t i = 0; i < n / kSuperBlock; ++i) {
        DequantQ4Q5K(b[i].d, b[i].dmin, b[i].scales, nullptr, b[i].qs, dst + i * kSuperBlock);
      }
      return;
    }
    case DType::kQ5_K: {
      const BlockQ5_K* b = static_cast<const BlockQ5_K*>(src);
      for (int64_t i = 0; i < n / kSuperBlock; ++i) {
        DequantQ4Q5K(b[i].d, b[i].dmin, b[i].scales, b[i].qh, b[i].qs, dst + i * kSuperBlock);
      }
      return;
    }
    case DType::kQ6_K: {
      const BlockQ6_K* b = static_cast<const BlockQ6_K*>(src);
      for (int64_t i = 0; i < n / kSuperBlock; ++i) {
        const float d = Fp16ToFp32(b[i].d);
        for (int v = 0; v < kSuperBlock; ++v) {
          dst[i * kSuperBlock + v] = d * b[i].scales[v / 16] * Q6KValue(b[i], v);
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
    case DType::kQ4_K:
      QuantizeRowQ4K(src, static_cast<BlockQ4_K*>(dst), n);
      return;
    case DType::kQ5_K:
      QuantizeRowQ5K(src, static_cast<BlockQ5_K*>(dst), n);
      return;
    case DType::kQ6_K:
      QuantizeRowQ6K(src, static_cast<BlockQ6_K*>(dst), n);
      return;
  }
}

}  // namespace pinfer
