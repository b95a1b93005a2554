// Every optimised CPU operator against the plain reference, ggml test-backend-ops style: fresh
// random inputs, normalised mean squared error limits, NaN checks and guard bytes around every
// output. Runs each compiled-in instruction set (scalar, AVX2, AVX-512 where the CPU has it),
// single- and multi-threaded.
#include "shared/engine/ops.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "shared/engine/row_kernels.h"
#include "shared/model/tensor.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {

constexpr float kGuard = 1234.5678f;
constexpr int kGuardLen = 16;

// An output buffer with guard values on both sides.
class Guarded {
 public:
  explicit Guarded(size_t n, float init = 0.f) : buf_(n + 2 * kGuardLen, kGuard), n_(n) {
    std::fill(data(), data() + n, init);
  }
  float* data() { return buf_.data() + kGuardLen; }
  const float* data() const { return buf_.data() + kGuardLen; }
  bool GuardsIntact() const {
    for (int i = 0; i < kGuardLen; ++i) {
      if (buf_[i] != kGuard || buf_[kGuardLen + n_ + i] != kGuard) return false;
    }
    return true;
  }
  size_t size() const { return n_; }

 private:
  std::vector<float> buf_;
  size_t n_;
};

// sum (a-b)^2 / sum b^2, as in ggml's test-backend-ops.
double Nmse(const float* a, const float* b, size_t n) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < n; ++i) {
    err += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  return ref == 0 ? err : err / ref;
}

bool AnyNan(const float* a, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(a[i])) return true;
  }
  return false;
}

std::vector<float> Random(size_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// A weight matrix stored in `dtype`, built from random fp32 values.
struct Weight {
  std::vector<uint8_t> bytes;
  TensorView view;
};

Weight MakeWeight(DType dtype, int64_t rows, int64_t cols, std::mt19937& rng) {
  Weight w;
  std::vector<float> f = Random(rows * cols, rng, 0.5f);
  w.bytes.resize(RowBytes(dtype, cols) * rows);
  for (int64_t r = 0; r < rows; ++r) {
    QuantizeRow(dtype, f.data() + r * cols, w.bytes.data() + r * RowBytes(dtype, cols), cols);
  }
  w.view.name = "w";
  w.view.dtype = dtype;
  w.view.shape = {rows, cols};
  w.view.data = w.bytes.data();
  return w;
}

struct Impl {
  const RowKernels* kernels;
  int threads;
};

std::vector<Impl> Implementations() {
  std::vector<Impl> out;
  const bool avx512 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512vnni");
  for (const RowKernels* k :
       {RowKernelsScalar(), RowKernelsAvx2(), RowKernelsAvx512(false), RowKernelsAvx512(true)}) {
    if (k == nullptr) continue;
    if (k == RowKernelsAvx2() && !__builtin_cpu_supports("avx2")) continue;
    if (k == RowKernelsAvx512(false) && !avx512) continue;
    if (k == RowKernelsAvx512(true) && !(avx512 && __builtin_cpu_supports("avx512vbmi"))) continue;
    out.push_back({k, 1});
    out.push_back({k, 3});
  }
  return out;
}

class OpsTest : public ::testing::TestWithParam<Impl> {
 protected:
  void SetUp() override {
    pool_ = std::make_unique<ThreadPool>(GetParam().threads);
    ops_ = NewSimdOpsWithKernels(pool_.get(), GetParam().kernels);
    ref_ = NewReferenceOps();
  }
  void ExpectClose(const Guarded& got, const Guarded& want, double limit) {
    EXPECT_TRUE(got.GuardsIntact()) << "wrote outside its output";
    EXPECT_FALSE(AnyNan(got.data(), got.size()));
    EXPECT_FALSE(AnyNan(want.data(), want.size()));
    EXPECT_LE(Nmse(got.data(), want.data(), got.size()), limit);
  }
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<CpuOps> ops_, ref_;
  std::mt19937 rng_{1234};
};

const DType kDTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0};

// The grouped kernel behind the sparse down projection must add exactly what one AXPY per row
// adds, in the same order: bit for bit, for 1..10 rows (more than a group of four or eight),
// every dtype, widths with and without a vector tail.
TEST_P(OpsTest, AxpyRowsEqualsOneAxpyPerRow) {
  const RowKernels* k = GetParam().kernels;
  for (DType dt : kDTypes) {
    for (int64_t cols : {int64_t{96}, int64_t{1056}}) {
      Weight w = MakeWeight(dt, 10, cols, rng_);
      for (int n = 1; n <= 10; ++n) {
        std::vector<float> a = Random(n, rng_), start = Random(cols, rng_);
        std::vector<const uint8_t*> rows;
        for (int j = 0; j < n; ++j) rows.push_back(static_cast<const uint8_t*>(w.view.row(j)));
        std::vector<float> want = start, got = start;
        for (int j = 0; j < n; ++j) {
          k->axpy[static_cast<size_t>(dt)](a[j], rows[j], want.data(), cols);
        }
        k->axpy_rows[static_cast<size_t>(dt)](a.data(), rows.data(), n, got.data(), cols);
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), cols * sizeof(float)))
            << DTypeName(dt) << " cols " << cols << " rows " << n;
      }
    }
  }
}

TEST_P(OpsTest, MatMulEveryDtypeAndBatch) {
  for (DType dt : kDTypes) {
    for (int n : {1, 2, 7}) {
      for (auto [rows, cols] : {std::pair<int, int>{37, 64}, {64, 96}, {5, 32}, {6, 288}}) {
        SCOPED_TRACE(testing::Message()
                     << DTypeName(dt) << " n=" << n << " " << rows << "x" << cols);
        Weight w = MakeWeight(dt, rows, cols, rng_);
        auto x = Random(n * cols, rng_);
        Guarded got(n * rows), want(n * rows);
        ops_->MatMul(w.view, x.data(), n, got.data());
        ref_->MatMul(w.view, x.data(), n, want.data());
        ExpectClose(got, want, 1e-10);
      }
    }
  }
}

// Dense and listed-row products use the same row kernels, so a row's result never depends on
// which other rows are computed with it (batched decode and sparse paths rely on this).
TEST_P(OpsTest, MatMulRowsIsBitIdenticalToMatMul) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    const int rows = 45, cols = 320;
    Weight w = MakeWeight(dt, rows, cols, rng_);
    auto x = Random(cols, rng_);
    std::vector<float> all(rows);
    ops_->MatMul(w.view, x.data(), 1, all.data());
    std::vector<int32_t> idx = {44, 3, 0, 17, 18, 19, 2};
    std::vector<float> some(idx.size());
    ops_->MatMulRows(w.view, idx.data(), idx.size(), x.data(), 1, some.data());
    for (size_t i = 0; i < idx.size(); ++i) EXPECT_EQ(some[i], all[idx[i]]) << "row " << idx[i];
  }
}

