// Hugging Face LlamaForCausalLM directory -> GGUF v3 `llama` file, following llama.cpp's
// convert_hf_to_gguf.py so that llama.cpp loads the result as one of its own:
//  - tensor names token_embd / output_norm / output / blk.N.{attn_norm, attn_q, attn_k, attn_v,
//    attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}; `output` is left out when tied;
//  - Q and K rows permuted per head (llama.cpp's `permute`) so that RoPE rotates adjacent pairs;
//  - 1-D tensors (norms) always F32; 2-D weights in the requested type. q8_0 quantizes every
//    matrix, token_embd and output included, as convert_hf_to_gguf.py --outtype q8_0 does. q4_0
//    follows llama-quantize Q4_0, which keeps the output matrix (token_embd when tied) at higher
//    precision: llama.cpp uses Q6_K there, pinfer Q8_0 (the closest type it computes with).
//    Matrices whose rows are not a multiple of 32 fall back to F16, as in llama.cpp;
//  - Llama-3 RoPE scaling as the `rope_freqs` tensor of per-frequency divisors;
//  - Mistral's sliding window (when shorter than the context) as `llama.attention.sliding_window`,
//    llama.cpp's key for it;
//  - the vocabulary as tokenizer.ggml.* keys: tokens, scores and types of a sentencepiece
//    tokenizer.model ("llama"), or tokens, types, merges and the pre-tokenizer of a byte-level BPE
//    tokenizer.json ("gpt2", Llama-3 style) when there is no tokenizer.model.
// pinfer adds one key of its own, `pinfer.hidden_act`, because GGUF has no standard way to say
// that a `llama` model's FFN is ReLU- rather than SiLU-gated (llama.cpp ignores the key).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "shared/model/ggml_dequant.h"
#include "shared/model/gguf.h"
#include "shared/model/model.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

// llama.cpp's llama_ftype values for general.file_type.
uint32_t FileType(const GgufConvertOptions& o) {
  switch (o.mix) {
    case KQuantMix::kQ4_K_S:
      return 14;  // LLAMA_FTYPE_MOSTLY_Q4_K_S
    case KQuantMix::kQ4_K_M:
      return 15;
    case KQuantMix::kQ5_K_S:
      return 16;
    case KQuantMix::kQ5_K_M:
      return 17;
    case KQuantMix::kQ6_K:
      return 18;
    case KQuantMix::kNone:
      break;
  }
  switch (o.type) {
    case GgmlType::kF32:
      return 0;  // LLAMA_FTYPE_ALL_F32
    case GgmlType::kF16:
      return 1;  // LLAMA_FTYPE_MOSTLY_F16
    case GgmlType::kQ4_0:
      return 2;  // LLAMA_FTYPE_MOSTLY_Q4_0
    case GgmlType::kQ8_0:
      return 7;  // LLAMA_FTYPE_MOSTLY_Q8_0
    default:
      return 0;
  }
}

// llama.cpp's LLM_TYPE_70B, which raises a K mix's attn_v: 80 layers with grouped-query attention.
bool IsSeventyB(int n_layers, int n_heads, int n_kv_heads) {
  return n_layers == 80 && n_heads != n_kv_heads;
}

// The layer of a blk.N.* tensor name; -1 for the others.
int LayerOf(const std::string& name) {
  int layer = -1;
  if (std::sscanf(name.c_str(), "blk.%d.", &layer) != 1) return -1;
  return layer;
}

struct SentencePieceVocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  bool add_dummy_prefix = true;
};

// A minimal protobuf wire-format reader: just enough of sentencepiece_model.proto (pieces and
// normalizer_spec.add_dummy_prefix) to copy a tokenizer.model's vocabulary.
class WireReader {
 public:
  explicit WireReader(absl::string_view b) : p_(b.data()), end_(b.data() + b.size()) {}
  bool done() const { return p_ == end_; }
  // Reads the next field; `bytes` is set for length-delimited fields, `value` for the others.
  bool Next(int* field, int* wire_type, uint64_t* value, absl::string_view* bytes) {
    uint64_t key;
    if (!Varint(&key)) return false;
    *field = static_cast<int>(key >> 3);
    *wire_type = static_cast<int>(key & 7);
    switch (*wire_type) {
      case 0:
        return Varint(value);
      case 1:
        return Fixed(8, value);
      case 5:
        return Fixed(4, value);
      case 2: {
        uint64_t len;
        if (!Varint(&len) || len > static_cast<uint64_t>(end_ - p_)) return false;
        *bytes = absl::string_view(p_, len);
        p_ += len;
        return true;
      }
      default:
        return false;
    }
  }

