// PowerInfer-compatible prepared models: writing and reading the GGUF (magic "PWRI") that carries
// the predictors and the transposed down projections, and the `.gpuidx` neuron index beside it.
//
// Prepared model (FILE.gguf), as PowerInfer's converter writes it:
//  - every tensor and key of the source GGUF model; the file's magic is "PWRI";
//  - blk.N.ffn_down_t.weight [ffn, hidden] instead of blk.N.ffn_down.weight;
//  - blk.N.fc1.weight [rank, hidden] and blk.N.fc2.weight [ffn, rank]: the predictor, a neuron
//    being active when fc2(relu(fc1(x))) >= powerinfer.sparse_threshold (one float for all layers;
//    pinfer folds its per-layer thresholds into fc2's scale so that one value serves them all);
//  - pinfer's own keys, which other readers ignore: pinfer.sparse.thresholds (per layer, on the
//    stored scores), pinfer.sparse.profile_tokens and pinfer.sparse.blk.N.activation_frequency
//    (the profile, so that placement can be redone for another budget without profiling).
// Split-aware storage: neurons are renumbered per layer from most to least frequently active (the
// FFN is invariant under this permutation of gate/up rows, down columns and fc2 rows). Every
// placement then puts a prefix of each layer on the GPU, so the hot rows and the cold rows of
// every FFN tensor are each one contiguous byte range, and a process that holds one part only
// touches (maps) that part; SplitByteRanges gives the ranges.
//
// Predictor input. PowerInfer's llama.cpp (build_llama_variants, `llama` and `bamboo`) feeds the
// predictor the residual stream before ffn_norm (`ffn_inp`), pinfer's FfnBlock sees the normalized
// FFN input x = r / rms(r) * w. The predictor has no biases, so fc2(relu(fc1(r))) = rms(r) *
// fc2(relu(fc1(x / w))): loading a PowerInfer file divides fc1's columns by ffn_norm's weights
// (F32 copy), which selects exactly the same neurons when powerinfer.sparse_threshold is 0 (every
// ReluLLaMA file) and compares against the threshold without the rms(r) factor otherwise. Files
// pinfer writes say `pinfer.sparse.predictor_input = "ffn_norm"` (their predictors read x).
//
// GPU index (FILE.gguf.generated.gpuidx), as PowerInfer's export_split.py writes it: magic "PWRI",
// general.architecture "generic.gpu_index", generic.gpu_index.block_count, split.vram_capacity
// (u64, the budget the index was made for), and per layer blk.N.gpu_idx (I32 [ffn], 1 = on the
// GPU) and blk.N.gpu_bucket (I32, the sorted ids of the GPU neurons). PowerInfer's ggml numbers
// I32 as type 18; see gguf_reader.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/model/gguf.h"
#include "shared/model/model.h"
#include "shared/sparse/placement.h"
#include "shared/sparse/profiler.h"
#include "shared/sparse/sparse_ffn.h"

namespace pinfer {

inline constexpr char kSparseThresholdKey[] = "powerinfer.sparse_threshold";
inline constexpr char kGpuIndexArchitecture[] = "generic.gpu_index";
inline constexpr char kPredictorInputKey[] = "pinfer.sparse.predictor_input";

// What `pinfer prepare` adds to a model.
struct PreparedContents {
  ActivationProfile profile;  // in the source model's neuron numbering
  PredictorSet predictors;    // in the source model's neuron numbering, per-layer thresholds
  std::vector<std::pair<std::string, std::string>> string_keys;  // extra metadata (pinfer.*)
};

// SiLU models (training-free magnitude sparsity): a plain GGUF copy of the source (ffn_down
// kept, llama.cpp still loads it) plus pinfer.sparse.magnitude_thresholds (per layer: neurons
// with |silu(gate)| at or below it are skipped), the profile keys and string_keys.
inline constexpr char kMagnitudeThresholdsKey[] = "pinfer.sparse.magnitude_thresholds";
absl::Status WriteMagnitudeSparseModel(
    const GgufFile& source, const ActivationProfile& profile, const std::vector<float>& thresholds,
    const std::vector<std::pair<std::string, std::string>>& string_keys,
    const std::string& out_path);

// Writes the prepared model from a source GGUF model file (llama architecture, with ffn_down or
// already with ffn_down_t). Down projections of quantized models are re-quantized after the
// transpose, as PowerInfer's converter does; float ones are transposed exactly.
absl::Status WritePreparedModel(const GgufFile& source, const PreparedContents& contents,
                                const std::string& out_path);

// A prepared model, loaded for sparse execution. Views point into the mapped file.
struct PreparedModel {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
  PredictorSet predictors;             // thresholds per layer; fc1 reads the normalized FFN input
  bool powerinfer_predictors = false;  // fc1 was rescaled from PowerInfer's pre-norm input
  float sparse_threshold = 0;  // powerinfer.sparse_threshold (0 when absent, as in PowerInfer)
  // From pinfer's keys; empty for files pinfer did not prepare.
  int64_t profile_tokens = 0;
  std::vector<std::vector<float>> activation_frequency;  // [layer][ffn]
  std::string source_fingerprint;  // pinfer.sparse.source: what it was prepared from

  // [ffn, hidden] per layer: the layers' down_t, views into the file (the loader requires them).
  std::vector<TensorView> down_t() const;
};

// Loads a PWRI model (pinfer's or PowerInfer's: architectures llama and bamboo; ffn_down_t and
// predictors in F32, F16, Q8_0, Q4_0, or Q4_1/Q5_0/Q5_1 (dequantized to F32)). Errors name the
// missing or malformed tensor.
absl::StatusOr<PreparedModel> LoadPreparedModel(const std::string& path,
                                                const GgufLoadOptions& options = {});

// The profile stored in a prepared model (frequencies times profile_tokens), for placement.
absl::StatusOr<ActivationProfile> StoredProfile(const PreparedModel& prepared);

struct GpuIndex {
  uint64_t vram_capacity = 0;
  std::vector<std::vector<int32_t>> gpu_idx;     // [layer][ffn], 0 or 1
  std::vector<std::vector<int32_t>> gpu_bucket;  // [layer]: sorted GPU neuron ids
};

std::string GpuIndexPath(const std::string& model_path);  // model_path + ".generated.gpuidx"
GpuIndex GpuIndexFromPlan(const PlacementPlan& plan, int ffn);
// Fails (FailedPrecondition) for a CPU-only plan or a layer without GPU neurons: PowerInfer's
// index cannot express an empty GPU share.
absl::Status WriteGpuIndex(const GpuIndex& index, const std::string& path);
// Checks everything: magic, architecture, block count, shapes, types, 0/1 values, and that each
// bucket lists exactly the neurons its gpu_idx marks, in ascending order. Tensors are looked up by
// name. A layer without gpu_bucket (powerinfer-py's export_split.py writes none for
// generic.gpu_index since it learned MoE indexes) gets the ids gpu_idx marks.
absl::StatusOr<GpuIndex> ReadGpuIndex(const std::string& path, int n_layers, int ffn);

// Byte ranges [begin, end) in the prepared file of one layer's hot rows (the first `hot` rows)
// and cold rows of ffn_gate, ffn_up and ffn_down_t, in that order.
struct ByteRange {
  uint64_t begin = 0, end = 0;
};
struct LayerSplitRanges {
  ByteRange hot[3], cold[3];
};
absl::StatusOr<LayerSplitRanges> SplitByteRanges(const GgufFile& file, int layer, int64_t hot);

}  // namespace pinfer
