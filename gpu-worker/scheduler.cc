// See scheduler.h.
#include "gpu-worker/scheduler.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "shared/service/log.h"

namespace pinfer::gpuworker {

Sequence::Sequence(SequenceOptions opts) : opts_(std::move(opts)) {}

void Sequence::Push(SequenceEvent e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

bool Sequence::WaitEvents(std::vector<SequenceEvent>* out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  if (events_.empty()) return false;
  while (!events_.empty()) {
    out->push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return true;
}

Scheduler::Scheduler(ComputeBackend* backend, const Model& model, SchedulerOptions options,
                     std::function<std::string()> peer_problem, SchedulerHooks hooks)
    : backend_(backend),
      model_(model),
      options_(options),
      peer_problem_(std::move(peer_problem)),
      hooks_(std::move(hooks)),
      prefix_(options_.prefix_cache) {
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (auto& s : all_) s->Cancel();
  }
  cv_.notify_all();
  thread_.join();
  while (std::optional<int> slot = prefix_.EvictOldest()) backend_->ReleaseSlot(*slot);
}

absl::StatusOr<std::shared_ptr<Sequence>> Scheduler::Submit(SequenceOptions opts) {
  const ModelConfig& c = model_.config;
  if (draining_.load()) return absl::UnavailableError("the gpu-worker is draining");
  if (opts.prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  for (int32_t t : opts.prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", t, " is outside the vocabulary (", c.vocab_size, " tokens)"));
    }
  }
  if (opts.gen.max_new_tokens < 0 || opts.gen.max_new_tokens > options_.max_new_tokens_limit) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens ", opts.gen.max_new_tokens,
                                                   " is over the limit of ",
                                                   options_.max_new_tokens_limit));
  }
  const size_t ctx = opts.prompt.size() + static_cast<size_t>(opts.gen.max_new_tokens);
  if (ctx > static_cast<size_t>(c.max_context)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", opts.prompt.size(), " tokens) plus max_new_tokens (",
                     opts.gen.max_new_tokens, ") exceeds the context length of ", c.max_context));
  }
  if (absl::Status st = opts.gen.sampling.Validate(); !st.ok()) return st;
  if (std::string problem = peer_problem_(); !problem.empty()) {
    return absl::UnavailableError(problem);
  }
  auto seq = std::make_shared<Sequence>(std::move(opts));
  seq->start_ = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int>(all_.size()) >= options_.max_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat("the gpu-worker is running its maximum of ",
                                                       options_.max_sequences, " sequences"));
    }
    pending_.push_back(seq);
    all_.push_back(seq);
  }
  cv_.notify_all();
  return seq;
}

bool Scheduler::CancelById(const std::string& request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  bool found = false;
  for (auto& s : all_) {
    if (!request_id.empty() && s->request_id() == request_id) {
      s->Cancel();
      found = true;
    }
  }
  return found;
}

void Scheduler::Drain() { draining_.store(true); }

void Scheduler::Loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !pending_.empty() || !active_.empty(); });
      if (stop_) break;
      for (auto& s : pending_) active_.push_back(std::move(s));
      pending_.clear();
    }
    running_.store(static_cast<int>(active_.size()));
    if (hooks_.on_running) hooks_.on_running(static_cast<int>(active_.size()));
    // One step for every active sequence per round: prefill chunks one by one, then the decode
    // steps of all sequences that are generating as one batch.
    std::vector<Sequence*> decoding;
    for (auto& s : active_) {
      if (Step(s.get())) decoding.push_back(s.get());
    }
    if (!decoding.empty()) DecodeBatch(decoding);
    if (hooks_.on_stats) hooks_.on_stats(backend_->TakeStats());
    std::vector<std::shared_ptr<Sequence>> finished;
    for (auto& s : active_) {
      if (s->done_) finished.push_back(s);
    }
    if (!finished.empty()) {
      active_.erase(
          std::remove_if(active_.begin(), active_.end(), [](const auto& s) { return s->done_; }),
          active_.end());
      std::lock_guard<std::mutex> lock(mu_);
      all_.erase(std::remove_if(all_.begin(), all_.end(), [](const auto& s) { return s->done_; }),
                 all_.end());
    }
    running_.store(static_cast<int>(active_.size()));
    if (hooks_.on_running) hooks_.on_running(static_cast<int>(active_.size()));
  }
  for (auto& s : active_) {
    if (!s->done_) Fail(s.get(), absl::UnavailableError("the gpu-worker is shutting down"));
  }
}

