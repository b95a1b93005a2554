// Prepared (PWRI) models and GPU indexes: what is written reloads and computes the same thing,
// the files follow PowerInfer's layout (magic, key and tensor names, I32 type id 18), hot and cold
// rows are contiguous, and malformed files give their specific errors.
#include "shared/sparse/prepared_model.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shared/engine/perplexity.h"
#include "shared/engine/transformer.h"
#include "shared/model/gguf.h"
#include "shared/util/half.h"
#include "shared/util/mapped_file.h"
#include "tests/sparse/random_model.h"

namespace pinfer {
namespace {

using ::testing::HasSubstr;
using testing_util::RandomModel;
using testing_util::RandomModelOptions;

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          (name + "." + std::to_string(::getpid()) + "." +
           ::testing::UnitTest::GetInstance()->current_test_info()->name()))
      .string();
}

std::string Bytes(const TensorView& t) {
  return std::string(static_cast<const char*>(t.data), t.nbytes());
}

// A weights-only llama GGUF of a random model (ReLU, F16 matrices).
std::string WriteRandomGguf(const Model& m, const std::string& path) {
  const ModelConfig& c = m.config;
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("llama.embedding_length", c.hidden_size);
  w.SetU32("llama.block_count", c.n_layers);
  w.SetU32("llama.feed_forward_length", c.ffn_size);
  w.SetU32("llama.attention.head_count", c.n_heads);
  w.SetU32("llama.attention.head_count_kv", c.n_kv_heads);
  w.SetU32("llama.context_length", c.max_context);
  w.SetF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.SetString("pinfer.hidden_act", "relu");
  auto add = [&](const std::string& name, const TensorView& t) {
    auto type = GgmlTypeFromDType(t.dtype);
    ASSERT_TRUE(type.ok());
    ASSERT_TRUE(w.AddTensor(name, *type, t.shape, Bytes(t)).ok()) << name;
  };
  add("token_embd.weight", m.tok_embeddings);
  add("output_norm.weight", m.output_norm);
  add("output.weight", m.output);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = m.layers[l];
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", L.attn_norm);
    add(p + "attn_q.weight", L.wq);
    add(p + "attn_k.weight", L.wk);
    add(p + "attn_v.weight", L.wv);
    add(p + "attn_output.weight", L.wo);
    add(p + "ffn_norm.weight", L.ffn_norm);
    add(p + "ffn_gate.weight", L.gate);
    add(p + "ffn_up.weight", L.up);
    add(p + "ffn_down.weight", L.down);
  }
  EXPECT_TRUE(w.WriteFile(path).ok());
  return path;
}

// fc1 = [I; -I], fc2 = [Wg, -Wg] / 4 (F16): score = gate / 4, threshold -0.05.
PredictorSet GatePredictor(const Model& model) {
  const ModelConfig& c = model.config;
  const int H = c.hidden_size, F = c.ffn_size;
  PredictorSet set;
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<float> w1(static_cast<size_t>(2 * H) * H, 0.f), w2(static_cast<size_t>(F) * 2 * H);
    for (int i = 0; i < H; ++i) {
      w1[i * H + i] = 1.f;
      w1[(H + i) * H + i] = -1.f;
    }
    std::vector<float> g(H);
    for (int j = 0; j < F; ++j) {
      DequantizeRow(model.layers[l].gate.dtype, model.layers[l].gate.row(j), g.data(), H);
      for (int i = 0; i < H; ++i) {
        w2[j * 2 * H + i] = g[i] / 4;
        w2[j * 2 * H + H + i] = -g[i] / 4;
      }
    }
    auto b1 = std::make_shared<std::vector<uint8_t>>(w1.size() * 2);
    auto b2 = std::make_shared<std::vector<uint8_t>>(w2.size() * 2);
    QuantizeRow(DType::kF16, w1.data(), b1->data(), static_cast<int64_t>(w1.size()));
    QuantizeRow(DType::kF16, w2.data(), b2->data(), static_cast<int64_t>(w2.size()));
    LayerPredictor p;
    p.fc1 = TensorView{"fc1", DType::kF16, {2 * H, H}, b1->data()};
    p.fc2 = TensorView{"fc2", DType::kF16, {F, 2 * H}, b2->data()};
    p.threshold = -0.05f;
    set.layers.push_back(p);
    set.owned.push_back(b1);
    set.owned.push_back(b2);
  }
  return set;
}

