// Hugging Face LlamaForCausalLM directories: config.json plus model.safetensors or a sharded
// model.safetensors.index.json. Safetensors files are mapped, never copied: a tensor view points
// straight at its bytes in the mapping.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "shared/model/huggingface.h"
#include "shared/model/model.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

absl::Status ConfigError(absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: ", msg));
}

absl::StatusOr<int> GetInt(const json& j, const char* key, std::optional<int> fallback = {}) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return ConfigError(absl::StrCat("missing key '", key, "'"));
  }
  if (!it->is_number_integer()) return ConfigError(absl::StrCat("'", key, "' is not an integer"));
  int64_t v = it->get<int64_t>();
  if (v < INT32_MIN || v > INT32_MAX) return ConfigError(absl::StrCat("'", key, "' out of range"));
  return static_cast<int>(v);
}

absl::StatusOr<float> GetFloat(const json& j, const char* key, std::optional<float> fallback = {}) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return ConfigError(absl::StrCat("missing key '", key, "'"));
  }
  if (!it->is_number()) return ConfigError(absl::StrCat("'", key, "' is not a number"));
  // Converting an out-of-range double to float is undefined behaviour: check first.
  const double v = it->get<double>();
  if (!(std::fabs(v) <= 3.0e38)) return ConfigError(absl::StrCat("'", key, "' out of range"));
  return static_cast<float>(v);
}

}  // namespace

