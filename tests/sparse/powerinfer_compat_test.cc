// Files from PowerInfer's model zoo: pinfer loads what PowerInfer's own tools write and computes
// the same model.
//
// No zoo file is bundled (they are gigabytes), so the test writes small random-weight models the
// way PowerInfer's tools do, step by step:
//  - convert.py (SJTU-IPADS/PowerInfer): Hugging Face tensors plus per-layer predictors
//    (model_N.pt: fc1.weight [rank, hidden], fc2.weight [ffn, rank]); Q and K rows permuted with
//    its permute() (n_head_kv for K); llama.cpp names; ffn_down transposed into ffn_down_t
//    ([ffn, hidden], ne = {hidden, ffn}); --outtype f32 (all F32), f16 (2-D F16, 1-D F32) or q8_0
//    (2-D Q8_0 by its NumPy quantizer: d = max|x| / 127, q = round-half-even(x / d)); keys of
//    add_meta_arch (context_length, embedding_length, block_count, feed_forward_length,
//    rope.dimension_count = hidden / heads, head counts, rms epsilon, rope.freq_base, file_type,
//    powerinfer.sparse_threshold from the predictor config.json); then "PWRI" over the magic.
//  - llama.cpp's quantize in PowerInfer (llama_model_quantize_internal, get_k_quant_type): every
//    2-D `*weight` tensor to the file type (ffn_down_t included: its name does not match
//    "ffn_down.weight"), fc1/fc2 to Q4_0 for Q4_0 files and Q5_0 otherwise, output to Q8_0 when
//    its rows are not a multiple of 256 (Q6_K otherwise), general.quantization_version 2.
// References are independent of that path: the Hugging Face directory of the same weights (loaded
// with rotate-half RoPE and no permutation), or, for quantized files, a plain llama GGUF holding
// the very same quantized tensors with ffn_down as the exact F32 transpose of ffn_down_t.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/transformer.h"
#include "shared/model/ggml_dequant.h"
#include "shared/model/gguf.h"
#include "shared/sparse/prepared_model.h"
#include "shared/sparse/sparse_ffn.h"
#include "shared/util/half.h"
#include "shared/util/thread_pool.h"

