// `pinfer convert` on relu-llama-tiny: the F32 GGUF (llama.cpp's layout: Q/K rows permuted for
// pairwise RoPE) must give the Hugging Face directory's logits and the transformers reference's
// greedy tokens; Q8_0 and Q4_0 must stay within 1% and 6% of the reference held-out perplexity
// over the whole file; tied embeddings, Llama-3 RoPE scaling and Mistral's sliding window survive
// the round trip.
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/generator.h"
#include "shared/engine/ops.h"
#include "shared/engine/perplexity.h"
#include "shared/model/gguf.h"
#include "shared/model/model.h"
#include "shared/tokenizer/sentencepiece_wrapper.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const std::string kHfDir = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";

std::string TempDir() {
  const std::string dir = ::testing::TempDir() + "/convert_test";
  fs::create_directories(dir);
  return dir;
}

std::string Convert(GgmlType type, const std::string& name, const std::string& hf_dir = kHfDir) {
  const std::string out = TempDir() + "/" + name;
  GgufConvertOptions opts;
  opts.type = type;
  absl::Status st = ConvertHuggingFaceToGguf(hf_dir, out, opts);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

nlohmann::json& Reference() {
  static nlohmann::json* ref = [] {
    std::ifstream in(kHfDir + "/reference.json");
    return new nlohmann::json(nlohmann::json::parse(in));
  }();
  return *ref;
}

// Logits at the last position of `ids`.
std::vector<float> LastLogits(const Model& m, const CpuOps& ops, const std::vector<int32_t>& ids) {
  Transformer t(m, ops);
  KvCache cache(m.config, static_cast<int>(ids.size()));
  std::vector<float> logits(m.config.vocab_size);
  absl::Status st = t.Forward(ids, 0, &cache, LogitsMode::kLast, logits.data());
  EXPECT_TRUE(st.ok()) << st;
  return logits;
}

// max |a - b| / max |b|
float RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  float max_abs = 0, max_err = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    max_abs = std::max(max_abs, std::fabs(b[i]));
    max_err = std::max(max_err, std::fabs(a[i] - b[i]));
  }
  return max_err / max_abs;
}

TEST(ConvertTest, F32GgufMatchesHuggingFaceAndTransformers) {
  const std::string path = Convert(GgmlType::kF32, "tiny-f32.gguf");
  auto gguf = LoadModel(path);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  auto hf = LoadModel(kHfDir);
  ASSERT_TRUE(hf.ok()) << hf.status();
  const ModelConfig& c = (*gguf)->config;
  EXPECT_EQ((*gguf)->format, "gguf");
  EXPECT_TRUE(c.rope_interleaved);
  EXPECT_FALSE((*hf)->config.rope_interleaved);
  EXPECT_EQ(c.activation, Activation::kRelu);
  EXPECT_EQ(c.n_heads, 6);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 4096);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_FALSE(c.tie_embeddings);

  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  Transformer transformer(**gguf, *ops);
  ASSERT_EQ(Reference()["prompts"].size(), 12u);
  for (const auto& p : Reference()["prompts"]) {
    const std::string prompt = p["prompt"];
    SCOPED_TRACE(prompt);
    // The vocabulary copied into the GGUF tokenizes like transformers.
    auto ids = (*gguf)->tokenizer->Encode(prompt);
    ASSERT_TRUE(ids.ok());
    std::vector<int32_t> input = {c.bos_id};
    input.insert(input.end(), ids->begin(), ids->end());
    ASSERT_EQ(input, p["input_ids"].get<std::vector<int32_t>>());

    // Interleaved RoPE on permuted rows == rotate-half RoPE on the original rows.
    const std::vector<float> a = LastLogits(**gguf, *ops, input);
    const std::vector<float> b = LastLogits(**hf, *ops, input);
    EXPECT_LE(RelativeError(a, b), 2e-6f);
    EXPECT_LE(RelativeError(a, p["last_logits"].get<std::vector<float>>()), 1e-3f);

    GenerateOptions opts;
    opts.max_new_tokens = 48;
    opts.stop_at_eos = false;
    auto result = Generate(transformer, *(*gguf)->tokenizer, input, opts, nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->ids, p["greedy_ids"].get<std::vector<int32_t>>());
  }
}

