// The chat template engine's values and interpreter (see template.h). Semantics follow Hugging
// Face's JavaScript renderer (npm @huggingface/jinja), the reference the tests compare against:
// lenient undefined (a missing key is undefined, not an error), JavaScript-style printing of
// values (true, 1.0 as "1.0" but "1" inside +), loose == and JSON-shaped output of lists and
// dicts. Loops get their own scope; if blocks share the enclosing one, as in Jinja.
#include "shared/chat/template.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <functional>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "shared/chat/template_syntax.h"
#include "shared/util/status_macros.h"

namespace pinfer::chat {
namespace {

struct Value;
using Array = std::vector<Value>;
using Entries = std::vector<std::pair<std::string, Value>>;  // ordered, as JSON objects are
struct Arguments {
  std::vector<Value> positional;
  Entries keyword;
};
using Function = std::function<absl::StatusOr<Value>(const Arguments&, int line)>;

struct Value {
  enum class Type {
    kUndefined,
    kNull,
    kBool,
    kInt,
    kFloat,
    kString,
    kArray,
    kObject,
    kNamespace,
    kFunction
  };
  Type type = Type::kUndefined;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string string;
  std::shared_ptr<Array> array;
  std::shared_ptr<Entries> object;  // kObject and kNamespace
  std::shared_ptr<Function> function;

  static Value Null() { return Of(Type::kNull); }
  static Value Bool(bool b) {
    Value v = Of(Type::kBool);
    v.boolean = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v = Of(Type::kInt);
    v.integer = i;
    return v;
  }
  static Value Float(double d) {
    Value v = Of(Type::kFloat);
    v.number = d;
    return v;
  }
  static Value String(std::string s) {
    Value v = Of(Type::kString);
    v.string = std::move(s);
    return v;
  }
  static Value List(Array items) {
    Value v = Of(Type::kArray);
    v.array = std::make_shared<Array>(std::move(items));
    return v;
  }
  static Value Object(Entries entries, Type type = Type::kObject) {
    Value v = Of(type);
    v.object = std::make_shared<Entries>(std::move(entries));
    return v;
  }
  static Value Fn(Function f) {
    Value v = Of(Type::kFunction);
    v.function = std::make_shared<Function>(std::move(f));
    return v;
  }
  static Value Of(Type t) {
    Value v;
    v.type = t;
    return v;
  }

