// The CUDA module end to end, loaded with dlopen exactly as the gpu-worker loads it: relu-llama-
// tiny split into hot rows on the GPU and cold rows computed by a CPU callback (the role the
// cpu-worker plays through shared memory) must produce transformers' greedy tokens
// (reference.json) for all 12 prompts; so must the whole model on the GPU in dense mode; and
// step-by-step logits must match the CPU reference forward pass. Skips without a CUDA device.
//
// This header is what the backend tests share: the module loaded once per suite (CudaBackendTest),
// the tiny model and its reference tokens, the CPU cold side, and the helpers that build quantized
// copies and predicted-mode cases. The tests are split by what they exercise into
// cuda_backend_*_test.cc, one executable (cuda_backend_test).
#pragma once

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu-worker/cuda/backend.h"
#include "gpu-worker/cuda/model_dims.h"
#include "gpu-worker/module_cache_slots.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/ops.h"
#include "shared/engine/sampler.h"
#include "shared/engine/transformer.h"
#include "shared/model/model.h"
#include "shared/sparse/hot_cache.h"
#include "shared/sparse/sparse_ffn.h"

namespace pinfer {
namespace cuda_test {

inline std::string ModelsDir() {
  const char* env = std::getenv("PINFER_MODELS_DIR");
  return env != nullptr ? env : PINFER_MODELS_DIR;
}

inline std::string ModulePath() {
  const char* env = std::getenv("PINFER_CUDA_MODULE");
  return env != nullptr ? env : PINFER_CUDA_MODULE_PATH;
}

struct Module {
  void* handle = nullptr;
  PinferCudaDeviceCountFn device_count = nullptr;
  PinferCudaCreateFn create = nullptr;
  PinferCudaDestroyFn destroy = nullptr;
};

inline cuda::HostMatrix FromView(const TensorView& t) {
  cuda::HostMatrix m;
  m.type = static_cast<cuda::HostType>(t.dtype);
  m.rows = t.rows();
  m.cols = t.cols();
  m.data = t.data;
  return m;
}

// down: [hidden, ffn] fp16 -> down_t: [ffn, hidden], moving the 16-bit values unchanged.
inline std::vector<uint16_t> Transpose16(const TensorView& down) {
  const int64_t rows = down.rows(), cols = down.cols();
  const auto* src = static_cast<const uint16_t*>(down.data);
  std::vector<uint16_t> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = src[r * cols + c];
  }
  return out;
}

// The cold side, computed on the CPU with the optimised operators. Exact mode: the cold gate
// rows decide which cold neurons are active, as in the cpu-worker. With split > 1, a single
// token's active neurons are dealt in turn to that many partial sums, handed to the GPU to add
// up (ColdRequest::max_parts), as the cpu-worker's threads do.
class CpuColdFfn : public cuda::ColdFfn {
 public:
  CpuColdFfn(const Model& model, const std::vector<TensorView>& down_t,
             const std::vector<std::vector<int32_t>>& cold_ids)
      : model_(model), down_t_(down_t), cold_ids_(cold_ids), ops_(NewSimdOps(nullptr)) {}

  cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
    const int H = model_.config.hidden_size;
    const LayerWeights& L = model_.layers[r.layer];
    // kGiven lists the cold neurons to consider (the rest are on the GPU); the gate still decides.
    std::vector<int32_t> listed;
    if (r.active != nullptr) listed.assign(r.active, r.active + r.n_active);
    const std::vector<int32_t>& ids = r.active != nullptr ? listed : cold_ids_[r.layer];
    const int parts = r.n == 1 ? std::min(split, r.max_parts) : 0;
    std::fill(r.out, r.out + static_cast<size_t>(std::max({r.n, parts, 1})) * H, 0.f);
    ++calls;
    if (r.max_parts > 0) ++offered_parts;
    for (int t = 0; t < r.n; ++t) {
      const float* x = r.x + static_cast<size_t>(t) * H;
      std::vector<float> g(ids.size());
      ops_->MatMulRows(L.gate, ids.data(), static_cast<int>(ids.size()), x, 1, g.data());
      std::vector<int32_t> active;
      std::vector<float> ga;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (g[i] > 0) {
          active.push_back(ids[i]);
          ga.push_back(g[i]);
        }
      }
      std::vector<float> u(active.size());
      ops_->MatMulRows(L.up, active.data(), static_cast<int>(active.size()), x, 1, u.data());
      ops_->GatedActivation(model_.config.activation, ga.data(), u.data(),
                            static_cast<int64_t>(ga.size()));
      if (parts > 1) {
        for (size_t i = 0; i < active.size(); ++i) {
          ops_->AccumulateRows(down_t_[r.layer], &active[i], 1, &ga[i], 1,
                               r.out + static_cast<size_t>(i % parts) * H);
        }
        *r.parts = parts;
        continue;
      }
      ops_->AccumulateRows(down_t_[r.layer], active.data(), static_cast<int>(active.size()),
                           ga.data(), 1, r.out + static_cast<size_t>(t) * H);
    }
    return {};
  }
  int split = 1;
  int calls = 0;
  int offered_parts = 0;  // calls that could hand over partial sums

 private:
  const Model& model_;
  const std::vector<TensorView>& down_t_;
  const std::vector<std::vector<int32_t>>& cold_ids_;
  std::unique_ptr<CpuOps> ops_;
};

