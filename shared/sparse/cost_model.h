// Who computes a layer's cold FFN rows for a batch of tokens: the CPU (the cpu-worker, only the
// active rows, token by token) or the GPU after streaming every cold row over PCIe. The answer
// depends on the batch: the CPU's time grows with tokens x active rows, the stream's is the
// bytes over the host->GPU bandwidth (the products on the tensor cores hide behind the copies
// until batches get very large). Every rate in the model is measured on the machine it runs on
// (CalibrateStreaming in the CUDA backend for the copy and the products, timed cold-side calls
// for the CPU) and never guessed, so the crossover moves with the hardware by itself.
//
//   cpu(n)    = cpu_fixed_s + active_row_tokens * cpu_s_per_row_token
//   stream(n) = stream_fixed_s + max(bytes / h2d_bytes_per_s,
//                                    2 * n * cold_rows * 3 * hidden / gpu_flops_per_s)
//
// (gate, up and down_t make three [cold_rows, hidden] products per layer.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pinfer {

struct ColdCostParams {
  double h2d_bytes_per_s = 0;      // host->GPU copy of pinned rows
  double gpu_flops_per_s = 0;      // the streamed products' effective rate
  double stream_fixed_s = 0;       // per streamed layer: launches, chunk hand-offs
  double cpu_fixed_s = 0;          // per cold call: exchange, wake-ups, reductions
  double cpu_s_per_row_token = 0;  // per active cold row and token
};

// One layer's cold work for one batch.
struct ColdLayerWork {
  int tokens = 0;
  int64_t cold_rows = 0;  // every cold neuron (what streaming moves and multiplies)
  double bytes = 0;       // their gate, up and down_t rows
  int hidden = 0;
  double active_row_tokens = 0;  // sum over tokens of the active cold rows (the CPU's work)
};

struct ColdPathChoice {
  double cpu_s = 0;
  double stream_s = 0;
  bool stream = false;  // stream_s < cpu_s (ties go to the CPU, which needs no VRAM traffic)
  std::string Describe() const;
};

// Fails with InvalidArgument when a rate the estimate needs is not positive.
absl::StatusOr<ColdPathChoice> ChooseColdPath(const ColdCostParams& p, const ColdLayerWork& w);

// The stream terms from one measured layer: copy_s for `bytes`, compute_s for `flops`, and
// overlapped_s for both as the backend runs them (the excess over the larger part is the fixed
// cost). Fails when a time is not positive.
absl::Status SetStreamCosts(double bytes, double copy_s, double flops, double compute_s,
                            double overlapped_s, ColdCostParams* p);

// Least-squares fit of cpu_fixed_s and cpu_s_per_row_token from timed cold calls
// (seconds = fixed + row_tokens * per_row_token). Needs two distinct row_tokens values; a
// negative fixed part (timing noise) is clamped to 0 and the slope refitted through the origin.
struct CpuSample {
  double row_tokens = 0;
  double seconds = 0;
};
absl::Status FitCpuCosts(const std::vector<CpuSample>& samples, ColdCostParams* p);

// The smallest batch in [1, max_tokens] at which streaming wins, when every token activates
// rows_per_token cold rows; 0 if it never does.
int StreamCrossover(const ColdCostParams& p, int64_t cold_rows, double bytes, int hidden,
                    double rows_per_token, int max_tokens);

}  // namespace pinfer
