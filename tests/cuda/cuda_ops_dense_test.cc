// The dense products (dense_products.cu, gemm.cu, kernel_config.cu): the row kernels for every
// weight type, the output head, cuBLAS, the split layout of block formats, the int8 path with
// llama.cpp's definition (written out in cuda_ops_test_util.h as Q8xReference), x quantized by its
// producer, programmatic launch, and the shapes the kernels refuse.
// Judged as cuda_ops_test_util.h says; without a CUDA device every test skips.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "tests/cuda/cuda_ops_test_util.h"

namespace pinfer {
namespace cuda_test {
namespace {

// Dense matrix-vector (all rows) and the sparse gate/up projection (listed rows only), for every
// weight type and batch sizes that need one and several passes of the token loop.
TEST_F(CudaOpsTest, MatVecRowsMatchesReferenceForEveryType) {
  // 1056 columns (33 blocks): rows not 16-byte aligned for the block formats, read in place;
  // 512 and 5120: staged in shared memory, four rows per block. 256 and 72 columns of the 16-byte
  // types: short rows, one warp per row.
  for (const auto& [type, cols] : std::vector<std::pair<DType, int64_t>>{{DType::kF32, 1056},
                                                                         {DType::kF16, 1056},
                                                                         {DType::kBF16, 1056},
                                                                         {DType::kF16, 256},
                                                                         {DType::kBF16, 72},
                                                                         {DType::kF32, 256},
                                                                         {DType::kQ8_0, 1056},
                                                                         {DType::kQ4_0, 1056},
                                                                         {DType::kQ8_0, 512},
                                                                         {DType::kQ4_0, 512},
                                                                         {DType::kQ4_0, 5120}}) {
    const int64_t rows = 301;
    HostWeights w = RandomWeights(type, rows, cols);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    for (int n : {1, 3, 11}) {
      std::vector<float> x = Random(static_cast<size_t>(n) * cols);
      DevBuf<float> dx(x);
      // All rows.
      {
        std::vector<float> ref(static_cast<size_t>(n) * rows);
        RefMatMul(w.view(), x.data(), n, ref.data());
        DevBuf<float> dy(ref.size());
        CUDA_OK(cuda::MatVecRows(m, nullptr, rows, nullptr, dx.get(), n, dy.get(), rows, nullptr));
        std::vector<float> out = dy.Download();
        EXPECT_FALSE(AnyNan(out)) << DTypeName(type) << " n " << n;
        EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type) << " n " << n;
        EXPECT_TRUE(dy.GuardsIntact());
      }
      // Listed rows with a device-side count below the bound, written with a wider stride:
      // entries past the count must stay unwritten.
      {
        const int bound = 120, count = 97, ldy = 128;
        std::vector<int32_t> ids = RandomRows(rows, bound);
        std::vector<float> ref(static_cast<size_t>(n) * count);
        RefMatMulRows(w.view(), ids.data(), count, x.data(), n, ref.data());
        DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
        DevBuf<float> dy(static_cast<size_t>(n) * ldy);
        CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dx.get(), n, dy.get(), ldy,
                                 nullptr));
        std::vector<float> all = dy.Download(), out;
        for (int t = 0; t < n; ++t) {
          for (int i = 0; i < ldy; ++i) {
            const float v = all[t * ldy + i];
            if (i < count) {
              out.push_back(v);
            } else {
              EXPECT_TRUE(std::isnan(v)) << "wrote past the count at " << i;
            }
          }
        }
        EXPECT_FALSE(AnyNan(out));
        EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type) << " rows, n " << n;
        EXPECT_TRUE(dy.GuardsIntact());
      }
    }
  }
}

