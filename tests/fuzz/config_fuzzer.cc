// Fuzzes the parser of a Hugging Face config.json: any accepted configuration must be valid.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "shared/model/huggingface.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto c = pinfer::ParseHuggingFaceConfig(std::string(reinterpret_cast<const char*>(data), size));
  if (c.ok() && !c->Validate().ok()) std::abort();
  return 0;
}