namespace pinfer {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A row-major float matrix (or vector when rows == 1 and is_vector).
struct Mat {
  std::vector<int64_t> shape;
  std::vector<float> v;
};

struct ZooModel {
  int hidden = 64, ffn = 128, layers = 2, heads = 4, kv_heads = 2, vocab = 96, rank = 32;
  float eps = 1e-5f, theta = 10000.f;
  std::string arch = "llama";                   // or "bamboo"
  std::map<std::string, Mat> hf;                // Hugging Face names
  std::vector<std::pair<Mat, Mat>> predictors;  // per layer: fc1, fc2
};

ZooModel RandomZooModel(const std::string& arch, uint32_t seed, int hidden = 64) {
  ZooModel m;
  m.arch = arch;
  m.hidden = hidden;
  std::mt19937 rng(seed);
  auto mat = [&](std::vector<int64_t> shape, float scale) {
    Mat a{shape, {}};
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::normal_distribution<float> d(0.f, scale);
    a.v.resize(n);
    for (float& x : a.v) x = d(rng);
    return a;
  };
  auto norm = [&](int64_t n) {
    Mat a{{n}, {}};
    std::uniform_real_distribution<float> d(0.5f, 1.5f);  // not all ones: the fold is exercised
    a.v.resize(n);
    for (float& x : a.v) x = d(rng);
    return a;
  };
  const int H = m.hidden, F = m.ffn, hd = H / m.heads;
  const float s = 1.f / std::sqrt(static_cast<float>(H));
  m.hf["model.embed_tokens.weight"] = mat({m.vocab, H}, 1.f);
  m.hf["model.norm.weight"] = norm(H);
  m.hf["lm_head.weight"] = mat({m.vocab, H}, s);
  for (int l = 0; l < m.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    m.hf[p + "input_layernorm.weight"] = norm(H);
    m.hf[p + "post_attention_layernorm.weight"] = norm(H);
    m.hf[p + "self_attn.q_proj.weight"] = mat({m.heads * hd, H}, s);
    m.hf[p + "self_attn.k_proj.weight"] = mat({m.kv_heads * hd, H}, s);
    m.hf[p + "self_attn.v_proj.weight"] = mat({m.kv_heads * hd, H}, s);
    m.hf[p + "self_attn.o_proj.weight"] = mat({H, m.heads * hd}, s);
    m.hf[p + "mlp.gate_proj.weight"] = mat({F, H}, s);
    m.hf[p + "mlp.up_proj.weight"] = mat({F, H}, s);
    m.hf[p + "mlp.down_proj.weight"] = mat({H, F}, 1.f / std::sqrt(static_cast<float>(F)));
    m.predictors.push_back({mat({m.rank, H}, s), mat({F, m.rank}, 0.2f)});
  }
  return m;
}

// --- what the files hold -----------------------------------------------------------------------

std::string ToBytes(const std::vector<float>& v, GgmlType type) {
  std::string out;
  if (type == GgmlType::kF32) {
    out.assign(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  } else if (type == GgmlType::kF16) {
    out.resize(v.size() * 2);
    QuantizeRow(DType::kF16, v.data(), out.data(), static_cast<int64_t>(v.size()));
  } else if (type == GgmlType::kQ4_0 || type == GgmlType::kQ8_0) {
    // llama.cpp's quantize: ggml's reference quantizers (pinfer's QuantizeRow follows them).
    const DType dt = type == GgmlType::kQ4_0 ? DType::kQ4_0 : DType::kQ8_0;
    out.resize(RowBytes(dt, static_cast<int64_t>(v.size())));
    QuantizeRow(dt, v.data(), out.data(), static_cast<int64_t>(v.size()));
  } else if (type == GgmlType::kQ5_0) {
    // ggml's quantize_row_q5_0_reference: d = (signed max) / -16, q = min(31, (int)(x / d + 16.5)).
    for (size_t b = 0; b < v.size() / 32; ++b) {
      const float* x = v.data() + b * 32;
      float amax = 0, max = 0;
      for (int j = 0; j < 32; ++j) {
        if (std::fabs(x[j]) > amax) {
          amax = std::fabs(x[j]);
          max = x[j];
        }
      }
      const float d = max / -16, id = d != 0 ? 1.f / d : 0.f;
      uint32_t qh = 0;
      uint8_t qs[16];
      for (int j = 0; j < 16; ++j) {
        const uint8_t x0 =
            static_cast<uint8_t>(std::min<int>(31, static_cast<int8_t>(x[j] * id + 16.5f)));
        const uint8_t x1 =
            static_cast<uint8_t>(std::min<int>(31, static_cast<int8_t>(x[16 + j] * id + 16.5f)));
        qs[j] = (x0 & 0x0F) | ((x1 & 0x0F) << 4);
        qh |= ((x0 & 0x10u) >> 4) << j;
        qh |= ((x1 & 0x10u) >> 4) << (j + 16);
      }
      const uint16_t dh = Fp32ToFp16(d);
      out.append(reinterpret_cast<const char*>(&dh), 2);
      out.append(reinterpret_cast<const char*>(&qh), 4);
      out.append(reinterpret_cast<const char*>(qs), 16);
    }
  }
  return out;
}

// convert.py's Q8_0QuantizedDataType.quantize: NumPy float32 arithmetic, np.round (half to even),
// d stored as float16.
std::string ConvertPyQ8_0(const std::vector<float>& v) {
  std::string out;
  for (size_t b = 0; b < v.size() / 32; ++b) {
    const float* x = v.data() + b * 32;
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f;
    const uint16_t dh = Fp32ToFp16(d);
    out.append(reinterpret_cast<const char*>(&dh), 2);
    for (int j = 0; j < 32; ++j) {
      const int8_t q = d == 0 ? 0 : static_cast<int8_t>(std::nearbyint(x[j] / d));
      out.push_back(static_cast<char>(q));
    }
  }
  return out;
}

// convert.py's permute(): reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2).
Mat Permute(const Mat& w, int n_head) {
  Mat out = w;
  const int64_t rows = w.shape[0], cols = w.shape[1], half = rows / n_head / 2;
  for (int64_t h = 0; h < n_head; ++h) {
    for (int64_t two = 0; two < 2; ++two) {
      for (int64_t i = 0; i < half; ++i) {
        const int64_t src = (h * 2 + two) * half + i, dst = (h * half + i) * 2 + two;
        std::memcpy(&out.v[dst * cols], &w.v[src * cols], cols * 4);
      }
    }
  }
  return out;
}

Mat Transposed(const Mat& w) {
  Mat t{{w.shape[1], w.shape[0]}, std::vector<float>(w.v.size())};
  for (int64_t r = 0; r < w.shape[0]; ++r) {
    for (int64_t c = 0; c < w.shape[1]; ++c) t.v[c * w.shape[0] + r] = w.v[r * w.shape[1] + c];
  }
  return t;
}

// The tensors convert.py writes, in llama.cpp names and float values (before the output type).
std::map<std::string, Mat> ConvertPyTensors(const ZooModel& m) {
  std::map<std::string, Mat> t;
  t["token_embd.weight"] = m.hf.at("model.embed_tokens.weight");
  t["output_norm.weight"] = m.hf.at("model.norm.weight");
  t["output.weight"] = m.hf.at("lm_head.weight");
  for (int l = 0; l < m.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string b = "blk." + std::to_string(l) + ".";
    t[b + "attn_norm.weight"] = m.hf.at(p + "input_layernorm.weight");
    t[b + "ffn_norm.weight"] = m.hf.at(p + "post_attention_layernorm.weight");
    t[b + "attn_q.weight"] = Permute(m.hf.at(p + "self_attn.q_proj.weight"), m.heads);
    t[b + "attn_k.weight"] = Permute(m.hf.at(p + "self_attn.k_proj.weight"), m.kv_heads);
    t[b + "attn_v.weight"] = m.hf.at(p + "self_attn.v_proj.weight");
    t[b + "attn_output.weight"] = m.hf.at(p + "self_attn.o_proj.weight");
    t[b + "ffn_gate.weight"] = m.hf.at(p + "mlp.gate_proj.weight");
    t[b + "ffn_up.weight"] = m.hf.at(p + "mlp.up_proj.weight");
    t[b + "ffn_down_t.weight"] = Transposed(m.hf.at(p + "mlp.down_proj.weight"));  // postprocess
    t[b + "fc1.weight"] = m.predictors[l].first;
    t[b + "fc2.weight"] = m.predictors[l].second;
  }
  return t;
}

void SetArchKeys(const ZooModel& m, GgufWriter* w, uint32_t file_type,
                 std::optional<float> sparse_threshold) {
  const std::string a = m.arch + ".";
  w->SetString("general.architecture", m.arch);
  w->SetString("general.name", "zoo-test");
  w->SetU32(a + "context_length", 256);
  w->SetU32(a + "embedding_length", m.hidden);
  w->SetU32(a + "block_count", m.layers);
  w->SetU32(a + "feed_forward_length", m.ffn);
  w->SetU32(a + "rope.dimension_count", m.hidden / m.heads);
  w->SetU32(a + "attention.head_count", m.heads);
  w->SetU32(a + "attention.head_count_kv", m.kv_heads);
  w->SetF32(a + "attention.layer_norm_rms_epsilon", m.eps);
  w->SetF32(a + "rope.freq_base", m.theta);
  w->SetU32("general.file_type", file_type);
  if (sparse_threshold) w->SetF32(kSparseThresholdKey, *sparse_threshold);
}

enum class OutType { kF32, kF16, kQ8_0 };

// convert.py model_dir mlp_dir --outtype ...
void WriteConvertPy(const ZooModel& m, OutType type, std::optional<float> sparse_threshold,
                    const std::string& path) {
  GgufWriter w(kPowerInferMagic);
  SetArchKeys(m, &w, type == OutType::kF32 ? 0 : type == OutType::kF16 ? 1 : 7, sparse_threshold);
  for (const auto& [name, t] : ConvertPyTensors(m)) {
    if (t.shape.size() == 1 || type == OutType::kF32) {
      ASSERT_TRUE(w.AddTensor(name, GgmlType::kF32, t.shape, ToBytes(t.v, GgmlType::kF32)).ok());
    } else if (type == OutType::kF16) {
      ASSERT_TRUE(w.AddTensor(name, GgmlType::kF16, t.shape, ToBytes(t.v, GgmlType::kF16)).ok());
    } else {
      ASSERT_TRUE(w.AddTensor(name, GgmlType::kQ8_0, t.shape, ConvertPyQ8_0(t.v)).ok());
    }
  }
  ASSERT_TRUE(w.WriteFile(path).ok());
}

// A Q6_K encoding of `v` (not llama.cpp's search for the best scales, but a valid block: per 16
// values a scale amax / 31 in units of d = max scale / 127, q = round(x / (d * scale)) in -32..31),
// laid out as ggml's block_q6_K: value i = 128h + 32k + l has its low four bits in
// ql[64h + l + 32(k % 2)] (the high nibble for k >= 2), its two high bits in qh[32h + l] at bit
// 2k, and its scale in scales[i / 16]. `values` receives what the blocks hold: d * scale * q.
std::string EncodeQ6K(const std::vector<float>& v, std::vector<float>* values) {
  std::string out;
  values->assign(v.size(), 0.f);
  for (size_t b = 0; b < v.size() / 256; ++b) {
    const float* x = v.data() + b * 256;
    float sub[16], max_sub = 0;
    for (int j = 0; j < 16; ++j) {
      float amax = 0;
      for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[16 * j + i]));
      sub[j] = amax / 31;
      max_sub = std::max(max_sub, sub[j]);
    }
    const uint16_t dh = Fp32ToFp16(max_sub / 127);
    const float d = Fp16ToFp32(dh);
    uint8_t ql[128] = {}, qh[64] = {};
    int8_t sc[16];
    for (int j = 0; j < 16; ++j) {
      sc[j] = static_cast<int8_t>(d > 0 ? std::min(127.f, std::round(sub[j] / d)) : 0);
    }
    for (int i = 0; i < 256; ++i) {
      const int h = i / 128, k = (i % 128) / 32, l = i % 32, j = i / 16;
      const float step = d * sc[j];
      const int q = step > 0 ? std::clamp(static_cast<int>(std::round(x[i] / step)), -32, 31) : 0;
      const int u = q + 32;
      uint8_t& low = ql[64 * h + l + 32 * (k % 2)];
      low |= k < 2 ? (u & 0x0F) : ((u & 0x0F) << 4);
      qh[32 * h + l] |= static_cast<uint8_t>(((u >> 4) & 3) << (2 * k));
      (*values)[b * 256 + i] = d * sc[j] * q;
    }
    out.append(reinterpret_cast<const char*>(ql), 128);
    out.append(reinterpret_cast<const char*>(qh), 64);
    out.append(reinterpret_cast<const char*>(sc), 16);
    out.append(reinterpret_cast<const char*>(&dh), 2);
  }
  return out;
}

