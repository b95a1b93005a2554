// Prefix caching in the gpu-worker's scheduler, with a scripted backend that records every
// forward pass and every slot it hands out and gets back: a second chat turn computes only the
// tokens after what the first turn's slot holds, a prompt the cache holds whole recomputes only
// its last token (its logits are needed), kept slots are given up least recently used first
// within the entry and byte budgets and whenever the backend has no free slot, a sequence its
// backend failed is never kept, and the emitted tokens are the ones a run without the cache
// gives. The numbers are the scripted chain's, which depends only on the fed token and its
// position; the real backends' tokens with the cache are compared with the in-process engine's
// in service_test (CPU) and cuda_backend_test (the module reusing a slot).
#include "gpu-worker/prefix_cache.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gpu-worker/backend.h"
#include "gpu-worker/scheduler.h"
#include "gtest/gtest.h"
#include "shared/model/model.h"

namespace pinfer::gpuworker {
namespace {

class RecordingBackend : public ComputeBackend {
 public:
  RecordingBackend(int vocab, int slots) : vocab_(vocab), free_(slots, true) {}

  static int32_t Target(int32_t token, int pos, int vocab) {
    return static_cast<int32_t>((static_cast<int64_t>(token) * 7 + pos * 3 + 11) % vocab);
  }

  std::string name() const override { return "recording"; }
  absl::StatusOr<int> AcquireSlot(int) override {
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i]) {
        free_[i] = false;
        return static_cast<int>(i);
      }
    }
    return absl::ResourceExhaustedError("every slot is in use");
  }
  void ReleaseSlot(int slot) override {
    EXPECT_FALSE(free_[slot]) << "slot " << slot << " released twice";
    free_[slot] = true;
    released.push_back(slot);
  }
  absl::Status ReuseSlot(int slot, int max_ctx, int keep) override {
    EXPECT_FALSE(free_[slot]) << "a kept slot must still be held";
    reused.push_back({slot, keep});
    if (max_ctx > reuse_limit) return absl::InvalidArgumentError("slot too small");
    return absl::OkStatus();
  }
  uint64_t slot_bytes(int) const override { return bytes_per_slot; }
  absl::Status Forward(int slot, std::span<const int32_t> tokens, int pos0,
                       float* logits) override {
    forwards.push_back({slot, pos0, static_cast<int>(tokens.size())});
    if (fail_forwards) return absl::InternalError("scripted failure");
    if (logits != nullptr) Fill(tokens.back(), pos0 + static_cast<int>(tokens.size()) - 1, logits);
    return absl::OkStatus();
  }
  absl::Status DecodeBatch(std::span<const DecodeItem> items) override {
    for (const DecodeItem& it : items) Fill(it.token, it.pos, it.logits);
    return absl::OkStatus();
  }
  uint64_t ffn_bytes() const override { return 0; }
  uint64_t dense_bytes() const override { return 0; }
  uint64_t ffn_neurons() const override { return 0; }
  BackendStats TakeStats() override { return {}; }

  struct Call {
    int slot, pos0, n;
  };
  // Written by the scheduler thread, read after its sequences have ended.
  std::vector<Call> forwards;
  std::vector<int> released;
  std::vector<std::pair<int, int>> reused;  // (slot, keep)
  uint64_t bytes_per_slot = 0;
  int reuse_limit = 1 << 30;
  bool fail_forwards = false;

 private:
  void Fill(int32_t token, int pos, float* logits) const {
    const int32_t peak = Target(token, pos, vocab_);
    for (int j = 0; j < vocab_; ++j) logits[j] = -0.01f * std::abs(j - peak);
  }
  const int vocab_;
  std::vector<bool> free_;
};

struct Outcome {
  std::vector<int32_t> ids;
  int cached = -1;
  absl::Status status;
};

class PrefixCacheTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = LoadModel(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
  }
  static void TearDownTestSuite() { delete model_; }

  static Outcome Run(Scheduler& scheduler, const std::vector<int32_t>& prompt, int n) {
    SequenceOptions opts;
    opts.prompt = prompt;
    opts.gen.max_new_tokens = n;
    opts.gen.stop_at_eos = false;
    Outcome out;
    auto seq = scheduler.Submit(opts);
    if (!seq.ok()) {
      out.status = seq.status();
      return out;
    }
    for (bool final = false; !final;) {
      std::vector<SequenceEvent> events;
      if (!(*seq)->WaitEvents(&events, std::chrono::seconds(30))) {
        ADD_FAILURE() << "no event in 30 s";
        break;
      }
      for (SequenceEvent& e : events) {
        if (!e.status.ok()) out.status = e.status;
        for (GeneratedToken& t : e.tokens) out.ids.push_back(t.id);
        out.cached = e.cached_prompt_tokens;
        final = final || e.final;
      }
    }
    // The sequence's slot is handed back (or kept) by the scheduler thread after its last event.
    for (int i = 0; i < 1000 && scheduler.running() > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return out;
  }

  // The scripted greedy continuation of `prompt`.
  static std::vector<int32_t> Chain(const std::vector<int32_t>& prompt, int n) {
    std::vector<int32_t> ids;
    int32_t token = prompt.back();
    for (int pos = static_cast<int>(prompt.size()) - 1; static_cast<int>(ids.size()) < n; ++pos) {
      token = RecordingBackend::Target(token, pos, model_->config.vocab_size);
      ids.push_back(token);
    }
    return ids;
  }

  static std::vector<int32_t> Prompt(int first, int n) {
    std::vector<int32_t> p = {1};
    for (int i = 1; i < n; ++i) p.push_back(first + i);
    return p;
  }

  static SchedulerOptions WithCache(int entries, uint64_t bytes = 1ull << 30, int min_tokens = 8) {
    SchedulerOptions o;
    o.prefix_cache = {entries, bytes, min_tokens};
    return o;
  }

  static Model* model_;
};
Model* PrefixCacheTest::model_ = nullptr;

struct HookCounts {
  std::atomic<int> hits{0}, misses{0}, reused_tokens{0}, evicted{0}, entries{0};
  SchedulerHooks Hooks() {
    SchedulerHooks h;
    h.on_prefix_lookup = [this](bool hit, int tokens) {
      (hit ? hits : misses) += 1;
      reused_tokens += tokens;
    };
    h.on_prefix_cache = [this](int ev, int n, uint64_t) {
      evicted += ev;
      entries = n;
    };
    return h;
  }
};

TEST_F(PrefixCacheTest, SecondTurnComputesOnlyTheTokensAfterTheKeptOnes) {
  RecordingBackend backend(model_->config.vocab_size, 4);
  HookCounts counts;
  Scheduler scheduler(
      &backend, *model_, WithCache(4), [] { return std::string(); }, counts.Hooks());
  const std::vector<int32_t> turn1 = Prompt(100, 20);
  const Outcome a = Run(scheduler, turn1, 6);
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.ids, Chain(turn1, 6));
  EXPECT_EQ(a.cached, 0);
  // The next turn re-sends the history (prompt and reply) and adds to it.
  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), a.ids.begin(), a.ids.end());
  for (int32_t t : {500, 501, 502}) turn2.push_back(t);
  backend.forwards.clear();
  const Outcome b = Run(scheduler, turn2, 5);
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(b.ids, Chain(turn2, 5));
  // The kept slot holds the prompt and every reply token fed back (all but the last sampled).
  const int kept = static_cast<int>(turn1.size()) + 6 - 1;
  EXPECT_EQ(b.cached, kept);
  ASSERT_EQ(backend.forwards.size(), 1u);
  EXPECT_EQ(backend.forwards[0].pos0, kept);
  EXPECT_EQ(backend.forwards[0].n, static_cast<int>(turn2.size()) - kept);
  EXPECT_EQ(counts.hits.load(), 1);
  EXPECT_EQ(counts.misses.load(), 1);
  EXPECT_EQ(counts.reused_tokens.load(), kept);
  EXPECT_TRUE(backend.released.empty()) << "a kept slot was given up";
  EXPECT_EQ(counts.entries.load(), 1);  // turn 1's slot went on to turn 2 and is kept again
}

