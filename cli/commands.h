// The pinfer subcommands. Each takes the arguments after its name and returns the exit code:
// 0 success, 1 runtime failure (message on stderr), 2 usage error.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pinfer::cli {

int GenerateCommand(const std::vector<std::string>& args);
int PerplexityCommand(const std::vector<std::string>& args);
int PrepareCommand(const std::vector<std::string>& args);
int ConvertCommand(const std::vector<std::string>& args);
int ServeCommand(const std::vector<std::string>& args);
int ChatTemplateCommand(const std::vector<std::string>& args);

// Prints a usage error (exit code 2) or a runtime error (exit code 1).
int UsageError(const std::string& usage, const absl::Status& st);
int RuntimeError(const absl::Status& st);

}  // namespace pinfer::cli