// The output head: a wide vocabulary against the final hidden state.
TEST_F(CudaOpsTest, OutputHeadMatchesReference) {
  for (DType type : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ4_0}) {
    const int64_t vocab = 32000, hidden = 512;
    HostWeights w = RandomWeights(type, vocab, hidden);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    std::vector<float> x = Random(hidden), ref(vocab);
    RefMatMul(w.view(), x.data(), 1, ref.data());
    DevBuf<float> dx(x), dy(vocab);
    CUDA_OK(cuda::MatVecRows(m, nullptr, vocab, nullptr, dx.get(), 1, dy.get(), vocab, nullptr));
    std::vector<float> out = dy.Download();
    EXPECT_FALSE(AnyNan(out));
    EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type);
    EXPECT_TRUE(dy.GuardsIntact());
    // The warp-per-row kernel (a tuning alternative) on the same matrix.
    const int saved = cuda::MatVecWarpRowsMin();
    cuda::SetMatVecWarpRowsMin(1);
    DevBuf<float> dyw(vocab);
    CUDA_OK(cuda::MatVecRows(m, nullptr, vocab, nullptr, dx.get(), 1, dyw.get(), vocab, nullptr));
    cuda::SetMatVecWarpRowsMin(saved);
    std::vector<float> outw = dyw.Download();
    EXPECT_FALSE(AnyNan(outw));
    EXPECT_LE(Nmse(outw, ref), kFp32Limit) << DTypeName(type) << " warp per row";
    EXPECT_TRUE(dyw.GuardsIntact());
    // A tall listed set with a device count.
    const int bound = 13000, count = 12500;
    std::vector<int32_t> ids = RandomRows(vocab, bound);
    std::vector<float> ref2(count);
    RefMatMulRows(w.view(), ids.data(), count, x.data(), 1, ref2.data());
    DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
    DevBuf<float> dy2(bound);
    CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dx.get(), 1, dy2.get(), bound,
                             nullptr));
    std::vector<float> out2 = dy2.Download();
    for (int i = count; i < bound; ++i) ASSERT_TRUE(std::isnan(out2[i])) << i;
    out2.resize(count);
    EXPECT_FALSE(AnyNan(out2));
    EXPECT_LE(Nmse(out2, ref2), kFp32Limit) << DTypeName(type) << " listed";
  }
}

// Batched products through cuBLAS: y = x w^T (projections, hot gate/up rows of a prompt) and
// y = a w (the down projection over transposed rows).
TEST_F(CudaOpsTest, CublasGemmsMatchReference) {
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  for (DType type : kAllTypes) {
    const int64_t rows = 300, cols = 1056;
    const int n = 37;
    const double limit = type == DType::kF32 ? kFp32Limit : kFp16Limit;
    HostWeights w = RandomWeights(type, rows, cols);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    DevBuf<uint8_t> wh(std::max<size_t>(16, cuda::GemmWeightScratchBytes(m)));
    DevBuf<uint8_t> xh(cuda::GemmActivationScratchBytes(m, n));
    cuda::GemmScratch s{wh.get(), wh.Bytes(), xh.get(), xh.Bytes()};
    {
      std::vector<float> x = Random(static_cast<size_t>(n) * cols);
      std::vector<float> ref(static_cast<size_t>(n) * rows);
      RefMatMul(w.view(), x.data(), n, ref.data());
      DevBuf<float> dx(x), dy(ref.size());
      ASSERT_EQ(cuda::GemmXWt(h, m, dx.get(), n, dy.get(), rows, 0.f, s, nullptr), 0);
      std::vector<float> out = dy.Download();
      EXPECT_FALSE(AnyNan(out));
      EXPECT_LE(Nmse(out, ref), limit) << DTypeName(type);
      EXPECT_TRUE(dy.GuardsIntact());
    }
    {
      std::vector<float> a = Random(static_cast<size_t>(n) * rows);
      std::vector<int32_t> all(rows);
      std::iota(all.begin(), all.end(), 0);
      std::vector<float> ref(static_cast<size_t>(n) * cols, 0.f);
      ref_->AccumulateRows(w.view(), all.data(), static_cast<int>(rows), a.data(), n, ref.data());
      DevBuf<float> da(a), dy(ref.size());
      ASSERT_EQ(cuda::GemmAW(h, m, da.get(), static_cast<int>(rows), n, dy.get(), 0.f, s, nullptr),
                0);
      std::vector<float> out = dy.Download();
      EXPECT_FALSE(AnyNan(out));
      EXPECT_LE(Nmse(out, ref), limit) << DTypeName(type) << " (a w)";
      EXPECT_TRUE(dy.GuardsIntact());
    }
  }
  cublasDestroy(h);
}

