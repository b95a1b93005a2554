// The exchange with the cold side: partial sums added on the GPU, Ahead before each decode layer's
// callback, a failing callback leaving no queued work behind, cold rows streamed to the GPU for
// prompts, the GPU's share of the cold rows, and the guess of the next layer's cold list.
// Judged as cuda_backend_test_fixture.h says; without a CUDA device every test skips.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "tests/cuda/cuda_backend_test_fixture.h"

namespace pinfer {
namespace cuda_test {
namespace {

// u with its prompt batches' cold rows streamed in chunks of 100 neurons through two slots (so
// that slots are reused many times per layer and across layers).
cuda::ModelUpload Streaming(cuda::ModelUpload u) {
  u.stream_cold = true;
  u.stream_chunk_rows = 100;
  u.stream_slots = 2;
  return u;
}

// A prompt batch of `tokens` from position 0 in exact mode, the cold rows by `path`, every
// position's logits into `logits`.
cuda::ForwardArgs ExactPrompt(const std::vector<int32_t>& tokens, cuda::ColdFfn* cold,
                              cuda::ColdPath path, float* logits) {
  cuda::ForwardArgs a;
  a.tokens = tokens.data();
  a.n = static_cast<int>(tokens.size());
  a.pos0 = 0;
  a.mode = cuda::FfnMode::kExact;
  a.cold = cold;
  a.cold_path = path;
  a.logits_mode = cuda::LogitsMode::kAll;
  a.logits = logits;
  return a;
}

// The cold side's partial sums added on the GPU (SumParts, the default for single tokens): each
// step's logits still equal the CPU reference's and the greedy tokens reference.json's, whether
// the callback hands over 5 parts, or 1, or (PINFER_CUDA_COLD_PARTS=0) is not offered parts;
// with the next layer queued behind the signal (which carries the count) and without.
TEST_F(CudaBackendTest, ColdPartsSummedOnTheGpuMatchCpuReference) {
  for (const auto& [knob, prelaunch] :
       std::vector<std::pair<std::string, std::string>>{{"1", "1"}, {"1", "0"}, {"0", "1"}}) {
    setenv("PINFER_CUDA_COLD_PARTS", knob.c_str(), 1);
    setenv("PINFER_CUDA_PRELAUNCH", prelaunch.c_str(), 1);
    auto backend = Create(Upload(/*hot=*/true));
    unsetenv("PINFER_CUDA_COLD_PARTS");
    unsetenv("PINFER_CUDA_PRELAUNCH");
    ASSERT_NE(backend, nullptr);
    for (int split : {5, 1}) {
      SCOPED_TRACE(::testing::Message()
                   << "COLD_PARTS=" << knob << " PRELAUNCH=" << prelaunch << " split " << split);
      CpuColdFfn cold(*model_, *down_t_, *cold_ids_);
      cold.split = split;
      ExpectStepsMatchReference(backend.get(), &cold, /*prompt_no=*/3, /*seq=*/0);
      const auto& p = (*reference_)["prompts"][7];
      std::vector<int32_t> expect = p["greedy_ids"].get<std::vector<int32_t>>();
      EXPECT_EQ(Greedy(backend.get(), p["input_ids"].get<std::vector<int32_t>>(),
                       static_cast<int>(expect.size()), cuda::FfnMode::kExact, &cold),
                expect);
      if (knob == "1") {
        EXPECT_GT(cold.offered_parts, 0);
      } else {
        EXPECT_EQ(cold.offered_parts, 0);
      }
    }
  }
}

// Queued decode steps tell the cold side each layer ahead of its callback, while the layer's
// attention runs: every Run of a decode step directly follows Ahead for the same layer, x_ready
// turns true (the FFN input published), and a cold side that spends the attention in Ahead
// leaves the logits equal to the CPU reference's.
TEST_F(CudaBackendTest, AheadPrecedesEachDecodeLayersColdCallback) {
  auto backend = Create(Upload(/*hot=*/true));
  ASSERT_NE(backend, nullptr);
  CpuColdFfn cpu(*model_, *down_t_, *cold_ids_);
  AheadRecorder cold(&cpu);
  ExpectStepsMatchReference(backend.get(), &cold, /*prompt_no=*/3, /*seq=*/0);
  EXPECT_EQ(cold.never_ready, 0);
  int aheads = 0, runs = 0;
  for (size_t i = 0; i < cold.events.size(); ++i) {
    const int e = cold.events[i];
    if (e >= 0) {
      ++runs;
      continue;
    }
    ++aheads;
    ASSERT_LT(i + 1, cold.events.size());
    EXPECT_EQ(cold.events[i + 1], -1 - e) << "event " << i;
  }
  const int layers = model_->config.n_layers;
  const int steps =
      static_cast<int>((*reference_)["prompts"][3]["input_ids"].get<std::vector<int32_t>>().size());
  EXPECT_EQ(runs, steps * layers);
  EXPECT_EQ(aheads, runs);
}

// A cold side that fails once, at a chosen layer of a chosen call, as a cpu-worker that dies
// would; otherwise the CPU cold FFN.
class FailingColdFfn : public cuda::ColdFfn {
 public:
  explicit FailingColdFfn(cuda::ColdFfn* inner) : inner_(inner) {}
  cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
    if (r.layer == fail_layer) {
      fail_layer = -1;
      return {cuda::Code::kUnavailable, "cold side gone at layer " + std::to_string(r.layer)};
    }
    cuda::BackendStatus st = inner_->Run(r);
    if (r.layer == overflow_layer && r.parts != nullptr) {
      overflow_layer = -1;
      *r.parts = r.max_parts + 1;  // claims more partial sums than the buffer holds
    }
    return st;
  }
  int fail_layer = -1;
  int overflow_layer = -1;

