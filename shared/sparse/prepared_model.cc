// See prepared_model.h. Writing streams one tensor at a time through GgufWriter producers;
// reading goes through GgufFile, which has already checked every size and offset.
#include "shared/sparse/prepared_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "shared/model/ggml_dequant.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

// blk.N.<rest> -> (N, rest); false for other names.
bool SplitLayerName(absl::string_view name, int* layer, std::string* rest) {
  if (!absl::StartsWith(name, "blk.")) return false;
  name.remove_prefix(4);
  const size_t dot = name.find('.');
  if (dot == absl::string_view::npos) return false;
  if (!absl::SimpleAtoi(name.substr(0, dot), layer)) return false;
  *rest = std::string(name.substr(dot + 1));
  return true;
}

// Neurons from most to least often active; ties keep the lower id first (the same order the
// placement's stable sort uses, so every placement is a prefix of it).
std::vector<int32_t> FrequencyOrder(const std::vector<int64_t>& counts) {
  std::vector<int32_t> order(counts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return counts[a] > counts[b]; });
  return order;
}

// Rows of `t` in the given order, bytes unchanged.
GgufWriter::Producer PermutedRows(TensorView t, std::vector<int32_t> order) {
  return [t, order]() -> absl::StatusOr<std::string> {
    const size_t rb = t.row_bytes();
    std::string out(rb * order.size(), '\0');
    for (size_t i = 0; i < order.size(); ++i) {
      std::memcpy(out.data() + i * rb, t.row(order[i]), rb);
    }
    return out;
  };
}

// down: [hidden, ffn] -> down_t: [ffn, hidden] with rows in `order`, stored in down's dtype.
GgufWriter::Producer TransposedDown(TensorView down, std::vector<int32_t> order) {
  return [down, order]() -> absl::StatusOr<std::string> {
    const int64_t H = down.rows(), F = down.cols();
    std::vector<float> dense(static_cast<size_t>(H) * F);
    for (int64_t h = 0; h < H; ++h) DequantizeRow(down.dtype, down.row(h), &dense[h * F], F);
    const size_t rb = RowBytes(down.dtype, H);
    std::string out(rb * F, '\0');
    std::vector<float> row(H);
    for (int64_t i = 0; i < F; ++i) {
      for (int64_t h = 0; h < H; ++h) row[h] = dense[h * F + order[i]];
      QuantizeRow(down.dtype, row.data(), out.data() + i * rb, H);
    }
    return out;
  };
}

GgufWriter::Producer RawBytes(const GgufTensorInfo* info) {
  return [info]() -> absl::StatusOr<std::string> {
    return std::string(reinterpret_cast<const char*>(info->data), info->nbytes);
  };
}

template <typename T>
std::vector<T> ArrayValues(const GgufArray& a) {
  std::vector<T> v(a.count);
  if (a.count > 0) std::memcpy(v.data(), a.data, a.count * sizeof(T));
  return v;
}

absl::Status CopyKey(const GgufKeyValue& kv, GgufWriter* w) {
  const GgufValue& v = kv.value;
  switch (v.type) {
    case GgufType::kUint8:
    case GgufType::kUint16:
    case GgufType::kUint32:
      w->SetU32(kv.key, static_cast<uint32_t>(v.u64));
      return absl::OkStatus();
    case GgufType::kInt8:
    case GgufType::kInt16:
    case GgufType::kInt32:
      w->SetI32(kv.key, static_cast<int32_t>(v.i64));
      return absl::OkStatus();
    case GgufType::kUint64:
      w->SetU64(kv.key, v.u64);
      return absl::OkStatus();
    case GgufType::kFloat32:
    case GgufType::kFloat64:
      w->SetF32(kv.key, static_cast<float>(v.f64));
      return absl::OkStatus();
    case GgufType::kBool:
      w->SetBool(kv.key, v.u64 != 0);
      return absl::OkStatus();
    case GgufType::kString:
      w->SetString(kv.key, v.str);
      return absl::OkStatus();
    case GgufType::kArray:
      switch (v.array.elem_type) {
        case GgufType::kString: {
          std::vector<std::string> s(v.array.strings.begin(), v.array.strings.end());
          w->SetStringArray(kv.key, s);
          return absl::OkStatus();
        }
        case GgufType::kFloat32:
          w->SetF32Array(kv.key, ArrayValues<float>(v.array));
          return absl::OkStatus();
        case GgufType::kInt32:
          w->SetI32Array(kv.key, ArrayValues<int32_t>(v.array));
          return absl::OkStatus();
        default:
          break;
      }
      break;
    default:
      break;
  }
  return absl::UnimplementedError(
      absl::StrCat("cannot copy metadata key '", kv.key, "' of type ", GgufTypeName(v.type)));
}

