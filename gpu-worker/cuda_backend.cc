// The gpu-worker's CUDA backend: the ComputeBackend interface over the CUDA module
// (gpu-worker/cuda, libpinfer_cuda.so, loaded with dlopen so that cuBLAS/CUDA never link into
// this process). The module computes embeddings, attention, the KV caches, norms, the hot FFN
// rows and the output head on the GPU; for each layer it calls back ExchangeColdFfn with the FFN
// input while the GPU works on the hot rows, and this callback runs the same shared-memory
// exchange with the cpu-worker as the CPU backend does.
//
// Decode steps of concurrent sequences run on lanes (--decode-lanes, cuda::Backend::NewLane): a
// second backend over the same weights and KV cache, driven by its own thread, so that while the
// cpu-worker computes one sequence's cold rows the GPU works on another's attention. A single
// sequence cannot overlap the two sides, since each layer needs the previous layer's cold rows.
// The exchanges take turns on the one segment, as the cpu-worker serves one at a time.
//
// Prompt batches can instead stream a layer's cold rows to the GPU (--cold-prefill): the module
// keeps a pinned host copy of them, and ColdPrefillPlanner (cold_prefill.h) picks the path per
// layer and batch from rates measured here: CalibrateStreaming at start-up for the stream, the
// timed exchanges of ExchangeColdFfn for the cpu-worker.
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "gpu-worker/backend.h"
#include "gpu-worker/cold_prefill.h"
#include "gpu-worker/cuda/backend.h"
#include "gpu-worker/cuda/model_dims.h"
#include "gpu-worker/lane_threads.h"
#include "gpu-worker/module_cache_slots.h"
#include "shared/engine/transformer.h"
#include "shared/service/log.h"
#include "shared/sparse/sparse_ffn.h"
#include "shared/util/status_macros.h"

namespace pinfer::gpuworker {
static_assert(kMaxDecodeLanes == cuda::kMaxLanes);
namespace {

cuda::HostMatrix FromView(const TensorView& t, bool vector = false) {
  cuda::HostMatrix m;
  m.type = static_cast<cuda::HostType>(t.dtype);
  m.rows = vector ? 1 : t.rows();
  m.cols = t.cols();
  m.data = t.data;
  return m;
}

// The cold side of every layer: the cpu-worker, through the segment. Each exchange is timed for
// the cold-prefill cost model (the CPU side's cost per active row-token). Lanes call it from their
// threads; the exchanges take turns, since the segment carries one at a time.
class ExchangeColdFfn : public cuda::ColdFfn {
 public:
  ExchangeColdFfn(shm::ExchangeClient* exchange, BackendStats* stats, absl::Mutex* stats_mu)
      : exchange_(exchange), stats_(stats), stats_mu_(stats_mu) {}

  void set_planner(ColdPrefillPlanner* planner) {
    absl::MutexLock turn(&turn_);
    planner_ = planner;
  }

  // The module's guess at the layer's cold neurons (--cold-guess), for the cpu-worker to load
  // their rows while the GPU computes the attention. A hint: failures are not errors.
  void Ahead(int layer, const cuda::ColdGuess& guess,
             const std::function<bool()>& x_ready) override {
    (void)x_ready;
    if (guess.n <= 0) return;
    absl::MutexLock turn(&turn_);
    exchange_->PostGuess(layer, guess.ids, guess.n, guess.first).IgnoreError();
  }

  cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
    absl::MutexLock turn(&turn_);
    const uint64_t start = shm::MonotonicNanos();
    const int H = exchange_->segment().geometry().hidden;
    const int W = exchange_->segment().geometry().words_per_mask();
    const uint64_t* masks = nullptr;
    if (r.active != nullptr) {
      // The module gives the union over the batch; every token gets it.
      masks_.assign(static_cast<size_t>(r.n) * W, 0);
      for (int i = 0; i < r.n_active; ++i) {
        const int32_t j = r.active[i];
        for (int t = 0; t < r.n; ++t)
          masks_[static_cast<size_t>(t) * W + (j >> 6)] |= 1ull << (j & 63);
      }
      masks = masks_.data();
    }
    absl::StatusOr<uint32_t> seq = exchange_->Post(r.layer, r.x, r.n, masks);
    if (!seq.ok()) return Fail(seq.status());
    std::memset(r.out, 0, sizeof(float) * static_cast<size_t>(r.n) * H);
    shm::ExchangeStats xs;
    const uint64_t t0 = shm::MonotonicNanos();
    absl::Status st = exchange_->AwaitAndAdd(*seq, r.n, r.out, &xs);
    const uint64_t waited = shm::MonotonicNanos() - t0;
    {
      absl::MutexLock lock(stats_mu_);
      stats_->exchange_wait_ns += waited;
      stats_->wait_samples.push_back(waited * 1e-9);
      stats_->exchanges += 1;
      stats_->cold_neurons += xs.cold_neurons;
    }
    if (!st.ok()) return Fail(st);
    if (planner_ != nullptr) {
      planner_->ObserveCpu(r.layer, r.n, static_cast<double>(xs.cold_neurons),
                           (shm::MonotonicNanos() - start) * 1e-9);
    }
    return {};
  }

