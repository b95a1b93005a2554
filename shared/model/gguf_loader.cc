// GGUF models of architecture `llama` (llama.cpp's conventions), including PowerInfer's variants
// (magic "PWRI", ReLU FFN, transposed `ffn_down_t`, architecture `bamboo`). Weights stay in the
// mapping, except types the kernels lack (dequantized to F32, see ggml_dequant.h) and PowerInfer's
// transposed down projection (transposed into memory the model owns).
//
// `bamboo` (PowerInfer's Bamboo models): the same keys under `bamboo.`, the same tensors, and the
// FFN relu(gate) * relu(up) (dReLU; PowerInfer's llama.cpp builds it as LLM_FFN_SYM with ReLU).
//
// llama.cpp's converter permutes the rows of Q and K so that RoPE rotates adjacent pairs
// (2i, 2i+1) instead of Hugging Face's halves (i, i + d/2); the model therefore runs with
// rope_interleaved, which gives the same results as the unpermuted Hugging Face weights.
//
// Activation: GGUF has no standard key for it (llama.cpp assumes SiLU for `llama`). pinfer's own
// files say it in `pinfer.hidden_act` ("silu", "relu" or "drelu"); PowerInfer files (magic PWRI,
// a `powerinfer.sparse_threshold` key or predictor tensors `blk.N.fc1.weight`) are ReluLLaMA
// models, whose FFN is ReLU-gated. Everything else is SiLU.
#include <cmath>
#include <cstring>
#include <numbers>
#include <optional>

#include "absl/strings/str_cat.h"
#include "shared/model/ggml_dequant.h"
#include "shared/model/gguf.h"
#include "shared/model/model.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

absl::StatusOr<int> GetInt(const GgufFile& f, const std::string& key,
                           std::optional<int> fallback = std::nullopt) {
  if (fallback && !f.HasKey(key)) return *fallback;
  ASSIGN_OR_RETURN(uint32_t v, f.GetU32(key));
  if (v > static_cast<uint32_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": key '", key, "' out of range"));
  }
  return static_cast<int>(v);
}

absl::StatusOr<float> GetFloat(const GgufFile& f, const std::string& key,
                               std::optional<float> fallback = std::nullopt) {
  if (fallback && !f.HasKey(key)) return *fallback;
  return f.GetF32(key);
}

