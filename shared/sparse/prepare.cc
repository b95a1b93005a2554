// See prepare.h. A Hugging Face model is first converted to GGUF (F16 weights stay F16, anything
// else becomes F32 so nothing is rounded), because the prepared model is a GGUF file.
#include "shared/sparse/prepare.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "shared/engine/perplexity.h"
#include "shared/engine/transformer.h"
#include "shared/model/gguf.h"
#include "shared/model/model.h"
#include "shared/sparse/prepared_model.h"
#include "shared/util/status_macros.h"

namespace pinfer {

std::string FormatPredictorReport(const std::vector<LayerPredictorReport>& reports) {
  std::string s = "layer  rank  active  recall  mag.recall  precision  sparsity  predictor cost\n";
  for (const LayerPredictorReport& r : reports) {
    absl::StrAppend(
        &s, absl::StrFormat("%5d  %4d  %6.3f  %6.3f  %10.4f  %9.3f  %8.3f  %13.3f\n", r.layer,
                            r.rank, r.true_active_rate, r.recall, r.magnitude_recall, r.precision,
                            r.sparsity, r.predictor_cost));
  }
  return s;
}

namespace {

// SiLU models have no exact zeros. Training-free magnitude sparsity (as in CATS): per layer, the
// threshold on |silu(gate)| below which the target fraction of neurons falls on the calibration
// tokens; those neurons skip up and down. The quality cost is measured, not assumed.
absl::StatusOr<PrepareResult> PrepareMagnitudeSparsity(
    const PrepareOptions& o, const CpuOps& ops, const Model& model, const GgufFile& source,
    const std::vector<int32_t>& tokens, ProfileResult prof, PrepareResult result,
    const std::function<void(const std::string&)>& log, std::chrono::steady_clock::time_point t0) {
  const ModelConfig& c = model.config;
  if (!(o.target_sparsity >= 0 && o.target_sparsity < 1)) {
    return absl::InvalidArgumentError("target sparsity must be in [0, 1)");
  }
  const int H = c.hidden_size, F = c.ffn_size;
  const int64_t n = prof.samples.count;
  const int64_t step = std::max<int64_t>(1, n / 8192);  // about 8K tokens per layer
  ActivationProfile& p = prof.profile;
  p.tokens = 0;
  std::vector<float> x(H), g(F), mags;
  for (int l = 0; l < c.n_layers; ++l) {
    mags.clear();
    std::vector<float> xs;
    for (int64_t t = 0; t < n; t += step) {
      prof.samples.Get(l, t, t + 1, x.data());
      xs.insert(xs.end(), x.begin(), x.end());
    }
    const int count = static_cast<int>(xs.size() / H);
    std::vector<float> gs(static_cast<size_t>(count) * F);
    ops.MatMul(model.layers[l].gate, xs.data(), count, gs.data());
    for (float v : gs) mags.push_back(std::fabs(v / (1.f + std::exp(-v))));
    const size_t k = static_cast<size_t>(o.target_sparsity * (mags.size() - 1));
    std::vector<float> sorted = mags;
    std::nth_element(sorted.begin(), sorted.begin() + k, sorted.end());
    const float thr = o.target_sparsity == 0 ? -1.f : sorted[k];
    result.magnitude_thresholds.push_back(thr);
    std::fill(p.active[l].begin(), p.active[l].end(), 0);
    for (size_t i = 0; i < mags.size(); ++i) p.active[l][i % F] += mags[i] > thr;
    p.tokens = count;
  }
  prof.samples = FfnSamples();

  // Quality: the last (at most 4) calibration windows, dense and sparse.
  const int window = std::min(o.window, c.max_context);
  const int64_t windows = static_cast<int64_t>(tokens.size()) / window;
  const int64_t use = std::min<int64_t>(4, windows);
  if (use > 0) {
    std::span<const int32_t> tail(tokens.data() + (windows - use) * window, use * window);
    Transformer tr(model, ops);
    ASSIGN_OR_RETURN(PerplexityResult dense, ComputePerplexity(tr, tail, window));
    ASSIGN_OR_RETURN(DownTransposed dt, TransposeDownProjections(model));
    ASSIGN_OR_RETURN(std::unique_ptr<GateSparseFfn> ffn,
                     GateSparseFfn::Create(model, ops, dt.layers, result.magnitude_thresholds));
    tr.set_ffn(ffn.get());
    ASSIGN_OR_RETURN(PerplexityResult sparse, ComputePerplexity(tr, tail, window));
    result.heldout_dense_perplexity = dense.perplexity;
    result.heldout_sparse_perplexity = sparse.perplexity;
    log(absl::StrFormat(
        "magnitude sparsity %.0f%% (SiLU, training-free): perplexity %.4f -> %.4f (%+.2f%%) on "
        "the last %d calibration windows; measured sparsity %.3f",
        100 * o.target_sparsity, dense.perplexity, sparse.perplexity,
        100 * (sparse.perplexity / dense.perplexity - 1), use, ffn->stats().Sparsity()));
  }
  std::vector<std::pair<std::string, std::string>> keys;
  if (!o.source_fingerprint.empty())
    keys.emplace_back("pinfer.sparse.source", o.source_fingerprint);
  RETURN_IF_ERROR(
      WriteMagnitudeSparseModel(source, p, result.magnitude_thresholds, keys, o.out_path));
  log(absl::StrCat("wrote ", o.out_path));
  if (o.vram_budget.has_value()) {
    PlacementOptions plo;
    plo.vram_budget = *o.vram_budget;
    plo.context = o.context;
    plo.max_batch = o.max_batch;
    plo.allow_cpu_only = o.allow_cpu_only;
    ASSIGN_OR_RETURN(PlacementPlan plan, PlanPlacement(model, p, nullptr, plo));
    log(plan.Summary());
    if (!plan.cpu_only) {
      result.gpu_index_path = GpuIndexPath(o.out_path);
      RETURN_IF_ERROR(WriteGpuIndex(GpuIndexFromPlan(plan, F), result.gpu_index_path));
    }
    result.plan = std::move(plan);
  }
  result.profile = std::move(p);
  result.total_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace

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

  // The GGUF the prepared file is built from.
  std::string temp_source;
  std::unique_ptr<GgufFile> source;
  if (model->format == "gguf") {
    ASSIGN_OR_RETURN(source, GgufFile::Open(o.model_path, {kGgufMagic, kPowerInferMagic}));
  } else {
    temp_source = o.out_path + ".source.tmp";
    GgufConvertOptions co;
    co.type = model->layers[0].gate.dtype == DType::kF16 ? GgmlType::kF16 : GgmlType::kF32;
    log(absl::StrCat("converting ", o.model_path, " to GGUF (",
                     GgmlTypeName(static_cast<uint32_t>(co.type)), ")"));
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
  ASSIGN_OR_RETURN(std::vector<int32_t> tokens,
                   TokenizeCalibrationText(*model, o.calibration_text));
  if (o.max_calibration_tokens > 0 &&
      static_cast<int64_t>(tokens.size()) > o.max_calibration_tokens) {
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
      absl::StrAppend(&rates, l == 0 ? "" : " ",
                      absl::StrFormat("%.3f", prof.profile.MeanActiveFraction(l)));
    }
    log(absl::StrFormat("profiled %d tokens in %.1f s; active fraction per layer: %s",
                        prof.profile.tokens, result.profile_seconds, rates));
  }

  if (c.activation == Activation::kSilu) {
    return PrepareMagnitudeSparsity(o, ops, *model, *source, tokens, std::move(prof),
                                    std::move(result), log, t0);
  }

  // 2. Train predictors.
  const auto tt = std::chrono::steady_clock::now();
  int layers_done = 0;
  ASSIGN_OR_RETURN(
      TrainedPredictors trained,
      TrainPredictors(*model, ops, prof.samples, o.training, [&](const std::string& s) {
        log(s);
        if (pg.bar)
          pg.bar("training",
                 static_cast<double>(++layers_done) / (c.n_layers * o.training.ranks.size()));
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
