// Writes a prepared (PWRI) model of any Llama shape with synthetic weights, predictors and
// profile, streamed tensor by tensor, so that the whole service can be started on a 70B shape
// (issue 43: time to the first token, host and GPU memory against the plan) without a 70B
// checkpoint, a day of profiling or twice the file in memory.
//
//   synthetic_pwri --out 70b.gguf --vocab-gguf models/llama2-vocab/llama-2-tiny-random.gguf
//       --layers 80 --hidden 8192 --ffn 28672 --heads 64 --kv-heads 8
//       [--dtype q4_0|q8_0|q4_k|q4_k_m|f16] [--skew 0.2] [--active 0.1] [--rank 128] [--seed 1]
//
// Weights are random blocks of the dtype with values of standard deviation 1/sqrt(hidden) (Q4_K
// with equal sub-block scales and mins that centre them). Norms are ones. The vocabulary and
// tokenizer come from --vocab-gguf, whose token count sets the vocabulary size.
//
// Activation locality by construction, as the benchmarks draw it (bench/cuda/bench_common.h):
// the first `skew` of each layer's neurons fire with probability 0.8 * active / skew, the rest
// with 0.2 * active / (1 - skew). The predictor input (the FFN norm's output) has RMS 1, so
// relu(fc1 x) with fc1 ~ N(0, 1/hidden) has E[h^2] = 1/2 per element, and fc2's row j with
// standard deviation s_j * sqrt(2 / rank) gives scores ~ N(0, s_j^2). With threshold 1, neuron j
// is predicted active with probability P(Z > 1 / s_j): s_j = 1 / z(p_j) sets it to p_j, which is
// also the stored profile's frequency. The neurons are stored hot first, as `pinfer prepare`
// orders them.
#include <chrono>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/flags.h"
#include "shared/model/gguf.h"
#include "shared/model/tensor.h"
#include "shared/sparse/prepared_model.h"
#include "shared/util/half.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

struct Shape {
  int layers, hidden, ffn, heads, kv_heads, vocab, rank;
};

// splitmix64: fast, and each tensor gets its own stream.
struct Rng {
  uint64_t s;
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float Uniform() { return static_cast<float>(Next() >> 40) * (1.f / 16777216.f); }  // [0, 1)
  // Uniform with standard deviation `sd` (sums over hundreds of them are Gaussian enough).
  float Centred(float sd) { return (2.f * Uniform() - 1.f) * sd * 1.7320508f; }
  void Fill(uint8_t* p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const uint64_t v = Next();
      std::memcpy(p + i, &v, 8);
    }
    for (; i < n; ++i) p[i] = static_cast<uint8_t>(Next());
  }
};

