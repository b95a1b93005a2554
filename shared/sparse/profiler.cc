// See profiler.h. The recording FFN computes the dense FFN exactly like DenseFfn and, on the side,
// counts active neurons and keeps the FFN inputs.
#include "shared/sparse/profiler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "shared/engine/transformer.h"
#include "shared/util/half.h"
#include "shared/util/status_macros.h"

namespace pinfer {

double ActivationProfile::MeanActiveFraction(int layer) const {
  if (tokens == 0 || ffn_size == 0) return 0;
  int64_t sum = 0;
  for (int64_t c : active[layer]) sum += c;
  return static_cast<double>(sum) / (static_cast<double>(tokens) * ffn_size);
}

void FfnSamples::Get(int layer, int64_t begin, int64_t end, float* out) const {
  const uint16_t* src = inputs[layer].data() + begin * hidden;
  const int64_t n = (end - begin) * hidden;
  for (int64_t i = 0; i < n; ++i) out[i] = Fp16ToFp32(src[i]);
}

namespace {

// Dense FFN that records activation counts and inputs.
class RecordingFfn : public FfnBlock {
 public:
  RecordingFfn(const Model& model, const CpuOps& ops, const ProfileOptions& options,
               ProfileResult* result)
      : model_(model), ops_(ops), options_(options), result_(result) {}

  absl::Status Forward(int layer, const float* x, int n, float* out) override {
    const ModelConfig& c = model_.config;
    const LayerWeights& L = model_.layers[layer];
    const int F = c.ffn_size, H = c.hidden_size;
    const size_t nf = static_cast<size_t>(n) * F;
    if (gate_.size() < nf) {
      gate_.resize(nf);
      up_.resize(nf);
      mask_.resize(nf);
    }
    ops_.MatMul(L.gate, x, n, gate_.data());  // gate: [n, ffn]
    ops_.MatMul(L.up, x, n, up_.data());      // up:   [n, ffn]
    std::vector<int64_t>& counts = result_->profile.active[layer];
    const bool magnitude = !options_.magnitude_thresholds.empty();
    const float thr = magnitude ? options_.magnitude_thresholds[layer] : 0.f;
    for (size_t i = 0; i < nf; ++i) {
      const float g = gate_[i];
      bool active = false;
      switch (c.activation) {
        case Activation::kRelu:
          active = g > 0;
          break;
        case Activation::kDRelu:
          active = g > 0 && up_[i] > 0;
          break;
        case Activation::kSilu:
          // No exact zeros: the gate's magnitude decides (the up factor is not known yet when a
          // sparse FFN applies the threshold).
          active = !magnitude || std::fabs(g / (1.f + std::exp(-g))) > thr;
          break;
      }
      mask_[i] = active;
    }
    for (int t = 0; t < n; ++t) {
      const uint8_t* m = mask_.data() + static_cast<size_t>(t) * F;
      for (int j = 0; j < F; ++j) counts[j] += m[j];
    }
    ops_.GatedActivation(c.activation, gate_.data(), up_.data(), static_cast<int64_t>(nf));
    if (options_.keep_inputs) {
      std::vector<uint16_t>& dst = result_->samples.inputs[layer];
      const size_t nh = static_cast<size_t>(n) * H;
      const size_t at = dst.size();
      dst.resize(at + nh);
      for (size_t i = 0; i < nh; ++i) dst[at + i] = Fp32ToFp16(std::clamp(x[i], -65504.f, 65504.f));
    }
    ops_.MatMul(L.down, gate_.data(), n, out);  // out: [n, hidden]
    return absl::OkStatus();
  }

 private:
  const Model& model_;
  const CpuOps& ops_;
  const ProfileOptions& options_;
  ProfileResult* result_;
  std::vector<float> gate_, up_;
  std::vector<uint8_t> mask_;
};

}  // namespace

absl::StatusOr<ProfileResult> ProfileActivations(
    const Model& model, const CpuOps& ops, std::span<const int32_t> tokens,
    const ProfileOptions& options, const std::function<void(int64_t, int64_t)>& progress) {
  const ModelConfig& c = model.config;
  if (options.window < 2 || options.window > c.max_context) {
    return absl::InvalidArgumentError(
        absl::StrCat("profiling window ", options.window, " must be in 2..", c.max_context));
  }
  if (!options.magnitude_thresholds.empty() &&
      static_cast<int>(options.magnitude_thresholds.size()) != c.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", c.n_layers,
                                                   " magnitude thresholds, got ",
                                                   options.magnitude_thresholds.size()));
  }
  int64_t usable = static_cast<int64_t>(tokens.size());
  if (options.max_tokens > 0) usable = std::min(usable, options.max_tokens);
  const int64_t n_windows = usable / options.window;
  if (n_windows == 0) {
    return absl::InvalidArgumentError(absl::StrCat("profiling needs at least one window of ",
                                                   options.window, " tokens, got ", tokens.size()));
  }
  const int64_t total = n_windows * options.window;

  ProfileResult result;
  result.profile.n_layers = c.n_layers;
  result.profile.ffn_size = c.ffn_size;
  result.profile.active.assign(c.n_layers, std::vector<int64_t>(c.ffn_size, 0));
  result.samples.hidden = c.hidden_size;
  result.samples.inputs.resize(c.n_layers);
  if (options.keep_inputs) {
    for (auto& v : result.samples.inputs) v.reserve(static_cast<size_t>(total) * c.hidden_size);
  }

  RecordingFfn ffn(model, ops, options, &result);
  Transformer transformer(model, ops);
  transformer.set_ffn(&ffn);
  KvCache cache(c, options.window);
  for (int64_t w = 0; w < n_windows; ++w) {
    std::span<const int32_t> win = tokens.subspan(w * options.window, options.window);
    RETURN_IF_ERROR(transformer.Forward(win, 0, &cache, LogitsMode::kNone, nullptr));
    result.profile.tokens += options.window;
    if (progress) progress(result.profile.tokens, total);
  }
  if (options.keep_inputs) result.samples.count = result.profile.tokens;
  return result;
}

absl::StatusOr<std::vector<int32_t>> TokenizeCalibrationText(const Model& model,
                                                             absl::string_view text) {
  if (model.tokenizer == nullptr) {
    return absl::FailedPreconditionError("the model has no tokenizer to read calibration text");
  }
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, model.tokenizer->Encode(text));
  std::vector<int32_t> out;
  out.reserve(ids.size() + 1);
  if (model.config.add_bos) out.push_back(model.config.bos_id);
  out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

}  // namespace pinfer
