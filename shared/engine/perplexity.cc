// See perplexity.h.
#include "shared/engine/perplexity.h"

#include <chrono>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "shared/util/status_macros.h"

namespace pinfer {

absl::StatusOr<PerplexityResult> ComputePerplexity(
    Transformer& model, std::span<const int32_t> tokens, int window,
    const std::function<void(int, int)>& progress) {
  const ModelConfig& c = model.model().config;
  if (window < 2) return absl::InvalidArgumentError("window must be at least 2");
  if (window > c.max_context) {
    return absl::InvalidArgumentError(
        absl::StrCat("window ", window, " exceeds the context length ", c.max_context));
  }
  const int n_windows = static_cast<int>(tokens.size() / window);
  if (n_windows == 0) return absl::InvalidArgumentError("fewer tokens than one window");
  auto t0 = std::chrono::steady_clock::now();
  KvCache cache(c, window);
  std::vector<float> logits(static_cast<size_t>(window) * c.vocab_size);
  double nll = 0;
  int64_t scored = 0;
  for (int w = 0; w < n_windows; ++w) {
    std::span<const int32_t> win = tokens.subspan(static_cast<size_t>(w) * window, window);
    RETURN_IF_ERROR(model.Forward(win, 0, &cache, LogitsMode::kAll, logits.data()));
    for (int t = 0; t + 1 < window; ++t) {
      const float* l = logits.data() + static_cast<size_t>(t) * c.vocab_size;
      double max = l[0];
      for (int i = 1; i < c.vocab_size; ++i) max = std::max<double>(max, l[i]);
      double sum = 0;
      for (int i = 0; i < c.vocab_size; ++i) sum += std::exp(l[i] - max);
      nll += max + std::log(sum) - l[win[t + 1]];
      ++scored;
    }
    if (progress) progress(w + 1, n_windows);
  }
  PerplexityResult r;
  r.perplexity = std::exp(nll / scored);
  r.tokens_scored = scored;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace pinfer
