// `pinfer chat-template`: prints exactly the prompt a chat becomes under the model's chat template
// (or --template FILE), with no added newline, so that users can see what the model is sent and
// tests can compare it byte for byte.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "cli/flags.h"
#include "nlohmann/json.hpp"
#include "shared/chat/model_chat.h"
#include "shared/model/model.h"
#include "shared/util/status_macros.h"

namespace pinfer::cli {
namespace {

constexpr char kUsage[] =
    "usage: pinfer chat-template --model PATH [--template FILE] --messages FILE.json\n"
    "         [--no-generation-prompt]\n"
    "  FILE.json: [{\"role\": \"system\"|\"user\"|\"assistant\", \"content\": \"...\"}, ...]\n"
    "  (or an object with that list under \"messages\")\n";

absl::StatusOr<std::vector<chat::ChatMessage>> ReadMessages(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError("cannot read " + path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  nlohmann::json json = nlohmann::json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return absl::InvalidArgumentError(path + " is not JSON");
  if (json.is_object() && json.contains("messages")) json = json["messages"];
  if (!json.is_array()) return absl::InvalidArgumentError(path + ": expected a list of messages");
  std::vector<chat::ChatMessage> messages;
  for (const auto& m : json) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string()) {
      return absl::InvalidArgumentError(path + ": each message needs string role and content");
    }
    messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return messages;
}

}  // namespace

int ChatTemplateCommand(const std::vector<std::string>& args) {
  auto flags = Flags::Parse(args, {"model", "template", "messages"}, {"no-generation-prompt"});
  if (!flags.ok()) return UsageError(kUsage, flags.status());
  auto model_path = flags->Required("model");
  if (!model_path.ok()) return UsageError(kUsage, model_path.status());
  auto messages_path = flags->Required("messages");
  if (!messages_path.ok()) return UsageError(kUsage, messages_path.status());
  auto messages = ReadMessages(*messages_path);
  if (!messages.ok()) return RuntimeError(messages.status());
  auto model = LoadModel(*model_path);
  if (!model.ok()) return RuntimeError(model.status());
  auto chat = chat::LoadModelChat(**model, flags->Get("template").value_or(""));
  if (!chat.ok()) return RuntimeError(chat.status());
  auto prompt = chat::RenderChatPrompt(*chat, *messages, !flags->Has("no-generation-prompt"));
  if (!prompt.ok()) return RuntimeError(prompt.status());
  std::fwrite(prompt->data(), 1, prompt->size(), stdout);
  std::fflush(stdout);
  return 0;
}

}  // namespace pinfer::cli
