// Sparse FFN execution on the CPU: FfnBlock implementations that compute only the neurons a token
// activates.
//
// A Llama FFN is out = down(act(gate(x)) * up(x)). Neuron j contributes act(g_j) * u_j times
// column j of down; when act(g_j) is zero (ReLU models, most neurons on most tokens) rows j of
// gate and up and column j of down are wasted work. Storing down transposed ([ffn, hidden]) turns
// that column into a contiguous row, so skipping a neuron skips three rows:
//
//  - GateSparseFfn (exact mode): gate fully, then up and down only for neurons with act(g) != 0.
//    Bit-for-bit the same maths as the dense FFN except the order of the fp32 sums. For SiLU
//    models the same block applies a per-layer magnitude threshold |silu(g)| <= t (training-free
//    magnitude sparsity) instead, which is an approximation.
//  - PredictedSparseFfn: a small predictor per layer picks the neurons; gate rows are computed
//    only for those, and up/down only for the ones whose gate then really is active. A neuron the
//    predictor wrongly includes costs one gate row; one it wrongly leaves out is lost.
//
// Batches: every token uses its own mask (no union over the batch). A token's output therefore
// does not depend on what else is in the batch, so prompt processing and token-by-token decoding
// give the same results, and a long prompt does not degrade to dense compute the way a union of
// masks does. All arithmetic runs through CpuOps: per token, SparseFfnToken reads each selected
// neuron's gate, up and down rows back to back (threaded over fixed chunks of neurons whose sums
// are added in order: no data races, the same result at any thread count).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/engine/ops.h"
#include "shared/engine/transformer.h"
#include "shared/model/model.h"

namespace pinfer {

// Transposed down projections, [ffn, hidden] per layer, with the memory they live in (when they
// are built in memory rather than read from a prepared file).
struct DownTransposed {
  std::vector<TensorView> layers;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> owned;
};

// Transposes every layer's down projection. Float dtypes keep their dtype (exact). Quantized
// dtypes are blocked along rows, so a transpose must re-quantize: `quantized_as` picks the dtype
// (F32 keeps the dequantized values exactly; Q8_0/Q4_0 are what a prepared file stores). A layer
// whose file stores the transpose (LayerWeights::down_t) gives that view, in the file's type,
// without a copy.
absl::StatusOr<DownTransposed> TransposeDownProjections(const Model& model,
                                                        DType quantized_as = DType::kF32);
// The dtype TransposeDownProjections gives a down projection stored as `down`.
DType TransposedDownType(DType down, DType quantized_as = DType::kF32);
// The dtype TransposeDownProjections gives the layer's down projection.
DType TransposedDownType(const LayerWeights& layer, DType quantized_as = DType::kF32);
absl::StatusOr<TensorView> TransposeMatrix(const TensorView& w, DType dtype,
                                           std::vector<uint8_t>* storage);

// One layer's activation predictor: score = fc2(relu(fc1(x))); neuron j is predicted active when
// score_j >= threshold (PowerInfer's rule with its `powerinfer.sparse_threshold`).
struct LayerPredictor {
  TensorView fc1;  // [rank, hidden]
  TensorView fc2;  // [ffn, rank]
  float threshold = 0;
  // fc1 was folded from a predictor of the residual before ffn_norm (PowerInfer's): its scores
  // are the original's divided by rms(residual), so a non-zero threshold is applied to
  // score * rms(residual) (FfnBlock::ForwardFromResidual).
  bool reads_residual = false;
  int rank() const { return static_cast<int>(fc1.rows()); }
};

// What a token's scores are multiplied by before the layer's threshold: rms(residual) (the
// token's FFN input before ffn_norm, [hidden]) when the predictor reads the residual and the
// threshold is non-zero, 1 otherwise (residual may then be null). See LayerPredictor.
inline bool ScoresNeedResidual(const LayerPredictor& p) {
  return p.reads_residual && p.threshold != 0;
}
float ScoreScale(const LayerPredictor& p, const float* residual, int hidden, float eps);

struct PredictorSet {
  std::vector<LayerPredictor> layers;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> owned;
};

// What a sparse FFN did, per layer, summed over tokens.
struct SparseFfnLayerStats {
  int64_t tokens = 0;
  // Neurons the mode selected for computation: the predicted set, or in exact mode the neurons
  // whose (fully computed) gate is active. Sparsity counts the others.
  int64_t selected = 0;
  int64_t gate_rows = 0;  // gate rows computed
  int64_t computed = 0;   // neurons whose up and down rows were computed
  // Only when recall is measured (PredictedSparseFfn::set_measure_recall):
  int64_t true_active = 0;      // neurons truly active
  int64_t true_active_hit = 0;  // ... of which the predictor selected
  double magnitude_total = 0;   // sum over truly active of |act * up| * |down row|
  double magnitude_hit = 0;     // ... of those selected
};

struct SparseFfnStats {
  int ffn_size = 0;
  std::vector<SparseFfnLayerStats> layers;

