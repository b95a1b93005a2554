// The Llama forward pass, written once against CpuOps so that the same code runs the plain
// reference operators and the optimised ones.
//
// The FFN is a pluggable FfnBlock: dense by default; the activation-locality work plugs in sparse
// (predictor-driven) and split (hot rows here, cold rows in the cpu-worker) versions without
// touching the rest of the pass.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"

namespace pinfer {

// Per-sequence key/value cache: k, v: [n_layers, max_ctx, kv_dim], zero-initialised.
struct KvCache {
  KvCache(const ModelConfig& c, int max_ctx)
      : max_ctx(max_ctx),
        kv_dim(c.kv_dim()),
        k(Allocate(static_cast<size_t>(c.n_layers) * max_ctx * c.kv_dim())),
        v(Allocate(static_cast<size_t>(c.n_layers) * max_ctx * c.kv_dim())) {}
  float* k_at(int layer, int pos) {
    return k.get() + (static_cast<size_t>(layer) * max_ctx + pos) * kv_dim;
  }
  float* v_at(int layer, int pos) {
    return v.get() + (static_cast<size_t>(layer) * max_ctx + pos) * kv_dim;
  }
  int max_ctx;
  int kv_dim;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  // From AllocateAligned: caches of 2 MiB and more in transparent huge pages, since each decode
  // step reads every cached row of every layer, a new 4 KiB page every row or so, and the TLB
  // misses cost ~6% of a Q4_0 decode step (measured on the benchmark model).
  static std::unique_ptr<float[], Free> Allocate(size_t n);
  std::unique_ptr<float[], Free> k, v;
};

// Computes one layer's FFN: out: [n, hidden] = down(act(gate(x)) * up(x)), x: [n, hidden] (after
// the FFN RMSNorm). Implementations may skip neurons whose activation is (predicted to be) zero.
class FfnBlock {
 public:
  virtual ~FfnBlock() = default;
  virtual absl::Status Forward(int layer, const float* x, int n, float* out) = 0;
  // The same, also given the FFN's input before its norm (residual: [n, hidden]; x is
  // RmsNorm(residual) * ffn_norm). Blocks whose predictors were trained on the residual
  // (PowerInfer's) need it to apply a non-zero score threshold exactly; the others ignore it.
  virtual absl::Status ForwardFromResidual(int layer, const float* residual, const float* x, int n,
                                           float* out) {
    (void)residual;
    return Forward(layer, x, n, out);
  }
};

// The dense FFN: every neuron, exactly as the model defines it.
class DenseFfn : public FfnBlock {
 public:
  DenseFfn(const Model& model, const CpuOps& ops) : model_(model), ops_(ops) {}
  absl::Status Forward(int layer, const float* x, int n, float* out) override;

 private:
  const Model& model_;
  const CpuOps& ops_;
  std::vector<float> gate_, up_;
};

enum class LogitsMode { kLast, kAll, kNone };

class Transformer {
 public:
  // `model` and `ops` must outlive the transformer.
  Transformer(const Model& model, const CpuOps& ops);

  // Replaces the dense FFN (not owned; null restores dense).
  void set_ffn(FfnBlock* ffn) { ffn_ = ffn != nullptr ? ffn : &dense_ffn_; }

  // Runs `tokens` at positions pos0.. of one sequence, appending to `cache`.
  // logits: [vocab] for kLast, [n, vocab] for kAll.
  absl::Status Forward(std::span<const int32_t> tokens, int pos0, KvCache* cache, LogitsMode mode,
                       float* logits);

  // One decode step (one new token) for each of several sequences at once, so that every weight
  // is read once for the whole batch (continuous batching in the gpu-worker). Every projection
  // runs row by row (CpuOps::MatMulRows, the kernel Forward uses for a single token) and attention
  // runs per sequence, so each sequence's logits are bit-identical to its own one-token Forward,
  // whatever else is in the batch (the FFN block must keep that property too; DenseFfn batches
  // with MatMul and does not). logits may be null for a step.
  struct DecodeStep {
    int32_t token;
    int pos;
    KvCache* cache;
    float* logits;  // [vocab] or null
  };
  absl::Status ForwardDecodeBatch(std::span<const DecodeStep> steps);

  // The FFN input of the last Forward, per layer: [n, hidden] (profiling and predictor training
  // read it). Only kept when `keep_ffn_inputs` is set.
  void set_keep_ffn_inputs(bool keep) { keep_ffn_inputs_ = keep; }
  const std::vector<std::vector<float>>& ffn_inputs() const { return ffn_inputs_; }

  const Model& model() const { return model_; }
  const CpuOps& ops() const { return ops_; }

 private:
  const Model& model_;
  const CpuOps& ops_;
  DenseFfn dense_ffn_;
  FfnBlock* ffn_;
  std::vector<float> inv_freq_;                               // [head_dim / 2]
  std::vector<std::vector<float>> attn_norm_, ffn_norm_;      // fp32 copies of the norm weights
  std::vector<std::vector<float>> q_bias_, k_bias_, v_bias_;  // fp32 biases (Qwen2), else empty
  std::vector<float> out_norm_;
  bool keep_ffn_inputs_ = false;
  std::vector<std::vector<float>> ffn_inputs_;
  // Scratch, grown to the largest batch seen.
  std::vector<float> x_, xb_, q_, k_, v_, att_, ffn_out_;
  std::vector<float> batch_logits_;  // ForwardDecodeBatch: [batch, vocab]
  std::vector<int32_t> all_rows_;    // 0, 1, 2, ... for MatMulRows over whole matrices
};

// RoPE inverse frequencies, including Llama-3 scaling.
std::vector<float> RopeInverseFrequencies(const ModelConfig& c);

}  // namespace pinfer
