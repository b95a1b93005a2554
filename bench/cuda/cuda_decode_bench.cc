// Decode speed of the pinfer split on a synthetic ReluLLaMA-13B-shape model, against dense layer
// offload (llama.cpp's strategy) and the whole model on the GPU, in one binary and one run, with
// the GPU and CPU bandwidths that make up the roofline measured in the same run.
//
// The model is built in memory: random weights (F16 or Q4_0) of the real shapes, and per-token
// activation masks drawn from a documented profile instead of a trained predictor (the
// predictors still run on the GPU so that their cost counts; their output is replaced by the
// mask). Profile: per layer the neurons are ranked by a random permutation; the top `skew`
// fraction ("hot tier") are active with probability p_hot = 0.8 * active / skew and the rest with
// p_cold = 0.2 * active / (1 - skew), so on average `active` of the neurons fire per token and the
// hot tier takes 80% of activations (skew 0.2 is what PowerInfer's authors report for ReLU
// models, 0.4 is the harder case).
//
// Modes, at the same VRAM budget (default half the model's bytes):
//   pinfer   attention, norms, embeddings, output head, predictors and the top-ranked FFN rows
//            that fit on the GPU; the active hot rows computed sparse on the GPU while the active
//            cold rows are computed sparse by CPU threads, overlapped within each layer.
//   offload  whole layers on the GPU up to the budget, the remaining layers computed dense on the
//            CPU (attention included), output head on the GPU.
//   gpu      every weight on the GPU, dense (no budget): the bandwidth check.
//   lanes    pinfer's backend and --lanes - 1 more lanes over the same weights (Backend::NewLane)
//            decode --lanes sequences at once (default 2), one thread each, the cold sides taking
//            turns on the CPU: one sequence's cold rows overlap the others' GPU work, where a
//            single sequence must wait for each layer's cold rows before the next layer's
//            attention. Tokens/s counts every sequence; bytes per token are one sequence's.
// Variants (--variants, sets of the module's knobs) take turns in one process; with --rounds=N
// the list runs N times over and a last table gives each mode's medians over the rounds.
// Weights are random, so down_t (the transposed down matrix the sparse path reads) is simply
// another random [ffn, hidden] matrix; the dense modes read the same bytes as [hidden, ffn].
// The synthetic model gates with SiLU rather than ReLU: with random weights a drawn-active
// neuron's ReLU gate would be zero half of the time, and the sparse kernels skip rows with a zero
// coefficient, which would flatter both sides; with SiLU every drawn-active row is read in full,
// as for truly active neurons of a ReLU model. The cost per row is the same.
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu-worker/cuda/backend.h"
#include "gpu-worker/cuda/kernels.h"
#include "gpu-worker/cuda/model_dims.h"
#include "gpu-worker/module_cache_slots.h"
#include "shared/engine/ops.h"
#include "shared/engine/row_kernels.h"
#include "shared/engine/sampler.h"
#include "shared/engine/transformer.h"
#include "shared/model/tensor.h"
#include "shared/sparse/cost_model.h"
#include "shared/sparse/hot_cache.h"
#include "shared/util/thread_pool.h"

namespace pinfer {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// "a,b,c" -> {a, b, c} (--skews=0.2,0.4 and the like).
template <typename T>
std::vector<T> CommaList(const char* v) {
  std::vector<T> out;
  for (const char* p = v; *p;) {
    out.push_back(static_cast<T>(std::atof(p)));
    const char* q = std::strchr(p, ',');
    if (q == nullptr) break;
    p = q + 1;
  }
  return out;
}

struct Options {
  std::string dtype = "F16";
  int layers = 40, hidden = 5120, ffn = 13824, heads = 40, vocab = 32000;
  int pred_rank = 256;
  double budget_fraction = 0.5;
  double active = 0.10;
  std::vector<double> skews = {0.2, 0.4};
  int warmup = 4, steps = 32;
  int threads = 0;  // 0: all cores
  int lanes = 2;    // --modes=lanes: sequences in flight
  std::string modes = "pinfer,offload,gpu";
  bool graphs = true;
  // --bandwidths=0 skips measuring the bandwidths, the products by shape and the cold rows
  // (profiling runs, where every launch is slow; the roofline columns are then meaningless).
  bool bandwidths = true;
  // --variants=base;PDL=0;REPACK=0+STEP_GRAPH=0: the modes are run once per variant, each a set
  // of the CUDA module's PINFER_CUDA_* knobs (read when a backend is created); "base" is none.
  std::vector<std::string> variants = {"base"};
  std::string variant_modes;  // --variant-modes=gpu: the modes of the variants other than base
  // --rounds=N: the variant list runs N times over, the variants taking turns in each round, and
  // PrintRounds summarizes each mode and variant over its rounds.
  int rounds = 1;
  // --modes=prefill
  std::vector<int> prefill_batches = {1, 16, 64, 256, 512};
  int stream_chunk = 1024, stream_slots = 2;
  // --modes=adaptive
  std::vector<double> cache_fractions = {0.5};
  double cache_decay = 0.95, cache_gain = 2.0;
  int cache_swaps = 256, cache_period = 4;
  // --modes=staged
  std::vector<int> stage_rows = {0, 100, 200};
  std::string stage_guess = "0.95:1.6:0.82:0.31";
  bool stage_ahead = false;
  bool stage_overlap = false;
};

// 64-byte aligned host buffer.
// Large buffers ask for 2 MB pages (transparent huge pages), as a worker holding weights would:
// the cold side reads 10-27 KB rows scattered over 280 MB matrices, and with 4 KB pages most of
// those rows start with a TLB miss. MeasureColdRows compares both page sizes.
struct Buffer {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit Buffer(size_t bytes, bool huge = true) : n(bytes) {
    constexpr size_t k2M = size_t{2} << 20;
    const size_t align = huge && bytes >= k2M ? k2M : 64;
    p = static_cast<uint8_t*>(std::aligned_alloc(align, (bytes + align - 1) / align * align));
    if (p == nullptr) {
      std::fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
      std::exit(1);
    }
    if (bytes >= k2M)
      madvise(p, (bytes + align - 1) / align * align, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  }
  ~Buffer() { std::free(p); }
};

inline uint64_t SplitMix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Random weights in the stored type. F16: magnitudes 2^-7..2^-4 with random sign and mantissa;
// Q4_0: scale ~0.004, random nibbles. Filled in parallel.
void FillRandom(DType t, uint8_t* p, size_t bytes, uint64_t seed, ThreadPool& pool) {
  const size_t chunk = 1 << 22;
  pool.ParallelFor(static_cast<int64_t>((bytes + chunk - 1) / chunk), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      uint64_t s = seed * 1000003 + c;
      const size_t begin = c * chunk, end = std::min(bytes, begin + chunk);
      if (t == DType::kF16) {
        uint16_t* h = reinterpret_cast<uint16_t*>(p + begin);
        for (size_t i = 0; i < (end - begin) / 2; i += 4) {
          const uint64_t r = SplitMix(s);
          for (int k = 0; k < 4; ++k) {
            const uint16_t x = static_cast<uint16_t>(r >> (16 * k));
            h[i + k] = static_cast<uint16_t>((x & 0x83ff) | ((8 + (x >> 10) % 4) << 10));
          }
        }
      } else {
        for (size_t i = begin; i < end; i += 8) {
          const uint64_t r = SplitMix(s);
          std::memcpy(p + i, &r, std::min<size_t>(8, end - i));
        }
      }
    }
  });
  if (t == DType::kQ4_0) {
    // Fix every block's scale to a sane fp16 value (0x1c00 ~ 0.0039 with small variations).
    const size_t blocks = bytes / sizeof(BlockQ4_0);
    pool.ParallelFor(static_cast<int64_t>(blocks), 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        auto* blk = reinterpret_cast<BlockQ4_0*>(p + i * sizeof(BlockQ4_0));
        blk->d = static_cast<uint16_t>(0x1c00 | (blk->d & 0xff));
      }
    });
  }
}

struct SynthLayer {
  std::unique_ptr<Buffer> wq, wk, wv, wo, gate, up, down_t, fc1, fc2;
  // The cold side's copy of the FFN rows as the cpu-worker keeps them (FfnRowStore): each
  // neuron's gate, up and down_t rows back to back.
  std::unique_ptr<Buffer> bundles;
  std::vector<float> attn_norm, ffn_norm;
  std::vector<int32_t> rank_of;  // neuron -> popularity rank (0 = most active)
};

struct SynthModel {
  DType dtype;
  ModelConfig config;
  std::unique_ptr<Buffer> emb, out;
  std::vector<float> out_norm;
  std::vector<SynthLayer> layers;
  int pred_rank = 0;

  size_t Rb(int64_t cols) const { return RowBytes(dtype, cols); }
  size_t AttnBytes() const {
    const ModelConfig& c = config;
    return Rb(c.hidden_size) * (2 * c.q_dim() + 2 * c.kv_dim());
  }
  size_t FfnBytes() const { return 3 * Rb(config.hidden_size) * config.ffn_size; }
  size_t PredBytes() const {
    return Rb(config.hidden_size) * pred_rank + Rb(pred_rank) * config.ffn_size;
  }
  size_t HeadBytes() const { return 2 * Rb(config.hidden_size) * config.vocab_size; }
  size_t ModelBytes() const {
    return HeadBytes() + config.n_layers * (AttnBytes() + FfnBytes() + 8 * config.hidden_size) +
           4 * config.hidden_size;
  }
};

TensorView View(DType t, int64_t rows, int64_t cols, const Buffer& b) {
  TensorView v;
  v.dtype = t;
  v.shape = {rows, cols};
  v.data = b.p;
  return v;
}

cuda::HostMatrix Host(DType t, int64_t rows, int64_t cols, const void* data) {
  cuda::HostMatrix m;
  m.type = static_cast<cuda::HostType>(t);
  m.rows = rows;
  m.cols = cols;
  m.data = data;
  return m;
}

std::unique_ptr<SynthModel> BuildModel(const Options& o, ThreadPool& pool) {
  auto m = std::make_unique<SynthModel>();
  m->dtype = o.dtype == "Q4_0" ? DType::kQ4_0 : DType::kF16;
  ModelConfig& c = m->config;
  c.vocab_size = o.vocab;
  c.hidden_size = o.hidden;
  c.n_layers = o.layers;
  c.n_heads = o.heads;
  c.n_kv_heads = o.heads;
  c.head_dim = o.hidden / o.heads;
  c.ffn_size = o.ffn;
  c.activation = Activation::kSilu;
  m->pred_rank = o.pred_rank;
  const int H = c.hidden_size, F = c.ffn_size;
  uint64_t seed = 1;
  auto make = [&](int64_t rows, int64_t cols) {
    auto b = std::make_unique<Buffer>(m->Rb(cols) * rows);
    FillRandom(m->dtype, b->p, b->n, seed++, pool);
    return b;
  };
  m->emb = make(c.vocab_size, H);
  m->out = make(c.vocab_size, H);
  m->out_norm.assign(H, 1.f);
  std::mt19937 rng(7);
  for (int l = 0; l < c.n_layers; ++l) {
    SynthLayer L;
    L.wq = make(c.q_dim(), H);
    L.wk = make(c.kv_dim(), H);
    L.wv = make(c.kv_dim(), H);
    L.wo = make(H, c.q_dim());
    L.gate = make(F, H);
    L.up = make(F, H);
    L.down_t = make(F, H);
    const size_t rb = m->Rb(H);
    L.bundles = std::make_unique<Buffer>(3 * rb * F);
    pool.ParallelFor(F, 256, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        uint8_t* dst = L.bundles->p + 3 * rb * j;
        std::memcpy(dst, L.gate->p + rb * j, rb);
        std::memcpy(dst + rb, L.up->p + rb * j, rb);
        std::memcpy(dst + 2 * rb, L.down_t->p + rb * j, rb);
      }
    });
    L.fc1 = make(m->pred_rank, H);
    L.fc2 = make(F, m->pred_rank);
    L.attn_norm.assign(H, 1.f);
    L.ffn_norm.assign(H, 1.f);
    std::vector<int32_t> perm(F);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    L.rank_of.resize(F);
    for (int r = 0; r < F; ++r) L.rank_of[perm[r]] = r;
    m->layers.push_back(std::move(L));
  }
  return m;
}

// masks[step][layer]: ascending active neuron ids, drawn from the profile.
using Masks = std::vector<std::vector<std::vector<int32_t>>>;

Masks DrawMasks(const SynthModel& m, double active, double skew, int steps, ThreadPool& pool) {
  const int F = m.config.ffn_size, Lc = m.config.n_layers;
  const double p_hot = 0.8 * active / skew, p_cold = 0.2 * active / (1 - skew);
  const int hot_tier = static_cast<int>(skew * F);
  Masks masks(steps, std::vector<std::vector<int32_t>>(Lc));
  pool.ParallelFor(static_cast<int64_t>(steps) * Lc, 1, [&](int64_t b, int64_t e) {
    for (int64_t job = b; job < e; ++job) {
      const int s = static_cast<int>(job / Lc), l = static_cast<int>(job % Lc);
      std::mt19937_64 rng(job * 7919 + static_cast<uint64_t>(skew * 1000));
      std::uniform_real_distribution<double> u(0, 1);
      std::vector<int32_t>& out = masks[s][l];
      for (int j = 0; j < F; ++j) {
        const double p = m.layers[l].rank_of[j] < hot_tier ? p_hot : p_cold;
        if (u(rng) < p) out.push_back(j);
      }
    }
  });
  return masks;
}

// The cold side's threads poll for work for this long before sleeping (the cpu-worker's
// --spin-us default): the cold side runs once per layer, 40 times per token, and waking sleeping
// threads (tens of microseconds) would be a visible share of a token.
constexpr std::chrono::microseconds kColdSpin(200);

// The cold rows on the CPU, as the cpu-worker computes them (PartialFfn): CpuOps::SparseFfnToken
// over the layer's active cold neurons on a pool of spinning threads (cpu-worker --threads N
// --spin-us 200): the list in one part per thread, each part's gate, up and down rows read in
// groups of eight (Q4_0 against Q8_0-quantized x with integer dots) into the part's own partial
// sum. A single token's partials are left for the GPU to add when the module offers it
// (SparseFfnTokenParts, ColdRequest::max_parts; variant COLD_PARTS=0: added here, in order, as the
// cpu-worker does; run 37). Rows are read from the per-neuron bundles as the cpu-worker stores
// them, or (variant COLD_BUNDLES=0, i.e. PINFER_CUDA_COLD_BUNDLES=0) from the three separate
// matrices.
//
// (Runs 1-33 split the list into equal shares in the bench itself, variant COLD_DEAL=static until
// 181910d; run 35 measured the op and the shares within noise of each other.)
class CpuColdFfn : public cuda::ColdFfn {
 public:
  CpuColdFfn(const SynthModel& m, ThreadPool& pool)
      : m_(m), pool_(pool), ops_(NewSimdOps(&pool)), coef_(static_cast<size_t>(m.config.ffn_size)) {
    const char* env = std::getenv("PINFER_CUDA_COLD_BUNDLES");
    bundles_ = env == nullptr || std::string(env) != "0";
    const char* hint = std::getenv("PINFER_CUDA_COLD_AHEAD_HINT");
    hint_ = hint == nullptr ? 2 : std::atoi(hint);
  }

  // Variant COLD_AHEAD: guess[layer], this step's guess at each layer's active cold neurons, whose
  // rows Ahead brings into the CPU's caches while the GPU computes the layer's attention;
  // first[layer] (ascending; may be null), the guess's first tier, loaded first within each part:
  // the step's actual cold lists for COLD_AHEAD_RANKED, the drawn tiers of COLD_AHEAD_TIER.
  void SetGuess(const std::vector<std::vector<int32_t>>* guess,
                const std::vector<std::vector<int32_t>>* first) {
    guess_ = guess;
    first_ = first;
  }