 private:
  cuda::BackendStatus Fail(const absl::Status& st) {
    cuda::BackendStatus s;
    s.code = static_cast<cuda::Code>(st.code());
    s.message = std::string(st.message());
    return s;
  }
  absl::Mutex turn_;
  shm::ExchangeClient* exchange_ ABSL_GUARDED_BY(turn_);
  BackendStats* stats_;
  absl::Mutex* stats_mu_;
  ColdPrefillPlanner* planner_ ABSL_GUARDED_BY(turn_) = nullptr;
  std::vector<uint64_t> masks_ ABSL_GUARDED_BY(turn_);
};

class CudaBackend : public ComputeBackend {
 public:
  CudaBackend(const Model& model, void* handle, cuda::Backend* backend, PinferCudaDestroyFn destroy,
              shm::ExchangeClient* exchange, int slots, int max_ctx, uint64_t hot_neurons,
              uint64_t hot_bytes, bool predicted, int cold_layers,
              std::unique_ptr<ColdPrefillPlanner> planner)
      : model_(model),
        handle_(handle),
        backend_(backend),
        destroy_(destroy),
        cold_(exchange, &stats_, &stats_mu_),
        free_(slots, true),
        max_ctx_(max_ctx),
        hot_neurons_(hot_neurons),
        hot_bytes_(hot_bytes),
        predicted_(predicted),
        cold_layers_(cold_layers),
        planner_(std::move(planner)) {
    cold_.set_planner(planner_.get());
  }
  ~CudaBackend() override {
    adaptive_.reset();
    threads_.clear();
    for (cuda::Backend* lane : lanes_) destroy_(lane);  // before the backend they share
    destroy_(backend_);                                 // the module stays loaded (CUDA at exit)
  }

  // Extra lanes for concurrent decode steps (the module's NewLane), each with a thread.
  void AddLane(cuda::Backend* lane) {
    lanes_.push_back(lane);
    threads_.push_back(std::make_unique<LaneThread>());
  }

  // Decode steps keep the cache slots filled with the cold neurons the text activates.
  void StartAdaptiveHotSet(AdaptiveHotCache cache, int plan_every, bool background) {
    slots_ = std::make_unique<ModuleCacheSlots>(backend_);
    adaptive_ =
        std::make_unique<AdaptiveHotSet>(std::move(cache), slots_.get(), plan_every, background);
  }

  std::string name() const override { return "cuda"; }

