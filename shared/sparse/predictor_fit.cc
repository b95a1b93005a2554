// See predictor_fit.h. Big products run through CpuOps::MatMul on fp32 views (the engine's SIMD
// kernels and thread pool); the small hidden x hidden linear algebra of the closed form is plain
// loops.
#include "shared/sparse/predictor_fit.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>

namespace pinfer {
namespace {

// Orthonormalises the k columns of z: [h, k] with respect to the inner product <a, b> = a^T G b
// (modified Gram-Schmidt). Columns that vanish are re-seeded randomly.
void OrthonormaliseG(std::vector<float>& z, const std::vector<float>& g, int h, int k,
                     std::mt19937& rng) {
  std::vector<double> col(h), gcol(h);
  std::vector<std::vector<double>> basis_g;  // G * accepted columns
  std::vector<std::vector<double>> basis;
  std::normal_distribution<double> nd;
  for (int c = 0; c < k; ++c) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      for (int i = 0; i < h; ++i) col[i] = z[static_cast<size_t>(i) * k + c];
      for (size_t b = 0; b < basis.size(); ++b) {
        double dot = 0;
        for (int i = 0; i < h; ++i) dot += col[i] * basis_g[b][i];
        for (int i = 0; i < h; ++i) col[i] -= dot * basis[b][i];
      }
      for (int i = 0; i < h; ++i) {
        double s = 0;
        for (int j = 0; j < h; ++j)
          s += static_cast<double>(g[static_cast<size_t>(i) * h + j]) * col[j];
        gcol[i] = s;
      }
      double norm2 = 0;
      for (int i = 0; i < h; ++i) norm2 += col[i] * gcol[i];
      if (norm2 > 1e-20) {
        const double inv = 1.0 / std::sqrt(norm2);
        for (int i = 0; i < h; ++i) {
          col[i] *= inv;
          gcol[i] *= inv;
        }
        break;
      }
      for (int i = 0; i < h; ++i) z[static_cast<size_t>(i) * k + c] = static_cast<float>(nd(rng));
    }
    basis.push_back(col);
    basis_g.push_back(gcol);
    for (int i = 0; i < h; ++i) z[static_cast<size_t>(i) * k + c] = static_cast<float>(col[i]);
  }
}

inline float Sigmoid(float s) { return 1.f / (1.f + std::exp(-s)); }

}  // namespace

void MatMulF32(const CpuOps& ops, const float* w, int64_t rows, int64_t cols, const float* x, int n,
               float* y) {
  TensorView t;
  t.dtype = DType::kF32;
  t.shape = {rows, cols};
  t.data = w;
  ops.MatMul(t, x, n, y);
}

void Transpose(const float* a, int64_t rows, int64_t cols, float* out) {
  constexpr int64_t kTile = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) out[c * rows + r] = a[r * cols + c];
      }
    }
  }
}

// The inner loop vectorises.
void GemmNN(const float* a, const float* b, float* c, int64_t m, int64_t k, int64_t n) {
  std::fill(c, c + m * n, 0.f);
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * n;
    for (int64_t p = 0; p < k; ++p) {
      const float aip = a[i * k + p];
      if (aip == 0) continue;
      const float* bp = b + p * n;
      for (int64_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
    }
  }
}

