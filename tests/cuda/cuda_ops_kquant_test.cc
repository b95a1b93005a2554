// The K-quant products (kquant_products.cu) and the slow paths that read K-quant rows (Embed,
// DequantizeToHalf for cuBLAS): Q4_K, Q5_K and Q6_K rows made by ggml's reference quantizers
// (shared/model/kquant_quantize.cc), against plain definitions written out here.
// Judged as cuda_ops_test_util.h says; without a CUDA device every test skips.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/cuda/cuda_ops_test_util.h"

namespace pinfer {
namespace cuda_test {
namespace {

constexpr DType kKTypes[] = {DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};

// llama.cpp's CUDA definition of a K-quant row times x (mmvq): x quantized to Q8_0 blocks of 32
// (d = fp16(max|x| / 127), q = round-half-even(x / d)), each block contributing d_x times the sum
// of the row's dequantized values (ggml's dequantize_row_q*_K, exact in fp32 here since they are
// fp16 scales times small integers) times q; summed in double.
std::vector<float> KQ8xReference(const HostWeights& w, const std::vector<int32_t>& ids,
                                 const std::vector<float>& x, int n) {
  const int64_t cols = w.cols, nblk = cols / 32;
  std::vector<float> y(static_cast<size_t>(n) * ids.size());
  std::vector<float> row(cols);
  for (int t = 0; t < n; ++t) {
    std::vector<int32_t> q(cols);
    std::vector<double> dx(nblk);
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
      DequantizeRow(w.type, w.view().row(ids[r]), row.data(), cols);
      double sum = 0;
      for (int64_t b = 0; b < nblk; ++b) {
        double s = 0;
        for (int i = 0; i < 32; ++i) s += static_cast<double>(row[b * 32 + i]) * q[b * 32 + i];
        sum += dx[b] * s;
      }
      y[t * ids.size() + r] = static_cast<float>(sum);
    }
  }
  return y;
}

// n random tokens of `cols` through an RMS norm that also quantizes its output for the int8
// product, as the producers do (out_qx): norm [n, cols] and qx (QxBytes(cols) a token).
void NormWithProducerQx(int64_t cols, int n, DevBuf<float>* norm, DevBuf<uint8_t>* qx) {
  DevBuf<float> dx(Random(static_cast<size_t>(n) * cols)), dg(Random(cols, 1.f));
  CUDA_OK(cuda::RmsNorm(dx.get(), dg.get(), n, static_cast<int>(cols), 1e-5f, norm->get(), nullptr,
                        qx->get()));
}

std::vector<int32_t> Iota(int n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// All rows and listed rows with a device count below the bound, one and several tokens (11: two
// passes of the token loop), against llama.cpp's definition; and against the exact fp32 product
// within the rounding of x to int8. 1280 columns: five super-blocks, so Q6_K's rows (1050 bytes)
// are only 2-byte aligned and a warp's last step takes one super-block of four.
TEST_F(CudaOpsTest, KQuantMatVecRowsMatchesLlamaCppDefinition) {
  for (DType type : kKTypes) {
    for (int64_t cols : {256, 1280, 4096}) {
      const int64_t rows = 301;
      HostWeights w = RandomWeights(type, rows, cols);
      DevBuf<uint8_t> dw(w.bytes.size());
      DeviceMatrix m = ToDevice(w, &dw);
      for (int n : {1, 3, 11}) {
        std::vector<float> x = Random(static_cast<size_t>(n) * cols);
        DevBuf<float> dx(x);
        {
          const std::vector<float> ref = KQ8xReference(w, Iota(rows), x, n);
          DevBuf<float> dy(ref.size());
          CUDA_OK(
              cuda::MatVecRows(m, nullptr, rows, nullptr, dx.get(), n, dy.get(), rows, nullptr));
          const std::vector<float> out = dy.Download();
          EXPECT_FALSE(AnyNan(out)) << DTypeName(type) << " cols " << cols << " n " << n;
          EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type) << " cols " << cols;
          EXPECT_TRUE(dy.GuardsIntact());
          std::vector<float> exact(ref.size());
          RefMatMul(w.view(), x.data(), n, exact.data());
          EXPECT_LE(Nmse(out, exact), 1e-4) << DTypeName(type) << " against fp32 x";
        }
        {
          const int bound = 120, count = 97, ldy = 128;
          std::vector<int32_t> ids = RandomRows(rows, bound);
          const std::vector<int32_t> listed(ids.begin(), ids.begin() + count);
          const std::vector<float> ref = KQ8xReference(w, listed, x, n);
          DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
          DevBuf<float> dy(static_cast<size_t>(n) * ldy);
          CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dx.get(), n, dy.get(), ldy,
                                   nullptr));
          std::vector<float> all = dy.Download(), out;
          for (int t = 0; t < n; ++t) {
            for (int i = 0; i < ldy; ++i) {
              if (i < count) {
                out.push_back(all[t * ldy + i]);
              } else {
                EXPECT_TRUE(std::isnan(all[t * ldy + i])) << "wrote past the count at " << i;
              }
            }
          }
          EXPECT_FALSE(AnyNan(out));
          EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type) << " listed, n " << n;
          EXPECT_TRUE(dy.GuardsIntact());
        }
      }
    }
  }
}

