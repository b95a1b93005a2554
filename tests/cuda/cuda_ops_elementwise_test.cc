// The element-wise kernels (elementwise.cu): gated activations, residual additions and ReLU,
// the GPU's greedy pick, and the embedding lookup.
// Judged as cuda_ops_test_util.h says; without a CUDA device every test skips.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "shared/engine/sampler.h"
#include "tests/cuda/cuda_ops_test_util.h"

namespace pinfer {
namespace cuda_test {
namespace {

TEST_F(CudaOpsTest, GatedActivationsMatchReference) {
  for (Activation act : {Activation::kSilu, Activation::kRelu, Activation::kDRelu}) {
    const int64_t count = 10007;
    std::vector<float> g = Random(count, 3.f), u = Random(count);
    std::vector<float> ref = g;
    ref_->GatedActivation(act, ref.data(), u.data(), count);
    DevBuf<float> dg(g), du(u);
    CUDA_OK(
        cuda::GatedActivation(static_cast<cuda::ActKind>(act), dg.get(), du.get(), count, nullptr));
    std::vector<float> out = dg.Download();
    EXPECT_FALSE(AnyNan(out));
    EXPECT_LE(Nmse(out, ref), kFp32Limit) << ActivationName(act);
    EXPECT_TRUE(dg.GuardsIntact());
  }
}

// Stacked gate/up outputs [n, 2 width] -> activations [n, width].
TEST_F(CudaOpsTest, GatedActivationPackedMatchesReference) {
  const int n = 3, width = 1000;
  for (Activation act : {Activation::kSilu, Activation::kRelu, Activation::kDRelu}) {
    std::vector<float> gu = Random(static_cast<size_t>(n) * 2 * width, 2.f);
    std::vector<float> g(n * width), u(n * width);
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < width; ++i) {
        g[t * width + i] = gu[t * 2 * width + i];
        u[t * width + i] = gu[t * 2 * width + width + i];
      }
    }
    ref_->GatedActivation(act, g.data(), u.data(), static_cast<int64_t>(g.size()));
    DevBuf<float> dgu(gu), dout(g.size());
    CUDA_OK(cuda::GatedActivationPacked(static_cast<cuda::ActKind>(act), dgu.get(), n, width,
                                        dout.get(), nullptr));
    std::vector<float> out = dout.Download();
    EXPECT_FALSE(AnyNan(out));
    EXPECT_LE(Nmse(out, g), kFp32Limit) << ActivationName(act);
    EXPECT_TRUE(dout.GuardsIntact());
  }
}

TEST_F(CudaOpsTest, ElementwiseOpsMatchReference) {
  const int64_t count = 4099;
  std::vector<float> x = Random(count), y = Random(count), z = Random(count);
  std::vector<float> relu = x, add = y, add2 = y;
  for (int64_t i = 0; i < count; ++i) {
    relu[i] = std::max(x[i], 0.f);
    add[i] = y[i] + x[i];
    add2[i] = y[i] + (x[i] + z[i]);
  }
  DevBuf<float> dx(x), dy(y), dy2(y), dz(z), dr(x);
  CUDA_OK(cuda::Relu(dr.get(), count, nullptr));
  CUDA_OK(cuda::AddInPlace(dy.get(), dx.get(), count, nullptr));
  CUDA_OK(cuda::Add2InPlace(dy2.get(), dx.get(), dz.get(), count, nullptr));
  EXPECT_EQ(dr.Download(), relu);
  EXPECT_LE(Nmse(dy.Download(), add), kFp32Limit);
  EXPECT_LE(Nmse(dy2.Download(), add2), kFp32Limit);
  EXPECT_TRUE(dr.GuardsIntact() && dy.GuardsIntact() && dy2.GuardsIntact());
}

// A bias row added to every token's row (Qwen2's q/k/v biases): the plain loop's values exactly,
// for one token and several, widths that are not a multiple of the block.
TEST_F(CudaOpsTest, AddRowBiasMatchesReference) {
  for (int n : {1, 7}) {
    const int64_t width = 1155;
    std::vector<float> y = Random(n * width), bias = Random(width), want = y;
    for (int t = 0; t < n; ++t) {
      for (int64_t i = 0; i < width; ++i) want[t * width + i] += bias[i];
    }
    DevBuf<float> dy(y), db(bias);
    CUDA_OK(cuda::AddRowBias(dy.get(), db.get(), n, width, nullptr));
    EXPECT_EQ(dy.Download(), want) << "n " << n;
    EXPECT_TRUE(dy.GuardsIntact() && db.GuardsIntact());
  }
}

// The GPU's greedy pick against its definition: the token is GreedyToken's (the sampler's own
// greedy pick) and the log-probability is log-softmax computed here in double, with NaN logits
// left out. Sizes around the four-at-a-time loads and the block size, aligned and unaligned
// logits, ties (the first index wins), NaNs, infinities and an all-NaN row.
TEST_F(CudaOpsTest, GreedyPickMatchesTheSamplersDefinition) {
  auto reference_logprob = [](const std::vector<float>& l, int32_t token) {
    const double max = l[token];
    double sum = 0;
    for (float v : l) {
      if (std::isnan(v)) continue;
      sum += v == max ? 1.0 : std::exp(double(v) - max);
    }
    return -std::log(sum);
  };
  struct Case {
    std::vector<float> logits;
    const char* what;
  };
  std::vector<Case> cases;
  for (int vocab : {1, 3, 5, 31, 1000, 1025, 4099, 32000, 50257}) {
    cases.push_back({Random(vocab, 4.f), "random"});
  }
  {
    std::vector<float> l = Random(32000, 4.f);
    const int32_t best = GreedyToken(l);
    l[best / 2] = l[best];  // an earlier tie must win
    l[std::min<int>(best + 7, 31999)] = l[best];
    cases.push_back({l, "ties"});
  }
  {
    std::vector<float> l = Random(32000, 4.f);
    for (int i = 0; i < 32000; i += 97) l[i] = NAN;
    l[5] = l[6] = -INFINITY;
    cases.push_back({l, "NaNs and -inf"});
  }
  {
    std::vector<float> l = Random(4099, 4.f);
    l[4000] = l[17] = INFINITY;
    cases.push_back({l, "two +inf"});
  }
  cases.push_back({std::vector<float>(1000, -INFINITY), "all -inf"});
  for (const Case& c : cases) {
    for (int offset : {0, 1}) {  // offset 1: logits not 16-byte aligned
      SCOPED_TRACE(testing::Message()
                   << c.what << ", vocab " << c.logits.size() << ", offset " << offset);
      std::vector<float> padded(offset, 0.f);
      padded.insert(padded.end(), c.logits.begin(), c.logits.end());
      DevBuf<float> dl(padded), dlogprob(1);
      DevBuf<int32_t> dtoken(1);
      CUDA_OK(cuda::GreedyPick(dl.get() + offset, static_cast<int>(c.logits.size()), dtoken.get(),
                               dlogprob.get(), nullptr));
      const int32_t want = GreedyToken(c.logits);
      ASSERT_EQ(dtoken.Download()[0], want);
      const float got = dlogprob.Download()[0];
      EXPECT_NEAR(got, reference_logprob(c.logits, want), 1e-5 + 1e-6 * std::abs(got));
      EXPECT_TRUE(dl.GuardsIntact() && dtoken.GuardsIntact() && dlogprob.GuardsIntact());
    }
  }
  // Finite logits: the same log-probability as the sampler's greedy path.
  std::vector<float> l = Random(32000, 4.f);
  float sampler_logprob = 1;
  std::vector<float> copy = l;
  const int32_t sampler_token = Sampler(SamplingParams{}).Sample(copy, {}, &sampler_logprob);
  DevBuf<float> dl(l), dlogprob(1);
  DevBuf<int32_t> dtoken(1);
  CUDA_OK(cuda::GreedyPick(dl.get(), 32000, dtoken.get(), dlogprob.get(), nullptr));
  EXPECT_EQ(dtoken.Download()[0], sampler_token);
  EXPECT_NEAR(dlogprob.Download()[0], sampler_logprob, 1e-5);
  // Every logit NaN: token 0 (as GreedyToken) and a NaN log-probability.
  DevBuf<float> dnan(std::vector<float>(777, NAN));
  CUDA_OK(cuda::GreedyPick(dnan.get(), 777, dtoken.get(), dlogprob.get(), nullptr));
  EXPECT_EQ(dtoken.Download()[0], 0);
  EXPECT_TRUE(std::isnan(dlogprob.Download()[0]));
  EXPECT_EQ(cuda::GreedyPick(nullptr, 1, dtoken.get(), dlogprob.get(), nullptr),
            cudaErrorInvalidValue);
}

TEST_F(CudaOpsTest, EmbedMatchesDequantizedRows) {
  for (DType type : kAllTypes) {
    const int64_t vocab = 257, hidden = 384;
    HostWeights w = RandomWeights(type, vocab, hidden, 1.f);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    std::vector<int32_t> tokens = {0, 256, 17, 17, 100};
    const int n = static_cast<int>(tokens.size());
    std::vector<float> ref(static_cast<size_t>(n) * hidden);
    for (int t = 0; t < n; ++t) {
      DequantizeRow(type, w.view().row(tokens[t]), ref.data() + t * hidden, hidden);
    }
    DevBuf<int32_t> dt(tokens);
    DevBuf<float> dout(ref.size());
    CUDA_OK(cuda::Embed(m, dt.get(), n, dout.get(), nullptr));
    EXPECT_EQ(dout.Download(), ref) << DTypeName(type);
    EXPECT_TRUE(dout.GuardsIntact());
  }
}

}  // namespace
}  // namespace cuda_test
}  // namespace pinfer
