// A small random Llama model built in memory, for tests that need exact control over weights and
// dtypes (every dtype the kernels support, ReLU/dReLU/SiLU) without a file on disk.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "shared/model/model.h"
#include "shared/util/half.h"

namespace pinfer::testing_util {

// A tensor of N(0, scale^2) values stored in `dtype`, owned by `model`.
inline TensorView RandomTensor(Model* model, const std::string& name, std::vector<int64_t> shape,
                               DType dtype, std::mt19937& rng, float scale) {
  TensorView t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  auto buf = std::make_shared<std::vector<uint8_t>>(t.nbytes());
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> row(t.cols());
  for (int64_t r = 0; r < t.numel() / t.cols(); ++r) {
    for (float& v : row) v = d(rng);
    QuantizeRow(dtype, row.data(), buf->data() + r * t.row_bytes(), t.cols());
  }
  t.data = buf->data();
  model->owned.push_back(std::move(buf));
  return t;
}

inline TensorView ConstantTensor(Model* model, const std::string& name, int64_t n, float value) {
  TensorView t;
  t.name = name;
  t.dtype = DType::kF32;
  t.shape = {n};
  auto buf = std::make_shared<std::vector<uint8_t>>(n * 4);
  std::vector<float> v(n, value);
  std::memcpy(buf->data(), v.data(), n * 4);
  t.data = buf->data();
  model->owned.push_back(std::move(buf));
  return t;
}

struct RandomModelOptions {
  int hidden = 64;
  int ffn = 256;
  int layers = 2;
  int heads = 4;
  int kv_heads = 2;
  int vocab = 96;
  DType dtype = DType::kF32;
  Activation activation = Activation::kRelu;
  uint32_t seed = 1;
};

inline std::unique_ptr<Model> RandomModel(const RandomModelOptions& o) {
  auto m = std::make_unique<Model>();
  ModelConfig& c = m->config;
  c.vocab_size = o.vocab;
  c.hidden_size = o.hidden;
  c.n_layers = o.layers;
  c.n_heads = o.heads;
  c.n_kv_heads = o.kv_heads;
  c.head_dim = o.hidden / o.heads;
  c.ffn_size = o.ffn;
  c.max_context = 256;
  c.activation = o.activation;
  std::mt19937 rng(o.seed);
  const float s = 1.f / std::sqrt(static_cast<float>(o.hidden));
  m->tok_embeddings =
      RandomTensor(m.get(), "tok_embeddings", {o.vocab, o.hidden}, DType::kF32, rng, 1.f);
  for (int l = 0; l < o.layers; ++l) {
    LayerWeights L;
    L.attn_norm = ConstantTensor(m.get(), "attn_norm", o.hidden, 1.f);
    L.ffn_norm = ConstantTensor(m.get(), "ffn_norm", o.hidden, 1.f);
    L.wq = RandomTensor(m.get(), "wq", {c.q_dim(), o.hidden}, o.dtype, rng, s);
    L.wk = RandomTensor(m.get(), "wk", {c.kv_dim(), o.hidden}, o.dtype, rng, s);
    L.wv = RandomTensor(m.get(), "wv", {c.kv_dim(), o.hidden}, o.dtype, rng, s);
    L.wo = RandomTensor(m.get(), "wo", {o.hidden, c.q_dim()}, o.dtype, rng, s);
    L.gate = RandomTensor(m.get(), "gate", {o.ffn, o.hidden}, o.dtype, rng, s);
    L.up = RandomTensor(m.get(), "up", {o.ffn, o.hidden}, o.dtype, rng, s);
    L.down = RandomTensor(m.get(), "down", {o.hidden, o.ffn}, o.dtype, rng,
                          1.f / std::sqrt(static_cast<float>(o.ffn)));
    m->layers.push_back(L);
  }
  m->output_norm = ConstantTensor(m.get(), "output_norm", o.hidden, 1.f);
  m->output = RandomTensor(m.get(), "output", {o.vocab, o.hidden}, DType::kF32, rng, s);
  return m;
}

}  // namespace pinfer::testing_util
