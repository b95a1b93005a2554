// `pinfer chat-template` end to end: the bundled model (no template of its own) with --template
// prints exactly the prompt @huggingface/jinja rendered into expected.json (no added newline),
// honours --no-generation-prompt, and without a template fails naming the flag.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace {

using nlohmann::ordered_json;
using ::testing::HasSubstr;

const std::string kDir = std::string(PINFER_SOURCE_DIR) + "/tests/chat/";
const std::string kModel = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

struct CliRun {
  int exit_code;
  std::string out;
};

CliRun RunPinfer(const std::string& args) {
  const std::string command = std::string(PINFER_CLI) + " " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  CliRun run{-1, ""};
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) run.out.append(buffer, n);
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

std::string WriteMessages(const std::string& set) {
  const ordered_json cases = ordered_json::parse(ReadFile(kDir + "cases.json"));
  const std::string path = testing::TempDir() + "/messages-" + set + ".json";
  std::ofstream(path) << cases["message_sets"][set].dump();
  return path;
}

TEST(ChatTemplateCli, PrintsTheReferencePromptExactly) {
  const ordered_json expected = ordered_json::parse(ReadFile(kDir + "expected.json"));
  const std::string name = "chatml-openhermes-2.5-mistral-7b.jinja";
  const std::string messages = WriteMessages("multi-turn");
  const std::string base = "chat-template --model " + kModel + " --template " + kDir +
                           "templates/" + name + " --messages " + messages;
  CliRun with = RunPinfer(base);
  ASSERT_EQ(with.exit_code, 0) << with.out;
  EXPECT_EQ(with.out,
            expected[name]["multi-turn/with_generation_prompt"]["output"].get<std::string>());
  CliRun without = RunPinfer(base + " --no-generation-prompt");
  ASSERT_EQ(without.exit_code, 0) << without.out;
  EXPECT_EQ(without.out,
            expected[name]["multi-turn/without_generation_prompt"]["output"].get<std::string>());
  EXPECT_NE(with.out, without.out);
}

TEST(ChatTemplateCli, ModelWithoutTemplateNamesTheFlag) {
  CliRun run =
      RunPinfer("chat-template --model " + kModel + " --messages " + WriteMessages("single-user"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_THAT(run.out, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_THAT(run.out, HasSubstr("--template FILE"));
}

TEST(ChatTemplateCli, TemplateErrorNamesLine) {
  const std::string bad = testing::TempDir() + "/bad.jinja";
  std::ofstream(bad) << "{{ bos_token }}\n{% include 'x' %}";
  CliRun run = RunPinfer("chat-template --model " + kModel + " --template " + bad + " --messages " +
                         WriteMessages("single-user"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_THAT(run.out,
              HasSubstr("bad.jinja: chat template line 2: unsupported statement 'include'"));
}

TEST(ChatTemplateCli, MissingMessagesIsAUsageError) {
  CliRun run = RunPinfer("chat-template --model " + kModel);
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.out, HasSubstr("usage: pinfer chat-template"));
}

}  // namespace