TEST(ConvertTest, WritesLlamaCppConventions) {
  const std::string f32 = Convert(GgmlType::kF32, "conv-f32.gguf");
  auto file = GgufFile::Open(f32);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(*f.GetString("general.architecture"), "llama");
  EXPECT_EQ(*f.GetString("general.name"), "relu-llama-tiny");
  EXPECT_EQ(*f.GetU32("general.file_type"), 0u);
  EXPECT_EQ(*f.GetU32("llama.block_count"), 6u);
  EXPECT_EQ(*f.GetU32("llama.attention.head_count_kv"), 2u);
  EXPECT_EQ(*f.GetU32("llama.rope.dimension_count"), 64u);
  EXPECT_EQ(*f.GetString("pinfer.hidden_act"), "relu");
  EXPECT_EQ(*f.GetString("tokenizer.ggml.model"), "llama");
  EXPECT_EQ(*f.GetU32("tokenizer.ggml.bos_token_id"), 1u);
  EXPECT_EQ(*f.GetU32("tokenizer.ggml.eos_token_id"), 2u);
  // Tokens, scores and types are libsentencepiece's view of tokenizer.model.
  std::ifstream in(kHfDir + "/tokenizer.model", std::ios::binary);
  std::string proto((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string error;
  auto sp = spm::Processor::Load(proto, &error);
  ASSERT_NE(sp, nullptr) << error;
  auto tokens = *f.GetStringArray("tokenizer.ggml.tokens");
  auto types = *f.GetI32Array("tokenizer.ggml.token_type");
  ASSERT_EQ(static_cast<int>(tokens.size()), sp->PieceSize());
  for (int id = 0; id < sp->PieceSize(); ++id) {
    EXPECT_EQ(tokens[id], sp->IdToPiece(id));
    const int want = sp->IsUnknown(id) ? 2 : sp->IsControl(id) ? 3 : sp->IsByte(id) ? 6 : 1;
    EXPECT_EQ(types[id], want) << id;
  }
  // Tensor names and layouts: output kept (untied), norms F32, Q/K rows permuted per head as
  // llama.cpp's permute does: stored row 2i (2i+1) of a head is its row i (i + head_dim/2).
  EXPECT_NE(f.FindTensor("output.weight"), nullptr);
  EXPECT_EQ(f.FindTensor("blk.5.ffn_down.weight")->ne, (std::vector<int64_t>{1536, 384}));
  auto hf = LoadModel(kHfDir);
  ASSERT_TRUE(hf.ok());
  for (const char* which : {"attn_q", "attn_k"}) {
    auto t = f.GetTensor(std::string("blk.3.") + which + ".weight");
    ASSERT_TRUE(t.ok());
    const TensorView& src =
        std::string(which) == "attn_q" ? (*hf)->layers[3].wq : (*hf)->layers[3].wk;
    ASSERT_EQ(t->shape, src.shape);
    for (int64_t r = 0; r < t->rows(); ++r) {
      const int64_t head = r / 64, i = r % 64;
      const int64_t from = head * 64 + (i % 2 == 0 ? i / 2 : i / 2 + 32);
      const float* got = reinterpret_cast<const float*>(t->row(r));
      const uint16_t* want = reinterpret_cast<const uint16_t*>(src.row(from));
      for (int64_t col = 0; col < 384; col += 37) ASSERT_EQ(got[col], Fp16ToFp32(want[col])) << r;
    }
  }

  const std::string q8 = Convert(GgmlType::kQ8_0, "conv-q8_0.gguf");
  const std::string q4 = Convert(GgmlType::kQ4_0, "conv-q4_0.gguf");
  auto f8 = GgufFile::Open(q8);
  auto f4 = GgufFile::Open(q4);
  ASSERT_TRUE(f8.ok() && f4.ok());
  EXPECT_EQ(*(*f8)->GetU32("general.file_type"), 7u);
  EXPECT_EQ(*(*f4)->GetU32("general.file_type"), 2u);
  for (const GgufTensorInfo& t : (*f8)->tensors()) {
    EXPECT_EQ(GgmlTypeName(t.type), t.ne.size() == 1 ? "F32" : "Q8_0") << t.name;
  }
  for (const GgufTensorInfo& t : (*f4)->tensors()) {
    const std::string want = t.ne.size() == 1 ? "F32" : t.name == "output.weight" ? "Q8_0" : "Q4_0";
    EXPECT_EQ(GgmlTypeName(t.type), want) << t.name;
  }
}

std::vector<int32_t> HeldOutTokens() {
  std::ifstream in(kHfDir + "/heldout-tokens.u32", std::ios::binary);
  std::vector<int32_t> tokens;
  uint32_t v;
  while (in.read(reinterpret_cast<char*>(&v), 4)) tokens.push_back(static_cast<int32_t>(v));
  return tokens;
}

void ExpectPerplexityWithin(GgmlType type, const std::string& name, double tolerance) {
  auto model = LoadModel(Convert(type, name));
  ASSERT_TRUE(model.ok()) << model.status();
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  Transformer transformer(**model, *ops);
  const std::vector<int32_t> tokens = HeldOutTokens();
  ASSERT_EQ(tokens.size(), 65024u);
  auto r = ComputePerplexity(transformer, tokens, 512);  // all 127 windows
  ASSERT_TRUE(r.ok()) << r.status();
  const double want = Reference()["heldout_ppl_512"];
  EXPECT_EQ(r->tokens_scored, Reference()["heldout_tokens"].get<int64_t>());
  std::printf("%s: perplexity %.4f, reference %.4f (%+.3f%%), %.1f s\n", name.c_str(),
              r->perplexity, want, 100 * (r->perplexity / want - 1), r->seconds);
  EXPECT_LE(std::fabs(r->perplexity / want - 1), tolerance);
}

TEST(ConvertTest, Q8_0PerplexityWithinOnePercent) {
  ExpectPerplexityWithin(GgmlType::kQ8_0, "ppl-q8_0.gguf", 0.01);
}

TEST(ConvertTest, Q4_0PerplexityWithinSixPercent) {
  ExpectPerplexityWithin(GgmlType::kQ4_0, "ppl-q4_0.gguf", 0.06);
}

// A copy of relu-llama-tiny with a changed config.json (weights and tokenizer linked).
std::string VariantDir(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  const std::string dir = TempDir() + "/" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* f : {"model.safetensors", "tokenizer.model"}) {
    fs::create_symlink(fs::absolute(kHfDir + "/" + f), dir + "/" + f);
  }
  std::ifstream in(kHfDir + "/config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  edit(config);
  std::ofstream(dir + "/config.json") << config.dump(2);
  return dir;
}

void ExpectSameLogits(const std::string& hf_dir, const std::string& gguf_path) {
  auto hf = LoadModel(hf_dir);
  auto gguf = LoadModel(gguf_path);
  ASSERT_TRUE(hf.ok()) << hf.status();
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  auto ops = NewSimdOps(nullptr);
  for (int i : {0, 7}) {
    const std::vector<int32_t> ids = Reference()["prompts"][i]["input_ids"];
    EXPECT_LE(RelativeError(LastLogits(**gguf, *ops, ids), LastLogits(**hf, *ops, ids)), 2e-6f);
  }
}

TEST(ConvertTest, TiedEmbeddingsRoundTrip) {
  const std::string dir =
      VariantDir("tied", [](nlohmann::json& c) { c["tie_word_embeddings"] = true; });
  const std::string path = Convert(GgmlType::kF32, "tied.gguf", dir);
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->FindTensor("output.weight"), nullptr);  // llama.cpp's convention for tied
  auto model = LoadModel(path);
  ASSERT_TRUE(model.ok());
  EXPECT_TRUE((*model)->config.tie_embeddings);
  ExpectSameLogits(dir, path);
}

TEST(ConvertTest, Llama3RopeScalingRoundTrip) {
  // Boundaries chosen so that, with head_dim 64 and theta 10000, some frequencies are kept, some
  // divided by `factor` and some blended.
  const std::string dir = VariantDir("llama3", [](nlohmann::json& c) {
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 256}};
  });
  const std::string path = Convert(GgmlType::kF32, "llama3.gguf", dir);
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok());
  const GgufTensorInfo* freqs = (*file)->FindTensor("rope_freqs.weight");
  ASSERT_NE(freqs, nullptr);
  EXPECT_EQ(freqs->ne, (std::vector<int64_t>{32}));
  auto gguf = LoadModel(path);
  auto hf = LoadModel(dir);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_TRUE((*gguf)->config.rope_scaling.llama3);
  EXPECT_FLOAT_EQ((*gguf)->config.rope_scaling.factor, 8.f);
  const std::vector<float> a = RopeInverseFrequencies((*gguf)->config);
  const std::vector<float> b = RopeInverseFrequencies((*hf)->config);
  int blended = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 1e-6f * b[i]) << i;
    const float base = std::pow(10000.f, -2.f * i / 64);
    blended += b[i] < base * 0.99f && b[i] > base / 8 * 1.01f;
  }
  EXPECT_GE(blended, 2);
  ExpectSameLogits(dir, path);
}

