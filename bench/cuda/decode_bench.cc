// Decode on a synthetic ReluLLaMA-13B-shape model (bench_common.h: the model and its activation
// profile): the pinfer split against dense layer offload (llama.cpp's strategy) and the whole
// model on the GPU, one sequence and decode lanes, in one binary and one run, with the GPU and CPU
// bandwidths that make up the roofline measured in the same run (issue 5's and issue 43's speed
// targets). Prints the command, a table per run and, with --rounds, the medians.
//
//   cuda_decode_bench --dtype=F16 --rounds=3                 # pinfer, offload, gpu at skews 20/40%
//   cuda_decode_bench --dtype=F16 --rounds=3 --modes=lanes   # two sequences in flight
//   cuda_decode_bench --dtype=Q4_K_M --rounds=3              # as llama.cpp's Q4_K_M types it
//
// --dtype=Q4_K_M is Q4_K with the output head and half of the layers' wv and down Q6_K, as
// `pinfer convert --type q4_k_m` writes a Llama (bench_common.h): byte counts, budgets and
// rooflines take each tensor's type, the bandwidths are measured on Q4_K.
//
// Modes (--modes, default pinfer,offload,gpu), at the same VRAM budget (default half the model's
// bytes):
//   pinfer   attention, norms, embeddings, output head, predictors and the top-ranked FFN rows
//            that fit on the GPU; the active hot rows computed sparse on the GPU while the active
//            cold rows are computed sparse by CPU threads (the cpu-worker's op), overlapped within
//            each layer.
//   offload  whole layers on the GPU up to the budget, the remaining layers computed dense on the
//            CPU (attention included), output head on the GPU.
//   gpu      every weight on the GPU, dense (no budget): the bandwidth check.
//   lanes    pinfer's backend and --lanes - 1 more lanes over the same weights (Backend::NewLane)
//            decode --lanes sequences at once (default 2, the service's --decode-lanes), one
//            thread each, the cold sides taking turns on the CPU: one sequence's cold rows overlap
//            the others' GPU work, where a single sequence must wait for each layer's cold rows
//            before the next layer's attention. Tokens/s counts every sequence; bytes per token
//            are one sequence's.
// Variants (--variants, sets of the module's PINFER_CUDA_* knobs; see ApplyVariant) take turns in
// one process; with --rounds=N the list runs N times over and a last table gives each mode's
// medians over the rounds. The loads ahead from a guess that cpu-worker --prefetch-guess makes
// are variant COLD_AHEAD (GuessCold below).
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/cuda/bench_common.h"
#include "gpu-worker/cuda/backend.h"
#include "shared/engine/ops.h"
#include "shared/engine/transformer.h"
#include "shared/util/thread_pool.h"

namespace pinfer::cudabench {
namespace {

struct Options : BenchOptions {
  int lanes = 2;  // --modes=lanes: sequences in flight
  std::string modes = "pinfer,offload,gpu";
  // --bandwidths=0 skips measuring the bandwidths (profiling runs, where every launch is slow;
  // the roofline columns are then meaningless).
  bool bandwidths = true;
  // --variants=base;PDL=0;REPACK=0+STEP_GRAPH=0: the modes are run once per variant, each a set
  // of the CUDA module's PINFER_CUDA_* knobs (read when a backend is created); "base" is none.
  std::vector<std::string> variants = {"base"};
  std::string variant_modes;  // --variant-modes=gpu: the modes of the variants other than base
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
      ops_->MatMul(View(L.wv_dtype, c.kv_dim(), H, *L.wv), xb.data(), 1, vc + pos * c.kv_dim());
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
      ops_->MatMul(View(L.down_dtype, H, F, *L.down_t), g.data(), 1, o.data());  // as [hidden, ffn]
      for (int i = 0; i < H; ++i) x[i] += o[i];
    }
  }

 private:
  const SynthModel& m_;
  std::unique_ptr<CpuOps> ops_;
  int first_, max_ctx_;
  std::vector<float> inv_freq_, k_, v_;
};

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

