// Perplexity over consecutive windows of a token stream: each complete window of W tokens is
// scored independently on its tokens 2..W (the first has no context); a trailing partial window
// is ignored. The same definition as the reference numbers in reference.json.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "absl/status/statusor.h"
#include "shared/engine/transformer.h"

namespace pinfer {

struct PerplexityResult {
  double perplexity = 0;
  int64_t tokens_scored = 0;
  double seconds = 0;
};

absl::StatusOr<PerplexityResult> ComputePerplexity(
    Transformer& model, std::span<const int32_t> tokens, int window,
    const std::function<void(int done, int total)>& progress = nullptr);

}  // namespace pinfer
