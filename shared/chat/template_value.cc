// The chat template engine's value helpers (template_value.h): conversion from JSON, printing
// and JSON output as the reference does them, truthiness and equality, string helpers.
#include "shared/chat/template_value.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "shared/util/status_macros.h"

namespace pinfer::chat::internal {

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

}  // namespace pinfer::chat::internal
