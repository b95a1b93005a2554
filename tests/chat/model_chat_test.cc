// A model's chat setup: where the template is found (tokenizer_config.json's string and
// list-of-named-templates forms, chat_template.jinja, the override file), the special tokens, and
// how a rendered prompt becomes ids (special-token strings as their ids, BOS once).
#include "shared/chat/model_chat.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "shared/model/gguf.h"

namespace pinfer::chat {
namespace {

using ::testing::HasSubstr;

const std::string kTiny = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";

std::unique_ptr<Model> Tiny() {
  auto model = LoadModel(kTiny);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

TEST(ModelChat, BundledModelHasNoTemplateButKnowsItsSpecialTokens) {
  auto model = Tiny();
  ASSERT_NE(model, nullptr);
  auto chat = LoadModelChat(*model, "");
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_FALSE(chat->chat_template.has_value());
  EXPECT_EQ(chat->bos_token, "<s>");
  EXPECT_EQ(chat->eos_token, "</s>");
  auto prompt = RenderChatPrompt(*chat, {{"user", "hi"}}, true);
  EXPECT_EQ(prompt.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(prompt.status().message()), HasSubstr("--chat-template FILE"));
}

TEST(ModelChat, SpecialTokenStringsBecomeTheirIdsAndBosIsNotDoubled) {
  auto model = Tiny();
  ASSERT_NE(model, nullptr);
  auto chat = LoadModelChat(*model, "");
  ASSERT_TRUE(chat.ok()) << chat.status();
  auto hello = model->tokenizer->Encode("Hello");
  auto there = model->tokenizer->Encode(" there");
  ASSERT_TRUE(hello.ok() && there.ok());
  // Starts with BOS already: no second one; </s> in the middle is the EOS token, not text.
  auto ids = EncodeChatPrompt(*chat, *model, "<s>Hello</s> there");
  ASSERT_TRUE(ids.ok()) << ids.status();
  std::vector<int32_t> want = {model->config.bos_id};
  want.insert(want.end(), hello->begin(), hello->end());
  want.push_back(model->config.eos_id);
  want.insert(want.end(), there->begin(), there->end());
  EXPECT_EQ(*ids, want);
  // Plain text: BOS prepended, as Generate does.
  auto plain = EncodeChatPrompt(*chat, *model, "Hello");
  ASSERT_TRUE(plain.ok());
  std::vector<int32_t> want_plain = {model->config.bos_id};
  want_plain.insert(want_plain.end(), hello->begin(), hello->end());
  EXPECT_EQ(*plain, want_plain);
}

TEST(ModelChat, GgufTemplateAndControlTokens) {
  GgufWriter writer;
  writer.SetString("general.architecture", "llama");
  writer.SetStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "<|im_start|>", "a"});
  writer.SetI32Array("tokenizer.ggml.token_type", {2, 3, 3, 4, 1});
  writer.SetString("tokenizer.chat_template",
                   "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.content }}"
                   "{{ eos_token }}{% endfor %}");
  const std::string path = ::testing::TempDir() + "/chat-template.gguf";
  ASSERT_TRUE(writer.WriteFile(path).ok());
  Model model;
  model.source_path = path;
  model.format = "gguf";
  model.config.bos_id = 1;
  model.config.eos_id = 2;
  auto chat = LoadModelChat(model, "");
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->template_origin, path + " (tokenizer.chat_template)");
  auto prompt = RenderChatPrompt(*chat, {{"user", "hi"}}, true);
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(*prompt, "<s><|im_start|>hi</s>");
  // Control (3) and user-defined (4) tokens are special, longest first; normal ones are not.
  std::vector<std::pair<std::string, int32_t>> want = {
      {"<|im_start|>", 3}, {"</s>", 2}, {"<s>", 1}};
  EXPECT_EQ(chat->special_tokens, want);
}