// PowerInfer's `quantize` of a convert.py F16 file to file type Q4_0 (2) or Q8_0 (7). A Q6_K
// output head's values go to `q6k_values`.
void WriteQuantized(const ZooModel& m, GgmlType qtype, const std::string& path,
                    std::map<std::string, std::vector<float>>* q6k_values = nullptr) {
  GgufWriter w(kPowerInferMagic);
  SetArchKeys(m, &w, qtype == GgmlType::kQ4_0 ? 2 : 7, std::nullopt);
  w.SetU32("general.quantization_version", 2);
  for (auto [name, t] : ConvertPyTensors(m)) {
    if (t.shape.size() == 1) {
      ASSERT_TRUE(w.AddTensor(name, GgmlType::kF32, t.shape, ToBytes(t.v, GgmlType::kF32)).ok());
      continue;
    }
    // The F16 source, dequantized.
    for (float& x : t.v) x = Fp16ToFp32(Fp32ToFp16(x));
    GgmlType type = qtype;
    if (name == "output.weight" && t.shape[1] % 256 != 0) type = GgmlType::kQ8_0;
    if (name == "output.weight" && t.shape[1] % 256 == 0) {
      std::vector<float> values;
      const std::string bytes = EncodeQ6K(t.v, &values);
      ASSERT_TRUE(w.AddTensor(name, GgmlType::kQ6_K, t.shape, bytes).ok());
      if (q6k_values != nullptr) (*q6k_values)[name] = values;
      continue;
    }
    if (name.find("fc1.weight") != std::string::npos ||
        name.find("fc2.weight") != std::string::npos) {
      type = qtype == GgmlType::kQ4_0 ? GgmlType::kQ4_0 : GgmlType::kQ5_0;
    }
    ASSERT_TRUE(w.AddTensor(name, type, t.shape, ToBytes(t.v, type)).ok()) << name;
  }
  ASSERT_TRUE(w.WriteFile(path).ok());
}

