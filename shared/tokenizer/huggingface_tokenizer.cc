// Tokenizer of a Hugging Face directory: tokenizer.model (sentencepiece) when present, otherwise
// tokenizer.json with a byte-level BPE model (Llama-3 style).
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "shared/tokenizer/tokenizer.h"
#include "shared/util/mapped_file.h"
#include "shared/util/status_macros.h"

namespace pinfer {

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerJson(const std::string& path);

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHuggingFaceTokenizer(const std::string& dir) {
  namespace fs = std::filesystem;
  fs::path spm = fs::path(dir) / "tokenizer.model";
  if (fs::exists(spm)) {
    ASSIGN_OR_RETURN(std::string proto, ReadFileToString(spm.string()));
    return NewSentencePieceTokenizer(proto);
  }
  fs::path json = fs::path(dir) / "tokenizer.json";
  if (fs::exists(json)) return LoadTokenizerJson(json.string());
  return absl::NotFoundError(absl::StrCat(dir, ": no tokenizer.model or tokenizer.json"));
}

}  // namespace pinfer