ActivationProfile RandomProfile(const ModelConfig& c, uint32_t seed) {
  ActivationProfile p;
  p.n_layers = c.n_layers;
  p.ffn_size = c.ffn_size;
  p.tokens = 1000;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> d(0, 1000);
  p.active.assign(c.n_layers, std::vector<int64_t>(c.ffn_size));
  for (auto& layer : p.active) {
    for (auto& v : layer) v = d(rng);
  }
  return p;
}

std::vector<int32_t> RandomTokens(int n, int vocab) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (auto& v : t) v = d(rng);
  return t;
}

class PreparedModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RandomModelOptions o;
    o.dtype = DType::kF16;
    model_ = RandomModel(o);
    source_path_ = WriteRandomGguf(*model_, TempPath("source.gguf"));
    out_path_ = TempPath("prepared.gguf");
    contents_.profile = RandomProfile(model_->config, 3);
    contents_.predictors = GatePredictor(*model_);
  }
  void TearDown() override {
    std::filesystem::remove(source_path_);
    std::filesystem::remove(out_path_);
    std::filesystem::remove(GpuIndexPath(out_path_));
  }
  absl::Status Write() {
    auto src = GgufFile::Open(source_path_);
    if (!src.ok()) return src.status();
    return WritePreparedModel(**src, contents_, out_path_);
  }
  std::unique_ptr<Model> model_;
  std::string source_path_, out_path_;
  PreparedContents contents_;
};

TEST_F(PreparedModelTest, FileFollowsPowerInferLayout) {
  ASSERT_TRUE(Write().ok());
  auto f = GgufFile::Open(out_path_, {kPowerInferMagic});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->magic(), "PWRI");
  EXPECT_TRUE((*f)->HasKey("powerinfer.sparse_threshold"));
  for (int l = 0; l < 2; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    EXPECT_EQ((*f)->FindTensor(p + "ffn_down.weight"), nullptr);
    const GgufTensorInfo* dt = (*f)->FindTensor(p + "ffn_down_t.weight");
    ASSERT_NE(dt, nullptr);
    EXPECT_EQ(dt->ne, (std::vector<int64_t>{64, 256}));  // ne innermost first: [hidden, ffn]
    const GgufTensorInfo* fc1 = (*f)->FindTensor(p + "fc1.weight");
    const GgufTensorInfo* fc2 = (*f)->FindTensor(p + "fc2.weight");
    ASSERT_NE(fc1, nullptr);
    ASSERT_NE(fc2, nullptr);
    EXPECT_EQ(fc1->ne, (std::vector<int64_t>{64, 128}));   // torch fc1.weight [128, 64]
    EXPECT_EQ(fc2->ne, (std::vector<int64_t>{128, 256}));  // torch fc2.weight [256, 128]
  }
}