absl::StatusOr<GgmlType> TypeOf(DType t) { return GgmlTypeFromDType(t); }

// fc1 [rank, hidden] with column i divided by the norm weight w_i (F32), so that it reads the
// normalized input x = r / rms(r) * w where PowerInfer's reads r. A zero w_i leaves x_i = 0 and
// the column is lost either way.
TensorView FoldInverseNorm(const TensorView& fc1, const TensorView& norm,
                           std::vector<std::shared_ptr<std::vector<uint8_t>>>* owned) {
  const int64_t R = fc1.rows(), H = fc1.cols();
  std::vector<float> w(H);
  DequantizeRow(norm.dtype, norm.data, w.data(), H);
  auto buf = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(R * H) * 4);
  float* out = reinterpret_cast<float*>(buf->data());
  for (int64_t r = 0; r < R; ++r) {
    DequantizeRow(fc1.dtype, fc1.row(r), out + r * H, H);
    for (int64_t i = 0; i < H; ++i) out[r * H + i] = w[i] != 0 ? out[r * H + i] / w[i] : 0.f;
  }
  TensorView t = fc1;
  t.dtype = DType::kF32;
  t.data = buf->data();
  owned->push_back(std::move(buf));
  return t;
}

}  // namespace

absl::Status WritePreparedModel(const GgufFile& src, const PreparedContents& contents,
                                const std::string& out_path) {
  ASSIGN_OR_RETURN(std::string arch, src.GetString("general.architecture"));
  ASSIGN_OR_RETURN(int n_layers, src.GetU32(arch + ".block_count"));
  ASSIGN_OR_RETURN(int ffn, src.GetU32(arch + ".feed_forward_length"));
  const ActivationProfile& prof = contents.profile;
  const PredictorSet& pred = contents.predictors;
  if (prof.n_layers != n_layers || prof.ffn_size != ffn ||
      static_cast<int>(pred.layers.size()) != n_layers) {
    return absl::InvalidArgumentError("profile and predictors do not match the source model");
  }
  std::vector<std::vector<int32_t>> order(n_layers);
  for (int l = 0; l < n_layers; ++l) order[l] = FrequencyOrder(prof.active[l]);

  GgufWriter w(kPowerInferMagic);
  for (const GgufKeyValue& kv : src.metadata()) {
    if (kv.key == kSparseThresholdKey || absl::StartsWith(kv.key, "pinfer.sparse.")) continue;
    RETURN_IF_ERROR(CopyKey(kv, &w));
  }
  // One threshold for PowerInfer: the layers' own when they agree (pinfer's training folds them
  // all to -1), else the first layer's, with the per-layer values in pinfer's key.
  std::vector<float> thresholds;
  for (const LayerPredictor& p : pred.layers) thresholds.push_back(p.threshold);
  w.SetF32(kSparseThresholdKey, thresholds.empty() ? 0.f : thresholds[0]);
  w.SetF32Array("pinfer.sparse.thresholds", thresholds);
  w.SetString(kPredictorInputKey, "ffn_norm");
  w.SetU64("pinfer.sparse.profile_tokens", static_cast<uint64_t>(prof.tokens));
  for (const auto& [key, value] : contents.string_keys) w.SetString(key, value);
  for (int l = 0; l < n_layers; ++l) {
    std::vector<float> freq(ffn);
    for (int i = 0; i < ffn; ++i) freq[i] = static_cast<float>(prof.Frequency(l, order[l][i]));
    w.SetF32Array(absl::StrCat("pinfer.sparse.blk.", l, ".activation_frequency"), freq);
  }

  for (const GgufTensorInfo& info : src.tensors()) {
    int l = -1;
    std::string rest;
    const bool in_layer = SplitLayerName(info.name, &l, &rest) && l >= 0 && l < n_layers;
    if (in_layer && (rest == "fc1.weight" || rest == "fc2.weight")) continue;  // replaced below
    if (in_layer &&
        (rest == "ffn_gate.weight" || rest == "ffn_up.weight" || rest == "ffn_down_t.weight")) {
      ASSIGN_OR_RETURN(TensorView t, GgufFile::ToTensorView(info));
      if (t.rows() != ffn) {
        return absl::InvalidArgumentError(absl::StrCat(info.name, " does not have ", ffn, " rows"));
      }
      RETURN_IF_ERROR(w.AddTensor(info.name, static_cast<GgmlType>(info.type), t.shape,
                                  PermutedRows(t, order[l])));
      continue;
    }
    if (in_layer && rest == "ffn_down.weight") {
      ASSIGN_OR_RETURN(TensorView t, GgufFile::ToTensorView(info));
      if (t.cols() != ffn) {
        return absl::InvalidArgumentError(
            absl::StrCat(info.name, " does not have ", ffn, " columns"));
      }
      if (t.rows() % BlockElems(t.dtype) != 0) {
        return absl::InvalidArgumentError(absl::StrCat(info.name, ": hidden size ", t.rows(),
                                                       " cannot be quantized after the transpose"));
      }
      RETURN_IF_ERROR(w.AddTensor(absl::StrCat("blk.", l, ".ffn_down_t.weight"),
                                  static_cast<GgmlType>(info.type), {t.cols(), t.rows()},
                                  TransposedDown(t, order[l])));
      continue;
    }
    RETURN_IF_ERROR(
        w.AddTensor(info.name, static_cast<GgmlType>(info.type), info.shape(), RawBytes(&info)));
  }
  for (int l = 0; l < n_layers; ++l) {
    const LayerPredictor& p = pred.layers[l];
    if (p.fc2.rows() != ffn) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l, ": fc2 does not have ", ffn, " rows"));
    }
    ASSIGN_OR_RETURN(GgmlType t1, TypeOf(p.fc1.dtype));
    ASSIGN_OR_RETURN(GgmlType t2, TypeOf(p.fc2.dtype));
    const TensorView fc1 = p.fc1;
    RETURN_IF_ERROR(w.AddTensor(absl::StrCat("blk.", l, ".fc1.weight"), t1, fc1.shape,
                                [fc1]() -> absl::StatusOr<std::string> {
                                  return std::string(static_cast<const char*>(fc1.data),
                                                     fc1.nbytes());
                                }));
    RETURN_IF_ERROR(w.AddTensor(absl::StrCat("blk.", l, ".fc2.weight"), t2, p.fc2.shape,
                                PermutedRows(p.fc2, order[l])));
  }
  return w.WriteFile(out_path);
}

