// The CUDA Backend (backend.h): uploads a placement's weights and runs the forward pass on one
// GPU, calling the cold side once per layer while the hot rows of that layer are computed.
//
// One stream carries all GPU work in order; the host only waits where the pinfer split needs it:
// for the FFN input of a layer to reach host memory (an event), and at the end of the step. So
// per layer the GPU runs attention, publishes the FFN input, and goes straight on to the hot
// rows, while the host hands the same input to the cold side; when the cold side returns, its
// contribution is copied up and added together with the hot one.
#include "gpu-worker/cuda/backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu-worker/cuda/cold_stream.h"
#include "gpu-worker/cuda/gemm.h"
#include "gpu-worker/cuda/kernels.h"
#include "shared/util/half.h"

namespace pinfer {
namespace cuda {
namespace {

// Batches up to this many tokens use the matrix-vector kernels (one pass over the weights);
// larger ones go through cuBLAS.
constexpr int kSmallBatch = 8;

BackendStatus Error(Code code, std::string message) {
  return BackendStatus{code, std::move(message)};
}
BackendStatus Ok() { return BackendStatus{}; }

BackendStatus CudaError(cudaError_t e, const char* what, int line) {
  return Error(Code::kInternal, std::string(what) + " (backend.cc:" + std::to_string(line) +
                                    "): " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

#define CUDA_RETURN_IF_ERROR(expr)                                \
  do {                                                            \
    cudaError_t _e = (expr);                                      \
    if (_e != cudaSuccess) return CudaError(_e, #expr, __LINE__); \
  } while (0)

#define BACKEND_RETURN_IF_ERROR(expr) \
  do {                                \
    BackendStatus _s = (expr);        \
    if (!_s.ok()) return _s;          \
  } while (0)

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

size_t HostRowBytes(HostType t, int64_t cols) { return WRowBytes(static_cast<WType>(t), cols); }

// fp32 copy of a small host vector (norm weights).
bool HostToFloat(const HostMatrix& m, std::vector<float>* out) {
  const int64_t n = m.rows * m.cols;
  out->resize(n);
  const auto* u16 = static_cast<const uint16_t*>(m.data);
  switch (m.type) {
    case HostType::kF32:
      std::memcpy(out->data(), m.data, n * 4);
      return true;
    case HostType::kF16:
      for (int64_t i = 0; i < n; ++i) (*out)[i] = pinfer::Fp16ToFp32(u16[i]);
      return true;
    case HostType::kBF16:
      for (int64_t i = 0; i < n; ++i) (*out)[i] = pinfer::Bf16ToFp32(u16[i]);
      return true;
    default:
      return false;
  }
}

struct DeviceLayer {
  FfnPlacement ffn = FfnPlacement::kNone;
  float* attn_norm = nullptr;
  float* ffn_norm = nullptr;
  DeviceMatrix wqkv, wo;                // wqkv: rows of wq, wk, wv stacked (one projection)
  DeviceMatrix gate_up;                 // kDense: rows of gate then up stacked
  DeviceMatrix gate, up, down, down_t;  // kHot: compact hot rows (gate, up, down_t)
  int n_hot = 0;
  int32_t* hot_ids = nullptr;  // device [n_hot] global ids
  std::vector<int32_t> hot_ids_host;
  std::vector<int32_t> cold_ids_host;  // ascending global ids not in hot_ids
  int32_t* cold_ids = nullptr;         // device [n_cold]
  DeviceMatrix fc1, fc2;
  float pred_cut = 0;     // predicted active when score > pred_cut (just below pred_threshold)
  bool pred_rms = false;  // LayerUpload::pred_scores_times_rms
  int kv_index = -1;      // KV cache layer slot
  ColdRows cold_rows;     // stream_cold: pinned host copy of the cold rows, in cold_ids_host order
  int n_cache = 0;        // adaptive cache slots after the hot rows (LayerUpload::cache_rows)
  DeviceMatrix gate_c, up_c, down_t_c;  // the hot rows and the slots, for small steps
  // kPredicted steps with the cache (SetCacheSlots): the compaction maps. hot_map_c: [n_hot +
  // n_cache] global ids of the hot rows, then each slot's neuron (-1: serves nobody); cold_map_c:
  // [n_cold] cold ids, -1 where a slot serves the neuron. Host mirrors of both, and each slot's
  // last loaded neuron.
  int32_t* hot_map_c = nullptr;
  int32_t* cold_map_c = nullptr;
  std::vector<int32_t> slot_neuron, cold_map_host, slot_loaded;
};

class CudaBackend : public Backend {
 public:
  ~CudaBackend() override { Release(); }

  BackendStatus Create(const ModelUpload& m);
  BackendStatus Forward(const ForwardArgs& args) override;
  BackendStatus RegisterHostMemory(void* ptr, size_t bytes) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault));
    return Ok();
  }
  BackendStatus UnregisterHostMemory(void* ptr) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaHostUnregister(ptr));
    return Ok();
  }
  size_t DeviceBytes() const override { return device_bytes_; }
  size_t WeightBytes() const override { return weight_bytes_; }
  std::string DeviceName() const override { return device_name_; }
  const ForwardStats& last_stats() const override { return stats_; }
  void set_collect_gpu_times(bool on) override { collect_gpu_times_ = on; }
  void set_cold_guess_shift(double shift) override {
    if (guess_shift_ != nullptr) {
      std::fill(guess_shift_, guess_shift_ + dims_.n_layers, static_cast<float>(shift));
    }
  }
  double cold_guess_shift(int layer) const override {
    return guess_shift_ != nullptr && layer >= 0 && layer < dims_.n_layers ? guess_shift_[layer]
                                                                           : 0;
  }
  void set_use_graphs(bool on) override { use_graphs_ = on; }
  BackendStatus NewLane(Backend** out) override;
  BackendStatus CalibrateStreaming(int layer, int n, StreamCalibration* out) override;
  BackendStatus LoadCacheRows(int layer, const std::vector<int32_t>& slots,
                              const std::vector<int32_t>& neurons) override;
  BackendStatus CacheRowsLanded(bool wait, bool* landed) override;
  BackendStatus SetCacheSlots(int layer, const std::vector<int32_t>& slots,
                              const std::vector<int32_t>& neurons) override;