TEST_F(PreparedModelTest, ReloadsAndComputesTheSame) {
  ASSERT_TRUE(Write().ok());
  auto pm = LoadPreparedModel(out_path_);
  ASSERT_TRUE(pm.ok()) << pm.status();
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  std::vector<int32_t> tokens = RandomTokens(2 * 64, model_->config.vocab_size);

  // The source as the GGUF loader reads it (rotary pairs interleaved, as GGUF files store Q/K).
  auto source = LoadModel(source_path_);
  ASSERT_TRUE(source.ok()) << source.status();
  // Dense: the renumbered neurons give the same function.
  Transformer original(**source, *ops);
  Transformer reloaded(*pm->model, *ops);
  auto a = ComputePerplexity(original, tokens, 64);
  auto b = ComputePerplexity(reloaded, tokens, 64);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(b->perplexity, a->perplexity, 1e-5 * a->perplexity);

  // Sparse with the predictors: in memory on the source vs. from the file.
  auto down_t = TransposeDownProjections(**source);
  ASSERT_TRUE(down_t.ok());
  auto s1 = PredictedSparseFfn::Create(**source, *ops, down_t->layers, &contents_.predictors);
  auto s2 = PredictedSparseFfn::Create(*pm->model, *ops, pm->down_t(), &pm->predictors);
  ASSERT_TRUE(s1.ok() && s2.ok());
  original.set_ffn(s1->get());
  reloaded.set_ffn(s2->get());
  auto c = ComputePerplexity(original, tokens, 64);
  auto d = ComputePerplexity(reloaded, tokens, 64);
  ASSERT_TRUE(c.ok() && d.ok());
  EXPECT_NEAR(d->perplexity, c->perplexity, 1e-5 * c->perplexity);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ((*s1)->stats().layers[l].selected, (*s2)->stats().layers[l].selected);
    EXPECT_FLOAT_EQ(pm->predictors.layers[l].threshold, -0.05f);
  }
  // The selection really is sparse (random model: about half the gates negative).
  EXPECT_GT((*s2)->stats().Sparsity(), 0.3);
}

TEST_F(PreparedModelTest, NeuronsAreOrderedHotFirstAndTheProfileIsKept) {
  ASSERT_TRUE(Write().ok());
  auto pm = LoadPreparedModel(out_path_);
  ASSERT_TRUE(pm.ok()) << pm.status();
  ASSERT_EQ(pm->activation_frequency.size(), 2u);
  EXPECT_EQ(pm->profile_tokens, 1000);
  for (int l = 0; l < 2; ++l) {
    const auto& freq = pm->activation_frequency[l];
    EXPECT_TRUE(std::is_sorted(freq.rbegin(), freq.rend())) << "layer " << l;
    // The hottest stored neuron is the source's hottest: its gate row moved to row 0.
    const auto& counts = contents_.profile.active[l];
    const int32_t hottest =
        static_cast<int32_t>(std::max_element(counts.begin(), counts.end()) - counts.begin());
    EXPECT_FLOAT_EQ(freq[0], counts[hottest] / 1000.f);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(pm->model->layers[l].gate.row(0)), 128),
              std::string(reinterpret_cast<const char*>(model_->layers[l].gate.row(hottest)), 128));
  }
  auto profile = StoredProfile(*pm);
  ASSERT_TRUE(profile.ok());
  // Any placement of the stored profile is a prefix of every layer.
  PlacementOptions po;
  po.vram_budget = DenseGpuBytes(*pm->model) + KvCacheBytes(pm->model->config, 16, 2) +
                   ScratchBytes(pm->model->config, 16, 1) + PredictorBytes(&pm->predictors) +
                   37 * HotNeuronBytes(*pm->model, 0);
  po.context = 16;
  po.max_batch = 1;
  auto plan = PlanPlacement(*pm->model, *profile, &pm->predictors, po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->hot_neurons(), 37);
  for (int l = 0; l < 2; ++l) {
    for (size_t i = 0; i < plan->hot[l].size(); ++i)
      EXPECT_EQ(plan->hot[l][i], static_cast<int>(i));
  }
}

