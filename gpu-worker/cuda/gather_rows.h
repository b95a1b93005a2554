// Gathers rows of three matrices (gate, up, down_t) from pinned host memory into device rows with
// one kernel: idx[2 i] is the source row, idx[2 i + 1] the destination row of pair i (device
// memory); src pointers are device-accessible pinned host memory (cudaMallocHost under UVA).
// row_bytes a multiple of 16, 16-byte aligned bases, count <= 65535.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pinfer {
namespace cuda {

cudaError_t GatherRows(const uint8_t* const src[3], const int64_t* idx, int count, size_t row_bytes,
                       uint8_t* const dst[3], cudaStream_t stream);

}  // namespace cuda
}  // namespace pinfer
