// See predictor_training.h. Big products (the MLP's forward and backward passes over batches,
// the gate over all samples) run through CpuOps::MatMul on fp32 views, so they use the engine's
// SIMD kernels and thread pool; the small H x H linear algebra of the closed form is plain loops.
#include "shared/sparse/predictor_training.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "shared/sparse/predictor_fit.h"
#include "shared/util/half.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

std::vector<float> Dequantize(const TensorView& w) {
  std::vector<float> out(static_cast<size_t>(w.numel()));
  for (int64_t r = 0; r < w.rows(); ++r)
    DequantizeRow(w.dtype, w.row(r), &out[r * w.cols()], w.cols());
  return out;
}

// Everything training needs about one layer, computed once.
struct LayerData {
  int64_t n = 0, n_train = 0;
  std::vector<float> x;                  // [n, hidden]
  std::vector<float> importance;         // [n, ffn]: contribution of truly active neurons, else 0
  std::vector<float> unit_contribution;  // [ffn]: contribution per unit of relu(gate)
  std::vector<float> second_moment;      // [hidden, hidden]: E[x x^T] over the training pairs
  std::vector<float> mean_active_importance;  // [ffn]: mean contribution when active (training)
  double mean_positive_importance = 0;
};

absl::StatusOr<LayerData> PrepareLayer(const Model& model, const CpuOps& ops,
                                       const FfnSamples& samples, int layer,
                                       const PredictorTrainingOptions& o) {
  const int H = model.config.hidden_size;
  LayerData d;
  d.n = samples.count;
  const int64_t n_hold = std::max<int64_t>(1, static_cast<int64_t>(d.n * o.holdout_fraction));
  d.n_train = d.n - n_hold;
  if (d.n_train < 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("too few profiled tokens (", d.n, ") to train predictors"));
  }
  d.x.resize(static_cast<size_t>(d.n) * H);
  samples.Get(layer, 0, d.n, d.x.data());

  FfnTargets t = ComputeFfnTargets(model, ops, layer, d.x.data(), d.n, d.n_train,
                                   /*keep_gate=*/false);
  d.importance = std::move(t.importance);
  d.unit_contribution = std::move(t.unit_contribution);
  d.mean_active_importance = std::move(t.mean_active_importance);
  d.mean_positive_importance = t.mean_positive_importance;
  d.second_moment = SecondMoment(ops, d.x.data(), d.n_train, H);
  return d;
}

// An MLP predictor in fp32 while training: w1: [r, hidden], w2: [ffn, r].
struct Mlp {
  int r = 0;
  std::vector<float> w1, w2;
  // Once rounded to a block format (Round): the stored rows, which the run-time product
  // multiplies with its activations quantized too, so scoring must go through them.
  DType stored_type = DType::kF32;
  std::vector<uint8_t> q1, q2;
};

// The closed-form start: the best rank-(r/2) linear predictor of the (contribution-weighted)
// gate, written as an MLP with r hidden units, with rows of fc2 scaled into logits.
Mlp ClosedFormInit(const Model& model, const LayerData& d, int layer, int r,
                   const PredictorTrainingOptions& o) {
  const ModelConfig& c = model.config;
  Mlp m;
  m.r = 2 * (r / 2);
  ClosedFormPredictor(Dequantize(model.layers[layer].gate),
                      o.weighted_regression ? &d.unit_contribution : nullptr, d.second_moment,
                      /*resid_var=*/nullptr, c.hidden_size, c.ffn_size, r,
                      o.seed + 7919 * layer + r, &m.w1, &m.w2);
  return m;
}

// He-initialised MLP for comparison with the closed-form start.
Mlp RandomInit(int H, int F, int r, uint32_t seed) {
  std::mt19937 rng(seed);
  Mlp m;
  m.r = r;
  m.w1.resize(static_cast<size_t>(r) * H);
  m.w2.resize(static_cast<size_t>(F) * r);
  std::normal_distribution<float> n1(0.f, std::sqrt(2.f / H)), n2(0.f, std::sqrt(1.f / r));
  for (float& v : m.w1) v = n1(rng);
  for (float& v : m.w2) v = n2(rng);
  return m;
}