inline double Nmse(const float* got, const float* want, int n) {
  double err = 0, norm = 0;
  for (int i = 0; i < n; ++i) {
    if (std::isnan(got[i])) return INFINITY;
    err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return err / norm;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    module_ = new Module;
    module_->handle = dlopen(ModulePath().c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(module_->handle, nullptr) << dlerror();
    module_->device_count = reinterpret_cast<PinferCudaDeviceCountFn>(
        dlsym(module_->handle, PINFER_CUDA_DEVICE_COUNT_SYMBOL));
    module_->create =
        reinterpret_cast<PinferCudaCreateFn>(dlsym(module_->handle, PINFER_CUDA_CREATE_SYMBOL));
    module_->destroy =
        reinterpret_cast<PinferCudaDestroyFn>(dlsym(module_->handle, PINFER_CUDA_DESTROY_SYMBOL));
    ASSERT_TRUE(module_->device_count && module_->create && module_->destroy);
    if (module_->device_count() == 0) return;
    auto m = LoadModel(ModelsDir() + "/relu-llama-tiny");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
    std::ifstream in(ModelsDir() + "/relu-llama-tiny/reference.json");
    reference_ = new nlohmann::json(nlohmann::json::parse(in));
    const ModelConfig& c = model_->config;
    down_t_data_ = new std::vector<std::vector<uint16_t>>;
    down_t_ = new std::vector<TensorView>;
    hot_ids_ = new std::vector<std::vector<int32_t>>(c.n_layers);
    cold_ids_ = new std::vector<std::vector<int32_t>>(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      ASSERT_EQ(model_->layers[l].down.dtype, DType::kF16);
      down_t_data_->push_back(Transpose16(model_->layers[l].down));
      TensorView t;
      t.dtype = DType::kF16;
      t.shape = {c.ffn_size, c.hidden_size};
      t.data = down_t_data_->back().data();
      down_t_->push_back(t);
      // A fixed quarter of each layer's neurons on the GPU, scattered by a hash.
      for (int j = 0; j < c.ffn_size; ++j) {
        const uint32_t h = static_cast<uint32_t>(j + 7919 * l) * 2654435761u;
        ((h >> 7) % 4 == 0 ? (*hot_ids_)[l] : (*cold_ids_)[l]).push_back(j);
      }
    }
  }
  static void TearDownTestSuite() {
    delete model_;
    delete reference_;
    delete down_t_;
    delete down_t_data_;
    delete hot_ids_;
    delete cold_ids_;
    delete module_;  // the module stays loaded: unloading CUDA libraries at exit is fragile
  }
  void SetUp() override {
    if (module_->device_count == nullptr || module_->device_count() == 0) {
      GTEST_SKIP() << "no CUDA device here";
    }
  }

  // AdaptiveCacheRowsMatchCpuReference for one set of weights (ref_model: what the split
  // multiplies, on the CPU reference), logits' normalized error at most `limit`.
  void CheckAdaptiveCacheRows(const Model& weights, const std::vector<TensorView>& down_t,
                              const Model& ref_model, double limit);

  // One sequence through the module and through the CPU reference forward pass side by side:
  // a first call of `prompt` tokens, then one decode step a call to the end of `tokens`, whole
  // model dense or hot/cold split (exact mode, the cold rows from `weights` and `down_t`).
  // ref_model is what the GPU multiplies (for the split, the down rows as uploaded). Fails the
  // test on an error or a NaN; returns how close each call's last-position logits came.
  struct StepAgreement {
    double worst_nmse = 0;
    int same_argmax = 0, calls = 0;
  };
  static StepAgreement CompareSteps(const Model& weights, const std::vector<TensorView>& down_t,
                                    const Model& ref_model, bool hot,
                                    const std::vector<int32_t>& tokens, int prompt);
  // A small random Q8_0 ReLU model (hidden 256, 3 layers, GQA 2:1) changed by `change` (a model
  // family's difference from Llama: biases, a window), `prompt` random tokens then decode steps
  // to n_tokens: the change must move the prompt's reference logits, and each call's logits must
  // follow the changed model's CPU reference, whole model and hot/cold split. `what` names it.
  static void CheckSmallModelFollowsReference(const char* what, uint32_t seed, int n_tokens,
                                              int prompt,
                                              const std::function<void(Model*)>& change);

  // hot: the split placement; otherwise every layer dense on the GPU.
  static cuda::ModelUpload Upload(bool hot) { return Upload(*model_, *down_t_, hot); }
  static cuda::ModelUpload Upload(const Model& model, const std::vector<TensorView>& down_t,
                                  bool hot) {
    const Model* model_ = &model;  // (shadows the fixture's model)
    const std::vector<TensorView>* down_t_ = &down_t;
    const ModelConfig& c = model_->config;
    cuda::ModelUpload u;
    u.dims = cuda::DimsFromConfig(c);
    u.tok_embeddings = FromView(model_->tok_embeddings);
    u.output_norm = FromView(model_->output_norm);
    u.output_norm.rows = 1;
    u.output = FromView(model_->output);
    u.max_ctx = 256;
    u.max_seqs = 2;
    u.max_batch = 64;
    for (int l = 0; l < c.n_layers; ++l) {
      const LayerWeights& L = model_->layers[l];
      cuda::LayerUpload lu;
      lu.attn_norm = FromView(L.attn_norm);
      lu.attn_norm.rows = 1;
      lu.ffn_norm = FromView(L.ffn_norm);
      lu.ffn_norm.rows = 1;
      lu.wq = FromView(L.wq);
      lu.wk = FromView(L.wk);
      lu.wv = FromView(L.wv);
      lu.wo = FromView(L.wo);
      if (c.qkv_bias) {
        for (auto [dst, src] : {std::pair{&lu.bq, &L.bq}, {&lu.bk, &L.bk}, {&lu.bv, &L.bv}}) {
          *dst = FromView(*src);
          dst->rows = 1;
        }
      }
      lu.gate = FromView(L.gate);
      lu.up = FromView(L.up);
      if (hot) {
        lu.ffn = cuda::FfnPlacement::kHot;
        lu.down_t = FromView((*down_t_)[l]);
        lu.hot_ids = (*hot_ids_)[l];
      } else {
        lu.ffn = cuda::FfnPlacement::kDense;
        lu.down = FromView(L.down);
      }
      u.layers.push_back(lu);
    }
    return u;
  }

  static std::unique_ptr<cuda::Backend, PinferCudaDestroyFn> Create(const cuda::ModelUpload& u) {
    cuda::Backend* b = nullptr;
    char err[512] = {0};
    const int rc = module_->create(&u, &b, err, sizeof(err));
    EXPECT_EQ(rc, 0) << err;
    return std::unique_ptr<cuda::Backend, PinferCudaDestroyFn>(b, module_->destroy);
  }

  static int Argmax(const std::vector<float>& v) {
    return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
  }

  // Greedy continuation: the prompt in one batch, then one token per step. The host picks from
  // the copied logits, or with gpu_pick the GPU does (LogitsMode::kGreedy); logprobs, if given,
  // gets each pick's log-probability (the host's from the sampler's greedy path).
  static std::vector<int32_t> Greedy(cuda::Backend* b, const std::vector<int32_t>& prompt,
                                     int steps, cuda::FfnMode mode, cuda::ColdFfn* cold,
                                     bool gpu_pick = false, int seq = 0,
                                     std::vector<float>* logprobs = nullptr) {
    std::vector<float> logits(model_->config.vocab_size);
    std::vector<int32_t> out;
    cuda::GreedyResult pick;
    Sampler sampler{SamplingParams{}};
    cuda::ForwardArgs a;
    a.seq = seq;
    a.tokens = prompt.data();
    a.n = static_cast<int>(prompt.size());
    a.pos0 = 0;
    a.mode = mode;
    a.cold = cold;
    if (gpu_pick) {
      a.logits_mode = cuda::LogitsMode::kGreedy;
      a.greedy = &pick;
    } else {
      a.logits = logits.data();
    }
    int pos = a.n;
    for (int s = 0; s < steps; ++s) {
      cuda::BackendStatus st = b->Forward(a);
      EXPECT_TRUE(st.ok()) << st.message;
      if (!st.ok()) return out;
      if (gpu_pick) {
        out.push_back(pick.token);
        if (logprobs != nullptr) logprobs->push_back(pick.logprob);
      } else {
        float logprob = 0;
        out.push_back(sampler.Sample(logits, {}, &logprob));
        EXPECT_EQ(out.back(), Argmax(logits));
        if (logprobs != nullptr) logprobs->push_back(logprob);
      }
      a.tokens = &out.back();
      a.n = 1;
      a.pos0 = pos++;
    }
    return out;
  }

  // Token by token over a reference prompt, in exact mode with `cold`: each step's logits equal
  // the CPU reference forward pass's up to fp32 summation order (NMSE <= 1e-6, no NaN).
  // `before` may run steps of its own at each position first.
  static void ExpectStepsMatchReference(
      cuda::Backend* b, cuda::ColdFfn* cold, int prompt_no, int seq,
      const std::function<void(const cuda::ForwardArgs&)>& before = nullptr) {
    std::unique_ptr<CpuOps> ref_ops = NewReferenceOps();
    Transformer ref(*model_, *ref_ops);
    KvCache cache(model_->config, 64);
    const int V = model_->config.vocab_size;
    std::vector<int32_t> tokens =
        (*reference_)["prompts"][prompt_no]["input_ids"].get<std::vector<int32_t>>();
    ASSERT_GE(tokens.size(), 5u);
    std::vector<float> got(V), want(V);
    for (int pos = 0; pos < static_cast<int>(tokens.size()); ++pos) {
      ASSERT_TRUE(ref.Forward({&tokens[pos], 1}, pos, &cache, LogitsMode::kLast, want.data()).ok());
      cuda::ForwardArgs a;
      a.tokens = &tokens[pos];
      a.n = 1;
      a.pos0 = pos;
      a.seq = seq;
      a.mode = cuda::FfnMode::kExact;
      a.cold = cold;
      a.logits = got.data();
      if (before) before(a);
      cuda::BackendStatus st = b->Forward(a);
      ASSERT_TRUE(st.ok()) << st.message;
      EXPECT_LE(Nmse(got.data(), want.data(), V), 1e-6) << "position " << pos;
    }
  }

  static inline Module* module_ = nullptr;
  static inline Model* model_ = nullptr;
  static inline nlohmann::json* reference_ = nullptr;
  static inline std::vector<std::vector<uint16_t>>* down_t_data_ = nullptr;
  static inline std::vector<TensorView>* down_t_ = nullptr;
  static inline std::vector<std::vector<int32_t>>* hot_ids_ = nullptr;
  static inline std::vector<std::vector<int32_t>>* cold_ids_ = nullptr;
};

// Records the order of Ahead and Run calls; in Ahead, waits for x_ready as a cold side that
// loads rows until the FFN input is published would.
class AheadRecorder : public cuda::ColdFfn {
 public:
  explicit AheadRecorder(cuda::ColdFfn* inner) : inner_(inner) {}
  void Ahead(int layer, const cuda::ColdGuess& guess,
             const std::function<bool()>& x_ready) override {
    events.push_back(-1 - layer);
    guesses.emplace_back(guess.ids, guess.ids + guess.n);
    firsts.emplace_back();
    for (int i = 0; i < guess.n; ++i) {
      if (guess.first != nullptr && guess.first[i] != 0) firsts.back().push_back(guess.ids[i]);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!x_ready()) {
      if (std::chrono::steady_clock::now() > deadline) {
        ++never_ready;
        return;
      }
    }
  }
  cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
    events.push_back(r.layer);
    return inner_->Run(r);
  }
  std::vector<int> events;                    // Run(l): l; Ahead(l): -1 - l
  std::vector<std::vector<int32_t>> guesses;  // per Ahead call
  std::vector<std::vector<int32_t>> firsts;   // per Ahead call: the guess's first tier
  int never_ready = 0;

 private:
  cuda::ColdFfn* inner_;
};

