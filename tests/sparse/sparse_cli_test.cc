// End to end through the `pinfer` binary on relu-llama-tiny:
//  - `perplexity --sparse` on the unprepared model prepares it once (bundled calibration text,
//    cached in PINFER_CACHE_DIR, per-layer recall and sparsity printed), then scores the whole
//    held-out file within 2% of the transformers library's dense perplexity (reference.json) with
//    at least 70% of the FFN neurons skipped in each of layers 1-5; a second run reuses the cache;
//  - `prepare` with a budget writes the PWRI model, the GPU index and the SVG report, and the
//    prepared file runs `generate --sparse`;
//  - `--exact-sparse` reproduces the dense perplexity; flag errors are usage errors.
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/model/gguf.h"
#include "shared/sparse/prepared_model.h"
#include "shared/util/mapped_file.h"

namespace pinfer {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

const std::string kPinfer = std::string(PINFER_BINARY_DIR) + "/cli/pinfer";
const std::string kModel = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";

struct RunResult {
  int code = -1;
  std::string out, err;
};

RunResult RunPinfer(const std::string& args, const std::string& env = "") {
  const fs::path dir =
      fs::temp_directory_path() / ("pinfer_sparse_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string out = (dir / "stdout").string(), err = (dir / "stderr").string();
  const std::string cmd = env + " " + kPinfer + " " + args + " >" + out + " 2>" + err;
  RunResult r;
  const int status = std::system(cmd.c_str());
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadFileToString(out).value_or("");
  r.err = ReadFileToString(err).value_or("");
  return r;
}

double ReferencePerplexity() {
  std::ifstream in(kModel + "/reference.json");
  return nlohmann::json::parse(in)["heldout_ppl_512"].get<double>();
}

// A prepared model generates eight tokens with --sparse, skipping some of its FFN neurons.
void ExpectSparseGeneration(const std::string& model) {
  RunResult r = RunPinfer("generate --model " + model +
                          " --prompt 'The file system' --max-tokens 8 --sparse --json");
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json g = nlohmann::json::parse(r.out);
  EXPECT_EQ(g["generated_ids"].size(), 8u);
  EXPECT_GT(g["ffn_sparsity"].get<double>(), 0.1);
}

class SparseCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("pinfer_sparse_cli_test_" + std::to_string(::getpid())));
    fs::create_directories(*dir_);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static fs::path* dir_;
};
fs::path* SparseCliTest::dir_ = nullptr;

// The must-show target: prepared with the default recipe from 60K tokens of calibration.txt,
// `perplexity --sparse` over the whole held-out file is within 2% of the transformers library's
// dense perplexity, with at least 70% of the FFN neurons skipped in each of layers 1-5.
TEST_F(SparseCliTest, PreparedSparsePerplexityIsWithinTwoPercentAtSeventyPercentSparsity) {
  const std::string out = (*dir_ / "target.gguf").string();
  RunResult r = RunPinfer("prepare --model " + kModel + " --calibration " + kModel +
                          "/calibration.txt --out " + out + " --max-tokens 60000 --threads 2");
  ASSERT_EQ(r.code, 0) << r.err;
  // Recall and sparsity per layer, printed by prepare.
  EXPECT_THAT(r.err, HasSubstr("layer  rank  active  recall  mag.recall  precision  sparsity"));
  std::fprintf(stderr, "%s", r.err.substr(r.err.find("layer  rank")).c_str());
  // The yardstick: a rank-128 predictor costs about 14% of this FFN's multiply-adds;
  // pinfer's per-layer ranks must cost less on average (last column of the table).
  {
    std::istringstream table(r.err.substr(r.err.find("layer  rank")));
    std::string line;
    std::getline(table, line);  // header
    double cost = 0;
    int layers = 0;
    for (int l = 0; l < 6 && std::getline(table, line); ++l) {
      std::istringstream fields(line);
      std::vector<double> v;
      for (double x; fields >> x;) v.push_back(x);
      ASSERT_EQ(v.size(), 8u) << line;
      cost += v.back();
      ++layers;
    }
    ASSERT_EQ(layers, 6);
    std::printf("mean predictor cost %.4f of the FFN\n", cost / layers);
    EXPECT_LT(cost / layers, 0.14);
  }
  r = RunPinfer("perplexity --model " + out + " --tokens " + kModel +
                "/heldout-tokens.u32 --window 512 --threads 2 --sparse --json");
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  const double dense = ReferencePerplexity();
  const double sparse = j["perplexity"];
  std::printf("dense (transformers) %.4f, sparse %.4f (%+.2f%%), sparsity %s, recall %.4f\n", dense,
              sparse, 100 * (sparse / dense - 1), j["ffn_sparsity_per_layer"].dump().c_str(),
              j["predictor_recall"].get<double>());
  EXPECT_EQ(j["tokens_scored"], 127 * 511);
  EXPECT_LE(sparse, 1.02 * dense);
  for (int l = 1; l <= 5; ++l) {
    EXPECT_GE(j["ffn_sparsity_per_layer"][l].get<double>(), 0.70) << "layer " << l;
  }
  EXPECT_GT(j["predictor_recall"].get<double>(), 0.8);
}

