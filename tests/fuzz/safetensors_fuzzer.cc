// Fuzzes the safetensors parser: whatever it accepts must lie inside the input.
#include <cstdint>
#include <map>
#include <string>

#include "shared/model/huggingface.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, pinfer::TensorView> tensors;
  if (!pinfer::ParseSafetensorsBytes(data, size, "fuzz.safetensors", &tensors).ok()) return 0;
  volatile uint64_t sink = 0;
  for (const auto& [name, t] : tensors) {
    const size_t n = t.nbytes();
    const uint8_t* p = static_cast<const uint8_t*>(t.data);
    for (size_t i = 0; i < n; i += 61) sink = sink + p[i];
    if (n > 0) sink = sink + p[n - 1];
  }
  return 0;
}
