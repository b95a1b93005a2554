// Sampling: greedy, seeds, and the filters (top-k, top-p, min-p, repetition penalty) checked
// against distributions computed by hand; stop-string hold-back in the generation loop.
#include "shared/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shared/engine/generator.h"

namespace pinfer {
namespace {

std::map<int32_t, int> Histogram(SamplingParams p, std::vector<float> logits, int draws) {
  p.seed = 42;
  Sampler s(p);
  std::map<int32_t, int> h;
  for (int i = 0; i < draws; ++i) {
    std::vector<float> l = logits;
    ++h[s.Sample(l, {}, nullptr)];
  }
  return h;
}

TEST(SamplerTest, GreedyPicksArgmaxAndReportsLogprob) {
  Sampler s(SamplingParams{});
  std::vector<float> logits = {0.f, 3.f, 1.f};
  float lp;
  EXPECT_EQ(s.Sample(logits, {}, &lp), 1);
  const double z = std::exp(0.0) + std::exp(3.0) + std::exp(1.0);
  EXPECT_NEAR(lp, 3.0 - std::log(z), 1e-5);
}

// The plain definition GreedyToken must match: the first index of the largest non-NaN logit.
int32_t FirstLargest(const std::vector<float>& v) {
  int32_t best = -1;
  for (size_t i = 0; i < v.size(); ++i) {
    if (std::isnan(v[i])) continue;
    if (best < 0 || v[i] > v[best]) best = static_cast<int32_t>(i);
  }
  return best < 0 ? 0 : best;
}

TEST(SamplerTest, GreedyTokenIsTheFirstLargestWithTiesNaNsAndTails) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 4.f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t n : {1, 2, 15, 16, 17, 31, 33, 100, 32000, 32003}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> v(n);
      for (float& x : v) x = normal(rng);
      std::uniform_int_distribution<size_t> at(0, n - 1);
      if (trial % 2 == 1) {  // the largest value several times: the first one wins
        const float top = 100.f + trial;
        for (int k = 0; k < 3; ++k) v[at(rng)] = top;
      }
      if (trial % 3 == 1) v[0] = nan;  // a leading NaN (std::max_element would stop there)
      if (trial % 3 == 2) v[at(rng)] = nan;
      if (trial % 5 == 4) v[n - 1] = 1000.f;  // the largest in the tail past the last full block
      ASSERT_EQ(GreedyToken(v), FirstLargest(v)) << "n " << n << " trial " << trial;
    }
  }
  EXPECT_EQ(GreedyToken(std::vector<float>{-inf, -inf, -inf}), 0);
  EXPECT_EQ(GreedyToken(std::vector<float>{nan, -inf, nan, 2.f, 2.f}), 3);
  EXPECT_EQ(GreedyToken(std::vector<float>(40, nan)), 0);
  EXPECT_EQ(GreedyToken(std::vector<float>{}), 0);
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDifferentTokens) {
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[i] = std::sin(i * 1.3f);
  SamplingParams p;
  p.temperature = 1.f;
  auto run = [&](uint64_t seed) {
    p.seed = seed;
    Sampler s(p);
    std::vector<int32_t> out;
    for (int i = 0; i < 40; ++i) {
      std::vector<float> l = logits;
      out.push_back(s.Sample(l, {}, nullptr));
    }
    return out;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

TEST(SamplerTest, TopKKeepsOnlyKBest) {
  SamplingParams p;
  p.temperature = 1.f;
  p.top_k = 2;
  auto h = Histogram(p, {1.f, 5.f, 4.f, 0.f}, 2000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_GT(h[1], h[2]);  // p(1)/p(2) = e
  EXPECT_NEAR(static_cast<double>(h[1]) / 2000, std::exp(5.) / (std::exp(5.) + std::exp(4.)), 0.04);
}

TEST(SamplerTest, TopPKeepsSmallestSetReachingP) {
  // Probabilities 0.5, 0.3, 0.2: top_p 0.7 keeps the first two.
  SamplingParams p;
  p.temperature = 1.f;
  p.top_p = 0.7f;
  auto h = Histogram(p, {std::log(0.5f), std::log(0.3f), std::log(0.2f)}, 3000);
  EXPECT_EQ(h.count(2), 0u);
  EXPECT_NEAR(static_cast<double>(h[0]) / 3000, 0.5 / 0.8, 0.04);
}

TEST(SamplerTest, MinPDropsTokensBelowFractionOfBest) {
  // 0.6, 0.3, 0.1 with min_p 0.4: threshold 0.24 keeps the first two.
  SamplingParams p;
  p.temperature = 1.f;
  p.min_p = 0.4f;
  auto h = Histogram(p, {std::log(0.6f), std::log(0.3f), std::log(0.1f)}, 3000);
  EXPECT_EQ(h.count(2), 0u);
  EXPECT_NEAR(static_cast<double>(h[0]) / 3000, 2.0 / 3.0, 0.04);
}

// Larger vocabularies take the vectorized and selection paths: 1000 tokens, three of them
// likely, the rest at logit 0.
std::vector<float> ThreeLikely() {
  std::vector<float> l(1000, 0.f);
  l[10] = 5.f;
  l[500] = 4.f;
  l[999] = 3.f;
  return l;
}

TEST(SamplerTest, TemperatureOverALargeVocabularyFollowsTheSoftmax) {
  SamplingParams p;
  p.temperature = 1.f;
  auto h = Histogram(p, ThreeLikely(), 20000);
  const double z = std::exp(5.) + std::exp(4.) + std::exp(3.) + 997;
  EXPECT_NEAR(h[10] / 20000., std::exp(5.) / z, 0.01);
  EXPECT_NEAR(h[500] / 20000., std::exp(4.) / z, 0.007);
  EXPECT_NEAR(h[999] / 20000., std::exp(3.) / z, 0.005);
  EXPECT_GT(h.size(), 500u);  // the flat tail is sampled too
}

TEST(SamplerTest, MinPOverALargeVocabularyKeepsTokensNearTheBest) {
  SamplingParams p;
  p.temperature = 1.f;
  p.min_p = 0.3f;  // keeps p >= 0.3 p(best): e^4 / e^5 = 0.37 stays, e^3 / e^5 = 0.14 goes
  auto h = Histogram(p, ThreeLikely(), 4000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_NEAR(h[10] / 4000., std::exp(5.) / (std::exp(5.) + std::exp(4.)), 0.03);
}

// The ranks (0 = best) of the smallest best-first set reaching top_p, computed in double after
// top-k, from the plain definition.
size_t TopPSetSize(std::vector<float> logits, int top_k, double top_p) {
  std::sort(logits.begin(), logits.end(), std::greater<float>());
  if (top_k > 0) logits.resize(top_k);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l) - logits[0]);
  double cum = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    cum += std::exp(static_cast<double>(logits[i]) - logits[0]) / z;
    if (cum >= top_p) return i + 1;
  }
  return logits.size();
}

TEST(SamplerTest, TopPOverALargeVocabularyKeepsTheBestFirstSet) {
  // 3000 distinct logits, -0.002 * rank, at shuffled ids: the set for top_p 0.5 has about 350
  // tokens of nearly equal probability, so draws reach its end and, if it were cut wrong, past it.
  std::vector<float> logits(3000);
  std::vector<int> rank_of(3000);
  std::iota(rank_of.begin(), rank_of.end(), 0);
  std::shuffle(rank_of.begin(), rank_of.end(), std::mt19937(3));
  for (int id = 0; id < 3000; ++id) logits[id] = -0.002f * rank_of[id];
  for (int top_k : {0, 1000}) {
    SamplingParams p;
    p.temperature = 1.f;
    p.top_k = top_k;
    p.top_p = 0.5f;
    const size_t size = TopPSetSize(logits, top_k, 0.5);
    auto h = Histogram(p, logits, 4000);
    int deepest = 0;
    for (const auto& [id, count] : h) deepest = std::max(deepest, rank_of[id]);
    // (one rank of slack: float and double sums may cross 0.5 a token apart)
    EXPECT_LE(deepest, static_cast<int>(size)) << "top_k " << top_k << ", set " << size;
    EXPECT_GE(deepest, static_cast<int>(size) - 20) << "top_k " << top_k << ", set " << size;
  }
}

TEST(SamplerTest, EveryLogitNaNGivesTokenZeroWithoutReadingPastTheCandidates) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float min_p : {0.f, 0.1f}) {
    for (float top_p : {1.f, 0.9f}) {
      SamplingParams p;
      p.temperature = 1.f;
      p.min_p = min_p;
      p.top_p = top_p;
      p.seed = 1;
      Sampler s(p);
      std::vector<float> logits(100, nan);
      EXPECT_EQ(s.Sample(logits, {}, nullptr), 0) << min_p << " " << top_p;
    }
  }
}

