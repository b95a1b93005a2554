// Shared parts of the tokenizers: whole-sequence decoding and UTF-8-safe streaming.
#include "shared/tokenizer/tokenizer.h"

namespace pinfer {
namespace {

// Length of the UTF-8 sequence introduced by lead byte c (0 for a continuation/invalid byte).
int Utf8SeqLen(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xe0) == 0xc0) return 2;
  if ((c & 0xf0) == 0xe0) return 3;
  if ((c & 0xf8) == 0xf0) return 4;
  return 0;
}

}  // namespace

std::string Tokenizer::Decode(const std::vector<int32_t>& ids, bool strip_dummy_prefix) const {
  std::string out;
  for (int32_t id : ids) out += TokenBytes(id);
  if (strip_dummy_prefix && adds_dummy_prefix() && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

std::string StreamingDetokenizer::Push(int32_t id) {
  pending_ += tok_.TokenBytes(id);
  // Find the longest prefix made of complete sequences; invalid bytes are passed through as
  // U+FFFD so that one bad byte cannot hold the stream back forever.
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    int len = Utf8SeqLen(static_cast<unsigned char>(pending_[i]));
    if (len == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    if (i + len > pending_.size()) {
      // Incomplete: keep waiting only if the bytes so far are valid continuations.
      bool valid = true;
      for (size_t j = i + 1; j < pending_.size(); ++j) {
        if ((static_cast<unsigned char>(pending_[j]) & 0xc0) != 0x80) valid = false;
      }
      if (valid) break;
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    bool valid = true;
    for (int j = 1; j < len; ++j) {
      if ((static_cast<unsigned char>(pending_[i + j]) & 0xc0) != 0x80) valid = false;
    }
    if (!valid) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    out.append(pending_, i, len);
    i += len;
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamingDetokenizer::Flush() {
  std::string out;
  for (size_t i = 0; i < pending_.size(); ++i) out += "\xEF\xBF\xBD";
  pending_.clear();
  return out;
}

}  // namespace pinfer
