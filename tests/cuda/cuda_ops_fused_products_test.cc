// The int8 products that fold a decode step's small kernels into themselves (dense_products.cu):
// the norm (NormMatVec), RoPE and the cache write (NormMatVecRope) and the gated activation
// (NormMatVecGated), each against the reference or bit for bit against the unfused kernels.
// Judged as cuda_ops_test_util.h says; without a CUDA device every test skips.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "tests/cuda/cuda_ops_test_util.h"

namespace pinfer {
namespace cuda_test {
namespace {

// A decode step's norm inside the int8 product that consumes it (NormMatVec): the product of the
// RMS-normed x + d1 (+ d2) matches the reference norm followed by the llama.cpp-definition
// product; the residual goes to x_out exactly (x + (d1 + d2), the norms' order of additions) and
// nowhere else; the result is the same on every run; rows the fused path does not take are
// refused with cudaErrorNotSupported, aliased outputs with cudaErrorInvalidValue.
TEST_F(CudaOpsTest, FusedNormProductMatchesReference) {
  const bool q8x = cuda::QuantizedActivations();
  cuda::SetQuantizedActivations(true);
  const float eps = 1e-5f;
  for (DType type : {DType::kQ4_0, DType::kQ8_0}) {
    for (int64_t cols : {512, 1056, 4096, 5120}) {
      for (int64_t rows : {1, 301, 15360}) {
        if (rows == 15360 && cols != 5120) continue;
        if (type == DType::kQ8_0 && cols > 4096) continue;  // two warps a row: not fused
        HostWeights w = RandomWeights(type, rows, cols);
        DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
        DeviceMatrix m = ToDeviceSplit(w, &dg, &ds);
        ASSERT_TRUE(cuda::NormMatVecFits(m)) << cols;
        std::vector<float> x = Random(cols, 2.f), d1 = Random(cols), d2 = Random(cols),
                           nw = Random(cols);
        DevBuf<float> dx(x), dd1(d1), dd2(d2), dnw(nw);
        std::vector<int32_t> all(rows);
        std::iota(all.begin(), all.end(), 0);
        for (int inputs = 0; inputs < 3; ++inputs) {  // x; x + d1; x + d1 + d2
          std::vector<float> xr = x;
          for (int64_t i = 0; i < cols; ++i) {
            if (inputs == 1) xr[i] = x[i] + d1[i];
            if (inputs == 2) xr[i] = x[i] + (d1[i] + d2[i]);
          }
          std::vector<float> xn(cols);
          ref_->RmsNorm(xr.data(), nw.data(), 1, static_cast<int>(cols), eps, xn.data());
          const std::vector<float> ref = Q8xReference(w, all, xn, 1);
          const std::string what = std::string(DTypeName(type)) + " cols " + std::to_string(cols) +
                                   " rows " + std::to_string(rows) + " inputs " +
                                   std::to_string(inputs);
          std::vector<float> got[2];
          for (int run = 0; run < 2; ++run) {
            DevBuf<float> dy(rows), dxo(cols);
            // The second run keeps no residual.
            CUDA_OK(cuda::NormMatVec(m, dx.get(), inputs > 0 ? dd1.get() : nullptr,
                                     inputs > 1 ? dd2.get() : nullptr, dnw.get(), eps,
                                     run == 0 ? dxo.get() : nullptr, dy.get(), nullptr));
            got[run] = dy.Download();
            const std::vector<float> xo = dxo.Download();
            if (run == 0) {
              EXPECT_EQ(xo, xr) << what << ": the residual";
            } else {
              EXPECT_TRUE(std::all_of(xo.begin(), xo.end(), [](float v) { return std::isnan(v); }))
                  << what << ": wrote a residual nobody asked for";
            }
            EXPECT_TRUE(dy.GuardsIntact() && dxo.GuardsIntact()) << what;
          }
          EXPECT_FALSE(AnyNan(got[0])) << what;
          EXPECT_EQ(got[0], got[1]) << what << ": not the same on every run";
          // The normed row is quantized from a sum of squares taken in another order than the
          // reference's, so an int8 of x may round the other way; over hundreds of rows that
          // stays far inside the limit, while one row's error is that one value's (3e-6 seen on
          // the H200), so a single row is checked for the launch, residual and repeatability.
          if (rows > 1) {
            EXPECT_LE(Nmse(got[0], ref), kFp32Limit) << what;
          }
        }
        EXPECT_EQ(dx.Download(), x) << "x itself is never written";
      }
    }
  }
  // Too wide for the registers' norm, or a layout the product does not hold in registers, or
  // the knob off.
  HostWeights wide = RandomWeights(DType::kQ4_0, 4, 13824);
  DevBuf<uint8_t> wg(wide.bytes.size()), ws(wide.bytes.size());
  const DeviceMatrix mw = ToDeviceSplit(wide, &wg, &ws);
  HostWeights f16 = RandomWeights(DType::kF16, 4, 512);
  DevBuf<uint8_t> fg(f16.bytes.size());
  const DeviceMatrix mf = ToDevice(f16, &fg);
  DevBuf<float> dx(13824), dw(13824), dxo(13824), dy(4);
  EXPECT_FALSE(cuda::NormMatVecFits(mw));
  EXPECT_EQ(
      cuda::NormMatVec(mw, dx.get(), nullptr, nullptr, dw.get(), eps, nullptr, dy.get(), nullptr),
      cudaErrorNotSupported);
  EXPECT_EQ(
      cuda::NormMatVec(mf, dx.get(), nullptr, nullptr, dw.get(), eps, nullptr, dy.get(), nullptr),
      cudaErrorNotSupported);
  HostWeights q = RandomWeights(DType::kQ4_0, 4, 512);
  DevBuf<uint8_t> qg(q.bytes.size()), qs(q.bytes.size());
  const DeviceMatrix mq = ToDeviceSplit(q, &qg, &qs);
  EXPECT_EQ(cuda::NormMatVec(mq, dx.get(), dxo.get(), nullptr, dw.get(), eps, dxo.get(), dy.get(),
                             nullptr),
            cudaErrorInvalidValue);
  cudaGetLastError();
  cuda::SetFusedNorm(false);
  EXPECT_FALSE(cuda::NormMatVecFits(mq));
  EXPECT_EQ(
      cuda::NormMatVec(mq, dx.get(), nullptr, nullptr, dw.get(), eps, nullptr, dy.get(), nullptr),
      cudaErrorNotSupported);
  cuda::SetFusedNorm(true);
  cuda::SetQuantizedActivations(q8x);
}

// RoPE and the cache write done where the fused-norm q/k/v product writes its rows
// (NormMatVecRope, with RopeTable's cosines and sines) leave q, the key cache and the value cache
// bit for bit as NormMatVec followed by RopeQkvToCache does (each checked against the reference by
// its own test), with grouped heads, both pair layouts and two positions; only the position's cache
// rows are written; the residual goes to x_out as NormMatVec's. At the 13B shape the grid takes
// every resident slot, so its last blocks load x before their first rows: the same bits again with
// every block loading its rows first (SetLateBlocksLoadXFirst(false)). A wqkv of the wrong height,
// an odd head, a missing output, a layout the product does not hold in registers and the knob off
// are refused.
TEST_F(CudaOpsTest, RopeInProductMatchesTheProductThenRope) {
  const bool q8x = cuda::QuantizedActivations();
  cuda::SetQuantizedActivations(true);
  struct Shape {
    int heads, kv_heads, head_dim;
    int64_t cols;
  };
  const float eps = 1e-5f;
  const int ctx = 48;
  for (DType type : {DType::kQ4_0, DType::kQ8_0}) {
    for (Shape sh : {Shape{4, 4, 128, 512}, Shape{8, 2, 64, 1056}, Shape{40, 40, 128, 5120}}) {
      if (type == DType::kQ8_0 && sh.cols > 4096) continue;  // two warps a row: not fused
      const int qd = sh.heads * sh.head_dim, kvd = sh.kv_heads * sh.head_dim;
      const int64_t rows = qd + 2 * kvd;
      HostWeights w = RandomWeights(type, rows, sh.cols);
      DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
      DeviceMatrix m = ToDeviceSplit(w, &dg, &ds);
      std::vector<float> inv(sh.head_dim / 2);
      for (int i = 0; i < sh.head_dim / 2; ++i)
        inv[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / sh.head_dim));
      DevBuf<float> dx(Random(sh.cols, 2.f)), dd1(Random(sh.cols)), dnw(Random(sh.cols)), dinv(inv);
      for (bool interleaved : {false, true}) {
        for (int pos : {0, 37}) {
          DevBuf<int32_t> dpos(std::vector<int32_t>{pos});
          DevBuf<float> dcs(sh.head_dim);
          CUDA_OK(cuda::RopeTable(dpos.get(), dinv.get(), sh.head_dim, dcs.get(), nullptr));
          const std::string what =
              std::string(DTypeName(type)) + " heads " + std::to_string(sh.heads) + "/" +
              std::to_string(sh.kv_heads) + " x " + std::to_string(sh.head_dim) +
              (interleaved ? " interleaved" : " halves") + " position " + std::to_string(pos);
          // [0]: the product, then the RoPE kernel; [1]: RoPE in the product; [2]: the same with
          // every block loading its rows before x.
          std::vector<float> q[3], k[3], v[3], xo[3];
          for (int run = 0; run < 3; ++run) {
            cuda::SetLateBlocksLoadXFirst(run != 2);
            DevBuf<float> dqkv(rows), dq(qd), dk(ctx * kvd), dv(ctx * kvd), dxo(sh.cols);
            if (run == 0) {
              CUDA_OK(cuda::NormMatVec(m, dx.get(), dd1.get(), nullptr, dnw.get(), eps, dxo.get(),
                                       dqkv.get(), nullptr));
              CUDA_OK(cuda::RopeQkvToCache(dqkv.get(), 1, sh.heads, sh.kv_heads, sh.head_dim,
                                           dpos.get(), dinv.get(), interleaved, dq.get(), dk.get(),
                                           dv.get(), nullptr));
            } else {
              cuda::RopeOut rope;
              rope.n_heads = sh.heads;
              rope.n_kv_heads = sh.kv_heads;
              rope.head_dim = sh.head_dim;
              rope.positions = dpos.get();
              rope.cos_sin = dcs.get();
              rope.interleaved = interleaved;
              rope.q = dq.get();
              rope.k_cache = dk.get();
              rope.v_cache = dv.get();
              CUDA_OK(cuda::NormMatVecRope(m, dx.get(), dd1.get(), nullptr, dnw.get(), eps,
                                           dxo.get(), rope, nullptr));
              EXPECT_TRUE(AllNan(dqkv.Download())) << what << ": wrote the stacked rows";
            }
            q[run] = dq.Download();
            k[run] = dk.Download();
            v[run] = dv.Download();
            xo[run] = dxo.Download();
            EXPECT_TRUE(dq.GuardsIntact() && dk.GuardsIntact() && dv.GuardsIntact() &&
                        dxo.GuardsIntact())
                << what;
          }
          cuda::SetLateBlocksLoadXFirst(true);
          EXPECT_FALSE(AnyNan(q[1])) << what;
          EXPECT_TRUE(SameBits(q[0], q[1])) << what << ": q";
          EXPECT_TRUE(SameBits(k[0], k[1])) << what << ": the key cache";
          EXPECT_TRUE(SameBits(v[0], v[1])) << what << ": the value cache";
          EXPECT_TRUE(SameBits(xo[0], xo[1])) << what << ": the residual";
          EXPECT_TRUE(SameBits(q[1], q[2]) && SameBits(k[1], k[2]) && SameBits(v[1], v[2]) &&
                      SameBits(xo[1], xo[2]))
              << what << ": late blocks loading x first";
          for (int i = 0; i < ctx * kvd; ++i) {
            const bool new_row = i / kvd == pos;
            ASSERT_EQ(std::isnan(k[1][i]) || std::isnan(v[1][i]), !new_row)
                << what << ": cache row " << i / kvd;
          }
        }
      }
    }
  }
  // Refusals.
  HostWeights w = RandomWeights(DType::kQ4_0, 3 * 64, 512);
  DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
  const DeviceMatrix m = ToDeviceSplit(w, &dg, &ds);
  HostWeights f16 = RandomWeights(DType::kF16, 3 * 64, 512);
  DevBuf<uint8_t> fg(f16.bytes.size());
  const DeviceMatrix mf = ToDevice(f16, &fg);
  DevBuf<float> dx(512), dw(512), dq(64), dk(ctx * 64), dv(ctx * 64), dcs(64);
  DevBuf<int32_t> dpos(std::vector<int32_t>{0});
  cuda::RopeOut rope;
  rope.n_heads = 1;
  rope.n_kv_heads = 1;
  rope.head_dim = 64;
  rope.positions = dpos.get();
  rope.cos_sin = dcs.get();
  rope.q = dq.get();
  rope.k_cache = dk.get();
  rope.v_cache = dv.get();
  auto run = [&](const DeviceMatrix& mat, const cuda::RopeOut& r) {
    return cuda::NormMatVecRope(mat, dx.get(), nullptr, nullptr, dw.get(), eps, nullptr, r,
                                nullptr);
  };
  CUDA_OK(run(m, rope));
  cuda::RopeOut tall = rope;
  tall.n_kv_heads = 2;  // 5 heads of rows, the matrix has 3
  EXPECT_EQ(run(m, tall), cudaErrorInvalidValue);
  cuda::RopeOut odd = rope;
  odd.head_dim = 63;
  EXPECT_EQ(run(m, odd), cudaErrorInvalidValue);
  cuda::RopeOut no_cache = rope;
  no_cache.k_cache = nullptr;
  EXPECT_EQ(run(m, no_cache), cudaErrorInvalidValue);
  cuda::RopeOut no_table = rope;
  no_table.cos_sin = nullptr;
  EXPECT_EQ(run(m, no_table), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::RopeTable(dpos.get(), dcs.get(), 63, dcs.get(), nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(run(mf, rope), cudaErrorNotSupported);
  cuda::SetRopeInProduct(false);
  EXPECT_EQ(run(m, rope), cudaErrorNotSupported);
  cuda::SetRopeInProduct(true);
  cudaGetLastError();
  cuda::SetQuantizedActivations(q8x);
}

// The gated activation applied where the fused-norm gate/up product writes its rows
// (NormMatVecGated) leaves the activation and its quantized copy bit for bit as NormMatVec
// followed by GatedActivationPacked does (each checked against the reference by its own test),
// for each activation, widths of one group of 32 neurons to more than one round of the resident
// blocks (the 13B shape's 13824: 432 groups), and the residual as NormMatVec's. An odd
// width, a missing output, a layout the product does not hold in registers and the knob off are
// refused.
TEST_F(CudaOpsTest, ActivationInProductMatchesTheProductThenTheActivation) {
  const bool q8x = cuda::QuantizedActivations();
  cuda::SetQuantizedActivations(true);
  const float eps = 1e-5f;
  for (DType type : {DType::kQ4_0, DType::kQ8_0}) {
    for (int64_t cols : {512, 5120}) {
      if (type == DType::kQ8_0 && cols > 4096) continue;  // two warps a row: not fused
      for (int ffn : {32, 1056, 13824, 17408}) {
        // 17408: 544 groups, so that a few blocks take one group more than the others.
        if ((ffn == 13824 && cols != 5120) || (ffn == 17408 && cols != 512)) continue;
        HostWeights w = RandomWeights(type, 2 * ffn, cols);
        DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
        DeviceMatrix m = ToDeviceSplit(w, &dg, &ds);
        DevBuf<float> dx(Random(cols, 2.f)), dd1(Random(cols)), dnw(Random(cols));
        for (cuda::ActKind act :
             {cuda::ActKind::kRelu, cuda::ActKind::kSilu, cuda::ActKind::kDRelu}) {
          const std::string what = std::string(DTypeName(type)) + " cols " + std::to_string(cols) +
                                   " ffn " + std::to_string(ffn) + " act " +
                                   std::to_string(static_cast<int>(act));
          // [0]: the product, then the activation kernel; [1]: the activation in the product.
          std::vector<float> out[2], xo[2];
          std::vector<int8_t> qx[2];
          for (int run = 0; run < 2; ++run) {
            DevBuf<float> dgu(2 * ffn), dout(ffn), dxo(cols);
            DevBuf<int8_t> dqx(cuda::QxBytes(ffn));
            if (run == 0) {
              CUDA_OK(cuda::NormMatVec(m, dx.get(), dd1.get(), nullptr, dnw.get(), eps, dxo.get(),
                                       dgu.get(), nullptr));
              CUDA_OK(cuda::GatedActivationPacked(act, dgu.get(), 1, ffn, dout.get(), nullptr,
                                                  dqx.get()));
            } else {
              CUDA_OK(cuda::NormMatVecGated(m, dx.get(), dd1.get(), nullptr, dnw.get(), eps,
                                            dxo.get(), act, dout.get(), dqx.get(), nullptr));
              EXPECT_TRUE(AllNan(dgu.Download())) << what << ": wrote the stacked rows";
            }
            out[run] = dout.Download();
            qx[run] = dqx.Download();
            xo[run] = dxo.Download();
            EXPECT_TRUE(dout.GuardsIntact() && dqx.GuardsIntact() && dxo.GuardsIntact()) << what;
          }
          EXPECT_FALSE(AnyNan(out[1])) << what;
          EXPECT_TRUE(SameBits(out[0], out[1])) << what << ": the activation";
          EXPECT_TRUE(SameBits(qx[0], qx[1])) << what << ": its quantized copy";
          EXPECT_TRUE(SameBits(xo[0], xo[1])) << what << ": the residual";
        }
      }
    }
  }
  // Refusals.
  HostWeights w = RandomWeights(DType::kQ4_0, 2 * 48, 512);  // 48 neurons: not whole groups
  DevBuf<uint8_t> dg(w.bytes.size()), ds(w.bytes.size());
  const DeviceMatrix m48 = ToDeviceSplit(w, &dg, &ds);
  HostWeights w64 = RandomWeights(DType::kQ4_0, 2 * 64, 512);
  DevBuf<uint8_t> dg64(w64.bytes.size()), ds64(w64.bytes.size());
  const DeviceMatrix m = ToDeviceSplit(w64, &dg64, &ds64);
  HostWeights f16 = RandomWeights(DType::kF16, 2 * 64, 512);
  DevBuf<uint8_t> fg(f16.bytes.size());
  const DeviceMatrix mf = ToDevice(f16, &fg);
  DevBuf<float> dx(512), dw(512), dout(64);
  DevBuf<int8_t> dqx(cuda::QxBytes(64));
  auto run = [&](const DeviceMatrix& mat, float* out, void* qx) {
    return cuda::NormMatVecGated(mat, dx.get(), nullptr, nullptr, dw.get(), eps, nullptr,
                                 cuda::ActKind::kRelu, out, qx, nullptr);
  };
  CUDA_OK(run(m, dout.get(), dqx.get()));
  EXPECT_EQ(run(m48, dout.get(), dqx.get()), cudaErrorInvalidValue);
  EXPECT_EQ(run(m, nullptr, dqx.get()), cudaErrorInvalidValue);
  EXPECT_EQ(run(m, dout.get(), nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(run(mf, dout.get(), dqx.get()), cudaErrorNotSupported);
  cuda::SetActivationInProduct(false);
  EXPECT_EQ(run(m, dout.get(), dqx.get()), cudaErrorNotSupported);
  cuda::SetActivationInProduct(true);
  cudaGetLastError();
  cuda::SetQuantizedActivations(q8x);
}

}  // namespace
}  // namespace cuda_test
}  // namespace pinfer