  // Fraction of neurons for which nothing at all was computed.
  double Sparsity(int layer) const;
  double Sparsity() const;  // over all layers
  // Fraction of neuron rows (gate + up + down) computed, relative to dense.
  double ComputeFraction(int layer) const;
  double Recall(int layer) const;
  double Recall() const;
  double MagnitudeRecall(int layer) const;
  double MagnitudeRecall() const;
};

// Exact sparse FFN for ReLU/dReLU models; magnitude-threshold sparse FFN for SiLU models.
class GateSparseFfn : public FfnBlock {
 public:
  // down_t: [ffn, hidden] per layer (must outlive this). `magnitude_thresholds` (SiLU only, one
  // per layer): neurons with |act(g)| <= t are skipped. Empty: exact (only exact zeros skipped).
  static absl::StatusOr<std::unique_ptr<GateSparseFfn>> Create(
      const Model& model, const CpuOps& ops, std::vector<TensorView> down_t,
      std::vector<float> magnitude_thresholds = {});

  absl::Status Forward(int layer, const float* x, int n, float* out) override;
  const SparseFfnStats& stats() const { return stats_; }
  void ResetStats();

 private:
  GateSparseFfn(const Model& model, const CpuOps& ops, std::vector<TensorView> down_t,
                std::vector<float> thresholds);
  const Model& model_;
  const CpuOps& ops_;
  std::vector<TensorView> down_t_;
  std::vector<float> thresholds_;
  SparseFfnStats stats_;
  std::vector<float> gate_, act_;
  std::vector<int32_t> rows_;
};

// Predictor-driven sparse FFN.
class PredictedSparseFfn : public FfnBlock {
 public:
  // down_t as above; predictors must outlive this.
  static absl::StatusOr<std::unique_ptr<PredictedSparseFfn>> Create(const Model& model,
                                                                    const CpuOps& ops,
                                                                    std::vector<TensorView> down_t,
                                                                    const PredictorSet* predictors);

  absl::Status Forward(int layer, const float* x, int n, float* out) override;
  absl::Status ForwardFromResidual(int layer, const float* residual, const float* x, int n,
                                   float* out) override;
  // Also runs the dense gate and up to compare the prediction with the true activations
  // (perplexity's predictor_recall). Costs a dense FFN's gate and up.
  void set_measure_recall(bool on) { measure_recall_ = on; }
  const SparseFfnStats& stats() const { return stats_; }
  void ResetStats();

 private:
  PredictedSparseFfn(const Model& model, const CpuOps& ops, std::vector<TensorView> down_t,
                     const PredictorSet* predictors);
  void MeasureRecall(int layer, const float* x, int n);

  const Model& model_;
  const CpuOps& ops_;
  std::vector<TensorView> down_t_;
  const PredictorSet* predictors_;
  bool measure_recall_ = false;
  const float* residual_ = nullptr;  // during ForwardFromResidual
  SparseFfnStats stats_;
  std::vector<std::vector<float>> down_norms_;  // [layer][ffn]: |row j of down_t|
  std::vector<float> hidden_, score_, act_, dense_gate_, dense_up_;
  std::vector<int32_t> rows_;
  std::vector<uint8_t> selected_;
};

// |row j| of a [rows, cols] matrix, for every row.
std::vector<float> RowNorms(const TensorView& w);

}  // namespace pinfer