// Q8_0 and Q4_0 rows multiply x quantized to Q8_0 (llama.cpp's definition): checked by hand on
// one block, where x's rounding changes the exact fp32 answer.
TEST(QuantizedMatMulTest, ActivationsAreQuantizedToQ8_0) {
  std::vector<float> wf(32, 0.f), x(32, 0.f);
  wf[0] = wf[1] = 1.f;  // Q8_0: q = 127, 127 with d_w = fp16(1 / 127)
  x[0] = 0.5f;          // the block's largest |x|: d_x = fp16(0.5 / 127), q = 127
  x[1] = 0.003f;        // q = round(0.003 * 254) = round(0.762) = 1
  std::vector<uint8_t> wq(RowBytes(DType::kQ8_0, 32));
  QuantizeRow(DType::kQ8_0, wf.data(), wq.data(), 32);
  TensorView w{"w", DType::kQ8_0, {1, 32}, wq.data()};
  const float d_w = Fp16ToFp32(reinterpret_cast<const BlockQ8_0*>(wq.data())->d);
  const float d_x = Fp16ToFp32(Fp32ToFp16(0.5f / 127.f));
  const float want = d_w * d_x * static_cast<float>(127 * 127 + 127 * 1);
  ThreadPool pool(1);
  for (auto& ops : {NewReferenceOps(), NewSimdOps(&pool)}) {
    float y = 0;
    ops->MatMul(w, x.data(), 1, &y);
    EXPECT_FLOAT_EQ(y, want) << ops->name();
    EXPECT_NE(y, d_w * 127 * (0.5f + 0.003f)) << "fp32 activations";
  }
}

TEST_P(OpsTest, MatMulOddWidthsFp) {
  // Widths that are not a multiple of the vector length exercise the scalar tails.
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int cols : {1, 8, 13, 31, 100}) {
      Weight w = MakeWeight(dt, 9, cols, rng_);
      auto x = Random(3 * cols, rng_);
      Guarded got(27), want(27);
      ops_->MatMul(w.view, x.data(), 3, got.data());
      ref_->MatMul(w.view, x.data(), 3, want.data());
      ExpectClose(got, want, 1e-10);
    }
  }
}

TEST_P(OpsTest, MatMulRowsAndAccumulateRows) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    const int rows = 200, cols = 160, n = 3;
    Weight w = MakeWeight(dt, rows, cols, rng_);
    std::vector<int32_t> idx = {0, 3, 4, 17, 101, 150, 199, 42};
    auto x = Random(n * cols, rng_);
    Guarded got(n * idx.size()), want(n * idx.size());
    ops_->MatMulRows(w.view, idx.data(), idx.size(), x.data(), n, got.data());
    ref_->MatMulRows(w.view, idx.data(), idx.size(), x.data(), n, want.data());
    ExpectClose(got, want, 1e-10);

    auto a = Random(n * idx.size(), rng_);
    a[2] = 0;  // zero coefficients are skipped
    auto y0 = Random(n * cols, rng_);
    Guarded acc(n * cols), acc_ref(n * cols);
    std::copy(y0.begin(), y0.end(), acc.data());
    std::copy(y0.begin(), y0.end(), acc_ref.data());
    ops_->AccumulateRows(w.view, idx.data(), idx.size(), a.data(), n, acc.data());
    ref_->AccumulateRows(w.view, idx.data(), idx.size(), a.data(), n, acc_ref.data());
    ExpectClose(acc, acc_ref, 1e-10);
  }
}

// The fused per-token FFN against the reference: every dtype and activation, with the gate
// computed by the op or given, over lists shorter and longer than one chunk of neurons.
TEST_P(OpsTest, SparseFfnToken) {
  for (DType dt : kDTypes) {
    for (Activation act : {Activation::kSilu, Activation::kRelu, Activation::kDRelu}) {
      for (int n_rows : {0, 7, 150}) {
        SCOPED_TRACE(::testing::Message()
                     << DTypeName(dt) << " act " << static_cast<int>(act) << " rows " << n_rows);
        const int ffn = 300, hidden = 96;
        Weight gate = MakeWeight(dt, ffn, hidden, rng_), up = MakeWeight(dt, ffn, hidden, rng_);
        Weight down_t = MakeWeight(dt, ffn, hidden, rng_);
        std::vector<int32_t> idx(ffn);
        for (int i = 0; i < ffn; ++i) idx[i] = i;
        std::shuffle(idx.begin(), idx.end(), rng_);
        idx.resize(n_rows);
        std::sort(idx.begin(), idx.end());
        auto x = Random(hidden, rng_), y0 = Random(hidden, rng_);
        auto given = Random(std::max(n_rows, 1), rng_);
        const std::vector<const float*> gate_values = {nullptr, given.data()};
        for (const float* gv : gate_values) {
          Guarded got(hidden), want(hidden), a(std::max(n_rows, 1)), a_ref(std::max(n_rows, 1));
          std::copy(y0.begin(), y0.end(), got.data());
          std::copy(y0.begin(), y0.end(), want.data());
          const int ups = ops_->SparseFfnToken(gate.view, up.view, down_t.view, idx.data(), n_rows,
                                               act, x.data(), gv, a.data(), got.data());
          const int ups_ref =
              ref_->SparseFfnToken(gate.view, up.view, down_t.view, idx.data(), n_rows, act,
                                   x.data(), gv, a_ref.data(), want.data());
          EXPECT_EQ(ups, ups_ref);
          if (act != Activation::kSilu && n_rows > 0) {
            EXPECT_LT(ups, n_rows);  // some gates are <= 0
          }
          ExpectClose(a, a_ref, 1e-10);
          ExpectClose(got, want, 1e-10);
          // A neuron skipped by its gate has a zero coefficient; the others match their gate.
          for (int i = 0; i < n_rows; ++i) {
            if (act != Activation::kSilu && a_ref.data()[i] == 0) {
              EXPECT_EQ(a.data()[i], 0.f);
            }
          }
        }
      }
    }
  }
}