 private:
  cuda::ColdFfn* inner_;
};

// Decode steps queue every layer before the first cold callback, each waiting on the GPU for the
// host's signal (PINFER_CUDA_PRELAUNCH). A callback that fails at the first, a middle or the last
// layer must return its error without leaving the GPU waiting (the test would hang) or a signal
// set for the next step (whose layer would then read a contribution not yet written): the step
// retried at the same position gives the CPU reference's logits. Both orders, queued and layer
// by layer. A callback that claims more partial sums than it was offered fails the step the same
// way, with its own error.
TEST_F(CudaBackendTest, FailedColdCallbackLeavesNoQueuedWorkBehind) {
  const int n_layers = model_->config.n_layers;
  for (const char* prelaunch : {"1", "0"}) {
    SCOPED_TRACE(std::string("PINFER_CUDA_PRELAUNCH=") + prelaunch);
    setenv("PINFER_CUDA_PRELAUNCH", prelaunch, 1);
    auto backend = Create(Upload(/*hot=*/true));
    unsetenv("PINFER_CUDA_PRELAUNCH");
    ASSERT_NE(backend, nullptr);
    CpuColdFfn cpu_cold(*model_, *down_t_, *cold_ids_);
    FailingColdFfn cold(&cpu_cold);
    int failures = 0;
    ExpectStepsMatchReference(
        backend.get(), &cold, /*prompt_no=*/3, /*seq=*/0, [&](const cuda::ForwardArgs& a) {
          const int fail_at = a.pos0 == 1   ? 0
                              : a.pos0 == 2 ? n_layers / 2
                              : a.pos0 == 4 ? n_layers - 1
                                            : -1;
          if (a.pos0 == 3) {
            cold.overflow_layer = n_layers / 3;
            cuda::BackendStatus st = backend->Forward(a);
            EXPECT_EQ(st.code, cuda::Code::kInternal);
            EXPECT_EQ(st.message, "cold side reported 65 partial sums; at most 64");
            EXPECT_EQ(cold.overflow_layer, -1);
            ++failures;
          }
          if (fail_at < 0) return;
          cold.fail_layer = fail_at;
          cuda::BackendStatus st = backend->Forward(a);
          EXPECT_EQ(st.code, cuda::Code::kUnavailable);
          EXPECT_EQ(st.message, "cold side gone at layer " + std::to_string(fail_at));
          EXPECT_EQ(cold.fail_layer, -1);
          ++failures;
        });
    EXPECT_EQ(failures, 4);
  }
}

// Prompt batches with the cold rows streamed to the GPU (ColdPath::kStream) in chunks of 100
// neurons through two slots (so slots are reused many times per layer and across layers): every
// position's logits equal the CPU reference forward pass's, the cold callback is never called,
// and every layer reports streaming. Then the same batch through the callback path, for the
// same backend, and the calibration's sizes.
TEST_F(CudaBackendTest, StreamedColdRowsMatchCpuReference) {
  auto backend = Create(Streaming(Upload(/*hot=*/true)));
  ASSERT_NE(backend, nullptr);
  const ModelConfig& c = model_->config;
  const int V = c.vocab_size, n = 48;
  std::vector<int32_t> tokens(n);
  {
    std::ifstream in(ModelsDir() + "/relu-llama-tiny/heldout-tokens.u32", std::ios::binary);
    std::vector<uint32_t> raw(n + 100);
    in.read(reinterpret_cast<char*>(raw.data()), raw.size() * 4);
    ASSERT_TRUE(in.good());
    for (int i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>(raw[100 + i]);
  }
  std::unique_ptr<CpuOps> ref_ops = NewReferenceOps();
  Transformer ref(*model_, *ref_ops);
  KvCache cache(c, 64);
  std::vector<float> want(static_cast<size_t>(n) * V);
  ASSERT_TRUE(ref.Forward(tokens, 0, &cache, LogitsMode::kAll, want.data()).ok());

  CpuColdFfn cold(*model_, *down_t_, *cold_ids_);
  for (cuda::ColdPath path : {cuda::ColdPath::kStream, cuda::ColdPath::kCallback}) {
    std::vector<float> got(static_cast<size_t>(n) * V, NAN);
    const cuda::ForwardArgs a = ExactPrompt(tokens, &cold, path, got.data());
    const int calls_before = cold.calls;
    cuda::BackendStatus st = backend->Forward(a);
    ASSERT_TRUE(st.ok()) << st.message;
    const bool streamed = path == cuda::ColdPath::kStream;
    EXPECT_EQ(backend->last_stats().streamed_layers, streamed ? c.n_layers : 0);
    EXPECT_EQ(cold.calls - calls_before, streamed ? 0 : c.n_layers);
    double err = 0, norm = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i])) << i;
      err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
      norm += double(want[i]) * want[i];
    }
    EXPECT_LE(err / norm, 1e-6) << (streamed ? "streamed" : "callback");
  }
  // Streamed bytes: every cold neuron's gate, up and down_t rows (fp16), per layer.
  cuda::StreamCalibration cal;
  cuda::BackendStatus st = backend->CalibrateStreaming(0, 32, &cal);
  ASSERT_TRUE(st.ok()) << st.message;
  const int64_t n_cold = static_cast<int64_t>((*cold_ids_)[0].size());
  EXPECT_EQ(cal.rows, n_cold);
  EXPECT_EQ(cal.bytes, 3.0 * n_cold * c.hidden_size * 2);
  EXPECT_GT(cal.copy_s, 0);
  EXPECT_GT(cal.compute_s, 0);
  EXPECT_GT(cal.overlapped_s, 0);
  st = backend->CalibrateStreaming(0, 4, &cal);
  EXPECT_EQ(st.code, cuda::Code::kInvalidArgument);
  EXPECT_NE(st.message.find("streaming needs 9..64 tokens"), std::string::npos) << st.message;
}

