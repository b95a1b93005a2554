// Every CUDA operator (gpu-worker/cuda/kernels.h, gemm.h) against the plain CPU reference
// (NewReferenceOps; matrix products against the plain loops below, which fix the definition the
// GPU computes), ggml test-backend-ops style: fresh random inputs on every run, the
// normalised mean squared error (as in tests/engine/ops_test.cc) at most 1e-6 where the GPU
// computes in fp32 (every row kernel, whatever the weight type, since weights are expanded to fp32
// exactly) and 1e-3 for cuBLAS products of fp16 / quantized weights (fp16 tensor-core inputs),
// no NaN, and poisoned guard regions around every device output that must come back untouched.
// Without a CUDA device every test skips.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "gpu-worker/cuda/gemm.h"
#include "gpu-worker/cuda/kernels.h"
#include "gtest/gtest.h"
#include "shared/engine/ops.h"
#include "shared/engine/sampler.h"
#include "shared/model/config.h"
#include "shared/model/tensor.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {

using cuda::DeviceMatrix;
using cuda::WType;

static_assert(static_cast<int>(DType::kF32) == static_cast<int>(WType::kF32));
static_assert(static_cast<int>(DType::kF16) == static_cast<int>(WType::kF16));
static_assert(static_cast<int>(DType::kBF16) == static_cast<int>(WType::kBF16));
static_assert(static_cast<int>(DType::kQ8_0) == static_cast<int>(WType::kQ8_0));
static_assert(static_cast<int>(DType::kQ4_0) == static_cast<int>(WType::kQ4_0));
static_assert(static_cast<int>(Activation::kDRelu) == static_cast<int>(cuda::ActKind::kDRelu));

constexpr double kFp32Limit = 1e-6;
constexpr double kFp16Limit = 1e-3;

bool HaveGpu() {
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
double Nmse(const std::vector<float>& a, const std::vector<float>& b) {
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

bool AnyNan(const std::vector<float>& a) {
  return std::any_of(a.begin(), a.end(), [](float v) { return std::isnan(v); });
}
// Untouched: DevBuf fills a fresh buffer with NaN.
bool AllNan(const std::vector<float>& a) {
  return std::all_of(a.begin(), a.end(), [](float v) { return std::isnan(v); });
}

// Bit for bit equal, NaN included (which == is not).
template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Fresh seed per run, printed so a failure can be replayed.
std::mt19937& Rng() {
  static std::mt19937 rng = [] {
    const unsigned seed = std::random_device{}();
    std::printf("cuda_ops_test seed %u\n", seed);
    return std::mt19937(seed);
  }();
  return rng;
}

std::vector<float> Random(size_t n, float scale = 1.f) {
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

HostWeights RandomWeights(DType type, int64_t rows, int64_t cols, float scale = 0.05f) {
  HostWeights w{type, rows, cols, {}};
  const size_t rb = RowBytes(type, cols);
  w.bytes.resize(rb * rows);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> v = Random(cols, scale);
    QuantizeRow(type, v.data(), w.bytes.data() + r * rb, cols);
  }
  return w;
}

DeviceMatrix ToDevice(const HostWeights& w, DevBuf<uint8_t>* buf) {
  buf->Upload(w.bytes);
  DeviceMatrix d;
  d.type = static_cast<WType>(w.type);
  d.rows = w.rows;
  d.cols = w.cols;
  d.data = buf->get();
  return d;
}

// The split layout of a block-format matrix (kernels.h), made on the GPU from the GGUF bytes.
DeviceMatrix ToDeviceSplit(const HostWeights& w, DevBuf<uint8_t>* gguf, DevBuf<uint8_t>* split) {
  DeviceMatrix src = ToDevice(w, gguf);
  DeviceMatrix d = src;
  d.data = split->get();
  d.scales = split->get() + cuda::QuantRowBytes(d.type, d.cols) * d.rows;
  EXPECT_EQ(cuda::RepackSplit(src, d, 0, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d;
}

const DType kAllTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0};

// Distinct random row ids in random order.
std::vector<int32_t> RandomRows(int total, int count) {
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
void RefMatMulRows(const TensorView& w, const int32_t* ids, int count, const float* x, int n,
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
void RefMatMul(const TensorView& w, const float* x, int n, float* y) {
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
                                hd, dout.get(), stream));
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
                              c.head_dim, dout.get(), nullptr));
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
                                c.kv_heads, c.head_dim, dout2.get(), nullptr));
      EXPECT_EQ(dout2.Download(), out);
      EXPECT_TRUE(dout2.GuardsIntact());
      if (online) {
        // The first keys loaded after the wait instead of before: the same values.
        cuda::SetAttentionEarlyLoad(false);
        CUDA_OK(cuda::AttentionAt(dq.get(), dk.get(), dv.get(), c.n, dpos.get(), ctx + 7, c.heads,
                                  c.kv_heads, c.head_dim, dout2.get(), nullptr));
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
                                  c.kv_heads, c.head_dim, dout3.get(), nullptr, dqx.get()));
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