FfnTargets ComputeFfnTargets(const Model& model, const CpuOps& ops, int layer, const float* ffn_x,
                             int64_t n, int64_t n_train, bool keep_gate) {
  const ModelConfig& c = model.config;
  const LayerWeights& L = model.layers[layer];
  const int H = c.hidden_size, F = c.ffn_size;
  FfnTargets d;
  // |column j of down|: how much a unit of neuron j's activation moves the output.
  std::vector<double> col2(F, 0.0);
  {
    std::vector<float> row(F);
    for (int64_t h = 0; h < H; ++h) {
      DequantizeRow(L.down.dtype, L.down.row(h), row.data(), F);
      for (int j = 0; j < F; ++j) col2[j] += static_cast<double>(row[j]) * row[j];
    }
  }
  std::vector<float> down_norm(F);
  for (int j = 0; j < F; ++j) down_norm[j] = static_cast<float>(std::sqrt(col2[j]));

  d.importance.resize(static_cast<size_t>(n) * F);
  if (keep_gate) d.gate.resize(d.importance.size());
  std::vector<double> imp2(F, 0.0), gate2(F, 0.0);
  double pos_sum = 0;
  int64_t pos_count = 0;
  constexpr int kChunk = 512;
  std::vector<float> g(keep_gate ? 0 : static_cast<size_t>(kChunk) * F),
      u(static_cast<size_t>(kChunk) * F);
  for (int64_t b0 = 0; b0 < n; b0 += kChunk) {
    const int nb = static_cast<int>(std::min<int64_t>(kChunk, n - b0));
    const float* xb = ffn_x + b0 * H;
    float* gb = keep_gate ? d.gate.data() + b0 * F : g.data();
    ops.MatMul(L.gate, xb, nb, gb);      // [nb, ffn]
    ops.MatMul(L.up, xb, nb, u.data());  // [nb, ffn]
    for (int t = 0; t < nb; ++t) {
      float* imp = d.importance.data() + (b0 + t) * F;
      const float* gt = gb + static_cast<size_t>(t) * F;
      const float* ut = u.data() + static_cast<size_t>(t) * F;
      for (int j = 0; j < F; ++j) {
        const float gj = gt[j];
        const bool active = gj > 0 && (c.activation != Activation::kDRelu || ut[j] > 0);
        if (!active) {
          imp[j] = 0;
          continue;
        }
        // Tiny but positive, so that "active" survives even when up is exactly zero.
        const float v = std::max(gj * std::fabs(ut[j]) * down_norm[j], 1e-30f);
        imp[j] = v;
        if (b0 + t < n_train) {
          imp2[j] += static_cast<double>(v) * v;
          gate2[j] += static_cast<double>(gj) * gj;
          pos_sum += v;
          ++pos_count;
        }
      }
    }
  }
  d.mean_positive_importance = pos_count > 0 ? pos_sum / pos_count : 1.0;
  {
    std::vector<double> sum(F, 0.0);
    std::vector<int64_t> count(F, 0);
    for (int64_t t = 0; t < n_train; ++t) {
      const float* imp = d.importance.data() + t * F;
      for (int j = 0; j < F; ++j) {
        if (imp[j] > 0) {
          sum[j] += imp[j];
          ++count[j];
        }
      }
    }
    d.mean_active_importance.resize(F);
    for (int j = 0; j < F; ++j) {
      d.mean_active_importance[j] = count[j] > 0
                                        ? static_cast<float>(sum[j] / count[j])
                                        : static_cast<float>(d.mean_positive_importance * 1e-3);
    }
  }

  d.unit_contribution.resize(F);
  for (int j = 0; j < F; ++j) {
    d.unit_contribution[j] =
        gate2[j] > 0 ? static_cast<float>(std::sqrt(imp2[j] / gate2[j])) : down_norm[j];
  }
  return d;
}

std::vector<float> SecondMoment(const CpuOps& ops, const float* x, int64_t n_train, int hidden) {
  const int H = hidden;
  constexpr int kChunk = 512;
  std::vector<double> acc(static_cast<size_t>(H) * H, 0.0);
  std::vector<float> xt(static_cast<size_t>(kChunk) * H), part(static_cast<size_t>(H) * H);
  for (int64_t b0 = 0; b0 < n_train; b0 += kChunk) {
    const int nb = static_cast<int>(std::min<int64_t>(kChunk, n_train - b0));
    Transpose(x + b0 * H, nb, H, xt.data());  // [H, nb]
    MatMulF32(ops, xt.data(), H, nb, xt.data(), H, part.data());
    for (size_t i = 0; i < part.size(); ++i) acc[i] += part[i];
  }
  std::vector<float> out(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) out[i] = static_cast<float>(acc[i] / n_train);
  return out;
}

