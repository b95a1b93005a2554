// The chat template engine's runtime values and built-ins, shared by the interpreter
// (template.cc), the value helpers (template_value.cc) and the filters, tests, methods and
// globals (template_builtins.cc); internal to shared/chat. Values follow Hugging Face's
// JavaScript renderer: printing, equality and truthiness are JavaScript's where it differs from
// Python's.
#ifndef PINFER_SHARED_CHAT_TEMPLATE_VALUE_H_
#define PINFER_SHARED_CHAT_TEMPLATE_VALUE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pinfer::chat::internal {

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

absl::string_view TypeName(const Value& v);
Value FromJson(const nlohmann::ordered_json& json);
// JavaScript's Number.prototype.toString.
std::string JsNumber(double d);
// JSON.stringify-shaped output ("key": value, ", " between items unless indenting).
absl::StatusOr<std::string> ToJson(const Value& v, int indent, int depth, bool undefined_as_null);
// The text a value prints as in {{ }}.
absl::StatusOr<std::string> Print(const Value& v);
// The text a value contributes to + and ~.
absl::StatusOr<std::string> Concatenable(const Value& v);
bool Truthy(const Value& v);
bool LooseEquals(const Value& a, const Value& b);   // JavaScript ==
bool StrictEquals(const Value& a, const Value& b);  // JavaScript ===
std::string AsciiUpper(std::string s);
std::string AsciiLower(std::string s);
bool IsJsSpace(char c);
std::string Strip(absl::string_view s, bool left, bool right);
std::string TitleCase(std::string s);
std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count);
const Value* Keyword(const Arguments& args, absl::string_view name);
// Positional argument i, else the keyword `name`, else null.
const Value* Argument(const Arguments& args, size_t i, absl::string_view name);
std::string StrftimeNow(const std::string& format);

// Built-ins (template_builtins.cc). A method is undefined when the name is not one.
Value ObjectMethod(const Value& object, const std::string& name);
Value StringMethod(const std::string& s, const std::string& name);
absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v);
absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& v, const Arguments& args,
                                  bool called);
// raise_exception, range, namespace, strftime_now, true/false/none.
void AddGlobals(std::unordered_map<std::string, Value>& globals);

}  // namespace pinfer::chat::internal

#endif  // PINFER_SHARED_CHAT_TEMPLATE_VALUE_H_
