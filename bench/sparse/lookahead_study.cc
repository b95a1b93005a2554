// Study: how well the module's guess (pinfer-gpu-worker --cold-guess) predicts a layer's FFN
// active set before the layer's attention, so that the cold side can load the guessed cold rows
// meanwhile (pinfer-cpu-worker --prefetch-guess). The guess is (d): layer l's own predictor
// applied to layer l - 1's FFN input (its residual after its attention), re-weighted to layer
// l's ffn_norm, which the GPU computes beside layer l - 1's FFN; it is compared with (a), the
// same predictor on layer l's FFN input, where it runs in the product. Per layer, on held-out
// tokens of relu-llama-tiny: (a)'s recall and selection, (d) at (a)'s magnitude recall, the guess's
// size by the module's rule (one shift on (a)'s thresholds) at 90% and 95% of (a)'s neurons, what
// a load window shorter than the guess holds by load order (ascending, first tier, ranked), what
// the first tier holds (the 13B-shape bench's COLD_AHEAD_TIER=A:B), and how far attention turns
// the residual (the cosine before / after). Prints Markdown tables and the command.
//
// (a) is trained with TrainPredictors' own steps (shared/sparse/predictor_fit.h): the closed-form
// start (the reduced-rank regression of the contribution-weighted gate, exactly linear in the FFN
// input), the same Adam fine-tuning on the same contribution-weighted BCE
// (PredictorTrainingOptions' defaults), weights rounded to F16 as stored, and the same
// per-neuron threshold rule: one cut lambda on log(sigmoid(score)) + log(m_j) that keeps
// `target` (0.96) of the activation magnitude on held-back pairs (the last 10% of the training
// tokens), neuron j's threshold on the score being logit(exp(lambda) / m_j). It is also trained
// with the library's TrainPredictors as a check on this program's use of the steps
// (library_check=1). Targets are always the true activations: relu(gate . ffn_input) > 0,
// weighted by the contribution relu(g) * |up| * |down column| as predictor_training.cc weighs
// them. (A lookahead predictor trained on the layer input, (a)'s predictor on the layer input
// and the previous token's active set were measured here and dropped: git show
// 3f81f74:bench/sparse/lookahead_study.cc.)
//
// usage: lookahead_study MODEL_DIR [key=value ...]
//   calibration=PATH (MODEL_DIR/calibration.txt) heldout=PATH (MODEL_DIR/heldout-tokens.u32)
//   rank=128 train_tokens=49152 eval_tokens=8192 epochs=6 target=0.96 threads=2 library_check=1
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "shared/engine/transformer.h"
#include "shared/sparse/predictor_fit.h"
#include "shared/sparse/predictor_training.h"
#include "shared/sparse/profiler.h"
#include "shared/util/half.h"
#include "shared/util/mapped_file.h"

using namespace pinfer;

namespace {

constexpr int kWindow = 512;

std::vector<float> ToFloat(const TensorView& t) {
  std::vector<float> v(t.numel());
  DequantizeRow(t.dtype, t.data, v.data(), t.numel());
  return v;
}

void AppendFp16(const float* x, size_t n, std::vector<uint16_t>* dst) {
  const size_t at = dst->size();
  dst->resize(at + n);
  for (size_t i = 0; i < n; ++i) (*dst)[at + i] = Fp32ToFp16(std::clamp(x[i], -65504.f, 65504.f));
}

// Per layer and token, stored as fp16 like the profiler's samples: [layer][n * hidden].
struct Recorded {
  int64_t n = 0;
  std::vector<std::vector<uint16_t>> layer_in;  // RmsNorm(residual before attention) * attn_norm
  std::vector<std::vector<uint16_t>> ffn_in;    // RmsNorm(residual after attention) * ffn_norm
};

// The dense FFN (DenseFfn) that also records the FFN input of its layer and the next layer's
// normalized input (this layer's residual + FFN output, through the next attn_norm).
class RecordingFfn : public FfnBlock {
 public:
  RecordingFfn(const Model& model, const CpuOps& ops, Recorded* rec)
      : model_(model), ops_(ops), dense_(model, ops), rec_(rec) {
    for (const LayerWeights& L : model.layers) attn_norm_.push_back(ToFloat(L.attn_norm));
  }
  absl::Status Forward(int layer, const float* x, int n, float* out) override {
    return dense_.Forward(layer, x, n, out);
  }
  absl::Status ForwardFromResidual(int layer, const float* residual, const float* x, int n,
                                   float* out) override {
    const ModelConfig& c = model_.config;
    const size_t nh = static_cast<size_t>(n) * c.hidden_size;
    if (absl::Status st = dense_.Forward(layer, x, n, out); !st.ok()) return st;
    AppendFp16(x, nh, &rec_->ffn_in[layer]);
    if (layer + 1 < c.n_layers) {
      next_.resize(nh);
      norm_.resize(nh);
      for (size_t i = 0; i < nh; ++i) next_[i] = residual[i] + out[i];
      ops_.RmsNorm(next_.data(), attn_norm_[layer + 1].data(), n, c.hidden_size, c.norm_eps,
                   norm_.data());
      AppendFp16(norm_.data(), nh, &rec_->layer_in[layer + 1]);
    }
    return absl::OkStatus();
  }
  const std::vector<float>& attn_norm(int layer) const { return attn_norm_[layer]; }

