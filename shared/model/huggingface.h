// The parsers behind LoadHuggingFaceModel, exposed for tests and fuzzers: config.json of a
// LlamaForCausalLM and the safetensors container.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "shared/model/config.h"
#include "shared/model/tensor.h"
#include "shared/util/mapped_file.h"

namespace pinfer {

// Parses config.json text; InvalidArgument "config.json: ..." naming the problem.
absl::StatusOr<ModelConfig> ParseHuggingFaceConfig(absl::string_view text);

// Parses a safetensors file held in `data` (which must outlive the views) and adds its tensors to
// `out`; `name` prefixes error messages. A tensor already in `out` (from another shard) is an
// error.
absl::Status ParseSafetensorsBytes(const uint8_t* data, size_t size, const std::string& name,
                                   std::map<std::string, TensorView>* out);
absl::Status ParseSafetensors(std::shared_ptr<MappedFile> file,
                              std::map<std::string, TensorView>* out);

}  // namespace pinfer
