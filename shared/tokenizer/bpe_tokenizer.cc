// Byte-level BPE, the tokenizer of Llama-3, Qwen2 (and GPT-2): text is cut into pre-tokens by a
// regex, each pre-token's bytes are written as GPT-2's printable "byte characters", and ranked
// merges join adjacent symbols until no merge applies. The vocabulary comes from a GGUF `gpt2`
// vocab (tokens, merges, types, `tokenizer.ggml.pre`) or from a Hugging Face tokenizer.json.
//
// The reference is llama.cpp (its tokenizer test vectors are bundled in models/llama3-vocab), so
// the corner cases follow it:
//  - The pre-tokenizer regexes use Unicode classes, run by RE2. RE2 has no lookahead, so the
//    `\s+(?!\S)` alternative is matched as `\s+` and then gives its last whitespace character
//    back when more text follows (exactly what backtracking does, and what llama.cpp's
//    hand-written splitter does). `\s` means Unicode White_Space (llama.cpp's table, e.g. U+00A0),
//    not RE2's ASCII-only `\s`; `(?i:'s|...)` is spelled with ASCII classes because RE2's
//    case folding would also accept e.g. U+017F for 's'.
//  - Control tokens (GGUF type 3, e.g. <|begin_of_text|>, <|eot_id|>) in the input are NOT parsed:
//    their text is tokenized like any other text, as llama.cpp does with parse_special=false
//    (its tokenizer tests) and so that user text cannot inject chat-template markers. BOS is
//    added by the caller. User-defined tokens (type 4) are matched in the raw text first, as in
//    llama.cpp and Hugging Face.
//  - With "llama-bpe" a pre-token that is itself a vocabulary entry is taken whole without
//    merging (Hugging Face's `ignore_merges`, on for Llama-3).
//  - Invalid UTF-8 in the input is replaced by U+FFFD before splitting, as llama.cpp does.
#include "shared/tokenizer/bpe_tokenizer.h"

#include <re2/re2.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <queue>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "shared/util/mapped_file.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

// GGUF token types (llama_token_type).
constexpr int32_t kTypeNormal = 1;
constexpr int32_t kTypeControl = 3;
constexpr int32_t kTypeUserDefined = 4;

constexpr char kReplacementChar[] = "\xEF\xBF\xBD";  // U+FFFD

// ---------------------------------------------------------------------------------------------
// UTF-8

// Decodes the code point at s[pos]. Returns its byte length, or 0 when the bytes there are not
// well-formed UTF-8 (stray continuation byte, truncated sequence, overlong form, surrogate,
// beyond U+10FFFF): RE2 would not match those bytes with any class.
int DecodeUtf8(absl::string_view s, size_t pos, uint32_t* cpt) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t c = byte(pos);
  if (c < 0x80) {
    *cpt = c;
    return 1;
  }
  int len;
  uint32_t v;
  if ((c & 0xe0) == 0xc0) {
    len = 2;
    v = c & 0x1f;
  } else if ((c & 0xf0) == 0xe0) {
    len = 3;
    v = c & 0x0f;
  } else if ((c & 0xf8) == 0xf0) {
    len = 4;
    v = c & 0x07;
  } else {
    return 0;
  }
  if (pos + len > s.size()) return 0;
  for (int i = 1; i < len; ++i) {
    if ((byte(pos + i) & 0xc0) != 0x80) return 0;
    v = (v << 6) | (byte(pos + i) & 0x3f);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[len] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
  *cpt = v;
  return len;
}

void AppendUtf8(uint32_t cpt, std::string* out) {
  if (cpt < 0x80) {
    out->push_back(static_cast<char>(cpt));
  } else if (cpt < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cpt >> 6)));
    out->push_back(static_cast<char>(0x80 | (cpt & 0x3f)));
  } else if (cpt < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cpt >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cpt & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cpt >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cpt >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cpt & 0x3f)));
  }
}