// Adam on weighted BCE over the training pairs.
void FineTune(const CpuOps& ops, const LayerData& d, int H, int F, Mlp& m,
              const PredictorTrainingOptions& o, uint32_t seed) {
  FineTunePredictor(ops, d.x.data(), d.importance.data(), d.mean_positive_importance, d.n_train, H,
                    F, m.r, o, seed, &m.w1, &m.w2);
}

// Rounds to the storage dtype and back, so calibration sees exactly the stored weights.
std::vector<float> RoundTrip(const std::vector<float>& w, int64_t cols, DType dtype,
                             std::vector<uint8_t>* stored) {
  const int64_t rows = static_cast<int64_t>(w.size()) / cols;
  const size_t rb = RowBytes(dtype, cols);
  stored->assign(rb * rows, 0);
  std::vector<float> out(w.size());
  for (int64_t r = 0; r < rows; ++r) {
    QuantizeRow(dtype, w.data() + r * cols, stored->data() + r * rb, cols);
    DequantizeRow(dtype, stored->data() + r * rb, out.data() + r * cols, cols);
  }
  return out;
}

// Rounds both layers to the storage dtype, keeping the stored bytes.
void Round(Mlp& m, int H, DType dtype) {
  m.w1 = RoundTrip(m.w1, H, dtype, &m.q1);
  m.w2 = RoundTrip(m.w2, m.r, dtype, &m.q2);
  m.stored_type = dtype;
}

// z: [n, r] = relu(fc1 x), s: [n, F] = fc2 z, computed as the sparse FFN computes them at run
// time: fp32 math on the (exactly rounded) weights, or for block formats the engine's quantized
// product on the stored rows.
void Scores(const CpuOps& ops, const Mlp& m, int H, int F, const float* x, int n, float* z,
            float* s) {
  const bool blocks = IsQuantized(m.stored_type);
  if (blocks) {
    ops.MatMul(TensorView{"fc1", m.stored_type, {m.r, H}, m.q1.data()}, x, n, z);
  } else {
    MatMulF32(ops, m.w1.data(), m.r, H, x, n, z);
  }
  for (size_t i = 0; i < static_cast<size_t>(n) * m.r; ++i) z[i] = std::max(z[i], 0.f);
  if (blocks) {
    ops.MatMul(TensorView{"fc2", m.stored_type, {F, m.r}, m.q2.data()}, z, n, s);
  } else {
    MatMulF32(ops, m.w2.data(), F, m.r, z, n, s);
  }
}

struct Evaluation {
  PredictorCandidate candidate;
  double true_active_rate = 0;
};

// Scores the held-back pairs, picks the threshold and measures recall, precision and sparsity.
Evaluation Calibrate(const CpuOps& ops, const LayerData& d, int H, int F, const Mlp& m,
                     double target, const float* fixed_threshold = nullptr) {
  const int64_t n_hold = d.n - d.n_train;
  constexpr int kChunk = 512;
  std::vector<float> z(static_cast<size_t>(kChunk) * m.r), s(static_cast<size_t>(kChunk) * F);
  std::vector<float> all_scores;
  all_scores.reserve(static_cast<size_t>(n_hold) * F);
  std::vector<std::pair<float, float>> active;  // (score, importance) of truly active pairs
  for (int64_t b0 = d.n_train; b0 < d.n; b0 += kChunk) {
    const int nb = static_cast<int>(std::min<int64_t>(kChunk, d.n - b0));
    Scores(ops, m, H, F, d.x.data() + b0 * H, nb, z.data(), s.data());
    for (int t = 0; t < nb; ++t) {
      const float* imp = d.importance.data() + (b0 + t) * F;
      for (int j = 0; j < F; ++j) {
        const float sc = s[static_cast<size_t>(t) * F + j];
        all_scores.push_back(sc);
        if (imp[j] > 0) active.emplace_back(sc, imp[j]);
      }
    }
  }
  Evaluation e;
  PredictorCandidate& c = e.candidate;
  c.rank = m.r;
  const int64_t n_active = static_cast<int64_t>(active.size());
  c.threshold =
      fixed_threshold != nullptr ? *fixed_threshold : ThresholdForWeightedRecall(active, target);
  int64_t selected = 0, hits = 0;
  double mag_total = 0, mag_hit = 0;
  for (float sc : all_scores) selected += sc >= c.threshold;
  for (const auto& [sc, w] : active) {
    mag_total += w;
    if (sc >= c.threshold) {
      ++hits;
      mag_hit += w;
    }
  }
  const double pairs = static_cast<double>(all_scores.size());
  e.true_active_rate = n_active / pairs;
  c.recall = n_active == 0 ? 1.0 : static_cast<double>(hits) / n_active;
  c.magnitude_recall = mag_total == 0 ? 1.0 : mag_hit / mag_total;
  c.precision = selected == 0 ? 1.0 : static_cast<double>(hits) / selected;
  c.sparsity = 1.0 - selected / pairs;
  // Per token: predictor r (H + F); a gate row per selected neuron, up and down rows per truly
  // active selected one; relative to the dense 3 F H.
  const double dense = 3.0 * F * H;
  c.cost = (static_cast<double>(m.r) * (H + F) + (selected / pairs) * F * H +
            2.0 * (hits / pairs) * F * H) /
           dense;
  return e;
}