 private:
  template <typename T>
  BackendStatus Alloc(size_t count, T** out, bool weight = false) {
    const size_t bytes = count * sizeof(T) + 0;
    void* p = nullptr;
    if (bytes > 0) {
      cudaError_t e = cudaMalloc(&p, bytes);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return Error(Code::kResourceExhausted, "cudaMalloc of " + std::to_string(bytes) +
                                                   " bytes failed: " + cudaGetErrorString(e) +
                                                   " (" + std::to_string(device_bytes_) +
                                                   " bytes already allocated)");
      }
      allocations_.push_back(p);
      device_bytes_ += bytes;
      if (weight) weight_bytes_ += bytes;
    }
    *out = static_cast<T*>(p);
    return Ok();
  }
  template <typename T>
  BackendStatus AllocHost(size_t count, T** out) {
    void* p = nullptr;
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, count * sizeof(T) + 64));
    host_allocations_.push_back(p);
    *out = static_cast<T*>(p);
    return Ok();
  }

  // Uploads a whole matrix, or only rows `ids` of it (in that order).
  BackendStatus UploadMatrix(const HostMatrix& h, const std::vector<int32_t>* ids, const char* name,
                             DeviceMatrix* out, int64_t extra_rows = 0);
  BackendStatus UploadVector(const HostMatrix& h, int64_t expect, const char* name, float** out);
  // Uploads matrices of one type and width as one, rows stacked in order.
  // Block formats go to the split layout (kernels.h) unless PINFER_CUDA_REPACK=0.
  BackendStatus MaybeSplit(DeviceMatrix* d, int64_t extra_rows = 0);
  BackendStatus UploadStacked(const std::vector<const HostMatrix*>& parts, const char* name,
                              DeviceMatrix* out);
  // y: [n, ldy] = x: [n, w.cols] @ w^T
  BackendStatus Proj(const DeviceMatrix& w, const float* x, int n, float* y, int ldy,
                     const void* x_qx = nullptr);
  // xb_ / up_ quantized by the kernel that writes them (see QxBytes), for small steps of a
  // model with block-format weights; null otherwise (the products then quantize for themselves).
  void* XbQx(int n) const { return qx_on_ && n <= kSmallBatch ? xb_qx_ : nullptr; }
  void* UpQx(int n) const { return qx_on_ && n <= kSmallBatch ? up_qx_ : nullptr; }
  void* AttQx(int n) const { return n <= kSmallBatch ? att_qx_ : nullptr; }
  static FfnMode EffectiveMode(const ForwardArgs& a) {
    return a.mode == FfnMode::kDense ? FfnMode::kExact : a.mode;
  }
  cudaError_t RecordEvent(cudaEvent_t e, cudaStream_t s = nullptr);  // null: stream_
  // Host-side checks and staging of one layer (never captured in a graph).
  BackendStatus PrepareLayer(int l, const ForwardArgs& a);
  // The layer's GPU work up to the hot FFN output (capturable: no host waits, fixed sizes).
  BackendStatus EnqueueLayer(int l, const ForwardArgs& a, const float* pend1, const float* pend2,
                             bool cold, float* exchange_x);
  // EnqueueLayer for a dense layer whose norms fold into their products (FusesNorms).
  BackendStatus EnqueueDenseLayerFused(int l, const float* pend1, float* k_seq, float* v_seq);
  // A single-token step with no cold side as one CUDA graph: embedding, layers, and (head) the
  // output norm and projection into logits_.
  bool UsesStepGraph(const ForwardArgs& a, int layer_end) const;
  BackendStatus RunStepGraph(const ForwardArgs& a, int layer_end, bool head);
  BackendStatus EnqueueStep(const ForwardArgs& a, int layer_end, bool head);
  // Waits for the FFN input, runs the cold callback, and then either queues its contribution
  // (pending2_) or, when the following work is already queued behind cold_ready_[l], signals it.
  BackendStatus FinishCold(int l, const ForwardArgs& a, float* exchange_x, float* exchange_out,
                           int32_t* exchange_active, bool signal);
  // Queues layer l's GPU work (one graph replay for decode steps). With wait_cold the layer
  // before it had a cold side whose contribution is not written yet: the work first waits on the
  // GPU for the host's signal (cold_ready_[l - 1]) and takes the contribution from exchange_out.
  BackendStatus LaunchLayer(int l, const ForwardArgs& a, float* exchange_x,
                            const float* exchange_out, bool wait_cold);
  BackendStatus RunLayer(int l, const ForwardArgs& a, float* exchange_x, float* exchange_out,
                         int32_t* exchange_active);
  // A decode step with each layer queued before the previous one's cold callback (prelaunch_).
  BackendStatus RunLayersQueued(const ForwardArgs& a, int layer_end, float* exchange_x,
                                float* exchange_out, int32_t* exchange_active);
  // Whether a single token's cold callback may leave its partial sums to the GPU
  // (ColdRequest::max_parts): with cold_parts_ on, into the internal exchange buffer, which has
  // room for kMaxColdParts of them and which kernels can read.
  bool ColdParts(const float* exchange_out, int n) {
    return cold_parts_ && n == 1 && exchange_out == out_host_ && DeviceReadable(exchange_out);
  }
  // Where the next kernel reads a cold contribution written to exchange_out: in place (zero-copy)
  // or from cold_in_ after a copy, or after SumParts added up the callback's parts.
  const float* ColdInput(const float* exchange_out, int n) {
    return n == 1 && zero_copy_cold_ && !ColdParts(exchange_out, n) && DeviceReadable(exchange_out)
               ? exchange_out
               : cold_in_;
  }
  // Queues the wait for layer l's cold contribution and, unless read in place (ColdInput), its
  // copy up or the sum of its parts.
  BackendStatus EnqueueColdWait(int l, const float* exchange_out, int n);
  // Streamed cold rows (prompt batches, ColdPath::kStream).
  bool StreamsLayer(int l, const ForwardArgs& a) const;
  // Whether layer l hands cold rows to the callback (ColdFfn) in this step.
  bool CallsColdSide(int l, const ForwardArgs& a) const {
    const DeviceLayer& L = layers_[l];
    return L.ffn == FfnPlacement::kHot && a.cold != nullptr && !L.cold_ids_host.empty() &&
           !StreamsLayer(l, a);
  }
  // Pins the cold rows; slots: also the streaming slots (else only the copy stream, for cache
  // loads).
  BackendStatus SetUpStreaming(const ModelUpload& m, bool slots);
  // Whether layer l's step addresses the adaptive cache slots (kGiven: by the given lists,
  // kPredicted: through the compaction maps).
  bool UsesCache(const DeviceLayer& L, const ForwardArgs& a) const {
    const FfnMode mode = EffectiveMode(a);
    return L.n_cache > 0 && (mode == FfnMode::kGiven || mode == FfnMode::kPredicted) &&
           a.n <= kSmallBatch;
  }
  // active_out's hot half: whether this step copies each layer's hot list to the host.
  static bool ObservesActive(const ForwardArgs& a) {
    return a.active_out != nullptr && EffectiveMode(a) == FfnMode::kPredicted && a.n == 1;
  }
  // Adds layer l's cold rows' contribution for the FFN input xb_ ([n, hidden]) to hot_out_.
  BackendStatus StreamCold(int l, int n);
  // This backend's own scratch, streams, events and pinned staging (Create, and a lane's whole
  // setup: everything else a lane shares with the backend it came from).
  BackendStatus AllocateScratch();
  BackendStatus InitLane(const CudaBackend& base);
  void Release();

  ModelDims dims_;
  int max_ctx_ = 0, max_seqs_ = 0, max_batch_ = 0, device_ = 0;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::vector<void*> allocations_, host_allocations_;
  size_t device_bytes_ = 0, weight_bytes_ = 0;
  int lanes_made_ = 0;    // NewLane's lanes so far (with this backend, at most kMaxLanes)
  bool is_lane_ = false;  // made by NewLane: shares another backend's weights
  int64_t widest_ = 0;    // the widest activation row, for the cuBLAS input scratch
  size_t w_half_ = 0;     // the largest weight conversion the cuBLAS path needs

  DeviceMatrix tok_embeddings_, output_;
  float* output_norm_ = nullptr;
  float* inv_freq_ = nullptr;
  // [head_dim / 2, 2]: RoPE's cosines and sines at a decode step's position (RopeTable), for the
  // q/k/v product that applies RoPE itself (NormMatVecRope).
  float* rope_cos_sin_ = nullptr;
  std::vector<DeviceLayer> layers_;
  int kv_layers_ = 0;
  float* k_cache_ = nullptr;  // [kv_layers, max_seqs, max_ctx, kv_dim]
  float* v_cache_ = nullptr;

  // Scratch, [max_batch, ...].
  // The residual of the previous layer's FFN, added by the next norm (ResidualRmsNorm).
  const float* pending1_ = nullptr;
  const float* pending2_ = nullptr;
  float* qkv_ = nullptr;
  float *x_ = nullptr, *xb_ = nullptr, *q_ = nullptr, *att_ = nullptr, *hot_out_ = nullptr,
        *cold_in_ = nullptr, *gate_ = nullptr, *up_ = nullptr, *pred_h_ = nullptr,
        *scores_ = nullptr, *logits_ = nullptr;
  GreedyResult* pick_dev_ = nullptr;   // device [1]: LogitsMode::kGreedy's pick
  GreedyResult* pick_host_ = nullptr;  // pinned [1]: its copy
  float* rms_ = nullptr;  // [max_batch] each token's rms(residual) for pre-norm predictors
  // hot_list_: [1 + ffn] = count, then ids (one copy uploads a given list); cold likewise.
  int32_t *tokens_dev_ = nullptr, *positions_dev_ = nullptr, *hot_list_ = nullptr,
          *cold_list_ = nullptr;
  int max_rank_ = 0;
  bool qx_on_ = false;
  int8_t *xb_qx_ = nullptr, *up_qx_ = nullptr;  // [kSmallBatch, QxBytes(hidden or ffn)]
  // Decode steps of dense layers fold both norms into the int8 products that consume them
  // (NormMatVec). The residual then alternates between x_ and x_alt_ ([hidden]): a fused norm's
  // product cannot update it in place while its other blocks still read it.
  float* x_alt_ = nullptr;
  bool FusesNorms(const DeviceLayer& L, int n, const float* pend2) const {
    return x_alt_ != nullptr && n == 1 && pend2 == nullptr && L.ffn == FfnPlacement::kDense &&
           AttQx(1) != nullptr && NormMatVecFits(L.wqkv) && NormMatVecFits(L.gate_up);
  }
  // [kSmallBatch, QxBytes(q_dim)], where the attention quantizes its output for the output
  // projection (PINFER_CUDA_ATTN_QX=0: null, the projection does it, for comparison).
  int8_t* att_qx_ = nullptr;
  GemmScratch gemm_;

  // Pinned host staging.
  int32_t* tokens_host_ = nullptr;    // [2 * max_batch]: tokens, positions
  int32_t* given_host_ = nullptr;     // [n_layers, ffn + 1]
  int32_t* counts_host_ = nullptr;    // [n_layers, 2]
  int32_t* cold_idx_host_ = nullptr;  // [ffn]
  float* x_host_ = nullptr;           // [max_batch, hidden]
  float* out_host_ = nullptr;
  int32_t* active_host_ = nullptr;    // [ffn]
  int32_t* observed_host_ = nullptr;  // [n_layers, ffn + 1]: hot lists (ForwardArgs::active_out)

  // Per-layer events: x published, hot start, hot end, attention start, the cold side's signal
  // seen (collect_gpu_times_ only); plus step start/end.
  std::vector<cudaEvent_t> ev_x_, ev_hot0_, ev_hot1_, ev_attn0_, ev_signal_;
  cudaEvent_t ev_start_ = nullptr, ev_layers_end_ = nullptr;
  // Early publishing (PINFER_CUDA_EARLY_PUBLISH, on by default; 0 restores the old order for
  // comparison): the FFN input is copied to the host on publish_stream_ while the predictor runs
  // (forked at ev_fork_, joined at ev_join_), and the hot list is compacted after the cold side
  // has what it needs, so neither sits between the norm and the host's wake-up.
  bool early_publish_ = true;
  cudaStream_t publish_stream_ = nullptr;
  cudaEvent_t ev_fork_ = nullptr, ev_join_ = nullptr;
  bool collect_gpu_times_ = false;
  bool use_graphs_ = true;
  std::map<std::vector<int64_t>, cudaGraphExec_t> graphs_;
  // Single-token steps without a cold side replay one graph for the whole step (embedding to
  // logits) instead of one per layer, so no launch gap separates the layers.
  bool step_graph_ = true;
  // With PINFER_CUDA_ZERO_COPY_COLD=1 decode reads the cold contribution from the pinned
  // exchange buffer in place instead of copying it up first. Off by default: within noise on the
  // H200, and 30% slower with the GPU's cold share at skew 20% (docs/benchmarks.md, session 5).
  bool zero_copy_cold_ = false;
  // Single-token cold callbacks may hand over their threads' partial sums (ColdRequest::
  // max_parts), which SumParts adds up on the GPU: the CPU's threads skip exchanging them
  // (~15 us of a ~80 us call on the H200 host, docs/benchmarks.md run 35).
  // PINFER_CUDA_COLD_PARTS=0: off, the callback sums them.
  bool cold_parts_ = true;
  int32_t* parts_count_dev_ = nullptr;  // device [1]: the part count the host's signal carried
  // Queued decode steps (PINFER_CUDA_PRELAUNCH, on by default; 0 for comparison): in a
  // single-token step with a cold side, the next layer is queued before a layer's callback runs,
  // waiting on the GPU (WaitHostFlag) for the cold contribution, instead of being launched after
  // the callback returns, so the host's launch and copy calls leave the critical path. On the
  // H200 the time per token outside the callback fell by 0-0.65 ms (docs/benchmarks.md, run 21).
  bool prelaunch_ = true;
  int32_t* cold_ready_ = nullptr;       // [n_layers] pinned: the host's signals, cleared by the GPU
  const void* readable_ptr_ = nullptr;  // last pointer DeviceReadable accepted
  bool DeviceReadable(const void* p);
  bool repack_ = true;
  void* repack_tmp_ = nullptr;  // upload-time scratch of MaybeSplit, freed at the end of Create
  size_t repack_tmp_bytes_ = 0;
  ForwardStats stats_;

  std::unique_ptr<ColdStreamer> streamer_;  // ModelUpload::stream_cold or cache_rows
  bool cache_loaded_ = false;

  // ModelUpload::cold_gpu_share as share_num_ / kShareDen; the rest of each list goes to the
  // callback. The GPU's part of a list is its first n * share_num_ / kShareDen entries. The
  // kernels read the current value from pinned host memory (share_dev_), so that captured graphs
  // need not change when it does. Adaptive (share_adaptive_): after every single-token step the
  // share moves by kShareStep towards the balance where the GPU finishes its part as the
  // callback returns: up when most layers' GPU part had finished first (the GPU waited), down
  // otherwise.
  static constexpr int kShareDen = 1024;
  static constexpr int kShareStep = 8;
  bool share_on_ = false, share_adaptive_ = false;
  int share_num_ = 0;
  int32_t* share_dev_ = nullptr;        // pinned [1]
  int gpu_first_ = 0, cpu_first_ = 0;   // this step's layers, by which side finished first
  std::vector<cudaEvent_t> ev_share_;   // per layer: the GPU's part done
  int32_t* cold_gpu_count_ = nullptr;   // device [1]: the GPU's part of a predicted list
  int32_t* cold_gpu_list_ = nullptr;    // device [1 + ffn]: count, cold positions (kGiven)
  int32_t* given_cold_host_ = nullptr;  // pinned [n_layers, ffn + 1]: its staging
  float *cold_gate_ = nullptr, *cold_up_ = nullptr;  // device [ffn]
  // Whether layer l's single-token step gives the GPU a share of its cold neurons.
  bool SharesCold(const DeviceLayer& L, const ForwardArgs& a) const {
    const FfnMode mode = EffectiveMode(a);
    return share_on_ && a.n == 1 && L.cold_rows.rows > 0 &&
           (mode == FfnMode::kPredicted || mode == FfnMode::kGiven);
  }
  int GpuShare(int count) const {
    return static_cast<int>(static_cast<int64_t>(count) * share_num_ / kShareDen);
  }

  // ModelUpload::cold_guess. Layer l's guess is made during layer l - 1, so that it is on the
  // host when layer l's attention starts: EnqueueGuessChain runs layer l's predictor on
  // guess_x_, compacts the cold neurons above its cut lowered by guess_shift_[l], copies the list
  // to guess_host_ and records ev_guess_[l], all on guess_stream_, which the main stream joins
  // (ev_gjoin_) at the end of the layer that forked it, so each captured graph holds its whole
  // branch. guess_x_ is the residual after layer l - 1's attention alone, through layer l's FFN
  // norm, forked beside layer l - 1's hot rows: the guess takes nothing from layer l's attention.
  // (From that residual plus layer l - 1's hot part, a closer guess, with its predictor forked
  // first in layer l, it took 0.27 ms a token from the attention on the H200: docs/
  // benchmarks.md, run 44; removed in session 28.) The stream has the device's highest priority
  // (layer graphs keep their nodes' priorities).
  bool guess_on_ = false;
  double guess_recall_ = 0.95;
  float guess_initial_shift_ = 1.f;
  float* guess_shift_ = nullptr;   // pinned [n_layers]
  float* guess_x_ = nullptr;       // device [hidden]
  float* guess_h_ = nullptr;       // device [max_rank]
  float* guess_scores_ = nullptr;  // device [ffn]
  // device [1 + ffn]: count, then positions in the cold list, kAboveBit set on the guess's first
  // tier (ColdGuess::first: above the predictor's own cut on the guess's input)
  int32_t* guess_list_ = nullptr;
  int32_t* guess_host_ = nullptr;     // pinned [n_layers, 1 + ffn]
  std::vector<int32_t> guess_ids_;    // the layer's guess in global ids, as Ahead gets it
  std::vector<uint8_t> guess_first_;  // [guess_ids_.size()]: ColdGuess::first
  std::vector<uint32_t> guess_mark_;  // [ffn]: == guess_epoch_ for the neurons of guess_ids_
  uint32_t guess_epoch_ = 0;
  int guess_layer_ = -1;  // the layer guess_ids_ belongs to (FinishCold scores it), or -1
  cudaStream_t guess_stream_ = nullptr;
  cudaEvent_t ev_gfork_ = nullptr, ev_gjoin_ = nullptr;
  std::vector<cudaEvent_t> ev_guess_;
  // Hands layer l's guess from guess_host_ to guess_ids_ (global ids) and guess_first_, and marks
  // its neurons; returns its size.
  int TakeGuess(int l);
  // On guess_stream_, from guess_x_: layer l's predictor, the compaction (its first tier marked),
  // the copy to the host, ev_guess_[l], ev_gjoin_.
  BackendStatus EnqueueGuessChain(int l, const ForwardArgs& a);
  // Whether layer l's guess is made (at the end of layer l - 1, which must be on the GPU's
  // sparse path in the same step).
  bool GuessMade(int l, const ForwardArgs& a) const {
    const int end = a.layer_end < 0 ? dims_.n_layers : a.layer_end;
    return l > a.layer_begin && l < end && layers_[l - 1].ffn == FfnPlacement::kHot &&
           Guesses(l, a);
  }
  bool Guesses(int l, const ForwardArgs& a) const {
    const DeviceLayer& L = layers_[l];
    const FfnMode mode = EffectiveMode(a);
    return guess_on_ && prelaunch_ && a.n == 1 && L.fc1.data != nullptr && !L.pred_rms &&
           CallsColdSide(l, a) &&
           (mode == FfnMode::kPredicted || (mode == FfnMode::kGiven && a.run_predictors));
  }
  // After the layer's actual cold list (global ids) is known: scores the guess handed to Ahead
  // and moves the layer's shift (cold_guess_recall).
  void ScoreGuess(int l, const int32_t* actual, int count, bool adapt);
};

void CudaBackend::Release() {
  if (device_name_.empty() && allocations_.empty()) return;
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (void* p : allocations_) cudaFree(p);
  for (void* p : host_allocations_) cudaFreeHost(p);
  if (repack_tmp_ != nullptr) cudaFree(repack_tmp_);
  repack_tmp_ = nullptr;
  allocations_.clear();
  host_allocations_.clear();
  streamer_.reset();
  for (auto* v : {&ev_x_, &ev_hot0_, &ev_hot1_, &ev_share_, &ev_attn0_, &ev_signal_}) {
    for (cudaEvent_t e : *v) cudaEventDestroy(e);
    v->clear();
  }
  if (ev_start_ != nullptr) cudaEventDestroy(ev_start_);
  if (ev_layers_end_ != nullptr) cudaEventDestroy(ev_layers_end_);
  for (cudaEvent_t e : ev_guess_) cudaEventDestroy(e);
  ev_guess_.clear();
  for (cudaEvent_t* e : {&ev_gfork_, &ev_gjoin_}) {
    if (*e != nullptr) cudaEventDestroy(*e);
    *e = nullptr;
  }
  if (guess_stream_ != nullptr) cudaStreamDestroy(guess_stream_);
  guess_stream_ = nullptr;
  if (ev_fork_ != nullptr) cudaEventDestroy(ev_fork_);
  if (ev_join_ != nullptr) cudaEventDestroy(ev_join_);
  if (publish_stream_ != nullptr) cudaStreamDestroy(publish_stream_);
  ev_fork_ = ev_join_ = nullptr;
  publish_stream_ = nullptr;
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  stream_ = nullptr;
  cublas_ = nullptr;
}

// extra_rows: zeroed rows allocated after the uploaded ones (adaptive cache slots), not counted
// in out->rows.
BackendStatus CudaBackend::UploadMatrix(const HostMatrix& h, const std::vector<int32_t>* ids,
                                        const char* name, DeviceMatrix* out, int64_t extra_rows) {
  if (h.empty()) return Error(Code::kInvalidArgument, std::string("missing tensor ") + name);
  DeviceMatrix d;
  d.type = static_cast<WType>(h.type);
  d.cols = h.cols;
  d.rows = ids != nullptr ? static_cast<int64_t>(ids->size()) : h.rows;
  d.data = reinterpret_cast<const void*>(16);  // shape check only
  if (CheckMatrixShape(d) != cudaSuccess) {
    return Error(Code::kInvalidArgument, std::string(name) + ": " + std::to_string(h.cols) +
                                             " columns of type " + WTypeName(d.type) +
                                             " do not suit the GPU row kernels");
  }
  const size_t rb = HostRowBytes(h.type, h.cols);
  uint8_t* dev = nullptr;
  BACKEND_RETURN_IF_ERROR(Alloc(rb * (d.rows + extra_rows), &dev, /*weight=*/true));
  if (extra_rows > 0) CUDA_RETURN_IF_ERROR(cudaMemset(dev + rb * d.rows, 0, rb * extra_rows));
  if (ids == nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemcpy(dev, h.data, rb * d.rows, cudaMemcpyHostToDevice));
  } else {
    // Gather the rows through a staging buffer, a few MB at a time.
    const size_t chunk_rows = std::max<size_t>(1, (64u << 20) / rb);
    std::vector<uint8_t> staging(std::min<size_t>(chunk_rows, d.rows) * rb);
    for (size_t r0 = 0; r0 < static_cast<size_t>(d.rows); r0 += chunk_rows) {
      const size_t nr = std::min<size_t>(chunk_rows, d.rows - r0);
      for (size_t i = 0; i < nr; ++i) {
        const int32_t id = (*ids)[r0 + i];
        if (id < 0 || id >= h.rows) {
          return Error(Code::kInvalidArgument,
                       std::string(name) + ": row id " + std::to_string(id) + " out of range");
        }
        std::memcpy(staging.data() + i * rb, static_cast<const uint8_t*>(h.data) + id * rb, rb);
      }
      CUDA_RETURN_IF_ERROR(
          cudaMemcpy(dev + r0 * rb, staging.data(), nr * rb, cudaMemcpyHostToDevice));
    }
  }
  d.data = dev;
  // Adaptive cache slots are loaded in GGUF's layout and rewritten into the split one
  // (ColdStreamer::LoadRows), so the slots take their share of the split layout too.
  BACKEND_RETURN_IF_ERROR(MaybeSplit(&d, extra_rows));
  *out = d;
  return Ok();
}