TEST_F(PreparedModelTest, HotAndColdRowsAreContiguousByteRanges) {
  ASSERT_TRUE(Write().ok());
  auto f = GgufFile::Open(out_path_, {kPowerInferMagic});
  ASSERT_TRUE(f.ok());
  auto bytes = ReadFileToString(out_path_);
  ASSERT_TRUE(bytes.ok());
  auto ranges = SplitByteRanges(**f, 1, 40);
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  const char* names[3] = {"blk.1.ffn_gate.weight", "blk.1.ffn_up.weight",
                          "blk.1.ffn_down_t.weight"};
  for (int i = 0; i < 3; ++i) {
    auto t = (*f)->GetTensor(names[i]);
    ASSERT_TRUE(t.ok());
    const ByteRange& hot = ranges->hot[i];
    const ByteRange& cold = ranges->cold[i];
    EXPECT_EQ(hot.end, cold.begin);
    EXPECT_EQ(hot.end - hot.begin, 40 * t->row_bytes());
    EXPECT_EQ(cold.end - cold.begin, 216 * t->row_bytes());
    // Rows 0..39 are exactly the hot range of the file.
    EXPECT_EQ(bytes->substr(hot.begin, hot.end - hot.begin),
              std::string(reinterpret_cast<const char*>(t->row(0)), 40 * t->row_bytes()));
  }
  EXPECT_EQ(SplitByteRanges(**f, 1, 257).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PreparedModelTest, GpuIndexRoundTripsInPowerInferLayout) {
  ASSERT_TRUE(Write().ok());
  PlacementPlan plan;
  plan.budget = 123456789;
  plan.hot = {{0, 1, 2, 7}, {0, 5}};
  const std::string path = GpuIndexPath(out_path_);
  EXPECT_EQ(path, out_path_ + ".generated.gpuidx");
  ASSERT_TRUE(WriteGpuIndex(GpuIndexFromPlan(plan, 256), path).ok());
  auto g = ReadGpuIndex(path, 2, 256);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->vram_capacity, 123456789u);
  EXPECT_EQ(g->gpu_bucket, plan.hot);
  EXPECT_EQ(g->gpu_idx[1][5], 1);
  EXPECT_EQ(g->gpu_idx[1][4], 0);
  // PowerInfer's reading: magic PWRI, architecture generic.gpu_index, I32 as type id 18.
  auto raw = ReadFileToString(path);
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(raw->substr(0, 4), "PWRI");
  EXPECT_NE(raw->find("generic.gpu_index"), std::string::npos);
  EXPECT_NE(raw->find("split.vram_capacity"), std::string::npos);
  const size_t name_at = raw->find("blk.0.gpu_idx");
  ASSERT_NE(name_at, std::string::npos);
  // name, n_dims (u32) = 1, ne[0] (u64) = 256, type (u32).
  uint32_t type;
  std::memcpy(&type, raw->data() + name_at + 13 + 4 + 8, 4);
  EXPECT_EQ(type, 18u);
}

