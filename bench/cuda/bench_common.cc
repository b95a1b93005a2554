// The CUDA benches' shared pieces (bench_common.h says what each is for).
#include "bench/cuda/bench_common.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <utility>

#include "gpu-worker/cuda/kernels.h"
#include "gpu-worker/cuda/model_dims.h"
#include "shared/engine/row_kernels.h"
#include "shared/model/gguf.h"

namespace pinfer::cudabench {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double MedianOf(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::vector<double> CommaList(const char* v) {
  std::vector<double> out;
  for (const char* p = v; *p;) {
    out.push_back(std::atof(p));
    const char* q = std::strchr(p, ',');
    if (q == nullptr) break;
    p = q + 1;
  }
  return out;
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

int BenchOptions::Threads() const {
  return threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
}

const char* FlagValue(const std::string& arg, const char* key) {
  const size_t n = std::strlen(key);
  return arg.compare(0, n, key) == 0 ? arg.c_str() + n : nullptr;
}

bool ParseNumberFlag(const std::string& a, const NumberFlags& flags) {
  for (const auto& [key, field] : flags.ints) {
    const char* v = FlagValue(a, key);
    if (v == nullptr) continue;
    *field = std::atoi(v);
    return true;
  }
  for (const auto& [key, field] : flags.reals) {
    const char* v = FlagValue(a, key);
    if (v == nullptr) continue;
    *field = std::atof(v);
    return true;
  }
  return false;
}

bool ParseSharedFlag(const std::string& a, BenchOptions* o) {
  const NumberFlags numbers = {{{"--layers=", &o->layers},
                                {"--hidden=", &o->hidden},
                                {"--ffn=", &o->ffn},
                                {"--heads=", &o->heads},
                                {"--kv-heads=", &o->kv_heads},
                                {"--vocab=", &o->vocab},
                                {"--pred-rank=", &o->pred_rank},
                                {"--steps=", &o->steps},
                                {"--warmup=", &o->warmup},
                                {"--threads=", &o->threads},
                                {"--rounds=", &o->rounds}},
                               {{"--budget-fraction=", &o->budget_fraction},
                                {"--budget-gb=", &o->budget_gb},
                                {"--active=", &o->active}}};
  if (ParseNumberFlag(a, numbers)) return true;
  if (const char* v = FlagValue(a, "--dtype=")) {
    // Q4_K_M is no DType but a mix over Q4_K (SynthModel).
    o->q4_k_m = std::string(v) == "Q4_K_M";
    o->dtype = o->q4_k_m ? "Q4_K" : v;
  } else if (const char* v = FlagValue(a, "--skews=")) {
    o->skews = CommaList(v);
  } else if (const char* v = FlagValue(a, "--graphs=")) {
    o->graphs = std::atoi(v) != 0;
  } else {
    return false;
  }
  return true;
}

bool ParseFlags(int argc, char** argv, BenchOptions* o,
                const std::function<bool(const std::string&)>& own) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (!ParseSharedFlag(a, o) && !own(a)) {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return false;
    }
  }
  if (o->dtype != "F16" && o->dtype != "Q4_0" && o->dtype != "Q4_K" && o->dtype != "Q6_K") {
    std::fprintf(stderr, "--dtype must be F16, Q4_0, Q4_K, Q4_K_M or Q6_K\n");
    return false;
  }
  if (o->q4_k_m && !o->mixes_ok) {
    std::fprintf(stderr, "--dtype=Q4_K_M: only cuda_decode_bench counts bytes per tensor type\n");
    return false;
  }
  // Rows of whole super-blocks (ffn_down's rows are ffn long in the file): else the converter
  // falls back to types the bench does not build (KMixTensorType).
  if (o->q4_k_m && (o->hidden % kSuperBlock != 0 || o->ffn % kSuperBlock != 0)) {
    std::fprintf(stderr, "--dtype=Q4_K_M needs --hidden and --ffn multiples of %d\n", kSuperBlock);
    return false;
  }
  if (o->rounds < 1 || o->rounds > 100) {
    std::fprintf(stderr, "--rounds must be 1 to 100\n");
    return false;
  }
  if (o->skews.empty() || o->steps < 1 || o->warmup < 0) {
    std::fprintf(stderr,
                 "--skews needs a value, --steps must be positive, --warmup not negative\n");
    return false;
  }
  std::printf("command:");
  for (int i = 0; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n");
  return true;
}

Buffer::Buffer(size_t bytes, bool huge) : n(bytes) {
  {
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
}

Buffer::~Buffer() { std::free(p); }

namespace {

inline uint64_t SplitMix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

cuda::HostMatrix Host(DType t, int64_t rows, int64_t cols, const void* data) {
  cuda::HostMatrix m;
  m.type = static_cast<cuda::HostType>(t);
  m.rows = rows;
  m.cols = cols;
  m.data = data;
  return m;
}

}  // namespace

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
  if (IsKQuant(t)) {
    // K super-blocks: random quants and sub-block scales, the fp16 scales of the scales (and of
    // the mins) fixed to small sane values, so no value is Inf or NaN.
    const size_t bb = RowBytes(t, kSuperBlock), blocks = bytes / bb;
    pool.ParallelFor(static_cast<int64_t>(blocks), 1 << 14, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        uint8_t* blk = p + i * bb;
        uint16_t* d = reinterpret_cast<uint16_t*>(t == DType::kQ6_K ? blk + 208 : blk);
        d[0] = static_cast<uint16_t>(0x1000 | (d[0] & 0xff));  // ~0.0005 times a 6-bit scale
        if (t != DType::kQ6_K) d[1] = static_cast<uint16_t>(0x1000 | (d[1] & 0xff));
      }
    });
  }
}

