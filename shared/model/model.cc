// Format dispatch and the shape checks every loader shares.
#include "shared/model/model.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "shared/util/status_macros.h"

namespace pinfer {

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return LoadHuggingFaceModel(path);
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat("model path '", path, "' does not exist"));
  }
  return LoadGgufModel(path);
}

absl::Status ValidateModelShapes(const Model& m) {
  const ModelConfig& c = m.config;
  RETURN_IF_ERROR(c.Validate());
  auto check = [](const TensorView& t, std::vector<int64_t> want) -> absl::Status {
    if (t.data == nullptr)
      return absl::NotFoundError(absl::StrCat("missing tensor '", t.name, "'"));
    // Norm vectors may be stored as [n] or [1, n].
    std::vector<int64_t> got = t.shape;
    while (got.size() > want.size() && got.front() == 1) got.erase(got.begin());
    if (got != want) {
      std::string g, w;
      for (auto d : t.shape) absl::StrAppend(&g, g.empty() ? "" : ",", d);
      for (auto d : want) absl::StrAppend(&w, w.empty() ? "" : ",", d);
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' has shape [", g, "], expected [", w, "]"));
    }
    if (t.cols() % BlockElems(t.dtype) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "': row length not a multiple of ", BlockElems(t.dtype)));
    }
    return absl::OkStatus();
  };
  const int64_t H = c.hidden_size, V = c.vocab_size, F = c.ffn_size;
  RETURN_IF_ERROR(check(m.tok_embeddings, {V, H}));
  RETURN_IF_ERROR(check(m.output_norm, {H}));
  RETURN_IF_ERROR(check(m.output, {V, H}));
  if (static_cast<int>(m.layers.size()) != c.n_layers) {
    return absl::InvalidArgumentError("layer count does not match config");
  }
  for (const LayerWeights& L : m.layers) {
    RETURN_IF_ERROR(check(L.attn_norm, {H}));
    RETURN_IF_ERROR(check(L.wq, {c.q_dim(), H}));
    RETURN_IF_ERROR(check(L.wk, {c.kv_dim(), H}));
    RETURN_IF_ERROR(check(L.wv, {c.kv_dim(), H}));
    RETURN_IF_ERROR(check(L.wo, {H, c.q_dim()}));
    if (c.qkv_bias) {
      RETURN_IF_ERROR(check(L.bq, {c.q_dim()}));
      RETURN_IF_ERROR(check(L.bk, {c.kv_dim()}));
      RETURN_IF_ERROR(check(L.bv, {c.kv_dim()}));
    }
    RETURN_IF_ERROR(check(L.ffn_norm, {H}));
    RETURN_IF_ERROR(check(L.gate, {F, H}));
    RETURN_IF_ERROR(check(L.up, {F, H}));
    if (L.down_t.data != nullptr) RETURN_IF_ERROR(check(L.down_t, {F, H}));
    if (L.down.data != nullptr || L.down_t.data == nullptr) RETURN_IF_ERROR(check(L.down, {H, F}));
  }
  return absl::OkStatus();
}

}  // namespace pinfer
