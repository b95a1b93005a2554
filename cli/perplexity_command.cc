// `pinfer perplexity`: perplexity over windows of a little-endian uint32 token file.
#include <cstdio>
#include <cstring>
#include <iostream>

#include "cli/commands.h"
#include "cli/flags.h"
#include "nlohmann/json.hpp"
#include "shared/engine/ops.h"
#include "shared/engine/perplexity.h"
#include "shared/model/model.h"
#include "shared/sparse/sparse_runtime.h"
#include "shared/util/mapped_file.h"
#include "shared/util/status_macros.h"

namespace pinfer::cli {
namespace {

constexpr char kUsage[] =
    "usage: pinfer perplexity --model PATH --tokens FILE.u32 --window W [--threads N] [--json]\n"
    "         [--sparse | --exact-sparse]\n"
    "  --sparse: the prepared model's predictors pick the FFN neurons (an unprepared ReLU model\n"
    "  is prepared once and cached); --exact-sparse: only neurons with an active gate (ReLU).\n";

absl::StatusOr<std::vector<int32_t>> ReadTokenFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  if (bytes.size() % 4 != 0) {
    return absl::InvalidArgumentError(path + ": size is not a multiple of 4 bytes");
  }
  std::vector<int32_t> ids(bytes.size() / 4);
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto* b = reinterpret_cast<const uint8_t*>(bytes.data() + 4 * i);
    uint32_t v = b[0] | b[1] << 8 | b[2] << 16 | static_cast<uint32_t>(b[3]) << 24;
    if (v > INT32_MAX) return absl::InvalidArgumentError(path + ": token id out of range");
    ids[i] = static_cast<int32_t>(v);
  }
  return ids;
}

}  // namespace

int PerplexityCommand(const std::vector<std::string>& args) {
  auto flags = Flags::Parse(args, {"model", "tokens", "window", "threads"}, {"json", "reference", "sparse", "exact-sparse"});
  if (!flags.ok()) return UsageError(kUsage, flags.status());
  auto model_path = flags->Required("model");
  auto tokens_path = flags->Required("tokens");
  auto window = flags->Int("window", 0);
  auto threads = flags->Int("threads", 1);
  for (const absl::Status& st : {model_path.status(), tokens_path.status(), window.status(), threads.status()}) {
    if (!st.ok()) return UsageError(kUsage, st);
  }
  if (!flags->Has("window") || *window < 2 || *window > (1 << 20)) {
    return UsageError(kUsage, absl::InvalidArgumentError("--window must be an integer >= 2"));
  }
  if (*threads < 1 || *threads > 1024) return UsageError(kUsage, absl::InvalidArgumentError("--threads out of range"));
  const bool sparse = flags->Has("sparse"), exact_sparse = flags->Has("exact-sparse");
  if (sparse && exact_sparse) {
    return UsageError(kUsage, absl::InvalidArgumentError("--sparse and --exact-sparse exclude each other"));
  }
  auto tokens = ReadTokenFile(*tokens_path);
  if (!tokens.ok()) return RuntimeError(tokens.status());
  ThreadPool pool(static_cast<int>(*threads));
  auto ops = flags->Has("reference") ? NewReferenceOps() : NewSimdOps(&pool);
  std::unique_ptr<Model> dense_model;
  std::unique_ptr<SparseSession> session;
  if (sparse || exact_sparse) {
    auto s = OpenSparseSession(*model_path, sparse ? SparseMode::kPredicted : SparseMode::kExact,
                               *ops, [](const std::string& line) {
                                 std::fprintf(stderr, "%s\n", line.c_str());
                               });
    if (!s.ok()) return RuntimeError(s.status());
    session = std::move(*s);
    session->set_measure_recall(true);  // for predictor_recall
  } else {
    auto model = LoadModel(*model_path);
    if (!model.ok()) return RuntimeError(model.status());
    dense_model = std::move(*model);
  }
  Transformer transformer(session != nullptr ? session->model() : *dense_model, *ops);
  if (session != nullptr) transformer.set_ffn(session->ffn());
  const bool json = flags->Has("json");
  auto result = ComputePerplexity(transformer, *tokens, static_cast<int>(*window), [&](int done, int total) {
    if (!json) std::fprintf(stderr, "\rwindow %d/%d", done, total);
  });
  if (!json) std::fprintf(stderr, "\n");
  if (!result.ok()) return RuntimeError(result.status());
  if (json) {
    nlohmann::json j;
    j["perplexity"] = result->perplexity;
    j["tokens_scored"] = result->tokens_scored;
    j["seconds"] = result->seconds;
    if (session != nullptr) {
      const SparseFfnStats& st = session->stats();
      j["ffn_sparsity"] = st.Sparsity();
      for (size_t l = 0; l < st.layers.size(); ++l) {
        j["ffn_sparsity_per_layer"].push_back(st.Sparsity(static_cast<int>(l)));
      }
      if (session->mode() == SparseMode::kPredicted) {
        j["predictor_recall"] = st.Recall();
        j["predictor_magnitude_recall"] = st.MagnitudeRecall();
      }
    }
    std::cout << j.dump() << "\n";
  } else {
    std::printf("perplexity %.6f over %lld tokens (%.1f s)\n", result->perplexity,
                static_cast<long long>(result->tokens_scored), result->seconds);
    if (session != nullptr) {
      const SparseFfnStats& st = session->stats();
      std::printf("ffn sparsity %.4f", st.Sparsity());
      if (session->mode() == SparseMode::kPredicted) {
        std::printf(", predictor recall %.4f (magnitude-weighted %.4f)", st.Recall(),
                    st.MagnitudeRecall());
      }
      std::printf("\nper layer:");
      for (size_t l = 0; l < st.layers.size(); ++l) std::printf(" %.3f", st.Sparsity(static_cast<int>(l)));
      std::printf("\n");
    }
  }
  return 0;
}

}  // namespace pinfer::cli