  // Each pool thread prefetches its share of the guessed neurons' rows, line by line, in the
  // order the op reads them (PINFER_CUDA_COLD_AHEAD_HINT: 3 = prefetcht0, 2 = prefetcht1,
  // 1 = prefetcht2, 0 = loads, -1 = none: what the parts and the wait for x cost alone), until x is
  // published: part 0 polls x_ready between neurons and tells the others to stop. (Checks every 2-8
  // KB within a neuron's rows as well, variant COLD_AHEAD_STEP of session 29, stopped no sooner:
  // docs/benchmarks.md, run 46.) With a first tier, each part loads its first-tier neurons first,
  // then the rest, as PartialFfn::Prefetch does with the module's tiers. COLD_AHEAD_RANKED=1
  // makes the tier the actually active neurons, as a guess ranked perfectly by its confidence
  // would (an upper bound on what ranking a guess larger than the loads' window can give).
  void Ahead(int layer, const cuda::ColdGuess& module_guess,
             const std::function<bool()>& x_ready) override {
    (void)module_guess;  // a guess from random predictors, about masks drawn independently
    if (guess_ == nullptr) return;
    const std::vector<int32_t>& g = (*guess_)[layer];
    if (g.empty()) return;
    const SynthLayer& L = m_.layers[layer];
    const size_t rb = RowBytes(m_.dtype, m_.config.hidden_size);
    const int n = static_cast<int>(g.size());
    const int parts = ops_->SparseFfnParts(n);  // the op's parts, on the same pinned threads
    std::atomic<bool> stop{false};
    pool_.ParallelFor(parts, 1, [&](int64_t p0, int64_t p1) {
      auto stopped = [&](int64_t part) {
        if (part == 0 && x_ready()) stop.store(true, std::memory_order_relaxed);
        return stop.load(std::memory_order_relaxed);
      };
      auto touch = [&](const uint8_t* p, size_t bytes) {
        if (hint_ < 0) return;  // COLD_AHEAD_HINT=-1: no loads, the parts and the polling only
        for (size_t o = 0; o < bytes; o += 64) {
          switch (hint_) {
            case 3:
              __builtin_prefetch(p + o, 0, 3);
              break;
            case 2:
              __builtin_prefetch(p + o, 0, 2);
              break;
            case 1:
              __builtin_prefetch(p + o, 0, 1);
              break;
            default:
              (void)*reinterpret_cast<const volatile uint8_t*>(p + o);  // volatile: kept
          }
        }
      };
      const std::vector<int32_t>* act = first_ != nullptr ? &(*first_)[layer] : nullptr;
      for (int64_t part = p0; part < p1; ++part) {
        const int i0 = SparseFfnPartBegin(n, parts, static_cast<int>(part));
        const int i1 = SparseFfnPartBegin(n, parts, static_cast<int>(part) + 1);
        for (int pass = act != nullptr ? 0 : 1; pass < 2; ++pass) {
          for (int i = i0; i < i1; ++i) {
            if (stopped(part)) break;
            if (act != nullptr && std::binary_search(act->begin(), act->end(), g[i]) != (pass == 0))
              continue;
            const size_t j = static_cast<size_t>(g[i]);
            if (bundles_) {
              touch(L.bundles->p + j * 3 * rb, 3 * rb);
            } else {
              touch(L.gate->p + j * rb, rb);
              touch(L.up->p + j * rb, rb);
              touch(L.down_t->p + j * rb, rb);
            }
          }
        }
        // Part 0 done early: keep watching for x, so that the other parts stop in time.
        if (part == 0) {
          while (!stop.load(std::memory_order_relaxed) && !x_ready()) {
          }
          stop.store(true, std::memory_order_relaxed);
        }
      }
    });
  }

  cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
    const int H = m_.config.hidden_size, F = m_.config.ffn_size;
    const SynthLayer& L = m_.layers[r.layer];
    auto view = [&](const Buffer& b) {
      TensorView v;
      v.dtype = m_.dtype;
      v.shape = {F, H};
      v.data = b.p;
      return v;
    };
    TensorView gate = view(*L.gate), up = view(*L.up), down_t = view(*L.down_t);
    if (bundles_) {
      const size_t rb = gate.row_bytes();
      gate.data = L.bundles->p;
      up.data = L.bundles->p + rb;
      down_t.data = L.bundles->p + 2 * rb;
      gate.row_stride = up.row_stride = down_t.row_stride = 3 * rb;
    }
    if (r.n == 1 && r.max_parts > 0) {  // the GPU adds the threads' partial sums
      ops_->SparseFfnTokenParts(gate, up, down_t, r.active, r.n_active, Activation::kSilu, r.x,
                                nullptr, coef_.data(), r.out, r.max_parts, r.parts);
      return {};
    }
    for (int t = 0; t < r.n; ++t) {
      const float* x = r.x + static_cast<size_t>(t) * H;
      float* out = r.out + static_cast<size_t>(t) * H;
      std::fill(out, out + H, 0.f);
      ops_->SparseFfnToken(gate, up, down_t, r.active, r.n_active, Activation::kSilu, x, nullptr,
                           coef_.data(), out);
    }
    return {};
  }

 private:
  const SynthModel& m_;
  ThreadPool& pool_;
  std::unique_ptr<CpuOps> ops_;
  std::vector<float> coef_;
  bool bundles_ = true;
  int hint_ = 2;
  const std::vector<std::vector<int32_t>>* guess_ = nullptr;
  const std::vector<std::vector<int32_t>>* first_ = nullptr;
};

// Variant COLD_AHEAD (PINFER_CUDA_COLD_AHEAD): per step and layer a guess at the active cold
// neurons, as a lookahead predictor on the layer's input would make before the attention
// ("Lookahead prediction on relu-llama-tiny" in docs/benchmarks.md). "1": the active cold
// neurons themselves; "R:X": each kept with probability R, plus inactive cold neurons drawn at
// random up to X times as many neurons as are active. Empty when off.
std::vector<std::vector<std::vector<int32_t>>> GuessCold(
    const std::vector<std::vector<std::vector<int32_t>>>& cold_ids,
    const std::vector<std::vector<int32_t>>& local_of, int ffn) {
  const char* env = std::getenv("PINFER_CUDA_COLD_AHEAD");
  if (env == nullptr || std::string(env) == "0") return {};
  double recall = 1, size = 1;
  if (std::string(env) != "1" && std::sscanf(env, "%lf:%lf", &recall, &size) != 2) {
    std::fprintf(stderr, "PINFER_CUDA_COLD_AHEAD=%s: expected 0, 1 or R:X\n", env);
    std::exit(2);
  }
  std::vector<std::vector<std::vector<int32_t>>> guess(cold_ids.size());
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> u(0, 1);
  std::uniform_int_distribution<int32_t> pick(0, ffn - 1);
  for (size_t s = 0; s < cold_ids.size(); ++s) {
    guess[s].resize(cold_ids[s].size());
    for (size_t l = 0; l < cold_ids[s].size(); ++l) {
      const std::vector<int32_t>& act = cold_ids[s][l];
      std::vector<int32_t>& g = guess[s][l];
      for (int32_t j : act)
        if (u(rng) < recall) g.push_back(j);
      const size_t want = static_cast<size_t>(std::lround(size * act.size()));
      std::vector<char> taken(static_cast<size_t>(ffn), 0);
      for (int32_t j : act) taken[j] = 1;
      for (int tries = 0; g.size() < want && tries < 100 * ffn; ++tries) {
        const int32_t j = pick(rng);
        if (local_of[l][j] < 0 && !taken[j]) {
          taken[j] = 1;
          g.push_back(j);
        }
      }
      std::sort(g.begin(), g.end());
    }
  }
  return guess;
}

// Variant COLD_AHEAD_TIER=A:B (PINFER_CUDA_COLD_AHEAD_TIER): a first tier for each guess of
// GuessCold, as the module marks the neurons its predictor selects at its own cut on the
// guess's input: each guessed neuron that is active joins it with probability A, each other one
// with probability B. lookahead_study's last table gives A and B for relu-llama-tiny's guesses
// (the bench's random predictors cannot make a tier worth measuring). The draws have their own
// generator, so the guesses are the same with the tier as without it. Empty when off.
std::vector<std::vector<std::vector<int32_t>>> TierCold(
    const std::vector<std::vector<std::vector<int32_t>>>& guess,
    const std::vector<std::vector<std::vector<int32_t>>>& cold_ids) {
  const char* env = std::getenv("PINFER_CUDA_COLD_AHEAD_TIER");
  if (env == nullptr || std::string(env) == "0" || guess.empty()) return {};
  double a = 0, b = 0;
  if (std::sscanf(env, "%lf:%lf", &a, &b) != 2) {
    std::fprintf(stderr, "PINFER_CUDA_COLD_AHEAD_TIER=%s: expected 0 or A:B\n", env);
    std::exit(2);
  }
  std::vector<std::vector<std::vector<int32_t>>> first(guess.size());
  std::mt19937 rng(29);
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t s = 0; s < guess.size(); ++s) {
    first[s].resize(guess[s].size());
    for (size_t l = 0; l < guess[s].size(); ++l) {
      const std::vector<int32_t>& act = cold_ids[s][l];
      for (int32_t j : guess[s][l]) {  // ascending, so the tier is too
        const bool active = std::binary_search(act.begin(), act.end(), j);
        if (u(rng) < (active ? a : b)) first[s][l].push_back(j);
      }
    }
  }
  return first;
}

// Two lanes' cold sides on one pool: each request runs alone, in arrival order, as the
// cpu-worker serves one exchange at a time. (A waiting lane that polled instead of blocking on
// the mutex, variant TURNS=spin of 7c9e593, was no faster in two H200 calls: docs/benchmarks.md,
// run 35.) A lane's loads ahead (variant COLD_AHEAD) take the turn too, and stop as soon as
// another lane's request waits for it, as the cpu-worker's loads stop at the next request's
// doorbell: the CPU's idle time between two lanes' requests is what they may use.
class TakeTurns : public cuda::ColdFfn {
 public:
  TakeTurns(cuda::ColdFfn* inner, std::mutex* turn, std::atomic<int>* waiting)
      : inner_(inner), turn_(turn), waiting_(waiting) {}
  cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
    waiting_->fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(*turn_);
    waiting_->fetch_sub(1, std::memory_order_relaxed);
    return inner_->Run(r);
  }
  void Ahead(int layer, const cuda::ColdGuess& guess,
             const std::function<bool()>& x_ready) override {
    std::lock_guard<std::mutex> lock(*turn_);
    inner_->Ahead(layer, guess,
                  [&] { return waiting_->load(std::memory_order_relaxed) > 0 || x_ready(); });
  }

 private:
  cuda::ColdFfn* inner_;
  std::mutex* turn_;
  std::atomic<int>* waiting_;  // lanes whose request waits for the turn
};

// The cold side's row bandwidth on one layer-sized set of gate, up and down_t rows: 10% of the
// rows drawn at random per pass, computed as CpuColdFfn does, with 4 KB and with 2 MB pages.
void MeasureColdRows(DType dtype, int hidden, int ffn, int threads, ThreadPool& fill_pool) {
  const RowKernels* k = BestRowKernels();
  const size_t rb = RowBytes(dtype, hidden), di = static_cast<size_t>(dtype);
  std::vector<float> x(hidden, 0.01f), partial(static_cast<size_t>(threads) * hidden);
  std::mt19937 rng(3);
  ThreadPool spin(threads, kColdSpin);
  std::printf("cold rows (%d threads, %d of %d rows):", threads, ffn / 10, ffn);
  for (bool huge : {false, true}) {
    Buffer gate(rb * ffn, huge), up(rb * ffn, huge), down(rb * ffn, huge);
    FillRandom(dtype, gate.p, gate.n, 11, fill_pool);
    FillRandom(dtype, up.p, up.n, 12, fill_pool);
    FillRandom(dtype, down.p, down.n, 13, fill_pool);
    std::vector<double> t;
    for (int rep = 0; rep < 24; ++rep) {
      std::vector<int32_t> ids(ffn);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(ffn / 10);
      std::sort(ids.begin(), ids.end());
      const int n_active = static_cast<int>(ids.size());
      const double t0 = Now();
      spin.ParallelFor(threads, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t part = p0; part < p1; ++part) {
          float* y = partial.data() + static_cast<size_t>(part) * hidden;
          std::fill(y, y + hidden, 0.f);
          const int i0 = static_cast<int>(static_cast<int64_t>(n_active) * part / threads);
          const int i1 = static_cast<int>(static_cast<int64_t>(n_active) * (part + 1) / threads);
          for (int i = i0; i < i1; ++i) {
            const int64_t j = ids[i];
            const float g = k->dot[di](gate.p + j * rb, x.data(), hidden);
            const float u = k->dot[di](up.p + j * rb, x.data(), hidden);
            k->axpy[di](g / (1.f + std::exp(-g)) * u, down.p + j * rb, y, hidden);
          }
        }
      });
      if (rep >= 4) t.push_back(Now() - t0);
    }
    std::sort(t.begin(), t.end());
    std::printf(" %s pages %.1f GB/s (%.0f us)", huge ? "2M" : "4K",
                3.0 * rb * (ffn / 10) / t[t.size() / 2] / 1e9, t[t.size() / 2] * 1e6);
  }
  std::printf("\n");
}

// Dense layers on the CPU for the offload mode (llama.cpp's CPU path): the whole layer with the
// optimised CPU operators over all threads.
class CpuDenseLayers {
 public:
  CpuDenseLayers(const SynthModel& m, ThreadPool& pool, int first, int max_ctx)
      : m_(m), ops_(NewSimdOps(&pool)), first_(first), max_ctx_(max_ctx) {
    const ModelConfig& c = m.config;
    inv_freq_ = RopeInverseFrequencies(c);
    k_.assign(static_cast<size_t>(c.n_layers - first) * max_ctx * c.kv_dim(), 0.f);
    v_ = k_;
  }
  // x: [1, hidden] in place, position pos.
  void Run(float* x, int pos) {
    const ModelConfig& c = m_.config;
    const int H = c.hidden_size, F = c.ffn_size;
    std::vector<float> xb(H), q(c.q_dim()), att(c.q_dim()), g(F), u(F), o(H);
    const int32_t position = pos;
    for (int l = first_; l < c.n_layers; ++l) {
      const SynthLayer& L = m_.layers[l];
      const size_t base = static_cast<size_t>(l - first_) * max_ctx_ * c.kv_dim();
      float* kc = k_.data() + base;
      float* vc = v_.data() + base;
      ops_->RmsNorm(x, L.attn_norm.data(), 1, H, c.norm_eps, xb.data());
      ops_->MatMul(View(m_.dtype, c.q_dim(), H, *L.wq), xb.data(), 1, q.data());
      ops_->MatMul(View(m_.dtype, c.kv_dim(), H, *L.wk), xb.data(), 1, kc + pos * c.kv_dim());
      ops_->MatMul(View(m_.dtype, c.kv_dim(), H, *L.wv), xb.data(), 1, vc + pos * c.kv_dim());
      ops_->Rope(q.data(), 1, c.n_heads, c.head_dim, &position, inv_freq_.data(), false);
      ops_->Rope(kc + pos * c.kv_dim(), 1, c.n_kv_heads, c.head_dim, &position, inv_freq_.data(),
                 false);
      ops_->Attention(q.data(), kc, vc, 1, pos, c.n_heads, c.n_kv_heads, c.head_dim, att.data());
      ops_->MatMul(View(m_.dtype, H, c.q_dim(), *L.wo), att.data(), 1, o.data());
      for (int i = 0; i < H; ++i) x[i] += o[i];
      ops_->RmsNorm(x, L.ffn_norm.data(), 1, H, c.norm_eps, xb.data());
      ops_->MatMul(View(m_.dtype, F, H, *L.gate), xb.data(), 1, g.data());
      ops_->MatMul(View(m_.dtype, F, H, *L.up), xb.data(), 1, u.data());
      ops_->GatedActivation(c.activation, g.data(), u.data(), F);
      ops_->MatMul(View(m_.dtype, H, F, *L.down_t), g.data(), 1, o.data());  // as [hidden, ffn]
      for (int i = 0; i < H; ++i) x[i] += o[i];
    }
  }

 private:
  const SynthModel& m_;
  std::unique_ptr<CpuOps> ops_;
  int first_, max_ctx_;
  std::vector<float> inv_freq_, k_, v_;
};

// ---------------------------------------------------------------------------------------------
// Bandwidths, measured in this run.

struct Bandwidths {
  double gpu_copy = 0;       // device-to-device copy, bytes read + written per second
  double gpu_gemv = 0;       // our F16/Q4_0 matrix-vector kernel over a 2 GB matrix
  double gpu_gemv_gguf = 0;  // block formats: the same in GGUF's layout (not what runs)
  double cpu_gemv = 0;       // SimdOps matrix-vector over all threads, 2 GB matrix
  double h2d = 0;            // pinned host to device
  double launch_us = 0;      // host time to enqueue one small kernel
  double kernel_us = 0;      // GPU time per small dependent kernel (back to back)
  double gpu() const { return std::max(gpu_copy, gpu_gemv); }
};