// A copy of `model` with every matrix but the embeddings stored as `type`, and its transposed
// down projections likewise. The buffers live in the copy's `owned`.
inline std::unique_ptr<Model> QuantizedCopy(const Model& model,
                                            const std::vector<TensorView>& down_t, DType type,
                                            std::vector<TensorView>* down_t_out) {
  auto q = std::make_unique<Model>();
  q->config = model.config;
  q->tok_embeddings = model.tok_embeddings;
  q->output_norm = model.output_norm;
  auto quantize = [&](const TensorView& t) {
    const int64_t rows = t.rows(), cols = t.cols();
    auto buf = std::make_shared<std::vector<uint8_t>>(RowBytes(type, cols) * rows);
    std::vector<float> row(cols);
    for (int64_t r = 0; r < rows; ++r) {
      DequantizeRow(t.dtype, static_cast<const uint8_t*>(t.data) + t.row_bytes() * r, row.data(),
                    cols);
      QuantizeRow(type, row.data(), buf->data() + RowBytes(type, cols) * r, cols);
    }
    q->owned.push_back(buf);
    TensorView v = t;
    v.dtype = type;
    v.data = buf->data();
    return v;
  };
  q->output = quantize(model.output);
  for (size_t l = 0; l < model.layers.size(); ++l) {
    LayerWeights L = model.layers[l];
    for (TensorView* t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.gate, &L.up, &L.down}) *t = quantize(*t);
    q->layers.push_back(L);
    down_t_out->push_back(quantize(down_t[l]));
  }
  return q;
}

