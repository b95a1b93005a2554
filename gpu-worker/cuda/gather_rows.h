// Gathers rows of three matrices (gate, up, down_t; row_bytes[m] each) from pinned host memory
// into device rows with one kernel: idx[2 i] is the source row, idx[2 i + 1] the destination row of
// pair i (device memory); src pointers are device-accessible pinned host memory (cudaMallocHost
// under UVA). Copies in 16-byte units where row_bytes and the bases allow it, else in the widest of
// 8, 4 or 2 bytes that they allow (Q8_0 / Q4_0 rows are multiples of 34 / 18 bytes: 2-byte units at
// the least). count <= 65535.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pinfer {
namespace cuda {

cudaError_t GatherRows(const uint8_t* const src[3], const int64_t* idx, int count,
                       const size_t row_bytes[3], uint8_t* const dst[3], cudaStream_t stream);

}  // namespace cuda
}  // namespace pinfer
