// See transformer.h. The pass reads top to bottom like llama2.c's, batched over n tokens.
// Mistral's sliding window only narrows the cache rows each query attends to (CpuOps::Attention):
// the cache keeps every position, so prefill chunks, decode steps and reused prefix-cache slots
// all see the same keys as one whole-sequence pass would.
#include "shared/engine/transformer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "shared/util/aligned_buffer.h"

namespace pinfer {

std::unique_ptr<float[], KvCache::Free> KvCache::Allocate(size_t n) {
  // AllocateAligned's memory is freed with std::free, as Free does.
  return std::unique_ptr<float[], Free>(
      reinterpret_cast<float*>(AllocateAligned(n * sizeof(float)).release()));
}

std::vector<float> RopeInverseFrequencies(const ModelConfig& c) {
  const int half = c.head_dim / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    // Same expression as transformers: theta ** (-(2i / d)), computed in double then rounded.
    inv[i] = static_cast<float>(
        1.0 / std::pow(static_cast<double>(c.rope_theta), static_cast<double>(2 * i) / c.head_dim));
  }
  if (c.rope_scaling.llama3) {
    const RopeScaling& s = c.rope_scaling;
    const double low_wavelen = s.original_max_position / s.low_freq_factor;
    const double high_wavelen = s.original_max_position / s.high_freq_factor;
    for (int i = 0; i < half; ++i) {
      const double wavelen = 2 * std::numbers::pi / inv[i];
      if (wavelen > low_wavelen) {
        inv[i] = static_cast<float>(inv[i] / s.factor);
      } else if (wavelen >= high_wavelen) {
        const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        inv[i] = static_cast<float>((1 - smooth) * inv[i] / s.factor + smooth * inv[i]);
      }
    }
  }
  return inv;
}

absl::Status DenseFfn::Forward(int layer, const float* x, int n, float* out) {
  const ModelConfig& c = model_.config;
  const LayerWeights& L = model_.layers[layer];
  const size_t nf = static_cast<size_t>(n) * c.ffn_size;
  if (gate_.size() < nf) {
    gate_.resize(nf);
    up_.resize(nf);
  }
  ops_.MatMul(L.gate, x, n, gate_.data());  // gate: [n, ffn]
  ops_.MatMul(L.up, x, n, up_.data());      // up:   [n, ffn]
  ops_.GatedActivation(c.activation, gate_.data(), up_.data(), static_cast<int64_t>(nf));
  ops_.MatMul(L.down, gate_.data(), n, out);  // out:  [n, hidden]
  return absl::OkStatus();
}

namespace {
std::vector<float> ToFloat(const TensorView& t) {
  if (t.empty()) return {};
  std::vector<float> v(t.numel());
  DequantizeRow(t.dtype, t.data, v.data(), t.numel());
  return v;
}

// y: [n, dim] += bias: [dim], for every row; nothing when the model has no bias.
void AddBias(const std::vector<float>& bias, int n, float* y) {
  const size_t dim = bias.size();
  for (int t = 0; t < n; ++t) {
    for (size_t i = 0; i < dim; ++i) y[t * dim + i] += bias[i];
  }
}
}  // namespace

Transformer::Transformer(const Model& model, const CpuOps& ops)
    : model_(model), ops_(ops), dense_ffn_(model, ops), ffn_(&dense_ffn_) {
  inv_freq_ = RopeInverseFrequencies(model.config);
  for (const LayerWeights& L : model.layers) {
    attn_norm_.push_back(ToFloat(L.attn_norm));
    ffn_norm_.push_back(ToFloat(L.ffn_norm));
    q_bias_.push_back(ToFloat(L.bq));
    k_bias_.push_back(ToFloat(L.bk));
    v_bias_.push_back(ToFloat(L.bv));
  }
  out_norm_ = ToFloat(model.output_norm);
}