// The same model with each layer's down projection replaced by the exact fp32 transpose of
// the given transposed rows: the weights the hot/cold split multiplies (its down projection adds
// rows of down_t with fp32 coefficients, so it is no Q8_0 product whose quantization differs).
inline std::unique_ptr<Model> WithDownFromRows(const Model& model,
                                               const std::vector<TensorView>& down_t) {
  auto m = std::make_unique<Model>();
  m->config = model.config;
  m->tok_embeddings = model.tok_embeddings;
  m->output_norm = model.output_norm;
  m->output = model.output;
  m->layers = model.layers;
  m->owned = model.owned;
  const int64_t H = model.config.hidden_size, F = model.config.ffn_size;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    auto buf = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(H * F) * 4);
    float* down = reinterpret_cast<float*>(buf->data());
    std::vector<float> row(H);
    for (int64_t j = 0; j < F; ++j) {
      DequantizeRow(down_t[l].dtype,
                    static_cast<const uint8_t*>(down_t[l].data) + down_t[l].row_bytes() * j,
                    row.data(), H);
      for (int64_t i = 0; i < H; ++i) down[i * F + j] = row[i];
    }
    m->owned.push_back(buf);
    m->layers[l].down.dtype = DType::kF32;
    m->layers[l].down.data = buf->data();
  }
  return m;
}