absl::StatusOr<int> Scheduler::AcquireSlot(Sequence* s, int ctx) {
  const std::vector<int32_t>& prompt = s->opts_.prompt;
  int evicted = 0;
  if (std::optional<PrefixCache::Hit> hit = prefix_.Take(prompt)) {
    if (backend_->ReuseSlot(hit->slot, ctx, hit->tokens).ok()) {
      s->cached_tokens_ = hit->tokens;
      if (hooks_.on_prefix_lookup) hooks_.on_prefix_lookup(true, hit->tokens);
      ReportPrefixCache(0);
      return hit->slot;
    }
    backend_->ReleaseSlot(hit->slot);  // too small for this sequence: give it up
    evicted += 1;
  }
  absl::StatusOr<int> slot = backend_->AcquireSlot(ctx);
  while (absl::IsResourceExhausted(slot.status())) {
    std::optional<int> victim = prefix_.EvictOldest();
    if (!victim.has_value()) break;
    backend_->ReleaseSlot(*victim);
    evicted += 1;
    slot = backend_->AcquireSlot(ctx);
  }
  // Counted once the sequence has its slot: one waiting for a free slot looks again next round.
  if (slot.ok() && prefix_.enabled() && hooks_.on_prefix_lookup) hooks_.on_prefix_lookup(false, 0);
  if (evicted > 0 || slot.ok()) ReportPrefixCache(evicted);
  return slot;
}

void Scheduler::ReportPrefixCache(int evicted) {
  if (prefix_.enabled() && hooks_.on_prefix_cache) {
    hooks_.on_prefix_cache(evicted, prefix_.entries(), prefix_.bytes());
  }
}

void Scheduler::Finish(Sequence* s, bool keep_cache) {
  if (s->slot_ >= 0) {
    // Positions whose KV is computed: the prompt so far, then every token fed back to decode
    // (the last sampled token never was).
    const size_t computed = s->next_pos_ > 0 ? static_cast<size_t>(s->next_pos_) : s->prefilled_;
    if (keep_cache && prefix_.enabled() && computed > 0 && computed <= s->history_.size()) {
      std::vector<int32_t> tokens(s->history_.begin(), s->history_.begin() + computed);
      const uint64_t bytes = backend_->slot_bytes(s->slot_);
      std::vector<int> evicted = prefix_.Put(s->slot_, std::move(tokens), bytes);
      for (int slot : evicted) backend_->ReleaseSlot(slot);
      ReportPrefixCache(static_cast<int>(evicted.size()));
    } else {
      backend_->ReleaseSlot(s->slot_);
    }
  }
  s->slot_ = -1;
  s->done_ = true;
}

void Scheduler::Fail(Sequence* s, absl::Status st, bool keep_cache) {
  SequenceEvent e;
  e.final = true;
  e.status = std::move(st);
  e.prompt_tokens = static_cast<int>(s->opts_.prompt.size());
  e.generated_tokens = s->generated_;
  e.cached_prompt_tokens = s->cached_tokens_;
  s->Push(std::move(e));
  Finish(s, keep_cache);
}