// `text` with every byte that is not part of well-formed UTF-8 replaced by U+FFFD, or nullopt
// when it is already well-formed (the common case, which then costs no copy).
std::optional<std::string> SanitizeUtf8(absl::string_view text) {
  uint32_t cpt;
  size_t pos = 0;
  while (pos < text.size()) {
    int len = DecodeUtf8(text, pos, &cpt);
    if (len == 0) break;
    pos += len;
  }
  if (pos == text.size()) return std::nullopt;
  std::string out(text.substr(0, pos));
  while (pos < text.size()) {
    int len = DecodeUtf8(text, pos, &cpt);
    if (len == 0) {
      out += kReplacementChar;
      ++pos;
    } else {
      out.append(text.data() + pos, len);
      pos += len;
    }
  }
  return out;
}

// Unicode White_Space, the set llama.cpp's splitter (and Python's `re` `\s`) uses.
bool IsWhitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
         c == 0x3000;
}
// The same set as the inside of an RE2 character class.
#define PINFER_WS                                                                             \
  "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}" \
  "\\x{205F}\\x{3000}"

// ---------------------------------------------------------------------------------------------
// GPT-2's byte <-> character map: printable Latin-1 bytes stand for themselves, the other 68 bytes
// are shifted to U+0100.. in byte order, so every token is printable text (space is "Ġ").

class ByteMap {
 public:
  static const ByteMap& Get() {
    static const ByteMap* map = new ByteMap();
    return *map;
  }
  // The UTF-8 of the character standing for byte b.
  const std::string& Char(uint8_t b) const { return chars_[b]; }
  // The byte character `cpt` stands for, or -1.
  int Byte(uint32_t cpt) const { return cpt < bytes_.size() ? bytes_[cpt] : -1; }

 private:
  ByteMap() {
    bytes_.fill(-1);
    int shifted = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      const uint32_t cpt = printable ? b : 256 + shifted++;
      AppendUtf8(cpt, &chars_[b]);
      bytes_[cpt] = b;
    }
  }
  std::array<std::string, 256> chars_;
  std::array<int, 256 + 68> bytes_;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers

// kQwen2 is Llama-3's split with digits taken one at a time (`\p{N}` for `\p{N}{1,3}`).
enum class PreTokenizerKind { kLlama3, kQwen2, kGpt2 };

struct PreTokenizerSpec {
  PreTokenizerKind kind;
  bool ignore_merges;
};

// Names as in GGUF `tokenizer.ggml.pre`, grouped the way llama.cpp maps them to regexes.
absl::StatusOr<PreTokenizerSpec> FindPreTokenizer(absl::string_view name) {
  static constexpr absl::string_view kLlama3[] = {"llama-bpe", "llama3",  "llama-v3", "falcon3",
                                                  "falcon-h1", "pixtral", "midm-2.0", "lfm2"};
  static constexpr absl::string_view kGpt2[] = {"gpt2", "mpt", "olmo", "jais", "trillion"};
  for (absl::string_view n : kLlama3) {
    if (name == n) return PreTokenizerSpec{PreTokenizerKind::kLlama3, /*ignore_merges=*/true};
  }
  if (name == "smaug-bpe") return PreTokenizerSpec{PreTokenizerKind::kLlama3, false};
  if (name == "qwen2") return PreTokenizerSpec{PreTokenizerKind::kQwen2, false};
  for (absl::string_view n : kGpt2) {
    if (name == n) return PreTokenizerSpec{PreTokenizerKind::kGpt2, false};
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported byte-level BPE pre-tokenizer '", name,
                                                 "' (supported: llama-bpe, qwen2, gpt2)"));
}

// Splits text into pre-tokens with one RE2 regex, matched anchored at each position in turn
// (the regex alternatives cover every code point, so the pieces tile the text).
class PreTokenizer {
 public:
  explicit PreTokenizer(PreTokenizerKind kind) : kind_(kind) {
    // `\s+(?!\S)|\s+` is written `\s+`; Split() applies the lookahead.
    static constexpr char kLlama3Pattern[] =
        "'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
        "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
        "|\\p{N}{1,3}"
        "| ?[^" PINFER_WS
        "\\p{L}\\p{N}]+[\\r\\n]*"
        "|[" PINFER_WS
        "]*[\\r\\n]+"
        "|[" PINFER_WS "]+";
    static constexpr char kQwen2Pattern[] =
        "'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
        "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
        "|\\p{N}"
        "| ?[^" PINFER_WS
        "\\p{L}\\p{N}]+[\\r\\n]*"
        "|[" PINFER_WS
        "]*[\\r\\n]+"
        "|[" PINFER_WS "]+";
    static constexpr char kGpt2Pattern[] =
        "'s|'t|'re|'ve|'m|'ll|'d"
        "| ?\\p{L}+"
        "| ?\\p{N}+"
        "| ?[^" PINFER_WS
        "\\p{L}\\p{N}]+"
        "|[" PINFER_WS "]+";
    RE2::Options options;
    options.set_log_errors(false);
    re_ = std::make_unique<RE2>(kind == PreTokenizerKind::kLlama3  ? kLlama3Pattern
                                : kind == PreTokenizerKind::kQwen2 ? kQwen2Pattern
                                                                   : kGpt2Pattern,
                                options);
  }

