// The gpu-worker's start-up steps, in the order main.cc's Main() takes them once the model is
// loaded: probe for a GPU, decide who computes prompt batches' cold rows, choose the placement
// (a GPU index, a VRAM budget or a fixed fraction), create the activation segment the cpu-worker
// attaches to, and build the backend (CUDA when it starts, else the CPU). Each step fills its part
// of the State; one that returns false has logged why and the process exits with code 1.
#ifndef PINFER_GPU_WORKER_STARTUP_H_
#define PINFER_GPU_WORKER_STARTUP_H_

#include <cstdint>
#include <string>

#include "gpu-worker/backend.h"
#include "gpu-worker/options.h"
#include "gpu-worker/worker_service.h"

namespace pinfer::gpuworker {

// Whether a GPU can be used. The CUDA backend lives in a module loaded with dlopen
// (gpu-worker/cuda); when it or a device is missing the worker computes on the CPU.
GpuProbe ProbeGpu(const Options& o);

// Sets s.cold_prefill: streamed cold rows for prompt batches are CUDA only, and only for models
// whose cold rows can be streamed (decided before the VRAM plan, which counts the stream's device
// buffers). False when --cold-prefill stream was asked for and cannot be had.
bool DecideColdPrefill(State& s);

// Sets s.placement (and s.vram_plan with --vram-budget); needs s.ops for profiling.
bool ChoosePlacement(State& s);

// Creates the activation segment, writes the placement into it and sets s.exchange.
bool CreateExchange(State& s);

// Builds s.backend, drops the model pages that building it read, and sets s.cold_bytes_estimate.
bool CreateBackend(State& s);

// "12.3 MiB", for the log.
std::string MiB(uint64_t bytes);

}  // namespace pinfer::gpuworker

#endif  // PINFER_GPU_WORKER_STARTUP_H_
