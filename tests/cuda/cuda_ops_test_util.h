// Every CUDA operator (gpu-worker/cuda/kernels.h, gemm.h) against the plain CPU reference
// (NewReferenceOps; matrix products against the plain loops below, which fix the definition the
// GPU computes), ggml test-backend-ops style: fresh random inputs on every run, the
// normalised mean squared error (as in tests/engine/ops_test.cc) at most 1e-6 where the GPU
// computes in fp32 (every row kernel, whatever the weight type, since weights are expanded to fp32
// exactly) and 1e-3 for cuBLAS products of fp16 / quantized weights (fp16 tensor-core inputs),
// no NaN, and poisoned guard regions around every device output that must come back untouched.
// Without a CUDA device every test skips.
//
// This header is what the op tests share: the fixture (CudaOpsTest), the guarded device buffers,
// the error measure and its limits, random inputs and weights, and the plain references. The tests
// themselves are split by kernel family into cuda_ops_*_test.cc, one executable (cuda_ops_test).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu-worker/cuda/gemm.h"
#include "gpu-worker/cuda/kernels.h"
#include "gtest/gtest.h"
#include "shared/engine/ops.h"
#include "shared/model/config.h"
#include "shared/model/tensor.h"
#include "shared/util/half.h"

namespace pinfer {
namespace cuda_test {

using cuda::DeviceMatrix;
using cuda::WType;

static_assert(static_cast<int>(DType::kF32) == static_cast<int>(WType::kF32));
static_assert(static_cast<int>(DType::kF16) == static_cast<int>(WType::kF16));
static_assert(static_cast<int>(DType::kBF16) == static_cast<int>(WType::kBF16));
static_assert(static_cast<int>(DType::kQ8_0) == static_cast<int>(WType::kQ8_0));
static_assert(static_cast<int>(DType::kQ4_0) == static_cast<int>(WType::kQ4_0));
static_assert(static_cast<int>(DType::kQ4_K) == static_cast<int>(WType::kQ4_K));
static_assert(static_cast<int>(DType::kQ5_K) == static_cast<int>(WType::kQ5_K));
static_assert(static_cast<int>(DType::kQ6_K) == static_cast<int>(WType::kQ6_K));
static_assert(static_cast<int>(Activation::kDRelu) == static_cast<int>(cuda::ActKind::kDRelu));

inline constexpr double kFp32Limit = 1e-6;
inline constexpr double kFp16Limit = 1e-3;

inline bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t _e = (expr);                                         \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e); \
  } while (0)

// A device buffer of T with guard regions on both sides. The payload starts poisoned (all bytes
// 0xff: NaN for floats, -1 for ints) so that an element the kernel should write but does not
// shows up as NaN; the guards hold 0xa5 bytes and must survive.
template <typename T>
class DevBuf {
 public:
  static constexpr size_t kGuardBytes = 256;
  explicit DevBuf(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&raw_, Bytes() + 2 * kGuardBytes), cudaSuccess);
    cudaMemset(raw_, 0xa5, kGuardBytes);
    cudaMemset(static_cast<uint8_t*>(raw_) + kGuardBytes, 0xff, Bytes());
    cudaMemset(static_cast<uint8_t*>(raw_) + kGuardBytes + Bytes(), 0xa5, kGuardBytes);
  }
  DevBuf(const std::vector<T>& v) : DevBuf(v.size()) { Upload(v); }
  ~DevBuf() { cudaFree(raw_); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;

  T* get() { return reinterpret_cast<T*>(static_cast<uint8_t*>(raw_) + kGuardBytes); }
  size_t Bytes() const { return n_ * sizeof(T); }
  void Upload(const std::vector<T>& v) {
    EXPECT_EQ(
        cudaMemcpy(get(), v.data(), std::min(v.size(), n_) * sizeof(T), cudaMemcpyHostToDevice),
        cudaSuccess);
  }
  std::vector<T> Download() {
    std::vector<T> v(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.data(), get(), Bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  bool GuardsIntact() {
    std::vector<uint8_t> g(2 * kGuardBytes);
    cudaDeviceSynchronize();
    cudaMemcpy(g.data(), raw_, kGuardBytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.data() + kGuardBytes, static_cast<uint8_t*>(raw_) + kGuardBytes + Bytes(),
               kGuardBytes, cudaMemcpyDeviceToHost);
    return std::all_of(g.begin(), g.end(), [](uint8_t b) { return b == 0xa5; });
  }

 private:
  void* raw_ = nullptr;
  size_t n_;
};

// Also prints each value, so that the run's log records how far inside the limits the ops are.
inline double Nmse(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    err += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  const double v = ref == 0 ? err : err / ref;
  std::printf("  nmse %-45s %.3g\n",
              ::testing::UnitTest::GetInstance()->current_test_info()->name(), v);
  return v;
}

inline bool AnyNan(const std::vector<float>& a) {
  return std::any_of(a.begin(), a.end(), [](float v) { return std::isnan(v); });
}
// Untouched: DevBuf fills a fresh buffer with NaN.
inline bool AllNan(const std::vector<float>& a) {
  return std::all_of(a.begin(), a.end(), [](float v) { return std::isnan(v); });
}

// Bit for bit equal, NaN included (which == is not).
template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Fresh seed per run, printed so a failure can be replayed.
inline std::mt19937& Rng() {
  static std::mt19937 rng = [] {
    const unsigned seed = std::random_device{}();
    std::printf("cuda_ops_test seed %u\n", seed);
    return std::mt19937(seed);
  }();
  return rng;
}

inline std::vector<float> Random(size_t n, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(Rng());
  return v;
}

// A random weight matrix stored in `type` (quantized with ggml's reference rounding).
struct HostWeights {
  DType type;
  int64_t rows, cols;
  std::vector<uint8_t> bytes;
  TensorView view() const {
    TensorView t;
    t.dtype = type;
    t.shape = {rows, cols};
    t.data = bytes.data();
    return t;
  }
};

inline HostWeights RandomWeights(DType type, int64_t rows, int64_t cols, float scale = 0.05f) {
  HostWeights w{type, rows, cols, {}};
  const size_t rb = RowBytes(type, cols);
  w.bytes.resize(rb * rows);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> v = Random(cols, scale);
    QuantizeRow(type, v.data(), w.bytes.data() + r * rb, cols);
  }
  return w;
}

inline DeviceMatrix ToDevice(const HostWeights& w, DevBuf<uint8_t>* buf) {
  buf->Upload(w.bytes);
  DeviceMatrix d;
  d.type = static_cast<WType>(w.type);
  d.rows = w.rows;
  d.cols = w.cols;
  d.data = buf->get();
  return d;
}

// The split layout of a block-format matrix (kernels.h), made on the GPU from the GGUF bytes.
inline DeviceMatrix ToDeviceSplit(const HostWeights& w, DevBuf<uint8_t>* gguf,
                                  DevBuf<uint8_t>* split) {
  DeviceMatrix src = ToDevice(w, gguf);
  DeviceMatrix d = src;
  d.data = split->get();
  d.scales = split->get() + cuda::QuantRowBytes(d.type, d.cols) * d.rows;
  EXPECT_EQ(cuda::RepackSplit(src, d, 0, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d;
}

inline constexpr DType kAllTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0,
                                      DType::kQ4_0};

// Distinct random row ids in random order.
inline std::vector<int32_t> RandomRows(int total, int count) {
  std::vector<int32_t> ids(total);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), Rng());
  ids.resize(count);
  return ids;
}

