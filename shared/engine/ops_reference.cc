// The reference operators: plain loops that read like the maths. Everything else is tested
// against these.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/string_view.h"
#include "shared/engine/ops.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {

// x quantized to Q8_0 as llama.cpp's quantize_row_q8_0 does it (with the round-half-even of its
// SIMD versions): per block of 32, d = max|x| / 127, q = round(x * (1 / d)); d kept as fp16.
struct Q8Block {
  float d;
  int32_t q[32];
};

std::vector<Q8Block> QuantizeToQ8(const float* x, int64_t n) {
  std::vector<Q8Block> out(n / 32);
  for (int64_t b = 0; b < n / 32; ++b) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const float d = amax / 127.f;
    const float inv = d != 0.f ? 1.f / d : 0.f;
    out[b].d = Fp16ToFp32(Fp32ToFp16(d));
    for (int i = 0; i < 32; ++i)
      out[b].q[i] = static_cast<int32_t>(std::nearbyint(x[b * 32 + i] * inv));
  }
  return out;
}

// Value i (0..31) of a quantized weight block, as an integer: Q8_0 q, Q4_0 nibble - 8.
int32_t BlockValue(DType t, const uint8_t* block, int i) {
  if (t == DType::kQ8_0) return reinterpret_cast<const BlockQ8_0*>(block)->qs[i];
  const uint8_t byte = reinterpret_cast<const BlockQ4_0*>(block)->qs[i % 16];
  return (i < 16 ? (byte & 0x0f) : (byte >> 4)) - 8;
}

// x quantized to Q8_K as ggml's quantize_row_q8_K does it: per block of 256 the value of largest
// magnitude m maps to -127, q = min(127, round(x * (-127 / m))), d = 1 / (-127 / m) in fp32.
struct Q8KBlock {
  float d;
  int32_t q[256];
};

std::vector<Q8KBlock> QuantizeToQ8K(const float* x, int64_t n) {
  std::vector<Q8KBlock> out(n / 256);
  for (int64_t b = 0; b < n / 256; ++b) {
    const float* xb = x + b * 256;
    float amax = 0, max = 0;
    for (int i = 0; i < 256; ++i) {
      if (std::fabs(xb[i]) > amax) {
        amax = std::fabs(xb[i]);
        max = xb[i];
      }
    }
    out[b].d = 0;
    for (int i = 0; i < 256; ++i) out[b].q[i] = 0;
    if (amax == 0) continue;
    const float iscale = -127.f / max;
    for (int i = 0; i < 256; ++i) {
      out[b].q[i] = std::min(127, static_cast<int32_t>(std::nearbyint(iscale * xb[i])));
    }
    out[b].d = 1.f / iscale;
  }
  return out;
}

// A K-quant super-block as integers: value i = scale[i / group] * q[i] - min[i / group] (before
// the block's fp16 factors d and dmin), group 32 (Q4_K, Q5_K) or 16 (Q6_K, whose mins are 0 and
// q is signed).
struct KLevels {
  float d = 0, dmin = 0;
  int group = 32;
  int32_t scale[16] = {}, min[16] = {};
  int32_t q[256] = {};
};

KLevels UnpackK(DType t, const uint8_t* block) {
  KLevels k;
  if (t == DType::kQ6_K) {
    const BlockQ6_K& b = *reinterpret_cast<const BlockQ6_K*>(block);
    k.d = Fp16ToFp32(b.d);
    k.group = 16;
    for (int g = 0; g < 16; ++g) k.scale[g] = b.scales[g];
    for (int i = 0; i < 256; ++i) {
      const int half = i / 128, l = i % 32, quarter = (i % 128) / 32;
      const uint8_t low_byte = b.ql[64 * half + l + (quarter % 2 == 1 ? 32 : 0)];
      const int low = quarter < 2 ? low_byte % 16 : low_byte / 16;
      const int high = (b.qh[32 * half + l] >> (2 * quarter)) % 4;
      k.q[i] = low + 16 * high - 32;
    }
    return k;
  }
  const bool q5 = t == DType::kQ5_K;
  const uint8_t* scales = q5 ? reinterpret_cast<const BlockQ5_K*>(block)->scales
                             : reinterpret_cast<const BlockQ4_K*>(block)->scales;
  const uint8_t* qs = q5 ? reinterpret_cast<const BlockQ5_K*>(block)->qs
                         : reinterpret_cast<const BlockQ4_K*>(block)->qs;
  uint16_t d, dmin;
  std::memcpy(&d, block, 2);
  std::memcpy(&dmin, block + 2, 2);
  k.d = Fp16ToFp32(d);
  k.dmin = Fp16ToFp32(dmin);
  for (int j = 0; j < 8; ++j) KScaleMin(scales, j, &k.scale[j], &k.min[j]);
  for (int i = 0; i < 256; ++i) {
    const int sub = i / 32, l = i % 32;
    const uint8_t byte = qs[32 * (sub / 2) + l];
    k.q[i] = sub % 2 == 0 ? byte % 16 : byte / 16;
    if (q5) k.q[i] += 16 * ((reinterpret_cast<const BlockQ5_K*>(block)->qh[l] >> sub) & 1);
  }
  return k;
}

