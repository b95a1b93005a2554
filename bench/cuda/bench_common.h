// What the CUDA benches share: a synthetic model of ReluLLaMA-13B's shape built in memory, the
// activation profile its masks are drawn from, the cold side as the cpu-worker computes it, the
// module's uploads for the three placements, the bandwidths a roofline divides by, and the flags
// every bench takes. Each bench (decode_bench.cc, prefill_bench.cc, adaptive_bench.cc,
// kernel_bench.cc) measures one thing with these, so that they all run the same model and the
// same cold side.
//
// The model: random weights (F16, Q4_0, Q4_K or Q6_K) of the real shapes, and per-token activation
// masks drawn from a profile instead of a trained predictor (the predictors still run on the GPU so
// that their cost counts; their output is replaced by the mask). Profile: per layer the neurons are
// ranked by a random permutation; the top `skew` fraction ("hot tier") are active with
// probability p_hot = 0.8 * active / skew and the rest with p_cold = 0.2 * active / (1 - skew), so
// on average `active` of the neurons fire per token and the hot tier takes 80% of activations
// (skew 0.2 is what PowerInfer's authors report for ReLU models, 0.4 is the harder case).
// Weights are random, so down_t (the transposed down matrix the sparse path reads) is simply
// another random [ffn, hidden] matrix; the dense paths read the same bytes as [hidden, ffn].
// The model gates with SiLU rather than ReLU: with random weights a drawn-active neuron's ReLU
// gate would be zero half of the time, and the sparse kernels skip rows with a zero coefficient,
// which would flatter both sides; with SiLU every drawn-active row is read in full, as for truly
// active neurons of a ReLU model. The cost per row is the same. --dtype=Q4_K_M mixes Q4_K and
// Q6_K as llama.cpp's Q4_K_M types a Llama (SynthModel).
#ifndef PINFER_BENCH_CUDA_BENCH_COMMON_H_
#define PINFER_BENCH_CUDA_BENCH_COMMON_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu-worker/cuda/backend.h"
#include "shared/engine/ops.h"
#include "shared/engine/transformer.h"
#include "shared/model/tensor.h"
#include "shared/util/thread_pool.h"

