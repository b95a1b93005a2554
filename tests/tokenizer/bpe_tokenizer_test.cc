// Byte-level BPE on its own: the pre-tokenizer splits, the GPT-2 byte map, merge order, special
// and user-defined tokens, and the tokenizer.json loader with its errors. The vocabularies here
// are tiny and hand-made; every expected result was derived by hand from the regex, GPT-2's
// bytes_to_unicode table and the BPE rule (lowest rank first, leftmost on ties), not from running
// this code. The full Llama-3 vocabulary is checked against llama.cpp in llama3_vocab_test.
#include "shared/tokenizer/bpe_tokenizer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shared/tokenizer/tokenizer.h"

namespace pinfer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> Split(absl::string_view text, absl::string_view pre) {
  auto r = SplitPreTokens(text, pre);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<std::string>{};
}

// ----- Llama-3 regex -----

TEST(Llama3PreTokenizerTest, WordsTakeOneLeadingNonLetter) {
  EXPECT_THAT(Split("Hello world", "llama-bpe"), ElementsAre("Hello", " world"));
  EXPECT_THAT(Split("\ttabbed\ttext", "llama-bpe"), ElementsAre("\ttabbed", "\ttext"));
  EXPECT_THAT(Split("snake_case", "llama-bpe"), ElementsAre("snake", "_case"));
}

TEST(Llama3PreTokenizerTest, WhitespaceRunGivesLastCharToNextWord) {
  // `\s+(?!\S)`: the run stops one short of a following non-space.
  EXPECT_THAT(Split("Hello  world", "llama-bpe"), ElementsAre("Hello", " ", " world"));
  EXPECT_THAT(Split("   leading spaces", "llama-bpe"), ElementsAre("  ", " leading", " spaces"));
  EXPECT_THAT(Split("a \t b", "llama-bpe"), ElementsAre("a", " \t", " b"));
  // A single space before a digit cannot join it: `\s+` takes it alone.
  EXPECT_THAT(Split("year 2026", "llama-bpe"), ElementsAre("year", " ", "202", "6"));
}

TEST(Llama3PreTokenizerTest, TrailingWhitespaceStaysWhole) {
  EXPECT_THAT(Split("trailing spaces   ", "llama-bpe"), ElementsAre("trailing", " spaces", "   "));
  EXPECT_THAT(Split(" ", "llama-bpe"), ElementsAre(" "));
  EXPECT_THAT(Split("   ", "llama-bpe"), ElementsAre("   "));
}

TEST(Llama3PreTokenizerTest, NewlinesEndAtTheLastLineBreak) {
  EXPECT_THAT(Split("line one\nline two\n\nline four", "llama-bpe"),
              ElementsAre("line", " one", "\n", "line", " two", "\n\n", "line", " four"));
  // `\s*[\r\n]+` takes spaces before the break; the spaces after it follow the `\s+(?!\S)` rule.
  EXPECT_THAT(Split("x  \n  y", "llama-bpe"), ElementsAre("x", "  \n", " ", " y"));
  EXPECT_THAT(Split("\t\n", "llama-bpe"), ElementsAre("\t\n"));
  EXPECT_THAT(Split("a\r\n", "llama-bpe"), ElementsAre("a", "\r\n"));
  // Punctuation keeps the line breaks that follow it.
  EXPECT_THAT(Split("!!!\n\nabc", "llama-bpe"), ElementsAre("!!!\n\n", "abc"));
}

TEST(Llama3PreTokenizerTest, DigitsInGroupsOfThree) {
  EXPECT_THAT(Split("1234567", "llama-bpe"), ElementsAre("123", "456", "7"));
  EXPECT_THAT(Split("3.14159", "llama-bpe"), ElementsAre("3", ".", "141", "59"));
}