absl::Status WriteMagnitudeSparseModel(
    const GgufFile& src, const ActivationProfile& prof, const std::vector<float>& thresholds,
    const std::vector<std::pair<std::string, std::string>>& string_keys,
    const std::string& out_path) {
  GgufWriter w;
  for (const GgufKeyValue& kv : src.metadata()) {
    if (absl::StartsWith(kv.key, "pinfer.sparse.")) continue;
    RETURN_IF_ERROR(CopyKey(kv, &w));
  }
  w.SetF32Array(kMagnitudeThresholdsKey, thresholds);
  w.SetU64("pinfer.sparse.profile_tokens", static_cast<uint64_t>(prof.tokens));
  for (int l = 0; l < prof.n_layers; ++l) {
    std::vector<float> freq(prof.ffn_size);
    for (int i = 0; i < prof.ffn_size; ++i) freq[i] = static_cast<float>(prof.Frequency(l, i));
    w.SetF32Array(absl::StrCat("pinfer.sparse.blk.", l, ".activation_frequency"), freq);
  }
  for (const auto& [key, value] : string_keys) w.SetString(key, value);
  for (const GgufTensorInfo& info : src.tensors()) {
    RETURN_IF_ERROR(
        w.AddTensor(info.name, static_cast<GgmlType>(info.type), info.shape(), RawBytes(&info)));
  }
  return w.WriteFile(out_path);
}