// Rows interleaved with other tensors' rows (TensorView::row_stride, the cpu-worker's per-neuron
// bundles) give every row op the same bits as the packed matrices: the products, the row sums and
// the fused FFN, single tokens and batches, in this kernel set and in the reference.
TEST_P(OpsTest, StridedRowsGiveTheSameBitsAsPackedRows) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    const int ffn = 150, hidden = 96;
    Weight gate = MakeWeight(dt, ffn, hidden, rng_), up = MakeWeight(dt, ffn, hidden, rng_);
    Weight down_t = MakeWeight(dt, ffn, hidden, rng_);
    const size_t rb = gate.view.row_bytes();
    std::vector<uint8_t> bundles(3 * rb * ffn);
    for (int j = 0; j < ffn; ++j) {
      std::memcpy(&bundles[3 * rb * j], gate.view.row(j), rb);
      std::memcpy(&bundles[3 * rb * j + rb], up.view.row(j), rb);
      std::memcpy(&bundles[3 * rb * j + 2 * rb], down_t.view.row(j), rb);
    }
    TensorView bg = gate.view, bu = up.view, bd = down_t.view;
    bg.data = &bundles[0];
    bu.data = &bundles[rb];
    bd.data = &bundles[2 * rb];
    bg.row_stride = bu.row_stride = bd.row_stride = 3 * rb;
    std::vector<int32_t> idx;
    for (int i = 0; i < ffn; i += 3) idx.push_back(i);
    const int k = static_cast<int>(idx.size());
    for (const CpuOps* ops : {ops_.get(), ref_.get()}) {
      for (int n : {1, 5}) {
        auto x = Random(static_cast<size_t>(n) * hidden, rng_);
        std::vector<float> packed(static_cast<size_t>(n) * ffn), strided(packed.size());
        ops->MatMul(gate.view, x.data(), n, packed.data());
        ops->MatMul(bg, x.data(), n, strided.data());
        EXPECT_EQ(packed, strided) << "MatMul n " << n;
        ops->MatMulRows(up.view, idx.data(), k, x.data(), n, packed.data());
        ops->MatMulRows(bu, idx.data(), k, x.data(), n, strided.data());
        EXPECT_EQ(packed, strided) << "MatMulRows n " << n;
        auto a = Random(static_cast<size_t>(n) * k, rng_);
        std::vector<float> acc(static_cast<size_t>(n) * hidden, 0.f), acc_s = acc;
        ops->AccumulateRows(down_t.view, idx.data(), k, a.data(), n, acc.data());
        ops->AccumulateRows(bd, idx.data(), k, a.data(), n, acc_s.data());
        EXPECT_EQ(acc, acc_s) << "AccumulateRows n " << n;
      }
      std::vector<float> x = Random(hidden, rng_), out(hidden, 0.f), out_s(hidden, 0.f);
      std::vector<float> coef(k), coef_s(k);
      ops->SparseFfnToken(gate.view, up.view, down_t.view, idx.data(), k, Activation::kRelu,
                          x.data(), nullptr, coef.data(), out.data());
      ops->SparseFfnToken(bg, bu, bd, idx.data(), k, Activation::kRelu, x.data(), nullptr,
                          coef_s.data(), out_s.data());
      EXPECT_EQ(out, out_s);
      EXPECT_EQ(coef, coef_s);
    }
  }
}

// The fused FFN splits the list into one part per pool thread: the same bits run to run for a
// given thread count, and within fp32 rounding of the one-thread result for two and five
// threads, for lists of one part and of many. The parts are added to what out held (F16 rows of
// 100 columns: a column range that is not whole 16-column lines).
TEST(SparseFfnTokenTest, SameBitsRunToRunAndCloseAcrossThreadCounts) {
  std::mt19937 rng(7);
  const int ffn = 2500;
  for (DType dt : {DType::kF16, DType::kQ4_0}) {
    const int hidden = dt == DType::kF16 ? 100 : 96;
    const std::vector<float> before = Random(hidden, rng);
    Weight gate = MakeWeight(dt, ffn, hidden, rng), up = MakeWeight(dt, ffn, hidden, rng);
    Weight down_t = MakeWeight(dt, ffn, hidden, rng);
    auto x = Random(hidden, rng);
    for (int n_rows : {7, 150, 700, 2500}) {
      std::vector<int32_t> idx(n_rows);
      for (int i = 0; i < n_rows; ++i) idx[i] = i * (ffn / n_rows);
      std::vector<float> one;
      for (int threads : {1, 2, 5}) {
        ThreadPool pool(threads);
        auto ops = NewSimdOps(&pool);
        std::vector<std::vector<float>> runs;
        for (int run = 0; run < 2; ++run) {
          std::vector<float> a(n_rows), out = before;
          ops->SparseFfnToken(gate.view, up.view, down_t.view, idx.data(), n_rows,
                              Activation::kRelu, x.data(), nullptr, a.data(), out.data());
          runs.push_back(out);
        }
        EXPECT_EQ(runs[0], runs[1])
            << DTypeName(dt) << " rows " << n_rows << " threads " << threads;
        if (threads == 1) {
          one = runs[0];
          continue;
        }
        double err = 0, scale = 0;
        for (int i = 0; i < hidden; ++i) {
          err = std::max(err, std::fabs(static_cast<double>(runs[0][i]) - one[i]));
          scale = std::max(scale, std::fabs(static_cast<double>(one[i])));
        }
        EXPECT_LE(err, 1e-6 * std::max(1.0, scale) * std::sqrt(static_cast<double>(n_rows)))
            << DTypeName(dt) << " rows " << n_rows << " threads " << threads;
      }
    }
  }
}

// The op with its last step left to the caller (a GPU adds the cpu-worker's partial sums): the
// parts, added in order from zero, are SparseFfnToken's result from zero, bit for bit when there
// is room for a part per thread, and there are never more than asked for; the reference computes
// one part.
TEST(SparseFfnTokenTest, PartsAddUpToTheSameBits) {
  std::mt19937 rng(11);
  const int ffn = 2500, hidden = 96;
  for (DType dt : {DType::kF16, DType::kQ4_0}) {
    Weight gate = MakeWeight(dt, ffn, hidden, rng), up = MakeWeight(dt, ffn, hidden, rng);
    Weight down_t = MakeWeight(dt, ffn, hidden, rng);
    auto x = Random(hidden, rng);
    for (int n_rows : {0, 7, 150, 700}) {
      std::vector<int32_t> idx(n_rows);
      for (int i = 0; i < n_rows; ++i) idx[i] = i * (ffn / std::max(n_rows, 1));
      for (int threads : {1, 5}) {
        ThreadPool pool(threads);
        auto simd = NewSimdOps(&pool);
        auto ref = NewReferenceOps();
        for (const CpuOps* ops : {simd.get(), ref.get()}) {
          for (int max_parts : {1, 3, 16}) {
            SCOPED_TRACE(::testing::Message()
                         << DTypeName(dt) << " " << ops->name() << " rows " << n_rows << " threads "
                         << threads << " max_parts " << max_parts);
            std::vector<float> a(std::max(n_rows, 1)), want(hidden, 0.f);
            const int ups =
                ops->SparseFfnToken(gate.view, up.view, down_t.view, idx.data(), n_rows,
                                    Activation::kRelu, x.data(), nullptr, a.data(), want.data());
            Guarded parts(static_cast<int64_t>(max_parts) * hidden);
            std::fill(parts.data(), parts.data() + max_parts * hidden, NAN);
            int n_parts = -1;
            EXPECT_EQ(ops->SparseFfnTokenParts(gate.view, up.view, down_t.view, idx.data(), n_rows,
                                               Activation::kRelu, x.data(), nullptr, a.data(),
                                               parts.data(), max_parts, &n_parts),
                      ups);
            ASSERT_GE(n_parts, 1);
            ASSERT_LE(n_parts, max_parts);
            EXPECT_EQ(n_parts, std::min(ops->SparseFfnParts(n_rows), max_parts));
            if (ops == ref.get() || threads == 1) {
              EXPECT_EQ(n_parts, 1);
            } else if (max_parts >= 3 && n_rows >= 150) {
              EXPECT_GT(n_parts, 1);  // the threads' partials, not one sum
            }
            std::vector<float> sum(hidden, 0.f);
            for (int p = 0; p < n_parts; ++p) {
              for (int i = 0; i < hidden; ++i) sum[i] += parts.data()[p * hidden + i];
            }
            if (max_parts >= threads || ops == ref.get()) {
              EXPECT_EQ(sum, want);
            } else {  // fewer parts than threads: other groups of neurons
              EXPECT_LE(Nmse(sum.data(), want.data(), hidden), 1e-10);
            }
            EXPECT_TRUE(parts.GuardsIntact());
            // A SIMD part p is the op on SparseFfnPartBegin's range alone (one thread, from zero):
            // the split that loads ahead of the op (PartialFfn::Prefetch) relies on.
            if (ops == simd.get() && n_parts == ops->SparseFfnParts(n_rows)) {
              auto one_thread = NewSimdOps(nullptr);
              for (int p = 0; p < n_parts; ++p) {
                const int b = SparseFfnPartBegin(n_rows, n_parts, p);
                const int e = SparseFfnPartBegin(n_rows, n_parts, p + 1);
                std::vector<float> part(hidden, 0.f);
                one_thread->SparseFfnToken(gate.view, up.view, down_t.view, idx.data() + b, e - b,
                                           Activation::kRelu, x.data(), nullptr, a.data(),
                                           part.data());
                EXPECT_EQ(
                    std::vector<float>(parts.data() + p * hidden, parts.data() + (p + 1) * hidden),
                    part)
                    << "part " << p;
              }
            }
          }
        }
      }
    }
  }
}