TEST(Llama3PreTokenizerTest, ContractionsAreCaseInsensitive) {
  EXPECT_THAT(Split("don't", "llama-bpe"), ElementsAre("don", "'t"));
  EXPECT_THAT(Split("I'VE", "llama-bpe"), ElementsAre("I", "'VE"));
  EXPECT_THAT(Split("we'Ll", "llama-bpe"), ElementsAre("we", "'Ll"));
  EXPECT_THAT(Split("'sup", "llama-bpe"), ElementsAre("'s", "up"));
  // U+017F (long s) case-folds to 's' but llama.cpp compares lower-cased ASCII only.
  EXPECT_THAT(Split("'\xC5\xBF", "llama-bpe"), ElementsAre("'\xC5\xBF"));
}

TEST(Llama3PreTokenizerTest, UnicodeClasses) {
  // U+00A0 is whitespace for llama.cpp (not for RE2's ASCII \s) and not \r\n: it leads a word.
  EXPECT_THAT(Split("a\xC2\xA0"
                    "b",
                    "llama-bpe"),
              ElementsAre("a",
                          "\xC2\xA0"
                          "b"));
  // U+3000 ideographic space between words: same rule.
  EXPECT_THAT(Split("x\xE3\x80\x80\xE3\x80\x80y", "llama-bpe"),
              ElementsAre("x", "\xE3\x80\x80", "\xE3\x80\x80y"));
  // A combining accent (U+0301, category Mn) is no letter: it leads the next letters.
  EXPECT_THAT(Split("e\xCC\x81t", "llama-bpe"), ElementsAre("e", "\xCC\x81t"));
  // Cyrillic letters; emoji are symbols.
  EXPECT_THAT(Split("\xD0\xBC\xD0\xB8\xD1\x80!", "llama-bpe"),
              ElementsAre("\xD0\xBC\xD0\xB8\xD1\x80", "!"));
  EXPECT_THAT(Split("\xF0\x9F\x9A\x80 x", "llama-bpe"), ElementsAre("\xF0\x9F\x9A\x80", " x"));
  // Superscript two (U+00B2) is \p{N}.
  EXPECT_THAT(Split("x\xC2\xB2\xC2\xB2\xC2\xB2\xC2\xB2", "llama-bpe"),
              ElementsAre("x", "\xC2\xB2\xC2\xB2\xC2\xB2", "\xC2\xB2"));
}

TEST(Llama3PreTokenizerTest, InvalidUtf8BecomesReplacementCharacter) {
  EXPECT_THAT(Split("ab\xFF"
                    "cd",
                    "llama-bpe"),
              ElementsAre("ab",
                          "\xEF\xBF\xBD"
                          "cd"));
  // A truncated sequence at the end.
  EXPECT_THAT(Split("ab\xE3\x80", "llama-bpe"), ElementsAre("ab", "\xEF\xBF\xBD\xEF\xBF\xBD"));
}

// ----- GPT-2 regex -----

TEST(Gpt2PreTokenizerTest, Splits) {
  EXPECT_THAT(Split("Hello  world", "gpt2"), ElementsAre("Hello", " ", " world"));
  EXPECT_THAT(Split(" 1234567", "gpt2"), ElementsAre(" 1234567"));
  EXPECT_THAT(Split("don't", "gpt2"), ElementsAre("don", "'t"));
  // Case-sensitive contractions.
  EXPECT_THAT(Split("DON'T", "gpt2"), ElementsAre("DON", "'", "T"));
  // No newline rule: "\n\n" before a word gives back its last newline, which stands alone.
  EXPECT_THAT(Split("a\n\nb", "gpt2"), ElementsAre("a", "\n", "\n", "b"));
  EXPECT_THAT(Split("foo  ", "gpt2"), ElementsAre("foo", "  "));
  EXPECT_THAT(Split("\ttab", "gpt2"), ElementsAre("\t", "tab"));
}

TEST(PreTokenizerTest, UnknownNameIsAnError) {
  auto r = SplitPreTokens("x", "deepseek-coder");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("unsupported byte-level BPE pre-tokenizer"));
}

// ----- BPE on hand-made vocabularies -----