TEST_F(CudaOpsTest, GatedActivationsMatchReference) {
  for (Activation act : {Activation::kSilu, Activation::kRelu, Activation::kDRelu}) {
    const int64_t count = 10007;
    std::vector<float> g = Random(count, 3.f), u = Random(count);
    std::vector<float> ref = g;
    ref_->GatedActivation(act, ref.data(), u.data(), count);
    DevBuf<float> dg(g), du(u);
    CUDA_OK(
        cuda::GatedActivation(static_cast<cuda::ActKind>(act), dg.get(), du.get(), count, nullptr));
    std::vector<float> out = dg.Download();
    EXPECT_FALSE(AnyNan(out));
    EXPECT_LE(Nmse(out, ref), kFp32Limit) << ActivationName(act);
    EXPECT_TRUE(dg.GuardsIntact());
  }
}

// Stacked gate/up outputs [n, 2 width] -> activations [n, width].
TEST_F(CudaOpsTest, GatedActivationPackedMatchesReference) {
  const int n = 3, width = 1000;
  for (Activation act : {Activation::kSilu, Activation::kRelu, Activation::kDRelu}) {
    std::vector<float> gu = Random(static_cast<size_t>(n) * 2 * width, 2.f);
    std::vector<float> g(n * width), u(n * width);
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < width; ++i) {
        g[t * width + i] = gu[t * 2 * width + i];
        u[t * width + i] = gu[t * 2 * width + width + i];
      }
    }
    ref_->GatedActivation(act, g.data(), u.data(), static_cast<int64_t>(g.size()));
    DevBuf<float> dgu(gu), dout(g.size());
    CUDA_OK(cuda::GatedActivationPacked(static_cast<cuda::ActKind>(act), dgu.get(), n, width,
                                        dout.get(), nullptr));
    std::vector<float> out = dout.Download();
    EXPECT_FALSE(AnyNan(out));
    EXPECT_LE(Nmse(out, g), kFp32Limit) << ActivationName(act);
    EXPECT_TRUE(dout.GuardsIntact());
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

TEST_F(CudaOpsTest, ElementwiseOpsMatchReference) {
  const int64_t count = 4099;
  std::vector<float> x = Random(count), y = Random(count), z = Random(count);
  std::vector<float> relu = x, add = y, add2 = y;
  for (int64_t i = 0; i < count; ++i) {
    relu[i] = std::max(x[i], 0.f);
    add[i] = y[i] + x[i];
    add2[i] = y[i] + (x[i] + z[i]);
  }
  DevBuf<float> dx(x), dy(y), dy2(y), dz(z), dr(x);
  CUDA_OK(cuda::Relu(dr.get(), count, nullptr));
  CUDA_OK(cuda::AddInPlace(dy.get(), dx.get(), count, nullptr));
  CUDA_OK(cuda::Add2InPlace(dy2.get(), dx.get(), dz.get(), count, nullptr));
  EXPECT_EQ(dr.Download(), relu);
  EXPECT_LE(Nmse(dy.Download(), add), kFp32Limit);
  EXPECT_LE(Nmse(dy2.Download(), add2), kFp32Limit);
  EXPECT_TRUE(dr.GuardsIntact() && dy.GuardsIntact() && dy2.GuardsIntact());
}

