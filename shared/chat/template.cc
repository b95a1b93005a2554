// The chat template engine's interpreter (see template.h; its values and built-ins are in
// template_value.h). Semantics follow Hugging Face's JavaScript renderer (npm @huggingface/jinja),
// the reference the tests compare against: lenient undefined (a missing key is undefined, not an
// error), JavaScript-style printing of values (true, 1.0 as "1.0" but "1" inside +), loose == and
// JSON-shaped output of lists and dicts. Loops get their own scope; if blocks share the
// enclosing one, as in Jinja.
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
#include "shared/chat/template_value.h"
#include "shared/util/status_macros.h"

namespace pinfer::chat {
namespace internal {
namespace {

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
    // Weak: the scope holds the macro, so a strong pointer back would be a cycle that outlives
    // the render.
    std::weak_ptr<Scope> defined_in = scope;
    scope->variables[node.value] =
        Value::Fn([this, macro, defined_in](const Arguments& args, int) -> absl::StatusOr<Value> {
          auto local = std::make_shared<Scope>();
          local->parent = defined_in.lock();
          if (local->parent == nullptr) {
            return LineError(macro->line, "macro called after its scope ended");
          }
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
};

}  // namespace
}  // namespace internal

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(absl::string_view source) {
  ASSIGN_OR_RETURN(std::shared_ptr<const ProgramNode> program, ParseProgram(source));
  return ChatTemplate(std::move(program));
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  if (!context.is_object())
    return absl::InvalidArgumentError("the template context must be an object");
  auto globals = std::make_shared<internal::Scope>();
  internal::AddGlobals(globals->variables);
  auto scope = std::make_shared<internal::Scope>();
  scope->parent = globals;
  for (const auto& [key, value] : context.items())
    scope->variables[key] = internal::FromJson(value);
  internal::Interpreter interpreter;
  std::string out;
  internal::Flow flow = internal::Flow::kNormal;
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