// A Hugging Face directory of the same weights (F32 or F16 safetensors).
void WriteHfDir(const ZooModel& m, const std::string& dtype, const std::string& dir) {
  fs::create_directories(dir);
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, t] : m.hf) {
    const std::string bytes =
        ToBytes(t.v, dtype == "F32" || t.shape.size() == 1 ? GgmlType::kF32 : GgmlType::kF16);
    const size_t begin = data.size();
    data += bytes;
    header[name] = {{"dtype", dtype == "F32" || t.shape.size() == 1 ? "F32" : "F16"},
                    {"shape", t.shape},
                    {"data_offsets", {begin, data.size()}}};
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  const uint64_t len = h.size();
  std::ofstream st(dir + "/model.safetensors", std::ios::binary);
  st.write(reinterpret_cast<const char*>(&len), 8);
  st << h << data;
  nlohmann::json config = {{"architectures", {"LlamaForCausalLM"}},
                           {"model_type", "llama"},
                           {"hidden_size", m.hidden},
                           {"intermediate_size", m.ffn},
                           {"num_hidden_layers", m.layers},
                           {"num_attention_heads", m.heads},
                           {"num_key_value_heads", m.kv_heads},
                           {"rms_norm_eps", m.eps},
                           {"rope_theta", m.theta},
                           {"vocab_size", m.vocab},
                           {"max_position_embeddings", 256},
                           {"hidden_act", m.arch == "bamboo" ? "drelu" : "relu"},
                           {"tie_word_embeddings", false}};
  std::ofstream(dir + "/config.json") << config.dump();
}

// A plain llama GGUF (magic GGUF) holding the PWRI file's tensors byte for byte, except that
// ffn_down is the exact F32 transpose of ffn_down_t and the predictors are left out.
void WritePlainTwin(const std::string& pwri, const std::string& path,
                    const std::map<std::string, std::vector<float>>& f32_values = {}) {
  auto f = GgufFile::Open(pwri, {kPowerInferMagic});
  ASSERT_TRUE(f.ok()) << f.status();
  GgufWriter w;
  for (const GgufKeyValue& kv : (*f)->metadata()) {
    if (kv.key != kSparseThresholdKey) w.SetValue(kv.key, kv.value);
  }
  for (const GgufTensorInfo& t : (*f)->tensors()) {
    if (t.name.find(".fc") != std::string::npos) continue;
    std::string bytes(reinterpret_cast<const char*>(t.data), t.nbytes);
    if (auto it = f32_values.find(t.name); it != f32_values.end()) {
      ASSERT_TRUE(
          w.AddTensor(t.name, GgmlType::kF32, t.shape(), ToBytes(it->second, GgmlType::kF32)).ok());
      continue;
    }
    if (t.name.find("ffn_down_t") != std::string::npos) {
      const int64_t F = t.shape()[0], H = t.shape()[1];
      std::vector<float> rows(F * H);
      ASSERT_TRUE(DequantizeGgmlRow(t.type, t.data, rows.data(), F * H).ok());
      Mat down = Transposed(Mat{{F, H}, rows});
      std::string name = t.name;
      name.replace(name.find("ffn_down_t"), 10, "ffn_down");
      ASSERT_TRUE(
          w.AddTensor(name, GgmlType::kF32, down.shape, ToBytes(down.v, GgmlType::kF32)).ok());
      continue;
    }
    ASSERT_TRUE(w.AddTensor(t.name, static_cast<GgmlType>(t.type), t.shape(), bytes).ok());
  }
  w.SetString("pinfer.hidden_act",
              (*f)->GetString("general.architecture").value() == "bamboo" ? "drelu" : "relu");
  ASSERT_TRUE(w.WriteFile(path).ok());
}

// --- running them ------------------------------------------------------------------------------

std::vector<float> Logits(const Model& m, const CpuOps& ops, FfnBlock* ffn = nullptr) {
  Transformer t(m, ops);
  if (ffn != nullptr) t.set_ffn(ffn);
  std::vector<int32_t> tokens(24);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 37 + 5) % 96);
  KvCache cache(m.config, 64);
  std::vector<float> logits(tokens.size() * m.config.vocab_size);
  EXPECT_TRUE(t.Forward(tokens, 0, &cache, LogitsMode::kAll, logits.data()).ok());
  return logits;
}

double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
  }
  return diff / scale;
}

class PowerInferZooTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pinfer_zoo_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    ops_ = NewSimdOps(&pool_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) { return (dir_ / name).string(); }

  // Loads `pwri`, checks it against `reference` (dense logits within `tol`), and that exact
  // sparse mode on the loaded ffn_down_t agrees with dense.
  void CheckAgainst(const std::string& pwri, const Model& reference, double tol) {
    auto pm = LoadPreparedModel(pwri);
    ASSERT_TRUE(pm.ok()) << pm.status();
    const std::vector<float> ref = Logits(reference, *ops_);
    const std::vector<float> dense = Logits(*pm->model, *ops_);
    if (tol == 0) {
      EXPECT_EQ(dense, ref);
    } else {
      EXPECT_LT(MaxRelDiff(dense, ref), tol);
    }
    auto exact = GateSparseFfn::Create(*pm->model, *ops_, pm->down_t());
    ASSERT_TRUE(exact.ok()) << exact.status();
    EXPECT_LT(MaxRelDiff(Logits(*pm->model, *ops_, exact->get()), dense), 1e-5);
    EXPECT_GT((*exact)->stats().Sparsity(), 0.2);  // ReLU: about half the gates are negative

    // The file's own predictors drive the sparse FFN (folded F32 fc1, fc2 and ffn_down_t in the
    // stored type); their selection itself is checked in PredictorsSelectWhatPowerInferSelects.
    // Random predictors: some neurons skipped, not all.
    auto predicted = PredictedSparseFfn::Create(*pm->model, *ops_, pm->down_t(), &pm->predictors);
    ASSERT_TRUE(predicted.ok()) << predicted.status();
    const std::vector<float> sparse = Logits(*pm->model, *ops_, predicted->get());
    ASSERT_EQ(sparse.size(), dense.size());
    for (float v : sparse) ASSERT_TRUE(std::isfinite(v));
    const double s = (*predicted)->stats().Sparsity();
    EXPECT_GT(s, 0.05);
    EXPECT_LT(s, 0.95);
  }

  fs::path dir_;
  ThreadPool pool_{2};
  std::unique_ptr<CpuOps> ops_;
};