// Rows wider than the row ops' column chunk, and sparse row lists that group rows: every dtype.
TEST_P(OpsTest, WideRowsDenseAndSparse) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    const int rows = 37, cols = 4096 + 96;
    Weight w = MakeWeight(dt, rows, cols, rng_);
    auto x = Random(cols, rng_);
    Guarded got(rows), want(rows);
    ops_->MatMul(w.view, x.data(), 1, got.data());
    ref_->MatMul(w.view, x.data(), 1, want.data());
    ExpectClose(got, want, 1e-10);
    std::vector<int32_t> idx = {36, 0, 5, 6, 7, 20, 21, 2, 33};
    Guarded got_rows(idx.size()), want_rows(idx.size());
    ops_->MatMulRows(w.view, idx.data(), idx.size(), x.data(), 1, got_rows.data());
    ref_->MatMulRows(w.view, idx.data(), idx.size(), x.data(), 1, want_rows.data());
    ExpectClose(got_rows, want_rows, 1e-10);
    for (size_t i = 0; i < idx.size(); ++i) {
      EXPECT_EQ(got_rows.data()[i], got.data()[idx[i]]) << "row " << idx[i];
    }
    auto a = Random(idx.size(), rng_);
    a[3] = 0;
    Guarded acc(cols), acc_ref(cols);
    ops_->AccumulateRows(w.view, idx.data(), idx.size(), a.data(), 1, acc.data());
    ref_->AccumulateRows(w.view, idx.data(), idx.size(), a.data(), 1, acc_ref.data());
    ExpectClose(acc, acc_ref, 1e-10);
  }
}

TEST_P(OpsTest, RmsNorm) {
  const int n = 5, dim = 72;
  auto x = Random(n * dim, rng_), w = Random(dim, rng_);
  Guarded got(n * dim), want(n * dim);
  ops_->RmsNorm(x.data(), w.data(), n, dim, 1e-5f, got.data());
  ref_->RmsNorm(x.data(), w.data(), n, dim, 1e-5f, want.data());
  ExpectClose(got, want, 1e-10);
}

TEST_P(OpsTest, RopeBothLayouts) {
  const int n = 4, heads = 3, hd = 16;
  std::vector<float> inv(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv[i] = std::pow(10000.f, -2.f * i / hd);
  std::vector<int32_t> pos = {0, 1, 57, 1000};
  for (bool interleaved : {false, true}) {
    auto x = Random(n * heads * hd, rng_);
    Guarded got(x.size()), want(x.size());
    std::copy(x.begin(), x.end(), got.data());
    std::copy(x.begin(), x.end(), want.data());
    ops_->Rope(got.data(), n, heads, hd, pos.data(), inv.data(), interleaved);
    ref_->Rope(want.data(), n, heads, hd, pos.data(), inv.data(), interleaved);
    ExpectClose(got, want, 1e-10);
  }
}

TEST_P(OpsTest, AttentionPrefillAndDecodeWithGqa) {
  const int heads = 6, kv_heads = 2, hd = 16, ctx = 40;
  auto k = Random(ctx * kv_heads * hd, rng_), v = Random(ctx * kv_heads * hd, rng_);
  for (auto [n, pos0] : {std::pair<int, int>{1, 0}, {1, 39}, {8, 0}, {5, 20}}) {
    auto q = Random(n * heads * hd, rng_);
    Guarded got(n * heads * hd), want(n * heads * hd);
    ops_->Attention(q.data(), k.data(), v.data(), n, pos0, heads, kv_heads, hd, got.data());
    ref_->Attention(q.data(), k.data(), v.data(), n, pos0, heads, kv_heads, hd, want.data());
    ExpectClose(got, want, 1e-10);
  }
}

// Mistral's sliding window: a query at position p sees only the keys j with p - window < j <= p.
// That is plain causal attention over the cache rows from p - window + 1 on, with the query as
// the last of them, which is how the expectation is computed; a window covering every earlier
// position changes nothing.
TEST_P(OpsTest, AttentionWithSlidingWindow) {
  const int heads = 6, kv_heads = 2, hd = 16, ctx = 40, row = kv_heads * hd;
  auto k = Random(ctx * row, rng_), v = Random(ctx * row, rng_);
  for (int window : {1, 3, 8, 40}) {
    for (auto [n, pos0] : {std::pair<int, int>{1, 0}, {1, 39}, {8, 0}, {12, 20}}) {
      auto q = Random(n * heads * hd, rng_);
      Guarded got(n * heads * hd), want(n * heads * hd), full(n * heads * hd);
      ops_->Attention(q.data(), k.data(), v.data(), n, pos0, heads, kv_heads, hd, window,
                      got.data());
      for (int t = 0; t < n; ++t) {
        const int pos = pos0 + t, first = std::max(0, pos - window + 1);
        ref_->Attention(&q[t * heads * hd], &k[first * row], &v[first * row], 1, pos - first, heads,
                        kv_heads, hd, &want.data()[t * heads * hd]);
      }
      ExpectClose(got, want, 1e-10);
      Guarded windowed(n * heads * hd);
      ref_->Attention(q.data(), k.data(), v.data(), n, pos0, heads, kv_heads, hd, window,
                      windowed.data());
      ExpectClose(windowed, want, 1e-10);
      ops_->Attention(q.data(), k.data(), v.data(), n, pos0, heads, kv_heads, hd, full.data());
      if (window >= pos0 + n) {
        ExpectClose(got, full, 1e-10);
      } else {
        float max_diff = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          max_diff = std::max(max_diff, std::fabs(got.data()[i] - full.data()[i]));
        }
        EXPECT_GT(max_diff, 1e-3f) << "window " << window << " n " << n << " pos0 " << pos0;
      }
    }
  }
}

TEST_P(OpsTest, GatedActivations) {
  for (Activation act : {Activation::kSilu, Activation::kRelu, Activation::kDRelu}) {
    auto g = Random(100, rng_), u = Random(100, rng_);
    g[0] = 100.f, g[1] = -100.f, g[2] = 88.5f, g[3] = -88.5f;  // SiLU's exp at its range ends
    Guarded got(100), want(100);
    std::copy(g.begin(), g.end(), got.data());
    std::copy(g.begin(), g.end(), want.data());
    ops_->GatedActivation(act, got.data(), u.data(), 100);
    ref_->GatedActivation(act, want.data(), u.data(), 100);
    ExpectClose(got, want, 1e-12);
  }
}

