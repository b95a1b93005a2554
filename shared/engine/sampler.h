// Token sampling: greedy (temperature 0), temperature, top-k, top-p, min-p, repetition penalty,
// seeded so that the same seed gives the same output.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace pinfer {

struct RowKernels;

struct SamplingParams {
  float temperature = 0.f;         // 0: greedy
  int top_k = 0;                   // 0: off
  float top_p = 1.f;               // 1: off
  float min_p = 0.f;               // 0: off
  float repetition_penalty = 1.f;  // 1: off (CTRL-style, as in transformers and llama.cpp)
  std::optional<uint64_t> seed;    // unset: a random seed

  absl::Status Validate() const;
};

// The greedy token: the first index of the largest logit, NaNs ignored (0 if every logit is NaN
// or there are none). It runs once per generated token on the whole vocabulary, where
// std::max_element's compare-and-branch per element cost 50-60 us for 32,000 logits on the H200's
// host, 2.4% of a 13B-shape decode step (docs/benchmarks.md, run 31); this takes two passes of
// packed compares, about ten times faster.
int32_t GreedyToken(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // Picks the next token from logits: [vocab] (modified in place by penalties). `history` holds
  // the tokens the repetition penalty applies to. Returns the token; *logprob gets its log
  // probability under the final (filtered, tempered) distribution, 0 for greedy.
  int32_t Sample(std::span<float> logits, std::span<const int32_t> history, float* logprob);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  const RowKernels* kernels_;  // the vector exp (row_kernels.h)
  std::vector<std::pair<float, int32_t>> cand_;
  std::vector<float> e_, w_;  // scratch: exp(logit - max) for top-p; the sampling weights
};

}  // namespace pinfer