TEST_F(PowerInferZooTest, ConvertPyFilesComputeTheHuggingFaceModel) {
  for (const std::string arch : {"llama", "bamboo"}) {
    ZooModel m = RandomZooModel(arch, arch == "llama" ? 11 : 12);
    for (OutType type : {OutType::kF32, OutType::kF16}) {
      SCOPED_TRACE(arch + (type == OutType::kF32 ? " f32" : " f16"));
      const std::string hf = Path(arch + "_hf"), pwri = Path(arch + ".powerinfer.gguf");
      WriteHfDir(m, type == OutType::kF32 ? "F32" : "F16", hf);
      WriteConvertPy(m, type, std::nullopt, pwri);
      auto reference = LoadHuggingFaceModel(hf);
      ASSERT_TRUE(reference.ok()) << reference.status();
      // The attention dot products sum the permuted dimensions in another order: not bitwise.
      CheckAgainst(pwri, **reference, 2e-5);
      auto pm = LoadPreparedModel(pwri);
      ASSERT_TRUE(pm.ok());
      EXPECT_EQ(pm->model->config.activation,
                arch == "bamboo" ? Activation::kDRelu : Activation::kRelu);
      EXPECT_TRUE(pm->model->config.rope_interleaved);
      EXPECT_TRUE(pm->powerinfer_predictors);
      EXPECT_EQ(pm->sparse_threshold, 0.f);  // no predictor config.json: PowerInfer's default
      fs::remove_all(hf);
    }
  }
}

TEST_F(PowerInferZooTest, QuantizedFilesComputeTheirPlainTwin) {
  ZooModel m = RandomZooModel("llama", 13);
  struct Case {
    std::string name;
    std::function<void(const std::string&)> write;
    GgmlType down_t, fc;
  };
  const std::vector<Case> cases = {
      {"convert.py --outtype q8_0",
       [&](const std::string& p) { WriteConvertPy(m, OutType::kQ8_0, 0.f, p); }, GgmlType::kQ8_0,
       GgmlType::kQ8_0},
      {"quantize Q4_0", [&](const std::string& p) { WriteQuantized(m, GgmlType::kQ4_0, p); },
       GgmlType::kQ4_0, GgmlType::kQ4_0},
      {"quantize Q8_0", [&](const std::string& p) { WriteQuantized(m, GgmlType::kQ8_0, p); },
       GgmlType::kQ8_0, GgmlType::kQ5_0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string pwri = Path("q.powerinfer.gguf"), twin = Path("twin.gguf");
    c.write(pwri);
    auto f = GgufFile::Open(pwri, {kPowerInferMagic});
    ASSERT_TRUE(f.ok());
    EXPECT_EQ((*f)->FindTensor("blk.1.ffn_down_t.weight")->type, static_cast<uint32_t>(c.down_t));
    EXPECT_EQ((*f)->FindTensor("blk.1.fc2.weight")->type, static_cast<uint32_t>(c.fc));
    WritePlainTwin(pwri, twin);
    auto reference = LoadModel(twin);
    ASSERT_TRUE(reference.ok()) << reference.status();
    CheckAgainst(pwri, **reference, 0);  // the same tensors and kernels: bit for bit
    auto pm = LoadPreparedModel(pwri);
    ASSERT_TRUE(pm.ok());
    EXPECT_EQ(pm->down_t()[1].dtype, c.down_t == GgmlType::kQ4_0 ? DType::kQ4_0 : DType::kQ8_0);
    EXPECT_EQ(pm->predictors.layers[1].fc1.dtype, DType::kF32);  // folded (and dequantized)
    // fc2 as stored (Q8_0 or Q4_0 kept, Q5_0 dequantized): within one quantization step of the
    // predictor's weights (Q4_0/Q5_0 clamp the top level), where a wrong bit layout would miss by
    // the block's range.
    const LayerPredictor& P = pm->predictors.layers[1];
    const Mat& fc2 = m.predictors[1].second;
    const int R = m.rank;
    const double levels = c.fc == GgmlType::kQ8_0 ? 127 : c.fc == GgmlType::kQ5_0 ? 16 : 8;
    std::vector<float> row(R);
    for (int j = 0; j < m.ffn; ++j) {
      DequantizeRow(P.fc2.dtype, P.fc2.row(j), row.data(), R);
      float amax = 0;
      for (int k = 0; k < R; ++k) amax = std::max(amax, std::fabs(fc2.v[j * R + k]));
      for (int k = 0; k < R; ++k) {
        ASSERT_NEAR(row[k], fc2.v[j * R + k], 1.01 * amax / levels + 1e-3 * amax) << j << "," << k;
      }
    }
  }
}

// Hidden 256: `quantize` stores the output head as Q6_K, which pinfer computes in its type, with
// activations rounded to Q8_K as llama.cpp does. The twin holds the values the test's own encoder
// put in the blocks, as F32, so the two differ by that rounding of the head's input.
TEST_F(PowerInferZooTest, Q6KOutputHeadComputesWhatItHolds) {
  ZooModel m = RandomZooModel("llama", 16, /*hidden=*/256);
  const std::string pwri = Path("q6k.powerinfer.gguf"), twin = Path("twin.gguf");
  std::map<std::string, std::vector<float>> values;
  WriteQuantized(m, GgmlType::kQ4_0, pwri, &values);
  ASSERT_EQ(values.size(), 1u);
  auto f = GgufFile::Open(pwri, {kPowerInferMagic});
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->FindTensor("output.weight")->type, static_cast<uint32_t>(GgmlType::kQ6_K));
  WritePlainTwin(pwri, twin, values);
  auto reference = LoadModel(twin);
  ASSERT_TRUE(reference.ok()) << reference.status();
  CheckAgainst(pwri, **reference, 2e-2);
}

