// The gpu-worker's scheduler with a scripted compute backend (no GPU, no gRPC): which requests
// take the backend's own greedy pick (ComputeBackend::picks_greedy, the CUDA backend's pick on
// the GPU) and which get the logits and the sampler, that the emitted tokens and
// log-probabilities are the ones each path defines, and that concurrent streams (also under TSan,
// scripts/test.sh) keep to their own.
//
// The backend's logits for a step peak at one token that depends on the fed token and its
// position, so the greedy chain is known in advance; its pick deliberately reports a
// log-probability no sampler computes (-0.125), so that the test can tell whose value came out.
#include "gpu-worker/scheduler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gpu-worker/backend.h"
#include "gtest/gtest.h"
#include "shared/engine/sampler.h"
#include "shared/model/model.h"

namespace pinfer::gpuworker {
namespace {

constexpr float kPickLogprob = -0.125f;

class ScriptedBackend : public ComputeBackend {
 public:
  ScriptedBackend(int vocab, bool picks) : vocab_(vocab), picks_(picks) {}

  // The token each step's logits peak at.
  static int32_t Target(int32_t token, int pos, int vocab) {
    return static_cast<int32_t>((static_cast<int64_t>(token) * 7 + pos * 3 + 11) % vocab);
  }

  std::string name() const override { return "scripted"; }
  absl::StatusOr<int> AcquireSlot(int) override { return next_slot_++; }
  void ReleaseSlot(int) override {}
  absl::Status Forward(int, std::span<const int32_t> tokens, int pos0, float* logits) override {
    if (logits != nullptr) {
      Fill(tokens.back(), pos0 + static_cast<int>(tokens.size()) - 1, logits);
    }
    return absl::OkStatus();
  }
  absl::Status DecodeBatch(std::span<const DecodeItem> items) override {
    for (const DecodeItem& it : items) {
      if (it.greedy != nullptr) {
        EXPECT_TRUE(picks_) << "a pick asked of a backend that does not pick";
        EXPECT_EQ(it.logits, nullptr);
        picked_steps += 1;
        *it.greedy = {Target(it.token, it.pos, vocab_), kPickLogprob};
      } else {
        EXPECT_NE(it.logits, nullptr);
        logits_steps += 1;
        Fill(it.token, it.pos, it.logits);
      }
    }
    return absl::OkStatus();
  }
  bool picks_greedy() const override { return picks_; }
  uint64_t ffn_bytes() const override { return 0; }
  uint64_t dense_bytes() const override { return 0; }
  uint64_t ffn_neurons() const override { return 0; }
  BackendStats TakeStats() override { return {}; }

  std::atomic<int> picked_steps{0}, logits_steps{0};

 private:
  void Fill(int32_t token, int pos, float* logits) const {
    const int32_t peak = Target(token, pos, vocab_);
    for (int j = 0; j < vocab_; ++j) logits[j] = -0.01f * std::abs(j - peak);
  }

  const int vocab_;
  const bool picks_;
  int next_slot_ = 0;
};

class SchedulerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = LoadModel(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
  }
  static void TearDownTestSuite() { delete model_; }

  // Runs one request to its end; the tokens it emitted.
  static std::vector<GeneratedToken> Run(ComputeBackend* backend, const SamplingParams& sampling,
                                         int max_new_tokens) {
    Scheduler scheduler(backend, *model_, SchedulerOptions{}, [] { return std::string(); }, {});
    SequenceOptions opts;
    opts.prompt = {1, 450, 1996};
    opts.gen.max_new_tokens = max_new_tokens;
    opts.gen.sampling = sampling;
    opts.gen.stop_at_eos = false;
    auto seq = scheduler.Submit(opts);
    EXPECT_TRUE(seq.ok()) << seq.status();
    std::vector<GeneratedToken> out;
    if (!seq.ok()) return out;
    for (bool final = false; !final;) {
      std::vector<SequenceEvent> events;
      if (!(*seq)->WaitEvents(&events, std::chrono::seconds(30))) {
        ADD_FAILURE() << "no event in 30 s";
        break;
      }
      for (SequenceEvent& e : events) {
        EXPECT_TRUE(e.status.ok()) << e.status;
        for (GeneratedToken& t : e.tokens) out.push_back(std::move(t));
        final = final || e.final;
      }
    }
    return out;
  }

  // The greedy chain the scripted logits define, from the prompt's last token.
  static std::vector<int32_t> Chain(int n) {
    std::vector<int32_t> ids;
    int32_t token = 1996;
    for (int pos = 2; static_cast<int>(ids.size()) < n; ++pos) {
      token = ScriptedBackend::Target(token, pos, model_->config.vocab_size);
      ids.push_back(token);
    }
    return ids;
  }

  static std::vector<int32_t> Ids(const std::vector<GeneratedToken>& tokens) {
    std::vector<int32_t> ids;
    for (const GeneratedToken& t : tokens) ids.push_back(t.id);
    return ids;
  }

  // The sampler's greedy log-probability for the step that feeds `token` at `pos`.
  static float SamplerLogprob(int32_t token, int pos) {
    std::vector<float> logits(model_->config.vocab_size);
    const int32_t peak = ScriptedBackend::Target(token, pos, model_->config.vocab_size);
    for (int j = 0; j < model_->config.vocab_size; ++j) logits[j] = -0.01f * std::abs(j - peak);
    float logprob = 0;
    Sampler(SamplingParams{}).Sample(logits, {}, &logprob);
    return logprob;
  }

