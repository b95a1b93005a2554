// See sparse_ffn.h. Each Forward reads top to bottom per token: select neurons, compute their gate
// rows (or the whole gate), keep the ones whose activation is non-zero, compute their up rows and
// add their rows of the transposed down projection into the output.
#include "shared/sparse/sparse_ffn.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "shared/util/status_macros.h"

namespace pinfer {

namespace {

inline float Silu(float g) { return g / (1.f + std::exp(-g)); }

// The activation of one neuron from its gate and up values, exactly as GatedActivation computes it.
inline float Activate(Activation act, float g, float u) {
  switch (act) {
    case Activation::kSilu:
      return Silu(g) * u;
    case Activation::kRelu:
      return (g > 0 ? g : 0.f) * u;
    case Activation::kDRelu:
      return (g > 0 ? g : 0.f) * (u > 0 ? u : 0.f);
  }
  return 0;
}

absl::Status CheckDownT(const Model& model, const std::vector<TensorView>& down_t) {
  const ModelConfig& c = model.config;
  if (static_cast<int>(down_t.size()) != c.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", c.n_layers, " transposed down projections, got ", down_t.size()));
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const TensorView& d = down_t[l];
    if (d.empty() || d.shape.size() != 2 || d.shape[0] != c.ffn_size ||
        d.shape[1] != c.hidden_size) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", l,
                                                     ": transposed down projection must be [",
                                                     c.ffn_size, ", ", c.hidden_size, "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TensorView> TransposeMatrix(const TensorView& w, DType dtype,
                                           std::vector<uint8_t>* storage) {
  if (w.shape.size() != 2) return absl::InvalidArgumentError(w.name + ": not a matrix");
  const int64_t rows = w.rows(), cols = w.cols();
  if (rows % BlockElems(dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(w.name, ": cannot store the transpose as ",
                                                   DTypeName(dtype), " (", rows,
                                                   " is not a multiple of ", BlockElems(dtype),
                                                   ")"));
  }
  // dense: [rows, cols] in fp32; one pass over the source, then one output row at a time.
  std::vector<float> dense(static_cast<size_t>(rows) * cols);
  for (int64_t r = 0; r < rows; ++r) DequantizeRow(w.dtype, w.row(r), &dense[r * cols], cols);
  TensorView t;
  t.name = w.name + ".T";
  t.dtype = dtype;
  t.shape = {cols, rows};
  storage->assign(t.nbytes(), 0);
  t.data = storage->data();
  std::vector<float> row(rows);
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) row[r] = dense[r * cols + c];
    QuantizeRow(dtype, row.data(), storage->data() + c * t.row_bytes(), rows);
  }
  return t;
}

DType TransposedDownType(DType down, DType quantized_as) {
  return IsQuantized(down) ? quantized_as : down;
}

DType TransposedDownType(const LayerWeights& L, DType quantized_as) {
  return L.down_t.data != nullptr ? L.down_t.dtype : TransposedDownType(L.down.dtype, quantized_as);
}

absl::StatusOr<DownTransposed> TransposeDownProjections(const Model& model, DType quantized_as) {
  DownTransposed out;
  for (const LayerWeights& L : model.layers) {
    if (L.down_t.data != nullptr) {
      out.layers.push_back(L.down_t);
      continue;
    }
    const DType dt = TransposedDownType(L.down.dtype, quantized_as);
    auto storage = std::make_shared<std::vector<uint8_t>>();
    ASSIGN_OR_RETURN(TensorView t, TransposeMatrix(L.down, dt, storage.get()));
    out.layers.push_back(std::move(t));
    out.owned.push_back(std::move(storage));
  }
  return out;
}

std::vector<float> RowNorms(const TensorView& w) {
  std::vector<float> norms(w.rows());
  std::vector<float> row(w.cols());
  for (int64_t r = 0; r < w.rows(); ++r) {
    DequantizeRow(w.dtype, w.row(r), row.data(), w.cols());
    double s = 0;
    for (float v : row) s += static_cast<double>(v) * v;
    norms[r] = static_cast<float>(std::sqrt(s));
  }
  return norms;
}

float ScoreScale(const LayerPredictor& p, const float* residual, int hidden, float eps) {
  if (!ScoresNeedResidual(p)) return 1.f;
  // The original predictor's score is the folded one times rms(residual): ReLU commutes with a
  // positive scale.
  double ss = 0;
  for (int i = 0; i < hidden; ++i) ss += static_cast<double>(residual[i]) * residual[i];
  return static_cast<float>(std::sqrt(ss / hidden + eps));
}

// --- statistics --------------------------------------------------------------------------------

double SparseFfnStats::Sparsity(int layer) const {
  const SparseFfnLayerStats& s = layers[layer];
  return s.tokens == 0 ? 0 : 1.0 - static_cast<double>(s.selected) / (s.tokens * ffn_size);
}

double SparseFfnStats::Sparsity() const {
  double selected = 0, total = 0;
  for (const SparseFfnLayerStats& s : layers) {
    selected += s.selected;
    total += static_cast<double>(s.tokens) * ffn_size;
  }
  return total == 0 ? 0 : 1.0 - selected / total;
}

double SparseFfnStats::ComputeFraction(int layer) const {
  const SparseFfnLayerStats& s = layers[layer];
  if (s.tokens == 0) return 0;
  return static_cast<double>(s.gate_rows + 2 * s.computed) / (3.0 * s.tokens * ffn_size);
}

double SparseFfnStats::Recall(int layer) const {
  const SparseFfnLayerStats& s = layers[layer];
  return s.true_active == 0 ? 1 : static_cast<double>(s.true_active_hit) / s.true_active;
}

double SparseFfnStats::Recall() const {
  double a = 0, b = 0;
  for (const SparseFfnLayerStats& s : layers) {
    a += s.true_active_hit;
    b += s.true_active;
  }
  return b == 0 ? 1 : a / b;
}

double SparseFfnStats::MagnitudeRecall(int layer) const {
  const SparseFfnLayerStats& s = layers[layer];
  return s.magnitude_total == 0 ? 1 : s.magnitude_hit / s.magnitude_total;
}

double SparseFfnStats::MagnitudeRecall() const {
  double a = 0, b = 0;
  for (const SparseFfnLayerStats& s : layers) {
    a += s.magnitude_hit;
    b += s.magnitude_total;
  }
  return b == 0 ? 1 : a / b;
}

// --- exact (gate-driven) mode ------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<GateSparseFfn>> GateSparseFfn::Create(
    const Model& model, const CpuOps& ops, std::vector<TensorView> down_t,
    std::vector<float> magnitude_thresholds) {
  const ModelConfig& c = model.config;
  RETURN_IF_ERROR(CheckDownT(model, down_t));
  if (c.activation == Activation::kSilu && magnitude_thresholds.empty()) {
    return absl::FailedPreconditionError(
        "exact sparse mode needs a ReLU model: SiLU activations are never exactly zero (use "
        "magnitude thresholds from `pinfer prepare`)");
  }
  if (!magnitude_thresholds.empty() && c.activation != Activation::kSilu) {
    return absl::InvalidArgumentError("magnitude thresholds apply to SiLU models only");
  }
  if (!magnitude_thresholds.empty() &&
      static_cast<int>(magnitude_thresholds.size()) != c.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected ", c.n_layers, " magnitude thresholds, got ", magnitude_thresholds.size()));
  }
  return std::unique_ptr<GateSparseFfn>(
      new GateSparseFfn(model, ops, std::move(down_t), std::move(magnitude_thresholds)));
}

