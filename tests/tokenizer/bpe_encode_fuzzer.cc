// libFuzzer target for byte-level BPE encoding with the bundled Llama-3 vocabulary: any input
// bytes must encode without a crash; well-formed UTF-8 must decode back to itself, whole and
// streamed token by token. Seeds: corpus/bpe_encode.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "shared/model/gguf.h"
#include "shared/tokenizer/tokenizer.h"

namespace {

bool IsValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    const int len = c < 0x80           ? 1
                    : (c >> 5) == 0x6  ? 2
                    : (c >> 4) == 0xe  ? 3
                    : (c >> 3) == 0x1e ? 4
                                       : 0;
    if (len == 0 || i + len > s.size()) return false;
    uint32_t v = len == 1 ? c : c & (0x7f >> len);
    for (int j = 1; j < len; ++j) {
      if ((static_cast<unsigned char>(s[i + j]) & 0xc0) != 0x80) return false;
      v = (v << 6) | (s[i + j] & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < kMin[len] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return false;
    i += len;
  }
  return true;
}

const pinfer::Tokenizer& Llama3() {
  static const pinfer::Tokenizer* tok = [] {
    auto file = pinfer::GgufFile::Open(std::string(PINFER_MODELS_DIR) +
                                       "/llama3-vocab/ggml-vocab-llama-bpe.gguf");
    if (!file.ok()) __builtin_trap();
    auto t = pinfer::LoadGgufTokenizer(**file);
    if (!t.ok()) __builtin_trap();
    return t->release();
  }();
  return *tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const pinfer::Tokenizer& tok = Llama3();
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto ids = tok.Encode(text);
  if (!ids.ok()) __builtin_trap();
  const std::string decoded = tok.Decode(*ids);
  // Invalid bytes become U+FFFD, so the decoded text is always well-formed.
  if (!IsValidUtf8(decoded)) __builtin_trap();
  if (IsValidUtf8(text) && decoded != text) __builtin_trap();
  pinfer::StreamingDetokenizer detok(tok);
  std::string streamed;
  for (int32_t id : *ids) {
    const std::string piece = detok.Push(id);
    if (!IsValidUtf8(piece)) __builtin_trap();
    streamed += piece;
  }
  streamed += detok.Flush();
  if (streamed != decoded) __builtin_trap();
  return 0;
}