// The matrix is on the device in GGUF's layout: copy it aside and rewrite it in place as the
// split layout (same bytes), which the matrix-vector kernels read with aligned 16-byte loads.
// extra_rows: slots after the rows, in the same allocation, which get zeros in the split layout
// (the scales of all rows, slots included, go after all the quants).
BackendStatus CudaBackend::MaybeSplit(DeviceMatrix* d, int64_t extra_rows) {
  if (!repack_ || (d->type != WType::kQ8_0 && d->type != WType::kQ4_0) || d->rows == 0) {
    return Ok();
  }
  const size_t bytes = d->bytes();
  if (repack_tmp_bytes_ < bytes) {
    if (repack_tmp_ != nullptr) cudaFree(repack_tmp_);
    repack_tmp_ = nullptr;
    repack_tmp_bytes_ = 0;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&repack_tmp_, bytes));
    repack_tmp_bytes_ = bytes;
  }
  // The rows were uploaded with cudaMemcpy from pageable memory, which may return before its
  // DMA lands, and stream_ (non-blocking) does not wait for the legacy stream: without this the
  // copy below read half-uploaded rows now and then (QuantizedModelStepLogitsMatchCpuReference).
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(repack_tmp_, d->data, bytes, cudaMemcpyDeviceToDevice, stream_));
  DeviceMatrix src = *d, dst = *d;
  src.data = repack_tmp_;
  const size_t qrb = QuantRowBytes(d->type, d->cols), srb = d->row_bytes() - qrb;
  auto* base = static_cast<uint8_t*>(const_cast<void*>(d->data));
  dst.scales = base + qrb * (d->rows + extra_rows);
  CUDA_RETURN_IF_ERROR(RepackSplit(src, dst, 0, stream_));
  if (extra_rows > 0) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base + qrb * d->rows, 0, qrb * extra_rows, stream_));
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base + qrb * (d->rows + extra_rows) + srb * d->rows, 0,
                                         srb * extra_rows, stream_));
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  *d = dst;
  return Ok();
}

BackendStatus CudaBackend::UploadVector(const HostMatrix& h, int64_t expect, const char* name,
                                        float** out) {
  std::vector<float> v;
  if (h.empty() || h.rows * h.cols != expect || !HostToFloat(h, &v)) {
    return Error(Code::kInvalidArgument, std::string("bad vector ") + name);
  }
  BACKEND_RETURN_IF_ERROR(Alloc(v.size(), out, /*weight=*/true));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(*out, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return Ok();
}

BackendStatus CudaBackend::UploadStacked(const std::vector<const HostMatrix*>& parts,
                                         const char* name, DeviceMatrix* out) {
  DeviceMatrix d;
  d.type = static_cast<WType>(parts[0]->type);
  d.cols = parts[0]->cols;
  for (const HostMatrix* p : parts) {
    if (p->empty() || p->type != parts[0]->type || p->cols != d.cols) {
      return Error(Code::kInvalidArgument, std::string(name) + ": parts differ in type or width");
    }
    d.rows += p->rows;
  }
  d.data = reinterpret_cast<const void*>(16);
  if (CheckMatrixShape(d) != cudaSuccess) {
    return Error(Code::kInvalidArgument, std::string(name) + ": " + std::to_string(d.cols) +
                                             " columns of type " + WTypeName(d.type) +
                                             " do not suit the GPU row kernels");
  }
  const size_t rb = HostRowBytes(parts[0]->type, d.cols);
  uint8_t* dev = nullptr;
  BACKEND_RETURN_IF_ERROR(Alloc(rb * d.rows, &dev, /*weight=*/true));
  size_t off = 0;
  for (const HostMatrix* p : parts) {
    CUDA_RETURN_IF_ERROR(cudaMemcpy(dev + off, p->data, rb * p->rows, cudaMemcpyHostToDevice));
    off += rb * p->rows;
  }
  d.data = dev;
  BACKEND_RETURN_IF_ERROR(MaybeSplit(&d));
  *out = d;
  return Ok();
}

BackendStatus CudaBackend::Create(const ModelUpload& m) {
  dims_ = m.dims;
  const ModelDims& c = dims_;
  max_ctx_ = m.max_ctx;
  max_seqs_ = m.max_seqs;
  max_batch_ = m.max_batch;
  device_ = m.device;
  if (c.hidden <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 ||
      c.ffn <= 0 || c.vocab <= 0 || static_cast<int>(m.layers.size()) != c.n_layers ||
      static_cast<int>(c.inv_freq.size()) != c.head_dim / 2 || max_ctx_ <= 0 || max_seqs_ <= 0 ||
      max_batch_ <= 0) {
    return Error(Code::kInvalidArgument, "inconsistent model dimensions for the CUDA backend");
  }
  if (max_ctx_ > MaxAttentionContext()) {
    return Error(Code::kInvalidArgument, "context " + std::to_string(max_ctx_) +
                                             " exceeds the attention kernel's limit " +
                                             std::to_string(MaxAttentionContext()));
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    cudaGetLastError();
    return Error(Code::kUnavailable, "no CUDA device");
  }
  if (device_ < 0 || device_ >= n_dev) {
    return Error(Code::kInvalidArgument,
                 "CUDA device " + std::to_string(device_) + " of " + std::to_string(n_dev));
  }
  if (const char* g = std::getenv("PINFER_CUDA_GRAPHS")) use_graphs_ = std::string(g) != "0";
  if (const char* g = std::getenv("PINFER_CUDA_REPACK")) repack_ = std::string(g) != "0";
  if (const char* g = std::getenv("PINFER_CUDA_STEP_GRAPH")) step_graph_ = std::string(g) != "0";
  if (const char* g = std::getenv("PINFER_CUDA_PDL")) SetProgrammaticLaunch(std::string(g) != "0");
  {
    double share = m.cold_gpu_share;
    share_adaptive_ = m.cold_gpu_share_adaptive;
    if (const char* g = std::getenv("PINFER_CUDA_COLD_GPU_SHARE")) {
      share_adaptive_ = std::string(g) == "auto";
      share = share_adaptive_ ? 0 : std::atof(g);
    }
    if (!(share >= 0 && share <= 1)) {
      return Error(Code::kInvalidArgument, "cold_gpu_share must be in [0, 1]");
    }
    share_num_ = static_cast<int>(share * kShareDen + 0.5);
    share_on_ = share_num_ > 0 || share_adaptive_;
  }
  guess_on_ = m.cold_guess;
  if (const char* g = std::getenv("PINFER_CUDA_COLD_GUESS")) guess_on_ = std::string(g) != "0";
  guess_recall_ = m.cold_guess_recall;
  if (const char* g = std::getenv("PINFER_CUDA_COLD_GUESS_RECALL")) guess_recall_ = std::atof(g);
  if (!(guess_recall_ >= 0 && guess_recall_ < 1) || !std::isfinite(m.cold_guess_shift)) {
    return Error(Code::kInvalidArgument,
                 "cold_guess_recall must be in [0, 1) and cold_guess_shift finite");
  }
  guess_initial_shift_ = static_cast<float>(m.cold_guess_shift);
  if (const char* g = std::getenv("PINFER_CUDA_COLD_GUESS_SHIFT")) {
    guess_initial_shift_ = static_cast<float>(std::atof(g));
  }
  if (const char* g = std::getenv("PINFER_CUDA_Q8X"))
    SetQuantizedActivations(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_PREFETCH")) SetWeightPrefetch(std::string(g) == "1");
  if (const char* g = std::getenv("PINFER_CUDA_QX_WARPS")) SetQuantWarps(std::atoi(g));
  if (const char* g = std::getenv("PINFER_CUDA_QX_ROWS")) SetQuantRowsPerWarp(std::atoi(g));
  if (const char* g = std::getenv("PINFER_CUDA_QX_SHAPE")) {
    SetQuantShapeBalanced(std::string(g) != "fixed");
  }
  if (const char* g = std::getenv("PINFER_CUDA_NORM_LOOP"))
    SetNormInRegisters(std::string(g) != "1");
  if (const char* g = std::getenv("PINFER_CUDA_NORM_VEC8")) SetNormVec8(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_QX_REGS")) SetQuantRegs(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_QX_EARLY")) SetQuantEarlyLoad(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_QX_PIPE")) SetQuantPipeline(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_ATTN_LATE_TRIGGER")) {
    SetAttentionLateTrigger(std::string(g) == "1");
  }
  if (const char* g = std::getenv("PINFER_CUDA_LATE_X_FIRST")) {
    SetLateBlocksLoadXFirst(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_FUSED_NORM")) SetFusedNorm(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_ROPE_IN_PRODUCT")) {
    SetRopeInProduct(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_ACT_IN_PRODUCT")) {
    SetActivationInProduct(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_ATTN_EARLY")) {
    SetAttentionEarlyLoad(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_ATTN_ONLINE")) {
    SetOnlineAttention(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_EARLY_PUBLISH")) {
    early_publish_ = std::string(g) != "0";
  }
  if (const char* g = std::getenv("PINFER_CUDA_ZERO_COPY_COLD")) {
    zero_copy_cold_ = std::string(g) == "1";
  }
  if (const char* g = std::getenv("PINFER_CUDA_PRELAUNCH")) prelaunch_ = std::string(g) != "0";
  if (const char* g = std::getenv("PINFER_CUDA_COLD_PARTS")) cold_parts_ = std::string(g) != "0";
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
  device_name_ = prop.name;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  if (cublasCreate(&cublas_) != CUBLAS_STATUS_SUCCESS) {
    return Error(Code::kInternal, "cublasCreate failed");
  }

  const int H = c.hidden, B = max_batch_, F = c.ffn;
  const int qdim = c.n_heads * c.head_dim, kvdim = c.n_kv_heads * c.head_dim;
  BACKEND_RETURN_IF_ERROR(
      UploadMatrix(m.tok_embeddings, nullptr, "tok_embeddings", &tok_embeddings_));
  BACKEND_RETURN_IF_ERROR(UploadMatrix(m.output, nullptr, "output", &output_));
  BACKEND_RETURN_IF_ERROR(UploadVector(m.output_norm, H, "output_norm", &output_norm_));
  BACKEND_RETURN_IF_ERROR(Alloc(c.inv_freq.size(), &inv_freq_));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpy(inv_freq_, c.inv_freq.data(), c.inv_freq.size() * 4, cudaMemcpyHostToDevice));

  size_t w_half = GemmWeightScratchBytes(output_);
  int64_t widest =
      std::max<int64_t>({int64_t{H}, int64_t{2} * F, int64_t{qdim} + 2 * kvdim, int64_t{c.vocab}});
  layers_.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerUpload& u = m.layers[l];
    DeviceLayer& d = layers_[l];
    d.ffn = u.ffn;
    if (u.ffn == FfnPlacement::kNone) continue;
    d.kv_index = kv_layers_++;
    BACKEND_RETURN_IF_ERROR(UploadVector(u.attn_norm, H, "attn_norm", &d.attn_norm));
    BACKEND_RETURN_IF_ERROR(UploadVector(u.ffn_norm, H, "ffn_norm", &d.ffn_norm));
    if (u.wq.rows != qdim || u.wk.rows != kvdim || u.wv.rows != kvdim || u.wo.rows != H ||
        u.wq.cols != H || u.wo.cols != qdim) {
      return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": attention shapes");
    }
    BACKEND_RETURN_IF_ERROR(UploadStacked({&u.wq, &u.wk, &u.wv}, "wq/wk/wv", &d.wqkv));
    BACKEND_RETURN_IF_ERROR(UploadMatrix(u.wo, nullptr, "wo", &d.wo));
    if (u.ffn == FfnPlacement::kDense) {
      if (u.gate.rows != F || u.up.rows != F || u.down.rows != H || u.down.cols != F) {
        return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": FFN shapes");
      }
      BACKEND_RETURN_IF_ERROR(UploadStacked({&u.gate, &u.up}, "gate/up", &d.gate_up));
      BACKEND_RETURN_IF_ERROR(UploadMatrix(u.down, nullptr, "down", &d.down));
      d.n_hot = F;
      if (d.down.rows != H) {
        return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": FFN shapes");
      }
    } else {
      for (size_t i = 0; i < u.hot_ids.size(); ++i) {
        if (u.hot_ids[i] < 0 || u.hot_ids[i] >= F || (i > 0 && u.hot_ids[i] <= u.hot_ids[i - 1])) {
          return Error(Code::kInvalidArgument,
                       "layer " + std::to_string(l) + ": hot_ids must be ascending neuron ids");
        }
      }
      d.n_hot = static_cast<int>(u.hot_ids.size());
      d.n_cache = u.cache_rows;
      if (d.n_cache < 0 || d.n_hot + d.n_cache > F) {
        return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": " +
                                                 std::to_string(d.n_cache) +
                                                 " cache rows do not fit beside the hot rows");
      }
      if (d.n_hot > 0 || d.n_cache > 0) {
        BACKEND_RETURN_IF_ERROR(UploadMatrix(u.gate, &u.hot_ids, "gate", &d.gate, d.n_cache));
        BACKEND_RETURN_IF_ERROR(UploadMatrix(u.up, &u.hot_ids, "up", &d.up, d.n_cache));
        BACKEND_RETURN_IF_ERROR(UploadMatrix(u.down_t, &u.hot_ids, "down_t", &d.down_t, d.n_cache));
        if (u.gate.rows != F || u.down_t.rows != F || u.down_t.cols != H) {
          return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": FFN shapes");
        }
      }
      d.hot_ids_host = u.hot_ids;
      if (d.n_hot > 0) {
        BACKEND_RETURN_IF_ERROR(Alloc(d.n_hot, &d.hot_ids));
        CUDA_RETURN_IF_ERROR(
            cudaMemcpy(d.hot_ids, u.hot_ids.data(), d.n_hot * 4, cudaMemcpyHostToDevice));
      }
      for (auto [all, part] : {std::pair{&d.gate_c, &d.gate}, std::pair{&d.up_c, &d.up},
                               std::pair{&d.down_t_c, &d.down_t}}) {
        *all = *part;
        all->rows += d.n_cache;
      }
      std::vector<char> is_hot(F, 0);
      for (int32_t id : u.hot_ids) is_hot[id] = 1;
      for (int j = 0; j < F; ++j) {
        if (!is_hot[j]) d.cold_ids_host.push_back(j);
      }
      if (!d.cold_ids_host.empty()) {
        BACKEND_RETURN_IF_ERROR(Alloc(d.cold_ids_host.size(), &d.cold_ids));
        CUDA_RETURN_IF_ERROR(cudaMemcpy(d.cold_ids, d.cold_ids_host.data(),
                                        d.cold_ids_host.size() * 4, cudaMemcpyHostToDevice));
      }
      if (d.n_cache > 0) {
        std::vector<int32_t> hot_map = u.hot_ids;
        hot_map.resize(static_cast<size_t>(d.n_hot) + d.n_cache, -1);
        d.slot_neuron.assign(d.n_cache, -1);
        d.slot_loaded.assign(d.n_cache, -1);
        d.cold_map_host = d.cold_ids_host;
        BACKEND_RETURN_IF_ERROR(Alloc(hot_map.size(), &d.hot_map_c));
        CUDA_RETURN_IF_ERROR(
            cudaMemcpy(d.hot_map_c, hot_map.data(), hot_map.size() * 4, cudaMemcpyHostToDevice));
        if (!d.cold_ids_host.empty()) {
          BACKEND_RETURN_IF_ERROR(Alloc(d.cold_ids_host.size(), &d.cold_map_c));
          CUDA_RETURN_IF_ERROR(cudaMemcpy(d.cold_map_c, d.cold_ids_host.data(),
                                          d.cold_ids_host.size() * 4, cudaMemcpyHostToDevice));
        }
      }
    }
    if (!u.pred_fc1.empty()) {
      BACKEND_RETURN_IF_ERROR(UploadMatrix(u.pred_fc1, nullptr, "pred_fc1", &d.fc1));
      BACKEND_RETURN_IF_ERROR(UploadMatrix(u.pred_fc2, nullptr, "pred_fc2", &d.fc2));
      if (d.fc1.cols != H || d.fc2.rows != F || d.fc2.cols != d.fc1.rows) {
        return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": predictor shapes");
      }
      max_rank_ = std::max<int>(max_rank_, static_cast<int>(d.fc1.rows));
      // The compaction keeps scores > cut; the next float below the threshold makes that
      // score >= threshold, the CPU predictors' rule.
      d.pred_cut = std::nextafter(u.pred_threshold, -INFINITY);
      d.pred_rms = u.pred_scores_times_rms;
    }
    for (const DeviceMatrix* w :
         {&d.wqkv, &d.wo, &d.gate_up, &d.gate, &d.up, &d.down, &d.down_t, &d.fc1, &d.fc2}) {
      if (w->data != nullptr) w_half = std::max(w_half, GemmWeightScratchBytes(*w));
    }
  }
  widest = std::max<int64_t>(widest, max_rank_);
  bool any_cache = false;
  for (const LayerUpload& u : m.layers) any_cache = any_cache || u.cache_rows > 0;
  if ((m.stream_cold && B > kSmallBatch) || any_cache || share_on_) {
    BACKEND_RETURN_IF_ERROR(SetUpStreaming(m, m.stream_cold && B > kSmallBatch));
    for (const DeviceLayer& d : layers_) {
      if (d.cold_rows.rows == 0) continue;
      const DeviceMatrix chunk{d.cold_rows.type, streamer_->chunk_rows(), H, d.cold_rows.gate};
      w_half = std::max(w_half, GemmWeightScratchBytes(chunk));
    }
  }

  // The KV cache, shared with every lane (NewLane); then this backend's own scratch.
  const size_t kv = static_cast<size_t>(kv_layers_) * max_seqs_ * max_ctx_ * kvdim;
  BACKEND_RETURN_IF_ERROR(Alloc(kv, &k_cache_));
  BACKEND_RETURN_IF_ERROR(Alloc(kv, &v_cache_));
  widest_ = widest;
  w_half_ = w_half;
  BACKEND_RETURN_IF_ERROR(AllocateScratch());
  if (repack_tmp_ != nullptr) CUDA_RETURN_IF_ERROR(cudaFree(repack_tmp_));
  repack_tmp_ = nullptr;
  repack_tmp_bytes_ = 0;
  return Ok();
}