GateSparseFfn::GateSparseFfn(const Model& model, const CpuOps& ops, std::vector<TensorView> down_t,
                             std::vector<float> thresholds)
    : model_(model), ops_(ops), down_t_(std::move(down_t)), thresholds_(std::move(thresholds)) {
  ResetStats();
}

void GateSparseFfn::ResetStats() {
  stats_.ffn_size = model_.config.ffn_size;
  stats_.layers.assign(model_.config.n_layers, {});
}

absl::Status GateSparseFfn::Forward(int layer, const float* x, int n, float* out) {
  const ModelConfig& c = model_.config;
  const LayerWeights& L = model_.layers[layer];
  const int F = c.ffn_size, H = c.hidden_size;
  const size_t nf = static_cast<size_t>(n) * F;
  if (gate_.size() < nf + F) gate_.resize(nf + F);  // [n, ffn] then one token's selected gates
  if (act_.size() < static_cast<size_t>(F)) {
    act_.resize(F);
    rows_.resize(F);
  }
  const bool magnitude = !thresholds_.empty();
  const float thr = magnitude ? thresholds_[layer] : 0.f;
  SparseFfnLayerStats& st = stats_.layers[layer];

  ops_.MatMul(L.gate, x, n, gate_.data());  // gate: [n, ffn]
  std::fill(out, out + static_cast<size_t>(n) * H, 0.f);
  for (int t = 0; t < n; ++t) {
    const float* g = gate_.data() + static_cast<size_t>(t) * F;
    const float* xt = x + static_cast<size_t>(t) * H;
    // rows: the neurons whose activation can be non-zero (or exceeds the magnitude threshold).
    int k = 0;
    if (magnitude) {
      for (int j = 0; j < F; ++j) {
        if (std::fabs(Silu(g[j])) > thr) rows_[k++] = j;
      }
    } else {
      for (int j = 0; j < F; ++j) {
        if (g[j] > 0) rows_[k++] = j;
      }
    }
    for (int i = 0; i < k; ++i) gate_[nf + i] = g[rows_[i]];  // the gate values of the rows
    ops_.SparseFfnToken(L.gate, L.up, down_t_[layer], rows_.data(), k, c.activation, xt,
                        gate_.data() + nf, act_.data(),
                        out + static_cast<size_t>(t) * H);  // out[t]: [hidden]
    st.tokens += 1;
    st.selected += k;
    st.gate_rows += F;
    st.computed += k;
  }
  return absl::OkStatus();
}