// Block formats in the split layout (quants and scales apart, repacked on the GPU): every
// operator that reads weights gives the reference's results, with rows past a warp's four and
// columns that are not a multiple of the warp's sweep.
TEST_F(CudaOpsTest, SplitLayoutMatchesReferenceForBlockTypes) {
  const bool q8x = cuda::QuantizedActivations();
  cuda::SetQuantizedActivations(false);  // the fp32 definition (the other has its own test)
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  for (DType type : {DType::kQ8_0, DType::kQ4_0}) {
    for (int64_t cols : {512, 1056, 5120}) {
      const int64_t rows = 301;
      HostWeights w = RandomWeights(type, rows, cols);
      DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
      DeviceMatrix m = ToDeviceSplit(w, &dg, &ds);
      EXPECT_TRUE(ds.GuardsIntact());
      for (int n : {1, 3, 11}) {
        std::vector<float> x = Random(static_cast<size_t>(n) * cols);
        DevBuf<float> dx(x);
        std::vector<float> ref(static_cast<size_t>(n) * rows);
        RefMatMul(w.view(), x.data(), n, ref.data());
        DevBuf<float> dy(ref.size());
        CUDA_OK(cuda::MatVecRows(m, nullptr, rows, nullptr, dx.get(), n, dy.get(), rows, nullptr));
        std::vector<float> out = dy.Download();
        EXPECT_FALSE(AnyNan(out)) << DTypeName(type) << " cols " << cols << " n " << n;
        EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type) << " cols " << cols << " n " << n;
        EXPECT_TRUE(dy.GuardsIntact());
        // Listed rows, device count below the bound: entries past the count stay unwritten.
        const int bound = 120, count = 97, ldy = 128;
        std::vector<int32_t> ids = RandomRows(rows, bound);
        std::vector<float> ref2(static_cast<size_t>(n) * count);
        RefMatMulRows(w.view(), ids.data(), count, x.data(), n, ref2.data());
        DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
        DevBuf<float> dy2(static_cast<size_t>(n) * ldy);
        CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dx.get(), n, dy2.get(), ldy,
                                 nullptr));
        std::vector<float> all = dy2.Download(), out2;
        for (int t = 0; t < n; ++t) {
          for (int i = 0; i < ldy; ++i) {
            if (i < count) {
              out2.push_back(all[t * ldy + i]);
            } else {
              EXPECT_TRUE(std::isnan(all[t * ldy + i])) << "wrote past the count at " << i;
            }
          }
        }
        EXPECT_FALSE(AnyNan(out2));
        EXPECT_LE(Nmse(out2, ref2), kFp32Limit) << DTypeName(type) << " listed, n " << n;
        EXPECT_TRUE(dy2.GuardsIntact());
      }
      // Sparse down projection: listed rows, zero coefficients, a device count.
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
        std::vector<float> out = dy.Download();
        EXPECT_FALSE(AnyNan(out));
        EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type) << " accumulate, n " << n;
        EXPECT_TRUE(dy.GuardsIntact());
      }
      // Embedding rows: exactly the dequantized values.
      {
        std::vector<int32_t> tokens = {0, 300, 17, 17};
        std::vector<float> ref(tokens.size() * cols);
        for (size_t t = 0; t < tokens.size(); ++t) {
          DequantizeRow(type, w.view().row(tokens[t]), ref.data() + t * cols, cols);
        }
        DevBuf<int32_t> dt(tokens);
        DevBuf<float> dout(ref.size());
        CUDA_OK(cuda::Embed(m, dt.get(), static_cast<int>(tokens.size()), dout.get(), nullptr));
        EXPECT_EQ(dout.Download(), ref) << DTypeName(type);
        EXPECT_TRUE(dout.GuardsIntact());
      }
      // cuBLAS through the fp16 expansion of the split matrix.
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
        std::vector<float> out = dy.Download();
        EXPECT_FALSE(AnyNan(out));
        EXPECT_LE(Nmse(out, ref), kFp16Limit) << DTypeName(type) << " cuBLAS";
      }
    }
  }
  cublasDestroy(h);
  cuda::SetQuantizedActivations(q8x);
}