namespace pinfer::cudabench {

double Now();
double MedianOf(std::vector<double> v);

// "a,b,c" -> {a, b, c} (--skews=0.2,0.4 and the like).
std::vector<double> CommaList(const char* v);
std::vector<std::string> Split(const std::string& s, char sep);

// The flags every CUDA bench takes: the model's shape and type, the profile, the budget, the
// decode loop. Defaults: the 13B shape at half its bytes in VRAM.
struct BenchOptions {
  std::string dtype = "F16";
  // --dtype=Q4_K_M: dtype "Q4_K" with some tensors Q6_K, as `pinfer convert --type q4_k_m` and
  // llama.cpp's quantize type them (SynthModel). Only benches whose byte counts follow each
  // tensor's type take it (mixes_ok).
  bool q4_k_m = false;
  bool mixes_ok = false;
  int layers = 40, hidden = 5120, ffn = 13824, heads = 40, vocab = 32000;
  int kv_heads = 0;  // --kv-heads=N: grouped-query attention (0: as many as heads, as 13B has)
  // --budget-gb=G: the VRAM budget for the weights in GB (1e9 bytes), instead of a fraction of
  // the model's bytes (70B at --budget-gb=22: a 24 GB card less its KV cache and buffers).
  double budget_gb = 0;
  double Budget(double model_bytes) const {
    return budget_gb > 0 ? budget_gb * 1e9 : budget_fraction * model_bytes;
  }
  int pred_rank = 256;
  double budget_fraction = 0.5;
  double active = 0.10;
  std::vector<double> skews = {0.2, 0.4};
  int warmup = 4, steps = 32;
  int threads = 0;  // 0: all cores
  // --rounds=N: the bench's list of runs N times over, taking turns, and medians at the end.
  int rounds = 1;
  bool graphs = true;  // --graphs=0: no CUDA graphs for single-token steps
  int Threads() const;
};

// The value of `arg` if it is `key` followed by the value ("--steps=" in "--steps=48").
const char* FlagValue(const std::string& arg, const char* key);
// Flags whose values are numbers, by key ("--steps=" and where its value goes).
struct NumberFlags {
  std::vector<std::pair<const char*, int*>> ints;
  std::vector<std::pair<const char*, double*>> reals;
};
// Consumes arg if it is one of `flags`.
bool ParseNumberFlag(const std::string& arg, const NumberFlags& flags);
// Consumes arg if it is one of BenchOptions' flags.
bool ParseSharedFlag(const std::string& arg, BenchOptions* o);
// Parses argv: BenchOptions' flags, then `own` for the bench's others (false: unknown). Prints
// the command line, so that every table comes with the command that made it. Returns false (and
// says why) on a bad flag.
bool ParseFlags(int argc, char** argv, BenchOptions* o,
                const std::function<bool(const std::string&)>& own);

// 64-byte aligned host buffer. Large buffers ask for 2 MB pages (transparent huge pages), as a
// worker holding weights would: the cold side reads 10-27 KB rows scattered over 280 MB matrices,
// and with 4 KB pages most of those rows start with a TLB miss (kernel_bench compares both).
struct Buffer {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit Buffer(size_t bytes, bool huge = true);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Random weights in the stored type. F16: magnitudes 2^-7..2^-4 with random sign and mantissa;
// Q4_0: scale ~0.004, random nibbles; Q4_K / Q5_K / Q6_K: random quants and sub-block scales under
// small fp16 super-block scales. Filled in parallel.
void FillRandom(DType t, uint8_t* p, size_t bytes, uint64_t seed, ThreadPool& pool);

struct SynthLayer {
  std::unique_ptr<Buffer> wq, wk, wv, wo, gate, up, down_t, fc1, fc2;
  // wv's and down_t's types: the model's dtype but where a mix raises them (Q4_K_M).
  DType wv_dtype, down_dtype;
  // The cold side's copy of the FFN rows as the cpu-worker keeps them (FfnRowStore): each
  // neuron's gate, up and down_t rows back to back (SynthModel::NeuronBytes apart; down_t's row
  // may be longer than the other two).
  std::unique_ptr<Buffer> bundles;
  std::vector<float> attn_norm, ffn_norm;
  std::vector<int32_t> rank_of;  // neuron -> popularity rank (0 = most active)
};

// Every weight in `dtype` but, with q4_k_m, the output head (out_dtype) and each layer's wv and
// down_t (SynthLayer::wv_dtype, down_dtype): llama.cpp's Q4_K_M gives those Q6_K in the layers
// of its use_more_bits, the first and last eighth and every third between, half of them
// (KMixTensorType in shared/model/gguf_convert.cc, with which `pinfer convert` writes files; on
// 80 layers with grouped-query attention the other layers' wv Q5_K). There down_t's rows are
// longer than gate's and up's. The embeddings and the predictors keep dtype.
struct SynthModel {
  DType dtype;
  DType out_dtype;
  bool q4_k_m = false;
  ModelConfig config;
  std::unique_ptr<Buffer> emb, out;
  std::vector<float> out_norm;
  std::vector<SynthLayer> layers;
  int pred_rank = 0;