  bool ok() const { return re_->ok(); }

  // Appends the pre-tokens of `text` (well-formed UTF-8) as views into it.
  void Split(absl::string_view text, std::vector<absl::string_view>* out) const {
    const re2::StringPiece input(text.data(), text.size());
    size_t pos = 0;
    while (pos < text.size()) {
      re2::StringPiece match;
      size_t end;
      if (re_->Match(input, pos, text.size(), RE2::ANCHOR_START, &match, 1) && !match.empty()) {
        end = pos + match.size();
      } else {
        // Unreachable for well-formed UTF-8; one code point keeps the loop going regardless.
        uint32_t cpt;
        end = pos + std::max(DecodeUtf8(text, pos, &cpt), 1);
      }
      end = ApplyLookahead(text, pos, end);
      out->push_back(text.substr(pos, end - pos));
      pos = end;
    }
  }

 private:
  // The regex's `\s+(?!\S)`: a whitespace run of two or more characters followed by more text
  // (necessarily non-space: the run is maximal) leaves its last character to start the next
  // pre-token, so " Hello" stays together after "  ". A whitespace-only match comes from the
  // `\s+` alternative unless it holds \r or \n in the Llama-3 regex (then `\s*[\r\n]+` made it).
  size_t ApplyLookahead(absl::string_view text, size_t pos, size_t end) const {
    if (end >= text.size()) return end;
    int count = 0;
    size_t last_start = pos;
    for (size_t i = pos; i < end;) {
      uint32_t cpt;
      const int len = DecodeUtf8(text, i, &cpt);
      if (len == 0 || !IsWhitespace(cpt)) return end;
      if (kind_ != PreTokenizerKind::kGpt2 && (cpt == '\r' || cpt == '\n')) return end;
      last_start = i;
      i += len;
      ++count;
    }
    return count >= 2 ? last_start : end;
  }

  PreTokenizerKind kind_;
  std::unique_ptr<RE2> re_;
};

// ---------------------------------------------------------------------------------------------
// The tokenizer