  absl::StatusOr<int> AcquireSlot(int max_ctx) override {
    if (max_ctx > max_ctx_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "context of ", max_ctx, " positions; the gpu-worker's KV caches hold ", max_ctx_));
    }
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i]) {
        free_[i] = false;
        return static_cast<int>(i);
      }
    }
    return absl::ResourceExhaustedError("every KV cache slot is in use");
  }

  void ReleaseSlot(int slot) override { free_[slot] = true; }

  // Every slot holds max_ctx_ positions on the device, so a kept one serves any sequence that
  // fits at all; its first `keep` positions stay as they are.
  absl::Status ReuseSlot(int slot, int max_ctx, int keep) override {
    if (slot < 0 || slot >= static_cast<int>(free_.size()) || free_[slot]) {
      return absl::InternalError(absl::StrCat("slot ", slot, " is not held"));
    }
    if (max_ctx > max_ctx_ || keep < 0 || keep > max_ctx_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "context of ", max_ctx, " positions; the gpu-worker's KV caches hold ", max_ctx_));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(int slot, std::span<const int32_t> tokens, int pos0,
                       float* logits) override {
    return Run(slot, tokens, pos0, logits, nullptr, /*decode=*/false);
  }

  // The module's Forward takes one sequence. With lanes the sequences are dealt round-robin to
  // this thread (the first backend) and the lanes' threads, each running its share one after
  // another, so that up to 1 + lanes sequences are in flight; decode steps never stream.
  absl::Status DecodeBatch(std::span<const DecodeItem> items) override {
    absl::Status st = RunDealt(items.size(), threads_, [&](size_t lane, size_t i) {
      const DecodeItem& it = items[i];
      return Run(lane == 0 ? backend_ : lanes_[lane - 1], it.slot,
                 std::span<const int32_t>(&it.token, 1), it.pos, it.logits, it.greedy,
                 /*decode=*/true);
    });
    absl::MutexLock lock(&stats_mu_);
    stats_.lane_steps += ItemsOffTheFirstLane(items.size(), threads_.size());
    return st;
  }
  bool picks_greedy() const override { return true; }

  uint64_t ffn_bytes() const override { return hot_bytes_; }
  uint64_t ffn_neurons() const override { return hot_neurons_; }
  uint64_t dense_bytes() const override {
    return backend_->WeightBytes() > hot_bytes_ ? backend_->WeightBytes() - hot_bytes_ : 0;
  }
  uint64_t device_bytes() const override {
    uint64_t bytes = backend_->DeviceBytes();
    for (const cuda::Backend* lane : lanes_) bytes += lane->DeviceBytes();
    return bytes;
  }
  BackendStats TakeStats() override {
    absl::MutexLock lock(&stats_mu_);
    return std::exchange(stats_, BackendStats{});
  }

 private:
  absl::Status Run(int slot, std::span<const int32_t> tokens, int pos0, float* logits,
                   GreedyPick* greedy, bool decode) {
    return Run(backend_, slot, tokens, pos0, logits, greedy, decode);
  }
  // b: the first backend or a lane (decode steps only: prompts, the adaptive hot set and the
  // prefill planner's decisions stay on the first backend, one call at a time).
  absl::Status Run(cuda::Backend* b, int slot, std::span<const int32_t> tokens, int pos0,
                   float* logits, GreedyPick* greedy, bool decode) {
    cuda::ForwardArgs a;
    a.seq = slot;
    a.tokens = tokens.data();
    a.n = static_cast<int>(tokens.size());
    a.pos0 = pos0;
    // Prompt batches take the union of their tokens' predicted neurons (a superset: for ReLU
    // every extra neuron is computed exactly); a decode step is exactly its token's prediction.
    a.mode = predicted_ ? cuda::FfnMode::kPredicted : cuda::FfnMode::kExact;
    a.cold = &cold_;
    a.logits_mode = logits != nullptr ? cuda::LogitsMode::kLast : cuda::LogitsMode::kNone;
    a.logits = logits;
    cuda::GreedyResult pick;
    if (greedy != nullptr) {
      a.logits_mode = cuda::LogitsMode::kGreedy;
      a.greedy = &pick;
    }
    const bool adapt = decode && adaptive_ != nullptr && a.n == 1;
    if (adapt) a.active_out = &active_;
    // Prompt batches: who takes each layer's cold rows.
    ColdPrefillPlanner::Decision decision;
    const bool choose = !decode && planner_ != nullptr && a.n > kMaxMatvecTokens;
    if (choose) {
      decision = planner_->Decide(a.n);
      cold_paths_.assign(decision.stream.size(), cuda::ColdPath::kCallback);
      for (size_t l = 0; l < decision.stream.size(); ++l) {
        if (decision.stream[l]) cold_paths_[l] = cuda::ColdPath::kStream;
      }
      a.cold_paths = &cold_paths_;
    }
    absl::Status st = ToStatus(b->Forward(a));
    if (greedy != nullptr && st.ok()) *greedy = {pick.token, pick.logprob};
    const cuda::ForwardStats& fs = b->last_stats();
    absl::MutexLock lock(&stats_mu_);
    stats_.guess_neurons += static_cast<uint64_t>(fs.guess_rows);
    stats_.guess_actual += static_cast<uint64_t>(fs.guess_actual);
    stats_.guess_hits += static_cast<uint64_t>(fs.guess_hits);
    stats_.guess_first += static_cast<uint64_t>(fs.guess_first);
    if (adapt && st.ok()) {
      const uint64_t before = adaptive_->swaps_committed();
      absl::Status ast = adaptive_->AfterStep(active_);
      stats_.cache_swaps += adaptive_->swaps_committed() - before;
      if (!ast.ok()) {
        // Each call left the module consistent (every neuron computed by one side), so decoding
        // goes on with the slots as they are.
        Log("adaptive hot set stopped after %llu steps: %s",
            static_cast<unsigned long long>(adaptive_->steps()), ast.ToString().c_str());
        adaptive_.reset();
      }
    }
    if (!decode) {
      // What the module did (it never streams a batch on the matrix-vector path).
      stats_.prefill_cold_layers_stream += static_cast<uint64_t>(fs.streamed_layers);
      stats_.prefill_cold_layers_cpu +=
          static_cast<uint64_t>(std::max(0, cold_layers_ - fs.streamed_layers));
      stats_.streamed_bytes += fs.streamed_bytes;
      if (choose && st.ok()) LogDecision(a.n, decision, fs);
      if (planner_ != nullptr && !cpu_fit_logged_ && planner_->mode() == ColdPrefill::kAuto &&
          planner_->cpu_calibrated()) {
        cpu_fit_logged_ = true;
        LogCpuFit();
      }
    }
    stats_.forward_ns += static_cast<uint64_t>(fs.total * 1e9);
    stats_.hot_ffn_ns += static_cast<uint64_t>(fs.gpu_hot_ffn * 1e9);
    // The GPU's share of the cold neurons (--cold-gpu-share) is computed here too.
    stats_.hot_neurons += static_cast<uint64_t>(fs.hot_rows_computed + fs.cold_rows_gpu);
    stats_.cold_gpu_neurons += static_cast<uint64_t>(fs.cold_rows_gpu);
    const uint64_t hot_per_layer = hot_neurons_ / std::max(1, model_.config.n_layers);
    stats_.hot_candidates += hot_per_layer * model_.config.n_layers * tokens.size();
    stats_.cold_candidates +=
        (static_cast<uint64_t>(model_.config.ffn_size) * model_.config.n_layers - hot_neurons_) *
        tokens.size();
    return st;
  }

  // The first prompt batches' decisions, then (a few) changes, so that the log shows what the
  // cost model does without a line per batch.
  void LogDecision(int n, const ColdPrefillPlanner::Decision& d, const cuda::ForwardStats& fs) {
    const bool changed = fs.streamed_layers != last_logged_streamed_;
    if (decisions_logged_ >= 4 && !(changed && decisions_logged_ < 24)) return;
    decisions_logged_ += 1;
    last_logged_streamed_ = fs.streamed_layers;
    Log("cold prefill: batch of %d tokens: %d of %d layers' cold rows streamed to the GPU "
        "(%.2f MiB), %d to the cpu-worker (%s)",
        n, fs.streamed_layers, cold_layers_, fs.streamed_bytes / 1048576.0,
        std::max(0, cold_layers_ - fs.streamed_layers), d.reason.c_str());
  }

  // Once, when the CPU side's costs are first fitted: the fit and where streaming starts to win
  // for the layer with the most cold rows.
  void LogCpuFit() {
    const std::vector<ColdLayerShape>& layers = planner_->layers();
    int big = -1;
    for (size_t l = 0; l < layers.size(); ++l) {
      if (planner_->RowsPerToken(static_cast<int>(l)) < 0 || layers[l].cold_rows == 0) continue;
      if (big < 0 || layers[l].cold_rows > layers[big].cold_rows) big = static_cast<int>(l);
    }
    const ColdCostParams& p = planner_->params();
    std::string crossover;
    if (big >= 0 && planner_->stream_calibrated()) {
      const double rows = planner_->RowsPerToken(big);
      const int n = StreamCrossover(p, layers[big].cold_rows, layers[big].bytes,
                                    model_.config.hidden_size, rows, 1 << 16);
      crossover =
          absl::StrFormat("; layer %d (%lld cold rows, %.1f active per token) streams from %s", big,
                          static_cast<long long>(layers[big].cold_rows), rows,
                          n > kMaxMatvecTokens ? absl::StrCat(n, " tokens")
                          : n > 0              ? absl::StrCat(kMaxMatvecTokens + 1, " tokens")
                                               : std::string("no batch size"));
    }
    Log("cold prefill: CPU side fitted from %d timed exchanges: %.3f ms + %.4f us per active "
        "row-token%s",
        planner_->cpu_samples(), p.cpu_fixed_s * 1e3, p.cpu_s_per_row_token * 1e6,
        crossover.c_str());
  }

  const Model& model_;
  void* handle_;
  cuda::Backend* backend_;
  PinferCudaDestroyFn destroy_;
  std::vector<cuda::Backend*> lanes_;                 // (NewLane) owned, destroyed first
  std::vector<std::unique_ptr<LaneThread>> threads_;  // one per lane
  // Counters from every lane's thread and the exchanges (TakeStats moves them out).
  absl::Mutex stats_mu_;
  BackendStats stats_ ABSL_GUARDED_BY(stats_mu_);
  ExchangeColdFfn cold_;
  std::vector<bool> free_;
  int max_ctx_;
  uint64_t hot_neurons_, hot_bytes_;
  bool predicted_;
  int cold_layers_;                              // layers with at least one cold neuron
  std::unique_ptr<ColdPrefillPlanner> planner_;  // null: every cold row to the cpu-worker
  std::vector<cuda::ColdPath> cold_paths_;
  std::unique_ptr<ModuleCacheSlots> slots_;
  std::unique_ptr<AdaptiveHotSet> adaptive_;  // null: the static placement only
  std::vector<std::vector<int32_t>> active_;  // the last decode step's active neurons per layer
  int decisions_logged_ = 0, last_logged_streamed_ = -1;
  bool cpu_fit_logged_ = false;
};

}  // namespace

