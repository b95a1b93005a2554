// The gpu-worker's compute, behind one interface so that the scheduler does not care where it
// runs: the CPU backend here (the Transformer with a hot/cold split FFN), or the CUDA module
// (gpu-worker/cuda, loaded with dlopen so that cuBLAS never shares the process image with
// prometheus-cpp at link time) once it is available on the machine.
//
// Either way the backend computes embeddings, attention, the KV caches, norms, the hot FFN rows
// and the output head; for every layer it hands the FFN input to the ColdLink (the shared-memory
// exchange with the cpu-worker) and adds the cold contribution back.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gpu-worker/cold_prefill.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"
#include "shared/service/ffn_split.h"
#include "shared/shm/activation_channel.h"
#include "shared/sparse/hot_cache.h"
#include "shared/sparse/sparse_ffn.h"
#include "shared/util/thread_pool.h"

namespace pinfer::gpuworker {

// Counters the backend accumulates for metrics; read and reset by the caller.
struct BackendStats {
  uint64_t forward_ns = 0;        // whole forward passes
  uint64_t hot_ffn_ns = 0;        // this side's FFN share
  uint64_t exchange_wait_ns = 0;  // waiting for the cold share after the hot share was done
  uint64_t exchanges = 0;
  uint64_t hot_neurons = 0;     // (token, neuron) pairs computed here
  uint64_t cold_neurons = 0;    // ... and by the cpu-worker
  uint64_t cold_gpu_neurons = 0;  // of hot_neurons, the cold lists' share the GPU took
  uint64_t hot_candidates = 0;  // (token, neuron) pairs that could have been computed here
  uint64_t cold_candidates = 0;
  std::vector<double> wait_samples;  // per exchange, seconds (for the wait histogram)
  // Prompt batches (CUDA backend): layers whose cold rows went to the cpu-worker or were
  // streamed to the GPU, and the bytes streamed.
  uint64_t prefill_cold_layers_cpu = 0;
  uint64_t prefill_cold_layers_stream = 0;
  double streamed_bytes = 0;
  // Adaptive hot set (CUDA backend): cold neurons moved into cache slots.
  uint64_t cache_swaps = 0;
  // Decode steps run on a second (or later) lane, beside another sequence's (CUDA backend).
  uint64_t lane_steps = 0;
  // --cold-guess (CUDA backend): neurons in the module's cold guesses, and of the actual cold
  // lists of the layers with a guess, how many neurons there were and how many the guess held.
  uint64_t guess_neurons = 0;
  uint64_t guess_actual = 0;
  uint64_t guess_hits = 0;
  uint64_t guess_first = 0;  // of guess_neurons, in the guesses' first tiers (loaded first)
};

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  // "cpu" or "cuda".
  virtual std::string name() const = 0;
  // Reserves the state of one sequence (its KV cache) for up to max_ctx positions.
  virtual absl::StatusOr<int> AcquireSlot(int max_ctx) = 0;
  virtual void ReleaseSlot(int slot) = 0;
  // Prefix caching (prefix_cache.h): readies a slot kept from a finished sequence for a new one
  // of up to max_ctx positions whose first `keep` positions are the slot's (their KV is kept;
  // the rest is overwritten). INVALID_ARGUMENT when the slot cannot hold max_ctx positions; the
  // scheduler then releases it and acquires another. Backends that cannot keep slots leave this.
  virtual absl::Status ReuseSlot(int slot, int max_ctx, int keep) {
    (void)slot, (void)max_ctx, (void)keep;
    return absl::UnimplementedError(absl::StrCat(name(), " backends do not reuse KV cache slots"));
  }
  // Memory that releasing `slot` would free (0 where the slots are allocated up front).
  virtual uint64_t slot_bytes(int slot) const {
    (void)slot;
    return 0;
  }
  // Runs tokens at positions pos0.. of the sequence in `slot`; logits: [vocab] of the last
  // token, or null when not needed (earlier prefill chunks).
  virtual absl::Status Forward(int slot, std::span<const int32_t> tokens, int pos0,
                               float* logits) = 0;
  struct GreedyPick {
    int32_t token = 0;  // the first index of the largest logit (NaNs ignored)
    float logprob = 0;  // its log-probability under softmax(logits)
  };
  struct DecodeItem {
    int slot;
    int32_t token;
    int pos;
    float* logits;  // [vocab]; null when `greedy` is set
    // Only for backends that picks_greedy(): the step's greedy token and its log-probability
    // (what Sampler gives for a greedy request) instead of the logits.
    GreedyPick* greedy = nullptr;
  };
  // Whether DecodeBatch can pick greedy tokens itself (DecodeItem::greedy): the CUDA backend
  // picks on the GPU, so that a greedy step copies 8 bytes instead of the vocabulary's logits.
  virtual bool picks_greedy() const { return false; }
  // One decode step for several sequences: each feeds `token` at `pos` and gets the next
  // logits (or its greedy pick). Backends that can batch read the weights once for all of them
  // (continuous batching); results must equal Forward's for each sequence. A failure fails the
  // whole batch.
  virtual absl::Status DecodeBatch(std::span<const DecodeItem> items) {
    for (const DecodeItem& it : items) {
      absl::Status st = Forward(it.slot, std::span<const int32_t>(&it.token, 1), it.pos, it.logits);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }
  // Bytes of FFN rows held here, and of everything else (attention, embeddings, head).
  virtual uint64_t ffn_bytes() const = 0;
  virtual uint64_t dense_bytes() const = 0;
  virtual uint64_t ffn_neurons() const = 0;
  // Bytes this backend allocated on a GPU (0 for the CPU backend).
  virtual uint64_t device_bytes() const { return 0; }
  // Moves the accumulated counters out.
  virtual BackendStats TakeStats() = 0;
};

// The CPU implementation. `model`, `ops` and `exchange` must outlive it; `placement` chooses the
// hot neurons (the rest are computed by the cpu-worker through `exchange`).
// predictors: --sparse mode (the predictors choose each token's neurons, on both sides), or null
// for exact mode. pool, if any, copies the hot rows at start-up (the one that runs ops).
absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCpuBackend(
    const Model& model, const CpuOps& ops, const Placement& placement,
    shm::ExchangeClient* exchange, const PredictorSet* predictors = nullptr,
    ThreadPool* pool = nullptr);

struct CudaBackendOptions {
  int slots = 8;       // KV cache slots (concurrent sequences) on the device
  int max_ctx = 2048;  // positions per slot
  int device = 0;
  bool gpu_timing = false;  // per-layer GPU event timings into the metrics (costs a little)
  // --sparse: the predictors (uploaded with the model) choose each layer's neurons on the GPU,
  // hot and cold alike; the cold ones go to the cpu-worker as masks. Null: exact mode.
  const PredictorSet* predictors = nullptr;
  // Prompt batches' cold rows (cold_prefill.h): kAuto and kStream keep a pinned host copy of the
  // cold rows and stream them through stream_slots device buffers of stream_chunk_rows neurons
  // (counted in MeasureCudaFootprint too, so that a VRAM plan includes them).
  ColdPrefill cold_prefill = ColdPrefill::kCpu;
  int stream_chunk_rows = 1024;
  int stream_slots = 2;
  // Adaptive hot set (shared/sparse/hot_cache.h; needs predictors): this many cache slots per
  // layer after the hot rows, refilled during decoding with the cold neurons the current text
  // keeps activating. 0: the static placement only.
  int adaptive_cache_rows = 0;
  HotCacheOptions cache_options;  // its slots field is set from adaptive_cache_rows
  int cache_plan_every = 4;       // decode steps between swap plans
  // Counting and planning on a thread of their own rather than between decode steps
  // (AdaptiveHotSet's background; --adaptive-cache-thread). Off by default: on a host whose
  // cores all run the cold side, the thread costs them more than it saves the decode step.
  bool cache_background = false;
  // With predictors: the share of each layer's active cold neurons the GPU computes from a
  // pinned host copy (ModelUpload::cold_gpu_share): auto balances it step by step; otherwise
  // cold_gpu_share (0: off).
  double cold_gpu_share = 0;
  bool cold_gpu_share_auto = false;
  // Decode steps of up to this many sequences in flight at once (cuda::Backend::NewLane: a lane
  // shares the weights and KV cache and adds its own scratch), so that one sequence's cold rows
  // on the cpu-worker overlap another's GPU work. 1: one at a time. Not with the adaptive hot set.
  int decode_lanes = 2;
  // With predictors: the module guesses each decode layer's active cold neurons ahead of its
  // attention (cuda::ModelUpload::cold_guess), which goes to the cpu-worker through the segment
  // (ExchangeClient::PostGuess), and scores each guess against the layer's actual list
  // (BackendStats::guess_*).
  bool cold_guess = false;
};
// The most decode lanes (the CUDA module's cuda::kMaxLanes).
constexpr int kMaxDecodeLanes = 8;

// Device bytes of `rows` adaptive cache slots per layer and their maps (for the VRAM plan).
uint64_t AdaptiveCacheBytes(const Model& model, int rows);

// Why the CUDA module cannot stream this model's cold rows ("" when it can): it streams gate and
// up rows of one stored type and the transposed down rows in theirs, which may differ (llama.cpp's
// K mixes give some layers' ffn_down more bits); a quantized down projection stored untransposed
// is kept as F32 rows (a quantized transpose would re-quantize), which it does not pin.
std::string ColdStreamingProblem(const Model& model);

// What the CUDA module allocates for `model` before any FFN row (measured by creating it once
// with no hot neurons) and the bytes one hot neuron of each layer adds, so that a placement under
// a VRAM budget plans exactly what the backend will hold.
struct CudaFootprint {
  uint64_t fixed_bytes = 0;
  std::vector<uint64_t> neuron_bytes;  // [layer]
};
absl::StatusOr<CudaFootprint> MeasureCudaFootprint(const Model& model, int max_batch,
                                                   const std::string& module_path,
                                                   const CudaBackendOptions& options);

// Whether the CUDA module computes every tensor type of `model` (FAILED_PRECONDITION naming the
// first tensor it does not: the K-quants are computed on the CPU only, for now).
absl::Status CudaModuleComputes(const Model& model);

// The CUDA implementation, from the module at `module_path` (gpu-worker/cuda). Fails with the
// module's status (no device, out of memory) so that the caller can fall back to the CPU.
absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(const Model& model,
                                                               const Placement& placement,
                                                               shm::ExchangeClient* exchange,
                                                               const std::string& module_path,
                                                               const CudaBackendOptions& options);

}  // namespace pinfer::gpuworker