class ByteLevelBpeTokenizer : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(const std::vector<std::string>& tokens,
                                                           const std::vector<std::string>& merges,
                                                           const std::vector<int32_t>& types,
                                                           PreTokenizerSpec spec) {
    if (tokens.empty()) return absl::InvalidArgumentError("byte-level BPE: empty vocabulary");
    if (!types.empty() && types.size() != tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "byte-level BPE: ", types.size(), " token types for ", tokens.size(), " tokens"));
    }
    std::unique_ptr<ByteLevelBpeTokenizer> t(new ByteLevelBpeTokenizer(spec));
    if (!t->pre_.ok()) return absl::InternalError("byte-level BPE: pre-tokenizer regex invalid");
    t->Build(tokens, merges, types);
    return std::unique_ptr<Tokenizer>(std::move(t));
  }

  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const override {
    std::optional<std::string> sanitized = SanitizeUtf8(text);
    if (sanitized.has_value()) text = *sanitized;
    std::vector<int32_t> ids;
    std::vector<absl::string_view> words;
    std::string scratch;
    // User-defined tokens cut the text into raw fragments first; each fragment is pre-tokenized
    // on its own, so no pre-token spans a user-defined token.
    for (const Fragment& f : SplitUserDefined(text)) {
      if (f.id >= 0) {
        ids.push_back(f.id);
        continue;
      }
      words.clear();
      pre_.Split(f.text, &words);
      for (absl::string_view w : words) EncodeWord(w, &scratch, &ids);
    }
    return ids;
  }

  std::string TokenBytes(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return "";
    return pieces_[id];
  }
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  // Control, unknown and unused tokens stand for no text.
  bool IsControl(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return true;
    return types_[id] != kTypeNormal && types_[id] != kTypeUserDefined;
  }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  struct Fragment {
    absl::string_view text;
    int32_t id;  // a user-defined token, or -1 for raw text
  };

  explicit ByteLevelBpeTokenizer(PreTokenizerSpec spec)
      : pre_(spec.kind), ignore_merges_(spec.ignore_merges) {}

  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void Build(const std::vector<std::string>& tokens, const std::vector<std::string>& merges,
             const std::vector<int32_t>& types) {
    const ByteMap& bytes = ByteMap::Get();
    const int n = static_cast<int>(tokens.size());
    types_.assign(n, kTypeNormal);
    if (!types.empty()) types_ = types;
    pieces_.resize(n);
    token_to_id_.reserve(n);
    for (int id = 0; id < n; ++id) {
      const std::string& text = tokens[id];
      // Later duplicates win, as in llama.cpp's token_to_id.
      if (!text.empty()) token_to_id_[text] = id;
      if (types_[id] == kTypeNormal) {
        // Undo the byte map; a character outside it is kept as its UTF-8.
        std::string& piece = pieces_[id];
        for (size_t i = 0; i < text.size();) {
          uint32_t cpt;
          const int len = DecodeUtf8(text, i, &cpt);
          const int b = len > 0 ? bytes.Byte(cpt) : -1;
          if (b >= 0) {
            piece.push_back(static_cast<char>(b));
          } else {
            piece.append(text, i, std::max(len, 1));
          }
          i += std::max(len, 1);
        }
      } else if (types_[id] == kTypeUserDefined) {
        pieces_[id] = text;  // user-defined tokens are stored as raw text
        if (!text.empty()) user_defined_.emplace_back(text, id);
      }
    }
    // Longest first, so that a user-defined token wins over its own prefixes (llama.cpp order).
    std::stable_sort(user_defined_.begin(), user_defined_.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });

    for (int b = 0; b < 256; ++b) {
      auto it = token_to_id_.find(bytes.Char(b));
      byte_token_[b] = it == token_to_id_.end() ? -1 : it->second;
    }

    // A merge whose parts or result are not tokens could never produce a token id; such merges
    // (absent from well-formed vocabularies, rejected by Hugging Face) are skipped, where
    // llama.cpp would merge the strings and later fall back to byte tokens. The first of
    // duplicate merges ranks.
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const std::string& m = merges[rank];
      const size_t space = m.find(' ', 1);
      if (space == std::string::npos) continue;
      auto a = token_to_id_.find(absl::string_view(m).substr(0, space));
      auto b = token_to_id_.find(absl::string_view(m).substr(space + 1));
      auto ab = token_to_id_.find(absl::StrCat(absl::string_view(m).substr(0, space),
                                               absl::string_view(m).substr(space + 1)));
      if (a == token_to_id_.end() || b == token_to_id_.end() || ab == token_to_id_.end()) continue;
      merges_.try_emplace(PairKey(a->second, b->second),
                          Merge{static_cast<int32_t>(rank), ab->second});
    }
  }

  std::vector<Fragment> SplitUserDefined(absl::string_view text) const {
    std::vector<Fragment> frags = {{text, -1}};
    for (const auto& [content, id] : user_defined_) {
      std::vector<Fragment> next;
      for (const Fragment& f : frags) {
        if (f.id >= 0) {
          next.push_back(f);
          continue;
        }
        absl::string_view rest = f.text;
        for (size_t at; (at = rest.find(content)) != absl::string_view::npos;) {
          if (at > 0) next.push_back({rest.substr(0, at), -1});
          next.push_back({rest.substr(at, content.size()), id});
          rest.remove_prefix(at + content.size());
        }
        if (!rest.empty()) next.push_back({rest, -1});
      }
      frags = std::move(next);
    }
    return frags;
  }

  // BPE on one pre-token: start from one symbol per byte and repeatedly apply the
  // lowest-ranked merge present (leftmost on ties), via a heap of candidate pairs over a linked
  // list of symbols, so long pre-tokens cost O(n log n).
  void EncodeWord(absl::string_view word, std::string* mapped, std::vector<int32_t>* out) const {
    const ByteMap& bytes = ByteMap::Get();
    if (ignore_merges_) {
      mapped->clear();
      for (char c : word) *mapped += bytes.Char(static_cast<uint8_t>(c));
      auto it = token_to_id_.find(*mapped);
      if (it != token_to_id_.end()) {
        out->push_back(it->second);
        return;
      }
    }
    struct Symbol {
      int32_t id;  // -1 once merged into its left neighbour
      int32_t prev;
      int32_t next;
    };
    std::vector<Symbol> syms;
    syms.reserve(word.size());
    for (char c : word) {
      const int32_t id = byte_token_[static_cast<uint8_t>(c)];
      // A byte without a token is dropped, as llama.cpp does.
      if (id < 0) continue;
      const int32_t i = static_cast<int32_t>(syms.size());
      syms.push_back({id, i - 1, -1});
      if (i > 0) syms[i - 1].next = i;
    }
    if (syms.size() > 1) {
      struct Candidate {
        int32_t rank;
        int32_t left;
        int32_t left_id;
        int32_t right_id;
        bool operator>(const Candidate& o) const {
          return rank != o.rank ? rank > o.rank : left > o.left;
        }
      };
      std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
      auto push = [&](int32_t left) {
        if (left < 0 || syms[left].next < 0) return;
        const int32_t a = syms[left].id, b = syms[syms[left].next].id;
        auto it = merges_.find(PairKey(a, b));
        if (it != merges_.end()) heap.push({it->second.rank, left, a, b});
      };
      for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) push(i);
      while (!heap.empty()) {
        const Candidate c = heap.top();
        heap.pop();
        Symbol& left = syms[c.left];
        // Skip candidates that earlier merges made stale.
        if (left.id != c.left_id || left.next < 0 || syms[left.next].id != c.right_id) continue;
        Symbol& right = syms[left.next];
        left.id = merges_.find(PairKey(c.left_id, c.right_id))->second.result;
        right.id = -1;
        left.next = right.next;
        if (left.next >= 0) syms[left.next].prev = c.left;
        push(left.prev);
        push(c.left);
      }
    }
    for (const Symbol& s : syms) {
      if (s.id >= 0) out->push_back(s.id);
    }
  }

  PreTokenizer pre_;
  bool ignore_merges_;
  std::vector<std::string> pieces_;  // the raw bytes of each token
  std::vector<int32_t> types_;
  absl::flat_hash_map<std::string, int32_t> token_to_id_;  // vocabulary text (byte characters)
  std::array<int32_t, 256> byte_token_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  std::vector<std::pair<std::string, int32_t>> user_defined_;
};

