// The profiler against the transformers library's activation statistics (reference.json), the
// kept FFN inputs against the engine's own record of them, and predictor training's bookkeeping:
// the threshold arithmetic by hand, and the recall training reports equal to what the sparse FFN
// then measures on the same tokens.
#include "shared/sparse/profiler.h"

#include <cmath>
#include <fstream>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/transformer.h"
#include "shared/sparse/predictor_training.h"
#include "shared/sparse/sparse_ffn.h"
#include "tests/sparse/random_model.h"

namespace pinfer {
namespace {

using ::testing::HasSubstr;

const std::string kModelDir = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";

std::vector<int32_t> HeldOut(size_t n) {
  std::ifstream in(kModelDir + "/heldout-tokens.u32", std::ios::binary);
  std::vector<int32_t> t(n);
  for (auto& v : t) {
    uint32_t u;
    in.read(reinterpret_cast<char*>(&u), 4);
    v = static_cast<int32_t>(u);
  }
  return t;
}

TEST(ProfilerTest, ActivationRatesMatchTransformersStatistics) {
  auto model = LoadModel(kModelDir);
  ASSERT_TRUE(model.ok()) << model.status();
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  ProfileOptions o;
  o.keep_inputs = false;
  int64_t last = 0;
  auto r =
      ProfileActivations(**model, *ops, HeldOut(32 * 512), o, [&](int64_t done, int64_t total) {
        EXPECT_GT(done, last);
        EXPECT_EQ(total, 32 * 512);
        last = done;
      });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->profile.tokens, 32 * 512);
  std::ifstream in(kModelDir + "/reference.json");
  nlohmann::json ref = nlohmann::json::parse(in);
  for (int l = 0; l < 6; ++l) {
    SCOPED_TRACE(l);
    const auto& stats = ref["activation_stats"][l];
    // A sample of 4096 tokens against the reference's full measurement.
    EXPECT_NEAR(r->profile.MeanActiveFraction(l), stats["mean_active_fraction"].get<double>(),
                0.02);
    // Per neuron: hot neurons are hot in both (correlation of the frequencies).
    const std::vector<double> want = stats["neuron_freq"].get<std::vector<double>>();
    ASSERT_EQ(want.size(), 1536u);
    double ma = 0, mb = 0;
    for (int j = 0; j < 1536; ++j) {
      ma += r->profile.Frequency(l, j) / 1536;
      mb += want[j] / 1536;
    }
    double sab = 0, saa = 0, sbb = 0;
    for (int j = 0; j < 1536; ++j) {
      const double a = r->profile.Frequency(l, j) - ma, b = want[j] - mb;
      sab += a * b;
      saa += a * a;
      sbb += b * b;
    }
    EXPECT_GT(sab / std::sqrt(saa * sbb), 0.9);
  }
}

TEST(ProfilerTest, KeptInputsAreTheFfnInputsOfTheForwardPass) {
  testing_util::RandomModelOptions mo;
  auto model = testing_util::RandomModel(mo);
  auto ops = NewReferenceOps();
  std::vector<int32_t> tokens(64);
  for (int i = 0; i < 64; ++i) tokens[i] = (i * 7) % mo.vocab;
  ProfileOptions o;
  o.window = 32;
  auto r = ProfileActivations(*model, *ops, tokens, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->samples.count, 64);
  // The engine records the same inputs itself (Transformer::set_keep_ffn_inputs).
  Transformer tr(*model, *ops);
  tr.set_keep_ffn_inputs(true);
  KvCache cache(model->config, 32);
  ASSERT_TRUE(tr.Forward(std::span<const int32_t>(tokens).subspan(32, 32), 0, &cache,
                         LogitsMode::kNone, nullptr)
                  .ok());
  std::vector<float> got(32 * mo.hidden);
  for (int l = 0; l < mo.layers; ++l) {
    r->samples.Get(l, 32, 64, got.data());
    const std::vector<float>& want = tr.ffn_inputs()[l];
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-3f * std::max(1.f, std::fabs(want[i])));  // fp16 storage
    }
    // Counts: exactly the positive gates of those inputs.
    std::vector<float> gate(32 * mo.ffn);
    ops->MatMul(model->layers[l].gate, want.data(), 32, gate.data());
    int64_t positive = 0;
    for (float g : gate) positive += g > 0;
    int64_t counted = 0;
    for (int j = 0; j < mo.ffn; ++j) counted += r->profile.active[l][j];
    EXPECT_NEAR(static_cast<double>(counted), static_cast<double>(positive) * 2, 0.25 * positive)
        << "two windows of similar tokens";
  }
  EXPECT_THAT(ProfileActivations(*model, *ops, std::vector<int32_t>(10, 1), o).status().message(),
              HasSubstr("at least one window of 32 tokens"));
}

