// Malformed Hugging Face directories: every broken config.json, safetensors file and shard index
// gives its specific error. A small random llama is written in the test (its own safetensors
// encoder), then damaged one way at a time.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/ops.h"
#include "shared/engine/transformer.h"
#include "shared/model/huggingface.h"
#include "shared/model/model.h"

namespace pinfer {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using json = nlohmann::json;

json TinyConfig() {
  return {{"model_type", "llama"},       {"vocab_size", 40},         {"hidden_size", 32},
          {"num_hidden_layers", 2},      {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"intermediate_size", 64},     {"rms_norm_eps", 1e-5},     {"hidden_act", "silu"},
          {"tie_word_embeddings", false}};
}

struct Tensor {
  std::vector<int64_t> shape;
  std::string dtype = "F32";
};

std::map<std::string, Tensor> TinyTensors() {
  std::map<std::string, Tensor> t = {{"model.embed_tokens.weight", {{40, 32}}},
                                     {"model.norm.weight", {{32}}},
                                     {"lm_head.weight", {{40, 32}}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t[p + "input_layernorm.weight"] = {{32}};
    t[p + "self_attn.q_proj.weight"] = {{32, 32}};
    t[p + "self_attn.k_proj.weight"] = {{16, 32}};
    t[p + "self_attn.v_proj.weight"] = {{16, 32}};
    t[p + "self_attn.o_proj.weight"] = {{32, 32}};
    t[p + "post_attention_layernorm.weight"] = {{32}};
    t[p + "mlp.gate_proj.weight"] = {{64, 32}};
    t[p + "mlp.up_proj.weight"] = {{64, 32}};
    t[p + "mlp.down_proj.weight"] = {{32, 64}};
  }
  return t;
}

// Encodes tensors as safetensors with deterministic random values. `pad` extra header bytes
// (spaces) move the data section, e.g. off its natural alignment.
std::string Safetensors(const std::map<std::string, Tensor>& tensors, size_t pad = 0) {
  json header = json::object();
  std::string data;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0, 0.3f);
  for (const auto& [name, t] : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const size_t begin = data.size();
    for (int64_t i = 0; i < n; ++i) {
      float v = dist(rng);
      data.append(reinterpret_cast<const char*>(&v), 4);
    }
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8 + pad, ' ');
  std::string out(8, '\0');
  const uint64_t len = h.size();
  std::memcpy(out.data(), &len, 8);
  return out + h + data;
}

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/hf_loader_test/" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

std::string MakeDir(const std::string& name, const json& config, const std::string& safetensors) {
  const std::string dir = TempDir(name);
  Write(dir + "/config.json", config.dump());
  Write(dir + "/model.safetensors", safetensors);
  return dir;
}

void ExpectLoadError(const std::string& dir, absl::StatusCode code, const std::string& message) {
  auto m = LoadModel(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), code) << m.status();
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(message));
}

void ExpectConfigError(const json& config, const std::string& message) {
  auto c = ParseHuggingFaceConfig(config.dump());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(message));
}

std::vector<float> Logits(const Model& m) {
  auto ops = NewReferenceOps();
  Transformer t(m, *ops);
  KvCache cache(m.config, 4);
  std::vector<float> logits(m.config.vocab_size);
  std::vector<int32_t> ids = {1, 9, 17};
  EXPECT_TRUE(t.Forward(ids, 0, &cache, LogitsMode::kLast, logits.data()).ok());
  return logits;
}

TEST(HuggingFaceLoaderTest, ValidTinyModelLoads) {
  auto m = LoadModel(MakeDir("valid", TinyConfig(), Safetensors(TinyTensors())));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->config.head_dim, 8);
  EXPECT_EQ((*m)->tokenizer, nullptr);
  for (float v : Logits(**m)) EXPECT_TRUE(std::isfinite(v));
}

// safetensors does not align its data; a header of odd length must still give the same model.
TEST(HuggingFaceLoaderTest, MisalignedDataGivesTheSameModel) {
  auto aligned = LoadModel(MakeDir("aligned", TinyConfig(), Safetensors(TinyTensors())));
  auto odd = LoadModel(MakeDir("odd", TinyConfig(), Safetensors(TinyTensors(), 3)));
  ASSERT_TRUE(aligned.ok() && odd.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*odd)->layers[0].wq.data) % 4, 0u);
  EXPECT_EQ(Logits(**aligned), Logits(**odd));
}