#define CHECK_CUDA(expr)                                               \
  do {                                                                 \
    cudaError_t _e = (expr);                                           \
    if (_e != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(_e)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

double MedianOf(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A bandwidth is the best of its timed repeats, as STREAM reports it: a roofline's denominator
// is what the hardware can do, and a repeat slowed by a neighbour on the host says nothing
// about that (the H200's host once measured its 16-thread matrix-vector at 68 GB/s by the
// median while the offload mode's CPU layers ran at 95 GB/s in the same process).
double FastestOf(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

Bandwidths MeasureBandwidths(DType dtype, ThreadPool& pool) {
  Bandwidths bw;
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 0x11, bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 12; ++i) {
    CHECK_CUDA(cudaEventRecord(e0));
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) t.push_back(ms * 1e-3);
  }
  bw.gpu_copy = 2.0 * bytes / FastestOf(t);

  // GEMV: a random matrix of the benchmark's type, hidden 5120 columns.
  const int64_t cols = 5120;
  const int64_t rows = static_cast<int64_t>(bytes / RowBytes(dtype, cols));
  {
    Buffer host(RowBytes(dtype, cols) * rows);
    FillRandom(dtype, host.p, host.n, 99, pool);
    CHECK_CUDA(cudaMemcpy(a, host.p, host.n, cudaMemcpyHostToDevice));
    std::vector<float> x(cols, 0.01f);
    CHECK_CUDA(cudaMemcpy(b, x.data(), cols * 4, cudaMemcpyHostToDevice));
    float* y = static_cast<float*>(b) + cols;
    cuda::DeviceMatrix m{static_cast<cuda::WType>(dtype), rows, cols, a};
    auto time_matvec = [&](const cuda::DeviceMatrix& w) {
      t.clear();
      for (int i = 0; i < 12; ++i) {
        CHECK_CUDA(cudaEventRecord(e0));
        CHECK_CUDA(cuda::MatVecRows(w, nullptr, static_cast<int>(rows), nullptr,
                                    static_cast<float*>(b), 1, y, static_cast<int>(rows), nullptr));
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 2) t.push_back(ms * 1e-3);
      }
      return static_cast<double>(host.n) / FastestOf(t);
    };
    bw.gpu_gemv = time_matvec(m);
    if (dtype == DType::kQ4_0 || dtype == DType::kQ8_0) {
      // The layout the backend uses: quants and scales apart (kernels.h), repacked on the GPU.
      bw.gpu_gemv_gguf = bw.gpu_gemv;
      void* c = nullptr;
      CHECK_CUDA(cudaMalloc(&c, host.n));
      cuda::DeviceMatrix sm = m;
      sm.data = c;
      sm.scales = static_cast<uint8_t*>(c) + cuda::QuantRowBytes(sm.type, cols) * rows;
      CHECK_CUDA(cuda::RepackSplit(m, sm, 0, nullptr));
      bw.gpu_gemv = time_matvec(sm);
      CHECK_CUDA(cudaFree(c));
    }

    // CPU: the same matrix through SimdOps on all threads.
    std::unique_ptr<CpuOps> ops = NewSimdOps(&pool);
    std::vector<float> yc(rows);
    t.clear();
    TensorView v = View(dtype, rows, cols, host);
    for (int i = 0; i < 9; ++i) {
      const double t0 = Now();
      ops->MatMul(v, x.data(), 1, yc.data());
      if (i >= 1) t.push_back(Now() - t0);
    }
    bw.cpu_gemv = static_cast<double>(host.n) / FastestOf(t);
  }
  {
    const size_t hb = size_t{1} << 30;
    void* pinned = nullptr;
    CHECK_CUDA(cudaMallocHost(&pinned, hb));
    std::memset(pinned, 1, hb);
    t.clear();
    for (int i = 0; i < 6; ++i) {
      const double t0 = Now();
      CHECK_CUDA(cudaMemcpy(a, pinned, hb, cudaMemcpyHostToDevice));
      if (i >= 1) t.push_back(Now() - t0);
    }
    bw.h2d = hb / FastestOf(t);
    cudaFreeHost(pinned);
  }
  {
    // Launch costs: 2000 tiny dependent kernels, host enqueue time and GPU time.
    float* f = static_cast<float*>(a);
    CHECK_CUDA(cuda::AddInPlace(f, f + 1024, 256, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    const double t0 = Now();
    CHECK_CUDA(cudaEventRecord(e0));
    for (int i = 0; i < 2000; ++i) CHECK_CUDA(cuda::AddInPlace(f, f + 1024, 256, nullptr));
    CHECK_CUDA(cudaEventRecord(e1));
    bw.launch_us = (Now() - t0) / 2000 * 1e6;
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    bw.kernel_us = ms * 1e3 / 2000;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return bw;
}

// Matrix-vector throughput per layer shape and kernel choice (one warp per row against one block
// per row), to see where a decode step loses bandwidth.
void MeasureShapes(DType dtype, ThreadPool& pool) {
  struct Shape {
    const char* name;
    int64_t rows, cols;
  };
  const Shape shapes[] = {{"wqkv", 15360, 5120},
                          {"wo", 5120, 5120},
                          {"gate_up", 27648, 5120},
                          {"down", 5120, 13824},
                          {"output", 32000, 5120}};
  const int saved = cuda::MatVecWarpRowsMin();
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::printf("matvec %s GB/s by shape:", DTypeName(dtype).data());
  for (const Shape& sh : shapes) {
    Buffer host(RowBytes(dtype, sh.cols) * sh.rows);
    FillRandom(dtype, host.p, host.n, 5, pool);
    void* w = nullptr;
    float *x = nullptr, *y = nullptr;
    CHECK_CUDA(cudaMalloc(&w, host.n));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&x), sh.cols * 4));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&y), sh.rows * 4));
    CHECK_CUDA(cudaMemcpy(w, host.p, host.n, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(x, 0, sh.cols * 4));
    cuda::DeviceMatrix m{static_cast<cuda::WType>(dtype), sh.rows, sh.cols, w};
    std::printf(" %s", sh.name);
    // Block formats: GGUF's layout against the split one the backend uses. Then the default
    // kernel 20 times back to back on a stream, without and with programmatic dependent launch
    // (the next launch's start and weight prefetch overlap the previous one's tail).
    const bool quant = dtype == DType::kQ4_0 || dtype == DType::kQ8_0;
    void* ws = nullptr;
    cuda::DeviceMatrix sm = m;
    if (quant) {
      CHECK_CUDA(cudaMalloc(&ws, host.n));
      sm.data = ws;
      sm.scales = static_cast<uint8_t*>(ws) + cuda::QuantRowBytes(sm.type, sh.cols) * sh.rows;
      CHECK_CUDA(cuda::RepackSplit(m, sm, 0, nullptr));
    }
    cudaStream_t s;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const bool pdl = cuda::ProgrammaticLaunch();
    for (int variant = 0; variant < 4; ++variant) {
      const char* names[] = {quant ? "gguf" : "warp", quant ? "split" : "block", "chain",
                             "chain+pdl"};
      if (!quant) cuda::SetMatVecWarpRowsMin(variant == 0 ? 1 : 1 << 30);  // warp rows, block rows
      const cuda::DeviceMatrix& mv = quant && variant > 0 ? sm : m;
      const int reps = variant >= 2 ? 20 : 1;
      cuda::SetProgrammaticLaunch(variant == 3);
      cudaStream_t st = variant >= 2 ? s : nullptr;
      std::vector<double> t;
      for (int i = 0; i < 25; ++i) {
        CHECK_CUDA(cudaEventRecord(e0, st));
        for (int k = 0; k < reps; ++k) {
          CHECK_CUDA(cuda::MatVecRows(mv, nullptr, static_cast<int>(sh.rows), nullptr, x, 1, y,
                                      static_cast<int>(sh.rows), st));
        }
        CHECK_CUDA(cudaEventRecord(e1, st));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 5) t.push_back(ms * 1e-3 / reps);
      }
      std::printf(" %s %.0f", names[variant], host.n / MedianOf(t) / 1e9);
    }
    cuda::SetProgrammaticLaunch(pdl);
    cudaStreamDestroy(s);
    if (ws != nullptr) cudaFree(ws);
    cudaFree(w);
    cudaFree(x);
    cudaFree(y);
  }
  std::printf("\n");
  cuda::SetMatVecWarpRowsMin(saved);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// ---------------------------------------------------------------------------------------------

struct Backend {
  cuda::Backend* b = nullptr;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  ~Backend() {
    if (b != nullptr) pinfer_cuda_destroy_backend(b);
  }
};

cuda::ModelUpload BaseUpload(const SynthModel& m, int max_ctx) {
  const ModelConfig& c = m.config;
  cuda::ModelUpload u;
  u.dims = cuda::DimsFromConfig(c);
  u.tok_embeddings = Host(m.dtype, c.vocab_size, c.hidden_size, m.emb->p);
  u.output = Host(m.dtype, c.vocab_size, c.hidden_size, m.out->p);
  u.output_norm = Host(DType::kF32, 1, c.hidden_size, m.out_norm.data());
  u.max_ctx = max_ctx;
  u.max_seqs = 1;
  u.max_batch = 8;  // decode only: no cuBLAS scratch
  u.layers.resize(c.n_layers);
  return u;
}

void FillAttention(const SynthModel& m, int l, cuda::LayerUpload* lu) {
  const ModelConfig& c = m.config;
  const SynthLayer& L = m.layers[l];
  const int H = c.hidden_size;
  lu->attn_norm = Host(DType::kF32, 1, H, L.attn_norm.data());
  lu->ffn_norm = Host(DType::kF32, 1, H, L.ffn_norm.data());
  lu->wq = Host(m.dtype, c.q_dim(), H, L.wq->p);
  lu->wk = Host(m.dtype, c.kv_dim(), H, L.wk->p);
  lu->wv = Host(m.dtype, c.kv_dim(), H, L.wv->p);
  lu->wo = Host(m.dtype, H, c.q_dim(), L.wo->p);
}

// Layer l with its attention and the kHot FFN of the pinfer split: the neurons ranked below n_hot
// on the GPU (hot_ids, ascending), every row of gate, up and down_t offered, and the predictors.
void FillHotLayer(const SynthModel& m, int l, int n_hot, cuda::LayerUpload* lu) {
  const ModelConfig& c = m.config;
  const SynthLayer& L = m.layers[l];
  const int H = c.hidden_size, F = c.ffn_size;
  FillAttention(m, l, lu);
  lu->ffn = cuda::FfnPlacement::kHot;
  lu->gate = Host(m.dtype, F, H, L.gate->p);
  lu->up = Host(m.dtype, F, H, L.up->p);
  lu->down_t = Host(m.dtype, F, H, L.down_t->p);
  lu->pred_fc1 = Host(m.dtype, m.pred_rank, H, L.fc1->p);
  lu->pred_fc2 = Host(m.dtype, F, m.pred_rank, L.fc2->p);
  lu->hot_ids.clear();
  for (int j = 0; j < F; ++j) {
    if (L.rank_of[j] < n_hot) lu->hot_ids.push_back(j);
  }
}

void FillDenseFfn(const SynthModel& m, int l, cuda::LayerUpload* lu) {
  const ModelConfig& c = m.config;
  const SynthLayer& L = m.layers[l];
  lu->ffn = cuda::FfnPlacement::kDense;
  lu->gate = Host(m.dtype, c.ffn_size, c.hidden_size, L.gate->p);
  lu->up = Host(m.dtype, c.ffn_size, c.hidden_size, L.up->p);
  lu->down = Host(m.dtype, c.hidden_size, c.ffn_size, L.down_t->p);
}

struct Result {
  std::string mode;
  std::string variant;
  double skew = 0;
  std::string placement;
  double tok_s = 0;
  double gpu_bytes = 0, cpu_bytes = 0;  // per token
  double floor_s = 0;
  double plan_bytes = 0, actual_bytes = 0;
  double cold_s = 0, wait_s = 0, gpu_hot_s = 0, gpu_attn_s = 0;
  double launch_s = 0, gpu_gap_s = 0, gpu_in_s = 0;  // ForwardStats' host_launch, gpu_cold_*
  double ahead_s = 0;                                // ForwardStats' cold_ahead
  double guess_wait_s = 0, guess_rows = 0;           // ForwardStats' guess_wait, guess_rows
  double gpu_cold_share = 0;  // fraction of the active cold rows the GPU read over PCIe
  double pcie_floor_s = 0;    // the floor with PCIe as a third resource (see PrintResults)
};

// Backend scratch and KV cache for a decode-only backend (mirrors CudaBackend::Create).
double ScratchBytes(const SynthModel& m, int max_ctx, int kv_layers, int max_batch) {
  const ModelConfig& c = m.config;
  const double B = max_batch;
  double s = 2.0 * kv_layers * max_ctx * c.kv_dim() * 4;  // KV cache (fp32)
  s += B * (6.0 * c.hidden_size + 2.0 * c.q_dim() + 3.0 * c.ffn_size + m.pred_rank + c.vocab_size) *
       4;
  s += 2.0 * c.ffn_size * 4 + 4.0 * B * 4 + c.head_dim * 2.0 + 8;
  s += 4.0 * c.hidden_size * (kv_layers * 2 + 1);  // fp32 norms
  return s;
}

// The roofline per token: max(GPU bytes / GPU bandwidth, CPU bytes / CPU bandwidth), the two
// sides overlapping; offload's layers run one after the other, so there it is the sum.
void SetFloors(const Bandwidths& bw, Result* r) {
  if (r->mode == "offload") {
    r->floor_s = r->gpu_bytes / bw.gpu() + r->cpu_bytes / bw.cpu_gemv;
  } else {
    r->floor_s = std::max(r->gpu_bytes / bw.gpu(), r->cpu_bytes / bw.cpu_gemv);
  }
  // The issue's floor puts every cold row on the CPU, as placed. When the GPU may also read cold
  // rows over PCIe (PINFER_CUDA_COLD_GPU_SHARE), the cold bytes can be split between the CPU and
  // the link, the best split giving cold / (CPU + host->GPU bandwidth).
  r->pcie_floor_s = std::max(r->gpu_bytes / bw.gpu(), r->cpu_bytes / (bw.cpu_gemv + bw.h2d));
}

void PrintResults(const Options& o, const SynthModel& m, const Bandwidths& bw,
                  const std::vector<Result>& rs) {
  double offload = 0;
  for (const Result& r : rs) {
    if (r.mode == "offload" && offload == 0) offload = r.tok_s;
  }
  std::printf(
      "\n| dtype | mode | skew | placement | tokens/s | ms/token | vs offload | GPU GB/token |"
      " CPU GB/token | roofline ms | %% of roofline | VRAM plan GB | VRAM actual GB |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Result& r : rs) {
    const double ms = 1e3 / r.tok_s;
    char skew[16] = "-";
    if (r.skew > 0) std::snprintf(skew, sizeof(skew), "%.0f%%", r.skew * 100);
    char vs[16] = "-";
    if (offload > 0) std::snprintf(vs, sizeof(vs), "%.1fx", r.tok_s / offload);
    const std::string mode =
        r.variant.empty() || r.variant == "base" ? r.mode : r.mode + " [" + r.variant + "]";
    std::printf(
        "| %s | %s | %s | %s | %.2f | %.2f | %s | %.2f | %.2f | %.2f | %.0f%% | %.2f | %.2f |\n",
        DTypeName(m.dtype).data(), mode.c_str(), skew, r.placement.c_str(), r.tok_s, ms, vs,
        r.gpu_bytes / 1e9, r.cpu_bytes / 1e9, r.floor_s * 1e3, 100.0 * r.floor_s * r.tok_s,
        r.plan_bytes / 1e9, r.actual_bytes / 1e9);
  }
  for (const Result& r : rs) {
    if (r.mode == "gpu") {
      std::printf("whole model on the GPU [%s]: %.0f GB/s = %.0f%% of the measured GPU bandwidth\n",
                  r.variant.c_str(), r.gpu_bytes * r.tok_s / 1e9,
                  100.0 * r.gpu_bytes * r.tok_s / bw.gpu());
    }
    if (r.mode.rfind("pinfer", 0) == 0) {
      std::printf(
          "%s [%s] skew %.0f%%: per token cold callback %.2f ms, host wait for x "
          "%.2f ms (GPU busy %.2f ms of it), GPU hot FFN (+ its cold share) %.2f ms; GPU took "
          "%.1f%% of the active cold rows over PCIe; floor with PCIe as a third resource %.2f ms "
          "(%.0f%% of it)\n",
          r.mode.c_str(), r.variant.c_str(), r.skew * 100, r.cold_s * 1e3, r.wait_s * 1e3,
          r.gpu_attn_s * 1e3, r.gpu_hot_s * 1e3, 100 * r.gpu_cold_share, r.pcie_floor_s * 1e3,
          100.0 * r.pcie_floor_s * r.tok_s);
      // Where a layer's turn between the two sides goes: the host queueing the next layer; on
      // the GPU, from x published to the cold side's signal seen (the host's wake-up and the
      // callback) and from the signal to the next layer's start (the cold sum brought in).
      std::printf(
          "%s [%s] skew %.0f%%: per token host queueing layers %.2f ms; GPU from x published to "
          "the signal %.2f ms (the callback %.2f ms of it), from the signal to the next layer "
          "%.2f ms; cold rows loaded ahead %.2f ms; the module's guess waited for %.2f ms, "
          "%.1f neurons a layer\n",
          r.mode.c_str(), r.variant.c_str(), r.skew * 100, r.launch_s * 1e3, r.gpu_gap_s * 1e3,
          r.cold_s * 1e3, r.gpu_in_s * 1e3, r.ahead_s * 1e3, r.guess_wait_s * 1e3,
          r.guess_rows / m.config.n_layers);
    }
  }
  (void)o;
}

