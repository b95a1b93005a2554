// Sparse FFN execution against the dense FFN: the exact (gate-driven) mode must reproduce the
// dense FFN for every dtype and activation, the predictor-driven mode must reproduce it when the
// predictor is perfect, and on relu-llama-tiny exact mode must give the dense perplexity.
#include "shared/sparse/sparse_ffn.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/perplexity.h"
#include "shared/engine/transformer.h"
#include "shared/model/model.h"
#include "shared/util/half.h"
#include "tests/sparse/random_model.h"

namespace pinfer {
namespace {

using ::testing::HasSubstr;
using testing_util::RandomModel;
using testing_util::RandomModelOptions;

double Nmse(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  return ref == 0 ? err : err / ref;
}

std::vector<float> RandomInput(int n, int hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n) * hidden);
  for (float& v : x) v = d(rng);
  return x;
}

// The dense FFN as the sparse paths define it: gate and up as DenseFfn computes them, then the
// down projection over the exact fp32 values of the stored down weights. For float weights this
// is DenseFfn; for Q8_0/Q4_0 DenseFfn also rounds the down projection's input to Q8_0 (llama.cpp's
// definition, ops.h), which sparse accumulation over active rows cannot do (a block's scale spans
// neurons on both sides of a hot/cold split), so it keeps fp32 coefficients.
std::vector<float> DenseFfnFp32Down(const Model& m, const CpuOps& ops, int layer,
                                    const std::vector<float>& x, int n) {
  const LayerWeights& L = m.layers[layer];
  const int F = m.config.ffn_size, H = m.config.hidden_size;
  std::vector<float> gate(static_cast<size_t>(n) * F), up(gate.size()),
      out(static_cast<size_t>(n) * H);
  ops.MatMul(L.gate, x.data(), n, gate.data());
  ops.MatMul(L.up, x.data(), n, up.data());
  ops.GatedActivation(m.config.activation, gate.data(), up.data(),
                      static_cast<int64_t>(gate.size()));
  std::vector<float> down(static_cast<size_t>(H) * F);
  for (int r = 0; r < H; ++r) DequantizeRow(L.down.dtype, L.down.row(r), down.data() + r * F, F);
  const TensorView down32{"down_fp32", DType::kF32, {H, F}, down.data()};
  ops.MatMul(down32, gate.data(), n, out.data());
  return out;
}

struct Case {
  DType dtype;
  Activation act;
  bool simd;
  int hidden = 64;  // 256 for the K-quants' super-blocks
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(DTypeName(info.param.dtype)) + "_" + ActivationName(info.param.act) +
         (info.param.simd ? "_simd" : "_reference");
}

class GateSparseFfnTest : public ::testing::TestWithParam<Case> {};

TEST_P(GateSparseFfnTest, EqualsDenseFfn) {
  const Case& p = GetParam();
  RandomModelOptions o;
  o.dtype = p.dtype;
  o.activation = p.act;
  o.hidden = p.hidden;
  auto model = RandomModel(o);
  ThreadPool pool(2);
  auto ops = p.simd ? NewSimdOps(&pool) : NewReferenceOps();
  auto down_t = TransposeDownProjections(*model);
  ASSERT_TRUE(down_t.ok()) << down_t.status();
  auto sparse = GateSparseFfn::Create(*model, *ops, down_t->layers);
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  DenseFfn dense(*model, *ops);
  for (int n : {1, 5}) {
    SCOPED_TRACE(n);
    std::vector<float> x = RandomInput(n, o.hidden, 7 + n);
    for (int l = 0; l < o.layers; ++l) {
      std::vector<float> want(static_cast<size_t>(n) * o.hidden), got(want.size(), 123.f);
      ASSERT_TRUE(dense.Forward(l, x.data(), n, want.data()).ok());
      ASSERT_TRUE((*sparse)->Forward(l, x.data(), n, got.data()).ok());
      // Same products as the definition, summed in a different order (fp32).
      EXPECT_LT(Nmse(got, DenseFfnFp32Down(*model, *ops, l, x, n)), 1e-10);
      // And DenseFfn itself up to its Q8_0 rounding of the down input (none for float weights).
      EXPECT_LT(Nmse(got, want), IsQuantized(p.dtype) ? 2e-4 : 1e-10);
    }
  }
  // It skipped exactly the neurons whose gate is not positive: count them independently.
  (*sparse)->ResetStats();
  std::vector<float> x = RandomInput(3, o.hidden, 99);
  std::vector<float> out(3 * o.hidden);
  ASSERT_TRUE((*sparse)->Forward(0, x.data(), 3, out.data()).ok());
  std::vector<float> gate(3 * o.ffn);
  NewReferenceOps()->MatMul(model->layers[0].gate, x.data(), 3, gate.data());
  int64_t positive = 0;
  for (float g : gate) positive += g > 0;
  const SparseFfnLayerStats& st = (*sparse)->stats().layers[0];
  EXPECT_EQ(st.tokens, 3);
  EXPECT_NEAR(static_cast<double>(st.computed), static_cast<double>(positive), 2);
  EXPECT_GT(st.computed, 0);
  EXPECT_LT(st.computed, 3 * o.ffn);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, GateSparseFfnTest,
                         ::testing::Values(Case{DType::kF32, Activation::kRelu, false},
                                           Case{DType::kF32, Activation::kRelu, true},
                                           Case{DType::kF16, Activation::kRelu, true},
                                           Case{DType::kBF16, Activation::kRelu, true},
                                           Case{DType::kQ8_0, Activation::kRelu, true},
                                           Case{DType::kQ4_0, Activation::kRelu, true},
                                           Case{DType::kQ4_0, Activation::kRelu, false},
                                           Case{DType::kF16, Activation::kDRelu, true},
                                           Case{DType::kQ4_K, Activation::kRelu, true, 256},
                                           Case{DType::kQ5_K, Activation::kRelu, true, 256},
                                           Case{DType::kQ6_K, Activation::kRelu, true, 256},
                                           Case{DType::kQ4_K, Activation::kRelu, false, 256}),
                         CaseName);