BackendStatus CudaBackend::AllocateScratch() {
  const ModelDims& c = dims_;
  const int H = c.hidden, B = max_batch_, F = c.ffn;
  const int qdim = c.n_heads * c.head_dim, kvdim = c.n_kv_heads * c.head_dim;
  const int64_t widest = widest_;
  const size_t w_half = w_half_;
  const char* attn_qx = std::getenv("PINFER_CUDA_ATTN_QX");  // 0: off (benchmarks)
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (stream_ == nullptr) {  // a lane's (Create made the first backend's for its uploads)
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  if (cublas_ == nullptr && cublasCreate(&cublas_) != CUBLAS_STATUS_SUCCESS) {
    return Error(Code::kInternal, "cublasCreate failed");
  }
  BACKEND_RETURN_IF_ERROR(Alloc(2 * c.inv_freq.size(), &rope_cos_sin_));
  const size_t bh = static_cast<size_t>(B) * H, bf = static_cast<size_t>(B) * F;
  BACKEND_RETURN_IF_ERROR(Alloc(bh, &x_));
  BACKEND_RETURN_IF_ERROR(Alloc(bh, &xb_));
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * qdim, &q_));
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * qdim, &att_));
  BACKEND_RETURN_IF_ERROR(Alloc(bh, &hot_out_));
  BACKEND_RETURN_IF_ERROR(Alloc(bh, &cold_in_));
  BACKEND_RETURN_IF_ERROR(Alloc(1, &parts_count_dev_));
  BACKEND_RETURN_IF_ERROR(Alloc(2 * bf, &gate_));  // also [n, 2 ffn] stacked gate/up outputs
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * (qdim + 2 * kvdim), &qkv_));
  BACKEND_RETURN_IF_ERROR(Alloc(bf, &up_));
  for (const DeviceLayer& L : layers_) {
    for (const DeviceMatrix* m : {&L.wqkv, &L.wo, &L.gate_up, &L.down, &L.gate, &L.up, &L.fc1}) {
      qx_on_ = qx_on_ || m->split();
    }
  }
  const char* producer_qx = std::getenv("PINFER_CUDA_PRODUCER_QX");  // 0: off (benchmarks)
  qx_on_ = qx_on_ && H % 32 == 0 && F % 32 == 0 &&
           (producer_qx == nullptr || std::string(producer_qx) != "0");
  if (qx_on_) {
    BACKEND_RETURN_IF_ERROR(Alloc(kSmallBatch * QxBytes(H), &xb_qx_));
    BACKEND_RETURN_IF_ERROR(Alloc(kSmallBatch * QxBytes(F), &up_qx_));
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(H), &x_alt_));
    if (qdim % 32 == 0 && (attn_qx == nullptr || std::string(attn_qx) != "0")) {
      BACKEND_RETURN_IF_ERROR(Alloc(kSmallBatch * QxBytes(qdim), &att_qx_));
    }
  }
  BACKEND_RETURN_IF_ERROR(Alloc(bf, &scores_));
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B), &rms_));
  if (max_rank_ > 0) BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * max_rank_, &pred_h_));
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * c.vocab, &logits_));
  BACKEND_RETURN_IF_ERROR(Alloc(1, &pick_dev_));
  BACKEND_RETURN_IF_ERROR(AllocHost(1, &pick_host_));
  BACKEND_RETURN_IF_ERROR(Alloc(2 * static_cast<size_t>(B), &tokens_dev_));
  positions_dev_ = tokens_dev_ + B;
  BACKEND_RETURN_IF_ERROR(Alloc(F + 1, &hot_list_));
  BACKEND_RETURN_IF_ERROR(Alloc(F + 1, &cold_list_));
  if (share_on_) {
    BACKEND_RETURN_IF_ERROR(AllocHost(1, &share_dev_));
    *share_dev_ = share_num_;
    ev_share_.resize(c.n_layers);
    for (cudaEvent_t& e : ev_share_) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    BACKEND_RETURN_IF_ERROR(Alloc(1, &cold_gpu_count_));
    BACKEND_RETURN_IF_ERROR(Alloc(F + 1, &cold_gpu_list_));
    BACKEND_RETURN_IF_ERROR(Alloc(F, &cold_gate_));
    BACKEND_RETURN_IF_ERROR(Alloc(F, &cold_up_));
    BACKEND_RETURN_IF_ERROR(
        AllocHost(static_cast<size_t>(c.n_layers) * (F + 1), &given_cold_host_));
  }
  // cuBLAS scratch only where batches can exceed the matrix-vector path.
  if (B > kSmallBatch) {
    gemm_.w_half_bytes = w_half;
    if (w_half > 0) {
      uint8_t* p = nullptr;
      BACKEND_RETURN_IF_ERROR(Alloc(w_half, &p));
      gemm_.w_half = p;
    }
    gemm_.x_half_bytes = 2 * static_cast<size_t>(B) * widest * 2;  // hi and lo halves
    uint8_t* p = nullptr;
    BACKEND_RETURN_IF_ERROR(Alloc(gemm_.x_half_bytes, &p));
    gemm_.x_half = p;
  }

  BACKEND_RETURN_IF_ERROR(AllocHost(2 * static_cast<size_t>(B), &tokens_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers) * (F + 1), &given_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers) * 2, &counts_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(F, &cold_idx_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(bh, &x_host_));
  // Room for a single token's kMaxColdParts partial sums (ColdParts) as well as a batch.
  BACKEND_RETURN_IF_ERROR(
      AllocHost(std::max(bh, static_cast<size_t>(kMaxColdParts) * H), &out_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(F, &active_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers), &cold_ready_));
  std::fill(cold_ready_, cold_ready_ + c.n_layers, 0);
  BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers) * (F + 1), &observed_host_));

  for (auto* v : {&ev_x_, &ev_hot0_, &ev_hot1_, &ev_attn0_, &ev_signal_}) {
    v->resize(c.n_layers);
    for (cudaEvent_t& e : *v) CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  }
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev_start_));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev_layers_end_));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev_join_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&publish_stream_, cudaStreamNonBlocking));
  if (guess_on_ && max_rank_ > 0) {
    BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers), &guess_shift_));
    std::fill(guess_shift_, guess_shift_ + c.n_layers, guess_initial_shift_);
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(H), &guess_x_));
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(max_rank_), &guess_h_));
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(F), &guess_scores_));
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(F) + 1, &guess_list_));
    BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers) * (F + 1), &guess_host_));
    guess_ids_.reserve(F);
    guess_mark_.assign(F, 0);
    ev_guess_.resize(c.n_layers);
    for (cudaEvent_t& e : ev_guess_) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    for (cudaEvent_t* e : {&ev_gfork_, &ev_gjoin_}) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
    int least = 0, greatest = 0;
    CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithPriority(&guess_stream_, cudaStreamNonBlocking, greatest));
  } else {
    guess_on_ = false;  // no predictors to guess with
  }
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return Ok();
}

BackendStatus CudaBackend::NewLane(Backend** out) {
  *out = nullptr;
  if (is_lane_) {
    return Error(Code::kFailedPrecondition,
                 "a lane makes no lanes: ask the backend it came from, which counts them");
  }
  if (lanes_made_ + 1 >= kMaxLanes) {
    return Error(Code::kResourceExhausted,
                 "at most " + std::to_string(kMaxLanes) + " lanes share a model's weights");
  }
  for (const DeviceLayer& L : layers_) {
    if (L.n_cache > 0) {
      return Error(Code::kFailedPrecondition,
                   "a model with adaptive cache rows has no lanes: SetCacheSlots changes what "
                   "every lane's steps read");
    }
  }
  auto lane = std::make_unique<CudaBackend>();
  BACKEND_RETURN_IF_ERROR(lane->InitLane(*this));
  *out = lane.release();
  ++lanes_made_;
  return Ok();
}

BackendStatus CudaBackend::InitLane(const CudaBackend& base) {
  is_lane_ = true;
  dims_ = base.dims_;
  max_ctx_ = base.max_ctx_;
  max_seqs_ = base.max_seqs_;
  // Lanes take decode steps: scratch for the matrix-vector path's 8 tokens only (no cuBLAS
  // scratch): about 1 MB with a 32,000-token vocabulary, where 128 tokens' logits alone take 16.
  max_batch_ = std::min(base.max_batch_, kSmallBatch);
  device_ = base.device_;
  device_name_ = base.device_name_;
  // Shared: the weights (device pointers in these structs, owned by base), the KV cache, and the
  // pinned cold rows of the GPU's cold share.
  tok_embeddings_ = base.tok_embeddings_;
  output_ = base.output_;
  output_norm_ = base.output_norm_;
  inv_freq_ = base.inv_freq_;
  layers_ = base.layers_;
  kv_layers_ = base.kv_layers_;
  k_cache_ = base.k_cache_;
  v_cache_ = base.v_cache_;
  max_rank_ = base.max_rank_;
  widest_ = base.widest_;
  w_half_ = base.w_half_;
  // The settings Create read.
  use_graphs_ = base.use_graphs_;
  step_graph_ = base.step_graph_;
  early_publish_ = base.early_publish_;
  zero_copy_cold_ = base.zero_copy_cold_;
  cold_parts_ = base.cold_parts_;
  prelaunch_ = base.prelaunch_;
  collect_gpu_times_ = base.collect_gpu_times_;
  share_on_ = base.share_on_;
  share_adaptive_ = base.share_adaptive_;
  share_num_ = base.share_num_;
  guess_on_ = base.guess_on_;
  guess_recall_ = base.guess_recall_;
  guess_initial_shift_ = base.guess_initial_shift_;
  return AllocateScratch();
}

BackendStatus CudaBackend::Proj(const DeviceMatrix& w, const float* x, int n, float* y, int ldy,
                                const void* x_qx) {
  if (n <= kSmallBatch) {
    CUDA_RETURN_IF_ERROR(
        MatVecRows(w, nullptr, static_cast<int>(w.rows), nullptr, x, n, y, ldy, stream_, x_qx));
    return Ok();
  }
  const int rc = GemmXWt(cublas_, w, x, n, y, ldy, 0.f, gemm_, stream_);
  if (rc != 0) return Error(Code::kInternal, std::string("cuBLAS: ") + GemmErrorString(rc));
  return Ok();
}

