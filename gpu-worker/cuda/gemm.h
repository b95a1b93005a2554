// Dense and batched matrix products through cuBLAS, for prompt batches and any n too large for
// the matrix-vector kernels: weights in any stored type are converted to fp16 in a caller-owned
// scratch buffer (fp16 weights are used in place), activations are split into two fp16 parts
// (x = hi + lo, so they keep about 22 bits), and cuBLAS multiplies both on the tensor cores with
// fp32 accumulation and fp32 output. Prompt batches thus stay within fp32 rounding of the
// reference for fp16 weights, at twice the (cheap) tensor-core work. fp32 weights take the
// plain fp32 path instead. Kept apart from kernels.h so that only code that links cuBLAS sees
// its handle type.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "gpu-worker/cuda/kernels.h"

namespace pinfer {
namespace cuda {

// Scratch a product needs: fp16 weights (unless already fp16 or fp32) and fp16 activations.
struct GemmScratch {
  void* w_half = nullptr;  // >= rows * cols halves when w is quantized or bf16
  size_t w_half_bytes = 0;
  void* x_half = nullptr;  // >= 2 * n * max(rows, cols) halves (hi and lo parts)
  size_t x_half_bytes = 0;
};

// Bytes of scratch the two products need for a matrix of rows x cols and n tokens.
size_t GemmWeightScratchBytes(const DeviceMatrix& w);
size_t GemmActivationScratchBytes(const DeviceMatrix& w, int n);

// Both return 0 on success, else a cublasStatus_t value (>0) or, for a failed conversion
// kernel, 1000 + the cudaError_t.
// y[t * ldy + r] = x[t, :] . w.row(r) + beta * y[t * ldy + r];  x: [n, w.cols]
int GemmXWt(cublasHandle_t h, const DeviceMatrix& w, const float* x, int n, float* y, int ldy,
            float beta, const GemmScratch& s, cudaStream_t stream);
// y[t, :] = sum_i a[t * lda + i] * w.row(i) + beta * y[t, :];  y: [n, w.cols], i < w.rows
int GemmAW(cublasHandle_t h, const DeviceMatrix& w, const float* a, int lda, int n, float* y,
           float beta, const GemmScratch& s, cudaStream_t stream);

const char* GemmErrorString(int code);

}  // namespace cuda
}  // namespace pinfer