// The roofline per token: max(GPU bytes / GPU bandwidth, CPU bytes / CPU bandwidth), the two
// sides overlapping; offload's layers run one after the other, so there it is the sum.
void SetFloors(const Bandwidths& bw, Result* r) {
  if (r->mode == "offload") {
    r->floor_s = r->gpu_bytes / bw.gpu() + r->cpu_bytes / bw.cpu_gemv;
  } else {
    r->floor_s = std::max(r->gpu_bytes / bw.gpu(), r->cpu_bytes / bw.cpu_gemv);
  }
  // The floor puts every cold row on the CPU, as placed. When the GPU may also read cold
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
        m.TypeName().c_str(), mode.c_str(), skew, r.placement.c_str(), r.tok_s, ms, vs,
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
                m.TypeName().c_str(), g.mode.c_str(), skew, g.variant.c_str(), g.tok_s.size(),
                MedianOf(g.tok_s), *std::min_element(g.tok_s.begin(), g.tok_s.end()),
                *std::max_element(g.tok_s.begin(), g.tok_s.end()), vs_offload, MedianOf(g.pct),
                vs_median, vs_round);
  }
}

// Variant LANES=N: --lanes for that variant (0: --lanes), so that lane counts can take turns in
// one process.
int g_variant_lanes = 0;
// Variant LANES_POOL=N: the lanes' shared cold pool has N threads (default: all cores but one per
// other lane).
int g_variant_lanes_pool = 0;
// Variant TIMES=0: pinfer's backends record no per-layer timing events (whose nodes sit between
// the kernels of every layer), so the per-token lines' GPU times are zero.
bool g_gpu_times = true;

// Runs step(s) for positions 0 .. warmup + steps - 1; returns the seconds the steps from position
// `warmup` on took, or -1 when a step failed.
double TimeSteps(const BenchOptions& o, const std::function<bool(int)>& step) {
  double start = Now();
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) start = Now();
    if (!step(s)) return -1;
  }
  return Now() - start;
}

bool Stepped(const cuda::BackendStatus& st, const char* mode) {
  if (!st.ok()) std::fprintf(stderr, "%s forward: %s\n", mode, st.message.c_str());
  return st.ok();
}

// The knobs a variant may set: the module's PINFER_CUDA_* names, the bench cold side's COLD_AHEAD
// family, and the bench's own.
bool KnownKnob(const std::string& name) {
  static const char* const kKnobs[] = {"PDL",
                                       "REPACK",
                                       "STEP_GRAPH",
                                       "GRAPHS",
                                       "PRODUCER_QX",
                                       "PRELAUNCH",
                                       "NORM_VEC8",
                                       "QX_REGS",
                                       "QX_EARLY",
                                       "ATTN_ONLINE",
                                       "ATTN_QX",
                                       "ATTN_EARLY",
                                       "QX_PIPE",
                                       "FUSED_NORM",
                                       "ROPE_IN_PRODUCT",
                                       "ACT_IN_PRODUCT",
                                       "LATE_X_FIRST",
                                       "PREFETCH",
                                       "ATTN_LATE_TRIGGER",
                                       "Q8X",
                                       "ZERO_COPY_COLD",
                                       "QX_WARPS",
                                       "QX_ROWS",
                                       "QX_SHAPE",
                                       "NORM_LOOP",
                                       "EARLY_PUBLISH",
                                       "COLD_GPU_SHARE",
                                       "COLD_PARTS",
                                       "COLD_AHEAD",
                                       "COLD_AHEAD_HINT",
                                       "COLD_AHEAD_RANKED",
                                       "COLD_AHEAD_TIER",
                                       "COLD_AHEAD_PIN",
                                       "COLD_GUESS",
                                       "COLD_GUESS_SHIFT",
                                       "COLD_GUESS_RECALL",
                                       "LANES",
                                       "LANES_POOL",
                                       "TIMES"};
  return std::find(std::begin(kKnobs), std::end(kKnobs), name) != std::end(kKnobs);
}

