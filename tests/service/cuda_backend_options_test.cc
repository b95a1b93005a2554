// Checks the gpu-worker's CUDA backend makes before it touches the module or a GPU, so they run
// everywhere: a PowerInfer file whose predictors read the pre-norm residual with a non-zero
// threshold is refused (the module's predictors would select other neurons), naming the way out.
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gpu-worker/backend.h"
#include "gtest/gtest.h"
#include "shared/model/model.h"
#include "shared/service/ffn_split.h"
#include "shared/sparse/sparse_ffn.h"

namespace pinfer::gpuworker {
namespace {

using ::testing::HasSubstr;

TEST(CudaBackendOptionsTest, RefusesPreNormPredictorsWithANonZeroThreshold) {
  auto model = LoadModel(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  const Placement placement = Placement::FixedFraction(c, 0.5);
  PredictorSet predictors;
  predictors.layers.resize(c.n_layers);
  for (LayerPredictor& p : predictors.layers) {
    p.reads_residual = true;
    p.threshold = 0.25f;
  }
  CudaBackendOptions o;
  o.predictors = &predictors;
  const std::string no_module = "/nonexistent/libpinfer_cuda.so";
  auto refused = NewCudaBackend(**model, placement, nullptr, no_module, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnimplemented) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--backend cpu"));

  // Threshold 0 (ReluLLaMA's files) selects the same neurons either way: no refusal, so the
  // missing module is what fails.
  for (LayerPredictor& p : predictors.layers) p.threshold = 0.f;
  auto no_refusal = NewCudaBackend(**model, placement, nullptr, no_module, o);
  ASSERT_FALSE(no_refusal.ok());
  EXPECT_NE(no_refusal.status().code(), absl::StatusCode::kUnimplemented) << no_refusal.status();
}

}  // namespace
}  // namespace pinfer::gpuworker