// The split layout's llama.cpp-definition path (SetQuantizedActivations) against that
// definition: all rows and listed rows with a device count, one and several tokens, for the
// kernel's warps per block and rows per warp (0: chosen by the row count), each as configured
// and with the wave-balanced shape of short matrices (fewer warps a block).
TEST_F(CudaOpsTest, QuantizedActivationsMatchLlamaCppDefinition) {
  const bool q8x = cuda::QuantizedActivations();
  cuda::SetQuantizedActivations(true);
  for (auto [warps, rows_per_warp, balanced] : {std::tuple{16, 1, true},
                                                {16, 1, false},
                                                {16, 2, false},
                                                {4, 0, false},
                                                {8, 0, true},
                                                {16, 0, false},
                                                {8, 1, false},
                                                {4, 1, true},
                                                {8, 4, false},
                                                {4, 4, true},
                                                {16, 4, false},
                                                {16, 2, true}}) {
    cuda::SetQuantWarps(warps);
    cuda::SetQuantRowsPerWarp(rows_per_warp);
    cuda::SetQuantShapeBalanced(balanced);
    for (DType type : {DType::kQ8_0, DType::kQ4_0}) {
      for (int64_t cols : {512, 1056, 5120}) {
        const int64_t rows = 301;
        HostWeights w = RandomWeights(type, rows, cols);
        DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
        DeviceMatrix m = ToDeviceSplit(w, &dg, &ds);
        for (int n : {1, 3}) {
          std::vector<float> x = Random(static_cast<size_t>(n) * cols);
          DevBuf<float> dx(x);
          std::vector<int32_t> all(rows);
          std::iota(all.begin(), all.end(), 0);
          std::vector<float> ref = Q8xReference(w, all, x, n);
          DevBuf<float> dy(ref.size());
          CUDA_OK(
              cuda::MatVecRows(m, nullptr, rows, nullptr, dx.get(), n, dy.get(), rows, nullptr));
          std::vector<float> out = dy.Download();
          EXPECT_FALSE(AnyNan(out));
          EXPECT_LE(Nmse(out, ref), kFp32Limit)
              << DTypeName(type) << " cols " << cols << " n " << n;
          EXPECT_TRUE(dy.GuardsIntact());
          const int bound = 120, count = 97, ldy = 128;
          std::vector<int32_t> ids = RandomRows(rows, bound);
          std::vector<float> ref2 =
              Q8xReference(w, std::vector<int32_t>(ids.begin(), ids.begin() + count), x, n);
          DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
          DevBuf<float> dy2(static_cast<size_t>(n) * ldy);
          CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dx.get(), n, dy2.get(), ldy,
                                   nullptr));
          std::vector<float> got = dy2.Download(), out2;
          for (int t = 0; t < n; ++t) {
            for (int i = 0; i < ldy; ++i) {
              if (i < count) {
                out2.push_back(got[t * ldy + i]);
              } else {
                EXPECT_TRUE(std::isnan(got[t * ldy + i])) << "wrote past the count at " << i;
              }
            }
          }
          EXPECT_LE(Nmse(out2, ref2), kFp32Limit)
              << DTypeName(type) << " listed, n " << n << ", " << warps << " warps, "
              << rows_per_warp << " rows per warp, balanced " << balanced;
        }
      }
    }
  }
  cuda::SetQuantWarps(16);  // the defaults
  cuda::SetQuantRowsPerWarp(1);
  cuda::SetQuantShapeBalanced(true);
  cuda::SetQuantizedActivations(q8x);
}

