// Checks the gpu-worker's CUDA backend makes before it touches the module or a GPU, so they run
// everywhere.
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gpu-worker/backend.h"
#include "gpu-worker/cuda/model_dims.h"
#include "gtest/gtest.h"
#include "shared/model/model.h"
#include "shared/service/ffn_split.h"

namespace pinfer::gpuworker {
namespace {

using ::testing::HasSubstr;

// The adaptive hot set follows the predictors' choices (in exact mode the cpu-worker decides
// with its own gate rows), and its VRAM is planned before the module exists.
TEST(CudaBackendOptionsTest, AdaptiveCacheNeedsPredictorsAndIsPlannedExactly) {
  auto model = LoadModel(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  const Placement placement = Placement::FixedFraction((*model)->config, 0.5);
  CudaBackendOptions o;
  o.adaptive_cache_rows = 64;
  auto refused = NewCudaBackend(**model, placement, nullptr, "/nonexistent/libpinfer_cuda.so", o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("needs --sparse"));
  // relu-llama-tiny: 6 layers, hidden 384, ffn 1536, fp16: a neuron's gate, up and transposed
  // down rows are 3 * 768 bytes; the maps hold an int32 per neuron and per slot.
  EXPECT_EQ(AdaptiveCacheBytes(**model, 10), 6u * (10 * 3 * 768 + 4 * (1536 + 10)));
  EXPECT_EQ(AdaptiveCacheBytes(**model, 0), 0u);
  // A PWRI file loaded for the workers has no dense down, only its ffn_down_t rows (here Q8_0:
  // 408 bytes for 384 values); the module gets those, so they are what a slot costs.
  for (LayerWeights& L : (*model)->layers) {
    L.down_t = TensorView{"ffn_down_t", DType::kQ8_0, {1536, 384}, L.gate.data};
    L.down = TensorView{};
  }
  EXPECT_EQ(AdaptiveCacheBytes(**model, 10), 6u * (10 * (768 + 768 + 408) + 4 * (1536 + 10)));
  EXPECT_TRUE(CudaModuleComputes(**model).ok());
  (*model)->layers[4].down_t.dtype = static_cast<DType>(kNumDTypes);
  EXPECT_THAT(std::string(CudaModuleComputes(**model).message()),
              HasSubstr("tensor 'blk.4.ffn_down_t' is "));
}

// The module computes every DType (K-quants included, and mixes of them); a type value it does
// not know is refused by name before the module is opened, so --backend auto can fall back to the
// CPU, as is a model whose attention has biases.
// Which models' cold rows the module can pin and stream (the GPU's cold share, streamed prompt
// rows and the adaptive hot set all need it): gate and up of one type with the transposed down
// rows in theirs, as a prepared Q4_K_M file has them (Q6_K ffn_down_t under Q4_K gate and up in
// half of the layers); not gate and up of two types, nor a quantized down projection stored
// untransposed (its rows would be F32 copies).
TEST(CudaBackendOptionsTest, StreamsColdRowsWhoseDownHasATypeOfItsOwn) {
  auto model = LoadModel(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  EXPECT_EQ(ColdStreamingProblem(m), "");  // fp16 throughout, down transposed as fp16
  // Only the types are read: the views keep the fp16 data.
  for (size_t l = 0; l < m.layers.size(); ++l) {
    LayerWeights& L = m.layers[l];
    L.gate.dtype = L.up.dtype = DType::kQ4_K;
    L.down_t = TensorView{
        "ffn_down_t", l % 2 == 0 ? DType::kQ6_K : DType::kQ4_K, {1536, 384}, L.gate.data};
    L.down = TensorView{};
  }
  EXPECT_EQ(ColdStreamingProblem(m), "");
  m.layers[3].up.dtype = DType::kQ6_K;
  EXPECT_THAT(ColdStreamingProblem(m), HasSubstr("layer 3 has gate Q4_K and up Q6_K rows"));
  m.layers[3].up.dtype = DType::kQ4_K;
  m.layers[4].down_t = TensorView{};
  m.layers[4].down = TensorView{"ffn_down", DType::kQ6_K, {384, 1536}, m.layers[4].gate.data};
  EXPECT_THAT(ColdStreamingProblem(m), HasSubstr("layer 4's Q6_K down projection is stored "
                                                 "untransposed"));
}

TEST(CudaBackendOptionsTest, RefusesTypesTheModuleDoesNotCompute) {
  auto model = LoadModel(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE(CudaModuleComputes(**model).ok());
  // Only the types are looked at: nothing is read.
  (*model)->layers[1].wv.dtype = DType::kQ6_K;
  (*model)->layers[2].up.dtype = DType::kQ5_K;
  (*model)->layers[3].gate.dtype = DType::kQ4_K;
  EXPECT_TRUE(CudaModuleComputes(**model).ok());
  (*model)->layers[2].up.dtype = static_cast<DType>(kNumDTypes);  // as a newer loader might add
  const absl::Status st = CudaModuleComputes(**model);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("tensor 'blk.2.ffn_up' is "));
  EXPECT_THAT(std::string(st.message()), HasSubstr("Q4_0, Q4_K, Q5_K and Q6_K"));
  const Placement placement = Placement::FixedFraction((*model)->config, 0.5);
  auto refused = NewCudaBackend(**model, placement, nullptr, "/nonexistent/libpinfer_cuda.so", {});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("blk.2.ffn_up"));
  (*model)->layers[2].up.dtype = DType::kF16;
  // Qwen2's q/k/v biases are computed; a missing one or one of a type the module lacks is
  // refused by name.
  (*model)->config.qkv_bias = true;
  EXPECT_THAT(std::string(CudaModuleComputes(**model).message()),
              HasSubstr("tensor 'blk.0.attn_q.bias' is missing"));
  for (LayerWeights& L : (*model)->layers) L.bq = L.bk = L.bv = L.attn_norm;
  EXPECT_TRUE(CudaModuleComputes(**model).ok());
  (*model)->layers[1].bk.dtype = static_cast<DType>(kNumDTypes);
  EXPECT_THAT(std::string(CudaModuleComputes(**model).message()),
              HasSubstr("tensor 'blk.1.attn_k.bias' is "));
}

// Mistral's sliding window is computed by the module (the window goes to its attention through
// ModelDims), so such a model is not refused.
TEST(CudaBackendOptionsTest, AcceptsASlidingWindow) {
  auto model = LoadModel(std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  (*model)->config.sliding_window = 4096;
  EXPECT_TRUE(CudaModuleComputes(**model).ok());
  EXPECT_EQ(cuda::DimsFromConfig((*model)->config).sliding_window, 4096);
}

}  // namespace
}  // namespace pinfer::gpuworker
