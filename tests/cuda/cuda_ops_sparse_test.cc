// The sparse kernels (sparse_gather.cu): the down projection over listed rows, the exact mode's
// activation of listed rows, the compaction of active neurons, the predictor, a whole hot FFN
// block, and the cold exchange's host-signalled wait and partial sums.
// Judged as cuda_ops_test_util.h says; without a CUDA device every test skips.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "tests/cuda/cuda_ops_test_util.h"

namespace pinfer {
namespace cuda_test {
namespace {

// The sparse down projection: y += sum of the active rows of the transposed matrix, with zero
// coefficients (inactive neurons for some tokens) and a device-side count.
TEST_F(CudaOpsTest, AccumulateRowsMatchesReferenceForEveryType) {
  // 1056 columns: block formats read in place; 4096: staged in shared memory.
  for (const auto& [type, cols] : std::vector<std::pair<DType, int64_t>>{{DType::kF32, 1056},
                                                                         {DType::kF16, 1056},
                                                                         {DType::kBF16, 1056},
                                                                         {DType::kQ8_0, 1056},
                                                                         {DType::kQ4_0, 1056},
                                                                         {DType::kQ8_0, 4096},
                                                                         {DType::kQ4_0, 4096}}) {
    const int64_t rows = 700;
    HostWeights w = RandomWeights(type, rows, cols);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    for (int n : {1, 3}) {
      for (bool listed : {false, true}) {
        const int bound = listed ? 400 : static_cast<int>(rows);
        const int count = listed ? 377 : static_cast<int>(rows);
        std::vector<int32_t> ids = listed ? RandomRows(rows, bound) : std::vector<int32_t>();
        std::vector<int32_t> all_ids(rows);
        std::iota(all_ids.begin(), all_ids.end(), 0);
        const int lda = bound + 5;
        std::vector<float> a = Random(static_cast<size_t>(n) * lda);
        std::bernoulli_distribution zero(0.3);
        for (float& v : a) {
          if (zero(Rng())) v = 0.f;
        }
        // The reference takes a packed [n, count] coefficient matrix.
        std::vector<float> packed(static_cast<size_t>(n) * count);
        for (int t = 0; t < n; ++t) {
          for (int i = 0; i < count; ++i) packed[t * count + i] = a[t * lda + i];
        }
        std::vector<float> y0 = Random(static_cast<size_t>(n) * cols);
        std::vector<float> ref = y0;
        ref_->AccumulateRows(w.view(), listed ? ids.data() : all_ids.data(), count, packed.data(),
                             n, ref.data());
        DevBuf<int32_t> dids(listed ? ids : all_ids), dcount(std::vector<int32_t>{count});
        DevBuf<float> da(a), dy(y0);
        CUDA_OK(cuda::AccumulateRows(m, listed ? dids.get() : nullptr, bound,
                                     listed ? dcount.get() : nullptr, da.get(), lda, n, dy.get(),
                                     nullptr));
        std::vector<float> out = dy.Download();
        EXPECT_FALSE(AnyNan(out));
        EXPECT_LE(Nmse(out, ref), kFp32Limit)
            << DTypeName(type) << " n " << n << " listed " << listed;
        EXPECT_TRUE(dy.GuardsIntact());
      }
    }
  }
}

// The exact mode's activation of listed rows, whose gate values sit at their full-row index.
TEST_F(CudaOpsTest, GatherGatedActivationMatchesReference) {
  const int n = 3, full = 500, bound = 200, count = 150, ld = 210;
  for (Activation act : {Activation::kRelu, Activation::kSilu}) {
    std::vector<float> gate = Random(static_cast<size_t>(n) * full, 2.f);
    std::vector<float> up = Random(static_cast<size_t>(n) * ld);
    std::vector<int32_t> idx = RandomRows(full, bound);
    std::vector<float> ref_g(static_cast<size_t>(n) * count), ref_u(ref_g.size());
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < count; ++i) {
        ref_g[t * count + i] = gate[t * full + idx[i]];
        ref_u[t * count + i] = up[t * ld + i];
      }
    }
    ref_->GatedActivation(act, ref_g.data(), ref_u.data(), static_cast<int64_t>(ref_g.size()));
    DevBuf<float> dg(gate), du(up);
    DevBuf<int32_t> didx(idx), dcount(std::vector<int32_t>{count});
    CUDA_OK(cuda::GatherGatedActivation(static_cast<cuda::ActKind>(act), dg.get(), full, didx.get(),
                                        bound, dcount.get(), du.get(), ld, n, nullptr));
    std::vector<float> all = du.Download(), out;
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < count; ++i) out.push_back(all[t * ld + i]);
      for (int i = count; i < ld; ++i) EXPECT_EQ(all[t * ld + i], up[t * ld + i]);
    }
    EXPECT_FALSE(AnyNan(out));
    EXPECT_LE(Nmse(out, ref_g), kFp32Limit);
    EXPECT_TRUE(du.GuardsIntact());
  }
}

