// See flags.h.
#include "cli/flags.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pinfer::cli {

absl::StatusOr<Flags> Flags::Parse(const std::vector<std::string>& args,
                                   const std::set<std::string>& valued,
                                   const std::set<std::string>& switches) {
  Flags f;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0)
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    std::string name = a.substr(2), value;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    if (switches.count(name)) {
      if (inline_value)
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      // (A moved string: assigning the literal trips GCC 12's false -Wrestrict warning.)
      f.values_[name] = std::string("1");
    } else if (valued.count(name)) {
      if (!inline_value) {
        if (i + 1 >= args.size())
          return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        value = args[++i];
      }
      f.values_[name] = value;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
  }
  return f;
}

std::optional<std::string> Flags::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::string> Flags::Required(const std::string& name) const {
  auto v = Get(name);
  if (!v) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  return *v;
}

absl::StatusOr<int64_t> Flags::Int(const std::string& name, int64_t fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  int64_t out;
  if (!absl::SimpleAtoi(*v, &out))
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": not an integer: ", *v));
  return out;
}

absl::StatusOr<double> Flags::Double(const std::string& name, double fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  double out;
  if (!absl::SimpleAtod(*v, &out) || !std::isfinite(out)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": not a number: ", *v));
  }
  return out;
}

absl::StatusOr<uint64_t> Flags::Size(const std::string& name, uint64_t fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  return ParseByteSize(*v);
}

absl::StatusOr<uint64_t> ParseByteSize(const std::string& s) {
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  double num;
  if (i == 0 || !absl::SimpleAtod(s.substr(0, i), &num)) {
    return absl::InvalidArgumentError(absl::StrCat("bad size '", s, "'"));
  }
  std::string unit = s.substr(i);
  static const std::pair<const char*, double> kUnits[] = {{"", 1},
                                                          {"B", 1},
                                                          {"KiB", 1024.0},
                                                          {"MiB", 1048576.0},
                                                          {"GiB", 1073741824.0},
                                                          {"TiB", 1099511627776.0},
                                                          {"KB", 1e3},
                                                          {"MB", 1e6},
                                                          {"GB", 1e9},
                                                          {"TB", 1e12},
                                                          {"K", 1024.0},
                                                          {"M", 1048576.0},
                                                          {"G", 1073741824.0}};
  for (auto& [u, mult] : kUnits) {
    if (unit == u) return static_cast<uint64_t>(std::llround(num * mult));
  }
  return absl::InvalidArgumentError(absl::StrCat("bad size unit in '", s, "'"));
}

}  // namespace pinfer::cli