  size_t Rb(int64_t cols) const { return RowBytes(dtype, cols); }
  // Layer l's wq, wk, wv and wo.
  size_t AttnBytes(int l) const;
  // One neuron's gate, up and down_t rows in layer l (its bundle on the cold side).
  size_t NeuronBytes(int l) const {
    return 2 * Rb(config.hidden_size) + RowBytes(layers[l].down_dtype, config.hidden_size);
  }
  size_t FfnBytes(int l) const { return NeuronBytes(l) * config.ffn_size; }
  // Over all layers: their attention matrices; one neuron's rows in each.
  size_t AllAttnBytes() const;
  size_t AllNeuronBytes() const;
  // What a neuron hot in every layer costs the VRAM budget: its rows and an id in each layer.
  double HotNeuronBytes() const {
    return static_cast<double>(AllNeuronBytes()) + 4.0 * config.n_layers;
  }
  size_t PredBytes() const;
  size_t OutBytes() const { return RowBytes(out_dtype, config.hidden_size) * config.vocab_size; }
  // The embeddings and the output head.
  size_t HeadBytes() const { return Rb(config.hidden_size) * config.vocab_size + OutBytes(); }
  size_t ModelBytes() const;
  // The types for the tables ("Q4_K_M"), and with detail = true what the mix holds.
  std::string TypeName(bool detail = false) const;
};

TensorView View(DType t, int64_t rows, int64_t cols, const Buffer& b);
// The model's shape and types, without its weights: its byte counts before it is built.
std::unique_ptr<SynthModel> PlanModel(const BenchOptions& o);
std::unique_ptr<SynthModel> BuildModel(const BenchOptions& o, ThreadPool& pool);
// The model line every bench prints first.
void PrintModel(const BenchOptions& o, const SynthModel& m, double build_s);

// masks[step][layer]: ascending active neuron ids, drawn from the profile.
using Masks = std::vector<std::vector<std::vector<int32_t>>>;
// With ranking rank_of[layer] (neuron -> rank); seed picks the draw.
Masks DrawMasksRanked(const std::vector<std::vector<int32_t>>& rank_of, int F, double active,
                      double skew, int steps, uint64_t seed, ThreadPool& pool);
// With the model's own ranking, the seed given by the skew.
Masks DrawMasks(const SynthModel& m, double active, double skew, int steps, ThreadPool& pool);

// The cold side's threads poll for work for this long before sleeping (the cpu-worker's
// --spin-us default): the cold side runs once per layer, 40 times per token, and waking sleeping
// threads (tens of microseconds) would be a visible share of a token.
constexpr std::chrono::microseconds kColdSpin(200);

// The cold rows on the CPU, as the cpu-worker computes them (PartialFfn): CpuOps::SparseFfnToken
// over the layer's active cold neurons on a pool of spinning threads (cpu-worker --threads N
// --spin-us 200): the list in one part per thread, each part's gate, up and down rows read from
// the per-neuron bundles in groups of eight (Q4_0 against Q8_0-quantized x with integer dots)
// into the part's own partial sum. A single token's partials are left for the GPU to add when the
// module offers it (SparseFfnTokenParts, ColdRequest::max_parts; variant COLD_PARTS=0: added
// here, in order, as the cpu-worker does; run 37).
class CpuColdFfn : public cuda::ColdFfn {
 public:
  CpuColdFfn(const SynthModel& m, ThreadPool& pool);

  // Variant COLD_AHEAD of decode_bench: guess[layer], this step's guess at each layer's active
  // cold neurons, whose rows Ahead brings into the CPU's caches while the GPU computes the
  // layer's attention, as cpu-worker --prefetch-guess does; first[layer] (ascending; may be
  // null), the guess's first tier, loaded first within each part.
  void SetGuess(const std::vector<std::vector<int32_t>>* guess,
                const std::vector<std::vector<int32_t>>* first) {
    guess_ = guess;
    first_ = first;
  }
  void Ahead(int layer, const cuda::ColdGuess& module_guess,
             const std::function<bool()>& x_ready) override;
  cuda::BackendStatus Run(const cuda::ColdRequest& r) override;

