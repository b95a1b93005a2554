// Rows of pinned host memory gathered straight into device rows by a kernel (zero-copy reads over
// PCIe), for the adaptive hot set's cache loads: a load moves a few dozen scattered 10 KB rows
// per layer, and one cudaMemcpyAsync per row would cost the host thread microseconds each
// (thousands per update); one launch per layer and matrix triple costs one.
#include <cuda_runtime.h>

#include <algorithm>

#include "gpu-worker/cuda/gather_rows.h"

namespace pinfer {
namespace cuda {
namespace {

template <typename Unit>
__global__ void GatherRowsKernel(const uint8_t* __restrict__ s0, const uint8_t* __restrict__ s1,
                                 const uint8_t* __restrict__ s2, const int64_t* __restrict__ idx,
                                 size_t rb0, size_t rb1, size_t rb2, uint8_t* d0, uint8_t* d1,
                                 uint8_t* d2) {
  const int i = blockIdx.y, m = blockIdx.z;
  const size_t row_bytes = m == 0 ? rb0 : m == 1 ? rb1 : rb2;
  const uint8_t* src = (m == 0 ? s0 : m == 1 ? s1 : s2) + idx[2 * i] * row_bytes;
  uint8_t* dst = (m == 0 ? d0 : m == 1 ? d1 : d2) + idx[2 * i + 1] * row_bytes;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x * sizeof(Unit);
  for (size_t off = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * sizeof(Unit);
       off < row_bytes; off += step) {
    *reinterpret_cast<Unit*>(dst + off) = *reinterpret_cast<const Unit*>(src + off);
  }
}

template <typename Unit>
cudaError_t LaunchGather(const uint8_t* const src[3], const int64_t* idx, int count,
                         const size_t row_bytes[3], uint8_t* const dst[3], cudaStream_t stream) {
  const int threads = 256;
  const size_t widest = std::max({row_bytes[0], row_bytes[1], row_bytes[2]});
  const size_t units = widest / sizeof(Unit);
  const unsigned bx = static_cast<unsigned>((units + threads - 1) / threads);
  GatherRowsKernel<Unit><<<dim3(bx, count, 3), threads, 0, stream>>>(
      src[0], src[1], src[2], idx, row_bytes[0], row_bytes[1], row_bytes[2], dst[0], dst[1],
      dst[2]);
  return cudaGetLastError();
}

}  // namespace

cudaError_t GatherRows(const uint8_t* const src[3], const int64_t* idx, int count,
                       const size_t row_bytes[3], uint8_t* const dst[3], cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count > 65535) return cudaErrorInvalidValue;
  // The widest unit that divides every row size and every base address.
  uintptr_t all = 0;
  for (int m = 0; m < 3; ++m) {
    all |= row_bytes[m] | reinterpret_cast<uintptr_t>(src[m]) | reinterpret_cast<uintptr_t>(dst[m]);
  }
  if (all % 16 == 0) return LaunchGather<uint4>(src, idx, count, row_bytes, dst, stream);
  if (all % 8 == 0) return LaunchGather<uint2>(src, idx, count, row_bytes, dst, stream);
  if (all % 4 == 0) return LaunchGather<uint32_t>(src, idx, count, row_bytes, dst, stream);
  if (all % 2 == 0) return LaunchGather<uint16_t>(src, idx, count, row_bytes, dst, stream);
  return cudaErrorMisalignedAddress;
}

}  // namespace cuda
}  // namespace pinfer
