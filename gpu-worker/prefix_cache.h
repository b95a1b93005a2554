// Prefix caching's bookkeeping. A multi-turn chat re-sends its whole history every turn, so the
// scheduler keeps a finished sequence's KV cache slot together with the tokens whose keys and
// values it holds, and hands it to a later sequence whose prompt starts with those tokens: that
// sequence computes only the rest. The backend owns the slots' memory; this class only remembers
// which kept slot holds what and which to give up first (least recently used), within a count
// and a byte budget, so the cache's memory stays bounded.
//
// A kept slot serves one sequence at a time: the taker overwrites the positions after the shared
// prefix. Scheduler-thread only; not locked.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace pinfer::gpuworker {

struct PrefixCacheOptions {
  int max_entries = 8;              // kept slots; 0 turns prefix caching off
  uint64_t max_bytes = 1ull << 30;  // what the kept slots may hold (ComputeBackend::slot_bytes)
  int min_tokens = 16;              // shorter shared prefixes are not worth a kept slot
};

class PrefixCache {
 public:
  explicit PrefixCache(PrefixCacheOptions options) : options_(options) {}

  bool enabled() const { return options_.max_entries > 0; }

  struct Hit {
    int slot = -1;
    int tokens = 0;  // leading prompt tokens whose KV the slot holds
  };
  // Takes out the kept slot that shares the longest prefix with `prompt` (the most recently used
  // of equals), if that prefix has at least min_tokens. The prompt's last token is never counted:
  // its logits must be computed, so a prompt the slot holds whole reuses all but that token.
  std::optional<Hit> Take(std::span<const int32_t> prompt);

  // Keeps `slot`, whose KV cache holds `tokens` and uses `bytes`. Returns the slots evicted to
  // stay within the budget, oldest first (possibly `slot` itself); the caller releases them.
  std::vector<int> Put(int slot, std::vector<int32_t> tokens, uint64_t bytes);

  // Gives up the least recently used kept slot (a new sequence needs one), if there is any.
  std::optional<int> EvictOldest();

  int entries() const { return static_cast<int>(entries_.size()); }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Entry {
    int slot;
    std::vector<int32_t> tokens;
    uint64_t bytes;
    uint64_t last_used;
  };
  std::optional<int> EvictAt(size_t i);

  const PrefixCacheOptions options_;
  std::vector<Entry> entries_;  // a few entries: a linear scan beats any index
  uint64_t bytes_ = 0;
  uint64_t clock_ = 0;
};

}  // namespace pinfer::gpuworker