 private:
  const Model& model_;
  const CpuOps& ops_;
  DenseFfn dense_;
  Recorded* rec_;
  std::vector<std::vector<float>> attn_norm_;
  std::vector<float> next_, norm_;
};

// Runs whole windows of `tokens` (fresh KV cache each, as the profiler does) and records.
absl::StatusOr<Recorded> Record(const Model& m, const CpuOps& ops,
                                std::span<const int32_t> tokens) {
  const ModelConfig& c = m.config;
  const int H = c.hidden_size;
  Recorded rec;
  rec.layer_in.resize(c.n_layers);
  rec.ffn_in.resize(c.n_layers);
  RecordingFfn ffn(m, ops, &rec);
  Transformer tr(m, ops);
  tr.set_ffn(&ffn);
  KvCache cache(c, kWindow);
  std::vector<float> emb(static_cast<size_t>(kWindow) * H), norm(emb.size());
  for (size_t w = 0; w + kWindow <= tokens.size(); w += kWindow) {
    std::span<const int32_t> win = tokens.subspan(w, kWindow);
    // Layer 0's input is the token embedding.
    for (int t = 0; t < kWindow; ++t) {
      DequantizeRow(m.tok_embeddings.dtype, m.tok_embeddings.row(win[t]), &emb[t * H], H);
    }
    ops.RmsNorm(emb.data(), ffn.attn_norm(0).data(), kWindow, H, c.norm_eps, norm.data());
    AppendFp16(norm.data(), norm.size(), &rec.layer_in[0]);
    absl::Status st = tr.Forward(win, 0, &cache, LogitsMode::kNone, nullptr);
    if (!st.ok()) return st;
    rec.n += kWindow;
  }
  return rec;
}

// ---- Training: predictor_fit.h's steps (the library's own). ----

// The targets of one layer (from the FFN input through the real gate/up/down). Rows: the n_cal
// calibration tokens (the first n_train trained on, the rest held back for the threshold), then the
// evaluation tokens.
struct Targets : FfnTargets {
  int64_t n_train = 0, n_cal = 0, n_all = 0;
};

Targets ComputeTargets(const Model& model, const CpuOps& ops, int layer, const float* ffn_x,
                       int64_t n_train, int64_t n_cal, int64_t n_all) {
  Targets d;
  static_cast<FfnTargets&>(d) =
      ComputeFfnTargets(model, ops, layer, ffn_x, n_all, n_train, /*keep_gate=*/true);
  d.n_train = n_train;
  d.n_cal = n_cal;
  d.n_all = n_all;
  return d;
}

struct Mlp {
  int r = 0;
  std::vector<float> w1, w2;  // [r, H], [F, r]
};

void RoundF16(std::vector<float>& w) {
  for (float& v : w) v = Fp16ToFp32(Fp32ToFp16(v));
}

// s: [n, F] = fc2 relu(fc1 x) for rows [begin, end) of x.
std::vector<float> Scores(const CpuOps& ops, const Mlp& m, int H, int F, const float* x,
                          int64_t begin, int64_t end) {
  const int64_t n = end - begin;
  std::vector<float> s(static_cast<size_t>(n) * F), z;
  constexpr int kChunk = 512;
  z.resize(static_cast<size_t>(kChunk) * m.r);
  for (int64_t b0 = 0; b0 < n; b0 += kChunk) {
    const int nb = static_cast<int>(std::min<int64_t>(kChunk, n - b0));
    MatMulF32(ops, m.w1.data(), m.r, H, x + (begin + b0) * H, nb, z.data());
    for (size_t i = 0; i < static_cast<size_t>(nb) * m.r; ++i) z[i] = std::max(z[i], 0.f);
    MatMulF32(ops, m.w2.data(), F, m.r, z.data(), nb, s.data() + b0 * F);
  }
  return s;
}

inline float LogSigmoid(float sc) {
  return sc >= 0 ? -std::log1p(std::exp(-sc)) : sc - std::log1p(std::exp(sc));
}

// Neuron j's threshold on its score for the cut lambda on log(sigmoid(s)) + log(m_j), clamped as
// FoldPerNeuronThresholds clamps it.
std::vector<float> NeuronThresholds(const Targets& d, double lambda) {
  const int F = static_cast<int>(d.mean_active_importance.size());
  std::vector<float> thr(F);
  for (int j = 0; j < F; ++j) {
    const double log_m = std::log(std::max(d.mean_active_importance[j], 1e-30f));
    if (!std::isfinite(lambda)) {
      thr[j] = lambda > 0 ? 1e30f : -1e30f;
      continue;
    }
    const double q = std::exp(lambda - log_m);
    thr[j] = q >= 0.499 ? -0.004f : static_cast<float>(std::log(q / (1 - q)));
  }
  return thr;
}

// The cut that keeps `target` of the magnitude on rows [begin, end) (scores s over those rows).
double CalibrateLambda(const Targets& d, const std::vector<float>& s, int64_t begin, int64_t end,
                       int F, double target) {
  std::vector<float> log_m(F);
  for (int j = 0; j < F; ++j) log_m[j] = std::log(std::max(d.mean_active_importance[j], 1e-30f));
  std::vector<std::pair<float, float>> active;
  for (int64_t t = begin; t < end; ++t) {
    const float* imp = d.importance.data() + t * F;
    const float* st = s.data() + (t - begin) * F;
    for (int j = 0; j < F; ++j) {
      if (imp[j] > 0) active.emplace_back(LogSigmoid(st[j]) + log_m[j], imp[j]);
    }
  }
  return ThresholdForWeightedRecall(std::move(active), target);
}

struct Metrics {
  double recall = 0, magnitude_recall = 0, precision = 0, predicted = 0, active = 0;
};

// Recall, precision and selected fraction over the evaluation rows [begin, end) for the
// selection s >= thr[j] (scores s over those rows).
Metrics Measure(const Targets& d, const std::vector<float>& s, int64_t begin, int64_t end, int F,
                const std::vector<float>& thr) {
  int64_t selected = 0, hits = 0, n_active = 0;
  double mag_total = 0, mag_hit = 0;
  for (int64_t t = begin; t < end; ++t) {
    const float* imp = d.importance.data() + t * F;
    for (int j = 0; j < F; ++j) {
      const bool sel = s[(t - begin) * F + j] >= thr[j];
      selected += sel;
      if (imp[j] > 0) {
        ++n_active;
        mag_total += imp[j];
        if (sel) {
          ++hits;
          mag_hit += imp[j];
        }
      }
    }
  }
  const double pairs = static_cast<double>(end - begin) * F;
  Metrics m;
  m.recall = n_active ? static_cast<double>(hits) / n_active : 1.0;
  m.magnitude_recall = mag_total > 0 ? mag_hit / mag_total : 1.0;
  m.precision = selected ? static_cast<double>(hits) / selected : 1.0;
  m.predicted = selected / pairs;
  m.active = n_active / pairs;
  return m;
}

// The module's rule (gpu-worker/cuda ModelUpload::cold_guess): a guess scored sg holds neuron j
// when sg >= thr[j] - shift, one shift for the layer. Returns the guess's size over the size of
// (a)'s selection (scores sa, thresholds thr) at the smallest shift whose guess holds `share` of
// the neurons (a) selects, counted over the rows (each neuron's rows are the same bytes, so this
// is the share of (a)'s cold rows a cold side could have loaded ahead).
double GuessSizeForShare(const std::vector<float>& sa, const std::vector<float>& sg,
                         const std::vector<float>& thr, int64_t rows, int F, double share,
                         double* shift_out = nullptr) {
  auto count = [&](double shift, int64_t* held, int64_t* guessed) {
    int64_t h = 0, g = 0;
    for (int64_t t = 0; t < rows; ++t) {
      const float* a = sa.data() + t * F;
      const float* b = sg.data() + t * F;
      for (int j = 0; j < F; ++j) {
        const bool in_guess = b[j] >= thr[j] - shift;
        g += in_guess;
        h += in_guess && a[j] >= thr[j];
      }
    }
    *held = h;
    *guessed = g;
  };
  int64_t actual = 0;
  for (int64_t t = 0; t < rows; ++t) {
    for (int j = 0; j < F; ++j) actual += sa[t * F + j] >= thr[j];
  }
  if (actual == 0) return 0;
  double lo = -50, hi = 50;  // held grows with the shift
  for (int it = 0; it < 40; ++it) {
    const double mid = 0.5 * (lo + hi);
    int64_t held = 0, guessed = 0;
    count(mid, &held, &guessed);
    (static_cast<double>(held) >= share * actual ? hi : lo) = mid;
  }
  int64_t held = 0, guessed = 0;
  count(hi, &held, &guessed);
  if (shift_out != nullptr) *shift_out = hi;
  return static_cast<double>(guessed) / actual;
}

// A cold side loads a layer's guessed rows until the layer's input arrives, which may come
// before the whole guess is loaded. For a guess by the module's rule at `shift`: the share of
// the neurons (a) selects that are among the loads when the window holds `window` times (a)'s
// mean selection per token, the guess split into kParts equal parts in ascending order as
// PartialFfn::Prefetch splits it (each part loading as many), for three orders within a part:
// ascending ids (the product before its guess had a first tier), the neurons the predictor
// selects on the guess's own input (sg >= thr) first ("tiers", what the product does now), and
// by the margin sg - thr, highest first ("ranked"). Also what the first tier holds, for the
// 13B-shape bench's drawn tiers (cuda_decode_bench's COLD_AHEAD_TIER=A:B): the share A of the
// guessed neurons that (a) selects which are in the first tier, and the share B of the other
// guessed neurons.
struct LoadShares {
  double ascending = 0, tiers = 0, ranked = 0;
  double tier_selected = 0, tier_other = 0;  // A and B
};
LoadShares LoadsInWindow(const std::vector<float>& sa, const std::vector<float>& sg,
                         const std::vector<float>& thr, int64_t rows, int F, double shift,
                         double window) {
  constexpr int kParts = 16;
  int64_t actual = 0;
  for (int64_t t = 0; t < rows; ++t) {
    for (int j = 0; j < F; ++j) actual += sa[t * F + j] >= thr[j];
  }
  if (actual == 0) return {};
  const int per_part = std::max<int>(
      1, static_cast<int>(std::lround(window * static_cast<double>(actual) / rows / kParts)));
  int64_t hits[3] = {0, 0, 0};
  int64_t guessed_selected = 0, guessed_other = 0, tier_selected = 0, tier_other = 0;
  std::vector<int> guess;
  std::vector<std::pair<float, int>> keyed;
  for (int64_t t = 0; t < rows; ++t) {
    const float* a = sa.data() + t * F;
    const float* b = sg.data() + t * F;
    guess.clear();
    for (int j = 0; j < F; ++j) {
      if (b[j] < thr[j] - shift) continue;
      guess.push_back(j);
      const bool selected = a[j] >= thr[j], in_tier = b[j] >= thr[j];
      (selected ? guessed_selected : guessed_other) += 1;
      if (in_tier) (selected ? tier_selected : tier_other) += 1;
    }
    const int n = static_cast<int>(guess.size());
    for (int p = 0; p < kParts; ++p) {
      const int i0 = static_cast<int>(static_cast<int64_t>(n) * p / kParts);
      const int i1 = static_cast<int>(static_cast<int64_t>(n) * (p + 1) / kParts);
      for (int order = 0; order < 3; ++order) {
        keyed.clear();
        for (int i = i0; i < i1; ++i) {
          const int j = guess[i];
          const float margin = b[j] - thr[j];
          keyed.emplace_back(order == 0 ? 0.f : order == 1 ? (margin >= 0 ? 1.f : 0.f) : margin, j);
        }
        std::stable_sort(keyed.begin(), keyed.end(),
                         [](const auto& x, const auto& y) { return x.first > y.first; });
        const int k = std::min(per_part, static_cast<int>(keyed.size()));
        for (int i = 0; i < k; ++i) hits[order] += a[keyed[i].second] >= thr[keyed[i].second];
      }
    }
  }
  const double n = static_cast<double>(actual);
  return {hits[0] / n, hits[1] / n, hits[2] / n,
          static_cast<double>(tier_selected) / std::max<int64_t>(1, guessed_selected),
          static_cast<double>(tier_other) / std::max<int64_t>(1, guessed_other)};
}

// The largest cut lambda at which scores s reach magnitude recall `target` over the evaluation
// rows [begin, end), by bisection. Magnitude recall falls as the cut rises: about 1 at the low
// end; at the high end every threshold is at its clamp (-0.004), the least this threshold family
// selects.
double CutForMagnitudeRecall(const Targets& d, const std::vector<float>& s, int64_t begin,
                             int64_t end, int F, double target) {
  double lo = -200, hi = 50;
  for (int it = 0; it < 60; ++it) {
    const double mid = 0.5 * (lo + hi);
    const Metrics mm = Measure(d, s, begin, end, F, NeuronThresholds(d, mid));
    (mm.magnitude_recall >= target ? lo : hi) = mid;
  }
  return lo;
}

// (a)'s predictor on the guess's features: at (a)'s magnitude recall, and the guess sizes by the
// module's rule.
struct Guess {
  Metrics matched;
  double size90 = 0, size95 = 0;
  LoadShares loads_half, loads_one;  // at the 95% shift, windows of 0.5x and 1x (a)'s selection
};

struct Trained {
  Mlp mlp;
  double lambda = 0;  // calibrated on the held-back calibration rows
};

// (a): the gate wg is exactly linear in the FFN input x, so the closed-form start has no residual.
Trained Train(const CpuOps& ops, const Targets& d, const float* x, const std::vector<float>& wg,
              int H, int F, int layer, const PredictorTrainingOptions& o, int rank) {
  const std::vector<float> s2 = SecondMoment(ops, x, d.n_train, H);
  Trained t;
  t.mlp.r = 2 * (rank / 2);
  ClosedFormPredictor(wg, &d.unit_contribution, s2, nullptr, H, F, rank,
                      o.seed + 7919 * layer + rank, &t.mlp.w1, &t.mlp.w2);
  if (o.epochs > 0) {
    FineTunePredictor(ops, x, d.importance.data(), d.mean_positive_importance, d.n_train, H, F,
                      t.mlp.r, o, o.seed + 31 * layer + rank, &t.mlp.w1, &t.mlp.w2);
  }
  RoundF16(t.mlp.w1);
  RoundF16(t.mlp.w2);
  const std::vector<float> s = Scores(ops, t.mlp, H, F, x, d.n_train, d.n_cal);
  t.lambda = CalibrateLambda(d, s, d.n_train, d.n_cal, F, o.target_recall);
  return t;
}

std::vector<float> ToF32(const std::vector<uint16_t>& h) {
  std::vector<float> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) out[i] = Fp16ToFp32(h[i]);
  return out;
}

