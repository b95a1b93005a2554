// Activation profiling: runs a model over calibration tokens and records, per layer and FFN
// neuron, how often the neuron's activation is non-zero, plus the FFN inputs that predictor
// training learns from.
//
// Everything downstream of `pinfer prepare` starts here: placement ranks neurons by these
// frequencies (hot neurons go to the GPU), and the predictors are trained on the kept inputs.
// Profiling plugs a recording FfnBlock into the ordinary Transformer, so the statistics come
// from exactly the forward pass that serves requests, at the cost of one dense pass.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"

namespace pinfer {

// When an FFN neuron counts as active. ReLU and dReLU models: its activation is exactly non-zero.
// SiLU models have no exact zeros; there a neuron counts as active when |act(gate)| exceeds the
// layer's magnitude threshold (training-free magnitude sparsity), see `magnitude_thresholds`.
struct ActivationProfile {
  int n_layers = 0;
  int ffn_size = 0;
  int64_t tokens = 0;
  std::vector<std::vector<int64_t>> active;  // [layer][neuron]: tokens on which it was active

  double Frequency(int layer, int neuron) const {
    return tokens == 0 ? 0.0 : static_cast<double>(active[layer][neuron]) / tokens;
  }
  // Mean over neurons of Frequency(layer, .): the layer's true activation rate.
  double MeanActiveFraction(int layer) const;
};

// FFN inputs (after the FFN RMSNorm) kept for predictor training, stored as fp16 to halve the
// memory: per layer [count, hidden]. Activation masks are recomputed from these exactly when
// needed, which is cheaper than keeping [count, ffn] masks and magnitudes for every layer.
struct FfnSamples {
  int hidden = 0;
  int64_t count = 0;
  std::vector<std::vector<uint16_t>> inputs;  // [layer][count * hidden]

  // out: [end - begin, hidden] as fp32.
  void Get(int layer, int64_t begin, int64_t end, float* out) const;
};

struct ProfileOptions {
  int window = 512;         // tokens per independent forward pass (fresh KV cache each)
  int64_t max_tokens = 0;   // 0: all whole windows of the input
  bool keep_inputs = true;  // fill FfnSamples
  // SiLU models only: per layer |act| threshold above which a neuron counts as active. Empty:
  // every non-zero activation counts (which for SiLU is every neuron).
  std::vector<float> magnitude_thresholds;
};

struct ProfileResult {
  ActivationProfile profile;
  FfnSamples samples;
};

// Runs `tokens` in consecutive windows of `options.window` through the model's dense forward pass.
// progress(done_tokens, total_tokens) is called after each window.
absl::StatusOr<ProfileResult> ProfileActivations(
    const Model& model, const CpuOps& ops, std::span<const int32_t> tokens,
    const ProfileOptions& options, const std::function<void(int64_t, int64_t)>& progress = nullptr);

// Tokenizes a calibration text for profiling: BOS (when the model adds one) followed by the whole
// text as one stream.
absl::StatusOr<std::vector<int32_t>> TokenizeCalibrationText(const Model& model,
                                                             absl::string_view text);

}  // namespace pinfer
