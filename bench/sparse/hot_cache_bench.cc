// Host cost of the adaptive hot set's bookkeeping per decode token (shared/sparse/hot_cache.h) at
// the synthetic 13B shape: 40 layers of 13824 neurons, 2752 cache slots per layer, 10% of neurons
// active per token with the hottest 20% taking 80%. The decode step waits for this work, so it
// adds to every token's time; prints the split, count and plan costs in ms per token.
//
//   hot_cache_bench [tokens=400] [slots=2752] [period=4]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "shared/sparse/hot_cache.h"

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace pinfer;
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 400;
  const int slots = argc > 2 ? std::atoi(argv[2]) : 2752;
  const int period = argc > 3 ? std::max(1, std::atoi(argv[3])) : 4;
  const int F = 13824, L = 40, tier = F / 5;
  HotCacheOptions o;
  o.slots = slots;
  o.max_swaps = 256;
  absl::StatusOr<AdaptiveHotCache> c =
      AdaptiveHotCache::Create(F, std::vector<std::vector<int32_t>>(L), o);
  if (!c.ok()) return 1;
  // 16 distinct tokens of masks, reused in turn.
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<std::vector<std::vector<int32_t>>> masks(16, std::vector<std::vector<int32_t>>(L));
  for (auto& token : masks) {
    for (auto& layer : token) {
      for (int j = 0; j < F; ++j) {
        if (u(rng) < (j < tier ? 0.4 : 0.025)) layer.push_back(j);
      }
    }
  }
  std::vector<int32_t> hot, cold;
  double split = 0, observe = 0, plan = 0;
  int measured = 0;
  for (int s = 0; s < tokens; ++s) {
    const auto& m = masks[s % masks.size()];
    const double t0 = Now();
    for (int l = 0; l < L; ++l) c->Split(l, m[l], &hot, &cold);
    const double t1 = Now();
    for (int l = 0; l < L; ++l) c->Observe(l, m[l]);
    c->EndToken();
    const double t2 = Now();
    if (s % period == 0) c->Commit(c->PlanSwaps());
    const double t3 = Now();
    if (s >= tokens / 2) {  // after the cache has filled
      split += t1 - t0;
      observe += t2 - t1;
      plan += t3 - t2;
      ++measured;
    }
  }
  std::printf(
      "per token: split %.3f ms, counts %.3f ms, plans %.3f ms (every %d tokens), "
      "total %.3f ms\n",
      split / measured * 1e3, observe / measured * 1e3, plan / measured * 1e3, period,
      (split + observe + plan) / measured * 1e3);
  return 0;
}