std::vector<TensorView> PreparedModel::down_t() const {
  std::vector<TensorView> views;
  for (const LayerWeights& L : model->layers) views.push_back(L.down_t);
  return views;
}

absl::StatusOr<PreparedModel> LoadPreparedModel(const std::string& path,
                                                const GgufLoadOptions& options) {
  PreparedModel pm;
  ASSIGN_OR_RETURN(pm.file, GgufFile::Open(path, {kPowerInferMagic, kGgufMagic}));
  const GgufFile& f = *pm.file;
  ASSIGN_OR_RETURN(pm.model, LoadGgufModelFrom(f, options));
  const ModelConfig& c = pm.model->config;
  if (f.HasKey(kSparseThresholdKey)) {
    ASSIGN_OR_RETURN(pm.sparse_threshold, f.GetF32(kSparseThresholdKey));
  }
  std::vector<float> thresholds(c.n_layers, pm.sparse_threshold);
  if (f.HasKey("pinfer.sparse.thresholds")) {
    ASSIGN_OR_RETURN(thresholds, f.GetF32Array("pinfer.sparse.thresholds"));
    if (static_cast<int>(thresholds.size()) != c.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": pinfer.sparse.thresholds has ",
                                                     thresholds.size(), " values for ", c.n_layers,
                                                     " layers"));
    }
  }
  // pinfer's files (older ones have pinfer.sparse.thresholds only) read the normalized input.
  std::string predictor_input = f.HasKey("pinfer.sparse.thresholds") ? "ffn_norm" : "ffn_inp";
  if (f.HasKey(kPredictorInputKey)) {
    ASSIGN_OR_RETURN(predictor_input, f.GetString(kPredictorInputKey));
  }
  if (predictor_input != "ffn_norm" && predictor_input != "ffn_inp") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unknown ", kPredictorInputKey, " '", predictor_input, "'"));
  }
  pm.powerinfer_predictors = predictor_input == "ffn_inp";
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    LayerPredictor lp;
    ASSIGN_OR_RETURN(lp.fc1, GgufTensorForEngine(f, p + "fc1.weight", &pm.predictors.owned));
    ASSIGN_OR_RETURN(lp.fc2, GgufTensorForEngine(f, p + "fc2.weight", &pm.predictors.owned));
    if (lp.fc1.shape.size() != 2 || lp.fc2.shape.size() != 2 || lp.fc1.cols() != c.hidden_size ||
        lp.fc2.rows() != c.ffn_size || lp.fc2.cols() != lp.fc1.rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": layer ", l, ": predictor shapes must be fc1 [rank, ", c.hidden_size,
                       "] and fc2 [", c.ffn_size, ", rank]"));
    }
    lp.threshold = thresholds[l];
    if (pm.powerinfer_predictors) {
      lp.fc1 = FoldInverseNorm(lp.fc1, pm.model->layers[l].ffn_norm, &pm.predictors.owned);
      lp.reads_residual = true;
    }
    pm.predictors.layers.push_back(lp);
    // The model loader took ffn_down_t when the file has it (and checked its shape).
    const TensorView& dt = pm.model->layers[l].down_t;
    if (dt.data == nullptr) {
      return absl::NotFoundError(absl::StrCat(path, ": missing tensor '", p, "ffn_down_t.weight'"));
    }
  }
  if (f.HasKey("pinfer.sparse.source")) {
    ASSIGN_OR_RETURN(pm.source_fingerprint, f.GetString("pinfer.sparse.source"));
  }
  if (f.HasKey("pinfer.sparse.profile_tokens")) {
    ASSIGN_OR_RETURN(uint64_t tokens, f.GetU64("pinfer.sparse.profile_tokens"));
    pm.profile_tokens = static_cast<int64_t>(tokens);
    for (int l = 0; l < c.n_layers; ++l) {
      ASSIGN_OR_RETURN(
          std::vector<float> freq,
          f.GetF32Array(absl::StrCat("pinfer.sparse.blk.", l, ".activation_frequency")));
      if (static_cast<int>(freq.size()) != c.ffn_size) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": layer ", l,
                                                       ": activation frequencies for ", freq.size(),
                                                       " neurons, expected ", c.ffn_size));
      }
      pm.activation_frequency.push_back(std::move(freq));
    }
  }
  return pm;
}

