// A model's chat setup: where its chat template comes from, the special tokens the template may
// write, and how a chat becomes prompt token ids. The template is, in order of preference, the
// --chat-template file, a GGUF file's `tokenizer.chat_template`, a Hugging Face folder's
// chat_template.jinja, or the `chat_template` of its tokenizer_config.json (a string, or the list
// of named templates, of which "default" is taken). bos_token and eos_token are the strings of the
// tokenizer's BOS and EOS tokens. A template that fails to parse is kept as the error, so that
// loading only warns and every chat request answers it (InvalidArgument).
#ifndef PINFER_SHARED_CHAT_MODEL_CHAT_H_
#define PINFER_SHARED_CHAT_MODEL_CHAT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shared/chat/template.h"
#include "shared/model/model.h"

namespace pinfer::chat {

struct ModelChat {
  std::optional<ChatTemplate> chat_template;
  absl::Status template_error;  // the parse error when the found template did not parse
  std::string template_origin;  // where it came from ("" when the model has none)
  std::string bos_token, eos_token;
  // Strings the tokenizer maps to one special token each (control and added tokens), longest
  // first, so that a rendered "<|im_start|>" becomes its token rather than text.
  std::vector<std::pair<std::string, int32_t>> special_tokens;
};

// Reads the chat setup of `model` (its source_path and format); `template_file` (may be empty)
// overrides the model's own template. Fails only when `template_file` cannot be read or the
// model's tokenizer files are malformed; a missing template is not an error here.
absl::StatusOr<ModelChat> LoadModelChat(const Model& model, const std::string& template_file);

// The rendered prompt. FailedPrecondition (naming --chat-template) when there is no template;
// InvalidArgument for a template that did not parse or failed while rendering.
absl::StatusOr<std::string> RenderChatPrompt(const ModelChat& chat,
                                             const std::vector<ChatMessage>& messages,
                                             bool add_generation_prompt);

// Token ids of a rendered prompt: special-token strings become their ids, the text between them
// goes through the tokenizer, and BOS is prepended when the model adds BOS and the text does not
// already start with it.
absl::StatusOr<std::vector<int32_t>> EncodeChatPrompt(const ModelChat& chat, const Model& model,
                                                      const std::string& prompt);

}  // namespace pinfer::chat

#endif  // PINFER_SHARED_CHAT_MODEL_CHAT_H_