// Byte characters used below (GPT-2 bytes_to_unicode): ' ' -> U+0120 "Ġ", '\n' -> U+010A "Ċ",
// 0xAD -> U+0143 "Ń" (the last shifted byte), 0xC3 -> "Ã", 0xA9 -> "©" (printable, unshifted).
constexpr char kSpaceChar[] = "\xC4\xA0";
constexpr char kNewlineChar[] = "\xC4\x8A";

struct Vocab {
  std::vector<std::string> tokens;
  std::vector<std::string> merges;
  std::vector<int32_t> types;
  int Add(const std::string& t, int32_t type = 1) {
    tokens.push_back(t);
    types.push_back(type);
    return static_cast<int>(tokens.size()) - 1;
  }
  std::unique_ptr<Tokenizer> Build(absl::string_view pre = "llama-bpe") const {
    auto t = NewByteLevelBpeTokenizer(tokens, merges, types, pre);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }
};

std::vector<int32_t> Enc(const Tokenizer& t, absl::string_view text) {
  auto r = t.Encode(text);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<int32_t>{};
}

TEST(BpeMergeTest, LowestRankMergesFirst) {
  Vocab v;
  const int a = v.Add("a"), b = v.Add("b"), c = v.Add("c");
  const int ab = v.Add("ab"), bc = v.Add("bc"), a_bc = v.Add("abc");
  v.merges = {"b c", "a b", "a bc"};
  // (b,c) outranks (a,b): a|bc, then a+bc.
  EXPECT_THAT(Enc(*v.Build("gpt2"), "abc"), ElementsAre(a_bc));
  // With (a,b) first, ab|c has no merge left.
  v.merges = {"a b", "b c", "a bc"};
  EXPECT_THAT(Enc(*v.Build("gpt2"), "abc"), ElementsAre(ab, c));
  EXPECT_THAT(Enc(*v.Build("gpt2"), "cab"), ElementsAre(c, ab));
  (void)a;
  (void)b;
  (void)bc;
}

TEST(BpeMergeTest, TiesGoToTheLeftmostPair) {
  Vocab v;
  const int a = v.Add("a"), aa = v.Add("aa"), aaaa = v.Add("aaaa");
  v.merges = {"a a", "aa aa"};
  EXPECT_THAT(Enc(*v.Build("gpt2"), "aaa"), ElementsAre(aa, a));
  EXPECT_THAT(Enc(*v.Build("gpt2"), "aaaaa"), ElementsAre(aaaa, a));
  EXPECT_THAT(Enc(*v.Build("gpt2"), "aaaaaa"), ElementsAre(aaaa, aa));
}

TEST(BpeMergeTest, LongPreTokenIsFast) {
  // 200k letters form one pre-token; the heap-based merge keeps this well under a second.
  Vocab v;
  const int a = v.Add("a"), aa = v.Add("aa"), aaaa = v.Add("aaaa");
  v.merges = {"a a", "aa aa"};
  auto t = v.Build("gpt2");
  std::vector<int32_t> ids = Enc(*t, std::string(200001, 'a'));
  ASSERT_EQ(ids.size(), 50001u);
  EXPECT_EQ(ids.front(), aaaa);
  EXPECT_EQ(ids.back(), a);
  (void)aa;
}

TEST(BpeMergeTest, MergesRespectPreTokenBoundaries) {
  Vocab v;
  const int a = v.Add("a"), sp = v.Add(kSpaceChar), spa = v.Add(std::string(kSpaceChar) + "a");
  const int aspace = v.Add(std::string("a") + kSpaceChar);
  v.merges = {std::string("a ") + kSpaceChar, std::string(kSpaceChar) + " a"};
  // "a a": pre-tokens "a" and " a"; the higher-ranked "a"+"Ġ" cannot cross the boundary.
  EXPECT_THAT(Enc(*v.Build("gpt2"), "a a"), ElementsAre(a, spa));
  (void)sp;
  (void)aspace;
}