// Inside a stream capture a plain cudaEventRecord only orders streams; the External flag makes it
// a node that records the event on every replay, so the host can wait on it.
cudaError_t CudaBackend::RecordEvent(cudaEvent_t e, cudaStream_t s) {
  if (s == nullptr) s = stream_;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(s, &capturing);
  if (err != cudaSuccess) return err;
  if (capturing == cudaStreamCaptureStatusActive) {
    return cudaEventRecordWithFlags(e, s, cudaEventRecordExternal);
  }
  return cudaEventRecord(e, s);
}

BackendStatus CudaBackend::PrepareLayer(int l, const ForwardArgs& a) {
  const DeviceLayer& L = layers_[l];
  if (L.ffn == FfnPlacement::kNone) {
    return Error(Code::kFailedPrecondition, "layer " + std::to_string(l) + " is not on the GPU");
  }
  if (L.ffn == FfnPlacement::kDense) return Ok();
  const FfnMode mode = EffectiveMode(a);
  if (mode == FfnMode::kPredicted && L.fc1.data == nullptr) {
    return Error(Code::kFailedPrecondition, "layer " + std::to_string(l) + " has no predictor");
  }
  const int F = dims_.ffn, n_hot = L.n_hot + (UsesCache(L, a) ? L.n_cache : 0);
  if (mode == FfnMode::kGiven && L.n_cache > 0 && a.n > kSmallBatch && cache_loaded_) {
    // The cuBLAS path computes every row it holds; slots being loaded or holding evicted
    // neurons would be counted twice.
    return Error(Code::kFailedPrecondition,
                 "kGiven batches over " + std::to_string(kSmallBatch) +
                     " tokens cannot use the adaptive cache once slots are loaded");
  }
  if (mode == FfnMode::kGiven && n_hot > 0) {
    if (a.given_hot == nullptr || static_cast<int>(a.given_hot->size()) <= l) {
      return Error(Code::kInvalidArgument, "kGiven needs given_hot for every layer");
    }
    const std::vector<int32_t>& g = (*a.given_hot)[l];
    if (static_cast<int>(g.size()) > n_hot) {
      return Error(Code::kInvalidArgument, "given_hot lists more rows than the layer holds");
    }
    // Staged in pinned memory; the copy to the GPU (fixed size, so a graph can replay it) is
    // part of the layer's GPU work.
    int32_t* stage = given_host_ + static_cast<size_t>(l) * (F + 1);
    stage[0] = static_cast<int32_t>(g.size());
    std::memcpy(stage + 1, g.data(), g.size() * 4);
    counts_host_[2 * l] = static_cast<int32_t>(g.size());
  }
  if (mode == FfnMode::kGiven && a.cold != nullptr &&
      (a.given_cold == nullptr || static_cast<int>(a.given_cold->size()) <= l)) {
    return Error(Code::kInvalidArgument, "kGiven needs given_cold for every layer");
  }
  if (mode == FfnMode::kGiven && a.cold != nullptr && SharesCold(L, a)) {
    // The GPU's part of the given cold list, as positions in the pinned cold rows.
    const std::vector<int32_t>& g = (*a.given_cold)[l];
    int32_t* stage = given_cold_host_ + static_cast<size_t>(l) * (F + 1);
    const int n_gpu = GpuShare(static_cast<int>(g.size()));
    stage[0] = n_gpu;
    for (int i = 0; i < n_gpu; ++i) {
      auto it = std::lower_bound(L.cold_ids_host.begin(), L.cold_ids_host.end(), g[i]);
      if (it == L.cold_ids_host.end() || *it != g[i]) {
        return Error(Code::kInvalidArgument, "given_cold lists neuron " + std::to_string(g[i]) +
                                                 ", not a cold neuron of layer " +
                                                 std::to_string(l));
      }
      stage[1 + i] = static_cast<int32_t>(it - L.cold_ids_host.begin());
    }
  }
  if (a.n > kSmallBatch || n_hot == 0) counts_host_[2 * l] = n_hot;
  if (StreamsLayer(l, a)) counts_host_[2 * l + 1] = 0;
  return Ok();
}

BackendStatus CudaBackend::LaunchLayer(int l, const ForwardArgs& a, float* exchange_x,
                                       const float* exchange_out, bool wait_cold) {
  BACKEND_RETURN_IF_ERROR(PrepareLayer(l, a));
  const DeviceLayer& L = layers_[l];
  const bool cold = CallsColdSide(l, a);
  const float* pend1 = pending1_;
  const float* pend2 = wait_cold ? ColdInput(exchange_out, a.n) : pending2_;
  auto enqueue = [&]() -> BackendStatus {
    if (wait_cold) BACKEND_RETURN_IF_ERROR(EnqueueColdWait(l - 1, exchange_out, a.n));
    return EnqueueLayer(l, a, pend1, pend2, cold, exchange_x);
  };
  if (use_graphs_ && a.n == 1) {
    // Decode steps replay one captured graph per layer: one launch instead of about twenty.
    const std::vector<int64_t> key = {
        l,
        a.seq,
        static_cast<int>(EffectiveMode(a)),
        a.run_predictors ? 1 : 0,
        pend1 != nullptr,
        static_cast<int64_t>(reinterpret_cast<uintptr_t>(pend2)),
        cold ? 1 : 0,
        static_cast<int64_t>(reinterpret_cast<uintptr_t>(cold ? exchange_x : nullptr)),
        collect_gpu_times_ ? 1 : 0,
        ObservesActive(a) ? 1 : 0,
        SharesCold(L, a) ? 1 : 0,
        static_cast<int64_t>(reinterpret_cast<uintptr_t>(wait_cold ? exchange_out : nullptr)),
        GuessMade(l, a) ? 1 : 0,
        GuessMade(l + 1, a) ? 1 : 0};
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      cudaGraph_t graph = nullptr;
      CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
      BackendStatus st = enqueue();
      cudaError_t end = cudaStreamEndCapture(stream_, &graph);
      if (!st.ok()) {
        if (graph != nullptr) cudaGraphDestroy(graph);
        return st;
      }
      CUDA_RETURN_IF_ERROR(end);
      cudaGraphExec_t exec = nullptr;
      // Node priorities: the cold guess's branch keeps its stream's (ModelUpload::cold_guess).
      cudaError_t inst =
          cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
      cudaGraphDestroy(graph);
      CUDA_RETURN_IF_ERROR(inst);
      it = graphs_.emplace(key, exec).first;
    }
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, stream_));
  } else {
    BACKEND_RETURN_IF_ERROR(enqueue());
  }
  pending1_ = hot_out_;
  pending2_ = nullptr;
  return Ok();
}

BackendStatus CudaBackend::RunLayer(int l, const ForwardArgs& a, float* exchange_x,
                                    float* exchange_out, int32_t* exchange_active) {
  BACKEND_RETURN_IF_ERROR(LaunchLayer(l, a, exchange_x, exchange_out, /*wait_cold=*/false));
  if (!CallsColdSide(l, a)) return Ok();
  return FinishCold(l, a, exchange_x, exchange_out, exchange_active, /*signal=*/false);
}

BackendStatus CudaBackend::EnqueueColdWait(int l, const float* exchange_out, int n) {
  if (ColdParts(exchange_out, n)) {
    // The signal's value is the callback's part count (FinishCold).
    CUDA_RETURN_IF_ERROR(WaitHostFlag(cold_ready_ + l, stream_, parts_count_dev_));
    if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_signal_[l]));
    CUDA_RETURN_IF_ERROR(
        SumParts(exchange_out, dims_.hidden, parts_count_dev_, 0, cold_in_, stream_));
    return Ok();
  }
  CUDA_RETURN_IF_ERROR(WaitHostFlag(cold_ready_ + l, stream_));
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_signal_[l]));
  const float* in = ColdInput(exchange_out, n);
  if (in != exchange_out) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(cold_in_, exchange_out,
                                         static_cast<size_t>(n) * dims_.hidden * 4,
                                         cudaMemcpyHostToDevice, stream_));
  }
  return Ok();
}

BackendStatus CudaBackend::RunLayersQueued(const ForwardArgs& a, int layer_end, float* exchange_x,
                                           float* exchange_out, int32_t* exchange_active) {
  // One layer ahead: the next layer is queued (waiting for this one's signal) before this one's
  // callback runs. Not more: a launch blocks once the device's queue is full, and with every
  // layer of a 40-layer step queued at once the host sat in a launch while the GPU waited for a
  // signal the host had not sent.
  guess_layer_ = -1;
  BackendStatus st = LaunchLayer(a.layer_begin, a, exchange_x, exchange_out, false);
  for (int l = a.layer_begin; st.ok() && l < layer_end; ++l) {
    const bool cold = CallsColdSide(l, a);
    if (l + 1 < layer_end) {
      const double t0 = Now();
      st = LaunchLayer(l + 1, a, exchange_x, exchange_out, cold);
      stats_.host_launch += Now() - t0;
    } else if (cold) {
      // The last contribution joins the residual after the loop (Forward).
      st = EnqueueColdWait(l, exchange_out, a.n);
      pending2_ = ColdInput(exchange_out, a.n);
    }
    int n_guess = 0;
    if (st.ok() && cold && GuessMade(l, a)) {
      // Made while the previous layer's cold part was computed: normally there already.
      const double tg = Now();
      const cudaError_t e = cudaEventSynchronize(ev_guess_[l]);
      stats_.guess_wait += Now() - tg;
      if (e == cudaSuccess) {
        n_guess = TakeGuess(l);
      } else {
        st = CudaError(e, "cudaEventSynchronize(ev_guess_[l])", __LINE__);
      }
    }
    if (st.ok() && cold) {
      const double t0 = Now();
      // Layer l's attention runs meanwhile (layer l + 1 is queued).
      ColdGuess guess;
      if (n_guess > 0) guess = {guess_ids_.data(), guess_first_.data(), n_guess};
      a.cold->Ahead(l, guess, [&] { return cudaEventQuery(ev_x_[l]) != cudaErrorNotReady; });
      stats_.cold_ahead += Now() - t0;
      st = FinishCold(l, a, exchange_x, exchange_out, exchange_active, /*signal=*/true);
    }
  }
  if (st.ok()) return st;
  // Release every wait the queued work may still hold, let it drain, and leave no signal behind
  // for the next step (a layer whose wait was never queued keeps its flag set until here).
  for (int l = 0; l < dims_.n_layers; ++l) __atomic_store_n(cold_ready_ + l, 1, __ATOMIC_RELEASE);
  cudaStreamSynchronize(stream_);
  for (int l = 0; l < dims_.n_layers; ++l) __atomic_store_n(cold_ready_ + l, 0, __ATOMIC_RELEASE);
  return st;
}

