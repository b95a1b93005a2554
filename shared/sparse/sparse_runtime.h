// Opening a model for sparse FFN execution, the one entry point the CLI (and the workers) use:
// a prepared PWRI model runs with its predictors; exact mode runs any ReLU model; an unprepared
// ReLU model with predictors requested is prepared first (see auto_prepare.h) and cached.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "shared/engine/ops.h"
#include "shared/engine/transformer.h"
#include "shared/model/model.h"
#include "shared/sparse/prepared_model.h"
#include "shared/sparse/sparse_ffn.h"

namespace pinfer {

enum class SparseMode {
  kExact,      // gate fully, then only active rows of up and down (ReLU models; no approximation)
  kPredicted,  // the prepared model's predictors choose the rows
};

class SparseSession {
 public:
  const Model& model() const { return *model_; }
  FfnBlock* ffn() const { return ffn_; }
  const SparseFfnStats& stats() const;
  void ResetStats();
  // Predicted mode: also compute the true activations to report recall (costs a dense gate/up).
  void set_measure_recall(bool on);
  SparseMode mode() const { return mode_; }
  const std::string& description() const { return description_; }

 private:
  friend absl::StatusOr<std::unique_ptr<SparseSession>> OpenSparseSession(
      const std::string&, SparseMode, const CpuOps&,
      const std::function<void(const std::string&)>&);
  SparseMode mode_ = SparseMode::kExact;
  std::unique_ptr<Model> owned_model_;
  std::unique_ptr<PreparedModel> prepared_;
  const Model* model_ = nullptr;
  DownTransposed transposed_;
  std::unique_ptr<GateSparseFfn> exact_;
  std::unique_ptr<PredictedSparseFfn> predicted_;
  FfnBlock* ffn_ = nullptr;
  std::string description_;
};

// `path`: a prepared PWRI model, or (exact mode, or predicted mode with auto-preparation) any
// model LoadModel reads. `log` receives progress lines (auto-preparation can take minutes).
absl::StatusOr<std::unique_ptr<SparseSession>> OpenSparseSession(
    const std::string& path, SparseMode mode, const CpuOps& ops,
    const std::function<void(const std::string&)>& log = nullptr);

}  // namespace pinfer
