// GGUF, the single-file model format of llama.cpp (ggml): a header, typed metadata key/values,
// tensor descriptions, then the aligned tensor data. pinfer reads GGUF models (architecture
// `llama`), the PowerInfer variants of it (files with magic "PWRI" carrying predictor tensors, and
// `.gpuidx` files of architecture `generic.gpu_index`), and writes GGUF v3 files that llama.cpp
// loads (`pinfer convert`).
//
// GgufFile parses a file (or bytes) once, checking every count, length, offset and size against
// the bytes that are actually there: a malformed or truncated file gives an absl error naming the
// problem, never a crash or a huge allocation. Everything stays in the mapping: metadata strings
// and tensor data are views into it, and other code looks keys and tensors up by name.
//
// Shapes: GGUF stores ne[] innermost first (ne[0] is the row length); pinfer's TensorView is
// outermost first, as in PyTorch. GgufTensorInfo keeps ne as stored; shape() and GetTensor()
// convert.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "shared/model/model.h"
#include "shared/model/tensor.h"
#include "shared/tokenizer/tokenizer.h"
#include "shared/util/mapped_file.h"

namespace pinfer {

inline constexpr uint32_t kGgufDefaultAlignment = 32;
inline constexpr char kGgufMagic[] = "GGUF";
inline constexpr char kPowerInferMagic[] = "PWRI";  // PowerInfer's GGUF with predictor tensors

// Metadata value types (gguf_type in ggml).
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// Bytes of one fixed-size metadata value; 0 for strings, arrays and unknown types.
size_t GgufValueSize(GgufType t);
absl::string_view GgufTypeName(GgufType t);

// Tensor types, numbered as in ggml.h. The reader knows the storage size of all of these (so it
// can check any file's layout); the engine computes with F32, F16, BF16, Q8_0 and Q4_0.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
};

struct GgmlTypeTraits {
  absl::string_view name;
  int block_size;  // elements per block (1 for plain types)
  int type_size;   // bytes per block
};
// Null for ids ggml does not define.
const GgmlTypeTraits* FindGgmlTypeTraits(uint32_t type);
std::string GgmlTypeName(uint32_t type);  // "type 123" for unknown ids
absl::StatusOr<GgmlType> GgmlTypeFromDType(DType t);
// InvalidArgument "unsupported tensor type X" for types the engine does not compute with.
absl::StatusOr<DType> DTypeFromGgmlType(uint32_t type);

// An array value. Fixed-size elements are little-endian, unaligned, at `data`; string elements
// are in `strings`. Nested arrays are rejected by the parser (ggml does not support them either).
struct GgufArray {
  GgufType elem_type = GgufType::kUint8;
  uint64_t count = 0;
  const uint8_t* data = nullptr;
  std::vector<absl::string_view> strings;
};

// One metadata value; strings point into the file's bytes.
struct GgufValue {
  GgufType type = GgufType::kUint8;
  uint64_t u64 = 0;  // unsigned integer types and bool
  int64_t i64 = 0;   // signed integer types
  double f64 = 0;    // kFloat32 / kFloat64
  absl::string_view str;
  GgufArray array;

  bool is_integer() const;
};

struct GgufKeyValue {
  std::string key;
  GgufValue value;
};

struct GgufTensorInfo {
  std::string name;
  uint32_t type = 0;        // ggml type id
  std::vector<int64_t> ne;  // innermost first, as stored
  uint64_t offset = 0;      // relative to the data section
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;

  std::vector<int64_t> shape() const { return {ne.rbegin(), ne.rend()}; }  // outermost first
  int64_t numel() const;
};