// The host-signalled wait: work queued behind it must not run before the host sets the flag,
// must run after, and the wait clears the flag for the next signal (twice in a row here).
TEST_F(CudaOpsTest, WaitHostFlagHoldsTheStreamUntilTheHostSignals) {
  int32_t* flag = nullptr;
  CUDA_OK(cudaMallocHost(reinterpret_cast<void**>(&flag), sizeof(int32_t)));
  *flag = 0;
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DevBuf<float> y(std::vector<float>(64, 1.f)), x(std::vector<float>(64, 2.f));
  for (int round = 0; round < 2; ++round) {
    CUDA_OK(cuda::WaitHostFlag(flag, stream));
    CUDA_OK(cuda::AddInPlace(y.get(), x.get(), 64, stream));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    // (Nothing here may synchronize the device before the signal.)
    EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "round " << round;
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(__atomic_load_n(flag, __ATOMIC_ACQUIRE), 0);
    EXPECT_EQ(y.Download(), std::vector<float>(64, 1.f + 2.f * (round + 1)));
  }
  EXPECT_TRUE(y.GuardsIntact());
  EXPECT_EQ(cuda::WaitHostFlag(nullptr, stream), cudaErrorInvalidValue);
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaFreeHost(flag));
}

// The cold side's partial sums, added on the GPU straight from pinned host memory: the same
// additions in the same order as on the CPU, so the same bits, with the count given by the host
// or carried by the wait's signal (device memory), for counts below, at and over the kernel's 16
// loads at once; the host rewrites the parts between calls and every call sees the new values.
TEST_F(CudaOpsTest, SumPartsAddsHostPartsInOrder) {
  const int64_t len = 5120 + 33;
  const int max_parts = 40;
  float* parts = nullptr;
  int32_t* flag = nullptr;
  CUDA_OK(cudaMallocHost(reinterpret_cast<void**>(&parts), sizeof(float) * len * max_parts));
  CUDA_OK(cudaMallocHost(reinterpret_cast<void**>(&flag), sizeof(int32_t)));
  *flag = 0;
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DevBuf<float> out(len);
  DevBuf<int32_t> count_dev(1);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 30.f);
  for (int count : {1, 5, 16, 17, 40}) {
    for (bool signalled : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "count " << count << (signalled ? " signalled" : ""));
      for (int64_t i = 0; i < len * count; ++i) parts[i] = nd(rng);
      std::vector<float> want(len, 0.f);
      for (int p = 0; p < count; ++p) {
        for (int64_t i = 0; i < len; ++i) want[i] += parts[p * len + i];
      }
      if (signalled) {
        CUDA_OK(cuda::WaitHostFlag(flag, stream, count_dev.get()));
        CUDA_OK(cuda::SumParts(parts, len, count_dev.get(), 0, out.get(), stream));
        __atomic_store_n(flag, count, __ATOMIC_RELEASE);
      } else {
        CUDA_OK(cuda::SumParts(parts, len, nullptr, count, out.get(), stream));
      }
      CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<float> got = out.Download();
      EXPECT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * len), 0);
      if (signalled) {
        EXPECT_EQ(count_dev.Download()[0], count);
      }
    }
  }
  EXPECT_TRUE(out.GuardsIntact());
  EXPECT_EQ(cuda::SumParts(parts, len, nullptr, 0, out.get(), stream), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::SumParts(nullptr, len, nullptr, 1, out.get(), stream), cudaErrorInvalidValue);
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaFreeHost(flag));
  CUDA_OK(cudaFreeHost(parts));
}