BackendStatus CudaBackend::EnqueueLayer(int l, const ForwardArgs& a, const float* pend1,
                                        const float* pend2, bool cold, float* exchange_x) {
  const ModelDims& c = dims_;
  const DeviceLayer& L = layers_[l];
  const int n = a.n, H = c.hidden, F = c.ffn;
  const int64_t nh = static_cast<int64_t>(n) * H;
  const int qdim = c.n_heads * c.head_dim, kvdim = c.n_kv_heads * c.head_dim;
  const ActKind act = static_cast<ActKind>(c.activation);

  // Attention block; new keys and values go straight into the cache.
  const size_t slot = (static_cast<size_t>(L.kv_index) * max_seqs_ + a.seq) * max_ctx_;
  float* k_seq = k_cache_ + slot * kvdim;  // [max_ctx, kv_dim]
  float* v_seq = v_cache_ + slot * kvdim;
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_attn0_[l]));
  if (FusesNorms(L, n, pend2)) return EnqueueDenseLayerFused(l, pend1, k_seq, v_seq);
  // The previous layer's FFN output joins the residual inside this norm.
  if (pend1 != nullptr) {
    CUDA_RETURN_IF_ERROR(
        ResidualRmsNorm(x_, pend1, pend2, L.attn_norm, n, H, c.norm_eps, xb_, stream_, XbQx(n)));
  } else {
    CUDA_RETURN_IF_ERROR(RmsNorm(x_, L.attn_norm, n, H, c.norm_eps, xb_, stream_, XbQx(n)));
  }
  BACKEND_RETURN_IF_ERROR(Proj(L.wqkv, xb_, n, qkv_, qdim + 2 * kvdim, XbQx(n)));  // [n, q + 2 kv]
  CUDA_RETURN_IF_ERROR(RopeQkvToCache(qkv_, n, c.n_heads, c.n_kv_heads, c.head_dim, positions_dev_,
                                      inv_freq_, c.rope_interleaved, q_, k_seq, v_seq,
                                      stream_));  // q: [n, q_dim]; k, v into the cache
  CUDA_RETURN_IF_ERROR(AttentionAt(q_, k_seq, v_seq, n, positions_dev_, max_ctx_, c.n_heads,
                                   c.n_kv_heads, c.head_dim, att_, stream_,
                                   AttQx(n)));                     // [n, q_dim]
  BACKEND_RETURN_IF_ERROR(Proj(L.wo, att_, n, xb_, H, AttQx(n)));  // xb: [n, hidden]

  // FFN block: x += attention output, xb = the FFN input.
  CUDA_RETURN_IF_ERROR(ResidualRmsNorm(x_, xb_, nullptr, L.ffn_norm, n, H, c.norm_eps, xb_, stream_,
                                       XbQx(n), L.pred_rms ? rms_ : nullptr));
  const bool early = cold && early_publish_;
  if (early) {
    // The cold side's input on its way to the host while the predictor runs.
    CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_fork_, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(publish_stream_, ev_fork_, 0));
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(exchange_x, xb_, nh * 4, cudaMemcpyDeviceToHost, publish_stream_));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_join_, publish_stream_));
  }
  if (L.ffn == FfnPlacement::kDense) {
    if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot0_[l]));
    BACKEND_RETURN_IF_ERROR(Proj(L.gate_up, xb_, n, gate_, 2 * F, XbQx(n)));  // [n, 2 ffn]
    CUDA_RETURN_IF_ERROR(
        GatedActivationPacked(act, gate_, n, F, up_, stream_, UpQx(n)));  // [n, ffn]
    BACKEND_RETURN_IF_ERROR(Proj(L.down, up_, n, hot_out_, H, UpQx(n)));  // [n, hidden]
    if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot1_[l]));
    return Ok();
  }

  // kGiven decode steps also address the adaptive cache slots after the hot rows.
  const bool use_cache = UsesCache(L, a);
  const int n_hot = L.n_hot + (use_cache ? L.n_cache : 0);
  const int n_cold = static_cast<int>(L.cold_ids_host.size());
  const DeviceMatrix& G = use_cache ? L.gate_c : L.gate;
  const DeviceMatrix& U = use_cache ? L.up_c : L.up;
  const DeviceMatrix& Dt = use_cache ? L.down_t_c : L.down_t;
  const bool small = n <= kSmallBatch;
  int32_t* hot_count = hot_list_;
  int32_t* hot_idx_ = hot_list_ + 1;
  int32_t* cold_count = cold_list_;
  int32_t* cold_idx_ = cold_list_ + 1;
  const FfnMode mode = EffectiveMode(a);

  // Predictors: scores: [n, ffn] = fc2(relu(fc1(x))).
  if (L.fc1.data != nullptr &&
      (mode == FfnMode::kPredicted || (mode == FfnMode::kGiven && a.run_predictors))) {
    const int rank = static_cast<int>(L.fc1.rows);
    BACKEND_RETURN_IF_ERROR(Proj(L.fc1, xb_, n, pred_h_, rank, XbQx(n)));
    CUDA_RETURN_IF_ERROR(Relu(pred_h_, static_cast<int64_t>(n) * rank, stream_));
    BACKEND_RETURN_IF_ERROR(Proj(L.fc2, pred_h_, n, scores_, F));
  }
  const float* score_scale = L.pred_rms ? rms_ : nullptr;  // [n] rms(residual), pre-norm scores
  // With the cache, the maps route a cached neuron to its slot and keep it off the cold list.
  auto compact_hot = [&]() -> BackendStatus {
    CUDA_RETURN_IF_ERROR(CompactActive(scores_, n, F, use_cache ? L.hot_map_c : L.hot_ids, n_hot,
                                       L.pred_cut, hot_idx_, hot_count, stream_, score_scale));
    if (ObservesActive(a)) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(observed_host_ + static_cast<size_t>(l) * (F + 1),
                                           hot_list_, (static_cast<size_t>(n_hot) + 1) * 4,
                                           cudaMemcpyDeviceToHost, stream_));
    }
    return Ok();
  };
  if (mode == FfnMode::kPredicted) {
    if (n_hot > 0 && !early) BACKEND_RETURN_IF_ERROR(compact_hot());
    if (cold) {
      CUDA_RETURN_IF_ERROR(CompactActive(scores_, n, F, use_cache ? L.cold_map_c : L.cold_ids,
                                         n_cold, L.pred_cut, cold_idx_, cold_count, stream_,
                                         score_scale));
      if (SharesCold(L, a)) {
        CUDA_RETURN_IF_ERROR(
            ShareOfCount(cold_count, share_dev_, kShareDen, cold_gpu_count_, stream_));
      }
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(cold_idx_host_, cold_idx_, n_cold * 4, cudaMemcpyDeviceToHost, stream_));
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(counts_host_ + 2 * l + 1, cold_count, 4,
                                           cudaMemcpyDeviceToHost, stream_));
    }
  } else if (mode == FfnMode::kGiven && n_hot > 0) {
    const int32_t* stage = given_host_ + static_cast<size_t>(l) * (F + 1);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(hot_list_, stage, (static_cast<size_t>(n_hot) + 1) * 4,
                                         cudaMemcpyHostToDevice, stream_));
  }

  // Publish the FFN input for the cold side before the hot work, so both run at once.
  if (cold) {
    if (early) {
      CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ev_join_, 0));
    } else {
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(exchange_x, xb_, nh * 4, cudaMemcpyDeviceToHost, stream_));
    }
    CUDA_RETURN_IF_ERROR(RecordEvent(ev_x_[l]));
  }
  if (mode == FfnMode::kPredicted && n_hot > 0 && early) BACKEND_RETURN_IF_ERROR(compact_hot());
  if (GuessMade(l + 1, a)) {
    // The next layer's guess beside this layer's hot rows: x_ is final until the next layer.
    CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_gfork_, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(guess_stream_, ev_gfork_, 0));
    CUDA_RETURN_IF_ERROR(
        RmsNorm(x_, layers_[l + 1].ffn_norm, 1, H, c.norm_eps, guess_x_, guess_stream_));
    BACKEND_RETURN_IF_ERROR(EnqueueGuessChain(l + 1, a));
  }

  // Hot rows.
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot0_[l]));
  if (n_hot > 0) {
    if (small) {
      float* coef = nullptr;  // [n, n_hot] activations of the listed rows
      if (mode == FfnMode::kExact) {
        // The gate decides: every hot gate row, then up and down for the active ones only.
        CUDA_RETURN_IF_ERROR(
            MatVecRows(G, nullptr, n_hot, nullptr, xb_, n, gate_, n_hot, stream_, XbQx(n)));
        const float threshold = act == ActKind::kSilu ? -INFINITY : 0.f;
        CUDA_RETURN_IF_ERROR(CompactActive(gate_, n, n_hot, nullptr, n_hot, threshold, hot_idx_,
                                           hot_count, stream_));
        CUDA_RETURN_IF_ERROR(
            MatVecRows(U, hot_idx_, n_hot, hot_count, xb_, n, up_, n_hot, stream_, XbQx(n)));
        CUDA_RETURN_IF_ERROR(GatherGatedActivation(act, gate_, n_hot, hot_idx_, n_hot, hot_count,
                                                   up_, n_hot, n, stream_));
        coef = up_;
      } else {
        CUDA_RETURN_IF_ERROR(
            MatVecRows(G, hot_idx_, n_hot, hot_count, xb_, n, gate_, n_hot, stream_, XbQx(n)));
        CUDA_RETURN_IF_ERROR(
            MatVecRows(U, hot_idx_, n_hot, hot_count, xb_, n, up_, n_hot, stream_, XbQx(n)));
        // Elements past the count are stale and never read.
        CUDA_RETURN_IF_ERROR(
            GatedActivation(act, gate_, up_, static_cast<int64_t>(n) * n_hot, stream_));
        coef = gate_;
      }
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(hot_out_, 0, nh * 4, stream_));
      CUDA_RETURN_IF_ERROR(
          AccumulateRows(Dt, hot_idx_, n_hot, hot_count, coef, n_hot, n, hot_out_, stream_));
      if (mode != FfnMode::kGiven) {
        CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(counts_host_ + 2 * l, hot_count, 4, cudaMemcpyDeviceToHost, stream_));
      }
    } else {
      // Prompt batches: every hot row through cuBLAS (a superset of any active set).
      int rc = GemmXWt(cublas_, G, xb_, n, gate_, n_hot, 0.f, gemm_, stream_);
      if (rc == 0) rc = GemmXWt(cublas_, U, xb_, n, up_, n_hot, 0.f, gemm_, stream_);
      if (rc != 0) return Error(Code::kInternal, std::string("cuBLAS: ") + GemmErrorString(rc));
      CUDA_RETURN_IF_ERROR(
          GatedActivation(act, gate_, up_, static_cast<int64_t>(n) * n_hot, stream_));
      rc = GemmAW(cublas_, Dt, gate_, n_hot, n, hot_out_, 0.f, gemm_, stream_);
      if (rc != 0) return Error(Code::kInternal, std::string("cuBLAS: ") + GemmErrorString(rc));
    }
  } else {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(hot_out_, 0, nh * 4, stream_));
  }
  if (StreamsLayer(l, a)) BACKEND_RETURN_IF_ERROR(StreamCold(l, n));
  if (cold && SharesCold(L, a)) {
    // The GPU's share of the cold neurons, rows read from pinned host memory over PCIe while the
    // callback computes the rest: gate and up products, activation, down rows into hot_out_.
    const int32_t* list = cold_idx_;
    const int32_t* count = cold_gpu_count_;
    if (mode == FfnMode::kGiven) {
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(cold_gpu_list_, given_cold_host_ + static_cast<size_t>(l) * (F + 1),
                          (static_cast<size_t>(n_cold) + 1) * 4, cudaMemcpyHostToDevice, stream_));
      list = cold_gpu_list_ + 1;
      count = cold_gpu_list_;
    }
    const ColdRows& R = L.cold_rows;
    const DeviceMatrix cg{R.type, R.rows, R.cols, R.gate};
    const DeviceMatrix cu{R.type, R.rows, R.cols, R.up};
    const DeviceMatrix cd{R.type, R.rows, R.cols, R.down_t};
    CUDA_RETURN_IF_ERROR(MatVecRows(cg, list, n_cold, count, xb_, 1, cold_gate_, n_cold, stream_));
    CUDA_RETURN_IF_ERROR(MatVecRows(cu, list, n_cold, count, xb_, 1, cold_up_, n_cold, stream_));
    CUDA_RETURN_IF_ERROR(GatedActivation(act, cold_gate_, cold_up_, n_cold, stream_));
    CUDA_RETURN_IF_ERROR(
        AccumulateRows(cd, list, n_cold, count, cold_gate_, n_cold, 1, hot_out_, stream_));
    CUDA_RETURN_IF_ERROR(RecordEvent(ev_share_[l]));
  }
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot1_[l]));
  if (GuessMade(l + 1, a)) {
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ev_gjoin_, 0));  // the branch forked here
  }
  return Ok();
}

BackendStatus CudaBackend::EnqueueGuessChain(int l, const ForwardArgs& a) {
  const DeviceLayer& L = layers_[l];
  const int F = dims_.ffn;
  const int n_cold = static_cast<int>(L.cold_ids_host.size());
  const int rank = static_cast<int>(L.fc1.rows);
  CUDA_RETURN_IF_ERROR(
      MatVecRows(L.fc1, nullptr, rank, nullptr, guess_x_, 1, guess_h_, rank, guess_stream_));
  CUDA_RETURN_IF_ERROR(Relu(guess_h_, rank, guess_stream_));
  CUDA_RETURN_IF_ERROR(MatVecRows(L.fc2, nullptr, F, nullptr, guess_h_, 1, guess_scores_, F,
                                  guess_stream_));  // [ffn]
  CUDA_RETURN_IF_ERROR(CompactActive(
      guess_scores_, 1, F, UsesCache(L, a) ? L.cold_map_c : L.cold_ids, n_cold, L.pred_cut,
      guess_list_ + 1, guess_list_, guess_stream_, nullptr, guess_shift_ + l,
      /*mark_unshifted=*/true));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(guess_host_ + static_cast<size_t>(l) * (F + 1), guess_list_,
                                       (static_cast<size_t>(n_cold) + 1) * 4,
                                       cudaMemcpyDeviceToHost, guess_stream_));
  CUDA_RETURN_IF_ERROR(RecordEvent(ev_guess_[l], guess_stream_));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_gjoin_, guess_stream_));
  return Ok();
}

BackendStatus CudaBackend::EnqueueDenseLayerFused(int l, const float* pend1, float* k_seq,
                                                  float* v_seq) {
  // EnqueueLayer's dense decode path with each norm inside the product that consumes it.
  const ModelDims& c = dims_;
  const DeviceLayer& L = layers_[l];
  const int H = c.hidden, F = c.ffn;
  // x_alt = x + the previous layer's FFN output; qkv: [1, q + 2 kv] = wqkv * norm(x_alt), and
  // RoPE and the cache write where the product writes its rows.
  if (RopeInProduct()) {
    RopeOut rope;
    rope.n_heads = c.n_heads;
    rope.n_kv_heads = c.n_kv_heads;
    rope.head_dim = c.head_dim;
    rope.positions = positions_dev_;
    rope.cos_sin = rope_cos_sin_;
    rope.interleaved = c.rope_interleaved;
    rope.q = q_;
    rope.k_cache = k_seq;
    rope.v_cache = v_seq;
    CUDA_RETURN_IF_ERROR(
        NormMatVecRope(L.wqkv, x_, pend1, nullptr, L.attn_norm, c.norm_eps, x_alt_, rope, stream_));
  } else {
    CUDA_RETURN_IF_ERROR(
        NormMatVec(L.wqkv, x_, pend1, nullptr, L.attn_norm, c.norm_eps, x_alt_, qkv_, stream_));
    CUDA_RETURN_IF_ERROR(RopeQkvToCache(qkv_, 1, c.n_heads, c.n_kv_heads, c.head_dim,
                                        positions_dev_, inv_freq_, c.rope_interleaved, q_, k_seq,
                                        v_seq, stream_));
  }
  CUDA_RETURN_IF_ERROR(AttentionAt(q_, k_seq, v_seq, 1, positions_dev_, max_ctx_, c.n_heads,
                                   c.n_kv_heads, c.head_dim, att_, stream_, AttQx(1)));
  BACKEND_RETURN_IF_ERROR(Proj(L.wo, att_, 1, xb_, H, AttQx(1)));  // xb: [1, hidden]
  // x = x_alt + attention output; gate: [1, 2 ffn] = gate_up * norm(x); up: [1, ffn] =
  // act(gate) * up, applied where the product writes its rows.
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot0_[l]));
  const ActKind act = static_cast<ActKind>(c.activation);
  if (ActivationInProduct()) {
    CUDA_RETURN_IF_ERROR(NormMatVecGated(L.gate_up, x_alt_, xb_, nullptr, L.ffn_norm, c.norm_eps,
                                         x_, act, up_, UpQx(1), stream_));
  } else {
    CUDA_RETURN_IF_ERROR(
        NormMatVec(L.gate_up, x_alt_, xb_, nullptr, L.ffn_norm, c.norm_eps, x_, gate_, stream_));
    CUDA_RETURN_IF_ERROR(GatedActivationPacked(act, gate_, 1, F, up_, stream_, UpQx(1)));
  }
  BACKEND_RETURN_IF_ERROR(Proj(L.down, up_, 1, hot_out_, H, UpQx(1)));  // [1, hidden]
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot1_[l]));
  return Ok();
}

bool CudaBackend::UsesStepGraph(const ForwardArgs& a, int layer_end) const {
  if (!use_graphs_ || !step_graph_ || a.n != 1 || collect_gpu_times_ || a.hidden_in != nullptr ||
      a.hidden_out != nullptr) {
    return false;
  }
  for (int l = a.layer_begin; l < layer_end; ++l) {
    const DeviceLayer& L = layers_[l];
    if (L.ffn == FfnPlacement::kHot && a.cold != nullptr && !L.cold_ids_host.empty()) {
      return false;
    }
  }
  return true;
}