 private:
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) return false;
      const uint8_t b = static_cast<uint8_t>(*p_++);
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (b < 0x80) return true;
    }
    return false;
  }
  bool Fixed(int n, uint64_t* v) {
    if (end_ - p_ < n) return false;
    *v = 0;
    std::memcpy(v, p_, n);
    p_ += n;
    return true;
  }
  const char* p_;
  const char* end_;
};

absl::StatusOr<SentencePieceVocab> ReadSentencePieceVocab(const std::string& path) {
  ASSIGN_OR_RETURN(std::string proto, ReadFileToString(path));
  auto bad = [&]() {
    return absl::InvalidArgumentError(absl::StrCat(path, ": malformed sentencepiece model"));
  };
  SentencePieceVocab v;
  WireReader top(proto);
  int field, wt;
  uint64_t value;
  absl::string_view bytes;
  while (!top.done()) {
    if (!top.Next(&field, &wt, &value, &bytes)) return bad();
    if (field == 1 && wt == 2) {  // ModelProto.pieces
      WireReader piece(bytes);
      std::string text;
      float score = 0;
      int32_t type = 1;  // NORMAL
      while (!piece.done()) {
        if (!piece.Next(&field, &wt, &value, &bytes)) return bad();
        if (field == 1 && wt == 2) text = std::string(bytes);
        if (field == 2 && wt == 5) {
          const uint32_t bits = static_cast<uint32_t>(value);
          std::memcpy(&score, &bits, 4);
        }
        if (field == 3 && wt == 0) type = static_cast<int32_t>(value);
      }
      v.tokens.push_back(std::move(text));
      v.scores.push_back(score);
      v.types.push_back(type);
    } else if (field == 3 && wt == 2) {  // ModelProto.normalizer_spec
      WireReader spec(bytes);
      while (!spec.done()) {
        if (!spec.Next(&field, &wt, &value, &bytes)) return bad();
        if (field == 3 && wt == 0) v.add_dummy_prefix = value != 0;
      }
    }
  }
  if (v.tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no pieces"));
  return v;
}

struct BpeVocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
  std::string pre;  // llama.cpp's pre-tokenizer name
};