TEST(BpeMergeTest, MergesOutsideTheVocabularyAreSkipped) {
  // Hugging Face rejects such files. pinfer ignores a merge whose parts or result are not tokens
  // (llama.cpp would apply it to strings and fall back to byte tokens; the two differ only for
  // such malformed vocabularies), and the valid merges still apply.
  Vocab v;
  const int a = v.Add("a"), b = v.Add("b"), ab = v.Add("ab");
  v.merges = {"a q", "b a", "ab", "a b"};  // unknown part, unknown result, not a pair, valid
  EXPECT_THAT(Enc(*v.Build("gpt2"), "aba"), ElementsAre(ab, a));
  (void)b;
}

TEST(BpeMergeTest, BytesWithoutATokenAreDropped) {
  // As in llama.cpp: a byte whose character is not in the vocabulary produces no token.
  Vocab v;
  const int a = v.Add("a");
  EXPECT_THAT(Enc(*v.Build("gpt2"), "aza"), ElementsAre(a, a));
}

TEST(BpeByteMapTest, MultiByteCharactersAndControlBytes) {
  Vocab v;
  const int c3 = v.Add("\xC3\x83"), a9 = v.Add("\xC2\xA9"), e_acute = v.Add("\xC3\x83\xC2\xA9");
  const int nl = v.Add(kNewlineChar), shy = v.Add("\xC5\x83"), sp = v.Add(kSpaceChar);
  v.merges = {"\xC3\x83 \xC2\xA9"};
  auto t = v.Build("gpt2");
  // "é" is the bytes C3 A9, written "Ã©".
  EXPECT_THAT(Enc(*t, "\xC3\xA9"), ElementsAre(e_acute));
  EXPECT_EQ(t->TokenBytes(e_acute), "\xC3\xA9");
  EXPECT_EQ(t->TokenBytes(c3), "\xC3");
  EXPECT_EQ(t->TokenBytes(a9), "\xA9");
  EXPECT_EQ(t->TokenBytes(nl), "\n");
  EXPECT_EQ(t->TokenBytes(shy), "\xAD");
  EXPECT_EQ(t->TokenBytes(sp), " ");
  EXPECT_THAT(Enc(*t, "\n"), ElementsAre(nl));
}

TEST(BpeByteMapTest, EveryByteRoundTrips) {
  // A vocabulary of exactly the 256 byte characters, in GPT-2's table order: printable bytes
  // first, then the 68 shifted ones. Token i must stand for the byte of that order.
  std::vector<int> order;
  for (int b = '!'; b <= '~'; ++b) order.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) order.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) order.push_back(b);
  const size_t printable = order.size();
  for (int b = 0; b < 256; ++b) {
    if (std::find(order.begin(), order.begin() + printable, b) == order.begin() + printable) {
      order.push_back(b);
    }
  }
  ASSERT_EQ(order.size(), 256u);
  Vocab v;
  for (size_t i = 0; i < order.size(); ++i) {
    const uint32_t cpt = i < printable ? order[i] : 256 + (i - printable);
    std::string s;
    if (cpt < 0x80) {
      s.push_back(static_cast<char>(cpt));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cpt >> 6)));
      s.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
    }
    v.Add(s);
  }
  auto t = v.Build("gpt2");
  for (int i = 0; i < 256; ++i) {
    ASSERT_EQ(t->TokenBytes(i), std::string(1, static_cast<char>(order[i]))) << "token " << i;
  }
  // Every valid text round-trips byte by byte.
  const std::string text = "Z\x7F\t\x01 \xC3\xA9\xF0\x9F\x9A\x80";
  std::vector<int32_t> ids = Enc(*t, text);
  EXPECT_EQ(ids.size(), text.size());
  EXPECT_EQ(t->Decode(ids), text);
}

TEST(BpeIgnoreMergesTest, LlamaBpeTakesWholeVocabularyWords) {
  Vocab v;
  const int a = v.Add("a"), b = v.Add("b"), c = v.Add("c"), abc = v.Add("abc");
  // No merge leads to "abc": only llama-bpe's ignore_merges finds it.
  EXPECT_THAT(Enc(*v.Build("llama-bpe"), "abc"), ElementsAre(abc));
  EXPECT_THAT(Enc(*v.Build("gpt2"), "abc"), ElementsAre(a, b, c));
  EXPECT_THAT(Enc(*v.Build("smaug-bpe"), "abc"), ElementsAre(a, b, c));
}