// llama.cpp stores Llama-3.1 RoPE scaling as a `rope_freqs` tensor of per-frequency divisors
// (computed from factor, low/high_freq_factor and the original context); pinfer's config holds
// the parameters. The divisor curve is 1 for high frequencies, `factor` for low ones and a
// smooth blend in between, linear in 1/wavelength; that recovers the parameters up to a common
// scale of (original context, low, high), which does not change the curve. The result is
// checked against every divisor, so any other curve is rejected rather than approximated.
absl::StatusOr<RopeScaling> RopeScalingFromFactors(const std::vector<float>& factors,
                                                   const ModelConfig& c, int original_context) {
  const int half = c.head_dim / 2;
  if (static_cast<int>(factors.size()) != half) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope_freqs has ", factors.size(), " values, expected head_dim/2 = ", half));
  }
  std::vector<double> wavelen(half);
  for (int i = 0; i < half; ++i) {
    wavelen[i] =
        2 * std::numbers::pi *
        std::pow(static_cast<double>(c.rope_theta), static_cast<double>(2 * i) / c.head_dim);
  }
  RopeScaling s;
  double factor = 1;
  for (float f : factors) {
    if (!(f > 0) || !std::isfinite(f)) return absl::InvalidArgumentError("rope_freqs: bad value");
    factor = std::max(factor, static_cast<double>(f));
  }
  if (factor == 1) return s;  // no scaling
  auto near = [](double a, double b) { return std::fabs(a - b) <= 1e-5 * std::max(1.0, b); };
  std::vector<int> high, mid, low;
  for (int i = 0; i < half; ++i) {
    (near(factors[i], 1) ? high : near(factors[i], factor) ? low : mid).push_back(i);
  }
  const double orig = original_context > 0 ? original_context : 8192;
  double high_wavelen, low_wavelen;  // the two boundaries of the blend
  if (mid.size() >= 2) {
    // smooth = 1/divisor blended linearly: (1/r - 1/factor) / (1 - 1/factor) = A/wavelen + B.
    auto smooth = [&](int i) { return (1 / factors[i] - 1 / factor) / (1 - 1 / factor); };
    const int a = mid.front(), b = mid.back();
    const double A = (smooth(a) - smooth(b)) / (1 / wavelen[a] - 1 / wavelen[b]);
    const double B = smooth(a) - A / wavelen[a];
    if (!(A > 0)) return absl::InvalidArgumentError("rope_freqs is not Llama-3 scaling");
    high_wavelen = A / (1 - B);  // smooth = 1
    low_wavelen = A / -B;        // smooth = 0
    if (!(B < 0) || !(high_wavelen < low_wavelen)) {
      return absl::InvalidArgumentError("rope_freqs is not Llama-3 scaling");
    }
  } else if (mid.empty()) {
    // A step from 1 to factor: put both boundaries between the last 1 and the first `factor`.
    const double lo = high.empty() ? wavelen[0] / 4 : wavelen[high.back()];
    const double hi = low.empty() ? wavelen[half - 1] * 4 : wavelen[low.front()];
    high_wavelen = std::sqrt(lo * std::sqrt(lo * hi));
    low_wavelen = std::sqrt(hi * std::sqrt(lo * hi));
  } else {
    return absl::InvalidArgumentError(
        "rope_freqs has a single blended frequency: Llama-3 parameters are ambiguous");
  }
  s.llama3 = true;
  s.factor = static_cast<float>(factor);
  s.original_max_position = static_cast<int>(orig);
  s.high_freq_factor = static_cast<float>(orig / high_wavelen);
  s.low_freq_factor = static_cast<float>(orig / low_wavelen);
  // Check: the same formula as the forward pass (RopeInverseFrequencies) gives every divisor.
  for (int i = 0; i < half; ++i) {
    const double lw = s.original_max_position / s.low_freq_factor;
    const double hw = s.original_max_position / s.high_freq_factor;
    double r = 1;
    if (wavelen[i] > lw) {
      r = s.factor;
    } else if (wavelen[i] >= hw) {
      const double sm = (s.original_max_position / wavelen[i] - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
      r = 1 / ((1 - sm) / s.factor + sm);
    }
    if (std::fabs(r - factors[i]) > 1e-4 * factors[i]) {
      return absl::InvalidArgumentError(absl::StrCat("rope_freqs value ", i, " (", factors[i],
                                                     ") does not follow Llama-3 scaling"));
    }
  }
  return s;
}

// PowerInfer stores the down projection transposed (`ffn_down_t`: [ffn, hidden]); the engine
// wants [hidden, ffn]. Plain dtypes are transposed into memory the model owns. Quantized ones are
// blocked along hidden, and re-quantizing along ffn would change the weights: they are
// dequantized and transposed into F32 (exact; sparse execution reads ffn_down_t itself).
absl::StatusOr<TensorView> TransposeDown(const TensorView& t, Model* model) {
  if (t.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' is not a matrix"));
  }
  const int64_t rows = t.shape[0], cols = t.shape[1];
  if (IsQuantized(t.dtype)) {
    auto buf = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(rows * cols) * 4);
    float* dst = reinterpret_cast<float*>(buf->data());
    std::vector<float> row(cols);
    for (int64_t r = 0; r < rows; ++r) {
      DequantizeRow(t.dtype, t.row(r), row.data(), cols);
      for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = row[c];
    }
    TensorView out = t;
    out.dtype = DType::kF32;
    out.shape = {cols, rows};
    out.data = buf->data();
    model->owned.push_back(std::move(buf));
    return out;
  }
  const size_t es = RowBytes(t.dtype, 1);
  auto buf = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(rows * cols) * es);
  const uint8_t* src = static_cast<const uint8_t*>(t.data);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      std::memcpy(buf->data() + (c * rows + r) * es, src + (r * cols + c) * es, es);
    }
  }
  TensorView out = t;
  out.shape = {cols, rows};
  out.data = buf->data();
  model->owned.push_back(std::move(buf));
  return out;
}

// A weight view; data that a file with a small general.alignment leaves unaligned for its element
// type is copied (the kernels read whole elements).
absl::StatusOr<TensorView> Weight(const GgufFile& f, const std::string& name, Model* model) {
  ASSIGN_OR_RETURN(TensorView t, GgufTensorForEngine(f, name, &model->owned));
  const size_t align = t.dtype == DType::kF32 ? 4 : 2;
  if (reinterpret_cast<uintptr_t>(t.data) % align != 0) {
    auto copy = std::make_shared<std::vector<uint8_t>>(t.nbytes());
    std::memcpy(copy->data(), t.data, copy->size());
    t.data = copy->data();
    model->owned.push_back(std::move(copy));
  }
  return t;
}

