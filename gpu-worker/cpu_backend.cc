// The gpu-worker's CPU backend: the engine's Transformer, with the FFN replaced by SplitFfn,
// which publishes each layer's FFN input to the cpu-worker, computes the hot neurons meanwhile
// (so both processes work on the layer at the same time), then adds the cold contribution.
#include <chrono>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "gpu-worker/backend.h"
#include "shared/engine/transformer.h"
#include "shared/sparse/sparse_ffn.h"

namespace pinfer::gpuworker {
namespace {

uint64_t Now() { return shm::MonotonicNanos(); }

class SplitFfn : public FfnBlock {
 public:
  SplitFfn(const Model& model, std::unique_ptr<FfnRowStore> hot_rows, const CpuOps& ops,
           shm::ExchangeClient* exchange, BackendStats* stats, const PredictorSet* predictors)
      : model_(model),
        hot_rows_(std::move(hot_rows)),
        hot_(*hot_rows_, model.config.activation, ops),
        ops_(ops),
        exchange_(exchange),
        stats_(stats),
        predictors_(predictors) {}

  absl::Status ForwardFromResidual(int layer, const float* residual, const float* x, int n,
                                   float* out) override {
    residual_ = residual;
    absl::Status st = Forward(layer, x, n, out);
    residual_ = nullptr;
    return st;
  }

  absl::Status Forward(int layer, const float* x, int n, float* out) override {
    const int H = model_.config.hidden_size;
    const int max_tokens = exchange_->segment().geometry().max_tokens;
    const int W = exchange_->segment().geometry().words_per_mask();
    const uint64_t hot_k = hot_rows_->layer(layer).neurons.size();
    for (int t0 = 0; t0 < n; t0 += max_tokens) {
      const int m = std::min(max_tokens, n - t0);
      const float* xc = x + static_cast<size_t>(t0) * H;
      float* oc = out + static_cast<size_t>(t0) * H;
      // Sparse mode: the predictor picks each token's neurons, for both sides.
      const uint64_t* masks = nullptr;
      if (predictors_ != nullptr) {
        const float* rc = residual_ != nullptr ? residual_ + static_cast<size_t>(t0) * H : nullptr;
        absl::StatusOr<const uint64_t*> predicted = Predict(layer, xc, rc, m, W);
        if (!predicted.ok()) return predicted.status();
        masks = *predicted;
      }
      // x: [m, hidden] goes to the cpu-worker first, so that it computes while we do.
      absl::StatusOr<uint32_t> seq = exchange_->Post(layer, xc, m, masks);
      if (!seq.ok()) return seq.status();
      std::fill(oc, oc + static_cast<size_t>(m) * H, 0.f);
      const uint64_t a = Now();
      stats_->hot_neurons += hot_.Accumulate(layer, xc, m, masks, W, oc);  // out: [m, hidden]
      const uint64_t b = Now();
      shm::ExchangeStats xs;
      absl::Status st = exchange_->AwaitAndAdd(*seq, m, oc, &xs);
      const uint64_t c = Now();
      stats_->hot_ffn_ns += b - a;
      stats_->exchange_wait_ns += c - b;
      stats_->wait_samples.push_back((c - b) * 1e-9);
      stats_->exchanges += 1;
      stats_->cold_neurons += xs.cold_neurons;
      stats_->hot_candidates += hot_k * m;
      stats_->cold_candidates += (model_.config.ffn_size - hot_k) * m;
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  uint64_t bytes() const { return hot_rows_->bytes(); }
  uint64_t neurons() const { return hot_rows_->neurons(); }

 private:
  // masks: [n][W], bit j set when fc2(relu(fc1(x))) >= the layer's threshold (PowerInfer's
  // rule, as shared/sparse's PredictedSparseFfn applies it, including its rescaling by
  // rms(residual) for predictors of the pre-norm residual). Small batches go row by row so that
  // a token's decision never depends on the rest of the batch.
  absl::StatusOr<const uint64_t*> Predict(int layer, const float* x, const float* residual, int n,
                                          int W) {
    const LayerPredictor& P = predictors_->layers[layer];
    if (ScoresNeedResidual(P) && residual == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", layer,
                       ": predictors of the residual before ffn_norm with "
                       "threshold ",
                       P.threshold, " need the residual"));
    }
    const int F = model_.config.ffn_size, R = P.rank();
    hidden_.resize(static_cast<size_t>(n) * R);
    score_.resize(static_cast<size_t>(n) * F);
    if (static_cast<int>(iota_.size()) < std::max(F, R)) {
      iota_.resize(std::max(F, R));
      for (size_t i = 0; i < iota_.size(); ++i) iota_[i] = static_cast<int32_t>(i);
    }
    const bool rowwise = n <= PartialFfn::kBatchInvariantTokens;
    if (rowwise) {
      ops_.MatMulRows(P.fc1, iota_.data(), R, x, n, hidden_.data());  // hidden: [n, rank]
    } else {
      ops_.MatMul(P.fc1, x, n, hidden_.data());
    }
    for (float& h : hidden_) h = std::max(h, 0.f);
    if (rowwise) {
      ops_.MatMulRows(P.fc2, iota_.data(), F, hidden_.data(), n, score_.data());  // [n, ffn]
    } else {
      ops_.MatMul(P.fc2, hidden_.data(), n, score_.data());
    }
    masks_.assign(static_cast<size_t>(n) * W, 0);
    const int H = model_.config.hidden_size;
    for (int t = 0; t < n; ++t) {
      const float* s = &score_[static_cast<size_t>(t) * F];
      uint64_t* mk = &masks_[static_cast<size_t>(t) * W];
      const float scale =
          ScoreScale(P, residual != nullptr ? residual + static_cast<size_t>(t) * H : nullptr, H,
                     model_.config.norm_eps);
      for (int j = 0; j < F; ++j) {
        if (s[j] * scale >= P.threshold) mk[j >> 6] |= 1ull << (j & 63);
      }
    }
    return masks_.data();
  }

