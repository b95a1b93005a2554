// The Llama-3 byte-level BPE tokenizer against llama.cpp: models/llama3-vocab holds llama.cpp's
// vocabulary GGUF and llama.cpp's token ids (with BOS) for 69 strings, including llama.cpp's own
// tokenizer test inputs (whitespace runs, digits, contractions, emoji, CJK, Khmer). The same
// vocabulary is also loaded through a tokenizer.json written from the GGUF arrays, and decoding
// (whole and streamed) must give the input text back.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/model/gguf.h"
#include "shared/tokenizer/bpe_tokenizer.h"
#include "shared/tokenizer/tokenizer.h"

namespace pinfer {
namespace {

using ::testing::Each;
using ::testing::Lt;

const std::string kVocabDir = std::string(PINFER_MODELS_DIR) + "/llama3-vocab";

struct Vector {
  std::string text;
  std::vector<int32_t> ids_with_bos;
};

// True when s is well-formed UTF-8 (checked here independently of the tokenizer's own code).
bool IsValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (int j = 1; j < len; ++j) {
      if ((static_cast<unsigned char>(s[i + j]) & 0xc0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

class Llama3VocabTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto file = GgufFile::Open(kVocabDir + "/ggml-vocab-llama-bpe.gguf");
    ASSERT_TRUE(file.ok()) << file.status();
    gguf_ = file->release();
    auto tok = LoadGgufTokenizer(*gguf_);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = tok->release();

    std::ifstream in(kVocabDir + "/tokenizer-vectors.json");
    std::stringstream ss;
    ss << in.rdbuf();
    nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(j.is_array());
    vectors_ = new std::vector<Vector>;
    for (const auto& e : j) {
      vectors_->push_back(
          {e["text"].get<std::string>(), e["ids_with_bos"].get<std::vector<int32_t>>()});
    }
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete gguf_;
    delete vectors_;
  }

  // Encodes each vector's text with BOS prepended and compares with llama.cpp's ids.
  static void ExpectLlamaCppIds(const Tokenizer& tok) {
    auto bos = gguf_->GetI32("tokenizer.ggml.bos_token_id");
    ASSERT_TRUE(bos.ok()) << bos.status();
    for (const Vector& v : *vectors_) {
      auto ids = tok.Encode(v.text);
      ASSERT_TRUE(ids.ok()) << ids.status();
      std::vector<int32_t> with_bos = {*bos};
      with_bos.insert(with_bos.end(), ids->begin(), ids->end());
      EXPECT_EQ(with_bos, v.ids_with_bos) << "text: " << nlohmann::json(v.text).dump();
    }
  }

  static GgufFile* gguf_;
  static Tokenizer* tokenizer_;
  static std::vector<Vector>* vectors_;
};

GgufFile* Llama3VocabTest::gguf_ = nullptr;
Tokenizer* Llama3VocabTest::tokenizer_ = nullptr;
std::vector<Vector>* Llama3VocabTest::vectors_ = nullptr;

TEST_F(Llama3VocabTest, VocabularyShape) {
  ASSERT_EQ(vectors_->size(), 69u);
  EXPECT_EQ(tokenizer_->vocab_size(), 128256);
  // <|begin_of_text|> and <|eot_id|> are control tokens that stand for no text.
  EXPECT_TRUE(tokenizer_->IsControl(128000));
  EXPECT_TRUE(tokenizer_->IsControl(128009));
  EXPECT_EQ(tokenizer_->TokenBytes(128000), "");
  EXPECT_FALSE(tokenizer_->IsControl(9906));
}

TEST_F(Llama3VocabTest, IdsEqualLlamaCpp) { ExpectLlamaCppIds(*tokenizer_); }

TEST_F(Llama3VocabTest, DecodeReproducesText) {
  for (const Vector& v : *vectors_) {
    auto ids = tokenizer_->Encode(v.text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(tokenizer_->Decode(*ids), v.text);
    // llama.cpp's ids (without BOS, which decodes to nothing) decode to the text as well.
    EXPECT_EQ(tokenizer_->Decode(v.ids_with_bos), v.text);
  }
}

TEST_F(Llama3VocabTest, StreamingNeverSplitsACharacter) {
  int split_characters = 0;  // tokens whose bytes end inside a multi-byte character
  for (const Vector& v : *vectors_) {
    StreamingDetokenizer detok(*tokenizer_);
    std::string streamed;
    for (int32_t id : v.ids_with_bos) {
      if (!IsValidUtf8(tokenizer_->TokenBytes(id))) ++split_characters;
      const std::string piece = detok.Push(id);
      EXPECT_TRUE(IsValidUtf8(piece)) << "text: " << nlohmann::json(v.text).dump();
      streamed += piece;
    }
    streamed += detok.Flush();
    EXPECT_EQ(streamed, v.text);
  }
  // The vectors do exercise the case: emoji, CJK and Khmer are cut inside characters.
  EXPECT_GT(split_characters, 10);
}

TEST_F(Llama3VocabTest, ControlTokenTextIsNotParsed) {
  // As in llama.cpp's tokenizer tests (parse_special = false): the text of a control token is
  // just text, so user input cannot produce <|eot_id|> or <|begin_of_text|>.
  const std::string text = "<|begin_of_text|>Hi<|eot_id|>";
  auto ids = tokenizer_->Encode(text);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, Each(Lt(128000)));
  EXPECT_EQ(tokenizer_->Decode(*ids), text);
}

TEST_F(Llama3VocabTest, TokenizerJsonFromTheSameVocabularyMatchesLlamaCpp) {
  // Writes the GGUF vocabulary as a Llama-3 tokenizer.json: normal tokens in model.vocab,
  // control tokens as special added_tokens, merges as [a, b] pairs.
  auto tokens = gguf_->GetStringArray("tokenizer.ggml.tokens");
  auto types = gguf_->GetI32Array("tokenizer.ggml.token_type");
  auto merges = gguf_->GetStringArray("tokenizer.ggml.merges");
  ASSERT_TRUE(tokens.ok() && types.ok() && merges.ok());
  nlohmann::json vocab = nlohmann::json::object();
  nlohmann::json added = nlohmann::json::array();
  for (size_t i = 0; i < tokens->size(); ++i) {
    if ((*types)[i] == 1) {
      vocab[(*tokens)[i]] = i;
    } else {
      ASSERT_EQ((*types)[i], 3);
      added.push_back({{"id", i}, {"content", (*tokens)[i]}, {"special", true}});
    }
  }
  nlohmann::json merge_pairs = nlohmann::json::array();
  for (const std::string& m : *merges) {
    const size_t space = m.find(' ', 1);
    merge_pairs.push_back({m.substr(0, space), m.substr(space + 1)});
  }
  nlohmann::json j = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern",
            {{"Regex",
              "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
              "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"},
           {"add_prefix_space", false},
           {"trim_offsets", true},
           {"use_regex", false}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"ignore_merges", true},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", merge_pairs}}}};
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("pinfer_llama3_tokenizer_" + std::to_string(getpid()) + ".json"))
                               .string();
  std::ofstream(path) << j.dump();
  auto tok = LoadTokenizerJson(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 128256);
  ExpectLlamaCppIds(**tok);
}

}  // namespace
}  // namespace pinfer