// Sets the module's knobs for one variant: every known knob back to its default, then the
// variant's NAME=VALUE pairs as PINFER_CUDA_NAME (LANES=N, LANES_POOL=N and TIMES=0 are the
// bench's own, above). The knobs are the module's (gpu-worker/cuda), but for COLD_AHEAD and its
// _HINT, _RANKED, _TIER and _PIN, which the bench's cold side reads.
void ApplyVariant(const std::string& variant) {
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

int Main(int argc, char** argv) {
  Options o;
  o.mixes_ok = true;  // every byte count below takes each tensor's type
  auto own = [&](const std::string& a) {
    if (const char* v = FlagValue(a, "--lanes="))
      o.lanes = std::atoi(v);
    else if (const char* v = FlagValue(a, "--modes="))
      o.modes = v;
    else if (const char* v = FlagValue(a, "--bandwidths="))
      o.bandwidths = std::string(v) != "0";
    else if (const char* v = FlagValue(a, "--variants="))
      o.variants = Split(v, ';');
    else if (const char* v = FlagValue(a, "--variant-modes="))
      o.variant_modes = v;
    else
      return false;
    return true;
  };
  if (!ParseFlags(argc, argv, &o, own)) return 2;
  for (const std::string* list : {&o.modes, &o.variant_modes}) {
    for (const std::string& mode : Split(*list, ',')) {
      if (mode != "pinfer" && mode != "offload" && mode != "gpu" && mode != "lanes") {
        // Prompt processing, the adaptive hot set and the cold side alone have binaries of their
        // own (cuda_prefill_bench, cuda_adaptive_bench, cuda_kernel_bench --sections=coldop).
        std::fprintf(stderr, "--modes: %s is not one of pinfer, offload, gpu, lanes\n",
                     mode.c_str());
        return 2;
      }
    }
  }
  for (const std::string& variant : o.variants) {
    for (const std::string& kv : Split(variant, '+')) {
      if (variant != "base" && !KnownKnob(kv.substr(0, kv.find('=')))) {
        std::fprintf(stderr, "--variants: %s is not a knob the module or the bench reads\n",
                     kv.c_str());
        return 2;
      }
    }
  }
  if (o.lanes < 2 || o.lanes > cuda::kMaxLanes) {  // backends sharing the weights (NewLane)
    std::fprintf(stderr, "--lanes must be 2 to %d\n", cuda::kMaxLanes);
    return 2;
  }
  const std::vector<std::string> one_round = o.variants;
  for (int r = 1; r < o.rounds; ++r)
    o.variants.insert(o.variants.end(), one_round.begin(), one_round.end());
  const int threads = o.Threads();
  if (!OpenDevice(threads)) return 1;
  ThreadPool pool(threads);
  double t0 = Now();
  std::unique_ptr<SynthModel> model = BuildModel(o, pool);
  const SynthModel& m = *model;
  const ModelConfig& c = m.config;
  const double model_bytes = m.ModelBytes();
  const double budget = o.Budget(model_bytes);
  PrintModel(o, m, Now() - t0);

  Bandwidths bw;
  if (o.bandwidths) {
    bw = MeasureBandwidths(m.dtype, pool);
    PrintBandwidths("", m.dtype, threads, bw);
  } else {
    std::printf("bandwidths not measured (--bandwidths=0): roofline columns are meaningless\n");
  }

  const int max_ctx = o.warmup + o.steps + 8;
  const int total_steps = o.warmup + o.steps;
  const double kv_per_layer = 2.0 * max_ctx * c.kv_dim() * 4;
  // Attention reads of the KV cache, averaged over the measured positions.
  const double kv_read = 2.0 * c.kv_dim() * 4 * (o.warmup + o.steps / 2.0);
  std::vector<Result> results;
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
      const double fixed = SplitFixedBytes(m, ScratchBytes(m, max_ctx * seqs, c.n_layers, 8) +
                                                  (seqs - 1) * ScratchBytes(m, 0, 0, 8));
      const int n_hot = HotNeuronsInBudget(m, budget, fixed);
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
      const double plan =
          fixed + m.HotNeuronBytes() * n_hot + 4.0 * c.n_layers * (c.ffn_size - n_hot);  // cold ids
      Backend be;
      t0 = Now();
      if (!CreateBackend(u, "pinfer", &be)) return 1;
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
        // Rows and their bytes (a neuron's rows are longer where down_t is Q6_K).
        double hot_rows = 0, cold_rows = 0, hot_bytes = 0, cold_bytes = 0;
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
              hot_bytes += static_cast<double>(hot[s][l].size() * m.NeuronBytes(l));
              cold_bytes += static_cast<double>(cold_ids[s][l].size() * m.NeuronBytes(l));
            }
          }
        }
        const double measured = o.steps * (drawn / total_steps);
        hot_rows /= measured;
        cold_rows /= measured;
        hot_bytes /= measured;
        cold_bytes /= measured;
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
          cuda::GreedyResult step_pick;
          int32_t token = 1;
          for (int s = 0; s < total_steps; ++s) {
            if (s == o.warmup) warm();
            if (on_step) on_step(first + s);
            cuda::ForwardArgs a = DecodeStep(&token, s, cuda::FfnMode::kGiven);
            a.seq = seq;
            a.given_hot = &hot[first + s];
            a.given_cold = &cold_ids[first + s];
            a.run_predictors = true;
            a.cold = cold;
            AskForPick(&a, &step_pick);
            cuda::BackendStatus st = b->Forward(a);
            if (!st.ok()) {
              std::fprintf(stderr, "forward: %s\n", st.message.c_str());
              return false;
            }
            token = step_pick.token;
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
        const double gpu_bytes =
            m.OutBytes() + m.AllAttnBytes() + c.n_layers * (m.PredBytes() + kv_read) + hot_bytes;
        auto result = [&](const char* mode, double tok_s, const Sums& x, double actual) {
          const double n = o.steps;
          results.push_back(Result{
              .mode = mode,
              .skew = skew,
              .placement = pl,
              .tok_s = tok_s,
              .gpu_bytes = gpu_bytes,
              .cpu_bytes = cold_bytes,
              .plan_bytes = plan,
              .actual_bytes = actual,
              .cold_s = x.cold_s / n,
              .wait_s = x.wait_s / n,
              .gpu_hot_s = x.hot_s / n,
              .gpu_attn_s = x.attn_s / n,
              .launch_s = x.launch_s / n,
              .gpu_gap_s = x.gap_s / n,
              .gpu_in_s = x.in_s / n,
              .ahead_s = x.ahead_s / n,
              .guess_wait_s = x.guess_wait_s / n,
              .guess_rows = x.guess_rows / n,
              .gpu_cold_share =
                  x.gpu_cold + x.cpu_cold > 0 ? x.gpu_cold / (x.gpu_cold + x.cpu_cold) : 0,
          });
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
      // The first layers that fit (their sizes differ where a mix raises wv and down).
      auto layer_bytes = [&](int l) {
        return static_cast<double>(m.AttnBytes(l) + m.FfnBytes(l)) + kv_per_layer +
               8.0 * c.hidden_size;
      };
      const double fixed = m.HeadBytes() + ScratchBytes(m, max_ctx, 0, 8);
      double plan = fixed;
      int gpu_layers = 0;
      while (gpu_layers < c.n_layers && plan + layer_bytes(gpu_layers) <= budget)
        plan += layer_bytes(gpu_layers++);
      cuda::ModelUpload u = BaseUpload(m, max_ctx);
      for (int l = 0; l < c.n_layers; ++l) {
        if (l < gpu_layers) {
          FillAttention(m, l, &u.layers[l]);
          FillDenseFfn(m, l, &u.layers[l]);
        } else {
          u.layers[l].ffn = cuda::FfnPlacement::kNone;
        }
      }
      Backend be;
      if (!CreateBackend(u, "offload", &be)) return 1;
      std::printf("offload: %d of %d layers on the GPU\n", gpu_layers, c.n_layers);
      be.b->set_use_graphs(o.graphs);
      CpuDenseLayers cpu(m, pool, gpu_layers, max_ctx);
      std::vector<float> x(c.hidden_size);
      int32_t token = 1;
      const double elapsed = TimeSteps(o, [&](int s) {
        cuda::ForwardArgs a = DecodeStep(&token, s, cuda::FfnMode::kDense);
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
          AskForPick(&h, &pick);
          st = be.b->Forward(h);
        }
        token = pick.token;
        return Stepped(st, "offload");
      });
      if (elapsed < 0) return 1;
      Result r;
      r.mode = "offload";
      r.tok_s = o.steps / elapsed;
      r.placement = std::to_string(gpu_layers) + " of " + std::to_string(c.n_layers) + " layers";
      r.gpu_bytes = m.OutBytes();
      for (int l = 0; l < c.n_layers; ++l) {
        const double layer_read = static_cast<double>(m.AttnBytes(l) + m.FfnBytes(l)) + kv_read;
        (l < gpu_layers ? r.gpu_bytes : r.cpu_bytes) += layer_read;
      }
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
      if (!CreateBackend(u, "gpu", &be)) return 1;
      be.b->set_use_graphs(o.graphs);
      int32_t token = 1;
      const double elapsed = TimeSteps(o, [&](int s) {
        cuda::ForwardArgs a = DecodeStep(&token, s, cuda::FfnMode::kDense);
        AskForPick(&a, &pick);
        const cuda::BackendStatus st = be.b->Forward(a);
        token = pick.token;  // the product's greedy pick, part of the step
        return Stepped(st, "gpu");
      });
      if (elapsed < 0) return 1;
      Result r;
      r.mode = "gpu";
      r.tok_s = o.steps / elapsed;
      r.placement = "all weights (no budget)";
      r.gpu_bytes =
          m.OutBytes() + m.AllAttnBytes() + m.AllNeuronBytes() * c.ffn_size + c.n_layers * kv_read;
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
}  // namespace pinfer::cudabench

int main(int argc, char** argv) { return pinfer::cudabench::Main(argc, argv); }
