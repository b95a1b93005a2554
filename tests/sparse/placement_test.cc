// Placement under a VRAM budget, with every byte count worked out by hand from the definitions in
// placement.h for a small random model (hidden 64, ffn 256, 2 layers, 4 heads of 16, 2 KV heads,
// vocab 96, F32 weights).
#include "shared/sparse/placement.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/sparse/random_model.h"

namespace pinfer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::RandomModel;
using testing_util::RandomModelOptions;

// Per layer: attn_norm 64*4 = 256, ffn_norm 256, wq 64*64*4 = 16384, wk 32*64*4 = 8192,
// wv 8192, wo 16384: 49664; two layers 99328; output_norm 256; output 96*64*4 = 24576.
constexpr uint64_t kDense = 99328 + 256 + 24576;  // 124160
// 2 (K, V) * 2 layers * 100 positions * kv_dim 32 * 2 bytes.
constexpr uint64_t kKv = 25600;
// 4 bytes * batch 2 * (3*64 + 64 + 2*32 + 3*256 + 96 + 4 heads * 100) = 8 * 1584.
constexpr uint64_t kScratch = 12672;
constexpr uint64_t kFixed = kDense + kKv + kScratch;  // 162432
// gate row 64*4 + up row 64*4 + down_t row 64*4.
constexpr uint64_t kNeuron = 768;

ActivationProfile OddEvenProfile() {
  // Layer 0 neuron j was active 2j+1 times, layer 1 neuron j 2j times: the most active neurons
  // alternate between the layers from the top (511, 510, 509, ...).
  ActivationProfile p;
  p.n_layers = 2;
  p.ffn_size = 256;
  p.tokens = 1000;
  p.active.assign(2, std::vector<int64_t>(256));
  for (int j = 0; j < 256; ++j) {
    p.active[0][j] = 2 * j + 1;
    p.active[1][j] = 2 * j;
  }
  return p;
}

PlacementOptions Options(uint64_t budget) {
  PlacementOptions o;
  o.vram_budget = budget;
  o.context = 100;
  o.max_batch = 2;
  o.kv_element_bytes = 2;
  return o;
}

class PlacementTest : public ::testing::Test {
 protected:
  void SetUp() override { model_ = RandomModel(RandomModelOptions{}); }
  std::unique_ptr<Model> model_;
  ActivationProfile profile_ = OddEvenProfile();
};

TEST_F(PlacementTest, FixedPartsAreCountedExactly) {
  EXPECT_EQ(DenseGpuBytes(*model_), kDense);
  EXPECT_EQ(KvCacheBytes(model_->config, 100, 2), kKv);
  EXPECT_EQ(ScratchBytes(model_->config, 100, 2), kScratch);
  EXPECT_EQ(HotNeuronBytes(*model_, 0), kNeuron);
  EXPECT_EQ(PredictorBytes(nullptr), 0u);
}

TEST_F(PlacementTest, BudgetThatFitsExactlyFiveRows) {
  auto plan = PlanPlacement(*model_, profile_, nullptr, Options(kFixed + 5 * kNeuron));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->cpu_only);
  EXPECT_THAT(plan->hot[0], ElementsAre(253, 254, 255));  // 511, 509, 507
  EXPECT_THAT(plan->hot[1], ElementsAre(254, 255));       // 510, 508
  EXPECT_EQ(plan->hot_row_bytes, 5 * kNeuron);
  EXPECT_EQ(plan->gpu_bytes(), kFixed + 5 * kNeuron);
  // Served: 511 + 510 + 509 + 508 + 507 of sum(2j+1) + sum(2j) = 65536 + 65280.
  EXPECT_DOUBLE_EQ(plan->gpu_activation_share, 2545.0 / 130816.0);
  std::vector<int32_t> idx = plan->GpuIndex(0, 256);
  EXPECT_EQ(idx[252], 0);
  EXPECT_EQ(idx[253], 1);
  EXPECT_EQ(idx[255], 1);

  // One byte short of a sixth row still gives five.
  auto almost = PlanPlacement(*model_, profile_, nullptr, Options(kFixed + 6 * kNeuron - 1));
  ASSERT_TRUE(almost.ok());
  EXPECT_EQ(almost->hot_neurons(), 5);
  auto six = PlanPlacement(*model_, profile_, nullptr, Options(kFixed + 6 * kNeuron));
  ASSERT_TRUE(six.ok());
  EXPECT_THAT(six->hot[1], ElementsAre(253, 254, 255));
}