// A [rows, cols] matrix of random `type` blocks whose values have standard deviation `sd`.
GgufWriter::Producer RandomMatrix(DType dt, int64_t rows, int64_t cols, float sd, uint64_t seed) {
  return [=]() -> absl::StatusOr<std::string> {
    Rng rng{seed};
    std::string out(rows * RowBytes(dt, cols), '\0');
    uint8_t* p = reinterpret_cast<uint8_t*>(out.data());
    const int64_t n = rows * cols;
    switch (dt) {
      case DType::kF16:
        for (int64_t i = 0; i < n; ++i) {
          const uint16_t h = Fp32ToFp16(rng.Centred(sd));
          std::memcpy(p + 2 * i, &h, 2);
        }
        break;
      case DType::kQ8_0: {  // d * q, q uniform in [-128, 127]: sd 73.9 d
        rng.Fill(p, out.size());
        const uint16_t d = Fp32ToFp16(sd / 73.9f);
        for (int64_t b = 0; b < n / 32; ++b) std::memcpy(p + b * sizeof(BlockQ8_0), &d, 2);
        break;
      }
      case DType::kQ4_0: {  // d * (q - 8), q uniform in [0, 15]: sd 4.61 d
        rng.Fill(p, out.size());
        const uint16_t d = Fp32ToFp16(sd / 4.61f);
        for (int64_t b = 0; b < n / 32; ++b) std::memcpy(p + b * sizeof(BlockQ4_0), &d, 2);
        break;
      }
      case DType::kQ4_K: {  // every scale and min 32: 32 * (d * q - dmin), dmin = 7.5 d
        rng.Fill(p, out.size());
        BlockQ4_K head;
        head.d = Fp32ToFp16(sd / (32 * 4.61f));
        head.dmin = Fp32ToFp16(7.5f * sd / (32 * 4.61f));
        // 6-bit 32 = 0b100000: sub-blocks 0-3 in the low six bits of bytes 0-7, the top two bits
        // of sub-blocks 4-7 in their top bits, and 4-7's low nibbles (zero) in bytes 8-11.
        for (int j = 0; j < 8; ++j) head.scales[j] = 0xA0;
        for (int j = 8; j < 12; ++j) head.scales[j] = 0;
        for (int64_t b = 0; b < n / kSuperBlock; ++b) {
          std::memcpy(p + b * sizeof(BlockQ4_K), &head, offsetof(BlockQ4_K, qs));
        }
        break;
      }
      case DType::kQ5_K: {  // every scale and min 32: 32 * (d * q - dmin), q in 0..31 (sd 9.23)
        rng.Fill(p, out.size());
        BlockQ5_K head;
        head.d = Fp32ToFp16(sd / (32 * 9.23f));
        head.dmin = Fp32ToFp16(15.5f * sd / (32 * 9.23f));
        for (int j = 0; j < 8; ++j) head.scales[j] = 0xA0;  // as Q4_K's
        for (int j = 8; j < 12; ++j) head.scales[j] = 0;
        for (int64_t b = 0; b < n / kSuperBlock; ++b) {
          std::memcpy(p + b * sizeof(BlockQ5_K), &head, offsetof(BlockQ5_K, qh));
        }
        break;
      }
      case DType::kQ6_K: {  // d * 16 * (q - 32), q uniform in 0..63: sd 18.5 * 16 d
        rng.Fill(p, out.size());
        const uint16_t d = Fp32ToFp16(sd / (16 * 18.47f));
        for (int64_t b = 0; b < n / kSuperBlock; ++b) {
          auto* blk = reinterpret_cast<BlockQ6_K*>(p + b * sizeof(BlockQ6_K));
          for (int8_t& sc : blk->scales) sc = 16;
          std::memcpy(&blk->d, &d, 2);
        }
        break;
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat("no random blocks for ", DTypeName(dt)));
    }
    return out;
  };
}

GgufWriter::Producer Ones(int64_t n) {
  return [n]() -> absl::StatusOr<std::string> {
    std::vector<float> v(n, 1.f);
    return std::string(reinterpret_cast<const char*>(v.data()), n * 4);
  };
}

