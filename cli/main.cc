// pinfer: the command-line tool. Subcommands run the engine in-process (generate, perplexity),
// convert and prepare model files, and start the service (serve).
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace {

constexpr char kUsage[] =
    "usage: pinfer <command> [flags]\n"
    "commands:\n"
    "  generate    --model PATH --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K]\n"
    "              [--top-p P] [--min-p P] [--repetition-penalty R] [--seed S] [--stop S]\n"
    "              [--threads N] [--json] [--logits] [--reference] [--sparse|--exact-sparse]\n"
    "  perplexity  --model PATH --tokens FILE.u32 --window W [--threads N] [--json]\n"
    "              [--sparse|--exact-sparse]\n"
    "  prepare     --model PATH --calibration TEXT --out FILE.gguf [--vram-budget SIZE]\n"
    "              [--context N] [--target-recall R] [--report FILE.svg] (predictors, placement)\n"
    "  convert     --model HF_DIR|FILE.gguf --out FILE.gguf [--name N]\n"
    "              [--type f16|q8_0|q4_0|f32|q4_k_m|q4_k_s|q5_k_m|q5_k_s|q6_k]\n"
    "  serve       --model PATH [--port P] [--metrics-port M] [--threads N] [--cpu-threads N]\n"
    "              [--hot-fraction F] (gateway + gpu-worker + cpu-worker; --help for more)\n"
    "  chat-template --model PATH --messages FILE.json [--template FILE]\n"
    "              [--no-generation-prompt] (prints the chat's rendered prompt)\n";

}  // namespace

int main(int argc, char** argv) {
  using Command = std::function<int(const std::vector<std::string>&)>;
  const std::map<std::string, Command> commands = {
      {"generate", pinfer::cli::GenerateCommand},
      {"perplexity", pinfer::cli::PerplexityCommand},
      {"prepare", pinfer::cli::PrepareCommand},
      {"convert", pinfer::cli::ConvertCommand},
      {"serve", pinfer::cli::ServeCommand},
      {"chat-template", pinfer::cli::ChatTemplateCommand},
  };
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  auto it = commands.find(name);
  if (it == commands.end()) {
    std::fprintf(stderr, "pinfer: unknown command '%s'\n%s", name.c_str(), kUsage);
    return 2;
  }
  return it->second(std::vector<std::string>(argv + 2, argv + argc));
}