absl::StatusOr<ModelConfig> ParseHuggingFaceConfig(absl::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return ConfigError("not a JSON object");
  ModelConfig c;
  const std::string model_type = j.contains("model_type") && j["model_type"].is_string()
                                     ? j["model_type"].get<std::string>()
                                     : "llama";
  if (model_type != "llama" && model_type != "mistral" && model_type != "qwen2") {
    return ConfigError(absl::StrCat("unsupported model_type '", model_type,
                                    "' (pinfer loads llama, mistral and qwen2)"));
  }
  auto flag = [&](const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_boolean() && it->get<bool>();
  };
  if (model_type == "qwen2") {
    // Qwen2Attention always has q/k/v biases (and none on o_proj); its RoPE rotates halves, as
    // transformers' Llama does.
    c.architecture = "qwen2";
    c.qkv_bias = true;
    // Qwen2's window applies only to the layers from max_window_layers on (a per-layer window the
    // engine does not have), so it stays refused; Mistral's below applies to every layer.
    if (flag("use_sliding_window")) {
      return ConfigError("use_sliding_window (sliding-window attention) is not supported");
    }
  }
  // MistralForCausalLM is Llama's network with an optional sliding window. A window that covers
  // the whole context (or none, as from Mistral-7B-v0.2 on) changes nothing and is stored as 0,
  // so that a checkpoint and its GGUF agree whichever way the window was written.
  if (model_type == "mistral" && j.contains("sliding_window") && !j["sliding_window"].is_null()) {
    ASSIGN_OR_RETURN(int window, GetInt(j, "sliding_window"));
    ASSIGN_OR_RETURN(int context, GetInt(j, "max_position_embeddings", 2048));
    if (window <= 0) return ConfigError(absl::StrCat("sliding_window ", window, " must be > 0"));
    if (window < context) c.sliding_window = window;
  }
  // Llama's optional biases (o_proj included, or the MLP's) are not computed: refuse them by name
  // rather than ignore weights.
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (model_type != "qwen2" && flag(key)) {
      return ConfigError(absl::StrCat("'", key, "': true is not supported"));
    }
  }
  ASSIGN_OR_RETURN(c.vocab_size, GetInt(j, "vocab_size"));
  ASSIGN_OR_RETURN(c.hidden_size, GetInt(j, "hidden_size"));
  ASSIGN_OR_RETURN(c.n_layers, GetInt(j, "num_hidden_layers"));
  ASSIGN_OR_RETURN(c.n_heads, GetInt(j, "num_attention_heads"));
  ASSIGN_OR_RETURN(c.n_kv_heads, GetInt(j, "num_key_value_heads", c.n_heads));
  if (c.n_heads <= 0) return ConfigError("num_attention_heads must be > 0");
  ASSIGN_OR_RETURN(c.head_dim, GetInt(j, "head_dim", c.hidden_size / c.n_heads));
  ASSIGN_OR_RETURN(c.ffn_size, GetInt(j, "intermediate_size"));
  ASSIGN_OR_RETURN(c.max_context, GetInt(j, "max_position_embeddings", 2048));
  ASSIGN_OR_RETURN(c.norm_eps, GetFloat(j, "rms_norm_eps", 1e-6f));

  // RoPE: `rope_theta` at top level (transformers < 5) or inside `rope_parameters` (>= 5); Llama-3
  // scaling in `rope_scaling` or `rope_parameters`.
  const json* rope = nullptr;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
    rope = &j["rope_parameters"];
  ASSIGN_OR_RETURN(c.rope_theta, GetFloat(j, "rope_theta", 10000.f));
  if (rope != nullptr) {
    ASSIGN_OR_RETURN(c.rope_theta, GetFloat(*rope, "rope_theta", c.rope_theta));
  }
  const json* scaling = nullptr;
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) scaling = &j["rope_scaling"];
  if (scaling == nullptr && rope != nullptr) scaling = rope;
  if (scaling != nullptr) {
    std::string type;
    if (scaling->contains("rope_type") && (*scaling)["rope_type"].is_string()) {
      type = (*scaling)["rope_type"];
    } else if (scaling->contains("type") && (*scaling)["type"].is_string()) {
      type = (*scaling)["type"];
    }
    if (type == "llama3") {
      c.rope_scaling.llama3 = true;
      ASSIGN_OR_RETURN(c.rope_scaling.factor, GetFloat(*scaling, "factor"));
      ASSIGN_OR_RETURN(c.rope_scaling.low_freq_factor, GetFloat(*scaling, "low_freq_factor"));
      ASSIGN_OR_RETURN(c.rope_scaling.high_freq_factor, GetFloat(*scaling, "high_freq_factor"));
      ASSIGN_OR_RETURN(c.rope_scaling.original_max_position,
                       GetInt(*scaling, "original_max_position_embeddings"));
      const RopeScaling& s = c.rope_scaling;
      if (!(s.factor > 0) || !(s.low_freq_factor > 0) ||
          !(s.high_freq_factor > s.low_freq_factor) || s.original_max_position <= 0) {
        return ConfigError(
            "llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
            "original_max_position_embeddings > 0");
      }
    } else if (!type.empty() && type != "default") {
      return ConfigError(absl::StrCat("unsupported rope type '", type, "'"));
    }
  }

  std::string act = "silu";
  if (j.contains("hidden_act") && j["hidden_act"].is_string()) act = j["hidden_act"];
  if (act == "silu" || act == "swish") {
    c.activation = Activation::kSilu;
  } else if (act == "relu") {
    c.activation = Activation::kRelu;
  } else if (act == "drelu") {
    c.activation = Activation::kDRelu;
  } else {
    return ConfigError(absl::StrCat("unsupported hidden_act '", act, "'"));
  }
  if (j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean()) {
    c.tie_embeddings = j["tie_word_embeddings"];
  }
  if (j.contains("bos_token_id") && j["bos_token_id"].is_number_integer())
    c.bos_id = j["bos_token_id"];
  if (j.contains("eos_token_id")) {
    if (j["eos_token_id"].is_number_integer()) c.eos_id = j["eos_token_id"];
    if (j["eos_token_id"].is_array() && !j["eos_token_id"].empty() &&
        j["eos_token_id"][0].is_number_integer()) {
      c.eos_id = j["eos_token_id"][0];
    }
  }
  RETURN_IF_ERROR(c.Validate());
  if (c.bos_id < 0 || c.bos_id >= c.vocab_size || c.eos_id < 0 || c.eos_id >= c.vocab_size) {
    return ConfigError(absl::StrCat("bos_token_id ", c.bos_id, " or eos_token_id ", c.eos_id,
                                    " is outside the vocabulary of ", c.vocab_size));
  }
  return c;
}

