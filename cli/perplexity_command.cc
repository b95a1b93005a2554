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
#include "shared/util/mapped_file.h"
#include "shared/util/status_macros.h"

namespace pinfer::cli {
namespace {

constexpr char kUsage[] =
    "usage: pinfer perplexity --model PATH --tokens FILE.u32 --window W [--threads N] [--json]\n";

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
  auto flags = Flags::Parse(args, {"model", "tokens", "window", "threads"}, {"json", "reference"});
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
  auto model = LoadModel(*model_path);
  if (!model.ok()) return RuntimeError(model.status());
  auto tokens = ReadTokenFile(*tokens_path);
  if (!tokens.ok()) return RuntimeError(tokens.status());
  ThreadPool pool(static_cast<int>(*threads));
  auto ops = flags->Has("reference") ? NewReferenceOps() : NewSimdOps(&pool);
  Transformer transformer(**model, *ops);
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
    std::cout << j.dump() << "\n";
  } else {
    std::printf("perplexity %.6f over %lld tokens (%.1f s)\n", result->perplexity,
                static_cast<long long>(result->tokens_scored), result->seconds);
  }
  return 0;
}

}  // namespace pinfer::cli