size_t SynthModel::AttnBytes(int l) const {
  const ModelConfig& c = config;
  return Rb(c.hidden_size) * (2 * c.q_dim() + c.kv_dim()) +
         RowBytes(layers[l].wv_dtype, c.hidden_size) * c.kv_dim();
}

size_t SynthModel::AllAttnBytes() const {
  size_t s = 0;
  for (int l = 0; l < config.n_layers; ++l) s += AttnBytes(l);
  return s;
}

size_t SynthModel::AllNeuronBytes() const {
  size_t s = 0;
  for (int l = 0; l < config.n_layers; ++l) s += NeuronBytes(l);
  return s;
}

size_t SynthModel::PredBytes() const {
  return Rb(config.hidden_size) * pred_rank + Rb(pred_rank) * config.ffn_size;
}

size_t SynthModel::ModelBytes() const {
  return HeadBytes() + AllAttnBytes() + AllNeuronBytes() * config.ffn_size +
         config.n_layers * 8 * config.hidden_size + 4 * config.hidden_size;
}

std::string SynthModel::TypeName(bool detail) const {
  const std::string base(DTypeName(dtype));
  if (!q4_k_m) return base;
  if (!detail) return "Q4_K_M";
  int wv6 = 0, down6 = 0, wv5 = 0;
  for (const SynthLayer& L : layers) {
    wv6 += L.wv_dtype == DType::kQ6_K;
    wv5 += L.wv_dtype == DType::kQ5_K;
    down6 += L.down_dtype == DType::kQ6_K;
  }
  std::string s = "Q4_K_M (" + base + ", " + std::string(DTypeName(out_dtype)) + " output";
  if (wv6 == down6) {
    s += ", Q6_K wv/down of " + std::to_string(wv6) + " layers";
  } else {
    s += ", Q6_K wv of " + std::to_string(wv6) + " layers and down of " + std::to_string(down6);
  }
  // llama.cpp's 70B rule (80 layers with grouped-query attention): the other layers' wv Q5_K.
  if (wv5 > 0) s += ", Q5_K wv of " + std::to_string(wv5) + " layers";
  return s + ")";
}

TensorView View(DType t, int64_t rows, int64_t cols, const Buffer& b) {
  TensorView v;
  v.dtype = t;
  v.shape = {rows, cols};
  v.data = b.p;
  return v;
}

