// The CUDA Backend (backend.h): uploads a placement's weights and runs the forward pass on one
// GPU, calling the cold side once per layer while the hot rows of that layer are computed.
//
// One stream carries all GPU work in order; the host only waits where the pinfer split needs it:
// for the FFN input of a layer to reach host memory (an event), and at the end of the step. So
// per layer the GPU runs attention, publishes the FFN input, and goes straight on to the hot
// rows, while the host hands the same input to the cold side; when the cold side returns, its
// contribution is copied up and added together with the hot one.
//
// The backend's parts live in files by responsibility: backend_internal.h (the class and its
// state), backend_upload.cc (the memory plan and upload), backend_step.cc (the forward step),
// backend_cold.cc (the cold exchange, the guesses and streamed cold rows) and
// backend_cache_slots.cc (the adaptive slots). This file holds the module's C entry points.
#include "gpu-worker/cuda/backend.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "gpu-worker/cuda/backend_internal.h"

namespace pinfer {
namespace cuda {

void CudaBackend::Release() {
  if (device_name_.empty() && allocations_.empty()) return;
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (void* p : allocations_) cudaFree(p);
  for (void* p : host_allocations_) cudaFreeHost(p);
  if (repack_tmp_ != nullptr) cudaFree(repack_tmp_);
  repack_tmp_ = nullptr;
  allocations_.clear();
  host_allocations_.clear();
  streamer_.reset();
  for (auto* v : {&ev_x_, &ev_hot0_, &ev_hot1_, &ev_share_, &ev_attn0_, &ev_signal_}) {
    for (cudaEvent_t e : *v) cudaEventDestroy(e);
    v->clear();
  }
  if (ev_start_ != nullptr) cudaEventDestroy(ev_start_);
  if (ev_layers_end_ != nullptr) cudaEventDestroy(ev_layers_end_);
  for (cudaEvent_t e : ev_guess_) cudaEventDestroy(e);
  ev_guess_.clear();
  for (cudaEvent_t* e : {&ev_gfork_, &ev_gjoin_}) {
    if (*e != nullptr) cudaEventDestroy(*e);
    *e = nullptr;
  }
  if (guess_stream_ != nullptr) cudaStreamDestroy(guess_stream_);
  guess_stream_ = nullptr;
  if (ev_fork_ != nullptr) cudaEventDestroy(ev_fork_);
  if (ev_join_ != nullptr) cudaEventDestroy(ev_join_);
  if (publish_stream_ != nullptr) cudaStreamDestroy(publish_stream_);
  ev_fork_ = ev_join_ = nullptr;
  publish_stream_ = nullptr;
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  stream_ = nullptr;
  cublas_ = nullptr;
}

}  // namespace cuda
}  // namespace pinfer

namespace {
// Lanes run several streams at once (each lane its compute and publish streams), and a lane's
// queued layer waits on the GPU for its host signal (WaitHostFlag). The driver maps streams onto
// CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default); two streams on one queue run in
// order, so a waiting kernel of one lane can hold back the copy that publishes another lane's FFN
// input, whose cold rows the first lane's signal waits behind. With four lanes (nine streams) the
// service hung once on the H200, most likely so; with 32 queues, which give every stream of
// kMaxLanes lanes its own, four and eight lanes ran without a hang. Set when the module
// loads, before the process's first CUDA call creates the context; a value the user set stays.
__attribute__((constructor)) void EnoughHardwareQueues() {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
}
}  // namespace

extern "C" int pinfer_cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

extern "C" int pinfer_cuda_create_backend(const pinfer::cuda::ModelUpload* model,
                                          pinfer::cuda::Backend** out, char* err, size_t err_len) {
  auto backend = std::make_unique<pinfer::cuda::CudaBackend>();
  pinfer::cuda::BackendStatus st = backend->Create(*model);
  if (!st.ok()) {
    if (err != nullptr && err_len > 0) std::snprintf(err, err_len, "%s", st.message.c_str());
    return static_cast<int>(st.code);
  }
  *out = backend.release();
  return 0;
}

extern "C" void pinfer_cuda_destroy_backend(pinfer::cuda::Backend* backend) { delete backend; }
