// Automatic preparation: the first sparse use of an unprepared ReLU model runs `pinfer prepare`
// with a calibration text built into pinfer, and caches the result; later uses find it again as
// long as the model files are unchanged.
//
// Cache: $PINFER_CACHE_DIR, else $XDG_CACHE_HOME/pinfer, else $HOME/.cache/pinfer; the file is
// named after a hash of the model's canonical path. It records a fingerprint of the source (path,
// size and modification time of every weight file, and the preparation recipe version) in the key
// pinfer.sparse.source; a mismatch means the model changed and it is prepared again.
// PINFER_AUTO_PREPARE_MAX_TOKENS=N uses only the first N calibration tokens (quick trials).
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "shared/engine/ops.h"

namespace pinfer {

// The calibration text compiled into pinfer (the bundled relu-llama-tiny calibration.txt: Python
// and Linux documentation and fortunes, ~100K tokens of English technical prose).
absl::string_view BundledCalibrationText();

// Fingerprint of a model path (file or Hugging Face directory).
absl::StatusOr<std::string> SourceFingerprint(const std::string& model_path);

// Where the automatic preparation of `model_path` is cached.
absl::StatusOr<std::string> CachedPreparedPath(const std::string& model_path);

// Returns the path of an up-to-date prepared model for `model_path`, preparing it first when
// there is none. `log` gets what happens ("using cached ...", progress while preparing).
absl::StatusOr<std::string> EnsurePrepared(const std::string& model_path, const CpuOps& ops,
                                           const std::function<void(const std::string&)>& log);

}  // namespace pinfer
