// The adaptive hot set's slots (ModelUpload::cache_rows): spare device rows after each layer's hot
// rows, into which LoadCacheRows copies the rows of cold neurons that turned hot, from the pinned
// cold copy on the copy stream while steps run, and SetCacheSlots then switches the compaction
// maps so that predicted steps compute those neurons on the GPU and leave them off the cold list.
// Apart from the step because the slots change between steps, driven by the adaptive hot set
// (shared/sparse/hot_cache.h, through gpu-worker/module_cache_slots.h), and a refused call must
// leave the maps as they were.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu-worker/cuda/backend_internal.h"
#include "gpu-worker/cuda/cold_stream.h"
#include "gpu-worker/cuda/gemm.h"
#include "gpu-worker/cuda/kernels.h"
#include "shared/util/half.h"

namespace pinfer {
namespace cuda {

// Adaptive hot set: cold rows into cache slots, from the pinned copy, in the background.
BackendStatus CudaBackend::LoadCacheRows(int layer, const std::vector<int32_t>& slots,
                                         const std::vector<int32_t>& neurons) {
  if (allocate_only_) return AllocateOnlyError();
  if (layer < 0 || layer >= dims_.n_layers || layers_[layer].n_cache == 0 || streamer_ == nullptr ||
      !streamer_->ready()) {
    return Error(Code::kFailedPrecondition,
                 "layer " + std::to_string(layer) + " has no adaptive cache rows");
  }
  const DeviceLayer& L = layers_[layer];
  if (slots.size() != neurons.size()) {
    return Error(Code::kInvalidArgument, "slots and neurons differ in length");
  }
  std::vector<int64_t> cold_index(neurons.size());
  for (size_t i = 0; i < neurons.size(); ++i) {
    auto it = std::lower_bound(L.cold_ids_host.begin(), L.cold_ids_host.end(), neurons[i]);
    if (it == L.cold_ids_host.end() || *it != neurons[i]) {
      return Error(Code::kInvalidArgument, "neuron " + std::to_string(neurons[i]) +
                                               " is not a cold neuron of layer " +
                                               std::to_string(layer));
    }
    if (slots[i] < 0 || slots[i] >= L.n_cache) {
      return Error(Code::kInvalidArgument,
                   "cache slot " + std::to_string(slots[i]) + " of " + std::to_string(L.n_cache));
    }
    cold_index[i] = it - L.cold_ids_host.begin();
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const DeviceMatrix dst[3] = {L.gate_c, L.up_c, L.down_t_c};
  for (size_t i = 0; i < slots.size(); ++i) {
    if (L.slot_neuron[slots[i]] >= 0) {
      return Error(Code::kFailedPrecondition,
                   "cache slot " + std::to_string(slots[i]) + " of layer " + std::to_string(layer) +
                       " still serves neuron " + std::to_string(L.slot_neuron[slots[i]]) +
                       " (SetCacheSlots -1 first)");
    }
  }
  CUDA_RETURN_IF_ERROR(streamer_->LoadRows(L.cold_rows, cold_index, slots, L.n_hot, dst, stream_));
  for (size_t i = 0; i < slots.size(); ++i) layers_[layer].slot_loaded[slots[i]] = neurons[i];
  cache_loaded_ = true;
  return Ok();
}

BackendStatus CudaBackend::SetCacheSlots(int layer, const std::vector<int32_t>& slots,
                                         const std::vector<int32_t>& neurons) {
  if (layer < 0 || layer >= dims_.n_layers || layers_[layer].n_cache == 0) {
    return Error(Code::kFailedPrecondition,
                 "layer " + std::to_string(layer) + " has no adaptive cache rows");
  }
  if (slots.size() != neurons.size()) {
    return Error(Code::kInvalidArgument, "slots and neurons differ in length");
  }
  DeviceLayer& L = layers_[layer];
  bool landed = true;
  if (streamer_ != nullptr && streamer_->ready()) {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(streamer_->RowsLanded(/*wait=*/false, &landed));
  }
  // Applied to copies first, so that a refused call changes nothing.
  std::vector<int32_t> slot_neuron = L.slot_neuron, cold_map = L.cold_map_host;
  auto cold_index = [&](int32_t j) -> int64_t {
    auto it = std::lower_bound(L.cold_ids_host.begin(), L.cold_ids_host.end(), j);
    return it != L.cold_ids_host.end() && *it == j ? it - L.cold_ids_host.begin() : -1;
  };
  for (size_t i = 0; i < slots.size(); ++i) {
    const int s = slots[i];
    if (s < 0 || s >= L.n_cache) {
      return Error(Code::kInvalidArgument,
                   "cache slot " + std::to_string(s) + " of " + std::to_string(L.n_cache));
    }
    if (slot_neuron[s] >= 0) cold_map[cold_index(slot_neuron[s])] = slot_neuron[s];
    slot_neuron[s] = -1;
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const int s = slots[i];
    const int32_t j = neurons[i];
    if (j < 0) continue;
    const int64_t ci = cold_index(j);
    if (ci < 0) {
      return Error(Code::kInvalidArgument, "neuron " + std::to_string(j) +
                                               " is not a cold neuron of layer " +
                                               std::to_string(layer));
    }
    if (L.slot_loaded[s] != j || !landed) {
      return Error(Code::kFailedPrecondition,
                   "cache slot " + std::to_string(s) + " does not hold neuron " +
                       std::to_string(j) + (landed ? "" : " yet (its rows are still loading)"));
    }
    if (cold_map[ci] < 0) {
      return Error(Code::kInvalidArgument,
                   "neuron " + std::to_string(j) + " is given to two cache slots");
    }
    cold_map[ci] = -1;
    slot_neuron[s] = j;
  }
  L.slot_neuron = std::move(slot_neuron);
  L.cold_map_host = std::move(cold_map);
  // From pageable memory: the copies take the values as of now, before the next step's work.
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(L.hot_map_c + L.n_hot, L.slot_neuron.data(),
                                       static_cast<size_t>(L.n_cache) * 4, cudaMemcpyHostToDevice,
                                       stream_));
  if (!L.cold_map_host.empty()) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(L.cold_map_c, L.cold_map_host.data(),
                                         L.cold_map_host.size() * 4, cudaMemcpyHostToDevice,
                                         stream_));
  }
  return Ok();
}

BackendStatus CudaBackend::CacheRowsLanded(bool wait, bool* landed) {
  if (streamer_ == nullptr || !streamer_->ready()) {
    *landed = true;
    return Ok();
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(streamer_->RowsLanded(wait, landed));
  return Ok();
}

}  // namespace cuda
}  // namespace pinfer