TEST(GateSparseFfnErrors, SiluNeedsThresholdsAndShapesAreChecked) {
  RandomModelOptions o;
  o.activation = Activation::kSilu;
  auto model = RandomModel(o);
  auto ops = NewReferenceOps();
  auto down_t = TransposeDownProjections(*model);
  ASSERT_TRUE(down_t.ok());
  auto s = GateSparseFfn::Create(*model, *ops, down_t->layers);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("needs a ReLU model"));

  auto wrong_count = GateSparseFfn::Create(*model, *ops, down_t->layers, {0.1f});
  EXPECT_EQ(wrong_count.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_count.status().message(), HasSubstr("expected 2 magnitude thresholds"));

  std::vector<TensorView> untransposed = {model->layers[0].down, model->layers[1].down};
  auto bad_shape = GateSparseFfn::Create(*model, *ops, untransposed, {0.1f, 0.1f});
  EXPECT_EQ(bad_shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_shape.status().message(), HasSubstr("must be [256, 64]"));
}

TEST(GateSparseFfnMagnitude, SiluThresholdZeroEqualsDenseAndLargeThresholdSkipsAll) {
  RandomModelOptions o;
  o.activation = Activation::kSilu;
  auto model = RandomModel(o);
  auto ops = NewReferenceOps();
  auto down_t = TransposeDownProjections(*model);
  ASSERT_TRUE(down_t.ok());
  DenseFfn dense(*model, *ops);
  std::vector<float> x = RandomInput(2, o.hidden, 5);
  std::vector<float> want(2 * o.hidden), got(want.size());
  ASSERT_TRUE(dense.Forward(1, x.data(), 2, want.data()).ok());
  // |silu(g)| > -1 holds for every neuron: nothing skipped.
  auto all = GateSparseFfn::Create(*model, *ops, down_t->layers, {-1.f, -1.f});
  ASSERT_TRUE(all.ok());
  ASSERT_TRUE((*all)->Forward(1, x.data(), 2, got.data()).ok());
  EXPECT_LT(Nmse(got, want), 1e-10);
  auto none = GateSparseFfn::Create(*model, *ops, down_t->layers, {1e30f, 1e30f});
  ASSERT_TRUE(none.ok());
  ASSERT_TRUE((*none)->Forward(1, x.data(), 2, got.data()).ok());
  for (float v : got) EXPECT_EQ(v, 0.f);
  EXPECT_DOUBLE_EQ((*none)->stats().Sparsity(1), 1.0);
}