TEST(ThresholdTest, WeightedRecallThresholdByHand) {
  // Scores 4, 3, 2, 1 with weights 10, 1, 5, 4 (total 20).
  std::vector<std::pair<float, float>> sw = {{2.f, 5.f}, {4.f, 10.f}, {1.f, 4.f}, {3.f, 1.f}};
  EXPECT_EQ(ThresholdForWeightedRecall(sw, 0.5), 4.f);   // 10 of 20
  EXPECT_EQ(ThresholdForWeightedRecall(sw, 0.51), 3.f);  // 11
  EXPECT_EQ(ThresholdForWeightedRecall(sw, 0.8), 2.f);   // 16
  EXPECT_EQ(ThresholdForWeightedRecall(sw, 0.81), 1.f);  // 20
  EXPECT_EQ(ThresholdForWeightedRecall(sw, 1.0), -INFINITY);
}

// F16 and Q8_0 predictors: what training reports on held-back pairs is what the sparse FFN then
// measures with the stored weights.
class PredictorTrainingTest : public ::testing::TestWithParam<DType> {};
INSTANTIATE_TEST_SUITE_P(StoredTypes, PredictorTrainingTest,
                         ::testing::Values(DType::kF16, DType::kQ8_0),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST_P(PredictorTrainingTest, ReportedRecallIsWhatTheSparseFfnMeasures) {
  testing_util::RandomModelOptions mo;
  mo.hidden = 64;
  mo.ffn = 256;
  auto model = testing_util::RandomModel(mo);
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> tok(0, mo.vocab - 1);
  std::vector<int32_t> tokens(40 * 64);
  for (auto& t : tokens) t = tok(rng);
  ProfileOptions po;
  po.window = 64;
  auto prof = ProfileActivations(*model, *ops, tokens, po);
  ASSERT_TRUE(prof.ok());
  PredictorTrainingOptions to;
  to.ranks = {32};
  to.epochs = 2;
  to.batch = 128;
  to.target_recall = 0.9;
  to.min_sparsity = 0;
  to.dtype = GetParam();
  auto trained = TrainPredictors(*model, *ops, prof->samples, to);
  ASSERT_TRUE(trained.ok()) << trained.status();
  EXPECT_EQ(trained->predictors.layers[1].fc1.dtype, GetParam());
  EXPECT_EQ(trained->predictors.layers[1].fc2.dtype, GetParam());
  ASSERT_EQ(trained->reports.size(), 2u);
  for (const LayerPredictorReport& r : trained->reports) {
    EXPECT_EQ(r.rank, 32);
    EXPECT_NEAR(r.magnitude_recall, 0.9, 0.03);  // per-neuron cut, measured after folding
    EXPECT_FLOAT_EQ(trained->predictors.layers[r.layer].threshold, kFoldedThreshold);
    EXPECT_GT(r.sparsity, 0.05);
  }
  // Layer 1 on the held-back tokens (the last 10%), through the sparse FFN: the same recall.
  const int64_t n = prof->samples.count, hold = n / 10;
  std::vector<float> x(hold * mo.hidden), out(hold * mo.hidden);
  prof->samples.Get(1, n - hold, n, x.data());
  auto down_t = TransposeDownProjections(*model);
  ASSERT_TRUE(down_t.ok());
  auto ffn = PredictedSparseFfn::Create(*model, *ops, down_t->layers, &trained->predictors);
  ASSERT_TRUE(ffn.ok());
  (*ffn)->set_measure_recall(true);
  ASSERT_TRUE((*ffn)->Forward(1, x.data(), static_cast<int>(hold), out.data()).ok());
  EXPECT_NEAR((*ffn)->stats().MagnitudeRecall(1), trained->reports[1].magnitude_recall, 0.01);
  EXPECT_NEAR((*ffn)->stats().Sparsity(1), trained->reports[1].sparsity, 0.01);

  // Q8_0 rows are blocks of 32 values: a rank of 48 cannot be stored.
  PredictorTrainingOptions odd = to;
  odd.dtype = DType::kQ8_0;
  odd.ranks = {48};
  auto bad = TrainPredictors(*model, *ops, prof->samples, odd);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("multiples of 32"));

  // SiLU models are refused with the reason.
  mo.activation = Activation::kSilu;
  auto silu = testing_util::RandomModel(mo);
  auto st = TrainPredictors(*silu, *ops, prof->samples, to);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.status().message(), HasSubstr("ReLU-family"));
}

}  // namespace
}  // namespace pinfer