// Records the predictor scores of one layer as its threshold sees them (times rms(residual) for
// pre-norm predictors, ScoreScale), then runs the wrapped FFN.
class ScoreProbe : public FfnBlock {
 public:
  ScoreProbe(FfnBlock* inner, const PredictorSet& p, const CpuOps& ops, int probe, float eps)
      : inner_(inner), p_(p), ops_(ops), probe_(probe), eps_(eps) {}
  absl::Status Forward(int layer, const float* x, int n, float* out) override {
    return ForwardFromResidual(layer, nullptr, x, n, out);
  }
  absl::Status ForwardFromResidual(int layer, const float* residual, const float* x, int n,
                                   float* out) override {
    if (layer == probe_) {
      const LayerPredictor& P = p_.layers[layer];
      const int H = static_cast<int>(P.fc1.cols()), F = static_cast<int>(P.fc2.rows());
      std::vector<float> h(static_cast<size_t>(n) * P.rank());
      std::vector<float> sc(static_cast<size_t>(n) * F);
      ops_.MatMul(P.fc1, x, n, h.data());
      for (float& v : h) v = std::max(v, 0.f);
      ops_.MatMul(P.fc2, h.data(), n, sc.data());
      for (int t = 0; t < n; ++t) {
        const float scale = ScoreScale(
            P, residual != nullptr ? residual + static_cast<size_t>(t) * H : nullptr, H, eps_);
        for (int j = 0; j < F; ++j) sc[static_cast<size_t>(t) * F + j] *= scale;
      }
      scores.insert(scores.end(), sc.begin(), sc.end());
    }
    return inner_->ForwardFromResidual(layer, residual, x, n, out);
  }
  std::vector<float> scores;

 private:
  FfnBlock* inner_;
  const PredictorSet& p_;
  const CpuOps& ops_;
  int probe_;
  float eps_;
};

// Random predictors (rank 16) for the predicted-mode tests, and the CPU reference's step logits
// with them: shared/sparse's PredictedSparseFfn in the reference forward pass, one token at a
// time. Each layer's threshold sits in the middle of the widest gap between the CPU's scores
// between two quantiles (lo_q, hi_q), so that fp32 rounding differences cannot flip a decision.
// reads_residual: PowerInfer's pre-norm predictors, whose non-zero threshold applies to the score
// times rms(residual).
struct PredictedCase {
  std::vector<std::vector<float>> fc1, fc2;
  PredictorSet preds;
  std::vector<float> want;  // [tokens, vocab]
  double min_margin = 1e30;
  double min_relative_margin = 1e30;  // the margin over the threshold's magnitude
};