// Compaction against a plain loop: ordered ids of the neurons active for any token, all neurons
// or through a map of global ids (hot or cold subsets), many passes of the 1024-thread block;
// with per-token scales (PowerInfer's pre-norm scores times rms(residual)) against a threshold;
// with the threshold lowered by a shift the kernel reads from pinned host memory (the module's
// cold guess), changed between launches, and with the ids of the neurons above the unshifted
// threshold marked (the guess's first tier).
TEST_F(CudaOpsTest, CompactActiveListsExactlyTheActiveNeurons) {
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, sizeof(float)), cudaSuccess);
  float* shift = static_cast<float*>(pinned);
  for (int n : {1, 3}) {
    for (int len : {37, 13824}) {
      for (int variant = 0; variant < 6; ++variant) {
        const bool mapped = variant == 1 || variant >= 4, scaled = variant == 2;
        const bool shifted = variant >= 3, marked = variant == 5;
        *shift = variant == 3 || marked ? 0.5f : -0.25f;
        const int full = 13824;
        std::vector<float> v = Random(static_cast<size_t>(n) * full);
        for (float& s : v) s -= 1.3f;  // about 10% above zero
        std::vector<float> scale(n, 1.f);
        const float threshold = scaled ? 0.25f : 0.f;
        const float effective = shifted ? threshold - *shift : threshold;
        if (scaled) {
          for (float& s : scale) s = 0.5f + std::abs(Random(1)[0]);
        }
        std::vector<int32_t> map;
        if (mapped) {
          map = RandomRows(full, len);
          std::sort(map.begin(), map.end());
          // Every seventh entry serves nobody (an empty cache slot, a neuron held by a slot).
          for (int j = 3; j < len; j += 7) map[j] = -1;
        }
        std::vector<int32_t> expect;
        for (int j = 0; j < len; ++j) {
          const int g = mapped ? map[j] : j;
          if (g < 0) continue;
          bool any = false, above = false;
          for (int t = 0; t < n; ++t) {
            any = any || v[static_cast<size_t>(t) * full + g] * scale[t] > effective;
            above = above || v[static_cast<size_t>(t) * full + g] * scale[t] > threshold;
          }
          if (any) {
            expect.push_back(marked && above ? static_cast<int32_t>(j | cuda::kAboveBit) : j);
          }
        }
        DevBuf<float> dv(v), dscale(scale);
        DevBuf<int32_t> dmap(mapped ? map : std::vector<int32_t>{0}), didx(len), dcount(1);
        CUDA_OK(cuda::CompactActive(dv.get(), n, full, mapped ? dmap.get() : nullptr, len,
                                    threshold, didx.get(), dcount.get(), nullptr,
                                    scaled ? dscale.get() : nullptr, shifted ? shift : nullptr,
                                    marked));
        std::vector<int32_t> count = dcount.Download(), idx = didx.Download();
        ASSERT_EQ(count[0], static_cast<int32_t>(expect.size()));
        idx.resize(expect.size());
        EXPECT_EQ(idx, expect) << "n " << n << " len " << len << " variant " << variant;
        EXPECT_TRUE(didx.GuardsIntact() && dcount.GuardsIntact());
      }
    }
  }
  cudaFreeHost(shift);
}

// The predictor: scores = fc2(relu(fc1(x))), then the neurons with a positive score.
TEST_F(CudaOpsTest, PredictorMatchesReference) {
  const int hidden = 512, rank = 128, ffn = 1536, n = 2;
  HostWeights fc1 = RandomWeights(DType::kF16, rank, hidden, 0.1f);
  HostWeights fc2 = RandomWeights(DType::kF16, ffn, rank, 0.1f);
  std::vector<float> x = Random(static_cast<size_t>(n) * hidden);
  std::vector<float> h(static_cast<size_t>(n) * rank), ref(static_cast<size_t>(n) * ffn);
  RefMatMul(fc1.view(), x.data(), n, h.data());
  for (float& v : h) v = std::max(v, 0.f);
  RefMatMul(fc2.view(), h.data(), n, ref.data());
  DevBuf<uint8_t> d1(fc1.bytes.size()), d2(fc2.bytes.size());
  DeviceMatrix m1 = ToDevice(fc1, &d1), m2 = ToDevice(fc2, &d2);
  DevBuf<float> dx(x), dh(h.size()), ds(ref.size());
  CUDA_OK(cuda::MatVecRows(m1, nullptr, rank, nullptr, dx.get(), n, dh.get(), rank, nullptr));
  CUDA_OK(cuda::Relu(dh.get(), static_cast<int64_t>(h.size()), nullptr));
  CUDA_OK(cuda::MatVecRows(m2, nullptr, ffn, nullptr, dh.get(), n, ds.get(), ffn, nullptr));
  std::vector<float> out = ds.Download();
  EXPECT_FALSE(AnyNan(out));
  EXPECT_LE(Nmse(out, ref), kFp32Limit);
  EXPECT_TRUE(ds.GuardsIntact() && dh.GuardsIntact());
}