absl::Status Transformer::Forward(std::span<const int32_t> tokens, int pos0, KvCache* cache,
                                  LogitsMode mode, float* logits) {
  const ModelConfig& c = model_.config;
  const int n = static_cast<int>(tokens.size());
  const int H = c.hidden_size, V = c.vocab_size;
  if (n == 0) return absl::InvalidArgumentError("no tokens to process");
  if (pos0 < 0 || pos0 + n > cache->max_ctx) {
    return absl::OutOfRangeError(absl::StrCat("positions ", pos0, "..", pos0 + n - 1,
                                              " exceed the context of ", cache->max_ctx));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= V)
      return absl::InvalidArgumentError(absl::StrCat("token id ", t, " out of range"));
  }
  const size_t nh = static_cast<size_t>(n) * H;
  if (x_.size() < nh) {
    x_.resize(nh);
    xb_.resize(nh);
    ffn_out_.resize(nh);
    q_.resize(static_cast<size_t>(n) * c.q_dim());
    att_.resize(static_cast<size_t>(n) * c.q_dim());
  }
  if (keep_ffn_inputs_) ffn_inputs_.assign(c.n_layers, {});
  std::vector<int32_t> positions(n);
  for (int t = 0; t < n; ++t) positions[t] = pos0 + t;

  // x: [n, hidden]
  for (int t = 0; t < n; ++t) {
    DequantizeRow(model_.tok_embeddings.dtype, model_.tok_embeddings.row(tokens[t]), &x_[t * H], H);
  }

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model_.layers[l];
    // Attention block. New keys and values go straight into the cache.
    ops_.RmsNorm(x_.data(), attn_norm_[l].data(), n, H, c.norm_eps, xb_.data());
    float* k = cache->k_at(l, pos0);  // k, v: [n, kv_dim] rows of the cache
    float* v = cache->v_at(l, pos0);
    ops_.MatMul(L.wq, xb_.data(), n, q_.data());  // q: [n, q_dim]
    ops_.MatMul(L.wk, xb_.data(), n, k);
    ops_.MatMul(L.wv, xb_.data(), n, v);
    AddBias(q_bias_[l], n, q_.data());
    AddBias(k_bias_[l], n, k);
    AddBias(v_bias_[l], n, v);
    ops_.Rope(q_.data(), n, c.n_heads, c.head_dim, positions.data(), inv_freq_.data(),
              c.rope_interleaved);
    ops_.Rope(k, n, c.n_kv_heads, c.head_dim, positions.data(), inv_freq_.data(),
              c.rope_interleaved);
    ops_.Attention(q_.data(), cache->k_at(l, 0), cache->v_at(l, 0), n, pos0, c.n_heads,
                   c.n_kv_heads, c.head_dim, c.sliding_window, att_.data());  // att: [n, q_dim]
    ops_.MatMul(L.wo, att_.data(), n, xb_.data());                            // xb: [n, hidden]
    for (size_t i = 0; i < nh; ++i) x_[i] += xb_[i];

    // FFN block.
    ops_.RmsNorm(x_.data(), ffn_norm_[l].data(), n, H, c.norm_eps, xb_.data());
    if (keep_ffn_inputs_) ffn_inputs_[l].assign(xb_.begin(), xb_.begin() + nh);
    absl::Status st = ffn_->ForwardFromResidual(l, x_.data(), xb_.data(), n, ffn_out_.data());
    if (!st.ok()) return st;
    for (size_t i = 0; i < nh; ++i) x_[i] += ffn_out_[i];
  }

  if (mode == LogitsMode::kNone) return absl::OkStatus();
  const int first = mode == LogitsMode::kLast ? n - 1 : 0;
  const int count = n - first;
  ops_.RmsNorm(&x_[static_cast<size_t>(first) * H], out_norm_.data(), count, H, c.norm_eps,
               xb_.data());
  ops_.MatMul(model_.output, xb_.data(), count, logits);  // logits: [count, vocab]
  return absl::OkStatus();
}