// Streamed cold rows whose down_t has a type of its own, as a prepared K-mix file has them
// (Q4_K_M: Q6_K ffn_down_t under Q4_K gate and up in half of the layers; here, at hidden 384,
// Q8_0 gate and up over Q4_0 down_t in every other layer): the streamed prompt batch's logits
// follow the callback path's, which computes the same rows on the CPU, and the calibration
// counts each matrix's own bytes.
TEST_F(CudaBackendTest, StreamedColdRowsWithTheirOwnDownTypeFollowTheCallback) {
  std::vector<TensorView> down_t, q4_down_t;
  std::unique_ptr<Model> q8 = QuantizedCopy(*model_, *down_t_, DType::kQ8_0, &down_t);
  std::unique_ptr<Model> q4 = QuantizedCopy(*model_, *down_t_, DType::kQ4_0, &q4_down_t);
  for (size_t l = 0; l < down_t.size(); l += 2) down_t[l] = q4_down_t[l];
  auto backend = Create(Streaming(Upload(*q8, down_t, /*hot=*/true)));
  ASSERT_NE(backend, nullptr);
  const ModelConfig& c = model_->config;
  const int V = c.vocab_size, n = 48;
  std::mt19937 rng(17);
  std::vector<int32_t> tokens(n);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % V);
  CpuColdFfn cold(*q8, down_t, *cold_ids_);
  std::vector<std::vector<float>> logits;
  for (cuda::ColdPath path : {cuda::ColdPath::kCallback, cuda::ColdPath::kStream}) {
    std::vector<float> got(static_cast<size_t>(n) * V, NAN);
    const cuda::ForwardArgs a = ExactPrompt(tokens, &cold, path, got.data());
    cuda::BackendStatus st = backend->Forward(a);
    ASSERT_TRUE(st.ok()) << st.message;
    EXPECT_EQ(backend->last_stats().streamed_layers,
              path == cuda::ColdPath::kStream ? c.n_layers : 0);
    logits.push_back(std::move(got));
  }
  const double nmse = Nmse(logits[1].data(), logits[0].data(), n * V);
  std::printf("  streamed against the callback, mixed down_t types: nmse %.3g\n", nmse);
  EXPECT_LE(nmse, 1e-3);
  cuda::StreamCalibration cal;
  for (int layer : {0, 1}) {  // Q4_0 down_t, then Q8_0
    cuda::BackendStatus st = backend->CalibrateStreaming(layer, 32, &cal);
    ASSERT_TRUE(st.ok()) << st.message;
    const double n_cold = static_cast<double>((*cold_ids_)[layer].size());
    const double down = static_cast<double>(RowBytes(down_t[layer].dtype, c.hidden_size));
    EXPECT_EQ(cal.bytes, n_cold * (2.0 * RowBytes(DType::kQ8_0, c.hidden_size) + down)) << layer;
  }
}