struct LayerResult {
  Metrics std_pred, lib_pred;
  Guess early;  // (d): on the previous layer's FFN input (layers > 0)
  double seconds = 0;
  double cosine = 0;  // mean cos(residual before attention, residual after), evaluation tokens
  bool has_lib = false;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [key=value...]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::map<std::string, std::string> kv;
  for (int i = 2; i < argc; ++i) {
    std::vector<std::string> p = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    kv[p[0]] = p.size() > 1 ? p[1] : "";
  }
  auto num = [&](const std::string& k, double def) {
    double v = def;
    if (kv.count(k) && !absl::SimpleAtod(kv[k], &v)) {
      std::fprintf(stderr, "bad value for %s\n", k.c_str());
      std::exit(2);
    }
    return v;
  };
  auto str = [&](const std::string& k, const std::string& def) {
    return kv.count(k) ? kv[k] : def;
  };
  const int rank = static_cast<int>(num("rank", 128));
  const int64_t train_tokens = static_cast<int64_t>(num("train_tokens", 49152));
  const int64_t eval_tokens = static_cast<int64_t>(num("eval_tokens", 8192));
  const bool library_check = num("library_check", 1) != 0;
  PredictorTrainingOptions o;
  o.epochs = static_cast<int>(num("epochs", o.epochs));
  o.target_recall = num("target", o.target_recall);

