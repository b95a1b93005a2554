// See auto_prepare.h.
#include "shared/sparse/auto_prepare.h"

#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "shared/sparse/prepare.h"
#include "shared/sparse/prepared_model.h"
#include "shared/util/status_macros.h"

// Generated from models/relu-llama-tiny/calibration.txt by shared/sparse/CMakeLists.txt.
extern const unsigned char kPinferBundledCalibration[];
extern const unsigned long kPinferBundledCalibrationSize;

namespace pinfer {
namespace fs = std::filesystem;

namespace {
// Bumped when the preparation recipe changes, so that old caches are redone.
constexpr char kRecipe[] = "pinfer-sparse-recipe-1";
}  // namespace

absl::string_view BundledCalibrationText() {
  return absl::string_view(reinterpret_cast<const char*>(kPinferBundledCalibration),
                           kPinferBundledCalibrationSize);
}

absl::StatusOr<std::string> SourceFingerprint(const std::string& model_path) {
  std::error_code ec;
  const fs::path canonical = fs::canonical(model_path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(model_path, ": ", ec.message()));
  std::vector<fs::path> files;
  if (fs::is_directory(canonical)) {
    for (const auto& e : fs::directory_iterator(canonical)) {
      const std::string ext = e.path().extension().string();
      if (ext == ".safetensors" || ext == ".json" || e.path().filename() == "tokenizer.model") {
        files.push_back(e.path());
      }
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(canonical);
  }
  std::string fp = absl::StrCat(kRecipe, " ", canonical.string());
  for (const fs::path& f : files) {
    const auto size = fs::file_size(f, ec);
    const auto mtime = fs::last_write_time(f, ec).time_since_epoch().count();
    absl::StrAppend(&fp, " ", f.filename().string(), ":", size, ":", mtime);
  }
  return fp;
}

absl::StatusOr<std::string> CachedPreparedPath(const std::string& model_path) {
  fs::path dir;
  if (const char* d = std::getenv("PINFER_CACHE_DIR"); d != nullptr && *d) {
    dir = d;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x) {
    dir = fs::path(x) / "pinfer";
  } else if (const char* h = std::getenv("HOME"); h != nullptr && *h) {
    dir = fs::path(h) / ".cache" / "pinfer";
  } else {
    return absl::FailedPreconditionError(
        "no cache folder for the automatic preparation: set PINFER_CACHE_DIR");
  }
  std::error_code ec;
  const fs::path canonical = fs::canonical(model_path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(model_path, ": ", ec.message()));
  const std::string stem = canonical.filename().string();
  // FNV-1a: stable across processes and builds (absl::Hash is seeded per process).
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : canonical.string()) h = (h ^ ch) * 1099511628211ull;
  return (dir / absl::StrFormat("%s-%016x.pwri.gguf", stem, h)).string();
}

absl::StatusOr<std::string> EnsurePrepared(const std::string& model_path, const CpuOps& ops,
                                           const std::function<void(const std::string&)>& log) {
  auto say = [&](const std::string& s) {
    if (log) log(s);
  };
  ASSIGN_OR_RETURN(std::string fingerprint, SourceFingerprint(model_path));
  // PINFER_AUTO_PREPARE_MAX_TOKENS limits the calibration tokens (quick trials, tests); part of
  // the fingerprint so that a quick preparation is not mistaken for a full one.
  int64_t max_tokens = 0;
  if (const char* v = std::getenv("PINFER_AUTO_PREPARE_MAX_TOKENS"); v != nullptr && *v) {
    if (!absl::SimpleAtoi(v, &max_tokens) || max_tokens < 0) {
      return absl::InvalidArgumentError("PINFER_AUTO_PREPARE_MAX_TOKENS must be a token count");
    }
    absl::StrAppend(&fingerprint, " max_tokens=", max_tokens);
  }
  ASSIGN_OR_RETURN(std::string cached, CachedPreparedPath(model_path));
  if (fs::exists(cached)) {
    auto pm = LoadPreparedModel(cached);
    if (pm.ok() && pm->source_fingerprint == fingerprint) {
      say(absl::StrCat("sparse: using the cached preparation ", cached));
      return cached;
    }
    say(absl::StrCat("sparse: the cached preparation ", cached,
                     pm.ok() ? " is for another version of the model" : " is unreadable",
                     "; preparing again"));
  }
  std::error_code ec;
  fs::create_directories(fs::path(cached).parent_path(), ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create the cache folder ",
                                                      fs::path(cached).parent_path().string(), ": ",
                                                      ec.message()));
  }
  say(absl::StrCat("sparse: ", model_path,
                   " has no predictors; preparing it once with the bundled calibration text (",
                   BundledCalibrationText().size() / 1024, " KiB) into ", cached));
  PrepareOptions po;
  po.model_path = model_path;
  po.calibration_text = std::string(BundledCalibrationText());
  po.out_path = cached + ".tmp";
  po.source_fingerprint = fingerprint;
  po.max_calibration_tokens = max_tokens;
  PrepareProgress pg;
  pg.log = say;
  ASSIGN_OR_RETURN(PrepareResult r, PrepareModel(po, ops, pg));
  fs::rename(po.out_path, cached, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot move the preparation into ", cached));
  say(absl::StrFormat("sparse: prepared in %.0f s, cached as %s", r.total_seconds, cached));
  return cached;
}

}  // namespace pinfer