// ---- K-quants: Q4_K, Q5_K, Q6_K (rows of whole 256-value super-blocks) ----

const DType kKDTypes[] = {DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};

// K-quant rows with every bit random (scales up to 63 with their packed high bits, Q5_K's fifth
// bits, negative Q6_K scales), only the fp16 factors kept finite and small. QuantizeRow's blocks
// (MakeWeight) use a narrower part of the format.
Weight MakeRandomKWeight(DType dtype, int64_t rows, int64_t cols, std::mt19937& rng) {
  Weight w;
  w.bytes.resize(RowBytes(dtype, cols) * rows);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : w.bytes) b = static_cast<uint8_t>(byte(rng));
  std::uniform_real_distribution<float> factor(1e-4f, 2e-3f);
  const size_t block = RowBytes(dtype, kSuperBlock);
  for (size_t off = 0; off < w.bytes.size(); off += block) {
    const uint16_t d = Fp32ToFp16(factor(rng)), dmin = Fp32ToFp16(factor(rng));
    if (dtype == DType::kQ6_K) {
      std::memcpy(&w.bytes[off + offsetof(BlockQ6_K, d)], &d, 2);
    } else {
      std::memcpy(&w.bytes[off], &d, 2);
      std::memcpy(&w.bytes[off + 2], &dmin, 2);
    }
  }
  w.view.name = "w";
  w.view.dtype = dtype;
  w.view.shape = {rows, cols};
  w.view.data = w.bytes.data();
  return w;
}

TEST_P(OpsTest, KQuantMatMulEveryBatch) {
  for (DType dt : kKDTypes) {
    for (bool random_bits : {false, true}) {
      for (int n : {1, 2, 7}) {
        for (auto [rows, cols] : {std::pair<int, int>{37, 256}, {20, 512}, {9, 2304}}) {
          SCOPED_TRACE(testing::Message() << DTypeName(dt) << " random " << random_bits
                                          << " n=" << n << " " << rows << "x" << cols);
          Weight w = random_bits ? MakeRandomKWeight(dt, rows, cols, rng_)
                                 : MakeWeight(dt, rows, cols, rng_);
          auto x = Random(n * cols, rng_);
          Guarded got(n * rows), want(n * rows);
          ops_->MatMul(w.view, x.data(), n, got.data());
          ref_->MatMul(w.view, x.data(), n, want.data());
          ExpectClose(got, want, 1e-10);
        }
      }
    }
  }
}

TEST_P(OpsTest, KQuantRowsAreBitIdenticalToMatMulAndAccumulate) {
  for (DType dt : kKDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    const int rows = 45, cols = 768, n = 3;
    Weight w = MakeRandomKWeight(dt, rows, cols, rng_);
    auto x = Random(cols, rng_);
    std::vector<float> all(rows);
    ops_->MatMul(w.view, x.data(), 1, all.data());
    std::vector<int32_t> idx = {44, 3, 0, 17, 18, 19, 2, 30, 31};
    std::vector<float> some(idx.size());
    ops_->MatMulRows(w.view, idx.data(), idx.size(), x.data(), 1, some.data());
    for (size_t i = 0; i < idx.size(); ++i) EXPECT_EQ(some[i], all[idx[i]]) << "row " << idx[i];

    auto xn = Random(n * cols, rng_);
    Guarded got(n * idx.size()), want(n * idx.size());
    ops_->MatMulRows(w.view, idx.data(), idx.size(), xn.data(), n, got.data());
    ref_->MatMulRows(w.view, idx.data(), idx.size(), xn.data(), n, want.data());
    ExpectClose(got, want, 1e-10);
    for (int tokens : {1, n}) {
      auto a = Random(tokens * idx.size(), rng_);
      a[2] = 0;
      auto y0 = Random(tokens * cols, rng_);
      Guarded acc(tokens * cols), acc_ref(tokens * cols);
      std::copy(y0.begin(), y0.end(), acc.data());
      std::copy(y0.begin(), y0.end(), acc_ref.data());
      ops_->AccumulateRows(w.view, idx.data(), idx.size(), a.data(), tokens, acc.data());
      ref_->AccumulateRows(w.view, idx.data(), idx.size(), a.data(), tokens, acc_ref.data());
      ExpectClose(acc, acc_ref, 1e-10);
    }
    // The grouped kernels compute exactly what one call per row computes.
    const RowKernels* k = GetParam().kernels;
    {
      std::vector<int8_t> q(cols);
      std::vector<float> d(cols / 256);
      std::vector<int16_t> bsums(cols / 16);
      k->quantize_q8k(x.data(), cols, q.data(), d.data(), bsums.data());
      const Q8KVector v{q.data(), d.data(), bsums.data()};
      std::vector<const uint8_t*> group;
      for (int32_t i : idx) group.push_back(w.view.row(i));
      std::vector<float> grouped(idx.size());
      k->dot_rows_q8k[static_cast<size_t>(dt)](group.data(), static_cast<int>(group.size()), v,
                                               cols, grouped.data());
      for (size_t i = 0; i < idx.size(); ++i) {
        EXPECT_EQ(grouped[i], k->dot_q8k[static_cast<size_t>(dt)](group[i], v, cols));
        EXPECT_EQ(grouped[i], all[idx[i]]);
      }
    }
    std::vector<const uint8_t*> rp;
    for (int j = 0; j < 10; ++j) rp.push_back(w.view.row(j));
    auto coef = Random(10, rng_), start = Random(cols, rng_);
    std::vector<float> one_by_one = start, grouped = start;
    for (int j = 0; j < 10; ++j) {
      k->axpy[static_cast<size_t>(dt)](coef[j], rp[j], one_by_one.data(), cols);
    }
    k->axpy_rows[static_cast<size_t>(dt)](coef.data(), rp.data(), 10, grouped.data(), cols);
    EXPECT_EQ(grouped, one_by_one);
  }
}

// The fused FFN on K-quant rows, with a file's typical mix: gate and up in one K type, the
// transposed down rows in Q6_K, Q8_0 or the same type.
TEST_P(OpsTest, KQuantSparseFfnToken) {
  for (DType dt : kKDTypes) {
    for (DType down_type : {DType::kQ6_K, DType::kQ8_0, dt}) {
      for (Activation act : {Activation::kSilu, Activation::kRelu}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " down " << DTypeName(down_type)
                                          << " act " << static_cast<int>(act));
        const int ffn = 120, hidden = 512, n_rows = 70;
        Weight gate = MakeRandomKWeight(dt, ffn, hidden, rng_);
        Weight up = MakeWeight(dt, ffn, hidden, rng_);
        Weight down_t = MakeWeight(down_type, ffn, hidden, rng_);
        std::vector<int32_t> idx(ffn);
        for (int i = 0; i < ffn; ++i) idx[i] = i;
        std::shuffle(idx.begin(), idx.end(), rng_);
        idx.resize(n_rows);
        auto x = Random(hidden, rng_);
        Guarded got(hidden), want(hidden), a(n_rows), a_ref(n_rows);
        const int ups = ops_->SparseFfnToken(gate.view, up.view, down_t.view, idx.data(), n_rows,
                                             act, x.data(), nullptr, a.data(), got.data());
        const int ups_ref =
            ref_->SparseFfnToken(gate.view, up.view, down_t.view, idx.data(), n_rows, act, x.data(),
                                 nullptr, a_ref.data(), want.data());
        EXPECT_EQ(ups, ups_ref);
        ExpectClose(a, a_ref, 1e-10);
        ExpectClose(got, want, 1e-10);
      }
    }
  }
}