BackendStatus CudaBackend::RunStepGraph(const ForwardArgs& a, int layer_end, bool head) {
  for (int l = a.layer_begin; l < layer_end; ++l) BACKEND_RETURN_IF_ERROR(PrepareLayer(l, a));
  const std::vector<int64_t> key = {-1,
                                    a.seq,
                                    static_cast<int>(EffectiveMode(a)),
                                    a.run_predictors ? 1 : 0,
                                    a.layer_begin,
                                    layer_end,
                                    head ? 1 : 0};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    cudaGraph_t graph = nullptr;
    CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    BackendStatus st = EnqueueStep(a, layer_end, head);
    cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    if (!st.ok()) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      return st;
    }
    CUDA_RETURN_IF_ERROR(end);
    cudaGraphExec_t exec = nullptr;
    cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_RETURN_IF_ERROR(inst);
    it = graphs_.emplace(key, exec).first;
  }
  CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, stream_));
  return Ok();
}

BackendStatus CudaBackend::EnqueueStep(const ForwardArgs& a, int layer_end, bool head) {
  const int H = dims_.hidden;
  CUDA_RETURN_IF_ERROR(Embed(tok_embeddings_, tokens_dev_, 1, x_, stream_));  // x: [1, hidden]
  const float* pend = nullptr;
  for (int l = a.layer_begin; l < layer_end; ++l) {
    BACKEND_RETURN_IF_ERROR(EnqueueLayer(l, a, pend, nullptr, /*cold=*/false, nullptr));
    pend = hot_out_;
  }
  if (head && x_alt_ != nullptr && NormMatVecFits(output_)) {
    // Nothing reads the residual after the step graph (it has no hidden_out), so it is not kept.
    CUDA_RETURN_IF_ERROR(NormMatVec(output_, x_, pend, nullptr, output_norm_, dims_.norm_eps,
                                    nullptr, logits_, stream_));  // [1, vocab]
    return Ok();
  }
  if (pend != nullptr) CUDA_RETURN_IF_ERROR(AddInPlace(x_, pend, H, stream_));
  if (head) {
    CUDA_RETURN_IF_ERROR(RmsNorm(x_, output_norm_, 1, H, dims_.norm_eps, xb_, stream_, XbQx(1)));
    BACKEND_RETURN_IF_ERROR(Proj(output_, xb_, 1, logits_, dims_.vocab, XbQx(1)));  // [1, vocab]
  }
  return Ok();
}

int CudaBackend::TakeGuess(int l) {
  const DeviceLayer& L = layers_[l];
  const int32_t* slot = guess_host_ + static_cast<size_t>(l) * (dims_.ffn + 1);
  const int count = std::clamp(slot[0], 0, static_cast<int>(L.cold_ids_host.size()));
  if (++guess_epoch_ == 0) {  // wrapped: old marks could read as current
    std::fill(guess_mark_.begin(), guess_mark_.end(), 0);
    guess_epoch_ = 1;
  }
  guess_ids_.resize(count);
  guess_first_.resize(count);
  for (int i = 0; i < count; ++i) {
    const uint32_t entry = static_cast<uint32_t>(slot[1 + i]);
    const int32_t id = L.cold_ids_host[entry & ~kAboveBit];
    guess_ids_[i] = id;
    guess_mark_[id] = guess_epoch_;
    guess_first_[i] = (entry & kAboveBit) != 0;
    stats_.guess_first += guess_first_[i];
  }
  guess_layer_ = l;
  stats_.guess_rows += count;
  return count;
}

void CudaBackend::ScoreGuess(int l, const int32_t* actual, int count, bool adapt) {
  guess_layer_ = -1;
  int hits = 0;
  for (int i = 0; i < count; ++i) hits += guess_mark_[actual[i]] == guess_epoch_;
  stats_.guess_hits += hits;
  stats_.guess_actual += count;
  if (!adapt || count == 0) return;
  // Stochastic quantile tracking: a missed neuron raises the cut's shift by kEta * recall, a held
  // one lowers it by kEta * (1 - recall), so it rests where the guess holds `recall` of the list.
  constexpr double kEta = 0.1, kMaxShift = 30;
  const double r = guess_recall_, miss = static_cast<double>(count - hits) / count;
  const double step = kEta * (miss * r - (1 - miss) * (1 - r));
  guess_shift_[l] = static_cast<float>(std::clamp(guess_shift_[l] + step, -kMaxShift, kMaxShift));
}

BackendStatus CudaBackend::FinishCold(int l, const ForwardArgs& a, float* exchange_x,
                                      float* exchange_out, int32_t* exchange_active, bool signal) {
  // The cold side runs while the GPU works on the hot rows.
  const DeviceLayer& L = layers_[l];
  const int n = a.n;
  const int64_t nh = static_cast<int64_t>(n) * dims_.hidden;
  const FfnMode mode = EffectiveMode(a);
  double t0 = Now();
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ev_x_[l]));
  double t1 = Now();
  stats_.wait_for_x += t1 - t0;
  ColdRequest req;
  req.layer = l;
  req.n = n;
  req.x = exchange_x;
  req.out = exchange_out;
  const bool parts_mode = ColdParts(exchange_out, n);
  int parts = 0;
  if (parts_mode) {
    req.max_parts = kMaxColdParts;
    req.parts = &parts;
  }
  // With cold_gpu_share the GPU has taken the first GpuShare(count) neurons of the list.
  const bool shared = SharesCold(L, a);
  if (mode == FfnMode::kPredicted) {
    const int count = counts_host_[2 * l + 1];
    for (int i = 0; i < count; ++i) exchange_active[i] = L.cold_ids_host[cold_idx_host_[i]];
    if (ObservesActive(a)) (*a.active_out)[l].assign(exchange_active, exchange_active + count);
    if (guess_layer_ == l) ScoreGuess(l, exchange_active, count, guess_recall_ > 0);
    const int n_gpu = shared ? GpuShare(count) : 0;
    req.active = exchange_active + n_gpu;
    req.n_active = count - n_gpu;
    stats_.cold_rows_gpu += n_gpu;
  } else if (mode == FfnMode::kGiven) {
    const std::vector<int32_t>& g = (*a.given_cold)[l];
    // Given lists are not the predictors' choice: the guess is scored, its shift kept.
    if (guess_layer_ == l) ScoreGuess(l, g.data(), static_cast<int>(g.size()), false);
    const int n_gpu = shared ? GpuShare(static_cast<int>(g.size())) : 0;
    req.active = g.data() + n_gpu;
    req.n_active = static_cast<int>(g.size()) - n_gpu;
    stats_.cold_rows_gpu += n_gpu;
  }
  stats_.cold_rows_requested += req.n_active;
  BackendStatus st = a.cold->Run(req);
  stats_.cold_callback += Now() - t1;
  if (!st.ok()) return st;
  if (parts < 0 || parts > kMaxColdParts) {
    return Error(Code::kInternal, "cold side reported " + std::to_string(parts) +
                                      " partial sums; at most " + std::to_string(kMaxColdParts));
  }
  const int count = std::max(parts, 1);  // 0: the callback wrote the sum (one part)
  if (shared) {
    const cudaError_t q = cudaEventQuery(ev_share_[l]);
    if (q == cudaSuccess) {
      ++gpu_first_;
    } else if (q == cudaErrorNotReady) {
      ++cpu_first_;
    } else {
      CUDA_RETURN_IF_ERROR(q);
    }
  }
  if (signal) {
    // The callback's writes to exchange_out happen before the flag (release), and the GPU reads
    // them only after it sees the flag. The flag carries the part count (1 without parts).
    __atomic_store_n(cold_ready_ + l, count, __ATOMIC_RELEASE);
    return Ok();
  }
  if (parts_mode) {
    CUDA_RETURN_IF_ERROR(SumParts(exchange_out, dims_.hidden, nullptr, count, cold_in_, stream_));
    pending2_ = cold_in_;
    return Ok();
  }
  // A single token's cold contribution (one row) may be read by the next kernel straight from
  // the pinned exchange buffer over PCIe (zero-copy); batches are copied up first.
  if (ColdInput(exchange_out, n) == exchange_out) {
    pending2_ = exchange_out;
    return Ok();
  }
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(cold_in_, exchange_out, nh * 4, cudaMemcpyHostToDevice, stream_));
  pending2_ = cold_in_;
  return Ok();
}

// Whether kernels can read this pinned host pointer as it is (mapped, same address).
bool CudaBackend::DeviceReadable(const void* p) {
  if (p == readable_ptr_) return true;
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer != p) return false;
  readable_ptr_ = p;
  return true;
}

BackendStatus CudaBackend::Forward(const ForwardArgs& a) {
  const double t_start = Now();
  stats_ = ForwardStats{};
  const ModelDims& c = dims_;
  const int n = a.n, H = c.hidden;
  const int layer_end = a.layer_end < 0 ? c.n_layers : a.layer_end;
  if (n <= 0 || n > max_batch_) {
    return Error(Code::kInvalidArgument, "batch of " + std::to_string(n) + " tokens (max " +
                                             std::to_string(max_batch_) + ")");
  }
  if (a.seq < 0 || a.seq >= max_seqs_) {
    return Error(Code::kInvalidArgument, "sequence slot " + std::to_string(a.seq));
  }
  if (a.pos0 < 0 || a.pos0 + n > max_ctx_) {
    return Error(Code::kOutOfRange, "positions " + std::to_string(a.pos0) + ".." +
                                        std::to_string(a.pos0 + n - 1) + " exceed the context of " +
                                        std::to_string(max_ctx_));
  }
  if (a.layer_begin < 0 || a.layer_begin > layer_end || layer_end > c.n_layers) {
    return Error(Code::kInvalidArgument, "bad layer range");
  }
  if (a.hidden_in == nullptr) {
    if (a.tokens == nullptr) return Error(Code::kInvalidArgument, "no tokens");
    for (int t = 0; t < n; ++t) {
      if (a.tokens[t] < 0 || a.tokens[t] >= c.vocab) {
        return Error(Code::kInvalidArgument,
                     "token id " + std::to_string(a.tokens[t]) + " out of range");
      }
    }
  }
  if (a.logits_mode == LogitsMode::kGreedy && a.greedy == nullptr) {
    return Error(Code::kInvalidArgument, "kGreedy logits without a place for the pick");
  }
  if ((a.mode == FfnMode::kDense) && a.cold != nullptr) {
    return Error(Code::kInvalidArgument, "kDense mode has no cold side");
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  float* exchange_x = a.exchange_x != nullptr ? a.exchange_x : x_host_;
  float* exchange_out = a.exchange_out != nullptr ? a.exchange_out : out_host_;
  int32_t* exchange_active = a.exchange_active != nullptr ? a.exchange_active : active_host_;

  for (int t = 0; t < n; ++t) {
    tokens_host_[t] = a.tokens != nullptr ? a.tokens[t] : 0;
    tokens_host_[max_batch_ + t] = a.pos0 + t;
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens_dev_, tokens_host_, 2 * max_batch_ * 4,
                                       cudaMemcpyHostToDevice, stream_));
  // The cosines and sines for the q/k/v products that apply RoPE themselves, in decode steps of
  // models whose layers can fold their small kernels (FusesNorms needs x_alt_).
  if (n == 1 && x_alt_ != nullptr && RopeInProduct()) {
    CUDA_RETURN_IF_ERROR(RopeTable(positions_dev_, inv_freq_, c.head_dim, rope_cos_sin_, stream_));
  }
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_start_, stream_));
  const bool greedy = a.logits_mode == LogitsMode::kGreedy;
  const bool head =
      layer_end == c.n_layers &&
      (greedy ? a.greedy != nullptr : a.logits_mode != LogitsMode::kNone && a.logits != nullptr);
  const bool step_graph = UsesStepGraph(a, layer_end);
  // x: [n, hidden] (the step graph starts with the embedding)
  if (a.hidden_in != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(x_, a.hidden_in, static_cast<size_t>(n) * H * 4,
                                         cudaMemcpyHostToDevice, stream_));
  } else if (!step_graph) {
    CUDA_RETURN_IF_ERROR(Embed(tok_embeddings_, tokens_dev_, n, x_, stream_));
  }
  pending1_ = pending2_ = nullptr;
  gpu_first_ = cpu_first_ = 0;
  if (ObservesActive(a)) {
    a.active_out->resize(c.n_layers);
    for (std::vector<int32_t>& v : *a.active_out) v.clear();
  }
  if (step_graph) {
    BackendStatus st = RunStepGraph(a, layer_end, head);
    if (!st.ok()) {
      cudaStreamSynchronize(stream_);
      return st;
    }
  }
  // Decode steps with a cold side queue each layer ahead of the callbacks (prelaunch_).
  const bool queued = !step_graph && prelaunch_ && n == 1 && a.cold != nullptr;
  if (queued) {
    BackendStatus st = RunLayersQueued(a, layer_end, exchange_x, exchange_out, exchange_active);
    if (!st.ok()) return st;  // (it has drained the stream)
  }
  for (int l = a.layer_begin; l < layer_end && !step_graph && !queued; ++l) {
    BackendStatus st = RunLayer(l, a, exchange_x, exchange_out, exchange_active);
    if (!st.ok()) {
      cudaStreamSynchronize(stream_);
      return st;
    }
  }
  if (pending1_ != nullptr) {  // the last layer's FFN output
    if (pending2_ != nullptr) {
      CUDA_RETURN_IF_ERROR(
          Add2InPlace(x_, pending1_, pending2_, static_cast<int64_t>(n) * H, stream_));
    } else {
      CUDA_RETURN_IF_ERROR(AddInPlace(x_, pending1_, static_cast<int64_t>(n) * H, stream_));
    }
    pending1_ = pending2_ = nullptr;
  }
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_layers_end_, stream_));
  if (a.hidden_out != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.hidden_out, x_, static_cast<size_t>(n) * H * 4,
                                         cudaMemcpyDeviceToHost, stream_));
  }
  if (head) {
    const int first = a.logits_mode == LogitsMode::kAll ? 0 : n - 1;
    const int count = n - first;
    if (!step_graph) {  // (the step graph ends with these two)
      CUDA_RETURN_IF_ERROR(RmsNorm(x_ + static_cast<size_t>(first) * H, output_norm_, count, H,
                                   c.norm_eps, xb_, stream_, XbQx(count)));
      BACKEND_RETURN_IF_ERROR(
          Proj(output_, xb_, count, logits_, c.vocab, XbQx(count)));  // [count, vocab]
    }
    if (greedy) {
      // The pick reads the logits where the head wrote them; only its 8 bytes cross PCIe.
      CUDA_RETURN_IF_ERROR(
          GreedyPick(logits_, c.vocab, &pick_dev_->token, &pick_dev_->logprob, stream_));
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pick_host_, pick_dev_, sizeof(GreedyResult),
                                           cudaMemcpyDeviceToHost, stream_));
    } else {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.logits, logits_,
                                           static_cast<size_t>(count) * c.vocab * 4,
                                           cudaMemcpyDeviceToHost, stream_));
    }
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (head && greedy) *a.greedy = *pick_host_;
  for (int l = a.layer_begin; l < layer_end; ++l) {
    if (layers_[l].ffn == FfnPlacement::kHot) stats_.hot_rows_computed += counts_host_[2 * l];
  }
  stats_.cold_gpu_share = static_cast<double>(share_num_) / kShareDen;
  if (share_adaptive_ && gpu_first_ + cpu_first_ > 0) {
    // Nothing reads the share between steps, so it changes here.
    share_num_ = gpu_first_ > cpu_first_ ? std::min(kShareDen, share_num_ + kShareStep)
                                         : std::max(0, share_num_ - kShareStep);
    *share_dev_ = share_num_;
  }
  if (ObservesActive(a)) {
    // The hot lists (local rows) in global ids, joined with the cold ones FinishCold kept.
    for (int l = a.layer_begin; l < layer_end; ++l) {
      const DeviceLayer& L = layers_[l];
      if (L.ffn != FfnPlacement::kHot) continue;
      const int n_hot = L.n_hot + (UsesCache(L, a) ? L.n_cache : 0);
      if (n_hot == 0) continue;
      const int32_t* obs = observed_host_ + static_cast<size_t>(l) * (c.ffn + 1);
      std::vector<int32_t>& out = (*a.active_out)[l];
      for (int i = 0; i < obs[0]; ++i) {
        const int32_t local = obs[1 + i];
        out.push_back(local < L.n_hot ? L.hot_ids_host[local] : L.slot_neuron[local - L.n_hot]);
      }
      std::sort(out.begin(), out.end());
    }
  }
  if (collect_gpu_times_) {
    for (int l = a.layer_begin; l < layer_end; ++l) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, ev_hot0_[l], ev_hot1_[l]) == cudaSuccess) {
        stats_.gpu_hot_ffn += ms * 1e-3;
      }
      if (CallsColdSide(l, a) && cudaEventElapsedTime(&ms, ev_attn0_[l], ev_x_[l]) == cudaSuccess) {
        stats_.gpu_attention += ms * 1e-3;
      }
      // Queued layers only: the signal's event is recorded where the next layer waits for it.
      if (queued && CallsColdSide(l, a) && l + 1 < layer_end) {
        if (cudaEventElapsedTime(&ms, ev_x_[l], ev_signal_[l]) == cudaSuccess) {
          stats_.gpu_cold_gap += ms * 1e-3;
        }
        if (cudaEventElapsedTime(&ms, ev_signal_[l], ev_attn0_[l + 1]) == cudaSuccess) {
          stats_.gpu_cold_in += ms * 1e-3;
        }
      }
    }
    float ms = 0;
    if (cudaEventElapsedTime(&ms, ev_start_, ev_layers_end_) == cudaSuccess) {
      stats_.gpu_layers = ms * 1e-3;
    }
    cudaGetLastError();
  }
  stats_.total = Now() - t_start;
  return Ok();
}

}  // namespace
}  // namespace cuda
}  // namespace pinfer