void ClosedFormPredictor(const std::vector<float>& wg, const std::vector<float>* unit_contribution,
                         const std::vector<float>& second_moment,
                         const std::vector<float>* resid_var, int hidden, int ffn, int r,
                         uint32_t seed, std::vector<float>* w1, std::vector<float>* w2) {
  const std::vector<float>& s2 = second_moment;
  const int H = hidden, F = ffn;
  const int k = r / 2;
  std::mt19937 rng(seed);

  // a = D wg with D = diag(contribution per unit of gate); g: [H, H] = a^T a.
  std::vector<float> a(wg.size());
  for (int j = 0; j < F; ++j) {
    const float dj = unit_contribution != nullptr ? (*unit_contribution)[j] : 1.f;
    for (int h = 0; h < H; ++h)
      a[static_cast<size_t>(j) * H + h] = dj * wg[static_cast<size_t>(j) * H + h];
  }
  std::vector<float> at(a.size());
  Transpose(a.data(), F, H, at.data());
  std::vector<float> g(static_cast<size_t>(H) * H);
  GemmNN(at.data(), a.data(), g.data(), H, F, H);

  // Subspace iteration in input space: the top-k eigenvectors of M = a s2 a^T are a z for the
  // dominant z of s2 g, orthonormal under <z1, z2> = z1^T g z2.
  std::vector<float> z(static_cast<size_t>(H) * k), tmp(z.size());
  std::normal_distribution<float> nd;
  for (float& v : z) v = nd(rng);
  OrthonormaliseG(z, g, H, k, rng);
  for (int it = 0; it < 40; ++it) {
    GemmNN(g.data(), z.data(), tmp.data(), H, H, k);   // g z
    GemmNN(s2.data(), tmp.data(), z.data(), H, H, k);  // s2 g z
    OrthonormaliseG(z, g, H, k, rng);
  }
  // fc1_lin: [k, H] = z^T g; fc2_lin: [F, k] = wg z.
  std::vector<float> zt(static_cast<size_t>(k) * H);
  Transpose(z.data(), H, k, zt.data());
  std::vector<float> fc1(static_cast<size_t>(k) * H), fc2(static_cast<size_t>(F) * k);
  GemmNN(zt.data(), g.data(), fc1.data(), k, H, H);
  GemmNN(wg.data(), z.data(), fc2.data(), F, H, k);

  // Unit-variance hidden units (conditioning for the fine-tuning): scale fc1 rows, undo in fc2.
  std::vector<float> s2f(H);
  for (int i = 0; i < k; ++i) {
    float* row = fc1.data() + static_cast<size_t>(i) * H;
    double var = 0;
    for (int p = 0; p < H; ++p) {
      double s = 0;
      for (int q = 0; q < H; ++q)
        s += static_cast<double>(s2[static_cast<size_t>(p) * H + q]) * row[q];
      var += s * row[p];
    }
    const float sd = static_cast<float>(std::sqrt(std::max(var, 1e-30)));
    for (int p = 0; p < H; ++p) row[p] /= sd;
    for (int j = 0; j < F; ++j) fc2[static_cast<size_t>(j) * k + i] *= sd;
  }

  // Residual spread per neuron: e_j = wg_j - fc2_j fc1; s_j^2 = e_j^T s2 e_j.
  std::vector<float> approx(static_cast<size_t>(F) * H);
  GemmNN(fc2.data(), fc1.data(), approx.data(), F, k, H);
  std::vector<float> scale(F);
  std::vector<float> e(H);
  for (int j = 0; j < F; ++j) {
    for (int h = 0; h < H; ++h) {
      e[h] = wg[static_cast<size_t>(j) * H + h] - approx[static_cast<size_t>(j) * H + h];
    }
    double var = resid_var != nullptr ? (*resid_var)[j] : 0.0;
    for (int p = 0; p < H; ++p) {
      const float* s2p = s2.data() + static_cast<size_t>(p) * H;
      double s = 0;
      for (int q = 0; q < H; ++q) s += static_cast<double>(s2p[q]) * e[q];
      var += s * e[p];
    }
    // 1.7 * x / sd is the logistic approximation of the normal CDF Phi(x / sd).
    scale[j] = 1.7f / static_cast<float>(std::sqrt(std::max(var, 1e-12)));
  }

  const int r2 = 2 * k;
  w1->resize(static_cast<size_t>(r2) * H);
  w2->resize(static_cast<size_t>(F) * r2);
  for (int i = 0; i < k; ++i) {
    for (int h = 0; h < H; ++h) {
      (*w1)[static_cast<size_t>(i) * H + h] = fc1[static_cast<size_t>(i) * H + h];
      (*w1)[static_cast<size_t>(k + i) * H + h] = -fc1[static_cast<size_t>(i) * H + h];
    }
  }
  for (int j = 0; j < F; ++j) {
    for (int i = 0; i < k; ++i) {
      const float v = scale[j] * fc2[static_cast<size_t>(j) * k + i];
      (*w2)[static_cast<size_t>(j) * r2 + i] = v;
      (*w2)[static_cast<size_t>(j) * r2 + k + i] = -v;
    }
  }
}

