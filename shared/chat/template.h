// The chat template engine: renders the Jinja templates that instruct models ship in their
// tokenizer_config.json or GGUF metadata (Llama-2/3, Mistral, ChatML/Qwen, Gemma, Phi, DeepSeek,
// Zephyr...) into the prompt text the model was trained on. No C++ Jinja library is packaged on
// Debian, so this is a focused one: the subset chat templates use, with Hugging Face's renderer
// (npm @huggingface/jinja, the reference its tests compare against byte for byte) as the definition
// of every corner case, including its whitespace handling (trim_blocks and lstrip_blocks on).
// Anything outside the subset is an error naming the template line and the reason, never a
// silently different prompt.
#ifndef PINFER_SHARED_CHAT_TEMPLATE_H_
#define PINFER_SHARED_CHAT_TEMPLATE_H_

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pinfer::chat {

struct ProgramNode;  // The parsed template, defined in template.cc.

// One parsed chat template. Parsing happens once (at model load); Render runs per request and is
// safe to call from several threads at once.
class ChatTemplate {
 public:
  // Parses `source`; a syntax error or an unsupported construct is InvalidArgument naming the
  // template line, e.g. "chat template line 3: unsupported statement 'include'".
  static absl::StatusOr<ChatTemplate> Parse(absl::string_view source);

  // Renders with `context` as the template's variables (messages, add_generation_prompt,
  // bos_token, eos_token, tools...; an object). Runtime errors, raise_exception included, are
  // InvalidArgument with the line and the message.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;

 private:
  explicit ChatTemplate(std::shared_ptr<const ProgramNode> program)
      : program_(std::move(program)) {}
  std::shared_ptr<const ProgramNode> program_;
};

// A chat's messages and the model's special tokens, rendered through `chat_template`: the usual
// Hugging Face apply_chat_template context (messages, add_generation_prompt, bos_token,
// eos_token).
struct ChatMessage {
  std::string role;
  std::string content;
};
absl::StatusOr<std::string> RenderChat(const ChatTemplate& chat_template,
                                       const std::vector<ChatMessage>& messages,
                                       bool add_generation_prompt, absl::string_view bos_token,
                                       absl::string_view eos_token);

}  // namespace pinfer::chat

#endif  // PINFER_SHARED_CHAT_TEMPLATE_H_
