// The Chat RPC end to end on the bundled model (relu-llama-tiny, which ships no chat template):
// with --chat-template, Chat's tokens equal Generate's on the prompt that Hugging Face's renderer
// (@huggingface/jinja, tests/chat/expected.json) makes of the same messages, so the service
// renders and tokenizes the chat as the reference does; without a template Chat answers
// FAILED_PRECONDITION naming the flag.
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/service/deployment.h"

namespace pinfer::testing {
namespace {

using ::testing::HasSubstr;

const std::string kTiny = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";
const std::string kChatDir = std::string(PINFER_SOURCE_DIR) + "/tests/chat/";
const std::string kTemplate = "chatml-openhermes-2.5-mistral-7b.jinja";

nlohmann::ordered_json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::ordered_json::parse(in);
}

GenerateResult RunChat(v1::Inference::Stub& stub, const v1::ChatRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  GenerateResult result;
  auto reader = stub.Chat(&ctx, req);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    ++result.messages;
    for (const auto& token : response.tokens()) {
      result.ids.push_back(token.id());
      result.text += token.text();
    }
    result.last = response;
  }
  result.status = reader->Finish();
  return result;
}

v1::ChatRequest ChatOf(const nlohmann::ordered_json& messages, int max_new_tokens) {
  v1::ChatRequest req;
  for (const auto& m : messages) {
    v1::ChatMessage* message = req.add_messages();
    message->set_role(m["role"].get<std::string>());
    message->set_content(m["content"].get<std::string>());
  }
  req.set_max_new_tokens(max_new_tokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  return req;
}

TEST(ChatServiceTest, ChatTokensEqualGenerateOnTheReferencePrompt) {
  DeploymentOptions o;
  o.model = kTiny;
  o.gpu_flags = {"--chat-template", kChatDir + "templates/" + kTemplate};
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  const auto cases = ReadJson(kChatDir + "cases.json");
  const auto expected = ReadJson(kChatDir + "expected.json");
  for (const std::string set : {"multi-turn", "single-user"}) {
    SCOPED_TRACE(set);
    const std::string prompt =
        expected[kTemplate][set + "/with_generation_prompt"]["output"].get<std::string>();
    v1::GenerateRequest greq;
    greq.set_prompt(prompt);
    greq.set_max_new_tokens(24);
    greq.mutable_sampling()->set_temperature(0);
    greq.set_ignore_eos(true);
    GenerateResult generated = RunGenerate(d.stub(), greq);
    ASSERT_TRUE(generated.status.ok()) << generated.status.error_message() << d.Logs();
    GenerateResult chat = RunChat(d.stub(), ChatOf(cases["message_sets"][set], 24));
    ASSERT_TRUE(chat.status.ok()) << chat.status.error_message() << d.Logs();
    ASSERT_EQ(chat.ids.size(), 24u);
    EXPECT_EQ(chat.ids, generated.ids);
    EXPECT_EQ(chat.text, generated.text);
    EXPECT_EQ(chat.last.usage().prompt_tokens(), generated.last.usage().prompt_tokens());
  }
}

TEST(ChatServiceTest, ModelWithoutTemplateAnswersFailedPreconditionNamingTheFlag) {
  DeploymentOptions o;
  o.model = kTiny;
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  GenerateResult chat = RunChat(
      d.stub(), ChatOf(nlohmann::ordered_json::parse(R"([{"role":"user","content":"Hi"}])"), 4));
  EXPECT_EQ(chat.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(chat.status.error_message(), HasSubstr("--chat-template FILE"));
  // Generate is unaffected.
  v1::GenerateRequest greq;
  greq.set_prompt("Hello");
  greq.set_max_new_tokens(4);
  EXPECT_TRUE(RunGenerate(d.stub(), greq).status.ok());
}

TEST(ChatServiceTest, TemplateThatDoesNotParseAnswersInvalidArgument) {
  const std::string bad = ::testing::TempDir() + "/broken.jinja";
  std::ofstream(bad) << "{% for m in messages %}\n{{ m.content }}";
  DeploymentOptions o;
  o.model = kTiny;
  o.gpu_flags = {"--chat-template", bad};
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  GenerateResult chat = RunChat(
      d.stub(), ChatOf(nlohmann::ordered_json::parse(R"([{"role":"user","content":"Hi"}])"), 4));
  EXPECT_EQ(chat.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(chat.status.error_message(),
              HasSubstr("chat template line 1: {% for %} is never closed"));
}

}  // namespace
}  // namespace pinfer::testing
