// The gpu-worker's choice of who computes a prompt batch's cold FFN rows (gpu-worker/
// cold_prefill.h), without a GPU: given calibration numbers, which path each layer takes for a
// batch. Every expected value below is worked out by hand from the cost model's formulas
// (shared/sparse/cost_model.h):
//   cpu(n)    = cpu_fixed + rows_per_token * n * cpu_per_row_token
//   stream(n) = stream_fixed + max(bytes / h2d, 2 * n * cold_rows * 3 * hidden / flops)
#include "gpu-worker/cold_prefill.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pinfer::gpuworker {
namespace {

using ::testing::HasSubstr;

TEST(ColdPrefillTest, ParsesTheFlag) {
  EXPECT_EQ(*ParseColdPrefill("auto"), ColdPrefill::kAuto);
  EXPECT_EQ(*ParseColdPrefill("cpu"), ColdPrefill::kCpu);
  EXPECT_EQ(*ParseColdPrefill("stream"), ColdPrefill::kStream);
  for (const char* bad : {"gpu", "", "Stream", "auto "}) {
    absl::StatusOr<ColdPrefill> m = ParseColdPrefill(bad);
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(m.status().message(), HasSubstr("--cold-prefill must be auto, cpu or stream"));
  }
  EXPECT_STREQ(ColdPrefillName(ColdPrefill::kStream), "stream");
}

TEST(ColdPrefillTest, StreamCostsCombineSeveralCalibrations) {
  // bytes 100e6 + 100e6 + 50e6 over copies 2 + 2 + 1 ms = 50 GB/s; flops 4e9 + 16e9 + 8e9 over
  // 1 + 3 + 1 ms = 5.6 TFLOP/s; beyond the larger part: 0.5, 0.2, 0.1 ms, median 0.2 ms.
  std::vector<StreamSample> s = {{16, 100e6, 2e-3, 4e9, 1e-3, 2.5e-3},
                                 {64, 100e6, 2e-3, 16e9, 3e-3, 3.2e-3},
                                 {32, 50e6, 1e-3, 8e9, 1e-3, 1.1e-3}};
  ColdCostParams p;
  ASSERT_TRUE(StreamCostsFrom(s, &p).ok());
  EXPECT_DOUBLE_EQ(p.h2d_bytes_per_s, 50e9);
  EXPECT_DOUBLE_EQ(p.gpu_flops_per_s, 5.6e12);
  EXPECT_NEAR(p.stream_fixed_s, 0.2e-3, 1e-15);
  // An even count takes the mean of the middle two: 0.5 and 0.2 ms -> 0.35 ms.
  s.pop_back();
  ASSERT_TRUE(StreamCostsFrom(s, &p).ok());
  EXPECT_NEAR(p.stream_fixed_s, 0.35e-3, 1e-15);
  // Overlapped faster than its parts (timing noise): no negative fixed cost.
  ASSERT_TRUE(StreamCostsFrom({{16, 1e6, 1e-3, 1e9, 1e-3, 0.9e-3}}, &p).ok());
  EXPECT_EQ(p.stream_fixed_s, 0);

  absl::Status st = StreamCostsFrom({}, &p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("no stream calibration samples"));
  st = StreamCostsFrom({{16, 1e6, 0, 1e9, 1e-3, 1e-3}}, &p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("positive sizes and times (16 tokens"));
}

// Three layers of a hidden-384 F16 model (2304 bytes of gate + up + down_t per neuron): layer 0
// all hot, layer 1 with 1000 cold neurons (2.304 MB), layer 2 with 500 (1.152 MB).
std::vector<ColdLayerShape> Shapes() { return {{0, 0}, {1000, 2.304e6}, {500, 1.152e6}}; }

// Stream: 1 GB/s, 1 TFLOP/s, 0.1 ms fixed (one calibration with copy 2 ms for 2 MB, products
// 1 ms for 1e9 flops, overlapped 2.1 ms).
const std::vector<StreamSample> kStream = {{64, 2e6, 2e-3, 1e9, 1e-3, 2.1e-3}};

// CPU: 0.2 ms + 1 us per row-token, from two decode steps: layer 1 with 100 active cold rows
// (0.3 ms), layer 2 with 40 (0.24 ms).
void ObserveCpuLine(ColdPrefillPlanner* p) {
  p->ObserveCpu(1, 1, 100, 0.3e-3);
  p->ObserveCpu(2, 1, 40, 0.24e-3);
}

TEST(ColdPrefillTest, AutoPicksPerLayerAndBatchFromMeasuredRates) {
  ColdPrefillPlanner p(ColdPrefill::kAuto, 384, Shapes());
  EXPECT_EQ(p.cold_layers(), 2);
  // Nothing measured: the CPU.
  ColdPrefillPlanner::Decision d = p.Decide(64);
  EXPECT_THAT(d.stream, ::testing::ElementsAre(false, false, false));
  EXPECT_THAT(d.reason, HasSubstr("not calibrated"));
  ASSERT_TRUE(p.SetStreamCalibration(kStream).ok());
  EXPECT_DOUBLE_EQ(p.params().h2d_bytes_per_s, 1e9);
  EXPECT_DOUBLE_EQ(p.params().gpu_flops_per_s, 1e12);
  EXPECT_NEAR(p.params().stream_fixed_s, 0.1e-3, 1e-15);
  // The stream is measured, the CPU not yet: the CPU, which is what measures it.
  d = p.Decide(64);
  EXPECT_EQ(d.streamed, 0);
  EXPECT_THAT(d.reason, HasSubstr("measuring the CPU side first (0 timed exchanges)"));
  // One exchange is not a fit (layer 2 not seen yet).
  p.ObserveCpu(1, 1, 100, 0.3e-3);
  EXPECT_FALSE(p.cpu_calibrated());
  p.ObserveCpu(2, 1, 40, 0.24e-3);
  ASSERT_TRUE(p.cpu_calibrated());
  EXPECT_EQ(p.cpu_samples(), 2);
  EXPECT_NEAR(p.params().cpu_fixed_s, 0.2e-3, 1e-12);
  EXPECT_NEAR(p.params().cpu_s_per_row_token, 1e-6, 1e-15);
  EXPECT_DOUBLE_EQ(p.RowsPerToken(1), 100);
  EXPECT_DOUBLE_EQ(p.RowsPerToken(2), 40);
  EXPECT_LT(p.RowsPerToken(0), 0);

  // 16 tokens: layer 1 cpu 0.2 + 1.6 = 1.8 ms, stream 0.1 + max(2.304, 0.037) = 2.404 ms;
  // layer 2 cpu 0.2 + 0.64 = 0.84 ms, stream 0.1 + 1.152 = 1.252 ms: both on the CPU.
  d = p.Decide(16);
  EXPECT_THAT(d.stream, ::testing::ElementsAre(false, false, false));
  EXPECT_THAT(d.reason, HasSubstr("layer 1: cpu 1.800 ms, stream 2.404 ms -> cpu"));
  // 24 tokens: layer 1 cpu 2.6 ms > stream 2.404 ms (flops 2*24*1000*1152 = 55.3e6: 0.055 ms);
  // layer 2 cpu 0.2 + 0.96 = 1.16 ms < stream 1.252 ms.
  d = p.Decide(24);
  EXPECT_THAT(d.stream, ::testing::ElementsAre(false, true, false));
  EXPECT_EQ(d.streamed, 1);
  // 32 tokens: layer 2 cpu 0.2 + 1.28 = 1.48 ms > 1.252 ms: both stream.
  d = p.Decide(32);
  EXPECT_THAT(d.stream, ::testing::ElementsAre(false, true, true));
  EXPECT_EQ(d.streamed, 2);
  // 2000 tokens: the products bound the stream: 2*2000*1000*1152 = 4.608e9 flops = 4.608 ms
  // (> 2.304 ms of copy), + 0.1 ms; the CPU 0.2 + 200 ms.
  d = p.Decide(2000);
  EXPECT_THAT(d.reason, HasSubstr("layer 1: cpu 200.200 ms, stream 4.708 ms -> stream"));
  // Up to the matrix-vector size nothing streams, whatever the model says.
  d = p.Decide(kMaxMatvecTokens);
  EXPECT_EQ(d.streamed, 0);
  EXPECT_THAT(d.reason, HasSubstr("matrix-vector"));
}

TEST(ColdPrefillTest, RowsPerTokenFollowTheRecentExchanges) {
  ColdPrefillPlanner p(ColdPrefill::kAuto, 384, Shapes());
  ASSERT_TRUE(p.SetStreamCalibration(kStream).ok());
  ObserveCpuLine(&p);
  // A 16-token prompt batch of layer 1 with 2400 (token, row) pairs: the older decode step
  // weighs 0.9: (0.9 * 100 + 2400) / (0.9 * 1 + 16) = 147.337... rows per token.
  p.ObserveCpu(1, 16, 2400, 0.2e-3 + 2400e-6);
  EXPECT_NEAR(p.RowsPerToken(1), (0.9 * 100 + 2400) / (0.9 + 16), 1e-12);
  // The third sample lies on the same line: the fit is unchanged. At 16 tokens layer 1's CPU
  // estimate is now 0.2 + 16 * 147.337 * 1e-3 = 2.557 ms > 2.404 ms: it streams.
  ASSERT_TRUE(p.cpu_calibrated());
  EXPECT_NEAR(p.params().cpu_s_per_row_token, 1e-6, 1e-12);
  ColdPrefillPlanner::Decision d = p.Decide(16);
  EXPECT_THAT(d.stream, ::testing::ElementsAre(false, true, false));
  EXPECT_THAT(d.reason, HasSubstr("layer 1: cpu 2.557 ms, stream 2.404 ms -> stream"));
  // Bad observations are ignored.
  p.ObserveCpu(7, 1, 10, 1e-3);
  p.ObserveCpu(1, 0, 10, 1e-3);
  p.ObserveCpu(1, 1, 10, 0);
  EXPECT_NEAR(p.RowsPerToken(1), (0.9 * 100 + 2400) / (0.9 + 16), 1e-12);
}

TEST(ColdPrefillTest, CpuFitNeedsTwoDistinctRowCounts) {
  ColdPrefillPlanner p(ColdPrefill::kAuto, 384, Shapes());
  ASSERT_TRUE(p.SetStreamCalibration(kStream).ok());
  // Same row count everywhere: no slope to fit, so the CPU keeps the work.
  p.ObserveCpu(1, 1, 50, 0.3e-3);
  p.ObserveCpu(2, 1, 50, 0.3e-3);
  EXPECT_FALSE(p.cpu_calibrated());
  EXPECT_EQ(p.Decide(512).streamed, 0);
  p.ObserveCpu(1, 1, 100, 0.35e-3);
  EXPECT_TRUE(p.cpu_calibrated());
  // (50, 0.3), (50, 0.3), (100, 0.35): slope 1 us, fixed 0.25 ms.
  EXPECT_NEAR(p.params().cpu_s_per_row_token, 1e-6, 1e-15);
  EXPECT_NEAR(p.params().cpu_fixed_s, 0.25e-3, 1e-12);
}

TEST(ColdPrefillTest, ForcedModes) {
  ColdPrefillPlanner stream(ColdPrefill::kStream, 384, Shapes());
  // No calibration needed: every layer with cold rows, for batches past the matrix-vector path.
  ColdPrefillPlanner::Decision d = stream.Decide(kMaxMatvecTokens + 1);
  EXPECT_THAT(d.stream, ::testing::ElementsAre(false, true, true));
  EXPECT_EQ(d.streamed, 2);
  EXPECT_EQ(stream.Decide(kMaxMatvecTokens).streamed, 0);
  EXPECT_EQ(stream.Decide(1).streamed, 0);

  ColdPrefillPlanner cpu(ColdPrefill::kCpu, 384, Shapes());
  ASSERT_TRUE(cpu.SetStreamCalibration(kStream).ok());
  ObserveCpuLine(&cpu);
  EXPECT_EQ(cpu.Decide(4096).streamed, 0);
  EXPECT_THAT(cpu.Decide(4096).reason, HasSubstr("--cold-prefill cpu"));

  // Every row hot: nothing to stream in any mode.
  ColdPrefillPlanner all_hot(ColdPrefill::kStream, 384, {{0, 0}, {0, 0}});
  EXPECT_EQ(all_hot.cold_layers(), 0);
  EXPECT_EQ(all_hot.Decide(256).streamed, 0);
}

}  // namespace
}  // namespace pinfer::gpuworker