// A Qwen2ForCausalLM directory: q/k/v biases, each one required by name and added to its
// projection (the logits move when a bias does).
TEST(HuggingFaceLoaderTest, Qwen2BiasesAreLoadedAndUsed) {
  json config = TinyConfig();
  config["model_type"] = "qwen2";
  auto tensors = TinyTensors();
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".self_attn.");
    tensors[p + "q_proj.bias"] = {{32}};
    tensors[p + "k_proj.bias"] = {{16}};
    tensors[p + "v_proj.bias"] = {{16}};
  }
  auto m = LoadModel(MakeDir("qwen2", config, Safetensors(tensors)));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->config.architecture, "qwen2");
  EXPECT_TRUE((*m)->config.qkv_bias);
  EXPECT_FALSE((*m)->config.rope_interleaved);
  const std::vector<float> with = Logits(**m);
  // The same weights with a zero k bias: the scores change, so the logits must.
  std::vector<float> zeros(16, 0.f);
  for (LayerWeights& L : (*m)->layers) {
    L.bk.data = zeros.data();
    L.bk.dtype = DType::kF32;
  }
  EXPECT_NE(Logits(**m), with);

  tensors.erase("model.layers.1.self_attn.v_proj.bias");
  ExpectLoadError(MakeDir("qwen2_no_bias", config, Safetensors(tensors)),
                  absl::StatusCode::kNotFound, "model.layers.1.self_attn.v_proj.bias");
  tensors["model.layers.1.self_attn.v_proj.bias"] = {{8}};
  ExpectLoadError(MakeDir("qwen2_bad_bias", config, Safetensors(tensors)),
                  absl::StatusCode::kInvalidArgument, "v_proj.bias");
}