// The adaptive hot set's slots come out of the budget before any hot row: the budget that gave
// five rows above gives three when two rows' worth is reserved for the cache.
TEST_F(PlacementTest, AdaptiveCacheBytesAreReservedBeforeHotRows) {
  PlacementOptions o = Options(kFixed + 5 * kNeuron);
  o.cache_bytes = 2 * kNeuron;
  auto plan = PlanPlacement(*model_, profile_, nullptr, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->hot_neurons(), 3);
  EXPECT_EQ(plan->fixed_bytes(), kFixed + 2 * kNeuron);
  EXPECT_EQ(plan->gpu_bytes(), kFixed + 5 * kNeuron);
  EXPECT_NE(plan->Summary().find("adaptive cache"), std::string::npos);
  o.cache_bytes = 5 * kNeuron + 1;
  plan = PlanPlacement(*model_, profile_, nullptr, o);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(PlacementTest, EverythingHot) {
  auto plan = PlanPlacement(*model_, profile_, nullptr, Options(kFixed + 512 * kNeuron + 12345));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->hot_neurons(), 512);
  EXPECT_EQ(plan->hot_row_bytes, 512 * kNeuron);
  EXPECT_DOUBLE_EQ(plan->gpu_activation_share, 1.0);
}

TEST_F(PlacementTest, EverythingColdWhenOnlyTheFixedPartsFit) {
  auto plan = PlanPlacement(*model_, profile_, nullptr, Options(kFixed));
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->cpu_only);
  EXPECT_EQ(plan->hot_neurons(), 0);
  EXPECT_EQ(plan->gpu_bytes(), kFixed);
  EXPECT_DOUBLE_EQ(plan->gpu_activation_share, 0.0);
}

TEST_F(PlacementTest, DensePartsThatDoNotFitAreAnErrorOrACpuOnlyPlan) {
  auto plan = PlanPlacement(*model_, profile_, nullptr, Options(kFixed - 1));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), HasSubstr("budget of 162431 bytes is below the 162432"));

  PlacementOptions o = Options(kFixed - 1);
  o.allow_cpu_only = true;
  auto cpu = PlanPlacement(*model_, profile_, nullptr, o);
  ASSERT_TRUE(cpu.ok());
  EXPECT_TRUE(cpu->cpu_only);
  EXPECT_EQ(cpu->hot_neurons(), 0);
  EXPECT_EQ(cpu->gpu_bytes(), 0u);
}

TEST_F(PlacementTest, PredictorsAreCountedAndQuantizedRowsAreSmaller) {
  // fc1 [8, 64] F16 = 1024 bytes and fc2 [256, 8] F16 = 4096 bytes, per layer.
  PredictorSet p;
  for (int l = 0; l < 2; ++l) {
    LayerPredictor lp;
    lp.fc1 = TensorView{"fc1", DType::kF16, {8, 64}, reinterpret_cast<const void*>(1)};
    lp.fc2 = TensorView{"fc2", DType::kF16, {256, 8}, reinterpret_cast<const void*>(1)};
    p.layers.push_back(lp);
  }
  EXPECT_EQ(PredictorBytes(&p), 10240u);
  auto plan = PlanPlacement(*model_, profile_, &p, Options(kFixed + 10240 + 2 * kNeuron));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->predictor_bytes, 10240u);
  EXPECT_EQ(plan->hot_neurons(), 2);

  RandomModelOptions q;
  q.dtype = DType::kQ8_0;  // 64 values = 2 blocks of 34 bytes per row
  EXPECT_EQ(HotNeuronBytes(*RandomModel(q), 1), 3u * 68);
  q.dtype = DType::kQ4_0;  // 2 blocks of 18 bytes
  EXPECT_EQ(HotNeuronBytes(*RandomModel(q), 1), 3u * 36);
  // K-quants: hidden 512 = 2 super-blocks of 144 / 176 / 210 bytes per row.
  q.hidden = 512;
  q.dtype = DType::kQ4_K;
  EXPECT_EQ(HotNeuronBytes(*RandomModel(q), 1), 3u * 288);
  q.dtype = DType::kQ5_K;
  EXPECT_EQ(HotNeuronBytes(*RandomModel(q), 1), 3u * 352);
  q.dtype = DType::kQ6_K;
  EXPECT_EQ(HotNeuronBytes(*RandomModel(q), 1), 3u * 420);
}

TEST_F(PlacementTest, MismatchedProfileIsRejected) {
  ActivationProfile bad = profile_;
  bad.ffn_size = 100;
  auto plan = PlanPlacement(*model_, bad, nullptr, Options(1 << 30));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("does not match the model"));
}

}  // namespace
}  // namespace pinfer