// --- predictor-driven mode ---------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<PredictedSparseFfn>> PredictedSparseFfn::Create(
    const Model& model, const CpuOps& ops, std::vector<TensorView> down_t,
    const PredictorSet* predictors) {
  const ModelConfig& c = model.config;
  RETURN_IF_ERROR(CheckDownT(model, down_t));
  if (predictors == nullptr || static_cast<int>(predictors->layers.size()) != c.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected predictors for ", c.n_layers, " layers"));
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerPredictor& p = predictors->layers[l];
    if (p.fc1.shape.size() != 2 || p.fc2.shape.size() != 2 || p.fc1.cols() != c.hidden_size ||
        p.fc2.rows() != c.ffn_size || p.fc2.cols() != p.fc1.rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l, ": predictor shapes must be fc1 [rank, ", c.hidden_size,
                       "] and fc2 [", c.ffn_size, ", rank]"));
    }
  }
  return std::unique_ptr<PredictedSparseFfn>(
      new PredictedSparseFfn(model, ops, std::move(down_t), predictors));
}

PredictedSparseFfn::PredictedSparseFfn(const Model& model, const CpuOps& ops,
                                       std::vector<TensorView> down_t,
                                       const PredictorSet* predictors)
    : model_(model), ops_(ops), down_t_(std::move(down_t)), predictors_(predictors) {
  ResetStats();
}

void PredictedSparseFfn::ResetStats() {
  stats_.ffn_size = model_.config.ffn_size;
  stats_.layers.assign(model_.config.n_layers, {});
}

