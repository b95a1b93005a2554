// Development tool: profiles relu-llama-tiny (or any ReLU model) on a calibration text, trains
// predictors with the given options and measures held-out perplexity with them, per-layer
// recall and sparsity. The profile is cached in a file so that training options can be compared
// quickly. Not part of the product; `pinfer prepare` is.
//
// usage: predictor_experiment MODEL CALIBRATION.txt HELDOUT.u32 CACHE [key=value ...]
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "shared/engine/perplexity.h"
#include "shared/sparse/predictor_training.h"
#include "shared/sparse/profiler.h"
#include "shared/sparse/sparse_ffn.h"
#include "shared/util/mapped_file.h"

using namespace pinfer;

static bool LoadCache(const std::string& path, FfnSamples* s) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  int64_t hdr[3];
  in.read(reinterpret_cast<char*>(hdr), sizeof(hdr));
  s->count = hdr[0];
  s->hidden = static_cast<int>(hdr[1]);
  s->inputs.resize(hdr[2]);
  for (auto& v : s->inputs) {
    v.resize(s->count * s->hidden);
    in.read(reinterpret_cast<char*>(v.data()), v.size() * 2);
  }
  return static_cast<bool>(in);
}

static void SaveCache(const std::string& path, const FfnSamples& s) {
  std::ofstream out(path, std::ios::binary);
  int64_t hdr[3] = {s.count, s.hidden, static_cast<int64_t>(s.inputs.size())};
  out.write(reinterpret_cast<const char*>(hdr), sizeof(hdr));
  for (const auto& v : s.inputs) out.write(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s MODEL CALIB HELDOUT CACHE [key=value...]\n", argv[0]);
    return 2;
  }
  std::map<std::string, std::string> kv;
  for (int i = 5; i < argc; ++i) {
    std::vector<std::string> p = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    kv[p[0]] = p.size() > 1 ? p[1] : "";
  }
  auto num = [&](const std::string& k, double def) {
    double v = def;
    if (kv.count(k)) (void)absl::SimpleAtod(kv[k], &v);
    return v;
  };
  auto model = LoadModel(argv[1]);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const Model& m = **model;
  ThreadPool pool(static_cast<int>(num("threads", 2)));
  auto ops = NewSimdOps(&pool);
  FfnSamples samples;
  if (!LoadCache(argv[4], &samples)) {
    auto text = ReadFileToString(argv[2]);
    auto ids = TokenizeCalibrationText(m, *text);
    std::fprintf(stderr, "calibration tokens: %zu\n", ids->size());
    ProfileOptions po;
    auto t0 = std::chrono::steady_clock::now();
    auto prof = ProfileActivations(m, *ops, *ids, po);
    if (!prof.ok()) {
      std::fprintf(stderr, "%s\n", prof.status().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "profiled %lld tokens in %.1f s\n", (long long)prof->profile.tokens,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    for (int l = 0; l < m.config.n_layers; ++l) {
      std::fprintf(stderr, "layer %d active %.4f\n", l, prof->profile.MeanActiveFraction(l));
    }
    samples = std::move(prof->samples);
    SaveCache(argv[4], samples);
  }
  if (kv.count("max_samples")) {
    const int64_t ms = static_cast<int64_t>(num("max_samples", 0));
    if (ms < samples.count) {
      // Keep the last ms samples' structure: first (ms - hold) training and the same hold-out.
      samples.count = ms;
      for (auto& v : samples.inputs) v.resize(ms * samples.hidden);
    }
  }
  PredictorTrainingOptions to;
  if (kv.count("ranks")) {
    to.ranks.clear();
    for (absl::string_view r : absl::StrSplit(kv["ranks"], ',')) {
      int v;
      (void)absl::SimpleAtoi(r, &v);
      to.ranks.push_back(v);
    }
  }
  to.epochs = static_cast<int>(num("epochs", to.epochs));
  to.target_recall = num("target", to.target_recall);
  to.learning_rate = static_cast<float>(num("lr", to.learning_rate));
  to.positive_weight_power = static_cast<float>(num("pw", to.positive_weight_power));
  to.negative_weight = static_cast<float>(num("nw", to.negative_weight));
  to.batch = static_cast<int>(num("batch", to.batch));
  to.weighted_regression = num("weighted", 1) != 0;
  to.closed_form_init = num("closed", 1) != 0;
  to.lr_decay = num("decay", 0) != 0;
  to.min_sparsity = num("min_sparsity", to.min_sparsity);
  to.per_neuron_thresholds = num("per_neuron", 1) != 0;
  if (kv.count("layers")) {
    for (absl::string_view r : absl::StrSplit(kv["layers"], ',')) {
      int v;
      (void)absl::SimpleAtoi(r, &v);
      to.layers.push_back(v);
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  auto trained = TrainPredictors(
      m, *ops, samples, to, [](const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); });
  if (!trained.ok()) {
    std::fprintf(stderr, "%s\n", trained.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "trained in %.1f s\n",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  const int windows = static_cast<int>(num("windows", 16));
  if (windows == 0) {
    for (const auto& r : trained->reports) {
      std::printf(
          "layer %d rank %3d | heldout-pairs: active %.3f recall %.3f mag %.4f precision %.3f "
          "sparsity %.3f\n",
          r.layer, r.rank, r.true_active_rate, r.recall, r.magnitude_recall, r.precision,
          r.sparsity);
    }
    return 0;
  }
  auto bytes = ReadFileToString(argv[3]);
  std::vector<int32_t> tokens(bytes->size() / 4);
  std::memcpy(tokens.data(), bytes->data(), tokens.size() * 4);
  tokens.resize(static_cast<size_t>(windows) * 512);
  Transformer tr(m, *ops);
  auto dense = ComputePerplexity(tr, tokens, 512);
  auto down_t = TransposeDownProjections(m);
  auto sparse = PredictedSparseFfn::Create(m, *ops, down_t->layers, &trained->predictors);
  (*sparse)->set_measure_recall(true);
  tr.set_ffn(sparse->get());
  auto sp = ComputePerplexity(tr, tokens, 512);
  const SparseFfnStats& st = (*sparse)->stats();
  std::printf("dense ppl %.4f  sparse ppl %.4f  (%+.2f%%)\n", dense->perplexity, sp->perplexity,
              100 * (sp->perplexity / dense->perplexity - 1));
  for (int l = 0; l < m.config.n_layers; ++l) {
    const auto& r = trained->reports[l];
    std::printf(
        "layer %d rank %3d thr %7.3f | heldout-pairs: active %.3f recall %.3f mag %.4f sparsity "
        "%.3f | eval: sparsity %.3f recall %.3f mag %.4f compute %.3f\n",
        l, r.rank, r.threshold, r.true_active_rate, r.recall, r.magnitude_recall, r.sparsity,
        st.Sparsity(l), st.Recall(l), st.MagnitudeRecall(l), st.ComputeFraction(l));
  }
  return 0;
}
