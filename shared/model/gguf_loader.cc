// PLACEHOLDER (being written): GGUF loading.
#include "shared/model/model.h"
namespace pinfer {
absl::StatusOr<std::unique_ptr<Model>> LoadGgufModel(const std::string& path) {
  return absl::UnimplementedError("GGUF not supported yet");
}
}  // namespace pinfer