// The matrix products' reference: every weight expanded to fp32 exactly (DequantizeRow) and
// multiplied by fp32 x with an fp32 sum, the definition the GPU row kernels implement (the
// engine's CPU operators may multiply quantized rows by int8 activations instead, llama.cpp's
// definition, which QuantizedActivationsMatchLlamaCppDefinition checks separately).
inline void RefMatMulRows(const TensorView& w, const int32_t* ids, int count, const float* x, int n,
                          float* y) {
  const int64_t cols = w.cols();
  std::vector<float> row(cols);
  for (int i = 0; i < count; ++i) {
    DequantizeRow(w.dtype, w.row(ids != nullptr ? ids[i] : i), row.data(), cols);
    for (int t = 0; t < n; ++t) {
      float sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += row[c] * x[t * cols + c];
      y[static_cast<size_t>(t) * count + i] = sum;
    }
  }
}
inline void RefMatMul(const TensorView& w, const float* x, int n, float* y) {
  RefMatMulRows(w, nullptr, static_cast<int>(w.rows()), x, n, y);
}

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device here";
    ref_ = NewReferenceOps();
  }
  std::unique_ptr<CpuOps> ref_;
};

// llama.cpp's quantized product, written out here as the plain definition: x quantized to Q8_0
// (d = fp16(max|x| / 127), q = round-half-even(x * (1 / d))), each block contributing
// d_w * d_x * sum_i w_i q_i with w_i the block's integer values (Q4_0: nibble - 8).
inline std::vector<float> Q8xReference(const HostWeights& w, const std::vector<int32_t>& ids,
                                       const std::vector<float>& x, int n) {
  const int64_t cols = w.cols, nblk = cols / 32;
  const size_t rb = RowBytes(w.type, cols), bb = RowBytes(w.type, 32);
  std::vector<float> y(static_cast<size_t>(n) * ids.size());
  for (int t = 0; t < n; ++t) {
    std::vector<int32_t> q(cols);
    std::vector<float> dx(nblk);
    for (int64_t b = 0; b < nblk; ++b) {
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[t * cols + b * 32 + i]));
      const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
      dx[b] = Fp16ToFp32(Fp32ToFp16(d));
      for (int i = 0; i < 32; ++i) {
        q[b * 32 + i] = static_cast<int32_t>(std::nearbyint(x[t * cols + b * 32 + i] * inv));
      }
    }
    for (size_t r = 0; r < ids.size(); ++r) {
      const uint8_t* row = w.bytes.data() + ids[r] * rb;
      double sum = 0;
      for (int64_t b = 0; b < nblk; ++b) {
        const uint8_t* blk = row + b * bb;
        uint16_t dw;
        std::memcpy(&dw, blk, 2);
        int64_t dot = 0;
        for (int i = 0; i < 32; ++i) {
          const int v = w.type == DType::kQ8_0
                            ? static_cast<int8_t>(blk[2 + i])
                            : ((i < 16 ? (blk[2 + i] & 0x0f) : (blk[2 + i - 16] >> 4)) - 8);
          dot += static_cast<int64_t>(v) * q[b * 32 + i];
        }
        sum += static_cast<double>(Fp16ToFp32(dw)) * dx[b] * static_cast<double>(dot);
      }
      y[t * ids.size() + r] = static_cast<float>(sum);
    }
  }
  return y;
}

}  // namespace cuda_test
}  // namespace pinfer
