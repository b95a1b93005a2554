// See service_model.h.
#include "shared/service/service_model.h"

#include <cstring>
#include <fstream>

namespace pinfer {

bool IsPreparedModelFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {0, 0, 0, 0};
  if (!in.read(magic, 4)) return false;
  return std::memcmp(magic, kPowerInferMagic, 4) == 0;
}

absl::StatusOr<ServiceModel> LoadServiceModel(const std::string& path) {
  ServiceModel m;
  if (IsPreparedModelFile(path)) {
    // The workers copy their rows out of ffn_down_t: no dense down (F32 for quantized files).
    auto pm = LoadPreparedModel(path, {.rebuild_down = false});
    if (!pm.ok()) return pm.status();
    m.prepared = std::make_unique<PreparedModel>(std::move(*pm));
    m.prepared->model->source_path = path;
  } else {
    auto model = LoadModel(path);
    if (!model.ok()) return model.status();
    m.owned = std::move(*model);
  }
  return m;
}

}  // namespace pinfer
