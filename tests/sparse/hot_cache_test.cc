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

// A GPU side that enforces the module's rules (gpu-worker/cuda/backend.h): rows are loaded only
// into slots that serve nobody, a slot serves only the neuron its landed copy brought in, and a
// neuron is served by one slot at most. Copies land at once, or (auto_land false) when the test
// says so.
class FakeSlots : public CacheSlotTarget {
 public:
  FakeSlots(int layers, int slots)
      : serving(layers, std::vector<int32_t>(slots, -1)),
        loaded(layers, std::vector<int32_t>(slots, -1)) {}
  absl::Status LoadRows(int layer, const std::vector<int32_t>& slots,
                        const std::vector<int32_t>& neurons) override {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (serving[layer][slots[i]] >= 0) return absl::FailedPreconditionError("slot serves");
      loaded[layer][slots[i]] = neurons[i];
    }
    landed = auto_land;
    return fail_loads ? absl::InternalError("copy failed") : absl::OkStatus();
  }
  absl::StatusOr<bool> RowsLanded() override { return landed; }
  absl::Status AssignSlots(int layer, const std::vector<int32_t>& slots,
                           const std::vector<int32_t>& neurons) override {
    for (size_t i = 0; i < slots.size(); ++i) {
      const int32_t j = neurons[i];
      if (j >= 0 && (!landed || loaded[layer][slots[i]] != j)) {
        return absl::FailedPreconditionError("slot does not hold the neuron yet");
      }
      for (size_t o = 0; o < serving[layer].size(); ++o) {
        if (j >= 0 && serving[layer][o] == j && static_cast<int>(o) != slots[i]) {
          return absl::InvalidArgumentError("neuron in two slots");
        }
      }
      serving[layer][slots[i]] = j;
    }
    return absl::OkStatus();
  }
  std::set<int32_t> Serving(int layer) const {
    std::set<int32_t> out;
    for (int32_t j : serving[layer]) {
      if (j >= 0) out.insert(j);
    }
    return out;
  }
  std::vector<std::vector<int32_t>> serving, loaded;
  bool landed = true, auto_land = true, fail_loads = false;
};

// Each test runs with the counting on the decode thread and on the set's background thread. In
// the background, Flush after each step makes the worker's plan ready for the next AfterStep,
// which is when the foreground would have started it, so the same sequence of calls holds.
class AdaptiveHotSetTest : public testing::TestWithParam<bool> {
 protected:
  bool background() const { return GetParam(); }
  absl::Status Step(AdaptiveHotSet& set, const std::vector<std::vector<int32_t>>& active) {
    absl::Status st = set.AfterStep(active);
    set.Flush();
    return st;
  }
};

TEST_P(AdaptiveHotSetTest, SlotsFollowTheTextThroughTheTargetsProtocol) {
  HotCacheOptions o;
  o.slots = 4;
  o.decay = 0.9;
  o.min_gain = 1.0;
  o.max_swaps = 4;
  absl::StatusOr<AdaptiveHotCache> c = AdaptiveHotCache::Create(64, {{0, 1}, {0, 1}}, o);
  ASSERT_TRUE(c.ok()) << c.status();
  FakeSlots gpu(2, 4);
  AdaptiveHotSet set(std::move(*c), &gpu, /*plan_every=*/2, background());
  // Layer 0 keeps activating 10..13, layer 1 20..23 (plus static neuron 0).
  const std::vector<std::vector<int32_t>> text_a = {{0, 10, 11, 12, 13}, {0, 20, 21, 22, 23}};
  for (int t = 0; t < 4; ++t) ASSERT_TRUE(Step(set, text_a).ok());
  // Foreground: planned and started at step 2 (counts 1.9 > 0 + 1), committed at step 3 (the
  // copy had landed). Background: planned after step 2, started at step 3, committed at step 4.
  EXPECT_EQ(gpu.Serving(0), (std::set<int32_t>{10, 11, 12, 13}));
  EXPECT_EQ(gpu.Serving(1), (std::set<int32_t>{20, 21, 22, 23}));
  EXPECT_EQ(set.swaps_committed(), 8u);
  // The text moves on; copies now land only when the test says so, and until then the slots
  // that were taken away serve nobody while the others keep serving.
  gpu.auto_land = false;
  const std::vector<std::vector<int32_t>> text_b = {{0, 30, 31, 32, 33}, {0, 40, 41, 42, 43}};
  int steps = 0;
  while (!set.copy_in_flight() && steps < 100) {
    ASSERT_TRUE(Step(set, text_b).ok());
    ++steps;
  }
  ASSERT_TRUE(set.copy_in_flight()) << "no swap planned after " << steps << " steps";
  const uint64_t before = set.swaps_committed();
  for (int t = 0; t < 3; ++t) ASSERT_TRUE(Step(set, text_b).ok());
  EXPECT_EQ(set.swaps_committed(), before);  // nothing committed before the copy lands
  for (int l = 0; l < 2; ++l) {
    for (int32_t j : gpu.Serving(l)) EXPECT_TRUE(j < 30) << "served before its copy landed";
  }
  gpu.landed = true;
  for (int t = 0; t < 40; ++t) ASSERT_TRUE(Step(set, text_b).ok());
  EXPECT_EQ(gpu.Serving(0), (std::set<int32_t>{30, 31, 32, 33}));
  EXPECT_EQ(gpu.Serving(1), (std::set<int32_t>{40, 41, 42, 43}));
}

