// Error reporting shared by the subcommands.
#include <cstdio>

#include "cli/commands.h"

namespace pinfer::cli {

int UsageError(const std::string& usage, const absl::Status& st) {
  std::fprintf(stderr, "pinfer: %s\n%s", std::string(st.message()).c_str(), usage.c_str());
  return 2;
}

int RuntimeError(const absl::Status& st) {
  std::fprintf(stderr, "pinfer: %s\n", st.ToString().c_str());
  return 1;
}

}  // namespace pinfer::cli
