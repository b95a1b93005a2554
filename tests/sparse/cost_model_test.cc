// The cold-row cost model's arithmetic against cases computed by hand (cost_model.h): which path
// each batch gets, the crossover batch size, the stream terms from a calibration and the CPU
// fit from timed calls, plus the specific errors for unmeasured or degenerate inputs.
#include "shared/sparse/cost_model.h"

#include "gtest/gtest.h"

namespace pinfer {
namespace {

// 50 GB/s host->GPU, 100 TFLOP/s products, 0.1 ms per streamed layer; CPU 0.05 ms per call and
// 0.2 us per active row per token.
ColdCostParams Params() {
  ColdCostParams p;
  p.h2d_bytes_per_s = 50e9;
  p.gpu_flops_per_s = 100e12;
  p.stream_fixed_s = 1e-4;
  p.cpu_fixed_s = 5e-5;
  p.cpu_s_per_row_token = 2e-7;
  return p;
}

// 10000 cold rows of 3 x 10 KB (300 MB), hidden 5000, 1000 active cold rows per token.
ColdLayerWork Work(int n) {
  ColdLayerWork w;
  w.tokens = n;
  w.cold_rows = 10000;
  w.bytes = 300e6;
  w.hidden = 5000;
  w.active_row_tokens = 1000.0 * n;
  return w;
}

TEST(ColdCostModelTest, SmallBatchStaysOnTheCpu) {
  // cpu = 5e-5 + 16000 * 2e-7 = 3.25 ms; stream = 1e-4 + max(300e6 / 50e9 = 6 ms,
  // 2 * 16 * 1e4 * 3 * 5000 / 1e14 = 0.048 ms) = 6.1 ms.
  absl::StatusOr<ColdPathChoice> c = ChooseColdPath(Params(), Work(16));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NEAR(c->cpu_s, 3.25e-3, 1e-12);
  EXPECT_NEAR(c->stream_s, 6.1e-3, 1e-12);
  EXPECT_FALSE(c->stream);
  EXPECT_EQ(c->Describe(), "cpu 3.250 ms, stream 6.100 ms -> cpu");
}

TEST(ColdCostModelTest, LargeBatchIsStreamed) {
  // cpu = 5e-5 + 64000 * 2e-7 = 12.85 ms; stream = 0.1 + max(6, 0.192) ms = 6.1 ms.
  absl::StatusOr<ColdPathChoice> c = ChooseColdPath(Params(), Work(64));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NEAR(c->cpu_s, 12.85e-3, 1e-12);
  EXPECT_NEAR(c->stream_s, 6.1e-3, 1e-12);
  EXPECT_TRUE(c->stream);
}

TEST(ColdCostModelTest, SlowProductsMakeTheStreamComputeBound) {
  // At 1 TFLOP/s the products take 2 * 64 * 1e4 * 3 * 5000 / 1e12 = 19.2 ms > the 6 ms copy:
  // stream = 19.3 ms > cpu 12.85 ms.
  ColdCostParams p = Params();
  p.gpu_flops_per_s = 1e12;
  absl::StatusOr<ColdPathChoice> c = ChooseColdPath(p, Work(64));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NEAR(c->stream_s, 19.3e-3, 1e-12);
  EXPECT_FALSE(c->stream);
}

TEST(ColdCostModelTest, TiesGoToTheCpu) {
  ColdCostParams p = Params();
  p.cpu_fixed_s = 0;
  p.stream_fixed_s = 0;
  p.cpu_s_per_row_token = 6e-3 / 16000;  // cpu = 6 ms = the copy
  absl::StatusOr<ColdPathChoice> c = ChooseColdPath(p, Work(16));
  ASSERT_TRUE(c.ok());
  EXPECT_DOUBLE_EQ(c->cpu_s, c->stream_s);
  EXPECT_FALSE(c->stream);
}

TEST(ColdCostModelTest, CrossoverIsTheFirstBatchWhereTheStreamWins) {
  // cpu(n) = 0.05 + 0.2 n ms against a flat 6.1 ms: n = 30 gives 6.05 (cpu), n = 31 gives 6.25.
  EXPECT_EQ(StreamCrossover(Params(), 10000, 300e6, 5000, 1000, 512), 31);
  // Never within 16 tokens.
  EXPECT_EQ(StreamCrossover(Params(), 10000, 300e6, 5000, 1000, 16), 0);
}

TEST(ColdCostModelTest, StreamTermsFromACalibration) {
  ColdCostParams p;
  ASSERT_TRUE(SetStreamCosts(300e6, 6e-3, 4.8e9, 4.8e-5, 6.1e-3, &p).ok());
  EXPECT_NEAR(p.h2d_bytes_per_s, 50e9, 1);
  EXPECT_NEAR(p.gpu_flops_per_s, 100e12, 1e3);
  EXPECT_NEAR(p.stream_fixed_s, 1e-4, 1e-12);
  // Overlapped faster than the copy alone (noise): no negative fixed cost.
  ASSERT_TRUE(SetStreamCosts(300e6, 6e-3, 4.8e9, 4.8e-5, 5.9e-3, &p).ok());
  EXPECT_EQ(p.stream_fixed_s, 0);
  absl::Status st = SetStreamCosts(300e6, 0, 4.8e9, 4.8e-5, 6.1e-3, &p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("positive"), std::string::npos) << st;
}

TEST(ColdCostModelTest, CpuFitFromTimedCalls) {
  ColdCostParams p;
  // Exactly 0.05 ms + 0.2 us per row-token.
  ASSERT_TRUE(FitCpuCosts({{1000, 0.25e-3}, {2000, 0.45e-3}, {4000, 0.85e-3}}, &p).ok());
  EXPECT_NEAR(p.cpu_fixed_s, 5e-5, 1e-12);
  EXPECT_NEAR(p.cpu_s_per_row_token, 2e-7, 1e-15);
  // A negative intercept (0.1 ms at 1000, 0.3 ms at 2000 -> -0.1 ms) is clamped to zero and the
  // slope refitted through the origin: (1000 * 1e-4 + 2000 * 3e-4) / (1000^2 + 2000^2) = 1.4e-7.
  ASSERT_TRUE(FitCpuCosts({{1000, 1e-4}, {2000, 3e-4}}, &p).ok());
  EXPECT_EQ(p.cpu_fixed_s, 0);
  EXPECT_NEAR(p.cpu_s_per_row_token, 1.4e-7, 1e-15);
}

TEST(ColdCostModelTest, SpecificErrors) {
  ColdCostParams p;
  absl::Status st = FitCpuCosts({{1000, 1e-4}}, &p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("two or more distinct"), std::string::npos) << st;
  st = FitCpuCosts({{1000, 1e-4}, {1000, 2e-4}}, &p);
  EXPECT_NE(st.message().find("two or more distinct"), std::string::npos) << st;
  st = FitCpuCosts({{1000, 3e-4}, {2000, 1e-4}}, &p);
  EXPECT_NE(st.message().find("slope"), std::string::npos) << st;

  absl::StatusOr<ColdPathChoice> c = ChooseColdPath(ColdCostParams{}, Work(16));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("stream costs are not measured"), std::string::npos);
  ColdCostParams no_cpu = Params();
  no_cpu.cpu_s_per_row_token = 0;
  c = ChooseColdPath(no_cpu, Work(16));
  EXPECT_NE(c.status().message().find("CPU cost is not measured"), std::string::npos);
  c = ChooseColdPath(Params(), Work(0));
  EXPECT_NE(c.status().message().find("bad layer work"), std::string::npos);
}

}  // namespace
}  // namespace pinfer