// The gpu-worker's VRAM plan measures its fixed part with an allocate_only instance: it must
// allocate exactly what the real instance of the same upload does (weights, split layout, KV
// cache, streaming slots sized from the cold rows it does not pin, a lane's scratch), for the
// split and for the measurement's own case of no hot row at all; and it computes nothing.
TEST_F(CudaBackendTest, AllocateOnlyInstanceSizesLikeTheRealOneAndComputesNothing) {
  for (bool no_hot_rows : {false, true}) {
    SCOPED_TRACE(no_hot_rows ? "every FFN row cold" : "the split placement");
    cuda::ModelUpload u = Upload(/*hot=*/true);
    u.stream_cold = true;
    u.stream_chunk_rows = 100;
    u.stream_slots = 2;
    u.cold_gpu_share = 0.25;
    if (no_hot_rows) {
      for (cuda::LayerUpload& lu : u.layers) lu.hot_ids.clear();
    }
    auto real = Create(u);
    ASSERT_NE(real, nullptr);
    u.allocate_only = true;
    auto sized = Create(u);
    ASSERT_NE(sized, nullptr);
    EXPECT_EQ(sized->DeviceBytes(), real->DeviceBytes());
    EXPECT_EQ(sized->WeightBytes(), real->WeightBytes());
    cuda::Backend* real_lane = nullptr;
    cuda::Backend* sized_lane = nullptr;
    ASSERT_TRUE(real->NewLane(&real_lane).ok());
    ASSERT_TRUE(sized->NewLane(&sized_lane).ok());
    EXPECT_EQ(sized_lane->DeviceBytes(), real_lane->DeviceBytes());

    std::vector<int32_t> tokens = {1, 450, 996};  // (the model's vocabulary is 4096)
    std::vector<float> logits(model_->config.vocab_size, NAN);
    CpuColdFfn cold(*model_, *down_t_, *cold_ids_);
    cuda::ForwardArgs a;
    a.tokens = tokens.data();
    a.n = static_cast<int>(tokens.size());
    a.mode = cuda::FfnMode::kExact;
    a.cold = &cold;
    a.logits = logits.data();
    for (cuda::Backend* b : {sized.get(), sized_lane}) {
      cuda::BackendStatus st = b->Forward(a);
      EXPECT_EQ(st.code, cuda::Code::kFailedPrecondition);
      EXPECT_NE(st.message.find("allocate_only"), std::string::npos) << st.message;
    }
    EXPECT_EQ(cold.calls, 0);
    EXPECT_TRUE(std::isnan(logits[0]));
    cuda::StreamCalibration cal;
    EXPECT_EQ(sized->CalibrateStreaming(0, 32, &cal).code, cuda::Code::kFailedPrecondition);
    // The real instance beside it still computes.
    cuda::BackendStatus st = real->Forward(a);
    EXPECT_TRUE(st.ok()) << st.message;
    module_->destroy(real_lane);
    module_->destroy(sized_lane);
  }
}