// A hot FFN block as the backend runs it in exact mode, against the reference composition:
// gate over every hot row, compaction of gate > 0, up for the active rows only, activation,
// then the sum of the active rows of the transposed down matrix.
TEST_F(CudaOpsTest, SparseHotFfnMatchesReference) {
  for (DType type : {DType::kF16, DType::kQ8_0, DType::kQ4_0}) {
    const int hidden = 512, n_hot = 900;
    HostWeights gate = RandomWeights(type, n_hot, hidden), up = RandomWeights(type, n_hot, hidden);
    HostWeights down_t = RandomWeights(type, n_hot, hidden);
    std::vector<float> x = Random(hidden);
    // Reference: gates of all rows, active = gate > 0, up rows of the active, relu(g) * u.
    std::vector<float> g(n_hot);
    RefMatMul(gate.view(), x.data(), 1, g.data());
    std::vector<int32_t> active;
    for (int i = 0; i < n_hot; ++i) {
      if (g[i] > 0) active.push_back(i);
    }
    const int count = static_cast<int>(active.size());
    std::vector<float> ga(count), ua(count);
    for (int i = 0; i < count; ++i) ga[i] = g[active[i]];
    RefMatMulRows(up.view(), active.data(), count, x.data(), 1, ua.data());
    ref_->GatedActivation(Activation::kRelu, ga.data(), ua.data(), count);
    std::vector<float> ref(hidden, 0.f);
    ref_->AccumulateRows(down_t.view(), active.data(), count, ga.data(), 1, ref.data());

    DevBuf<uint8_t> dg(gate.bytes.size()), du(up.bytes.size()), dd(down_t.bytes.size());
    DeviceMatrix mg = ToDevice(gate, &dg), mu = ToDevice(up, &du), md = ToDevice(down_t, &dd);
    DevBuf<float> dx(x), dgate(n_hot), dup(n_hot), dout(std::vector<float>(hidden, 0.f));
    DevBuf<int32_t> didx(n_hot), dcount(1);
    CUDA_OK(
        cuda::MatVecRows(mg, nullptr, n_hot, nullptr, dx.get(), 1, dgate.get(), n_hot, nullptr));
    CUDA_OK(cuda::CompactActive(dgate.get(), 1, n_hot, nullptr, n_hot, 0.f, didx.get(),
                                dcount.get(), nullptr));
    CUDA_OK(cuda::MatVecRows(mu, didx.get(), n_hot, dcount.get(), dx.get(), 1, dup.get(), n_hot,
                             nullptr));
    CUDA_OK(cuda::GatherGatedActivation(cuda::ActKind::kRelu, dgate.get(), n_hot, didx.get(), n_hot,
                                        dcount.get(), dup.get(), n_hot, 1, nullptr));
    CUDA_OK(cuda::AccumulateRows(md, didx.get(), n_hot, dcount.get(), dup.get(), n_hot, 1,
                                 dout.get(), nullptr));
    EXPECT_EQ(dcount.Download()[0], count);
    std::vector<float> out = dout.Download();
    EXPECT_FALSE(AnyNan(out));
    EXPECT_LE(Nmse(out, ref), kFp32Limit) << DTypeName(type);
    EXPECT_TRUE(dout.GuardsIntact());
  }
}

}  // namespace
}  // namespace cuda_test
}  // namespace pinfer