// Per-neuron thresholds, folded into fc2's rows. The score is a logit of P(active); the expected
// contribution of a pair is about sigmoid(s) * m_j (m_j: neuron j's mean contribution when
// active), so the best pairs to keep are those with the largest sigmoid(s) * m_j. One cut
// lambda on that key reaches the target on the held-back pairs; neuron j's threshold on s is then
// logit(lambda / m_j), and scaling row j of fc2 by 1 / |threshold_j| makes every threshold -1.
// Thresholds that would be >= 0 (p >= 1/2 needed: unimportant neurons) are clamped just below
// zero, which keeps a little more than necessary.
void FoldPerNeuronThresholds(const CpuOps& ops, const LayerData& d, int H, int F, Mlp& m,
                             double target) {
  const int64_t n_hold = d.n - d.n_train;
  constexpr int kChunk = 512;
  std::vector<float> z(static_cast<size_t>(kChunk) * m.r), s(static_cast<size_t>(kChunk) * F);
  std::vector<float> log_m(F);
  for (int j = 0; j < F; ++j) log_m[j] = std::log(std::max(d.mean_active_importance[j], 1e-30f));
  std::vector<std::pair<float, float>> active;
  active.reserve(static_cast<size_t>(n_hold) * F / 4);
  for (int64_t b0 = d.n_train; b0 < d.n; b0 += kChunk) {
    const int nb = static_cast<int>(std::min<int64_t>(kChunk, d.n - b0));
    Scores(ops, m, H, F, d.x.data() + b0 * H, nb, z.data(), s.data());
    for (int t = 0; t < nb; ++t) {
      const float* imp = d.importance.data() + (b0 + t) * F;
      for (int j = 0; j < F; ++j) {
        if (imp[j] <= 0) continue;
        const float sc = s[static_cast<size_t>(t) * F + j];
        const float log_sigmoid =
            sc >= 0 ? -std::log1p(std::exp(-sc)) : sc - std::log1p(std::exp(sc));
        active.emplace_back(log_sigmoid + log_m[j], imp[j]);
      }
    }
  }
  const float lambda = ThresholdForWeightedRecall(active, target);  // on log(sigmoid(s) m_j)
  std::vector<float> thrs;
  for (int j = 0; j < F; ++j) {
    float thr;
    if (!std::isfinite(lambda)) {
      thr = lambda > 0 ? 1e30f : -1e30f;
    } else {
      const double q = std::exp(static_cast<double>(lambda) - log_m[j]);  // sigmoid(s) needed
      thr = q >= 0.499 ? -0.004f : static_cast<float>(std::log(q / (1 - q)));
    }
    // (target > 0 is checked up front, so lambda is never +inf; -inf means keep everything.)
    thrs.push_back(thr);
    const float scale = thr <= -1e29f ? 0.f : 1.f / -std::min(thr, -0.004f);
    for (int i = 0; i < m.r; ++i) m.w2[static_cast<size_t>(j) * m.r + i] *= scale;
  }
  if (std::getenv("PINFER_TRAIN_TIMING") != nullptr) {
    std::sort(thrs.begin(), thrs.end());
    std::fprintf(
        stderr,
        "per-neuron thresholds: lambda %.3f min %.3f p10 %.3f median %.3f p90 %.3f max %.3f\n",
        lambda, thrs.front(), thrs[F / 10], thrs[F / 2], thrs[9 * F / 10], thrs.back());
  }
}

}  // namespace

