// `pinfer convert`: a Hugging Face LlamaForCausalLM directory to a GGUF v3 `llama` file that
// pinfer and llama.cpp both load (ConvertHuggingFaceToGguf), or a GGUF file to another weight type
// (ConvertGgufToGguf, like llama-quantize).
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "cli/flags.h"
#include "shared/model/gguf.h"

namespace pinfer::cli {
namespace {

constexpr char kUsage[] =
    "usage: pinfer convert --model HF_DIR|FILE.gguf --out FILE.gguf\n"
    "         [--type f16|q8_0|q4_0|f32|q4_k_m|q4_k_s|q5_k_m|q5_k_s|q6_k] [--name NAME]\n"
    "  The K types are llama.cpp's mixes: the per-tensor types and blocks of its `quantize`.\n";

}  // namespace

int ConvertCommand(const std::vector<std::string>& args) {
  auto flags = Flags::Parse(args, {"model", "out", "type", "name"}, {});
  if (!flags.ok()) return UsageError(kUsage, flags.status());
  auto model = flags->Required("model");
  auto out = flags->Required("out");
  for (const absl::Status& st : {model.status(), out.status()}) {
    if (!st.ok()) return UsageError(kUsage, st);
  }
  GgufConvertOptions opts;
  const std::string type = flags->Get("type").value_or("f16");
  if (absl::Status st = ParseConvertType(type, &opts); !st.ok()) return UsageError(kUsage, st);
  opts.name = flags->Get("name").value_or("");
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  absl::Status st = std::filesystem::is_regular_file(*model, ec)
                        ? ConvertGgufToGguf(*model, *out, opts)
                        : ConvertHuggingFaceToGguf(*model, *out, opts);
  if (!st.ok()) return RuntimeError(st);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "wrote %s (%s) in %.1f s\n", out->c_str(), type.c_str(), s);
  return 0;
}

}  // namespace pinfer::cli
