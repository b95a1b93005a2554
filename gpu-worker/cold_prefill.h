// Who computes a prompt batch's cold FFN rows when the gpu-worker runs on the CUDA backend: the
// cpu-worker (through the shared-memory segment, only the rows each token activates) or the GPU
// itself, streaming every cold row of the layer from a pinned host copy (ColdPath::kStream in
// gpu-worker/cuda/backend.h). This is the glue between the measurements the gpu-worker takes and
// shared/sparse/cost_model.h, kept free of CUDA and gRPC so that the decisions are tested
// without a GPU (tests/service/cold_prefill_test.cc).
//
// Both sides of the comparison are measured in the running process, never guessed:
//  - the stream's copy and product rates by Backend::CalibrateStreaming at start-up (the GPU is
//    the gpu-worker's own, so it can be measured before any request);
//  - the CPU side's cost per active (token, row) pair by timing the real cold exchanges with the
//    cpu-worker. That peer may attach after start-up, so this is measured lazily: until a fit of
//    fixed + per-row-token cost succeeds (samples at two or more distinct row-token counts, at
//    least one per layer with cold rows), `auto` sends every cold row to the CPU, which is also
//    what produces the samples; decode steps keep adding samples afterwards.
// The active rows per token of each layer (what the CPU would compute) come from the same
// exchanges: the cpu-worker reports the (token, neuron) pairs it computed.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "shared/sparse/cost_model.h"

namespace pinfer::gpuworker {

// --cold-prefill: auto (the cost model decides per layer and batch), cpu (never stream), stream
// (every prompt batch the module can stream).
enum class ColdPrefill { kAuto, kCpu, kStream };
absl::StatusOr<ColdPrefill> ParseColdPrefill(absl::string_view text);
const char* ColdPrefillName(ColdPrefill mode);

// Batches up to this many tokens take the module's matrix-vector path, which has no streamed
// variant (kSmallBatch in gpu-worker/cuda/backend_internal.h); decode steps are single tokens.
inline constexpr int kMaxMatvecTokens = 8;

// One layer's cold neurons as placed: what streaming would move.
struct ColdLayerShape {
  int64_t cold_rows = 0;
  double bytes = 0;  // their gate, up and down_t rows
};

// One Backend::CalibrateStreaming result (the module's StreamCalibration, without CUDA types).
struct StreamSample {
  int tokens = 0;
  double bytes = 0, copy_s = 0, flops = 0, compute_s = 0, overlapped_s = 0;
};

// The stream terms of the cost model from several calibrations (layers, batch sizes): the copy
// rate is all bytes over all copy time, the product rate all flops over all product time, the
// fixed part the median over samples of what the overlapped run took beyond its larger part
// (never negative). Fails on no samples or a non-positive size or time.
absl::Status StreamCostsFrom(const std::vector<StreamSample>& samples, ColdCostParams* p);

class ColdPrefillPlanner {
 public:
  struct Decision {
    std::vector<bool> stream;  // [layer]
    int streamed = 0;          // layers set in `stream`
    std::string reason;        // for the log
  };

  // layers: [n_layers]; hidden: the model's hidden size.
  ColdPrefillPlanner(ColdPrefill mode, int hidden, std::vector<ColdLayerShape> layers);

  ColdPrefill mode() const { return mode_; }
  const std::vector<ColdLayerShape>& layers() const { return layers_; }
  // Layers with at least one cold row (the only ones a path is chosen for).
  int cold_layers() const { return cold_layers_; }

  absl::Status SetStreamCalibration(const std::vector<StreamSample>& samples);
  bool stream_calibrated() const { return stream_calibrated_; }

  // One timed cold exchange with the cpu-worker: `tokens` tokens of `layer`, `row_tokens`
  // (token, neuron) pairs computed there, `seconds` from posting the input to having the answer.
  void ObserveCpu(int layer, int tokens, double row_tokens, double seconds);
  // Whether the CPU's costs are fitted (refits if samples arrived since the last call).
  bool cpu_calibrated();
  // Timed exchanges kept for the fit.
  int cpu_samples() const {
    return static_cast<int>(decode_samples_.size() + prompt_samples_.size());
  }
  // Mean active cold rows per token of `layer` over its recent exchanges; < 0 before any.
  double RowsPerToken(int layer) const;
  const ColdCostParams& params() const { return params_; }

  // Per layer, whether a batch of `tokens` prompt tokens streams its cold rows.
  Decision Decide(int tokens);

  // Samples kept per kind (decode steps, prompt batches), the newest.
  static constexpr size_t kMaxSamples = 64;
  // Weight of the older exchanges in the rows-per-token mean, per new exchange of the layer.
  static constexpr double kRowsDecay = 0.9;

 private:
  ColdPrefill mode_;
  int hidden_;
  std::vector<ColdLayerShape> layers_;
  int cold_layers_ = 0;
  ColdCostParams params_;
  bool stream_calibrated_ = false;
  bool cpu_fitted_ = false, cpu_dirty_ = false;
  std::deque<CpuSample> decode_samples_, prompt_samples_;
  std::vector<double> rows_sum_, tokens_sum_;  // [layer], decayed
};

}  // namespace pinfer::gpuworker