  const Model& model_;
  std::unique_ptr<FfnRowStore> hot_rows_;
  PartialFfn hot_;
  const CpuOps& ops_;
  shm::ExchangeClient* exchange_;
  BackendStats* stats_;
  const PredictorSet* predictors_;
  const float* residual_ = nullptr;  // during ForwardFromResidual
  std::vector<float> hidden_, score_;
  std::vector<int32_t> iota_;
  std::vector<uint64_t> masks_;
};

class CpuBackend : public ComputeBackend {
 public:
  CpuBackend(const Model& model, const CpuOps& ops, std::unique_ptr<FfnRowStore> hot,
             shm::ExchangeClient* exchange, const PredictorSet* predictors)
      : model_(model),
        ffn_(model, std::move(hot), ops, exchange, &stats_, predictors),
        transformer_(model, ops) {
    transformer_.set_ffn(&ffn_);
  }

  std::string name() const override { return "cpu"; }

  absl::StatusOr<int> AcquireSlot(int max_ctx) override {
    if (max_ctx <= 0 || max_ctx > model_.config.max_context) {
      return absl::InvalidArgumentError(absl::StrCat(
          "context of ", max_ctx, " positions; the model supports ", model_.config.max_context));
    }
    const int slot = next_slot_++;
    caches_.emplace(slot, std::make_unique<KvCache>(model_.config, max_ctx));
    return slot;
  }

  void ReleaseSlot(int slot) override { caches_.erase(slot); }