absl::StatusOr<Activation> ActivationOf(const GgufFile& f, const std::string& arch) {
  if (f.HasKey("pinfer.hidden_act")) {
    ASSIGN_OR_RETURN(std::string act, f.GetString("pinfer.hidden_act"));
    if (act == "silu") return Activation::kSilu;
    if (act == "relu") return Activation::kRelu;
    if (act == "drelu") return Activation::kDRelu;
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": unsupported pinfer.hidden_act '", act, "'"));
  }
  if (arch == "bamboo") return Activation::kDRelu;
  if (f.magic() == kPowerInferMagic || f.HasKey("powerinfer.sparse_threshold") ||
      f.FindTensor("blk.0.fc1.weight") != nullptr) {
    return Activation::kRelu;
  }
  return Activation::kSilu;
}

absl::StatusOr<ModelConfig> ConfigFromGguf(const GgufFile& f) {
  ModelConfig c;
  ASSIGN_OR_RETURN(c.architecture, f.GetString("general.architecture"));
  if (c.architecture != "llama" && c.architecture != "bamboo" && c.architecture != "qwen2") {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": unsupported architecture '",
                                                   c.architecture,
                                                   "' (pinfer loads llama, qwen2 and bamboo)"));
  }
  const std::string a = c.architecture + ".";
  if (f.HasKey(a + "expert_count")) {
    ASSIGN_OR_RETURN(int experts, GetInt(f, a + "expert_count"));
    if (experts > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.name(), ": mixture-of-experts models are not supported"));
    }
  }
  ASSIGN_OR_RETURN(c.hidden_size, GetInt(f, a + "embedding_length"));
  ASSIGN_OR_RETURN(c.n_layers, GetInt(f, a + "block_count"));
  ASSIGN_OR_RETURN(c.ffn_size, GetInt(f, a + "feed_forward_length"));
  ASSIGN_OR_RETURN(c.n_heads, GetInt(f, a + "attention.head_count"));
  if (c.n_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": attention.head_count must be > 0"));
  }
  ASSIGN_OR_RETURN(c.n_kv_heads, GetInt(f, a + "attention.head_count_kv", c.n_heads));
  ASSIGN_OR_RETURN(c.head_dim, GetInt(f, a + "attention.key_length", c.hidden_size / c.n_heads));
  ASSIGN_OR_RETURN(int value_dim, GetInt(f, a + "attention.value_length", c.head_dim));
  if (value_dim != c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": attention.value_length ", value_dim,
                                                   " differs from attention.key_length ",
                                                   c.head_dim));
  }
  ASSIGN_OR_RETURN(int rope_dim, GetInt(f, a + "rope.dimension_count", c.head_dim));
  if (rope_dim != c.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": rope.dimension_count ", rope_dim, " differs from head_dim ",
                     c.head_dim, " (partial rotary embeddings are not supported)"));
  }
  ASSIGN_OR_RETURN(c.max_context, GetInt(f, a + "context_length", 2048));
  ASSIGN_OR_RETURN(c.norm_eps, GetFloat(f, a + "attention.layer_norm_rms_epsilon"));
  // Mistral's sliding window (llama.cpp's key; `pinfer convert` writes it). 0 and windows that
  // cover the context are none, as in the Hugging Face loader. qwen2 files are left alone: Qwen2's
  // window covers only some layers and llama.cpp's qwen2 graph ignores the key too.
  if (c.architecture != "qwen2") {
    ASSIGN_OR_RETURN(int window, GetInt(f, a + "attention.sliding_window", 0));
    c.sliding_window = window < c.max_context ? window : 0;
  }
  ASSIGN_OR_RETURN(c.rope_theta, GetFloat(f, a + "rope.freq_base", 10000.f));

  // Linear RoPE scaling (positions divided by `factor`) is every frequency divided by `factor`:
  // that is Llama-3 scaling with both wavelength boundaries below the shortest wavelength (2 pi).
  std::string scaling_type = "none";
  float linear = 1;
  if (f.HasKey(a + "rope.scaling.type")) {
    ASSIGN_OR_RETURN(scaling_type, f.GetString(a + "rope.scaling.type"));
  }
  if (scaling_type == "linear") {
    ASSIGN_OR_RETURN(linear, GetFloat(f, a + "rope.scaling.factor", 1.f));
  } else if (scaling_type == "none") {
    ASSIGN_OR_RETURN(linear, GetFloat(f, a + "rope.scale_linear", 1.f));  // older files
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": unsupported rope scaling type '", scaling_type, "'"));
  }
  if (!(linear > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": invalid rope scaling factor"));
  }
  if (linear != 1) {
    c.rope_scaling.llama3 = true;
    c.rope_scaling.factor = linear;
    c.rope_scaling.original_max_position = 1;
    c.rope_scaling.low_freq_factor = 1;  // low-frequency boundary: wavelength 1 < 2 pi
    c.rope_scaling.high_freq_factor = 2;
  }
  ASSIGN_OR_RETURN(c.activation, ActivationOf(f, c.architecture));
  // llama.cpp's llama files carry Q/K rows permuted for pairwise RoPE; qwen2 files keep
  // Hugging Face's rows and rotate halves (LLAMA_ROPE_TYPE_NEOX).
  c.rope_interleaved = c.architecture != "qwen2";
  c.qkv_bias = c.architecture == "qwen2";

  const std::string t = "tokenizer.ggml.";
  ASSIGN_OR_RETURN(c.bos_id, GetInt(f, t + "bos_token_id", c.bos_id));
  ASSIGN_OR_RETURN(c.eos_id, GetInt(f, t + "eos_token_id", c.eos_id));
  if (f.HasKey(t + "add_bos_token")) {
    ASSIGN_OR_RETURN(c.add_bos, f.GetBool(t + "add_bos_token"));
  }
  return c;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const GgufFile& f) {
  const std::string t = "tokenizer.ggml.";
  if (!f.HasKey(t + "model")) {
    return absl::NotFoundError(absl::StrCat(f.name(), ": no vocabulary (tokenizer.ggml.model)"));
  }
  ASSIGN_OR_RETURN(std::string model, f.GetString(t + "model"));
  ASSIGN_OR_RETURN(std::vector<std::string> tokens, f.GetStringArray(t + "tokens"));
  std::vector<int32_t> types;
  if (f.HasKey(t + "token_type")) {
    ASSIGN_OR_RETURN(types, f.GetI32Array(t + "token_type"));
    if (types.size() != tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(f.name(), ": ", tokens.size(), " tokens but ",
                                                     types.size(), " token types"));
    }
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok;
  if (model == "llama") {
    std::vector<float> scores;
    if (f.HasKey(t + "scores")) {
      ASSIGN_OR_RETURN(scores, f.GetF32Array(t + "scores"));
    }
    bool add_space_prefix = true;
    if (f.HasKey(t + "add_space_prefix")) {
      ASSIGN_OR_RETURN(add_space_prefix, f.GetBool(t + "add_space_prefix"));
    }
    tok = NewSentencePieceTokenizerFromVocab(tokens, scores, types, add_space_prefix);
  } else if (model == "gpt2") {
    ASSIGN_OR_RETURN(std::vector<std::string> merges, f.GetStringArray(t + "merges"));
    std::string pre = "gpt2";
    if (f.HasKey(t + "pre")) {
      ASSIGN_OR_RETURN(pre, f.GetString(t + "pre"));
    }
    tok = NewByteLevelBpeTokenizer(tokens, merges, types, pre);
  } else {
    return absl::UnimplementedError(
        absl::StrCat(f.name(), ": unsupported tokenizer model '", model, "'"));
  }
  if (!tok.ok()) {
    return absl::Status(tok.status().code(),
                        absl::StrCat(f.name(), ": vocabulary: ", tok.status().message()));
  }
  return tok;
}

