// Read-only memory mapping of a file. Model weights are used straight from the mapping so that a
// process touches (and keeps resident) only the bytes it actually reads: the cpu-worker maps only
// the cold rows, the gpu-worker copies only what goes to the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace pinfer {

class MappedFile {
 public:
  static absl::StatusOr<std::shared_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_;
  size_t size_;
};

// Reads a whole (small) file into a string: configs, vocabularies.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace pinfer