// The GPU's greedy pick against its definition: the token is GreedyToken's (the sampler's own
// greedy pick) and the log-probability is log-softmax computed here in double, with NaN logits
// left out. Sizes around the four-at-a-time loads and the block size, aligned and unaligned
// logits, ties (the first index wins), NaNs, infinities and an all-NaN row.
TEST_F(CudaOpsTest, GreedyPickMatchesTheSamplersDefinition) {
  auto reference_logprob = [](const std::vector<float>& l, int32_t token) {
    const double max = l[token];
    double sum = 0;
    for (float v : l) {
      if (std::isnan(v)) continue;
      sum += v == max ? 1.0 : std::exp(double(v) - max);
    }
    return -std::log(sum);
  };
  struct Case {
    std::vector<float> logits;
    const char* what;
  };
  std::vector<Case> cases;
  for (int vocab : {1, 3, 5, 31, 1000, 1025, 4099, 32000, 50257}) {
    cases.push_back({Random(vocab, 4.f), "random"});
  }
  {
    std::vector<float> l = Random(32000, 4.f);
    const int32_t best = GreedyToken(l);
    l[best / 2] = l[best];  // an earlier tie must win
    l[std::min<int>(best + 7, 31999)] = l[best];
    cases.push_back({l, "ties"});
  }
  {
    std::vector<float> l = Random(32000, 4.f);
    for (int i = 0; i < 32000; i += 97) l[i] = NAN;
    l[5] = l[6] = -INFINITY;
    cases.push_back({l, "NaNs and -inf"});
  }
  {
    std::vector<float> l = Random(4099, 4.f);
    l[4000] = l[17] = INFINITY;
    cases.push_back({l, "two +inf"});
  }
  cases.push_back({std::vector<float>(1000, -INFINITY), "all -inf"});
  for (const Case& c : cases) {
    for (int offset : {0, 1}) {  // offset 1: logits not 16-byte aligned
      SCOPED_TRACE(testing::Message()
                   << c.what << ", vocab " << c.logits.size() << ", offset " << offset);
      std::vector<float> padded(offset, 0.f);
      padded.insert(padded.end(), c.logits.begin(), c.logits.end());
      DevBuf<float> dl(padded), dlogprob(1);
      DevBuf<int32_t> dtoken(1);
      CUDA_OK(cuda::GreedyPick(dl.get() + offset, static_cast<int>(c.logits.size()), dtoken.get(),
                               dlogprob.get(), nullptr));
      const int32_t want = GreedyToken(c.logits);
      ASSERT_EQ(dtoken.Download()[0], want);
      const float got = dlogprob.Download()[0];
      EXPECT_NEAR(got, reference_logprob(c.logits, want), 1e-5 + 1e-6 * std::abs(got));
      EXPECT_TRUE(dl.GuardsIntact() && dtoken.GuardsIntact() && dlogprob.GuardsIntact());
    }
  }
  // Finite logits: the same log-probability as the sampler's greedy path.
  std::vector<float> l = Random(32000, 4.f);
  float sampler_logprob = 1;
  std::vector<float> copy = l;
  const int32_t sampler_token = Sampler(SamplingParams{}).Sample(copy, {}, &sampler_logprob);
  DevBuf<float> dl(l), dlogprob(1);
  DevBuf<int32_t> dtoken(1);
  CUDA_OK(cuda::GreedyPick(dl.get(), 32000, dtoken.get(), dlogprob.get(), nullptr));
  EXPECT_EQ(dtoken.Download()[0], sampler_token);
  EXPECT_NEAR(dlogprob.Download()[0], sampler_logprob, 1e-5);
  // Every logit NaN: token 0 (as GreedyToken) and a NaN log-probability.
  DevBuf<float> dnan(std::vector<float>(777, NAN));
  CUDA_OK(cuda::GreedyPick(dnan.get(), 777, dtoken.get(), dlogprob.get(), nullptr));
  EXPECT_EQ(dtoken.Download()[0], 0);
  EXPECT_TRUE(std::isnan(dlogprob.Download()[0]));
  EXPECT_EQ(cuda::GreedyPick(nullptr, 1, dtoken.get(), dlogprob.get(), nullptr),
            cudaErrorInvalidValue);
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

TEST_F(CudaOpsTest, EmbedMatchesDequantizedRows) {
  for (DType type : kAllTypes) {
    const int64_t vocab = 257, hidden = 384;
    HostWeights w = RandomWeights(type, vocab, hidden, 1.f);
    DevBuf<uint8_t> dw(w.bytes.size());
    DeviceMatrix m = ToDevice(w, &dw);
    std::vector<int32_t> tokens = {0, 256, 17, 17, 100};
    const int n = static_cast<int>(tokens.size());
    std::vector<float> ref(static_cast<size_t>(n) * hidden);
    for (int t = 0; t < n; ++t) {
      DequantizeRow(type, w.view().row(tokens[t]), ref.data() + t * hidden, hidden);
    }
    DevBuf<int32_t> dt(tokens);
    DevBuf<float> dout(ref.size());
    CUDA_OK(cuda::Embed(m, dt.get(), n, dout.get(), nullptr));
    EXPECT_EQ(dout.Download(), ref) << DTypeName(type);
    EXPECT_TRUE(dout.GuardsIntact());
  }
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

// llama.cpp's quantized product, written out here as the plain definition: x quantized to Q8_0
// (d = fp16(max|x| / 127), q = round-half-even(x * (1 / d))), each block contributing
// d_w * d_x * sum_i w_i q_i with w_i the block's integer values (Q4_0: nibble - 8).
std::vector<float> Q8xReference(const HostWeights& w, const std::vector<int32_t>& ids,
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
  EXPECT_EQ(cuda::Attention(nullptr, nullptr, nullptr, 1, 0, 4, 4, 512, nullptr, nullptr),
            cudaErrorInvalidValue);
  // A quantized copy of the attention's output needs whole blocks of 32 in every head.
  int8_t qx = 0;
  EXPECT_EQ(
      cuda::AttentionAt(nullptr, nullptr, nullptr, 1, nullptr, 16, 4, 4, 48, nullptr, nullptr, &qx),
      cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pinfer
