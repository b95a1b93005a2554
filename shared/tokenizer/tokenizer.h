// Text <-> token ids. Two families are supported:
//  - Llama-2 style sentencepiece BPE with byte fallback (tokenizer.model, or a GGUF `llama` vocab),
//    run by Debian's libsentencepiece;
//  - Llama-3 style byte-level BPE (tokenizer.json, or a GGUF `gpt2` vocab with merges), with the
//    pre-tokenizer regex run by RE2.
// Decoding is per token into raw bytes; StreamingDetokenizer turns those bytes into text that never
// ends in half a UTF-8 character.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/status/statusor.h"

namespace pinfer {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Encodes text without BOS/EOS.
  virtual absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const = 0;
  // The raw bytes a token stands for in running text (control tokens give ""). For sentencepiece
  // the word-start marker becomes a space, so concatenating pieces reproduces the text with the
  // dummy prefix space.
  virtual std::string TokenBytes(int32_t id) const = 0;
  virtual int vocab_size() const = 0;
  virtual bool IsControl(int32_t id) const = 0;
  // True when Encode adds a dummy leading space (sentencepiece add_dummy_prefix), which Decode of
  // a whole prompt strips again.
  virtual bool adds_dummy_prefix() const { return false; }

  // Decodes a sequence; strips the dummy prefix space when `strip_dummy_prefix`.
  std::string Decode(const std::vector<int32_t>& ids, bool strip_dummy_prefix = true) const;
};

// Sentencepiece from a serialized ModelProto (the bytes of tokenizer.model).
absl::StatusOr<std::unique_ptr<Tokenizer>> NewSentencePieceTokenizer(absl::string_view model_proto);

// Sentencepiece-style vocabulary given as arrays (GGUF `tokenizer.ggml.model = llama`).
// types: GGUF token types (1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte).
absl::StatusOr<std::unique_ptr<Tokenizer>> NewSentencePieceTokenizerFromVocab(
    const std::vector<std::string>& tokens, const std::vector<float>& scores,
    const std::vector<int32_t>& types, bool add_dummy_prefix = true);

// Byte-level BPE (GGUF `tokenizer.ggml.model = gpt2`, or tokenizer.json with model.type BPE).
// `pre_tokenizer` names the split regex: "llama-bpe" (Llama-3) or "gpt2".
absl::StatusOr<std::unique_ptr<Tokenizer>> NewByteLevelBpeTokenizer(
    const std::vector<std::string>& tokens, const std::vector<std::string>& merges,
    const std::vector<int32_t>& types, absl::string_view pre_tokenizer);

// Loads tokenizer.model (preferred) or tokenizer.json from a Hugging Face directory.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHuggingFaceTokenizer(const std::string& dir);

// Accumulates token bytes and releases only complete UTF-8 sequences.
class StreamingDetokenizer {
 public:
  explicit StreamingDetokenizer(const Tokenizer& tok) : tok_(tok) {}
  // Returns the text that became complete with this token (possibly empty).
  std::string Push(int32_t id);
  // Returns what is left (invalid trailing bytes are replaced by U+FFFD).
  std::string Flush();

 private:
  const Tokenizer& tok_;
  std::string pending_;
};

}  // namespace pinfer
