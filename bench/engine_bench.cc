// Times pinfer's in-process engine exactly as bench/llama_cpp/bench.mjs times llama.cpp: prompt
// processing of the same deterministic token sequence, then greedy decoding, several repetitions.
// Prints one JSON object with the per-repetition tokens/s.
//
// usage: engine_bench MODEL PROMPT_TOKENS DECODE_TOKENS REPS THREADS
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "shared/engine/ops.h"
#include "shared/engine/transformer.h"
#include "shared/model/model.h"

int main(int argc, char** argv) {
  using namespace pinfer;
  using Clock = std::chrono::steady_clock;
  if (argc != 6) {
    std::fprintf(stderr, "usage: engine_bench MODEL PROMPT_TOKENS DECODE_TOKENS REPS THREADS\n");
    return 2;
  }
  const int prompt_n = std::atoi(argv[2]), decode_n = std::atoi(argv[3]), reps = std::atoi(argv[4]);
  auto model = LoadModel(argv[1]);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const ModelConfig& c = (*model)->config;
  std::vector<int32_t> prompt = {c.bos_id};
  for (int i = 1; i < prompt_n; ++i) prompt.push_back((i * 7919) % (c.vocab_size - 3) + 3);
  ThreadPool pool(std::atoi(argv[5]));
  auto ops = NewSimdOps(&pool);
  Transformer transformer(**model, *ops);
  std::vector<float> logits(c.vocab_size);
  nlohmann::json out;
  out["engine"] = std::string("pinfer (") + std::string(SimdLevel()) + ")";
  out["model"] = argv[1];
  for (int r = 0; r < reps; ++r) {
    KvCache cache(c, prompt_n + decode_n + 1);
    auto t0 = Clock::now();
    if (!transformer.Forward(prompt, 0, &cache, LogitsMode::kLast, logits.data()).ok()) return 1;
    auto t1 = Clock::now();
    out["prompt_tokens_per_second"].push_back(prompt_n / std::chrono::duration<double>(t1 - t0).count());
    int32_t token = prompt.back();
    t0 = Clock::now();
    for (int i = 0; i < decode_n; ++i) {
      if (!transformer.Forward({&token, 1}, prompt_n + i, &cache, LogitsMode::kLast, logits.data()).ok()) return 1;
      token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    }
    t1 = Clock::now();
    out["decode_tokens_per_second"].push_back(decode_n / std::chrono::duration<double>(t1 - t0).count());
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