std::unique_ptr<SynthModel> PlanModel(const BenchOptions& o) {
  auto m = std::make_unique<SynthModel>();
  auto parsed = DTypeFromName(o.dtype);
  m->dtype = parsed.ok() ? *parsed : DType::kF16;
  m->q4_k_m = o.q4_k_m;
  m->config = ModelConfig{.vocab_size = o.vocab,
                          .hidden_size = o.hidden,
                          .n_layers = o.layers,
                          .n_heads = o.heads,
                          .n_kv_heads = o.kv_heads > 0 ? o.kv_heads : o.heads,
                          .head_dim = o.hidden / o.heads,
                          .ffn_size = o.ffn,
                          .activation = Activation::kSilu};
  const ModelConfig& c = m->config;
  m->pred_rank = o.pred_rank;
  // The mix's types as `pinfer convert --type q4_k_m` picks them, by the tensors' GGUF names and
  // row lengths (ffn_down's rows are ffn long there); is_70b as gguf_convert.cc's IsSeventyB.
  const bool is_70b = c.n_layers == 80 && c.n_heads != c.n_kv_heads;
  auto mix_type = [&](const std::string& name, int64_t cols, bool is_output) {
    if (!m->q4_k_m) return m->dtype;
    const GgmlType g =
        KMixTensorType(KQuantMix::kQ4_K_M, name, cols, c.n_layers, is_output, is_70b);
    auto t = DTypeFromGgmlType(static_cast<uint32_t>(g));
    if (!t.ok()) {  // ParseFlags' checks keep the mix to types the bench builds
      std::fprintf(stderr, "%s: %s\n", name.c_str(), t.status().ToString().c_str());
      std::exit(2);
    }
    return *t;
  };
  m->out_dtype = mix_type("output.weight", c.hidden_size, true);
  m->layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string blk = "blk." + std::to_string(l) + ".";
    m->layers[l].wv_dtype = mix_type(blk + "attn_v.weight", c.hidden_size, false);
    m->layers[l].down_dtype = mix_type(blk + "ffn_down.weight", c.ffn_size, false);
  }
  return m;
}

std::unique_ptr<SynthModel> BuildModel(const BenchOptions& o, ThreadPool& pool) {
  std::unique_ptr<SynthModel> m = PlanModel(o);
  const ModelConfig& c = m->config;
  const int H = c.hidden_size, F = c.ffn_size;
  uint64_t seed = 1;
  auto make = [&](int64_t rows, int64_t cols, DType t) {
    auto b = std::make_unique<Buffer>(RowBytes(t, cols) * rows);
    FillRandom(t, b->p, b->n, seed++, pool);
    return b;
  };
  m->emb = make(c.vocab_size, H, m->dtype);
  m->out = make(c.vocab_size, H, m->out_dtype);
  m->out_norm.assign(H, 1.f);
  std::mt19937 rng(7);
  for (int l = 0; l < c.n_layers; ++l) {
    SynthLayer& L = m->layers[l];
    L.wq = make(c.q_dim(), H, m->dtype);
    L.wk = make(c.kv_dim(), H, m->dtype);
    L.wv = make(c.kv_dim(), H, L.wv_dtype);
    L.wo = make(H, c.q_dim(), m->dtype);
    L.gate = make(F, H, m->dtype);
    L.up = make(F, H, m->dtype);
    L.down_t = make(F, H, L.down_dtype);
    const size_t rb = m->Rb(H), rb_down = RowBytes(L.down_dtype, H), nb = m->NeuronBytes(l);
    L.bundles = std::make_unique<Buffer>(nb * F);
    pool.ParallelFor(F, 256, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        uint8_t* dst = L.bundles->p + nb * j;
        std::memcpy(dst, L.gate->p + rb * j, rb);
        std::memcpy(dst + rb, L.up->p + rb * j, rb);
        std::memcpy(dst + 2 * rb, L.down_t->p + rb_down * j, rb_down);
      }
    });
    L.fc1 = make(m->pred_rank, H, m->dtype);
    L.fc2 = make(F, m->pred_rank, m->dtype);
    L.attn_norm.assign(H, 1.f);
    L.ffn_norm.assign(H, 1.f);
    std::vector<int32_t> perm(F);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    L.rank_of.resize(F);
    for (int r = 0; r < F; ++r) L.rank_of[perm[r]] = r;
  }
  return m;
}

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

