// Rows of pinned host memory gathered straight into device rows by a kernel (zero-copy reads over
// PCIe), for the adaptive hot set's cache loads: a load moves a few dozen scattered 10 KB rows
// per layer, and one cudaMemcpyAsync per row would cost the host thread microseconds each
// (thousands per update); one launch per layer and matrix triple costs one.
#include <cuda_runtime.h>

#include "gpu-worker/cuda/gather_rows.h"

namespace pinfer {
namespace cuda {
namespace {

__global__ void GatherRowsKernel(const uint8_t* __restrict__ s0, const uint8_t* __restrict__ s1,
                                 const uint8_t* __restrict__ s2, const int64_t* __restrict__ idx,
                                 size_t row_bytes, uint8_t* d0, uint8_t* d1, uint8_t* d2) {
  const int i = blockIdx.y, m = blockIdx.z;
  const uint8_t* src = (m == 0 ? s0 : m == 1 ? s1 : s2) + idx[2 * i] * row_bytes;
  uint8_t* dst = (m == 0 ? d0 : m == 1 ? d1 : d2) + idx[2 * i + 1] * row_bytes;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x * 16;
  for (size_t off = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 16;
       off < row_bytes; off += step) {
    *reinterpret_cast<uint4*>(dst + off) = *reinterpret_cast<const uint4*>(src + off);
  }
}

}  // namespace

cudaError_t GatherRows(const uint8_t* const src[3], const int64_t* idx, int count, size_t row_bytes,
                       uint8_t* const dst[3], cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (row_bytes % 16 != 0 || count > 65535) return cudaErrorInvalidValue;
  for (int m = 0; m < 3; ++m) {
    if (reinterpret_cast<uintptr_t>(src[m]) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(dst[m]) % 16 != 0) {
      return cudaErrorMisalignedAddress;
    }
  }
  const int threads = 256;
  const unsigned bx = static_cast<unsigned>((row_bytes / 16 + threads - 1) / threads);
  GatherRowsKernel<<<dim3(bx, count, 3), threads, 0, stream>>>(src[0], src[1], src[2], idx,
                                                               row_bytes, dst[0], dst[1], dst[2]);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace pinfer