// Where a mode ran more than once at a skew (variants taking turns, --rounds): per mode, skew and
// variant the median over its runs and their range, and against base the ratio of the medians and
// the median of the round-by-round ratios (the k-th run of the variant against base's k-th, which
// ran next to it), which a drift of the host's speed during the process disturbs less. Single
// runs on these hosts move by 10-15% and now and then by 2x (docs/benchmarks.md).
void PrintRounds(const SynthModel& m, const std::vector<Result>& rs) {
  struct Group {
    std::string mode, variant;
    double skew;
    std::vector<double> tok_s, pct;
  };
  std::vector<Group> groups;
  bool repeated = false;
  for (const Result& r : rs) {
    const std::string variant = r.variant.empty() ? "base" : r.variant;
    auto g = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
      return x.mode == r.mode && x.variant == variant && x.skew == r.skew;
    });
    if (g == groups.end()) {
      groups.push_back({r.mode, variant, r.skew, {}, {}});
      g = groups.end() - 1;
    }
    g->tok_s.push_back(r.tok_s);
    g->pct.push_back(100.0 * r.floor_s * r.tok_s);
    repeated = repeated || g->tok_s.size() > 1;
  }
  if (!repeated) return;
  std::printf(
      "\nOver the rounds (medians; the ratios against base are the ratio of the medians and the "
      "median of the round-by-round ratios):\n\n| dtype | mode | skew | variant | runs | tokens/s "
      "| range | vs offload | %% of roofline | vs base (medians) | vs base (by round) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
  auto offload = std::find_if(groups.begin(), groups.end(),
                              [](const Group& x) { return x.mode == "offload"; });
  for (const Group& g : groups) {
    char skew[16] = "-";
    if (g.skew > 0) std::snprintf(skew, sizeof(skew), "%.0f%%", g.skew * 100);
    char vs_median[32] = "-", vs_round[32] = "-";
    auto base = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
      return x.mode == g.mode && x.variant == "base" && x.skew == g.skew;
    });
    if (g.variant != "base" && base != groups.end()) {
      std::vector<double> ratios;
      for (size_t k = 0; k < std::min(g.tok_s.size(), base->tok_s.size()); ++k)
        ratios.push_back(g.tok_s[k] / base->tok_s[k]);
      std::snprintf(vs_median, sizeof(vs_median), "%.3f",
                    MedianOf(g.tok_s) / MedianOf(base->tok_s));
      std::snprintf(vs_round, sizeof(vs_round), "%.3f", MedianOf(ratios));
    }
    char vs_offload[16] = "-";
    if (offload != groups.end()) {
      std::snprintf(vs_offload, sizeof(vs_offload), "%.1fx",
                    MedianOf(g.tok_s) / MedianOf(offload->tok_s));
    }
    std::printf("| %s | %s | %s | %s | %zu | %.2f | %.2f-%.2f | %s | %.0f%% | %s | %s |\n",
                DTypeName(m.dtype).data(), g.mode.c_str(), skew, g.variant.c_str(), g.tok_s.size(),
                MedianOf(g.tok_s), *std::min_element(g.tok_s.begin(), g.tok_s.end()),
                *std::max_element(g.tok_s.begin(), g.tok_s.end()), vs_offload, MedianOf(g.pct),
                vs_median, vs_round);
  }
}

// ---------------------------------------------------------------------------------------------
// Prompt processing (--modes=prefill): cold rows on the CPU vs streamed to the GPU vs the cost
// model's choice (shared/sparse/cost_model.h), per batch size, at the same VRAM budget. The hot
// rows of a batch go through cuBLAS either way. The CPU side computes, token by token, only that
// token's active cold rows (drawn from the same profile as decode), the best case for the CPU;
// the stream moves every cold row once per batch. The cost model's rates are measured here
// first: the stream's copy and product rates with CalibrateStreaming, the CPU's per-row-token
// cost by timing the cold callback on one layer at several batch sizes.

// The cold callback for a batch: token t's own active cold rows, through the decode bench's CPU
// kernel (one call per token).
class BatchCpuCold : public cuda::ColdFfn {
 public:
  BatchCpuCold(CpuColdFfn& one, const SynthModel& m) : one_(one), m_(m) {}
  // per_token[t][layer]: token t's active cold neuron ids.
  void set_masks(const std::vector<std::vector<std::vector<int32_t>>>* per_token) {
    per_token_ = per_token;
  }
  cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
    const int H = m_.config.hidden_size;
    for (int t = 0; t < r.n; ++t) {
      const std::vector<int32_t>& ids = (*per_token_)[t][r.layer];
      cuda::ColdRequest one = r;
      one.n = 1;
      one.x = r.x + static_cast<size_t>(t) * H;
      one.out = r.out + static_cast<size_t>(t) * H;
      one.active = ids.data();
      one.n_active = static_cast<int>(ids.size());
      cuda::BackendStatus st = one_.Run(one);
      if (!st.ok()) return st;
    }
    return {};
  }

 private:
  CpuColdFfn& one_;
  const SynthModel& m_;
  const std::vector<std::vector<std::vector<int32_t>>>* per_token_ = nullptr;
};