absl::Status ParseSafetensors(std::shared_ptr<MappedFile> file,
                              std::map<std::string, TensorView>* out) {
  return ParseSafetensorsBytes(file->data(), file->size(), file->path(), out);
}

// Parses one safetensors file and adds its tensors (views into `data`) to `out`.
absl::Status ParseSafetensorsBytes(const uint8_t* data, size_t size, const std::string& path,
                                   std::map<std::string, TensorView>* out) {
  auto err = [&](absl::string_view msg) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", msg));
  };
  if (size < 8) return err("truncated safetensors header");
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);
  if (header_len > size - 8) return err("safetensors header length out of bounds");
  absl::string_view header(reinterpret_cast<const char*>(data + 8), header_len);
  json j = json::parse(header, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return err("safetensors header is not a JSON object");
  const uint8_t* base = data + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  for (auto& [name, info] : j.items()) {
    if (name == "__metadata__") continue;
    if (!info.is_object() || !info.contains("dtype") || !info["dtype"].is_string() ||
        !info.contains("shape") || !info["shape"].is_array() || !info.contains("data_offsets") ||
        !info["data_offsets"].is_array() || info["data_offsets"].size() != 2) {
      return err(absl::StrCat("tensor '", name, "': malformed entry"));
    }
    TensorView t;
    t.name = name;
    std::string dt = info["dtype"];
    if (dt == "F32") {
      t.dtype = DType::kF32;
    } else if (dt == "F16") {
      t.dtype = DType::kF16;
    } else if (dt == "BF16") {
      t.dtype = DType::kBF16;
    } else {
      return err(absl::StrCat("tensor '", name, "': unsupported dtype ", dt));
    }
    uint64_t numel = 1;
    for (auto& d : info["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (1ull << 32)) {
        return err(absl::StrCat("tensor '", name, "': bad shape"));
      }
      t.shape.push_back(d.get<int64_t>());
      numel *= d.get<uint64_t>();
      if (numel > (1ull << 40)) return err(absl::StrCat("tensor '", name, "': bad shape"));
    }
    if (t.shape.empty()) t.shape.push_back(1);
    auto& off = info["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return err(absl::StrCat("tensor '", name, "': bad data_offsets"));
    }
    uint64_t b = off[0], e = off[1];
    if (b > e || e > data_size) {
      return err(absl::StrCat("tensor '", name, "': data offsets out of bounds"));
    }
    if (e - b != numel * (t.dtype == DType::kF32 ? 4 : 2)) {
      return err(absl::StrCat("tensor '", name, "': byte size does not match shape"));
    }
    t.data = base + b;
    if (!out->emplace(name, std::move(t)).second) {
      return err(absl::StrCat("tensor '", name, "' appears in more than one shard"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Model>> LoadHuggingFaceModel(const std::string& dir) {
  auto model = std::make_unique<Model>();
  model->source_path = dir;
  model->format = "huggingface";
  ASSIGN_OR_RETURN(std::string config_text,
                   ReadFileToString((fs::path(dir) / "config.json").string()));
  ASSIGN_OR_RETURN(model->config, ParseHuggingFaceConfig(config_text));

  std::vector<std::string> shard_paths;
  fs::path single = fs::path(dir) / "model.safetensors";
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) {
    shard_paths.push_back(single.string());
  } else if (fs::exists(index)) {
    ASSIGN_OR_RETURN(std::string idx_text, ReadFileToString(index.string()));
    json idx = json::parse(idx_text, nullptr, false);
    if (idx.is_discarded() || !idx.contains("weight_map") || !idx["weight_map"].is_object()) {
      return absl::InvalidArgumentError("model.safetensors.index.json: missing weight_map");
    }
    std::set<std::string> shards;
    for (auto& [name, shard] : idx["weight_map"].items()) {
      if (!shard.is_string() || shard.get<std::string>().find('/') != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.safetensors.index.json: bad shard for '", name, "'"));
      }
      shards.insert(shard.get<std::string>());
    }
    for (auto& s : shards) shard_paths.push_back((fs::path(dir) / s).string());
  } else {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no model.safetensors or model.safetensors.index.json"));
  }
  std::map<std::string, TensorView> tensors;
  for (auto& p : shard_paths) {
    ASSIGN_OR_RETURN(auto file, MappedFile::Open(p));
    RETURN_IF_ERROR(ParseSafetensors(file, &tensors));
    model->files.push_back(std::move(file));
  }
  auto take = [&](const std::string& name, TensorView* dst) -> absl::Status {
    auto it = tensors.find(name);
    if (it == tensors.end())
      return absl::NotFoundError(absl::StrCat("missing tensor '", name, "'"));
    *dst = it->second;
    // safetensors does not promise alignment; the kernels read whole elements, so a tensor
    // whose data is not aligned to its element size gets an aligned copy.
    const size_t align = dst->dtype == DType::kF32 ? 4 : 2;
    if (reinterpret_cast<uintptr_t>(dst->data) % align != 0) {
      auto copy = std::make_shared<std::vector<uint8_t>>(dst->nbytes());
      std::memcpy(copy->data(), dst->data, copy->size());
      dst->data = copy->data();
      model->owned.push_back(std::move(copy));
    }
    return absl::OkStatus();
  };
  const ModelConfig& c = model->config;
  RETURN_IF_ERROR(take("model.embed_tokens.weight", &model->tok_embeddings));
  RETURN_IF_ERROR(take("model.norm.weight", &model->output_norm));
  if (tensors.count("lm_head.weight") && !c.tie_embeddings) {
    RETURN_IF_ERROR(take("lm_head.weight", &model->output));
  } else if (c.tie_embeddings || !tensors.count("lm_head.weight")) {
    if (!c.tie_embeddings) return absl::NotFoundError("missing tensor 'lm_head.weight'");
    model->output = model->tok_embeddings;
  }
  model->layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights& L = model->layers[l];
    RETURN_IF_ERROR(take(p + "input_layernorm.weight", &L.attn_norm));
    RETURN_IF_ERROR(take(p + "self_attn.q_proj.weight", &L.wq));
    RETURN_IF_ERROR(take(p + "self_attn.k_proj.weight", &L.wk));
    RETURN_IF_ERROR(take(p + "self_attn.v_proj.weight", &L.wv));
    RETURN_IF_ERROR(take(p + "self_attn.o_proj.weight", &L.wo));
    if (c.qkv_bias) {
      RETURN_IF_ERROR(take(p + "self_attn.q_proj.bias", &L.bq));
      RETURN_IF_ERROR(take(p + "self_attn.k_proj.bias", &L.bk));
      RETURN_IF_ERROR(take(p + "self_attn.v_proj.bias", &L.bv));
    }
    RETURN_IF_ERROR(take(p + "post_attention_layernorm.weight", &L.ffn_norm));
    RETURN_IF_ERROR(take(p + "mlp.gate_proj.weight", &L.gate));
    RETURN_IF_ERROR(take(p + "mlp.up_proj.weight", &L.up));
    RETURN_IF_ERROR(take(p + "mlp.down_proj.weight", &L.down));
  }
  RETURN_IF_ERROR(ValidateModelShapes(*model));
  auto tok = LoadHuggingFaceTokenizer(dir);
  if (tok.ok()) {
    if ((*tok)->vocab_size() > c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, ": the tokenizer has ", (*tok)->vocab_size(),
                       " tokens but the model only ", c.vocab_size, " embeddings"));
    }
    model->tokenizer = std::move(*tok);
  } else if (!absl::IsNotFound(tok.status())) {
    return tok.status();
  }
  return model;
}

}  // namespace pinfer
