// See placement.h. The budget arithmetic is done in uint64 bytes throughout; the selection is a
// sort of all neurons by profiled frequency per byte.
#include "shared/sparse/placement.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pinfer {

uint64_t DenseGpuBytes(const Model& model) {
  uint64_t bytes = 0;
  for (const LayerWeights& L : model.layers) {
    for (const TensorView* t : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_norm}) {
      bytes += t->nbytes();
    }
  }
  return bytes + model.output_norm.nbytes() + model.output.nbytes();
}

uint64_t KvCacheBytes(const ModelConfig& c, int context, int kv_element_bytes) {
  return 2ull * c.n_layers * static_cast<uint64_t>(context) * c.kv_dim() * kv_element_bytes;
}

uint64_t ScratchBytes(const ModelConfig& c, int context, int max_batch) {
  const uint64_t per_token = 3ull * c.hidden_size + c.q_dim() + 2ull * c.kv_dim() +
                             3ull * c.ffn_size + c.vocab_size +
                             static_cast<uint64_t>(c.n_heads) * context;
  return 4ull * max_batch * per_token;
}

uint64_t PredictorBytes(const PredictorSet* predictors) {
  if (predictors == nullptr) return 0;
  uint64_t bytes = 0;
  for (const LayerPredictor& p : predictors->layers) bytes += p.fc1.nbytes() + p.fc2.nbytes();
  return bytes;
}

uint64_t HotNeuronBytes(const Model& model, int layer) {
  const LayerWeights& L = model.layers[layer];
  // The file's bytes of a neuron's down column (a PWRI file's ffn_down_t row).
  const uint64_t down =
      L.down_t.data != nullptr ? L.down_t.row_bytes() : RowBytes(L.down.dtype, L.down.rows());
  return L.gate.row_bytes() + L.up.row_bytes() + down;
}

int64_t PlacementPlan::hot_neurons() const {
  int64_t n = 0;
  for (const auto& h : hot) n += static_cast<int64_t>(h.size());
  return n;
}

std::vector<int32_t> PlacementPlan::GpuIndex(int layer, int ffn) const {
  std::vector<int32_t> idx(ffn, 0);
  for (int32_t j : hot[layer]) idx[j] = 1;
  return idx;
}

std::string PlacementPlan::Summary() const {
  auto mib = [](uint64_t b) { return absl::StrFormat("%.2f MiB (%d bytes)", b / 1048576.0, b); };
  std::string s = absl::StrCat("VRAM budget ", mib(budget), "\n");
  if (measured_fixed_bytes.has_value()) {
    absl::StrAppend(&s, "  fixed part      ", mib(*measured_fixed_bytes),
                    " (measured: the backend's allocation without FFN rows)\n");
  } else {
    absl::StrAppend(&s, "  dense tensors   ", mib(dense_bytes), "\n");
    absl::StrAppend(&s, "  KV cache        ", mib(kv_cache_bytes), "\n");
    absl::StrAppend(&s, "  predictors      ", mib(predictor_bytes), "\n");
    absl::StrAppend(&s, "  scratch         ", mib(scratch_bytes), "\n");
  }
  if (cache_bytes > 0) {
    absl::StrAppend(&s, "  adaptive cache  ", mib(cache_bytes), " (slots for cold neurons)\n");
  }
  absl::StrAppend(&s, "  hot FFN rows    ", mib(hot_row_bytes), "\n");
  if (cpu_only) {
    absl::StrAppend(&s, "  CPU-only plan: the fixed parts alone exceed the budget\n");
  } else {
    absl::StrAppend(&s, "  total on GPU    ", mib(gpu_bytes()), "\n");
  }
  for (size_t l = 0; l < hot.size(); ++l) {
    absl::StrAppend(&s, "  layer ", l, ": ", hot[l].size(), " hot neurons\n");
  }
  absl::StrAppend(
      &s, absl::StrFormat("  activations served by the GPU: %.1f%%\n", 100 * gpu_activation_share));
  return s;
}