// `pinfer convert` (and the prepared models serve --sparse makes) keep a Hugging Face folder's
// chat_template.jinja as the GGUF's tokenizer.chat_template, which the gpu-worker then finds.
TEST(ModelChat, ConvertedModelKeepsTheFoldersTemplate) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "tiny-with-template";
  std::filesystem::create_directories(dir);
  for (const auto& entry : std::filesystem::directory_iterator(kTiny)) {
    std::filesystem::copy_file(entry.path(), dir / entry.path().filename(),
                               std::filesystem::copy_options::overwrite_existing);
  }
  const std::string source = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}";
  std::ofstream(dir / "chat_template.jinja") << source;
  const std::string gguf = (dir / "converted.gguf").string();
  GgufConvertOptions options;
  ASSERT_TRUE(ConvertHuggingFaceToGguf(dir.string(), gguf, options).ok());
  auto model = LoadModel(gguf);
  ASSERT_TRUE(model.ok()) << model.status();
  auto chat = LoadModelChat(**model, "");
  ASSERT_TRUE(chat.ok()) << chat.status();
  auto prompt = RenderChatPrompt(*chat, {{"user", "hi"}}, true);
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(*prompt, "[user] hi\n");
  EXPECT_EQ(chat->bos_token, "<s>");
  EXPECT_EQ(chat->eos_token, "</s>");
}

class TemplateFolder : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::create_directories(dir_);
    model_.source_path = dir_.string();
    model_.format = "huggingface";
  }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  std::string Render(const std::string& override_file = "") {
    auto chat = LoadModelChat(model_, override_file);
    EXPECT_TRUE(chat.ok()) << chat.status();
    if (!chat.ok()) return "";
    auto prompt = RenderChatPrompt(*chat, {{"user", "hi"}}, false);
    EXPECT_TRUE(prompt.ok()) << prompt.status();
    return prompt.ok() ? *prompt : "";
  }
  std::filesystem::path dir_;
  Model model_;
};

TEST_F(TemplateFolder, TokenizerConfigStringTemplateWithItsTokens) {
  Write("tokenizer_config.json",
        R"({"bos_token": {"content": "<B>"}, "eos_token": "<E>",
            "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"})");
  EXPECT_EQ(Render(), "<B>hi<E>");
}

TEST_F(TemplateFolder, NamedTemplateListTakesDefault) {
  Write("tokenizer_config.json",
        R"({"chat_template": [{"name": "tool_use", "template": "tools"},
                              {"name": "default", "template": "default:{{ messages[0].content }}"}]})");
  EXPECT_EQ(Render(), "default:hi");
}

// Entries of the wrong shape are skipped, not thrown on (nlohmann's value() would throw).
TEST_F(TemplateFolder, NamedTemplateListSkipsMalformedEntries) {
  Write("tokenizer_config.json",
        R"({"chat_template": [7, {"name": 3, "template": "x"}, "s",
                              {"name": "default", "template": "default:{{ messages[0].content }}"}]})");
  EXPECT_EQ(Render(), "default:hi");
}

TEST_F(TemplateFolder, ChatTemplateJinjaBeatsConfigAndFileBeatsBoth) {
  Write("tokenizer_config.json", R"({"chat_template": "config"})");
  Write("chat_template.jinja", "jinja file");
  EXPECT_EQ(Render(), "jinja file");
  Write("override.jinja", "override");
  EXPECT_EQ(Render((dir_ / "override.jinja").string()), "override");
}

TEST_F(TemplateFolder, UnparsableTemplateIsKeptAsTheError) {
  Write("chat_template.jinja", "{% if x %}never closed");
  auto chat = LoadModelChat(model_, "");
  ASSERT_TRUE(chat.ok()) << chat.status();
  auto prompt = RenderChatPrompt(*chat, {{"user", "hi"}}, false);
  EXPECT_EQ(prompt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(prompt.status().message()),
              HasSubstr("chat_template.jinja: chat template line 1: {% if %} is never closed"));
}

TEST_F(TemplateFolder, MissingOverrideFileIsAnError) {
  auto chat = LoadModelChat(model_, (dir_ / "absent.jinja").string());
  EXPECT_EQ(chat.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pinfer::chat
