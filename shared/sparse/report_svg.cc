// See report_svg.h. Plain SVG 1.1, no scripts or external resources.
#include "shared/sparse/report_svg.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pinfer {

std::string LocalityReportSvg(const PrepareResult& r) {
  const ActivationProfile& p = r.profile;
  constexpr int kPanelW = 360, kPanelH = 200, kPad = 40, kCols = 3;
  const int rows = (p.n_layers + kCols - 1) / kCols;
  const int width = kCols * (kPanelW + kPad) + kPad;
  const int height = rows * (kPanelH + 2 * kPad) + 2 * kPad;
  std::string s = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" "
      "fill=\"white\"/>\n<text x=\"%d\" y=\"24\" font-size=\"16\">Activation locality: neuron "
      "activation frequency, hot to cold (%d profiled tokens)</text>\n",
      width, height, kPad, p.tokens);
  for (int l = 0; l < p.n_layers; ++l) {
    const int x0 = kPad + (l % kCols) * (kPanelW + kPad);
    const int y0 = 2 * kPad + (l / kCols) * (kPanelH + 2 * kPad);
    std::vector<double> f(p.ffn_size);
    for (int j = 0; j < p.ffn_size; ++j) f[j] = p.Frequency(l, j);
    std::sort(f.rbegin(), f.rend());
    const double ymax = std::max(1e-9, f.empty() ? 1.0 : f[0]);
    absl::StrAppend(
        &s,
        absl::StrFormat(
            "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#888\"/>\n",
            x0, y0, kPanelW, kPanelH));
    // GPU share shaded.
    if (r.plan.has_value() && !r.plan->cpu_only && l < static_cast<int>(r.plan->hot.size())) {
      const double cut = static_cast<double>(r.plan->hot[l].size()) / p.ffn_size * kPanelW;
      absl::StrAppend(
          &s,
          absl::StrFormat(
              "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"#d8f0d8\"/>\n"
              "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"green\" "
              "stroke-dasharray=\"4 2\"/>\n<text x=\"%.1f\" y=\"%d\" fill=\"green\">GPU | "
              "CPU</text>\n",
              x0, y0, cut, kPanelH, x0 + cut, y0, x0 + cut, y0 + kPanelH, x0 + cut - 30, y0 + 14));
    }
    std::string pts;
    const int step = std::max(1, p.ffn_size / kPanelW);
    for (int j = 0; j < p.ffn_size; j += step) {
      absl::StrAppend(
          &pts, absl::StrFormat("%.1f,%.1f ", x0 + static_cast<double>(j) / p.ffn_size * kPanelW,
                                y0 + kPanelH - f[j] / ymax * kPanelH));
    }
    absl::StrAppend(&s, "<polyline fill=\"none\" stroke=\"#c33\" stroke-width=\"1.5\" points=\"",
                    pts, "\"/>\n");
    absl::StrAppend(
        &s, absl::StrFormat("<text x=\"%d\" y=\"%d\" font-weight=\"bold\">layer %d</text>\n"
                            "<text x=\"%d\" y=\"%d\">max %.2f, mean %.3f</text>\n",
                            x0, y0 - 6, l, x0 + kPanelW - 120, y0 - 6, f.empty() ? 0.0 : f[0],
                            p.MeanActiveFraction(l)));
    if (l < static_cast<int>(r.reports.size())) {
      const LayerPredictorReport& rep = r.reports[l];
      absl::StrAppend(
          &s,
          absl::StrFormat(
              "<text x=\"%d\" y=\"%d\">predictor rank %d: recall %.3f (magnitude %.3f), sparsity "
              "%.2f, cost %.1f%%</text>\n",
              x0, y0 + kPanelH + 16, rep.rank, rep.recall, rep.magnitude_recall, rep.sparsity,
              100 * rep.predictor_cost));
    }
  }
  absl::StrAppend(&s, "</svg>\n");
  return s;
}

absl::Status WriteLocalityReport(const PrepareResult& result, const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  out << LocalityReportSvg(result);
  if (!out) return absl::DataLossError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace pinfer
