// The interface between the gpu-worker process and its CUDA module (libpinfer_cuda.so).
//
// The module is loaded with dlopen because cuBLAS and prometheus-cpp's civetweb cannot share a
// process's thread-stack settings at link time; so this header is everything the process sees
// of CUDA: plain C++17 types, no CUDA, cuBLAS or absl headers, and one extern "C" factory. The
// process converts its Model and placement into a ModelUpload, creates a Backend, and calls
// Forward per step; errors come back as a BackendStatus whose code uses absl::StatusCode's
// numbering, so the caller turns it into an absl::Status with one cast.
//
// What runs where (the pinfer split): embeddings, attention, the KV cache, norms, predictors,
// the hot FFN rows and the output head run here; the cold FFN rows run in the cpu-worker. Forward
// hands each layer's FFN input to a ColdFfn callback (the process's shared-memory exchange) while
// the GPU computes the hot rows of the same layer, and adds the cold contribution back when the
// callback returns, so hot and cold work overlap within every layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pinfer {
namespace cuda {

// absl::StatusCode numbering.
enum class Code : int {
  kOk = 0,
  kInvalidArgument = 3,
  kNotFound = 5,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
};

struct BackendStatus {
  Code code = Code::kOk;
  std::string message;
  bool ok() const { return code == Code::kOk; }
};

// Stored element types, numbered as pinfer::DType.
enum class HostType : int {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kQ8_0 = 3,
  kQ4_0 = 4,
  kQ4_K = 5,
  kQ5_K = 6,
  kQ6_K = 7
};

// A row-major host matrix [rows, cols] in a stored type (ggml block layouts for Q8_0/Q4_0). A
// vector is rows = 1. Only read during Create.
struct HostMatrix {
  HostType type = HostType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  const void* data = nullptr;
  bool empty() const { return data == nullptr; }
};

struct ModelDims {
  int vocab = 0;
  int hidden = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int ffn = 0;
  float norm_eps = 1e-5f;
  int activation = 1;  // pinfer::Activation: 0 SiLU, 1 ReLU, 2 dReLU
  bool rope_interleaved = false;
  int sliding_window = 0;       // Mistral: a query sees the last this many positions; 0: all
  std::vector<float> inv_freq;  // [head_dim / 2], RopeInverseFrequencies()
};

enum class FfnPlacement : int {
  kNone = 0,  // the layer is not on the GPU (dense layer offload computes it elsewhere)
  kDense =
      1,  // every neuron on the GPU, computed densely: gate, up [ffn, hidden], down [hidden, ffn]
  kHot = 2,  // only hot_ids: rows of gate, up and of down_t (down transposed, [ffn, hidden])
};

struct LayerUpload {
  HostMatrix attn_norm, wq, wk, wv, wo, ffn_norm;  // norms as [1, hidden] (any type)
  // Qwen2's attention biases, [1, q_dim], [1, kv_dim], [1, kv_dim]: all three or none.
  HostMatrix bq, bk, bv;
  FfnPlacement ffn = FfnPlacement::kHot;
  HostMatrix gate, up;           // [ffn, hidden]: kDense uploads all rows, kHot the rows in hot_ids
  HostMatrix down;               // [hidden, ffn]: kDense only
  HostMatrix down_t;             // [ffn, hidden]: kHot only (rows in hot_ids)
  std::vector<int32_t> hot_ids;  // ascending global neuron ids (kHot)
  // Adaptive hot set (kHot, shared/sparse/hot_cache.h): this many extra GPU rows after the hot
  // rows, filled with cold neurons by LoadCacheRows and used by steps of at most the
  // matrix-vector path's size: kGiven steps address them as local rows hot_ids.size() + slot,
  // kPredicted steps through SetCacheSlots. hot_ids.size() + cache_rows <= ffn.
  int cache_rows = 0;
  HostMatrix pred_fc1;       // optional predictor: [rank, hidden]
  HostMatrix pred_fc2;       // [ffn, rank]
  float pred_threshold = 0;  // a neuron is predicted active when its score >= this
  // PowerInfer's pre-norm predictors (fc1 folded onto the normalized input) with a non-zero
  // threshold (ProSparse): the score is compared after multiplying it by rms(residual), the
  // token's FFN input before ffn_norm (shared/sparse's ScoreScale).
  bool pred_scores_times_rms = false;
};

struct ModelUpload {
  ModelDims dims;
  HostMatrix tok_embeddings;  // [vocab, hidden]
  HostMatrix output_norm;     // [1, hidden]
  HostMatrix output;          // [vocab, hidden]
  std::vector<LayerUpload> layers;
  int max_ctx = 2048;   // KV cache rows per sequence
  int max_seqs = 1;     // KV cache slots
  int max_batch = 512;  // tokens per Forward
  int device = 0;
  // Prompt processing with streamed cold rows (ForwardArgs::cold_path): the backend keeps a
  // compact pinned host copy of every kHot layer's cold rows (gate, up, down_t) and, for batches
  // that take the cuBLAS path, can copy them to the GPU in chunks of stream_chunk_rows neurons
  // through stream_slots device buffers on a copy stream, overlapped with the products on the
  // previous chunk. Device cost: stream_slots * chunk * (gate + up + down_t row bytes).
  bool stream_cold = false;
  int stream_chunk_rows = 1024;
  int stream_slots = 2;
  // Single-token steps (kPredicted, kGiven): the GPU computes this fraction of each layer's
  // active cold neurons itself, reading their rows from a pinned host copy over PCIe (zero-copy)
  // after its hot rows, while the cold callback computes the rest; so the GPU, idle while the
  // CPU works through the cold rows, takes a share of them. 0: off. Adaptive: the share starts
  // at cold_gpu_share and moves after every step towards the balance where both sides finish a
  // layer together (measured: which side finished first). PINFER_CUDA_COLD_GPU_SHARE (a fraction,
  // or "auto" for adaptive from 0) overrides both. Keeps the same pinned copy as stream_cold
  // (host memory, no device bytes).
  double cold_gpu_share = 0;
  bool cold_gpu_share_adaptive = false;
  // Queued single-token steps whose layers have predictors (kPredicted, or kGiven with
  // run_predictors): beside layer l - 1's hot rows, the GPU runs layer l's own predictor on a
  // guess at layer l's FFN input, the residual after layer l - 1's attention through layer l's
  // FFN norm (what the FFN input would be if layer l - 1's FFN and layer l's attention added
  // nothing). The cold neurons it selects with its cut lowered by
  // `cold_guess_shift` (score units) reach ColdFfn::Ahead(l) as the guess, with the whole of
  // layer l's attention still ahead. (On relu-llama-tiny this guess reaches the predictor's
  // magnitude recall with 1.29-1.50x its neurons in four of five layers: bench/sparse/
  // lookahead_study, "(d)".) The first layer of a step gets no guess. cold_guess_recall > 0:
  // after each kPredicted step each layer's shift moves towards the point where the guess holds
  // that fraction of the layer's actual cold list (stochastic quantile tracking); 0: the shift
  // stays. (0.9 and 0.95, at relu-llama-tiny's guess sizes for each, 1.9x and 2.2x the list,
  // took turns ahead on the H200: docs/benchmarks.md, run 45.) PINFER_CUDA_COLD_GUESS=0/1,
  // PINFER_CUDA_COLD_GUESS_SHIFT and PINFER_CUDA_COLD_GUESS_RECALL override cold_guess,
  // cold_guess_shift and cold_guess_recall. Layers with pre-norm predictors (pred_scores_times_rms)
  // get no guess.
  bool cold_guess = false;
  double cold_guess_shift = 1.0;
  double cold_guess_recall = 0.95;
  // Sizing only: allocate every device buffer a real instance of this upload would, but copy no
  // weight to the GPU and pin no host row; Forward and the other compute calls refuse. The
  // gpu-worker measures its VRAM plan's fixed part this way (MeasureCudaFootprint) instead of
  // uploading the dense tensors once more and pinning every FFN row as cold (on a 70B Q4_0
  // model: 24 s of start-up and 32 GB of pinned host memory).
  bool allocate_only = false;
};

// Who computes the cold rows of a layer in a Forward.
enum class ColdPath : int {
  kCallback = 0,  // the ColdFfn callback (the cpu-worker), overlapped with the hot rows
  kStream = 1,    // the GPU, streaming the cold rows from pinned host memory (needs
                  // ModelUpload::stream_cold and a batch larger than the matrix-vector path's);
                  // every cold row is computed (a superset of any active set, like the hot rows
                  // of a prompt batch), so exact and predicted results stay exact for ReLU.
};

// What one layer's streamed cold rows cost on this GPU, measured by CalibrateStreaming.
struct StreamCalibration {
  int n = 0;                // tokens
  int64_t rows = 0;         // cold neurons streamed
  double bytes = 0;         // host->GPU bytes of their rows
  double copy_s = 0;        // the copies alone (copy stream, events)
  double compute_s = 0;     // the products alone, on rows already in VRAM
  double flops = 0;         // of the products (2 * n * rows * 3 * hidden)
  double overlapped_s = 0;  // the whole streamed layer as Forward runs it
};

// What the GPU decides about the FFN's active neurons.
enum class FfnMode : int {
  kDense = 0,      // kDense layers: every neuron (no cold side)
  kExact = 1,      // every neuron whose gate is > 0 (hot rows: gate decides on the GPU; the cold
                   // side gets only x and applies the same rule to its rows)
  kPredicted = 2,  // the predictors decide, for hot and cold rows alike
  kGiven = 3,      // the caller lists the active rows (benchmarks with drawn masks)
};

// One layer's cold FFN work, handed to the caller while the GPU computes the hot part.
struct ColdRequest {
  int layer = 0;
  int n = 0;                 // tokens
  const float* x = nullptr;  // [n, hidden] FFN input (after the FFN norm), host memory
  // kPredicted / kGiven: the active cold neurons (global ids, ascending) of the union over the
  // n tokens; null in kExact mode (the cold side decides with its own gate rows).
  const int32_t* active = nullptr;
  int n_active = 0;
  float* out = nullptr;  // [n, hidden] host memory the callback fills (overwrites)
  // When max_parts > 0 (single tokens), the callback may instead write up to max_parts partial
  // sums [parts, hidden] at out and report how many in *parts; the GPU adds them in order
  // (SumParts), so the CPU's threads need not exchange them. *parts = 0 (as set): out is the sum.
  int max_parts = 0;
  int* parts = nullptr;
};

// The max_parts a backend offers: more than a cpu-worker's threads on any host we have measured.
constexpr int kMaxColdParts = 64;

// The module's guess at a decode layer's active cold neurons (ModelUpload::cold_guess).
struct ColdGuess {
  const int32_t* ids = nullptr;  // [n] global ids, ascending
  // [n]: 1 for the neurons that the layer's predictor selects at its own cut on the guess's
  // input, the likelier ones (the rest are there only through the lowered cut): a cold side whose
  // loads may be cut short loads them first.
  const uint8_t* first = nullptr;
  int n = 0;
};

class ColdFfn {
 public:
  virtual ~ColdFfn() = default;
  virtual BackendStatus Run(const ColdRequest& request) = 0;
  // Decode steps with queued layers call Ahead(l) while the GPU computes layer l's attention,
  // before Run for layer l: a cold side that can guess the layer's active rows may load them
  // into its caches meanwhile, since the host's memory is idle then. It should stop once
  // x_ready() (the FFN input is published, so Run could start): loads past that point delay the
  // layer. x_ready may be called from one thread at a time only. Must not fail.
  // guess: with ModelUpload::cold_guess, the module's guess at the layer's active cold neurons
  // (ColdGuess), valid during the call; otherwise empty.
  virtual void Ahead(int layer, const ColdGuess& guess, const std::function<bool()>& x_ready) {
    (void)layer;
    (void)guess;
    (void)x_ready;
  }
};

// kGreedy: the last token's greedy pick, made on the GPU (ForwardArgs::greedy), so that a greedy
// decode step copies 8 bytes to the host instead of the vocabulary's logits.
enum class LogitsMode : int { kLast = 0, kAll = 1, kNone = 2, kGreedy = 3 };

// The greedy token (the first index of the largest logit, NaNs ignored) and its log-probability
// under softmax of the logits: what the sampler computes for a greedy request.
struct GreedyResult {
  int32_t token = 0;
  float logprob = 0;
};

struct ForwardArgs {
  int seq = 0;                      // KV cache slot
  const int32_t* tokens = nullptr;  // [n]; ignored when hidden_in is set
  int n = 0;
  int pos0 = 0;
  FfnMode mode = FfnMode::kExact;
  ColdFfn* cold = nullptr;  // null: no cold rows (the GPU holds every neuron needed)
  // kGiven: per layer, the active hot rows (local indices into hot_ids) and cold neurons
  // (global ids), each ascending.
  const std::vector<std::vector<int32_t>>* given_hot = nullptr;
  const std::vector<std::vector<int32_t>>* given_cold = nullptr;
  bool run_predictors = false;
  // Who computes the cold rows: one path for every layer, or per layer when cold_paths is set
  // (size n_layers). kStream applies only to batches over the matrix-vector path's size; smaller
  // ones always use the callback.
  ColdPath cold_path = ColdPath::kCallback;
  const std::vector<ColdPath>* cold_paths =
      nullptr;  // kGiven: still run the predictors so their cost counts
  // Layer range, for dense layer offload: hidden_in (host [n, hidden]) replaces the embedding,
  // hidden_out (host) receives x after layer_end - 1. layer_end < 0 means n_layers.
  int layer_begin = 0;
  int layer_end = -1;
  const float* hidden_in = nullptr;
  float* hidden_out = nullptr;
  LogitsMode logits_mode = LogitsMode::kLast;
  float* logits = nullptr;         // host: [vocab] (kLast) or [n, vocab] (kAll)
  GreedyResult* greedy = nullptr;  // kGreedy: the last token's pick (host)
  // Host exchange buffers (e.g. a shared-memory segment registered with RegisterHostMemory):
  // x [max_batch, hidden], out [max_batch, hidden], active [ffn]. Null: internal pinned buffers.
  float* exchange_x = nullptr;
  float* exchange_out = nullptr;
  int32_t* exchange_active = nullptr;
  // kPredicted single-token steps: filled with each layer's predicted-active neurons (global
  // ids, hot and cold, ascending), what the adaptive hot set counts. Null: not collected.
  std::vector<std::vector<int32_t>>* active_out = nullptr;
};

// Seconds summed over the layers of the last Forward (host clock, except gpu_* from events).
struct ForwardStats {
  double total = 0;
  double cold_callback = 0;         // inside ColdFfn::Run
  double wait_for_x = 0;            // host waiting for the GPU to publish the FFN input
  double gpu_hot_ffn = 0;           // GPU time of the hot FFN kernels (events)
  double gpu_layers = 0;            // GPU time from embedding to the last layer's end (events)
  int64_t hot_rows_computed = 0;    // active hot neurons summed over layers (union over tokens)
  int64_t cold_rows_requested = 0;  // handed to the cold callback
  int64_t cold_rows_gpu = 0;        // active cold neurons the GPU took (cold_gpu_share)
  double cold_gpu_share = 0;        // the share in effect for this step
  int streamed_layers = 0;          // layers whose cold rows were streamed (ColdPath::kStream)
  double streamed_bytes = 0;        // host->GPU bytes of those rows
  // GPU time (events) from each layer's first kernel to its FFN input being published for the
  // cold side, summed over the layers with one: what the host's wait_for_x would be without
  // launch and wake-up latency.
  double gpu_attention = 0;
  // Decode steps with queued layers; the two GPU times (events) only with set_collect_gpu_times:
  double host_launch = 0;   // host time queueing the next layer before each cold callback
  double cold_ahead = 0;    // inside ColdFfn::Ahead (overlapped with the attention)
  double gpu_cold_gap = 0;  // from a layer's FFN input published to the GPU seeing the cold
                            // side's signal: the host's wake-up, the callback, the signal's trip
  double gpu_cold_in = 0;   // from that signal to the next layer's first kernel: the cold
                            // contribution brought in (SumParts or a copy)
  // ModelUpload::cold_guess: the guesses handed to Ahead (neurons, summed over layers), and in
  // kPredicted steps how many of the actual cold lists' neurons they held.
  int64_t guess_rows = 0;
  int64_t guess_hits = 0;
  int64_t guess_actual = 0;  // neurons of the actual cold lists of the layers with a guess
  int64_t guess_first = 0;   // of guess_rows, in the guesses' first tiers (ColdGuess::first)
  double guess_wait = 0;     // host waiting for the guess before Ahead
};

// Backends sharing one model's weights: the first and its lanes (Backend::NewLane).
constexpr int kMaxLanes = 8;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendStatus Forward(const ForwardArgs& args) = 0;
  // Pins host memory (cudaHostRegister) so the GPU copies straight from and to it.
  virtual BackendStatus RegisterHostMemory(void* ptr, size_t bytes) = 0;
  virtual BackendStatus UnregisterHostMemory(void* ptr) = 0;
  // Device bytes this backend allocated (weights, KV cache, scratch), for placement checks.
  virtual size_t DeviceBytes() const = 0;
  virtual size_t WeightBytes() const = 0;
  virtual std::string DeviceName() const = 0;
  // Where the creation's time went ("device and cuBLAS 0.41 s, weights 12.3 s (22.1 GiB), ..."):
  // a 70B start spent 34 s in it, which its log could not yet divide. Empty for lanes.
  virtual std::string CreateTimes() const { return {}; }
  virtual const ForwardStats& last_stats() const = 0;
  // Records GPU event timings per Forward (costs a little; off by default).
  virtual void set_collect_gpu_times(bool on) = 0;
  // ModelUpload::cold_guess: sets every layer's shift (read by the GPU when the guess runs, so
  // captured graphs need not change); the adaptation, if on, moves it from there.
  virtual void set_cold_guess_shift(double shift) = 0;
  virtual double cold_guess_shift(int layer) const = 0;
  // Times layer `layer`'s streamed cold rows for a batch of n tokens (copies alone, products
  // alone, both overlapped), for the cost model that picks ColdPath. Needs stream_cold.
  virtual BackendStatus CalibrateStreaming(int layer, int n, StreamCalibration* out) = 0;
  // Adaptive hot set: copies the rows of cold neurons `neurons` (global ids of the layer's cold
  // set) into cache slots `slots` from the pinned host copy, on a copy stream after the GPU work
  // queued so far, and returns at once. List a slot in given_hot only once CacheRowsLanded says
  // so; a slot being overwritten must not be listed.
  virtual BackendStatus LoadCacheRows(int layer, const std::vector<int32_t>& slots,
                                      const std::vector<int32_t>& neurons) = 0;
  // Whether every LoadCacheRows so far has landed (wait = true blocks until it has).
  virtual BackendStatus CacheRowsLanded(bool wait, bool* landed) = 0;
  // kPredicted steps from the next Forward on: slots[i] serves cold neuron neurons[i], or nobody
  // when it is -1. A slot's previous neuron is cold again; a neuron given to a slot is computed
  // there and no longer listed for the cold side, so it must be the neuron that the slot's
  // landed LoadCacheRows brought in, and in no other slot. Take a slot away (-1) before loading
  // new rows into it.
  virtual BackendStatus SetCacheSlots(int layer, const std::vector<int32_t>& slots,
                                      const std::vector<int32_t>& neurons) = 0;
  // A second backend over the same weights and KV cache, with its own scratch, streams, graphs
  // and statistics, so that two threads can run Forward at once: while one sequence's cold rows
  // run on the CPU, the GPU works on another sequence's attention, where a single sequence leaves
  // one side idle (each layer needs the previous one's cold contribution). Sequence slots are
  // shared: run each slot on one backend at a time. Destroy the lane (with
  // pinfer_cuda_destroy_backend) before this backend. A lane takes batches of at most 8 tokens
  // (decode steps; its scratch is sized for those) and streams no cold rows. FAILED_PRECONDITION
  // for a model with adaptive cache rows, whose slots change under SetCacheSlots, and for a lane
  // (lanes come from the first backend, which counts them); RESOURCE_EXHAUSTED past kMaxLanes lanes
  // in all (this backend included: each lane's two streams need their own hardware queue, of 32).
  virtual BackendStatus NewLane(Backend** out) = 0;
  // Single-token steps replay one CUDA graph per layer (captured on first use per layer,
  // sequence slot and mode); on by default, or off with PINFER_CUDA_GRAPHS=0.
  virtual void set_use_graphs(bool on) = 0;
};

}  // namespace cuda
}  // namespace pinfer

// The module's entry points, looked up with dlsym. Create returns 0 and sets *out, or returns the
// Code and writes a message into err.
#define PINFER_CUDA_EXPORT __attribute__((visibility("default")))
extern "C" {
PINFER_CUDA_EXPORT int pinfer_cuda_device_count();
PINFER_CUDA_EXPORT int pinfer_cuda_create_backend(const pinfer::cuda::ModelUpload* model,
                                                  pinfer::cuda::Backend** out, char* err,
                                                  size_t err_len);
PINFER_CUDA_EXPORT void pinfer_cuda_destroy_backend(pinfer::cuda::Backend* backend);
}
// The function types, for dlsym.
using PinferCudaDeviceCountFn = int (*)();
using PinferCudaCreateFn = int (*)(const pinfer::cuda::ModelUpload*, pinfer::cuda::Backend**, char*,
                                   size_t);
using PinferCudaDestroyFn = void (*)(pinfer::cuda::Backend*);
#define PINFER_CUDA_CREATE_SYMBOL "pinfer_cuda_create_backend"
#define PINFER_CUDA_DESTROY_SYMBOL "pinfer_cuda_destroy_backend"
#define PINFER_CUDA_DEVICE_COUNT_SYMBOL "pinfer_cuda_device_count"
