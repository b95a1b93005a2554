// Loading the model a worker serves: any model LoadModel reads, or a prepared PowerInfer-style
// model (magic "PWRI", from `pinfer prepare`), whose predictors drive --sparse mode and whose
// transposed down projection (ffn_down_t) the workers copy their rows from directly: such models
// load without the dense down projection (LayerWeights::down is empty).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/model/model.h"
#include "shared/sparse/prepared_model.h"

namespace pinfer {

struct ServiceModel {
  std::unique_ptr<Model> owned;             // plain models
  std::unique_ptr<PreparedModel> prepared;  // PWRI models
  const Model& model() const { return prepared != nullptr ? *prepared->model : *owned; }
  Model& mutable_model() { return prepared != nullptr ? *prepared->model : *owned; }
  const PredictorSet* predictors() const {
    return prepared != nullptr ? &prepared->predictors : nullptr;
  }
};

// True when the file at `path` starts with the PWRI magic.
bool IsPreparedModelFile(const std::string& path);

absl::StatusOr<ServiceModel> LoadServiceModel(const std::string& path);

}  // namespace pinfer
