// The chat template engine's syntax tree, shared by its parser (template_parser.cc) and its
// interpreter (template.cc); internal to shared/chat.
#ifndef PINFER_SHARED_CHAT_TEMPLATE_SYNTAX_H_
#define PINFER_SHARED_CHAT_TEMPLATE_SYNTAX_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pinfer::chat {

// Every error names the template line it comes from.
inline absl::Status LineError(int line, absl::string_view reason) {
  return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", reason));
}

// ---------------------------------------------------------------------------------------------
// Syntax tree. One node type serves statements and expressions; `children` holds the operands
// in a fixed order per kind (noted beside each kind).

enum class Kind {
  kText,      // value: the text
  kIf,        // children: [test]; body, alternate
  kFor,       // children: [loop variable, iterable, select test or null]; body, alternate
  kSet,       // children: [target, value]
  kSetBlock,  // children: [target]; body
  kMacro,     // value: name; children: parameter defaults (null if none); names: parameters
  kBreak,
  kContinue,
  kComment,
  kString,
  kInteger,
  kFloat,
  kIdentifier,  // value / number
  kBinary,      // value: operator; children: [left, right]
  kUnary,       // value: "not", "-", "+"; children: [operand]
  kTernary,     // children: [if true, test, if false or null]
  kMember,      // children: [object, property]; computed: obj[prop] rather than obj.prop
  kSlice,       // children: [object, start, stop, step] (null where absent)
  kCall,        // children: [callee, arguments...]; names: keyword per argument ("" positional)
  kFilter,      // value: filter name; children: [operand, arguments...]; names as for kCall
  kTest,        // value: test name; children: [operand]; negate
  kList,
  kTuple,  // children: items
  kDict,   // children: key, value, key, value...
};

struct Node {
  Kind kind;
  int line = 0;
  std::string value;
  int64_t integer = 0;
  double number = 0;
  bool computed = false;
  bool negate = false;
  std::vector<std::unique_ptr<Node>> children;
  std::vector<std::string> names;
  std::vector<std::unique_ptr<Node>> body;
  std::vector<std::unique_ptr<Node>> alternate;
};
using NodePtr = std::unique_ptr<Node>;

inline NodePtr MakeNode(Kind kind, int line) {
  auto node = std::make_unique<Node>();
  node->kind = kind;
  node->line = line;
  return node;
}

struct ProgramNode {
  std::vector<NodePtr> body;
};

// Lexes and parses a template (with the reference's trim_blocks / lstrip_blocks preprocessing).
absl::StatusOr<std::shared_ptr<const ProgramNode>> ParseProgram(absl::string_view source);

}  // namespace pinfer::chat

#endif  // PINFER_SHARED_CHAT_TEMPLATE_SYNTAX_H_
