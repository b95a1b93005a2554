// Memory for large arrays that the CPU streams row by row (copied weight rows, KV caches):
// page-aligned, so a row whose size is a multiple of the page size never straddles one page more
// than it must (the hardware prefetchers stop at page boundaries), and for large arrays 2 MiB-
// aligned in transparent huge pages, so scattered row reads do not each start with a TLB miss.
// Zero-filled.
//
// The hint (MADV_HUGEPAGE) alone gets huge pages only where the kernel finds free 2 MiB blocks when
// the memory is first touched (and the THP defrag setting lets it compact); where free memory is
// fragmented it falls back to 4 KiB pages without a word. So the zero-filled pages are then
// collapsed into huge pages (MADV_COLLAPSE, Linux 6.1+), which compacts memory if it must; where
// they already are huge pages, it costs nothing.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "shared/util/thread_pool.h"

namespace pinfer {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<uint8_t[], FreeDeleter>;

// Asks for [p, p + bytes) (2 MiB-aligned, its pages present) to be backed by huge pages now:
// the hint, then a synchronous collapse. Returns whether the collapse succeeded; a kernel without
// MADV_COLLAPSE, THP turned off or no memory to compact into leaves the pages as they are.
inline bool CollapseToHugePages(void* p, size_t bytes) {
#ifndef MADV_COLLAPSE
  constexpr int MADV_COLLAPSE = 25;  // Linux 6.1's value; older kernels answer EINVAL
#endif
  madvise(p, bytes, MADV_HUGEPAGE);
  return madvise(p, bytes, MADV_COLLAPSE) == 0;
}

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// AllocateAligned's memory before its fill: aligned and hinted, no page of it touched yet, its
// contents undefined. For a caller that writes every byte itself (the first touch's page faults
// then fall on the threads that write) and then calls CollapseToHugePages where bytes >=
// kHugePageBytes. *rounded: the allocation's size, bytes rounded up to its alignment.
inline AlignedBytes AllocateAlignedUnfilled(size_t bytes, size_t* rounded) {
  constexpr size_t kPage = 4096;
  const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : kPage;
  *rounded = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, *rounded);
  if (p == nullptr) throw std::bad_alloc();
  if (align == kHugePageBytes) madvise(p, *rounded, MADV_HUGEPAGE);
  return AlignedBytes(static_cast<uint8_t*>(p));
}

// With a pool, its threads do the zero fill, 2 MiB blocks each: the fill is the memory's first
// touch, whose page faults are most of a large allocation's cost (and more on a VM whose memory
// is backed only as it is first used, as the GPU hosts' are).
inline AlignedBytes AllocateAligned(size_t bytes, ThreadPool* pool = nullptr) {
  constexpr size_t kHugePage = kHugePageBytes;
  size_t rounded = 0;
  AlignedBytes out = AllocateAlignedUnfilled(bytes, &rounded);
  uint8_t* p = out.get();
  const bool huge = bytes >= kHugePage;
  if (pool != nullptr && huge) {
    auto* base = static_cast<uint8_t*>(p);
    pool->ParallelFor(static_cast<int64_t>(rounded / kHugePage), 8, [&](int64_t b, int64_t e) {
      std::memset(base + b * kHugePage, 0, (e - b) * kHugePage);
    });
  } else {
    std::memset(p, 0, rounded);
  }
  if (huge) (void)CollapseToHugePages(p, rounded);  // best effort
  return out;
}

}  // namespace pinfer
