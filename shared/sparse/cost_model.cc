// The cold-row cost model (cost_model.h).
#include "shared/sparse/cost_model.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pinfer {

std::string ColdPathChoice::Describe() const {
  return absl::StrFormat("cpu %.3f ms, stream %.3f ms -> %s", cpu_s * 1e3, stream_s * 1e3,
                         stream ? "stream" : "cpu");
}

absl::StatusOr<ColdPathChoice> ChooseColdPath(const ColdCostParams& p, const ColdLayerWork& w) {
  if (p.h2d_bytes_per_s <= 0 || p.gpu_flops_per_s <= 0) {
    return absl::InvalidArgumentError("the stream costs are not measured (rates must be > 0)");
  }
  if (p.cpu_s_per_row_token <= 0) {
    return absl::InvalidArgumentError("the CPU cost is not measured (per row-token must be > 0)");
  }
  if (w.tokens <= 0 || w.cold_rows < 0 || w.bytes < 0 || w.hidden <= 0 || w.active_row_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad layer work: tokens ", w.tokens, ", cold rows ", w.cold_rows));
  }
  ColdPathChoice c;
  c.cpu_s = p.cpu_fixed_s + w.active_row_tokens * p.cpu_s_per_row_token;
  const double flops = 2.0 * w.tokens * static_cast<double>(w.cold_rows) * 3.0 * w.hidden;
  c.stream_s = p.stream_fixed_s + std::max(w.bytes / p.h2d_bytes_per_s, flops / p.gpu_flops_per_s);
  c.stream = c.stream_s < c.cpu_s;
  return c;
}

absl::Status SetStreamCosts(double bytes, double copy_s, double flops, double compute_s,
                            double overlapped_s, ColdCostParams* p) {
  if (bytes <= 0 || copy_s <= 0 || flops <= 0 || compute_s <= 0 || overlapped_s <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("stream calibration needs positive sizes and times (bytes %g, copy %g s, "
                        "flops %g, compute %g s, overlapped %g s)",
                        bytes, copy_s, flops, compute_s, overlapped_s));
  }
  p->h2d_bytes_per_s = bytes / copy_s;
  p->gpu_flops_per_s = flops / compute_s;
  p->stream_fixed_s = std::max(0.0, overlapped_s - std::max(copy_s, compute_s));
  return absl::OkStatus();
}

absl::Status FitCpuCosts(const std::vector<CpuSample>& samples, ColdCostParams* p) {
  const double n = static_cast<double>(samples.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const CpuSample& s : samples) {
    sx += s.row_tokens;
    sy += s.seconds;
    sxx += s.row_tokens * s.row_tokens;
    sxy += s.row_tokens * s.seconds;
  }
  const double det = n * sxx - sx * sx;
  // det is n^2 times the variance of row_tokens: zero when they are all the same.
  if (samples.size() < 2 || det <= 1e-12 * std::max(1.0, sxx * n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CPU fit needs samples at two or more distinct row-token counts (got ",
                     samples.size(), " samples)"));
  }
  double slope = (n * sxy - sx * sy) / det;
  double fixed = (sy - slope * sx) / n;
  if (fixed < 0) {
    fixed = 0;
    slope = sxy / sxx;
  }
  if (slope <= 0) {
    return absl::InvalidArgumentError("the CPU time does not grow with the rows (slope <= 0)");
  }
  p->cpu_fixed_s = fixed;
  p->cpu_s_per_row_token = slope;
  return absl::OkStatus();
}

int StreamCrossover(const ColdCostParams& p, int64_t cold_rows, double bytes, int hidden,
                    double rows_per_token, int max_tokens) {
  for (int n = 1; n <= max_tokens; ++n) {
    ColdLayerWork w;
    w.tokens = n;
    w.cold_rows = cold_rows;
    w.bytes = bytes;
    w.hidden = hidden;
    w.active_row_tokens = n * rows_per_token;
    absl::StatusOr<ColdPathChoice> c = ChooseColdPath(p, w);
    if (c.ok() && c->stream) return n;
  }
  return 0;
}

}  // namespace pinfer