namespace {

struct Module {
  void* handle = nullptr;
  PinferCudaCreateFn create = nullptr;
  PinferCudaDestroyFn destroy = nullptr;
};

absl::StatusOr<Module> OpenModule(const std::string& module_path) {
  Module m;
  m.handle = ::dlopen(module_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (m.handle == nullptr) return absl::UnavailableError(absl::StrCat("dlopen: ", ::dlerror()));
  m.create = reinterpret_cast<PinferCudaCreateFn>(::dlsym(m.handle, PINFER_CUDA_CREATE_SYMBOL));
  m.destroy = reinterpret_cast<PinferCudaDestroyFn>(::dlsym(m.handle, PINFER_CUDA_DESTROY_SYMBOL));
  if (m.create == nullptr || m.destroy == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(module_path, " lacks the pinfer CUDA entry points"));
  }
  return m;
}

// Everything but the FFN rows: those depend on the placement.
// The module computes the types of cuda::HostType, whose values equal DType's for those types.
// Any other type is refused by name rather than handed to the module as a value it does not know.
absl::Status CheckModuleTypes(const Model& model) {
  auto check = [](const TensorView& t, const std::string& name) -> absl::Status {
    if (t.data == nullptr) return absl::OkStatus();
    switch (t.dtype) {
      case DType::kF32:
      case DType::kF16:
      case DType::kBF16:
      case DType::kQ8_0:
      case DType::kQ4_0:
      case DType::kQ4_K:
      case DType::kQ5_K:
      case DType::kQ6_K:
        return absl::OkStatus();
      default:
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor '", name, "' is ", DTypeName(t.dtype),
            ", which the CUDA module does not compute (it computes F32, F16, BF16, Q8_0, Q4_0, "
            "Q4_K, Q5_K and Q6_K); run the gpu-worker with --backend cpu or convert the model to "
            "one of those"));
    }
  };
  RETURN_IF_ERROR(check(model.tok_embeddings, "token_embd"));
  RETURN_IF_ERROR(check(model.output_norm, "output_norm"));
  RETURN_IF_ERROR(check(model.output, "output"));
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const LayerWeights& L = model.layers[l];
    const std::pair<const TensorView*, const char*> tensors[] = {
        {&L.attn_norm, "attn_norm"}, {&L.wq, "attn_q"},      {&L.wk, "attn_k"},
        {&L.wv, "attn_v"},           {&L.wo, "attn_output"}, {&L.ffn_norm, "ffn_norm"},
        {&L.gate, "ffn_gate"},       {&L.up, "ffn_up"},      {&L.down, "ffn_down"},
        {&L.down_t, "ffn_down_t"}};
    for (const auto& [t, name] : tensors) {
      RETURN_IF_ERROR(check(*t, absl::StrCat("blk.", l, ".", name)));
    }
    if (model.config.qkv_bias) {  // Qwen2: added after the stacked q/k/v projection
      const std::pair<const TensorView*, const char*> biases[] = {
          {&L.bq, "attn_q.bias"}, {&L.bk, "attn_k.bias"}, {&L.bv, "attn_v.bias"}};
      for (const auto& [t, name] : biases) {
        if (t->data == nullptr) {
          return absl::FailedPreconditionError(absl::StrCat(
              "the model has q/k/v biases but tensor 'blk.", l, ".", name, "' is missing"));
        }
        RETURN_IF_ERROR(check(*t, absl::StrCat("blk.", l, ".", name)));
      }
    }
  }
  return absl::OkStatus();
}