// One K-quant row against x quantized to Q8_K, ggml's ggml_vec_dot_q*_K_q8_K: per super-block
// d * d_x * sum_i scale * q_i * x_i - dmin * d_x * sum_i min * x_i, both integer sums exact.
float KRowDot(DType t, const uint8_t* row, const std::vector<Q8KBlock>& xq) {
  const size_t block_bytes = RowBytes(t, 256);
  float sum = 0;
  for (size_t b = 0; b < xq.size(); ++b) {
    const KLevels k = UnpackK(t, row + b * block_bytes);
    int64_t scaled = 0, mins = 0;
    for (int i = 0; i < 256; ++i) {
      scaled += int64_t{k.scale[i / k.group]} * k.q[i] * xq[b].q[i];
      mins += int64_t{k.min[i / k.group]} * xq[b].q[i];
    }
    sum += k.d * xq[b].d * static_cast<float>(scaled) - k.dmin * xq[b].d * static_cast<float>(mins);
  }
  return sum;
}

// y[t * n_rows + i] = w.row(row_ids[i]) . x[t]. Q8_0 and Q4_0 rows multiply x quantized to Q8_0
// with exact integer dots per block, sum_b d_w * d_x * sum_i w_i q_i (llama.cpp's definition);
// Q4_K, Q5_K and Q6_K rows x quantized to Q8_K (KRowDot); other dtypes multiply fp32 x.
void RowsTimesVectors(const TensorView& w, const std::vector<int64_t>& row_ids, const float* x,
                      int n, float* y) {
  const int64_t cols = w.cols(), n_rows = static_cast<int64_t>(row_ids.size());
  if (IsKQuant(w.dtype)) {
    std::vector<std::vector<Q8KBlock>> xq;
    for (int t = 0; t < n; ++t) xq.push_back(QuantizeToQ8K(x + t * cols, cols));
    for (int64_t i = 0; i < n_rows; ++i) {
      for (int t = 0; t < n; ++t) y[t * n_rows + i] = KRowDot(w.dtype, w.row(row_ids[i]), xq[t]);
    }
    return;
  }
  if (IsQuantized(w.dtype)) {
    std::vector<std::vector<Q8Block>> xq;
    for (int t = 0; t < n; ++t) xq.push_back(QuantizeToQ8(x + t * cols, cols));
    const size_t block_bytes = RowBytes(w.dtype, 32);
    for (int64_t i = 0; i < n_rows; ++i) {
      for (int t = 0; t < n; ++t) {
        float sum = 0;
        for (int64_t b = 0; b < cols / 32; ++b) {
          const uint8_t* block = w.row(row_ids[i]) + b * block_bytes;
          int32_t dot = 0;
          for (int k = 0; k < 32; ++k) dot += BlockValue(w.dtype, block, k) * xq[t][b].q[k];
          uint16_t d_w;
          std::memcpy(&d_w, block, 2);  // both block types start with their fp16 scale
          sum += Fp16ToFp32(d_w) * xq[t][b].d * static_cast<float>(dot);
        }
        y[t * n_rows + i] = sum;
      }
    }
    return;
  }
  std::vector<float> row(cols);
  for (int64_t i = 0; i < n_rows; ++i) {
    DequantizeRow(w.dtype, w.row(row_ids[i]), row.data(), cols);
    for (int t = 0; t < n; ++t) {
      float sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += row[c] * x[t * cols + c];
      y[t * n_rows + i] = sum;
    }
  }
}

class ReferenceOps : public CpuOps {
 public:
  absl::string_view name() const override { return "reference"; }

  void MatMul(const TensorView& w, const float* x, int n, float* y) const override {
    std::vector<int64_t> all(w.rows());
    for (int64_t r = 0; r < w.rows(); ++r) all[r] = r;
    RowsTimesVectors(w, all, x, n, y);
  }

  void MatMulRows(const TensorView& w, const int32_t* rows, int n_rows, const float* x, int n,
                  float* y) const override {
    RowsTimesVectors(w, std::vector<int64_t>(rows, rows + n_rows), x, n, y);
  }

  void AccumulateRows(const TensorView& w, const int32_t* rows, int n_rows, const float* a, int n,
                      float* y) const override {
    const int64_t cols = w.cols();
    std::vector<float> row(cols);
    for (int i = 0; i < n_rows; ++i) {
      DequantizeRow(w.dtype, w.row(rows[i]), row.data(), cols);
      for (int t = 0; t < n; ++t) {
        float coef = a[t * n_rows + i];
        if (coef == 0) continue;
        for (int64_t c = 0; c < cols; ++c) y[t * cols + c] += coef * row[c];
      }
    }
  }