TEST(BpeSpecialTokenTest, ControlTokensAreNotParsedFromText) {
  Vocab v;
  const int lt = v.Add("<"), gt = v.Add(">"), x = v.Add("x");
  const int ctl = v.Add("<x>", /*control*/ 3);
  auto t = v.Build("gpt2");
  EXPECT_THAT(Enc(*t, "<x>"), ElementsAre(lt, x, gt));
  EXPECT_EQ(t->TokenBytes(ctl), "");
  EXPECT_TRUE(t->IsControl(ctl));
  EXPECT_FALSE(t->IsControl(x));
  EXPECT_TRUE(t->IsControl(-1));
  EXPECT_TRUE(t->IsControl(t->vocab_size()));
  EXPECT_EQ(t->Decode({x, ctl, x}), "xx");
}

TEST(BpeSpecialTokenTest, UserDefinedTokensAreMatchedInRawText) {
  Vocab v;
  const int lt = v.Add("<"), gt = v.Add(">"), x = v.Add("x"), y = v.Add("y");
  const int sp = v.Add(kSpaceChar);
  const int tag = v.Add("<t>", /*user defined*/ 4), tag2 = v.Add("<t><t>", 4);
  const int t_ = v.Add("t");
  auto t = v.Build("llama-bpe");
  // The longest user-defined token wins; the text between is pre-tokenized on its own.
  EXPECT_THAT(Enc(*t, "x<t>y<t><t> <t"), ElementsAre(x, tag, y, tag2, sp, lt, t_));
  EXPECT_EQ(t->TokenBytes(tag), "<t>");
  EXPECT_FALSE(t->IsControl(tag));
  (void)gt;
}

TEST(BpeConstructionTest, Errors) {
  auto empty = NewByteLevelBpeTokenizer({}, {}, {}, "llama-bpe");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("empty vocabulary"));
  auto types = NewByteLevelBpeTokenizer({"a", "b"}, {}, {1}, "llama-bpe");
  EXPECT_EQ(types.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(types.status().message(), HasSubstr("1 token types for 2 tokens"));
  auto pre = NewByteLevelBpeTokenizer({"a"}, {}, {1}, "deepseek-llm");
  EXPECT_EQ(pre.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pre.status().message(),
              HasSubstr("'deepseek-llm' (supported: llama-bpe, qwen2, gpt2)"));
}

// ----- tokenizer.json -----

class TokenizerJsonTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& content) {
    const std::string path =
        (std::filesystem::temp_directory_path() / ("pinfer_bpe_test_" + std::to_string(getpid()) +
                                                   "_" + std::to_string(counter_++) + ".json"))
            .string();
    std::ofstream(path, std::ios::binary) << content;
    paths_.push_back(path);
    return path;
  }
  void TearDown() override {
    for (const auto& p : paths_) std::remove(p.c_str());
  }
  absl::Status LoadError(const std::string& content) {
    auto t = LoadTokenizerJson(Write(content));
    EXPECT_FALSE(t.ok());
    return t.ok() ? absl::OkStatus() : t.status();
  }

  int counter_ = 0;
  std::vector<std::string> paths_;
};

// A Llama-3 style tokenizer.json around a given model/added_tokens/pre_tokenizer.
std::string Llama3Json(const std::string& vocab, const std::string& merges,
                       const std::string& added = "[]", const std::string& extra_model = "",
                       const std::string& pre = "") {
  const std::string llama3_pre = R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
       "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})";
  return R"({"version": "1.0", "truncation": null, "padding": null, "added_tokens": )" + added +
         R"(, "normalizer": null, "pre_tokenizer": )" + (pre.empty() ? llama3_pre : pre) +
         R"(, "post_processor": null, "decoder": {"type": "ByteLevel"},
         "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false,
                   "byte_fallback": false)" +
         extra_model + R"(, "vocab": )" + vocab + R"(, "merges": )" + merges + "}}";
}

