// The chat template engine's built-ins (template_value.h): dict and string methods, filters,
// tests and globals, each as Hugging Face's renderer defines it; anything else is an error naming
// what is unsupported.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "shared/chat/template_syntax.h"
#include "shared/chat/template_value.h"
#include "shared/util/status_macros.h"

namespace pinfer::chat::internal {

Value ObjectMethod(const Value& object, const std::string& name) {
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

Value StringMethod(const std::string& s, const std::string& name) {
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
    return Value::String(
        Replace(s, from->string, to->string, count && count->Is(Type::kInt) ? count->integer : -1));
  });
}

absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v) {
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

absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& v, const Arguments& args,
                                  bool called) {
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

void AddGlobals(std::unordered_map<std::string, Value>& g) {
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
}

}  // namespace pinfer::chat::internal
