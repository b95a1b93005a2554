// GGUF models and vocabularies against llama.cpp's own outputs: stories260K's greedy
// continuations (models/stories260K/reference.json) and the token ids of the Llama-2
// sentencepiece and Llama-3 byte-level BPE vocabularies (models/*-vocab/tokenizer-vectors.json).
#include <fstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/generator.h"
#include "shared/engine/ops.h"
#include "shared/model/gguf.h"
#include "shared/model/model.h"

namespace pinfer {
namespace {

const std::string kModels = PINFER_MODELS_DIR;

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(Stories260kTest, ConfigIsRead) {
  auto m = LoadModel(kModels + "/stories260K/stories260K.gguf");
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config;
  EXPECT_EQ((*m)->format, "gguf");
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.ffn_size, 172);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_context, 128);
  EXPECT_EQ(c.activation, Activation::kSilu);
  EXPECT_TRUE(c.rope_interleaved);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.bos_id, 1);
  EXPECT_EQ(c.eos_id, 2);
  ASSERT_NE((*m)->tokenizer, nullptr);
  EXPECT_EQ((*m)->tokenizer->vocab_size(), 512);
}

// llama.cpp's completion tool prints the prompt, then the continuation, then a blank line.
TEST(Stories260kTest, GreedyContinuationsMatchLlamaCpp) {
  auto m = LoadModel(kModels + "/stories260K/stories260K.gguf");
  ASSERT_TRUE(m.ok()) << m.status();
  const Model& model = **m;
  auto ref = ReadJson(kModels + "/stories260K/reference.json");
  ASSERT_EQ(ref["references"].size(), 4u);
  ThreadPool pool(2);
  auto simd = NewSimdOps(&pool);
  auto plain = NewReferenceOps();
  for (const CpuOps* ops : {simd.get(), plain.get()}) {
    Transformer transformer(model, *ops);
    for (const auto& r : ref["references"]) {
      const std::string prompt = r["prompt"];
      SCOPED_TRACE(prompt + " / " + std::string(ops->name()));
      auto ids = model.tokenizer->Encode(prompt);
      ASSERT_TRUE(ids.ok()) << ids.status();
      std::vector<int32_t> input = {model.config.bos_id};
      input.insert(input.end(), ids->begin(), ids->end());
      GenerateOptions opts;
      opts.max_new_tokens = r["n_predict"];
      opts.stop_at_eos = false;
      auto result = Generate(transformer, *model.tokenizer, input, opts, nullptr);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->ids.size(), 64u);
      EXPECT_EQ(result->text + "\n\n", r["greedy_continuation"].get<std::string>());
    }
  }
}

void ExpectVocabMatches(const std::string& gguf, const std::string& vectors) {
  auto file = GgufFile::Open(gguf);
  ASSERT_TRUE(file.ok()) << file.status();
  auto tok = LoadGgufTokenizer(**file);
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto bos = (*file)->GetU32("tokenizer.ggml.bos_token_id");
  ASSERT_TRUE(bos.ok());
  auto cases = ReadJson(vectors);
  ASSERT_GE(cases.size(), 60u);
  for (const auto& c : cases) {
    const std::string text = c["text"];
    SCOPED_TRACE(text);
    auto ids = (*tok)->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    std::vector<int32_t> got = {static_cast<int32_t>(*bos)};
    got.insert(got.end(), ids->begin(), ids->end());
    EXPECT_EQ(got, c["ids_with_bos"].get<std::vector<int32_t>>());
  }
}

TEST(GgufVocabTest, Llama2SentencePieceIdsMatchLlamaCpp) {
  ExpectVocabMatches(kModels + "/llama2-vocab/llama-2-tiny-random.gguf",
                     kModels + "/llama2-vocab/tokenizer-vectors.json");
}

TEST(GgufVocabTest, Llama3ByteLevelBpeIdsMatchLlamaCpp) {
  ExpectVocabMatches(kModels + "/llama3-vocab/ggml-vocab-llama-bpe.gguf",
                     kModels + "/llama3-vocab/tokenizer-vectors.json");
}

}  // namespace
}  // namespace pinfer