TEST(HuggingFaceConfigTest, MalformedConfigs) {
  EXPECT_THAT(std::string(ParseHuggingFaceConfig("{not json").status().message()),
              HasSubstr("config.json: not a JSON object"));
  EXPECT_THAT(std::string(ParseHuggingFaceConfig("[1, 2]").status().message()),
              HasSubstr("not a JSON object"));
  json c = TinyConfig();
  c.erase("hidden_size");
  ExpectConfigError(c, "config.json: missing key 'hidden_size'");
  c = TinyConfig();
  c["num_hidden_layers"] = "2";
  ExpectConfigError(c, "'num_hidden_layers' is not an integer");
  c = TinyConfig();
  c["vocab_size"] = 1ll << 40;
  ExpectConfigError(c, "'vocab_size' out of range");
  c = TinyConfig();
  c["rms_norm_eps"] = 1e300;
  ExpectConfigError(c, "'rms_norm_eps' out of range");
  c = TinyConfig();
  c["rms_norm_eps"] = "small";
  ExpectConfigError(c, "'rms_norm_eps' is not a number");
  c = TinyConfig();
  c["model_type"] = "gpt_neox";
  ExpectConfigError(c, "unsupported model_type 'gpt_neox' (pinfer loads llama, mistral and qwen2)");
  c = TinyConfig();
  c["model_type"] = "mistral";
  c["max_position_embeddings"] = 32768;
  c["sliding_window"] = 4096;  // Mistral-7B-v0.1: a window shorter than the context
  auto windowed = ParseHuggingFaceConfig(c.dump());
  ASSERT_TRUE(windowed.ok()) << windowed.status();
  EXPECT_EQ(windowed->sliding_window, 4096);
  EXPECT_EQ(windowed->architecture, "llama");
  c["sliding_window"] = "wide";
  ExpectConfigError(c, "'sliding_window' is not an integer");
  c["sliding_window"] = 0;
  ExpectConfigError(c, "sliding_window 0 must be > 0");
  c["sliding_window"] = nullptr;  // Mistral-7B-v0.2 and later: Llama's network
  auto unwindowed = ParseHuggingFaceConfig(c.dump());
  ASSERT_TRUE(unwindowed.ok()) << unwindowed.status();
  EXPECT_EQ(unwindowed->sliding_window, 0);
  c["sliding_window"] = 32768;  // covers the context: no window
  unwindowed = ParseHuggingFaceConfig(c.dump());
  ASSERT_TRUE(unwindowed.ok()) << unwindowed.status();
  EXPECT_EQ(unwindowed->sliding_window, 0);
  c["model_type"] = "llama";  // only Mistral's sliding_window means a window
  c["sliding_window"] = 4096;
  unwindowed = ParseHuggingFaceConfig(c.dump());
  ASSERT_TRUE(unwindowed.ok()) << unwindowed.status();
  EXPECT_EQ(unwindowed->sliding_window, 0);
  c = TinyConfig();
  c["model_type"] = "qwen2";
  c["use_sliding_window"] = "yes";  // not a boolean: not a window either, and no exception
  EXPECT_TRUE(ParseHuggingFaceConfig(c.dump()).ok());
  c = TinyConfig();
  c["model_type"] = "qwen2";
  c["use_sliding_window"] = true;
  ExpectConfigError(c, "use_sliding_window (sliding-window attention) is not supported");
  c = TinyConfig();
  c["attention_bias"] = true;
  ExpectConfigError(c, "'attention_bias': true is not supported");
  c = TinyConfig();
  c["mlp_bias"] = true;
  ExpectConfigError(c, "'mlp_bias': true is not supported");
  c = TinyConfig();
  c["hidden_act"] = "gelu";
  ExpectConfigError(c, "unsupported hidden_act 'gelu'");
  c = TinyConfig();
  c["num_attention_heads"] = 0;
  ExpectConfigError(c, "num_attention_heads must be > 0");
  c = TinyConfig();
  c["num_key_value_heads"] = 3;
  ExpectConfigError(c, "num_attention_heads 4 is not a multiple of num_key_value_heads 3");
  c = TinyConfig();
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  ExpectConfigError(c, "unsupported rope type 'yarn'");
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  ExpectConfigError(c, "missing key 'low_freq_factor'");
  c["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 4.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  ExpectConfigError(c, "0 < low_freq_factor < high_freq_factor");
  c = TinyConfig();
  c["rope_theta"] = -1;
  ExpectConfigError(c, "rms_norm_eps and rope_theta must be > 0");
  c = TinyConfig();
  c["bos_token_id"] = 40;
  ExpectConfigError(c, "bos_token_id 40 or eos_token_id 2 is outside the vocabulary of 40");
  c = TinyConfig();
  c["head_dim"] = 7;
  ExpectConfigError(c, "invalid head_dim = 7");
}

TEST(HuggingFaceLoaderTest, MissingFiles) {
  const std::string empty = TempDir("empty");
  ExpectLoadError(empty, absl::StatusCode::kNotFound, "cannot open");
  const std::string no_weights = TempDir("no_weights");
  Write(no_weights + "/config.json", TinyConfig().dump());
  ExpectLoadError(no_weights, absl::StatusCode::kNotFound,
                  "no model.safetensors or model.safetensors.index.json");
}

TEST(HuggingFaceLoaderTest, MalformedSafetensors) {
  const json config = TinyConfig();
  ExpectLoadError(MakeDir("short", config, "abc"), absl::StatusCode::kInvalidArgument,
                  "truncated safetensors header");
  std::string huge(8, '\xff');
  ExpectLoadError(MakeDir("huge_header", config, huge + "{}"), absl::StatusCode::kInvalidArgument,
                  "safetensors header length out of bounds");
  std::string bad_json = Safetensors(TinyTensors());
  bad_json[8] = '[';
  ExpectLoadError(MakeDir("bad_json", config, bad_json), absl::StatusCode::kInvalidArgument,
                  "safetensors header is not a JSON object");

  auto with_header = [](const json& header, size_t data_bytes) {
    std::string h = header.dump();
    std::string out(8, '\0');
    const uint64_t len = h.size();
    std::memcpy(out.data(), &len, 8);
    return out + h + std::string(data_bytes, '\0');
  };
  json entry = {{"dtype", "F32"}, {"shape", {2, 2}}, {"data_offsets", {0, 16}}};
  json h = {{"t", entry}};
  h["t"].erase("dtype");
  ExpectLoadError(MakeDir("no_dtype", config, with_header(h, 16)),
                  absl::StatusCode::kInvalidArgument, "tensor 't': malformed entry");
  h = {{"t", entry}};
  h["t"]["dtype"] = "I8";
  ExpectLoadError(MakeDir("dtype", config, with_header(h, 16)), absl::StatusCode::kInvalidArgument,
                  "tensor 't': unsupported dtype I8");
  h = {{"t", entry}};
  h["t"]["shape"] = {2, -2};
  ExpectLoadError(MakeDir("neg_shape", config, with_header(h, 16)),
                  absl::StatusCode::kInvalidArgument, "tensor 't': bad shape");
  h = {{"t", entry}};
  h["t"]["shape"] = {1ll << 31, 1ll << 31};
  ExpectLoadError(MakeDir("big_shape", config, with_header(h, 16)),
                  absl::StatusCode::kInvalidArgument, "tensor 't': bad shape");
  h = {{"t", entry}};
  h["t"]["data_offsets"] = {0, 17};
  ExpectLoadError(MakeDir("oob", config, with_header(h, 16)), absl::StatusCode::kInvalidArgument,
                  "tensor 't': data offsets out of bounds");
  h["t"]["data_offsets"] = {8, 4};
  ExpectLoadError(MakeDir("reversed", config, with_header(h, 16)),
                  absl::StatusCode::kInvalidArgument, "tensor 't': data offsets out of bounds");
  h["t"]["data_offsets"] = {0, 12};
  ExpectLoadError(MakeDir("size", config, with_header(h, 16)), absl::StatusCode::kInvalidArgument,
                  "tensor 't': byte size does not match shape");
  h["t"]["data_offsets"] = {-1, 12};
  ExpectLoadError(MakeDir("neg_offset", config, with_header(h, 16)),
                  absl::StatusCode::kInvalidArgument, "tensor 't': bad data_offsets");
}

// A zero extent is legal in safetensors; such a tensor holds no bytes (the fuzzer found nbytes()
// dividing by its zero column count).
TEST(HuggingFaceLoaderTest, ZeroExtentTensorsHoldNoBytes) {
  for (const json& shape : {json{4, 0}, json{0, 4}, json{0}}) {
    const json header = {{"t", {{"dtype", "F16"}, {"shape", shape}, {"data_offsets", {0, 0}}}}};
    std::string h = header.dump();
    std::string bytes(8, '\0');
    const uint64_t len = h.size();
    std::memcpy(bytes.data(), &len, 8);
    bytes += h;
    std::map<std::string, TensorView> tensors;
    ASSERT_TRUE(ParseSafetensorsBytes(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                      "zero.safetensors", &tensors)
                    .ok())
        << shape.dump();
    ASSERT_EQ(tensors.count("t"), 1u);
    EXPECT_EQ(tensors["t"].numel(), 0);
    EXPECT_EQ(tensors["t"].nbytes(), 0u) << shape.dump();
  }
}

TEST(HuggingFaceLoaderTest, MissingOrMisshapenTensors) {
  auto tensors = TinyTensors();
  tensors.erase("model.layers.1.mlp.up_proj.weight");
  ExpectLoadError(MakeDir("missing", TinyConfig(), Safetensors(tensors)),
                  absl::StatusCode::kNotFound,
                  "missing tensor 'model.layers.1.mlp.up_proj.weight'");
  tensors = TinyTensors();
  tensors.erase("lm_head.weight");
  ExpectLoadError(MakeDir("no_head", TinyConfig(), Safetensors(tensors)),
                  absl::StatusCode::kNotFound, "missing tensor 'lm_head.weight'");
  json tied = TinyConfig();
  tied["tie_word_embeddings"] = true;
  auto m = LoadModel(MakeDir("tied", tied, Safetensors(tensors)));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->output.data, (*m)->tok_embeddings.data);
  tensors = TinyTensors();
  tensors["model.layers.0.self_attn.k_proj.weight"].shape = {32, 32};
  ExpectLoadError(
      MakeDir("shape", TinyConfig(), Safetensors(tensors)), absl::StatusCode::kInvalidArgument,
      "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [32,32], expected [16,32]");
  json more_layers = TinyConfig();
  more_layers["num_hidden_layers"] = 3;
  ExpectLoadError(MakeDir("layers", more_layers, Safetensors(TinyTensors())),
                  absl::StatusCode::kNotFound,
                  "missing tensor 'model.layers.2.input_layernorm.weight'");
}