cuda::ModelUpload BaseUpload(const Model& model, int max_batch, const CudaBackendOptions& o) {
  const ModelConfig& c = model.config;
  cuda::ModelUpload u;
  u.dims = cuda::DimsFromConfig(c);
  u.tok_embeddings = FromView(model.tok_embeddings);
  u.output_norm = FromView(model.output_norm, true);
  u.output = FromView(model.output);
  u.max_ctx = o.max_ctx;
  u.max_seqs = o.slots;
  u.max_batch = max_batch;
  u.device = o.device;
  // The same stream, cold-share and guess settings for the measuring instance and the real one,
  // so that their buffers (the slots; the share's and the guess's lists) are part of the measured
  // fixed footprint. The GPU's share of the cold neurons needs the predictors' lists (exact mode
  // has none) and a pinned copy of the cold rows in one type (the streamed prompt rows' copy).
  u.stream_cold = o.cold_prefill != ColdPrefill::kCpu;
  u.stream_chunk_rows = o.stream_chunk_rows;
  u.stream_slots = o.stream_slots;
  if (o.predictors != nullptr && (o.cold_gpu_share > 0 || o.cold_gpu_share_auto) &&
      ColdStreamingProblem(model).empty()) {
    u.cold_gpu_share = o.cold_gpu_share;
    u.cold_gpu_share_adaptive = o.cold_gpu_share_auto;
  }
  u.cold_guess = o.cold_guess && o.predictors != nullptr;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model.layers[l];
    cuda::LayerUpload lu;
    lu.attn_norm = FromView(L.attn_norm, true);
    lu.ffn_norm = FromView(L.ffn_norm, true);
    lu.wq = FromView(L.wq);
    lu.wk = FromView(L.wk);
    lu.wv = FromView(L.wv);
    lu.wo = FromView(L.wo);
    if (c.qkv_bias) {
      lu.bq = FromView(L.bq, true);
      lu.bk = FromView(L.bk, true);
      lu.bv = FromView(L.bv, true);
    }
    lu.ffn = cuda::FfnPlacement::kHot;
    lu.gate = FromView(L.gate);
    lu.up = FromView(L.up);
    if (o.predictors != nullptr) {
      const LayerPredictor& p = o.predictors->layers[l];
      lu.pred_fc1 = FromView(p.fc1);
      lu.pred_fc2 = FromView(p.fc2);
      lu.pred_threshold = p.threshold;
      lu.pred_scores_times_rms = ScoresNeedResidual(p);
    }
    u.layers.push_back(std::move(lu));
  }
  return u;
}

