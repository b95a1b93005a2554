// See prepare.h. A Hugging Face model is first converted to GGUF (F16 weights stay F16, anything
// else becomes F32 so nothing is rounded), because the prepared model is a GGUF file.
#include "shared/sparse/prepare.h"

#include <chrono>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "shared/model/gguf.h"
#include "shared/model/model.h"
#include "shared/sparse/prepared_model.h"
#include "shared/util/status_macros.h"

namespace pinfer {

std::string FormatPredictorReport(const std::vector<LayerPredictorReport>& reports) {
  std::string s =
      "layer  rank  active  recall  mag.recall  precision  sparsity  predictor cost\n";
  for (const LayerPredictorReport& r : reports) {
    absl::StrAppend(&s, absl::StrFormat("%5d  %4d  %6.3f  %6.3f  %10.4f  %9.3f  %8.3f  %13.3f\n",
                                        r.layer, r.rank, r.true_active_rate, r.recall,
                                        r.magnitude_recall, r.precision, r.sparsity,
                                        r.predictor_cost));
  }
  return s;
}

absl::StatusOr<PrepareResult> PrepareModel(const PrepareOptions& o, const CpuOps& ops,
                                           const PrepareProgress& pg) {
  namespace fs = std::filesystem;
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds_since = [](auto t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  auto log = [&](const std::string& s) {
    if (pg.log) pg.log(s);
  };
  if (o.out_path.empty()) return absl::InvalidArgumentError("no output path");
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(o.model_path));
  const ModelConfig& c = model->config;
  if (c.activation == Activation::kSilu) {
    return absl::UnimplementedError(
        "activation predictors need a ReLU-family model; this model is SiLU-gated");
  }

  // The GGUF the prepared file is built from.
  std::string temp_source;
  std::unique_ptr<GgufFile> source;
  if (model->format == "gguf") {
    ASSIGN_OR_RETURN(source, GgufFile::Open(o.model_path, {kGgufMagic, kPowerInferMagic}));
  } else {
    temp_source = o.out_path + ".source.tmp";
    GgufConvertOptions co;
    co.type = model->layers[0].gate.dtype == DType::kF16 ? GgmlType::kF16 : GgmlType::kF32;
    log(absl::StrCat("converting ", o.model_path, " to GGUF (", GgmlTypeName(static_cast<uint32_t>(co.type)), ")"));
    RETURN_IF_ERROR(ConvertHuggingFaceToGguf(o.model_path, temp_source, co));
    ASSIGN_OR_RETURN(source, GgufFile::Open(temp_source));
  }
  struct Cleanup {
    std::string path;
    ~Cleanup() {
      if (!path.empty()) std::filesystem::remove(path);
    }
  } cleanup{temp_source};

  // 1. Profile.
  ASSIGN_OR_RETURN(std::vector<int32_t> tokens, TokenizeCalibrationText(*model, o.calibration_text));
  if (o.max_calibration_tokens > 0 && static_cast<int64_t>(tokens.size()) > o.max_calibration_tokens) {
    tokens.resize(o.max_calibration_tokens);
  }
  ProfileOptions po;
  po.window = std::min(o.window, c.max_context);
  const auto tp = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(ProfileResult prof,
                   ProfileActivations(*model, ops, tokens, po, [&](int64_t done, int64_t total) {
                     if (pg.bar) pg.bar("profiling", static_cast<double>(done) / total);
                   }));
  PrepareResult result;
  result.profile_seconds = seconds_since(tp);
  {
    std::string rates;
    for (int l = 0; l < c.n_layers; ++l) {
      absl::StrAppend(&rates, l == 0 ? "" : " ", absl::StrFormat("%.3f", prof.profile.MeanActiveFraction(l)));
    }
    log(absl::StrFormat("profiled %d tokens in %.1f s; active fraction per layer: %s",
                        prof.profile.tokens, result.profile_seconds, rates));
  }

  // 2. Train predictors.
  const auto tt = std::chrono::steady_clock::now();
  int layers_done = 0;
  ASSIGN_OR_RETURN(TrainedPredictors trained,
                   TrainPredictors(*model, ops, prof.samples, o.training, [&](const std::string& s) {
                     log(s);
                     if (pg.bar) pg.bar("training", static_cast<double>(++layers_done) /
                                                        (c.n_layers * o.training.ranks.size()));
                   }));
  result.train_seconds = seconds_since(tt);
  prof.samples = FfnSamples();  // free the inputs
  result.reports = trained.reports;
  log(FormatPredictorReport(result.reports));

  // 3. Write the prepared model.
  if (pg.bar) pg.bar("writing", 0);
  PreparedContents contents;
  contents.profile = prof.profile;
  contents.predictors = std::move(trained.predictors);
  if (!o.source_fingerprint.empty()) {
    contents.string_keys.emplace_back("pinfer.sparse.source", o.source_fingerprint);
  }
  RETURN_IF_ERROR(WritePreparedModel(*source, contents, o.out_path));
  if (pg.bar) pg.bar("writing", 1);
  log(absl::StrCat("wrote ", o.out_path));
  result.profile = std::move(prof.profile);

  // 4. Place neurons and write the GPU index.
  if (o.vram_budget.has_value()) {
    ASSIGN_OR_RETURN(PreparedModel pm, LoadPreparedModel(o.out_path));
    ASSIGN_OR_RETURN(ActivationProfile stored, StoredProfile(pm));
    PlacementOptions plo;
    plo.vram_budget = *o.vram_budget;
    plo.context = o.context;
    plo.max_batch = o.max_batch;
    plo.allow_cpu_only = o.allow_cpu_only;
    ASSIGN_OR_RETURN(PlacementPlan plan, PlanPlacement(*pm.model, stored, &pm.predictors, plo));
    log(plan.Summary());
    if (!plan.cpu_only) {
      result.gpu_index_path = GpuIndexPath(o.out_path);
      RETURN_IF_ERROR(WriteGpuIndex(GpuIndexFromPlan(plan, c.ffn_size), result.gpu_index_path));
      log(absl::StrCat("wrote ", result.gpu_index_path));
    } else {
      fs::remove(GpuIndexPath(o.out_path));
    }
    result.plan = std::move(plan);
  }
  result.total_seconds = seconds_since(t0);
  return result;
}

}  // namespace pinfer