// Greedy continuations with every prompt batch over 8 tokens streamed equal transformers'.
TEST_F(CudaBackendTest, StreamedPrefillGivesReferenceGreedyTokens) {
  cuda::ModelUpload u = Upload(/*hot=*/true);
  u.stream_cold = true;
  auto backend = Create(u);
  ASSERT_NE(backend, nullptr);
  CpuColdFfn cold(*model_, *down_t_, *cold_ids_);
  std::vector<float> logits(model_->config.vocab_size);
  int streamed_prompts = 0;
  for (const auto& p : (*reference_)["prompts"]) {
    // Prompts of up to 8 tokens take the matrix-vector path, where the callback always runs;
    // the longer ones (10 and 14 tokens) are streamed.
    std::vector<int32_t> prompt = p["input_ids"].get<std::vector<int32_t>>();
    std::vector<int32_t> expect = p["greedy_ids"].get<std::vector<int32_t>>();
    if (prompt.size() <= 8) {
      EXPECT_EQ(Greedy(backend.get(), prompt, static_cast<int>(expect.size()),
                       cuda::FfnMode::kExact, &cold),
                expect);
      continue;
    }
    cuda::ForwardArgs a;
    a.tokens = prompt.data();
    a.n = static_cast<int>(prompt.size());
    a.mode = cuda::FfnMode::kExact;
    a.cold = &cold;
    a.cold_path = cuda::ColdPath::kStream;
    a.logits = logits.data();
    std::vector<int32_t> got;
    int pos = a.n;
    for (size_t s = 0; s < expect.size(); ++s) {
      cuda::BackendStatus st = backend->Forward(a);
      ASSERT_TRUE(st.ok()) << st.message;
      if (s == 0) {
        EXPECT_EQ(backend->last_stats().streamed_layers, model_->config.n_layers);
        ++streamed_prompts;
      }
      got.push_back(Argmax(logits));
      a.tokens = &got.back();
      a.n = 1;
      a.pos0 = pos++;
    }
    EXPECT_EQ(got, expect) << p["prompt"];
  }
  EXPECT_EQ(streamed_prompts, 2);  // the prompts of 10 and 14 tokens
}