  bool Is(Type t) const { return type == t; }
  bool IsNumber() const { return type == Type::kInt || type == Type::kFloat; }
  bool IsMapping() const { return type == Type::kObject || type == Type::kNamespace; }
  double AsDouble() const { return type == Type::kInt ? static_cast<double>(integer) : number; }
  const Value* Find(absl::string_view key) const {
    if (!IsMapping()) return nullptr;
    for (const auto& [k, v] : *object) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};
using Type = Value::Type;

absl::string_view TypeName(const Value& v) {
  switch (v.type) {
    case Type::kUndefined:
      return "undefined";
    case Type::kNull:
      return "none";
    case Type::kBool:
      return "boolean";
    case Type::kInt:
      return "integer";
    case Type::kFloat:
      return "float";
    case Type::kString:
      return "string";
    case Type::kArray:
      return "list";
    case Type::kObject:
      return "dict";
    case Type::kNamespace:
      return "namespace";
    case Type::kFunction:
      return "function";
  }
  return "?";
}

Value FromJson(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::json::value_t::null:
      return Value::Null();
    case nlohmann::json::value_t::boolean:
      return Value::Bool(json.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::Int(json.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      return Value::Int(static_cast<int64_t>(json.get<uint64_t>()));
    case nlohmann::json::value_t::number_float:
      return Value::Float(json.get<double>());
    case nlohmann::json::value_t::string:
      return Value::String(json.get<std::string>());
    case nlohmann::json::value_t::array: {
      Array items;
      for (const auto& item : json) items.push_back(FromJson(item));
      return Value::List(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Entries entries;
      for (const auto& [key, item] : json.items()) entries.emplace_back(key, FromJson(item));
      return Value::Object(std::move(entries));
    }
    default:
      return Value();
  }
}

// JavaScript's Number.prototype.toString for the values templates meet.
std::string JsNumber(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  if (d == std::floor(d) && std::fabs(d) < 1e21) return absl::StrCat(static_cast<int64_t>(d));
  char buffer[64];
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), d);
  return std::string(buffer, end);
}

// JSON.stringify's string quoting (non-ASCII stays as is, as the reference's tojson does).
std::string JsonQuote(absl::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char hex[8];
          std::snprintf(hex, sizeof(hex), "\\u%04x", c);
          out += hex;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out + "\"";
}

absl::StatusOr<std::string> ToJson(const Value& v, int indent, int depth, bool undefined_as_null) {
  switch (v.type) {
    case Type::kUndefined:
      return std::string(undefined_as_null ? "null" : "undefined");
    case Type::kNull:
      return std::string("null");
    case Type::kBool:
      return std::string(v.boolean ? "true" : "false");
    case Type::kInt:
      return absl::StrCat(v.integer);
    case Type::kFloat:
      return std::isfinite(v.number) ? JsNumber(v.number) : "null";
    case Type::kString:
      return JsonQuote(v.string);
    case Type::kArray:
    case Type::kObject:
    case Type::kNamespace: {
      const std::string item_separator = indent > 0 ? "," : ", ";
      const std::string pad = "\n" + std::string(static_cast<size_t>(indent * depth), ' ');
      const std::string child_pad = pad + std::string(static_cast<size_t>(indent), ' ');
      std::vector<std::string> core;
      if (v.Is(Type::kArray)) {
        for (const Value& item : *v.array) {
          ASSIGN_OR_RETURN(std::string s, ToJson(item, indent, depth + 1, undefined_as_null));
          core.push_back(std::move(s));
        }
        if (indent > 0 && !core.empty()) {
          return absl::StrCat("[", child_pad, absl::StrJoin(core, item_separator + child_pad), pad,
                              "]");
        }
        return absl::StrCat("[", absl::StrJoin(core, item_separator), "]");
      }
      for (const auto& [key, item] : *v.object) {
        ASSIGN_OR_RETURN(std::string s, ToJson(item, indent, depth + 1, undefined_as_null));
        core.push_back(absl::StrCat(indent > 0 ? child_pad : "", JsonQuote(key), ": ", s));
      }
      if (indent > 0 && !core.empty()) {
        return absl::StrCat("{", absl::StrJoin(core, item_separator), pad, "}");
      }
      return absl::StrCat("{", absl::StrJoin(core, item_separator), "}");
    }
    case Type::kFunction:
      return absl::InvalidArgumentError("cannot convert a function to JSON");
  }
  return std::string();
}

// The text a value prints as in {{ }} (the reference's toString()).
absl::StatusOr<std::string> Print(const Value& v) {
  switch (v.type) {
    case Type::kUndefined:
      return std::string();
    case Type::kNull:
      return std::string("null");
    case Type::kBool:
      return std::string(v.boolean ? "true" : "false");
    case Type::kInt:
      return absl::StrCat(v.integer);
    case Type::kFloat:
      if (v.number == std::floor(v.number) && std::isfinite(v.number)) {
        return absl::StrCat(JsNumber(v.number), ".0");
      }
      return JsNumber(v.number);
    case Type::kString:
      return v.string;
    default:
      return ToJson(v, 0, 0, false);
  }
}

// The text a value contributes to + and ~ (the reference concatenates raw JavaScript values).
absl::StatusOr<std::string> Concatenable(const Value& v) {
  switch (v.type) {
    case Type::kFloat:
      return JsNumber(v.number);
    case Type::kString:
    case Type::kInt:
    case Type::kBool:
    case Type::kNull:
      return Print(v);
    default:
      return absl::InvalidArgumentError(absl::StrCat("cannot concatenate a ", TypeName(v)));
  }
}

bool Truthy(const Value& v) {
  switch (v.type) {
    case Type::kUndefined:
    case Type::kNull:
      return false;
    case Type::kBool:
      return v.boolean;
    case Type::kInt:
      return v.integer != 0;
    case Type::kFloat:
      return v.number != 0 && !std::isnan(v.number);
    case Type::kString:
      return !v.string.empty();
    case Type::kArray:
      return !v.array->empty();
    case Type::kObject:
      return !v.object->empty();
    default:
      return true;
  }
}

// JavaScript's loose == on the values' payloads, which is what the reference compares.
bool LooseEquals(const Value& a, const Value& b) {
  const bool a_nullish = a.Is(Type::kNull) || a.Is(Type::kUndefined);
  const bool b_nullish = b.Is(Type::kNull) || b.Is(Type::kUndefined);
  if (a_nullish || b_nullish) return a_nullish && b_nullish;
  auto numeric = [](const Value& v, double* out) {
    if (v.IsNumber())
      *out = v.AsDouble();
    else if (v.Is(Type::kBool))
      *out = v.boolean ? 1 : 0;
    else
      return false;
    return true;
  };
  double x, y;
  if (numeric(a, &x) && numeric(b, &y)) return x == y;
  if (a.type != b.type) {
    const Value& s = a.Is(Type::kString) ? a : b;
    const Value& o = a.Is(Type::kString) ? b : a;
    if (s.Is(Type::kString) && numeric(o, &y)) {
      char* end = nullptr;
      const double parsed = s.string.empty() ? 0 : std::strtod(s.string.c_str(), &end);
      return (s.string.empty() || *end == '\0') && parsed == y;
    }
    return false;
  }
  switch (a.type) {
    case Type::kString:
      return a.string == b.string;
    case Type::kArray:
      return a.array == b.array;
    case Type::kFunction:
      return a.function == b.function;
    default:
      return a.object == b.object;
  }
}

// JavaScript's === on payloads (the reference's list membership).
bool StrictEquals(const Value& a, const Value& b) {
  if (a.IsNumber() && b.IsNumber()) return a.AsDouble() == b.AsDouble();
  if (a.type != b.type) return false;
  switch (a.type) {
    case Type::kUndefined:
    case Type::kNull:
      return true;
    case Type::kBool:
      return a.boolean == b.boolean;
    case Type::kString:
      return a.string == b.string;
    default:
      return LooseEquals(a, b);
  }
}

std::string AsciiUpper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return s;
}
std::string AsciiLower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}
bool IsJsSpace(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
std::string Strip(absl::string_view s, bool left, bool right) {
  size_t begin = 0, end = s.size();
  if (left) {
    while (begin < end && IsJsSpace(s[begin])) ++begin;
  }
  if (right) {
    while (end > begin && IsJsSpace(s[end - 1])) --end;
  }
  return std::string(s.substr(begin, end - begin));
}
// /\b\w/g -> upper case: the first word character after a non-word one.
std::string TitleCase(std::string s) {
  auto word = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  };
  for (size_t i = 0; i < s.size(); ++i) {
    if (word(s[i]) && (i == 0 || !word(s[i - 1])) && s[i] >= 'a' && s[i] <= 'z') {
      s[i] = static_cast<char>(s[i] - 'a' + 'A');
    }
  }
  return s;
}
std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count) {
  if (count == 0) return s;
  if (count < 0) count = INT64_MAX;
  std::string out;
  if (from.empty()) {
    for (size_t i = 0; i <= s.size(); ++i) {
      if (count > 0) {
        out += to;
        --count;
      }
      if (i < s.size()) out.push_back(s[i]);
    }
    return out;
  }
  size_t pos = 0;
  while (count > 0) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
    --count;
  }
  out.append(s, pos);
  return out;
}

