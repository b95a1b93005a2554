// The prompt batches' cold-row path decision (cold_prefill.h).
#include "gpu-worker/cold_prefill.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pinfer::gpuworker {

absl::StatusOr<ColdPrefill> ParseColdPrefill(absl::string_view text) {
  if (text == "auto") return ColdPrefill::kAuto;
  if (text == "cpu") return ColdPrefill::kCpu;
  if (text == "stream") return ColdPrefill::kStream;
  return absl::InvalidArgumentError(
      absl::StrCat("--cold-prefill must be auto, cpu or stream (got \"", text, "\")"));
}

const char* ColdPrefillName(ColdPrefill mode) {
  switch (mode) {
    case ColdPrefill::kAuto:
      return "auto";
    case ColdPrefill::kCpu:
      return "cpu";
    case ColdPrefill::kStream:
      return "stream";
  }
  return "?";
}

absl::Status StreamCostsFrom(const std::vector<StreamSample>& samples, ColdCostParams* p) {
  if (samples.empty()) return absl::InvalidArgumentError("no stream calibration samples");
  double bytes = 0, copy = 0, flops = 0, compute = 0;
  std::vector<double> fixed;
  for (const StreamSample& s : samples) {
    if (s.bytes <= 0 || s.copy_s <= 0 || s.flops <= 0 || s.compute_s <= 0 || s.overlapped_s <= 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "stream calibration needs positive sizes and times (%d tokens: bytes %g, copy %g s, "
          "flops %g, compute %g s, overlapped %g s)",
          s.tokens, s.bytes, s.copy_s, s.flops, s.compute_s, s.overlapped_s));
    }
    bytes += s.bytes;
    copy += s.copy_s;
    flops += s.flops;
    compute += s.compute_s;
    fixed.push_back(std::max(0.0, s.overlapped_s - std::max(s.copy_s, s.compute_s)));
  }
  std::sort(fixed.begin(), fixed.end());
  const size_t m = fixed.size();
  p->h2d_bytes_per_s = bytes / copy;
  p->gpu_flops_per_s = flops / compute;
  p->stream_fixed_s = m % 2 == 1 ? fixed[m / 2] : 0.5 * (fixed[m / 2 - 1] + fixed[m / 2]);
  return absl::OkStatus();
}

ColdPrefillPlanner::ColdPrefillPlanner(ColdPrefill mode, int hidden,
                                       std::vector<ColdLayerShape> layers)
    : mode_(mode),
      hidden_(hidden),
      layers_(std::move(layers)),
      rows_sum_(layers_.size(), 0.0),
      tokens_sum_(layers_.size(), 0.0) {
  for (const ColdLayerShape& l : layers_) cold_layers_ += l.cold_rows > 0 ? 1 : 0;
}

absl::Status ColdPrefillPlanner::SetStreamCalibration(const std::vector<StreamSample>& samples) {
  ColdCostParams p = params_;
  if (absl::Status st = StreamCostsFrom(samples, &p); !st.ok()) return st;
  params_.h2d_bytes_per_s = p.h2d_bytes_per_s;
  params_.gpu_flops_per_s = p.gpu_flops_per_s;
  params_.stream_fixed_s = p.stream_fixed_s;
  stream_calibrated_ = true;
  return absl::OkStatus();
}

void ColdPrefillPlanner::ObserveCpu(int layer, int tokens, double row_tokens, double seconds) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || tokens <= 0 || seconds <= 0) {
    return;
  }
  std::deque<CpuSample>& q = tokens == 1 ? decode_samples_ : prompt_samples_;
  q.push_back({row_tokens, seconds});
  if (q.size() > kMaxSamples) q.pop_front();
  cpu_dirty_ = true;
  rows_sum_[layer] = rows_sum_[layer] * kRowsDecay + row_tokens;
  tokens_sum_[layer] = tokens_sum_[layer] * kRowsDecay + tokens;
}

bool ColdPrefillPlanner::cpu_calibrated() {
  if (!cpu_dirty_) return cpu_fitted_;
  cpu_dirty_ = false;
  // At least one sample per layer that has cold rows: the first prompt batch (or step) is seen
  // whole before its samples decide anything.
  if (static_cast<int>(decode_samples_.size() + prompt_samples_.size()) <
      std::max(2, cold_layers_)) {
    return cpu_fitted_;
  }
  std::vector<CpuSample> all(decode_samples_.begin(), decode_samples_.end());
  all.insert(all.end(), prompt_samples_.begin(), prompt_samples_.end());
  ColdCostParams p = params_;
  if (FitCpuCosts(all, &p).ok()) {
    params_.cpu_fixed_s = p.cpu_fixed_s;
    params_.cpu_s_per_row_token = p.cpu_s_per_row_token;
    cpu_fitted_ = true;
  }
  return cpu_fitted_;
}

double ColdPrefillPlanner::RowsPerToken(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || tokens_sum_[layer] <= 0) {
    return -1;
  }
  return rows_sum_[layer] / tokens_sum_[layer];
}

ColdPrefillPlanner::Decision ColdPrefillPlanner::Decide(int tokens) {
  Decision d;
  d.stream.assign(layers_.size(), false);
  if (mode_ == ColdPrefill::kCpu) {
    d.reason = "--cold-prefill cpu";
    return d;
  }
  if (tokens <= kMaxMatvecTokens) {
    d.reason = absl::StrCat(tokens, " tokens take the matrix-vector path (no streaming)");
    return d;
  }
  if (cold_layers_ == 0) {
    d.reason = "no cold rows";
    return d;
  }
  if (mode_ == ColdPrefill::kStream) {
    for (size_t l = 0; l < layers_.size(); ++l) {
      d.stream[l] = layers_[l].cold_rows > 0;
      d.streamed += d.stream[l] ? 1 : 0;
    }
    d.reason = "--cold-prefill stream";
    return d;
  }
  if (!stream_calibrated_) {
    d.reason = "the stream is not calibrated";
    return d;
  }
  if (!cpu_calibrated()) {
    d.reason = absl::StrCat("measuring the CPU side first (",
                            decode_samples_.size() + prompt_samples_.size(), " timed exchanges)");
    return d;
  }
  // The largest layer's estimate, for the log.
  int shown = -1;
  ColdPathChoice shown_choice;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const ColdLayerShape& s = layers_[l];
    const double rows = RowsPerToken(static_cast<int>(l));
    if (s.cold_rows == 0 || rows < 0) continue;  // never seen on the CPU: keep it there
    ColdLayerWork w;
    w.tokens = tokens;
    w.cold_rows = s.cold_rows;
    w.bytes = s.bytes;
    w.hidden = hidden_;
    w.active_row_tokens = rows * tokens;
    absl::StatusOr<ColdPathChoice> c = ChooseColdPath(params_, w);
    if (!c.ok()) continue;
    d.stream[l] = c->stream;
    d.streamed += c->stream ? 1 : 0;
    if (shown < 0 || s.cold_rows > layers_[shown].cold_rows) {
      shown = static_cast<int>(l);
      shown_choice = *c;
    }
  }
  d.reason = shown < 0 ? "no layer measured on the CPU yet"
                       : absl::StrCat("cost model, layer ", shown, ": ", shown_choice.Describe());
  return d;
}

}  // namespace pinfer::gpuworker