 private:
  const SynthModel& m_;
  ThreadPool& pool_;
  std::unique_ptr<CpuOps> ops_;
  std::vector<float> coef_;
  int hint_ = 2;
  const std::vector<std::vector<int32_t>>* guess_ = nullptr;
  const std::vector<std::vector<int32_t>>* first_ = nullptr;
};

// A backend of the module, destroyed with its scope.
struct Backend {
  cuda::Backend* b = nullptr;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  ~Backend();
};
// Creates be from u; false (and says why, naming `what`) on failure.
bool CreateBackend(const cuda::ModelUpload& u, const char* what, Backend* be);

// The embeddings, output head and its norm; decode-only scratch (max_batch 8, no cuBLAS).
cuda::ModelUpload BaseUpload(const SynthModel& m, int max_ctx);
void FillAttention(const SynthModel& m, int l, cuda::LayerUpload* lu);
// Layer l with its attention and the kHot FFN of the pinfer split: the neurons ranked below n_hot
// on the GPU (hot_ids, ascending), every row of gate, up and down_t offered, and the predictors.
void FillHotLayer(const SynthModel& m, int l, int n_hot, cuda::LayerUpload* lu);
void FillDenseFfn(const SynthModel& m, int l, cuda::LayerUpload* lu);
// Backend scratch and KV cache for a decode-only backend (mirrors CudaBackend::Create).
double ScratchBytes(const SynthModel& m, int max_ctx, int kv_layers, int max_batch);
// The device bytes the pinfer split leaves around its hot rows: head, attention, predictors and
// `scratch`.
double SplitFixedBytes(const SynthModel& m, double scratch);
// How many FFN neurons a layer gets on the GPU when `fixed` bytes of the budget are taken (each
// neuron: its gate, up and down_t rows and its id; as many in every layer, even where down_t's
// rows are longer).
int HotNeuronsInBudget(const SynthModel& m, double budget, double fixed);

// A one-token decode step at position pos.
cuda::ForwardArgs DecodeStep(const int32_t* token, int pos, cuda::FfnMode mode);
// Asks the step for the greedy token picked on the GPU, as the gpu-worker does for greedy
// requests (LogitsMode::kGreedy: 8 bytes come back).
void AskForPick(cuda::ForwardArgs* a, cuda::GreedyResult* pick);

// Bandwidths, measured in this run.
struct Bandwidths {
  double gpu_copy = 0;   // device-to-device copy, bytes read + written per second
  double gpu_gemv = 0;   // the module's F16/Q4_0 matrix-vector kernel over a 2 GB matrix
  double cpu_gemv = 0;   // SimdOps matrix-vector over all threads, 2 GB matrix
  double h2d = 0;        // pinned host to device
  double launch_us = 0;  // host time to enqueue one small kernel
  double kernel_us = 0;  // GPU time per small dependent kernel (back to back)
  double gpu() const { return std::max(gpu_copy, gpu_gemv); }
};
// A bandwidth is the best of its timed repeats, as STREAM reports it: a roofline's denominator
// is what the hardware can do, and a repeat slowed by a neighbour on the host says nothing
// about that (the H200's host once measured its 16-thread matrix-vector at 68 GB/s by the
// median while the offload mode's CPU layers ran at 95 GB/s in the same process).
Bandwidths MeasureBandwidths(DType dtype, ThreadPool& pool);
void PrintBandwidths(const char* when, DType dtype, int threads, const Bandwidths& bw);

// Exits if a CUDA call fails: a bench has nothing to report after one.
void CheckCuda(int error, const char* expr);
#define PINFER_BENCH_CUDA(expr) ::pinfer::cudabench::CheckCuda(static_cast<int>(expr), #expr)

// False (and says so) when the machine has no CUDA device; else prints the device line.
bool OpenDevice(int threads);
// Opens the device, builds the model on a pool of o.Threads() threads and returns
// run(model, pool, threads); 1 without a device.
int WithModel(const BenchOptions& o,
              const std::function<int(const SynthModel&, ThreadPool&, int)>& run);

}  // namespace pinfer::cudabench

#endif  // PINFER_BENCH_CUDA_BENCH_COMMON_H_
