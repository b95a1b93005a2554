// The norms, RoPE and attention kernels (norm_rope.cu, attention.cu) against the CPU reference.
// Judged as cuda_ops_test_util.h says; without a CUDA device every test skips.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "tests/cuda/cuda_ops_test_util.h"

namespace pinfer {
namespace cuda_test {
namespace {

// Both norm kernels where the eight-a-thread one applies (256, 2048, 5120), the element-a-lane
// one elsewhere (9216: longer than its registers hold).
TEST_F(CudaOpsTest, RmsNormMatchesReference) {
  for (bool vec8 : {true, false}) {
    cuda::SetNormVec8(vec8);
    for (int dim : {256, 384, 1000, 2048, 5120, 9216}) {
      const int n = 3;
      std::vector<float> x = Random(n * dim, 2.f), w = Random(dim);
      std::vector<float> ref(n * dim);
      ref_->RmsNorm(x.data(), w.data(), n, dim, 1e-5f, ref.data());
      DevBuf<float> dx(x), dw(w), dout(n * dim);
      CUDA_OK(cuda::RmsNorm(dx.get(), dw.get(), n, dim, 1e-5f, dout.get(), nullptr));
      std::vector<float> out = dout.Download();
      EXPECT_FALSE(AnyNan(out));
      EXPECT_LE(Nmse(out, ref), kFp32Limit) << "dim " << dim << " vec8 " << vec8;
      EXPECT_TRUE(dout.GuardsIntact());
    }
  }
  cuda::SetNormVec8(true);
}

// x += d1 (+ d2), then the norm, writing over d1 (the backend's in-place use), and each token's
// rms for the pre-norm predictors' threshold.
TEST_F(CudaOpsTest, ResidualRmsNormMatchesReference) {
  for (int variant = 0; variant < 4; ++variant) {
    const bool two = variant % 2 == 1;
    cuda::SetNormVec8(variant < 2);
    const int n = 3, dim = 5120;
    std::vector<float> x = Random(n * dim), d1 = Random(n * dim), d2 = Random(n * dim);
    std::vector<float> w = Random(dim), ref_x = x, ref(n * dim);
    for (int i = 0; i < n * dim; ++i) ref_x[i] += two ? d1[i] + d2[i] : d1[i];
    ref_->RmsNorm(ref_x.data(), w.data(), n, dim, 1e-5f, ref.data());
    DevBuf<float> dx(x), dd1(d1), dd2(d2), dw(w), drms(n);
    CUDA_OK(cuda::ResidualRmsNorm(dx.get(), dd1.get(), two ? dd2.get() : nullptr, dw.get(), n, dim,
                                  1e-5f, dd1.get(), nullptr, nullptr, drms.get()));
    std::vector<float> out = dd1.Download(), rms = drms.Download();
    EXPECT_FALSE(AnyNan(out));
    EXPECT_LE(Nmse(out, ref), kFp32Limit);
    EXPECT_LE(Nmse(dx.Download(), ref_x), kFp32Limit);
    for (int t = 0; t < n; ++t) {
      double ss = 0;
      for (int i = 0; i < dim; ++i)
        ss += static_cast<double>(ref_x[t * dim + i]) * ref_x[t * dim + i];
      const double want = std::sqrt(ss / dim + 1e-5);
      EXPECT_NEAR(rms[t], want, 1e-5 * want) << "token " << t;
    }
    EXPECT_TRUE(dd1.GuardsIntact() && dx.GuardsIntact() && drms.GuardsIntact());
  }
  cuda::SetNormVec8(true);
}

// The stacked q/k/v projection's output rotated and scattered: q to its buffer, k and v to the
// cache rows of the new positions (other cache rows untouched).
TEST_F(CudaOpsTest, RopeQkvToCacheMatchesReference) {
  for (bool interleaved : {false, true}) {
    const int n = 4, heads = 8, kv_heads = 2, hd = 64, pos0 = 21, ctx = 32;
    const int qd = heads * hd, kvd = kv_heads * hd;
    std::vector<float> inv(hd / 2);
    for (int i = 0; i < hd / 2; ++i)
      inv[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / hd));
    std::vector<int32_t> pos(n);
    for (int t = 0; t < n; ++t) pos[t] = pos0 + t;
    std::vector<float> qkv = Random(static_cast<size_t>(n) * (qd + 2 * kvd));
    std::vector<float> q(n * qd), k(n * kvd), v(n * kvd);
    for (int t = 0; t < n; ++t) {
      const float* src = qkv.data() + t * (qd + 2 * kvd);
      std::copy(src, src + qd, q.begin() + t * qd);
      std::copy(src + qd, src + qd + kvd, k.begin() + t * kvd);
      std::copy(src + qd + kvd, src + qd + 2 * kvd, v.begin() + t * kvd);
    }
    ref_->Rope(q.data(), n, heads, hd, pos.data(), inv.data(), interleaved);
    ref_->Rope(k.data(), n, kv_heads, hd, pos.data(), inv.data(), interleaved);
    DevBuf<float> dqkv(qkv), dinv(inv), dq(q.size()), dk(ctx * kvd), dv(ctx * kvd);
    DevBuf<int32_t> dpos(pos);
    CUDA_OK(cuda::RopeQkvToCache(dqkv.get(), n, heads, kv_heads, hd, dpos.get(), dinv.get(),
                                 interleaved, dq.get(), dk.get(), dv.get(), nullptr));
    EXPECT_LE(Nmse(dq.Download(), q), kFp32Limit);
    std::vector<float> kc = dk.Download(), vc = dv.Download();
    std::vector<float> k_new(kc.begin() + pos0 * kvd, kc.begin() + (pos0 + n) * kvd);
    std::vector<float> v_new(vc.begin() + pos0 * kvd, vc.begin() + (pos0 + n) * kvd);
    EXPECT_LE(Nmse(k_new, k), kFp32Limit);
    EXPECT_EQ(v_new, v);
    for (int i = 0; i < ctx * kvd; ++i) {
      if (i < pos0 * kvd || i >= (pos0 + n) * kvd) {
        ASSERT_TRUE(std::isnan(kc[i]) && std::isnan(vc[i])) << "cache row " << i / kvd;
      }
    }
    EXPECT_TRUE(dq.GuardsIntact() && dk.GuardsIntact() && dv.GuardsIntact());
  }
}

// On a stream, with programmatic launch, as a decode step runs them: RoPE writes the new keys
// into a cache whose rows from there on hold NaN, and the attention that follows loads the older
// keys before it waits for RoPE; a new key read too early would bring a NaN into the output.
TEST_F(CudaOpsTest, AttentionAfterRopeOnAStreamReadsTheNewKeys) {
  const int heads = 8, kv_heads = 2, hd = 128, qd = heads * hd, kvd = kv_heads * hd;
  std::vector<float> inv(hd / 2);
  for (int i = 0; i < hd / 2; ++i)
    inv[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / hd));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int n : {1, 3}) {
    for (int pos0 : {0, 5, 47, 300}) {
      const int ctx = pos0 + n;
      std::vector<float> qkv = Random(static_cast<size_t>(n) * (qd + 2 * kvd));
      std::vector<float> kc = Random(static_cast<size_t>(ctx) * kvd), vc = Random(kc.size());
      std::vector<int32_t> pos(n);
      std::vector<float> q(n * qd);
      for (int t = 0; t < n; ++t) {
        pos[t] = pos0 + t;
        const float* src = qkv.data() + t * (qd + 2 * kvd);
        std::copy(src, src + qd, q.begin() + t * qd);
        std::copy(src + qd, src + qd + kvd, kc.begin() + (pos0 + t) * kvd);
        std::copy(src + qd + kvd, src + qd + 2 * kvd, vc.begin() + (pos0 + t) * kvd);
      }
      ref_->Rope(q.data(), n, heads, hd, pos.data(), inv.data(), false);
      ref_->Rope(kc.data() + pos0 * kvd, n, kv_heads, hd, pos.data(), inv.data(), false);
      std::vector<float> ref(q.size());
      ref_->Attention(q.data(), kc.data(), vc.data(), n, pos0, heads, kv_heads, hd, ref.data());
      std::vector<float> k_old(kc), v_old(vc);
      std::fill(k_old.begin() + pos0 * kvd, k_old.end(), NAN);
      std::fill(v_old.begin() + pos0 * kvd, v_old.end(), NAN);
      DevBuf<float> dqkv(qkv), dinv(inv), dq(q.size()), dk(k_old), dv(v_old), dout(q.size());
      DevBuf<int32_t> dpos(pos);
      CUDA_OK(cudaDeviceSynchronize());  // the buffers' set-up, on the legacy stream
      CUDA_OK(cuda::RopeQkvToCache(dqkv.get(), n, heads, kv_heads, hd, dpos.get(), dinv.get(),
                                   false, dq.get(), dk.get(), dv.get(), stream));
      CUDA_OK(cuda::AttentionAt(dq.get(), dk.get(), dv.get(), n, dpos.get(), ctx, heads, kv_heads,
                                hd, /*window=*/0, dout.get(), stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<float> out = dout.Download();
      EXPECT_FALSE(AnyNan(out)) << "n " << n << " pos0 " << pos0;
      EXPECT_LE(Nmse(out, ref), kFp32Limit) << "n " << n << " pos0 " << pos0;
    }
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_F(CudaOpsTest, RopeBothLayoutsMatchReference) {
  for (bool interleaved : {false, true}) {
    for (int head_dim : {64, 128}) {
      const int n = 5, heads = 6;
      std::vector<float> inv(head_dim / 2);
      for (int i = 0; i < head_dim / 2; ++i) {
        inv[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / head_dim));
      }
      std::vector<int32_t> pos(n);
      std::uniform_int_distribution<int> pd(0, 4000);
      for (int32_t& p : pos) p = pd(Rng());
      std::vector<float> x = Random(static_cast<size_t>(n) * heads * head_dim);
      std::vector<float> ref = x;
      ref_->Rope(ref.data(), n, heads, head_dim, pos.data(), inv.data(), interleaved);
      DevBuf<float> dx(x), dinv(inv);
      DevBuf<int32_t> dpos(pos);
      CUDA_OK(
          cuda::Rope(dx.get(), n, heads, head_dim, dpos.get(), dinv.get(), interleaved, nullptr));
      std::vector<float> out = dx.Download();
      EXPECT_FALSE(AnyNan(out));
      EXPECT_LE(Nmse(out, ref), kFp32Limit) << "interleaved " << interleaved << " hd " << head_dim;
      EXPECT_TRUE(dx.GuardsIntact());
    }
  }
}

// Decode (n = 1) and prompt batches (n > 1), grouped-query heads, short and long contexts
// (the long one needs more than 48 KB of scores in shared memory), with the online-softmax
// kernel (head sizes 32, 64, 128; 96 takes the other kernel either way) and the stored-scores
// kernel.
TEST_F(CudaOpsTest, AttentionDecodeAndPromptMatchReference) {
  struct Case {
    int n, pos0, heads, kv_heads, head_dim;
  };
  for (bool online : {true, false}) {
    cuda::SetOnlineAttention(online);
    SCOPED_TRACE(online ? "online softmax" : "stored scores");
    for (const Case& c : {Case{1, 0, 4, 4, 64}, Case{1, 37, 8, 2, 64}, Case{1, 300, 6, 2, 128},
                          Case{9, 0, 6, 2, 64}, Case{7, 13, 8, 8, 128}, Case{33, 100, 4, 1, 96},
                          Case{1, 15000, 2, 1, 128}, Case{1, 63, 40, 40, 128},
                          Case{1, 64, 40, 40, 128}, Case{5, 70, 4, 2, 32}}) {
      const int ctx = c.pos0 + c.n;
      const size_t kv = static_cast<size_t>(ctx) * c.kv_heads * c.head_dim;
      std::vector<float> q = Random(static_cast<size_t>(c.n) * c.heads * c.head_dim);
      std::vector<float> k = Random(kv), v = Random(kv);
      std::vector<float> ref(q.size());
      ref_->Attention(q.data(), k.data(), v.data(), c.n, c.pos0, c.heads, c.kv_heads, c.head_dim,
                      ref.data());
      DevBuf<float> dq(q), dk(k), dv(v), dout(q.size());
      CUDA_OK(cuda::Attention(dq.get(), dk.get(), dv.get(), c.n, c.pos0, c.heads, c.kv_heads,
                              c.head_dim, /*window=*/0, dout.get(), nullptr));
      std::vector<float> out = dout.Download();
      EXPECT_FALSE(AnyNan(out));
      EXPECT_LE(Nmse(out, ref), kFp32Limit) << "n " << c.n << " pos0 " << c.pos0;
      EXPECT_TRUE(dout.GuardsIntact());
      // The graph-friendly variant: the first position from device memory.
      std::vector<int32_t> positions(c.n);
      for (int t = 0; t < c.n; ++t) positions[t] = c.pos0 + t;
      DevBuf<int32_t> dpos(positions);
      DevBuf<float> dout2(q.size());
      CUDA_OK(cuda::AttentionAt(dq.get(), dk.get(), dv.get(), c.n, dpos.get(), ctx + 7, c.heads,
                                c.kv_heads, c.head_dim, /*window=*/0, dout2.get(), nullptr));
      EXPECT_EQ(dout2.Download(), out);
      EXPECT_TRUE(dout2.GuardsIntact());
      if (online) {
        // The first keys loaded after the wait instead of before: the same values.
        cuda::SetAttentionEarlyLoad(false);
        CUDA_OK(cuda::AttentionAt(dq.get(), dk.get(), dv.get(), c.n, dpos.get(), ctx + 7, c.heads,
                                  c.kv_heads, c.head_dim, /*window=*/0, dout2.get(), nullptr));
        cuda::SetAttentionEarlyLoad(true);
        EXPECT_EQ(dout2.Download(), out) << "early load, n " << c.n << " pos0 " << c.pos0;
      }
      // The output quantized by the attention itself gives the int8 product what its own
      // quantization gives, bit for bit.
      const int qd = c.heads * c.head_dim;
      if (c.head_dim % 32 == 0 && c.n <= 4) {
        DevBuf<int8_t> dqx(c.n * cuda::QxBytes(qd));
        DevBuf<float> dout3(q.size());
        CUDA_OK(cuda::AttentionAt(dq.get(), dk.get(), dv.get(), c.n, dpos.get(), ctx + 7, c.heads,
                                  c.kv_heads, c.head_dim, /*window=*/0, dout3.get(), nullptr,
                                  dqx.get()));
        EXPECT_EQ(dout3.Download(), out);
        HostWeights w = RandomWeights(DType::kQ8_0, 29, qd);
        DevBuf<uint8_t> wg(w.bytes.size()), ws(w.bytes.size());
        const DeviceMatrix m = ToDeviceSplit(w, &wg, &ws);
        DevBuf<float> y1(c.n * 29), y2(c.n * 29);
        CUDA_OK(cuda::MatVecRows(m, nullptr, 29, nullptr, dout3.get(), c.n, y1.get(), 29, nullptr,
                                 dqx.get()));
        CUDA_OK(cuda::MatVecRows(m, nullptr, 29, nullptr, dout3.get(), c.n, y2.get(), 29, nullptr));
        EXPECT_EQ(y1.Download(), y2.Download()) << "n " << c.n << " pos0 " << c.pos0;
        EXPECT_TRUE(dqx.GuardsIntact());
      }
    }
  }
  cuda::SetOnlineAttention(true);
}

// Mistral's sliding window: each query sees only its last `window` keys, against the reference's
// window (CpuOps::Attention), in both kernels, with the first position from the host and from
// device memory, and with the older keys loaded before or after the wait. Windows of 1 (the
// query's own key), shorter than a batch of keys, longer than a prompt, and covering the whole
// context (which must equal no window at all).
TEST_F(CudaOpsTest, AttentionSlidingWindowMatchesReference) {
  struct Case {
    int n, pos0, heads, kv_heads, head_dim, window;
  };
  for (bool online : {true, false}) {
    cuda::SetOnlineAttention(online);
    SCOPED_TRACE(online ? "online softmax" : "stored scores");
    for (const Case& c :
         {Case{1, 300, 8, 2, 128, 1}, Case{1, 300, 8, 2, 128, 5}, Case{1, 300, 4, 4, 64, 64},
          Case{9, 40, 6, 2, 64, 16}, Case{7, 3, 8, 8, 128, 4}, Case{33, 100, 4, 1, 96, 50},
          Case{5, 70, 4, 2, 32, 200}, Case{1, 1000, 2, 1, 128, 4096}}) {
      const int ctx = c.pos0 + c.n;
      const size_t kv = static_cast<size_t>(ctx) * c.kv_heads * c.head_dim;
      std::vector<float> q = Random(static_cast<size_t>(c.n) * c.heads * c.head_dim);
      std::vector<float> k = Random(kv), v = Random(kv);
      std::vector<float> ref(q.size()), full(q.size());
      ref_->Attention(q.data(), k.data(), v.data(), c.n, c.pos0, c.heads, c.kv_heads, c.head_dim,
                      c.window, ref.data());
      ref_->Attention(q.data(), k.data(), v.data(), c.n, c.pos0, c.heads, c.kv_heads, c.head_dim,
                      full.data());
      const bool narrows = c.window < ctx;
      DevBuf<float> dq(q), dk(k), dv(v), dout(q.size());
      CUDA_OK(cuda::Attention(dq.get(), dk.get(), dv.get(), c.n, c.pos0, c.heads, c.kv_heads,
                              c.head_dim, c.window, dout.get(), nullptr));
      const std::vector<float> out = dout.Download();
      const std::string where = "n " + std::to_string(c.n) + " pos0 " + std::to_string(c.pos0) +
                                " window " + std::to_string(c.window);
      EXPECT_FALSE(AnyNan(out)) << where;
      EXPECT_LE(Nmse(out, ref), kFp32Limit) << where;
      // The window changes the result where it is shorter than the context, and only there.
      if (narrows) {
        EXPECT_GT(Nmse(out, full), 1e-4) << where;
      } else {
        EXPECT_LE(Nmse(out, full), kFp32Limit) << where;
      }
      EXPECT_TRUE(dout.GuardsIntact());
      std::vector<int32_t> positions(c.n);
      for (int t = 0; t < c.n; ++t) positions[t] = c.pos0 + t;
      DevBuf<int32_t> dpos(positions);
      for (bool early : {true, false}) {
        cuda::SetAttentionEarlyLoad(early);
        DevBuf<float> dout2(q.size());
        CUDA_OK(cuda::AttentionAt(dq.get(), dk.get(), dv.get(), c.n, dpos.get(), ctx + 7, c.heads,
                                  c.kv_heads, c.head_dim, c.window, dout2.get(), nullptr));
        EXPECT_EQ(dout2.Download(), out) << where << (early ? " early load" : " late load");
        EXPECT_TRUE(dout2.GuardsIntact());
      }
      cuda::SetAttentionEarlyLoad(true);
    }
  }
  cuda::SetOnlineAttention(true);
}

}  // namespace
}  // namespace cuda_test
}  // namespace pinfer