  int SparseFfnToken(const TensorView& gate, const TensorView& up, const TensorView& down_t,
                     const int32_t* rows, int n_rows, Activation act, const float* x,
                     const float* gate_values, float* a, float* out) const override {
    const bool gate_decides = act != Activation::kSilu;
    int ups = 0;
    for (int i = 0; i < n_rows; ++i) {
      float g, u;
      if (gate_values != nullptr) {
        g = gate_values[i];
      } else {
        MatMulRows(gate, rows + i, 1, x, 1, &g);
      }
      a[i] = 0;
      if (gate_decides && g <= 0) continue;
      MatMulRows(up, rows + i, 1, x, 1, &u);
      ++ups;
      a[i] = g;
      GatedActivation(act, &a[i], &u, 1);
    }
    AccumulateRows(down_t, rows, n_rows, a, 1, out);
    return ups;
  }

  void RmsNorm(const float* x, const float* weight, int n, int dim, float eps,
               float* out) const override {
    for (int t = 0; t < n; ++t) {
      const float* xt = x + static_cast<int64_t>(t) * dim;
      float ss = 0;
      for (int i = 0; i < dim; ++i) ss += xt[i] * xt[i];
      float scale = 1.f / std::sqrt(ss / dim + eps);
      for (int i = 0; i < dim; ++i) out[t * dim + i] = xt[i] * scale * weight[i];
    }
  }

  void Rope(float* x, int n, int n_heads, int head_dim, const int32_t* positions,
            const float* inv_freq, bool interleaved) const override {
    const int half = head_dim / 2;
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < n_heads; ++h) {
        float* v = x + (static_cast<int64_t>(t) * n_heads + h) * head_dim;
        for (int i = 0; i < half; ++i) {
          float angle = static_cast<float>(positions[t]) * inv_freq[i];
          float c = std::cos(angle), s = std::sin(angle);
          int a = interleaved ? 2 * i : i;
          int b = interleaved ? 2 * i + 1 : i + half;
          float x0 = v[a], x1 = v[b];
          v[a] = x0 * c - x1 * s;
          v[b] = x0 * s + x1 * c;
        }
      }
    }
  }

  void Attention(const float* q, const float* k, const float* v, int n, int pos0, int n_heads,
                 int n_kv_heads, int head_dim, int window, float* out) const override {
    const int group = n_heads / n_kv_heads;
    const int kv_stride = n_kv_heads * head_dim;
    const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
    std::vector<float> scores(pos0 + n);
    for (int t = 0; t < n; ++t) {
      const int pos = pos0 + t;
      const int first = window > 0 ? std::max(0, pos - window + 1) : 0;  // keys first..pos
      for (int h = 0; h < n_heads; ++h) {
        const float* qh = q + (static_cast<int64_t>(t) * n_heads + h) * head_dim;
        const int kvh = h / group;
        float max = -INFINITY;
        for (int p = first; p <= pos; ++p) {
          const float* kp = k + static_cast<int64_t>(p) * kv_stride + kvh * head_dim;
          float dot = 0;
          for (int i = 0; i < head_dim; ++i) dot += qh[i] * kp[i];
          scores[p] = dot * scale;
          max = std::max(max, scores[p]);
        }
        float sum = 0;
        for (int p = first; p <= pos; ++p) {
          scores[p] = std::exp(scores[p] - max);
          sum += scores[p];
        }
        float* oh = out + (static_cast<int64_t>(t) * n_heads + h) * head_dim;
        for (int i = 0; i < head_dim; ++i) oh[i] = 0;
        for (int p = first; p <= pos; ++p) {
          const float* vp = v + static_cast<int64_t>(p) * kv_stride + kvh * head_dim;
          float wgt = scores[p] / sum;
          for (int i = 0; i < head_dim; ++i) oh[i] += wgt * vp[i];
        }
      }
    }
  }

  void GatedActivation(Activation act, float* gate, const float* up, int64_t n) const override {
    for (int64_t i = 0; i < n; ++i) {
      float g = gate[i];
      switch (act) {
        case Activation::kSilu:
          gate[i] = g / (1.f + std::exp(-g)) * up[i];
          break;
        case Activation::kRelu:
          gate[i] = (g > 0 ? g : 0.f) * up[i];
          break;
        case Activation::kDRelu:
          gate[i] = (g > 0 ? g : 0.f) * (up[i] > 0 ? up[i] : 0.f);
          break;
      }
    }
  }
};

}  // namespace

std::unique_ptr<CpuOps> NewReferenceOps() { return std::make_unique<ReferenceOps>(); }

}  // namespace pinfer
