// Fuzzes the GGUF parser and everything built on it: metadata getters, tensor views, the
// vocabulary (sentencepiece and byte-level BPE tokenizers) and the llama model loader, whose
// shape checks must leave every weight row it accepted inside the file.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "shared/model/gguf.h"
#include "shared/model/model.h"

namespace {

void Exercise(const pinfer::GgufFile& f) {
  volatile uint64_t sink = 0;
  for (const pinfer::GgufKeyValue& kv : f.metadata()) {
    (void)f.GetString(kv.key);
    (void)f.GetU32(kv.key);
    (void)f.GetI32(kv.key);
    (void)f.GetF32(kv.key);
    (void)f.GetBool(kv.key);
    (void)f.GetStringArray(kv.key);
    (void)f.GetF32Array(kv.key);
    (void)f.GetI32Array(kv.key);
  }
  for (const pinfer::GgufTensorInfo& t : f.tensors()) {
    // Every byte the parser vouched for must be readable.
    for (uint64_t i = 0; i < t.nbytes; i += 61) sink = sink + t.data[i];
    if (t.nbytes > 0) sink = sink + t.data[t.nbytes - 1];
    (void)pinfer::GgufFile::ToTensorView(t);
  }
  auto tok = pinfer::LoadGgufTokenizer(f);
  if (tok.ok()) {
    auto ids = (*tok)->Encode("Hello world, <s> 123 \xE2\x96\x81 caf\xC3\xA9 \xF0\x9F\xA6\x99");
    if (ids.ok()) {
      for (int32_t id : *ids) sink = sink + (*tok)->TokenBytes(id).size();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = pinfer::GgufFile::Parse(data, size, "fuzz.gguf", nullptr,
                                      {pinfer::kGgufMagic, pinfer::kPowerInferMagic});
  if (!file.ok()) return 0;
  Exercise(**file);

  // The model loader needs a mapped file.
  static const std::string path = "/tmp/pinfer-gguf-fuzz-" + std::to_string(getpid()) + ".gguf";
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) return 0;
  std::fwrite(data, 1, size, out);
  std::fclose(out);
  auto model = pinfer::LoadModel(path);
  if (model.ok()) {
    // The last byte of the last row of every weight must be readable.
    const pinfer::Model& m = **model;
    std::vector<const pinfer::TensorView*> all = {&m.tok_embeddings, &m.output_norm, &m.output};
    for (const pinfer::LayerWeights& l : m.layers) {
      for (const pinfer::TensorView* t :
           {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.gate, &l.up, &l.down}) {
        all.push_back(t);
      }
    }
    volatile uint8_t sink = 0;
    for (const pinfer::TensorView* t : all) {
      sink = sink + t->row(t->rows() - 1)[t->row_bytes() - 1];
    }
  }
  return 0;
}