TEST_F(PreparedModelTest, MalformedGpuIndexesGiveSpecificErrors) {
  const std::string path = GpuIndexPath(out_path_);
  auto write = [&](const std::string& arch, int blocks, std::vector<int32_t> idx,
                   std::vector<int32_t> bucket) {
    GgufWriter w(kPowerInferMagic);
    w.SetString("general.architecture", arch);
    w.SetU32(arch + ".block_count", blocks);
    w.SetU64("split.vram_capacity", 1);
    ASSERT_TRUE(w.AddTensor("blk.0.gpu_idx", GgmlType::kI32, {static_cast<int64_t>(idx.size())},
                            std::string(reinterpret_cast<char*>(idx.data()), idx.size() * 4))
                    .ok());
    ASSERT_TRUE(w.AddTensor("blk.0.gpu_bucket", GgmlType::kI32,
                            {static_cast<int64_t>(bucket.size())},
                            std::string(reinterpret_cast<char*>(bucket.data()), bucket.size() * 4))
                    .ok());
    ASSERT_TRUE(w.WriteFile(path).ok());
  };
  write("llama", 1, {1, 0, 0, 0}, {0});
  auto r = ReadGpuIndex(path, 1, 4);
  EXPECT_THAT(r.status().message(), HasSubstr("architecture 'llama' is not generic.gpu_index"));
  write("generic.gpu_index", 2, {1, 0, 0, 0}, {0});
  r = ReadGpuIndex(path, 1, 4);
  EXPECT_THAT(r.status().message(), HasSubstr("index for 2 layers, the model has 1"));
  write("generic.gpu_index", 1, {1, 0, 2, 0}, {0});
  r = ReadGpuIndex(path, 1, 4);
  EXPECT_THAT(r.status().message(), HasSubstr("blk.0.gpu_idx[2] is 2, not 0 or 1"));
  write("generic.gpu_index", 1, {1, 0, 1, 0}, {2, 0});
  r = ReadGpuIndex(path, 1, 4);
  EXPECT_THAT(r.status().message(), HasSubstr("gpu_bucket does not list, in ascending order"));
  write("generic.gpu_index", 1, {1, 0, 1}, {0, 2});
  r = ReadGpuIndex(path, 1, 4);
  EXPECT_THAT(r.status().message(), HasSubstr("blk.0.gpu_idx must be a vector of 4 values"));
  // Truncated: the reader names the problem instead of reading past the end.
  write("generic.gpu_index", 1, {1, 0, 1, 0}, {0, 2});
  std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
  r = ReadGpuIndex(path, 1, 4);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("truncated"));
  std::filesystem::remove(path);
  r = ReadGpuIndex(path, 1, 4);
  EXPECT_FALSE(r.ok());

  PlacementPlan empty_layer;
  empty_layer.hot = {{1}, {}};
  auto st = WriteGpuIndex(GpuIndexFromPlan(empty_layer, 4), path);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("layer 1 has no GPU neurons"));
}

// The workers load PWRI files without the dense down projection: for a quantized file the rebuilt
// [hidden, ffn] copy is F32, four bytes a weight (75 GB for a 70B model), and they only read
// ffn_down_t's rows. Those rows are then the file's own, in its type, and compute as before.
TEST(PreparedQuantizedModelTest, LoadsWithoutRebuildingDown) {
  RandomModelOptions o;
  o.dtype = DType::kQ8_0;
  auto model = RandomModel(o);
  const std::string source_path = WriteRandomGguf(*model, TempPath("q8-source.gguf"));
  const std::string out_path = TempPath("q8-prepared.gguf");
  PreparedContents contents;
  contents.profile = RandomProfile(model->config, 4);
  contents.predictors = GatePredictor(*model);
  {
    auto src = GgufFile::Open(source_path);
    ASSERT_TRUE(src.ok());
    ASSERT_TRUE(WritePreparedModel(**src, contents, out_path).ok());
  }
  auto rebuilt = LoadPreparedModel(out_path);
  auto lean = LoadPreparedModel(out_path, {.rebuild_down = false});
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  ASSERT_TRUE(lean.ok()) << lean.status();
  const auto& mapped = *lean->model->files.at(0);
  const int H = o.hidden;
  for (int l = 0; l < o.layers; ++l) {
    const LayerWeights& L = lean->model->layers[l];
    EXPECT_EQ(L.down.data, nullptr) << "layer " << l;
    EXPECT_EQ(rebuilt->model->layers[l].down.dtype, DType::kF32);
    ASSERT_EQ(L.down_t.dtype, DType::kQ8_0);
    EXPECT_EQ(L.down_t.shape, (std::vector<int64_t>{o.ffn, H}));
    // A view into the mapped file, not a copy.
    const auto* p = static_cast<const uint8_t*>(L.down_t.data);
    EXPECT_TRUE(p >= mapped.data() && p + L.down_t.nbytes() <= mapped.data() + mapped.size());
    // Placement counts the file's Q8_0 bytes of a neuron's down row either way.
    EXPECT_EQ(HotNeuronBytes(*lean->model, l), 3 * RowBytes(DType::kQ8_0, H));
    EXPECT_EQ(HotNeuronBytes(*rebuilt->model, l), HotNeuronBytes(*lean->model, l));
    // TransposeDownProjections hands the stored rows over without a copy.
    auto dt = TransposeDownProjections(*lean->model);
    ASSERT_TRUE(dt.ok()) << dt.status();
    EXPECT_EQ(dt->layers[l].data, L.down_t.data);
    EXPECT_TRUE(dt->owned.empty());
  }
  EXPECT_TRUE(lean->model->owned.empty());
  // The lean model computes without its dense down: the sparse FFN reads only ffn_down_t, so it
  // gives the rebuilt model's result. (Its agreement with a reference lives in ReloadsAndComputes-
  // TheSame and the PowerInfer compatibility tests; this checks nothing else needs `down`.)
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  std::vector<int32_t> tokens = RandomTokens(2 * 64, model->config.vocab_size);
  auto s_lean = PredictedSparseFfn::Create(*lean->model, *ops, lean->down_t(), &lean->predictors);
  auto s_rebuilt =
      PredictedSparseFfn::Create(*rebuilt->model, *ops, rebuilt->down_t(), &rebuilt->predictors);
  ASSERT_TRUE(s_lean.ok() && s_rebuilt.ok());
  Transformer t_lean(*lean->model, *ops), t_rebuilt(*rebuilt->model, *ops);
  t_lean.set_ffn(s_lean->get());
  t_rebuilt.set_ffn(s_rebuilt->get());
  auto a = ComputePerplexity(t_lean, tokens, 64);
  auto b = ComputePerplexity(t_rebuilt, tokens, 64);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->perplexity, b->perplexity);
  std::filesystem::remove(source_path);
  std::filesystem::remove(out_path);
}