absl::StatusOr<PlacementPlan> PlanPlacement(const Model& model, const ActivationProfile& profile,
                                            const PredictorSet* predictors,
                                            const PlacementOptions& o) {
  const ModelConfig& c = model.config;
  if (profile.n_layers != c.n_layers || profile.ffn_size != c.ffn_size ||
      static_cast<int>(profile.active.size()) != c.n_layers) {
    return absl::InvalidArgumentError("the activation profile does not match the model");
  }
  if (o.context < 1 || o.max_batch < 1 || o.kv_element_bytes < 1) {
    return absl::InvalidArgumentError("context, batch and KV element size must be positive");
  }
  PlacementPlan plan;
  plan.budget = o.vram_budget;
  plan.dense_bytes = DenseGpuBytes(model);
  plan.kv_cache_bytes = KvCacheBytes(c, o.context, o.kv_element_bytes);
  plan.predictor_bytes = PredictorBytes(predictors);
  plan.scratch_bytes = ScratchBytes(c, o.context, o.max_batch);
  plan.measured_fixed_bytes = o.measured_fixed_bytes;
  plan.cache_bytes = o.cache_bytes;
  plan.hot.assign(c.n_layers, {});
  if (!o.backend_neuron_bytes.empty() &&
      static_cast<int>(o.backend_neuron_bytes.size()) != c.n_layers) {
    return absl::InvalidArgumentError("backend_neuron_bytes needs one entry per layer");
  }
  for (int l = 0; l < c.n_layers; ++l) {
    plan.neuron_bytes.push_back(o.backend_neuron_bytes.empty() ? HotNeuronBytes(model, l)
                                                               : o.backend_neuron_bytes[l]);
  }
  if (plan.fixed_bytes() > o.vram_budget) {
    if (!o.allow_cpu_only && plan.measured_fixed_bytes.has_value()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the VRAM budget of ", o.vram_budget, " bytes is below the ", plan.fixed_bytes(),
          " bytes the GPU backend allocates before any FFN row (dense tensors, embeddings, KV "
          "cache, scratch)"));
    }
    if (!o.allow_cpu_only) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the VRAM budget of ", o.vram_budget, " bytes is below the ", plan.fixed_bytes(),
          " bytes the dense tensors, KV cache, predictors and scratch buffers need (dense ",
          plan.dense_bytes, ", KV cache ", plan.kv_cache_bytes, ", predictors ",
          plan.predictor_bytes, ", scratch ", plan.scratch_bytes, ")"));
    }
    plan.cpu_only = true;
    return plan;
  }

  // Every neuron, best frequency per byte first; ties keep (layer, neuron) order.
  struct Item {
    int layer;
    int32_t neuron;
    int64_t count;
  };
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(c.n_layers) * c.ffn_size);
  double total = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    for (int32_t j = 0; j < c.ffn_size; ++j) {
      items.push_back({l, j, profile.active[l][j]});
      total += static_cast<double>(profile.active[l][j]);
    }
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    // count_a / bytes_a > count_b / bytes_b without division.
    return static_cast<double>(a.count) * plan.neuron_bytes[b.layer] >
           static_cast<double>(b.count) * plan.neuron_bytes[a.layer];
  });
  uint64_t left = o.vram_budget - plan.fixed_bytes();
  double served = 0;
  for (const Item& it : items) {
    const uint64_t b = plan.neuron_bytes[it.layer];
    if (b > left) continue;  // a smaller row of another layer may still fit
    left -= b;
    plan.hot_row_bytes += b;
    plan.hot[it.layer].push_back(it.neuron);
    served += static_cast<double>(it.count);
  }
  for (auto& h : plan.hot) std::sort(h.begin(), h.end());
  plan.gpu_activation_share = total > 0 ? served / total : 0;
  return plan;
}

}  // namespace pinfer