// The GPU's share of the cold neurons (ModelUpload::cold_gpu_share): the GPU multiplies the first
// half of each layer's active cold list from the pinned host rows, the callback the rest. The
// logits stay the CPU reference's, in predicted mode and with the same lists given (kGiven, the
// benchmark's mode), and the work is split as asked.
TEST_F(CudaBackendTest, ColdGpuShareMatchesCpuReference) {
  const ModelConfig& c = model_->config;
  std::vector<int32_t> tokens =
      (*reference_)["prompts"][3]["input_ids"].get<std::vector<int32_t>>();
  std::unique_ptr<PredictedCase> pc = MakePredictedCase(*model_, *down_t_, tokens);
  ASSERT_GT(pc->min_margin, 1e-4) << "no safe threshold gap; change the seed";
  const int V = c.vocab_size;
  cuda::ModelUpload u = WithPredictors(Upload(/*hot=*/true), *pc);
  u.cold_gpu_share = 0.5;
  auto predicted = Create(u);
  auto given = Create(u);
  ASSERT_NE(predicted, nullptr);
  ASSERT_NE(given, nullptr);
  CpuColdFfn cold(*model_, *down_t_, *cold_ids_);
  std::vector<float> got(V);
  std::vector<std::vector<int32_t>> active, given_hot(c.n_layers), given_cold(c.n_layers);
  int64_t gpu_cold = 0, cpu_cold = 0;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    cuda::ForwardArgs a = PredictedStep(tokens, pos, &cold, got.data());
    a.active_out = &active;
    cuda::BackendStatus st = predicted->Forward(a);
    ASSERT_TRUE(st.ok()) << st.message;
    EXPECT_LE(Nmse(got.data(), pc->want.data() + pos * V, V), 1e-6)
        << "predicted, position " << pos;
    const cuda::ForwardStats& fs = predicted->last_stats();
    gpu_cold += fs.cold_rows_gpu;
    cpu_cold += fs.cold_rows_requested;
    // The same neurons, given: hot ones as local rows, cold ones as ids.
    for (int l = 0; l < c.n_layers; ++l) {
      given_hot[l].clear();
      given_cold[l].clear();
      const std::vector<int32_t>& hot = (*hot_ids_)[l];
      for (int32_t j : active[l]) {
        auto it = std::lower_bound(hot.begin(), hot.end(), j);
        if (it != hot.end() && *it == j) {
          given_hot[l].push_back(static_cast<int32_t>(it - hot.begin()));
        } else {
          given_cold[l].push_back(j);
        }
      }
    }
    a.mode = cuda::FfnMode::kGiven;
    a.active_out = nullptr;
    a.given_hot = &given_hot;
    a.given_cold = &given_cold;
    st = given->Forward(a);
    ASSERT_TRUE(st.ok()) << st.message;
    EXPECT_LE(Nmse(got.data(), pc->want.data() + pos * V, V), 1e-6) << "given, position " << pos;
    int64_t want_gpu = 0;
    for (const auto& g : given_cold) want_gpu += static_cast<int64_t>(g.size()) * 512 / 1024;
    EXPECT_EQ(given->last_stats().cold_rows_gpu, want_gpu) << "position " << pos;
  }
  // Half of each list, rounded down, went to the GPU.
  EXPECT_GT(gpu_cold, 0);
  EXPECT_GE(cpu_cold, gpu_cold);
  EXPECT_LE(cpu_cold, gpu_cold + static_cast<int64_t>(tokens.size()) * c.n_layers);
  // Adaptive: the share moves between steps (towards where both sides finish a layer together);
  // whatever it is, each step's logits stay the reference's.
  u.cold_gpu_share = 0;
  u.cold_gpu_share_adaptive = true;
  auto adaptive = Create(u);
  ASSERT_NE(adaptive, nullptr);
  double lo = 1, hi = 0;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    cuda::ForwardArgs a = PredictedStep(tokens, pos, &cold, got.data());
    cuda::BackendStatus st = adaptive->Forward(a);
    ASSERT_TRUE(st.ok()) << st.message;
    EXPECT_LE(Nmse(got.data(), pc->want.data() + pos * V, V), 1e-6) << "adaptive, position " << pos;
    lo = std::min(lo, adaptive->last_stats().cold_gpu_share);
    hi = std::max(hi, adaptive->last_stats().cold_gpu_share);
  }
  std::printf("adaptive cold share over %zu steps: %.3f .. %.3f\n", tokens.size(), lo, hi);
  u.cold_gpu_share_adaptive = false;
  // Out of range is refused at creation.
  u.cold_gpu_share = 1.5;
  cuda::Backend* b = nullptr;
  char err[256] = {0};
  EXPECT_EQ(module_->create(&u, &b, err, sizeof(err)),
            static_cast<int>(cuda::Code::kInvalidArgument));
  EXPECT_NE(std::string(err).find("cold_gpu_share"), std::string::npos) << err;
}

