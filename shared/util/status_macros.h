// Early-return helpers for absl::Status / absl::StatusOr, in the style used across Abseil users.
// Every fallible function in pinfer returns a Status; these keep the happy path readable.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PINFER_CONCAT_INNER_(a, b) a##b
#define PINFER_CONCAT_(a, b) PINFER_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                \
  do {                                       \
    ::absl::Status _pinfer_status = (expr);  \
    if (!_pinfer_status.ok()) return _pinfer_status; \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(*tmp)

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(PINFER_CONCAT_(_pinfer_statusor_, __COUNTER__), lhs, expr)