// PowerInfer feeds its predictors the residual before ffn_norm; pinfer's FFN block sees the
// normalized input. With threshold 0 the folded predictor must pick exactly PowerInfer's neurons.
TEST_F(PowerInferZooTest, PredictorsSelectWhatPowerInferSelects) {
  ZooModel m = RandomZooModel("llama", 14);
  const std::string pwri = Path("p.powerinfer.gguf");
  WriteConvertPy(m, OutType::kF32, 0.f, pwri);
  auto pm = LoadPreparedModel(pwri);
  ASSERT_TRUE(pm.ok()) << pm.status();
  const int H = m.hidden, F = m.ffn, R = m.rank;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.f, 3.f);
  int64_t agree = 0, total = 0;
  for (int l = 0; l < m.layers; ++l) {
    const LayerPredictor& P = pm->predictors.layers[l];
    const Mat& w =
        m.hf.at("model.layers." + std::to_string(l) + ".post_attention_layernorm.weight");
    std::vector<float> fc1(R * H), fc2(F * R);
    for (int r = 0; r < R; ++r) DequantizeRow(P.fc1.dtype, P.fc1.row(r), &fc1[r * H], H);
    for (int j = 0; j < F; ++j) DequantizeRow(P.fc2.dtype, P.fc2.row(j), &fc2[j * R], R);
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> r(H), x(H);
      double ms = 0;
      for (float& v : r) {
        v = d(rng);
        ms += v * v;
      }
      const double inv = 1 / std::sqrt(ms / H + m.eps);
      for (int i = 0; i < H; ++i) x[i] = static_cast<float>(r[i] * inv) * w.v[i];
      // PowerInfer: fc2(relu(fc1 r)) on the file's fc1/fc2; pinfer: the loaded ones on x.
      std::vector<double> h_pi(R), h_pf(R);
      for (int k = 0; k < R; ++k) {
        for (int i = 0; i < H; ++i) {
          h_pi[k] += static_cast<double>(m.predictors[l].first.v[k * H + i]) * r[i];
          h_pf[k] += static_cast<double>(fc1[k * H + i]) * x[i];
        }
        h_pi[k] = std::max(h_pi[k], 0.0);
        h_pf[k] = std::max(h_pf[k], 0.0);
      }
      for (int j = 0; j < F; ++j) {
        double s_pi = 0, s_pf = 0;
        for (int k = 0; k < R; ++k) {
          s_pi += m.predictors[l].second.v[j * R + k] * h_pi[k];
          s_pf += fc2[j * R + k] * h_pf[k];
        }
        ++total;
        agree += (s_pi >= pm->sparse_threshold) == (s_pf >= P.threshold);
        // Up to rounding, pinfer's score is PowerInfer's divided by rms(r).
        EXPECT_NEAR(s_pf, s_pi * inv, 1e-4 * (1 + std::fabs(s_pi * inv)));
      }
    }
  }
  EXPECT_EQ(agree, total);
}

// Runs PowerInfer's rule beside pinfer's block: for every layer and token, the number of neurons
// whose score on the residual before ffn_norm (the file's own fc1 and fc2) reaches the threshold,
// against the number PredictedSparseFfn selected from the normalized input.
class PowerInferRuleProbe : public FfnBlock {
 public:
  PowerInferRuleProbe(const ZooModel& m, float threshold, PredictedSparseFfn* inner)
      : m_(m), threshold_(threshold), inner_(inner) {}
  absl::Status Forward(int layer, const float* x, int n, float* out) override {
    return inner_->Forward(layer, x, n, out);
  }
  absl::Status ForwardFromResidual(int layer, const float* residual, const float* x, int n,
                                   float* out) override {
    const int H = m_.hidden, F = m_.ffn, R = m_.rank;
    const Mat& fc1 = m_.predictors[layer].first;
    const Mat& fc2 = m_.predictors[layer].second;
    for (int t = 0; t < n; ++t) {
      const float* r = residual + static_cast<size_t>(t) * H;
      std::vector<double> h(R, 0.0);
      for (int k = 0; k < R; ++k) {
        for (int i = 0; i < H; ++i) h[k] += static_cast<double>(fc1.v[k * H + i]) * r[i];
        h[k] = std::max(h[k], 0.0);
      }
      double ss = 0;
      for (int i = 0; i < H; ++i) ss += static_cast<double>(r[i]) * r[i];
      const double rms = std::sqrt(ss / H + m_.eps);
      for (int j = 0; j < F; ++j) {
        double score = 0;
        for (int k = 0; k < R; ++k) score += fc2.v[j * R + k] * h[k];
        scores.push_back(score);
        reference_selected += score >= threshold_;
        unscaled_selected += score / rms >= threshold_;  // the folded score, not rescaled
      }
    }
    const int64_t before = inner_->stats().layers[layer].selected;
    absl::Status st = inner_->ForwardFromResidual(layer, residual, x, n, out);
    pinfer_selected += inner_->stats().layers[layer].selected - before;
    return st;
  }
  int64_t reference_selected = 0, pinfer_selected = 0, unscaled_selected = 0;
  std::vector<double> scores;

 private:
  const ZooModel& m_;
  float threshold_;
  PredictedSparseFfn* inner_;
};

