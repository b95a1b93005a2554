// `pinfer prepare --report FILE.svg`: one picture of a model's activation locality. Per layer, the
// neurons' activation frequency sorted from hot to cold (a curve that drops fast means a few
// neurons do most of the work), the GPU/CPU cut of the placement when there is one, and the
// predictor's recall, sparsity and cost; users see at a glance how much their model gains.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "shared/sparse/prepare.h"

namespace pinfer {

std::string LocalityReportSvg(const PrepareResult& result);
absl::Status WriteLocalityReport(const PrepareResult& result, const std::string& path);

}  // namespace pinfer