TEST(HuggingFaceLoaderTest, ShardedIndex) {
  auto all = TinyTensors();
  std::map<std::string, Tensor> a, b;
  json weight_map = json::object();
  int i = 0;
  for (const auto& [name, t] : all) {
    const bool first = i++ % 2 == 0;
    (first ? a : b)[name] = t;
    weight_map[name] =
        first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  const std::string dir = TempDir("sharded");
  Write(dir + "/config.json", TinyConfig().dump());
  Write(dir + "/model-00001-of-00002.safetensors", Safetensors(a));
  Write(dir + "/model-00002-of-00002.safetensors", Safetensors(b));
  Write(dir + "/model.safetensors.index.json", json({{"weight_map", weight_map}}).dump());
  auto m = LoadModel(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->files.size(), 2u);

  // The same tensor in two shards.
  Write(dir + "/model-00002-of-00002.safetensors", Safetensors(all));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, "appears in more than one shard");
  // A shard outside the directory, no weight_map, a missing shard.
  Write(dir + "/model.safetensors.index.json",
        json({{"weight_map", {{"x", "../model.safetensors"}}}}).dump());
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, "bad shard for 'x'");
  Write(dir + "/model.safetensors.index.json", json({{"metadata", {}}}).dump());
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, "missing weight_map");
  Write(dir + "/model.safetensors.index.json",
        json({{"weight_map", {{"x", "model-00003-of-00003.safetensors"}}}}).dump());
  ExpectLoadError(dir, absl::StatusCode::kNotFound, "model-00003-of-00003.safetensors");
}

}  // namespace
}  // namespace pinfer
