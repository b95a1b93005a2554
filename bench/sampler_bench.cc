// Times the sampler, per generated token, on random logits (normal, sigma 3, about what a trained
// model's last layer gives) for common vocabulary sizes and settings. The sampler runs once per
// token on the whole vocabulary in the gpu-worker and the engine, so its microseconds add to every
// decode step. Prints a markdown table of medians, one thread.
//
// usage: sampler_bench [REPS]   (default 201 timed calls per row)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "shared/engine/sampler.h"

int main(int argc, char** argv) {
  using namespace pinfer;
  using Clock = std::chrono::steady_clock;
  const int reps = argc > 1 ? std::atoi(argv[1]) : 201;
  struct Setting {
    const char* name;
    SamplingParams p;
    bool logprob;
  };
  auto params = [](float t, int k, float top_p, float min_p) {
    SamplingParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.seed = 1;
    return p;
  };
  const Setting settings[] = {
      {"greedy", params(0, 0, 1, 0), false},
      {"greedy + logprob", params(0, 0, 1, 0), true},
      {"temperature 0.8", params(0.8f, 0, 1, 0), true},
      {"temperature 0.8, top-k 40", params(0.8f, 40, 1, 0), true},
      {"temperature 0.8, top-p 0.95", params(0.8f, 0, 0.95f, 0), true},
      {"temperature 0.8, min-p 0.05", params(0.8f, 0, 1, 0.05f), true},
      {"temperature 0.8, top-k 40, top-p 0.95, min-p 0.05", params(0.8f, 40, 0.95f, 0.05f), true},
  };
  const int vocabs[] = {4096, 32000, 128256};
  std::printf(
      "command: sampler_bench %d\n\n| setting | vocab 4096 (us) | 32000 (us) | 128256 (us) |\n",
      reps);
  std::printf("|---|---|---|---|\n");
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (const Setting& s : settings) {
    std::printf("| %s |", s.name);
    for (int vocab : vocabs) {
      std::vector<float> base(vocab);
      for (float& x : base) x = normal(rng);
      Sampler sampler(s.p);
      std::vector<float> logits;
      std::vector<double> us;
      int64_t sink = 0;
      for (int r = 0; r < reps + 5; ++r) {
        logits = base;
        logits[r % vocab] += 0.5f;  // a slightly different row each call
        float lp = 0;
        const auto t0 = Clock::now();
        sink += sampler.Sample(logits, {}, s.logprob ? &lp : nullptr);
        const auto t1 = Clock::now();
        if (r >= 5) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
      std::printf(" %.1f |", us[us.size() / 2]);
      if (sink == -1) std::printf("!");
    }
    std::printf("\n");
  }
  return 0;
}