// Mistral's sliding window goes into the GGUF as llama.cpp's key and comes back as the same
// window, so both files compute the same logits (prompt 7 is longer than the window, so it
// matters); a model without a window writes no key.
TEST(ConvertTest, MistralSlidingWindowRoundTrip) {
  const std::string dir = VariantDir("mistral", [](nlohmann::json& c) {
    c["model_type"] = "mistral";
    c["architectures"] = {"MistralForCausalLM"};
    c["sliding_window"] = 4;
  });
  const std::string path = Convert(GgmlType::kF32, "mistral.gguf", dir);
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto window = (*file)->GetU32("llama.attention.sliding_window");
  ASSERT_TRUE(window.ok()) << window.status();
  EXPECT_EQ(*window, 4u);
  auto gguf = LoadModel(path);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  EXPECT_EQ((*gguf)->config.sliding_window, 4);
  ExpectSameLogits(dir, path);
  auto plain = LoadModel(kHfDir);
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto ops = NewSimdOps(nullptr);
  const std::vector<int32_t> ids = Reference()["prompts"][7]["input_ids"];
  ASSERT_GT(ids.size(), 4u);
  EXPECT_GT(RelativeError(LastLogits(**gguf, *ops, ids), LastLogits(**plain, *ops, ids)), 1e-2f);

  auto unwindowed = GgufFile::Open(Convert(GgmlType::kF32, "tiny-no-window.gguf"));
  ASSERT_TRUE(unwindowed.ok());
  EXPECT_FALSE((*unwindowed)->HasKey("llama.attention.sliding_window"));
}

