// Llama-2 style tokenizer backed by libsentencepiece (BPE with byte fallback).
#include <memory>

#include "absl/strings/string_view.h"
#include "absl/strings/str_cat.h"
#include "shared/tokenizer/sentencepiece_wrapper.h"
#include "shared/tokenizer/tokenizer.h"
#include "shared/util/mapped_file.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(std::unique_ptr<spm::Processor> sp)
      : sp_(std::move(sp)) {
    const int n = sp_->PieceSize();
    pieces_.resize(n);
    control_.resize(n);
    for (int id = 0; id < n; ++id) {
      control_[id] = sp_->IsControl(id) || sp_->IsUnknown(id) || sp_->IsUnused(id);
      if (sp_->IsByte(id)) {
        // "<0xAB>" stands for the single byte 0xAB.
        const std::string p = sp_->IdToPiece(id);
        pieces_[id] = std::string(1, static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16)));
      } else if (sp_->IsUnknown(id)) {
        pieces_[id] = " \xE2\x81\x87 ";  // sentencepiece renders <unk> as " ⁇ "
      } else if (!control_[id]) {
        std::string p = sp_->IdToPiece(id);
        std::string out;
        for (size_t i = 0; i < p.size();) {
          if (p.compare(i, 3, "\xE2\x96\x81") == 0) {  // U+2581 word-start marker
            out += ' ';
            i += 3;
          } else {
            out += p[i++];
          }
        }
        pieces_[id] = std::move(out);
      }
    }
  }

  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const override {
    std::vector<int> ids;
    std::string error;
    if (!sp_->Encode(std::string(text), &ids, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("sentencepiece: ", error));
    }
    return std::vector<int32_t>(ids.begin(), ids.end());
  }
  std::string TokenBytes(int32_t id) const override {
    if (id < 0 || id >= static_cast<int32_t>(pieces_.size())) return "";
    return pieces_[id];
  }
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  bool IsControl(int32_t id) const override {
    return id < 0 || id >= static_cast<int32_t>(control_.size()) || control_[id];
  }
  bool adds_dummy_prefix() const override { return true; }

 private:
  std::unique_ptr<spm::Processor> sp_;
  std::vector<std::string> pieces_;
  std::vector<bool> control_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> NewSentencePieceTokenizer(absl::string_view model_proto) {
  std::string error;
  auto sp = spm::Processor::Load(std::string(model_proto), &error);
  if (sp == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("invalid sentencepiece model: ", error));
  }
  return std::unique_ptr<Tokenizer>(new SentencePieceTokenizer(std::move(sp)));
}

}  // namespace pinfer