absl::StatusOr<std::unique_ptr<Model>> LoadGgufModelFrom(const GgufFile& f,
                                                         const GgufLoadOptions& options) {
  if (f.mapped_file() == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": a model needs a GGUF file opened with GgufFile::Open"));
  }
  auto model = std::make_unique<Model>();
  model->source_path = f.name();
  model->format = "gguf";
  model->files.push_back(f.mapped_file());
  ASSIGN_OR_RETURN(model->config, ConfigFromGguf(f));
  ModelConfig& c = model->config;

  ASSIGN_OR_RETURN(model->tok_embeddings, Weight(f, "token_embd.weight", model.get()));
  if (model->tok_embeddings.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": token_embd.weight is not a matrix"));
  }
  c.vocab_size = static_cast<int>(std::min<int64_t>(model->tok_embeddings.shape[0], INT32_MAX));
  if (f.HasKey(c.architecture + ".vocab_size")) {
    ASSIGN_OR_RETURN(int v, GetInt(f, c.architecture + ".vocab_size"));
    if (v != c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(f.name(), ": ", c.architecture, ".vocab_size ",
                                                     v, " but token_embd.weight has ", c.vocab_size,
                                                     " rows"));
    }
  }
  ASSIGN_OR_RETURN(model->output_norm, Weight(f, "output_norm.weight", model.get()));
  if (f.FindTensor("output.weight") != nullptr) {
    ASSIGN_OR_RETURN(model->output, Weight(f, "output.weight", model.get()));
  } else {
    c.tie_embeddings = true;
    model->output = model->tok_embeddings;
  }
  if (const GgufTensorInfo* rf = f.FindTensor("rope_freqs.weight"); rf != nullptr) {
    if (rf->type != static_cast<uint32_t>(GgmlType::kF32)) {
      return absl::InvalidArgumentError(absl::StrCat(f.name(), ": rope_freqs.weight is not F32"));
    }
    std::vector<float> factors(rf->numel());
    std::memcpy(factors.data(), rf->data, factors.size() * 4);
    ASSIGN_OR_RETURN(int orig,
                     GetInt(f, c.architecture + ".rope.scaling.original_context_length", 0));
    auto scaling = RopeScalingFromFactors(factors, c, orig);
    if (!scaling.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(f.name(), ": ", scaling.status().message()));
    }
    if (scaling->llama3) {
      if (c.rope_scaling.llama3) {
        return absl::InvalidArgumentError(
            absl::StrCat(f.name(), ": both linear rope scaling and rope_freqs are given"));
      }
      c.rope_scaling = *scaling;
    }
  }

  if (absl::Status st = c.Validate(); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat(f.name(), ": ", st.message()));
  }
  model->layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    LayerWeights& L = model->layers[l];
    ASSIGN_OR_RETURN(L.attn_norm, Weight(f, p + "attn_norm.weight", model.get()));
    ASSIGN_OR_RETURN(L.wq, Weight(f, p + "attn_q.weight", model.get()));
    ASSIGN_OR_RETURN(L.wk, Weight(f, p + "attn_k.weight", model.get()));
    ASSIGN_OR_RETURN(L.wv, Weight(f, p + "attn_v.weight", model.get()));
    ASSIGN_OR_RETURN(L.wo, Weight(f, p + "attn_output.weight", model.get()));
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(L.bq, Weight(f, p + "attn_q.bias", model.get()));
      ASSIGN_OR_RETURN(L.bk, Weight(f, p + "attn_k.bias", model.get()));
      ASSIGN_OR_RETURN(L.bv, Weight(f, p + "attn_v.bias", model.get()));
    }
    ASSIGN_OR_RETURN(L.ffn_norm, Weight(f, p + "ffn_norm.weight", model.get()));
    ASSIGN_OR_RETURN(L.gate, Weight(f, p + "ffn_gate.weight", model.get()));
    ASSIGN_OR_RETURN(L.up, Weight(f, p + "ffn_up.weight", model.get()));
    if (f.FindTensor(p + "ffn_down_t.weight") != nullptr) {
      ASSIGN_OR_RETURN(L.down_t, Weight(f, p + "ffn_down_t.weight", model.get()));
    }
    if (f.FindTensor(p + "ffn_down.weight") == nullptr && L.down_t.data != nullptr) {
      if (options.rebuild_down) {
        ASSIGN_OR_RETURN(L.down, TransposeDown(L.down_t, model.get()));
      }
    } else {
      ASSIGN_OR_RETURN(L.down, Weight(f, p + "ffn_down.weight", model.get()));
    }
  }
  {
    absl::Status st = ValidateModelShapes(*model);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(f.name(), ": ", st.message()));
  }

  if (f.HasKey("tokenizer.ggml.model")) {  // otherwise a weights-only file
    ASSIGN_OR_RETURN(model->tokenizer, LoadGgufTokenizer(f));
    if (model->tokenizer->vocab_size() > c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.name(), ": the vocabulary has ", model->tokenizer->vocab_size(),
                       " tokens but token_embd.weight only ", c.vocab_size, " rows"));
    }
  }
  if (c.bos_id < 0 || c.bos_id >= c.vocab_size || c.eos_id < 0 || c.eos_id >= c.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": bos/eos token id out of the vocabulary"));
  }
  return model;
}

absl::StatusOr<std::unique_ptr<Model>> LoadGgufModel(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file,
                   GgufFile::Open(path, {kGgufMagic, kPowerInferMagic}));
  return LoadGgufModelFrom(*file);
}

}  // namespace pinfer