// ---- Batched products of quantized rows (MatMul with n > 1: the tiled integer kernels) ----

const DType kQuantTypes[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};

// Q8_0 / Q4_0 rows with every value byte random (Q8_0's -128 included, which QuantizeRow never
// writes), the fp16 scales finite; K rows as MakeRandomKWeight makes them.
Weight MakeRandomBitsWeight(DType dtype, int64_t rows, int64_t cols, std::mt19937& rng) {
  if (IsKQuant(dtype)) return MakeRandomKWeight(dtype, rows, cols, rng);
  Weight w;
  w.bytes.resize(RowBytes(dtype, cols) * rows);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : w.bytes) b = static_cast<uint8_t>(byte(rng));
  std::uniform_real_distribution<float> factor(1e-3f, 2e-2f);
  const size_t block = RowBytes(dtype, 32);
  for (size_t off = 0; off < w.bytes.size(); off += block) {
    const uint16_t d = Fp32ToFp16(factor(rng));
    std::memcpy(&w.bytes[off], &d, 2);
  }
  w.view.name = "w";
  w.view.dtype = dtype;
  w.view.shape = {rows, cols};
  w.view.data = w.bytes.data();
  return w;
}

// Per element, got within fp32 summation-order rounding of want, for y: [n, w.rows()] = x @ w^T:
// |got - want| <= 1e-5 * sum_i |w_i| |x_i| (the dequantized row against |x|). Each ordering rounds
// partial sums bounded by that magnitude, a few ulp each; a block of the sum lost or miscounted
// (one of at most a few dozen here) would move the result by a thousand times more.
void ExpectSameUpToRounding(const TensorView& w, const float* x, int n, const float* got,
                            const float* want) {
  const int64_t rows = w.rows(), cols = w.cols();
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow(w.dtype, w.row(r), row.data(), cols);
    for (int t = 0; t < n; ++t) {
      double bound = 0;
      for (int64_t c = 0; c < cols; ++c) bound += std::fabs(row[c] * x[t * cols + c]);
      ASSERT_NEAR(got[t * rows + r], want[t * rows + r], 1e-5 * bound)
          << "row " << r << " token " << t;
    }
  }
}

// The tiled kernels for every quantized type against the reference (llama.cpp's definition) and
// against the one-token products (the decode kernels, dot_q8x / dot_q8k), with token counts that
// leave partial token tiles, row counts that leave partial row tiles (16, 8 and 4 rows),
// QuantizeRow's and random-bit weights, and x whose blocks all quantize to +-127 (the largest
// integer sums, where a 16-bit intermediate would saturate first).
TEST_P(OpsTest, QuantizedBatchMatchesReferenceAndOneTokenProducts) {
  for (DType dt : kQuantTypes) {
    const std::vector<int> widths =
        IsKQuant(dt) ? std::vector<int>{256, 768} : std::vector<int>{32, 96, 800};
    for (int cols : widths) {
      for (int rows : {1, 5, 17, 37}) {
        for (int kind = 0; kind < 3; ++kind) {  // QuantizeRow's, random bits, random bits + +-x
          Weight w = kind == 0 ? MakeWeight(dt, rows, cols, rng_)
                               : MakeRandomBitsWeight(dt, rows, cols, rng_);
          for (int n : {1, 2, 3, 5, 7, 17}) {
            SCOPED_TRACE(testing::Message() << DTypeName(dt) << " " << rows << "x" << cols
                                            << " kind " << kind << " n=" << n);
            auto x = Random(n * cols, rng_);
            if (kind == 2) {
              for (auto& v : x) v = v < 0 ? -1.f : 1.f;
            }
            Guarded got(n * rows), want(n * rows);
            ops_->MatMul(w.view, x.data(), n, got.data());
            ref_->MatMul(w.view, x.data(), n, want.data());
            ExpectClose(got, want, 1e-10);
            ExpectSameUpToRounding(w.view, x.data(), n, got.data(), want.data());
            std::vector<float> one(rows);
            for (int t = 0; t < n; ++t) {
              ops_->MatMul(w.view, x.data() + t * cols, 1, one.data());
              ExpectSameUpToRounding(w.view, x.data() + t * cols, 1, got.data() + t * rows,
                                     one.data());
            }
          }
        }
      }
    }
  }
}

// Wide rows run the tokens in several chunks (about 256 KB of x each, here 32 tokens), each with
// every row group unpacked again.
TEST_P(OpsTest, QuantizedBatchOverSeveralTokenChunks) {
  for (DType dt : kQuantTypes) {
    SCOPED_TRACE(DTypeName(dt));
    const int rows = 21, cols = 8192, n = 41;
    Weight w = MakeRandomBitsWeight(dt, rows, cols, rng_);
    auto x = Random(n * cols, rng_);
    Guarded got(n * rows), want(n * rows);
    ops_->MatMul(w.view, x.data(), n, got.data());
    ref_->MatMul(w.view, x.data(), n, want.data());
    ExpectClose(got, want, 1e-10);
    ExpectSameUpToRounding(w.view, x.data(), n, got.data(), want.data());
  }
}

// Every kernel set has the tiled kernel for exactly the quantized types.
TEST_P(OpsTest, EveryKernelSetHasTheBatchedKernels) {
  const RowKernels* k = GetParam().kernels;
  for (int i = 0; i < kNumDTypes; ++i) {
    EXPECT_EQ(k->matmul_q8b[i] != nullptr, IsQuantized(static_cast<DType>(i))) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(AllKernels, OpsTest, ::testing::ValuesIn(Implementations()),
                         [](const auto& info) {
                           std::string name = info.param.kernels->name;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name + "_t" + std::to_string(info.param.threads);
                         });

// AVX-512's Q4_0 row-group dots (two blocks a 512-bit step, up to eight rows) form each sum exactly
// as the 256-bit block kernel does (the AVX2 set's): bit for bit, for 1..17 rows and odd block
// counts.
TEST(RowKernelsTest, Avx512Q4_0RowDotsEqualTheBlockKernelsBitForBit) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512vnni")) {
    GTEST_SKIP() << "needs AVX2 and AVX-512 VNNI";
  }
  const RowKernels* want_k = RowKernelsAvx2();
  if (want_k == nullptr || RowKernelsAvx512(false) == nullptr) GTEST_SKIP() << "not compiled in";
  std::mt19937 rng(11);
  for (int64_t cols : {int64_t{32}, int64_t{96}, int64_t{1056}}) {
    Weight w = MakeWeight(DType::kQ4_0, 17, cols, rng);
    std::vector<float> x = Random(cols, rng);
    std::vector<int8_t> q(cols);
    std::vector<float> d(cols / 32);
    std::vector<int32_t> s8(cols / 4);
    want_k->quantize_q8x(x.data(), cols, q.data(), d.data(), s8.data());
    const Q8Vector v{q.data(), d.data(), s8.data()};
    for (bool vbmi : {false, true}) {
      if (vbmi && !__builtin_cpu_supports("avx512vbmi")) continue;
      const RowKernels* k = RowKernelsAvx512(vbmi);
      for (int n = 1; n <= 17; ++n) {
        std::vector<const uint8_t*> rows;
        for (int j = 0; j < n; ++j) {
          rows.push_back(static_cast<const uint8_t*>(w.view.row((j * 7) % 17)));
        }
        std::vector<float> got(n), want(n);
        k->dot_rows_q8x[static_cast<size_t>(DType::kQ4_0)](rows.data(), n, v, cols, got.data());
        want_k->dot_rows_q8x[static_cast<size_t>(DType::kQ4_0)](rows.data(), n, v, cols,
                                                                want.data());
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), n * sizeof(float)))
            << k->name << " cols " << cols << " rows " << n;
      }
    }
  }
}

