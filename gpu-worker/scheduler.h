// The gpu-worker's scheduler: one thread owns the compute backend and advances every running
// sequence in turn, a prefill chunk or one decode step at a time, so that concurrent Generate
// streams interleave fairly and a long prompt never stalls the others for more than a chunk.
// Each sequence has its own KV cache slot, sampler, detokenizer and stop-string matcher, so
// streams cannot see each other's state. The per-sequence logic mirrors the engine's Generate
// (shared/engine/generator.h) step for step, so that outputs equal the in-process engine's.
// A finished sequence's slot is kept in the prefix cache (prefix_cache.h) while the budget allows,
// so that a prompt that starts with its tokens (a chat's next turn) computes only the rest.
//
// gRPC handler threads talk to a sequence only through its event queue and its cancel flag.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu-worker/backend.h"
#include "gpu-worker/prefix_cache.h"
#include "shared/engine/generator.h"
#include "shared/engine/sampler.h"

namespace pinfer::gpuworker {

using Clock = std::chrono::steady_clock;

struct SequenceOptions {
  std::vector<int32_t> prompt;  // token ids, BOS included
  GenerateOptions gen;
  std::string request_id;
  Clock::time_point deadline = Clock::time_point::max();
};

struct SequenceEvent {
  std::vector<GeneratedToken> tokens;
  bool final = false;
  FinishReason finish = FinishReason::kLength;
  absl::Status status;  // non-OK ends the sequence with this error
  int prompt_tokens = 0;
  int generated_tokens = 0;
  int cached_prompt_tokens = 0;  // leading prompt tokens whose KV came from the prefix cache
  double prefill_seconds = -1;   // set on the event carrying the first token
};

class Sequence {
 public:
  explicit Sequence(SequenceOptions opts);
  // Moves pending events into *out, waiting up to `timeout` for at least one. Returns true if
  // any were moved.
  bool WaitEvents(std::vector<SequenceEvent>* out, std::chrono::milliseconds timeout);
  // Asks the scheduler to stop this sequence at its next step.
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  const std::string& request_id() const { return opts_.request_id; }

 private:
  friend class Scheduler;
  void Push(SequenceEvent e);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SequenceEvent> events_;
  std::atomic<bool> cancelled_{false};

  // Scheduler-thread state.
  SequenceOptions opts_;
  int slot_ = -1;
  size_t prefilled_ = 0;
  int cached_tokens_ = 0;  // of prefilled_, taken from a kept slot
  int next_pos_ = 0;
  int generated_ = 0;
  bool done_ = false;
  std::vector<int32_t> history_;
  std::optional<Sampler> sampler_;
  std::optional<StreamingDetokenizer> detok_;
  std::optional<StopStringMatcher> stops_;
  std::vector<float> logits_;
  // Greedy requests on a backend that picks_greedy(): its pick replaces the logits and Sampler.
  bool backend_picks_ = false;
  ComputeBackend::GreedyPick pick_;
  Clock::time_point start_;
};

struct SchedulerOptions {
  int max_sequences = 64;   // running + waiting; more is RESOURCE_EXHAUSTED
  int prefill_chunk = 128;  // prompt tokens per step
  int max_new_tokens_limit = 4096;
  // Finished sequences' KV caches kept for later prompts that start with the same tokens.
  PrefixCacheOptions prefix_cache;
};

// Hooks the scheduler calls from its thread after each step (metrics).
struct SchedulerHooks {
  std::function<void(const BackendStats&)> on_stats;
  std::function<void(int running)> on_running;
  std::function<void(int tokens)> on_tokens;
  std::function<void(int sequences)> on_decode_batch;
  // Prefix cache: a sequence got its slot, with `tokens` prompt tokens reused (0: a miss).
  std::function<void(bool hit, int tokens)> on_prefix_lookup;
  // Prefix cache: after it changed, `evicted` slots given up since the last call.
  std::function<void(int evicted, int entries, uint64_t bytes)> on_prefix_cache;
};

class Scheduler {
 public:
  // `peer_problem` returns why the cpu-worker cannot take work now ("" when it can); new
  // sequences are refused with UNAVAILABLE while it is non-empty.
  Scheduler(ComputeBackend* backend, const Model& model, SchedulerOptions options,
            std::function<std::string()> peer_problem, SchedulerHooks hooks);
  ~Scheduler();

  // Validates and queues a sequence.
  absl::StatusOr<std::shared_ptr<Sequence>> Submit(SequenceOptions opts);
  bool CancelById(const std::string& request_id);
  // Refuses new sequences from now on; running ones finish.
  void Drain();
  bool draining() const { return draining_.load(); }
  int running() const { return running_.load(); }

 private:
  void Loop();
  // Advances one sequence by a prefill chunk (or finishes it: cancelled, deadline, error).
  // Returns true when it instead needs a decode step, which the caller batches with the other
  // sequences' decode steps.
  bool Step(Sequence* s);
  void DecodeBatch(const std::vector<Sequence*>& seqs);
  // Emits the next token: the backend's greedy pick (picked) or the sampler's choice from the
  // logits.
  void SampleAndEmit(Sequence* s, double prefill_seconds, bool picked = false);
  // The slot for a new sequence: a kept one holding a prefix of its prompt (s->cached_tokens_
  // set), else a fresh one, giving up kept slots while the backend has none free.
  absl::StatusOr<int> AcquireSlot(Sequence* s, int ctx);
  // keep_cache: the sequence's KV cache is intact (it was not failed by its backend) and may be
  // kept for later prompts.
  void Fail(Sequence* s, absl::Status st, bool keep_cache = false);
  void Finish(Sequence* s, bool keep_cache = true);
  void ReportPrefixCache(int evicted);

  ComputeBackend* backend_;
  const Model& model_;
  SchedulerOptions options_;
  std::function<std::string()> peer_problem_;
  SchedulerHooks hooks_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Sequence>> pending_;  // guarded by mu_
  std::vector<std::shared_ptr<Sequence>> all_;      // guarded by mu_: pending + active
  bool stop_ = false;                               // guarded by mu_
  std::atomic<bool> draining_{false};
  std::atomic<int> running_{0};
  std::vector<std::shared_ptr<Sequence>> active_;  // scheduler thread only
  PrefixCache prefix_;                             // scheduler thread only
  std::thread thread_;
};

}  // namespace pinfer::gpuworker
