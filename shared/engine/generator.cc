// See generator.h.
#include "absl/strings/string_view.h"
#include "shared/engine/generator.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "shared/util/status_macros.h"

namespace pinfer {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return "length";
    case FinishReason::kEos: return "eos";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "?";
}

std::string StopStringMatcher::Push(absl::string_view text, bool* stopped) {
  *stopped = false;
  held_.append(text.data(), text.size());
  size_t first = std::string::npos;
  for (const auto& s : stop_) {
    if (s.empty()) continue;
    size_t at = held_.find(s);
    if (at != std::string::npos && at < first) first = at;
  }
  if (first != std::string::npos) {
    *stopped = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Keep the longest suffix that is a proper prefix of some stop string.
  size_t keep_from = held_.size();
  for (size_t i = 0; i < held_.size(); ++i) {
    absl::string_view suffix(held_.data() + i, held_.size() - i);
    bool is_prefix = false;
    for (const auto& s : stop_) {
      if (s.size() > suffix.size() && absl::string_view(s).substr(0, suffix.size()) == suffix) is_prefix = true;
    }
    if (is_prefix) {
      keep_from = i;
      break;
    }
  }
  std::string out = held_.substr(0, keep_from);
  held_.erase(0, keep_from);
  return out;
}

absl::StatusOr<GenerateResult> Generate(Transformer& model, const Tokenizer& tokenizer,
                                        std::span<const int32_t> prompt,
                                        const GenerateOptions& opts,
                                        const std::function<bool(const GeneratedToken&)>& on_token,
                                        std::vector<float>* last_prompt_logits) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& c = model.model().config;
  RETURN_IF_ERROR(opts.sampling.Validate());
  if (prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  if (opts.max_new_tokens < 0) return absl::InvalidArgumentError("max_new_tokens must be >= 0");
  const int ctx = static_cast<int>(prompt.size()) + opts.max_new_tokens;
  if (ctx > c.max_context) {
    return absl::InvalidArgumentError(absl::StrCat("prompt (", prompt.size(), " tokens) plus ",
                                                   opts.max_new_tokens,
                                                   " new tokens exceed the context length ",
                                                   c.max_context));
  }
  KvCache cache(c, ctx);
  std::vector<float> logits(c.vocab_size);
  GenerateResult result;
  auto t0 = Clock::now();
  RETURN_IF_ERROR(model.Forward(prompt, 0, &cache, LogitsMode::kLast, logits.data()));
  auto t1 = Clock::now();
  result.prompt_seconds = std::chrono::duration<double>(t1 - t0).count();
  if (last_prompt_logits != nullptr) *last_prompt_logits = logits;

  Sampler sampler(opts.sampling);
  StreamingDetokenizer detok(tokenizer);
  StopStringMatcher stops(opts.stop);
  std::vector<int32_t> history(prompt.begin(), prompt.end());
  int pos = static_cast<int>(prompt.size());
  for (int i = 0; i < opts.max_new_tokens; ++i) {
    if (i > 0) {
      int32_t last = history.back();
      RETURN_IF_ERROR(model.Forward({&last, 1}, pos - 1, &cache, LogitsMode::kLast, logits.data()));
    }
    GeneratedToken tok;
    tok.id = sampler.Sample(logits, history, &tok.logprob);
    history.push_back(tok.id);
    ++pos;
    const bool eos = opts.stop_at_eos && tok.id == c.eos_id;
    bool stopped = false;
    if (!eos) tok.text = stops.Push(detok.Push(tok.id), &stopped);
    result.ids.push_back(tok.id);
    result.text += tok.text;
    if (eos || stopped || i + 1 == opts.max_new_tokens) {
      if (!stopped) {
        std::string rest = stops.Push(detok.Flush(), &stopped);
        if (!stopped) rest += stops.Flush();
        tok.text += rest;
        result.text += rest;
      }
      result.finish = eos ? FinishReason::kEos : stopped ? FinishReason::kStop : FinishReason::kLength;
      if (on_token && !on_token(tok)) result.finish = FinishReason::kCancelled;
      break;
    }
    if (on_token && !on_token(tok)) {
      result.finish = FinishReason::kCancelled;
      break;
    }
  }
  result.generation_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  return result;
}

}  // namespace pinfer