absl::StatusOr<ActivationProfile> StoredProfile(const PreparedModel& pm) {
  if (pm.activation_frequency.empty()) {
    return absl::NotFoundError("the prepared model has no stored activation profile");
  }
  ActivationProfile p;
  p.n_layers = pm.model->config.n_layers;
  p.ffn_size = pm.model->config.ffn_size;
  p.tokens = pm.profile_tokens;
  for (const auto& freq : pm.activation_frequency) {
    std::vector<int64_t> counts(freq.size());
    for (size_t i = 0; i < freq.size(); ++i) {
      counts[i] = static_cast<int64_t>(std::llround(static_cast<double>(freq[i]) * p.tokens));
    }
    p.active.push_back(std::move(counts));
  }
  return p;
}

std::string GpuIndexPath(const std::string& model_path) { return model_path + ".generated.gpuidx"; }

GpuIndex GpuIndexFromPlan(const PlacementPlan& plan, int ffn) {
  GpuIndex g;
  g.vram_capacity = plan.budget;
  for (size_t l = 0; l < plan.hot.size(); ++l) {
    g.gpu_idx.push_back(plan.GpuIndex(static_cast<int>(l), ffn));
    g.gpu_bucket.push_back(plan.hot[l]);
  }
  return g;
}

absl::Status WriteGpuIndex(const GpuIndex& index, const std::string& path) {
  GgufWriter w(kPowerInferMagic);
  const int n_layers = static_cast<int>(index.gpu_idx.size());
  w.SetString("general.architecture", kGpuIndexArchitecture);
  w.SetU32(absl::StrCat(kGpuIndexArchitecture, ".block_count"), static_cast<uint32_t>(n_layers));
  w.SetU64("split.vram_capacity", index.vram_capacity);
  auto i32 = [](const std::vector<int32_t>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  };
  for (int l = 0; l < n_layers; ++l) {
    if (index.gpu_bucket[l].empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", l,
                       " has no GPU neurons; a PowerInfer GPU index cannot express an empty GPU "
                       "share (raise the VRAM budget or run CPU-only without an index)"));
    }
    const std::vector<int32_t>& idx = index.gpu_idx[l];
    RETURN_IF_ERROR(w.AddTensor(absl::StrCat("blk.", l, ".gpu_idx"), GgmlType::kI32,
                                {static_cast<int64_t>(idx.size())}, i32(idx)));
    RETURN_IF_ERROR(w.AddTensor(absl::StrCat("blk.", l, ".gpu_bucket"), GgmlType::kI32,
                                {static_cast<int64_t>(index.gpu_bucket[l].size())},
                                i32(index.gpu_bucket[l])));
  }
  return w.WriteFile(path);
}