// Every instruction set quantizes x for Q8_0 / Q4_0 rows exactly as the scalar set does (the
// products of the quantized models depend on it bit for bit): random blocks, an all-zero block,
// large magnitudes, and a block whose scale is 1 with values halfway between integers, where
// rounding half to even decides.
TEST(RowKernelsTest, QuantizeQ8xOfEverySetEqualsTheScalarSetBitForBit) {
  std::mt19937 rng(5);
  const int64_t cols = 1024;
  std::vector<float> x = Random(cols, rng);
  for (int i = 32; i < 64; ++i) x[i] = 0;
  for (int i = 64; i < 96; ++i) x[i] *= 1e6f;
  x[96] = 127;
  for (int i = 97; i < 128; ++i) x[i] = (i % 2 ? -1.f : 1.f) * (static_cast<float>(i - 97) + 0.5f);
  const RowKernels* want_k = RowKernelsScalar();
  std::vector<int8_t> want_q(cols);
  std::vector<float> want_d(cols / 32);
  std::vector<int32_t> want_s8(cols / 4);
  want_k->quantize_q8x(x.data(), cols, want_q.data(), want_d.data(), want_s8.data());
  int compared = 0;
  const RowKernels* previous = want_k;
  for (const Impl& impl : Implementations()) {  // the sets this processor runs, each twice
    const RowKernels* k = impl.kernels;
    if (k == previous) continue;
    previous = k;
    std::vector<int8_t> q(cols);
    std::vector<float> d(cols / 32);
    std::vector<int32_t> s8(cols / 4);
    k->quantize_q8x(x.data(), cols, q.data(), d.data(), s8.data());
    EXPECT_EQ(q, want_q) << k->name;
    EXPECT_EQ(0, std::memcmp(d.data(), want_d.data(), d.size() * sizeof(float))) << k->name;
    EXPECT_EQ(s8, want_s8) << k->name;
    ++compared;
  }
  if (compared == 0) GTEST_SKIP() << "no vector instruction set here";
  // The halfway block: -0.5 -> 0, 1.5 -> 2, -2.5 -> -2, 3.5 -> 4.
  EXPECT_EQ(want_q[97], 0);
  EXPECT_EQ(want_q[98], 2);
  EXPECT_EQ(want_q[99], -2);
  EXPECT_EQ(want_q[100], 4);
}

// The storage formats round-trip within their precision.
TEST(QuantizeTest, RoundTripErrorWithinFormatPrecision) {
  std::mt19937 rng(7);
  auto x = Random(1024, rng);
  const std::pair<DType, double> limits[] = {{DType::kF32, 0},
                                             {DType::kF16, 1e-6},
                                             {DType::kBF16, 1e-4},
                                             {DType::kQ8_0, 1e-4},
                                             {DType::kQ4_0, 1.5e-2}};
  for (auto [dt, limit] : limits) {
    std::vector<uint8_t> q(RowBytes(dt, 1024));
    std::vector<float> back(1024);
    QuantizeRow(dt, x.data(), q.data(), 1024);
    DequantizeRow(dt, q.data(), back.data(), 1024);
    EXPECT_LE(Nmse(back.data(), x.data(), 1024), limit) << DTypeName(dt);
  }
}

TEST(QuantizeTest, Q4_0MatchesGgmlLayout) {
  // ggml: element j in the low nibble of qs[j], element j+16 in the high nibble; value (q-8)*d,
  // and the largest-magnitude value maps to -8.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = static_cast<float>(i - 16) / 2;  // -8 .. 7.5
  BlockQ4_0 b;
  QuantizeRow(DType::kQ4_0, x.data(), &b, 32);
  EXPECT_EQ(b.qs[0] & 0x0f, 0);  // x[0] = -8 is the max magnitude -> q = 0 -> (0-8)*d = -8
  std::vector<float> back(32);
  DequantizeRow(DType::kQ4_0, &b, back.data(), 32);
  EXPECT_FLOAT_EQ(back[0], -8.f);
  EXPECT_NEAR(back[16], 0.f, 1e-6);
}

// ggml's dequantize_row_q4_K / q5_K / q6_K, written here from ggml-quants.c's loops (pointers
// walking the block, get_scale_min_k4 on the packed scales) as an independent check of the
// engine's layouts.
void GgmlScaleMin(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

void GgmlDequantize(DType t, const uint8_t* row, int64_t n, float* y) {
  for (int64_t i = 0; i < n / 256; ++i) {
    const uint8_t* blk = row + i * RowBytes(t, 256);
    if (t == DType::kQ6_K) {
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      uint16_t dh;
      std::memcpy(&dh, blk + 208, 2);
      const float d = Fp16ToFp32(dh);
      for (int n128 = 0; n128 < 256; n128 += 128) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int8_t q1 = static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int8_t q2 =
              static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int8_t q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int8_t q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l + 0] = d * sc[is + 0] * q1;
          y[l + 32] = d * sc[is + 2] * q2;
          y[l + 64] = d * sc[is + 4] * q3;
          y[l + 96] = d * sc[is + 6] * q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
      }
      continue;
    }
    const bool q5 = t == DType::kQ5_K;
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    const float d = Fp16ToFp32(dh), min = Fp16ToFp32(mh);
    const uint8_t* scales = blk + 4;
    const uint8_t* qh = blk + 16;
    const uint8_t* ql = blk + (q5 ? 48 : 16);
    int is = 0;
    uint8_t u1 = 1, u2 = 2, sc, m;
    for (int j = 0; j < 256; j += 64) {
      GgmlScaleMin(is + 0, scales, &sc, &m);
      const float d1 = d * sc, m1 = min * m;
      GgmlScaleMin(is + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) {
        *y++ = d1 * ((ql[l] & 0xF) + (q5 && (qh[l] & u1) ? 16 : 0)) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        *y++ = d2 * ((ql[l] >> 4) + (q5 && (qh[l] & u2) ? 16 : 0)) - m2;
      }
      ql += 32;
      is += 2;
      u1 <<= 2;
      u2 <<= 2;
    }
  }
}