// The int8 product with x in registers: rows whose blocks fit one warp (up to 5120 columns) give
// exactly what the kernel that reads x from memory gives; wider rows, split between two or four
// warps, give the same up to summation order, the same on every run. For whole matrices of
// several heights (one block to more blocks than stay resident), listed rows with a device count,
// several tokens, and x quantized by the product itself or by its producer; all against the
// llama.cpp-definition reference.
TEST_F(CudaOpsTest, QuantRegsProductMatchesTheMemoryKernel) {
  const bool q8x = cuda::QuantizedActivations();
  cuda::SetQuantizedActivations(true);
  for (DType type : {DType::kQ4_0, DType::kQ8_0}) {
    for (int64_t cols : {512, 1056, 3072, 5120, 5152, 8192, 13824, 20480}) {
      for (int64_t rows : {1, 17, 301, 20000}) {
        if (rows == 20000 && cols != 5120 && cols != 13824) continue;
        HostWeights w = RandomWeights(type, rows, cols);
        DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
        DeviceMatrix m = ToDeviceSplit(w, &dg, &ds);
        const int n = rows == 20000 ? 1 : 3;
        std::vector<float> x = Random(static_cast<size_t>(n) * cols);
        DevBuf<float> dx(x);
        DevBuf<int8_t> dqx(n * cuda::QxBytes(cols));
        std::vector<float> nw(cols, 1.f);
        DevBuf<float> dnw(nw), dxn(static_cast<size_t>(n) * cols);
        // x through a norm that also writes the quantized copy (the producer path).
        CUDA_OK(cuda::RmsNorm(dx.get(), dnw.get(), n, static_cast<int>(cols), 1e-5f, dxn.get(),
                              nullptr, dqx.get()));
        const std::vector<float> xn = dxn.Download();
        const int bound = static_cast<int>(std::min<int64_t>(rows, 120));
        const int count = std::max(1, bound * 4 / 5);
        std::vector<int32_t> ids = RandomRows(static_cast<int>(rows), bound);
        DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
        std::vector<int32_t> all(rows);
        std::iota(all.begin(), all.end(), 0);
        const std::vector<float> ref = Q8xReference(w, all, xn, n);
        const std::vector<float> ref_listed =
            Q8xReference(w, std::vector<int32_t>(ids.begin(), ids.begin() + count), xn, n);
        const bool one_warp = cols / 32 <= (type == DType::kQ8_0 ? 128 : 160);
        for (bool producer : {false, true}) {
          // [0]: x from memory; [1], [2]: x in registers, twice; [3]: x in registers, the
          // first rows loaded after the wait instead of before and every step's rows after the
          // previous step's sums.
          std::vector<float> whole[4], listed[4];
          for (int run = 0; run < 4; ++run) {
            cuda::SetQuantRegs(run > 0);
            cuda::SetQuantEarlyLoad(run != 3);
            cuda::SetQuantPipeline(run != 3);
            DevBuf<float> dy(static_cast<size_t>(n) * rows), dy2(static_cast<size_t>(n) * bound);
            const int8_t* qx = producer ? dqx.get() : nullptr;
            CUDA_OK(cuda::MatVecRows(m, nullptr, static_cast<int>(rows), nullptr, dxn.get(), n,
                                     dy.get(), static_cast<int>(rows), nullptr, qx));
            CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dxn.get(), n, dy2.get(),
                                     bound, nullptr, qx));
            whole[run] = dy.Download();
            const std::vector<float> got = dy2.Download();
            for (int t = 0; t < n; ++t) {
              for (int i = 0; i < bound; ++i) {
                if (i < count) {
                  listed[run].push_back(got[t * bound + i]);
                } else {
                  EXPECT_TRUE(std::isnan(got[t * bound + i])) << "wrote past the count at " << i;
                }
              }
            }
            EXPECT_TRUE(dy.GuardsIntact() && dy2.GuardsIntact());
          }
          const std::string what = std::string(DTypeName(type)) + " cols " + std::to_string(cols) +
                                   " rows " + std::to_string(rows) +
                                   (producer ? " producer" : " own");
          EXPECT_FALSE(AnyNan(whole[1]) || AnyNan(listed[1])) << what;
          EXPECT_EQ(whole[1], whole[2]) << what << ": not the same on every run";
          EXPECT_EQ(listed[1], listed[2]) << what << ": not the same on every run";
          EXPECT_EQ(whole[1], whole[3]) << what << ": the load order changed the values";
          EXPECT_EQ(listed[1], listed[3]) << what << ": the load order changed the values";
          if (one_warp) {
            EXPECT_EQ(whole[1], whole[0]) << what;
            EXPECT_EQ(listed[1], listed[0]) << what << " listed";
          }
          EXPECT_LE(Nmse(whole[1], ref), kFp32Limit) << what;
          EXPECT_LE(Nmse(listed[1], ref_listed), kFp32Limit) << what << " listed";
        }
      }
    }
  }
  cuda::SetQuantRegs(true);
  cuda::SetQuantEarlyLoad(true);
  cuda::SetQuantPipeline(true);
  cuda::SetQuantizedActivations(q8x);
}

