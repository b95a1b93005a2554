// See sampler.h. The filter order follows llama.cpp's default chain: penalties, top-k, top-p,
// min-p, temperature.
#include "shared/engine/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "shared/engine/row_kernels.h"

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
    : p_(p),
      rng_(p.seed.has_value() ? *p.seed : std::random_device{}()),
      kernels_(BestRowKernels()) {}

int32_t Sampler::Sample(std::span<float> logits, std::span<const int32_t> history, float* logprob) {
  const int vocab = static_cast<int>(logits.size());
  if (vocab == 0) return 0;
  if (p_.repetition_penalty != 1.f) {
    std::unordered_set<int32_t> seen(history.begin(), history.end());
    for (int32_t id : seen) {
      if (id < 0 || id >= vocab) continue;
      float& l = logits[id];
      l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
    }
  }
  const bool top_k = p_.temperature > 0.f && p_.top_k > 0 && p_.top_k < vocab;
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (top_k) {
    cand_.resize(vocab);
    for (int i = 0; i < vocab; ++i) cand_[i] = {logits[i], i};
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
  }
  const int32_t best = top_k ? cand_[0].second : GreedyToken(logits);
  const float max = logits[best];
  if (p_.temperature == 0.f) {
    if (logprob != nullptr) {
      w_.assign(logits.begin(), logits.end());
      *logprob = -std::log(kernels_->exp_sub_sum(w_.data(), vocab, max));
    }
    return best;
  }
  // The candidates. Sorting the whole vocabulary took 2.5 ms a token at 32,000 logits
  // (bench/sampler_bench.cc), so top-k sorts only its k, top-p selects its set in linear time, and
  // min-p compares logits with a floor.
  // min-p keeps prob >= min_p * prob(best), that is logit >= max + log(min_p).
  const float min_p_floor = p_.min_p > 0.f ? max + std::log(p_.min_p) : -INFINITY;
  float sum = 0;  // top-p's softmax denominator: over top-k's survivors, or every logit
  if (p_.top_p < 1.f) {
    e_.assign(logits.begin(), logits.end());
    sum = kernels_->exp_sub_sum(e_.data(), vocab, max);  // e_[id] = exp(logits[id] - max)
  }
  size_t n = 0;
  bool sorted = false;  // cand_[0, n) best first
  if (top_k) {
    n = p_.top_k;
    sorted = true;
    if (p_.top_p < 1.f) {
      sum = 0;
      for (size_t i = 0; i < n; ++i) sum += e_[cand_[i].second];
    }
  } else {
    // Whatever top-p keeps, min-p keeps only logits from its floor on, so only those are
    // candidates (NaN never is one).
    cand_.clear();
    for (int i = 0; i < vocab; ++i) {
      if (logits[i] >= min_p_floor) cand_.push_back({logits[i], i});
    }
    n = cand_.size();
  }
  if (p_.top_p < 1.f) {
    // The smallest best-first set whose probability reaches top_p. Sampling needs only which
    // candidates it holds, not their order, so unsorted candidates are halved with nth_element,
    // keeping the half where the running probability crosses top_p, down to a short run that is
    // sorted and scanned. [0, lo) is in the set and better than all of [lo, n); cum is its mass.
    auto prob = [&](size_t i) { return e_[cand_[i].second] / sum; };
    size_t lo = 0, hi = n;
    float cum = 0;
    while (!sorted && hi - lo > 32) {
      const size_t mid = lo + (hi - lo) / 2;
      std::nth_element(cand_.begin() + lo, cand_.begin() + mid, cand_.begin() + hi, by_logit);
      float half = 0;
      for (size_t i = lo; i < mid; ++i) half += prob(i);
      if (cum + half >= p_.top_p) {
        hi = mid;
      } else {
        cum += half;
        lo = mid;
      }
    }
    if (!sorted) std::sort(cand_.begin() + lo, cand_.begin() + hi, by_logit);
    size_t keep = hi;
    for (size_t i = lo; i < hi; ++i) {
      cum += prob(i);
      if (cum >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
  }
  // min-p over what top-k left (otherwise the candidates above are past it already). Weights
  // below e^-87 count as e^-87, the vector exp's floor.
  if (p_.min_p > 0.f && top_k) {
    size_t keep = 0;
    for (size_t i = 0; i < n; ++i) {
      if (cand_[i].first >= min_p_floor) cand_[keep++] = cand_[i];
    }
    n = std::max<size_t>(keep, 1);
  }
  if (n == 0) {  // every logit NaN: nothing to weigh
    if (logprob != nullptr) *logprob = 0;
    return best;
  }
  // Temperature, then sample: w[i] = exp((l[i] - max) / T).
  w_.resize(n);
  for (size_t i = 0; i < n; ++i) w_[i] = cand_[i].first / p_.temperature;
  const float total =
      kernels_->exp_sub_sum(w_.data(), static_cast<int64_t>(n), max / p_.temperature);
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(rng_);
  size_t pick = 0;
  for (size_t i = 0; i < n; ++i) {
    if (w_[i] > 0) pick = i;  // (rounding may leave r just above the sum: the last one then)
    r -= w_[i];
    if (r < 0) break;
  }
  if (logprob != nullptr) *logprob = std::log(w_[pick] / total);
  return cand_[pick].second;
}

}  // namespace pinfer
