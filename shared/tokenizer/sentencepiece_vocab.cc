// A sentencepiece tokenizer from a vocabulary given as arrays (a GGUF `llama` vocabulary: tokens,
// scores, token types), run by libsentencepiece so that it behaves exactly like the
// tokenizer.model the vocabulary was taken from.
//
// libsentencepiece loads only a serialized ModelProto, so we build one. It needs just a handful
// of fields, which we encode by hand with the protobuf wire format rather than compile a second
// copy of sentencepiece_model.proto (whose descriptors would clash with the library's own). The
// settings are those of Llama-2's tokenizer.model, which llama.cpp's SPM tokenizer reproduces:
// BPE merges by piece score, byte fallback for characters outside the vocabulary, a dummy "▁"
// prefix, whitespace escaped to "▁" and never collapsed, no Unicode normalization, and runs of
// whitespace allowed to form one piece ("▁▁▁").
//
// Like llama.cpp (and Hugging Face), the text of special tokens (control, unknown and
// user-defined tokens such as "<s>") is recognised in the input and becomes that token; the text
// between them is encoded by sentencepiece, each piece with its own dummy prefix, which is what
// llama.cpp does after a special token.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "shared/tokenizer/tokenizer.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

// Field numbers from sentencepiece_model.proto.
namespace field {
// ModelProto
constexpr int kPieces = 1;
constexpr int kTrainerSpec = 2;
constexpr int kNormalizerSpec = 3;
// ModelProto.SentencePiece
constexpr int kPiece = 1;
constexpr int kScore = 2;
constexpr int kType = 3;
// TrainerSpec
constexpr int kModelType = 3;  // enum ModelType { UNIGRAM = 1; BPE = 2; ... }
constexpr int kVocabSize = 4;
constexpr int kSplitDigits = 25;
constexpr int kAllowWhitespaceOnlyPieces = 26;
constexpr int kByteFallback = 35;
constexpr int kUnkId = 40;
constexpr int kBosId = 41;
constexpr int kEosId = 42;
constexpr int kPadId = 43;
// NormalizerSpec
constexpr int kName = 1;
constexpr int kAddDummyPrefix = 3;
constexpr int kRemoveExtraWhitespaces = 4;
constexpr int kEscapeWhitespaces = 5;
}  // namespace field

constexpr int kModelTypeBpe = 2;

// Token types: GGUF uses sentencepiece's ModelProto.SentencePiece.Type numbering.
constexpr int kTypeNormal = 1;
constexpr int kTypeUnknown = 2;
constexpr int kTypeControl = 3;
constexpr int kTypeUserDefined = 4;
constexpr int kTypeByte = 6;