constexpr char kSmallVocab[] =
    R"({"H": 0, "i": 1, "Ġ": 2, "t": 3, "h": 4, "e": 5, "r": 6, "Hi": 7, "Ġt": 8, "he": 9,
        "Ġthe": 10, "er": 11, "re": 12, "Ġthere": 13, "Ġther": 14, "!": 15})";

TEST_F(TokenizerJsonTest, LoadsLlama3StyleFile) {
  const std::string added =
      R"([{"id": 16, "content": "<|begin_of_text|>", "special": true},
          {"id": 17, "content": "<sep>", "special": false}])";
  for (const std::string merges :
       {R"(["H i", "Ġ t", "h e", "Ġt he", "Ġthe r", "Ġther e", "e r"])",
        R"([["H", "i"], ["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["Ġthe", "r"], ["Ġther", "e"],
            ["e", "r"]])"}) {
    auto t = LoadTokenizerJson(Write(Llama3Json(kSmallVocab, merges, added)));
    ASSERT_TRUE(t.ok()) << t.status();
    // "Hi there!" -> "Hi" | " there" | "!"; " there" merges Ġ+t, h+e, Ġt+he, +r, +e.
    EXPECT_THAT(Enc(**t, "Hi there!"), ElementsAre(7, 13, 15));
    // " therr": Ġt, he, Ġthe, Ġther; then (Ġther, r) has no merge and "er" lost its "e".
    EXPECT_THAT(Enc(**t, " therr"), ElementsAre(14, 6));
    EXPECT_EQ((*t)->vocab_size(), 18);
    EXPECT_TRUE((*t)->IsControl(16));
    EXPECT_EQ((*t)->TokenBytes(16), "");
    // The special token's text is not parsed; the user-defined one is.
    EXPECT_THAT(Enc(**t, "Hi<sep>Hi"), ElementsAre(7, 17, 7));
    EXPECT_EQ((*t)->Decode({7, 13, 17, 15}), "Hi there<sep>!");
  }
}

TEST_F(TokenizerJsonTest, IgnoreMergesFollowsTheFile) {
  // "Ġthere" is in the vocabulary but the only merge is Ġ+t; with ignore_merges the whole
  // pre-token " there" is looked up before merging.
  const std::string merges = R"(["Ġ t"])";
  auto with =
      LoadTokenizerJson(Write(Llama3Json(kSmallVocab, merges, "[]", R"(, "ignore_merges": true)")));
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_THAT(Enc(**with, " there"), ElementsAre(13));
  auto without = LoadTokenizerJson(Write(Llama3Json(kSmallVocab, merges)));
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_THAT(Enc(**without, " there"), ElementsAre(8, 4, 5, 6, 5));
}

TEST_F(TokenizerJsonTest, LoadsGpt2StyleFile) {
  const std::string pre =
      R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})";
  auto t = LoadTokenizerJson(Write(Llama3Json(kSmallVocab, R"(["H i", "Ġ t"])", "[]", "", pre)));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(Enc(**t, "Hi t"), ElementsAre(7, 8));
}

