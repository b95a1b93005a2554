// libFuzzer target for the tokenizer.json parser: any bytes must give a tokenizer or an error,
// never a crash, an exception or a runaway allocation; a tokenizer that loads must encode and
// decode. Seeds: corpus/tokenizer_json.
#include <cstddef>
#include <cstdint>
#include <string>

#include "shared/tokenizer/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  auto tok = pinfer::ParseTokenizerJson(json, "fuzz");
  if (!tok.ok()) return 0;
  auto ids = (*tok)->Encode("Hi there! 123 \xF0\x9F\x9A\x80\n\n <sep>");
  if (!ids.ok()) __builtin_trap();
  (void)(*tok)->Decode(*ids);
  for (int32_t id = -1; id <= (*tok)->vocab_size(); ++id) (void)(*tok)->TokenBytes(id);
  return 0;
}
