// See sampler.h. The filter order follows llama.cpp's default chain: penalties, top-k, top-p,
// min-p, temperature.
#include "shared/engine/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "absl/strings/str_cat.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace pinfer {

absl::Status SamplingParams::Validate() const {
  if (!(temperature >= 0) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be >= 0, got ", temperature));
  }
  if (top_k < 0) return absl::InvalidArgumentError("top_k must be >= 0");
  if (!(top_p > 0 && top_p <= 1)) return absl::InvalidArgumentError("top_p must be in (0, 1]");
  if (!(min_p >= 0 && min_p <= 1)) return absl::InvalidArgumentError("min_p must be in [0, 1]");
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty)) {
    return absl::InvalidArgumentError("repetition_penalty must be > 0");
  }
  return absl::OkStatus();
}

int32_t GreedyToken(std::span<const float> logits) {
  const float* p = logits.data();
  const size_t n = logits.size();
  constexpr float kLow = -std::numeric_limits<float>::infinity();
  size_t i = 0;
  float max = kLow;
  // Pass 1: the largest value. (GCC will not vectorize `a < b ? b : a` by itself: without
  // -ffinite-math-only it may not assume the packed max's NaN rule, which here is the one wanted.)
#if defined(__SSE2__)
  __m128 acc[4] = {_mm_set1_ps(kLow), _mm_set1_ps(kLow), _mm_set1_ps(kLow), _mm_set1_ps(kLow)};
  for (; i + 16 <= n; i += 16) {
    // maxps(x, acc) is x > acc ? x : acc, so a NaN x leaves acc as it was.
    for (int k = 0; k < 4; ++k) acc[k] = _mm_max_ps(_mm_loadu_ps(p + i + 4 * k), acc[k]);
  }
  alignas(16) float lane[16];
  for (int k = 0; k < 4; ++k) _mm_store_ps(lane + 4 * k, acc[k]);
  for (float l : lane) max = max < l ? l : max;
#endif
  for (; i < n; ++i) max = max < p[i] ? p[i] : max;
  // Pass 2: the first block of 16 that holds it, then its first index there.
  i = 0;
#if defined(__SSE2__)
  const __m128 m = _mm_set1_ps(max);
  for (; i + 16 <= n; i += 16) {
    int hits = 0;
    for (int k = 0; k < 4; ++k) {
      hits |= _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(p + i + 4 * k), m)) << (4 * k);
    }
    if (hits != 0) return static_cast<int32_t>(i + std::countr_zero(static_cast<unsigned>(hits)));
  }
#endif
  for (; i < n; ++i) {
    if (p[i] == max) return static_cast<int32_t>(i);
  }
  return 0;  // every logit NaN (or none)
}

Sampler::Sampler(const SamplingParams& p)
    : p_(p), rng_(p.seed.has_value() ? *p.seed : std::random_device{}()) {}

int32_t Sampler::Sample(std::span<float> logits, std::span<const int32_t> history, float* logprob) {
  const int vocab = static_cast<int>(logits.size());
  if (p_.repetition_penalty != 1.f) {
    std::unordered_set<int32_t> seen(history.begin(), history.end());
    for (int32_t id : seen) {
      if (id < 0 || id >= vocab) continue;
      float& l = logits[id];
      l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
    }
  }
  if (p_.temperature == 0.f) {
    const int32_t best = GreedyToken(logits);
    if (logprob != nullptr) {
      float max = logits[best], sum = 0;
      for (float l : logits) sum += std::exp(l - max);
      *logprob = -std::log(sum);
    }
    return best;
  }
  cand_.resize(vocab);
  for (int i = 0; i < vocab; ++i) cand_[i] = {logits[i], i};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t n = cand_.size();
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < n) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    n = p_.top_k;
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  // Softmax over the survivors (at temperature 1, as llama.cpp's top-p and min-p see them).
  std::vector<float> prob(n);
  float max = cand_[0].first, sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp(cand_[i].first - max);
  for (auto& q : prob) q /= sum;
  if (p_.top_p < 1.f) {
    float cum = 0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      cum += prob[i];
      if (cum >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
  }
  if (p_.min_p > 0.f) {
    const float threshold = p_.min_p * prob[0];
    size_t keep = 1;
    while (keep < n && prob[keep] >= threshold) ++keep;
    n = keep;
  }
  // Temperature, then sample.
  std::vector<double> w(n);
  double total = 0;
  for (size_t i = 0; i < n; ++i) {
    total += w[i] = std::exp((cand_[i].first - max) / p_.temperature);
  }
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(rng_);
  size_t pick = n - 1;
  for (size_t i = 0; i < n; ++i) {
    r -= w[i];
    if (r < 0) {
      pick = i;
      break;
    }
  }
  if (logprob != nullptr) *logprob = static_cast<float>(std::log(w[pick] / total));
  return cand_[pick].second;
}

}  // namespace pinfer
