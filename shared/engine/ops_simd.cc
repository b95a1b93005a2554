// The optimised CPU operators: SIMD row kernels (row_kernels.h) spread over a thread pool.
// Results match ReferenceOps up to fp32 summation order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/string_view.h"
#include "shared/engine/ops.h"
#include "shared/engine/row_kernels.h"

namespace pinfer {
namespace {

class SimdOps : public CpuOps {
 public:
  SimdOps(ThreadPool* pool, const RowKernels* k) : pool_(pool), k_(k) {}
  absl::string_view name() const override { return k_->name; }

  void MatMul(const TensorView& w, const float* x, int n, float* y) const override {
    const int64_t rows = w.rows(), cols = w.cols();
    if (n == 1) {
      RowsTimesVectors(w, nullptr, rows, x, n, y);
      return;
    }
    if (IsQuantized(w.dtype)) {
      QuantizedBatch(w, x, n, y);
      return;
    }
    // Batched F32 / F16 / BF16: convert four weight rows to fp32 once, then run them against
    // every token, so the conversion is amortised and each load of x feeds four dot products.
    For((rows + 3) / 4, 1, [&](int64_t b, int64_t e) {
      std::vector<float> buf(4 * cols);
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t r0 = blk * 4;
        const int nr = static_cast<int>(std::min<int64_t>(4, rows - r0));
        for (int j = 0; j < 4; ++j) {
          if (j < nr) {
            DequantizeRow(w.dtype, w.row(r0 + j), buf.data() + j * cols, cols);
          } else {
            std::fill(buf.begin() + j * cols, buf.begin() + (j + 1) * cols, 0.f);
          }
        }
        float out[16];
        int t = 0;
        for (; t + 4 <= n; t += 4) {
          k_->dot4x4_f32(buf.data(), x + t * cols, cols, cols, out);
          for (int tt = 0; tt < 4; ++tt) {
            for (int j = 0; j < nr; ++j) y[(t + tt) * rows + r0 + j] = out[tt * 4 + j];
          }
        }
        for (; t < n; ++t) {
          k_->dot4_f32(buf.data(), buf.data() + cols, buf.data() + 2 * cols, buf.data() + 3 * cols,
                       x + t * cols, cols, out);
          for (int j = 0; j < nr; ++j) y[t * rows + r0 + j] = out[j];
        }
      }
    });
  }

  void MatMulRows(const TensorView& w, const int32_t* rows, int n_rows, const float* x, int n,
                  float* y) const override {
    RowsTimesVectors(w, rows, n_rows, x, n, y);
  }

  void AccumulateRows(const TensorView& w, const int32_t* rows, int n_rows, const float* a, int n,
                      float* y) const override {
    // Threads split the output columns (not the rows), so no two threads ever add into the same
    // element: deterministic and race-free. Columns are split on 32-element boundaries (256 for
    // the K-quants' super-blocks).
    const int64_t cols = w.cols();
    const int64_t span = std::max(32, BlockElems(w.dtype));
    const int64_t blocks = (cols + span - 1) / span;
    const int64_t grain = std::max<int64_t>(1, 4 * 32 / span);
    if (n > 1) {  // batches: each row segment once, for every token
      const size_t di = static_cast<size_t>(w.dtype);
      For(blocks, grain, [&](int64_t b, int64_t e) {
        const int64_t c0 = b * span, c1 = std::min(cols, e * span);
        const size_t off = RowBytes(w.dtype, c0);
        for (int i = 0; i < n_rows; ++i) {
          const uint8_t* row = w.row(rows[i]) + off;
          for (int t = 0; t < n; ++t) {
            float coef = a[t * n_rows + i];
            if (coef != 0) k_->axpy[di](coef, row, y + t * cols + c0, c1 - c0);
          }
        }
      });
      return;
    }
    // One token: kGroup rows at a time, read interleaved (see AxpyRows).
    For(blocks, grain, [&](int64_t b, int64_t e) {
      const int64_t c0 = b * span, c1 = std::min(cols, e * span);
      const uint8_t* group[kGroup];
      float coef[kGroup];
      int k = 0;
      for (int i = 0; i < n_rows; ++i) {
        if (a[i] == 0) continue;
        group[k] = w.row(rows[i]);
        coef[k++] = a[i];
        if (k == kGroup) {
          AxpyRows(w.dtype, group, coef, k, y, c0, c1);
          k = 0;
        }
      }
      if (k > 0) AxpyRows(w.dtype, group, coef, k, y, c0, c1);
    });
  }