// z with P(Z > z) = p for a standard normal Z (bisection on erfc; p in (0, 1)).
double UpperQuantile(double p) {
  double lo = -10, hi = 10;
  for (int i = 0; i < 100; ++i) {
    const double mid = 0.5 * (lo + hi);
    (0.5 * std::erfc(mid / std::sqrt(2.0)) > p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

// fc2 rows with standard deviations that make neuron j fire with probability freq[j].
GgufWriter::Producer Fc2(const std::vector<float>& freq, int rank, uint64_t seed) {
  return [=]() -> absl::StatusOr<std::string> {
    Rng rng{seed};
    std::string out(freq.size() * rank * 2, '\0');
    const float per_element = std::sqrt(2.f / rank);
    for (size_t j = 0; j < freq.size(); ++j) {
      const float s = static_cast<float>(1.0 / UpperQuantile(freq[j])) * per_element;
      for (int k = 0; k < rank; ++k) {
        const uint16_t h = Fp32ToFp16(rng.Centred(s));
        std::memcpy(out.data() + 2 * (j * rank + k), &h, 2);
      }
    }
    return out;
  };
}

absl::Status Run(const cli::Flags& f) {
  ASSIGN_OR_RETURN(std::string out, f.Required("out"));
  ASSIGN_OR_RETURN(std::string vocab_path, f.Required("vocab-gguf"));
  Shape s;
  ASSIGN_OR_RETURN(int64_t layers, f.Int("layers", 80));
  ASSIGN_OR_RETURN(int64_t hidden, f.Int("hidden", 8192));
  ASSIGN_OR_RETURN(int64_t ffn, f.Int("ffn", 28672));
  ASSIGN_OR_RETURN(int64_t heads, f.Int("heads", 64));
  ASSIGN_OR_RETURN(int64_t kv_heads, f.Int("kv-heads", 8));
  ASSIGN_OR_RETURN(int64_t rank, f.Int("rank", 128));
  ASSIGN_OR_RETURN(int64_t seed, f.Int("seed", 1));
  ASSIGN_OR_RETURN(double skew, f.Double("skew", 0.2));
  ASSIGN_OR_RETURN(double active, f.Double("active", 0.1));
  s = {static_cast<int>(layers), static_cast<int>(hidden), static_cast<int>(ffn),
       static_cast<int>(heads),  static_cast<int>(kv_heads), 0, static_cast<int>(rank)};
  const std::string dtype_name = f.Get("dtype").value_or("q4_0");
  DType type;
  // q4_k_m: Q4_K, with the tensors llama.cpp's Q4_K_M raises (the output head, attn_v and
  // ffn_down of its more-bits layers; KMixTensorType, as `pinfer convert` types them). The
  // prepared file's ffn_down_t takes ffn_down's type, as `pinfer prepare` stores it.
  const bool q4_k_m = dtype_name == "q4_k_m";
  if (dtype_name == "q4_0") {
    type = DType::kQ4_0;
  } else if (dtype_name == "q8_0") {
    type = DType::kQ8_0;
  } else if (dtype_name == "q4_k" || q4_k_m) {
    type = DType::kQ4_K;
  } else if (dtype_name == "f16") {
    type = DType::kF16;
  } else {
    return absl::InvalidArgumentError("--dtype must be q4_0, q8_0, q4_k, q4_k_m or f16");
  }
  const int block = BlockElems(type);
  if (s.layers < 1 || s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads != 0 ||
      s.hidden % s.heads != 0 || s.hidden % block != 0 || s.ffn % block != 0 || s.rank < 1) {
    return absl::InvalidArgumentError("inconsistent shape");
  }
  const double p_hot = 0.8 * active / skew, p_cold = 0.2 * active / (1 - skew);
  if (!(skew > 0 && skew < 1 && p_hot < 1 && p_cold > 0)) {
    return absl::InvalidArgumentError("--skew and --active give no valid probabilities");
  }

  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> vocab, GgufFile::Open(vocab_path));
  GgufWriter w(kPowerInferMagic);
  for (const GgufKeyValue& kv : vocab->metadata()) {
    if (kv.key.rfind("tokenizer.", 0) == 0) w.SetValue(kv.key, kv.value);
    if (kv.key == "tokenizer.ggml.tokens") s.vocab = static_cast<int>(kv.value.array.count);
  }
  if (s.vocab == 0) return absl::InvalidArgumentError(vocab_path + " has no tokenizer.ggml.tokens");
  const int head_dim = s.hidden / s.heads, kv_dim = head_dim * s.kv_heads;
  w.SetString("general.architecture", "llama");
  w.SetString("general.name", absl::StrCat("synthetic ", s.layers, "-layer ", dtype_name));
  w.SetString("pinfer.hidden_act", "relu");
  w.SetU32("llama.context_length", 4096);
  w.SetU32("llama.embedding_length", s.hidden);
  w.SetU32("llama.block_count", s.layers);
  w.SetU32("llama.feed_forward_length", s.ffn);
  w.SetU32("llama.attention.head_count", s.heads);
  w.SetU32("llama.attention.head_count_kv", s.kv_heads);
  w.SetU32("llama.rope.dimension_count", head_dim);
  w.SetF32("llama.rope.freq_base", 10000.f);
  w.SetF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  // The predictors' scores are compared with 1 (see the top of the file).
  w.SetF32(kSparseThresholdKey, 1.f);
  w.SetF32Array("pinfer.sparse.thresholds", std::vector<float>(s.layers, 1.f));
  w.SetString(kPredictorInputKey, "ffn_norm");
  w.SetU64("pinfer.sparse.profile_tokens", 1000000);
  std::vector<float> freq(s.ffn);
  const int hot = static_cast<int>(std::lround(skew * s.ffn));
  for (int j = 0; j < s.ffn; ++j) freq[j] = static_cast<float>(j < hot ? p_hot : p_cold);
  for (int l = 0; l < s.layers; ++l) {
    w.SetF32Array(absl::StrCat("pinfer.sparse.blk.", l, ".activation_frequency"), freq);
  }

  const float sd = 1.f / std::sqrt(static_cast<float>(s.hidden));
  uint64_t stream = static_cast<uint64_t>(seed) << 32;
  // The type of `gguf_name` (rows of `cols` values in the source model): `type`, or the mix's.
  auto type_of = [&](const std::string& gguf_name, int64_t cols) -> absl::StatusOr<DType> {
    if (!q4_k_m) return type;
    const bool is_70b = s.layers == 80 && s.heads != s.kv_heads;
    const GgmlType g = KMixTensorType(KQuantMix::kQ4_K_M, gguf_name, cols, s.layers,
                                      gguf_name == "output.weight", is_70b);
    return DTypeFromGgmlType(static_cast<uint32_t>(g));
  };
  auto matrix = [&](const std::string& name, DType t, int64_t rows, int64_t cols,
                    float value_sd) -> absl::Status {
    ASSIGN_OR_RETURN(GgmlType gt, GgmlTypeFromDType(t));
    return w.AddTensor(name, gt, {rows, cols}, RandomMatrix(t, rows, cols, value_sd, ++stream));
  };
  std::string types_used;  // the mix, for the summary line
  RETURN_IF_ERROR(matrix("token_embd.weight", type, s.vocab, s.hidden, sd));
  RETURN_IF_ERROR(w.AddTensor("output_norm.weight", GgmlType::kF32, {s.hidden}, Ones(s.hidden)));
  ASSIGN_OR_RETURN(DType out_type, type_of("output.weight", s.hidden));
  RETURN_IF_ERROR(matrix("output.weight", out_type, s.vocab, s.hidden, sd));
  int raised_v = 0, raised_down = 0;
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    RETURN_IF_ERROR(w.AddTensor(p + "attn_norm.weight", GgmlType::kF32, {s.hidden}, Ones(s.hidden)));
    RETURN_IF_ERROR(matrix(p + "attn_q.weight", type, s.hidden, s.hidden, sd));
    RETURN_IF_ERROR(matrix(p + "attn_k.weight", type, kv_dim, s.hidden, sd));
    ASSIGN_OR_RETURN(DType v_type, type_of(p + "attn_v.weight", s.hidden));
    ASSIGN_OR_RETURN(DType down_type, type_of(p + "ffn_down.weight", s.ffn));
    raised_v += v_type != type;
    raised_down += down_type != type;
    RETURN_IF_ERROR(matrix(p + "attn_v.weight", v_type, kv_dim, s.hidden, sd));
    RETURN_IF_ERROR(matrix(p + "attn_output.weight", type, s.hidden, s.hidden, sd));
    RETURN_IF_ERROR(w.AddTensor(p + "ffn_norm.weight", GgmlType::kF32, {s.hidden}, Ones(s.hidden)));
    RETURN_IF_ERROR(matrix(p + "ffn_gate.weight", type, s.ffn, s.hidden, sd));
    RETURN_IF_ERROR(matrix(p + "ffn_up.weight", type, s.ffn, s.hidden, sd));
    // A neuron's down column, stored as a row: [ffn, hidden], values of sd 1/sqrt(ffn).
    RETURN_IF_ERROR(matrix(p + "ffn_down_t.weight", down_type, s.ffn, s.hidden,
                           1.f / std::sqrt(static_cast<float>(s.ffn))));
    RETURN_IF_ERROR(matrix(p + "fc1.weight", DType::kF16, s.rank, s.hidden, sd));
    RETURN_IF_ERROR(w.AddTensor(p + "fc2.weight", GgmlType::kF16, {s.ffn, s.rank},
                                Fc2(freq, s.rank, ++stream)));
  }
  const auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(w.WriteFile(out));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto written = GgufFile::Open(out, {kPowerInferMagic});
  if (!written.ok()) return written.status();
  uint64_t bytes = 0;
  for (const GgufTensorInfo& t : (*written)->tensors()) bytes += t.nbytes;
  if (q4_k_m) {
    types_used = absl::StrCat(" (output ", DTypeName(out_type), ", attn_v raised in ", raised_v,
                              " layers, ffn_down_t in ", raised_down, ")");
  }
  std::printf(
      "wrote %s: %d layers, hidden %d, ffn %d, %d/%d heads, vocab %d, %s%s, %.2f GB of "
      "tensors in %.1f s; neurons: %d of %d per layer fire with p %.3f, the rest %.4f\n",
      out.c_str(), s.layers, s.hidden, s.ffn, s.heads, s.kv_heads, s.vocab, dtype_name.c_str(),
      types_used.c_str(), bytes * 1e-9, secs, hot, s.ffn, p_hot, p_cold);
  return absl::OkStatus();
}

}  // namespace
}  // namespace pinfer

int main(int argc, char** argv) {
  auto f = pinfer::cli::Flags::Parse(
      std::vector<std::string>(argv + 1, argv + argc),
      {"out", "vocab-gguf", "layers", "hidden", "ffn", "heads", "kv-heads", "rank", "seed", "skew",
       "active", "dtype"},
      {});
  if (!f.ok()) {
    std::fprintf(stderr, "%s\n", std::string(f.status().message()).c_str());
    return 2;
  }
  absl::Status st = pinfer::Run(*f);
  if (!st.ok()) {
    std::fprintf(stderr, "synthetic_pwri: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
