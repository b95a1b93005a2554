// The chat template engine against Hugging Face's own renderer: every template in templates/
// (real models' chat templates) rendered with every message set of cases.json must equal, byte for
// byte, what @huggingface/jinja rendered into expected.json (render_reference.mjs); where the
// reference raised, the engine must fail too, with the reference's raise_exception message. Then
// the engine's own errors: unsupported constructs and syntax errors name the line and the reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "shared/chat/template.h"

namespace pinfer::chat {
namespace {

using nlohmann::ordered_json;
using ::testing::HasSubstr;

const std::string kDir = std::string(PINFER_SOURCE_DIR) + "/tests/chat/";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

TEST(ChatTemplateReference, EveryTemplateMatchesHuggingFaceJinja) {
  const ordered_json cases = ordered_json::parse(ReadFile(kDir + "cases.json"));
  const ordered_json expected = ordered_json::parse(ReadFile(kDir + "expected.json"));
  ASSERT_GE(cases["templates"].size(), 12u);
  int compared = 0;
  ASSERT_GE(cases["snippets"].size(), 15u);
  const ordered_json snippet_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  // Real templates by file name, then the one-construct snippets ("snippet:NAME").
  for (const auto& [name, results] : expected.items()) {
    SCOPED_TRACE(name);
    const bool snippet = name.rfind("snippet:", 0) == 0;
    const std::string source = snippet ? cases["snippets"][name.substr(8)].get<std::string>()
                                       : ReadFile(kDir + "templates/" + name);
    const ordered_json& tokens = snippet ? snippet_tokens : cases["templates"].at(name);
    auto parsed = ChatTemplate::Parse(source);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    for (const auto& [key, result] : results.items()) {
      SCOPED_TRACE(key);
      const std::string set = key.substr(0, key.find('/'));
      ordered_json context = cases["context"];
      context["bos_token"] = tokens["bos_token"];
      context["eos_token"] = tokens["eos_token"];
      if (set == "tools") {
        context["messages"] = cases["tool_cases"]["messages"];
        context["tools"] = cases["tool_cases"]["tools"];
      } else {
        context["messages"] = cases["message_sets"].at(set);
      }
      context["add_generation_prompt"] = key.find("/with_") != std::string::npos;
      auto rendered = parsed->Render(context);
      if (result.contains("error")) {
        ASSERT_FALSE(rendered.ok()) << "the reference raised: " << result["error"];
        EXPECT_EQ(rendered.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(rendered.status().message()),
                    HasSubstr(result["error"].get<std::string>()));
      } else {
        ASSERT_TRUE(rendered.ok()) << rendered.status();
        EXPECT_EQ(*rendered, result["output"].get<std::string>());
      }
      ++compared;
    }
  }
  EXPECT_EQ(expected.size(), cases["templates"].size() + cases["snippets"].size());
  EXPECT_GE(compared, 240);
}

TEST(ChatTemplateErrors, RaiseExceptionSurfacesItsMessageAndLine) {
  auto parsed = ChatTemplate::Parse(
      "{% for m in messages %}\n{% if m.role == 'system' %}\n"
      "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  auto rendered = RenderChat(*parsed, {{"system", "x"}}, true, "<s>", "</s>");
  ASSERT_FALSE(rendered.ok());
  EXPECT_EQ(rendered.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rendered.status().message(),
            "chat template line 3: raise_exception: System role not supported");
}

TEST(ChatTemplateErrors, UnsupportedStatementNamesLineAndReason) {
  auto parsed = ChatTemplate::Parse("{{ bos_token }}\nhello\n{% include 'other.jinja' %}");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(parsed.status().message(), "chat template line 3: unsupported statement 'include'");
}

TEST(ChatTemplateErrors, UnsupportedFilterNamesLineAndReason) {
  auto parsed = ChatTemplate::Parse("a\n\n{{ messages | wordcount }}");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  auto rendered = RenderChat(*parsed, {{"user", "hi"}}, false, "", "");
  ASSERT_FALSE(rendered.ok());
  EXPECT_EQ(rendered.status().message(),
            "chat template line 3: unsupported filter 'wordcount' on a list");
}

TEST(ChatTemplateErrors, UnclosedBlockNamesWhereItOpened) {
  auto parsed = ChatTemplate::Parse("x\n{% for m in messages %}{{ m.content }}");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().message(), "chat template line 2: {% for %} is never closed");
}

TEST(ChatTemplateErrors, UnterminatedStringIsASyntaxError) {
  auto parsed = ChatTemplate::Parse("{{ 'abc }}");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("line 1: unterminated string"));
}

// The constructs the bundled templates lean on, each checked against the value Python Jinja and
// the reference agree on.
TEST(ChatTemplateSubset, NamespaceLoopAndFilters) {
  auto parsed = ChatTemplate::Parse(
      "{%- set ns = namespace(n=0, names=[]) -%}\n"
      "{%- for m in messages if m.role != 'system' -%}\n"
      "  {%- set ns.n = ns.n + 1 -%}\n"
      "  {{- loop.index0 }}:{{ m.content | upper }}{% if not loop.last %},{% endif -%}\n"
      "{%- endfor -%}\n"
      "|{{ ns.n }}|{{ messages | length }}|{{ messages[-1].content.split(' ')[1] }}"
      "|{{ 'a,b' .replace(',', '+') }}|{{ (messages | first).role }}|{{ x | default('dflt') }}"
      "|{{ messages[0] | tojson }}|{{ none is none }}|{{ 7 // 2 }}|{{ 'abc'[1:] }}");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  auto rendered = RenderChat(*parsed, {{"system", "s"}, {"user", "one two"}, {"assistant", "x y"}},
                             false, "", "");
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  EXPECT_EQ(*rendered,
            "0:ONE TWO,1:X Y|2|3|y|a+b|system|dflt|{\"role\": \"system\", \"content\": \"s\"}"
            "|true|3|bc");
}

}  // namespace
}  // namespace pinfer::chat
