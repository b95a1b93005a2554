// GGUF parsing (see gguf.h). Every read goes through a bounds-checked cursor, and every count is
// checked against the bytes left before anything is allocated for it, so that a hostile or
// truncated file costs at most a small multiple of its own size and always ends in a clear error.
#include <bit>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "shared/model/gguf.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

static_assert(std::endian::native == std::endian::little,
              "GGUF parsing assumes a little-endian host");

constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS

bool IsKnownValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kFloat64); }

// A printable rendering of 4 magic bytes.
std::string PrintableMagic(const uint8_t* p) {
  std::string out;
  for (int i = 0; i < 4; ++i) {
    if (p[i] >= 0x20 && p[i] < 0x7f) {
      out += static_cast<char>(p[i]);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(p[i], absl::kZeroPad2));
    }
  }
  return out;
}

// Bounds-checked little-endian reads from the file's bytes.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size, const std::string& name)
      : data_(data), size_(size), name_(name) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  const uint8_t* here() const { return data_ + pos_; }

  absl::Status Error(absl::string_view msg) const {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": ", msg));
  }
  absl::Status Need(size_t n, absl::string_view what) const {
    if (n > remaining()) {
      return Error(absl::StrCat("truncated file: ", what, " at offset ", pos_, " needs ", n,
                                " bytes, only ", remaining(), " left"));
    }
    return absl::OkStatus();
  }
  absl::Status Skip(size_t n, absl::string_view what) {
    RETURN_IF_ERROR(Need(n, what));
    pos_ += n;
    return absl::OkStatus();
  }
  template <typename T>
  absl::StatusOr<T> Read(absl::string_view what) {
    RETURN_IF_ERROR(Need(sizeof(T), what));
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  absl::StatusOr<absl::string_view> ReadString(absl::string_view what) {
    ASSIGN_OR_RETURN(uint64_t len, Read<uint64_t>(absl::StrCat(what, " length")));
    if (len > remaining()) {
      return Error(absl::StrCat("truncated file: ", what, " at offset ", pos_, " has length ", len,
                                ", only ", remaining(), " bytes left"));
    }
    absl::string_view s(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& name_;
};

absl::Status ParseValue(Cursor& in, GgufType type, absl::string_view what, GgufValue* out) {
  out->type = type;
  switch (type) {
    case GgufType::kUint8: {
      ASSIGN_OR_RETURN(out->u64, in.Read<uint8_t>(what));
      return absl::OkStatus();
    }
    case GgufType::kBool: {
      ASSIGN_OR_RETURN(uint8_t b, in.Read<uint8_t>(what));
      out->u64 = b != 0;
      return absl::OkStatus();
    }
    case GgufType::kInt8: {
      ASSIGN_OR_RETURN(out->i64, in.Read<int8_t>(what));
      return absl::OkStatus();
    }
    case GgufType::kUint16: {
      ASSIGN_OR_RETURN(out->u64, in.Read<uint16_t>(what));
      return absl::OkStatus();
    }
    case GgufType::kInt16: {
      ASSIGN_OR_RETURN(out->i64, in.Read<int16_t>(what));
      return absl::OkStatus();
    }
    case GgufType::kUint32: {
      ASSIGN_OR_RETURN(out->u64, in.Read<uint32_t>(what));
      return absl::OkStatus();
    }
    case GgufType::kInt32: {
      ASSIGN_OR_RETURN(out->i64, in.Read<int32_t>(what));
      return absl::OkStatus();
    }
    case GgufType::kUint64: {
      ASSIGN_OR_RETURN(out->u64, in.Read<uint64_t>(what));
      return absl::OkStatus();
    }
    case GgufType::kInt64: {
      ASSIGN_OR_RETURN(out->i64, in.Read<int64_t>(what));
      return absl::OkStatus();
    }
    case GgufType::kFloat32: {
      ASSIGN_OR_RETURN(out->f64, in.Read<float>(what));
      return absl::OkStatus();
    }
    case GgufType::kFloat64: {
      ASSIGN_OR_RETURN(out->f64, in.Read<double>(what));
      return absl::OkStatus();
    }
    case GgufType::kString: {
      ASSIGN_OR_RETURN(out->str, in.ReadString(what));
      return absl::OkStatus();
    }
    case GgufType::kArray: {
      ASSIGN_OR_RETURN(uint32_t elem, in.Read<uint32_t>(absl::StrCat(what, " element type")));
      if (!IsKnownValueType(elem)) {
        return in.Error(absl::StrCat(what, ": unknown array element type ", elem));
      }
      if (elem == static_cast<uint32_t>(GgufType::kArray)) {
        return in.Error(absl::StrCat(what, ": nested arrays are not supported"));
      }
      GgufArray& a = out->array;
      a.elem_type = static_cast<GgufType>(elem);
      ASSIGN_OR_RETURN(a.count, in.Read<uint64_t>(absl::StrCat(what, " element count")));
      if (a.elem_type == GgufType::kString) {
        // Each string takes at least its 8-byte length: bound the count before reserving.
        if (a.count > in.remaining() / 8) {
          return in.Error(absl::StrCat("truncated file: ", what, " claims ", a.count,
                                       " strings, more than the ", in.remaining(),
                                       " bytes left can hold"));
        }
        a.strings.reserve(a.count);
        for (uint64_t i = 0; i < a.count; ++i) {
          ASSIGN_OR_RETURN(absl::string_view s, in.ReadString(absl::StrCat(what, "[", i, "]")));
          a.strings.push_back(s);
        }
        return absl::OkStatus();
      }
      const size_t elem_size = GgufValueSize(a.elem_type);
      if (a.count > in.remaining() / elem_size) {
        return in.Error(absl::StrCat("truncated file: ", what, " claims ", a.count, " elements of ",
                                     elem_size, " bytes, only ", in.remaining(), " bytes left"));
      }
      a.data = in.here();
      return in.Skip(a.count * elem_size, what);
    }
  }
  return in.Error(absl::StrCat(what, ": unknown value type ", static_cast<uint32_t>(type)));
}

// Reads element i of a fixed-size array as a double / signed 128-bit-safe integer pair.
template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Integer element `i` of an integer array: sets *neg/*mag (sign and magnitude).
void ArrayInt(const GgufArray& a, uint64_t i, bool* neg, uint64_t* mag) {
  int64_t s = 0;
  uint64_t u = 0;
  bool is_signed = true;
  const uint8_t* p = a.data + i * GgufValueSize(a.elem_type);
  switch (a.elem_type) {
    case GgufType::kInt8:
      s = Load<int8_t>(p);
      break;
    case GgufType::kInt16:
      s = Load<int16_t>(p);
      break;
    case GgufType::kInt32:
      s = Load<int32_t>(p);
      break;
    case GgufType::kInt64:
      s = Load<int64_t>(p);
      break;
    case GgufType::kUint8:
      u = Load<uint8_t>(p);
      is_signed = false;
      break;
    case GgufType::kUint16:
      u = Load<uint16_t>(p);
      is_signed = false;
      break;
    case GgufType::kUint32:
      u = Load<uint32_t>(p);
      is_signed = false;
      break;
    case GgufType::kUint64:
      u = Load<uint64_t>(p);
      is_signed = false;
      break;
    default:
      break;
  }
  if (is_signed) {
    *neg = s < 0;
    *mag = s < 0 ? 0 - static_cast<uint64_t>(s) : static_cast<uint64_t>(s);
  } else {
    *neg = false;
    *mag = u;
  }
}

bool IsIntegerType(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kUint16:
    case GgufType::kInt16:
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kUint64:
    case GgufType::kInt64:
      return true;
    default:
      return false;
  }
}

bool IsSignedType(GgufType t) {
  return t == GgufType::kInt8 || t == GgufType::kInt16 || t == GgufType::kInt32 ||
         t == GgufType::kInt64;
}

struct TypeEntry {
  uint32_t id;
  GgmlTypeTraits traits;
};
constexpr TypeEntry kGgmlTypes[] = {
    {0, {"F32", 1, 4}},         {1, {"F16", 1, 2}},         {2, {"Q4_0", 32, 18}},
    {3, {"Q4_1", 32, 20}},      {6, {"Q5_0", 32, 22}},      {7, {"Q5_1", 32, 24}},
    {8, {"Q8_0", 32, 34}},      {9, {"Q8_1", 32, 36}},      {10, {"Q2_K", 256, 84}},
    {11, {"Q3_K", 256, 110}},   {12, {"Q4_K", 256, 144}},   {13, {"Q5_K", 256, 176}},
    {14, {"Q6_K", 256, 210}},   {15, {"Q8_K", 256, 292}},   {16, {"IQ2_XXS", 256, 66}},
    {17, {"IQ2_XS", 256, 74}},  {18, {"IQ3_XXS", 256, 98}}, {19, {"IQ1_S", 256, 50}},
    {20, {"IQ4_NL", 32, 18}},   {21, {"IQ3_S", 256, 110}},  {22, {"IQ2_S", 256, 82}},
    {23, {"IQ4_XS", 256, 136}}, {24, {"I8", 1, 1}},         {25, {"I16", 1, 2}},
    {26, {"I32", 1, 4}},        {27, {"I64", 1, 8}},        {28, {"F64", 1, 8}},
    {29, {"IQ1_M", 256, 56}},   {30, {"BF16", 1, 2}},       {34, {"TQ1_0", 256, 54}},
    {35, {"TQ2_0", 256, 66}},   {39, {"MXFP4", 32, 17}},
};

}  // namespace

size_t GgufValueSize(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return 1;
    case GgufType::kUint16:
    case GgufType::kInt16:
      return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return 8;
    case GgufType::kString:
    case GgufType::kArray:
      return 0;
  }
  return 0;
}

absl::string_view GgufTypeName(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
      return "uint8";
    case GgufType::kInt8:
      return "int8";
    case GgufType::kUint16:
      return "uint16";
    case GgufType::kInt16:
      return "int16";
    case GgufType::kUint32:
      return "uint32";
    case GgufType::kInt32:
      return "int32";
    case GgufType::kFloat32:
      return "float32";
    case GgufType::kBool:
      return "bool";
    case GgufType::kString:
      return "string";
    case GgufType::kArray:
      return "array";
    case GgufType::kUint64:
      return "uint64";
    case GgufType::kInt64:
      return "int64";
    case GgufType::kFloat64:
      return "float64";
  }
  return "unknown";
}

const GgmlTypeTraits* FindGgmlTypeTraits(uint32_t type) {
  for (const TypeEntry& e : kGgmlTypes) {
    if (e.id == type) return &e.traits;
  }
  return nullptr;
}

std::string GgmlTypeName(uint32_t type) {
  const GgmlTypeTraits* t = FindGgmlTypeTraits(type);
  return t != nullptr ? std::string(t->name) : absl::StrCat("type ", type);
}

absl::StatusOr<GgmlType> GgmlTypeFromDType(DType t) {
  switch (t) {
    case DType::kF32:
      return GgmlType::kF32;
    case DType::kF16:
      return GgmlType::kF16;
    case DType::kBF16:
      return GgmlType::kBF16;
    case DType::kQ8_0:
      return GgmlType::kQ8_0;
    case DType::kQ4_0:
      return GgmlType::kQ4_0;
    case DType::kQ4_K:
      return GgmlType::kQ4_K;
    case DType::kQ5_K:
      return GgmlType::kQ5_K;
    case DType::kQ6_K:
      return GgmlType::kQ6_K;
  }
  return absl::InvalidArgumentError("dtype has no ggml equivalent");
}

absl::StatusOr<DType> DTypeFromGgmlType(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      return DType::kF32;
    case GgmlType::kF16:
      return DType::kF16;
    case GgmlType::kBF16:
      return DType::kBF16;
    case GgmlType::kQ8_0:
      return DType::kQ8_0;
    case GgmlType::kQ4_0:
      return DType::kQ4_0;
    case GgmlType::kQ4_K:
      return DType::kQ4_K;
    case GgmlType::kQ5_K:
      return DType::kQ5_K;
    case GgmlType::kQ6_K:
      return DType::kQ6_K;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported tensor type ", GgmlTypeName(type),
                   " (pinfer computes with F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K and Q6_K)"));
}

bool GgufValue::is_integer() const { return IsIntegerType(type); }

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // the parser guarantees this does not overflow
  return n;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(
    const std::string& path, const std::vector<std::string>& accepted_magics) {
  ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> mapped, MappedFile::Open(path));
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->name_ = path;
  f->mapped_ = mapped;
  f->keep_alive_ = mapped;
  RETURN_IF_ERROR(f->ParseAll(mapped->data(), mapped->size(), accepted_magics));
  return f;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(
    const uint8_t* data, size_t size, std::string name, std::shared_ptr<const void> keep_alive,
    const std::vector<std::string>& accepted_magics) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->name_ = std::move(name);
  f->keep_alive_ = std::move(keep_alive);
  RETURN_IF_ERROR(f->ParseAll(data, size, accepted_magics));
  return f;
}

absl::Status GgufFile::ParseAll(const uint8_t* data, size_t size,
                                const std::vector<std::string>& accepted_magics) {
  Cursor in(data, size, name_);

  // Header: magic, version, tensor count, key/value count.
  if (size < 4) return in.Error("truncated file: too small for a GGUF header");
  magic_.assign(reinterpret_cast<const char*>(data), 4);
  bool magic_ok = false;
  std::string expected;
  for (const std::string& m : accepted_magics) {
    magic_ok |= (m == magic_);
    absl::StrAppend(&expected, expected.empty() ? "" : " or ", m);
  }
  if (!magic_ok) {
    return in.Error(absl::StrCat("bad magic '", PrintableMagic(data), "' (expected ", expected,
                                 "): not a GGUF file"));
  }
  RETURN_IF_ERROR(in.Skip(4, "magic"));
  ASSIGN_OR_RETURN(version_, in.Read<uint32_t>("version"));
  if (version_ != 2 && version_ != 3) {
    if (version_ != 0 && (version_ & 0xffff) == 0) {
      return in.Error("big-endian GGUF files are not supported");
    }
    return in.Error(
        absl::StrCat("unsupported GGUF version ", version_, " (2 and 3 are supported)"));
  }
  ASSIGN_OR_RETURN(uint64_t n_tensors, in.Read<uint64_t>("tensor count"));
  ASSIGN_OR_RETURN(uint64_t n_kv, in.Read<uint64_t>("metadata count"));
  // The smallest key/value is 13 bytes (empty key, type, one byte); the smallest tensor info 32
  // (empty name, dimension count, one dimension, type, offset).
  if (n_kv > in.remaining() / 13) {
    return in.Error(absl::StrCat("metadata count ", n_kv, " is more than the ", in.remaining(),
                                 " bytes left can hold (truncated or corrupt file)"));
  }
  if (n_tensors > in.remaining() / 32) {
    return in.Error(absl::StrCat("tensor count ", n_tensors, " is more than the ", in.remaining(),
                                 " bytes left can hold (truncated or corrupt file)"));
  }

  // Metadata.
  kvs_.reserve(n_kv);
  for (uint64_t i = 0; i < n_kv; ++i) {
    GgufKeyValue kv;
    ASSIGN_OR_RETURN(absl::string_view key, in.ReadString(absl::StrCat("key of metadata #", i)));
    kv.key = std::string(key);
    ASSIGN_OR_RETURN(uint32_t type, in.Read<uint32_t>(absl::StrCat("type of key '", kv.key, "'")));
    if (!IsKnownValueType(type)) {
      return in.Error(absl::StrCat("key '", kv.key, "' has unknown value type ", type));
    }
    RETURN_IF_ERROR(
        ParseValue(in, static_cast<GgufType>(type), absl::StrCat("key '", kv.key, "'"), &kv.value));
    if (!kv_index_.emplace(kv.key, kvs_.size()).second) {
      return in.Error(absl::StrCat("duplicate key '", kv.key, "'"));
    }
    kvs_.push_back(std::move(kv));
  }

  alignment_ = kGgufDefaultAlignment;
  if (const GgufValue* a = FindKey("general.alignment"); a != nullptr) {
    if (a->type != GgufType::kUint32) {
      return in.Error(
          absl::StrCat("general.alignment has type ", GgufTypeName(a->type), ", expected uint32"));
    }
    if (a->u64 == 0 || (a->u64 & (a->u64 - 1)) != 0) {
      return in.Error(absl::StrCat("general.alignment ", a->u64, " is not a power of two"));
    }
    alignment_ = a->u64;
  }

  // Tensor infos.
  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    ASSIGN_OR_RETURN(absl::string_view name, in.ReadString(absl::StrCat("name of tensor #", i)));
    t.name = std::string(name);
    const std::string what = absl::StrCat("tensor '", t.name, "'");
    ASSIGN_OR_RETURN(uint32_t n_dims, in.Read<uint32_t>(absl::StrCat(what, " dimension count")));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return in.Error(
          absl::StrCat(what, " has ", n_dims, " dimensions (1 to ", kMaxDims, " are supported)"));
    }
    uint64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      ASSIGN_OR_RETURN(uint64_t ne, in.Read<uint64_t>(absl::StrCat(what, " dimension")));
      if (ne == 0 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return in.Error(absl::StrCat(what, " has invalid dimension ", ne));
      }
      if (__builtin_mul_overflow(numel, ne, &numel) ||
          numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return in.Error(absl::StrCat(what, ": element count overflows"));
      }
      t.ne.push_back(static_cast<int64_t>(ne));
    }
    ASSIGN_OR_RETURN(t.type, in.Read<uint32_t>(absl::StrCat(what, " type")));
    // PowerInfer's ggml fork numbers I8/I16/I32 16/17/18 (ids later ggml gave to IQ2_XXS,
    // IQ2_XS, IQ3_XXS); its files (magic PWRI, e.g. the .gpuidx neuron index) use them.
    if (magic_ == kPowerInferMagic && t.type >= 16 && t.type <= 18) t.type += 8;
    const GgmlTypeTraits* traits = FindGgmlTypeTraits(t.type);
    if (traits == nullptr) {
      return in.Error(absl::StrCat(what, " has unknown tensor type ", t.type));
    }
    if (t.ne[0] % traits->block_size != 0) {
      return in.Error(absl::StrCat(what, ": row length ", t.ne[0], " is not a multiple of the ",
                                   traits->name, " block size ", traits->block_size));
    }
    // Storage size = blocks * block bytes; numel < 2^63 keeps blocks small enough, but the byte
    // count may still overflow.
    const uint64_t blocks = numel / traits->block_size;
    if (__builtin_mul_overflow(blocks, static_cast<uint64_t>(traits->type_size), &t.nbytes)) {
      return in.Error(absl::StrCat(what, ": byte size overflows"));
    }
    ASSIGN_OR_RETURN(t.offset, in.Read<uint64_t>(absl::StrCat(what, " offset")));
    if (!tensor_index_.emplace(t.name, tensors_.size()).second) {
      return in.Error(absl::StrCat("duplicate tensor name '", t.name, "'"));
    }
    tensors_.push_back(std::move(t));
  }

  // Tensor data: the section starts at the next multiple of the alignment.
  const uint64_t pos = in.pos();
  data_offset_ = (pos + alignment_ - 1) / alignment_ * alignment_;  // pos < 2^63: no overflow
  if (tensors_.empty()) return absl::OkStatus();
  if (data_offset_ > size) {
    return in.Error(absl::StrCat("truncated file: tensor data section starts at ", data_offset_,
                                 " but the file has ", size, " bytes"));
  }
  const uint64_t data_size = size - data_offset_;
  for (GgufTensorInfo& t : tensors_) {
    if (t.offset % alignment_ != 0) {
      return in.Error(absl::StrCat("tensor '", t.name, "' offset ", t.offset,
                                   " is not a multiple of the alignment ", alignment_));
    }
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      return in.Error(absl::StrCat("tensor '", t.name, "' data (offset ", t.offset, ", ", t.nbytes,
                                   " bytes) is out of bounds: the data section has ", data_size,
                                   " bytes"));
    }
    t.data = data + data_offset_ + t.offset;
  }
  return absl::OkStatus();
}

const GgufValue* GgufFile::FindKey(absl::string_view key) const {
  auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
}

namespace {

absl::Status MissingKey(const std::string& file, absl::string_view key) {
  return absl::NotFoundError(absl::StrCat(file, ": missing key '", key, "'"));
}
absl::Status WrongType(const std::string& file, absl::string_view key, const GgufValue& v,
                       absl::string_view expected) {
  std::string got(GgufTypeName(v.type));
  if (v.type == GgufType::kArray) got = absl::StrCat("array of ", GgufTypeName(v.array.elem_type));
  return absl::InvalidArgumentError(
      absl::StrCat(file, ": key '", key, "' has type ", got, ", expected ", expected));
}

// An integer value's sign and magnitude.
void ScalarInt(const GgufValue& v, bool* neg, uint64_t* mag) {
  if (IsSignedType(v.type)) {
    *neg = v.i64 < 0;
    *mag = v.i64 < 0 ? 0 - static_cast<uint64_t>(v.i64) : static_cast<uint64_t>(v.i64);
  } else {
    *neg = false;
    *mag = v.u64;
  }
}

}  // namespace

absl::StatusOr<std::string> GgufFile::GetString(absl::string_view key) const {
  const GgufValue* v = FindKey(key);
  if (v == nullptr) return MissingKey(name_, key);
  if (v->type != GgufType::kString) return WrongType(name_, key, *v, "string");
  return std::string(v->str);
}

absl::StatusOr<uint64_t> GgufFile::GetU64(absl::string_view key) const {
  const GgufValue* v = FindKey(key);
  if (v == nullptr) return MissingKey(name_, key);
  if (!v->is_integer()) return WrongType(name_, key, *v, "an unsigned integer");
  bool neg;
  uint64_t mag;
  ScalarInt(*v, &neg, &mag);
  if (neg) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": key '", key, "' is negative"));
  }
  return mag;
}

absl::StatusOr<uint32_t> GgufFile::GetU32(absl::string_view key) const {
  ASSIGN_OR_RETURN(uint64_t v, GetU64(key));
  if (v > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": key '", key, "' value ", v, " is out of range"));
  }
  return static_cast<uint32_t>(v);
}

absl::StatusOr<int32_t> GgufFile::GetI32(absl::string_view key) const {
  const GgufValue* v = FindKey(key);
  if (v == nullptr) return MissingKey(name_, key);
  if (!v->is_integer()) return WrongType(name_, key, *v, "an integer");
  bool neg;
  uint64_t mag;
  ScalarInt(*v, &neg, &mag);
  if (mag > (neg ? 2147483648ull : 2147483647ull)) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": key '", key, "' is out of range"));
  }
  return neg ? static_cast<int32_t>(-static_cast<int64_t>(mag)) : static_cast<int32_t>(mag);
}

absl::StatusOr<float> GgufFile::GetF32(absl::string_view key) const {
  const GgufValue* v = FindKey(key);
  if (v == nullptr) return MissingKey(name_, key);
  if (v->type != GgufType::kFloat32 && v->type != GgufType::kFloat64) {
    return WrongType(name_, key, *v, "float32");
  }
  return static_cast<float>(v->f64);
}

absl::StatusOr<bool> GgufFile::GetBool(absl::string_view key) const {
  const GgufValue* v = FindKey(key);
  if (v == nullptr) return MissingKey(name_, key);
  if (v->type != GgufType::kBool) return WrongType(name_, key, *v, "bool");
  return v->u64 != 0;
}

absl::StatusOr<const GgufArray*> GgufFile::GetArray(absl::string_view key) const {
  const GgufValue* v = FindKey(key);
  if (v == nullptr) return MissingKey(name_, key);
  if (v->type != GgufType::kArray) return WrongType(name_, key, *v, "array");
  return &v->array;
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufArray* a, GetArray(key));
  if (a->elem_type != GgufType::kString) {
    return WrongType(name_, key, *FindKey(key), "array of string");
  }
  return std::vector<std::string>(a->strings.begin(), a->strings.end());
}

absl::StatusOr<std::vector<float>> GgufFile::GetF32Array(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufArray* a, GetArray(key));
  std::vector<float> out(a->count);
  if (a->elem_type == GgufType::kFloat32) {
    if (a->count > 0) std::memcpy(out.data(), a->data, a->count * 4);
  } else if (a->elem_type == GgufType::kFloat64) {
    for (uint64_t i = 0; i < a->count; ++i)
      out[i] = static_cast<float>(Load<double>(a->data + 8 * i));
  } else {
    return WrongType(name_, key, *FindKey(key), "array of float32");
  }
  return out;
}

absl::StatusOr<std::vector<int32_t>> GgufFile::GetI32Array(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufArray* a, GetArray(key));
  if (!IsIntegerType(a->elem_type)) {
    return WrongType(name_, key, *FindKey(key), "array of int32");
  }
  std::vector<int32_t> out(a->count);
  for (uint64_t i = 0; i < a->count; ++i) {
    bool neg;
    uint64_t mag;
    ArrayInt(*a, i, &neg, &mag);
    if (mag > (neg ? 2147483648ull : 2147483647ull)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": key '", key, "' element ", i, " is out of int32 range"));
    }
    out[i] = neg ? static_cast<int32_t>(-static_cast<int64_t>(mag)) : static_cast<int32_t>(mag);
  }
  return out;
}

const GgufTensorInfo* GgufFile::FindTensor(absl::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<TensorView> GgufFile::ToTensorView(const GgufTensorInfo& info) {
  auto dtype = DTypeFromGgmlType(info.type);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", info.name, "': ", dtype.status().message()));
  }
  TensorView t;
  t.name = info.name;
  t.dtype = *dtype;
  t.shape = info.shape();
  t.data = info.data;
  return t;
}

absl::StatusOr<TensorView> GgufFile::GetTensor(absl::string_view name) const {
  const GgufTensorInfo* info = FindTensor(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(name_, ": missing tensor '", name, "'"));
  }
  auto view = ToTensorView(*info);
  if (!view.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": ", view.status().message()));
  }
  return view;
}

absl::StatusOr<const GgufTensorInfo*> GgufFile::GetTensorOfType(absl::string_view name,
                                                                GgmlType type) const {
  const GgufTensorInfo* info = FindTensor(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(name_, ": missing tensor '", name, "'"));
  }
  if (info->type != static_cast<uint32_t>(type)) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor '", name, "' has type ",
                                                   GgmlTypeName(info->type), ", expected ",
                                                   GgmlTypeName(static_cast<uint32_t>(type))));
  }
  return info;
}

}  // namespace pinfer
