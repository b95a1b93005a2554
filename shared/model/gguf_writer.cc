// GGUF v3 writing (see gguf.h). The layout is exactly what ggml's gguf_write produces: header,
// key/values, tensor infos, zero padding to the alignment, then each tensor's bytes padded to the
// alignment, so that llama.cpp (which insists on tightly packed, aligned offsets) loads the file.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "shared/model/gguf.h"
#include "shared/util/status_macros.h"

namespace pinfer {
namespace {

constexpr size_t kMaxTensorName = 63;  // ggml's GGML_MAX_NAME (64) includes the terminator

template <typename T>
void Append(std::string* out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out->append(b, sizeof(T));
}

void AppendString(std::string* out, absl::string_view s) {
  Append<uint64_t>(out, s.size());
  out->append(s.data(), s.size());
}

uint64_t AlignUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

class StringSink {
 public:
  explicit StringSink(std::string* out) : out_(out) {}
  absl::Status Write(absl::string_view bytes) {
    out_->append(bytes.data(), bytes.size());
    return absl::OkStatus();
  }

 private:
  std::string* out_;
};

class FileSink {
 public:
  FileSink(std::FILE* f, const std::string& path) : f_(f), path_(path) {}
  absl::Status Write(absl::string_view bytes) {
    if (std::fwrite(bytes.data(), 1, bytes.size(), f_) != bytes.size()) {
      return absl::InternalError(absl::StrCat("writing ", path_, " failed"));
    }
    return absl::OkStatus();
  }