// ---------------------------------------------------------------------------------------------
// tokenizer.json

using Json = nlohmann::json;

// Records why nlohmann's parser rejected a document (the non-throwing DOM parse gives no reason).
class ParseErrorRecorder : public nlohmann::json_sax<Json> {
 public:
  std::string message;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    message = ex.what();
    return false;
  }
};

// Qwen2's Split regex (Qwen2 / Qwen2.5 tokenizer.json): Llama-3's with single digits.
constexpr absl::string_view kQwen2SplitRegexes[] = {
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};

// The Llama-3 Split regex as tokenizer.json files spell it.
constexpr absl::string_view kLlama3SplitRegexes[] = {
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};

// nlohmann's accessors throw on a type mismatch; these read optional fields without throwing.
std::string StringField(const Json& obj, const char* key) {
  if (!obj.is_object()) return "";
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : "";
}
// nullopt when the field is there but not a boolean.
std::optional<bool> BoolField(const Json& obj, const char* key, bool absent) {
  if (!obj.is_object()) return std::nullopt;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absent;
  if (!it->is_boolean()) return std::nullopt;
  return it->get<bool>();
}

std::string Abbreviate(const Json& j) {
  std::string s = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 160) s = s.substr(0, 160) + "...";
  return s;
}

bool IsByteLevel(const Json& p, bool use_regex) {
  return StringField(p, "type") == "ByteLevel" && BoolField(p, "use_regex", true) == use_regex;
}

