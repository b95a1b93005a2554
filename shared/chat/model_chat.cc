// Finds a model's chat template and special tokens, and turns a chat into prompt ids (see
// model_chat.h).
#include "shared/chat/model_chat.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "shared/model/gguf.h"
#include "shared/util/status_macros.h"

namespace pinfer::chat {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// A special token's text in tokenizer_config.json: a string, or {"content": "..."}.
std::string TokenContent(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    return value["content"].get<std::string>();
  }
  return "";
}

void AddSpecial(ModelChat& chat, std::string text, int32_t id) {
  if (text.empty()) return;
  for (const auto& [t, i] : chat.special_tokens) {
    if (t == text) return;
  }
  chat.special_tokens.emplace_back(std::move(text), id);
}

absl::Status LoadGguf(const Model& model, ModelChat& chat, std::optional<std::string>& source) {
  ASSIGN_OR_RETURN(auto gguf, GgufFile::Open(model.source_path, {kGgufMagic, kPowerInferMagic}));
  if (gguf->HasKey("tokenizer.chat_template")) {
    ASSIGN_OR_RETURN(source, gguf->GetString("tokenizer.chat_template"));
    chat.template_origin = absl::StrCat(model.source_path, " (tokenizer.chat_template)");
  }
  if (!gguf->HasKey("tokenizer.ggml.tokens")) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<std::string> tokens, gguf->GetStringArray("tokenizer.ggml.tokens"));
  std::vector<int32_t> types;
  if (gguf->HasKey("tokenizer.ggml.token_type")) {
    ASSIGN_OR_RETURN(types, gguf->GetI32Array("tokenizer.ggml.token_type"));
  }
  const int32_t n = static_cast<int32_t>(tokens.size());
  const ModelConfig& c = model.config;
  if (c.bos_id >= 0 && c.bos_id < n) chat.bos_token = tokens[c.bos_id];
  if (c.eos_id >= 0 && c.eos_id < n) chat.eos_token = tokens[c.eos_id];
  for (int32_t id = 0; id < n && id < static_cast<int32_t>(types.size()); ++id) {
    if (types[id] == 3 || types[id] == 4)
      AddSpecial(chat, tokens[id], id);  // control, user-defined
  }
  return absl::OkStatus();
}

absl::Status LoadHuggingFace(const Model& model, ModelChat& chat,
                             std::optional<std::string>& source) {
  const fs::path dir = model.source_path;
  nlohmann::json config;
  if (fs::exists(dir / "tokenizer_config.json")) {
    ASSIGN_OR_RETURN(std::string text, ReadText(dir / "tokenizer_config.json"));
    config = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir.string(), "/tokenizer_config.json is not JSON"));
    }
  }
  if (fs::exists(dir / "chat_template.jinja")) {
    ASSIGN_OR_RETURN(source, ReadText(dir / "chat_template.jinja"));
    chat.template_origin = (dir / "chat_template.jinja").string();
  } else if (config.contains("chat_template")) {
    const nlohmann::json& t = config["chat_template"];
    if (t.is_string()) {
      source = t.get<std::string>();
    } else if (t.is_array()) {
      for (const auto& named : t) {
        if (named.contains("name") && named["name"] == "default" && named.contains("template") &&
            named["template"].is_string()) {
          source = named["template"].get<std::string>();
        }
      }
    }
    if (source) chat.template_origin = (dir / "tokenizer_config.json").string();
  }
  if (config.contains("bos_token")) chat.bos_token = TokenContent(config["bos_token"]);
  if (config.contains("eos_token")) chat.eos_token = TokenContent(config["eos_token"]);
  if (config.contains("added_tokens_decoder") && config["added_tokens_decoder"].is_object()) {
    for (const auto& [id, token] : config["added_tokens_decoder"].items()) {
      AddSpecial(chat, TokenContent(token), static_cast<int32_t>(std::stol(id)));
    }
  }
  if (fs::exists(dir / "tokenizer.json")) {
    ASSIGN_OR_RETURN(std::string text, ReadText(dir / "tokenizer.json"));
    const nlohmann::json tokenizer = nlohmann::json::parse(text, nullptr, false);
    if (!tokenizer.is_discarded() && tokenizer.contains("added_tokens") &&
        tokenizer["added_tokens"].is_array()) {
      for (const auto& token : tokenizer["added_tokens"]) {
        if (token.contains("id") && token["id"].is_number_integer()) {
          AddSpecial(chat, TokenContent(token), token["id"].get<int32_t>());
        }
      }
    }
  }
  // A tokenizer.model-only folder names no added tokens; BOS and EOS are still special.
  AddSpecial(chat, chat.bos_token, model.config.bos_id);
  AddSpecial(chat, chat.eos_token, model.config.eos_id);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelChat> LoadModelChat(const Model& model, const std::string& template_file) {
  ModelChat chat;
  std::optional<std::string> source;
  if (model.format == "gguf") {
    RETURN_IF_ERROR(LoadGguf(model, chat, source));
  } else {
    RETURN_IF_ERROR(LoadHuggingFace(model, chat, source));
  }
  if (!template_file.empty()) {
    ASSIGN_OR_RETURN(source, ReadText(template_file));
    chat.template_origin = template_file;
  }
  std::stable_sort(chat.special_tokens.begin(), chat.special_tokens.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  if (source) {
    auto parsed = ChatTemplate::Parse(*source);
    if (parsed.ok()) {
      chat.chat_template = std::move(*parsed);
    } else {
      chat.template_error = absl::InvalidArgumentError(
          absl::StrCat(chat.template_origin, ": ", parsed.status().message()));
    }
  }
  return chat;
}

absl::StatusOr<std::string> RenderChatPrompt(const ModelChat& chat,
                                             const std::vector<ChatMessage>& messages,
                                             bool add_generation_prompt) {
  if (!chat.template_error.ok()) return chat.template_error;
  if (!chat.chat_template) {
    return absl::FailedPreconditionError(
        "the model has no chat template; pass one with --chat-template FILE (pinfer serve) "
        "or --template FILE (pinfer chat-template)");
  }
  return RenderChat(*chat.chat_template, messages, add_generation_prompt, chat.bos_token,
                    chat.eos_token);
}

absl::StatusOr<std::vector<int32_t>> EncodeChatPrompt(const ModelChat& chat, const Model& model,
                                                      const std::string& prompt) {
  if (model.tokenizer == nullptr)
    return absl::FailedPreconditionError("the model has no tokenizer");
  std::vector<int32_t> ids;
  size_t text_start = 0;
  auto flush = [&](size_t end) -> absl::Status {
    if (end > text_start) {
      ASSIGN_OR_RETURN(std::vector<int32_t> piece,
                       model.tokenizer->Encode(prompt.substr(text_start, end - text_start)));
      ids.insert(ids.end(), piece.begin(), piece.end());
    }
    return absl::OkStatus();
  };
  for (size_t pos = 0; pos < prompt.size();) {
    const std::pair<std::string, int32_t>* hit = nullptr;
    for (const auto& special : chat.special_tokens) {  // longest first
      if (prompt.compare(pos, special.first.size(), special.first) == 0) {
        hit = &special;
        break;
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    RETURN_IF_ERROR(flush(pos));
    ids.push_back(hit->second);
    pos += hit->first.size();
    text_start = pos;
  }
  RETURN_IF_ERROR(flush(prompt.size()));
  if (model.config.add_bos && (ids.empty() || ids.front() != model.config.bos_id)) {
    ids.insert(ids.begin(), model.config.bos_id);
  }
  return ids;
}

}  // namespace pinfer::chat