TEST_F(PrefixCacheTest, PromptHeldWholeRecomputesOnlyItsLastToken) {
  RecordingBackend backend(model_->config.vocab_size, 4);
  Scheduler scheduler(&backend, *model_, WithCache(4), [] { return std::string(); }, {});
  const std::vector<int32_t> prompt = Prompt(300, 30);
  const Outcome a = Run(scheduler, prompt, 4);
  backend.forwards.clear();
  const Outcome b = Run(scheduler, prompt, 4);
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(b.ids, a.ids);
  EXPECT_EQ(b.ids, Chain(prompt, 4));
  EXPECT_EQ(b.cached, 29);
  ASSERT_EQ(backend.forwards.size(), 1u);
  EXPECT_EQ(backend.forwards[0].pos0, 29);
  EXPECT_EQ(backend.forwards[0].n, 1);
  // A prompt that is a prefix of the kept tokens reuses all but its own last token too.
  const std::vector<int32_t> shorter(prompt.begin(), prompt.begin() + 20);
  const Outcome c = Run(scheduler, shorter, 3);
  EXPECT_EQ(c.cached, 19);
  EXPECT_EQ(c.ids, Chain(shorter, 3));
}

TEST_F(PrefixCacheTest, ShortPrefixesMissAndTheBestMatchIsTaken) {
  RecordingBackend backend(model_->config.vocab_size, 8);
  Scheduler scheduler(&backend, *model_, WithCache(4, 1ull << 30, /*min_tokens=*/10),
                      [] { return std::string(); }, {});
  const std::vector<int32_t> p = Prompt(100, 24);
  std::vector<int32_t> q = p;
  q.resize(12);
  for (int i = 0; i < 12; ++i) q.push_back(700 + i);  // shares 12 tokens with p
  ASSERT_TRUE(Run(scheduler, p, 2).status.ok());
  ASSERT_TRUE(Run(scheduler, q, 2).status.ok());  // 12 >= 10: takes p's slot
  // Shares 20 tokens with p's tokens, 12 with q's: q's slot (which held p's prefix) was kept
  // with q's tokens, so the best match is 12 and comes from it.
  std::vector<int32_t> r(p.begin(), p.begin() + 20);
  r.push_back(900);
  const Outcome out = Run(scheduler, r, 2);
  EXPECT_EQ(out.cached, 12);
  EXPECT_EQ(out.ids, Chain(r, 2));
  // Nine shared tokens are under the minimum: a miss, computed from position 0.
  std::vector<int32_t> s(p.begin(), p.begin() + 9);
  for (int i = 0; i < 10; ++i) s.push_back(800 + i);
  backend.forwards.clear();
  const Outcome miss = Run(scheduler, s, 2);
  EXPECT_EQ(miss.cached, 0);
  ASSERT_FALSE(backend.forwards.empty());
  EXPECT_EQ(backend.forwards[0].pos0, 0);
}

TEST_F(PrefixCacheTest, EntriesAndBytesAreBoundedLeastRecentlyUsedFirst) {
  RecordingBackend backend(model_->config.vocab_size, 8);
  backend.bytes_per_slot = 100;
  HookCounts counts;
  Scheduler scheduler(
      &backend, *model_, WithCache(3, /*bytes=*/250), [] { return std::string(); }, counts.Hooks());
  const std::vector<int32_t> a = Prompt(100, 20), b = Prompt(200, 20), c = Prompt(300, 20);
  ASSERT_TRUE(Run(scheduler, a, 2).status.ok());
  ASSERT_TRUE(Run(scheduler, b, 2).status.ok());
  EXPECT_TRUE(backend.released.empty());
  ASSERT_TRUE(Run(scheduler, c, 2).status.ok());  // 300 bytes > 250: a's slot goes
  ASSERT_EQ(backend.released.size(), 1u);
  EXPECT_EQ(counts.evicted.load(), 1);
  EXPECT_EQ(counts.entries.load(), 2);
  EXPECT_EQ(Run(scheduler, b, 2).cached, 19);  // b was kept
  EXPECT_EQ(Run(scheduler, a, 2).cached, 0);   // a was evicted
}

