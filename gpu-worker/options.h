// The gpu-worker's command line: the Options struct every other part of the process reads, the
// usage text printed on a wrong argument, and ParseOptions, which checks each flag's range and the
// flags that exclude or need each other (--vram-budget against --placement/--hot-fraction,
// --cold-guess and --adaptive-cache-rows needing --sparse, ...). Nothing here touches the model or
// the GPU; main.cc decides what the options mean once the model is loaded.
#ifndef PINFER_GPU_WORKER_OPTIONS_H_
#define PINFER_GPU_WORKER_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu-worker/cold_prefill.h"

namespace pinfer::gpuworker {

// The usage message, printed with exit code 2 when ParseOptions fails.
extern const char kUsage[];

struct Options {
  std::string model, listen = "127.0.0.1:0", port_file, segment, metrics_port, metrics_port_file;
  std::string backend = "auto", cuda_module, placement;
  std::string chat_template;  // --chat-template FILE; empty: the model's own template
  uint64_t vram_budget = 0;  // 0: not given
  bool hot_fraction_given = false;
  int threads = 1;
  double hot_fraction = 0.5;
  int max_batch_tokens = 128;
  int max_sequences = 64;
  int max_new_tokens_limit = 4096;
  int gpu_slots = 8, max_context = 0, cuda_device = 0;
  int64_t exchange_timeout_ms = 30000, liveness_ms = 2000, drain_timeout_ms = 30000;
  // How long a wait for the cpu-worker's answer polls before it sleeps on a futex.
  int64_t exchange_spin_us = 20;
  bool sparse = false;
  bool gpu_timing = false;
  ColdPrefill cold_prefill = ColdPrefill::kAuto;
  bool cold_prefill_given = false;
  int stream_chunk_rows = 1024, stream_slots = 2;
  int adaptive_cache_rows = 0;
  double cold_gpu_share = 0;
  bool cold_gpu_share_auto = true;
  int decode_lanes = 2;
  bool decode_lanes_given = false;
  bool cold_guess = false;
  bool adaptive_cache_thread = false;
  int prefix_cache_entries = 8;               // 0: no prefix caching
  uint64_t prefix_cache_bytes = 1ull << 30;  // CPU backend KV caches kept (GPU slots are fixed)
  int prefix_cache_min_tokens = 16;
};
// Parses the arguments after the program name; an error names the offending flag.
absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args);

}  // namespace pinfer::gpuworker

#endif  // PINFER_GPU_WORKER_OPTIONS_H_