// The byte-level BPE vocabulary of a tokenizer.json, laid out as llama.cpp's converter does:
// added special tokens are CONTROL (3), other added tokens USER_DEFINED (4), ids without a token
// "[PADn]" (USER_DEFINED), up to `vocab_size` entries.
absl::StatusOr<BpeVocab> ReadByteLevelBpeVocab(const std::string& path, int vocab_size) {
  using nlohmann::json;
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  auto bad = [&](absl::string_view msg) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", msg));
  };
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (!j.contains("model") || !j["model"].is_object() || j["model"]["type"] != "BPE" ||
      !j["model"].contains("vocab") || !j["model"]["vocab"].is_object() ||
      !j["model"].contains("merges") || !j["model"]["merges"].is_array()) {
    return absl::UnimplementedError(
        absl::StrCat(path, ": only BPE models with vocab and merges are converted"));
  }
  BpeVocab v;
  // Pre-tokenizer: LoadHuggingFaceModel has already accepted this file, whose pre-tokenizer is
  // then either Llama-3's (a Split with its regex, then ByteLevel) or GPT-2's (ByteLevel alone).
  const std::string dump = j.contains("pre_tokenizer") ? j["pre_tokenizer"].dump() : "null";
  // Llama-3's split takes up to three digits at a time, Qwen2's one (llama.cpp's "qwen2").
  v.pre = dump.find("\"Split\"") == std::string::npos   ? "gpt2"
          : dump.find("p{N}{1,3}") != std::string::npos ? "llama-bpe"
                                                        : "qwen2";
  v.tokens.assign(vocab_size, "");
  v.types.assign(vocab_size, 1);
  std::vector<bool> seen(vocab_size, false);
  auto put = [&](const std::string& token, const json& id, int type) -> absl::Status {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size) {
      return bad(absl::StrCat("token '", token, "' has an id outside the model's ", vocab_size,
                              " embeddings"));
    }
    v.tokens[id.get<int64_t>()] = token;
    v.types[id.get<int64_t>()] = type;
    seen[id.get<int64_t>()] = true;
    return absl::OkStatus();
  };
  for (const auto& [token, id] : j["model"]["vocab"].items()) RETURN_IF_ERROR(put(token, id, 1));
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const json& a : j["added_tokens"]) {
      if (!a.is_object() || !a.contains("content") || !a["content"].is_string() ||
          !a.contains("id")) {
        return bad("malformed added_tokens entry");
      }
      RETURN_IF_ERROR(
          put(a["content"], a["id"], a.contains("special") && a["special"] == true ? 3 : 4));
    }
  }
  for (int i = 0; i < vocab_size; ++i) {
    if (!seen[i]) {
      v.tokens[i] = absl::StrCat("[PAD", i, "]");
      v.types[i] = 4;
    }
  }
  for (const json& m : j["model"]["merges"]) {
    if (m.is_string()) {
      v.merges.push_back(m);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      v.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    } else {
      return bad("malformed merge");
    }
  }
  return v;
}

// Converts (and row-permutes) one tensor into `type` when the Producer runs.
GgufWriter::Producer Converter(TensorView src, GgmlType type,
                               std::function<int64_t(int64_t)> row_of) {
  return [src, type, row_of]() -> absl::StatusOr<std::string> {
    const int64_t rows = src.rows(), cols = src.cols();
    const GgmlTypeTraits* tr = FindGgmlTypeTraits(static_cast<uint32_t>(type));
    const size_t out_row = static_cast<size_t>(cols / tr->block_size) * tr->type_size;
    std::string out(static_cast<size_t>(rows) * out_row, '\0');
    std::vector<float> tmp(cols);
    for (int64_t r = 0; r < rows; ++r) {
      DequantizeRow(src.dtype, src.row(row_of ? row_of(r) : r), tmp.data(), cols);
      RETURN_IF_ERROR(
          QuantizeGgmlRow(static_cast<uint32_t>(type), tmp.data(), out.data() + r * out_row, cols));
    }
    return out;
  };
}

// llama.cpp's `permute`: within each head of `head_dim` rows, stored row 2i comes from row i and
// stored row 2i+1 from row i + head_dim/2, which turns rotate-half RoPE into pairwise RoPE.
std::function<int64_t(int64_t)> RopePermutation(int head_dim) {
  return [head_dim](int64_t r) -> int64_t {
    const int64_t head = r / head_dim, i = r % head_dim;
    return head * head_dim + (i % 2) * (head_dim / 2) + i / 2;
  };
}

// The storage type of a weight: norms (1-D) stay F32; a K mix follows llama.cpp's choices; with
// q4_0 the output matrix (token_embd when tied) is Q8_0 (llama.cpp: Q6_K, which pinfer's CUDA
// module does not compute yet); rows that are not whole quantization blocks fall back to F16.
GgmlType WeightType(const GgufConvertOptions& o, const std::string& name,
                    const std::vector<int64_t>& shape, bool is_output, int n_layers, bool is_70b) {
  if (shape.size() == 1 || (shape.size() == 2 && shape[0] == 1)) return GgmlType::kF32;
  if (o.mix != KQuantMix::kNone) {
    return KMixTensorType(o.mix, name, shape.back(), n_layers, is_output, is_70b);
  }
  GgmlType type = o.type;
  if (is_output && o.type == GgmlType::kQ4_0) type = GgmlType::kQ8_0;
  if ((type == GgmlType::kQ8_0 || type == GgmlType::kQ4_0) && shape.back() % kQuantBlock != 0) {
    type = GgmlType::kF16;
  }
  return type;
}