TEST_F(PrefixCacheTest, KeptSlotsAreGivenUpWhenTheBackendHasNoneFree) {
  RecordingBackend backend(model_->config.vocab_size, 2);
  HookCounts counts;
  Scheduler scheduler(
      &backend, *model_, WithCache(8), [] { return std::string(); }, counts.Hooks());
  const std::vector<int32_t> a = Prompt(100, 20), b = Prompt(200, 20), c = Prompt(300, 20);
  ASSERT_TRUE(Run(scheduler, a, 2).status.ok());
  ASSERT_TRUE(Run(scheduler, b, 2).status.ok());
  // Both slots are kept; a third prompt takes the least recently used (a's).
  const Outcome out = Run(scheduler, c, 2);
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.ids, Chain(c, 2));
  ASSERT_EQ(backend.released.size(), 1u);
  EXPECT_EQ(Run(scheduler, b, 2).cached, 19);
  EXPECT_EQ(counts.evicted.load(), 1);
}

TEST_F(PrefixCacheTest, FailedSequencesAreNotKeptAndTooSmallSlotsAreGivenUp) {
  RecordingBackend backend(model_->config.vocab_size, 4);
  Scheduler scheduler(&backend, *model_, WithCache(4), [] { return std::string(); }, {});
  const std::vector<int32_t> p = Prompt(100, 20);
  backend.fail_forwards = true;
  const Outcome failed = Run(scheduler, p, 2);
  EXPECT_EQ(failed.status.code(), absl::StatusCode::kInternal) << failed.status;
  ASSERT_EQ(backend.released.size(), 1u) << "a failed sequence's slot must be released";
  backend.fail_forwards = false;
  EXPECT_EQ(Run(scheduler, p, 2).cached, 0);  // nothing was kept
  // A kept slot the backend cannot stretch to the new sequence's context is released and the
  // sequence computed from scratch in another.
  backend.reuse_limit = 0;
  backend.released.clear();
  const Outcome out = Run(scheduler, p, 2);
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.cached, 0);
  EXPECT_EQ(out.ids, Chain(p, 2));
  EXPECT_EQ(backend.released.size(), 1u);
  EXPECT_EQ(backend.reused.size(), 1u);
}

TEST_F(PrefixCacheTest, OffMeansEverySlotIsReleased) {
  RecordingBackend backend(model_->config.vocab_size, 4);
  HookCounts counts;
  Scheduler scheduler(
      &backend, *model_, WithCache(0), [] { return std::string(); }, counts.Hooks());
  const std::vector<int32_t> p = Prompt(100, 20);
  ASSERT_TRUE(Run(scheduler, p, 2).status.ok());
  EXPECT_EQ(Run(scheduler, p, 2).cached, 0);
  EXPECT_EQ(backend.released.size(), 2u);
  EXPECT_EQ(counts.hits.load() + counts.misses.load(), 0);
}

// The bookkeeping alone.
TEST(PrefixCacheBookkeepingTest, TakeRemovesTheEntryAndPutEvictsOldestFirst) {
  PrefixCache cache({/*max_entries=*/2, /*max_bytes=*/1000, /*min_tokens=*/2});
  EXPECT_TRUE(cache.Put(7, {1, 2, 3, 4}, 10).empty());
  EXPECT_TRUE(cache.Put(8, {1, 2, 9}, 10).empty());
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  auto hit = cache.Take(prompt);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->slot, 7);
  EXPECT_EQ(hit->tokens, 4);
  EXPECT_EQ(cache.entries(), 1);
  EXPECT_EQ(cache.bytes(), 10u);
  EXPECT_TRUE(cache.Put(7, {5, 5}, 10).empty());
  EXPECT_EQ(cache.Put(9, {6, 6}, 10), std::vector<int>{8});  // three entries: 8 is oldest
  EXPECT_EQ(cache.EvictOldest(), 7);
  EXPECT_EQ(cache.EvictOldest(), 9);
  EXPECT_FALSE(cache.EvictOldest().has_value());
  // A single entry over the byte budget is not kept at all.
  PrefixCache small({4, 5, 2});
  EXPECT_EQ(small.Put(3, {1, 2, 3}, 6), std::vector<int>{3});
  // A one-token prompt has nothing to reuse: its only token must be computed for the logits.
  PrefixCache one({4, 1000, 1});
  one.Put(1, {1, 2}, 0);
  const std::vector<int32_t> bos = {1};
  EXPECT_FALSE(one.Take(bos).has_value());
}

}  // namespace
}  // namespace pinfer::gpuworker
