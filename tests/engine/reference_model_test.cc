// relu-llama-tiny against the transformers library's own fp32 outputs (models/relu-llama-tiny/
// reference.json): prompt token ids, last-position logits, 48 greedy tokens for all 12 prompts,
// and held-out perplexity. Also checks that the reference operators and the optimised ones give
// identical greedy tokens, and that a sliding window (Mistral's) is applied the same way on every
// path through the forward pass.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <span>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/generator.h"
#include "shared/engine/ops.h"
#include "shared/engine/perplexity.h"
#include "shared/model/model.h"

namespace pinfer {
namespace {

const std::string kModelDir = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";

class ReluLlamaTinyTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = LoadModel(kModelDir);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
    std::ifstream in(kModelDir + "/reference.json");
    reference_ = new nlohmann::json(nlohmann::json::parse(in));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete reference_;
  }

  static std::vector<int32_t> PromptIds(const std::string& text) {
    auto ids = model_->tokenizer->Encode(text);
    EXPECT_TRUE(ids.ok());
    std::vector<int32_t> out = {model_->config.bos_id};
    out.insert(out.end(), ids->begin(), ids->end());
    return out;
  }

  static Model* model_;
  static nlohmann::json* reference_;
};
Model* ReluLlamaTinyTest::model_ = nullptr;
nlohmann::json* ReluLlamaTinyTest::reference_ = nullptr;

TEST_F(ReluLlamaTinyTest, ConfigIsRead) {
  const ModelConfig& c = model_->config;
  EXPECT_EQ(c.activation, Activation::kRelu);
  EXPECT_EQ(c.n_heads, 6);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 4096);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.f);  // given inside rope_parameters
  EXPECT_FALSE(c.tie_embeddings);
}

TEST_F(ReluLlamaTinyTest, PromptIdsLogitsAndGreedyTokensMatchTransformers) {
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  Transformer transformer(*model_, *ops);
  ASSERT_EQ((*reference_)["prompts"].size(), 12u);
  for (const auto& p : (*reference_)["prompts"]) {
    const std::string prompt = p["prompt"];
    SCOPED_TRACE(prompt);
    std::vector<int32_t> ids = PromptIds(prompt);
    EXPECT_EQ(ids, p["input_ids"].get<std::vector<int32_t>>());

    GenerateOptions opts;
    opts.max_new_tokens = 48;
    opts.stop_at_eos = false;  // the reference does not stop at EOS
    std::vector<float> logits;
    auto result = Generate(transformer, *model_->tokenizer, ids, opts, nullptr, &logits);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->ids, p["greedy_ids"].get<std::vector<int32_t>>());

    auto want = p["last_logits"].get<std::vector<float>>();
    ASSERT_EQ(logits.size(), want.size());
    float max_abs = 0, max_err = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_abs = std::max(max_abs, std::fabs(want[i]));
      max_err = std::max(max_err, std::fabs(logits[i] - want[i]));
    }
    EXPECT_LE(max_err, 1e-3f * max_abs);
  }
}

TEST_F(ReluLlamaTinyTest, ReferenceAndOptimisedPathsGiveIdenticalGreedyTokens) {
  ThreadPool pool(2);
  auto simd = NewSimdOps(&pool);
  auto ref = NewReferenceOps();
  Transformer fast(*model_, *simd), plain(*model_, *ref);
  GenerateOptions opts;
  opts.max_new_tokens = 24;
  opts.stop_at_eos = false;
  for (int i : {0, 5, 11}) {
    std::vector<int32_t> ids = (*reference_)["prompts"][i]["input_ids"];
    auto a = Generate(fast, *model_->tokenizer, ids, opts, nullptr);
    auto b = Generate(plain, *model_->tokenizer, ids, opts, nullptr);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->ids, b->ids);
  }
}

// max |a - b| / max |b| over [first, last) rows of `vocab` logits.
float RowsError(const std::vector<float>& a, const std::vector<float>& b, int vocab, int first,
                int last) {
  float max_abs = 0, max_err = 0;
  for (size_t i = static_cast<size_t>(first) * vocab; i < static_cast<size_t>(last) * vocab; ++i) {
    max_abs = std::max(max_abs, std::fabs(b[i]));
    max_err = std::max(max_err, std::fabs(a[i] - b[i]));
  }
  return max_err / max_abs;
}