// x quantized by its producer (a norm's out_qx) gives the product the very values it would
// compute for itself: the same result bit for bit.
TEST_F(CudaOpsTest, KQuantMatVecTakesProducerQuantizedX) {
  for (DType type : kKTypes) {
    const int64_t rows = 257, cols = 2048;
    HostWeights w = RandomWeights(type, rows, cols);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    for (int n : {1, 5}) {
      DevBuf<float> dnorm(static_cast<size_t>(n) * cols);
      DevBuf<uint8_t> dq(cuda::QxBytes(cols) * n);
      NormWithProducerQx(cols, n, &dnorm, &dq);
      DevBuf<float> own(static_cast<size_t>(n) * rows), given(static_cast<size_t>(n) * rows);
      CUDA_OK(
          cuda::MatVecRows(m, nullptr, rows, nullptr, dnorm.get(), n, own.get(), rows, nullptr));
      CUDA_OK(cuda::MatVecRows(m, nullptr, rows, nullptr, dnorm.get(), n, given.get(), rows,
                               nullptr, dq.get()));
      EXPECT_TRUE(SameBits(own.Download(), given.Download())) << DTypeName(type) << " n " << n;
      EXPECT_FALSE(AnyNan(given.Download()));
    }
  }
}

// Every launch shape of the product (warps a block, the register limit of the one-token kernel)
// gives the same values bit for bit, over all rows and over listed rows with a device count (and
// writes nothing past the count).
TEST_F(CudaOpsTest, KQuantMatVecShapesAgreeBitForBit) {
  for (DType type : kKTypes) {
    const int64_t rows = 203, cols = 1280;
    HostWeights w = RandomWeights(type, rows, cols);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    const int bound = 120, count = 97, ldy = 128;
    std::vector<int32_t> ids = RandomRows(rows, bound);
    DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
    for (int n : {1, 5}) {
      DevBuf<float> dnorm(static_cast<size_t>(n) * cols);
      DevBuf<uint8_t> dq(cuda::QxBytes(cols) * n);
      NormWithProducerQx(cols, n, &dnorm, &dq);
      cuda::SetKMatVecShape(8, 1);
      DevBuf<float> want(static_cast<size_t>(n) * rows), want_listed(static_cast<size_t>(n) * ldy);
      CUDA_OK(cuda::MatVecRows(m, nullptr, rows, nullptr, dnorm.get(), n, want.get(), rows, nullptr,
                               dq.get()));
      CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dnorm.get(), n,
                               want_listed.get(), ldy, nullptr, dq.get()));
      for (int warps : {4, 8}) {
        for (int min_blocks : {1, 4, 5, 6}) {
          cuda::SetKMatVecShape(warps, min_blocks);
          const std::string shape = std::string(DTypeName(type)) + " " + std::to_string(warps) +
                                    " warps, " + std::to_string(min_blocks) + " blocks, n " +
                                    std::to_string(n);
          DevBuf<float> got(static_cast<size_t>(n) * rows), listed(static_cast<size_t>(n) * ldy);
          CUDA_OK(cuda::MatVecRows(m, nullptr, rows, nullptr, dnorm.get(), n, got.get(), rows,
                                   nullptr, dq.get()));
          CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dnorm.get(), n, listed.get(),
                                   ldy, nullptr, dq.get()));
          EXPECT_TRUE(SameBits(got.Download(), want.Download())) << shape;
          const std::vector<float> a = listed.Download(), b = want_listed.Download();
          for (int t = 0; t < n; ++t) {
            for (int i = 0; i < ldy; ++i) {
              const float u = a[t * ldy + i], v = b[t * ldy + i];
              if (i < count) {
                EXPECT_EQ(std::memcmp(&u, &v, 4), 0) << shape << " listed row " << i;
              } else {
                EXPECT_TRUE(std::isnan(u)) << shape << " wrote past the count at " << i;
              }
            }
          }
          EXPECT_TRUE(got.GuardsIntact() && listed.GuardsIntact()) << shape;
        }
      }
      cuda::SetKMatVecShape(8, 5);
    }
  }
}