TEST_P(AdaptiveHotSetTest, ReportsTheTargetsErrorsAndBadInput) {
  HotCacheOptions o;
  o.slots = 2;
  o.min_gain = 0.5;
  absl::StatusOr<AdaptiveHotCache> c = AdaptiveHotCache::Create(16, {{0}}, o);
  ASSERT_TRUE(c.ok());
  FakeSlots gpu(1, 2);
  gpu.fail_loads = true;
  AdaptiveHotSet set(std::move(*c), &gpu, /*plan_every=*/1, background());
  // In the background the plan made from the first step is started by the second.
  if (background()) {
    ASSERT_TRUE(Step(set, {{5, 6}}).ok());
  }
  absl::Status st = Step(set, {{5, 6}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(st.message(), "copy failed");
  st = Step(set, {{5}, {6}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("active neurons of 2 layers for a cache of 1"), std::string::npos)
      << st;
}

INSTANTIATE_TEST_SUITE_P(CountingThread, AdaptiveHotSetTest, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& info) {
                           return info.param ? "Background" : "Foreground";
                         });

// Steps that do not wait for the worker (as in decoding): the text drifts every 50 steps and
// copies land a few steps after they start, while the worker counts and plans concurrently. The
// fake target fails any call that breaks the protocol, and once the text stays put the slots
// serve exactly its neurons. Under TSan this is the test of the handover between the threads.
TEST(AdaptiveHotSetBackgroundTest, StepsDoNotWaitAndTheSlotsStillFollowTheText) {
  HotCacheOptions o;
  o.slots = 8;
  o.decay = 0.8;
  o.min_gain = 0.5;
  o.max_swaps = 3;
  const int layers = 3;
  absl::StatusOr<AdaptiveHotCache> c =
      AdaptiveHotCache::Create(256, std::vector<std::vector<int32_t>>(layers, {0, 1, 2}), o);
  ASSERT_TRUE(c.ok()) << c.status();
  FakeSlots gpu(layers, 8);
  gpu.auto_land = false;
  AdaptiveHotSet set(std::move(*c), &gpu, /*plan_every=*/1, /*background=*/true);
  auto text = [&](int phase) {
    std::vector<std::vector<int32_t>> active(layers);
    for (int l = 0; l < layers; ++l) {
      active[l].push_back(0);
      for (int k = 0; k < 8; ++k) active[l].push_back(16 + 32 * phase + 8 * l + k);
    }
    return active;
  };
  int in_flight_for = 0;
  for (int t = 0; t < 400; ++t) {
    ASSERT_TRUE(set.AfterStep(text(t / 50 % 4)).ok()) << "step " << t;
    in_flight_for = set.copy_in_flight() ? in_flight_for + 1 : 0;
    if (in_flight_for == 3) gpu.landed = true;  // the copy lands three steps after its start
  }
  EXPECT_GT(set.swaps_committed(), static_cast<uint64_t>(layers * 8));  // filled and moved on
  gpu.landed = true;
  gpu.auto_land = true;
  for (int t = 0; t < 30; ++t) {
    ASSERT_TRUE(set.AfterStep(text(1)).ok());
    set.Flush();
  }
  for (int l = 0; l < layers; ++l) {
    std::set<int32_t> want;
    for (int k = 0; k < 8; ++k) want.insert(16 + 32 + 8 * l + k);
    EXPECT_EQ(gpu.Serving(l), want) << "layer " << l;
  }
}

}  // namespace
}  // namespace pinfer
