// See sparse_runtime.h.
#include "shared/sparse/sparse_runtime.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "shared/sparse/auto_prepare.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

bool HasPowerInferMagic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string(magic, 4) == kPowerInferMagic;
}

// A GGUF prepared for magnitude sparsity (SiLU) carries per-layer thresholds.
bool MagnitudeThresholds(const std::string& path, std::vector<float>* out) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  if (!in.read(magic, 4) || std::string(magic, 4) != kGgufMagic) return false;
  auto f = GgufFile::Open(path);
  if (!f.ok() || !(*f)->HasKey(kMagnitudeThresholdsKey)) return false;
  auto t = (*f)->GetF32Array(kMagnitudeThresholdsKey);
  if (!t.ok()) return false;
  *out = std::move(*t);
  return !out->empty();
}

}  // namespace

const SparseFfnStats& SparseSession::stats() const {
  return exact_ != nullptr ? exact_->stats() : predicted_->stats();
}

void SparseSession::ResetStats() {
  if (exact_ != nullptr) exact_->ResetStats();
  if (predicted_ != nullptr) predicted_->ResetStats();
}

void SparseSession::set_measure_recall(bool on) {
  if (predicted_ != nullptr) predicted_->set_measure_recall(on);
}

absl::StatusOr<std::unique_ptr<SparseSession>> OpenSparseSession(
    const std::string& path, SparseMode mode, const CpuOps& ops,
    const std::function<void(const std::string&)>& log) {
  auto s = std::unique_ptr<SparseSession>(new SparseSession());
  s->mode_ = mode;
  std::string prepared_path;
  std::vector<float> magnitude_thresholds;
  if (HasPowerInferMagic(path) || MagnitudeThresholds(path, &magnitude_thresholds)) {
    prepared_path = path;
  } else if (mode == SparseMode::kPredicted) {
    ASSIGN_OR_RETURN(prepared_path, EnsurePrepared(path, ops, log));
    MagnitudeThresholds(prepared_path, &magnitude_thresholds);
  }

  std::vector<TensorView> down_t;
  if (!magnitude_thresholds.empty()) {
    // A SiLU model prepared for magnitude sparsity: no predictors, thresholds on |silu(gate)|.
    ASSIGN_OR_RETURN(s->owned_model_, LoadModel(prepared_path));
    s->model_ = s->owned_model_.get();
    ASSIGN_OR_RETURN(s->transposed_, TransposeDownProjections(*s->model_));
    ASSIGN_OR_RETURN(s->exact_, GateSparseFfn::Create(*s->model_, ops, s->transposed_.layers,
                                                      magnitude_thresholds));
    s->ffn_ = s->exact_.get();
    s->mode_ = SparseMode::kExact;  // no predictor to measure
    s->description_ = absl::StrCat("model ", prepared_path, ", magnitude-threshold sparse FFN");
    return s;
  }
  if (!prepared_path.empty()) {
    ASSIGN_OR_RETURN(PreparedModel pm, LoadPreparedModel(prepared_path));
    s->prepared_ = std::make_unique<PreparedModel>(std::move(pm));
    s->model_ = s->prepared_->model.get();
    down_t = s->prepared_->down_t();
    s->description_ = absl::StrCat("prepared model ", prepared_path);
  } else {
    ASSIGN_OR_RETURN(s->owned_model_, LoadModel(path));
    s->model_ = s->owned_model_.get();
    ASSIGN_OR_RETURN(s->transposed_, TransposeDownProjections(*s->model_));
    down_t = s->transposed_.layers;
    s->description_ = absl::StrCat("model ", path);
  }
  if (mode == SparseMode::kExact) {
    ASSIGN_OR_RETURN(s->exact_, GateSparseFfn::Create(*s->model_, ops, down_t));
    s->ffn_ = s->exact_.get();
    absl::StrAppend(&s->description_, ", exact sparse FFN");
  } else {
    ASSIGN_OR_RETURN(s->predicted_, PredictedSparseFfn::Create(*s->model_, ops, down_t,
                                                               &s->prepared_->predictors));
    s->ffn_ = s->predicted_.get();
    absl::StrAppend(&s->description_, ", predictor-driven sparse FFN");
  }
  return s;
}

}  // namespace pinfer
