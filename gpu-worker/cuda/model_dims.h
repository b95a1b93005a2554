// The CUDA module's model dimensions from an engine ModelConfig. backend.h stays free of engine
// and Abseil headers (it is the module's C++17 ABI); host code that has a ModelConfig uses this.
#pragma once

#include "gpu-worker/cuda/backend.h"
#include "shared/engine/transformer.h"
#include "shared/model/config.h"

namespace pinfer::cuda {

inline ModelDims DimsFromConfig(const ModelConfig& c) {
  ModelDims d;
  d.vocab = c.vocab_size;
  d.hidden = c.hidden_size;
  d.n_layers = c.n_layers;
  d.n_heads = c.n_heads;
  d.n_kv_heads = c.n_kv_heads;
  d.head_dim = c.head_dim;
  d.ffn = c.ffn_size;
  d.norm_eps = c.norm_eps;
  d.activation = static_cast<int>(c.activation);
  d.rope_interleaved = c.rope_interleaved;
  d.sliding_window = c.sliding_window;
  d.inv_freq = RopeInverseFrequencies(c);
  return d;
}

}  // namespace pinfer::cuda