// Splits text at special tokens, longest tokens first (llama.cpp's tokenizer_st_partition), and
// runs sentencepiece on the rest.
class SpecialTokenSentencePiece : public Tokenizer {
 public:
  SpecialTokenSentencePiece(std::unique_ptr<Tokenizer> inner,
                            std::vector<std::pair<std::string, int32_t>> specials,
                            bool add_dummy_prefix)
      : inner_(std::move(inner)),
        specials_(std::move(specials)),
        add_dummy_prefix_(add_dummy_prefix) {
    std::stable_sort(specials_.begin(), specials_.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }

  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const override {
    struct Fragment {
      absl::string_view text;  // raw text when id < 0
      int32_t id;
    };
    std::vector<Fragment> frags = {{text, -1}};
    for (const auto& [piece, id] : specials_) {
      std::vector<Fragment> next;
      for (const Fragment& f : frags) {
        if (f.id >= 0) {
          next.push_back(f);
          continue;
        }
        absl::string_view rest = f.text;
        for (size_t at; (at = rest.find(piece)) != absl::string_view::npos;) {
          if (at > 0) next.push_back({rest.substr(0, at), -1});
          next.push_back({{}, id});
          rest.remove_prefix(at + piece.size());
        }
        if (!rest.empty()) next.push_back({rest, -1});
      }
      frags = std::move(next);
    }
    std::vector<int32_t> out;
    for (const Fragment& f : frags) {
      if (f.id >= 0) {
        out.push_back(f.id);
        continue;
      }
      auto ids = inner_->Encode(f.text);
      if (!ids.ok()) return ids.status();
      out.insert(out.end(), ids->begin(), ids->end());
    }
    return out;
  }
  std::string TokenBytes(int32_t id) const override { return inner_->TokenBytes(id); }
  int vocab_size() const override { return inner_->vocab_size(); }
  bool IsControl(int32_t id) const override { return inner_->IsControl(id); }
  bool adds_dummy_prefix() const override { return add_dummy_prefix_; }

 private:
  std::unique_ptr<Tokenizer> inner_;
  std::vector<std::pair<std::string, int32_t>> specials_;
  bool add_dummy_prefix_;
};

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void PutTag(std::string* out, int field, int wire_type) {
  PutVarint(out, static_cast<uint64_t>(field) << 3 | wire_type);
}
// int32 fields are encoded as 64-bit two's complement varints (so -1 takes 10 bytes).
void PutInt(std::string* out, int field, int64_t v) {
  PutTag(out, field, 0);
  PutVarint(out, static_cast<uint64_t>(v));
}
void PutBytes(std::string* out, int field, absl::string_view bytes) {
  PutTag(out, field, 2);
  PutVarint(out, bytes.size());
  out->append(bytes.data(), bytes.size());
}
void PutFloat(std::string* out, int field, float v) {
  PutTag(out, field, 5);
  char b[4];
  std::memcpy(b, &v, 4);
  out->append(b, 4);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> NewSentencePieceTokenizerFromVocab(
    const std::vector<std::string>& tokens, const std::vector<float>& scores,
    const std::vector<int32_t>& types, bool add_dummy_prefix) {
  const size_t n = tokens.size();
  if (n == 0) return absl::InvalidArgumentError("sentencepiece vocabulary is empty");
  if (!scores.empty() && scores.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("sentencepiece vocabulary has ", n, " tokens but ", scores.size(), " scores"));
  }
  if (!types.empty() && types.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("sentencepiece vocabulary has ", n,
                                                   " tokens but ", types.size(), " token types"));
  }
  std::string model;
  std::set<absl::string_view> seen;
  std::vector<std::pair<std::string, int32_t>> specials;
  int unk_id = -1, bos_id = -1, eos_id = -1, n_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    // Type 0 ("undefined" in llama.cpp) is treated as normal, like llama.cpp does.
    int type = types.empty() || types[i] == 0 ? kTypeNormal : types[i];
    if (type < kTypeNormal || type > kTypeByte) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " has invalid type ", type));
    }
    if (tokens[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " is empty"));
    }
    if (!seen.insert(tokens[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", i, " ('", tokens[i], "') appears twice in the vocabulary"));
    }
    if (type == kTypeUnknown && unk_id < 0) unk_id = static_cast<int>(i);
    if (type == kTypeUnknown || type == kTypeControl || type == kTypeUserDefined) {
      specials.emplace_back(tokens[i], static_cast<int32_t>(i));
    }
    if (type == kTypeControl && tokens[i] == "<s>") bos_id = static_cast<int>(i);
    if (type == kTypeControl && tokens[i] == "</s>") eos_id = static_cast<int>(i);
    if (type == kTypeByte) {
      // Byte pieces must be spelled "<0xAB>"; sentencepiece rejects anything else.
      unsigned v;
      char tail;
      if (tokens[i].size() != 6 || std::sscanf(tokens[i].c_str(), "<0x%2X%c", &v, &tail) != 2 ||
          tail != '>') {
        return absl::InvalidArgumentError(
            absl::StrCat("byte token ", i, " is spelled '", tokens[i], "', expected <0xXX>"));
      }
      ++n_bytes;
    }
    std::string piece;
    PutBytes(&piece, field::kPiece, tokens[i]);
    PutFloat(&piece, field::kScore, scores.empty() ? 0.f : scores[i]);
    if (type != kTypeNormal) PutInt(&piece, field::kType, type);
    PutBytes(&model, field::kPieces, piece);
  }
  if (unk_id < 0) {
    return absl::InvalidArgumentError("sentencepiece vocabulary has no unknown token (type 2)");
  }

  std::string trainer;
  PutInt(&trainer, field::kModelType, kModelTypeBpe);
  PutInt(&trainer, field::kVocabSize, static_cast<int64_t>(n));
  PutInt(&trainer, field::kSplitDigits, 1);
  PutInt(&trainer, field::kAllowWhitespaceOnlyPieces, 1);
  // With all 256 byte pieces, characters outside the vocabulary become their UTF-8 bytes (as in
  // llama.cpp); without them they become <unk>.
  PutInt(&trainer, field::kByteFallback, n_bytes == 256 ? 1 : 0);
  PutInt(&trainer, field::kUnkId, unk_id);
  PutInt(&trainer, field::kBosId, bos_id);
  PutInt(&trainer, field::kEosId, eos_id);
  PutInt(&trainer, field::kPadId, -1);
  PutBytes(&model, field::kTrainerSpec, trainer);

  std::string normalizer;
  PutBytes(&normalizer, field::kName, "identity");
  PutInt(&normalizer, field::kAddDummyPrefix, add_dummy_prefix ? 1 : 0);
  PutInt(&normalizer, field::kRemoveExtraWhitespaces, 0);
  PutInt(&normalizer, field::kEscapeWhitespaces, 1);
  PutBytes(&model, field::kNormalizerSpec, normalizer);

  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> inner, NewSentencePieceTokenizer(model));
  return std::unique_ptr<Tokenizer>(
      new SpecialTokenSentencePiece(std::move(inner), std::move(specials), add_dummy_prefix));
}

}  // namespace pinfer
