// Trains the per-layer activation predictors (PowerInfer's fc1 -> ReLU -> fc2 MLP) from profiled
// FFN inputs, in C++, in seconds per layer.
//
// The gate pre-activation g = Wg x is linear in the FFN input x, so the best rank-k linear
// predictor of g is known in closed form (reduced-rank regression: project Wg onto the top-k
// eigenvectors of the gate's second moment Wg E[xx^T] Wg^T). pinfer starts from it:
//  1. closed form: rank-k estimate g^ = A B x; the MLP represents it exactly with 2k hidden units
//     (fc1 = [B; -B], fc2 = [A, -A], since relu(z) - relu(-z) = z);
//  2. calibration: each neuron's residual spread s_j turns g^_j into a logit 1.7 g^_j / s_j of
//     P(g_j > 0), folded into fc2's rows;
//  3. fine-tuning: a short Adam pass over the training pairs on a BCE loss whose positive terms are
//     weighted by the neuron's contribution |relu(g) * up| * |down column| — missing a large
//     activation costs quality, missing a tiny one almost nothing;
//  4. threshold: on held-back pairs, the layer's threshold is the highest score cut that keeps the
//     target fraction of the activation magnitude (magnitude-weighted recall).
// Among the candidate ranks, each layer keeps the one with the lowest total FFN cost (predictor +
// computed rows) at the target recall.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"
#include "shared/sparse/profiler.h"
#include "shared/sparse/sparse_ffn.h"
#include "shared/util/thread_pool.h"

namespace pinfer {

// Every trained layer's threshold after folding it into fc2's scale (see TrainPredictors).
inline constexpr float kFoldedThreshold = -1.f;

struct PredictorTrainingOptions {
  // Candidate hidden sizes of the MLP (even: the closed-form start uses rank / 2). Per layer the
  // smallest that keeps min_sparsity of the neurons skipped at the target recall; when none does,
  // the one with the lowest total cost (predictor + computed rows).
  // Small ranks first: on relu-llama-tiny the total cost (predictor + rows) grows with the rank
  // at a fixed recall, so a layer only pays for more rank when the sparsity target needs it.
  std::vector<int> ranks = {64, 96, 128, 160, 192};
  double min_sparsity = 0.7;
  // Magnitude-weighted recall each layer's threshold is set to reach on held-back pairs.
  double target_recall = 0.96;
  double holdout_fraction = 0.1;  // the last part of the samples, never trained on
  int epochs = 6;                 // fine-tuning passes over the training pairs (0: closed form)
  int batch = 1024;
  float learning_rate = 2e-2f;
  bool lr_decay = false;  // linear decay to zero
  // Thresholds per neuron (from its typical contribution) rather than one per layer; both are
  // folded into fc2 so that the stored threshold is kFoldedThreshold.
  bool per_neuron_thresholds = true;
  // BCE weights: a truly active neuron weighs (contribution / mean contribution)^power, clipped
  // to [min, max]; an inactive one weighs negative_weight.
  float positive_weight_power = 0.5f;
  float positive_weight_min = 0.05f;
  float positive_weight_max = 20.f;
  float negative_weight = 1.f;
  // Start from the closed-form linear predictor (else a random start).
  bool closed_form_init = true;
  // Weight the closed-form regression by each neuron's typical contribution.
  bool weighted_regression = true;
  // Storage of fc1/fc2: F16, F32 or Q8_0 (half F16's bytes; hidden size and ranks multiples of
  // 32). Thresholds are calibrated on the stored weights, multiplied as the run time multiplies
  // them (Q8_0: with the activations quantized too).
  DType dtype = DType::kF16;
  uint32_t seed = 1;
  // Restrict training to these layers (empty: all). The others get a predictor that selects every
  // neuron (rank 2, all zero, threshold 0), i.e. they run exactly (tests, experiments).
  std::vector<int> layers;
};

struct PredictorCandidate {
  int rank = 0;
  float threshold = 0;
  double recall = 0, magnitude_recall = 0, precision = 0, sparsity = 0;
  double cost = 0;  // multiply-adds per token relative to the dense FFN (predictor + rows)
};

struct LayerPredictorReport {
  int layer = 0;
  int rank = 0;
  float threshold = 0;
  int64_t train_pairs = 0, heldout_pairs = 0;
  // On the held-back pairs, at the chosen threshold:
  double true_active_rate = 0;  // fraction of neurons truly active
  double recall = 0;            // truly active neurons selected / truly active
  double magnitude_recall = 0;  // the same, weighted by contribution
  double precision = 0;         // truly active among selected
  double sparsity = 0;          // fraction of neurons not selected
  double predictor_cost = 0;    // predictor multiply-adds / dense FFN multiply-adds
  double seconds = 0;
  std::vector<PredictorCandidate> candidates;
};

struct TrainedPredictors {
  PredictorSet predictors;
  std::vector<LayerPredictorReport> reports;
};

// Trains predictors for every layer from `samples` (ProfileActivations with keep_inputs).
// `log` receives one progress line at a time.
absl::StatusOr<TrainedPredictors> TrainPredictors(
    const Model& model, const CpuOps& ops, const FfnSamples& samples,
    const PredictorTrainingOptions& options,
    const std::function<void(const std::string&)>& log = nullptr);

// The threshold on `scores` of truly active pairs (weights > 0) that keeps `target` of the total
// weight: the largest t with sum(weight where score >= t) >= target * sum(weight). Exposed for
// tests. Returns -inf when target >= 1 cannot be met otherwise.
float ThresholdForWeightedRecall(std::vector<std::pair<float, float>> score_weight, double target);

}  // namespace pinfer
