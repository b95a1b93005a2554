// `pinfer prepare` as a library call: profile, train predictors, write the PWRI model, place
// neurons under a VRAM budget and write the GPU index. Also used by auto-preparation.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/engine/ops.h"
#include "shared/sparse/placement.h"
#include "shared/sparse/predictor_training.h"
#include "shared/sparse/profiler.h"

namespace pinfer {

struct PrepareOptions {
  std::string model_path;
  std::string calibration_text;
  std::string out_path;
  int64_t max_calibration_tokens = 0;  // 0: the whole text
  int window = 512;
  PredictorTrainingOptions training;
  std::optional<uint64_t> vram_budget;  // no GPU index without one
  int context = 2048;
  int max_batch = 32;
  bool allow_cpu_only = true;  // a budget below the dense parts gives a CPU-only plan (no index)
  // SiLU models: the fraction of neurons each layer's magnitude threshold skips.
  double target_sparsity = 0.5;
  // Stored in the prepared file so that a cached preparation can be recognised.
  std::string source_fingerprint;
};

struct PrepareProgress {
  // A stage ("profiling", "training", "writing") and its fraction done, for progress bars.
  std::function<void(const std::string& stage, double fraction)> bar;
  // Finished lines (per-layer results, summaries).
  std::function<void(const std::string& line)> log;
};

struct PrepareResult {
  ActivationProfile profile;
  std::vector<LayerPredictorReport> reports;
  std::optional<PlacementPlan> plan;  // in the prepared file's neuron numbering
  std::string gpu_index_path;         // empty when none was written
  double profile_seconds = 0, train_seconds = 0, total_seconds = 0;
  // SiLU models: per-layer magnitude thresholds and their measured quality cost (perplexity on
  // the last calibration windows, dense and sparse).
  std::vector<float> magnitude_thresholds;
  double heldout_dense_perplexity = 0, heldout_sparse_perplexity = 0;
};

absl::StatusOr<PrepareResult> PrepareModel(const PrepareOptions& options, const CpuOps& ops,
                                           const PrepareProgress& progress = {});

// One line per layer: rank, true rate, recall, magnitude recall, precision, sparsity, cost.
std::string FormatPredictorReport(const std::vector<LayerPredictorReport>& reports);

}  // namespace pinfer
