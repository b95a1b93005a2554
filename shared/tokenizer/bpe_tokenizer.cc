// PLACEHOLDER (being written): byte-level BPE.
#include "shared/tokenizer/tokenizer.h"
namespace pinfer {
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerJson(const std::string& path) {
  return absl::UnimplementedError("tokenizer.json not supported yet");
}
}  // namespace pinfer