int RunPinfer(const std::string& args) {
  const std::string cmd =
      std::string(PINFER_BINARY_DIR) + "/cli/pinfer convert " + args + " >/dev/null 2>&1";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(ConvertTest, CommandLine) {
  const std::string out = TempDir() + "/cli.gguf";
  fs::remove(out);
  EXPECT_EQ(RunPinfer(""), 2);
  EXPECT_EQ(RunPinfer("--model " + kHfDir), 2);  // no --out
  EXPECT_EQ(RunPinfer("--model " + kHfDir + " --out " + out + " --type q5_k"), 2);
  EXPECT_EQ(RunPinfer("--model " + kHfDir + " --out " + out + " --bogus 1"), 2);
  EXPECT_EQ(RunPinfer("--model /nonexistent --out " + out), 1);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(RunPinfer("--model " + kHfDir + " --out " + out + " --type q8_0"), 0);
  auto model = LoadModel(out);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->get()->layers[0].wq.dtype, DType::kQ8_0);
}

// A Llama-3 style directory (byte-level BPE tokenizer.json, no tokenizer.model) converts to a
// `gpt2` GGUF vocabulary that tokenizes exactly like llama.cpp. The tokenizer.json is rebuilt
// from llama.cpp's own Llama-3 vocabulary; the weights are small and random (tied embeddings).
TEST(ConvertTest, Llama3TokenizerJsonBecomesGpt2Vocabulary) {
  const std::string models = PINFER_MODELS_DIR;
  auto ref = GgufFile::Open(models + "/llama3-vocab/ggml-vocab-llama-bpe.gguf");
  ASSERT_TRUE(ref.ok());
  const std::vector<std::string> tokens = *(*ref)->GetStringArray("tokenizer.ggml.tokens");
  const std::vector<int32_t> types = *(*ref)->GetI32Array("tokenizer.ggml.token_type");
  const std::vector<std::string> merges = *(*ref)->GetStringArray("tokenizer.ggml.merges");
  const int V = static_cast<int>(tokens.size());
  nlohmann::json vocab = nlohmann::json::object(), added = nlohmann::json::array();
  for (int i = 0; i < V; ++i) {
    if (types[i] == 1) {
      vocab[tokens[i]] = i;
    } else {
      added.push_back({{"id", i}, {"content", tokens[i]}, {"special", types[i] == 3}});
    }
  }
  const std::string regex =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  nlohmann::json tokenizer = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", regex}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"},
           {"add_prefix_space", false},
           {"trim_offsets", true},
           {"use_regex", false}}}}}},
      {"model", {{"type", "BPE"}, {"ignore_merges", true}, {"vocab", vocab}, {"merges", merges}}}};

  const std::string dir = TempDir() + "/llama3-hf";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << tokenizer.dump();
  nlohmann::json config = {{"model_type", "llama"},       {"vocab_size", V},
                           {"hidden_size", 32},           {"num_hidden_layers", 1},
                           {"num_attention_heads", 4},    {"num_key_value_heads", 2},
                           {"intermediate_size", 64},     {"rms_norm_eps", 1e-5},
                           {"rope_theta", 500000.0},      {"hidden_act", "silu"},
                           {"tie_word_embeddings", true}, {"bos_token_id", 128000},
                           {"eos_token_id", 128001}};
  std::ofstream(dir + "/config.json") << config.dump();
  // Random F16 weights.
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"model.embed_tokens.weight", {V, 32}},
      {"model.norm.weight", {32}},
      {"model.layers.0.input_layernorm.weight", {32}},
      {"model.layers.0.self_attn.q_proj.weight", {32, 32}},
      {"model.layers.0.self_attn.k_proj.weight", {16, 32}},
      {"model.layers.0.self_attn.v_proj.weight", {16, 32}},
      {"model.layers.0.self_attn.o_proj.weight", {32, 32}},
      {"model.layers.0.post_attention_layernorm.weight", {32}},
      {"model.layers.0.mlp.gate_proj.weight", {64, 32}},
      {"model.layers.0.mlp.up_proj.weight", {64, 32}},
      {"model.layers.0.mlp.down_proj.weight", {32, 64}}};
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  uint32_t seed = 1;
  for (const auto& [name, shape] : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const size_t begin = data.size();
    for (int64_t i = 0; i < n; ++i) {
      seed = seed * 1664525u + 1013904223u;
      const uint16_t h = Fp32ToFp16((static_cast<float>(seed >> 8) / (1 << 24) - 0.5f) * 0.2f);
      data.append(reinterpret_cast<const char*>(&h), 2);
    }
    header[name] = {{"dtype", "F16"}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  const uint64_t len = h.size();
  std::ofstream st(dir + "/model.safetensors", std::ios::binary);
  st.write(reinterpret_cast<const char*>(&len), 8);
  st << h << data;
  st.close();

  const std::string path = Convert(GgmlType::kF16, "llama3.gguf", dir);
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(*(*file)->GetString("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(*(*file)->GetString("tokenizer.ggml.pre"), "llama-bpe");
  EXPECT_EQ(*(*file)->GetStringArray("tokenizer.ggml.tokens"), tokens);
  EXPECT_EQ(*(*file)->GetI32Array("tokenizer.ggml.token_type"), types);
  EXPECT_EQ(*(*file)->GetStringArray("tokenizer.ggml.merges"), merges);
  EXPECT_EQ((*file)->FindTensor("output.weight"), nullptr);
  auto model = LoadModel(path);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config.bos_id, 128000);
  std::ifstream in(models + "/llama3-vocab/tokenizer-vectors.json");
  const nlohmann::json cases = nlohmann::json::parse(in);
  ASSERT_GE(cases.size(), 60u);
  for (const auto& c : cases) {
    auto ids = (*model)->tokenizer->Encode(c["text"].get<std::string>());
    ASSERT_TRUE(ids.ok());
    ids->insert(ids->begin(), 128000);
    EXPECT_EQ(*ids, c["ids_with_bos"].get<std::vector<int32_t>>()) << c["text"];
  }
}

// GGUF -> GGUF (like llama-quantize): weights re-stored, everything else copied.
TEST(ConvertTest, RequantizesGgufFiles) {
  const std::string in = std::string(PINFER_MODELS_DIR) + "/stories260K/stories260K.gguf";
  const std::string out = TempDir() + "/stories-q4_0.gguf";
  GgufConvertOptions opts;
  opts.type = GgmlType::kQ4_0;
  ASSERT_TRUE(ConvertGgufToGguf(in, out, opts).ok());
  auto src = GgufFile::Open(in);
  auto dst = GgufFile::Open(out);
  ASSERT_TRUE(src.ok() && dst.ok());
  EXPECT_EQ(*(*dst)->GetU32("general.file_type"), 2u);
  EXPECT_EQ(*(*dst)->GetStringArray("tokenizer.ggml.tokens"),
            *(*src)->GetStringArray("tokenizer.ggml.tokens"));
  ASSERT_EQ((*dst)->tensors().size(), (*src)->tensors().size());
  for (const GgufTensorInfo& t : (*dst)->tensors()) {
    // ffn_down rows (172) are not whole Q4_0 blocks: F16, as llama.cpp falls back.
    const std::string want = t.ne.size() == 1            ? "F32"
                             : t.name == "output.weight" ? "Q8_0"
                             : t.ne[0] % 32 != 0         ? "F16"
                                                         : "Q4_0";
    EXPECT_EQ(GgmlTypeName(t.type), want) << t.name;
    EXPECT_EQ(t.ne, (*src)->FindTensor(t.name)->ne);
  }
  auto model = LoadModel(out);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->get()->layers[0].wq.dtype, DType::kQ4_0);
  EXPECT_THAT(std::string(ConvertGgufToGguf(out, out, opts).message()),
              HasSubstr("must differ from the input"));
}

TEST(ConvertTest, RejectsDirectoriesItCannotConvert) {
  const std::string dir = TempDir() + "/no_tokenizer";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(kHfDir + "/config.json", dir + "/config.json");
  fs::create_symlink(fs::absolute(kHfDir + "/model.safetensors"), dir + "/model.safetensors");
  absl::Status st = ConvertHuggingFaceToGguf(dir, TempDir() + "/x.gguf", {});
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(st.message()), HasSubstr("no tokenizer.model or tokenizer.json"));
  GgufConvertOptions bf16;
  bf16.type = GgmlType::kBF16;
  EXPECT_THAT(std::string(ConvertHuggingFaceToGguf(kHfDir, TempDir() + "/x.gguf", bf16).message()),
              HasSubstr("output type must be f32, f16, q8_0, q4_0 or a K mix"));
}

