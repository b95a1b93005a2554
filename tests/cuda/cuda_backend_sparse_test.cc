// The GPU's own sparsity decisions: predicted mode against the CPU's predicted sparse FFN (and
// PowerInfer's pre-norm thresholds), and the adaptive hot set's cache slots in exact and predicted
// mode against the CPU reference.
// Judged as cuda_backend_test_fixture.h says; without a CUDA device every test skips.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tests/cuda/cuda_backend_test_fixture.h"

namespace pinfer {
namespace cuda_test {
namespace {

// The adaptive hot set's kernels side: cold neurons copied into cache slots in the background
// and listed (kGiven) as local rows n_hot + slot, the rest of the cold neurons on the CPU. Every
// neuron is listed on exactly one side (inactive ones give exactly zero through ReLU), so the
// logits at every position equal the CPU reference's; halfway, half of the slots are reloaded
// with other neurons, the evicted ones moving back to the CPU side. For the model's F16 rows and
// for Q8_0 / Q4_0 copies, whose slots are gathered in GGUF's layout and rewritten into the split
// layout of the rows around them (ColdStreamer::LoadRows); the quantized ones against the
// reference on the weights the split multiplies, as QuantizedModelStepLogitsMatchCpuReference.
// The last case mixes types as llama.cpp's K mixes do: Q8_0 gate and up rows over Q4_0 down_t
// rows in every other layer (the slots' gathers and split-layout rewrites per matrix type).
TEST_F(CudaBackendTest, AdaptiveCacheRowsMatchCpuReference) {
  constexpr DType kMixed = DType::kF32;  // stands for the mix below
  for (DType type : {DType::kF16, DType::kQ8_0, DType::kQ4_0, kMixed}) {
    SCOPED_TRACE(type == kMixed ? std::string("Q8_0 with Q4_0 down_t in even layers")
                                : std::string(DTypeName(type)));
    std::vector<TensorView> qdown_t, q4_down_t;
    std::unique_ptr<Model> qmodel, split_model, q4_model;
    if (type == kMixed) {
      qmodel = QuantizedCopy(*model_, *down_t_, DType::kQ8_0, &qdown_t);
      q4_model = QuantizedCopy(*model_, *down_t_, DType::kQ4_0, &q4_down_t);
      for (size_t l = 0; l < qdown_t.size(); l += 2) qdown_t[l] = q4_down_t[l];
      split_model = WithDownFromRows(*qmodel, qdown_t);
    } else if (type != DType::kF16) {
      qmodel = QuantizedCopy(*model_, *down_t_, type, &qdown_t);
      split_model = WithDownFromRows(*qmodel, qdown_t);
    }
    const Model& weights = qmodel != nullptr ? *qmodel : *model_;
    const std::vector<TensorView>& down_t = qmodel != nullptr ? qdown_t : *down_t_;
    const Model& ref_model = qmodel != nullptr ? *split_model : *model_;
    const double limit = qmodel != nullptr ? 1e-3 : 1e-6;
    CheckAdaptiveCacheRows(weights, down_t, ref_model, limit);
  }
}

}  // namespace

void CudaBackendTest::CheckAdaptiveCacheRows(const Model& weights,
                                             const std::vector<TensorView>& down_t,
                                             const Model& ref_model, double limit) {
  const ModelConfig& c = model_->config;
  const int slots = 32;
  cuda::ModelUpload u = Upload(weights, down_t, /*hot=*/true);
  for (cuda::LayerUpload& lu : u.layers) lu.cache_rows = slots;
  auto backend = Create(u);
  ASSERT_NE(backend, nullptr);
  // cached[l][s]: the neuron in slot s (-1: empty).
  std::vector<std::vector<int32_t>> cached(c.n_layers, std::vector<int32_t>(slots, -1));
  auto load = [&](int first_slot, int count, int stride, int offset) {
    for (int l = 0; l < c.n_layers; ++l) {
      std::vector<int32_t> ss, ns;
      for (int s = first_slot; s < first_slot + count; ++s) {
        // A neuron lives in one slot at most (the bookkeeping guarantees it; so must the test).
        size_t k = offset + s * stride;
        auto in_other_slot = [&](int32_t j) {
          for (int o = 0; o < slots; ++o) {
            if (o != s && cached[l][o] == j) return true;
          }
          return false;
        };
        while (in_other_slot((*cold_ids_)[l][k % (*cold_ids_)[l].size()])) ++k;
        ss.push_back(s);
        ns.push_back((*cold_ids_)[l][k % (*cold_ids_)[l].size()]);
        cached[l][s] = ns.back();
      }
      cuda::BackendStatus st = backend->LoadCacheRows(l, ss, ns);
      ASSERT_TRUE(st.ok()) << st.message;
    }
    bool landed = false;
    ASSERT_TRUE(backend->CacheRowsLanded(/*wait=*/true, &landed).ok());
    ASSERT_TRUE(landed);
  };
  load(0, slots, 7, 3);
  std::vector<std::vector<int32_t>> given_hot(c.n_layers), given_cold(c.n_layers);
  auto split = [&]() {
    for (int l = 0; l < c.n_layers; ++l) {
      const int n_hot = static_cast<int>((*hot_ids_)[l].size());
      given_hot[l].clear();
      for (int i = 0; i < n_hot; ++i) given_hot[l].push_back(i);
      for (int s = 0; s < slots; ++s) {
        if (cached[l][s] >= 0) given_hot[l].push_back(n_hot + s);
      }
      given_cold[l].clear();
      for (int32_t j : (*cold_ids_)[l]) {
        if (std::find(cached[l].begin(), cached[l].end(), j) == cached[l].end()) {
          given_cold[l].push_back(j);
        }
      }
    }
  };
  split();
  CpuColdFfn cold(weights, down_t, *cold_ids_);
  std::unique_ptr<CpuOps> ref_ops = NewReferenceOps();
  Transformer ref(ref_model, *ref_ops);
  KvCache cache(c, 64);
  const int V = c.vocab_size;
  std::vector<int32_t> tokens =
      (*reference_)["prompts"][10]["input_ids"].get<std::vector<int32_t>>();
  std::vector<float> got(V), want(V);
  for (int pos = 0; pos < static_cast<int>(tokens.size()); ++pos) {
    if (pos == static_cast<int>(tokens.size()) / 2) {
      load(0, slots / 2, 11, 5);  // evicts half the cached neurons, caches others
      split();
    }
    ASSERT_TRUE(ref.Forward({&tokens[pos], 1}, pos, &cache, LogitsMode::kLast, want.data()).ok());
    cuda::ForwardArgs a;
    a.tokens = &tokens[pos];
    a.n = 1;
    a.pos0 = pos;
    a.mode = cuda::FfnMode::kGiven;
    a.given_hot = &given_hot;
    a.given_cold = &given_cold;
    a.cold = &cold;
    a.logits = got.data();
    cuda::BackendStatus st = backend->Forward(a);
    ASSERT_TRUE(st.ok()) << st.message;
    double err = 0, norm = 0;
    for (int i = 0; i < V; ++i) {
      ASSERT_FALSE(std::isnan(got[i]));
      err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
      norm += double(want[i]) * want[i];
    }
    EXPECT_LE(err / norm, limit) << "position " << pos;
  }
  // A cuBLAS batch would compute every slot, loaded or not: refused once slots are loaded.
  cuda::ForwardArgs a;
  a.tokens = tokens.data();
  a.n = static_cast<int>(tokens.size());
  a.mode = cuda::FfnMode::kGiven;
  a.given_hot = &given_hot;
  a.given_cold = &given_cold;
  a.cold = &cold;
  a.logits = got.data();
  cuda::BackendStatus st = backend->Forward(a);
  EXPECT_EQ(st.code, cuda::Code::kFailedPrecondition);
  EXPECT_NE(st.message.find("cannot use the adaptive cache"), std::string::npos) << st.message;
  // Hot neurons cannot be loaded into slots.
  st = backend->LoadCacheRows(0, {0}, {(*hot_ids_)[0][0]});
  EXPECT_EQ(st.code, cuda::Code::kInvalidArgument);
  EXPECT_NE(st.message.find("is not a cold neuron"), std::string::npos) << st.message;
}

namespace {

// --sparse on the GPU: the module's predictors (kPredicted) pick hot and cold neurons, the cold
// ones reach the callback as a list, and each decode step's logits equal the CPU reference with
// the same predictors.
TEST_F(CudaBackendTest, PredictedModeMatchesCpuPredictedSparseFfn) {
  const ModelConfig& c = model_->config;
  std::vector<int32_t> tokens =
      (*reference_)["prompts"][3]["input_ids"].get<std::vector<int32_t>>();
  std::unique_ptr<PredictedCase> pc = MakePredictedCase(*model_, *down_t_, tokens);
  ASSERT_GT(pc->min_margin, 1e-4) << "no safe threshold gap; change the seed";
  const int V = c.vocab_size;
  cuda::ModelUpload u = WithPredictors(Upload(/*hot=*/true), *pc);
  auto backend = Create(u);
  ASSERT_NE(backend, nullptr);
  CpuColdFfn cold(*model_, *down_t_, *cold_ids_);
  std::vector<float> got(V);
  int64_t hot_computed = 0, cold_listed = 0;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    cuda::ForwardArgs a = PredictedStep(tokens, pos, &cold, got.data());
    cuda::BackendStatus st = backend->Forward(a);
    ASSERT_TRUE(st.ok()) << st.message;
    hot_computed += backend->last_stats().hot_rows_computed;
    cold_listed += backend->last_stats().cold_rows_requested;
    EXPECT_LE(Nmse(got.data(), pc->want.data() + pos * V, V), 1e-6) << "position " << pos;
  }
  // About 30% of the neurons are predicted active per token, on both sides of the split.
  int64_t hot_total = 0;
  for (const auto& h : *hot_ids_) hot_total += static_cast<int64_t>(h.size());
  const double steps = static_cast<double>(tokens.size());
  EXPECT_GT(hot_computed / steps, 0.2 * hot_total);
  EXPECT_LT(hot_computed / steps, 0.4 * hot_total);
  EXPECT_GT(cold_listed / steps, 0.2 * (c.n_layers * c.ffn_size - hot_total));
  EXPECT_LT(cold_listed / steps, 0.4 * (c.n_layers * c.ffn_size - hot_total));
}

// PowerInfer's pre-norm predictors with a non-zero threshold (ProSparse's files): the module
// multiplies each token's scores by rms(residual), which the FFN norm computes anyway, and picks
// the neurons the CPU's PredictedSparseFfn picks, so the logits match. Without that factor it
// would pick other neurons.
TEST_F(CudaBackendTest, PreNormPredictorThresholdsMatchCpuPredictedSparseFfn) {
  const ModelConfig& c = model_->config;
  std::vector<int32_t> tokens =
      (*reference_)["prompts"][3]["input_ids"].get<std::vector<int32_t>>();
  std::unique_ptr<PredictedCase> pc =
      MakePredictedCase(*model_, *down_t_, tokens, 0.6, 0.8, /*reads_residual=*/true);
  // Scaled scores are as small as the residual (layer 0's threshold is about 0.01), so the gap is
  // judged against the threshold: fp32 rounding differs by about 1e-6 of it.
  ASSERT_GT(pc->min_relative_margin, 1e-4) << "no safe threshold gap; change the seed";
  for (const LayerPredictor& p : pc->preds.layers) ASSERT_TRUE(ScoresNeedResidual(p));
  const int V = c.vocab_size;
  cuda::ModelUpload u = WithPredictors(Upload(/*hot=*/true), *pc);
  cuda::ModelUpload unscaled = u;
  for (cuda::LayerUpload& l : unscaled.layers) l.pred_scores_times_rms = false;
  auto backend = Create(u);
  auto wrong = Create(unscaled);
  ASSERT_NE(backend, nullptr);
  ASSERT_NE(wrong, nullptr);
  CpuColdFfn cold(*model_, *down_t_, *cold_ids_);
  std::vector<float> got(V), other(V);
  int64_t selected = 0, selected_unscaled = 0;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    cuda::BackendStatus st = backend->Forward(PredictedStep(tokens, pos, &cold, got.data()));
    ASSERT_TRUE(st.ok()) << st.message;
    selected += backend->last_stats().hot_rows_computed + backend->last_stats().cold_rows_requested;
    EXPECT_LE(Nmse(got.data(), pc->want.data() + pos * V, V), 1e-6) << "position " << pos;
    st = wrong->Forward(PredictedStep(tokens, pos, &cold, other.data()));
    ASSERT_TRUE(st.ok()) << st.message;
    selected_unscaled +=
        wrong->last_stats().hot_rows_computed + wrong->last_stats().cold_rows_requested;
  }
  EXPECT_GT(std::abs(static_cast<double>(selected_unscaled - selected)), 0.05 * selected)
      << selected << " neurons selected with the rms factor, " << selected_unscaled << " without";
}

// The adaptive hot set in predicted mode (what `--sparse --adaptive-cache-rows` runs): driven by
// AdaptiveHotSet from the active neurons each step reports, cache slots fill and churn while the
// logits stay equal to the CPU reference's (every predicted-active neuron computed once, by the
// GPU's static rows, a slot, or the cold side). In lockstep with a backend without the cache, the
// same neurons are active and the cache moves some of them from the cold side to the GPU.
TEST_F(CudaBackendTest, AdaptiveCacheInPredictedModeMatchesCpuReference) {
  const ModelConfig& c = model_->config;
  std::vector<int32_t> tokens;  // the first six prompts, 39 tokens
  for (int i = 0; i < 6; ++i) {
    for (int32_t t : (*reference_)["prompts"][i]["input_ids"].get<std::vector<int32_t>>()) {
      tokens.push_back(t);
    }
  }
  std::unique_ptr<PredictedCase> pc = MakePredictedCase(*model_, *down_t_, tokens, 0.5, 0.9);
  ASSERT_GT(pc->min_margin, 1e-4) << "no safe threshold gap; change the seed";
  const int V = c.vocab_size, slots = 48;
  cuda::ModelUpload u = WithPredictors(Upload(/*hot=*/true), *pc);
  auto plain = Create(u);
  ASSERT_NE(plain, nullptr);
  for (cuda::LayerUpload& lu : u.layers) lu.cache_rows = slots;
  // The driver counting between steps, then on its own thread (flushed after each step, so that
  // both make the same calls, one step apart).
  for (bool background : {false, true}) {
    SCOPED_TRACE(background ? "counting in the background" : "counting between steps");
    auto cached = Create(u);
    ASSERT_NE(cached, nullptr);
    HotCacheOptions ho;
    ho.slots = slots;
    ho.decay = 0.8;
    ho.min_gain = 0.5;
    ho.max_swaps = 16;
    absl::StatusOr<AdaptiveHotCache> hc = AdaptiveHotCache::Create(c.ffn_size, *hot_ids_, ho);
    ASSERT_TRUE(hc.ok()) << hc.status();
    gpuworker::ModuleCacheSlots target(cached.get());
    AdaptiveHotSet set(std::move(*hc), &target, /*plan_every=*/1, background);
    CpuColdFfn cold(*model_, *down_t_, *cold_ids_);
    std::vector<float> got(V), got_plain(V);
    std::vector<std::vector<int32_t>> active;
    int64_t moved = 0;
    for (size_t pos = 0; pos < tokens.size(); ++pos) {
      cuda::ForwardArgs a = PredictedStep(tokens, pos, &cold, got_plain.data());
      cuda::BackendStatus st = plain->Forward(a);
      ASSERT_TRUE(st.ok()) << st.message;
      const cuda::ForwardStats p = plain->last_stats();
      a.logits = got.data();
      a.active_out = &active;
      st = cached->Forward(a);
      ASSERT_TRUE(st.ok()) << st.message;
      const cuda::ForwardStats q = cached->last_stats();
      EXPECT_LE(Nmse(got.data(), pc->want.data() + pos * V, V), 1e-6) << "position " << pos;
      // The same active neurons, each computed once; the cache only moves some to the GPU.
      int64_t reported = 0;
      for (const auto& v : active) reported += static_cast<int64_t>(v.size());
      EXPECT_EQ(q.hot_rows_computed + q.cold_rows_requested, reported) << "position " << pos;
      EXPECT_EQ(p.hot_rows_computed + p.cold_rows_requested, reported) << "position " << pos;
      EXPECT_GE(q.hot_rows_computed, p.hot_rows_computed) << "position " << pos;
      moved += q.hot_rows_computed - p.hot_rows_computed;
      absl::Status ast = set.AfterStep(active);
      ASSERT_TRUE(ast.ok()) << ast;
      set.Flush();
    }
    EXPECT_GT(set.swaps_committed(), static_cast<uint64_t>(c.n_layers * slots));  // filled, churned
    EXPECT_GT(moved, static_cast<int64_t>(tokens.size()));  // more than a neuron per step
    // The module's rules: a slot still serving cannot be reloaded; a slot serves only what landed.
    int serving = -1;
    for (int s = 0; s < slots && serving < 0; ++s) {
      cuda::BackendStatus st = cached->LoadCacheRows(0, {s}, {(*cold_ids_)[0][0]});
      if (st.code == cuda::Code::kFailedPrecondition) serving = s;
    }
    EXPECT_GE(serving, 0) << "no slot of layer 0 serves a neuron after the run";
    cuda::BackendStatus st = cached->SetCacheSlots(0, {0}, {(*hot_ids_)[0][0]});
    EXPECT_EQ(st.code, cuda::Code::kInvalidArgument);
    EXPECT_NE(st.message.find("is not a cold neuron"), std::string::npos) << st.message;
  }
}

}  // namespace
}  // namespace cuda_test
}  // namespace pinfer
