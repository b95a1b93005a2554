// Neuron placement under a VRAM budget: which FFN neurons are hot (their gate, up and transposed
// down rows live on the GPU) and which are cold (computed by the CPU).
//
// Byte accounting is exact and fixed by this header, so that a plan can be checked by hand:
//
//   dense      = per layer: attn_norm + wq + wk + wv + wo + ffn_norm, plus output_norm and the
//                output head, each at its stored size (TensorView::nbytes). The token embedding
//                table stays in host memory (a row lookup per token needs no GPU).
//   kv_cache   = 2 (K and V) * n_layers * context * kv_dim * kv_element_bytes (2: fp16 on the GPU)
//   predictors = per layer fc1 + fc2 at their stored size (0 without predictors)
//   scratch    = 4 * max_batch * (3 * hidden + q_dim + 2 * kv_dim + 3 * ffn + vocab
//                                 + n_heads * context)
//                (fp32 activations of one batch: residual, norm output and FFN output; q, k, v;
//                 gate, up and predictor scores; logits; attention scores)
//   hot rows   = per hot neuron of layer l: row_bytes(gate_l) + row_bytes(up_l) +
//                row_bytes(down_t_l), down_t stored in down's dtype
//
// The fixed part (dense + kv_cache + predictors + scratch) goes first. What remains of the budget
// takes the neurons with the highest profiled activation frequency — the expected activations
// served by the GPU — across all layers. With the same row size in every layer (one dtype) this
// greedy choice is optimal; with mixed sizes it ranks by frequency per byte. When the fixed part
// alone exceeds the budget, PlanPlacement fails with ResourceExhausted naming both sizes, unless
// `allow_cpu_only` is set: then the plan puts nothing on the GPU (cpu_only = true, every neuron
// cold, gpu bytes 0) and the model runs on the CPU.
//
// A running gpu-worker knows its backend better than these formulas (the CUDA module also keeps
// the embedding table, a KV cache per sequence slot and its own scratch on the device): it measures
// the backend's allocation without FFN rows and passes it as `measured_fixed_bytes`, which then
// replaces the four fixed items, and the bytes the backend stores per hot neuron of each layer as
// `backend_neuron_bytes`, so that the plan is what that process will allocate.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/model/model.h"
#include "shared/sparse/profiler.h"
#include "shared/sparse/sparse_ffn.h"

namespace pinfer {

struct PlacementOptions {
  uint64_t vram_budget = 0;
  int context = 2048;
  int kv_element_bytes = 2;
  int max_batch = 32;
  bool allow_cpu_only = false;
  std::optional<uint64_t> measured_fixed_bytes;
  std::vector<uint64_t> backend_neuron_bytes;  // [layer]; empty: HotNeuronBytes
  // Reserved before any hot row: the adaptive hot set's cache slots and their maps.
  uint64_t cache_bytes = 0;
};

struct PlacementPlan {
  uint64_t budget = 0;
  uint64_t dense_bytes = 0;
  uint64_t kv_cache_bytes = 0;
  uint64_t predictor_bytes = 0;
  uint64_t scratch_bytes = 0;
  uint64_t hot_row_bytes = 0;
  std::optional<uint64_t> measured_fixed_bytes;  // replaces the four items above when set
  uint64_t cache_bytes = 0;                      // PlacementOptions::cache_bytes
  bool cpu_only = false;
  std::vector<uint64_t> neuron_bytes;     // [layer]: bytes of one hot neuron's rows
  std::vector<std::vector<int32_t>> hot;  // [layer]: hot neuron ids, ascending
  double gpu_activation_share = 0;        // profiled activations served by hot neurons

  uint64_t fixed_bytes() const {
    if (measured_fixed_bytes.has_value()) return *measured_fixed_bytes + cache_bytes;
    return dense_bytes + kv_cache_bytes + predictor_bytes + scratch_bytes + cache_bytes;
  }
  uint64_t gpu_bytes() const { return cpu_only ? 0 : fixed_bytes() + hot_row_bytes; }
  int64_t hot_neurons() const;
  // gpu_idx per layer as PowerInfer stores it: 1 for hot neurons, 0 for cold, [ffn].
  std::vector<int32_t> GpuIndex(int layer, int ffn) const;
  std::string Summary() const;  // one line per item, for `pinfer prepare`
};

// Bytes of the fixed parts, as defined above.
uint64_t DenseGpuBytes(const Model& model);
uint64_t KvCacheBytes(const ModelConfig& c, int context, int kv_element_bytes);
uint64_t ScratchBytes(const ModelConfig& c, int context, int max_batch);
uint64_t PredictorBytes(const PredictorSet* predictors);
uint64_t HotNeuronBytes(const Model& model, int layer);

absl::StatusOr<PlacementPlan> PlanPlacement(const Model& model, const ActivationProfile& profile,
                                            const PredictorSet* predictors,
                                            const PlacementOptions& options);

}  // namespace pinfer