TEST(TransposeTest, FloatTransposeIsExactAndQuantizedGoesToF32Exactly) {
  RandomModelOptions o;
  for (DType dt : {DType::kF16, DType::kQ8_0}) {
    o.dtype = dt;
    auto model = RandomModel(o);
    auto t = TransposeDownProjections(*model);
    ASSERT_TRUE(t.ok());
    const TensorView& d = model->layers[1].down;  // [hidden, ffn]
    const TensorView& dt_view = t->layers[1];     // [ffn, hidden]
    EXPECT_EQ(dt_view.dtype, dt == DType::kF16 ? DType::kF16 : DType::kF32);
    ASSERT_EQ(dt_view.shape, (std::vector<int64_t>{o.ffn, o.hidden}));
    std::vector<float> row(o.ffn), col(o.hidden);
    for (int h = 0; h < o.hidden; h += 7) {
      DequantizeRow(d.dtype, d.row(h), row.data(), o.ffn);
      for (int j = 0; j < o.ffn; j += 5) {
        DequantizeRow(dt_view.dtype, dt_view.row(j), col.data(), o.hidden);
        ASSERT_EQ(col[h], row[j]) << h << "," << j;
      }
    }
  }
}

// A predictor that is exact: fc1 = [I; -I], fc2 = [Wg, -Wg] gives score = Wg relu(x) - Wg relu(-x)
// = Wg x, the gate itself, so threshold 0 selects exactly the active neurons.
PredictorSet PerfectPredictor(const Model& model, float threshold) {
  const ModelConfig& c = model.config;
  const int H = c.hidden_size, F = c.ffn_size;
  PredictorSet set;
  for (int l = 0; l < c.n_layers; ++l) {
    auto fc1 = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(2 * H) * H * 4);
    auto fc2 = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(F) * 2 * H * 4);
    float* w1 = reinterpret_cast<float*>(fc1->data());
    float* w2 = reinterpret_cast<float*>(fc2->data());
    std::fill(w1, w1 + 2 * H * H, 0.f);
    for (int i = 0; i < H; ++i) {
      w1[i * H + i] = 1.f;
      w1[(H + i) * H + i] = -1.f;
    }
    std::vector<float> g(H);
    for (int j = 0; j < F; ++j) {
      DequantizeRow(model.layers[l].gate.dtype, model.layers[l].gate.row(j), g.data(), H);
      for (int i = 0; i < H; ++i) {
        w2[j * 2 * H + i] = g[i];
        w2[j * 2 * H + H + i] = -g[i];
      }
    }
    LayerPredictor p;
    p.fc1 = TensorView{"fc1", DType::kF32, {2 * H, H}, fc1->data()};
    p.fc2 = TensorView{"fc2", DType::kF32, {F, 2 * H}, fc2->data()};
    p.threshold = threshold;
    set.layers.push_back(p);
    set.owned.push_back(fc1);
    set.owned.push_back(fc2);
  }
  return set;
}

TEST(PredictedSparseFfnTest, PerfectPredictorEqualsDenseWithFullRecall) {
  for (DType dt : {DType::kF32, DType::kQ8_0}) {
    SCOPED_TRACE(DTypeName(dt));
    RandomModelOptions o;
    o.dtype = dt;
    auto model = RandomModel(o);
    ThreadPool pool(2);
    auto ops = NewSimdOps(&pool);
    auto down_t = TransposeDownProjections(*model);
    ASSERT_TRUE(down_t.ok());
    PredictorSet predictors = PerfectPredictor(*model, 0.f);
    auto sparse = PredictedSparseFfn::Create(*model, *ops, down_t->layers, &predictors);
    ASSERT_TRUE(sparse.ok()) << sparse.status();
    (*sparse)->set_measure_recall(true);
    DenseFfn dense(*model, *ops);
    std::vector<float> x = RandomInput(4, o.hidden, 3);
    std::vector<float> want(4 * o.hidden), got(want.size());
    for (int l = 0; l < o.layers; ++l) {
      ASSERT_TRUE(dense.Forward(l, x.data(), 4, want.data()).ok());
      ASSERT_TRUE((*sparse)->Forward(l, x.data(), 4, got.data()).ok());
      EXPECT_LT(Nmse(got, DenseFfnFp32Down(*model, *ops, l, x, 4)), 1e-9);
      // DenseFfn rounds the down input to Q8_0 for quantized weights (see DenseFfnFp32Down).
      EXPECT_LT(Nmse(got, want), IsQuantized(dt) ? 2e-4 : 1e-9);
    }
    const SparseFfnStats& st = (*sparse)->stats();
    // Score and gate are the same linear function computed in different orders, so neurons right
    // at zero may flip; their activation is ~0 either way.
    EXPECT_GT(st.Recall(), 0.995);
    EXPECT_GT(st.MagnitudeRecall(), 0.99999);
    EXPECT_GT(st.Sparsity(), 0.3);  // random model: about half the neurons inactive
    EXPECT_LT(st.Sparsity(), 0.7);
  }
}

