// The gpu-worker's CPU backend: the engine's Transformer, with the FFN replaced by SplitFfn,
// which publishes each layer's FFN input to the cpu-worker, computes the hot neurons meanwhile
// (so both processes work on the layer at the same time), then adds the cold contribution.
#include <chrono>
#include <map>

#include "absl/strings/str_cat.h"
#include "gpu-worker/backend.h"
#include "shared/engine/transformer.h"

namespace pinfer::gpuworker {
namespace {

uint64_t Now() { return shm::MonotonicNanos(); }

class SplitFfn : public FfnBlock {
 public:
  SplitFfn(const Model& model, std::unique_ptr<FfnRowStore> hot_rows, const CpuOps& ops,
           shm::ExchangeClient* exchange, BackendStats* stats)
      : model_(model),
        hot_rows_(std::move(hot_rows)),
        hot_(*hot_rows_, model.config.activation, ops),
        exchange_(exchange),
        stats_(stats) {}

  absl::Status Forward(int layer, const float* x, int n, float* out) override {
    const int H = model_.config.hidden_size;
    const int max_tokens = exchange_->segment().geometry().max_tokens;
    const uint64_t hot_k = hot_rows_->layer(layer).neurons.size();
    for (int t0 = 0; t0 < n; t0 += max_tokens) {
      const int m = std::min(max_tokens, n - t0);
      const float* xc = x + static_cast<size_t>(t0) * H;
      float* oc = out + static_cast<size_t>(t0) * H;
      // x: [m, hidden] goes to the cpu-worker first, so that it computes while we do.
      absl::StatusOr<uint32_t> seq = exchange_->Post(layer, xc, m, nullptr);
      if (!seq.ok()) return seq.status();
      std::fill(oc, oc + static_cast<size_t>(m) * H, 0.f);
      const uint64_t a = Now();
      stats_->hot_neurons += hot_.Accumulate(layer, xc, m, nullptr, 0, oc);  // out: [m, hidden]
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
  const Model& model_;
  std::unique_ptr<FfnRowStore> hot_rows_;
  PartialFfn hot_;
  shm::ExchangeClient* exchange_;
  BackendStats* stats_;
};

class CpuBackend : public ComputeBackend {
 public:
  CpuBackend(const Model& model, const CpuOps& ops, std::unique_ptr<FfnRowStore> hot,
             shm::ExchangeClient* exchange)
      : model_(model),
        ffn_(model, std::move(hot), ops, exchange, &stats_),
        transformer_(model, ops) {
    transformer_.set_ffn(&ffn_);
  }

  std::string name() const override { return "cpu"; }

  absl::StatusOr<int> AcquireSlot(int max_ctx) override {
    if (max_ctx <= 0 || max_ctx > model_.config.max_context) {
      return absl::InvalidArgumentError(absl::StrCat("context of ", max_ctx,
                                                     " positions; the model supports ",
                                                     model_.config.max_context));
    }
    const int slot = next_slot_++;
    caches_.emplace(slot, std::make_unique<KvCache>(model_.config, max_ctx));
    return slot;
  }

  void ReleaseSlot(int slot) override { caches_.erase(slot); }

  absl::Status Forward(int slot, std::span<const int32_t> tokens, int pos0,
                       float* logits) override {
    auto it = caches_.find(slot);
    if (it == caches_.end()) return absl::InternalError(absl::StrCat("no sequence slot ", slot));
    const uint64_t t0 = Now();
    absl::Status st = transformer_.Forward(
        tokens, pos0, it->second.get(), logits != nullptr ? LogitsMode::kLast : LogitsMode::kNone,
        logits);
    stats_.forward_ns += Now() - t0;
    return st;
  }

  absl::Status DecodeBatch(std::span<const DecodeItem> items) override {
    // Chunks small enough that the split FFN computes every token as it would alone, so the
    // batch never changes a sequence's output (Transformer::ForwardDecodeBatch, PartialFfn).
    const uint64_t t0 = Now();
    absl::Status st;
    for (size_t b = 0; b < items.size() && st.ok();
         b += PartialFfn::kBatchInvariantTokens) {
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

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCpuBackend(const Model& model,
                                                              const CpuOps& ops,
                                                              const Placement& placement,
                                                              shm::ExchangeClient* exchange) {
  auto hot = FfnRowStore::Build(model, placement.hot);
  if (!hot.ok()) return hot.status();
  return std::unique_ptr<ComputeBackend>(
      new CpuBackend(model, ops, std::move(*hot), exchange));
}

}  // namespace pinfer::gpuworker