// The sparse down projection over K-quant rows: listed rows, zero coefficients, a device count,
// added to what y holds; the reference is the CPU reference operator (exact fp32 weights).
TEST_F(CudaOpsTest, KQuantAccumulateRowsMatchesReference) {
  for (DType type : kKTypes) {
    for (int64_t cols : {1280, 4096}) {
      const int64_t rows = 301;
      HostWeights w = RandomWeights(type, rows, cols);
      DevBuf<uint8_t> dw(w.bytes.size());
      DeviceMatrix m = ToDevice(w, &dw);
      for (int n : {1, 3}) {
        const int bound = 200, count = 177, lda = bound + 3;
        std::vector<int32_t> ids = RandomRows(rows, bound);
        std::vector<float> a = Random(static_cast<size_t>(n) * lda);
        std::bernoulli_distribution zero(0.3);
        for (float& v : a) {
          if (zero(Rng())) v = 0.f;
        }
        std::vector<float> packed(static_cast<size_t>(n) * count);
        for (int t = 0; t < n; ++t) {
          for (int i = 0; i < count; ++i) packed[t * count + i] = a[t * lda + i];
        }
        std::vector<float> y0 = Random(static_cast<size_t>(n) * cols), ref = y0;
        ref_->AccumulateRows(w.view(), ids.data(), count, packed.data(), n, ref.data());
        DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
        DevBuf<float> da(a), dy(y0);
        CUDA_OK(cuda::AccumulateRows(m, dids.get(), bound, dcount.get(), da.get(), lda, n, dy.get(),
                                     nullptr));
        const std::vector<float> out = dy.Download();
        EXPECT_FALSE(AnyNan(out));
        EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type) << " cols " << cols << " n " << n;
        EXPECT_TRUE(dy.GuardsIntact());
      }
    }
  }
}

// Embedding rows are exactly ggml's dequantized values; cuBLAS products go through their fp16
// expansion (DequantizeToHalf) within the fp16 limit.
TEST_F(CudaOpsTest, KQuantEmbedAndCublasMatchReference) {
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  for (DType type : kKTypes) {
    const int64_t rows = 301, cols = 1280;
    HostWeights w = RandomWeights(type, rows, cols);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    {
      const std::vector<int32_t> tokens = {0, 300, 17, 17};
      std::vector<float> ref(tokens.size() * cols);
      for (size_t t = 0; t < tokens.size(); ++t) {
        DequantizeRow(type, w.view().row(tokens[t]), ref.data() + t * cols, cols);
      }
      DevBuf<int32_t> dt(tokens);
      DevBuf<float> dout(ref.size());
      CUDA_OK(cuda::Embed(m, dt.get(), static_cast<int>(tokens.size()), dout.get(), nullptr));
      const std::vector<float> out = dout.Download();
      EXPECT_FALSE(AnyNan(out));
      EXPECT_LE(Nmse(out, ref), 1e-12) << DTypeName(type);
      EXPECT_TRUE(dout.GuardsIntact());
    }
    {
      const int n = 37;
      DevBuf<uint8_t> wh(cuda::GemmWeightScratchBytes(m));
      DevBuf<uint8_t> xh(cuda::GemmActivationScratchBytes(m, n));
      cuda::GemmScratch sc{wh.get(), wh.Bytes(), xh.get(), xh.Bytes()};
      std::vector<float> x = Random(static_cast<size_t>(n) * cols);
      std::vector<float> ref(static_cast<size_t>(n) * rows);
      RefMatMul(w.view(), x.data(), n, ref.data());
      DevBuf<float> dx(x), dy(ref.size());
      ASSERT_EQ(cuda::GemmXWt(h, m, dx.get(), n, dy.get(), rows, 0.f, sc, nullptr), 0);
      const std::vector<float> out = dy.Download();
      EXPECT_FALSE(AnyNan(out));
      EXPECT_LE(Nmse(out, ref), kFp16Limit) << DTypeName(type) << " cuBLAS";
      EXPECT_TRUE(dy.GuardsIntact());
    }
  }
  cublasDestroy(h);
}

// Rows that are not whole super-blocks, a split layout (which K-quants never take) and an unknown
// type value are refused before any kernel runs.
TEST_F(CudaOpsTest, KQuantShapesTheKernelsRefuse) {
  DevBuf<uint8_t> dw(4096);
  DevBuf<float> dx(std::vector<float>(512, 1.f)), dy(64);
  for (DType type : kKTypes) {
    DeviceMatrix m;
    m.type = static_cast<WType>(type);
    m.rows = 4;
    m.cols = 384;  // 1.5 super-blocks
    m.data = dw.get();
    EXPECT_EQ(cuda::MatVecRows(m, nullptr, 4, nullptr, dx.get(), 1, dy.get(), 4, nullptr),
              cudaErrorInvalidValue)
        << DTypeName(type);
    EXPECT_EQ(cuda::AccumulateRows(m, nullptr, 4, nullptr, dx.get(), 4, 1, dy.get(), nullptr),
              cudaErrorInvalidValue);
    m.cols = 256;
    m.scales = dw.get();
    EXPECT_EQ(cuda::CheckMatrixShape(m), cudaErrorInvalidValue) << DTypeName(type) << " split";
    m.scales = nullptr;
    EXPECT_EQ(cuda::CheckMatrixShape(m), cudaSuccess);
    EXPECT_EQ(cuda::WRowBytes(m.type, 512),
              static_cast<size_t>(RowBytes(type, 512)));  // the engine's block sizes
  }
  DeviceMatrix bad;
  bad.type = static_cast<WType>(kNumDTypes);
  bad.rows = 1;
  bad.cols = 256;
  bad.data = dw.get();
  EXPECT_EQ(cuda::CheckMatrixShape(bad), cudaErrorInvalidValue);
  EXPECT_TRUE(dy.GuardsIntact());
}

}  // namespace
}  // namespace cuda_test
}  // namespace pinfer