// x quantized by the kernel that produces it (the norms, the packed activation) gives the int8
// product exactly what the product computes when it quantizes x itself, for whole matrices and
// listed rows, and matches the llama.cpp-definition reference.
TEST_F(CudaOpsTest, ProducerQuantizedActivationsGiveTheSameProduct) {
  const bool q8x = cuda::QuantizedActivations();
  cuda::SetQuantizedActivations(true);
  const int n = 3;
  for (DType type : {DType::kQ8_0, DType::kQ4_0}) {
    for (int64_t cols : {512, 5120, 13824}) {
      const int64_t rows = 301;
      HostWeights w = RandomWeights(type, rows, cols);
      DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
      DeviceMatrix m = ToDeviceSplit(w, &dg, &ds);
      for (int producer = 0; producer < 5; ++producer) {
        // x: [n, cols] from an RMSNorm, a residual RMSNorm or the packed activation; 3 and 4:
        // the norms again, each with the other norm kernel where both apply.
        cuda::SetNormVec8(producer < 3);
        DevBuf<float> dx(static_cast<size_t>(n) * cols);
        DevBuf<int8_t> dqx(n * cuda::QxBytes(cols));
        std::vector<float> a = Random(static_cast<size_t>(n) * 2 * cols, 2.f);
        std::vector<float> nw = Random(cols);
        DevBuf<float> da(a), dnw(nw), dres(std::vector<float>(a.begin(), a.begin() + n * cols));
        if (producer % 3 == 0) {
          CUDA_OK(cuda::RmsNorm(da.get(), dnw.get(), n, static_cast<int>(cols), 1e-5f, dx.get(),
                                nullptr, dqx.get()));
        } else if (producer % 3 == 1) {
          CUDA_OK(cuda::ResidualRmsNorm(dres.get(), da.get(), nullptr, dnw.get(), n,
                                        static_cast<int>(cols), 1e-5f, dx.get(), nullptr,
                                        dqx.get()));
        } else {
          CUDA_OK(cuda::GatedActivationPacked(cuda::ActKind::kSilu, da.get(), n,
                                              static_cast<int>(cols), dx.get(), nullptr,
                                              dqx.get()));
        }
        std::vector<float> x = dx.Download();
        std::vector<int32_t> all(rows);
        std::iota(all.begin(), all.end(), 0);
        std::vector<float> ref = Q8xReference(w, all, x, n);
        DevBuf<float> own(static_cast<size_t>(n) * rows), pre(static_cast<size_t>(n) * rows);
        CUDA_OK(cuda::MatVecRows(m, nullptr, rows, nullptr, dx.get(), n, own.get(), rows, nullptr));
        CUDA_OK(cuda::MatVecRows(m, nullptr, rows, nullptr, dx.get(), n, pre.get(), rows, nullptr,
                                 dqx.get()));
        const std::vector<float> out_own = own.Download(), out_pre = pre.Download();
        EXPECT_FALSE(AnyNan(out_pre));
        EXPECT_EQ(out_pre, out_own)
            << DTypeName(type) << " cols " << cols << " producer " << producer;
        EXPECT_LE(Nmse(out_pre, ref), kFp32Limit);
        // Listed rows with a device count.
        const int bound = 120, count = 97;
        std::vector<int32_t> ids = RandomRows(rows, bound);
        DevBuf<int32_t> dids(ids), dcount(std::vector<int32_t>{count});
        DevBuf<float> own2(static_cast<size_t>(n) * bound), pre2(static_cast<size_t>(n) * bound);
        CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dx.get(), n, own2.get(), bound,
                                 nullptr));
        CUDA_OK(cuda::MatVecRows(m, dids.get(), bound, dcount.get(), dx.get(), n, pre2.get(), bound,
                                 nullptr, dqx.get()));
        const std::vector<float> got_pre = pre2.Download(), got_own = own2.Download();
        for (int t = 0; t < n; ++t) {
          for (int i = 0; i < count; ++i) {
            ASSERT_EQ(got_pre[t * bound + i], got_own[t * bound + i])
                << "token " << t << " row " << i;
          }
        }
        EXPECT_TRUE(dqx.GuardsIntact() && dx.GuardsIntact() && pre.GuardsIntact());
      }
    }
  }
  cuda::SetNormVec8(true);
  // The quantized output needs whole blocks of 32.
  DevBuf<float> dx(3 * 1000), dw(1000), dout(3 * 1000);
  DevBuf<int8_t> dqx(3 * cuda::QxBytes(1024));
  EXPECT_EQ(cuda::RmsNorm(dx.get(), dw.get(), 3, 1000, 1e-5f, dout.get(), nullptr, dqx.get()),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::GatedActivationPacked(cuda::ActKind::kRelu, dx.get(), 1, 1000, dout.get(),
                                        nullptr, dqx.get()),
            cudaErrorInvalidValue);
  cuda::SetQuantizedActivations(q8x);
}