class GgufFile {
 public:
  // Maps and parses a file whose magic is one of `accepted_magics` (4 characters each).
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(
      const std::string& path, const std::vector<std::string>& accepted_magics = {kGgufMagic});
  // Parses bytes that stay valid while `keep_alive` lives (fuzzers, in-memory files). `name`
  // prefixes error messages.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Parse(
      const uint8_t* data, size_t size, std::string name, std::shared_ptr<const void> keep_alive,
      const std::vector<std::string>& accepted_magics = {kGgufMagic});

  const std::string& name() const { return name_; }
  const std::string& magic() const { return magic_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the tensor data section
  // The mapping the views point into (null for Parse of caller-owned bytes).
  const std::shared_ptr<MappedFile>& mapped_file() const { return mapped_; }

  const std::vector<GgufKeyValue>& metadata() const { return kvs_; }
  const GgufValue* FindKey(absl::string_view key) const;
  bool HasKey(absl::string_view key) const { return FindKey(key) != nullptr; }
  // Typed getters: NotFound "missing key 'k'" when absent, InvalidArgument when the stored type
  // does not fit (integers are accepted from any integer type whose value is in range).
  absl::StatusOr<std::string> GetString(absl::string_view key) const;
  absl::StatusOr<uint32_t> GetU32(absl::string_view key) const;
  absl::StatusOr<int32_t> GetI32(absl::string_view key) const;
  absl::StatusOr<uint64_t> GetU64(absl::string_view key) const;
  absl::StatusOr<float> GetF32(absl::string_view key) const;  // from float32 or float64
  absl::StatusOr<bool> GetBool(absl::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(absl::string_view key) const;
  absl::StatusOr<std::vector<float>> GetF32Array(absl::string_view key) const;
  absl::StatusOr<std::vector<int32_t>> GetI32Array(absl::string_view key) const;
  // The array value of `key`, of any element type.
  absl::StatusOr<const GgufArray*> GetArray(absl::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* FindTensor(absl::string_view name) const;
  // A view for the engine (shape outermost first). NotFound "missing tensor 'n'"; InvalidArgument
  // "unsupported tensor type" for types outside F32/F16/BF16/Q8_0/Q4_0.
  absl::StatusOr<TensorView> GetTensor(absl::string_view name) const;
  static absl::StatusOr<TensorView> ToTensorView(const GgufTensorInfo& info);
  // The tensor, which must have ggml type `type` (e.g. kI32 index tensors).
  absl::StatusOr<const GgufTensorInfo*> GetTensorOfType(absl::string_view name,
                                                        GgmlType type) const;

 private:
  GgufFile() = default;
  absl::Status ParseAll(const uint8_t* data, size_t size,
                        const std::vector<std::string>& accepted_magics);

  std::string name_;
  std::string magic_;
  uint32_t version_ = 0;
  uint64_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::shared_ptr<MappedFile> mapped_;
  std::shared_ptr<const void> keep_alive_;
  std::vector<GgufKeyValue> kvs_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// Builds a GGUF v3 file: metadata in insertion order, then tensors, each aligned to
// `general.alignment` (32 unless set). Tensor data can be given up front or produced lazily at
// write time, so converting a large model holds one tensor in memory at a time.
class GgufWriter {
 public:
  explicit GgufWriter(std::string magic = kGgufMagic) : magic_(std::move(magic)) {}

  // Setting a key twice replaces the value (the key keeps its first position).
  void SetString(const std::string& key, absl::string_view value);
  void SetU32(const std::string& key, uint32_t value);
  void SetI32(const std::string& key, int32_t value);
  void SetU64(const std::string& key, uint64_t value);
  void SetF32(const std::string& key, float value);
  void SetBool(const std::string& key, bool value);
  void SetStringArray(const std::string& key, const std::vector<std::string>& values);
  void SetF32Array(const std::string& key, const std::vector<float>& values);
  void SetI32Array(const std::string& key, const std::vector<int32_t>& values);
  // Any value as parsed by GgufFile, with its type (copies metadata between files).
  void SetValue(const std::string& key, const GgufValue& value);

  using Producer = std::function<absl::StatusOr<std::string>()>;
  // `shape` is outermost first (pinfer's order); it is written innermost first. The data must be
  // exactly the tensor's storage size; a Producer's result is checked when it runs.
  absl::Status AddTensor(const std::string& name, GgmlType type, const std::vector<int64_t>& shape,
                         std::string data);
  absl::Status AddTensor(const std::string& name, GgmlType type, const std::vector<int64_t>& shape,
                         Producer produce);

  // Writes to `path` (through a temporary file renamed into place).
  absl::Status WriteFile(const std::string& path) const;
  // The whole file in memory (tests, small files).
  absl::StatusOr<std::string> WriteToString() const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> ne;  // innermost first
    uint64_t nbytes;
    Producer produce;
  };
  void SetRaw(const std::string& key, GgufType type, std::string payload);
  uint64_t Alignment() const;
  template <typename Sink>
  absl::Status WriteTo(Sink& sink) const;

  std::string magic_;
  std::vector<std::pair<std::string, std::string>> kvs_;  // key -> encoded type + value
  std::vector<Tensor> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// The tokenizer a GGUF file describes (tokenizer.ggml.model "llama" = sentencepiece BPE,
// "gpt2" = byte-level BPE). NotFound when the file has no vocabulary.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const GgufFile& file);

// LoadGgufModel on an already-opened file (the activation-locality loaders open PWRI files
// themselves, read their extra tensors and reuse this). The model shares the file's mapping.
struct GgufLoadOptions {
  // A PWRI file stores the down projection only transposed (ffn_down_t, LayerWeights::down_t).
  // The dense path wants down: [hidden, ffn], rebuilt in memory, and for quantized types in F32
  // (re-quantizing along the other axis would change the weights): 4 bytes a weight, 75 GB for a
  // 70B model. The workers read ffn_down_t's rows themselves and pass false: down stays empty.
  bool rebuild_down = true;
};
absl::StatusOr<std::unique_ptr<Model>> LoadGgufModelFrom(const GgufFile& file,
                                                         const GgufLoadOptions& options = {});

// llama.cpp's K-quant file types, as its `quantize` writes them: a base K type, some tensors at a
// higher one (the output head Q6_K; for the _M mixes attn_v and ffn_down of a third of the
// layers Q6_K), and fallbacks for rows that are not whole 256-value super-blocks.
enum class KQuantMix { kNone, kQ4_K_S, kQ4_K_M, kQ5_K_S, kQ5_K_M, kQ6_K };
struct GgufConvertOptions {
  GgmlType type = GgmlType::kF16;  // kF32, kF16, kQ8_0 or kQ4_0; ignored when `mix` is set
  KQuantMix mix = KQuantMix::kNone;
  std::string name;  // general.name; the directory's name when empty
};
// `pinfer convert --type`: f32, f16, q8_0, q4_0, q4_k_s, q4_k_m, q5_k_s, q5_k_m or q6_k.
absl::Status ParseConvertType(absl::string_view name, GgufConvertOptions* opts);
// The type llama.cpp's llama_tensor_get_type (no importance matrix) gives the 2-D weight `name`
// (a GGUF name such as blk.3.attn_v.weight) with rows of `cols` values, in a `n_layers`-layer
// llama model (`is_70b`: 80 layers with grouped-query attention, llama.cpp's LLM_TYPE_70B);
// `is_output` for output.weight, or token_embd.weight when the head is tied to it.
GgmlType KMixTensorType(KQuantMix mix, const std::string& name, int64_t cols, int n_layers,
                        bool is_output, bool is_70b);
// Converts a Hugging Face LlamaForCausalLM directory with a sentencepiece tokenizer.model to a
// GGUF v3 `llama` file in llama.cpp's conventions (`pinfer convert`; see gguf_convert.cc).
absl::Status ConvertHuggingFaceToGguf(const std::string& hf_dir, const std::string& out_path,
                                      const GgufConvertOptions& opts);
// Re-stores the weight matrices of a GGUF file in another type (like llama-quantize; F32/F16/
// BF16/Q8_0/Q4_0 sources), with the same rules; vectors and other tensors are copied unchanged.
absl::Status ConvertGgufToGguf(const std::string& in_path, const std::string& out_path,
                               const GgufConvertOptions& opts);

}  // namespace pinfer