// The module gets the transposed down rows from TransposeDownProjections: a PWRI file's own
// ffn_down_t rows in the file's type, else down's columns (F32 for quantized down).
DType DownTransposedType(const Model& model, int layer) {
  return TransposedDownType(model.layers[layer]);
}

// Times the streamed cold rows of the layer with the most cold rows at a few batch sizes and of
// the next largest at the largest size, and gives the planner the stream's rates.
void CalibrateStream(cuda::Backend* b, int max_batch, ColdPrefillPlanner* planner) {
  const std::vector<ColdLayerShape>& layers = planner->layers();
  std::vector<int> order;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].cold_rows > 0) order.push_back(static_cast<int>(l));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return layers[x].cold_rows > layers[y].cold_rows; });
  std::vector<int> sizes;
  for (int n : {16, 64, 256, 512}) {
    if (n <= max_batch) sizes.push_back(n);
  }
  if (sizes.empty()) sizes.push_back(max_batch);
  std::vector<std::pair<int, int>> runs;  // (layer, tokens)
  for (int n : sizes) runs.push_back({order[0], n});
  if (order.size() > 1) runs.push_back({order[1], sizes.back()});
  std::vector<StreamSample> samples;
  for (auto [layer, n] : runs) {
    cuda::StreamCalibration c;
    absl::Status st = ToStatus(b->CalibrateStreaming(layer, n, &c));
    if (!st.ok()) {
      Log("cold prefill: stream calibration of layer %d at %d tokens failed: %s", layer, n,
          st.ToString().c_str());
      continue;
    }
    Log("cold prefill: stream calibration, layer %d, %d tokens: %lld cold rows, %.2f MiB; copy "
        "%.3f ms (%.2f GB/s), products %.3f ms (%.2f TFLOP/s), overlapped %.3f ms",
        layer, n, static_cast<long long>(c.rows), c.bytes / 1048576.0, c.copy_s * 1e3,
        c.bytes / c.copy_s * 1e-9, c.compute_s * 1e3, c.flops / c.compute_s * 1e-12,
        c.overlapped_s * 1e3);
    samples.push_back({c.n, c.bytes, c.copy_s, c.flops, c.compute_s, c.overlapped_s});
  }
  absl::Status st = planner->SetStreamCalibration(samples);
  if (!st.ok()) {
    Log("cold prefill: no stream calibration (%s)%s", st.ToString().c_str(),
        planner->mode() == ColdPrefill::kAuto ? ": every cold row goes to the cpu-worker" : "");
    return;
  }
  const ColdCostParams& p = planner->params();
  Log("cold prefill: stream model: %.2f GB/s host->GPU, %.2f TFLOP/s products, %.3f ms fixed "
      "per layer; the CPU side's cost is measured on the first prompt batches (--cold-prefill "
      "%s)",
      p.h2d_bytes_per_s * 1e-9, p.gpu_flops_per_s * 1e-12, p.stream_fixed_s * 1e3,
      ColdPrefillName(planner->mode()));
}

}  // namespace

absl::Status CudaModuleComputes(const Model& model) { return CheckModuleTypes(model); }

std::string ColdStreamingProblem(const Model& model) {
  for (int l = 0; l < model.config.n_layers; ++l) {
    const LayerWeights& L = model.layers[l];
    if (L.gate.dtype != L.up.dtype) {
      return absl::StrCat("layer ", l, " has gate ", DTypeName(L.gate.dtype), " and up ",
                          DTypeName(L.up.dtype), " rows; streaming needs the two of one type");
    }
    const DType dt = DownTransposedType(model, l);
    if (IsQuantized(L.down.dtype) && L.down_t.data == nullptr && dt != L.down.dtype) {
      return absl::StrCat("layer ", l, "'s ", DTypeName(L.down.dtype),
                          " down projection is stored untransposed, so its cold rows would be ",
                          DTypeName(dt),
                          " copies; a prepared model (pinfer prepare) stores "
                          "ffn_down_t");
    }
  }
  return "";
}

