// The adaptive hot set's bookkeeping (shared/sparse/hot_cache.h) without a GPU: decayed counts
// and swap decisions against a sequence worked out by hand, and on long random sequences with a
// shifting activation profile and copies that land after random delays, that every active
// neuron goes to exactly one side and the GPU side only ever uses static rows and slots whose
// copy has landed.
#include "shared/sparse/hot_cache.h"

#include <algorithm>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace pinfer {
namespace {

TEST(AdaptiveHotCacheTest, HandWorkedSequence) {
  HotCacheOptions o;
  o.slots = 2;
  o.decay = 0.5;
  o.min_gain = 0.5;
  o.max_swaps = 2;
  absl::StatusOr<AdaptiveHotCache> c = AdaptiveHotCache::Create(8, {{1, 3}}, o);
  ASSERT_TRUE(c.ok()) << c.status();
  c->Observe(0, {0, 1, 5});
  c->EndToken();
  c->Observe(0, {5, 6});
  c->EndToken();
  // Counts: 0 -> 0.5, 1 -> 0.5, 5 -> 0.5 + 1 = 1.5, 6 -> 1.
  EXPECT_DOUBLE_EQ(c->Count(0, 5), 1.5);
  EXPECT_DOUBLE_EQ(c->Count(0, 6), 1.0);
  EXPECT_DOUBLE_EQ(c->Count(0, 0), 0.5);
  // Candidates above min_gain 0.5: 5 and 6 (0 is not above it; 1 is static).
  std::vector<CacheSwap> s = c->PlanSwaps();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].slot, 0);
  EXPECT_EQ(s[0].neuron, 5);
  EXPECT_EQ(s[0].evicted, -1);
  EXPECT_EQ(s[1].slot, 1);
  EXPECT_EQ(s[1].neuron, 6);
  std::vector<int32_t> hot, cold;
  c->Split(0, {1, 5, 6, 7}, &hot, &cold);  // copies in flight: 5 and 6 still cold
  EXPECT_EQ(hot, (std::vector<int32_t>{0}));
  EXPECT_EQ(cold, (std::vector<int32_t>{5, 6, 7}));
  c->Commit(s);
  c->Split(0, {1, 5, 6, 7}, &hot, &cold);  // local: static 1 -> 0; slot 0 -> 2, slot 1 -> 3
  EXPECT_EQ(hot, (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(cold, (std::vector<int32_t>{7}));

  c->Observe(0, {7});
  c->EndToken();
  c->Observe(0, {7});
  c->EndToken();
  // 5 -> 1.5 / 4 = 0.375, 6 -> 0.25, 7 -> 1.5: 7 replaces the coldest slot (1, holding 6),
  // 1.5 > 0.25 + 0.5; 5 stays (no other candidate above 0.5).
  EXPECT_DOUBLE_EQ(c->Count(0, 5), 0.375);
  EXPECT_DOUBLE_EQ(c->Count(0, 7), 1.5);
  s = c->PlanSwaps();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].slot, 1);
  EXPECT_EQ(s[0].neuron, 7);
  EXPECT_EQ(s[0].evicted, 6);
  EXPECT_EQ(c->SlotNeuron(0, 1), -1);   // pending
  c->Split(0, {5, 6, 7}, &hot, &cold);  // 6 is cold at once, 7 not yet hot
  EXPECT_EQ(hot, (std::vector<int32_t>{2}));
  EXPECT_EQ(cold, (std::vector<int32_t>{6, 7}));
  EXPECT_TRUE(c->PlanSwaps().empty());  // the pending slot is not planned twice
  c->Commit(s);
  EXPECT_EQ(c->SlotNeuron(0, 1), 7);
  c->Split(0, {5, 6, 7}, &hot, &cold);
  EXPECT_EQ(hot, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(cold, (std::vector<int32_t>{6}));
}