// Maps the pre_tokenizer section onto one of the supported splits.
absl::StatusOr<PreTokenizerKind> PreTokenizerFromJson(const Json& p) {
  const auto unsupported = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported pre_tokenizer (", why, "): ", Abbreviate(p)));
  };
  const Json* byte_level = nullptr;
  PreTokenizerKind kind;
  if (IsByteLevel(p, /*use_regex=*/true)) {
    kind = PreTokenizerKind::kGpt2;
    byte_level = &p;
  } else if (StringField(p, "type") == "Sequence") {
    auto it = p.find("pretokenizers");
    if (it == p.end() || !it->is_array() || it->size() != 2) {
      return unsupported("expected a Sequence of Split and ByteLevel");
    }
    const Json& split = (*it)[0];
    if (StringField(split, "type") != "Split" || StringField(split, "behavior") != "Isolated" ||
        BoolField(split, "invert", false) != false) {
      return unsupported("expected an isolating Split first");
    }
    auto pattern = split.find("pattern");
    if (pattern == split.end() || !pattern->is_object() || !pattern->contains("Regex") ||
        !(*pattern)["Regex"].is_string()) {
      return unsupported("Split without a Regex pattern");
    }
    const std::string regex = (*pattern)["Regex"].get<std::string>();
    if (std::find(std::begin(kLlama3SplitRegexes), std::end(kLlama3SplitRegexes),
                  absl::string_view(regex)) != std::end(kLlama3SplitRegexes)) {
      kind = PreTokenizerKind::kLlama3;
    } else if (std::find(std::begin(kQwen2SplitRegexes), std::end(kQwen2SplitRegexes),
                         absl::string_view(regex)) != std::end(kQwen2SplitRegexes)) {
      kind = PreTokenizerKind::kQwen2;
    } else {
      return unsupported("Split regex is neither Llama-3's nor Qwen2's");
    }
    if (!IsByteLevel((*it)[1], /*use_regex=*/false)) {
      return unsupported("expected ByteLevel with use_regex false after Split");
    }
    byte_level = &(*it)[1];
  } else {
    return unsupported("not byte-level");
  }
  if (BoolField(*byte_level, "add_prefix_space", false) != false) {
    return unsupported("add_prefix_space");
  }
  return kind;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> ParseTokenizerJson(absl::string_view text,
                                                              const std::string& name) {
  const auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", parts...));
  };
  Json root = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    ParseErrorRecorder recorder;
    Json::sax_parse(text.begin(), text.end(), &recorder);
    return error("invalid JSON: ", recorder.message);
  }
  if (!root.is_object()) return error("not a JSON object");

  auto model_it = root.find("model");
  if (model_it == root.end() || !model_it->is_object()) return error("missing 'model' object");
  const Json& model = *model_it;
  if (model.contains("type") && StringField(model, "type") != "BPE") {
    return error("model.type is ", Abbreviate(model["type"]), "; only BPE is supported");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() && model[key] != "") {
      return error("model.", key, " is not supported");
    }
  }
  auto normalizer = root.find("normalizer");
  // Qwen2's NFC normalizer is accepted and, as in llama.cpp (the reference here), not applied:
  // text already in NFC, which is nearly all text, tokenizes the same either way.
  if (normalizer != root.end() && !normalizer->is_null() &&
      StringField(*normalizer, "type") != "NFC") {
    return error("normalizer ", Abbreviate(*normalizer), " is not supported");
  }
  auto pre_it = root.find("pre_tokenizer");
  if (pre_it == root.end() || pre_it->is_null()) return error("missing pre_tokenizer");
  absl::StatusOr<PreTokenizerKind> kind = PreTokenizerFromJson(*pre_it);
  if (!kind.ok()) return error(kind.status().message());
  const std::optional<bool> ignore_merges = BoolField(model, "ignore_merges", false);
  if (!ignore_merges.has_value()) return error("model.ignore_merges is not a boolean");

  // Vocabulary and added tokens share one id space; the ids must be dense enough that the
  // table cannot be inflated by one huge id.
  auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) return error("missing model.vocab object");
  const Json& vocab = *vocab_it;
  const Json empty_array = Json::array();
  const Json* added = &empty_array;
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    added = &root["added_tokens"];
    if (!added->is_array()) return error("added_tokens is not an array");
  }
  const size_t max_tokens = vocab.size() + added->size();
  std::vector<std::string> tokens(max_tokens);
  std::vector<int32_t> types(max_tokens, /*unused*/ 5);
  size_t n = 0;  // one past the largest id
  const auto check_id = [&](const Json& id, absl::string_view what) -> absl::StatusOr<size_t> {
    if (!id.is_number_integer()) return error(what, ": id is not an integer");
    const int64_t v = id.get<int64_t>();
    if (v < 0 || static_cast<uint64_t>(v) >= max_tokens) {
      return error(what, ": id ", v, " out of range [0, ", max_tokens, ")");
    }
    n = std::max(n, static_cast<size_t>(v) + 1);
    return static_cast<size_t>(v);
  };
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    size_t id;
    ASSIGN_OR_RETURN(id, check_id(it.value(), absl::StrCat("vocab entry '", it.key(), "'")));
    if (types[id] != 5) return error("vocab id ", id, " is used twice");
    tokens[id] = it.key();
    types[id] = kTypeNormal;
  }
  for (size_t i = 0; i < added->size(); ++i) {
    const Json& a = (*added)[i];
    const std::string what = absl::StrCat("added_tokens[", i, "]");
    if (!a.is_object() || !a.contains("content") || !a["content"].is_string() ||
        !a.contains("id")) {
      return error(what, ": expected an object with 'id' and string 'content'");
    }
    size_t id;
    ASSIGN_OR_RETURN(id, check_id(a["id"], what));
    const std::string content = a["content"].get<std::string>();
    if (types[id] != 5 && tokens[id] != content) {
      return error(what, ": id ", id, " ('", content, "') is already '", tokens[id], "'");
    }
    const std::optional<bool> special_field = BoolField(a, "special", false);
    if (!special_field.has_value()) return error(what, ": 'special' is not a boolean");
    const bool special = *special_field;
    tokens[id] = content;
    if (special) {
      types[id] = kTypeControl;
    } else if (types[id] != kTypeNormal) {
      types[id] = kTypeUserDefined;
    }
  }
  tokens.resize(n);
  types.resize(n);

  auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array())
    return error("missing model.merges array");
  std::vector<std::string> merges;
  merges.reserve(merges_it->size());
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const Json& m = (*merges_it)[i];
    // Either "a b" or ["a", "b"]; byte-level tokens never contain a space, so both become "a b".
    if (m.is_string()) {
      merges.push_back(m.get<std::string>());
      if (merges.back().find(' ', 1) == std::string::npos) {
        return error("merges[", i, "] '", merges.back(), "' is not two tokens");
      }
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      const std::string a = m[0].get<std::string>(), b = m[1].get<std::string>();
      if (a.empty() || b.empty() || a.find(' ') != std::string::npos ||
          b.find(' ') != std::string::npos) {
        return error("merges[", i, "] has an empty part or a space");
      }
      merges.push_back(absl::StrCat(a, " ", b));
    } else {
      return error("merges[", i, "] is neither \"a b\" nor [\"a\", \"b\"]");
    }
  }
  return ByteLevelBpeTokenizer::Create(tokens, merges, types, {*kind, *ignore_merges});
}

absl::StatusOr<std::unique_ptr<Tokenizer>> NewByteLevelBpeTokenizer(
    const std::vector<std::string>& tokens, const std::vector<std::string>& merges,
    const std::vector<int32_t>& types, absl::string_view pre_tokenizer) {
  ASSIGN_OR_RETURN(PreTokenizerSpec spec, FindPreTokenizer(pre_tokenizer));
  return ByteLevelBpeTokenizer::Create(tokens, merges, types, spec);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerJson(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseTokenizerJson(text, path);
}

absl::StatusOr<std::vector<std::string>> SplitPreTokens(absl::string_view text,
                                                        absl::string_view pre_tokenizer) {
  ASSIGN_OR_RETURN(PreTokenizerSpec spec, FindPreTokenizer(pre_tokenizer));
  const PreTokenizer pre(spec.kind);
  if (!pre.ok()) return absl::InternalError("pre-tokenizer regex invalid");
  std::optional<std::string> sanitized = SanitizeUtf8(text);
  if (sanitized.has_value()) text = *sanitized;
  std::vector<absl::string_view> views;
  pre.Split(text, &views);
  return std::vector<std::string>(views.begin(), views.end());
}

}  // namespace pinfer