absl::Status CheckOutputType(const GgufConvertOptions& o) {
  if (o.mix == KQuantMix::kNone && o.type != GgmlType::kF32 && o.type != GgmlType::kF16 &&
      o.type != GgmlType::kQ8_0 && o.type != GgmlType::kQ4_0) {
    return absl::InvalidArgumentError(
        "output type must be f32, f16, q8_0, q4_0 or a K mix (q4_k_s, q4_k_m, q5_k_s, q5_k_m, "
        "q6_k)");
  }
  return absl::OkStatus();
}

}  // namespace

GgmlType KMixTensorType(KQuantMix mix, const std::string& name, int64_t cols, int n_layers,
                        bool is_output, bool is_70b) {
  // llama.cpp's use_more_bits: the first and last eighth of the layers and every third between.
  auto more_bits = [n_layers](int i) {
    return i < n_layers / 8 || i >= 7 * n_layers / 8 || (i - n_layers / 8) % 3 == 2;
  };
  const bool medium = mix == KQuantMix::kQ4_K_M || mix == KQuantMix::kQ5_K_M;
  const int layer = LayerOf(name);
  GgmlType type = mix == KQuantMix::kQ6_K                                    ? GgmlType::kQ6_K
                  : (mix == KQuantMix::kQ5_K_S || mix == KQuantMix::kQ5_K_M) ? GgmlType::kQ5_K
                                                                             : GgmlType::kQ4_K;
  if (is_output) {
    type = cols % kSuperBlock != 0 ? GgmlType::kQ8_0 : GgmlType::kQ6_K;
  } else if (name == "token_embd.weight") {
    // the base type
  } else if (absl::StrContains(name, "attn_v.weight")) {
    if (medium && more_bits(layer)) {
      type = GgmlType::kQ6_K;
    } else if (mix == KQuantMix::kQ4_K_S && layer < 4) {
      type = GgmlType::kQ5_K;
    }
    // GQA 8:1 makes attn_v an eighth of attn_q's size: more bits cost little there.
    if (is_70b && type == GgmlType::kQ4_K) type = GgmlType::kQ5_K;
  } else if (absl::StrContains(name, "ffn_down")) {
    if (medium && more_bits(layer)) {
      type = GgmlType::kQ6_K;
    } else if (mix == KQuantMix::kQ4_K_S && layer < n_layers / 8) {
      type = GgmlType::kQ5_K;
    }
  }
  // Rows that are not whole blocks of the chosen type: llama.cpp's fallbacks.
  const GgmlTypeTraits* tr = FindGgmlTypeTraits(static_cast<uint32_t>(type));
  if (cols % tr->block_size != 0) {
    type = type == GgmlType::kQ4_K   ? GgmlType::kQ5_0
           : type == GgmlType::kQ5_K ? GgmlType::kQ5_1
                                     : GgmlType::kQ8_0;
    if (cols % kQuantBlock != 0) type = GgmlType::kF16;
  }
  return type;
}

absl::Status ParseConvertType(absl::string_view name, GgufConvertOptions* opts) {
  static const struct {
    absl::string_view name;
    GgmlType type;
    KQuantMix mix;
  } kTypes[] = {{"f32", GgmlType::kF32, KQuantMix::kNone},
                {"f16", GgmlType::kF16, KQuantMix::kNone},
                {"q8_0", GgmlType::kQ8_0, KQuantMix::kNone},
                {"q4_0", GgmlType::kQ4_0, KQuantMix::kNone},
                {"q4_k_s", GgmlType::kQ4_K, KQuantMix::kQ4_K_S},
                {"q4_k_m", GgmlType::kQ4_K, KQuantMix::kQ4_K_M},
                {"q5_k_s", GgmlType::kQ5_K, KQuantMix::kQ5_K_S},
                {"q5_k_m", GgmlType::kQ5_K, KQuantMix::kQ5_K_M},
                {"q6_k", GgmlType::kQ6_K, KQuantMix::kQ6_K}};
  for (const auto& t : kTypes) {
    if (absl::EqualsIgnoreCase(name, t.name)) {
      opts->type = t.type;
      opts->mix = t.mix;
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown type '", name,
      "': --type must be f16, q8_0, q4_0, f32, q4_k_s, q4_k_m, q5_k_s, q5_k_m or q6_k"));
}