TEST(ConvertTest, ParsesTypesAndMixes) {
  GgufConvertOptions o;
  ASSERT_TRUE(ParseConvertType("Q4_K_M", &o).ok());
  EXPECT_EQ(o.mix, KQuantMix::kQ4_K_M);
  ASSERT_TRUE(ParseConvertType("q8_0", &o).ok());
  EXPECT_EQ(o.mix, KQuantMix::kNone);
  EXPECT_EQ(o.type, GgmlType::kQ8_0);
  absl::Status st = ParseConvertType("q3_k_m", &o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("unknown type 'q3_k_m'"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("q4_k_m"));
}

// llama.cpp's rules (llama_tensor_get_type) where the llama.cpp comparison in
// llama_cpp_kquant_test.py has no file to show them: a 70B-shaped model's attn_v, and rows that
// fit no quantization block.
TEST(ConvertTest, KMixTypesOfShapesTooLargeToCompareWithLlamaCpp) {
  // 80 layers: use_more_bits picks layers < 10, >= 70 and (i - 10) % 3 == 2.
  EXPECT_EQ(KMixTensorType(KQuantMix::kQ4_K_M, "blk.11.attn_v.weight", 8192, 80, false, true),
            GgmlType::kQ5_K);  // Q4_K raised for the 70B's 8:1 grouped attention
  EXPECT_EQ(KMixTensorType(KQuantMix::kQ4_K_M, "blk.12.attn_v.weight", 8192, 80, false, true),
            GgmlType::kQ6_K);
  EXPECT_EQ(KMixTensorType(KQuantMix::kQ4_K_M, "blk.11.attn_v.weight", 8192, 80, false, false),
            GgmlType::kQ4_K);
  EXPECT_EQ(KMixTensorType(KQuantMix::kQ4_K_M, "blk.12.ffn_down.weight", 28672, 80, false, true),
            GgmlType::kQ6_K);
  EXPECT_EQ(KMixTensorType(KQuantMix::kQ4_K_M, "blk.11.ffn_down.weight", 28672, 80, false, true),
            GgmlType::kQ4_K);
  EXPECT_EQ(KMixTensorType(KQuantMix::kQ4_K_M, "output.weight", 8192, 80, true, true),
            GgmlType::kQ6_K);
  // Rows of 48 values: no K block and no 32-value block fits, so F16.
  EXPECT_EQ(KMixTensorType(KQuantMix::kQ4_K_M, "blk.0.attn_q.weight", 48, 2, false, false),
            GgmlType::kF16);
  EXPECT_EQ(KMixTensorType(KQuantMix::kQ6_K, "output.weight", 48, 2, true, false), GgmlType::kF16);
}

}  // namespace
}  // namespace pinfer