// A non-zero powerinfer.sparse_threshold (ProSparse's files carry one): the folded predictor's
// score is PowerInfer's divided by rms(residual), so pinfer rescales it by the residual's rms
// before comparing. Through the Transformer, the selections must match PowerInfer's rule applied
// to the residual; without the residual the block refuses instead of selecting differently.
TEST_F(PowerInferZooTest, NonZeroThresholdSelectsWhatPowerInferSelects) {
  ZooModel m = RandomZooModel("llama", 15);
  // First the scores themselves (threshold 0), to put the threshold amid the positive ones.
  const std::string probe_file = Path("probe.powerinfer.gguf");
  WriteConvertPy(m, OutType::kF32, 0.f, probe_file);
  auto probe_pm = LoadPreparedModel(probe_file);
  ASSERT_TRUE(probe_pm.ok()) << probe_pm.status();
  auto probe_block = PredictedSparseFfn::Create(*probe_pm->model, *ops_, probe_pm->down_t(),
                                                &probe_pm->predictors);
  ASSERT_TRUE(probe_block.ok()) << probe_block.status();
  PowerInferRuleProbe probe(m, 0.f, probe_block->get());
  Logits(*probe_pm->model, *ops_, &probe);
  std::vector<double> positive;
  for (double v : probe.scores) {
    if (v > 0) positive.push_back(v);
  }
  ASSERT_GT(positive.size(), 100u);
  std::nth_element(positive.begin(), positive.begin() + positive.size() / 2, positive.end());
  const float threshold = static_cast<float>(positive[positive.size() / 2]);

  const std::string pwri = Path("t.powerinfer.gguf");
  WriteConvertPy(m, OutType::kF32, threshold, pwri);
  auto pm = LoadPreparedModel(pwri);
  ASSERT_TRUE(pm.ok()) << pm.status();
  EXPECT_EQ(pm->sparse_threshold, threshold);
  ASSERT_TRUE(pm->predictors.layers[0].reads_residual);
  auto block = PredictedSparseFfn::Create(*pm->model, *ops_, pm->down_t(), &pm->predictors);
  ASSERT_TRUE(block.ok()) << block.status();
  PowerInferRuleProbe rule(m, threshold, block->get());
  Logits(*pm->model, *ops_, &rule);
  // Half the positive scores lie above the threshold: a real cut, not all or nothing.
  EXPECT_GT(rule.reference_selected, 0.2 * rule.scores.size() / 2);
  EXPECT_LT(rule.reference_selected, 0.8 * rule.scores.size());
  // Equal but for scores within rounding of the threshold (float against double sums).
  EXPECT_NEAR(static_cast<double>(rule.pinfer_selected), rule.reference_selected,
              1e-3 * rule.reference_selected + 1);

  // Without the rescaling by rms(residual) the selection would differ: the check above can fail.
  EXPECT_GT(std::abs(rule.unscaled_selected - rule.reference_selected),
            0.05 * rule.reference_selected);

  // Called without the residual, the block refuses (FailedPrecondition) instead of guessing.
  std::vector<float> x(m.hidden, 0.5f), out(m.hidden);
  absl::Status st = (*block)->Forward(0, x.data(), 1, out.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("need the residual"));
}

TEST_F(PowerInferZooTest, MalformedZooFilesGiveSpecificErrors) {
  ZooModel m = RandomZooModel("llama", 15);
  const std::string pwri = Path("bad.powerinfer.gguf");
  m.arch = "falcon";
  WriteConvertPy(m, OutType::kF16, std::nullopt, pwri);
  auto pm = LoadPreparedModel(pwri);
  EXPECT_EQ(pm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pm.status().message(), HasSubstr("unsupported architecture 'falcon'"));

  // A ffn_down_t of the wrong shape (not transposed).
  m.arch = "llama";
  GgufWriter w(kPowerInferMagic);
  SetArchKeys(m, &w, 1, std::nullopt);
  for (auto [name, t] : ConvertPyTensors(m)) {
    if (name == "blk.1.ffn_down_t.weight") t = Transposed(t);
    ASSERT_TRUE(w.AddTensor(name, GgmlType::kF32, t.shape, ToBytes(t.v, GgmlType::kF32)).ok());
  }
  ASSERT_TRUE(w.WriteFile(pwri).ok());
  pm = LoadPreparedModel(pwri);
  EXPECT_FALSE(pm.ok());
  EXPECT_THAT(pm.status().message(), HasSubstr("blk.1."));

  // A tensor of a type pinfer cannot read (Q2_K).
  GgufWriter w2(kPowerInferMagic);
  SetArchKeys(m, &w2, 1, std::nullopt);
  for (const auto& [name, t] : ConvertPyTensors(m)) {
    if (name == "blk.0.fc1.weight") {
      ASSERT_TRUE(w2.AddTensor(name, GgmlType::kQ2_K, {32, 256}, std::string(32 * 84, '\0')).ok());
      continue;
    }
    ASSERT_TRUE(w2.AddTensor(name, GgmlType::kF32, t.shape, ToBytes(t.v, GgmlType::kF32)).ok());
  }
  ASSERT_TRUE(w2.WriteFile(pwri).ok());
  pm = LoadPreparedModel(pwri);
  EXPECT_EQ(pm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pm.status().message(), HasSubstr("unsupported tensor type Q2_K"));
}