bool Scheduler::Step(Sequence* s) {
  if (s->done_) return false;
  if (s->cancelled()) {
    // The handler has gone (client cancelled or deadline): nobody reads events any more.
    Finish(s);
    return false;
  }
  if (Clock::now() > s->opts_.deadline) {
    Fail(s, absl::DeadlineExceededError("deadline exceeded while generating"),
         /*keep_cache=*/true);
    return false;
  }
  const ModelConfig& c = model_.config;
  const std::vector<int32_t>& prompt = s->opts_.prompt;
  if (s->slot_ < 0) {
    const int ctx = static_cast<int>(prompt.size()) + s->opts_.gen.max_new_tokens;
    absl::StatusOr<int> slot = AcquireSlot(s, ctx);
    if (absl::IsResourceExhausted(slot.status())) return false;  // every slot busy: next round
    if (!slot.ok()) {
      Fail(s, slot.status());
      return false;
    }
    s->slot_ = *slot;
    s->prefilled_ = static_cast<size_t>(s->cached_tokens_);
    s->sampler_.emplace(s->opts_.gen.sampling);
    s->detok_.emplace(*model_.tokenizer);
    s->stops_.emplace(s->opts_.gen.stop);
    s->history_ = prompt;
    s->logits_.resize(c.vocab_size);
    // Greedy without a repetition penalty is the logits' first largest, whoever computes it.
    const SamplingParams& sp = s->opts_.gen.sampling;
    s->backend_picks_ =
        backend_->picks_greedy() && sp.temperature == 0.f && sp.repetition_penalty == 1.f;
  }
  if (s->prefilled_ < prompt.size()) {
    // Prefill, one chunk per step; logits only after the last chunk.
    const size_t n = std::min(prompt.size() - s->prefilled_,
                              static_cast<size_t>(std::max(1, options_.prefill_chunk)));
    const bool last = s->prefilled_ + n == prompt.size();
    absl::Status st =
        backend_->Forward(s->slot_, std::span<const int32_t>(prompt.data() + s->prefilled_, n),
                          static_cast<int>(s->prefilled_), last ? s->logits_.data() : nullptr);
    if (!st.ok()) {
      Fail(s, st);
      return false;
    }
    s->prefilled_ += n;
    if (!last) return false;
    s->next_pos_ = static_cast<int>(prompt.size());
    const double prefill_seconds = std::chrono::duration<double>(Clock::now() - s->start_).count();
    if (s->opts_.gen.max_new_tokens == 0) {
      SequenceEvent e;
      e.final = true;
      e.finish = FinishReason::kLength;
      e.prompt_tokens = static_cast<int>(prompt.size());
      e.cached_prompt_tokens = s->cached_tokens_;
      e.prefill_seconds = prefill_seconds;
      s->Push(std::move(e));
      Finish(s);
      return false;
    }
    SampleAndEmit(s, prefill_seconds);
    return false;
  }
  return true;  // decode: feed the last sampled token, then sample the next
}

void Scheduler::DecodeBatch(const std::vector<Sequence*>& seqs) {
  std::vector<ComputeBackend::DecodeItem> items;
  for (Sequence* s : seqs) {
    if (s->backend_picks_) {
      items.push_back({s->slot_, s->history_.back(), s->next_pos_, nullptr, &s->pick_});
    } else {
      items.push_back({s->slot_, s->history_.back(), s->next_pos_, s->logits_.data()});
    }
  }
  if (hooks_.on_decode_batch) hooks_.on_decode_batch(static_cast<int>(seqs.size()));
  absl::Status st = backend_->DecodeBatch(items);
  for (Sequence* s : seqs) {
    if (!st.ok()) {
      Fail(s, st);
      continue;
    }
    s->next_pos_ += 1;
    SampleAndEmit(s, -1, s->backend_picks_);
  }
}

void Scheduler::SampleAndEmit(Sequence* s, double prefill_seconds, bool picked) {
  const ModelConfig& c = model_.config;
  const GenerateOptions& gen = s->opts_.gen;
  GeneratedToken tok;
  if (picked) {
    tok.id = s->pick_.token;
    tok.logprob = s->pick_.logprob;
  } else {
    tok.id = s->sampler_->Sample(s->logits_, s->history_, &tok.logprob);
  }
  s->history_.push_back(tok.id);
  s->generated_ += 1;
  if (hooks_.on_tokens) hooks_.on_tokens(1);
  const bool eos = gen.stop_at_eos && tok.id == c.eos_id;
  bool stopped = false;
  if (!eos) tok.text = s->stops_->Push(s->detok_->Push(tok.id), &stopped);
  SequenceEvent e;
  e.prompt_tokens = static_cast<int>(s->opts_.prompt.size());
  e.cached_prompt_tokens = s->cached_tokens_;
  e.prefill_seconds = prefill_seconds;
  if (eos || stopped || s->generated_ == gen.max_new_tokens) {
    if (!stopped) {
      std::string rest = s->stops_->Push(s->detok_->Flush(), &stopped);
      if (!stopped) rest += s->stops_->Flush();
      tok.text += rest;
    }
    e.final = true;
    e.finish = eos ? FinishReason::kEos : stopped ? FinishReason::kStop : FinishReason::kLength;
  }
  e.generated_tokens = s->generated_;
  e.tokens.push_back(std::move(tok));
  const bool final = e.final;
  s->Push(std::move(e));
  if (final) Finish(s);
}

}  // namespace pinfer::gpuworker
