// `pinfer prepare`: makes a ReLU model's activation locality usable. Profiles the model over a
// calibration text, trains one activation predictor per layer, writes a PowerInfer-compatible
// PWRI model and, given a VRAM budget, the neuron placement as FILE.gguf.generated.gpuidx.
#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "nlohmann/json.hpp"
#include "shared/engine/ops.h"
#include "shared/sparse/prepare.h"
#include "shared/sparse/report_svg.h"
#include "shared/util/mapped_file.h"
#include "shared/util/status_macros.h"

namespace pinfer::cli {
namespace {

constexpr char kUsage[] =
    "usage: pinfer prepare --model PATH --calibration TEXT_FILE --out FILE.gguf\n"
    "         [--vram-budget SIZE] [--context N] [--target-recall R] [--ranks R1,R2,...]\n"
    "         [--min-sparsity S] [--target-sparsity S] [--epochs N] [--max-tokens N]\n"
    "         [--predictor-type f16|q8_0] [--threads N] [--report FILE.svg] [--json]\n"
    "  SIZE: bytes or with a unit (8MiB, 24GiB, 500MB). --target-recall: the fraction of the\n"
    "  activation magnitude each layer's predictor must keep on held-back tokens (default 0.96).\n"
    "  --ranks: candidate predictor sizes (default 64,96,128,160,192); per layer the\n"
    "  smallest that skips --min-sparsity of the neurons (default 0.7) at that recall, else\n"
    "  the cheapest overall.\n"
    "  --predictor-type q8_0 stores the predictors in half F16's bytes (ranks: multiples of 32);\n"
    "  their thresholds are calibrated on the stored weights.\n"
    "  SiLU models get training-free magnitude sparsity instead: --target-sparsity S (default "
    "0.5)\n"
    "  is the fraction of neurons each layer skips; the perplexity cost is measured and printed.\n";

struct Options {
  PrepareOptions prepare;
  std::string calibration_path, report_path;
  int threads = 2;
  bool json = false;
};

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(
      Flags f, Flags::Parse(args,
                            {"model", "calibration", "out", "vram-budget", "context",
                             "target-recall", "ranks", "epochs", "max-tokens", "threads", "report",
                             "target-sparsity", "min-sparsity", "predictor-type"},
                            {"json"}));
  Options o;
  ASSIGN_OR_RETURN(o.prepare.model_path, f.Required("model"));
  ASSIGN_OR_RETURN(o.calibration_path, f.Required("calibration"));
  ASSIGN_OR_RETURN(o.prepare.out_path, f.Required("out"));
  if (f.Has("vram-budget")) {
    ASSIGN_OR_RETURN(uint64_t budget, f.Size("vram-budget", 0));
    o.prepare.vram_budget = budget;
  }
  ASSIGN_OR_RETURN(int64_t context, f.Int("context", 2048));
  if (context < 1 || context > (1 << 24))
    return absl::InvalidArgumentError("--context out of range");
  o.prepare.context = static_cast<int>(context);
  ASSIGN_OR_RETURN(double recall, f.Double("target-recall", o.prepare.training.target_recall));
  if (!(recall > 0 && recall <= 1))
    return absl::InvalidArgumentError("--target-recall must be in (0, 1]");
  o.prepare.training.target_recall = recall;
  if (auto ranks = f.Get("ranks")) {
    o.prepare.training.ranks.clear();
    for (absl::string_view r : absl::StrSplit(*ranks, ',')) {
      int v = 0;
      if (!absl::SimpleAtoi(r, &v) || v < 2 || v % 2 != 0) {
        return absl::InvalidArgumentError("--ranks must be even integers >= 2, comma separated");
      }
      o.prepare.training.ranks.push_back(v);
    }
  }
  const std::string type = f.Get("predictor-type").value_or("f16");
  if (type == "f16") {
    o.prepare.training.dtype = DType::kF16;
  } else if (type == "q8_0") {
    o.prepare.training.dtype = DType::kQ8_0;
  } else {
    return absl::InvalidArgumentError("--predictor-type must be f16 or q8_0");
  }
  ASSIGN_OR_RETURN(o.prepare.training.min_sparsity,
                   f.Double("min-sparsity", o.prepare.training.min_sparsity));
  if (!(o.prepare.training.min_sparsity >= 0 && o.prepare.training.min_sparsity < 1)) {
    return absl::InvalidArgumentError("--min-sparsity must be in [0, 1)");
  }
  ASSIGN_OR_RETURN(o.prepare.target_sparsity, f.Double("target-sparsity", 0.5));
  if (!(o.prepare.target_sparsity >= 0 && o.prepare.target_sparsity < 1)) {
    return absl::InvalidArgumentError("--target-sparsity must be in [0, 1)");
  }
  ASSIGN_OR_RETURN(int64_t epochs, f.Int("epochs", o.prepare.training.epochs));
  if (epochs < 0 || epochs > 1000) return absl::InvalidArgumentError("--epochs out of range");
  o.prepare.training.epochs = static_cast<int>(epochs);
  ASSIGN_OR_RETURN(o.prepare.max_calibration_tokens, f.Int("max-tokens", 0));
  if (o.prepare.max_calibration_tokens < 0)
    return absl::InvalidArgumentError("--max-tokens out of range");
  ASSIGN_OR_RETURN(int64_t threads, f.Int("threads", 2));
  if (threads < 1 || threads > 1024) return absl::InvalidArgumentError("--threads out of range");
  o.threads = static_cast<int>(threads);
  o.report_path = f.Get("report").value_or("");
  o.json = f.Has("json");
  return o;
}

// A one-line progress bar on stderr, redrawn in place.
void DrawBar(const std::string& stage, double fraction) {
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(fraction * kWidth + 0.5);
  std::fprintf(stderr, "\r%-10s [%s%s] %3d%%", stage.c_str(), std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), static_cast<int>(fraction * 100 + 0.5));
  if (fraction >= 1) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

}  // namespace