float ThresholdForWeightedRecall(std::vector<std::pair<float, float>> score_weight, double target) {
  if (score_weight.empty() || target <= 0) return std::numeric_limits<float>::infinity();
  std::sort(score_weight.begin(), score_weight.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  double total = 0;
  for (const auto& p : score_weight) total += p.second;
  if (target >= 1) return -std::numeric_limits<float>::infinity();
  const double want = target * total;
  double cum = 0;
  for (const auto& [score, w] : score_weight) {
    cum += w;
    if (cum >= want) return score;
  }
  return score_weight.back().first;
}

absl::StatusOr<TrainedPredictors> TrainPredictors(
    const Model& model, const CpuOps& ops, const FfnSamples& samples,
    const PredictorTrainingOptions& o, const std::function<void(const std::string&)>& log) {
  const ModelConfig& c = model.config;
  if (c.activation == Activation::kSilu) {
    return absl::FailedPreconditionError(
        "activation predictors need a ReLU-family model (SiLU models use magnitude thresholds)");
  }
  if (samples.count == 0 || static_cast<int>(samples.inputs.size()) != c.n_layers ||
      samples.hidden != c.hidden_size) {
    return absl::InvalidArgumentError(
        "no FFN input samples for this model (profile with keep_inputs)");
  }
  if (o.ranks.empty()) return absl::InvalidArgumentError("no candidate predictor ranks");
  for (int r : o.ranks) {
    if (r < 2 || r % 2 != 0 || r > 2 * c.hidden_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("predictor rank ", r, " must be even and in 2..", 2 * c.hidden_size));
    }
  }
  if (!(o.target_recall > 0 && o.target_recall <= 1)) {
    return absl::InvalidArgumentError("target recall must be in (0, 1]");
  }
  if (o.dtype != DType::kF16 && o.dtype != DType::kF32 && o.dtype != DType::kQ8_0) {
    return absl::InvalidArgumentError(
        absl::StrCat("predictors are stored as F32, F16 or Q8_0, not ", DTypeName(o.dtype)));
  }
  if (o.dtype == DType::kQ8_0) {
    // Q8_0 rows are blocks of 32: fc1's rows have hidden columns, fc2's rank columns.
    bool fits = c.hidden_size % 32 == 0;
    for (int r : o.ranks) fits = fits && r % 32 == 0;
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrCat("Q8_0 predictors need the hidden size (",
                                                     c.hidden_size,
                                                     ") and every rank to be multiples of 32"));
    }
  }
  const int H = c.hidden_size, F = c.ffn_size;
  TrainedPredictors out;
  for (int l = 0; l < c.n_layers; ++l) {
    if (!o.layers.empty() && std::find(o.layers.begin(), o.layers.end(), l) == o.layers.end()) {
      // (F16 whatever the dtype: a rank-2 row is no Q8_0 block.)
      auto w1 = std::make_shared<std::vector<uint8_t>>(RowBytes(DType::kF16, H) * 2, 0);
      auto w2 = std::make_shared<std::vector<uint8_t>>(RowBytes(DType::kF16, 2) * F, 0);
      LayerPredictor p;
      p.fc1 = TensorView{absl::StrCat("blk.", l, ".fc1.weight"), DType::kF16, {2, H}, w1->data()};
      p.fc2 = TensorView{absl::StrCat("blk.", l, ".fc2.weight"), DType::kF16, {F, 2}, w2->data()};
      p.threshold = kFoldedThreshold;  // all-zero scores >= -1: every neuron selected
      out.predictors.layers.push_back(p);
      out.predictors.owned.push_back(w1);
      out.predictors.owned.push_back(w2);
      LayerPredictorReport report;
      report.layer = l;
      report.rank = 2;
      report.recall = report.magnitude_recall = 1;
      out.reports.push_back(report);
      continue;
    }
    const auto t0 = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(LayerData d, PrepareLayer(model, ops, samples, l, o));
    LayerPredictorReport report;
    report.layer = l;
    report.train_pairs = d.n_train;
    report.heldout_pairs = d.n - d.n_train;
    // Ranks in increasing order: the first that reaches min_sparsity at the target recall wins
    // (later ones are not even trained); if none does, the cheapest in total cost.
    std::vector<int> ranks = o.ranks;
    std::sort(ranks.begin(), ranks.end());
    double best_cost = std::numeric_limits<double>::infinity();
    bool reached = false;
    Mlp best;
    double prev_sparsity = -1;
    for (size_t ri = 0; ri < ranks.size(); ++ri) {
      const int r = ranks[ri];
      Mlp m =
          o.closed_form_init ? ClosedFormInit(model, d, l, r, o) : RandomInit(H, F, r, o.seed + l);
      if (o.epochs > 0) FineTune(ops, d, H, F, m, o, o.seed + 31 * l + r);
      Round(m, H, o.dtype);
      Evaluation e = Calibrate(ops, d, H, F, m, o.target_recall);
      report.candidates.push_back(e.candidate);
      if (log) {
        log(absl::StrFormat(
            "layer %d rank %d: recall %.3f (magnitude %.3f), precision %.3f, sparsity %.3f, "
            "cost %.3f of dense",
            l, r, e.candidate.recall, e.candidate.magnitude_recall, e.candidate.precision,
            e.candidate.sparsity, e.candidate.cost));
      }
      // The held-back estimate moves by about a point between text samples: ask for a margin.
      constexpr double kSparsityMargin = 0.02;
      reached = o.min_sparsity > 0 && e.candidate.sparsity >= o.min_sparsity + kSparsityMargin;
      if (e.candidate.cost < best_cost || reached) {
        best_cost = e.candidate.cost;
        report.threshold = e.candidate.threshold;
        best = std::move(m);
      }
      if (reached) break;
      // Sparsity grows ever more slowly with the rank: when even the last step's gain repeated
      // for every remaining rank would not reach the target, the remaining (largest, slowest)
      // ranks are not trained; the cheapest in total cost so far is kept.
      const double s = e.candidate.sparsity;
      if (o.min_sparsity > 0 && prev_sparsity >= 0 &&
          s + (s - prev_sparsity) * static_cast<double>(ranks.size() - 1 - ri) <
              o.min_sparsity + kSparsityMargin) {
        break;
      }
      prev_sparsity = s;
    }
    // Fold the threshold into fc2's scale so that every layer uses kFoldedThreshold, the single
    // value PowerInfer's file format has room for: s >= t  <=>  s / |t| >= -1 for t < 0.
    // (Calibrated thresholds are negative: a neuron is kept unless the predictor is confident.)
    float threshold = report.threshold;
    if (o.per_neuron_thresholds) {
      FoldPerNeuronThresholds(ops, d, H, F, best, o.target_recall);
      threshold = kFoldedThreshold;
    } else if (std::isfinite(threshold) && threshold < 0) {
      const float scale = 1.f / -threshold;
      for (float& v : best.w2) v *= scale;
      threshold = kFoldedThreshold;
    }
    Round(best, H, o.dtype);  // again: the fold rescaled fc2's rows
    // The final numbers are measured on exactly the stored weights and threshold.
    Evaluation e = Calibrate(ops, d, H, F, best, o.target_recall, &threshold);
    report.rank = best.r;
    report.threshold = threshold;
    report.true_active_rate = e.true_active_rate;
    report.recall = e.candidate.recall;
    report.magnitude_recall = e.candidate.magnitude_recall;
    report.precision = e.candidate.precision;
    report.sparsity = e.candidate.sparsity;
    report.predictor_cost = static_cast<double>(best.r) * (H + F) / (3.0 * F * H);
    auto w1 = std::make_shared<std::vector<uint8_t>>(std::move(best.q1));
    auto w2 = std::make_shared<std::vector<uint8_t>>(std::move(best.q2));
    LayerPredictor p;
    p.fc1 = TensorView{absl::StrCat("blk.", l, ".fc1.weight"), o.dtype, {best.r, H}, w1->data()};
    p.fc2 = TensorView{absl::StrCat("blk.", l, ".fc2.weight"), o.dtype, {F, best.r}, w2->data()};
    p.threshold = threshold;
    out.predictors.layers.push_back(p);
    out.predictors.owned.push_back(w1);
    out.predictors.owned.push_back(w2);
    report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.reports.push_back(std::move(report));
  }
  return out;
}

}  // namespace pinfer