absl::Status ConvertGgufToGguf(const std::string& in_path, const std::string& out_path,
                               const GgufConvertOptions& opts) {
  RETURN_IF_ERROR(CheckOutputType(opts));
  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> in,
                   GgufFile::Open(in_path, {kGgufMagic, kPowerInferMagic}));
  if (std::filesystem::weakly_canonical(in_path) == std::filesystem::weakly_canonical(out_path)) {
    return absl::InvalidArgumentError("the output file must differ from the input file");
  }
  GgufWriter w(in->magic());
  for (const GgufKeyValue& kv : in->metadata()) w.SetValue(kv.key, kv.value);
  w.SetU32("general.file_type", FileType(opts));
  if (!opts.name.empty()) w.SetString("general.name", opts.name);
  const bool tied = in->FindTensor("output.weight") == nullptr;
  // What llama.cpp's quantize counts to place a mix's higher-precision layers.
  int n_layers = 0;
  for (const GgufTensorInfo& t : in->tensors()) {
    if (absl::StrContains(t.name, "attn_v.weight")) ++n_layers;
  }
  const std::string arch = in->GetString("general.architecture").value_or("");
  const int n_heads = static_cast<int>(in->GetU32(arch + ".attention.head_count").value_or(0));
  const bool is_70b =
      IsSeventyB(n_layers, n_heads,
                 static_cast<int>(in->GetU32(arch + ".attention.head_count_kv").value_or(n_heads)));
  for (const GgufTensorInfo& t : in->tensors()) {
    auto view = GgufFile::ToTensorView(t);
    const bool is_matrix = t.ne.size() == 2 && t.ne[1] > 1;
    if (!view.ok() ||
        !is_matrix) {  // other types (index tensors...) and vectors: copied as they are
      RETURN_IF_ERROR(w.AddTensor(t.name, static_cast<GgmlType>(t.type), t.shape(),
                                  std::string(reinterpret_cast<const char*>(t.data), t.nbytes)));
      continue;
    }
    const bool is_output = t.name == "output.weight" || (tied && t.name == "token_embd.weight");
    const GgmlType type = WeightType(opts, t.name, view->shape, is_output, n_layers, is_70b);
    RETURN_IF_ERROR(w.AddTensor(t.name, type, view->shape, Converter(*view, type, nullptr)));
  }
  return w.WriteFile(out_path);
}