void FineTunePredictor(const CpuOps& ops, const float* x, const float* importance,
                       double mean_positive_importance, int64_t n_train, int hidden, int ffn, int r,
                       const PredictorTrainingOptions& o, uint32_t seed, std::vector<float>* w1,
                       std::vector<float>* w2) {
  const int H = hidden, F = ffn, B = o.batch;
  std::vector<float>& w1v = *w1;
  std::vector<float>& w2v = *w2;
  std::vector<float> m1(w1v.size(), 0.f), v1(w1v.size(), 0.f);
  std::vector<float> m2(w2v.size(), 0.f), v2(w2v.size(), 0.f);
  std::vector<float> xb(static_cast<size_t>(B) * H), xbt(xb.size());
  std::vector<float> z(static_cast<size_t>(B) * r), hd(z.size()), hdt(z.size());
  std::vector<float> s(static_cast<size_t>(B) * F), ds(s.size()), dst(s.size());
  std::vector<float> w2t(w2v.size());
  std::vector<float> dhd(z.size()), dzt(z.size());
  std::vector<float> gw1(w1v.size()), gw2(w2v.size());
  std::vector<int64_t> order(n_train);
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 rng(seed);
  const float inv_mean = static_cast<float>(1.0 / mean_positive_importance);
  // (contribution / mean)^power, clipped; a table over the float's exponent and top mantissa bits
  // would do too, but pow on the ~20% active pairs is cheap next to the products.
  auto PositiveWeight = [&](float imp) {
    const float w = o.positive_weight_power == 0.5f
                        ? std::sqrt(imp * inv_mean)
                        : std::pow(imp * inv_mean, o.positive_weight_power);
    return std::clamp(w, o.positive_weight_min, o.positive_weight_max);
  };
  const float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  int64_t step = 0;
  const int64_t total_steps = std::max<int64_t>(1, o.epochs * (n_train / B));
  double t_fwd = 0, t_loss = 0, t_bwd = 0;
  const auto t_start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < o.epochs; ++epoch) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t b0 = 0; b0 + B <= n_train; b0 += B) {
      for (int t = 0; t < B; ++t) {
        std::copy_n(x + order[b0 + t] * H, H, xb.data() + static_cast<size_t>(t) * H);
      }
      auto tp0 = std::chrono::steady_clock::now();
      // Forward: z: [B, r] = xb w1^T; hd = relu(z); s: [B, F] = hd w2^T.
      MatMulF32(ops, w1v.data(), r, H, xb.data(), B, z.data());
      for (size_t i = 0; i < z.size(); ++i) hd[i] = std::max(z[i], 0.f);
      MatMulF32(ops, w2v.data(), F, r, hd.data(), B, s.data());
      auto tp1 = std::chrono::steady_clock::now();
      // ds = dLoss/ds, weighted BCE averaged over the batch.
      const float inv_b = 1.f / B;
      for (int t = 0; t < B; ++t) {
        const float* imp = importance + order[b0 + t] * F;
        const float* st = s.data() + static_cast<size_t>(t) * F;
        float* dt = ds.data() + static_cast<size_t>(t) * F;
        for (int j = 0; j < F; ++j) {
          const float p = Sigmoid(st[j]);
          dt[j] = imp[j] > 0 ? PositiveWeight(imp[j]) * (p - 1.f) * inv_b
                             : o.negative_weight * p * inv_b;
        }
      }
      auto tp2 = std::chrono::steady_clock::now();
      // Backward: gw2: [F, r] = ds^T hd; dhd: [B, r] = ds w2; gw1: [r, H] = dz^T xb.
      Transpose(hd.data(), B, r, hdt.data());
      Transpose(ds.data(), B, F, dst.data());
      MatMulF32(ops, hdt.data(), r, B, dst.data(), F, gw2.data());
      Transpose(w2v.data(), F, r, w2t.data());
      MatMulF32(ops, w2t.data(), r, F, ds.data(), B, dhd.data());
      for (size_t i = 0; i < dhd.size(); ++i) {
        if (z[i] <= 0) dhd[i] = 0;
      }
      Transpose(dhd.data(), B, r, dzt.data());
      Transpose(xb.data(), B, H, xbt.data());
      MatMulF32(ops, xbt.data(), H, B, dzt.data(), r, gw1.data());
      auto tp3 = std::chrono::steady_clock::now();
      t_fwd += std::chrono::duration<double>(tp1 - tp0).count();
      t_loss += std::chrono::duration<double>(tp2 - tp1).count();
      t_bwd += std::chrono::duration<double>(tp3 - tp2).count();
      ++step;
      const float c1 = 1.f - std::pow(beta1, static_cast<float>(step));
      const float c2 = 1.f - std::pow(beta2, static_cast<float>(step));
      // Linear decay to zero over the run: large steps first, then settle.
      const float decay = o.lr_decay ? 1.f - static_cast<float>(step - 1) / total_steps : 1.f;
      const float lr = o.learning_rate * decay * std::sqrt(c2) / c1;
      auto adam = [&](std::vector<float>& w, std::vector<float>& mm, std::vector<float>& vv,
                      const std::vector<float>& grad) {
        for (size_t i = 0; i < w.size(); ++i) {
          mm[i] = beta1 * mm[i] + (1 - beta1) * grad[i];
          vv[i] = beta2 * vv[i] + (1 - beta2) * grad[i] * grad[i];
          w[i] -= lr * mm[i] / (std::sqrt(vv[i]) + eps);
        }
      };
      adam(w1v, m1, v1, gw1);
      adam(w2v, m2, v2, gw2);
    }
  }
  if (std::getenv("PINFER_TRAIN_TIMING") != nullptr) {
    std::fprintf(stderr,
                 "fine-tune r=%d: %lld steps, %.2f s (forward %.2f, loss %.2f, backward %.2f)\n", r,
                 static_cast<long long>(step),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(),
                 t_fwd, t_loss, t_bwd);
  }
}

}  // namespace pinfer