TEST(PredictedSparseFfnTest, ThresholdsSelectNothingOrEverything) {
  RandomModelOptions o;
  auto model = RandomModel(o);
  auto ops = NewReferenceOps();
  auto down_t = TransposeDownProjections(*model);
  ASSERT_TRUE(down_t.ok());
  DenseFfn dense(*model, *ops);
  std::vector<float> x = RandomInput(2, o.hidden, 11);
  std::vector<float> want(2 * o.hidden), got(want.size());
  ASSERT_TRUE(dense.Forward(0, x.data(), 2, want.data()).ok());

  PredictorSet everything = PerfectPredictor(*model, -std::numeric_limits<float>::infinity());
  auto all = PredictedSparseFfn::Create(*model, *ops, down_t->layers, &everything);
  ASSERT_TRUE(all.ok());
  ASSERT_TRUE((*all)->Forward(0, x.data(), 2, got.data()).ok());
  EXPECT_LT(Nmse(got, want), 1e-10);
  EXPECT_DOUBLE_EQ((*all)->stats().Sparsity(0), 0.0);

  PredictorSet nothing = PerfectPredictor(*model, std::numeric_limits<float>::infinity());
  auto none = PredictedSparseFfn::Create(*model, *ops, down_t->layers, &nothing);
  ASSERT_TRUE(none.ok());
  (*none)->set_measure_recall(true);
  ASSERT_TRUE((*none)->Forward(0, x.data(), 2, got.data()).ok());
  for (float v : got) EXPECT_EQ(v, 0.f);
  EXPECT_DOUBLE_EQ((*none)->stats().Sparsity(0), 1.0);
  EXPECT_DOUBLE_EQ((*none)->stats().Recall(0), 0.0);
}

TEST(PredictedSparseFfnTest, RejectsPredictorsOfTheWrongShape) {
  RandomModelOptions o;
  auto model = RandomModel(o);
  auto ops = NewReferenceOps();
  auto down_t = TransposeDownProjections(*model);
  ASSERT_TRUE(down_t.ok());
  PredictorSet p = PerfectPredictor(*model, 0.f);
  p.layers[1].fc2.shape = {o.ffn - 1, 2 * o.hidden};
  auto s = PredictedSparseFfn::Create(*model, *ops, down_t->layers, &p);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("layer 1: predictor shapes"));
  p.layers.pop_back();
  s = PredictedSparseFfn::Create(*model, *ops, down_t->layers, &p);
  EXPECT_THAT(s.status().message(), HasSubstr("expected predictors for 2 layers"));
}

std::vector<int32_t> ReadHeldOut() {
  std::ifstream in(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny/heldout-tokens.u32",
                   std::ios::binary);
  std::vector<int32_t> tokens;
  uint32_t v;
  while (in.read(reinterpret_cast<char*>(&v), 4)) tokens.push_back(static_cast<int32_t>(v));
  return tokens;
}

TEST(ReluLlamaTinySparse, ExactModePerplexityEqualsDense) {
  auto model = LoadModel(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> tokens = ReadHeldOut();
  ASSERT_EQ(tokens.size(), 65024u);
  tokens.resize(8 * 512);
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  Transformer transformer(**model, *ops);
  auto dense = ComputePerplexity(transformer, tokens, 512);
  ASSERT_TRUE(dense.ok()) << dense.status();

  auto down_t = TransposeDownProjections(**model);
  ASSERT_TRUE(down_t.ok());
  auto sparse = GateSparseFfn::Create(**model, *ops, down_t->layers);
  ASSERT_TRUE(sparse.ok());
  transformer.set_ffn(sparse->get());
  auto exact = ComputePerplexity(transformer, tokens, 512);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_NEAR(exact->perplexity, dense->perplexity, 1e-4 * dense->perplexity);
  EXPECT_EQ(exact->tokens_scored, dense->tokens_scored);

  // The skipped neurons are the inactive ones: the sparsity per layer is one minus the true
  // activation rate that transformers measured (reference.json), up to the sample.
  std::ifstream in(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny/reference.json");
  nlohmann::json ref = nlohmann::json::parse(in);
  for (int l = 0; l < 6; ++l) {
    const double rate = ref["activation_stats"][l]["mean_active_fraction"];
    EXPECT_NEAR((*sparse)->stats().Sparsity(l), 1 - rate, 0.03) << "layer " << l;
  }
}

}  // namespace
}  // namespace pinfer
