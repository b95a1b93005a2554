// Hyper-parameters of a Llama-family model, independent of the file format it came from.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace pinfer {

enum class Activation { kSilu, kRelu, kDRelu };  // dReLU: ReLU on both gate and up

struct RopeScaling {
  bool llama3 = false;  // Llama-3.1 frequency-dependent scaling
  float factor = 1.f;
  float low_freq_factor = 1.f;
  float high_freq_factor = 4.f;
  int original_max_position = 8192;
};

struct ModelConfig {
  std::string architecture = "llama";
  int vocab_size = 0;
  int hidden_size = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int ffn_size = 0;
  int max_context = 2048;
  float norm_eps = 1e-5f;
  float rope_theta = 10000.f;
  RopeScaling rope_scaling;
  Activation activation = Activation::kSilu;
  bool tie_embeddings = false;
  // GGUF files store Q/K rows permuted so that RoPE rotates adjacent pairs (2i, 2i+1); Hugging
  // Face rotates halves (i, i + head_dim/2). Both layouts give identical results.
  bool rope_interleaved = false;
  // Qwen2: the q, k and v projections add a bias (LayerWeights::bq, bk, bv).
  bool qkv_bias = false;
  // Mistral's sliding-window attention: a query at position p attends only to the keys at
  // positions j with p - sliding_window < j <= p. 0: none (every earlier position), which is also
  // what a window covering the whole context is stored as.
  int sliding_window = 0;
  int bos_id = 1;
  int eos_id = 2;
  bool add_bos = true;

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  absl::Status Validate() const;
};

std::string ActivationName(Activation a);

}  // namespace pinfer
