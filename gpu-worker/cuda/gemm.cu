// cuBLAS products for batches (see gemm.h). Row-major [rows, cols] weights are column-major
// [cols, rows] to cuBLAS, so y = x w^T is C(rows x n) = op_T(W) * X and y = a w is
// C(cols x n) = op_N(W) * A, with every matrix read in place.
#include "gpu-worker/cuda/gemm.h"

#include <cuda_fp16.h>

namespace pinfer {
namespace cuda {
namespace {

bool NeedsWeightScratch(const DeviceMatrix& w) {
  return w.type != WType::kF16 && w.type != WType::kF32;
}

// Returns the weights as fp16 (converting into scratch when needed) or an error code.
int HalfWeights(const DeviceMatrix& w, const GemmScratch& s, cudaStream_t stream,
                const void** out) {
  if (w.type == WType::kF16) {
    *out = w.data;
    return 0;
  }
  const size_t need = static_cast<size_t>(w.rows) * w.cols * sizeof(__half);
  if (s.w_half == nullptr || s.w_half_bytes < need) return CUBLAS_STATUS_INVALID_VALUE;
  cudaError_t e = DequantizeToHalf(w, s.w_half, stream);
  if (e != cudaSuccess) return 1000 + static_cast<int>(e);
  *out = s.w_half;
  return 0;
}

// x = hi + lo with both halves in fp16 (scratch: hi then lo), so that two tensor-core products
// carry x to about 22 bits instead of fp16's 11.
int SplitActivations(const float* x, int64_t count, const GemmScratch& s, cudaStream_t stream,
                     const void** hi, const void** lo) {
  if (s.x_half == nullptr || s.x_half_bytes < 2 * static_cast<size_t>(count) * sizeof(__half)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  __half* h = static_cast<__half*>(s.x_half);
  cudaError_t e = FloatToHalfSplit(x, count, h, h + count, stream);
  *hi = h;
  *lo = h + count;
  return e == cudaSuccess ? 0 : 1000 + static_cast<int>(e);
}

}  // namespace

size_t GemmWeightScratchBytes(const DeviceMatrix& w) {
  return NeedsWeightScratch(w) ? static_cast<size_t>(w.rows) * w.cols * sizeof(__half) : 0;
}

size_t GemmActivationScratchBytes(const DeviceMatrix& w, int n) {
  const int64_t widest = w.rows > w.cols ? w.rows : w.cols;
  return 2 * static_cast<size_t>(n) * widest * sizeof(__half);
}

int GemmXWt(cublasHandle_t h, const DeviceMatrix& w, const float* x, int n, float* y, int ldy,
            float beta, const GemmScratch& s, cudaStream_t stream) {
  if (n <= 0 || w.rows <= 0) return 0;
  cublasStatus_t st = cublasSetStream(h, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const float alpha = 1.f;
  const int m = static_cast<int>(w.rows), k = static_cast<int>(w.cols);
  if (w.type == WType::kF32) {
    return cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha,
                       static_cast<const float*>(w.data), k, x, k, &beta, y, ldy);
  }
  const void* wh = nullptr;
  int rc = HalfWeights(w, s, stream, &wh);
  if (rc != 0) return rc;
  const void *hi = nullptr, *lo = nullptr;
  rc = SplitActivations(x, static_cast<int64_t>(n) * k, s, stream, &hi, &lo);
  if (rc != 0) return rc;
  const float one = 1.f;
  rc = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, wh, CUDA_R_16F, k, hi,
                    CUDA_R_16F, k, &beta, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT);
  if (rc != 0) return rc;
  return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, wh, CUDA_R_16F, k, lo,
                      CUDA_R_16F, k, &one, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

int GemmAW(cublasHandle_t h, const DeviceMatrix& w, const float* a, int lda, int n, float* y,
           float beta, const GemmScratch& s, cudaStream_t stream) {
  if (n <= 0 || w.rows <= 0) return 0;
  cublasStatus_t st = cublasSetStream(h, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const float alpha = 1.f;
  const int m = static_cast<int>(w.cols), k = static_cast<int>(w.rows);
  if (w.type == WType::kF32) {
    return cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha,
                       static_cast<const float*>(w.data), m, a, lda, &beta, y, m);
  }
  const void* wh = nullptr;
  int rc = HalfWeights(w, s, stream, &wh);
  if (rc != 0) return rc;
  const void *hi = nullptr, *lo = nullptr;
  rc = SplitActivations(a, static_cast<int64_t>(n) * lda, s, stream, &hi, &lo);
  if (rc != 0) return rc;
  const float one = 1.f;
  rc = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, wh, CUDA_R_16F, m, hi,
                    CUDA_R_16F, lda, &beta, y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT);
  if (rc != 0) return rc;
  return cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, wh, CUDA_R_16F, m, lo,
                      CUDA_R_16F, lda, &one, y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

const char* GemmErrorString(int code) {
  if (code == 0) return "success";
  if (code >= 1000) return cudaGetErrorString(static_cast<cudaError_t>(code - 1000));
  return cublasGetStatusString(static_cast<cublasStatus_t>(code));
}

}  // namespace cuda
}  // namespace pinfer
