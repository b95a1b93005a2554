// `pinfer generate`: runs a prompt through the in-process engine and streams the continuation
// (text to stdout, speeds to stderr) or prints one JSON object with --json.
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "cli/flags.h"
#include "nlohmann/json.hpp"
#include "shared/engine/generator.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"
#include "shared/sparse/sparse_runtime.h"
#include "shared/util/status_macros.h"

namespace pinfer::cli {
namespace {

constexpr char kUsage[] =
    "usage: pinfer generate --model PATH --prompt TEXT [--max-tokens N] [--temperature T]\n"
    "         [--top-k K] [--top-p P] [--min-p P] [--repetition-penalty R] [--seed S]\n"
    "         [--stop STRING] [--threads N] [--json] [--logits] [--reference]\n"
    "         [--sparse | --exact-sparse]\n";

struct Options {
  std::string model, prompt;
  GenerateOptions gen;
  int threads = 1;
  bool json = false, logits = false, reference = false;
  bool sparse = false, exact_sparse = false;
};

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(Flags f, Flags::Parse(args,
                                         {"model", "prompt", "max-tokens", "temperature", "top-k",
                                          "top-p", "min-p", "repetition-penalty", "seed", "stop",
                                          "threads"},
                                         {"json", "logits", "reference", "sparse", "exact-sparse"}));
  Options o;
  ASSIGN_OR_RETURN(o.model, f.Required("model"));
  ASSIGN_OR_RETURN(o.prompt, f.Required("prompt"));
  ASSIGN_OR_RETURN(int64_t max_tokens, f.Int("max-tokens", 128));
  ASSIGN_OR_RETURN(double temperature, f.Double("temperature", 0));
  ASSIGN_OR_RETURN(int64_t top_k, f.Int("top-k", 0));
  ASSIGN_OR_RETURN(double top_p, f.Double("top-p", 1));
  ASSIGN_OR_RETURN(double min_p, f.Double("min-p", 0));
  ASSIGN_OR_RETURN(double rep, f.Double("repetition-penalty", 1));
  ASSIGN_OR_RETURN(int64_t threads, f.Int("threads", 1));
  if (max_tokens < 0 || max_tokens > (1 << 20)) return absl::InvalidArgumentError("--max-tokens out of range");
  if (threads < 1 || threads > 1024) return absl::InvalidArgumentError("--threads out of range");
  if (top_k < 0 || top_k > (1 << 24)) return absl::InvalidArgumentError("--top-k out of range");
  o.gen.max_new_tokens = static_cast<int>(max_tokens);
  o.gen.sampling.temperature = static_cast<float>(temperature);
  o.gen.sampling.top_k = static_cast<int>(top_k);
  o.gen.sampling.top_p = static_cast<float>(top_p);
  o.gen.sampling.min_p = static_cast<float>(min_p);
  o.gen.sampling.repetition_penalty = static_cast<float>(rep);
  if (f.Has("seed")) {
    ASSIGN_OR_RETURN(int64_t seed, f.Int("seed", 0));
    o.gen.sampling.seed = static_cast<uint64_t>(seed);
  }
  RETURN_IF_ERROR(o.gen.sampling.Validate());
  if (auto stop = f.Get("stop")) o.gen.stop.push_back(*stop);
  o.threads = static_cast<int>(threads);
  o.json = f.Has("json");
  o.logits = f.Has("logits");
  o.reference = f.Has("reference");
  o.sparse = f.Has("sparse");
  o.exact_sparse = f.Has("exact-sparse");
  if (o.sparse && o.exact_sparse) {
    return absl::InvalidArgumentError("--sparse and --exact-sparse exclude each other");
  }
  return o;
}

}  // namespace

int GenerateCommand(const std::vector<std::string>& args) {
  auto opts = ParseOptions(args);
  if (!opts.ok()) return UsageError(kUsage, opts.status());
  const Options& o = *opts;
  ThreadPool pool(o.threads);
  std::unique_ptr<CpuOps> ops = o.reference ? NewReferenceOps() : NewSimdOps(&pool);
  std::unique_ptr<Model> dense_model;
  std::unique_ptr<SparseSession> session;
  if (o.sparse || o.exact_sparse) {
    auto s = OpenSparseSession(o.model, o.sparse ? SparseMode::kPredicted : SparseMode::kExact,
                               *ops, [](const std::string& line) {
                                 std::fprintf(stderr, "%s\n", line.c_str());
                               });
    if (!s.ok()) return RuntimeError(s.status());
    session = std::move(*s);
  } else {
    auto model = LoadModel(o.model);
    if (!model.ok()) return RuntimeError(model.status());
    dense_model = std::move(*model);
  }
  const Model& m = session != nullptr ? session->model() : *dense_model;
  if (m.tokenizer == nullptr) return RuntimeError(absl::FailedPreconditionError("model has no tokenizer"));
  auto ids = m.tokenizer->Encode(o.prompt);
  if (!ids.ok()) return RuntimeError(ids.status());
  std::vector<int32_t> prompt;
  if (m.config.add_bos) prompt.push_back(m.config.bos_id);
  prompt.insert(prompt.end(), ids->begin(), ids->end());

  Transformer transformer(m, *ops);
  if (session != nullptr) transformer.set_ffn(session->ffn());
  std::vector<float> last_logits;
  auto on_token = [&](const GeneratedToken& t) {
    if (!o.json) {
      std::fwrite(t.text.data(), 1, t.text.size(), stdout);
      std::fflush(stdout);
    }
    return true;
  };
  auto result = Generate(transformer, *m.tokenizer, prompt, o.gen, on_token,
                         o.logits ? &last_logits : nullptr);
  if (!result.ok()) return RuntimeError(result.status());
  const double prompt_tps = prompt.size() / std::max(result->prompt_seconds, 1e-9);
  const double gen_tps = result->ids.size() / std::max(result->generation_seconds, 1e-9);
  if (o.json) {
    nlohmann::json j;
    j["prompt_ids"] = prompt;
    j["generated_ids"] = result->ids;
    j["text"] = result->text;
    j["finish_reason"] = FinishReasonName(result->finish);
    j["prompt_tokens_per_second"] = prompt_tps;
    j["generation_tokens_per_second"] = gen_tps;
    if (session != nullptr) j["ffn_sparsity"] = session->stats().Sparsity();
    if (o.logits) j["last_prompt_logits"] = last_logits;
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::fprintf(stdout, "\n");
    std::fprintf(stderr, "prompt: %zu tokens, %.1f tokens/s; generation: %zu tokens, %.1f tokens/s\n",
                 prompt.size(), prompt_tps, result->ids.size(), gen_tps);
  }
  return 0;
}

}  // namespace pinfer::cli
