// See sampler.h. The filter order follows llama.cpp's default chain: penalties, top-k, top-p,
// min-p, temperature.
#include "shared/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "absl/strings/str_cat.h"

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
    int32_t best = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
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
