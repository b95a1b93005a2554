// A thin, absl-free facade over libsentencepiece. Debian's sentencepiece header defines
// `absl::string_view` as std::string_view, which clashes with Debian's Abseil (where it is a class
// of its own); only sentencepiece_wrapper.cc includes that header, and nothing there includes
// Abseil.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace pinfer::spm {

class Processor {
 public:
  // Returns null and sets *error when the serialized ModelProto is invalid.
  static std::unique_ptr<Processor> Load(const std::string& model_proto, std::string* error);
  virtual ~Processor() = default;
  virtual bool Encode(const std::string& text, std::vector<int>* ids, std::string* error) const = 0;
  virtual int PieceSize() const = 0;
  virtual std::string IdToPiece(int id) const = 0;
  virtual bool IsControl(int id) const = 0;
  virtual bool IsUnknown(int id) const = 0;
  virtual bool IsUnused(int id) const = 0;
  virtual bool IsByte(int id) const = 0;
};

}  // namespace pinfer::spm
