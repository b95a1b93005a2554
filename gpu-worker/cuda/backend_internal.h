// CudaBackend, the module's implementation of Backend (backend.h): its class, the per-layer device
// state (DeviceLayer) and the error helpers its files share. The class is one object because a
// step, the upload and the cold exchange all read the same buffers, streams and events; its methods
// are defined by role in backend_upload.cc, backend_step.cc, backend_cold.cc and
// backend_cache_slots.cc (backend.cc holds the C entry points). Private to the module: nothing
// outside gpu-worker/cuda/ includes this header, and the module exports only its extern "C"
// functions (hidden visibility).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu-worker/cuda/backend.h"
#include "gpu-worker/cuda/cold_stream.h"
#include "gpu-worker/cuda/gemm.h"
#include "gpu-worker/cuda/kernels.h"

namespace pinfer {
namespace cuda {

// Batches up to this many tokens use the matrix-vector kernels (one pass over the weights);
// larger ones go through cuBLAS.
constexpr int kSmallBatch = 8;

inline BackendStatus Error(Code code, std::string message) {
  return BackendStatus{code, std::move(message)};
}
inline BackendStatus Ok() { return BackendStatus{}; }

inline BackendStatus CudaError(cudaError_t e, const char* what, const char* file, int line) {
  const char* slash = std::strrchr(file, '/');
  return Error(Code::kInternal, std::string(what) + " (" + (slash ? slash + 1 : file) + ":" +
                                    std::to_string(line) + "): " + cudaGetErrorName(e) + ": " +
                                    cudaGetErrorString(e));
}

#define CUDA_RETURN_IF_ERROR(expr)                                          \
  do {                                                                      \
    cudaError_t _e = (expr);                                                \
    if (_e != cudaSuccess) return CudaError(_e, #expr, __FILE__, __LINE__); \
  } while (0)

#define BACKEND_RETURN_IF_ERROR(expr) \
  do {                                \
    BackendStatus _s = (expr);        \
    if (!_s.ok()) return _s;          \
  } while (0)

inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct DeviceLayer {
  FfnPlacement ffn = FfnPlacement::kNone;
  float* attn_norm = nullptr;
  float* qkv_bias = nullptr;  // [q_dim + 2 kv_dim]: bq, bk, bv one after the other (null: none)
  float* ffn_norm = nullptr;
  DeviceMatrix wqkv, wo;  // wqkv: rows of wq, wk, wv stacked (one projection)
  DeviceMatrix gate_up;   // kDense: rows of gate then up stacked
  // Where the stacked parts differ in type: each on its own (wqkv / gate_up hold no data).
  std::vector<DeviceMatrix> wqkv_parts, gate_up_parts;
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
  std::string CreateTimes() const override { return create_times_; }
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
  // Parts of different types (a K-quant mix's attn_v at a higher type than attn_q) are uploaded
  // one by one into *separate, and *out then has the stacked shape and no data.
  BackendStatus UploadStacked(const std::vector<const HostMatrix*>& parts, const char* name,
                              DeviceMatrix* out, std::vector<DeviceMatrix>* separate);
  // y: [n, ldy] = x: [n, w.cols] @ w^T
  BackendStatus Proj(const DeviceMatrix& w, const float* x, int n, float* y, int ldy,
                     const void* x_qx = nullptr);
  // The same over a stacked projection: one product, or one a part into its rows of y.
  BackendStatus ProjStacked(const DeviceMatrix& w, const std::vector<DeviceMatrix>& separate,
                            const float* x, int n, float* y, int ldy, const void* x_qx);
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
           AttQx(1) != nullptr && L.wqkv_parts.empty() && L.gate_up_parts.empty() &&
           L.qkv_bias == nullptr && NormMatVecFits(L.wqkv) && NormMatVecFits(L.gate_up);
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
  bool allocate_only_ = false;  // ModelUpload::allocate_only
  static BackendStatus AllocateOnlyError() {
    return Error(Code::kFailedPrecondition,
                 "this instance was created with allocate_only: it holds no weights");
  }
  void* repack_tmp_ = nullptr;  // upload-time scratch of MaybeSplit, freed at the end of Create
  size_t repack_tmp_bytes_ = 0;
  ForwardStats stats_;
  std::string create_times_;  // CreateTimes()

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

}  // namespace cuda
}  // namespace pinfer