// A chain of dependent kernels on an explicit stream, so that each one is launched with
// programmatic dependent launch and may start (and prefetch its weights) before its
// predecessor ends: norm -> F16 projection -> ReLU -> Q4_0 (split) projection -> sparse
// accumulation, run directly and replayed from a captured graph, against the reference chain.
TEST_F(CudaOpsTest, ProgrammaticLaunchChainMatchesReference) {
  ASSERT_TRUE(cuda::ProgrammaticLaunch());
  const bool q8x = cuda::QuantizedActivations();
  cuda::SetQuantizedActivations(false);
  const int hidden = 2048, mid = 4096;
  std::vector<float> x = Random(hidden, 2.f), nw = Random(hidden);
  HostWeights w1 = RandomWeights(DType::kF16, mid, hidden);
  HostWeights w2 = RandomWeights(DType::kQ4_0, hidden, mid);
  HostWeights w3 = RandomWeights(DType::kQ4_0, hidden, hidden);
  std::vector<float> xn(hidden), h1(mid), h2(hidden), ref = Random(hidden);
  const std::vector<float> y0 = ref;
  ref_->RmsNorm(x.data(), nw.data(), 1, hidden, 1e-5f, xn.data());
  RefMatMul(w1.view(), xn.data(), 1, h1.data());
  for (float& v : h1) v = std::max(v, 0.f);
  RefMatMul(w2.view(), h1.data(), 1, h2.data());
  std::vector<int32_t> all(hidden);
  std::iota(all.begin(), all.end(), 0);
  ref_->AccumulateRows(w3.view(), all.data(), hidden, h2.data(), 1, ref.data());

  DevBuf<uint8_t> d1(w1.bytes.size()), d2g(w2.bytes.size()), d2(w2.bytes.size());
  DevBuf<uint8_t> d3g(w3.bytes.size()), d3(w3.bytes.size());
  DeviceMatrix m1 = ToDevice(w1, &d1), m2 = ToDeviceSplit(w2, &d2g, &d2);
  DeviceMatrix m3 = ToDeviceSplit(w3, &d3g, &d3);
  DevBuf<float> dx(x), dnw(nw), dxn(hidden), dh1(mid), dh2(hidden), dy(y0);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto enqueue = [&]() {
    CUDA_OK(cuda::RmsNorm(dx.get(), dnw.get(), 1, hidden, 1e-5f, dxn.get(), s));
    CUDA_OK(cuda::MatVecRows(m1, nullptr, mid, nullptr, dxn.get(), 1, dh1.get(), mid, s));
    CUDA_OK(cuda::Relu(dh1.get(), mid, s));
    CUDA_OK(cuda::MatVecRows(m2, nullptr, hidden, nullptr, dh1.get(), 1, dh2.get(), hidden, s));
    CUDA_OK(cuda::AccumulateRows(m3, nullptr, hidden, nullptr, dh2.get(), hidden, 1, dy.get(), s));
  };
  enqueue();
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<float> out = dy.Download();
  EXPECT_FALSE(AnyNan(out));
  EXPECT_LE(Nmse(out, ref), kFp32Limit) << "stream";
  // The same chain captured into a graph (programmatic edges between its kernel nodes),
  // replayed three times from the same starting y.
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  enqueue();
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    dy.Upload(y0);
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<float> g = dy.Download();
    EXPECT_FALSE(AnyNan(g));
    EXPECT_LE(Nmse(g, ref), kFp32Limit) << "graph replay " << rep;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  cuda::SetQuantizedActivations(q8x);
  EXPECT_TRUE(dy.GuardsIntact() && dh1.GuardsIntact() && dh2.GuardsIntact());
}

TEST_F(CudaOpsTest, RejectsShapesTheKernelsCannotRead) {
  DevBuf<uint8_t> buf(4096);
  DeviceMatrix m{WType::kQ4_0, 2, 48, buf.get()};  // 48 is not a whole number of blocks
  EXPECT_EQ(cuda::CheckMatrixShape(m), cudaErrorInvalidValue);
  DeviceMatrix f{WType::kF16, 2, 36, buf.get()};  // rows not 16-byte aligned
  EXPECT_EQ(cuda::CheckMatrixShape(f), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::Attention(nullptr, nullptr, nullptr, 1, 0, 4, 4, 512, 0, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::Attention(nullptr, nullptr, nullptr, 1, 0, 4, 4, 64, -1, nullptr, nullptr),
            cudaErrorInvalidValue);  // a negative window
  // A quantized copy of the attention's output needs whole blocks of 32 in every head.
  int8_t qx = 0;
  EXPECT_EQ(cuda::AttentionAt(nullptr, nullptr, nullptr, 1, nullptr, 16, 4, 4, 48, 0, nullptr,
                              nullptr, &qx),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace cuda_test
}  // namespace pinfer