TEST(SamplerTest, TemperatureSharpens) {
  SamplingParams p;
  p.temperature = 0.5f;
  auto h = Histogram(p, {0.f, std::log(2.f)}, 4000);  // p ∝ 1, 4 at T = 0.5
  EXPECT_NEAR(static_cast<double>(h[1]) / 4000, 0.8, 0.03);
}

TEST(SamplerTest, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams p;
  p.repetition_penalty = 2.f;
  Sampler s(p);
  std::vector<float> logits = {3.f, 2.f, -1.f};
  std::vector<int32_t> history = {0, 2};
  EXPECT_EQ(s.Sample(logits, history, nullptr), 1);  // 3/2 = 1.5 < 2
  EXPECT_FLOAT_EQ(logits[0], 1.5f);
  EXPECT_FLOAT_EQ(logits[2], -2.f);
}

TEST(SamplerTest, InvalidParamsAreRejected) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
  p = {};
  p.top_p = 0;
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
  p = {};
  p.min_p = 2;
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
  p = {};
  p.repetition_penalty = 0;
  EXPECT_THAT(std::string(p.Validate().message()), ::testing::HasSubstr("repetition_penalty"));
}

TEST(StopStringMatcherTest, HoldsBackPossiblePrefixesAndStopsAcrossPieces) {
  StopStringMatcher m({"\n\n", "END"});
  bool stopped;
  EXPECT_EQ(m.Push("hello E", &stopped), "hello ");
  EXPECT_FALSE(stopped);
  EXPECT_EQ(m.Push("N", &stopped), "");
  EXPECT_EQ(m.Push("Dless", &stopped), "");
  EXPECT_TRUE(stopped);
}

TEST(StopStringMatcherTest, ReleasesHeldTextWhenItCannotStop) {
  StopStringMatcher m({"END"});
  bool stopped;
  EXPECT_EQ(m.Push("xEN", &stopped), "x");
  EXPECT_EQ(m.Push("Z", &stopped), "ENZ");
  EXPECT_FALSE(stopped);
}

}  // namespace
}  // namespace pinfer
