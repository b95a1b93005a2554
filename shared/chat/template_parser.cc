// The chat template engine's lexer and parser (see template.h). Both follow
// Hugging Face's JavaScript renderer (npm @huggingface/jinja), the reference the tests compare
// against, rather than Python Jinja where the two differ: its text-level trim_blocks /
// lstrip_blocks pass, its operator precedence (filters bind tighter than + and comparisons), its
// lenient undefined (a missing key or attribute is undefined, not an error), and its JavaScript
// value printing (true, not True). Every node keeps its template line so that errors can name it.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <functional>
#include <map>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "shared/chat/template_syntax.h"
#include "shared/util/status_macros.h"

namespace pinfer::chat {
namespace {

bool IsSpace(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
bool IsWord(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// ---------------------------------------------------------------------------------------------
// Preprocessing: the reference applies trim_blocks and lstrip_blocks as regular expressions over
// the whole text before lexing; this does the same, carrying each character's source line along.

struct SourceText {
  std::string text;
  std::vector<int> line;  // line[i]: 1-based source line of text[i]
};

SourceText Preprocess(absl::string_view source) {
  SourceText in;
  int line = 1;
  for (char c : source) {
    in.text.push_back(c);
    in.line.push_back(line);
    if (c == '\n') ++line;
  }
  if (!in.text.empty() && in.text.back() == '\n') {
    in.text.pop_back();
    in.line.pop_back();
  }
  // lstrip_blocks: /^[ \t]*({[#%-])/gm -> "$1".
  SourceText stripped;
  for (size_t i = 0; i < in.text.size();) {
    const bool line_start = i == 0 || in.text[i - 1] == '\n' || in.text[i - 1] == '\r';
    if (line_start) {
      size_t j = i;
      while (j < in.text.size() && (in.text[j] == ' ' || in.text[j] == '\t')) ++j;
      if (j + 1 < in.text.size() && in.text[j] == '{' &&
          (in.text[j + 1] == '#' || in.text[j + 1] == '%' || in.text[j + 1] == '-')) {
        i = j;
      }
    }
    stripped.text.push_back(in.text[i]);
    stripped.line.push_back(in.line[i]);
    ++i;
  }
  // trim_blocks: /([#%-]})\n/g -> "$1".
  SourceText out;
  for (size_t i = 0; i < stripped.text.size(); ++i) {
    out.text.push_back(stripped.text[i]);
    out.line.push_back(stripped.line[i]);
    const size_t n = out.text.size();
    if (n >= 2 && out.text[n - 1] == '}' &&
        (out.text[n - 2] == '#' || out.text[n - 2] == '%' || out.text[n - 2] == '-') &&
        i + 1 < stripped.text.size() && stripped.text[i + 1] == '\n') {
      ++i;
    }
  }
  // transformers' {% generation %} / {% endgeneration %} (training masks) render as nothing:
  // /{%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/gs, removed as the reference removes it.
  const std::string& t = out.text;
  SourceText result;
  auto append = [&](size_t from, size_t to) {
    result.text.append(t, from, to - from);
    result.line.insert(result.line.end(), out.line.begin() + from, out.line.begin() + to);
  };
  size_t last = 0;
  for (size_t i = 0; i + 1 < t.size();) {
    if (t[i] != '{' || t[i + 1] != '%') {
      ++i;
      continue;
    }
    size_t j = i + 2;
    const bool lstrip = j < t.size() && t[j] == '-';
    if (lstrip) ++j;
    while (j < t.size() && IsSpace(t[j])) ++j;
    if (t.compare(j, 3, "end") == 0) j += 3;
    if (t.compare(j, 10, "generation") != 0) {
      ++i;
      continue;
    }
    j += 10;
    while (j < t.size() && IsSpace(t[j])) ++j;
    const bool rstrip = j < t.size() && t[j] == '-';
    if (rstrip) ++j;
    if (t.compare(j, 2, "%}") != 0) {
      ++i;
      continue;
    }
    j += 2;
    const size_t after = j;
    while (j < t.size() && IsSpace(t[j])) ++j;
    size_t end = i;
    if (lstrip) {
      while (end > last && IsSpace(t[end - 1])) --end;
    }
    append(last, end);
    if (!rstrip) append(after, j);
    last = i = j;
  }
  append(last, t.size());
  return result;
}

// ---------------------------------------------------------------------------------------------
// Lexer.

enum class Tok {
  kText,
  kNumber,
  kString,
  kIdentifier,
  kEquals,
  kOpenParen,
  kCloseParen,
  kOpenStatement,
  kCloseStatement,
  kOpenExpression,
  kCloseExpression,
  kOpenSquare,
  kCloseSquare,
  kOpenCurly,
  kCloseCurly,
  kComma,
  kDot,
  kColon,
  kPipe,
  kAdditive,
  kMultiplicative,
  kPower,
  kComparison,
  kUnary,
  kComment
};

struct Token {
  Tok type;
  std::string value;
  int line;
};

absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source) {
  const SourceText src = Preprocess(source);
  const std::string& s = src.text;
  const size_t n = s.size();
  auto line_at = [&](size_t pos) { return src.line.empty() ? 1 : src.line[std::min(pos, n - 1)]; };
  std::vector<Token> tokens;
  size_t pos = 0;
  int curly_depth = 0;
  auto push = [&](Tok type, std::string value, size_t at) {
    tokens.push_back(Token{type, std::move(value), line_at(at)});
  };
  auto strip_trailing = [&] {
    if (!tokens.empty() && tokens.back().type == Tok::kText) {
      std::string& v = tokens.back().value;
      while (!v.empty() && IsSpace(v.back())) v.pop_back();
      if (v.empty()) tokens.pop_back();
    }
  };
  auto skip_leading = [&] {
    while (pos < n && IsSpace(s[pos])) ++pos;
  };
  static const std::vector<std::pair<std::string, Tok>> kRules = {
      {"{%", Tok::kOpenStatement},  {"%}", Tok::kCloseStatement},
      {"{{", Tok::kOpenExpression}, {"}}", Tok::kCloseExpression},
      {"(", Tok::kOpenParen},       {")", Tok::kCloseParen},
      {"{", Tok::kOpenCurly},       {"}", Tok::kCloseCurly},
      {"[", Tok::kOpenSquare},      {"]", Tok::kCloseSquare},
      {",", Tok::kComma},           {".", Tok::kDot},
      {":", Tok::kColon},           {"|", Tok::kPipe},
      {"<=", Tok::kComparison},     {">=", Tok::kComparison},
      {"==", Tok::kComparison},     {"!=", Tok::kComparison},
      {"<", Tok::kComparison},      {">", Tok::kComparison},
      {"+", Tok::kAdditive},        {"-", Tok::kAdditive},
      {"~", Tok::kAdditive},        {"**", Tok::kPower},
      {"*", Tok::kMultiplicative},  {"//", Tok::kMultiplicative},
      {"/", Tok::kMultiplicative},  {"%", Tok::kMultiplicative},
      {"=", Tok::kEquals}};
  while (pos < n) {
    const std::optional<Tok> last =
        tokens.empty() ? std::nullopt : std::optional<Tok>(tokens.back().type);
    if (!last || *last == Tok::kCloseStatement || *last == Tok::kCloseExpression ||
        *last == Tok::kComment) {
      size_t end = pos;
      while (true) {
        end = s.find('{', end);
        if (end == std::string::npos) {
          end = n;
          break;
        }
        if (end + 1 < n && (s[end + 1] == '%' || s[end + 1] == '{' || s[end + 1] == '#')) break;
        ++end;
      }
      if (end > pos) {
        push(Tok::kText, s.substr(pos, end - pos), pos);
        pos = end;
        continue;
      }
    }
    if (s[pos] == '{' && pos + 1 < n) {
      const char next = s[pos + 1];
      if (next == '#') {
        const size_t start = pos;
        pos += 2;
        const bool strip_before = pos < n && s[pos] == '-';
        if (strip_before) ++pos;
        const size_t end = s.find("#}", pos);
        if (end == std::string::npos)
          return LineError(line_at(start), "missing end of comment tag");
        const bool strip_after = end > pos && s[end - 1] == '-';
        if (strip_before) strip_trailing();
        push(Tok::kComment, "", start);
        pos = end + 2;
        if (strip_after) skip_leading();
        continue;
      }
      if (pos + 2 < n && s[pos + 2] == '-' && (next == '%' || next == '{')) {
        strip_trailing();
        push(next == '%' ? Tok::kOpenStatement : Tok::kOpenExpression, "", pos);
        if (next == '{') curly_depth = 0;
        pos += 3;
        continue;
      }
    }
    while (pos < n && IsSpace(s[pos])) ++pos;
    if (pos >= n) return LineError(line_at(n), "unexpected end of template inside a tag");
    const char c = s[pos];
    if (c == '-' && pos + 2 < n && s[pos + 2] == '}' && (s[pos + 1] == '%' || s[pos + 1] == '}')) {
      push(s[pos + 1] == '%' ? Tok::kCloseStatement : Tok::kCloseExpression, "", pos);
      pos += 3;
      skip_leading();
      continue;
    }
    if (c == '-' || c == '+') {
      const Tok lt = last.value_or(Tok::kText);
      if (!last || lt == Tok::kText) return LineError(line_at(pos), "unexpected character");
      if (lt != Tok::kIdentifier && lt != Tok::kNumber && lt != Tok::kString &&
          lt != Tok::kCloseParen && lt != Tok::kCloseSquare) {
        const size_t start = pos++;
        std::string num;
        while (pos < n && IsDigit(s[pos])) num.push_back(s[pos++]);
        if (!num.empty() && pos + 1 < n && s[pos] == '.' && IsDigit(s[pos + 1])) {
          num.push_back(s[pos++]);
          while (pos < n && IsDigit(s[pos])) num.push_back(s[pos++]);
        }
        push(num.empty() ? Tok::kUnary : Tok::kNumber, std::string(1, c) + num, start);
        continue;
      }
    }
    bool matched = false;
    for (const auto& [seq, type] : kRules) {
      if (seq == "}}" && curly_depth > 0) continue;
      if (s.compare(pos, seq.size(), seq) == 0) {
        push(type, seq, pos);
        if (type == Tok::kOpenExpression) curly_depth = 0;
        if (type == Tok::kOpenCurly) ++curly_depth;
        if (type == Tok::kCloseCurly) --curly_depth;
        pos += seq.size();
        matched = true;
        break;
      }
    }
    if (matched) continue;
    if (c == '\'' || c == '"') {
      const size_t start = pos++;
      std::string value;
      while (true) {
        if (pos >= n) return LineError(line_at(start), "unterminated string literal");
        const char ch = s[pos];
        if (ch == c) break;
        ++pos;
        if (ch != '\\') {
          value.push_back(ch);
          continue;
        }
        if (pos >= n) return LineError(line_at(start), "unterminated string literal");
        const char e = s[pos++];
        switch (e) {
          case 'n':
            value.push_back('\n');
            break;
          case 't':
            value.push_back('\t');
            break;
          case 'r':
            value.push_back('\r');
            break;
          case 'b':
            value.push_back('\b');
            break;
          case 'f':
            value.push_back('\f');
            break;
          case 'v':
            value.push_back('\v');
            break;
          case '\'':
          case '"':
          case '\\':
            value.push_back(e);
            break;
          default:
            return LineError(line_at(pos), absl::StrCat("unsupported escape '\\", std::string(1, e),
                                                        "' in a string literal"));
        }
      }
      ++pos;
      push(Tok::kString, std::move(value), start);
      continue;
    }
    if (IsDigit(c)) {
      const size_t start = pos;
      std::string num;
      while (pos < n && IsDigit(s[pos])) num.push_back(s[pos++]);
      if (last != Tok::kDot && pos + 1 < n && s[pos] == '.' && IsDigit(s[pos + 1])) {
        num.push_back(s[pos++]);
        while (pos < n && IsDigit(s[pos])) num.push_back(s[pos++]);
      }
      push(Tok::kNumber, std::move(num), start);
      continue;
    }
    if (IsWord(c)) {
      const size_t start = pos;
      while (pos < n && IsWord(s[pos])) ++pos;
      push(Tok::kIdentifier, s.substr(start, pos - start), start);
      continue;
    }
    return LineError(line_at(pos), absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }
  return tokens;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  absl::StatusOr<std::vector<NodePtr>> ParseProgram() {
    std::vector<NodePtr> body;
    while (current_ < tokens_.size()) {
      ASSIGN_OR_RETURN(NodePtr node, ParseAny());
      body.push_back(std::move(node));
    }
    return body;
  }

 private:
  bool Is(Tok type, size_t ahead = 0) const {
    return current_ + ahead < tokens_.size() && tokens_[current_ + ahead].type == type;
  }
  bool IsIdentifier(absl::string_view name, size_t ahead = 0) const {
    return Is(Tok::kIdentifier, ahead) && tokens_[current_ + ahead].value == name;
  }
  bool IsStatement(std::initializer_list<absl::string_view> names) const {
    if (!Is(Tok::kOpenStatement) || !Is(Tok::kIdentifier, 1)) return false;
    const std::string& name = tokens_[current_ + 1].value;
    return std::find(names.begin(), names.end(), name) != names.end();
  }
  int Line() const {
    if (tokens_.empty()) return 1;
    return tokens_[std::min(current_, tokens_.size() - 1)].line;
  }
  absl::Status Expect(Tok type, absl::string_view what) {
    if (!Is(type)) return LineError(Line(), absl::StrCat("expected ", what));
    ++current_;
    return absl::OkStatus();
  }
  absl::Status ExpectStatement(absl::string_view name) {
    if (!IsStatement({name})) {
      return LineError(Line(), absl::StrCat("expected {% ", name, " %}"));
    }
    current_ += 2;
    return Expect(Tok::kCloseStatement, "%}");
  }
  // Reads the statements of a block up to (not including) one of `ends`.
  absl::StatusOr<std::vector<NodePtr>> ParseBlock(std::initializer_list<absl::string_view> ends,
                                                  int opened_at, absl::string_view opener) {
    std::vector<NodePtr> body;
    while (!IsStatement(ends)) {
      if (current_ >= tokens_.size()) {
        return LineError(opened_at, absl::StrCat("{% ", opener, " %} is never closed"));
      }
      ASSIGN_OR_RETURN(NodePtr node, ParseAny());
      body.push_back(std::move(node));
    }
    return body;
  }

  absl::StatusOr<NodePtr> ParseAny() {
    const Token& token = tokens_[current_];
    switch (token.type) {
      case Tok::kComment: {
        ++current_;
        return MakeNode(Kind::kComment, token.line);
      }
      case Tok::kText: {
        ++current_;
        NodePtr node = MakeNode(Kind::kText, token.line);
        node->value = token.value;
        return node;
      }
      case Tok::kOpenStatement:
        return ParseStatement();
      case Tok::kOpenExpression: {
        ++current_;
        ASSIGN_OR_RETURN(NodePtr node, ParseExpression());
        RETURN_IF_ERROR(Expect(Tok::kCloseExpression, "}} to close the expression"));
        return node;
      }
      default:
        return LineError(token.line, "unexpected token outside a tag");
    }
  }

  absl::StatusOr<NodePtr> ParseStatement() {
    ++current_;  // {%
    if (!Is(Tok::kIdentifier)) return LineError(Line(), "expected a statement name after {%");
    const std::string name = tokens_[current_].value;
    const int line = Line();
    ++current_;
    if (name == "if") {
      ASSIGN_OR_RETURN(NodePtr node, ParseIf(line));
      RETURN_IF_ERROR(ExpectStatement("endif"));
      return node;
    }
    if (name == "for") return ParseFor(line);
    if (name == "set") return ParseSet(line);
    if (name == "macro") return ParseMacro(line);
    if (name == "break" || name == "continue") {
      RETURN_IF_ERROR(Expect(Tok::kCloseStatement, "%}"));
      return MakeNode(name == "break" ? Kind::kBreak : Kind::kContinue, line);
    }
    return LineError(line, absl::StrCat("unsupported statement '", name, "'"));
  }

  absl::StatusOr<NodePtr> ParseIf(int line) {
    NodePtr node = MakeNode(Kind::kIf, line);
    ASSIGN_OR_RETURN(NodePtr test, ParseExpression());
    node->children.push_back(std::move(test));
    RETURN_IF_ERROR(Expect(Tok::kCloseStatement, "%} after the if condition"));
    ASSIGN_OR_RETURN(node->body, ParseBlock({"elif", "else", "endif"}, line, "if"));
    if (IsStatement({"elif"})) {
      const int elif_line = tokens_[current_ + 1].line;
      current_ += 2;
      ASSIGN_OR_RETURN(NodePtr nested, ParseIf(elif_line));
      node->alternate.push_back(std::move(nested));
    } else if (IsStatement({"else"})) {
      current_ += 2;
      RETURN_IF_ERROR(Expect(Tok::kCloseStatement, "%} after else"));
      ASSIGN_OR_RETURN(node->alternate, ParseBlock({"endif"}, line, "if"));
    }
    return node;
  }

  absl::StatusOr<NodePtr> ParseFor(int line) {
    NodePtr node = MakeNode(Kind::kFor, line);
    ASSIGN_OR_RETURN(NodePtr loop_variable, ParseSequence(/*primary=*/true));
    if (loop_variable->kind != Kind::kIdentifier && loop_variable->kind != Kind::kTuple) {
      return LineError(line, "expected a name or names as the loop variable");
    }
    if (!IsIdentifier("in")) return LineError(Line(), "expected 'in' after the loop variable");
    ++current_;
    ASSIGN_OR_RETURN(NodePtr iterable, ParseExpression());
    NodePtr select;
    if (iterable->kind == Kind::kTernary && iterable->children[2] == nullptr) {
      select = std::move(iterable->children[1]);
      iterable = std::move(iterable->children[0]);
    }
    node->children.push_back(std::move(loop_variable));
    node->children.push_back(std::move(iterable));
    node->children.push_back(std::move(select));
    if (IsIdentifier("recursive")) return LineError(Line(), "unsupported: recursive for loops");
    RETURN_IF_ERROR(Expect(Tok::kCloseStatement, "%} after the for loop header"));
    ASSIGN_OR_RETURN(node->body, ParseBlock({"endfor", "else"}, line, "for"));
    if (IsStatement({"else"})) {
      current_ += 2;
      RETURN_IF_ERROR(Expect(Tok::kCloseStatement, "%} after else"));
      ASSIGN_OR_RETURN(node->alternate, ParseBlock({"endfor"}, line, "for"));
    }
    RETURN_IF_ERROR(ExpectStatement("endfor"));
    return node;
  }

  absl::StatusOr<NodePtr> ParseSet(int line) {
    ASSIGN_OR_RETURN(NodePtr target, ParseSequence(false));
    if (Is(Tok::kEquals)) {
      ++current_;
      NodePtr node = MakeNode(Kind::kSet, line);
      ASSIGN_OR_RETURN(NodePtr value, ParseSequence(false));
      node->children.push_back(std::move(target));
      node->children.push_back(std::move(value));
      RETURN_IF_ERROR(Expect(Tok::kCloseStatement, "%} after the set statement"));
      return node;
    }
    if (target->kind != Kind::kIdentifier) return LineError(line, "expected '=' in set");
    RETURN_IF_ERROR(Expect(Tok::kCloseStatement, "%} after the set name"));
    NodePtr node = MakeNode(Kind::kSetBlock, line);
    node->children.push_back(std::move(target));
    ASSIGN_OR_RETURN(node->body, ParseBlock({"endset"}, line, "set"));
    RETURN_IF_ERROR(ExpectStatement("endset"));
    return node;
  }

  absl::StatusOr<NodePtr> ParseMacro(int line) {
    if (!Is(Tok::kIdentifier)) return LineError(line, "expected the macro's name");
    NodePtr node = MakeNode(Kind::kMacro, line);
    node->value = tokens_[current_++].value;
    RETURN_IF_ERROR(Expect(Tok::kOpenParen, "( after the macro name"));
    while (!Is(Tok::kCloseParen)) {
      if (!Is(Tok::kIdentifier)) return LineError(Line(), "expected a macro parameter name");
      node->names.push_back(tokens_[current_++].value);
      NodePtr default_value;
      if (Is(Tok::kEquals)) {
        ++current_;
        ASSIGN_OR_RETURN(default_value, ParseExpression());
      }
      node->children.push_back(std::move(default_value));
      if (Is(Tok::kComma))
        ++current_;
      else if (!Is(Tok::kCloseParen))
        return LineError(Line(), "expected , or ) in the macro parameters");
    }
    ++current_;
    RETURN_IF_ERROR(Expect(Tok::kCloseStatement, "%} after the macro header"));
    ASSIGN_OR_RETURN(node->body, ParseBlock({"endmacro"}, line, "macro"));
    RETURN_IF_ERROR(ExpectStatement("endmacro"));
    return node;
  }

  absl::StatusOr<NodePtr> ParseSequence(bool primary) {
    const int line = Line();
    std::vector<NodePtr> items;
    ASSIGN_OR_RETURN(NodePtr first, primary ? ParsePrimary() : ParseExpression());
    if (!Is(Tok::kComma)) return first;
    items.push_back(std::move(first));
    while (Is(Tok::kComma)) {
      ++current_;
      ASSIGN_OR_RETURN(NodePtr next, primary ? ParsePrimary() : ParseExpression());
      items.push_back(std::move(next));
    }
    NodePtr tuple = MakeNode(Kind::kTuple, line);
    tuple->children = std::move(items);
    return tuple;
  }

  absl::StatusOr<NodePtr> ParseExpression() { return ParseTernary(); }

  absl::StatusOr<NodePtr> ParseTernary() {
    ASSIGN_OR_RETURN(NodePtr a, ParseOr());
    if (!IsIdentifier("if")) return a;
    const int line = Line();
    ++current_;
    ASSIGN_OR_RETURN(NodePtr test, ParseOr());
    NodePtr node = MakeNode(Kind::kTernary, line);
    NodePtr otherwise;
    if (IsIdentifier("else")) {
      ++current_;
      ASSIGN_OR_RETURN(otherwise, ParseTernary());
    }
    node->children.push_back(std::move(a));
    node->children.push_back(std::move(test));
    node->children.push_back(std::move(otherwise));
    return node;
  }

  NodePtr Binary(std::string op, NodePtr left, NodePtr right, int line) {
    NodePtr node = MakeNode(Kind::kBinary, line);
    node->value = std::move(op);
    node->children.push_back(std::move(left));
    node->children.push_back(std::move(right));
    return node;
  }

  absl::StatusOr<NodePtr> ParseOr() {
    ASSIGN_OR_RETURN(NodePtr left, ParseAnd());
    while (IsIdentifier("or")) {
      const int line = Line();
      ++current_;
      ASSIGN_OR_RETURN(NodePtr right, ParseAnd());
      left = Binary("or", std::move(left), std::move(right), line);
    }
    return left;
  }
  absl::StatusOr<NodePtr> ParseAnd() {
    ASSIGN_OR_RETURN(NodePtr left, ParseNot());
    while (IsIdentifier("and")) {
      const int line = Line();
      ++current_;
      ASSIGN_OR_RETURN(NodePtr right, ParseNot());
      left = Binary("and", std::move(left), std::move(right), line);
    }
    return left;
  }
  absl::StatusOr<NodePtr> ParseNot() {
    if (IsIdentifier("not")) {
      const int line = Line();
      ++current_;
      ASSIGN_OR_RETURN(NodePtr operand, ParseNot());
      NodePtr node = MakeNode(Kind::kUnary, line);
      node->value = "not";
      node->children.push_back(std::move(operand));
      return node;
    }
    return ParseComparison();
  }
  absl::StatusOr<NodePtr> ParseComparison() {
    ASSIGN_OR_RETURN(NodePtr left, ParseAdditive());
    while (true) {
      const int line = Line();
      std::string op;
      if (IsIdentifier("not") && IsIdentifier("in", 1)) {
        op = "not in";
        current_ += 2;
      } else if (IsIdentifier("in")) {
        op = "in";
        ++current_;
      } else if (Is(Tok::kComparison)) {
        op = tokens_[current_++].value;
      } else {
        break;
      }
      ASSIGN_OR_RETURN(NodePtr right, ParseAdditive());
      left = Binary(op, std::move(left), std::move(right), line);
    }
    return left;
  }
  absl::StatusOr<NodePtr> ParseAdditive() {
    ASSIGN_OR_RETURN(NodePtr left, ParseMultiplicative());
    while (Is(Tok::kAdditive)) {
      const int line = Line();
      std::string op = tokens_[current_++].value;
      ASSIGN_OR_RETURN(NodePtr right, ParseMultiplicative());
      left = Binary(op, std::move(left), std::move(right), line);
    }
    return left;
  }
  absl::StatusOr<NodePtr> ParseMultiplicative() {
    ASSIGN_OR_RETURN(NodePtr left, ParsePower());
    while (Is(Tok::kMultiplicative)) {
      const int line = Line();
      std::string op = tokens_[current_++].value;
      ASSIGN_OR_RETURN(NodePtr right, ParsePower());
      left = Binary(op, std::move(left), std::move(right), line);
    }
    return left;
  }
  absl::StatusOr<NodePtr> ParsePower() {
    ASSIGN_OR_RETURN(NodePtr left, ParseTest());
    while (Is(Tok::kPower)) {
      const int line = Line();
      ++current_;
      ASSIGN_OR_RETURN(NodePtr right, ParseTest());
      left = Binary("**", std::move(left), std::move(right), line);
    }
    return left;
  }
  absl::StatusOr<NodePtr> ParseTest() {
    ASSIGN_OR_RETURN(NodePtr operand, ParseFilter());
    while (IsIdentifier("is")) {
      const int line = Line();
      ++current_;
      const bool negate = IsIdentifier("not");
      if (negate) ++current_;
      if (!Is(Tok::kIdentifier)) return LineError(Line(), "expected a test name after 'is'");
      NodePtr node = MakeNode(Kind::kTest, line);
      node->value = tokens_[current_++].value;
      node->negate = negate;
      if (Is(Tok::kOpenParen)) return LineError(line, "unsupported: tests with arguments");
      node->children.push_back(std::move(operand));
      operand = std::move(node);
    }
    return operand;
  }
  absl::StatusOr<NodePtr> ParseFilter() {
    ASSIGN_OR_RETURN(NodePtr operand, ParseUnarySign());
    while (Is(Tok::kPipe)) {
      const int line = Line();
      ++current_;
      if (!Is(Tok::kIdentifier)) return LineError(Line(), "expected a filter name after |");
      NodePtr node = MakeNode(Kind::kFilter, line);
      node->value = tokens_[current_++].value;
      node->children.push_back(std::move(operand));
      if (Is(Tok::kOpenParen)) RETURN_IF_ERROR(ParseArguments(*node));
      operand = std::move(node);
    }
    return operand;
  }
  absl::StatusOr<NodePtr> ParseUnarySign() {
    if ((Is(Tok::kUnary) || Is(Tok::kAdditive)) &&
        (tokens_[current_].value == "-" || tokens_[current_].value == "+")) {
      const int line = Line();
      NodePtr node = MakeNode(Kind::kUnary, line);
      node->value = tokens_[current_++].value;
      ASSIGN_OR_RETURN(NodePtr operand, ParseUnarySign());
      node->children.push_back(std::move(operand));
      return node;
    }
    return ParseCallMember();
  }
  absl::StatusOr<NodePtr> ParseCallMember() {
    ASSIGN_OR_RETURN(NodePtr primary, ParsePrimary());
    ASSIGN_OR_RETURN(NodePtr node, ParseMember(std::move(primary)));
    while (Is(Tok::kOpenParen)) {
      NodePtr call = MakeNode(Kind::kCall, Line());
      call->children.push_back(std::move(node));
      call->names.push_back("");
      RETURN_IF_ERROR(ParseArguments(*call));
      ASSIGN_OR_RETURN(node, ParseMember(std::move(call)));
    }
    return node;
  }
  // Appends "(a, b, key=c)" to node's children and names.
  absl::Status ParseArguments(Node& node) {
    if (node.names.size() < node.children.size()) node.names.resize(node.children.size());
    ++current_;  // (
    while (!Is(Tok::kCloseParen)) {
      if (current_ >= tokens_.size()) return LineError(node.line, "unclosed argument list");
      std::string name;
      if (Is(Tok::kIdentifier) && Is(Tok::kEquals, 1)) {
        name = tokens_[current_].value;
        current_ += 2;
      } else if (Is(Tok::kMultiplicative) || Is(Tok::kPower)) {
        return LineError(Line(), "unsupported: * and ** argument unpacking");
      }
      ASSIGN_OR_RETURN(NodePtr value, ParseExpression());
      node.children.push_back(std::move(value));
      node.names.push_back(std::move(name));
      if (Is(Tok::kComma))
        ++current_;
      else if (!Is(Tok::kCloseParen))
        return LineError(Line(), "expected , or ) in the arguments");
    }
    ++current_;
    return absl::OkStatus();
  }
  absl::StatusOr<NodePtr> ParseMember(NodePtr object) {
    while (Is(Tok::kDot) || Is(Tok::kOpenSquare)) {
      const int line = Line();
      const bool computed = Is(Tok::kOpenSquare);
      ++current_;
      if (computed) {
        // Either an index or a slice [start:stop:step].
        std::vector<NodePtr> parts(1);
        bool slice = false;
        while (!Is(Tok::kCloseSquare)) {
          if (current_ >= tokens_.size()) return LineError(line, "unclosed [");
          if (Is(Tok::kColon)) {
            slice = true;
            parts.emplace_back();
            ++current_;
            continue;
          }
          ASSIGN_OR_RETURN(parts.back(), ParseExpression());
        }
        ++current_;
        if (slice) {
          if (parts.size() > 3) return LineError(line, "a slice takes at most three parts");
          parts.resize(3);
          NodePtr node = MakeNode(Kind::kSlice, line);
          node->children.push_back(std::move(object));
          for (auto& part : parts) node->children.push_back(std::move(part));
          object = std::move(node);
          continue;
        }
        if (parts[0] == nullptr) return LineError(line, "empty []");
        NodePtr node = MakeNode(Kind::kMember, line);
        node->computed = true;
        node->children.push_back(std::move(object));
        node->children.push_back(std::move(parts[0]));
        object = std::move(node);
      } else {
        ASSIGN_OR_RETURN(NodePtr property, ParsePrimary());
        if (property->kind != Kind::kIdentifier && property->kind != Kind::kInteger) {
          return LineError(line, "expected a name after '.'");
        }
        NodePtr node = MakeNode(Kind::kMember, line);
        node->children.push_back(std::move(object));
        node->children.push_back(std::move(property));
        object = std::move(node);
      }
    }
    return object;
  }
  absl::StatusOr<NodePtr> ParsePrimary() {
    if (current_ >= tokens_.size()) return LineError(Line(), "unexpected end of template");
    const Token& token = tokens_[current_++];
    switch (token.type) {
      case Tok::kNumber: {
        if (token.value.find('.') != std::string::npos) {
          NodePtr node = MakeNode(Kind::kFloat, token.line);
          node->number = std::stod(token.value);
          return node;
        }
        NodePtr node = MakeNode(Kind::kInteger, token.line);
        node->integer = std::stoll(token.value);
        return node;
      }
      case Tok::kString: {
        NodePtr node = MakeNode(Kind::kString, token.line);
        node->value = token.value;
        while (Is(Tok::kString)) node->value += tokens_[current_++].value;
        return node;
      }
      case Tok::kIdentifier: {
        NodePtr node = MakeNode(Kind::kIdentifier, token.line);
        node->value = token.value;
        return node;
      }
      case Tok::kOpenParen: {
        ASSIGN_OR_RETURN(NodePtr inner, ParseSequence(false));
        RETURN_IF_ERROR(Expect(Tok::kCloseParen, "closing parenthesis"));
        return inner;
      }
      case Tok::kOpenSquare: {
        NodePtr node = MakeNode(Kind::kList, token.line);
        while (!Is(Tok::kCloseSquare)) {
          if (current_ >= tokens_.size()) return LineError(token.line, "unclosed [");
          ASSIGN_OR_RETURN(NodePtr item, ParseExpression());
          node->children.push_back(std::move(item));
          if (Is(Tok::kComma)) ++current_;
        }
        ++current_;
        return node;
      }
      case Tok::kOpenCurly: {
        NodePtr node = MakeNode(Kind::kDict, token.line);
        while (!Is(Tok::kCloseCurly)) {
          if (current_ >= tokens_.size()) return LineError(token.line, "unclosed {");
          ASSIGN_OR_RETURN(NodePtr key, ParseExpression());
          RETURN_IF_ERROR(Expect(Tok::kColon, "':' between key and value"));
          ASSIGN_OR_RETURN(NodePtr value, ParseExpression());
          node->children.push_back(std::move(key));
          node->children.push_back(std::move(value));
          if (Is(Tok::kComma)) ++current_;
        }
        ++current_;
        return node;
      }
      default:
        return LineError(token.line, "unexpected token in an expression");
    }
  }

  std::vector<Token> tokens_;
  size_t current_ = 0;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const ProgramNode>> ParseProgram(absl::string_view source) {
  ASSIGN_OR_RETURN(std::vector<Token> tokens, Tokenize(source));
  Parser parser(std::move(tokens));
  auto program = std::make_shared<ProgramNode>();
  ASSIGN_OR_RETURN(program->body, parser.ParseProgram());
  return std::shared_ptr<const ProgramNode>(std::move(program));
}

}  // namespace pinfer::chat