// PowerInfer's loader takes the index's tensors by position (layer l: tensors 2l and 2l+1) and
// only checks their count; pinfer looks them up by name and says what is wrong with each.
TEST_F(PowerInferZooTest, GpuIndexesAreReadByNameAndMalformedOnesNameTheProblem) {
  const std::string path = Path("m.gguf.generated.gpuidx");
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> shape;
    std::vector<int32_t> v;
  };
  auto write = [&](const std::vector<Tensor>& tensors, bool capacity = true) {
    GgufWriter w(kPowerInferMagic);
    w.SetString("general.architecture", kGpuIndexArchitecture);
    w.SetU32(std::string(kGpuIndexArchitecture) + ".block_count", 2);
    if (capacity) w.SetU64("split.vram_capacity", 4096);
    for (const Tensor& t : tensors) {
      ASSERT_TRUE(
          w.AddTensor(t.name, t.type, t.shape,
                      std::string(reinterpret_cast<const char*>(t.v.data()), t.v.size() * 4))
              .ok());
    }
    ASSERT_TRUE(w.WriteFile(path).ok());
  };
  const Tensor idx0{"blk.0.gpu_idx", GgmlType::kI32, {4}, {1, 1, 0, 0}};
  const Tensor bucket0{"blk.0.gpu_bucket", GgmlType::kI32, {2}, {0, 1}};
  const Tensor idx1{"blk.1.gpu_idx", GgmlType::kI32, {4}, {0, 0, 0, 1}};
  const Tensor bucket1{"blk.1.gpu_bucket", GgmlType::kI32, {1}, {3}};
  // Any order of the tensors.
  write({bucket1, idx0, idx1, bucket0});
  auto g = ReadGpuIndex(path, 2, 4);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->vram_capacity, 4096u);
  EXPECT_EQ(g->gpu_bucket[1], std::vector<int32_t>({3}));

  // Without buckets (powerinfer-py's export_split.py since its MoE support): derived from gpu_idx.
  write({idx0, idx1});
  g = ReadGpuIndex(path, 2, 4);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->gpu_bucket[0], std::vector<int32_t>({0, 1}));
  EXPECT_EQ(g->gpu_bucket[1], std::vector<int32_t>({3}));
  write({idx0, bucket0, bucket1});
  g = ReadGpuIndex(path, 2, 4);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(g.status().message(), HasSubstr("missing tensor 'blk.1.gpu_idx'"));
  Tensor f32 = idx1;
  f32.type = GgmlType::kF32;
  write({idx0, bucket0, f32, bucket1});
  g = ReadGpuIndex(path, 2, 4);
  EXPECT_THAT(g.status().message(), HasSubstr("tensor 'blk.1.gpu_idx' has type F32, expected I32"));
  Tensor matrix = idx1;
  matrix.shape = {2, 2};
  write({idx0, bucket0, matrix, bucket1});
  g = ReadGpuIndex(path, 2, 4);
  EXPECT_THAT(g.status().message(), HasSubstr("blk.1.gpu_idx must be a vector of 4 values"));
  write({idx0, bucket0, idx1, bucket1}, /*capacity=*/false);
  g = ReadGpuIndex(path, 2, 4);
  EXPECT_FALSE(g.ok());
  EXPECT_THAT(g.status().message(), HasSubstr("split.vram_capacity"));
  Tensor unsorted = bucket0;
  unsorted.v = {1, 0};
  write({idx0, unsorted, idx1, bucket1});
  g = ReadGpuIndex(path, 2, 4);
  EXPECT_THAT(g.status().message(),
              HasSubstr("blk.0.gpu_bucket does not list, in ascending order, the 2 neurons"));
}

// Q6_K (the quantize tool's output head for rows of 256k) by hand: d = 0.5, every scale 2, and
// six-bit values chosen per position so that each of the four interleaved groups is visible.
TEST(GgmlDequantTest, Q6KAndQ5Blocks) {
  std::vector<uint8_t> b(210, 0);
  // All ql nibbles 1, all qh pairs 2: q = 1 | (2 << 4) = 33 -> value 0.5 * 2 * (33 - 32) = 1.
  for (int i = 0; i < 128; ++i) b[i] = 0x11;
  for (int i = 0; i < 64; ++i) b[128 + i] = 0xAA;
  for (int i = 0; i < 16; ++i) b[192 + i] = 2;
  const uint16_t d = Fp32ToFp16(0.5f);
  std::memcpy(&b[208], &d, 2);
  b[192 + 15] = static_cast<uint8_t>(-3);  // the last 16 values of the second half: scale -3
  b[0] = 0x10;  // value 0: low nibble 0 -> q = 32 -> 0; value 64 (high nibble of ql[0]): q = 33
  std::vector<float> y(256);
  ASSERT_TRUE(
      DequantizeGgmlRow(static_cast<uint32_t>(GgmlType::kQ6_K), b.data(), y.data(), 256).ok());
  EXPECT_EQ(y[0], 0.f);
  EXPECT_EQ(y[64], 1.f);
  EXPECT_EQ(y[1], 1.f);
  EXPECT_EQ(y[255], -1.5f);  // group 4 of the second half, l >= 16: scale index 8 + 1 + 6 = 15
  EXPECT_EQ(y[254 - 128], 1.f);

  // Q5_0: d = 0.25, q = 20 everywhere except the fifth bit cleared at position 3 -> 4.
  std::vector<uint8_t> q5(22, 0);
  const uint16_t d5 = Fp32ToFp16(0.25f);
  std::memcpy(&q5[0], &d5, 2);
  const uint32_t qh = 0xFFFFFFFFu & ~(1u << 3);
  std::memcpy(&q5[2], &qh, 4);
  for (int i = 0; i < 16; ++i) q5[6 + i] = 0x44;
  std::vector<float> y5(32);
  ASSERT_TRUE(
      DequantizeGgmlRow(static_cast<uint32_t>(GgmlType::kQ5_0), q5.data(), y5.data(), 32).ok());
  EXPECT_EQ(y5[0], (20 - 16) * 0.25f);
  EXPECT_EQ(y5[3], (4 - 16) * 0.25f);
  EXPECT_EQ(y5[19], (20 - 16) * 0.25f);
}

}  // namespace
}  // namespace pinfer