// --sparse on an unprepared model prepares it once (here from 2048 calibration tokens, to keep
// the test short) and reuses the cached result afterwards.
TEST_F(SparseCliTest, AutoPreparationIsCachedAndReused) {
  const std::string env =
      "PINFER_CACHE_DIR=" + (*dir_ / "cache").string() + " PINFER_AUTO_PREPARE_MAX_TOKENS=2048";
  const std::string two_windows = (*dir_ / "two.u32").string();
  {
    auto bytes = ReadFileToString(kModel + "/heldout-tokens.u32");
    ASSERT_TRUE(bytes.ok());
    std::ofstream(two_windows, std::ios::binary) << bytes->substr(0, 2 * 512 * 4);
  }
  const std::string cmd =
      "perplexity --model " + kModel + " --tokens " + two_windows + " --window 512 --sparse --json";
  RunResult r = RunPinfer(cmd, env);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err,
              HasSubstr("has no predictors; preparing it once with the bundled calibration"));
  EXPECT_THAT(r.err, HasSubstr("layer  rank  active  recall"));
  const double first = nlohmann::json::parse(r.out)["perplexity"];
  r = RunPinfer(cmd, env);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("sparse: using the cached preparation"));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("preparing it once")));
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(r.out)["perplexity"].get<double>(), first);
  // Another recipe (more calibration tokens) does not reuse it.
  r = RunPinfer(cmd, "PINFER_CACHE_DIR=" + (*dir_ / "cache").string() +
                         " PINFER_AUTO_PREPARE_MAX_TOKENS=1024");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("is for another version of the model; preparing again"));
}

TEST_F(SparseCliTest, PrepareWritesModelIndexAndReportAndTheModelGenerates) {
  const std::string out = (*dir_ / "tiny.gguf").string();
  const std::string svg = (*dir_ / "tiny.svg").string();
  RunResult r = RunPinfer(
      "prepare --model " + kModel + " --calibration " + kModel + "/calibration.txt --out " + out +
      " --max-tokens 3072 --epochs 1 --ranks 32 --vram-budget 20MiB --context 512"
      " --report " +
      svg + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("profiling  ["));  // progress bar
  EXPECT_THAT(r.err, HasSubstr("mag.recall"));
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["layers"].size(), 6u);
  EXPECT_EQ(j["gpu_index"], out + ".generated.gpuidx");
  EXPECT_EQ(j["placement"]["budget"], 20u * 1024 * 1024);
  EXPECT_LE(j["placement"]["dense_bytes"].get<uint64_t>() +
                j["placement"]["kv_cache_bytes"].get<uint64_t>() +
                j["placement"]["predictor_bytes"].get<uint64_t>() +
                j["placement"]["scratch_bytes"].get<uint64_t>() +
                j["placement"]["hot_row_bytes"].get<uint64_t>(),
            20u * 1024 * 1024);
  auto index = ReadGpuIndex(out + ".generated.gpuidx", 6, 1536);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->vram_capacity, 20u * 1024 * 1024);
  auto report = ReadFileToString(svg);
  ASSERT_TRUE(report.ok());
  EXPECT_THAT(*report, HasSubstr("<svg"));
  EXPECT_THAT(*report, HasSubstr("layer 5"));
  EXPECT_THAT(*report, HasSubstr("GPU | CPU"));

  ExpectSparseGeneration(out);

  // A budget below the dense parts gives a CPU-only plan and no index.
  const std::string small = (*dir_ / "small.gguf").string();
  r = RunPinfer("prepare --model " + kModel + " --calibration " + kModel +
                "/calibration.txt --out " + small +
                " --max-tokens 1024 --epochs 0 --ranks 16 --vram-budget 1MiB --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("CPU-only plan"));
  EXPECT_TRUE(nlohmann::json::parse(r.out)["placement"]["cpu_only"].get<bool>());
  EXPECT_FALSE(fs::exists(small + ".generated.gpuidx"));
}