// The cold guess (ModelUpload::cold_guess): with the attention's output projection and every
// FFN down row zeroed (on the GPU and on the cold side), each layer's FFN input is the layer's
// residual, which is what the guess is made from (the residual after the previous layer's
// attention). So layer l's predictor sees exactly its FFN input, and with its
// cut lowered by a little (1e-3) the guess handed to Ahead must hold every neuron of the actual
// cold list that the same step's callback gets, and little else; its first tier (the predictor's
// own cut) is the actual list itself, up to the rounding of scores that sit on the cut. Each guess
// is ascending and within the layer's cold neurons; the first layer gets none.
TEST_F(CudaBackendTest, ColdGuessWithoutAttentionHoldsTheActualColdList) {
  const ModelConfig& c = model_->config;
  std::vector<int32_t> tokens =
      (*reference_)["prompts"][3]["input_ids"].get<std::vector<int32_t>>();
  std::unique_ptr<PredictedCase> pc = MakePredictedCase(*model_, *down_t_, tokens);
  cuda::ModelUpload u = WithPredictors(Upload(/*hot=*/true), *pc);
  std::vector<TensorView> zero_down_t = *down_t_;
  std::vector<std::vector<uint8_t>> zero_wo(c.n_layers), zeros(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    zero_wo[l].assign(model_->layers[l].wo.nbytes(), 0);  // zero in every weight format
    u.layers[l].wo.data = zero_wo[l].data();
    zeros[l].assign(zero_down_t[l].nbytes(), 0);
    zero_down_t[l].data = zeros[l].data();
    u.layers[l].down_t.data = zeros[l].data();
  }
  u.cold_guess = true;
  u.cold_guess_shift = 1e-3;
  u.cold_guess_recall = 0;  // the shift stays
  auto backend = Create(u);
  ASSERT_NE(backend, nullptr);
  CpuColdFfn cpu(*model_, zero_down_t, *cold_ids_);
  class Recorder : public AheadRecorder {
   public:
    using AheadRecorder::AheadRecorder;
    cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
      actual.emplace_back(r.active, r.active + r.n_active);
      return AheadRecorder::Run(r);
    }
    std::vector<std::vector<int32_t>> actual;
  } cold(&cpu);
  std::vector<float> got(c.vocab_size);
  int64_t guessed = 0, listed = 0, tier_differs = 0, first_total = 0, stats_first = 0;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    cuda::BackendStatus st = backend->Forward(PredictedStep(tokens, pos, &cold, got.data()));
    ASSERT_TRUE(st.ok()) << st.message;
    const cuda::ForwardStats& fs = backend->last_stats();
    EXPECT_EQ(fs.guess_hits, fs.guess_actual) << "position " << pos;
    stats_first += fs.guess_first;
    const std::vector<int32_t>& first = cold.actual[cold.actual.size() - c.n_layers];
    EXPECT_EQ(fs.guess_actual, fs.cold_rows_requested - static_cast<int64_t>(first.size()))
        << "position " << pos;
  }
  ASSERT_EQ(cold.guesses.size(), cold.actual.size());
  ASSERT_EQ(cold.actual.size(), tokens.size() * c.n_layers);
  for (size_t i = 0; i < cold.actual.size(); ++i) {
    const int l = static_cast<int>(i % c.n_layers);
    const std::vector<int32_t>& g = cold.guesses[i];
    if (l == 0) {
      EXPECT_TRUE(g.empty()) << "call " << i;
      continue;
    }
    const std::vector<int32_t>& cold_l = (*cold_ids_)[l];
    EXPECT_TRUE(std::is_sorted(g.begin(), g.end()) &&
                std::adjacent_find(g.begin(), g.end()) == g.end())
        << "call " << i;
    for (int32_t j : g) {
      EXPECT_TRUE(std::binary_search(cold_l.begin(), cold_l.end(), j)) << j << ", call " << i;
    }
    for (int32_t j : cold.actual[i]) {
      EXPECT_TRUE(std::binary_search(g.begin(), g.end(), j)) << j << " missed, call " << i;
    }
    guessed += static_cast<int64_t>(g.size());
    listed += static_cast<int64_t>(cold.actual[i].size());
    const std::vector<int32_t>& f = cold.firsts[i];
    std::vector<int32_t> diff;
    std::set_symmetric_difference(f.begin(), f.end(), cold.actual[i].begin(), cold.actual[i].end(),
                                  std::back_inserter(diff));
    tier_differs += static_cast<int64_t>(diff.size());
    first_total += static_cast<int64_t>(f.size());
  }
  EXPECT_GT(listed, 0);
  EXPECT_LE(guessed, listed + listed / 20) << "the cut lowered by 1e-3 adds few neurons";
  EXPECT_LE(tier_differs, listed / 100) << first_total << " in the first tiers";
  EXPECT_EQ(stats_first, first_total);

  // Values out of range are refused at creation.
  for (int bad = 0; bad < 2; ++bad) {
    cuda::ModelUpload v = u;
    v.cold_guess_recall = bad == 0 ? 1 : 0.95;
    v.cold_guess_shift = bad == 1 ? NAN : 1;
    cuda::Backend* b = nullptr;
    char err[256] = {0};
    EXPECT_EQ(module_->create(&v, &b, err, sizeof(err)),
              static_cast<int>(cuda::Code::kInvalidArgument))
        << bad;
    EXPECT_NE(std::string(err).find("cold_guess_recall must be in [0, 1) and cold_guess_shift"),
              std::string::npos)
        << err;
  }
}

