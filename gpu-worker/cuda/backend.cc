// The CUDA module's entry points (backend.h): the extern "C" functions the gpu-worker finds with
// dlsym, and the one setting that must be made when the module loads. The Backend they create is
// CudaBackend (backend_internal.h), implemented by role so that each part can be read on its own:
//
//   backend_upload.cc       the memory plan and upload of weights, scratch and lanes
//   backend_step.cc         one forward step: layers, CUDA graphs, the output head
//   backend_cold.cc         the exchange with the cold side, its guesses, streamed cold rows
//   backend_cache_slots.cc  the adaptive hot set's slots
//
// One stream carries all GPU work in order; the host only waits where the pinfer split needs it:
// for the FFN input of a layer to reach host memory (an event), and at the end of the step. So
// per layer the GPU runs attention, publishes the FFN input, and goes straight on to the hot
// rows, while the host hands the same input to the cold side; when the cold side returns, its
// contribution is copied up and added together with the hot one.
#include "gpu-worker/cuda/backend.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "gpu-worker/cuda/backend_internal.h"

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