// x as ggml's quantize_row_q8_K rounds it, back in fp32: d * q per 256 values.
std::vector<float> GgmlQ8KRounded(const float* x, int64_t n) {
  std::vector<float> out(n);
  for (int64_t b = 0; b < n / 256; ++b) {
    float max = 0, amax = 0;
    for (int j = 0; j < 256; ++j) {
      if (std::fabs(x[b * 256 + j]) > amax) {
        amax = std::fabs(x[b * 256 + j]);
        max = x[b * 256 + j];
      }
    }
    const float iscale = amax == 0 ? 0 : -127.f / max;
    for (int j = 0; j < 256; ++j) {
      // nearest_int: ggml's float trick, round half to even.
      float v = iscale * x[b * 256 + j] + 12582912.f;
      int32_t i;
      std::memcpy(&i, &v, 4);
      const int q = std::min(127, (i & 0x007fffff) - 0x00400000);
      out[b * 256 + j] = amax == 0 ? 0.f : q * (1 / iscale);
    }
  }
  return out;
}

TEST(KQuantTest, EngineDequantizationIsGgmlsBitForBit) {
  std::mt19937 rng(11);
  for (DType dt : kKDTypes) {
    Weight w = MakeRandomKWeight(dt, 3, 768, rng);
    std::vector<float> engine(768), ggml(768);
    for (int r = 0; r < 3; ++r) {
      DequantizeRow(dt, w.view.row(r), engine.data(), 768);
      GgmlDequantize(dt, w.view.row(r), 768, ggml.data());
      EXPECT_EQ(engine, ggml) << DTypeName(dt) << " row " << r;
    }
  }
}

// Every kernel set (and the reference) against an F32 product on the weights dequantized by
// ggml's formulas: with x rounded as Q8_K rounds it the two differ only by fp32 summation order;
// with x in fp32 by at most Q8_K's rounding of x (relative error ~ 1 / 254 per value).
TEST(KQuantTest, ProductsMatchAnF32ProductOnGgmlDequantizedWeights) {
  std::mt19937 rng(12);
  const int rows = 24, cols = 1024;
  for (DType dt : kKDTypes) {
    for (bool random_bits : {false, true}) {
      Weight w =
          random_bits ? MakeRandomKWeight(dt, rows, cols, rng) : MakeWeight(dt, rows, cols, rng);
      auto x = Random(cols, rng);
      x[5] = 0.f;  // exercises a zero in a block, not a zero block
      const std::vector<float> xr = GgmlQ8KRounded(x.data(), cols);
      std::vector<float> want_rounded(rows), want_fp32(rows), deq(cols);
      for (int r = 0; r < rows; ++r) {
        GgmlDequantize(dt, w.view.row(r), cols, deq.data());
        double s = 0, s32 = 0;
        for (int c = 0; c < cols; ++c) {
          s += double(deq[c]) * xr[c];
          s32 += double(deq[c]) * x[c];
        }
        want_rounded[r] = static_cast<float>(s);
        want_fp32[r] = static_cast<float>(s32);
      }
      std::vector<std::unique_ptr<CpuOps>> all;
      all.push_back(NewReferenceOps());
      for (const Impl& impl : Implementations()) {
        if (impl.threads == 1) all.push_back(NewSimdOpsWithKernels(nullptr, impl.kernels));
      }
      for (const auto& ops : all) {
        SCOPED_TRACE(testing::Message()
                     << DTypeName(dt) << " " << ops->name() << " random " << random_bits);
        std::vector<float> got(rows);
        ops->MatMul(w.view, x.data(), 1, got.data());
        EXPECT_FALSE(AnyNan(got.data(), rows));
        EXPECT_LT(Nmse(got.data(), want_rounded.data(), rows), 1e-10);
        EXPECT_LT(Nmse(got.data(), want_fp32.data(), rows), 1e-4);
        EXPECT_GT(Nmse(got.data(), want_fp32.data(), rows), 0) << "x was not quantized";
      }
    }
  }
}

// quantize_row_q8_K by hand: the value of largest magnitude (here negative) maps to -127, the
// others to round(x * 127 / |max|) with ties to even, capped at 127; bsums add 16 values.
TEST(KQuantTest, ActivationsQuantizeToQ8KAsGgmlDoes) {
  std::vector<float> x(512, 0.f);
  x[0] = -2.f;         // iscale = -127 / -2 = 63.5, q = -127
  x[1] = 2.f;          // q = 127
  x[2] = 0.5f;         // 31.75 -> 32
  x[3] = 1.f / 127.f;  // 0.5 -> 0 (ties to even)
  x[4] = 3.f / 127.f;  // 1.5 -> 2
  x[17] = -0.25f;      // -15.875 -> -16
  // block 1 stays zero: d = 0, q = 0
  for (const Impl& impl : Implementations()) {
    if (impl.threads != 1) continue;
    SCOPED_TRACE(impl.kernels->name);
    std::vector<int8_t> q(512, 99);
    std::vector<float> d(2, 99.f);
    std::vector<int16_t> bsums(32, 99);
    impl.kernels->quantize_q8k(x.data(), 512, q.data(), d.data(), bsums.data());
    EXPECT_EQ(q[0], -127);
    EXPECT_EQ(q[1], 127);
    EXPECT_EQ(q[2], 32);
    EXPECT_EQ(q[3], 0);
    EXPECT_EQ(q[4], 2);
    EXPECT_EQ(q[17], -16);
    EXPECT_EQ(q[300], 0);
    EXPECT_FLOAT_EQ(d[0], 1.f / 63.5f);
    EXPECT_EQ(d[1], 0.f);
    EXPECT_EQ(bsums[0], -127 + 127 + 32 + 0 + 2);
    EXPECT_EQ(bsums[1], -16);
    EXPECT_EQ(bsums[16], 0);
  }
}

TEST(KQuantTest, BlockSizesAndRoundTrip) {
  EXPECT_EQ(RowBytes(DType::kQ4_K, 4096), 16u * 144);
  EXPECT_EQ(RowBytes(DType::kQ5_K, 4096), 16u * 176);
  EXPECT_EQ(RowBytes(DType::kQ6_K, 4096), 16u * 210);
  for (DType dt : kKDTypes) EXPECT_EQ(BlockElems(dt), 256) << DTypeName(dt);
  std::mt19937 rng(13);
  auto x = Random(1024, rng);
  // Nmse of a uniform quantizer with 16 / 32 / 64 levels over a block's spread.
  const std::pair<DType, double> limits[] = {
      {DType::kQ4_K, 1.5e-2}, {DType::kQ5_K, 4e-3}, {DType::kQ6_K, 1.5e-3}};
  for (auto [dt, limit] : limits) {
    std::vector<uint8_t> q(RowBytes(dt, 1024));
    std::vector<float> back(1024);
    QuantizeRow(dt, x.data(), q.data(), 1024);
    DequantizeRow(dt, q.data(), back.data(), 1024);
    EXPECT_LE(Nmse(back.data(), x.data(), 1024), limit) << DTypeName(dt);
    std::vector<float> ggml(1024);
    GgmlDequantize(dt, q.data(), 1024, ggml.data());
    EXPECT_EQ(back, ggml) << DTypeName(dt);
  }
  EXPECT_EQ(*DTypeFromName("q4_k"), DType::kQ4_K);
  EXPECT_EQ(DTypeName(DType::kQ6_K), "Q6_K");
}

}  // namespace
}  // namespace pinfer