// With the attention in place, the guess changes nothing the step computes: each step's logits
// equal the CPU reference's. The adaptation moves each guessing layer's shift towards the asked
// recall, and a shift set between steps reaches the captured graphs' next replay: a very large
// one guesses every cold neuron, a very negative one none.
TEST_F(CudaBackendTest, ColdGuessLeavesPredictedLogitsAndFollowsItsShift) {
  const ModelConfig& c = model_->config;
  std::vector<int32_t> tokens =
      (*reference_)["prompts"][3]["input_ids"].get<std::vector<int32_t>>();
  std::unique_ptr<PredictedCase> pc = MakePredictedCase(*model_, *down_t_, tokens);
  ASSERT_GT(pc->min_margin, 1e-4) << "no safe threshold gap; change the seed";
  const int V = c.vocab_size;
  cuda::ModelUpload u = WithPredictors(Upload(/*hot=*/true), *pc);
  u.cold_guess = true;
  u.cold_guess_shift = 0.5;
  u.cold_guess_recall = 0.95;
  auto backend = Create(u);
  ASSERT_NE(backend, nullptr);
  CpuColdFfn cpu(*model_, *down_t_, *cold_ids_);
  AheadRecorder cold(&cpu);
  std::vector<float> got(V);
  int64_t guess_rows = 0, hits = 0, actual = 0;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    cuda::BackendStatus st = backend->Forward(PredictedStep(tokens, pos, &cold, got.data()));
    ASSERT_TRUE(st.ok()) << st.message;
    EXPECT_LE(Nmse(got.data(), pc->want.data() + pos * V, V), 1e-6) << "position " << pos;
    guess_rows += backend->last_stats().guess_rows;
    hits += backend->last_stats().guess_hits;
    actual += backend->last_stats().guess_actual;
  }
  EXPECT_GT(guess_rows, 0);
  EXPECT_GT(actual, 0);
  int moved = 0;
  for (int l = 0; l < c.n_layers; ++l) moved += backend->cold_guess_shift(l) != 0.5;
  EXPECT_EQ(moved, c.n_layers - 1);  // the first layer makes no guess
  std::printf("guess: %lld neurons for %lld actual, %.3f of them held; shifts now",
              static_cast<long long>(guess_rows), static_cast<long long>(actual),
              static_cast<double>(hits) / actual);
  for (int l = 0; l < c.n_layers; ++l) std::printf(" %.3f", backend->cold_guess_shift(l));
  std::printf("\n");

  for (double shift : {1e30, -1e30}) {
    SCOPED_TRACE(shift);
    backend->set_cold_guess_shift(shift);
    cold.guesses.clear();
    const size_t pos = tokens.size() - 1;
    cuda::BackendStatus st = backend->Forward(PredictedStep(tokens, pos, &cold, got.data()));
    ASSERT_TRUE(st.ok()) << st.message;
    EXPECT_LE(Nmse(got.data(), pc->want.data() + pos * V, V), 1e-6);
    ASSERT_EQ(cold.guesses.size(), static_cast<size_t>(c.n_layers));
    for (int l = 0; l < c.n_layers; ++l) {
      EXPECT_EQ(cold.guesses[l], shift > 0 && l > 0 ? (*cold_ids_)[l] : std::vector<int32_t>{})
          << "layer " << l;
    }
  }
}

}  // namespace
}  // namespace cuda_test
}  // namespace pinfer