absl::Status Transformer::ForwardDecodeBatch(std::span<const DecodeStep> steps) {
  const ModelConfig& c = model_.config;
  const int n = static_cast<int>(steps.size());
  const int H = c.hidden_size, V = c.vocab_size, KV = c.kv_dim(), Q = c.q_dim();
  if (n == 0) return absl::InvalidArgumentError("no sequences to step");
  for (const DecodeStep& s : steps) {
    if (s.token < 0 || s.token >= V) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", s.token, " out of range"));
    }
    if (s.pos < 0 || s.pos >= s.cache->max_ctx) {
      return absl::OutOfRangeError(
          absl::StrCat("position ", s.pos, " exceeds the context of ", s.cache->max_ctx));
    }
  }
  const size_t nh = static_cast<size_t>(n) * H;
  if (x_.size() < nh) {
    x_.resize(nh);
    xb_.resize(nh);
    ffn_out_.resize(nh);
  }
  if (q_.size() < static_cast<size_t>(n) * Q) {
    q_.resize(static_cast<size_t>(n) * Q);
    att_.resize(static_cast<size_t>(n) * Q);
  }
  k_.resize(static_cast<size_t>(n) * KV);
  v_.resize(static_cast<size_t>(n) * KV);
  const int max_rows = std::max({V, Q, H, KV});
  if (static_cast<int>(all_rows_.size()) < max_rows) {
    all_rows_.resize(max_rows);
    for (int i = 0; i < max_rows; ++i) all_rows_[i] = i;
  }
  const int32_t* rows = all_rows_.data();
  if (keep_ffn_inputs_) ffn_inputs_.assign(c.n_layers, {});
  std::vector<int32_t> positions(n);
  for (int b = 0; b < n; ++b) positions[b] = steps[b].pos;

  // x: [n, hidden], one row per sequence
  for (int b = 0; b < n; ++b) {
    DequantizeRow(model_.tok_embeddings.dtype, model_.tok_embeddings.row(steps[b].token),
                  &x_[static_cast<size_t>(b) * H], H);
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model_.layers[l];
    ops_.RmsNorm(x_.data(), attn_norm_[l].data(), n, H, c.norm_eps, xb_.data());
    ops_.MatMulRows(L.wq, rows, Q, xb_.data(), n, q_.data());   // q: [n, q_dim]
    ops_.MatMulRows(L.wk, rows, KV, xb_.data(), n, k_.data());  // k, v: [n, kv_dim]
    ops_.MatMulRows(L.wv, rows, KV, xb_.data(), n, v_.data());
    AddBias(q_bias_[l], n, q_.data());
    AddBias(k_bias_[l], n, k_.data());
    AddBias(v_bias_[l], n, v_.data());
    ops_.Rope(q_.data(), n, c.n_heads, c.head_dim, positions.data(), inv_freq_.data(),
              c.rope_interleaved);
    ops_.Rope(k_.data(), n, c.n_kv_heads, c.head_dim, positions.data(), inv_freq_.data(),
              c.rope_interleaved);
    for (int b = 0; b < n; ++b) {
      KvCache* cache = steps[b].cache;
      std::copy_n(&k_[static_cast<size_t>(b) * KV], KV, cache->k_at(l, steps[b].pos));
      std::copy_n(&v_[static_cast<size_t>(b) * KV], KV, cache->v_at(l, steps[b].pos));
      ops_.Attention(&q_[static_cast<size_t>(b) * Q], cache->k_at(l, 0), cache->v_at(l, 0), 1,
                     steps[b].pos, c.n_heads, c.n_kv_heads, c.head_dim, c.sliding_window,
                     &att_[static_cast<size_t>(b) * Q]);  // att: [n, q_dim]
    }
    ops_.MatMulRows(L.wo, rows, H, att_.data(), n, xb_.data());  // xb: [n, hidden]
    for (size_t i = 0; i < nh; ++i) x_[i] += xb_[i];

    ops_.RmsNorm(x_.data(), ffn_norm_[l].data(), n, H, c.norm_eps, xb_.data());
    if (keep_ffn_inputs_) ffn_inputs_[l].assign(xb_.begin(), xb_.begin() + nh);
    absl::Status st = ffn_->ForwardFromResidual(l, x_.data(), xb_.data(), n, ffn_out_.data());
    if (!st.ok()) return st;
    for (size_t i = 0; i < nh; ++i) x_[i] += ffn_out_[i];
  }

  ops_.RmsNorm(x_.data(), out_norm_.data(), n, H, c.norm_eps, xb_.data());
  batch_logits_.resize(static_cast<size_t>(n) * V);
  ops_.MatMulRows(model_.output, rows, V, xb_.data(), n, batch_logits_.data());  // [n, vocab]
  for (int b = 0; b < n; ++b) {
    if (steps[b].logits != nullptr) {
      std::copy_n(&batch_logits_[static_cast<size_t>(b) * V], V, steps[b].logits);
    }
  }
  return absl::OkStatus();
}

}  // namespace pinfer