  auto model = LoadModel(dir);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const Model& m = **model;
  const ModelConfig& c = m.config;
  const int H = c.hidden_size, F = c.ffn_size;
  ThreadPool pool(static_cast<int>(num("threads", 2)));
  auto ops = NewSimdOps(&pool);

  auto text = ReadFileToString(str("calibration", dir + "/calibration.txt"));
  auto heldout = ReadFileToString(str("heldout", dir + "/heldout-tokens.u32"));
  if (!text.ok() || !heldout.ok()) {
    std::fprintf(stderr, "cannot read the calibration text or the held-out tokens\n");
    return 1;
  }
  auto cal_ids = TokenizeCalibrationText(m, *text);
  if (!cal_ids.ok()) {
    std::fprintf(stderr, "%s\n", cal_ids.status().ToString().c_str());
    return 1;
  }
  std::vector<int32_t> ev_ids(heldout->size() / 4);
  std::memcpy(ev_ids.data(), heldout->data(), ev_ids.size() * 4);
  const int64_t n_cal_tok = std::min<int64_t>(train_tokens, cal_ids->size()) / kWindow * kWindow;
  const int64_t n_ev_tok = std::min<int64_t>(eval_tokens, ev_ids.size()) / kWindow * kWindow;
  if (n_cal_tok == 0 || n_ev_tok == 0) {
    std::fprintf(stderr, "need at least one window of %d tokens of each\n", kWindow);
    return 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto cal = Record(m, *ops, std::span<const int32_t>(*cal_ids).first(n_cal_tok));
  auto ev = Record(m, *ops, std::span<const int32_t>(ev_ids).first(n_ev_tok));
  if (!cal.ok() || !ev.ok()) {
    std::fprintf(stderr, "forward pass failed\n");
    return 1;
  }
  std::fprintf(stderr,
               "recorded %lld calibration tokens (of %zu) and %lld held-out tokens in %.1f s; "
               "rank %d, %d epochs, target magnitude recall %.2f\n",
               static_cast<long long>(cal->n), cal_ids->size(), static_cast<long long>(ev->n),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), rank,
               o.epochs, o.target_recall);

