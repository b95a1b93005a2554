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
    auto pm = LoadPreparedModel(path);
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

void DropRebuiltDown(ServiceModel* m) {
  if (m->prepared == nullptr) return;
  Model& model = *m->prepared->model;
  for (LayerWeights& L : model.layers) {
    for (auto& buf : model.owned) {
      if (buf != nullptr && buf->data() == L.down.data) {
        buf.reset();
        break;
      }
    }
    L.down = TensorView{};
  }
}

}  // namespace pinfer
