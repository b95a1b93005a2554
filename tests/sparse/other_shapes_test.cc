// The whole preparation pipeline on a ReLU model of another shape than relu-llama-tiny: grouped
// queries 4:1 (one KV head), head_dim 48 with hidden 128 (q_dim 192, not hidden), tied
// embeddings, RoPE theta 500000, an FFN of 352 and three layers, from a Hugging Face directory of
// random F16 weights (the bundled tokenizer.model for the vocabulary). It must prepare (profile,
// train, write), reload with that shape, compute the source model, run exact sparse mode equal
// to dense, run the predictors at about their trained recall, and place neurons as a hot prefix
// whose GPU index round-trips.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/perplexity.h"
#include "shared/engine/transformer.h"
#include "shared/sparse/placement.h"
#include "shared/sparse/prepare.h"
#include "shared/sparse/prepared_model.h"
#include "shared/sparse/sparse_ffn.h"
#include "shared/util/half.h"
#include "shared/util/thread_pool.h"

namespace pinfer {
namespace {

namespace fs = std::filesystem;
const std::string kTiny = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Random F16 weights of the shape above, as transformers names them.
void WriteModelDir(const std::string& dir, const std::string& act) {
  const int H = 128, F = 352, L = 3, heads = 4, kv = 1, hd = 48, V = 4096;
  fs::create_directories(dir);
  std::mt19937 rng(21);
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale, bool norm) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::normal_distribution<float> d(0.f, scale);
    std::uniform_real_distribution<float> u(0.8f, 1.2f);
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = Fp32ToFp16(norm ? u(rng) : d(rng));
    const size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(v.data()), v.size() * 2);
    header[name] = {{"dtype", "F16"}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
  };
  const float s = 1.f / std::sqrt(static_cast<float>(H));
  add("model.embed_tokens.weight", {V, H}, 1.f, false);
  add("model.norm.weight", {H}, 0, true);
  for (int l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, 0, true);
    add(p + "post_attention_layernorm.weight", {H}, 0, true);
    add(p + "self_attn.q_proj.weight", {heads * hd, H}, s, false);
    add(p + "self_attn.k_proj.weight", {kv * hd, H}, s, false);
    add(p + "self_attn.v_proj.weight", {kv * hd, H}, s, false);
    add(p + "self_attn.o_proj.weight", {H, heads * hd}, 1.f / std::sqrt(heads * hd * 1.f), false);
    add(p + "mlp.gate_proj.weight", {F, H}, s, false);
    add(p + "mlp.up_proj.weight", {F, H}, s, false);
    add(p + "mlp.down_proj.weight", {H, F}, 1.f / std::sqrt(static_cast<float>(F)), false);
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  const uint64_t len = h.size();
  std::ofstream st(dir + "/model.safetensors", std::ios::binary);
  st.write(reinterpret_cast<const char*>(&len), 8);
  st << h << data;
  st.close();
  nlohmann::json config = {{"architectures", {"LlamaForCausalLM"}},
                           {"model_type", "llama"},
                           {"hidden_size", H},
                           {"intermediate_size", F},
                           {"num_hidden_layers", L},
                           {"num_attention_heads", heads},
                           {"num_key_value_heads", kv},
                           {"head_dim", hd},
                           {"rms_norm_eps", 1e-6},
                           {"rope_theta", 500000.0},
                           {"vocab_size", V},
                           {"max_position_embeddings", 1024},
                           {"hidden_act", act},
                           {"bos_token_id", 1},
                           {"eos_token_id", 2},
                           {"tie_word_embeddings", true}};
  std::ofstream(dir + "/config.json") << config.dump();
  fs::copy_file(kTiny + "/tokenizer.model", dir + "/tokenizer.model",
                fs::copy_options::overwrite_existing);
}

std::vector<int32_t> HeldoutTokens(size_t n) {
  const std::string raw = ReadFile(kTiny + "/heldout-tokens.u32");
  std::vector<int32_t> t(std::min(n, raw.size() / 4));
  std::memcpy(t.data(), raw.data(), t.size() * 4);
  return t;
}

class OtherShapesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(OtherShapesTest, PreparesPlacesAndRunsExactly) {
  const fs::path dir = fs::temp_directory_path() /
                       ("pinfer_shapes_" + std::to_string(::getpid()) + "_" + GetParam());
  fs::remove_all(dir);
  WriteModelDir((dir / "hf").string(), GetParam());
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);

  PrepareOptions o;
  o.model_path = (dir / "hf").string();
  o.calibration_text = ReadFile(kTiny + "/calibration.txt");
  o.out_path = (dir / "prepared.gguf").string();
  o.max_calibration_tokens = 3072;
  o.window = 256;
  o.training.ranks = {32};
  o.training.epochs = 1;
  o.training.target_recall = 0.98;
  auto prepared = PrepareModel(o, *ops);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  ASSERT_EQ(prepared->reports.size(), 3u);
  for (const LayerPredictorReport& r : prepared->reports) {
    EXPECT_EQ(r.rank, 32);
    EXPECT_GT(r.magnitude_recall, 0.95);
  }

  auto pm = LoadPreparedModel(o.out_path);
  ASSERT_TRUE(pm.ok()) << pm.status();
  const ModelConfig& c = pm->model->config;
  EXPECT_EQ(c.head_dim, 48);
  EXPECT_EQ(c.n_kv_heads, 1);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(c.activation, GetParam() == "drelu" ? Activation::kDRelu : Activation::kRelu);
  EXPECT_FALSE(pm->powerinfer_predictors);

  // Dense: the prepared file (renumbered neurons, ffn_down_t) computes the source model.
  auto source = LoadModel(o.model_path);
  ASSERT_TRUE(source.ok()) << source.status();
  const std::vector<int32_t> tokens = HeldoutTokens(512);
  Transformer src(**source, *ops), dense(*pm->model, *ops);
  auto p_src = ComputePerplexity(src, tokens, 256);
  auto p_dense = ComputePerplexity(dense, tokens, 256);
  ASSERT_TRUE(p_src.ok() && p_dense.ok());
  EXPECT_NEAR(p_dense->perplexity, p_src->perplexity, 1e-4 * p_src->perplexity);

  // Exact sparse mode equals dense.
  auto exact = GateSparseFfn::Create(*pm->model, *ops, pm->down_t());
  ASSERT_TRUE(exact.ok()) << exact.status();
  Transformer ex(*pm->model, *ops);
  ex.set_ffn(exact->get());
  auto p_exact = ComputePerplexity(ex, tokens, 256);
  ASSERT_TRUE(p_exact.ok());
  EXPECT_NEAR(p_exact->perplexity, p_dense->perplexity, 1e-4 * p_dense->perplexity);
  EXPECT_GT((*exact)->stats().Sparsity(), 0.2);

  // The predictors, at about the recall they were trained for.
  auto predicted = PredictedSparseFfn::Create(*pm->model, *ops, pm->down_t(), &pm->predictors);
  ASSERT_TRUE(predicted.ok()) << predicted.status();
  (*predicted)->set_measure_recall(true);
  Transformer pr(*pm->model, *ops);
  pr.set_ffn(predicted->get());
  ASSERT_TRUE(ComputePerplexity(pr, tokens, 256).ok());
  EXPECT_GT((*predicted)->stats().MagnitudeRecall(), 0.9);

  // Placement: a budget for the dense parts plus 40% of all rows puts a hot prefix of every
  // layer on the GPU (the file is frequency-ordered), and the index round-trips.
  auto profile = StoredProfile(*pm);
  ASSERT_TRUE(profile.ok()) << profile.status();
  PlacementOptions po;
  po.context = 256;
  po.vram_budget = uint64_t{1} << 40;
  auto all = PlanPlacement(*pm->model, *profile, &pm->predictors, po);
  ASSERT_TRUE(all.ok()) << all.status();
  const uint64_t fixed =
      all->dense_bytes + all->kv_cache_bytes + all->predictor_bytes + all->scratch_bytes;
  po.vram_budget = fixed + all->hot_row_bytes * 4 / 10;
  auto plan = PlanPlacement(*pm->model, *profile, &pm->predictors, po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_LE(plan->hot_row_bytes, all->hot_row_bytes * 4 / 10);
  int64_t hot = 0;
  for (size_t l = 0; l < plan->hot.size(); ++l) {
    for (size_t i = 0; i < plan->hot[l].size(); ++i) EXPECT_EQ(plan->hot[l][i], i);
    hot += plan->hot[l].size();
    auto ranges = SplitByteRanges(*pm->file, static_cast<int>(l), plan->hot[l].size());
    ASSERT_TRUE(ranges.ok());
    EXPECT_EQ(ranges->hot[0].end, ranges->cold[0].begin);
  }
  EXPECT_GT(hot, 0);
  EXPECT_LT(hot, 3 * 352);
  const std::string index = GpuIndexPath(o.out_path);
  ASSERT_TRUE(WriteGpuIndex(GpuIndexFromPlan(*plan, 352), index).ok());
  auto read = ReadGpuIndex(index, 3, 352);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->gpu_bucket, plan->hot);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(ReluFamily, OtherShapesTest, ::testing::Values("relu", "drelu"));

}  // namespace
}  // namespace pinfer