  // A kept cache was sized for its first sequence; a longer one gets a larger cache with the
  // kept positions copied over (a memcpy per layer, far cheaper than computing them again).
  absl::Status ReuseSlot(int slot, int max_ctx, int keep) override {
    auto it = caches_.find(slot);
    if (it == caches_.end()) return absl::InternalError(absl::StrCat("no sequence slot ", slot));
    KvCache& old = *it->second;
    if (max_ctx <= 0 || max_ctx > model_.config.max_context || keep < 0 || keep > old.max_ctx) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot reuse a slot of ", old.max_ctx, " positions for ", max_ctx, " keeping ", keep));
    }
    if (max_ctx <= old.max_ctx) return absl::OkStatus();
    auto grown = std::make_unique<KvCache>(model_.config, max_ctx);
    const size_t row_bytes = static_cast<size_t>(keep) * old.kv_dim * sizeof(float);
    for (int l = 0; l < model_.config.n_layers; ++l) {
      std::memcpy(grown->k_at(l, 0), old.k_at(l, 0), row_bytes);
      std::memcpy(grown->v_at(l, 0), old.v_at(l, 0), row_bytes);
    }
    it->second = std::move(grown);
    return absl::OkStatus();
  }

  uint64_t slot_bytes(int slot) const override {
    auto it = caches_.find(slot);
    if (it == caches_.end()) return 0;
    const ModelConfig& c = model_.config;
    return 2ull * c.n_layers * it->second->max_ctx * c.kv_dim() * sizeof(float);
  }

  absl::Status Forward(int slot, std::span<const int32_t> tokens, int pos0,
                       float* logits) override {
    auto it = caches_.find(slot);
    if (it == caches_.end()) return absl::InternalError(absl::StrCat("no sequence slot ", slot));
    const uint64_t t0 = Now();
    absl::Status st =
        transformer_.Forward(tokens, pos0, it->second.get(),
                             logits != nullptr ? LogitsMode::kLast : LogitsMode::kNone, logits);
    stats_.forward_ns += Now() - t0;
    return st;
  }

  absl::Status DecodeBatch(std::span<const DecodeItem> items) override {
    // Chunks small enough that the split FFN computes every token as it would alone, so the
    // batch never changes a sequence's output (Transformer::ForwardDecodeBatch, PartialFfn).
    const uint64_t t0 = Now();
    absl::Status st;
    for (size_t b = 0; b < items.size() && st.ok(); b += PartialFfn::kBatchInvariantTokens) {
      steps_.clear();
      const size_t e = std::min(items.size(), b + PartialFfn::kBatchInvariantTokens);
      for (size_t i = b; i < e; ++i) {
        auto it = caches_.find(items[i].slot);
        if (it == caches_.end()) {
          return absl::InternalError(absl::StrCat("no sequence slot ", items[i].slot));
        }
        steps_.push_back({items[i].token, items[i].pos, it->second.get(), items[i].logits});
      }
      st = transformer_.ForwardDecodeBatch(steps_);
    }
    stats_.forward_ns += Now() - t0;
    return st;
  }

  uint64_t ffn_bytes() const override { return ffn_.bytes(); }
  uint64_t ffn_neurons() const override { return ffn_.neurons(); }
  uint64_t dense_bytes() const override {
    uint64_t b = model_.tok_embeddings.nbytes() + model_.output_norm.nbytes();
    if (model_.output.data != model_.tok_embeddings.data) b += model_.output.nbytes();
    for (const LayerWeights& L : model_.layers) {
      for (const TensorView* t : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_norm}) {
        b += t->nbytes();
      }
    }
    return b;
  }

  BackendStats TakeStats() override { return std::exchange(stats_, BackendStats{}); }

 private:
  const Model& model_;
  BackendStats stats_;
  SplitFfn ffn_;
  Transformer transformer_;
  std::map<int, std::unique_ptr<KvCache>> caches_;
  std::vector<Transformer::DecodeStep> steps_;
  int next_slot_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCpuBackend(const Model& model, const CpuOps& ops,
                                                              const Placement& placement,
                                                              shm::ExchangeClient* exchange,
                                                              const PredictorSet* predictors,
                                                              ThreadPool* pool) {
  auto hot = FfnRowStore::Build(model, placement.hot, pool);
  if (!hot.ok()) return hot.status();
  return std::unique_ptr<ComputeBackend>(
      new CpuBackend(model, ops, std::move(*hot), exchange, predictors));
}

}  // namespace pinfer::gpuworker
