// See sentencepiece_wrapper.h. Must not include any Abseil header.
#include "shared/tokenizer/sentencepiece_wrapper.h"

#include <sentencepiece_processor.h>

namespace pinfer::spm {
namespace {

class ProcessorImpl : public Processor {
 public:
  sentencepiece::SentencePieceProcessor sp;
  bool Encode(const std::string& text, std::vector<int>* ids, std::string* error) const override {
    auto st = sp.Encode(text, ids);
    if (!st.ok()) *error = st.ToString();
    return st.ok();
  }
  int PieceSize() const override { return sp.GetPieceSize(); }
  std::string IdToPiece(int id) const override { return sp.IdToPiece(id); }
  bool IsControl(int id) const override { return sp.IsControl(id); }
  bool IsUnknown(int id) const override { return sp.IsUnknown(id); }
  bool IsUnused(int id) const override { return sp.IsUnused(id); }
  bool IsByte(int id) const override { return sp.IsByte(id); }
};

}  // namespace

std::unique_ptr<Processor> Processor::Load(const std::string& model_proto, std::string* error) {
  auto p = std::make_unique<ProcessorImpl>();
  auto st = p->sp.LoadFromSerializedProto(model_proto);
  if (!st.ok()) {
    *error = st.ToString();
    return nullptr;
  }
  return p;
}

}  // namespace pinfer::spm
