// The adaptive hot set's driver (shared/sparse/hot_cache.h) talking to the CUDA module: the
// CacheSlotTarget calls mapped onto cuda::Backend, and the module's BackendStatus onto
// absl::Status. Header-only, so that the gpu-worker and the module's own tests (which load the
// module with dlopen and link no gpu-worker code) drive the module through the same adapter.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu-worker/cuda/backend.h"
#include "shared/sparse/hot_cache.h"

namespace pinfer::gpuworker {

inline absl::Status ToStatus(const cuda::BackendStatus& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.code), s.message);
}

class ModuleCacheSlots : public CacheSlotTarget {
 public:
  explicit ModuleCacheSlots(cuda::Backend* b) : b_(b) {}
  absl::Status LoadRows(int layer, const std::vector<int32_t>& slots,
                        const std::vector<int32_t>& neurons) override {
    return ToStatus(b_->LoadCacheRows(layer, slots, neurons));
  }
  absl::StatusOr<bool> RowsLanded() override {
    bool landed = false;
    absl::Status st = ToStatus(b_->CacheRowsLanded(/*wait=*/false, &landed));
    if (!st.ok()) return st;
    return landed;
  }
  absl::Status AssignSlots(int layer, const std::vector<int32_t>& slots,
                           const std::vector<int32_t>& neurons) override {
    return ToStatus(b_->SetCacheSlots(layer, slots, neurons));
  }

 private:
  cuda::Backend* b_;
};

}  // namespace pinfer::gpuworker