// Python's slice arithmetic, as the reference's slice().
template <typename Item, typename Sequence>
std::vector<Item> SliceOf(const Sequence& seq, std::optional<int64_t> start,
                          std::optional<int64_t> stop, int64_t step) {
  const int64_t n = static_cast<int64_t>(seq.size());
  std::vector<Item> out;
  if (step > 0) {
    int64_t a = start.value_or(0), b = stop.value_or(n);
    a = a < 0 ? std::max(n + a, int64_t{0}) : std::min(a, n);
    b = b < 0 ? std::max(n + b, int64_t{0}) : std::min(b, n);
    for (int64_t i = a; i < b; i += step) out.push_back(seq[static_cast<size_t>(i)]);
  } else {
    int64_t a = start.value_or(n - 1), b = stop.value_or(-1);
    a = a < 0 ? std::max(n + a, int64_t{-1}) : std::min(a, n - 1);
    b = b < -1 ? std::max(n + b, int64_t{-1}) : std::min(b, n - 1);
    for (int64_t i = a; i > b; i += step) out.push_back(seq[static_cast<size_t>(i)]);
  }
  return out;
}

struct Scope {
  std::shared_ptr<Scope> parent;
  std::unordered_map<std::string, Value> variables;

  const Value* Lookup(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
      auto it = s->variables.find(name);
      if (it != s->variables.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { kNormal, kBreak, kContinue };

const Value* Keyword(const Arguments& args, absl::string_view name) {
  for (const auto& [key, value] : args.keyword) {
    if (key == name) return &value;
  }
  return nullptr;
}
// Positional argument i, else the keyword `name`, else null.
const Value* Argument(const Arguments& args, size_t i, absl::string_view name) {
  if (i < args.positional.size()) return &args.positional[i];
  return Keyword(args, name);
}

std::string StrftimeNow(const std::string& format) {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buffer[256];
  const size_t n = std::strftime(buffer, sizeof(buffer), format.c_str(), &local);
  return std::string(buffer, n);
}

class Interpreter {
 public:
  absl::Status RenderBlock(const std::vector<NodePtr>& block, const ScopePtr& scope,
                           std::string& out, Flow& flow) {
    for (const NodePtr& node : block) {
      switch (node->kind) {
        case Kind::kText:
          out += node->value;
          break;
        case Kind::kComment:
          break;
        case Kind::kIf: {
          ASSIGN_OR_RETURN(Value test, Evaluate(*node->children[0], scope));
          RETURN_IF_ERROR(
              RenderBlock(Truthy(test) ? node->body : node->alternate, scope, out, flow));
          if (flow != Flow::kNormal) return absl::OkStatus();
          break;
        }
        case Kind::kFor:
          RETURN_IF_ERROR(RenderFor(*node, scope, out));
          break;
        case Kind::kSet: {
          ASSIGN_OR_RETURN(Value value, Evaluate(*node->children[1], scope));
          RETURN_IF_ERROR(Assign(*node->children[0], std::move(value), scope));
          break;
        }
        case Kind::kSetBlock: {
          std::string text;
          Flow inner = Flow::kNormal;
          RETURN_IF_ERROR(RenderBlock(node->body, scope, text, inner));
          scope->variables[node->children[0]->value] = Value::String(std::move(text));
          break;
        }
        case Kind::kMacro:
          DefineMacro(*node, scope);
          break;
        case Kind::kBreak:
          flow = Flow::kBreak;
          return absl::OkStatus();
        case Kind::kContinue:
          flow = Flow::kContinue;
          return absl::OkStatus();
        default: {
          ASSIGN_OR_RETURN(Value value, Evaluate(*node, scope));
          if (!value.Is(Type::kNull) && !value.Is(Type::kUndefined)) {
            auto text = Print(value);
            if (!text.ok()) return LineError(node->line, text.status().message());
            out += *text;
          }
        }
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Assign(const Node& target, Value value, const ScopePtr& scope) {
    if (target.kind == Kind::kIdentifier) {
      scope->variables[target.value] = std::move(value);
      return absl::OkStatus();
    }
    if (target.kind == Kind::kTuple) {
      if (!value.Is(Type::kArray) || value.array->size() != target.children.size()) {
        return LineError(target.line, "cannot unpack the value into the names in set");
      }
      for (size_t i = 0; i < target.children.size(); ++i) {
        RETURN_IF_ERROR(Assign(*target.children[i], (*value.array)[i], scope));
      }
      return absl::OkStatus();
    }
    if (target.kind == Kind::kMember && !target.computed) {
      ASSIGN_OR_RETURN(Value object, Evaluate(*target.children[0], scope));
      if (!object.Is(Type::kNamespace)) {
        return LineError(target.line, "cannot assign an attribute of anything but a namespace");
      }
      const std::string& key = target.children[1]->value;
      for (auto& [k, v] : *object.object) {
        if (k == key) {
          v = std::move(value);
          return absl::OkStatus();
        }
      }
      object.object->emplace_back(key, std::move(value));
      return absl::OkStatus();
    }
    return LineError(target.line, "unsupported assignment target in set");
  }

  void DefineMacro(const Node& node, const ScopePtr& scope) {
    const Node* macro = &node;
    ScopePtr defined_in = scope;
    scope->variables[node.value] =
        Value::Fn([this, macro, defined_in](const Arguments& args, int) -> absl::StatusOr<Value> {
          auto local = std::make_shared<Scope>();
          local->parent = defined_in;
          for (size_t i = 0; i < macro->names.size(); ++i) {
            const Value* given = Argument(args, i, macro->names[i]);
            if (given != nullptr) {
              local->variables[macro->names[i]] = *given;
            } else if (macro->children[i] != nullptr) {
              ASSIGN_OR_RETURN(local->variables[macro->names[i]],
                               Evaluate(*macro->children[i], local));
            } else {
              local->variables[macro->names[i]] = Value();
            }
          }
          std::string text;
          Flow flow = Flow::kNormal;
          RETURN_IF_ERROR(RenderBlock(macro->body, local, text, flow));
          return Value::String(std::move(text));
        });
  }

  absl::Status RenderFor(const Node& node, const ScopePtr& outer, std::string& out) {
    auto scope = std::make_shared<Scope>();
    scope->parent = outer;
    ASSIGN_OR_RETURN(Value iterable, Evaluate(*node.children[1], scope));
    Array candidates;
    if (iterable.Is(Type::kArray)) {
      candidates = *iterable.array;
    } else if (iterable.Is(Type::kObject)) {
      for (const auto& [key, value] : *iterable.object) candidates.push_back(Value::String(key));
    } else {
      return LineError(node.line, absl::StrCat("cannot loop over a ", TypeName(iterable)));
    }
    const Node& loop_variable = *node.children[0];
    Array items;
    for (Value& item : candidates) {
      if (node.children[2] != nullptr) {
        auto test_scope = std::make_shared<Scope>();
        test_scope->parent = scope;
        RETURN_IF_ERROR(Assign(loop_variable, item, test_scope));
        ASSIGN_OR_RETURN(Value keep, Evaluate(*node.children[2], test_scope));
        if (!Truthy(keep)) continue;
      }
      items.push_back(std::move(item));
    }
    bool iterated = false;
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      Entries loop = {{"index", Value::Int(i + 1)},
                      {"index0", Value::Int(i)},
                      {"revindex", Value::Int(n - i)},
                      {"revindex0", Value::Int(n - i - 1)},
                      {"first", Value::Bool(i == 0)},
                      {"last", Value::Bool(i == n - 1)},
                      {"length", Value::Int(n)},
                      {"previtem", i > 0 ? items[i - 1] : Value()},
                      {"nextitem", i < n - 1 ? items[i + 1] : Value()}};
      scope->variables["loop"] = Value::Object(std::move(loop));
      RETURN_IF_ERROR(Assign(loop_variable, items[i], scope));
      // As in the reference, break and continue drop what their iteration had rendered so far.
      Flow flow = Flow::kNormal;
      std::string body;
      RETURN_IF_ERROR(RenderBlock(node.body, scope, body, flow));
      if (flow == Flow::kBreak) break;
      if (flow == Flow::kContinue) continue;
      out += body;
      iterated = true;
    }
    if (!iterated) {
      Flow flow = Flow::kNormal;
      RETURN_IF_ERROR(RenderBlock(node.alternate, scope, out, flow));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Arguments> EvaluateArguments(const Node& node, size_t first,
                                              const ScopePtr& scope) {
    Arguments args;
    for (size_t i = first; i < node.children.size(); ++i) {
      ASSIGN_OR_RETURN(Value value, Evaluate(*node.children[i], scope));
      const std::string& name = i < node.names.size() ? node.names[i] : std::string();
      if (name.empty())
        args.positional.push_back(std::move(value));
      else
        args.keyword.emplace_back(name, std::move(value));
    }
    return args;
  }

  absl::StatusOr<Value> Evaluate(const Node& node, const ScopePtr& scope) {
    switch (node.kind) {
      case Kind::kString:
        return Value::String(node.value);
      case Kind::kInteger:
        return Value::Int(node.integer);
      case Kind::kFloat:
        return Value::Float(node.number);
      case Kind::kIdentifier: {
        const Value* value = scope->Lookup(node.value);
        return value ? *value : Value();
      }
      case Kind::kList:
      case Kind::kTuple: {
        Array items;
        for (const NodePtr& child : node.children) {
          ASSIGN_OR_RETURN(Value item, Evaluate(*child, scope));
          items.push_back(std::move(item));
        }
        return Value::List(std::move(items));
      }
      case Kind::kDict: {
        Entries entries;
        for (size_t i = 0; i + 1 < node.children.size(); i += 2) {
          ASSIGN_OR_RETURN(Value key, Evaluate(*node.children[i], scope));
          ASSIGN_OR_RETURN(Value value, Evaluate(*node.children[i + 1], scope));
          if (!key.Is(Type::kString)) return LineError(node.line, "dict keys must be strings");
          entries.emplace_back(key.string, std::move(value));
        }
        return Value::Object(std::move(entries));
      }
      case Kind::kUnary: {
        ASSIGN_OR_RETURN(Value operand, Evaluate(*node.children[0], scope));
        if (node.value == "not") return Value::Bool(!Truthy(operand));
        if (operand.Is(Type::kInt))
          return Value::Int(node.value == "-" ? -operand.integer : operand.integer);
        if (operand.Is(Type::kFloat))
          return Value::Float(node.value == "-" ? -operand.number : operand.number);
        return LineError(node.line, absl::StrCat("unary ", node.value, " needs a number, got a ",
                                                 TypeName(operand)));
      }
      case Kind::kTernary: {
        ASSIGN_OR_RETURN(Value test, Evaluate(*node.children[1], scope));
        if (Truthy(test)) return Evaluate(*node.children[0], scope);
        if (node.children[2] == nullptr) return Value();
        return Evaluate(*node.children[2], scope);
      }
      case Kind::kBinary:
        return EvaluateBinary(node, scope);
      case Kind::kMember:
        return EvaluateMember(node, scope);
      case Kind::kSlice: {
        ASSIGN_OR_RETURN(Value object, Evaluate(*node.children[0], scope));
        std::optional<int64_t> part[3];
        for (int i = 0; i < 3; ++i) {
          if (node.children[i + 1] == nullptr) continue;
          ASSIGN_OR_RETURN(Value v, Evaluate(*node.children[i + 1], scope));
          if (!v.Is(Type::kInt)) return LineError(node.line, "slice bounds must be integers");
          part[i] = v.integer;
        }
        const int64_t step = part[2].value_or(1);
        if (step == 0) return LineError(node.line, "slice step cannot be zero");
        if (object.Is(Type::kArray))
          return Value::List(SliceOf<Value>(*object.array, part[0], part[1], step));
        if (object.Is(Type::kString)) {
          std::vector<char> chars = SliceOf<char>(object.string, part[0], part[1], step);
          return Value::String(std::string(chars.begin(), chars.end()));
        }
        return LineError(node.line, absl::StrCat("cannot slice a ", TypeName(object)));
      }
      case Kind::kCall: {
        ASSIGN_OR_RETURN(Value callee, Evaluate(*node.children[0], scope));
        ASSIGN_OR_RETURN(Arguments args, EvaluateArguments(node, 1, scope));
        if (!callee.Is(Type::kFunction)) {
          return LineError(node.line, absl::StrCat("cannot call a ", TypeName(callee)));
        }
        auto result = (*callee.function)(args, node.line);
        if (!result.ok() && result.status().message().rfind("chat template line", 0) != 0) {
          return LineError(node.line, result.status().message());
        }
        return result;
      }
      case Kind::kFilter: {
        ASSIGN_OR_RETURN(Value operand, Evaluate(*node.children[0], scope));
        ASSIGN_OR_RETURN(Arguments args, EvaluateArguments(node, 1, scope));
        auto result =
            ApplyFilter(node.value, operand, args, node.children.size() > 1 || !node.names.empty());
        if (!result.ok()) return LineError(node.line, result.status().message());
        return result;
      }
      case Kind::kTest: {
        ASSIGN_OR_RETURN(Value operand, Evaluate(*node.children[0], scope));
        auto result = ApplyTest(node.value, operand);
        if (!result.ok()) return LineError(node.line, result.status().message());
        return Value::Bool(*result != node.negate);
      }
      default:
        return LineError(node.line, "statement used as an expression");
    }
  }

  absl::StatusOr<Value> EvaluateBinary(const Node& node, const ScopePtr& scope) {
    const std::string& op = node.value;
    ASSIGN_OR_RETURN(Value left, Evaluate(*node.children[0], scope));
    if (op == "and") return Truthy(left) ? Evaluate(*node.children[1], scope) : left;
    if (op == "or") return Truthy(left) ? left : Evaluate(*node.children[1], scope);
    ASSIGN_OR_RETURN(Value right, Evaluate(*node.children[1], scope));
    if (op == "==") return Value::Bool(LooseEquals(left, right));
    if (op == "!=") return Value::Bool(!LooseEquals(left, right));
    auto fail = [&](absl::string_view why) { return LineError(node.line, why); };
    if (left.IsNumber() && right.IsNumber() && op != "~" && op != "**") {
      const bool is_float = left.Is(Type::kFloat) || right.Is(Type::kFloat);
      const double a = left.AsDouble(), b = right.AsDouble();
      auto number = [&](double r) {
        return is_float ? Value::Float(r) : Value::Int(static_cast<int64_t>(r));
      };
      if (op == "+")
        return is_float ? Value::Float(a + b) : Value::Int(left.integer + right.integer);
      if (op == "-")
        return is_float ? Value::Float(a - b) : Value::Int(left.integer - right.integer);
      if (op == "*")
        return is_float ? Value::Float(a * b) : Value::Int(left.integer * right.integer);
      if (op == "/") return Value::Float(a / b);
      if (op == "//") {
        if (b == 0) return fail("integer division by zero");
        return number(std::floor(a / b));
      }
      if (op == "%") {
        if (!is_float && right.integer == 0) return fail("modulo by zero");
        return is_float ? Value::Float(std::fmod(a, b)) : Value::Int(left.integer % right.integer);
      }
      if (op == "<") return Value::Bool(a < b);
      if (op == ">") return Value::Bool(a > b);
      if (op == "<=") return Value::Bool(a <= b);
      if (op == ">=") return Value::Bool(a >= b);
    }
    if (left.Is(Type::kUndefined) || right.Is(Type::kUndefined)) {
      if (right.Is(Type::kUndefined) && (op == "in" || op == "not in"))
        return Value::Bool(op == "not in");
      if (op == "~" && !left.Is(Type::kNull) && !right.Is(Type::kNull)) {
        std::string text;
        for (const Value* v : {&left, &right}) {
          if (v->Is(Type::kUndefined)) continue;
          auto s = Concatenable(*v);
          if (!s.ok()) return fail(s.status().message());
          text += *s;
        }
        return Value::String(std::move(text));
      }
      return fail(absl::StrCat("cannot apply ", op, " to an undefined value"));
    }
    if (left.Is(Type::kNull) || right.Is(Type::kNull)) {
      return fail(absl::StrCat("cannot apply ", op, " to none"));
    }
    if (op == "~" || (op == "+" && (left.Is(Type::kString) || right.Is(Type::kString)))) {
      auto a = Concatenable(left);
      auto b = Concatenable(right);
      if (!a.ok()) return fail(a.status().message());
      if (!b.ok()) return fail(b.status().message());
      return Value::String(*a + *b);
    }
    if (op == "**" && (left.IsNumber() || left.Is(Type::kBool)) &&
        (right.IsNumber() || right.Is(Type::kBool))) {
      const double a = left.Is(Type::kBool) ? (left.boolean ? 1 : 0) : left.AsDouble();
      const double b = right.Is(Type::kBool) ? (right.boolean ? 1 : 0) : right.AsDouble();
      if (a == 0 && b < 0) return fail("0.0 cannot be raised to a negative power");
      const double result = std::pow(a, b);
      if (!std::isfinite(result)) return fail("exponentiation result is not a finite real number");
      if (left.Is(Type::kFloat) || right.Is(Type::kFloat) || b < 0) return Value::Float(result);
      return Value::Int(static_cast<int64_t>(result));
    }
    if (op == "+" && left.Is(Type::kArray) && right.Is(Type::kArray)) {
      Array joined = *left.array;
      joined.insert(joined.end(), right.array->begin(), right.array->end());
      return Value::List(std::move(joined));
    }
    if (op == "in" || op == "not in") {
      bool member = false;
      if (right.Is(Type::kArray)) {
        member = std::any_of(right.array->begin(), right.array->end(),
                             [&](const Value& x) { return StrictEquals(x, left); });
      } else if (left.Is(Type::kString) && right.Is(Type::kString)) {
        member = right.string.find(left.string) != std::string::npos;
      } else if (left.Is(Type::kString) && right.Is(Type::kObject)) {
        member = right.Find(left.string) != nullptr;
      } else {
        return fail(absl::StrCat("cannot test membership of a ", TypeName(left), " in a ",
                                 TypeName(right)));
      }
      return Value::Bool(member == (op == "in"));
    }
    return fail(absl::StrCat("unsupported operator ", op, " between a ", TypeName(left), " and a ",
                             TypeName(right)));
  }

  absl::StatusOr<Value> EvaluateMember(const Node& node, const ScopePtr& scope) {
    ASSIGN_OR_RETURN(Value object, Evaluate(*node.children[0], scope));
    Value property;
    if (node.computed) {
      ASSIGN_OR_RETURN(property, Evaluate(*node.children[1], scope));
    } else if (node.children[1]->kind == Kind::kInteger) {
      property = Value::Int(node.children[1]->integer);
    } else {
      property = Value::String(node.children[1]->value);
    }
    if (object.IsMapping()) {
      if (!property.Is(Type::kString)) return LineError(node.line, "dict keys must be strings");
      if (const Value* found = object.Find(property.string)) return *found;
      if (object.Is(Type::kObject)) return ObjectMethod(object, property.string);
      return Value();
    }
    if (object.Is(Type::kArray) || object.Is(Type::kString)) {
      if (property.Is(Type::kInt)) {
        const int64_t n = static_cast<int64_t>(object.Is(Type::kArray) ? object.array->size()
                                                                       : object.string.size());
        const int64_t i = property.integer < 0 ? n + property.integer : property.integer;
        if (i < 0 || i >= n) return Value();
        if (object.Is(Type::kArray)) return (*object.array)[static_cast<size_t>(i)];
        return Value::String(std::string(1, object.string[static_cast<size_t>(i)]));
      }
      if (property.Is(Type::kString) && object.Is(Type::kString)) {
        return StringMethod(object.string, property.string);
      }
      if (property.Is(Type::kString)) return Value();
      return LineError(node.line, "list indices must be integers");
    }
    return Value();
  }

  static Value ObjectMethod(const Value& object, const std::string& name) {
    auto entries = object.object;
    if (name == "items" || name == "keys" || name == "values") {
      return Value::Fn([entries, name](const Arguments&, int) -> absl::StatusOr<Value> {
        Array out;
        for (const auto& [k, v] : *entries) {
          if (name == "items")
            out.push_back(Value::List({Value::String(k), v}));
          else if (name == "keys")
            out.push_back(Value::String(k));
          else
            out.push_back(v);
        }
        return Value::List(std::move(out));
      });
    }
    if (name == "get") {
      return Value::Fn([object](const Arguments& args, int) -> absl::StatusOr<Value> {
        const Value* key = Argument(args, 0, "key");
        if (key == nullptr || !key->Is(Type::kString)) {
          return absl::InvalidArgumentError("get() needs a string key");
        }
        if (const Value* found = object.Find(key->string)) return *found;
        const Value* fallback = Argument(args, 1, "default");
        return fallback ? *fallback : Value::Null();
      });
    }
    return Value();
  }

  static Value StringMethod(const std::string& s, const std::string& name) {
    if (name == "length") return Value::Int(static_cast<int64_t>(s.size()));
    static const char* kMethods[] = {"upper",    "lower", "strip",      "lstrip",
                                     "rstrip",   "title", "capitalize", "startswith",
                                     "endswith", "split", "replace"};
    if (std::find(std::begin(kMethods), std::end(kMethods), name) == std::end(kMethods)) {
      return Value();
    }
    return Value::Fn([s, name](const Arguments& args, int) -> absl::StatusOr<Value> {
      if (name == "upper") return Value::String(AsciiUpper(s));
      if (name == "lower") return Value::String(AsciiLower(s));
      if (name == "title") return Value::String(TitleCase(s));
      if (name == "capitalize") {
        std::string out = s;
        if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 32);
        return Value::String(out);
      }
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        // The reference strips whitespace only and ignores a `chars` argument.
        return Value::String(Strip(s, name != "rstrip", name != "lstrip"));
      }
      if (name == "startswith" || name == "endswith") {
        const Value* arg = Argument(args, 0, "prefix");
        Array options;
        if (arg && arg->Is(Type::kString))
          options.push_back(*arg);
        else if (arg && arg->Is(Type::kArray))
          options = *arg->array;
        else
          return absl::InvalidArgumentError(absl::StrCat(name, "() needs a string"));
        for (const Value& o : options) {
          if (!o.Is(Type::kString)) continue;
          const std::string& p = o.string;
          if (p.size() <= s.size() &&
              (name == "startswith" ? s.compare(0, p.size(), p) == 0
                                    : s.compare(s.size() - p.size(), p.size(), p) == 0)) {
            return Value::Bool(true);
          }
        }
        return Value::Bool(false);
      }
      if (name == "split") {
        const Value* sep = Argument(args, 0, "sep");
        const Value* max = Argument(args, 1, "maxsplit");
        int64_t remaining = max && max->Is(Type::kInt) ? max->integer : -1;
        Array parts;
        if (sep == nullptr || sep->Is(Type::kNull)) {
          size_t i = 0;
          while (i < s.size()) {
            while (i < s.size() && IsJsSpace(s[i])) ++i;
            if (i >= s.size()) break;
            if (remaining == 0) {
              parts.push_back(Value::String(Strip(s.substr(i), false, true)));
              break;
            }
            size_t j = i;
            while (j < s.size() && !IsJsSpace(s[j])) ++j;
            parts.push_back(Value::String(s.substr(i, j - i)));
            if (remaining > 0) --remaining;
            i = j;
          }
          return Value::List(std::move(parts));
        }
        if (!sep->Is(Type::kString) || sep->string.empty()) {
          return absl::InvalidArgumentError("split() needs a non-empty string separator");
        }
        size_t pos = 0;
        while (remaining != 0) {
          const size_t hit = s.find(sep->string, pos);
          if (hit == std::string::npos) break;
          parts.push_back(Value::String(s.substr(pos, hit - pos)));
          pos = hit + sep->string.size();
          if (remaining > 0) --remaining;
        }
        parts.push_back(Value::String(s.substr(pos)));
        return Value::List(std::move(parts));
      }
      // replace
      const Value* from = Argument(args, 0, "old");
      const Value* to = Argument(args, 1, "new");
      const Value* count = Argument(args, 2, "count");
      if (!from || !to || !from->Is(Type::kString) || !to->Is(Type::kString)) {
        return absl::InvalidArgumentError("replace() needs two strings");
      }
      return Value::String(Replace(s, from->string, to->string,
                                   count && count->Is(Type::kInt) ? count->integer : -1));
    });
  }

  static absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v) {
    if (name == "defined") return !v.Is(Type::kUndefined);
    if (name == "undefined") return v.Is(Type::kUndefined);
    if (name == "none") return v.Is(Type::kNull);
    if (name == "boolean") return v.Is(Type::kBool);
    if (name == "true") return v.Is(Type::kBool) && v.boolean;
    if (name == "false") return v.Is(Type::kBool) && !v.boolean;
    if (name == "string") return v.Is(Type::kString);
    if (name == "number") return v.IsNumber();
    if (name == "integer") return v.Is(Type::kInt);
    if (name == "float") return v.Is(Type::kFloat);
    if (name == "mapping") return v.Is(Type::kObject);
    if (name == "iterable" || name == "sequence") {
      return v.Is(Type::kArray) || v.Is(Type::kString) || v.Is(Type::kObject);
    }
    if (name == "callable") return v.Is(Type::kFunction);
    if (name == "odd" || name == "even") {
      if (!v.Is(Type::kInt))
        return absl::InvalidArgumentError(absl::StrCat("'", name, "' test needs an integer"));
      return (v.integer % 2 != 0) == (name == "odd");
    }
    if (name == "lower") return v.Is(Type::kString) && v.string == AsciiLower(v.string);
    if (name == "upper") return v.Is(Type::kString) && v.string == AsciiUpper(v.string);
    return absl::InvalidArgumentError(absl::StrCat("unsupported test '", name, "'"));
  }

  static absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& v,
                                           const Arguments& args, bool called) {
    if (name == "safe") return v;
    if (name == "tojson") {
      const Value* indent = Keyword(args, "indent");
      if (indent == nullptr && !args.positional.empty()) indent = &args.positional[0];
      ASSIGN_OR_RETURN(
          std::string json,
          ToJson(v, indent && indent->Is(Type::kInt) ? static_cast<int>(indent->integer) : 0, 0,
                 true));
      return Value::String(std::move(json));
    }
    if (name == "default" || name == "d") {
      const Value* fallback = Argument(args, 0, "default_value");
      const Value* boolean = Argument(args, 1, "boolean");
      const bool by_truth = boolean && Truthy(*boolean);
      if (v.Is(Type::kUndefined) || (by_truth && !Truthy(v)))
        return fallback ? *fallback : Value::String("");
      return v;
    }
    if (name == "string") {
      ASSIGN_OR_RETURN(std::string s, Print(v));
      return Value::String(std::move(s));
    }
    if (name == "length" || name == "count") {
      if (v.Is(Type::kString)) return Value::Int(static_cast<int64_t>(v.string.size()));
      if (v.Is(Type::kArray)) return Value::Int(static_cast<int64_t>(v.array->size()));
      if (v.Is(Type::kObject)) return Value::Int(static_cast<int64_t>(v.object->size()));
    }
    if (v.Is(Type::kString)) {
      if (name == "upper") return Value::String(AsciiUpper(v.string));
      if (name == "lower") return Value::String(AsciiLower(v.string));
      if (name == "title") return Value::String(TitleCase(v.string));
      if (name == "capitalize")
        return StringMethod(v.string, "capitalize").function->operator()(args, 0);
      if (name == "trim") return Value::String(Strip(v.string, true, true));
      if (name == "replace") return StringMethod(v.string, "replace").function->operator()(args, 0);
      if (name == "int") {
        char* end = nullptr;
        const long long parsed = std::strtoll(v.string.c_str(), &end, 10);
        if (end == v.string.c_str()) return Value::Int(0);
        return Value::Int(parsed);
      }
      if (name == "list") {
        Array chars;
        for (char c : v.string) chars.push_back(Value::String(std::string(1, c)));
        return Value::List(std::move(chars));
      }
    }
    if (v.Is(Type::kArray)) {
      const Array& items = *v.array;
      if (name == "first") return items.empty() ? Value() : items.front();
      if (name == "last") return items.empty() ? Value() : items.back();
      if (name == "list") return v;
      if (name == "reverse") return Value::List(Array(items.rbegin(), items.rend()));
      if (name == "join") {
        const Value* sep = Argument(args, 0, "d");
        std::string out;
        for (size_t i = 0; i < items.size(); ++i) {
          if (i > 0 && sep && sep->Is(Type::kString)) out += sep->string;
          ASSIGN_OR_RETURN(std::string s, Print(items[i]));
          out += s;
        }
        return Value::String(std::move(out));
      }
      if (name == "map") {
        const Value* attribute = Keyword(args, "attribute");
        if (attribute == nullptr || !attribute->Is(Type::kString)) {
          return absl::InvalidArgumentError("unsupported: map() other than map(attribute=...)");
        }
        Array out;
        for (const Value& item : items) {
          const Value* found = item.Find(attribute->string);
          out.push_back(found ? *found : Value());
        }
        return Value::List(std::move(out));
      }
      if (name == "selectattr" || name == "rejectattr") {
        const Value* attribute = Argument(args, 0, "attribute");
        if (attribute == nullptr || !attribute->Is(Type::kString)) {
          return absl::InvalidArgumentError(absl::StrCat(name, "() needs an attribute name"));
        }
        const Value* test = args.positional.size() > 1 ? &args.positional[1] : nullptr;
        const Value* operand = args.positional.size() > 2 ? &args.positional[2] : nullptr;
        Array out;
        for (const Value& item : items) {
          const Value* found = item.Find(attribute->string);
          const Value field = found ? *found : Value();
          bool pass;
          if (test == nullptr) {
            pass = Truthy(field);
          } else if (!test->Is(Type::kString)) {
            return absl::InvalidArgumentError("the test of selectattr must be a name");
          } else if (test->string == "equalto" || test->string == "==" || test->string == "eq") {
            pass = operand != nullptr && LooseEquals(field, *operand);
          } else {
            ASSIGN_OR_RETURN(pass, ApplyTest(test->string, field));
          }
          if (pass == (name == "selectattr")) out.push_back(item);
        }
        return Value::List(std::move(out));
      }
    }
    if (v.Is(Type::kObject) && (name == "items" || name == "dictsort")) {
      Array out;
      for (const auto& [k, x] : *v.object) out.push_back(Value::List({Value::String(k), x}));
      if (name == "dictsort") {
        std::sort(out.begin(), out.end(), [](const Value& a, const Value& b) {
          return AsciiLower((*a.array)[0].string) < AsciiLower((*b.array)[0].string);
        });
      }
      return Value::List(std::move(out));
    }
    if (v.IsNumber()) {
      if (name == "int") return Value::Int(static_cast<int64_t>(std::trunc(v.AsDouble())));
      if (name == "float") return Value::Float(v.AsDouble());
      if (name == "abs")
        return v.Is(Type::kInt) ? Value::Int(std::llabs(v.integer))
                                : Value::Float(std::fabs(v.number));
    }
    (void)called;
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported filter '", name, "' on a ", TypeName(v)));
  }
};

ScopePtr Globals() {
  auto scope = std::make_shared<Scope>();
  auto& g = scope->variables;
  g["true"] = g["True"] = Value::Bool(true);
  g["false"] = g["False"] = Value::Bool(false);
  g["none"] = g["None"] = Value::Null();
  g["raise_exception"] = Value::Fn([](const Arguments& args, int line) -> absl::StatusOr<Value> {
    std::string message;
    if (!args.positional.empty()) {
      auto printed = Print(args.positional[0]);
      if (printed.ok()) message = *printed;
    }
    return LineError(line, absl::StrCat("raise_exception: ", message));
  });
  g["range"] = Value::Fn([](const Arguments& args, int) -> absl::StatusOr<Value> {
    std::vector<int64_t> n;
    for (const Value& a : args.positional) {
      if (!a.Is(Type::kInt)) return absl::InvalidArgumentError("range() needs integers");
      n.push_back(a.integer);
    }
    if (n.empty() || n.size() > 3)
      return absl::InvalidArgumentError("range() takes 1 to 3 integers");
    const int64_t start = n.size() == 1 ? 0 : n[0];
    const int64_t stop = n.size() == 1 ? n[0] : n[1];
    const int64_t step = n.size() == 3 ? n[2] : 1;
    if (step == 0) return absl::InvalidArgumentError("range() step must not be zero");
    Array out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(Value::Int(i));
    return Value::List(std::move(out));
  });
  g["namespace"] = Value::Fn([](const Arguments& args, int) -> absl::StatusOr<Value> {
    Entries entries;
    if (!args.positional.empty()) {
      if (!args.positional[0].Is(Type::kObject)) {
        return absl::InvalidArgumentError("namespace() takes a dict or keyword arguments");
      }
      entries = *args.positional[0].object;
    }
    for (const auto& kw : args.keyword) entries.push_back(kw);
    return Value::Object(std::move(entries), Type::kNamespace);
  });
  g["strftime_now"] = Value::Fn([](const Arguments& args, int) -> absl::StatusOr<Value> {
    if (args.positional.empty() || !args.positional[0].Is(Type::kString)) {
      return absl::InvalidArgumentError("strftime_now() needs a format string");
    }
    return Value::String(StrftimeNow(args.positional[0].string));
  });
  return scope;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(absl::string_view source) {
  ASSIGN_OR_RETURN(std::shared_ptr<const ProgramNode> program, ParseProgram(source));
  return ChatTemplate(std::move(program));
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  if (!context.is_object())
    return absl::InvalidArgumentError("the template context must be an object");
  auto scope = std::make_shared<Scope>();
  scope->parent = Globals();
  for (const auto& [key, value] : context.items()) scope->variables[key] = FromJson(value);
  Interpreter interpreter;
  std::string out;
  Flow flow = Flow::kNormal;
  RETURN_IF_ERROR(interpreter.RenderBlock(program_->body, scope, out, flow));
  return out;
}

absl::StatusOr<std::string> RenderChat(const ChatTemplate& chat_template,
                                       const std::vector<ChatMessage>& messages,
                                       bool add_generation_prompt, absl::string_view bos_token,
                                       absl::string_view eos_token) {
  nlohmann::ordered_json context;
  context["messages"] = nlohmann::ordered_json::array();
  for (const ChatMessage& message : messages) {
    context["messages"].push_back({{"role", message.role}, {"content", message.content}});
  }
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = std::string(bos_token);
  context["eos_token"] = std::string(eos_token);
  return chat_template.Render(context);
}

}  // namespace pinfer::chat