  const int64_t n_cal = cal->n;
  const int64_t n_hold = std::max<int64_t>(1, static_cast<int64_t>(n_cal * o.holdout_fraction));
  const int64_t n_train = n_cal - n_hold, n_all = n_cal + ev->n;
  std::vector<LayerResult> results;
  std::vector<float> prev_eval, prev_wf;  // the previous layer's evaluation FFN inputs, ffn_norm
  for (int l = 0; l < c.n_layers; ++l) {
    const auto tl = std::chrono::steady_clock::now();
    LayerResult res;
    // Rows: calibration then evaluation; the layer input for the cosine only.
    std::vector<float> ffn_x = ToF32(cal->ffn_in[l]), lay_x = ToF32(cal->layer_in[l]);
    {
      const std::vector<float> a = ToF32(ev->ffn_in[l]), b = ToF32(ev->layer_in[l]);
      ffn_x.insert(ffn_x.end(), a.begin(), a.end());
      lay_x.insert(lay_x.end(), b.begin(), b.end());
    }
    const Targets d = ComputeTargets(m, *ops, l, ffn_x.data(), n_train, n_cal, n_all);

    // (a) standard: the gate is exactly linear in the FFN input.
    const std::vector<float> wg = ToFloat(m.layers[l].gate);
    const Trained a = Train(*ops, d, ffn_x.data(), wg, H, F, l, o, rank);
    const std::vector<float> sa = Scores(*ops, a.mlp, H, F, ffn_x.data(), n_cal, n_all);
    const std::vector<float> thr_a = NeuronThresholds(d, a.lambda);
    res.std_pred = Measure(d, sa, n_cal, n_all, F, thr_a);

    // (a)'s predictor on the evaluation rows of other features x: [n_all - n_cal, H].
    auto guess = [&](const std::vector<float>& x) {
      Guess r;
      const std::vector<float> sc = Scores(*ops, a.mlp, H, F, x.data(), 0, n_all - n_cal);
      const double cut =
          CutForMagnitudeRecall(d, sc, n_cal, n_all, F, res.std_pred.magnitude_recall);
      r.matched = Measure(d, sc, n_cal, n_all, F, NeuronThresholds(d, cut));
      r.size90 = GuessSizeForShare(sa, sc, thr_a, n_all - n_cal, F, 0.90);
      double shift95 = 0;
      r.size95 = GuessSizeForShare(sa, sc, thr_a, n_all - n_cal, F, 0.95, &shift95);
      r.loads_half = LoadsInWindow(sa, sc, thr_a, n_all - n_cal, F, shift95, 0.5);
      r.loads_one = LoadsInWindow(sa, sc, thr_a, n_all - n_cal, F, shift95, 1.0);
      return r;
    };
    // (d): (a)'s predictor on the previous layer's FFN input (its residual after
    // its attention, before its FFN), re-weighted to this layer's ffn_norm: what a GPU can
    // compute beside the previous layer's FFN.
    if (l > 0) {
      const std::vector<float> wf = ToFloat(m.layers[l].ffn_norm);
      std::vector<float> early_x(prev_eval.size());
      for (size_t i = 0; i < early_x.size(); ++i) {
        const size_t h = i % H;
        early_x[i] = prev_wf[h] == 0 ? 0 : prev_eval[i] / prev_wf[h] * wf[h];
      }
      res.early = guess(early_x);
    }
    prev_eval = ToF32(ev->ffn_in[l]);
    prev_wf = ToFloat(m.layers[l].ffn_norm);
    {
      // How far attention turns the residual: undo the two norms' weights (both vectors then
      // have unit RMS up to the norm's own scale) and average the cosine over tokens.
      const std::vector<float> wa = ToFloat(m.layers[l].attn_norm);
      const std::vector<float> wf = ToFloat(m.layers[l].ffn_norm);
      double sum = 0;
      for (int64_t t = n_cal; t < n_all; ++t) {
        double ab = 0, aa = 0, bb = 0;
        for (int h = 0; h < H; ++h) {
          if (wa[h] == 0 || wf[h] == 0) continue;
          const double x = lay_x[t * H + h] / wa[h], y = ffn_x[t * H + h] / wf[h];
          ab += x * y;
          aa += x * x;
          bb += y * y;
        }
        sum += ab / std::sqrt(std::max(aa * bb, 1e-30));
      }
      res.cosine = sum / (n_all - n_cal);
    }

    if (library_check) {
      FfnSamples samples;
      samples.hidden = H;
      samples.count = n_cal;
      samples.inputs.resize(c.n_layers);
      samples.inputs[l] = cal->ffn_in[l];
      PredictorTrainingOptions lo = o;
      lo.ranks = {rank};
      lo.min_sparsity = 0;
      lo.layers = {l};
      auto lib = TrainPredictors(m, *ops, samples, lo);
      if (!lib.ok()) {
        std::fprintf(stderr, "%s\n", lib.status().ToString().c_str());
        return 1;
      }
      const LayerPredictor& p = lib->predictors.layers[l];
      const int r = static_cast<int>(p.fc1.rows());
      std::vector<float> z(static_cast<size_t>(ev->n) * r), s(static_cast<size_t>(ev->n) * F);
      ops->MatMul(p.fc1, ffn_x.data() + n_cal * H, static_cast<int>(ev->n), z.data());
      for (float& v : z) v = std::max(v, 0.f);
      ops->MatMul(p.fc2, z.data(), static_cast<int>(ev->n), s.data());
      res.lib_pred = Measure(d, s, n_cal, n_all, F, std::vector<float>(F, p.threshold));
      res.has_lib = true;
    }
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - tl).count();
    auto line = [&](const char* name, const Metrics& x) {
      std::fprintf(stderr,
                   "layer %d %-22s recall %.3f  magnitude %.4f  precision %.3f  predicted %.3f "
                   "(active %.3f)\n",
                   l, name, x.recall, x.magnitude_recall, x.precision, x.predicted, x.active);
    };
    line("(a) standard", res.std_pred);
    if (res.has_lib) line("(a) library check", res.lib_pred);
    if (l > 0) line("(d) prev. FFN input matched", res.early.matched);
    std::fprintf(stderr, "layer %d: cos(residual before, after attention) %.3f; done in %.1f s\n",
                 l, res.cosine, res.seconds);
    results.push_back(res);
  }

  // Markdown tables, per layer.
  std::printf("command:");
  for (int i = 0; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf(
      "\n\nEval: %lld held-out tokens; train: %lld calibration tokens (%lld held back for the "
      "threshold); rank %d, %d epochs, target %.2f.\n\n",
      static_cast<long long>(ev->n), static_cast<long long>(n_cal), static_cast<long long>(n_hold),
      rank, o.epochs, o.target_recall);
  std::printf(
      "| layer | active | cos(residual before, after attention) | (a) recall / mag. recall / "
      "precision / predicted | (d) at (a)'s mag. recall: recall / mag. recall / precision / "
      "predicted | (d) / (a) predicted | guess holding 90%% / 95%% of (a)'s neurons: size over "
      "(a)'s |\n|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const LayerResult& r = results[i];
    const Metrics &a = r.std_pred, &e = r.early.matched;
    char d[160] = "- | - | -";  // layer 0 has no previous layer
    if (i > 0) {
      std::snprintf(d, sizeof(d), "%.3f / %.3f / %.3f / %.3f | %.2fx | %.2fx / %.2fx", e.recall,
                    e.magnitude_recall, e.precision, e.predicted, e.predicted / a.predicted,
                    r.early.size90, r.early.size95);
    }
    std::printf("| %zu | %.3f | %.3f | %.3f / %.3f / %.3f / %.3f | %s |\n", i, a.active, r.cosine,
                a.recall, a.magnitude_recall, a.precision, a.predicted, d);
  }
  std::printf(
      "\nLoads in a window shorter than the guess ((d), the guess holding 95%% of (a)'s neurons): "
      "the share of (a)'s neurons loaded when the window holds 0.5x / 1x (a)'s selection, in 16 "
      "parts, each loading in ascending order / the predictor's own selection on the guess's "
      "input first / by its margin; and the first tier's share of the guessed neurons that (a) "
      "selects / of the other guessed neurons:\n\n| layer | guess size | 0.5x: ascending / "
      "tiers / ranked | 1x: ascending / tiers / ranked | first tier: selected / other "
      "|\n|---|---|---|---|---|\n");
  for (size_t i = 1; i < results.size(); ++i) {
    const Guess& r = results[i].early;
    std::printf("| %zu | %.2fx | %.3f / %.3f / %.3f | %.3f / %.3f / %.3f | %.3f / %.3f |\n", i,
                r.size95, r.loads_half.ascending, r.loads_half.tiers, r.loads_half.ranked,
                r.loads_one.ascending, r.loads_one.tiers, r.loads_one.ranked,
                r.loads_one.tier_selected, r.loads_one.tier_other);
  }
  if (library_check) {
    std::printf(
        "\nCheck, (a) trained by the library's TrainPredictors (same rank, data, split):\n\n"
        "| layer | recall | mag. recall | precision | predicted |\n|---|---|---|---|---|\n");
    for (size_t i = 0; i < results.size(); ++i) {
      const Metrics& x = results[i].lib_pred;
      std::printf("| %zu | %.3f | %.4f | %.3f | %.3f |\n", i, x.recall, x.magnitude_recall,
                  x.precision, x.predicted);
    }
  }
  return 0;
}
