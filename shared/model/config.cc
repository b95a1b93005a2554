// See config.h.
#include "shared/model/config.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pinfer {

std::string ActivationName(Activation a) {
  switch (a) {
    case Activation::kSilu:
      return "silu";
    case Activation::kRelu:
      return "relu";
    case Activation::kDRelu:
      return "drelu";
  }
  return "?";
}

absl::Status ModelConfig::Validate() const {
  auto bad = [](absl::string_view what, int v) {
    return absl::InvalidArgumentError(absl::StrCat("model config: invalid ", what, " = ", v));
  };
  if (vocab_size <= 0 || vocab_size > (1 << 24)) return bad("vocab_size", vocab_size);
  if (hidden_size <= 0 || hidden_size > (1 << 16)) return bad("hidden_size", hidden_size);
  if (n_layers <= 0 || n_layers > 1024) return bad("num_hidden_layers", n_layers);
  if (n_heads <= 0 || n_heads > 1024) return bad("num_attention_heads", n_heads);
  if (n_kv_heads <= 0 || n_kv_heads > n_heads) return bad("num_key_value_heads", n_kv_heads);
  if (n_heads % n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model config: num_attention_heads ", n_heads,
                                                   " is not a multiple of num_key_value_heads ",
                                                   n_kv_heads));
  }
  if (head_dim <= 0 || head_dim % 2 != 0 || head_dim > 1024) return bad("head_dim", head_dim);
  if (ffn_size <= 0 || ffn_size > (1 << 20)) return bad("intermediate_size", ffn_size);
  if (max_context <= 0) return bad("max_position_embeddings", max_context);
  if (sliding_window < 0) return bad("sliding_window", sliding_window);
  if (!(norm_eps > 0) || !(rope_theta > 0)) {
    return absl::InvalidArgumentError("model config: rms_norm_eps and rope_theta must be > 0");
  }
  return absl::OkStatus();
}

}  // namespace pinfer