 private:
  std::FILE* f_;
  const std::string& path_;
};

}  // namespace

void GgufWriter::SetRaw(const std::string& key, GgufType type, std::string payload) {
  std::string encoded;
  Append<uint32_t>(&encoded, static_cast<uint32_t>(type));
  encoded += payload;
  for (auto& kv : kvs_) {
    if (kv.first == key) {
      kv.second = std::move(encoded);
      return;
    }
  }
  kvs_.emplace_back(key, std::move(encoded));
}

void GgufWriter::SetString(const std::string& key, absl::string_view value) {
  std::string p;
  AppendString(&p, value);
  SetRaw(key, GgufType::kString, std::move(p));
}

void GgufWriter::SetU32(const std::string& key, uint32_t value) {
  std::string p;
  Append(&p, value);
  SetRaw(key, GgufType::kUint32, std::move(p));
}

void GgufWriter::SetI32(const std::string& key, int32_t value) {
  std::string p;
  Append(&p, value);
  SetRaw(key, GgufType::kInt32, std::move(p));
}

void GgufWriter::SetU64(const std::string& key, uint64_t value) {
  std::string p;
  Append(&p, value);
  SetRaw(key, GgufType::kUint64, std::move(p));
}

void GgufWriter::SetF32(const std::string& key, float value) {
  std::string p;
  Append(&p, value);
  SetRaw(key, GgufType::kFloat32, std::move(p));
}

void GgufWriter::SetBool(const std::string& key, bool value) {
  std::string p;
  Append<uint8_t>(&p, value ? 1 : 0);
  SetRaw(key, GgufType::kBool, std::move(p));
}

void GgufWriter::SetStringArray(const std::string& key, const std::vector<std::string>& values) {
  std::string p;
  Append<uint32_t>(&p, static_cast<uint32_t>(GgufType::kString));
  Append<uint64_t>(&p, values.size());
  for (const std::string& s : values) AppendString(&p, s);
  SetRaw(key, GgufType::kArray, std::move(p));
}

void GgufWriter::SetF32Array(const std::string& key, const std::vector<float>& values) {
  std::string p;
  Append<uint32_t>(&p, static_cast<uint32_t>(GgufType::kFloat32));
  Append<uint64_t>(&p, values.size());
  for (float v : values) Append(&p, v);
  SetRaw(key, GgufType::kArray, std::move(p));
}

void GgufWriter::SetI32Array(const std::string& key, const std::vector<int32_t>& values) {
  std::string p;
  Append<uint32_t>(&p, static_cast<uint32_t>(GgufType::kInt32));
  Append<uint64_t>(&p, values.size());
  for (int32_t v : values) Append(&p, v);
  SetRaw(key, GgufType::kArray, std::move(p));
}

void GgufWriter::SetValue(const std::string& key, const GgufValue& v) {
  std::string p;
  auto scalar = [&](GgufType t, uint64_t u, int64_t i, double f) {
    switch (t) {
      case GgufType::kUint8:
      case GgufType::kBool:
        Append<uint8_t>(&p, static_cast<uint8_t>(u));
        break;
      case GgufType::kInt8:
        Append<int8_t>(&p, static_cast<int8_t>(i));
        break;
      case GgufType::kUint16:
        Append<uint16_t>(&p, static_cast<uint16_t>(u));
        break;
      case GgufType::kInt16:
        Append<int16_t>(&p, static_cast<int16_t>(i));
        break;
      case GgufType::kUint32:
        Append<uint32_t>(&p, static_cast<uint32_t>(u));
        break;
      case GgufType::kInt32:
        Append<int32_t>(&p, static_cast<int32_t>(i));
        break;
      case GgufType::kUint64:
        Append<uint64_t>(&p, u);
        break;
      case GgufType::kInt64:
        Append<int64_t>(&p, i);
        break;
      case GgufType::kFloat32:
        Append<float>(&p, static_cast<float>(f));
        break;
      case GgufType::kFloat64:
        Append<double>(&p, f);
        break;
      default:
        break;
    }
  };
  if (v.type == GgufType::kString) {
    AppendString(&p, v.str);
  } else if (v.type == GgufType::kArray) {
    const GgufArray& a = v.array;
    Append<uint32_t>(&p, static_cast<uint32_t>(a.elem_type));
    Append<uint64_t>(&p, a.count);
    if (a.elem_type == GgufType::kString) {
      for (absl::string_view s : a.strings) AppendString(&p, s);
    } else {
      // Fixed-size elements are little-endian in the source file already: copy the bytes.
      p.append(reinterpret_cast<const char*>(a.data), a.count * GgufValueSize(a.elem_type));
    }
  } else {
    scalar(v.type, v.u64, v.i64, v.f64);
  }
  SetRaw(key, v.type, std::move(p));
}

uint64_t GgufWriter::Alignment() const {
  for (const auto& kv : kvs_) {
    if (kv.first == "general.alignment" && kv.second.size() == 8) {
      uint32_t type, value;
      std::memcpy(&type, kv.second.data(), 4);
      std::memcpy(&value, kv.second.data() + 4, 4);
      if (type == static_cast<uint32_t>(GgufType::kUint32)) return value;
    }
  }
  return kGgufDefaultAlignment;
}

absl::Status GgufWriter::AddTensor(const std::string& name, GgmlType type,
                                   const std::vector<int64_t>& shape, std::string data) {
  const size_t size = data.size();
  auto shared = std::make_shared<std::string>(std::move(data));
  RETURN_IF_ERROR(
      AddTensor(name, type, shape, [shared]() -> absl::StatusOr<std::string> { return *shared; }));
  const uint64_t want = tensors_.back().nbytes;
  if (size != want) {
    tensors_.pop_back();
    tensor_index_.erase(name);
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': ", size, " bytes of data for a tensor of ", want, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status GgufWriter::AddTensor(const std::string& name, GgmlType type,
                                   const std::vector<int64_t>& shape, Producer produce) {
  auto err = [&](absl::string_view msg) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': ", msg));
  };
  if (name.empty() || name.size() > kMaxTensorName) {
    return err(absl::StrCat("name must have 1 to ", kMaxTensorName, " bytes"));
  }
  if (tensor_index_.count(name)) return err("added twice");
  if (shape.empty() || shape.size() > 4) return err("must have 1 to 4 dimensions");
  const GgmlTypeTraits* traits = FindGgmlTypeTraits(static_cast<uint32_t>(type));
  if (traits == nullptr) return err("unknown tensor type");
  Tensor t;
  t.name = name;
  t.type = type;
  t.ne.assign(shape.rbegin(), shape.rend());
  uint64_t numel = 1;
  for (int64_t d : t.ne) {
    if (d <= 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      return err("invalid shape");
    }
  }
  if (t.ne[0] % traits->block_size != 0) {
    return err(absl::StrCat("row length ", t.ne[0], " is not a multiple of ", traits->block_size));
  }
  t.nbytes = numel / traits->block_size * traits->type_size;
  t.produce = std::move(produce);
  tensor_index_[name] = tensors_.size();
  tensors_.push_back(std::move(t));
  return absl::OkStatus();
}

template <typename Sink>
absl::Status GgufWriter::WriteTo(Sink& sink) const {
  if (magic_.size() != 4) return absl::InvalidArgumentError("GGUF magic must have 4 bytes");
  const uint64_t alignment = Alignment();
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError("general.alignment must be a power of two");
  }
  std::string head = magic_;
  Append<uint32_t>(&head, 3);
  Append<uint64_t>(&head, tensors_.size());
  Append<uint64_t>(&head, kvs_.size());
  for (const auto& [key, encoded] : kvs_) {
    AppendString(&head, key);
    head += encoded;
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    AppendString(&head, t.name);
    Append<uint32_t>(&head, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) Append<uint64_t>(&head, static_cast<uint64_t>(d));
    uint32_t type = static_cast<uint32_t>(t.type);
    // PWRI files use PowerInfer's ggml numbering of the integer types (see gguf_reader.cc).
    if (magic_ == kPowerInferMagic && type >= 24 && type <= 26) type -= 8;
    Append<uint32_t>(&head, type);
    Append<uint64_t>(&head, offset);
    offset = AlignUp(offset + t.nbytes, alignment);
  }
  head.resize(AlignUp(head.size(), alignment), '\0');
  RETURN_IF_ERROR(sink.Write(head));
  for (const Tensor& t : tensors_) {
    ASSIGN_OR_RETURN(std::string data, t.produce());
    if (data.size() != t.nbytes) {
      return absl::InternalError(absl::StrCat("tensor '", t.name, "': produced ", data.size(),
                                              " bytes, expected ", t.nbytes));
    }
    data.resize(AlignUp(data.size(), alignment), '\0');
    RETURN_IF_ERROR(sink.Write(data));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> GgufWriter::WriteToString() const {
  std::string out;
  StringSink sink(&out);
  RETURN_IF_ERROR(WriteTo(sink));
  return out;
}

absl::Status GgufWriter::WriteFile(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  }
  FileSink sink(f, tmp);
  absl::Status st = WriteTo(sink);
  if (std::fclose(f) != 0 && st.ok()) {
    st = absl::InternalError(absl::StrCat("writing ", tmp, " failed"));
  }
  std::error_code ec;
  if (!st.ok()) {
    std::filesystem::remove(tmp, ec);
    return st;
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec)
    return absl::InternalError(absl::StrCat("renaming ", tmp, " to ", path, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace pinfer