absl::StatusOr<CudaFootprint> MeasureCudaFootprint(const Model& model, int max_batch,
                                                   const std::string& module_path,
                                                   const CudaBackendOptions& o) {
  RETURN_IF_ERROR(CheckModuleTypes(model));
  ASSIGN_OR_RETURN(Module m, OpenModule(module_path));
  const ModelConfig& c = model.config;
  cuda::ModelUpload u = BaseUpload(model, max_batch, o);
  // Sizes only: the real backend uploads the weights once, after the placement.
  u.allocate_only = true;
  CudaFootprint f;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model.layers[l];
    const DType dt = DownTransposedType(model, l);
    // No hot ids: the module checks the shape and copies no row, so down's bytes stand in.
    u.layers[l].down_t.type = static_cast<cuda::HostType>(dt);
    u.layers[l].down_t.rows = c.ffn_size;
    u.layers[l].down_t.cols = c.hidden_size;
    u.layers[l].down_t.data = L.down_t.data != nullptr ? L.down_t.data : L.down.data;
    f.neuron_bytes.push_back(L.gate.row_bytes() + L.up.row_bytes() + RowBytes(dt, c.hidden_size));
  }
  cuda::Backend* b = nullptr;
  char err[1024] = {0};
  const int rc = m.create(&u, &b, err, sizeof(err));
  if (rc != 0) return absl::Status(static_cast<absl::StatusCode>(rc), err);
  f.fixed_bytes = b->DeviceBytes();
  // The lanes NewCudaBackend will add (their scratch; they share the rest).
  for (int i = 1; i < std::min(o.decode_lanes, o.slots) && o.adaptive_cache_rows == 0; ++i) {
    cuda::Backend* lane = nullptr;
    if (!b->NewLane(&lane).ok()) break;
    f.fixed_bytes += lane->DeviceBytes();
    m.destroy(lane);
  }
  m.destroy(b);
  return f;
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(const Model& model,
                                                               const Placement& placement,
                                                               shm::ExchangeClient* exchange,
                                                               const std::string& module_path,
                                                               const CudaBackendOptions& o) {
  RETURN_IF_ERROR(CheckModuleTypes(model));
  const ModelConfig& c = model.config;
  int cache_rows = o.adaptive_cache_rows;
  if (cache_rows > 0) {
    if (o.predictors == nullptr) {
      return absl::FailedPreconditionError(
          "the adaptive hot set needs --sparse: in exact mode the cpu-worker decides its neurons "
          "with its own gate rows, so it cannot hand any to the GPU's cache");
    }
    if (std::string why = ColdStreamingProblem(model); !why.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the adaptive hot set copies gate, up and down rows of one type: ", why));
    }
    for (int l = 0; l < c.n_layers; ++l) {
      cache_rows =
          std::min<int>(cache_rows, c.ffn_size - static_cast<int>(placement.hot[l].size()));
    }
    if (cache_rows < o.adaptive_cache_rows) {
      Log("adaptive hot set: %d cache rows per layer (the least any layer has cold neurons) "
          "instead of %d",
          cache_rows, o.adaptive_cache_rows);
    }
  }
  ASSIGN_OR_RETURN(Module m, OpenModule(module_path));
  // The module takes hot rows of gate, up and of the transposed down projection.
  auto down_t = TransposeDownProjections(model);
  if (!down_t.ok()) return down_t.status();
  const int max_batch = exchange->segment().geometry().max_tokens;
  cuda::ModelUpload u = BaseUpload(model, max_batch, o);
  uint64_t hot_neurons = 0, hot_bytes = 0;
  std::vector<ColdLayerShape> shapes(c.n_layers);
  int cold_layers = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model.layers[l];
    cuda::LayerUpload& lu = u.layers[l];
    lu.down_t = FromView(down_t->layers[l]);
    lu.hot_ids = placement.hot[l];
    lu.cache_rows = cache_rows;
    hot_neurons += lu.hot_ids.size();
    const uint64_t row = L.gate.row_bytes() + L.up.row_bytes() + down_t->layers[l].row_bytes();
    hot_bytes += lu.hot_ids.size() * row;
    shapes[l].cold_rows = c.ffn_size - static_cast<int64_t>(lu.hot_ids.size());
    shapes[l].bytes = static_cast<double>(shapes[l].cold_rows) * row;
    cold_layers += shapes[l].cold_rows > 0 ? 1 : 0;
  }
  if (o.predictors != nullptr && (o.cold_gpu_share > 0 || o.cold_gpu_share_auto) &&
      !ColdStreamingProblem(model).empty()) {
    Log("the GPU takes no share of the cold neurons: %s", ColdStreamingProblem(model).c_str());
  }
  cuda::Backend* b = nullptr;
  char err[1024] = {0};
  const int rc = m.create(&u, &b, err, sizeof(err));
  if (rc != 0) return absl::Status(static_cast<absl::StatusCode>(rc), err);
  b->set_collect_gpu_times(o.gpu_timing);
  if (u.cold_gpu_share_adaptive || u.cold_gpu_share > 0) {
    Log("decode: the GPU computes %s of each layer's active cold neurons from pinned host rows",
        u.cold_gpu_share_adaptive ? "a share balanced step by step"
                                  : absl::StrFormat("%.0f%%", 100 * u.cold_gpu_share).c_str());
  }
  Log("CUDA backend on %s: %.1f MiB on the device", b->DeviceName().c_str(),
      b->DeviceBytes() / 1048576.0);
  Log("CUDA backend built: %s", b->CreateTimes().c_str());
  std::unique_ptr<ColdPrefillPlanner> planner;
  if (o.cold_prefill != ColdPrefill::kCpu) {
    if (max_batch <= kMaxMatvecTokens) {
      Log("cold prefill: batches of at most %d tokens never stream (--max-batch-tokens); every "
          "cold row goes to the cpu-worker",
          max_batch);
    } else if (cold_layers == 0) {
      Log("cold prefill: every FFN row is on the GPU; nothing to stream");
    } else {
      planner = std::make_unique<ColdPrefillPlanner>(o.cold_prefill, c.hidden_size, shapes);
      double pinned = 0;
      for (const ColdLayerShape& s : shapes) pinned += s.bytes;
      Log("cold prefill: --cold-prefill %s, %.1f MiB of cold rows pinned in host memory for "
          "streaming, %d slots of %d rows on the GPU",
          ColdPrefillName(o.cold_prefill), pinned / 1048576.0, o.stream_slots,
          std::min(o.stream_chunk_rows, c.ffn_size));
      CalibrateStream(b, max_batch, planner.get());
    }
  }
  auto backend = std::make_unique<CudaBackend>(
      model, m.handle, b, m.destroy, exchange, o.slots, o.max_ctx, hot_neurons, hot_bytes,
      o.predictors != nullptr, cold_layers, std::move(planner));
  // Lanes for concurrent decode steps; the adaptive hot set's slots change under every lane's
  // steps, so it keeps one (the module refuses lanes then).
  int lanes = 1;
  for (; lanes < std::min(o.decode_lanes, o.slots) && cache_rows == 0; ++lanes) {
    cuda::Backend* lane = nullptr;
    absl::Status st = ToStatus(b->NewLane(&lane));
    if (!st.ok()) {
      Log("decode lanes: %d instead of %d (%s)", lanes, o.decode_lanes, st.ToString().c_str());
      break;
    }
    lane->set_collect_gpu_times(o.gpu_timing);
    backend->AddLane(lane);
  }
  if (cache_rows > 0 && o.decode_lanes > 1) {
    Log("decode lanes: 1 (the adaptive hot set's slots change under every lane's steps)");
  }
  if (lanes > 1) {
    Log("decode lanes: %d sequences' steps in flight at once, %.1f MiB on the device in all", lanes,
        backend->device_bytes() / 1048576.0);
  }
  if (cache_rows > 0) {
    HotCacheOptions ho = o.cache_options;
    ho.slots = cache_rows;
    ASSIGN_OR_RETURN(AdaptiveHotCache cache,
                     AdaptiveHotCache::Create(c.ffn_size, placement.hot, ho));
    backend->StartAdaptiveHotSet(std::move(cache), o.cache_plan_every, o.cache_background);
    Log("adaptive hot set: %d cache rows per layer (%.1f MiB), counts decaying by %.3g per token, "
        "swaps planned every %d decode steps, counted %s",
        cache_rows, AdaptiveCacheBytes(model, cache_rows) / 1048576.0, ho.decay, o.cache_plan_every,
        o.cache_background ? "on a thread of their own" : "between steps");
  }
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

uint64_t AdaptiveCacheBytes(const Model& model, int rows) {
  const ModelConfig& c = model.config;
  uint64_t bytes = 0;
  if (rows <= 0) return 0;  // no cache, no maps
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model.layers[l];
    const uint64_t row = L.gate.row_bytes() + L.up.row_bytes() +
                         RowBytes(DownTransposedType(model, l), c.hidden_size);
    // The slots' rows, and the maps: hot rows + slots and cold neurons, an int32 each.
    bytes += rows * row + 4 * (static_cast<uint64_t>(c.ffn_size) + rows);
  }
  return bytes;
}

}  // namespace pinfer::gpuworker
