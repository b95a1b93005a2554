// The parts of the byte-level BPE tokenizer (bpe_tokenizer.cc) that other code and the tests use
// beyond the Tokenizer interface: the tokenizer.json loader and the pre-tokenizer split on its own,
// so that the split can be tested apart from any vocabulary.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "shared/tokenizer/tokenizer.h"

namespace pinfer {

// Loads a Hugging Face tokenizer.json whose model is byte-level BPE (model.type "BPE" with a
// ByteLevel pre-tokenizer: Llama-3's Split regex + ByteLevel, or GPT-2's plain ByteLevel).
// Malformed or unsupported files give InvalidArgument naming the problem.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerJson(const std::string& path);
// The same from the file's bytes; `name` prefixes error messages (fuzzing, in-memory files).
absl::StatusOr<std::unique_ptr<Tokenizer>> ParseTokenizerJson(absl::string_view json,
                                                              const std::string& name);

// Splits `text` into the pre-tokens that BPE then merges independently. `pre_tokenizer` is
// "llama-bpe" (aliases "llama3", "llama-v3") or "gpt2". Invalid UTF-8 is first replaced by U+FFFD,
// as llama.cpp does.
absl::StatusOr<std::vector<std::string>> SplitPreTokens(absl::string_view text,
                                                        absl::string_view pre_tokenizer);

}  // namespace pinfer