inline std::unique_ptr<PredictedCase> MakePredictedCase(const Model& model,
                                                        const std::vector<TensorView>& down_t,
                                                        const std::vector<int32_t>& tokens,
                                                        double lo_q = 0.6, double hi_q = 0.8,
                                                        bool reads_residual = false) {
  const ModelConfig& c = model.config;
  const int rank = 16;
  auto pc = std::make_unique<PredictedCase>();
  pc->fc1.resize(c.n_layers);
  pc->fc2.resize(c.n_layers);
  uint64_t state = 12345;
  auto normal = [&] {
    double u = 0;
    for (int i = 0; i < 12; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      u += static_cast<double>(state >> 11) / 9007199254740992.0;
    }
    return static_cast<float>(u - 6);
  };
  for (int l = 0; l < c.n_layers; ++l) {
    pc->fc1[l].resize(static_cast<size_t>(rank) * c.hidden_size);
    pc->fc2[l].resize(static_cast<size_t>(c.ffn_size) * rank);
    for (float& v : pc->fc1[l]) v = normal() / std::sqrt(float(c.hidden_size));
    for (float& v : pc->fc2[l]) v = normal() / std::sqrt(float(rank));
    LayerPredictor p;
    p.fc1.dtype = p.fc2.dtype = DType::kF32;
    p.fc1.shape = {rank, c.hidden_size};
    p.fc1.data = pc->fc1[l].data();
    p.fc2.shape = {c.ffn_size, rank};
    p.fc2.data = pc->fc2[l].data();
    p.threshold = 1e30f;  // set below, layer by layer
    p.reads_residual = reads_residual;
    pc->preds.layers.push_back(p);
  }
  std::unique_ptr<CpuOps> ref_ops = NewReferenceOps();
  const int V = c.vocab_size;
  auto cpu_run = [&](int probe, std::vector<float>* scores) {
    auto ffn = PredictedSparseFfn::Create(model, *ref_ops, down_t, &pc->preds);
    EXPECT_TRUE(ffn.ok()) << ffn.status();
    ScoreProbe probe_ffn(ffn->get(), pc->preds, *ref_ops, probe, c.norm_eps);
    Transformer t(model, *ref_ops);
    t.set_ffn(&probe_ffn);
    KvCache cache(c, static_cast<int>(tokens.size()));
    std::vector<float> logits(static_cast<size_t>(tokens.size()) * V);
    for (size_t pos = 0; pos < tokens.size(); ++pos) {
      EXPECT_TRUE(t.Forward({&tokens[pos], 1}, static_cast<int>(pos), &cache, LogitsMode::kLast,
                            logits.data() + pos * V)
                      .ok());
    }
    if (scores != nullptr) *scores = std::move(probe_ffn.scores);
    return logits;
  };
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<float> sc;
    cpu_run(l, &sc);
    std::sort(sc.begin(), sc.end());
    const size_t lo = static_cast<size_t>(sc.size() * lo_q);
    const size_t hi = static_cast<size_t>(sc.size() * hi_q);
    size_t best = lo;
    for (size_t i = lo; i < hi; ++i) {
      if (sc[i + 1] - sc[i] > sc[best + 1] - sc[best]) best = i;
    }
    pc->preds.layers[l].threshold = 0.5f * (sc[best] + sc[best + 1]);
    pc->min_margin = std::min<double>(pc->min_margin, 0.5 * (sc[best + 1] - sc[best]));
    pc->min_relative_margin =
        std::min<double>(pc->min_relative_margin,
                         0.5 * (sc[best + 1] - sc[best]) / std::abs(pc->preds.layers[l].threshold));
  }
  pc->want = cpu_run(-1, nullptr);
  return pc;
}

// The upload with the case's predictors on every layer.
inline cuda::ModelUpload WithPredictors(cuda::ModelUpload u, const PredictedCase& pc) {
  for (size_t l = 0; l < u.layers.size(); ++l) {
    u.layers[l].pred_fc1 = FromView(pc.preds.layers[l].fc1);
    u.layers[l].pred_fc2 = FromView(pc.preds.layers[l].fc2);
    u.layers[l].pred_threshold = pc.preds.layers[l].threshold;
    u.layers[l].pred_scores_times_rms = ScoresNeedResidual(pc.preds.layers[l]);
  }
  return u;
}

// Decode step `pos` of `tokens` in predicted mode.
inline cuda::ForwardArgs PredictedStep(const std::vector<int32_t>& tokens, size_t pos,
                                       cuda::ColdFfn* cold, float* logits) {
  cuda::ForwardArgs a;
  a.tokens = &tokens[pos];
  a.n = 1;
  a.pos0 = static_cast<int>(pos);
  a.mode = cuda::FfnMode::kPredicted;
  a.cold = cold;
  a.logits = logits;
  return a;
}

}  // namespace cuda_test
}  // namespace pinfer
