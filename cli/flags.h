// A minimal `--name value` / `--switch` parser for the pinfer subcommands. Unknown flags, missing
// values and malformed numbers are usage errors (exit code 2), as the CLI contract requires.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pinfer::cli {

class Flags {
 public:
  // `valued` flags take a value; `switches` take none.
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args,
                                     const std::set<std::string>& valued,
                                     const std::set<std::string>& switches);
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::optional<std::string> Get(const std::string& name) const;
  absl::StatusOr<std::string> Required(const std::string& name) const;
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t fallback) const;
  absl::StatusOr<double> Double(const std::string& name, double fallback) const;
  absl::StatusOr<uint64_t> Size(const std::string& name, uint64_t fallback) const;  // 8MiB, 24GiB

 private:
  std::map<std::string, std::string> values_;
};

// Parses byte sizes such as "1048576", "8MiB", "24GiB", "500MB".
absl::StatusOr<uint64_t> ParseByteSize(const std::string& s);

}  // namespace pinfer::cli