absl::StatusOr<GpuIndex> ReadGpuIndex(const std::string& path, int n_layers, int ffn) {
  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f,
                   GgufFile::Open(path, {kPowerInferMagic, kGgufMagic}));
  ASSIGN_OR_RETURN(std::string arch, f->GetString("general.architecture"));
  if (arch != kGpuIndexArchitecture) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": architecture '", arch, "' is not ", kGpuIndexArchitecture));
  }
  ASSIGN_OR_RETURN(uint32_t blocks, f->GetU32(absl::StrCat(kGpuIndexArchitecture, ".block_count")));
  if (static_cast<int>(blocks) != n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": index for ", blocks, " layers, the model has ", n_layers));
  }
  GpuIndex g;
  ASSIGN_OR_RETURN(g.vram_capacity, f->GetU64("split.vram_capacity"));
  auto values = [&](const std::string& name,
                    int64_t expect) -> absl::StatusOr<std::vector<int32_t>> {
    ASSIGN_OR_RETURN(const GgufTensorInfo* t, f->GetTensorOfType(name, GgmlType::kI32));
    if (t->ne.size() != 1 || (expect >= 0 && t->ne[0] != expect)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", name, " must be a vector of ",
                                                     expect >= 0 ? absl::StrCat(expect) : "some",
                                                     " values"));
    }
    std::vector<int32_t> v(t->ne[0]);
    std::memcpy(v.data(), t->data, v.size() * 4);
    return v;
  };
  for (int l = 0; l < n_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    ASSIGN_OR_RETURN(std::vector<int32_t> idx, values(p + "gpu_idx", ffn));
    std::vector<int32_t> bucket;
    const bool has_bucket = f->FindTensor(p + "gpu_bucket") != nullptr;
    if (has_bucket) {
      ASSIGN_OR_RETURN(bucket, values(p + "gpu_bucket", -1));
    }
    std::vector<int32_t> marked;
    for (int j = 0; j < ffn; ++j) {
      if (idx[j] != 0 && idx[j] != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": ", p, "gpu_idx[", j, "] is ", idx[j], ", not 0 or 1"));
      }
      if (idx[j] == 1) marked.push_back(j);
    }
    if (!has_bucket) bucket = marked;  // export_split.py since its MoE support writes none
    if (bucket != marked) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", p, "gpu_bucket does not list, in ascending order, the ",
                       marked.size(), " neurons gpu_idx marks"));
    }
    g.gpu_idx.push_back(std::move(idx));
    g.gpu_bucket.push_back(std::move(bucket));
  }
  return g;
}

absl::StatusOr<LayerSplitRanges> SplitByteRanges(const GgufFile& file, int layer, int64_t hot) {
  LayerSplitRanges r;
  const char* names[3] = {"ffn_gate.weight", "ffn_up.weight", "ffn_down_t.weight"};
  for (int i = 0; i < 3; ++i) {
    const std::string name = absl::StrCat("blk.", layer, ".", names[i]);
    const GgufTensorInfo* t = file.FindTensor(name);
    if (t == nullptr) return absl::NotFoundError(absl::StrCat("missing tensor '", name, "'"));
    const int64_t rows = t->shape()[0];
    if (hot < 0 || hot > rows) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", hot, " hot rows of ", rows));
    }
    const uint64_t row_bytes = t->nbytes / rows;
    const uint64_t begin = file.data_offset() + t->offset;
    r.hot[i] = {begin, begin + hot * row_bytes};
    r.cold[i] = {begin + hot * row_bytes, begin + t->nbytes};
  }
  return r;
}

}  // namespace pinfer