// Mistral's sliding window (here put on relu-llama-tiny's weights): a whole-sequence prefill,
// prefill in chunks, one-token decode steps and ForwardDecodeBatch must attend to the same keys,
// so give the same logits; positions before the window's length are unchanged by it, later ones
// change. (tests/engine/model_family_test.py checks the windowed model against NumPy.)
TEST_F(ReluLlamaTinyTest, SlidingWindowGivesTheSameLogitsOnEveryPath) {
  constexpr int kWindow = 8, kLen = 30, kPrefill = 11;
  struct Restore {
    ~Restore() { model_->config.sliding_window = 0; }
  } restore;
  const int V = model_->config.vocab_size;
  std::vector<int32_t> ids = (*reference_)["prompts"][0]["input_ids"];
  const std::vector<int32_t> more = (*reference_)["prompts"][0]["greedy_ids"];
  ids.insert(ids.end(), more.begin(), more.end());
  ASSERT_GE(ids.size(), static_cast<size_t>(kLen));
  ids.resize(kLen);
  ThreadPool pool(2);
  auto simd = NewSimdOps(&pool);
  auto ref = NewReferenceOps();
  Transformer fast(*model_, *simd), plain(*model_, *ref);
  auto whole = [&](Transformer& t) {
    KvCache cache(model_->config, kLen);
    std::vector<float> logits(static_cast<size_t>(kLen) * V);
    EXPECT_TRUE(t.Forward(ids, 0, &cache, LogitsMode::kAll, logits.data()).ok());
    return logits;
  };
  const std::vector<float> full = whole(fast);
  model_->config.sliding_window = kWindow;
  const std::vector<float> want = whole(fast);
  EXPECT_LE(RowsError(whole(plain), want, V, 0, kLen), 1e-4f);
  // The window changes nothing until a query has more than kWindow keys, then a clear margin.
  EXPECT_EQ(RowsError(want, full, V, 0, kWindow), 0.f);
  EXPECT_GT(RowsError(want, full, V, kWindow, kLen), 0.05f);

  // Prefill in chunks of 5 (as a prefix-cache hit computes only the rest of a prompt).
  std::vector<float> got(static_cast<size_t>(kLen) * V);
  KvCache chunked(model_->config, kLen);
  for (int pos = 0; pos < kLen; pos += 5) {
    const int n = std::min(5, kLen - pos);
    ASSERT_TRUE(fast.Forward(std::span<const int32_t>(ids).subspan(pos, n), pos, &chunked,
                             LogitsMode::kAll, &got[static_cast<size_t>(pos) * V])
                    .ok());
  }
  EXPECT_LE(RowsError(got, want, V, 0, kLen), 1e-5f);

  // A prompt prefill, then one token at a time: with Forward, and with ForwardDecodeBatch for two
  // sequences at once (the second a step behind, so the two attend over different ranges).
  KvCache steps(model_->config, kLen), a(model_->config, kLen), b(model_->config, kLen);
  std::vector<float> last(V);
  for (KvCache* c : {&steps, &a, &b}) {
    ASSERT_TRUE(fast.Forward(std::span<const int32_t>(ids).first(kPrefill), 0, c, LogitsMode::kLast,
                             last.data())
                    .ok());
  }
  std::fill(got.begin(), got.end(), 0.f);
  std::vector<float> batched(static_cast<size_t>(kLen) * V);
  for (int pos = kPrefill; pos < kLen; ++pos) {
    ASSERT_TRUE(fast.Forward({&ids[pos], 1}, pos, &steps, LogitsMode::kLast,
                             &got[static_cast<size_t>(pos) * V])
                    .ok());
    std::vector<Transformer::DecodeStep> batch = {
        {ids[pos], pos, &a, &batched[static_cast<size_t>(pos) * V]}};
    if (pos > kPrefill) batch.push_back({ids[pos - 1], pos - 1, &b, nullptr});
    ASSERT_TRUE(fast.ForwardDecodeBatch(batch).ok());
  }
  EXPECT_LE(RowsError(got, want, V, kPrefill, kLen), 1e-5f);
  EXPECT_LE(RowsError(batched, want, V, kPrefill, kLen), 1e-5f);
}

TEST_F(ReluLlamaTinyTest, HeldOutPerplexityMatchesTransformers) {
  std::ifstream in(kModelDir + "/heldout-tokens.u32", std::ios::binary);
  std::vector<int32_t> tokens;
  uint32_t v;
  while (in.read(reinterpret_cast<char*>(&v), 4)) tokens.push_back(static_cast<int32_t>(v));
  ASSERT_EQ(tokens.size(), 65024u);
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  Transformer transformer(*model_, *ops);
  auto r = ComputePerplexity(transformer, tokens, 512);
  ASSERT_TRUE(r.ok()) << r.status();
  const double want = (*reference_)["heldout_ppl_512"];
  EXPECT_EQ(r->tokens_scored, (*reference_)["heldout_tokens"].get<int64_t>());
  EXPECT_NEAR(r->perplexity, want, 0.002 * want);
}

}  // namespace
}  // namespace pinfer