TEST_F(TokenizerJsonTest, MalformedFiles) {
  struct Case {
    std::string json;
    std::string message;
  };
  const std::string ok_merges = R"(["H i"])";
  const std::vector<Case> cases = {
      {R"({"model": )", "invalid JSON: [json.exception.parse_error"},
      {"[1, 2]", "not a JSON object"},
      {R"({"version": "1.0"})", "missing 'model' object"},
      {R"({"model": {"type": "WordPiece", "vocab": {}}, "pre_tokenizer": null})",
       "model.type is \"WordPiece\"; only BPE is supported"},
      {Llama3Json(R"({"a": 0})", ok_merges, "[]", R"(, "continuing_subword_prefix": "##")"),
       "model.continuing_subword_prefix is not supported"},
      {Llama3Json(R"({"a": "zero"})", ok_merges), "vocab entry 'a': id is not an integer"},
      {Llama3Json(R"({"a": 0, "b": 7})", ok_merges), "vocab entry 'b': id 7 out of range [0, 2)"},
      {Llama3Json(R"({"a": 0, "b": -1})", ok_merges), "id -1 out of range"},
      {Llama3Json(R"({"a": 0, "b": 0})", ok_merges), "vocab id 0 is used twice"},
      {Llama3Json(R"([1])", ok_merges), "missing model.vocab object"},
      {Llama3Json(kSmallVocab, R"("H i")"), "missing model.merges array"},
      {Llama3Json(kSmallVocab, R"(["Hi"])"), "merges[0] 'Hi' is not two tokens"},
      {Llama3Json(kSmallVocab, R"([["H", "i", "x"]])"),
       "merges[0] is neither \"a b\" nor [\"a\", \"b\"]"},
      {Llama3Json(kSmallVocab, R"([["H", ""]])"), "merges[0] has an empty part or a space"},
      {Llama3Json(kSmallVocab, ok_merges, R"([{"id": 3, "content": "<x>", "special": true}])"),
       "added_tokens[0]: id 3 ('<x>') is already 't'"},
      {Llama3Json(kSmallVocab, ok_merges, R"([{"content": "<x>"}])"),
       "added_tokens[0]: expected an object with 'id' and string 'content'"},
      {Llama3Json(kSmallVocab, ok_merges, R"([{"id": 16, "content": "<x>", "special": 1}])"),
       "added_tokens[0]: 'special' is not a boolean"},
      {Llama3Json(kSmallVocab, ok_merges, R"({"id": 16})"), "added_tokens is not an array"},
      {Llama3Json(kSmallVocab, ok_merges, "[]", R"(, "ignore_merges": "yes")"),
       "model.ignore_merges is not a boolean"},
      {Llama3Json(kSmallVocab, ok_merges, "[]", "", R"({"type": "Metaspace", "replacement": "▁"})"),
       "unsupported pre_tokenizer (not byte-level)"},
      {Llama3Json(kSmallVocab, ok_merges, "[]", "",
                  R"({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true})"),
       "unsupported pre_tokenizer (add_prefix_space)"},
      {Llama3Json(kSmallVocab, ok_merges, "[]", "",
                  R"({"type": "Sequence", "pretokenizers": [{"type": "Split",
                      "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": false},
                      {"type": "ByteLevel", "use_regex": false}]})"),
       "Split regex is neither Llama-3's nor Qwen2's"},
      {Llama3Json(kSmallVocab, ok_merges, "[]", "", R"({"type": "Sequence"})"),
       "expected a Sequence of Split and ByteLevel"},
  };
  for (const Case& c : cases) {
    absl::Status s = LoadError(c.json);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.json;
  }
  // A normalizer is not supported (Llama-3 has none), but for Qwen2's NFC, which llama.cpp does
  // not apply either.
  std::string with_normalizer = Llama3Json(kSmallVocab, ok_merges);
  with_normalizer.replace(with_normalizer.find(R"("normalizer": null)"), 18,
                          R"("normalizer": {"type": "NFKC"})");
  absl::Status s = LoadError(with_normalizer);
  EXPECT_THAT(s.message(), HasSubstr(R"(normalizer {"type":"NFKC"} is not supported)"));
}

TEST_F(TokenizerJsonTest, MissingFile) {
  auto t = LoadTokenizerJson("/nonexistent/tokenizer.json");
  EXPECT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("/nonexistent/tokenizer.json"));
}

TEST_F(TokenizerJsonTest, HuggingFaceDirectoryFallsBackToTokenizerJson) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("pinfer_bpe_dir_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << Llama3Json(kSmallVocab, R"(["H i"])");
  auto t = LoadHuggingFaceTokenizer(dir.string());
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(Enc(**t, "Hi"), ElementsAre(7));
}

}  // namespace
}  // namespace pinfer