namespace {
// Lanes run several streams at once (each lane its compute and publish streams), and a lane's
// queued layer waits on the GPU for its host signal (WaitHostFlag). The driver maps streams onto
// CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default); two streams on one queue run in
// order, so a waiting kernel of one lane can hold back the copy that publishes another lane's FFN
// input, whose cold rows the first lane's signal waits behind. With four lanes (nine streams) the
// service hung once on the H200, most likely so; with 32 queues, which give every stream of
// kMaxLanes lanes its own, four and eight lanes ran without a hang. Set when the module
// loads, before the process's first CUDA call creates the context; a value the user set stays.
__attribute__((constructor)) void EnoughHardwareQueues() {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
}
}  // namespace

extern "C" int pinfer_cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

extern "C" int pinfer_cuda_create_backend(const pinfer::cuda::ModelUpload* model,
                                          pinfer::cuda::Backend** out, char* err, size_t err_len) {
  auto backend = std::make_unique<pinfer::cuda::CudaBackend>();
  pinfer::cuda::BackendStatus st = backend->Create(*model);
  if (!st.ok()) {
    if (err != nullptr && err_len > 0) std::snprintf(err, err_len, "%s", st.message.c_str());
    return static_cast<int>(st.code);
  }
  *out = backend.release();
  return 0;
}

extern "C" void pinfer_cuda_destroy_backend(pinfer::cuda::Backend* backend) { delete backend; }

namespace pinfer {
namespace cuda {
namespace {

// Streamed cold rows (ColdPath::kStream): the pinned copies, the slots and the per-layer call.
BackendStatus CudaBackend::SetUpStreaming(const ModelUpload& m, bool slots) {
  streamer_ = std::make_unique<ColdStreamer>();
  size_t max_rb = 0;
  for (int l = 0; l < dims_.n_layers; ++l) {
    const LayerUpload& u = m.layers[l];
    DeviceLayer& d = layers_[l];
    if (d.ffn != FfnPlacement::kHot || d.cold_ids_host.empty()) continue;
    if (u.gate.type != u.up.type || u.gate.type != u.down_t.type || u.down_t.empty()) {
      return Error(Code::kInvalidArgument, "layer " + std::to_string(l) +
                                               ": streamed cold rows need gate, up and down_t "
                                               "of one type");
    }
    CUDA_RETURN_IF_ERROR(streamer_->PinRows(static_cast<WType>(u.gate.type), dims_.hidden,
                                            u.gate.data, u.up.data, u.down_t.data, d.cold_ids_host,
                                            &d.cold_rows));
    max_rb = std::max(max_rb, d.cold_rows.row_bytes());
  }
  if (max_rb == 0) return Ok();  // no cold rows anywhere
  const int chunk = std::min(std::max(1, m.stream_chunk_rows), dims_.ffn);
  size_t bytes = 0;
  cudaError_t e = streamer_->Init(chunk, slots ? std::max(1, m.stream_slots) : 0, max_rb, &bytes);
  device_bytes_ += bytes;
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Error(Code::kResourceExhausted, "streaming slots of " + std::to_string(bytes) +
                                               " bytes: " + cudaGetErrorString(e));
  }
  return Ok();
}

bool CudaBackend::StreamsLayer(int l, const ForwardArgs& a) const {
  if (streamer_ == nullptr || !streamer_->has_slots() || a.n <= kSmallBatch) return false;
  const DeviceLayer& L = layers_[l];
  if (L.ffn != FfnPlacement::kHot || L.cold_rows.rows == 0) return false;
  const ColdPath path = a.cold_paths != nullptr && static_cast<int>(a.cold_paths->size()) > l
                            ? (*a.cold_paths)[l]
                            : a.cold_path;
  return path == ColdPath::kStream;
}

BackendStatus CudaBackend::StreamCold(int l, int n) {
  const DeviceLayer& L = layers_[l];
  StreamTarget t;
  t.x = xb_;
  t.n = n;
  t.out = hot_out_;
  t.gate = gate_;
  t.up = up_;
  t.act = static_cast<ActKind>(dims_.activation);
  const int rc = streamer_->Run(cublas_, L.cold_rows, t, gemm_, stream_);
  if (rc != 0)
    return Error(Code::kInternal, std::string("streamed cold rows: ") + GemmErrorString(rc));
  stats_.streamed_layers += 1;
  stats_.streamed_bytes += static_cast<double>(L.cold_rows.bytes());
  return Ok();
}

BackendStatus CudaBackend::CalibrateStreaming(int layer, int n, StreamCalibration* out) {
  if (streamer_ == nullptr || !streamer_->has_slots()) {
    return Error(Code::kFailedPrecondition, "the backend was created without stream_cold");
  }
  if (layer < 0 || layer >= dims_.n_layers || layers_[layer].cold_rows.rows == 0) {
    return Error(Code::kInvalidArgument, "layer " + std::to_string(layer) + " has no cold rows");
  }
  if (n <= kSmallBatch || n > max_batch_) {
    return Error(Code::kInvalidArgument, "streaming needs " + std::to_string(kSmallBatch + 1) +
                                             ".." + std::to_string(max_batch_) + " tokens");
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const ColdRows& rows = layers_[layer].cold_rows;
  // A non-zero FFN input (zeros can run faster than real data).
  std::vector<float> x(static_cast<size_t>(n) * dims_.hidden);
  uint32_t s = 12345;
  for (float& v : x) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<int32_t>(s >> 8) % 2001 - 1000) * 1e-3f;
  }
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(xb_, x.data(), x.size() * 4, cudaMemcpyHostToDevice, stream_));
  StreamTarget t;
  t.x = xb_;
  t.n = n;
  t.out = hot_out_;
  t.gate = gate_;
  t.up = up_;
  t.act = static_cast<ActKind>(dims_.activation);
  StreamCalibration c;
  c.n = n;
  c.rows = rows.rows;
  c.bytes = static_cast<double>(rows.bytes());
  c.flops = 2.0 * n * rows.rows * 3.0 * dims_.hidden;
  const int rc = streamer_->Calibrate(cublas_, rows, t, gemm_, stream_, &c.copy_s, &c.compute_s,
                                      &c.overlapped_s);
  if (rc != 0) return Error(Code::kInternal, std::string("calibration: ") + GemmErrorString(rc));
  *out = c;
  return Ok();
}

// Adaptive hot set: cold rows into cache slots, from the pinned copy, in the background.
BackendStatus CudaBackend::LoadCacheRows(int layer, const std::vector<int32_t>& slots,
                                         const std::vector<int32_t>& neurons) {
  if (layer < 0 || layer >= dims_.n_layers || layers_[layer].n_cache == 0 || streamer_ == nullptr ||
      !streamer_->ready()) {
    return Error(Code::kFailedPrecondition,
                 "layer " + std::to_string(layer) + " has no adaptive cache rows");
  }
  const DeviceLayer& L = layers_[layer];
  if (slots.size() != neurons.size()) {
    return Error(Code::kInvalidArgument, "slots and neurons differ in length");
  }
  std::vector<int64_t> cold_index(neurons.size());
  for (size_t i = 0; i < neurons.size(); ++i) {
    auto it = std::lower_bound(L.cold_ids_host.begin(), L.cold_ids_host.end(), neurons[i]);
    if (it == L.cold_ids_host.end() || *it != neurons[i]) {
      return Error(Code::kInvalidArgument, "neuron " + std::to_string(neurons[i]) +
                                               " is not a cold neuron of layer " +
                                               std::to_string(layer));
    }
    if (slots[i] < 0 || slots[i] >= L.n_cache) {
      return Error(Code::kInvalidArgument,
                   "cache slot " + std::to_string(slots[i]) + " of " + std::to_string(L.n_cache));
    }
    cold_index[i] = it - L.cold_ids_host.begin();
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const DeviceMatrix dst[3] = {L.gate_c, L.up_c, L.down_t_c};
  for (size_t i = 0; i < slots.size(); ++i) {
    if (L.slot_neuron[slots[i]] >= 0) {
      return Error(Code::kFailedPrecondition,
                   "cache slot " + std::to_string(slots[i]) + " of layer " + std::to_string(layer) +
                       " still serves neuron " + std::to_string(L.slot_neuron[slots[i]]) +
                       " (SetCacheSlots -1 first)");
    }
  }
  CUDA_RETURN_IF_ERROR(streamer_->LoadRows(L.cold_rows, cold_index, slots, L.n_hot, dst, stream_));
  for (size_t i = 0; i < slots.size(); ++i) layers_[layer].slot_loaded[slots[i]] = neurons[i];
  cache_loaded_ = true;
  return Ok();
}

BackendStatus CudaBackend::SetCacheSlots(int layer, const std::vector<int32_t>& slots,
                                         const std::vector<int32_t>& neurons) {
  if (layer < 0 || layer >= dims_.n_layers || layers_[layer].n_cache == 0) {
    return Error(Code::kFailedPrecondition,
                 "layer " + std::to_string(layer) + " has no adaptive cache rows");
  }
  if (slots.size() != neurons.size()) {
    return Error(Code::kInvalidArgument, "slots and neurons differ in length");
  }
  DeviceLayer& L = layers_[layer];
  bool landed = true;
  if (streamer_ != nullptr && streamer_->ready()) {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(streamer_->RowsLanded(/*wait=*/false, &landed));
  }
  // Applied to copies first, so that a refused call changes nothing.
  std::vector<int32_t> slot_neuron = L.slot_neuron, cold_map = L.cold_map_host;
  auto cold_index = [&](int32_t j) -> int64_t {
    auto it = std::lower_bound(L.cold_ids_host.begin(), L.cold_ids_host.end(), j);
    return it != L.cold_ids_host.end() && *it == j ? it - L.cold_ids_host.begin() : -1;
  };
  for (size_t i = 0; i < slots.size(); ++i) {
    const int s = slots[i];
    if (s < 0 || s >= L.n_cache) {
      return Error(Code::kInvalidArgument,
                   "cache slot " + std::to_string(s) + " of " + std::to_string(L.n_cache));
    }
    if (slot_neuron[s] >= 0) cold_map[cold_index(slot_neuron[s])] = slot_neuron[s];
    slot_neuron[s] = -1;
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const int s = slots[i];
    const int32_t j = neurons[i];
    if (j < 0) continue;
    const int64_t ci = cold_index(j);
    if (ci < 0) {
      return Error(Code::kInvalidArgument, "neuron " + std::to_string(j) +
                                               " is not a cold neuron of layer " +
                                               std::to_string(layer));
    }
    if (L.slot_loaded[s] != j || !landed) {
      return Error(Code::kFailedPrecondition,
                   "cache slot " + std::to_string(s) + " does not hold neuron " +
                       std::to_string(j) + (landed ? "" : " yet (its rows are still loading)"));
    }
    if (cold_map[ci] < 0) {
      return Error(Code::kInvalidArgument,
                   "neuron " + std::to_string(j) + " is given to two cache slots");
    }
    cold_map[ci] = -1;
    slot_neuron[s] = j;
  }
  L.slot_neuron = std::move(slot_neuron);
  L.cold_map_host = std::move(cold_map);
  // From pageable memory: the copies take the values as of now, before the next step's work.
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(L.hot_map_c + L.n_hot, L.slot_neuron.data(),
                                       static_cast<size_t>(L.n_cache) * 4, cudaMemcpyHostToDevice,
                                       stream_));
  if (!L.cold_map_host.empty()) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(L.cold_map_c, L.cold_map_host.data(),
                                         L.cold_map_host.size() * 4, cudaMemcpyHostToDevice,
                                         stream_));
  }
  return Ok();
}

BackendStatus CudaBackend::CacheRowsLanded(bool wait, bool* landed) {
  if (streamer_ == nullptr || !streamer_->ready()) {
    *landed = true;
    return Ok();
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(streamer_->RowsLanded(wait, landed));
  return Ok();
}

}  // namespace
}  // namespace cuda
}  // namespace pinfer
