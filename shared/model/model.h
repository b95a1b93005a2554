// A loaded Llama-family model: configuration, weight views into mapped files, and tokenizer.
//
// LoadModel accepts a Hugging Face directory (config.json + safetensors) or a GGUF file. Weights
// stay in the mapping, in their stored dtype; the engine converts to fp32 on the fly.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/model/config.h"
#include "shared/model/tensor.h"
#include "shared/tokenizer/tokenizer.h"
#include "shared/util/mapped_file.h"

namespace pinfer {

struct LayerWeights {
  TensorView attn_norm;   // [hidden]
  TensorView wq;          // [q_dim, hidden]
  TensorView wk;          // [kv_dim, hidden]
  TensorView wv;          // [kv_dim, hidden]
  TensorView wo;          // [hidden, q_dim]
  TensorView bq, bk, bv;  // [q_dim], [kv_dim], [kv_dim]: Qwen2's biases; empty without qkv_bias
  TensorView ffn_norm;    // [hidden]
  TensorView gate;        // [ffn, hidden]
  TensorView up;          // [ffn, hidden]
  TensorView down;        // [hidden, ffn]; empty when only down_t was loaded (see GgufLoadOptions)
  // [ffn, hidden]: the down projection as a PWRI file stores it (a row per neuron, in the file's
  // type), else empty. The sparse paths read its rows directly.
  TensorView down_t;
};

struct Model {
  ModelConfig config;
  TensorView tok_embeddings;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  TensorView output_norm;                // [hidden]
  TensorView output;                     // [vocab, hidden]; same data as tok_embeddings when tied
  std::unique_ptr<Tokenizer> tokenizer;  // null for weight-only files
  std::string source_path;
  std::string format;  // "huggingface" or "gguf"

  // Keeps the memory that the views point into alive.
  std::vector<std::shared_ptr<MappedFile>> files;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> owned;
};

// Loads a Hugging Face directory or a GGUF file.
absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& path);
absl::StatusOr<std::unique_ptr<Model>> LoadHuggingFaceModel(const std::string& dir);
absl::StatusOr<std::unique_ptr<Model>> LoadGgufModel(const std::string& path);

// Checks every tensor's presence and shape against the configuration.
absl::Status ValidateModelShapes(const Model& model);

}  // namespace pinfer