  int SparseFfnToken(const TensorView& gate, const TensorView& up, const TensorView& down_t,
                     const int32_t* rows, int n_rows, Activation act, const float* x,
                     const float* gate_values, float* a, float* out) const override {
    return SparseFfnSplit(gate, up, down_t, rows, n_rows, act, x, gate_values, a, out, nullptr,
                          INT32_MAX, nullptr);
  }

  int SparseFfnTokenParts(const TensorView& gate, const TensorView& up, const TensorView& down_t,
                          const int32_t* rows, int n_rows, Activation act, const float* x,
                          const float* gate_values, float* a, float* parts, int max_parts,
                          int* n_parts) const override {
    return SparseFfnSplit(gate, up, down_t, rows, n_rows, act, x, gate_values, a, nullptr, parts,
                          std::max(max_parts, 1), n_parts);
  }

  int SparseFfnParts(int n_rows) const override {
    const int threads = pool_ == nullptr ? 1 : pool_->size();
    return std::clamp((n_rows + kGroup - 1) / kGroup, 1, threads);
  }

  // Both of the above: with out, the parts are summed into it here; with parts, they are left
  // there, at most max_parts of them.
  int SparseFfnSplit(const TensorView& gate, const TensorView& up, const TensorView& down_t,
                     const int32_t* rows, int n_rows, Activation act, const float* x,
                     const float* gate_values, float* a, float* out, float* parts, int max_parts,
                     int* n_parts) const {
    const int64_t cols = up.cols(), hidden = down_t.cols();
    auto q8_0_rows = [](DType t) { return IsQuantized(t) && !IsKQuant(t); };
    const bool needs_q8 = q8_0_rows(gate.dtype) || q8_0_rows(up.dtype);
    const bool needs_q8k = IsKQuant(gate.dtype) || IsKQuant(up.dtype);
    // x quantized for Q8_0 / Q4_0 rows (Q8_K for K-quant rows) by the thread that reads it, once
    // per part: a copy in each thread's own cache instead of one that every thread reads from the
    // caller's (H200 host: a Q4_0 layer of 295 neurons took 80 us with one copy, 58 with one per
    // thread).
    auto quantize_x = [&] {
      Q8Scratch& qx = ThreadQ8Scratch();
      if (needs_q8) {
        qx.q.resize(cols);
        qx.d.resize(cols / 32);
        qx.s8.resize(cols / 4);
        k_->quantize_q8x(x, cols, qx.q.data(), qx.d.data(), qx.s8.data());
      }
      if (needs_q8k) {
        qx.qk.resize(cols);
        qx.dk.resize(cols / 256);
        qx.bsums.resize(cols / 16);
        k_->quantize_q8k(x, cols, qx.qk.data(), qx.dk.data(), qx.bsums.data());
      }
      return XQuant{Q8Vector{qx.q.data(), qx.d.data(), qx.s8.data()},
                    Q8KVector{qx.qk.data(), qx.dk.data(), qx.bsums.data()}};
    };
    const bool gate_decides = act != Activation::kSilu;
    // The list in equal parts, one per pool thread (and at least kGroup neurons each), each part
    // summed into its own buffer and the buffers added in order: a cpu-worker's few hundred cold
    // neurons of a layer reach every thread, and the result is the same bits run to run (it
    // depends on the list and the thread count only). Measured on the H200 host (16 threads, 295
    // and 838 neurons, docs/benchmarks.md run 34): ~48 fixed-size chunks, whose result did not
    // depend on the thread count, were up to 1.6x slower (twice the buffers to zero and add);
    // 64-neuron chunks left most threads idle. Within a part, groups of kGroup neurons
    // (kGateGroup where the gate decides, below): their gate rows, then the up rows of the active
    // ones, then their down rows, each set read interleaved.
    const int threads = pool_ == nullptr ? 1 : pool_->size();
    const int chunks = std::min(SparseFfnParts(n_rows), max_parts);
    auto part_begin = [&](int c) { return SparseFfnPartBegin(n_rows, chunks, c); };
    // Up rows per chunk, in the calling thread's buffer (reused: decode allocates nothing once
    // warm). The workers reach it through this pointer: a thread_local named inside the lambda
    // would be each worker's own.
    thread_local std::vector<int> ups_buffer;
    ups_buffer.assign(std::max(chunks, 1), 0);
    int* ups = ups_buffer.data();
    // Where the gate decides, twice the neurons a group: about half of a ReLU model's listed
    // neurons have a positive gate, and the up and down rows of a group's live ones are what the
    // kernels read together (up to eight at once), so eight-neuron groups left them reading ~4.
    // (70B width, Q4_0, one thread, `cold_rows_bench ways=accumulate gap_us=0`, the two builds
    // alternating three times: 442 listed of which 233 live, 253-270 us against 283-288; 1100
    // listed, 666-677 against 670-733. The sums do not change: the axpy adds each element's
    // terms in row order, and a dot does not depend on its group.)
    const int group = gate_decides ? kGateGroup : kGroup;
    auto run_chunk = [&](int c, float* acc) {
      const XQuant v = quantize_x();
      const int end = part_begin(c + 1);
      int up_rows = 0;  // counted here and stored once: ups[] shares a cache line between parts
      for (int i0 = part_begin(c); i0 < end; i0 += group) {
        const int k = std::min(group, end - i0);
        const uint8_t* rp[kGateGroup];
        float g[kGateGroup], u[kGateGroup];
        if (gate_values != nullptr) {
          for (int j = 0; j < k; ++j) g[j] = gate_values[i0 + j];
        } else {
          for (int j = 0; j < k; ++j) rp[j] = gate.row(rows[i0 + j]);
          DotRows(gate.dtype, rp, k, x, v, cols, g);
        }
        int live[kGateGroup], m = 0;
        for (int j = 0; j < k; ++j) {
          a[i0 + j] = 0;
          if (!gate_decides || g[j] > 0) live[m++] = j;
        }
        if (m == 0) continue;
        for (int j = 0; j < m; ++j) rp[j] = up.row(rows[i0 + live[j]]);
        DotRows(up.dtype, rp, m, x, v, cols, u);
        up_rows += m;
        float coef[kGateGroup];
        int nz = 0;
        for (int j = 0; j < m; ++j) {
          float gj = g[live[j]];
          GatedActivation(act, &gj, &u[j], 1);
          a[i0 + live[j]] = gj;
          if (gj != 0) {
            rp[nz] = down_t.row(rows[i0 + live[j]]);
            coef[nz++] = gj;
          }
        }
        if (nz > 0) AxpyRows(down_t.dtype, rp, coef, nz, acc, 0, hidden);
      }
      ups[c] = up_rows;
    };
    if (parts != nullptr) *n_parts = chunks;
    if (chunks <= 1) {
      if (parts != nullptr) std::fill(parts, parts + hidden, 0.f);
      if (n_rows > 0) run_chunk(0, parts != nullptr ? parts : out);
      return ups[0];
    }
    thread_local std::vector<float> partial;
    if (parts == nullptr) partial.resize(static_cast<size_t>(chunks) * hidden);
    float* p = parts != nullptr ? parts : partial.data();
    For(chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        std::fill(p + c * hidden, p + (c + 1) * hidden, 0.f);  // by the worker: zeroed in parallel
        run_chunk(static_cast<int>(c), p + c * hidden);
      }
    });
    int total = 0;
    for (int c = 0; c < chunks; ++c) total += ups[c];
    if (parts != nullptr) return total;
    // One column range per thread, and within it 16 columns at a time summed over every part
    // in order (the same additions as part after part): the parts' lines are read together,
    // from the caches of the threads that wrote them. On the H200 host ~40 ranges of 128
    // columns, each part's range read after the other's, cost ~15 us more per call than equal
    // shares' 16 ranges (docs/benchmarks.md, run 35).
    constexpr int64_t kLine = 16;
    const int64_t range = (hidden + threads * kLine - 1) / (threads * kLine) * kLine;
    For(hidden, range, [&](int64_t b, int64_t e) {
      int64_t i0 = b;
      for (; i0 + kLine <= e; i0 += kLine) {  // a constant width: s stays in registers
        float s[kLine];
        for (int64_t i = 0; i < kLine; ++i) s[i] = out[i0 + i];
        for (int c = 0; c < chunks; ++c) {
          const float* pc = p + static_cast<int64_t>(c) * hidden + i0;
          for (int64_t i = 0; i < kLine; ++i) s[i] += pc[i];
        }
        for (int64_t i = 0; i < kLine; ++i) out[i0 + i] = s[i];
      }
      for (int c = 0; c < chunks; ++c) {
        const float* pc = p + static_cast<int64_t>(c) * hidden;
        for (int64_t i = i0; i < e; ++i) out[i] += pc[i];
      }
    });
    return total;
  }

  void RmsNorm(const float* x, const float* weight, int n, int dim, float eps,
               float* out) const override {
    for (int t = 0; t < n; ++t) {
      const float* xt = x + static_cast<int64_t>(t) * dim;
      float ss = k_->dot_f32(xt, xt, dim);
      float scale = 1.f / std::sqrt(ss / dim + eps);
      for (int i = 0; i < dim; ++i) out[t * dim + i] = xt[i] * scale * weight[i];
    }
  }

  void Rope(float* x, int n, int n_heads, int head_dim, const int32_t* positions,
            const float* inv_freq, bool interleaved) const override {
    const int half = head_dim / 2;
    std::vector<float> cs(half), sn(half);
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < half; ++i) {
        float angle = static_cast<float>(positions[t]) * inv_freq[i];
        cs[i] = std::cos(angle);
        sn[i] = std::sin(angle);
      }
      for (int h = 0; h < n_heads; ++h) {
        float* v = x + (static_cast<int64_t>(t) * n_heads + h) * head_dim;
        for (int i = 0; i < half; ++i) {
          int a = interleaved ? 2 * i : i;
          int b = interleaved ? 2 * i + 1 : i + half;
          float x0 = v[a], x1 = v[b];
          v[a] = x0 * cs[i] - x1 * sn[i];
          v[b] = x0 * sn[i] + x1 * cs[i];
        }
      }
    }
  }

  void Attention(const float* q, const float* k, const float* v, int n, int pos0, int n_heads,
                 int n_kv_heads, int head_dim, int window, float* out) const override {
    const int group = n_heads / n_kv_heads;
    const int kv_stride = n_kv_heads * head_dim;
    const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
    // Jobs are (token, head) pairs; a thread takes a range of them and, per token, walks the
    // cache position by position for all its heads at once, so the keys and values stream
    // through in address order instead of once per head with a stride.
    For(static_cast<int64_t>(n) * n_heads, 1, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> scores;
      for (int64_t t = b / n_heads; t * n_heads < e; ++t) {
        const int h0 = static_cast<int>(std::max<int64_t>(b, t * n_heads) - t * n_heads);
        const int h1 = static_cast<int>(std::min<int64_t>(e, (t + 1) * n_heads) - t * n_heads);
        const int pos = pos0 + static_cast<int>(t);
        const int first = window > 0 ? std::max(0, pos - window + 1) : 0;  // keys first..pos
        const int len = pos - first + 1;
        const int nh = h1 - h0;
        if (scores.size() < static_cast<size_t>(nh) * len)
          scores.resize(static_cast<size_t>(nh) * len);
        const float* qt = q + (t * n_heads + h0) * head_dim;
        const float* kt = k + static_cast<int64_t>(first) * kv_stride;
        const float* vt = v + static_cast<int64_t>(first) * kv_stride;
        for (int p = 0; p < len; ++p) {
          const float* kp = kt + static_cast<int64_t>(p) * kv_stride;
          for (int h = 0; h < nh; ++h) {
            scores[h * len + p] =
                k_->dot_f32(qt + h * head_dim, kp + ((h0 + h) / group) * head_dim, head_dim) *
                scale;
          }
        }
        float* ot = out + (t * n_heads + h0) * head_dim;
        std::fill(ot, ot + nh * head_dim, 0.f);
        for (int h = 0; h < nh; ++h) {
          float* sc = &scores[h * len];
          const float max = *std::max_element(sc, sc + len);
          const float inv = 1.f / k_->exp_sub_sum(sc, len, max);
          for (int p = 0; p < len; ++p) sc[p] *= inv;
        }
        for (int p = 0; p < len; ++p) {
          const float* vp = vt + static_cast<int64_t>(p) * kv_stride;
          for (int h = 0; h < nh; ++h) {
            k_->axpy_f32(scores[h * len + p], vp + ((h0 + h) / group) * head_dim, ot + h * head_dim,
                         head_dim);
          }
        }
      }
    });
  }

  void GatedActivation(Activation act, float* gate, const float* up, int64_t n) const override {
    if (act == Activation::kSilu) {
      k_->silu_mul(gate, up, n);
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      float g = gate[i];
      switch (act) {
        case Activation::kSilu:
          gate[i] = g / (1.f + std::exp(-g)) * up[i];
          break;
        case Activation::kRelu:
          gate[i] = (g > 0 ? g : 0.f) * up[i];
          break;
        case Activation::kDRelu:
          gate[i] = (g > 0 ? g : 0.f) * (up[i] > 0 ? up[i] : 0.f);
          break;
      }
    }
  }

 private:
  // y[t * n_rows + i] = row(i) . x[t] for the rows 0..n_rows-1 (ids == null) or ids[i]. Q8_0 /
  // Q4_0 rows multiply x quantized to Q8_0 (each token once), as in ReferenceOps; the others
  // multiply fp32 x. The same row kernel serves MatMul and MatMulRows, so a row's result is the
  // same whichever rows it is computed with (dense, sparse and batched paths agree bit for bit).
  void RowsTimesVectors(const TensorView& w, const int32_t* ids, int64_t n_rows, const float* x,
                        int n, float* y) const {
    if (IsKQuant(w.dtype)) {
      KRowsTimesVectors(w, ids, n_rows, x, n, y);
      return;
    }
    const int64_t cols = w.cols();
    const size_t di = static_cast<size_t>(w.dtype);
    const bool quantized = IsQuantized(w.dtype);
    Q8Scratch& qx = ThreadQ8Scratch();
    if (quantized) {
      const int64_t nb = cols / 32;
      qx.q.resize(static_cast<size_t>(n) * cols);
      qx.d.resize(static_cast<size_t>(n) * nb);
      qx.s8.resize(static_cast<size_t>(n) * nb * 8);
      for (int t = 0; t < n; ++t) {
        k_->quantize_q8x(x + t * cols, cols, &qx.q[t * cols], &qx.d[t * nb], &qx.s8[t * nb * 8]);
      }
    }
    const int8_t* xq = qx.q.data();
    const float* xd = qx.d.data();
    const int32_t* xs = qx.s8.data();
    const int64_t nb = cols / 32;
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
    const size_t stride = w.row_stride != 0 ? w.row_stride : w.row_bytes();  // row to row
    if (n == 1) {  // decode: the tightest loop, one kernel call per row
      const Q8Vector v{xq, xd, xs};
      auto dot_q8x = k_->dot_q8x[di];
      auto dot = k_->dot[di];
      For(n_rows, 16, [&](int64_t b, int64_t e) {
        if (quantized) {
          for (int64_t i = b; i < e; ++i) {
            y[i] = dot_q8x(data + (ids != nullptr ? ids[i] : i) * stride, v, cols);
          }
        } else {
          for (int64_t i = b; i < e; ++i) {
            y[i] = dot(data + (ids != nullptr ? ids[i] : i) * stride, x, cols);
          }
        }
      });
      return;
    }
    For(n_rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const uint8_t* row = data + (ids != nullptr ? ids[i] : i) * stride;
        for (int t = 0; t < n; ++t) {
          y[t * n_rows + i] =
              quantized ? k_->dot_q8x[di](
                              row, Q8Vector{xq + t * cols, xd + t * nb, xs + t * nb * 8}, cols)
                        : k_->dot[di](row, x + t * cols, cols);
        }
      }
    });
  }

  // MatMul of a quantized matrix with n > 1 tokens: each token quantized once (Q8_0, or Q8_K
  // for K-quant rows, as for one token) into a Q8Batch, then the tiled integer kernel over
  // groups of 16 rows (a multiple of every kernel set's tile) split among the threads. Each sum is
  // the one-token product's up to fp32 summation order.
  void QuantizedBatch(const TensorView& w, const float* x, int n, float* y) const {
    const int64_t rows = w.rows(), cols = w.cols();
    const bool k_quant = IsKQuant(w.dtype);
    const int64_t nb = cols / BlockElems(w.dtype);
    const int per = BatchOffsetsPerBlock(w.dtype);
    const int64_t tokens = (n + Q8Batch::kTokens - 1) / Q8Batch::kTokens * Q8Batch::kTokens;
    Q8Scratch& qx = ThreadQ8Scratch();
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> d;
    thread_local std::vector<int32_t> offsets;
    q.resize(static_cast<size_t>(tokens) * cols);
    d.resize(static_cast<size_t>(tokens) * nb);
    offsets.resize(static_cast<size_t>(tokens) * nb * per);
    qx.q.resize(cols);
    qx.d.resize(cols / 32);
    qx.s8.resize(cols / 4);
    qx.bsums.resize(cols / 16);
    const Q8Batch batch{q.data(), d.data(), offsets.data(), nb};
    const int64_t block = BlockElems(w.dtype);
    for (int t = 0; t < n; ++t) {
      if (k_quant) {
        k_->quantize_q8k(x + t * cols, cols, qx.q.data(), qx.d.data(), qx.bsums.data());
      } else {
        k_->quantize_q8x(x + t * cols, cols, qx.q.data(), qx.d.data(), qx.s8.data());
      }
      const int64_t first = batch.Index(t, 0);
      BatchOffsets(w.dtype, qx.q.data(), qx.bsums.data(), cols, Q8Batch::kTokens * per,
                   &offsets[first * per]);
      for (int64_t b = 0; b < nb; ++b) {  // token t's blocks, kTokens blocks apart
        const int64_t i = first + b * Q8Batch::kTokens;
        std::copy(&qx.q[b * block], &qx.q[b * block] + block, &q[i * block]);
        d[i] = qx.d[b];
      }
    }
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
    const size_t stride = w.row_stride != 0 ? w.row_stride : w.row_bytes();
    auto kernel = k_->matmul_q8b[static_cast<size_t>(w.dtype)];
    For((rows + 15) / 16, 1, [&](int64_t b, int64_t e) {
      const int64_t r0 = b * 16, r1 = std::min(rows, e * 16);
      kernel(data + r0 * stride, stride, r1 - r0, batch, n, cols, y + r0, rows);
    });
  }

  // RowsTimesVectors for Q4_K / Q5_K / Q6_K rows: x quantized to Q8_K, each token once.
  void KRowsTimesVectors(const TensorView& w, const int32_t* ids, int64_t n_rows, const float* x,
                         int n, float* y) const {
    const int64_t cols = w.cols(), nb = cols / 256;
    Q8Scratch& qx = ThreadQ8Scratch();
    qx.qk.resize(static_cast<size_t>(n) * cols);
    qx.dk.resize(static_cast<size_t>(n) * nb);
    qx.bsums.resize(static_cast<size_t>(n) * nb * 16);
    for (int t = 0; t < n; ++t) {
      k_->quantize_q8k(x + t * cols, cols, &qx.qk[t * cols], &qx.dk[t * nb],
                       &qx.bsums[t * nb * 16]);
    }
    const int8_t* xq = qx.qk.data();
    const float* xd = qx.dk.data();
    const int16_t* xs = qx.bsums.data();
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
    const size_t stride = w.row_stride != 0 ? w.row_stride : w.row_bytes();
    auto dot = k_->dot_q8k[static_cast<size_t>(w.dtype)];
    For(n_rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const uint8_t* row = data + (ids != nullptr ? ids[i] : i) * stride;
        for (int t = 0; t < n; ++t) {
          y[t * n_rows + i] =
              dot(row, Q8KVector{xq + t * cols, xd + t * nb, xs + t * nb * 16}, cols);
        }
      }
    });
  }

  // A single core reads a random 4-8 KB row at well under half its sequential bandwidth (the
  // hardware prefetchers restart at every row; measured 8-9 GB/s against 20-22 GB/s here), but
  // several scattered rows read at once keep several streams in flight (4 rows: 14-17 GB/s). So
  // the sparse ops hand up to kGroup rows to the kernels (axpy_rows, dot_rows*), which read up to
  // four of them together, vector by vector (eight: AVX-512's Q8_0 / Q4_0 axpy and Q4_0 dots;
  // eight-neuron groups made the Q4_0 token 1.1x faster there, F16 and Q8_0 no slower).
  // (Neighbouring rows of a dense product stream best one after the other: MatMul and MatMulRows
  // keep one kernel call per row.) AxpyRows adds each element's terms in row order, exactly as
  // one row after the other would; a row's dot does not depend on the rows it is grouped with.
  static constexpr int kGroup = 8;
  static constexpr int kGateGroup = 2 * kGroup;  // SparseFfnSplit's groups where the gate decides

  // x in the forms quantized rows multiply it.
  struct XQuant {
    Q8Vector q8;
    Q8KVector q8k;
  };

  // out[j] = rows[j] . x for j < k (Q8_0 / Q4_0 rows against the quantized v.q8, K-quant rows
  // against v.q8k), the rows read together by one kernel.

  void DotRows(DType dt, const uint8_t* const* rows, int k, const float* x, const XQuant& v,
               int64_t cols, float* out) const {
    const size_t di = static_cast<size_t>(dt);
    if (IsKQuant(dt)) {
      k_->dot_rows_q8k[di](rows, k, v.q8k, cols, out);
    } else if (IsQuantized(dt)) {
      k_->dot_rows_q8x[di](rows, k, v.q8, cols, out);
    } else {
      k_->dot_rows[di](rows, k, x, cols, out);
    }
  }

  // y[c0, c1) += sum_j a[j] * rows[j][c0, c1), each element's terms added in j order (c0 a
  // multiple of 32).
  void AxpyRows(DType dt, const uint8_t* const* rows, const float* a, int k, float* y, int64_t c0,
                int64_t c1) const {
    // One pass over [c0, c1): the kernel reads the k rows together, vector by vector.
    const size_t off = RowBytes(dt, c0);
    const uint8_t* rp[kGateGroup];
    for (int j = 0; j < k; ++j) rp[j] = rows[j] + off;
    k_->axpy_rows[static_cast<size_t>(dt)](a, rp, k, y + c0, c1 - c0);
  }

  struct Q8Scratch {
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> s8;
    std::vector<int8_t> qk;  // Q8_K
    std::vector<float> dk;
    std::vector<int16_t> bsums;
  };
  // Per calling thread, so that one SimdOps may serve several threads and decode allocates
  // nothing once warm.
  static Q8Scratch& ThreadQ8Scratch() {
    thread_local Q8Scratch scratch;
    return scratch;
  }

  template <typename F>
  void For(int64_t n, int64_t grain, F&& fn) const {
    if (pool_ == nullptr) {
      fn(int64_t{0}, n);
    } else {
      pool_->ParallelFor(n, grain, fn);
    }
  }

  ThreadPool* pool_;
  const RowKernels* k_;
};

}  // namespace

std::unique_ptr<CpuOps> NewSimdOps(ThreadPool* pool) {
  return std::make_unique<SimdOps>(pool, BestRowKernels());
}

std::unique_ptr<CpuOps> NewSimdOpsWithKernels(ThreadPool* pool, const RowKernels* k) {
  return std::make_unique<SimdOps>(pool, k);
}

absl::string_view SimdLevel() { return BestRowKernels()->name; }

}  // namespace pinfer
