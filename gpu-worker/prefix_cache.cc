// See prefix_cache.h.
#include "gpu-worker/prefix_cache.h"

#include <algorithm>
#include <utility>

namespace pinfer::gpuworker {

std::optional<PrefixCache::Hit> PrefixCache::Take(std::span<const int32_t> prompt) {
  if (!enabled() || prompt.size() < 2) return std::nullopt;
  const size_t usable = prompt.size() - 1;
  size_t best = 0, best_len = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const std::vector<int32_t>& t = entries_[i].tokens;
    const size_t n = std::min(usable, t.size());
    const size_t len = std::mismatch(t.begin(), t.begin() + n, prompt.begin()).first - t.begin();
    if (len > best_len ||
        (len == best_len && len > 0 && entries_[i].last_used > entries_[best].last_used)) {
      best = i;
      best_len = len;
    }
  }
  if (best_len == 0 || best_len < static_cast<size_t>(options_.min_tokens)) return std::nullopt;
  const Hit hit{entries_[best].slot, static_cast<int>(best_len)};
  EvictAt(best);
  return hit;
}

std::vector<int> PrefixCache::Put(int slot, std::vector<int32_t> tokens, uint64_t bytes) {
  entries_.push_back({slot, std::move(tokens), bytes, ++clock_});
  bytes_ += bytes;
  std::vector<int> evicted;
  while (static_cast<int>(entries_.size()) > options_.max_entries || bytes_ > options_.max_bytes) {
    std::optional<int> s = EvictOldest();
    if (!s.has_value()) break;
    evicted.push_back(*s);
  }
  return evicted;
}

std::optional<int> PrefixCache::EvictOldest() {
  if (entries_.empty()) return std::nullopt;
  size_t oldest = 0;
  for (size_t i = 1; i < entries_.size(); ++i) {
    if (entries_[i].last_used < entries_[oldest].last_used) oldest = i;
  }
  return EvictAt(oldest);
}

std::optional<int> PrefixCache::EvictAt(size_t i) {
  const int slot = entries_[i].slot;
  bytes_ -= entries_[i].bytes;
  entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(i));
  return slot;
}

}  // namespace pinfer::gpuworker