TEST(AdaptiveHotCacheTest, EveryActiveNeuronOnExactlyOneSide) {
  const int ffn = 200, layers = 3, slots = 24;
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> static_hot(layers);
  for (int l = 0; l < layers; ++l) {
    for (int j = 0; j < ffn; ++j) {
      if (rng() % 5 == 0) static_hot[l].push_back(j);
    }
  }
  HotCacheOptions o;
  o.slots = slots;
  o.decay = 0.8;
  o.min_gain = 0.3;
  o.max_swaps = 5;
  absl::StatusOr<AdaptiveHotCache> c = AdaptiveHotCache::Create(ffn, static_hot, o);
  ASSERT_TRUE(c.ok());
  std::vector<std::vector<CacheSwap>> in_flight;  // committed after random delays
  int served_from_slots = 0;
  for (int token = 0; token < 600; ++token) {
    // The popular set moves every 150 tokens.
    const int shift = (token / 150) * 37;
    for (int l = 0; l < layers; ++l) {
      std::vector<int32_t> active;
      for (int j = 0; j < ffn; ++j) {
        const bool popular = (j + shift + 13 * l) % ffn < 30;
        if (rng() % 100 < (popular ? 60u : 4u)) active.push_back(j);
      }
      std::vector<int32_t> hot, cold;
      c->Split(l, active, &hot, &cold);
      std::multiset<int32_t> seen(cold.begin(), cold.end());
      for (int32_t h : hot) {
        int32_t neuron;
        if (h < c->n_static(l)) {
          neuron = static_hot[l][h];
        } else {
          ASSERT_LT(h - c->n_static(l), slots);
          neuron = c->SlotNeuron(l, h - c->n_static(l));  // -1 if pending: must not be served
          ASSERT_GE(neuron, 0) << "token " << token << ": a slot in flight was used";
          ++served_from_slots;
        }
        seen.insert(neuron);
      }
      ASSERT_EQ(seen, std::multiset<int32_t>(active.begin(), active.end())) << "token " << token;
      ASSERT_TRUE(std::is_sorted(hot.begin(), hot.end()));
      ASSERT_TRUE(std::is_sorted(cold.begin(), cold.end()));
      c->Observe(l, active);
    }
    c->EndToken();
    if (token % 3 == 0) in_flight.push_back(c->PlanSwaps());
    while (!in_flight.empty() && rng() % 2 == 0) {
      c->Commit(in_flight.front());
      in_flight.erase(in_flight.begin());
    }
  }
  EXPECT_GT(served_from_slots, 1000);
}

TEST(AdaptiveHotCacheTest, SlotsFollowTheText) {
  HotCacheOptions o;
  o.slots = 4;
  o.decay = 0.9;
  o.min_gain = 1.0;
  o.max_swaps = 4;
  absl::StatusOr<AdaptiveHotCache> c = AdaptiveHotCache::Create(64, {{0, 1, 2, 3}}, o);
  ASSERT_TRUE(c.ok());
  auto slots_hold = [&]() {
    std::set<int32_t> s;
    for (int i = 0; i < 4; ++i) s.insert(c->SlotNeuron(0, i));
    return s;
  };
  for (int t = 0; t < 10; ++t) {
    c->Observe(0, {0, 10, 11, 12, 13, 40 + t});
    c->EndToken();
  }
  c->Commit(c->PlanSwaps());
  EXPECT_EQ(slots_hold(), (std::set<int32_t>{10, 11, 12, 13}));
  // The text moves on to 20..23: after 20 tokens their counts (8.8) beat the old ones (6.5 * 0.9^20
  // = 0.8).
  for (int t = 0; t < 20; ++t) {
    c->Observe(0, {20, 21, 22, 23});
    c->EndToken();
  }
  c->Commit(c->PlanSwaps());
  EXPECT_EQ(slots_hold(), (std::set<int32_t>{20, 21, 22, 23}));
}

TEST(AdaptiveHotCacheTest, RejectsBadInput) {
  HotCacheOptions o;
  o.slots = 2;
  absl::StatusOr<AdaptiveHotCache> c = AdaptiveHotCache::Create(8, {{3, 1}}, o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("ascending"), std::string::npos) << c.status();
  o.decay = 0;
  c = AdaptiveHotCache::Create(8, {{1}}, o);
  EXPECT_NE(c.status().message().find("bad hot cache options"), std::string::npos);
}

}  // namespace
}  // namespace pinfer