TEST_F(PreparedModelTest, MalformedPreparedModelsGiveSpecificErrors) {
  // Without predictors (a plain GGUF model): the first missing tensor is named.
  auto plain = LoadPreparedModel(source_path_);
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(plain.status().message(), HasSubstr("blk.0.fc1.weight"));

  // fc2 with the wrong number of rows.
  PredictorSet bad = GatePredictor(*model_);
  bad.layers[1].fc2.shape = {128, 128};
  contents_.predictors = bad;
  EXPECT_THAT(Write().message(), HasSubstr("layer 1: fc2 does not have 256 rows"));

  // A hand-made PWRI whose fc1 has the wrong width.
  contents_.predictors = GatePredictor(*model_);
  ASSERT_TRUE(Write().ok());
  auto src = GgufFile::Open(out_path_, {kPowerInferMagic});
  ASSERT_TRUE(src.ok());
  GgufWriter w(kPowerInferMagic);
  for (const GgufKeyValue& kv : (*src)->metadata()) {
    if (kv.value.type == GgufType::kString) w.SetString(kv.key, kv.value.str);
    if (kv.value.type == GgufType::kUint32) w.SetU32(kv.key, static_cast<uint32_t>(kv.value.u64));
    if (kv.value.type == GgufType::kFloat32) w.SetF32(kv.key, static_cast<float>(kv.value.f64));
  }
  for (const GgufTensorInfo& t : (*src)->tensors()) {
    std::vector<int64_t> shape = t.shape();
    std::string data(reinterpret_cast<const char*>(t.data), t.nbytes);
    if (t.name == "blk.1.fc1.weight") {
      shape = {64, 128};  // [rank, hidden] with hidden 128 instead of 64
      data.resize(64 * 128 * 2);
    }
    ASSERT_TRUE(w.AddTensor(t.name, static_cast<GgmlType>(t.type), shape, data).ok()) << t.name;
  }
  const std::string bad_path = TempPath("bad.gguf");
  ASSERT_TRUE(w.WriteFile(bad_path).ok());
  auto pm = LoadPreparedModel(bad_path);
  EXPECT_EQ(pm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pm.status().message(), HasSubstr("layer 1: predictor shapes must be fc1 [rank, 64]"));
  std::filesystem::remove(bad_path);
}

}  // namespace
}  // namespace pinfer