Masks DrawMasks(const SynthModel& m, double active, double skew, int steps, ThreadPool& pool) {
  std::vector<std::vector<int32_t>> rank_of;
  for (const SynthLayer& L : m.layers) rank_of.push_back(L.rank_of);
  return DrawMasksRanked(rank_of, m.config.ffn_size, active, skew, steps,
                         static_cast<uint64_t>(skew * 1000), pool);
}

CpuColdFfn::CpuColdFfn(const SynthModel& m, ThreadPool& pool)
    : m_(m), pool_(pool), ops_(NewSimdOps(&pool)), coef_(static_cast<size_t>(m.config.ffn_size)) {
  const char* hint = std::getenv("PINFER_CUDA_COLD_AHEAD_HINT");
  hint_ = hint == nullptr ? 2 : std::atoi(hint);
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
void CpuColdFfn::Ahead(int layer, const cuda::ColdGuess& module_guess,
                       const std::function<bool()>& x_ready) {
  (void)module_guess;  // a guess from random predictors, about masks drawn independently
  if (guess_ == nullptr) return;
  const std::vector<int32_t>& g = (*guess_)[layer];
  if (g.empty()) return;
  const SynthLayer& L = m_.layers[layer];
  const size_t nb = m_.NeuronBytes(layer);
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
          touch(L.bundles->p + j * nb, nb);
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

cuda::BackendStatus CpuColdFfn::Run(const cuda::ColdRequest& r) {
  const int H = m_.config.hidden_size, F = m_.config.ffn_size;
  const SynthLayer& L = m_.layers[r.layer];
  // The three matrices as strided views into the bundles, down_t in its own type.
  const size_t rb = m_.Rb(H);
  TensorView gate = View(m_.dtype, F, H, *L.bundles), up = gate;
  TensorView down_t = View(L.down_dtype, F, H, *L.bundles);
  up.data = L.bundles->p + rb;
  down_t.data = L.bundles->p + 2 * rb;
  gate.row_stride = up.row_stride = down_t.row_stride = m_.NeuronBytes(r.layer);
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

void CheckCuda(int error, const char* expr) {
  const auto e = static_cast<cudaError_t>(error);
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", expr, cudaGetErrorString(e));
  std::exit(1);
}

bool OpenDevice(int threads) {
  if (pinfer_cuda_device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return false;
  }
  cudaDeviceProp prop;
  PINFER_BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; CPU threads: %d (%s)\n", prop.name, prop.multiProcessorCount,
              threads, SimdLevel().data());
  return true;
}

namespace {
double FastestOf(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
}  // namespace

Bandwidths MeasureBandwidths(DType dtype, ThreadPool& pool) {
  Bandwidths bw;
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  PINFER_BENCH_CUDA(cudaMalloc(&a, bytes));
  PINFER_BENCH_CUDA(cudaMalloc(&b, bytes));
  PINFER_BENCH_CUDA(cudaMemset(a, 0x11, bytes));
  cudaEvent_t e0, e1;
  PINFER_BENCH_CUDA(cudaEventCreate(&e0));
  PINFER_BENCH_CUDA(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 12; ++i) {
    PINFER_BENCH_CUDA(cudaEventRecord(e0));
    PINFER_BENCH_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    PINFER_BENCH_CUDA(cudaEventRecord(e1));
    PINFER_BENCH_CUDA(cudaEventSynchronize(e1));
    float ms;
    PINFER_BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) t.push_back(ms * 1e-3);
  }
  bw.gpu_copy = 2.0 * bytes / FastestOf(t);

  // GEMV: a random matrix of the benchmark's type, hidden 5120 columns.
  const int64_t cols = 5120;
  const int64_t rows = static_cast<int64_t>(bytes / RowBytes(dtype, cols));
  {
    Buffer host(RowBytes(dtype, cols) * rows);
    FillRandom(dtype, host.p, host.n, 99, pool);
    PINFER_BENCH_CUDA(cudaMemcpy(a, host.p, host.n, cudaMemcpyHostToDevice));
    std::vector<float> x(cols, 0.01f);
    PINFER_BENCH_CUDA(cudaMemcpy(b, x.data(), cols * 4, cudaMemcpyHostToDevice));
    float* y = static_cast<float*>(b) + cols;
    cuda::DeviceMatrix m{static_cast<cuda::WType>(dtype), rows, cols, a};
    auto time_matvec = [&](const cuda::DeviceMatrix& w) {
      t.clear();
      for (int i = 0; i < 12; ++i) {
        PINFER_BENCH_CUDA(cudaEventRecord(e0));
        PINFER_BENCH_CUDA(cuda::MatVecRows(w, nullptr, static_cast<int>(rows), nullptr,
                                           static_cast<float*>(b), 1, y, static_cast<int>(rows),
                                           nullptr));
        PINFER_BENCH_CUDA(cudaEventRecord(e1));
        PINFER_BENCH_CUDA(cudaEventSynchronize(e1));
        float ms;
        PINFER_BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 2) t.push_back(ms * 1e-3);
      }
      return static_cast<double>(host.n) / FastestOf(t);
    };
    if (dtype == DType::kQ4_0 || dtype == DType::kQ8_0) {
      // The layout the backend runs: quants and scales apart (kernels.h), repacked on the GPU.
      void* c = nullptr;
      PINFER_BENCH_CUDA(cudaMalloc(&c, host.n));
      cuda::DeviceMatrix sm = m;
      sm.data = c;
      sm.scales = static_cast<uint8_t*>(c) + cuda::QuantRowBytes(sm.type, cols) * rows;
      PINFER_BENCH_CUDA(cuda::RepackSplit(m, sm, 0, nullptr));
      bw.gpu_gemv = time_matvec(sm);
      PINFER_BENCH_CUDA(cudaFree(c));
    } else {
      bw.gpu_gemv = time_matvec(m);
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
    PINFER_BENCH_CUDA(cudaMallocHost(&pinned, hb));
    std::memset(pinned, 1, hb);
    t.clear();
    for (int i = 0; i < 6; ++i) {
      const double t0 = Now();
      PINFER_BENCH_CUDA(cudaMemcpy(a, pinned, hb, cudaMemcpyHostToDevice));
      if (i >= 1) t.push_back(Now() - t0);
    }
    bw.h2d = hb / FastestOf(t);
    cudaFreeHost(pinned);
  }
  {
    // Launch costs: 2000 tiny dependent kernels, host enqueue time and GPU time.
    float* f = static_cast<float*>(a);
    PINFER_BENCH_CUDA(cuda::AddInPlace(f, f + 1024, 256, nullptr));
    PINFER_BENCH_CUDA(cudaDeviceSynchronize());
    const double t0 = Now();
    PINFER_BENCH_CUDA(cudaEventRecord(e0));
    for (int i = 0; i < 2000; ++i) PINFER_BENCH_CUDA(cuda::AddInPlace(f, f + 1024, 256, nullptr));
    PINFER_BENCH_CUDA(cudaEventRecord(e1));
    bw.launch_us = (Now() - t0) / 2000 * 1e6;
    PINFER_BENCH_CUDA(cudaEventSynchronize(e1));
    float ms;
    PINFER_BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    bw.kernel_us = ms * 1e3 / 2000;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return bw;
}

Backend::~Backend() {
  if (b != nullptr) pinfer_cuda_destroy_backend(b);
}

bool CreateBackend(const cuda::ModelUpload& u, const char* what, Backend* be) {
  char err[512] = {0};
  if (pinfer_cuda_create_backend(&u, &be->b, err, sizeof(err)) == 0) return true;
  std::fprintf(stderr, "%s backend: %s\n", what, err);
  return false;
}

cuda::ModelUpload BaseUpload(const SynthModel& m, int max_ctx) {
  const ModelConfig& c = m.config;
  cuda::ModelUpload u;
  u.dims = cuda::DimsFromConfig(c);
  u.tok_embeddings = Host(m.dtype, c.vocab_size, c.hidden_size, m.emb->p);
  u.output = Host(m.out_dtype, c.vocab_size, c.hidden_size, m.out->p);
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
  lu->wv = Host(L.wv_dtype, c.kv_dim(), H, L.wv->p);
  lu->wo = Host(m.dtype, H, c.q_dim(), L.wo->p);
}

void FillHotLayer(const SynthModel& m, int l, int n_hot, cuda::LayerUpload* lu) {
  const ModelConfig& c = m.config;
  const SynthLayer& L = m.layers[l];
  const int H = c.hidden_size, F = c.ffn_size;
  FillAttention(m, l, lu);
  lu->ffn = cuda::FfnPlacement::kHot;
  lu->gate = Host(m.dtype, F, H, L.gate->p);
  lu->up = Host(m.dtype, F, H, L.up->p);
  lu->down_t = Host(L.down_dtype, F, H, L.down_t->p);
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
  lu->down = Host(L.down_dtype, c.hidden_size, c.ffn_size, L.down_t->p);
}

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

double SplitFixedBytes(const SynthModel& m, double scratch) {
  return m.HeadBytes() + m.AllAttnBytes() + m.config.n_layers * m.PredBytes() + scratch;
}

int HotNeuronsInBudget(const SynthModel& m, double budget, double fixed) {
  return std::max(
      0, std::min(m.config.ffn_size, static_cast<int>((budget - fixed) / m.HotNeuronBytes())));
}

cuda::ForwardArgs DecodeStep(const int32_t* token, int pos, cuda::FfnMode mode) {
  cuda::ForwardArgs a;
  a.tokens = token;
  a.n = 1;
  a.pos0 = pos;
  a.mode = mode;
  return a;
}

void AskForPick(cuda::ForwardArgs* a, cuda::GreedyResult* pick) {
  a->logits_mode = cuda::LogitsMode::kGreedy;
  a->greedy = pick;
}

void PrintModel(const BenchOptions& o, const SynthModel& m, double build_s) {
  const ModelConfig& c = m.config;
  std::printf(
      "model: %d layers, hidden %d, ffn %d, heads %d (kv %d), vocab %d, %s: %.2f GB (+ predictors "
      "rank %d: %.2f GB); VRAM budget %.2f GB; built in %.1f s\n",
      c.n_layers, c.hidden_size, c.ffn_size, c.n_heads, c.n_kv_heads, c.vocab_size,
      m.TypeName(true).c_str(), m.ModelBytes() / 1e9, m.pred_rank, c.n_layers * m.PredBytes() / 1e9,
      o.Budget(m.ModelBytes()) / 1e9, build_s);
}

void PrintBandwidths(const char* when, DType dtype, int threads, const Bandwidths& bw) {
  std::printf(
      "bandwidth%s: GPU copy %.0f GB/s, GPU %s matvec %.0f GB/s, CPU %s matvec (%d threads) "
      "%.1f GB/s, host->GPU %.1f GB/s; kernel launch %.2f us host, %.2f us GPU\n",
      when, bw.gpu_copy / 1e9, DTypeName(dtype).data(), bw.gpu_gemv / 1e9, DTypeName(dtype).data(),
      threads, bw.cpu_gemv / 1e9, bw.h2d / 1e9, bw.launch_us, bw.kernel_us);
}

int WithModel(const BenchOptions& o,
              const std::function<int(const SynthModel&, ThreadPool&, int)>& run) {
  const int threads = o.Threads();
  if (!OpenDevice(threads)) return 1;
  ThreadPool pool(threads);
  const double t0 = Now();
  std::unique_ptr<SynthModel> model = BuildModel(o, pool);
  PrintModel(o, *model, Now() - t0);
  return run(*model, pool, threads);
}

}  // namespace pinfer::cudabench
