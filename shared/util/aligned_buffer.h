// Memory for large arrays that the CPU streams row by row (copied weight rows, KV caches):
// page-aligned, so a row whose size is a multiple of the page size never straddles one page more
// than it must (the hardware prefetchers stop at page boundaries), and for large arrays 2 MiB-
// aligned with a transparent-huge-page hint, so scattered row reads do not each start with a TLB
// miss. Zero-filled.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace pinfer {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<uint8_t[], FreeDeleter>;

inline AlignedBytes AllocateAligned(size_t bytes) {
  constexpr size_t kPage = 4096, kHugePage = size_t{2} << 20;
  const size_t align = bytes >= kHugePage ? kHugePage : kPage;
  const size_t rounded = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) throw std::bad_alloc();
  if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure is harmless
  std::memset(p, 0, rounded);
  return AlignedBytes(static_cast<uint8_t*>(p));
}

}  // namespace pinfer
