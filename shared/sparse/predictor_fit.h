// The numeric steps of predictor training (predictor_training.h) on any features: the targets a
// layer's predictor learns (from FFN inputs through the real gate, up and down), the closed-form
// start from a linear model of the gate, and the Adam fine-tuning on the contribution-weighted
// BCE. TrainPredictors runs them on the FFN input, where the gate is exactly linear; studies of
// other features (bench/sparse/lookahead_study.cc: the layer's input, before its attention) run
// the same steps with a fitted linear model of the gate instead.
#pragma once

#include <cstdint>
#include <vector>

#include "shared/engine/ops.h"
#include "shared/model/model.h"
#include "shared/sparse/predictor_training.h"

namespace pinfer {

// y: [n, rows] = x: [n, cols] @ w^T for a row-major fp32 w: [rows, cols], through ops (SIMD,
// threads).
void MatMulF32(const CpuOps& ops, const float* w, int64_t rows, int64_t cols, const float* x, int n,
               float* y);
// out: [cols, rows] = a^T for a: [rows, cols].
void Transpose(const float* a, int64_t rows, int64_t cols, float* out);
// c: [m, n] = a: [m, k] @ b: [k, n] (all row-major), single-threaded.
void GemmNN(const float* a, const float* b, float* c, int64_t m, int64_t k, int64_t n);

// What layer `layer`'s predictor learns about tokens with FFN inputs ffn_x: [n, hidden], the
// statistics taken over the first n_train of them.
struct FfnTargets {
  std::vector<float> gate;                    // [n, ffn] gate pre-activations (keep_gate only)
  std::vector<float> importance;              // [n, ffn]: contribution when truly active, else 0
  std::vector<float> unit_contribution;       // [ffn]: contribution per unit of relu(gate)
  std::vector<float> mean_active_importance;  // [ffn]: mean contribution when active
  double mean_positive_importance = 0;
};
FfnTargets ComputeFfnTargets(const Model& model, const CpuOps& ops, int layer, const float* ffn_x,
                             int64_t n, int64_t n_train, bool keep_gate);

// E[x x^T]: [hidden, hidden] over the rows [0, n_train) of x: [n, hidden].
std::vector<float> SecondMoment(const CpuOps& ops, const float* x, int64_t n_train, int hidden);

// The closed-form start: with the gate modelled as g = wg u (wg: [ffn, hidden] over features u
// with second moment second_moment), the best rank-(r/2) linear predictor of the gate weighted by
// unit_contribution (null: unweighted), written as an MLP with r hidden units (fc1 = [B; -B],
// fc2 = [A, -A]) whose fc2 rows are scaled into logits of P(g > 0) by each neuron's residual
// spread (plus resid_var[j], the linear model's own error, when given). w1: [r, hidden], w2:
// [ffn, r].
void ClosedFormPredictor(const std::vector<float>& wg, const std::vector<float>* unit_contribution,
                         const std::vector<float>& second_moment,
                         const std::vector<float>* resid_var, int hidden, int ffn, int r,
                         uint32_t seed, std::vector<float>* w1, std::vector<float>* w2);

// Adam on the contribution-weighted BCE (PredictorTrainingOptions) over the first n_train rows of
// features x: [n, hidden] with targets importance: [n, ffn]; w1: [r, hidden], w2: [ffn, r] in
// place.
void FineTunePredictor(const CpuOps& ops, const float* x, const float* importance,
                       double mean_positive_importance, int64_t n_train, int hidden, int ffn, int r,
                       const PredictorTrainingOptions& o, uint32_t seed, std::vector<float>* w1,
                       std::vector<float>* w2);

}  // namespace pinfer
