// The generation loop shared by the CLI and the service: prompt, then decode token by token with
// sampling, EOS, stop strings (held back while they might still be forming, never streamed) and a
// token budget, streaming UTF-8-safe text through a callback.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/status/statusor.h"
#include "shared/engine/sampler.h"
#include "shared/engine/transformer.h"
#include "shared/tokenizer/tokenizer.h"

namespace pinfer {

enum class FinishReason { kLength, kEos, kStop, kCancelled };
const char* FinishReasonName(FinishReason r);

struct GenerateOptions {
  int max_new_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool stop_at_eos = true;
};

struct GeneratedToken {
  int32_t id;
  std::string text;  // text released with this token (may be empty while UTF-8 or a stop string is pending)
  float logprob;
};

struct GenerateResult {
  std::vector<int32_t> ids;
  std::string text;
  FinishReason finish = FinishReason::kLength;
  double prompt_seconds = 0;
  double generation_seconds = 0;
};

// Holds back text that may be the beginning of a stop string.
class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stop) : stop_(std::move(stop)) {}
  // Adds text; returns what can be released. Sets *stopped when a stop string completed (the
  // returned text then ends right before it).
  std::string Push(absl::string_view text, bool* stopped);
  std::string Flush() { return std::exchange(held_, ""); }

 private:
  std::vector<std::string> stop_;
  std::string held_;
};

// on_token returns false to cancel. last_prompt_logits, if given, receives the logits at the last
// prompt position.
absl::StatusOr<GenerateResult> Generate(Transformer& model, const Tokenizer& tokenizer,
                                        std::span<const int32_t> prompt,
                                        const GenerateOptions& opts,
                                        const std::function<bool(const GeneratedToken&)>& on_token,
                                        std::vector<float>* last_prompt_logits = nullptr);

}  // namespace pinfer