int PrepareCommand(const std::vector<std::string>& args) {
  auto opts = ParseOptions(args);
  if (!opts.ok()) return UsageError(kUsage, opts.status());
  Options& o = *opts;
  auto text = ReadFileToString(o.calibration_path);
  if (!text.ok()) return RuntimeError(text.status());
  o.prepare.calibration_text = std::move(*text);
  ThreadPool pool(o.threads);
  auto ops = NewSimdOps(&pool);
  PrepareProgress pg;
  bool bar_open = false;
  pg.bar = [&](const std::string& stage, double fraction) {
    DrawBar(stage, fraction);
    bar_open = fraction < 1;
  };
  pg.log = [&](const std::string& line) {
    if (bar_open) std::fprintf(stderr, "\n");
    bar_open = false;
    std::fprintf(stderr, "%s%s", line.c_str(), line.empty() || line.back() != '\n' ? "\n" : "");
  };
  auto result = PrepareModel(o.prepare, *ops, pg);
  if (!result.ok()) return RuntimeError(result.status());
  if (!o.report_path.empty()) {
    absl::Status st = WriteLocalityReport(*result, o.report_path);
    if (!st.ok()) return RuntimeError(st);
    std::fprintf(stderr, "wrote %s\n", o.report_path.c_str());
  }
  if (o.json) {
    nlohmann::json j;
    j["out"] = o.prepare.out_path;
    j["gpu_index"] = result->gpu_index_path;
    j["profile_tokens"] = result->profile.tokens;
    j["seconds"] = result->total_seconds;
    if (!result->magnitude_thresholds.empty()) {
      j["magnitude_thresholds"] = result->magnitude_thresholds;
      j["heldout_dense_perplexity"] = result->heldout_dense_perplexity;
      j["heldout_sparse_perplexity"] = result->heldout_sparse_perplexity;
    }
    for (const LayerPredictorReport& r : result->reports) {
      j["layers"].push_back({{"layer", r.layer},
                             {"rank", r.rank},
                             {"true_active_rate", r.true_active_rate},
                             {"recall", r.recall},
                             {"magnitude_recall", r.magnitude_recall},
                             {"precision", r.precision},
                             {"sparsity", r.sparsity},
                             {"predictor_cost", r.predictor_cost}});
    }
    if (result->plan.has_value()) {
      const PlacementPlan& p = *result->plan;
      j["placement"] = {{"budget", p.budget},
                        {"cpu_only", p.cpu_only},
                        {"dense_bytes", p.dense_bytes},
                        {"kv_cache_bytes", p.kv_cache_bytes},
                        {"predictor_bytes", p.predictor_bytes},
                        {"scratch_bytes", p.scratch_bytes},
                        {"hot_row_bytes", p.hot_row_bytes},
                        {"hot_neurons", p.hot_neurons()},
                        {"gpu_activation_share", p.gpu_activation_share}};
    }
    std::cout << j.dump() << "\n";
  }
  return 0;
}

}  // namespace pinfer::cli