void PredictedSparseFfn::MeasureRecall(int layer, const float* x, int n) {
  const ModelConfig& c = model_.config;
  const LayerWeights& L = model_.layers[layer];
  const size_t nf = static_cast<size_t>(n) * c.ffn_size;
  if (down_norms_.empty()) {
    for (const TensorView& d : down_t_) down_norms_.push_back(RowNorms(d));
  }
  if (dense_gate_.size() < nf) {
    dense_gate_.resize(nf);
    dense_up_.resize(nf);
  }
  ops_.MatMul(L.gate, x, n, dense_gate_.data());  // [n, ffn]
  ops_.MatMul(L.up, x, n, dense_up_.data());      // [n, ffn]
}

absl::Status PredictedSparseFfn::ForwardFromResidual(int layer, const float* residual,
                                                     const float* x, int n, float* out) {
  residual_ = residual;
  absl::Status st = Forward(layer, x, n, out);
  residual_ = nullptr;
  return st;
}

absl::Status PredictedSparseFfn::Forward(int layer, const float* x, int n, float* out) {
  const ModelConfig& c = model_.config;
  const LayerWeights& L = model_.layers[layer];
  const LayerPredictor& P = predictors_->layers[layer];
  const int F = c.ffn_size, H = c.hidden_size, R = P.rank();
  const size_t nf = static_cast<size_t>(n) * F;
  if (score_.size() < nf) score_.resize(nf);
  if (hidden_.size() < static_cast<size_t>(n) * R) hidden_.resize(static_cast<size_t>(n) * R);
  if (act_.size() < static_cast<size_t>(F)) {
    act_.resize(F);
    rows_.resize(F);
    selected_.resize(F);
  }
  SparseFfnLayerStats& st = stats_.layers[layer];

  // The predictor: score: [n, ffn] = fc2(relu(fc1(x))).
  ops_.MatMul(P.fc1, x, n, hidden_.data());  // hidden: [n, rank]
  for (size_t i = 0; i < static_cast<size_t>(n) * R; ++i) hidden_[i] = std::max(hidden_[i], 0.f);
  ops_.MatMul(P.fc2, hidden_.data(), n, score_.data());
  if (measure_recall_) MeasureRecall(layer, x, n);

  if (ScoresNeedResidual(P) && residual_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, ": predictors of the residual before ffn_norm with threshold ",
        P.threshold, " need the residual (FfnBlock::ForwardFromResidual)"));
  }
  std::fill(out, out + static_cast<size_t>(n) * H, 0.f);
  for (int t = 0; t < n; ++t) {
    const float* s = score_.data() + static_cast<size_t>(t) * F;
    const float* xt = x + static_cast<size_t>(t) * H;
    const float scale = ScoreScale(
        P, residual_ != nullptr ? residual_ + static_cast<size_t>(t) * H : nullptr, H, c.norm_eps);
    int k = 0;
    for (int j = 0; j < F; ++j) {
      if (s[j] * scale >= P.threshold) rows_[k++] = j;
    }
    // Gate rows of the selected neurons; up and down rows only where the gate is really active.
    const int m = ops_.SparseFfnToken(L.gate, L.up, down_t_[layer], rows_.data(), k, c.activation,
                                      xt, /*gate_values=*/nullptr, act_.data(),
                                      out + static_cast<size_t>(t) * H);  // out[t]: [hidden]
    st.tokens += 1;
    st.selected += k;
    st.gate_rows += k;
    st.computed += m;

    if (measure_recall_) {
      std::fill(selected_.begin(), selected_.end(), 0);
      for (int i = 0; i < k; ++i) selected_[rows_[i]] = 1;
      const float* g = dense_gate_.data() + static_cast<size_t>(t) * F;
      const float* u = dense_up_.data() + static_cast<size_t>(t) * F;
      const std::vector<float>& norms = down_norms_[layer];
      for (int j = 0; j < F; ++j) {
        const float a = Activate(c.activation, g[j], u[j]);
        if (a == 0 || (c.activation != Activation::kSilu && g[j] <= 0)) continue;
        const double mag = std::fabs(a) * norms[j];
        st.true_active += 1;
        st.magnitude_total += mag;
        if (selected_[j]) {
          st.true_active_hit += 1;
          st.magnitude_hit += mag;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pinfer