  static Model* model_;
};
Model* SchedulerTest::model_ = nullptr;

TEST_F(SchedulerTest, GreedyRequestsTakeThePickingBackendsPick) {
  ScriptedBackend backend(model_->config.vocab_size, /*picks=*/true);
  std::vector<GeneratedToken> got = Run(&backend, SamplingParams{}, 6);
  EXPECT_EQ(Ids(got), Chain(6));
  ASSERT_EQ(got.size(), 6u);
  // The first token comes from the prompt's logits, through the sampler; the decode steps'
  // tokens and log-probabilities are the backend's.
  EXPECT_FLOAT_EQ(got[0].logprob, SamplerLogprob(1996, 2));
  EXPECT_NE(got[0].logprob, kPickLogprob);
  for (size_t i = 1; i < got.size(); ++i) EXPECT_EQ(got[i].logprob, kPickLogprob) << i;
  EXPECT_EQ(backend.picked_steps.load(), 5);
  EXPECT_EQ(backend.logits_steps.load(), 0);
}

TEST_F(SchedulerTest, SamplingAndPenalizedRequestsGetTheLogits) {
  SamplingParams sampled;
  sampled.temperature = 0.7f;
  sampled.top_k = 1;  // (so the chain is still the logits' peak)
  sampled.seed = 5;
  SamplingParams penalized;
  penalized.repetition_penalty = 1.3f;
  for (const SamplingParams& p : {sampled, penalized}) {
    ScriptedBackend backend(model_->config.vocab_size, /*picks=*/true);
    std::vector<GeneratedToken> got = Run(&backend, p, 5);
    EXPECT_EQ(Ids(got), Chain(5));
    for (const GeneratedToken& t : got) EXPECT_NE(t.logprob, kPickLogprob);
    EXPECT_EQ(backend.picked_steps.load(), 0);
    EXPECT_EQ(backend.logits_steps.load(), 4);
  }
}

TEST_F(SchedulerTest, GreedyRequestsOnABackendThatDoesNotPickUseTheSampler) {
  ScriptedBackend backend(model_->config.vocab_size, /*picks=*/false);
  std::vector<GeneratedToken> got = Run(&backend, SamplingParams{}, 5);
  const std::vector<int32_t> chain = Chain(5);
  EXPECT_EQ(Ids(got), chain);
  ASSERT_EQ(got.size(), 5u);
  int32_t fed = 1996;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_FLOAT_EQ(got[i].logprob, SamplerLogprob(fed, 2 + static_cast<int>(i))) << i;
    fed = chain[i];
  }
  EXPECT_EQ(backend.picked_steps.load(), 0);
  EXPECT_EQ(backend.logits_steps.load(), 4);
}

// Streams submitted from several threads at once, greedy and sampled, one of them cancelled: the
// scheduler batches their decode steps together, and every stream still gets its own chain (the
// scripted logits depend only on the fed token and its position). Also run under TSan.
TEST_F(SchedulerTest, ConcurrentStreamsEachGetTheirOwnChain) {
  ScriptedBackend backend(model_->config.vocab_size, /*picks=*/true);
  Scheduler scheduler(&backend, *model_, SchedulerOptions{}, [] { return std::string(); }, {});
  constexpr int kStreams = 6, kTokens = 24;
  std::vector<std::vector<int32_t>> got(kStreams);
  std::vector<std::thread> clients;
  for (int i = 0; i < kStreams; ++i) {
    clients.emplace_back([&, i] {
      SequenceOptions opts;
      opts.prompt = {1, 450, 1996};
      opts.gen.max_new_tokens = kTokens;
      opts.gen.stop_at_eos = false;
      if (i % 2 == 1) {
        opts.gen.sampling.temperature = 0.9f;
        opts.gen.sampling.top_k = 1;
        opts.gen.sampling.seed = i;
      }
      auto seq = scheduler.Submit(opts);
      ASSERT_TRUE(seq.ok()) << seq.status();
      for (bool final = false; !final;) {
        std::vector<SequenceEvent> events;
        if (!(*seq)->WaitEvents(&events, std::chrono::seconds(30))) {
          ADD_FAILURE() << "stream " << i << ": no event in 30 s";
          return;
        }
        for (SequenceEvent& e : events) {
          EXPECT_TRUE(e.status.ok()) << e.status;
          for (const GeneratedToken& t : e.tokens) got[i].push_back(t.id);
          final = final || e.final;
        }
        if (i == 0 && got[i].size() >= 3) {
          (*seq)->Cancel();  // nobody reads this stream's events any more
          return;
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  const std::vector<int32_t> chain = Chain(kTokens);
  EXPECT_GE(got[0].size(), 3u);
  EXPECT_TRUE(std::equal(got[0].begin(), got[0].end(), chain.begin()));
  for (int i = 1; i < kStreams; ++i) EXPECT_EQ(got[i], chain) << "stream " << i;
  EXPECT_GT(backend.picked_steps.load(), 0);
  EXPECT_GT(backend.logits_steps.load(), 0);
}

}  // namespace
}  // namespace pinfer::gpuworker