// Q8_0 predictors: the plan counts their bytes exactly (by hand: per layer fc1 is 32 rows of 12
// blocks and fc2 1536 rows of one block, 34 bytes a block), the file stores them as Q8_0, and
// the prepared model generates with them.
TEST_F(SparseCliTest, Q8PredictorsTakeHalfTheBytesAndTheModelGenerates) {
  const std::string out = (*dir_ / "q8pred.gguf").string();
  RunResult r = RunPinfer("prepare --model " + kModel + " --calibration " + kModel +
                          "/calibration.txt --out " + out +
                          " --max-tokens 3072 --epochs 1 --ranks 32 --predictor-type q8_0"
                          " --vram-budget 20MiB --json");
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["placement"]["predictor_bytes"].get<uint64_t>(), 6u * (32 * 12 * 34 + 1536 * 34));
  for (const auto& layer : j["layers"]) {
    EXPECT_EQ(layer["rank"], 32);
    EXPECT_NEAR(layer["magnitude_recall"].get<double>(), 0.96, 0.02);
  }
  auto file = GgufFile::Open(out, {kPowerInferMagic});
  ASSERT_TRUE(file.ok()) << file.status();
  for (const char* name : {"blk.0.fc1.weight", "blk.5.fc2.weight"}) {
    const GgufTensorInfo* t = (*file)->FindTensor(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->type, static_cast<uint32_t>(GgmlType::kQ8_0)) << name;
  }
  ExpectSparseGeneration(out);

  r = RunPinfer("prepare --model " + kModel + " --calibration x --out y --predictor-type q4_0");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--predictor-type must be f16 or q8_0"));
}

TEST_F(SparseCliTest, SiluModelGetsMagnitudeSparsityWithItsQualityCostReported) {
  const std::string stories = std::string(PINFER_MODELS_DIR) + "/stories260K/stories260K.gguf";
  const std::string out = (*dir_ / "stories-sparse.gguf").string();
  RunResult r = RunPinfer("prepare --model " + stories + " --calibration " + kModel +
                          "/calibration.txt --out " + out +
                          " --max-tokens 4096 --target-sparsity 0.5 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("magnitude sparsity 50% (SiLU, training-free): perplexity"));
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["magnitude_thresholds"].size(), 5u);
  const double dense = j["heldout_dense_perplexity"], sparse = j["heldout_sparse_perplexity"];
  EXPECT_GT(sparse, dense * 0.999);  // skipping neurons does not help
  EXPECT_LT(sparse, dense * 1.5);

  // The prepared SiLU model runs --sparse at about the calibrated sparsity, and still loads as a
  // plain GGUF model.
  const std::string tokens = (*dir_ / "stories.u32").string();
  {
    std::vector<uint32_t> ids;
    for (int i = 0; i < 256; ++i) ids.push_back(static_cast<uint32_t>((i * 37 + 11) % 512));
    std::ofstream(tokens, std::ios::binary)
        .write(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
  }
  r = RunPinfer("perplexity --model " + out + " --tokens " + tokens +
                " --window 128 --sparse --json");
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json p = nlohmann::json::parse(r.out);
  EXPECT_NEAR(p["ffn_sparsity"].get<double>(), 0.5, 0.15);
  r = RunPinfer("perplexity --model " + out + " --tokens " + tokens + " --window 128 --json");
  ASSERT_EQ(r.code, 0) << r.err;
}

TEST_F(SparseCliTest, ExactSparseEqualsDenseAndBadFlagsAreUsageErrors) {
  const std::string two_windows = (*dir_ / "exact.u32").string();
  {
    auto bytes = ReadFileToString(kModel + "/heldout-tokens.u32");
    ASSERT_TRUE(bytes.ok());
    std::ofstream(two_windows, std::ios::binary) << bytes->substr(0, 2 * 512 * 4);
  }
  RunResult dense = RunPinfer("perplexity --model " + kModel + " --tokens " + two_windows +
                              " --window 512 --json");
  RunResult exact = RunPinfer("perplexity --model " + kModel + " --tokens " + two_windows +
                              " --window 512 --exact-sparse --json");
  ASSERT_EQ(dense.code, 0) << dense.err;
  ASSERT_EQ(exact.code, 0) << exact.err;
  const double d = nlohmann::json::parse(dense.out)["perplexity"];
  nlohmann::json e = nlohmann::json::parse(exact.out);
  EXPECT_NEAR(e["perplexity"].get<double>(), d, 1e-4 * d);
  EXPECT_GT(e["ffn_sparsity"].get<double>(), 0.7);  // the true inactive fraction

  RunResult both = RunPinfer("perplexity --model " + kModel + " --tokens " + two_windows +
                             " --window 512 --sparse --exact-sparse");
  EXPECT_EQ(both.code, 2);
  EXPECT_THAT(both.err, HasSubstr("exclude each other"));
  RunResult bad =
      RunPinfer("prepare --model " + kModel + " --calibration x --out y --target-recall 1.5");
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--target-recall must be in (0, 1]"));
  RunResult size =
      RunPinfer("prepare --model " + kModel + " --calibration x --out y --vram-budget 12XB");
  EXPECT_EQ(size.code, 2);
}

}  // namespace
}  // namespace pinfer