int PrefillBench(const Options& o, const SynthModel& m, ThreadPool& pool, int threads) {
  const ModelConfig& c = m.config;
  const int H = c.hidden_size, F = c.ffn_size;
  int max_n = 1;
  for (int n : o.prefill_batches) max_n = std::max(max_n, n);
  const int B = std::max(max_n, 16), max_ctx = max_n + 8;
  const size_t rb = m.Rb(H);
  const double budget = o.budget_fraction * m.ModelBytes();
  // Fixed device bytes: as decode, plus the cuBLAS scratch of B-token batches (fp16 hi/lo
  // activations of the widest product; fp16 weights for block formats) and the stream slots.
  const int64_t widest =
      std::max<int64_t>({int64_t{H}, int64_t{2} * F, int64_t{c.q_dim()} + 2 * c.kv_dim(),
                         int64_t{c.vocab_size}, int64_t{m.pred_rank}});
  double w_half = 0;
  if (m.dtype != DType::kF16) {
    w_half = 2.0 *
             std::max<int64_t>(
                 {int64_t{c.vocab_size}, int64_t{c.q_dim()} + 2 * c.kv_dim(), int64_t{F}}) *
             H;
  }
  const double gemm_scratch = 2.0 * B * widest * 2 + w_half;
  const double slots = static_cast<double>(o.stream_slots) * 3 * std::min(o.stream_chunk, F) * rb;
  const double fixed = m.HeadBytes() + c.n_layers * (m.AttnBytes() + m.PredBytes()) +
                       ScratchBytes(m, max_ctx, c.n_layers, B) + gemm_scratch + slots;
  const double per_neuron = 3.0 * rb + 4;
  const int n_hot =
      std::max(0, std::min(F, static_cast<int>((budget - fixed) / (c.n_layers * per_neuron))));
  const int n_cold = F - n_hot;
  cuda::ModelUpload u = BaseUpload(m, max_ctx);
  u.max_batch = B;
  u.stream_cold = true;
  u.stream_chunk_rows = o.stream_chunk;
  u.stream_slots = o.stream_slots;
  std::vector<std::vector<int32_t>> is_hot(c.n_layers, std::vector<int32_t>(F, 0));
  for (int l = 0; l < c.n_layers; ++l) {
    FillHotLayer(m, l, n_hot, &u.layers[l]);
    for (int32_t j : u.layers[l].hot_ids) is_hot[l][j] = 1;
  }
  const double plan = fixed + c.n_layers * (per_neuron * n_hot + 4.0 * n_cold);
  Backend be;
  char err[512] = {0};
  double t0 = Now();
  if (int rc = pinfer_cuda_create_backend(&u, &be.b, err, sizeof(err)); rc != 0) {
    std::fprintf(stderr, "prefill backend: %s\n", err);
    return 1;
  }
  std::printf(
      "prefill: %d of %d FFN neurons per layer on the GPU (%.1f%%), %d cold streamed in "
      "chunks of %d through %d slots; created (upload + pinned cold rows) in %.1f s; "
      "VRAM plan %.2f GB, actual %.2f GB (%+.2f%%)\n",
      n_hot, F, 100.0 * n_hot / F, n_cold, o.stream_chunk, o.stream_slots, Now() - t0, plan / 1e9,
      be.b->DeviceBytes() / 1e9, 100.0 * (be.b->DeviceBytes() - plan) / plan);

  ThreadPool spin(threads, kColdSpin);
  CpuColdFfn one(m, spin);
  BatchCpuCold cold(one, m);
  // Per-token masks for the largest batch; smaller batches use its first tokens.
  const double skew = o.skews.empty() ? 0.2 : o.skews[0];
  Masks masks = DrawMasks(m, o.active, skew, max_n, pool);
  std::vector<std::vector<std::vector<int32_t>>> cold_tok(
      max_n, std::vector<std::vector<int32_t>>(c.n_layers));
  double cold_rows_per_token = 0;
  for (int t = 0; t < max_n; ++t) {
    for (int l = 0; l < c.n_layers; ++l) {
      for (int32_t j : masks[t][l]) {
        if (!is_hot[l][j]) cold_tok[t][l].push_back(j);
      }
      cold_rows_per_token += cold_tok[t][l].size();
    }
  }
  cold_rows_per_token /= static_cast<double>(max_n) * c.n_layers;
  cold.set_masks(&cold_tok);

  // --- Calibration (measured, on layer 0).
  ColdCostParams params;
  {
    std::vector<CpuSample> samples;
    // Each timed call on a different layer, as in a forward pass: a layer's rows are back in
    // DRAM by the time it comes round again (timing one layer repeatedly would measure the L3).
    std::vector<float> x(static_cast<size_t>(16) * H), out(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * static_cast<float>((i * 7919) % 201) - 1.f;
    int next_layer = 0;
    for (int n : {1, 2, 4, 8, 16}) {
      if (n > max_n) break;
      double rt = 0, sec = 0;
      for (int rep = 0; rep < 8; ++rep) {
        cuda::ColdRequest r;
        r.layer = next_layer;
        next_layer = (next_layer + 1) % c.n_layers;
        r.n = n;
        r.x = x.data();
        r.out = out.data();
        const double s0 = Now();
        cold.Run(r);
        const double dt = Now() - s0;
        double row_tokens = 0;
        for (int t = 0; t < n; ++t) row_tokens += cold_tok[t][r.layer].size();
        if (rep > 0) {  // the first call wakes the pool
          samples.push_back({row_tokens, dt});
          rt += row_tokens;
          sec += dt;
        }
      }
      std::printf(
          "calibration: CPU cold, %d tokens, %.0f row-tokens per layer: %.3f ms (mean of "
          "7 layers)\n",
          n, rt / 7, sec / 7 * 1e3);
    }
    if (absl::Status st = FitCpuCosts(samples, &params); !st.ok()) {
      std::fprintf(stderr, "CPU fit: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    const int cal_n = std::min(B, 256);
    cuda::StreamCalibration cal;
    cuda::BackendStatus bst = be.b->CalibrateStreaming(0, cal_n, &cal);
    if (!bst.ok()) {
      std::fprintf(stderr, "stream calibration: %s\n", bst.message.c_str());
      return 1;
    }
    if (absl::Status st = SetStreamCosts(cal.bytes, cal.copy_s, cal.flops, cal.compute_s,
                                         cal.overlapped_s, &params);
        !st.ok()) {
      std::fprintf(stderr, "stream fit: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    std::printf(
        "calibration: stream layer 0, %d tokens, %.1f MB: copy %.3f ms (%.1f GB/s), "
        "products %.3f ms (%.0f TFLOP/s), overlapped %.3f ms\n",
        cal_n, cal.bytes / 1e6, cal.copy_s * 1e3, params.h2d_bytes_per_s / 1e9, cal.compute_s * 1e3,
        params.gpu_flops_per_s / 1e12, cal.overlapped_s * 1e3);
    std::printf(
        "cost model: cpu %.3f ms + %.4f us per row-token; stream %.3f ms + max(bytes / "
        "%.1f GB/s, flops / %.0f TFLOP/s); %.1f active cold rows per token per layer; "
        "crossover at %d tokens\n",
        params.cpu_fixed_s * 1e3, params.cpu_s_per_row_token * 1e6, params.stream_fixed_s * 1e3,
        params.h2d_bytes_per_s / 1e9, params.gpu_flops_per_s / 1e12, cold_rows_per_token,
        StreamCrossover(params, n_cold, cal.bytes, H, cold_rows_per_token, B));
  }

  // --- Batches.
  struct Row {
    int n;
    double cpu_s = -1, stream_s = -1, pred_cpu_s = 0, pred_stream_s = 0, cold_cb_s = 0;
    double model_s = -1;
    int model_stream_layers = 0;
    bool choose_stream = false;
  };
  std::vector<Row> rows;
  std::vector<int32_t> tokens(max_n);
  for (int t = 0; t < max_n; ++t) tokens[t] = 1 + (t * 7919) % (c.vocab_size - 1);
  std::vector<float> logits(c.vocab_size);
  std::vector<std::vector<int32_t>> no_hot(c.n_layers), cold_union(c.n_layers);
  for (int n : o.prefill_batches) {
    Row row;
    row.n = n;
    ColdLayerWork w;
    w.tokens = n;
    w.cold_rows = n_cold;
    w.bytes = 3.0 * rb * n_cold;
    w.hidden = H;
    w.active_row_tokens = cold_rows_per_token * n;
    absl::StatusOr<ColdPathChoice> choice = ChooseColdPath(params, w);
    if (!choice.ok()) {
      std::fprintf(stderr, "cost model: %s\n", std::string(choice.status().message()).c_str());
      return 1;
    }
    // The model predicts per layer; times the layers for the whole batch.
    row.pred_cpu_s = choice->cpu_s * c.n_layers;
    row.pred_stream_s = choice->stream_s * c.n_layers;
    row.choose_stream = choice->stream && n > 8;
    std::printf("cost model, %d tokens, per layer: %s%s\n", n, choice->Describe().c_str(),
                n <= 8 && choice->stream ? " (matrix-vector batch: cpu)" : "");
    // given lists (kGiven): hot rows are all computed by cuBLAS for batches; cold = union.
    for (int l = 0; l < c.n_layers; ++l) {
      std::vector<char> seen(F, 0);
      cold_union[l].clear();
      no_hot[l].clear();
      for (int t = 0; t < n; ++t) {
        for (int32_t j : cold_tok[t][l]) seen[j] = 1;
      }
      for (int j = 0; j < F; ++j) {
        if (seen[j]) cold_union[l].push_back(j);
      }
    }
    // The model's choice, executed: per layer, from that layer's active cold rows in this batch.
    std::vector<cuda::ColdPath> chosen_paths(c.n_layers, cuda::ColdPath::kCallback);
    for (int l = 0; l < c.n_layers; ++l) {
      ColdLayerWork wl = w;
      wl.active_row_tokens = 0;
      for (int t = 0; t < n; ++t) wl.active_row_tokens += cold_tok[t][l].size();
      absl::StatusOr<ColdPathChoice> cl = ChooseColdPath(params, wl);
      if (cl.ok() && cl->stream && n > 8) {
        chosen_paths[l] = cuda::ColdPath::kStream;
        ++row.model_stream_layers;
      }
    }
    for (int pass = 0; pass < 3; ++pass) {
      const cuda::ColdPath path = pass == 1 ? cuda::ColdPath::kStream : cuda::ColdPath::kCallback;
      if (path == cuda::ColdPath::kStream && n <= 8) continue;
      const int reps = n >= 256 ? 1 : (n >= 64 ? 2 : 3);
      std::vector<double> ts;
      for (int rep = -1; rep < reps; ++rep) {
        if (rep < 0 && (pass != 1 && n >= 64)) continue;  // warm enough
        cuda::ForwardArgs a;
        a.tokens = tokens.data();
        a.n = n;
        a.pos0 = 0;
        a.mode = cuda::FfnMode::kGiven;
        a.given_hot = &no_hot;  // ignored by the cuBLAS path, which computes every hot row
        a.given_cold = &cold_union;
        a.run_predictors = true;
        a.cold = &cold;
        a.cold_path = path;
        if (pass == 2) a.cold_paths = &chosen_paths;
        a.logits = logits.data();
        const double s0 = Now();
        cuda::BackendStatus st = be.b->Forward(a);
        if (!st.ok()) {
          std::fprintf(stderr, "prefill forward (%d tokens): %s\n", n, st.message.c_str());
          return 1;
        }
        if (rep >= 0) ts.push_back(Now() - s0);
        if (pass == 0) row.cold_cb_s = be.b->last_stats().cold_callback;
        if (pass == 2 && be.b->last_stats().streamed_layers != row.model_stream_layers) {
          std::fprintf(stderr, "the backend streamed %d layers, the model chose %d\n",
                       be.b->last_stats().streamed_layers, row.model_stream_layers);
          return 1;
        }
      }
      (pass == 0 ? row.cpu_s : pass == 1 ? row.stream_s : row.model_s) = MedianOf(ts);
    }
    rows.push_back(row);
  }
  std::printf(
      "\n| dtype | tokens | CPU-cold tok/s | streamed-cold tok/s | model's choice "
      "(streamed layers) | model tok/s | predicted CPU cold ms | measured CPU cold ms | batch ms, "
      "CPU cold | predicted "
      "stream ms | batch ms, streamed |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    char st[32] = "-", sm[32] = "-";
    if (r.stream_s > 0) {
      std::snprintf(st, sizeof(st), "%.1f", r.n / r.stream_s);
      std::snprintf(sm, sizeof(sm), "%.1f", r.stream_s * 1e3);
    }
    const double best = r.stream_s > 0 ? std::min(r.stream_s, r.cpu_s) : r.cpu_s;
    const char* choice = r.model_stream_layers == c.n_layers ? "stream"
                         : r.model_stream_layers == 0        ? "cpu"
                                                             : "mixed";
    std::printf("| %s | %d | %.1f | %s | %s (%d)%s | %.1f | %.1f | %.1f | %.1f | %.1f | %s |\n",
                DTypeName(m.dtype).data(), r.n, r.n / r.cpu_s, st, choice, r.model_stream_layers,
                r.model_s > best * 1.05 ? ", slower than the best path" : "", r.n / r.model_s,
                r.pred_cpu_s * 1e3, r.cold_cb_s * 1e3, r.cpu_s * 1e3, r.pred_stream_s * 1e3, sm);
  }
  return 0;
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t b = 0;
  while (b <= s.size()) {
    const size_t e = std::min(s.find(sep, b), s.size());
    if (e > b) out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

// Where each step's greedy token is picked: on the GPU, as the gpu-worker does for greedy
// requests (LogitsMode::kGreedy: 8 bytes come back), or, in a variant with PICK=host, from the
// logits copied to the host (the path before session 18, for comparison).
bool g_host_pick = false;
// Variant LANES=N: --lanes for that variant (0: --lanes), so that lane counts can take turns in
// one process.
int g_variant_lanes = 0;
// Variant LANES_POOL=N: the lanes' shared cold pool has N threads (default: all cores but one per
// other lane).
int g_variant_lanes_pool = 0;
// Variant TIMES=0: pinfer's backends record no per-layer timing events (whose nodes sit between
// the kernels of every layer), so the per-token lines' GPU times are zero.
bool g_gpu_times = true;

void AskForPick(cuda::ForwardArgs* a, std::vector<float>* logits, cuda::GreedyResult* pick) {
  if (g_host_pick) {
    a->logits = logits->data();
  } else {
    a->logits_mode = cuda::LogitsMode::kGreedy;
    a->greedy = pick;
  }
}

int32_t Picked(const std::vector<float>& logits, const cuda::GreedyResult& pick) {
  return g_host_pick ? GreedyToken(logits) : pick.token;
}

// Sets the module's knobs for one variant: every known knob back to its default, then the
// variant's NAME=VALUE pairs as PINFER_CUDA_NAME (PICK=host, LANES=N and TIMES=0 are the
// bench's own, above).
void ApplyVariant(const std::string& variant) {
  g_host_pick = false;
  g_variant_lanes = 0;
  g_gpu_times = true;
  for (const char* k :
       {"PDL", "REPACK", "STEP_GRAPH", "GRAPHS", "PRODUCER_QX", "PRELAUNCH", "NORM_VEC8", "QX_REGS",
        "QX_EARLY", "ATTN_ONLINE", "ATTN_QX", "ATTN_EARLY", "QX_PIPE", "FUSED_NORM",
        "ROPE_IN_PRODUCT", "ACT_IN_PRODUCT", "LATE_X_FIRST"}) {
    setenv((std::string("PINFER_CUDA_") + k).c_str(), "1", 1);
  }
  setenv("PINFER_CUDA_PREFETCH", "0", 1);
  setenv("PINFER_CUDA_ATTN_LATE_TRIGGER", "0", 1);
  setenv("PINFER_CUDA_Q8X", "1", 1);
  setenv("PINFER_CUDA_ZERO_COPY_COLD", "0", 1);
  setenv("PINFER_CUDA_QX_WARPS", "16", 1);  // the module's defaults (kernels.cu)
  setenv("PINFER_CUDA_QX_ROWS", "1", 1);
  setenv("PINFER_CUDA_QX_SHAPE", "balanced", 1);
  setenv("PINFER_CUDA_NORM_LOOP", "0", 1);
  setenv("PINFER_CUDA_EARLY_PUBLISH", "1", 1);
  setenv("PINFER_CUDA_COLD_GPU_SHARE", "0", 1);
  setenv("PINFER_CUDA_COLD_BUNDLES", "1", 1);  // the bench's cold side (CpuColdFfn)
  setenv("PINFER_CUDA_COLD_PARTS", "1", 1);
  setenv("PINFER_CUDA_COLD_AHEAD", "0", 1);  // the bench's cold side: no guess, no loads ahead
  setenv("PINFER_CUDA_COLD_AHEAD_HINT", "2", 1);
  setenv("PINFER_CUDA_COLD_AHEAD_RANKED", "0", 1);
  setenv("PINFER_CUDA_COLD_AHEAD_TIER", "0", 1);
  setenv("PINFER_CUDA_COLD_AHEAD_PIN", "0", 1);  // the pool's chunks taken by any thread
  // COLD_GUESS=1: the module's own guess (ModelUpload::cold_guess) runs beside each layer's hot
  // rows, so its cost counts; with masks drawn independently of the random predictors its content
  // means nothing, and the bench's cold side keeps its drawn guess (COLD_AHEAD) instead.
  setenv("PINFER_CUDA_COLD_GUESS", "0", 1);
  unsetenv("PINFER_CUDA_COLD_GUESS_SHIFT");  // COLD_GUESS_SHIFT=S: the cut lowered by S
  unsetenv("PINFER_CUDA_COLD_GUESS_RECALL");
  g_variant_lanes_pool = 0;
  if (variant == "base") return;
  for (const std::string& kv : Split(variant, '+')) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    if (kv == "PICK=host") {
      g_host_pick = true;
      continue;
    }
    if (kv == "TIMES=0") {
      g_gpu_times = false;
      continue;
    }
    if (kv.starts_with("LANES=")) {  // the bench's own knob: --lanes for this variant
      g_variant_lanes = std::clamp(std::atoi(kv.c_str() + eq + 1), 2, cuda::kMaxLanes);
      continue;
    }
    if (kv.starts_with("LANES_POOL=")) {
      g_variant_lanes_pool = std::max(1, std::atoi(kv.c_str() + eq + 1));
      continue;
    }
    setenv(("PINFER_CUDA_" + kv.substr(0, eq)).c_str(), kv.substr(eq + 1).c_str(), 1);
  }
}

// ---------------------------------------------------------------------------------------------
// Adaptive hot set (--modes=adaptive): decode with the static placement against the same VRAM
// budget split into static hot rows and cache slots that follow the text
// (shared/sparse/hot_cache.h), on two run-time profiles: "matched" (the run-time ranking is the
// calibration ranking the placement used) and "shifted" (the run-time hot tier is a different
// random 20% of each layer: text unlike the calibration text). The cache is run by the product's
// driver (AdaptiveHotSet, as the gpu-worker runs it), once counting on the decode thread and once
// on its own thread: after each step it commits the swaps whose copies have landed and every
// `cache_period` tokens plans new swaps whose rows are gathered on a copy stream while the next
// steps run. Before each step the bench splits every layer's drawn active set between the GPU's
// rows and the CPU from the slots as the driver assigned them (kGiven; the service's predicted
// mode makes this split on the GPU), and times the split and the driver apart.

// masks[step][layer] drawn from the profile of DrawMasks with ranking rank_of[layer].
Masks DrawMasksRanked(const std::vector<std::vector<int32_t>>& rank_of, int F, double active,
                      double skew, int steps, uint64_t seed, ThreadPool& pool) {
  const int Lc = static_cast<int>(rank_of.size());
  const double p_hot = 0.8 * active / skew, p_cold = 0.2 * active / (1 - skew);
  const int hot_tier = static_cast<int>(skew * F);
  Masks masks(steps, std::vector<std::vector<int32_t>>(Lc));
  pool.ParallelFor(static_cast<int64_t>(steps) * Lc, 1, [&](int64_t b, int64_t e) {
    for (int64_t job = b; job < e; ++job) {
      const int s = static_cast<int>(job / Lc), l = static_cast<int>(job % Lc);
      std::mt19937_64 rng(job * 7919 + seed);
      std::uniform_real_distribution<double> u(0, 1);
      for (int j = 0; j < F; ++j) {
        if (u(rng) < (rank_of[l][j] < hot_tier ? p_hot : p_cold)) masks[s][l].push_back(j);
      }
    }
  });
  return masks;
}

// The adaptive bench's GPU side for the product's driver (AdaptiveHotSet): the module's calls as
// the gpu-worker makes them (ModuleCacheSlots), plus a copy of what each slot serves, from which
// the bench splits a step's drawn active neurons for kGiven. In the service the module's
// predicted mode makes that split on the GPU, from the same slot tables.
class BenchSlots : public CacheSlotTarget {
 public:
  BenchSlots(cuda::Backend* b, int F, const std::vector<std::vector<int32_t>>& static_hot,
             int slots)
      : module_(b), n_slots_(slots) {
    for (const std::vector<int32_t>& hot : static_hot) {
      Layer& L = layers_.emplace_back();
      L.n_static = static_cast<int32_t>(hot.size());
      L.static_local.assign(F, -1);
      for (size_t i = 0; i < hot.size(); ++i) L.static_local[hot[i]] = static_cast<int32_t>(i);
      L.slot_of.assign(F, -1);
      L.neuron_of.assign(slots, -1);
    }
  }
  absl::Status LoadRows(int layer, const std::vector<int32_t>& slots,
                        const std::vector<int32_t>& neurons) override {
    return module_.LoadRows(layer, slots, neurons);
  }
  absl::StatusOr<bool> RowsLanded() override { return module_.RowsLanded(); }
  absl::Status AssignSlots(int layer, const std::vector<int32_t>& slots,
                           const std::vector<int32_t>& neurons) override {
    absl::Status st = module_.AssignSlots(layer, slots, neurons);
    if (!st.ok()) return st;
    Layer& L = layers_[layer];
    for (size_t i = 0; i < slots.size(); ++i) {
      if (L.neuron_of[slots[i]] >= 0) L.slot_of[L.neuron_of[slots[i]]] = -1;
      L.neuron_of[slots[i]] = neurons[i];
      if (neurons[i] >= 0) L.slot_of[neurons[i]] = slots[i];
    }
    return absl::OkStatus();
  }
  // Every slot serves nobody again (the module's tables too), for the next run on this backend.
  absl::Status Clear() {
    std::vector<int32_t> all(n_slots_), none(n_slots_, -1);
    std::iota(all.begin(), all.end(), 0);
    for (int l = 0; l < static_cast<int>(layers_.size()) && n_slots_ > 0; ++l) {
      absl::Status st = AssignSlots(l, all, none);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }
  // The step's split as the module would make it from the slots assigned so far.
  void Split(int layer, const std::vector<int32_t>& active, std::vector<int32_t>* hot,
             std::vector<int32_t>* cold) const {
    const Layer& L = layers_[layer];
    SplitActive(active, L.static_local, L.slot_of, L.n_static, n_slots_, hot, cold, &marks_);
  }

 private:
  struct Layer {
    int32_t n_static = 0;
    std::vector<int32_t> static_local, slot_of, neuron_of;
  };
  gpuworker::ModuleCacheSlots module_;
  int n_slots_;
  std::vector<Layer> layers_;
  mutable std::vector<char> marks_;
};

int AdaptiveBench(const Options& o, const SynthModel& m, ThreadPool& pool, int threads) {
  const ModelConfig& c = m.config;
  const int H = c.hidden_size, F = c.ffn_size;
  const int max_ctx = o.warmup + o.steps + 8, total = o.warmup + o.steps;
  const size_t rb = m.Rb(H);
  const double budget = o.budget_fraction * m.ModelBytes();
  const double fixed = m.HeadBytes() + c.n_layers * (m.AttnBytes() + m.PredBytes()) +
                       ScratchBytes(m, max_ctx, c.n_layers, 8);
  const double per_neuron = 3.0 * rb + 4;
  const int n_gpu =
      std::max(0, std::min(F, static_cast<int>((budget - fixed) / (c.n_layers * per_neuron))));
  const double skew = o.skews.empty() ? 0.2 : o.skews[0];
  std::vector<std::vector<int32_t>> calib_rank(c.n_layers), shifted_rank(c.n_layers);
  std::mt19937 rng(4242);
  for (int l = 0; l < c.n_layers; ++l) {
    calib_rank[l] = m.layers[l].rank_of;
    std::vector<int32_t> perm(F);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    shifted_rank[l].resize(F);
    for (int r = 0; r < F; ++r) shifted_rank[l][perm[r]] = r;
  }
  ThreadPool spin(threads, kColdSpin);
  CpuColdFfn cold(m, spin);
  std::printf(
      "adaptive: %d GPU FFN rows per layer in the budget; skew %.0f%%; %d warm-up + %d "
      "measured tokens; decay %.2f, gain %.1f, up to %d swaps per layer every %d tokens\n",
      n_gpu, skew * 100, o.warmup, o.steps, o.cache_decay, o.cache_gain, o.cache_swaps,
      o.cache_period);
  struct Row {
    std::string profile;
    double fraction = 0;
    double tok_s = 0, gpu_share = 0, gpu_share_last = 0, plan = 0, actual = 0;
    double tok_s_unsplit = 0;  // the same time less the bench's split (the service's GPU splits)
    std::string driver;        // where AdaptiveHotSet counts: "foreground", "background"; "" static
    double split_s = 0;   // the bench's kGiven split per measured token (the GPU's, in the service)
    double driver_s = 0;  // AdaptiveHotSet::AfterStep per measured token (the product's)
    int64_t swaps = 0;
  };
  std::vector<Row> rows;
  std::vector<float> logits(c.vocab_size);
  cuda::GreedyResult pick;
  std::vector<double> fractions = {0.0};
  for (double f : o.cache_fractions) fractions.push_back(std::min(1.0, std::max(0.0, f)));
  for (double fraction : fractions) {
    const int slots = static_cast<int>(fraction * n_gpu);
    const int n_static = n_gpu - slots;
    cuda::ModelUpload u = BaseUpload(m, max_ctx);
    std::vector<std::vector<int32_t>> static_hot(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      cuda::LayerUpload& lu = u.layers[l];
      FillHotLayer(m, l, n_static, &lu);
      lu.cache_rows = slots;
      static_hot[l] = lu.hot_ids;
    }
    // Slots cost the rows' bytes but no id (the bookkeeping stays on the host).
    const double plan =
        fixed + c.n_layers * (per_neuron * n_static + 3.0 * rb * slots + 4.0 * (F - n_static));
    Backend be;
    char err[512] = {0};
    const double t0 = Now();
    if (int rc = pinfer_cuda_create_backend(&u, &be.b, err, sizeof(err)); rc != 0) {
      std::fprintf(stderr, "adaptive backend: %s\n", err);
      return 1;
    }
    std::printf("cache fraction %.2f: %d static + %d cache rows per layer, created in %.1f s\n",
                fraction, n_static, slots, Now() - t0);
    be.b->set_use_graphs(o.graphs);
    // The static placement runs once per profile; the cache with the product's driver counting
    // on the decode thread between steps, and on its own thread.
    // --rounds=N: the list N times over, taking turns, for medians.
    std::vector<bool> drivers;
    for (int round = 0; round < std::max(1, o.rounds); ++round) {
      drivers.push_back(false);
      if (slots > 0) drivers.push_back(true);
    }
    for (const char* profile : {"shifted", "matched"}) {
      const auto& ranks = std::string(profile) == "shifted" ? shifted_rank : calib_rank;
      Masks masks = DrawMasksRanked(ranks, F, o.active, skew, total, 77, pool);
      for (bool background : drivers) {
        HotCacheOptions ho;
        ho.slots = slots;
        ho.decay = o.cache_decay;
        ho.min_gain = o.cache_gain;
        ho.max_swaps = o.cache_swaps;
        absl::StatusOr<AdaptiveHotCache> cache = AdaptiveHotCache::Create(F, static_hot, ho);
        if (!cache.ok()) {
          std::fprintf(stderr, "%s\n", std::string(cache.status().message()).c_str());
          return 1;
        }
        BenchSlots target(be.b, F, static_hot, slots);
        auto set = std::make_unique<AdaptiveHotSet>(std::move(*cache), &target, o.cache_period,
                                                    background);
        std::vector<std::vector<int32_t>> hot(c.n_layers), cold_ids(c.n_layers);
        Row row;
        row.profile = profile;
        row.fraction = fraction;
        row.driver = slots == 0 ? "" : background ? "background" : "foreground";
        row.plan = plan;
        row.actual = static_cast<double>(be.b->DeviceBytes());
        double hot_rows = 0, all_rows = 0, hot_last = 0, all_last = 0, start = 0;
        int32_t token = 1;
        for (int s = 0; s < total; ++s) {
          if (s == o.warmup) start = Now();
          const double h0 = Now();
          for (int l = 0; l < c.n_layers; ++l) {
            target.Split(l, masks[s][l], &hot[l], &cold_ids[l]);
            if (s >= o.warmup) {
              hot_rows += hot[l].size();
              all_rows += masks[s][l].size();
              if (s >= total - 8) {
                hot_last += hot[l].size();
                all_last += masks[s][l].size();
              }
            }
          }
          if (s >= o.warmup) row.split_s += Now() - h0;
          cuda::ForwardArgs a;
          a.tokens = &token;
          a.n = 1;
          a.pos0 = s;
          a.mode = cuda::FfnMode::kGiven;
          a.given_hot = &hot;
          a.given_cold = &cold_ids;
          a.run_predictors = true;
          a.cold = &cold;
          AskForPick(&a, &logits, &pick);
          cuda::BackendStatus st = be.b->Forward(a);
          if (!st.ok()) {
            std::fprintf(stderr, "adaptive forward: %s\n", st.message.c_str());
            return 1;
          }
          token = Picked(logits, pick);
          if (slots > 0) {
            const double h1 = Now();
            const uint64_t before = set->swaps_committed();
            if (absl::Status ast = set->AfterStep(masks[s]); !ast.ok()) {
              std::fprintf(stderr, "adaptive hot set: %s\n", ast.ToString().c_str());
              return 1;
            }
            if (s >= o.warmup) row.driver_s += Now() - h1;
            row.swaps += static_cast<int64_t>(set->swaps_committed() - before);
          }
        }
        const double elapsed = Now() - start;
        row.tok_s = o.steps / elapsed;
        row.tok_s_unsplit = o.steps / (elapsed - row.split_s);
        row.split_s /= o.steps;
        row.driver_s /= o.steps;
        row.gpu_share = hot_rows / all_rows;
        row.gpu_share_last = hot_last / all_last;
        std::printf(
            "%s, cache fraction %.2f%s%s: %.2f tokens/s, GPU share of activations %.1f%% (last 8 "
            "tokens %.1f%%), %lld swaps, split %.3f ms/token, driver %.3f ms/token\n",
            profile, fraction, row.driver.empty() ? "" : ", counting in the ", row.driver.c_str(),
            row.tok_s, 100 * row.gpu_share, 100 * row.gpu_share_last,
            static_cast<long long>(row.swaps), row.split_s * 1e3, row.driver_s * 1e3);
        rows.push_back(row);
        set.reset();
        bool landed = false;
        be.b->CacheRowsLanded(/*wait=*/true, &landed);
        if (absl::Status cst = target.Clear(); !cst.ok()) {
          std::fprintf(stderr, "clearing the slots: %s\n", cst.ToString().c_str());
          return 1;
        }
      }
    }
  }
  const char* const header =
      "\n| dtype | run-time profile | placement | counting | tokens/s | vs static | less the "
      "split: tokens/s | vs static | GPU share of activations | last 8 tokens | swaps | split "
      "ms/token | driver ms/token | VRAM plan GB | VRAM actual GB |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  std::fputs(header, stdout);
  // Against the static placement's median on the same profile.
  auto median = [&](const std::string& profile, double fraction, const std::string& driver,
                    double Row::*field) {
    std::vector<double> v;
    for (const Row& q : rows) {
      if (q.profile == profile && q.fraction == fraction && q.driver == driver)
        v.push_back(q.*field);
    }
    return MedianOf(v);
  };
  auto print = [&](const Row& r, double tok_s, double tok_s_unsplit) {
    const double base = median(r.profile, 0, "", &Row::tok_s);
    const double base_unsplit = median(r.profile, 0, "", &Row::tok_s_unsplit);
    char pl[64];
    if (r.fraction == 0) {
      std::snprintf(pl, sizeof(pl), "static (%d hot rows)", n_gpu);
    } else {
      std::snprintf(pl, sizeof(pl), "adaptive (%.0f%% of them as cache)", 100 * r.fraction);
    }
    std::printf(
        "| %s | %s | %s | %s | %.2f | %.2fx | %.2f | %.2fx | %.1f%% | %.1f%% | %lld | %.3f | "
        "%.3f | %.2f | %.2f |\n",
        DTypeName(m.dtype).data(), r.profile.c_str(), pl, r.driver.empty() ? "-" : r.driver.c_str(),
        tok_s, tok_s / base, tok_s_unsplit, tok_s_unsplit / base_unsplit, 100 * r.gpu_share,
        100 * r.gpu_share_last, static_cast<long long>(r.swaps), r.split_s * 1e3, r.driver_s * 1e3,
        r.plan / 1e9, r.actual / 1e9);
  };
  for (const Row& r : rows) print(r, r.tok_s, r.tok_s_unsplit);
  if (o.rounds > 1) {
    std::printf("\nMedians of the %d rounds (the other columns: the first round's):\n", o.rounds);
    std::fputs(header, stdout);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      bool first = true;
      for (size_t k = 0; k < i; ++k) {
        const Row& q = rows[k];
        if (q.profile == r.profile && q.fraction == r.fraction && q.driver == r.driver)
          first = false;
      }
      if (!first) continue;
      print(r, median(r.profile, r.fraction, r.driver, &Row::tok_s),
            median(r.profile, r.fraction, r.driver, &Row::tok_s_unsplit));
    }
  }
  return 0;
}

// --modes=staged: what staging each layer's guessed cold rows in VRAM could give one sequence,
// as a bound. The budget's hot rows stay on the GPU, and each layer gets --stage-rows=K slots
// besides (a staging that copies each layer's rows during the layer before needs slots for two
// or three layers only, not all of them: 2 x 200 F16 neurons are 12 MB). Before each step the K
// most likely neurons of each layer's drawn guess
// (--stage-guess=R:X:A:B: GuessCold's recall R and size X, TierCold's tier A:B; the tier first,
// then the rest of the guess) are copied into them from the pinned cold rows (LoadCacheRows: one
// gather kernel per layer over PCIe). The step then lists every staged neuron that is active
// among the GPU's rows and only the others for the CPU. The copies run before the step, not
// beside it, so the step's tokens/s is what a staging that hid its copies entirely would reach;
// tokens/s with the copies counted, and their rate, say how much PCIe time hiding them needs.
// K = 0 is the pinfer mode's static placement on the same masks. --stage-ahead=1 runs each K
// twice, the second time with the CPU loading the guess's other neurons (its tier first) while
// the GPU computes the attention, as variant COLD_AHEAD does (PINFER_CUDA_COLD_AHEAD_PIN and
// _HINT from the environment). --stage-overlap=1 gives each layer 2K slots and copies step s +
// 1's rows into one half while step s runs on the other: the copies then share the GPU, the PCIe
// link and host memory with the step, as a staging during the previous layer would (with the
// rows a whole step early, which only the bench can know); "copies counted" is then that
// overlapped rate. (Run 47: the bound was 1.26-1.38x for F16, the overlapped copies lost, so the
// product does not stage; this mode stays as the measurement.)
int StagedBench(const Options& o, const SynthModel& m, ThreadPool& pool, int threads) {
  const ModelConfig& c = m.config;
  const int H = c.hidden_size, F = c.ffn_size, Lc = c.n_layers;
  const int max_ctx = o.warmup + o.steps + 8, total = o.warmup + o.steps;
  const size_t rb = m.Rb(H);
  const double budget = o.budget_fraction * m.ModelBytes();
  const double fixed =
      m.HeadBytes() + Lc * (m.AttnBytes() + m.PredBytes()) + ScratchBytes(m, max_ctx, Lc, 8);
  const int n_gpu =
      std::max(0, std::min(F, static_cast<int>((budget - fixed) / (Lc * (3.0 * rb + 4)))));
  const double skew = o.skews.empty() ? 0.2 : o.skews[0];
  double recall = 0.95, size = 1.6, tier_a = 0.82, tier_b = 0.31;
  if (std::sscanf(o.stage_guess.c_str(), "%lf:%lf:%lf:%lf", &recall, &size, &tier_a, &tier_b) !=
      4) {
    std::fprintf(stderr, "--stage-guess=%s: expected R:X:A:B\n", o.stage_guess.c_str());
    return 2;
  }
  std::vector<std::vector<int32_t>> rank(Lc);
  for (int l = 0; l < Lc; ++l) rank[l] = m.layers[l].rank_of;
  const Masks masks = DrawMasksRanked(rank, F, o.active, skew, total, 77, pool);
  ThreadPool spin(threads, kColdSpin);
  const char* pin = std::getenv("PINFER_CUDA_COLD_AHEAD_PIN");
  spin.set_pinned_chunks(pin != nullptr && std::string(pin) == "1");
  CpuColdFfn cold(m, spin);
  std::printf(
      "staged: %d GPU FFN rows per layer in the budget; skew %.0f%%; guess recall %.2f, size "
      "%.2fx, tier %.2f:%.2f; %d warm-up + %d measured tokens%s\n",
      n_gpu, skew * 100, recall, size, tier_a, tier_b, o.warmup, o.steps,
      o.stage_overlap ? "; copies overlapped with the step before" : "");

  struct Stage {
    int k = 0, n_static = 0;
    Backend be;
    // [step][layer]: the staged neurons (slot i holds staged[i]) and the step's given lists.
    std::vector<std::vector<std::vector<int32_t>>> staged, hot, cold_ids;
    // [step][layer]: the guess's neurons left to the CPU (ascending), and those of its tier.
    std::vector<std::vector<std::vector<int32_t>>> ahead, ahead_first;
    double share = 0, precision = 0;  // GPU share of activations; active / staged
    // Per round, [0] without and [1] with the CPU's loads ahead.
    std::vector<double> fast[2], serial[2], load_gbps[2], callback_ms[2];
  };
  std::vector<std::unique_ptr<Stage>> stages;  // Backend does not move
  for (int k : o.stage_rows) {
    if (k < 0 || n_gpu + (o.stage_overlap ? 2 : 1) * k > F) continue;
    stages.push_back(std::make_unique<Stage>());
    Stage& st = *stages.back();
    st.k = k;
    st.n_static = n_gpu;
    cuda::ModelUpload u = BaseUpload(m, max_ctx);
    std::vector<std::vector<int32_t>> local_of(Lc, std::vector<int32_t>(F, -1));
    for (int l = 0; l < Lc; ++l) {
      cuda::LayerUpload& lu = u.layers[l];
      FillHotLayer(m, l, st.n_static, &lu);
      for (size_t i = 0; i < lu.hot_ids.size(); ++i) {
        local_of[l][lu.hot_ids[i]] = static_cast<int32_t>(i);
      }
      lu.cache_rows = o.stage_overlap ? 2 * k : k;
    }
    char err[512] = {0};
    if (int rc = pinfer_cuda_create_backend(&u, &st.be.b, err, sizeof(err)); rc != 0) {
      std::fprintf(stderr, "staged backend: %s\n", err);
      return 1;
    }
    st.be.b->set_use_graphs(o.graphs);
    st.be.b->set_collect_gpu_times(true);
    std::mt19937 rng(1234 + k);
    std::uniform_real_distribution<double> u01(0, 1);
    std::uniform_int_distribution<int32_t> pick(0, F - 1);
    st.staged.assign(total, std::vector<std::vector<int32_t>>(Lc));
    st.hot = st.cold_ids = st.ahead = st.ahead_first = st.staged;
    double staged_n = 0, staged_active = 0, gpu_acts = 0, all_acts = 0;
    for (int s = 0; s < total; ++s) {
      for (int l = 0; l < Lc; ++l) {
        std::vector<char> active(F, 0), in_tier(F, 0);
        std::vector<int32_t> cold_act, first, rest;
        for (int32_t j : masks[s][l]) {
          active[j] = 1;
          if (local_of[l][j] >= 0) {
            st.hot[s][l].push_back(local_of[l][j]);
          } else {
            cold_act.push_back(j);
            if (u01(rng) < recall) {
              in_tier[j] = u01(rng) < tier_a;
              (in_tier[j] ? first : rest).push_back(j);
            }
          }
        }
        // The guess's inactive neurons, drawn among the cold ones up to its size.
        std::vector<char> taken(active);
        const size_t want = static_cast<size_t>(std::lround(size * cold_act.size()));
        size_t n = first.size() + rest.size();
        for (int tries = 0; n < want && tries < 100 * F; ++tries) {
          const int32_t j = pick(rng);
          if (local_of[l][j] >= 0 || taken[j]) continue;
          taken[j] = 1;
          in_tier[j] = u01(rng) < tier_b;
          (in_tier[j] ? first : rest).push_back(j);
          ++n;
        }
        std::shuffle(first.begin(), first.end(), rng);
        std::shuffle(rest.begin(), rest.end(), rng);
        first.insert(first.end(), rest.begin(), rest.end());
        if (first.size() > static_cast<size_t>(k)) {
          std::vector<int32_t>& left = st.ahead[s][l];
          left.assign(first.begin() + k, first.end());
          std::sort(left.begin(), left.end());
          for (int32_t j : left) {
            if (in_tier[j]) st.ahead_first[s][l].push_back(j);
          }
          first.resize(k);
        }
        std::vector<char> on_gpu(F, 0);
        int32_t active_staged = 0;
        for (size_t i = 0; i < first.size(); ++i) {
          if (active[first[i]]) {
            st.hot[s][l].push_back(st.n_static + (o.stage_overlap ? (s % 2) * k : 0) +
                                   static_cast<int32_t>(i));
            on_gpu[first[i]] = 1;
            ++active_staged;
          }
        }
        std::sort(st.hot[s][l].begin(), st.hot[s][l].end());
        for (int32_t j : cold_act) {
          if (!on_gpu[j]) st.cold_ids[s][l].push_back(j);
        }
        st.staged[s][l] = std::move(first);
        if (s >= o.warmup) {
          staged_n += static_cast<double>(st.staged[s][l].size());
          staged_active += active_staged;
          gpu_acts += static_cast<double>(st.hot[s][l].size());
          all_acts += static_cast<double>(masks[s][l].size());
        }
      }
    }
    st.share = gpu_acts / all_acts;
    st.precision = staged_n > 0 ? staged_active / staged_n : 0;
    std::printf(
        "staged %d rows a layer: %d static hot rows; GPU share of activations %.1f%%, %.0f%% of "
        "the staged neurons active\n",
        k, st.n_static, 100 * st.share, 100 * st.precision);
  }
  std::vector<float> logits(c.vocab_size);
  cuda::GreedyResult pick;
  for (int round = 0; round < o.rounds; ++round) {
    for (int w = 0; w < (o.stage_ahead ? 2 : 1) * static_cast<int>(stages.size()); ++w) {
      Stage& st = *stages[w / (o.stage_ahead ? 2 : 1)];
      const int ahead = o.stage_ahead ? w % 2 : 0;
      double fwd = 0, load = 0, bytes = 0, callback = 0, hot_ffn = 0, attention = 0;
      int32_t token = 1;
      std::vector<int32_t> slots;
      // Queues step s's copies (into half s % 2 of the slots with --stage-overlap) and returns
      // their bytes, or -1 on an error.
      auto load_step = [&](int s) -> double {
        double step_bytes = 0;
        for (int l = 0; l < Lc && st.k > 0; ++l) {
          const std::vector<int32_t>& g = st.staged[s][l];
          slots.resize(g.size());
          std::iota(slots.begin(), slots.end(), o.stage_overlap ? (s % 2) * st.k : 0);
          cuda::BackendStatus bs = st.be.b->LoadCacheRows(l, slots, g);
          if (!bs.ok()) {
            std::fprintf(stderr, "staged load: %s\n", bs.message.c_str());
            return -1;
          }
          step_bytes += 3.0 * rb * g.size();
        }
        return step_bytes;
      };
      double next_bytes = o.stage_overlap ? load_step(0) : 0;
      for (int s = 0; s < total; ++s) {
        const double t0 = Now();
        double step_bytes = o.stage_overlap ? next_bytes : load_step(s);
        if (step_bytes < 0) return 1;
        bool landed = true;
        if (st.k > 0) st.be.b->CacheRowsLanded(/*wait=*/true, &landed);
        const double t1 = Now();
        if (o.stage_overlap && s + 1 < total) {
          // The next step's copies, beside this step (its slots' half is free: the step before
          // used it and is done).
          if ((next_bytes = load_step(s + 1)) < 0) return 1;
        }
        if (ahead) cold.SetGuess(&st.ahead[s], &st.ahead_first[s]);
        cuda::ForwardArgs a;
        a.tokens = &token;
        a.n = 1;
        a.pos0 = s;
        a.mode = cuda::FfnMode::kGiven;
        a.given_hot = &st.hot[s];
        a.given_cold = &st.cold_ids[s];
        a.run_predictors = true;
        a.cold = &cold;
        AskForPick(&a, &logits, &pick);
        cuda::BackendStatus bs = st.be.b->Forward(a);
        if (!bs.ok()) {
          std::fprintf(stderr, "staged forward: %s\n", bs.message.c_str());
          return 1;
        }
        token = Picked(logits, pick);
        if (s >= o.warmup) {
          load += t1 - t0;
          fwd += Now() - t1;
          bytes += step_bytes;
          const cuda::ForwardStats& fs = st.be.b->last_stats();
          callback += fs.cold_callback;
          hot_ffn += fs.gpu_hot_ffn;
          attention += fs.gpu_attention;
        }
      }
      cold.SetGuess(nullptr, nullptr);
      st.fast[ahead].push_back(o.steps / fwd);
      st.serial[ahead].push_back(o.steps / (fwd + load));
      // (Overlapped copies have no rate of their own: the wait is what they add.)
      st.load_gbps[ahead].push_back(load > 0 && !o.stage_overlap ? bytes / load / 1e9 : 0);
      st.callback_ms[ahead].push_back(callback / o.steps * 1e3);
      std::printf(
          "round %d, staged %d%s: %.2f tokens/s with the copies hidden, %.2f with them counted "
          "(%.1f GB/s), cold callback %.2f ms/token, GPU attention phase %.2f, GPU hot FFN %.2f\n",
          round + 1, st.k, ahead ? ", CPU loads ahead" : "", st.fast[ahead].back(),
          st.serial[ahead].back(), st.load_gbps[ahead].back(), st.callback_ms[ahead].back(),
          attention / o.steps * 1e3, hot_ffn / o.steps * 1e3);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  std::printf(
      "\n| dtype | skew | staged rows a layer | CPU loads ahead | static hot rows | GPU share of "
      "activations | "
      "staged active | tokens/s, copies hidden | vs 0 | tokens/s, copies counted | copies GB/s | "
      "cold callback ms/token |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const double base = stages.empty() ? 0 : median(stages[0]->fast[0]);
  for (const auto& stage : stages) {
    const Stage& st = *stage;
    for (int ahead = 0; ahead < (o.stage_ahead ? 2 : 1); ++ahead) {
      std::printf(
          "| %s | %.0f%% | %d | %s | %d | %.1f%% | %.0f%% | %.2f | %.2fx | %.2f | %.1f | %.2f |\n",
          DTypeName(m.dtype).data(), skew * 100, st.k, ahead ? "yes" : "no", st.n_static,
          100 * st.share, 100 * st.precision, median(st.fast[ahead]), median(st.fast[ahead]) / base,
          median(st.serial[ahead]), median(st.load_gbps[ahead]), median(st.callback_ms[ahead]));
    }
  }
  return 0;
}

// The cold side alone (--modes=coldrows; no GPU): a layer's cold rows as the pinfer mode
// computes them (CpuColdFfn: the cpu-worker's op on spinning threads), by list length and thread
// count. Each call takes a fresh random set of n neurons of the next layer, so rows come from
// memory as in decode; medians over the calls. The last line is one thread on 16 neurons kept in
// cache: the kernels' compute ceiling.
int ColdRowsBench(const SynthModel& m, int threads) {
  const ModelConfig& c = m.config;
  const int H = c.hidden_size, F = c.ffn_size, L = c.n_layers;
  const double neuron_bytes = 3.0 * m.Rb(H);
  std::mt19937 rng(5);
  std::vector<float> x(H);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& v : x) v = u(rng);
  // n random neurons of a layer, sorted as the cpu-worker's lists are.
  auto draw = [&](int n) {
    std::vector<int32_t> all(F);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> ids(all.begin(), all.begin() + n);
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  std::vector<float> out(static_cast<size_t>(cuda::kMaxColdParts) * H);
  // Median seconds per call over `calls` calls after 4 unmeasured ones: n > 0 draws n neurons of
  // the next layer per call; n = 0 takes layer 0's first 16 neurons every time (kept in cache).
  // With parts, the calls alternate between the op that sums its threads' partials and the op
  // that leaves them to the GPU (ColdRequest::max_parts), whose median goes to *parts_s.
  auto time_calls = [&](CpuColdFfn& cold, int n, int calls, double* parts_s = nullptr) {
    std::vector<int32_t> ids(16);
    std::iota(ids.begin(), ids.end(), 0);
    std::vector<double> t, tp;
    for (int i = 0; i < calls; ++i) {
      for (int way = 0; way < (parts_s != nullptr ? 2 : 1); ++way) {
        if (n > 0) ids = draw(n);
        int n_parts = 0;
        cuda::ColdRequest r;
        r.layer = n > 0 ? i % L : 0;
        r.n = 1;
        r.x = x.data();
        r.out = out.data();
        r.active = ids.data();
        r.n_active = static_cast<int>(ids.size());
        if (way == 1) {
          r.max_parts = cuda::kMaxColdParts;
          r.parts = &n_parts;
        }
        const double t0 = Now();
        cold.Run(r);
        if (i >= 4) (way == 0 ? t : tp).push_back(Now() - t0);
      }
    }
    if (parts_s != nullptr) *parts_s = MedianOf(tp);
    return MedianOf(t);
  };
  auto row = [&](const char* what, int T, int n, double s) {
    const int rows = n > 0 ? n : 16;
    std::printf("| %s | %d | %d | %.1f | %.1f |\n", what, T, rows, s * 1e6,
                rows * neuron_bytes / s / 1e9);
  };
  std::printf(
      "\n| cold side (%s) | threads | neurons | us per call | GB/s |\n|---|---|---|---|---|\n",
      DTypeName(m.dtype).data());
  const int calls = 4 * L + 4;
  for (int T : {threads, threads - 1}) {
    if (T < 1) continue;
    ThreadPool spin(T, kColdSpin);
    CpuColdFfn cold(m, spin);
    for (int n : {64, 150, 295, 500, 838, 1382}) {
      if (T == threads) {  // the two ways taking turns call by call
        double parts_s = 0;
        row("cpu-worker op", T, n, time_calls(cold, n, calls, &parts_s));
        row("op, partials left to the GPU", T, n, parts_s);
        continue;
      }
      row("cpu-worker op", T, n, time_calls(cold, n, calls));
    }
  }
  for (int T : {1, 2, 4, 8, 12}) {
    if (T >= threads) break;
    ThreadPool spin(T, kColdSpin);
    CpuColdFfn cold(m, spin);
    row("cpu-worker op", T, 838, time_calls(cold, 838, calls));
  }
  {
    ThreadPool spin(1);
    CpuColdFfn cold(m, spin);
    row("cpu-worker op, 16 neurons in cache", 1, 0, time_calls(cold, 0, 200));
  }
  // The op's fixed costs, each alone on the pool of all threads (medians of 400): the empty loop
  // over one part per thread (a wake-up of the polling threads and the wait for the last),
  // quantizing x for Q8_0 / Q4_0 rows (one thread), and the partial sums' traffic: each thread
  // writes a hidden-sized partial, then every thread adds its column range over all of them.
  {
    ThreadPool spin(threads, kColdSpin);
    const RowKernels* k = BestRowKernels();
    std::vector<float> partial(static_cast<size_t>(threads) * H);
    std::vector<int8_t> q(H);
    std::vector<float> d(H / 32);
    std::vector<int32_t> s8(H / 4);
    auto median_us = [&](const std::function<void()>& fn) {
      std::vector<double> t;
      for (int i = 0; i < 404; ++i) {
        const double t0 = Now();
        fn();
        if (i >= 4) t.push_back(Now() - t0);
      }
      return MedianOf(t) * 1e6;
    };
    const double loop = median_us([&] { spin.ParallelFor(threads, 1, [](int64_t, int64_t) {}); });
    const double quantize =
        median_us([&] { k->quantize_q8x(x.data(), H, q.data(), d.data(), s8.data()); });
    const double sums = median_us([&] {
      spin.ParallelFor(threads, 1, [&](int64_t b, int64_t e) {
        for (int64_t c = b; c < e; ++c) std::fill_n(partial.data() + c * H, H, 1.f + c);
      });
      const int64_t range = (H + threads - 1) / threads;
      spin.ParallelFor(H, range, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          float acc = out[i];
          for (int c = 0; c < threads; ++c) acc += partial[static_cast<size_t>(c) * H + i];
          out[i] = acc;
        }
      });
    });
    std::printf(
        "\nfixed costs per call (%d threads, us): empty loop %.1f, quantize x %.1f, "
        "partials written and summed (two loops) %.1f\n",
        threads, loop, quantize, sums);
  }
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* key) -> const char* {
      const size_t n = std::strlen(key);
      return a.compare(0, n, key) == 0 ? a.c_str() + n : nullptr;
    };
    if (const char* v = val("--dtype="))
      o.dtype = v;
    else if (const char* v = val("--layers="))
      o.layers = std::atoi(v);
    else if (const char* v = val("--hidden="))
      o.hidden = std::atoi(v);
    else if (const char* v = val("--ffn="))
      o.ffn = std::atoi(v);
    else if (const char* v = val("--heads="))
      o.heads = std::atoi(v);
    else if (const char* v = val("--vocab="))
      o.vocab = std::atoi(v);
    else if (const char* v = val("--pred-rank="))
      o.pred_rank = std::atoi(v);
    else if (const char* v = val("--budget-fraction="))
      o.budget_fraction = std::atof(v);
    else if (const char* v = val("--active="))
      o.active = std::atof(v);
    else if (const char* v = val("--lanes="))
      o.lanes = std::atoi(v);
    else if (const char* v = val("--steps="))
      o.steps = std::atoi(v);
    else if (const char* v = val("--warmup="))
      o.warmup = std::atoi(v);
    else if (const char* v = val("--threads="))
      o.threads = std::atoi(v);
    else if (const char* v = val("--modes="))
      o.modes = v;
    else if (const char* v = val("--bandwidths="))
      o.bandwidths = std::string(v) != "0";
    else if (const char* v = val("--variants="))
      o.variants = Split(v, ';');
    else if (const char* v = val("--variant-modes="))
      o.variant_modes = v;
    else if (const char* v = val("--rounds="))
      o.rounds = std::atoi(v);
    else if (const char* v = val("--graphs="))
      o.graphs = std::atoi(v) != 0;
    else if (const char* v = val("--stream-chunk="))
      o.stream_chunk = std::atoi(v);
    else if (const char* v = val("--stream-slots="))
      o.stream_slots = std::atoi(v);
    else if (const char* v = val("--cache-fractions="))
      o.cache_fractions = CommaList<double>(v);
    else if (const char* v = val("--stage-rows="))
      o.stage_rows = CommaList<int>(v);
    else if (const char* v = val("--stage-guess="))
      o.stage_guess = v;
    else if (const char* v = val("--stage-ahead="))
      o.stage_ahead = std::atoi(v) != 0;
    else if (const char* v = val("--stage-overlap="))
      o.stage_overlap = std::atoi(v) != 0;
    else if (const char* v = val("--cache-decay="))
      o.cache_decay = std::atof(v);
    else if (const char* v = val("--cache-gain="))
      o.cache_gain = std::atof(v);
    else if (const char* v = val("--cache-swaps="))
      o.cache_swaps = std::atoi(v);
    else if (const char* v = val("--cache-period="))
      o.cache_period = std::max(1, std::atoi(v));
    else if (const char* v = val("--prefill-batches="))
      o.prefill_batches = CommaList<int>(v);
    else if (const char* v = val("--skews="))
      o.skews = CommaList<double>(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (o.lanes < 2 || o.lanes > cuda::kMaxLanes) {  // backends sharing the weights (NewLane)
    std::fprintf(stderr, "--lanes must be 2 to %d\n", cuda::kMaxLanes);
    return 2;
  }
  if (o.rounds < 1 || o.rounds > 100) {
    std::fprintf(stderr, "--rounds must be 1 to 100\n");
    return 2;
  }
  const std::vector<std::string> one_round = o.variants;
  for (int r = 1; r < o.rounds; ++r)
    o.variants.insert(o.variants.end(), one_round.begin(), one_round.end());
  std::printf("command:");
  // (CUDA graphs: one per layer for single-token steps unless --graphs=0.)
  for (int i = 0; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n");
  const int threads =
      o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency());
  if (o.modes == "coldrows") {
    ThreadPool pool(threads);
    std::unique_ptr<SynthModel> model = BuildModel(o, pool);
    return ColdRowsBench(*model, threads);
  }
  if (pinfer_cuda_device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  ThreadPool pool(threads);
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; CPU threads: %d (%s)\n", prop.name, prop.multiProcessorCount,
              threads, SimdLevel().data());

  double t0 = Now();
  std::unique_ptr<SynthModel> model = BuildModel(o, pool);
  const SynthModel& m = *model;
  const ModelConfig& c = m.config;
  const double model_bytes = m.ModelBytes();
  const double budget = o.budget_fraction * model_bytes;
  std::printf(
      "model: %d layers, hidden %d, ffn %d, heads %d, vocab %d, %s: %.2f GB (+ predictors "
      "rank %d: %.2f GB); VRAM budget %.2f GB; built in %.1f s\n",
      c.n_layers, c.hidden_size, c.ffn_size, c.n_heads, c.vocab_size, DTypeName(m.dtype).data(),
      model_bytes / 1e9, m.pred_rank, c.n_layers * m.PredBytes() / 1e9, budget / 1e9, Now() - t0);

  if (o.modes == "prefill") return PrefillBench(o, m, pool, threads);
  if (o.modes == "adaptive") return AdaptiveBench(o, m, pool, threads);
  if (o.modes == "staged") return StagedBench(o, m, pool, threads);
  Bandwidths bw;
  if (o.bandwidths) {
    bw = MeasureBandwidths(m.dtype, pool);
  } else {
    std::printf("bandwidths not measured (--bandwidths=0): roofline columns are meaningless\n");
  }
  std::printf(
      "bandwidth: GPU copy %.0f GB/s, GPU %s matvec %.0f GB/s (GGUF layout %.0f), CPU %s "
      "matvec (%d threads) %.1f GB/s, host->GPU %.1f GB/s; kernel launch %.2f us host, "
      "%.2f us GPU\n",
      bw.gpu_copy / 1e9, DTypeName(m.dtype).data(), bw.gpu_gemv / 1e9, bw.gpu_gemv_gguf / 1e9,
      DTypeName(m.dtype).data(), threads, bw.cpu_gemv / 1e9, bw.h2d / 1e9, bw.launch_us,
      bw.kernel_us);

  if (o.bandwidths) {
    MeasureShapes(m.dtype, pool);
    MeasureColdRows(m.dtype, c.hidden_size, c.ffn_size, threads, pool);
  }
  if (const char* v = std::getenv("PINFER_MATVEC_WARP_ROWS")) {
    cuda::SetMatVecWarpRowsMin(std::atoi(v));
    std::printf("warp-per-row from %d rows\n", cuda::MatVecWarpRowsMin());
  }

  const int max_ctx = o.warmup + o.steps + 8;
  const int total_steps = o.warmup + o.steps;
  const size_t rb = m.Rb(c.hidden_size);
  const double kv_per_layer = 2.0 * max_ctx * c.kv_dim() * 4;
  // Attention reads of the KV cache, averaged over the measured positions.
  const double kv_read = 2.0 * c.kv_dim() * 4 * (o.warmup + o.steps / 2.0);
  std::vector<Result> results;
  std::vector<float> logits(c.vocab_size);
  cuda::GreedyResult pick;

  const std::string* modes = &o.modes;
  auto has_mode = [&](const char* name) { return modes->find(name) != std::string::npos; };

  for (const std::string& variant : o.variants) {
    ApplyVariant(variant);
    modes = variant == "base" || o.variant_modes.empty() ? &o.modes : &o.variant_modes;
    std::printf("variant %s: modes %s\n", variant.c_str(), modes->c_str());
    const size_t first_result = results.size();
    // --- pinfer: hot rows on the GPU, cold rows on the CPU, overlapped. lanes: the same backend
    // and more lanes (Backend::NewLane) decode o.lanes sequences at once, one thread each.
    const bool lanes = has_mode("lanes");
    const int seqs = !lanes ? 1 : g_variant_lanes > 0 ? g_variant_lanes : o.lanes;
    if (has_mode("pinfer") || lanes) {
      // With lanes: a KV slot per sequence and each extra lane's scratch (which holds no KV cache).
      const double fixed = m.HeadBytes() + c.n_layers * (m.AttnBytes() + m.PredBytes()) +
                           ScratchBytes(m, max_ctx * seqs, c.n_layers, 8) +
                           (seqs - 1) * ScratchBytes(m, 0, 0, 8);
      const double per_neuron = 3.0 * rb + 4;  // gate, up, down_t rows and the id
      const int n_hot = std::max(
          0, std::min(c.ffn_size, static_cast<int>((budget - fixed) / (c.n_layers * per_neuron))));
      cuda::ModelUpload u = BaseUpload(m, max_ctx);
      u.max_seqs = seqs;
      std::vector<std::vector<int32_t>> local_of(c.n_layers);  // global -> hot local or -1
      for (int l = 0; l < c.n_layers; ++l) {
        cuda::LayerUpload& lu = u.layers[l];
        FillHotLayer(m, l, n_hot, &lu);
        local_of[l].assign(c.ffn_size, -1);
        for (size_t i = 0; i < lu.hot_ids.size(); ++i)
          local_of[l][lu.hot_ids[i]] = static_cast<int>(i);
      }
      const double plan = fixed + c.n_layers * per_neuron * n_hot +
                          4.0 * c.n_layers * (c.ffn_size - n_hot);  // cold ids
      Backend be;
      char err[512] = {0};
      t0 = Now();
      if (int rc = pinfer_cuda_create_backend(&u, &be.b, err, sizeof(err)); rc != 0) {
        std::fprintf(stderr, "pinfer backend: %s\n", err);
        return 1;
      }
      std::printf(
          "pinfer: %d of %d FFN neurons per layer on the GPU (%.1f%%), uploaded in %.1f s\n", n_hot,
          c.ffn_size, 100.0 * n_hot / c.ffn_size, Now() - t0);
      be.b->set_collect_gpu_times(g_gpu_times);
      be.b->set_use_graphs(o.graphs);
      std::vector<Backend> lane(seqs - 1);
      for (Backend& l : lane) {
        cuda::BackendStatus st = be.b->NewLane(&l.b);
        if (!st.ok()) {
          std::fprintf(stderr, "lane: %s\n", st.message.c_str());
          return 1;
        }
        l.b->set_collect_gpu_times(g_gpu_times);
        l.b->set_use_graphs(o.graphs);
      }
      for (double skew : o.skews) {
        // Lanes: sequence i's steps follow sequence i - 1's in the masks.
        const int drawn = seqs * total_steps;
        Masks masks = DrawMasks(m, o.active, skew, drawn, pool);
        std::vector<std::vector<std::vector<int32_t>>> hot(drawn), cold_ids(drawn);
        double hot_rows = 0, cold_rows = 0;
        for (int s = 0; s < drawn; ++s) {
          hot[s].resize(c.n_layers);
          cold_ids[s].resize(c.n_layers);
          for (int l = 0; l < c.n_layers; ++l) {
            for (int32_t j : masks[s][l]) {
              if (local_of[l][j] >= 0)
                hot[s][l].push_back(local_of[l][j]);
              else
                cold_ids[s][l].push_back(j);
            }
            if (s % total_steps >= o.warmup) {
              hot_rows += hot[s][l].size();
              cold_rows += cold_ids[s][l].size();
            }
          }
        }
        hot_rows /= o.steps * (drawn / total_steps);
        cold_rows /= o.steps * (drawn / total_steps);
        // One sequence's decode on backend b in KV slot `seq`, its masks from step `first`;
        // `warm` runs once between the warm-up and the measured steps. The stats sum the
        // measured steps.
        struct Sums {
          double cold_s = 0, wait_s = 0, hot_s = 0, attn_s = 0, gpu_cold = 0, cpu_cold = 0;
          double launch_s = 0, gap_s = 0, in_s = 0, ahead_s = 0, guess_wait_s = 0, guess_rows = 0;
        };
        auto decode = [&](cuda::Backend* b, int seq, int first, cuda::ColdFfn* cold,
                          const std::function<void()>& warm, Sums* sums,
                          const std::function<void(int)>& on_step = nullptr) -> bool {
          std::vector<float> step_logits(c.vocab_size);
          cuda::GreedyResult step_pick;
          int32_t token = 1;
          for (int s = 0; s < total_steps; ++s) {
            if (s == o.warmup) warm();
            if (on_step) on_step(first + s);
            cuda::ForwardArgs a;
            a.seq = seq;
            a.tokens = &token;
            a.n = 1;
            a.pos0 = s;
            a.mode = cuda::FfnMode::kGiven;
            a.given_hot = &hot[first + s];
            a.given_cold = &cold_ids[first + s];
            a.run_predictors = true;
            a.cold = cold;
            AskForPick(&a, &step_logits, &step_pick);
            cuda::BackendStatus st = b->Forward(a);
            if (!st.ok()) {
              std::fprintf(stderr, "forward: %s\n", st.message.c_str());
              return false;
            }
            token = Picked(step_logits, step_pick);
            if (s >= o.warmup) {
              const cuda::ForwardStats& fs = b->last_stats();
              sums->cold_s += fs.cold_callback;
              sums->wait_s += fs.wait_for_x;
              sums->gpu_cold += static_cast<double>(fs.cold_rows_gpu);
              sums->cpu_cold += static_cast<double>(fs.cold_rows_requested);
              sums->hot_s += fs.gpu_hot_ffn;
              sums->attn_s += fs.gpu_attention;
              sums->launch_s += fs.host_launch;
              sums->ahead_s += fs.cold_ahead;
              sums->guess_wait_s += fs.guess_wait;
              sums->guess_rows += static_cast<double>(fs.guess_rows);
              sums->gap_s += fs.gpu_cold_gap;
              sums->in_s += fs.gpu_cold_in;
            }
          }
          return true;
        };
        char pl[64];
        std::snprintf(pl, sizeof(pl), "%.1f%% FFN rows hot", 100.0 * n_hot / c.ffn_size);
        // Bytes per token: the same for one sequence and for each of two.
        const double gpu_bytes = m.HeadBytes() / 2 +
                                 c.n_layers * (m.AttnBytes() + m.PredBytes() + kv_read) +
                                 hot_rows * 3 * rb;
        auto result = [&](const char* mode, double tok_s, const Sums& x, double actual) {
          Result r;
          r.mode = mode;
          r.skew = skew;
          r.tok_s = tok_s;
          r.placement = pl;
          r.gpu_bytes = gpu_bytes;
          r.cpu_bytes = cold_rows * 3 * rb;
          r.gpu_cold_share =
              x.gpu_cold + x.cpu_cold > 0 ? x.gpu_cold / (x.gpu_cold + x.cpu_cold) : 0;
          r.plan_bytes = plan;
          r.actual_bytes = actual;
          r.cold_s = x.cold_s / o.steps;
          r.wait_s = x.wait_s / o.steps;
          r.gpu_hot_s = x.hot_s / o.steps;
          r.gpu_attn_s = x.attn_s / o.steps;
          r.launch_s = x.launch_s / o.steps;
          r.ahead_s = x.ahead_s / o.steps;
          r.guess_wait_s = x.guess_wait_s / o.steps;
          r.guess_rows = x.guess_rows / o.steps;
          r.gpu_gap_s = x.gap_s / o.steps;
          r.gpu_in_s = x.in_s / o.steps;
          results.push_back(r);
        };
        std::printf("pinfer skew %.0f%%: %.1f hot + %.1f cold active rows per layer per token\n",
                    skew * 100, hot_rows / c.n_layers, cold_rows / c.n_layers);
        // Variant COLD_AHEAD and its knobs, for one sequence and for lanes alike.
        const char* pin = std::getenv("PINFER_CUDA_COLD_AHEAD_PIN");
        const bool pinned = pin != nullptr && std::string(pin) == "1";
        const std::vector<std::vector<std::vector<int32_t>>> guess =
            GuessCold(cold_ids, local_of, c.ffn_size);
        const std::vector<std::vector<std::vector<int32_t>>> tiers = TierCold(guess, cold_ids);
        const char* ranked = std::getenv("PINFER_CUDA_COLD_AHEAD_RANKED");
        const std::vector<std::vector<std::vector<int32_t>>>* first =
            ranked != nullptr && std::string(ranked) == "1" ? &cold_ids
            : tiers.empty()                                 ? nullptr
                                                            : &tiers;
        if (has_mode("pinfer")) {
          ThreadPool spin(threads, kColdSpin);
          spin.set_pinned_chunks(pinned);
          CpuColdFfn cold(m, spin);
          std::function<void(int)> on_step;
          if (!guess.empty()) {
            on_step = [&](int s) {
              cold.SetGuess(&guess[s], first == nullptr ? nullptr : &(*first)[s]);
            };
          }
          double start = 0;
          Sums sums;
          if (!decode(
                  be.b, 0, 0, &cold, [&] { start = Now(); }, &sums, on_step))
            return 1;
          result("pinfer", o.steps / (Now() - start), sums,
                 static_cast<double>(be.b->DeviceBytes()));
        }
        if (lanes) {
          // The sequences, each on its own lane and thread with its own cold side; the cold
          // sides take turns on one pool (the CPU computes one layer's cold rows at a time, while
          // the GPU works on the other sequences). The pool has a thread fewer per other lane,
          // for their host threads, which poll the GPU meanwhile (a lane waiting for its turn
          // sleeps). (A pool of half the threads per lane, two lanes' cold rows at once, variant
          // COLD_POOLS=split of 7c9e593, was slower at skew 20% in two H200 calls: each layer's
          // cold rows take longer, and a lane waits for them; docs/benchmarks.md, run 35. A pool
          // of all 16 threads, variant LANES_POOL=16, gave 0.36x (Q4_0) and 0.49x (F16) of the
          // default's two-lane tokens/s in run 41: a pool thread then shares its core with a
          // polling host thread, and every layer waits for that thread's part.)
          ThreadPool spin(
              g_variant_lanes_pool > 0 ? g_variant_lanes_pool : std::max(1, threads - (seqs - 1)),
              kColdSpin);
          spin.set_pinned_chunks(pinned);
          std::mutex turn;
          std::atomic<int> waiting{0};
          std::vector<std::unique_ptr<CpuColdFfn>> colds;
          std::vector<std::unique_ptr<TakeTurns>> takes;
          for (int i = 0; i < seqs; ++i) {
            colds.push_back(std::make_unique<CpuColdFfn>(m, spin));
            takes.push_back(std::make_unique<TakeTurns>(colds.back().get(), &turn, &waiting));
          }
          // Lane i's guesses, for the steps of its masks (from step i * total_steps).
          auto lane_step = [&](int i) -> std::function<void(int)> {
            if (guess.empty()) return nullptr;
            return [&, i](int s) {
              colds[i]->SetGuess(&guess[s], first == nullptr ? nullptr : &(*first)[s]);
            };
          };
          std::barrier warm_done(seqs);
          std::atomic<double> start{0};
          std::vector<Sums> sums(seqs);
          std::vector<char> ok(seqs, 1);
          auto warm = [&] {
            warm_done.arrive_and_wait();
            double zero = 0;
            start.compare_exchange_strong(zero, Now());
          };
          std::vector<std::thread> others;
          for (int i = 1; i < seqs; ++i) {
            others.emplace_back([&, i] {
              ok[i] = decode(lane[i - 1].b, i, i * total_steps, takes[i].get(), warm, &sums[i],
                             lane_step(i));
            });
          }
          ok[0] = decode(be.b, 0, 0, takes[0].get(), warm, &sums[0], lane_step(0));
          for (std::thread& t : others) t.join();
          if (std::count(ok.begin(), ok.end(), 0) > 0) return 1;
          double device_bytes = static_cast<double>(be.b->DeviceBytes());
          for (const Backend& l : lane) device_bytes += static_cast<double>(l.b->DeviceBytes());
          const std::string label = "pinfer, " + std::to_string(seqs) + " lanes";
          result(label.c_str(), seqs * o.steps / (Now() - start.load()), sums[0], device_bytes);
        }
      }
    }
    // --- offload: whole layers on the GPU up to the budget, the rest dense on the CPU.
    if (has_mode("offload")) {
      const double layer_bytes = m.AttnBytes() + m.FfnBytes() + kv_per_layer + 8.0 * c.hidden_size;
      const double fixed = m.HeadBytes() + ScratchBytes(m, max_ctx, 0, 8);
      const int gpu_layers =
          std::max(0, std::min(c.n_layers, static_cast<int>((budget - fixed) / layer_bytes)));
      cuda::ModelUpload u = BaseUpload(m, max_ctx);
      for (int l = 0; l < c.n_layers; ++l) {
        if (l < gpu_layers) {
          FillAttention(m, l, &u.layers[l]);
          FillDenseFfn(m, l, &u.layers[l]);
        } else {
          u.layers[l].ffn = cuda::FfnPlacement::kNone;
        }
      }
      const double plan = fixed + gpu_layers * layer_bytes;
      Backend be;
      char err[512] = {0};
      if (int rc = pinfer_cuda_create_backend(&u, &be.b, err, sizeof(err)); rc != 0) {
        std::fprintf(stderr, "offload backend: %s\n", err);
        return 1;
      }
      std::printf("offload: %d of %d layers on the GPU\n", gpu_layers, c.n_layers);
      be.b->set_use_graphs(o.graphs);
      CpuDenseLayers cpu(m, pool, gpu_layers, max_ctx);
      std::vector<float> x(c.hidden_size);
      int32_t token = 1;
      double start = 0;
      for (int s = 0; s < total_steps; ++s) {
        if (s == o.warmup) start = Now();
        cuda::ForwardArgs a;
        a.tokens = &token;
        a.n = 1;
        a.pos0 = s;
        a.mode = cuda::FfnMode::kDense;
        a.layer_end = gpu_layers;
        a.hidden_out = x.data();
        a.logits_mode = cuda::LogitsMode::kNone;
        cuda::BackendStatus st = be.b->Forward(a);
        if (st.ok()) {
          cpu.Run(x.data(), s);
          cuda::ForwardArgs h;
          h.n = 1;
          h.pos0 = s;
          h.mode = cuda::FfnMode::kDense;
          h.hidden_in = x.data();
          h.layer_begin = c.n_layers;
          h.layer_end = c.n_layers;
          AskForPick(&h, &logits, &pick);
          st = be.b->Forward(h);
        }
        if (!st.ok()) {
          std::fprintf(stderr, "offload forward: %s\n", st.message.c_str());
          return 1;
        }
        token = Picked(logits, pick);
      }
      Result r;
      r.mode = "offload";
      r.tok_s = o.steps / (Now() - start);
      r.placement = std::to_string(gpu_layers) + " of " + std::to_string(c.n_layers) + " layers";
      const double layer_read = m.AttnBytes() + m.FfnBytes() + kv_read;
      r.gpu_bytes = m.HeadBytes() / 2 + gpu_layers * layer_read;
      r.cpu_bytes = (c.n_layers - gpu_layers) * layer_read;
      r.plan_bytes = plan;
      r.actual_bytes = static_cast<double>(be.b->DeviceBytes());
      results.push_back(r);
    }

    // --- gpu: every weight on the GPU, dense.
    if (has_mode("gpu")) {
      cuda::ModelUpload u = BaseUpload(m, max_ctx);
      for (int l = 0; l < c.n_layers; ++l) {
        FillAttention(m, l, &u.layers[l]);
        FillDenseFfn(m, l, &u.layers[l]);
      }
      Backend be;
      char err[512] = {0};
      if (int rc = pinfer_cuda_create_backend(&u, &be.b, err, sizeof(err)); rc != 0) {
        std::fprintf(stderr, "gpu backend: %s\n", err);
        return 1;
      }
      be.b->set_use_graphs(o.graphs);
      int32_t token = 1;
      double start = 0;
      for (int s = 0; s < total_steps; ++s) {
        if (s == o.warmup) start = Now();
        cuda::ForwardArgs a;
        a.tokens = &token;
        a.n = 1;
        a.pos0 = s;
        a.mode = cuda::FfnMode::kDense;
        AskForPick(&a, &logits, &pick);
        cuda::BackendStatus st = be.b->Forward(a);
        if (!st.ok()) {
          std::fprintf(stderr, "gpu forward: %s\n", st.message.c_str());
          return 1;
        }
        token = Picked(logits, pick);  // the product's greedy pick, part of the step
      }
      Result r;
      r.mode = "gpu";
      r.tok_s = o.steps / (Now() - start);
      r.placement = "all weights (no budget)";
      r.gpu_bytes = m.HeadBytes() / 2 + c.n_layers * (m.AttnBytes() + m.FfnBytes() + kv_read);
      r.plan_bytes = model_bytes + ScratchBytes(m, max_ctx, c.n_layers, 8);
      r.actual_bytes = static_cast<double>(be.b->DeviceBytes());
      results.push_back(r);
    }
    for (size_t i = first_result; i < results.size(); ++i) results[i].variant = variant;
  }

  if (o.bandwidths) {
    // Measured again after the modes, so that a host slowed at the start by a neighbour does not
    // lower a roofline: each bandwidth is the better of its two measurements.
    const Bandwidths again = MeasureBandwidths(m.dtype, pool);
    std::printf(
        "bandwidth after the modes: GPU copy %.0f GB/s, GPU %s matvec %.0f GB/s, CPU %s matvec "
        "%.1f GB/s, host->GPU %.1f GB/s (the roofline takes the larger of each)\n",
        again.gpu_copy / 1e9, DTypeName(m.dtype).data(), again.gpu_gemv / 1e9,
        DTypeName(m.dtype).data(), again.cpu_gemv / 1e9, again.h2d / 1e9);
    bw.gpu_copy = std::max(bw.gpu_copy, again.gpu_copy);
    bw.gpu_gemv = std::max(bw.gpu_gemv, again.gpu_gemv);
    bw.cpu_gemv = std::max(bw.cpu_gemv, again.cpu_gemv);
    bw.h2d = std::max(bw.h2d, again.h2d);
  }
  for (Result& r : results) SetFloors(bw, &r);
  PrintResults(o, m, bw, results);
  PrintRounds(m, results);
  return 0;
}

}  // namespace
}  // namespace pinfer

int main(int argc, char** argv) { return pinfer::Main(argc, argv); }