absl::Status ConvertHuggingFaceToGguf(const std::string& hf_dir, const std::string& out_path,
                                      const GgufConvertOptions& opts) {
  namespace fs = std::filesystem;
  RETURN_IF_ERROR(CheckOutputType(opts));
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadHuggingFaceModel(hf_dir));
  const ModelConfig& c = model->config;
  const fs::path spm_path = fs::path(hf_dir) / "tokenizer.model";
  const fs::path json_path = fs::path(hf_dir) / "tokenizer.json";
  std::optional<BpeVocab> bpe;
  SentencePieceVocab vocab;
  if (fs::exists(spm_path)) {
    ASSIGN_OR_RETURN(vocab, ReadSentencePieceVocab(spm_path.string()));
  } else if (fs::exists(json_path)) {
    ASSIGN_OR_RETURN(bpe, ReadByteLevelBpeVocab(json_path.string(), c.vocab_size));
  } else {
    return absl::UnimplementedError(
        absl::StrCat(hf_dir, ": no tokenizer.model or tokenizer.json to take the vocabulary from"));
  }
  if (!bpe && static_cast<int>(vocab.tokens.size()) > c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.model has ", vocab.tokens.size(),
                                                   " pieces but the model only ", c.vocab_size,
                                                   " embeddings"));
  }
  // Embedding rows beyond the tokenizer are padding (llama.cpp names them [PADn], unused).
  for (int i = static_cast<int>(vocab.tokens.size()); !bpe && i < c.vocab_size; ++i) {
    vocab.tokens.push_back(absl::StrCat("[PAD", i, "]"));
    vocab.scores.push_back(-1000.f);
    vocab.types.push_back(5);
  }
  int unk_id = 0;
  for (size_t i = 0; i < vocab.types.size(); ++i) {
    if (vocab.types[i] == 2) {
      unk_id = static_cast<int>(i);
      break;
    }
  }
  bool add_bos = c.add_bos, add_eos = false;
  std::string chat_template;
  if (auto tc = ReadFileToString((fs::path(hf_dir) / "tokenizer_config.json").string()); tc.ok()) {
    nlohmann::json j = nlohmann::json::parse(*tc, nullptr, false);
    if (j.is_object()) {
      if (j.contains("add_bos_token") && j["add_bos_token"].is_boolean())
        add_bos = j["add_bos_token"];
      if (j.contains("add_eos_token") && j["add_eos_token"].is_boolean())
        add_eos = j["add_eos_token"];
      if (j.contains("chat_template") && j["chat_template"].is_string())
        chat_template = j["chat_template"];
      // The list form of named templates: the "default" one (as transformers picks it).
      if (j.contains("chat_template") && j["chat_template"].is_array()) {
        for (const auto& named : j["chat_template"]) {
          if (named.is_object() && named.contains("name") && named["name"] == "default" &&
              named.contains("template") && named["template"].is_string())
            chat_template = named["template"];
        }
      }
    }
  }
  // A chat_template.jinja beside it is what transformers reads first.
  if (auto jinja = ReadFileToString((fs::path(hf_dir) / "chat_template.jinja").string());
      jinja.ok())
    chat_template = *jinja;

  GgufWriter w;
  std::string name = opts.name;
  if (name.empty()) name = fs::path(hf_dir).lexically_normal().filename().string();
  if (name.empty()) name = fs::path(hf_dir).lexically_normal().parent_path().filename().string();
  // qwen2 is llama.cpp's name for Qwen2/2.5; its keys are the llama ones under "qwen2.".
  const std::string arch = c.architecture == "qwen2" ? "qwen2" : "llama";
  w.SetString("general.architecture", arch);
  w.SetString("general.name", name);
  w.SetU32("general.file_type", FileType(opts));
  w.SetU32("general.quantization_version", 2);  // GGML_QNT_VERSION
  w.SetU32(arch + ".vocab_size", static_cast<uint32_t>(c.vocab_size));
  w.SetU32(arch + ".context_length", static_cast<uint32_t>(c.max_context));
  w.SetU32(arch + ".embedding_length", static_cast<uint32_t>(c.hidden_size));
  w.SetU32(arch + ".block_count", static_cast<uint32_t>(c.n_layers));
  w.SetU32(arch + ".feed_forward_length", static_cast<uint32_t>(c.ffn_size));
  w.SetU32(arch + ".rope.dimension_count", static_cast<uint32_t>(c.head_dim));
  w.SetU32(arch + ".attention.head_count", static_cast<uint32_t>(c.n_heads));
  w.SetU32(arch + ".attention.head_count_kv", static_cast<uint32_t>(c.n_kv_heads));
  w.SetU32(arch + ".attention.key_length", static_cast<uint32_t>(c.head_dim));
  w.SetU32(arch + ".attention.value_length", static_cast<uint32_t>(c.head_dim));
  w.SetF32(arch + ".attention.layer_norm_rms_epsilon", c.norm_eps);
  w.SetF32(arch + ".rope.freq_base", c.rope_theta);
  if (c.sliding_window > 0) {
    w.SetU32(arch + ".attention.sliding_window", static_cast<uint32_t>(c.sliding_window));
  }
  w.SetString("pinfer.hidden_act", ActivationName(c.activation));
  if (bpe) {
    w.SetString("tokenizer.ggml.model", "gpt2");
    w.SetString("tokenizer.ggml.pre", bpe->pre);
    w.SetStringArray("tokenizer.ggml.tokens", bpe->tokens);
    w.SetI32Array("tokenizer.ggml.token_type", bpe->types);
    w.SetStringArray("tokenizer.ggml.merges", bpe->merges);
  } else {
    w.SetString("tokenizer.ggml.model", "llama");
    w.SetStringArray("tokenizer.ggml.tokens", vocab.tokens);
    w.SetF32Array("tokenizer.ggml.scores", vocab.scores);
    w.SetI32Array("tokenizer.ggml.token_type", vocab.types);
  }
  w.SetU32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(c.bos_id));
  w.SetU32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(c.eos_id));
  if (!bpe) w.SetU32("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(unk_id));
  w.SetBool("tokenizer.ggml.add_bos_token", add_bos);
  w.SetBool("tokenizer.ggml.add_eos_token", add_eos);
  if (!bpe) w.SetBool("tokenizer.ggml.add_space_prefix", vocab.add_dummy_prefix);
  if (!chat_template.empty()) w.SetString("tokenizer.chat_template", chat_template);

  const bool is_70b = IsSeventyB(c.n_layers, c.n_heads, c.n_kv_heads);
  auto add = [&](const std::string& gguf_name, const TensorView& t, bool is_output,
                 std::function<int64_t(int64_t)> row_of = nullptr) -> absl::Status {
    const GgmlType type = WeightType(opts, gguf_name, t.shape, is_output, c.n_layers, is_70b);
    std::vector<int64_t> shape = t.shape;
    if (shape.size() == 2 && shape[0] == 1) shape.erase(shape.begin());
    return w.AddTensor(gguf_name, type, shape, Converter(t, type, std::move(row_of)));
  };
  RETURN_IF_ERROR(add("token_embd.weight", model->tok_embeddings, c.tie_embeddings));
  if (c.rope_scaling.llama3) {
    // convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, in float32 like torch.
    const RopeScaling& s = c.rope_scaling;
    const double low_wavelen = s.original_max_position / s.low_freq_factor;
    const double high_wavelen = s.original_max_position / s.high_freq_factor;
    std::string factors;
    for (int i = 0; i < c.head_dim / 2; ++i) {
      const float freq = 1.f / std::pow(c.rope_theta, static_cast<float>(2 * i) / c.head_dim);
      const double wavelen = 2 * M_PI / freq;
      double f = 1;
      if (wavelen > low_wavelen) {
        f = s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = 1 / ((1 - smooth) / s.factor + smooth);
      }
      const float ff = static_cast<float>(f);
      factors.append(reinterpret_cast<const char*>(&ff), 4);
    }
    RETURN_IF_ERROR(w.AddTensor("rope_freqs.weight", GgmlType::kF32, {c.head_dim / 2}, factors));
  }
  RETURN_IF_ERROR(add("output_norm.weight", model->output_norm, false));
  if (!c.tie_embeddings) RETURN_IF_ERROR(add("output.weight", model->output, true));
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model->layers[l];
    const std::string p = absl::StrCat("blk.", l, ".");
    RETURN_IF_ERROR(add(p + "attn_norm.weight", L.attn_norm, false));
    // llama files rotate adjacent pairs (rows permuted); qwen2 files keep the rows and
    // llama.cpp rotates halves, as transformers does.
    auto rope_rows = arch == "llama" ? RopePermutation(c.head_dim) : nullptr;
    RETURN_IF_ERROR(add(p + "attn_q.weight", L.wq, false, rope_rows));
    RETURN_IF_ERROR(add(p + "attn_k.weight", L.wk, false, rope_rows));
    RETURN_IF_ERROR(add(p + "attn_v.weight", L.wv, false));
    if (c.qkv_bias) {
      RETURN_IF_ERROR(add(p + "attn_q.bias", L.bq, false));
      RETURN_IF_ERROR(add(p + "attn_k.bias", L.bk, false));
      RETURN_IF_ERROR(add(p + "attn_v.bias", L.bv, false));
    }
    RETURN_IF_ERROR(add(p + "attn_output.weight", L.wo, false));
    RETURN_IF_ERROR(add(p + "ffn_norm.weight", L.ffn_norm, false));
    RETURN_IF_ERROR(add(p + "ffn_gate.weight", L.gate, false));
    RETURN_IF_ERROR(add(p + "ffn_up.weight", L.up, false));
    RETURN_IF_ERROR(add(p + "ffn_down.weight", L.down, false));
  }
  return w.WriteFile(out_path);
}

}  // namespace pinfer
