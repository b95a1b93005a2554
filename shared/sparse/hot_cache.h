// The bookkeeping of the adaptive hot set: spare VRAM as a cache of cold neurons that the
// current text keeps activating.
//
// A static placement ranks neurons by how often they fired on the calibration text. When the
// text being generated activates a different set, the GPU's share of the activations drops and
// the CPU does most of the work. So each layer gets `slots` extra GPU rows (after its static hot
// rows); per-neuron activation counters with exponential decay over recent tokens (a neuron's
// count is sum over past tokens t of decay^(age of t) * active) pick the cold neurons to promote,
// replacing the cached neuron with the lowest count when the newcomer's count is higher by
// min_gain. Loading a slot takes a host->GPU copy in the background, so a swap has two halves:
// PlanSwaps takes the slot away from its old neuron at once (that neuron is cold again from the
// next token) and Commit, called once the copy has landed, hands it to the new one. Between the
// two the slot serves nobody, so every active neuron is computed exactly once, by one side.
//
// The GPU side addresses a layer's rows by local index: static hot neuron i is local i (its
// position in the ascending static list), slot s is local n_static + s.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pinfer {

struct HotCacheOptions {
  int slots = 0;          // cache rows per layer
  double decay = 0.95;    // per token; counts forget with half-life log(0.5)/log(decay)
  double min_gain = 2.0;  // promote only when count(new) > count(evicted) + min_gain
                          // (hysteresis: neurons of similar rates do not keep swapping)
  int max_swaps = 64;     // per layer and PlanSwaps call (bounds the copy per step)
};

struct CacheSwap {
  int layer = 0;
  int slot = 0;
  int32_t neuron = 0;    // promoted (cold until Commit)
  int32_t evicted = -1;  // the slot's previous neuron (cold from PlanSwaps on), -1 if empty
};

// Splits one token's active neurons of a layer between the GPU and the CPU: hot_local gets the
// GPU's local rows (static row static_local[j], or slot slot_of[j] as row n_static + slot;
// ascending), cold the rest (global ids, ascending); -1 in either map: none. marks: scratch.
void SplitActive(const std::vector<int32_t>& active, const std::vector<int32_t>& static_local,
                 const std::vector<int32_t>& slot_of, int32_t n_static, int n_slots,
                 std::vector<int32_t>* hot_local, std::vector<int32_t>* cold,
                 std::vector<char>* marks);

class AdaptiveHotCache {
 public:
  // static_hot[l]: the placement's hot neuron ids of layer l, ascending.
  static absl::StatusOr<AdaptiveHotCache> Create(int ffn,
                                                 std::vector<std::vector<int32_t>> static_hot,
                                                 const HotCacheOptions& options);

  // One token's active neurons of one layer (any order, no duplicates). Call for every layer,
  // then EndToken.
  void Observe(int layer, const std::vector<int32_t>& active);
  void EndToken();

  // Up to max_swaps promotions per layer; the evicted neurons are cold from now on and the slots
  // serve nobody until Commit. Swaps of a pending slot are not planned again before Commit.
  std::vector<CacheSwap> PlanSwaps();
  void Commit(const std::vector<CacheSwap>& swaps);

  // Splits one token's active neurons of a layer: hot_local gets the GPU's local indices (static
  // rows and loaded slots, ascending), cold the rest (global ids, ascending).
  void Split(int layer, const std::vector<int32_t>& active, std::vector<int32_t>* hot_local,
             std::vector<int32_t>* cold) const;

  double Count(int layer, int32_t neuron) const;  // the decayed count
  int32_t SlotNeuron(int layer, int slot) const;  // -1: empty or pending
  int n_static(int layer) const { return static_cast<int>(layers_[layer].static_hot.size()); }
  int n_layers() const { return static_cast<int>(layers_.size()); }
  const HotCacheOptions& options() const { return options_; }

 private:
  struct Layer {
    std::vector<int32_t> static_hot;
    std::vector<int32_t> static_local;  // [ffn]: local index, or -1
    std::vector<int32_t> slot_of;       // [ffn]: loaded slot, or -1
    std::vector<int32_t> slot_neuron;   // [slots]: loaded neuron, or -1
    std::vector<char> pending;          // [slots]: a copy is in flight
    std::vector<int32_t> pending_neuron;
    std::vector<char> is_pending;  // [ffn]: the target of a copy in flight
    std::vector<double> count;     // [ffn], in units of weight_ (see below)
  };
  AdaptiveHotCache() = default;

  int ffn_ = 0;
  HotCacheOptions options_;
  std::vector<Layer> layers_;
  // Decay without touching every counter per token: an observation at token t adds weight_ =
  // decay^-t, and a count is read as stored * decay^t; rescaled when weight_ grows large.
  double weight_ = 1.0;
  std::vector<int32_t> scratch_cand_;
  std::vector<int> scratch_victims_;
  mutable std::vector<char> scratch_marks_;
};

// What the driver below needs from the GPU side: the CUDA module through the gpu-worker (or a
// test's fake that checks the protocol).
class CacheSlotTarget {
 public:
  virtual ~CacheSlotTarget() = default;
  // Starts copying the rows of cold neurons `neurons` into `slots` in the background.
  virtual absl::Status LoadRows(int layer, const std::vector<int32_t>& slots,
                                const std::vector<int32_t>& neurons) = 0;
  // Whether every LoadRows so far has landed.
  virtual absl::StatusOr<bool> RowsLanded() = 0;
  // From the next step on, slots[i] serves neurons[i] (-1: nobody).
  virtual absl::Status AssignSlots(int layer, const std::vector<int32_t>& slots,
                                   const std::vector<int32_t>& neurons) = 0;
};

// Runs the cache during decoding: after every step it counts the step's active neurons, commits
// the swaps whose copies have landed (their slots start serving the new neurons) and every
// `plan_every` steps, when no copy is in flight, plans new swaps: their slots stop serving at
// once and their rows start loading. Every call to the target leaves each layer consistent (a
// neuron is served by one side only), so an error only stops the adapting.
//
// With `background`, the counting and planning (a pass over every neuron of every layer) run on a
// thread of the set's own instead of between two decode steps: AfterStep hands the step's active
// neurons over and only makes the target's calls, so the next step starts at once. A plan is then
// carried out by the AfterStep after the one whose step it counted. The target is still called
// from AfterStep only, i.e. from the decode thread, so it needs no locking.
class AdaptiveHotSet {
 public:
  AdaptiveHotSet(AdaptiveHotCache cache, CacheSlotTarget* target, int plan_every,
                 bool background = false);
  ~AdaptiveHotSet();
  AdaptiveHotSet(const AdaptiveHotSet&) = delete;
  AdaptiveHotSet& operator=(const AdaptiveHotSet&) = delete;

  // active[l]: the step's active neurons of layer l (global ids, hot and cold).
  absl::Status AfterStep(const std::vector<std::vector<int32_t>>& active);

  // Waits until the background thread has counted every step handed to it and made the plan
  // those steps call for (so the next AfterStep carries it out); returns at once without one.
  void Flush();

  uint64_t steps() const { return steps_; }
  uint64_t swaps_committed() const { return swaps_committed_; }
  bool copy_in_flight() const { return !pending_.empty(); }

 private:
  void Count(const std::vector<std::vector<int32_t>>& active);  // one step's active neurons
  // Every plan_every_ counted steps with no plan outstanding: new swaps (empty if none).
  std::vector<CacheSwap> MaybePlan();
  // Hands the landed copies' slots to their neurons (and the cache's view after them).
  absl::Status CommitIfLanded();
  // The plan's slots stop serving; their rows start loading.
  absl::Status Start(std::vector<CacheSwap> swaps);
  void Work();  // the background thread
  // Calls fn(layer, slots, neurons) once per layer that the swaps touch.
  template <typename Fn>
  absl::Status ByLayer(const std::vector<CacheSwap>& swaps, bool neurons, Fn fn);

  CacheSlotTarget* target_;
  const int plan_every_;
  const bool background_;
  const int n_layers_;
  // The decode thread's: copies in flight and the counters.
  uint64_t steps_ = 0, swaps_committed_ = 0;
  std::vector<CacheSwap> pending_;

  // The counts and the planning: the decode thread's in the foreground, the worker's otherwise
  // (after construction only the worker touches them then).
  AdaptiveHotCache cache_;
  uint64_t counted_ = 0;
  bool plan_outstanding_ = false;  // planned and not yet committed

  // Between the decode thread and the worker (std::mutex rather than absl::Mutex: Debian's Abseil
  // is not built for ThreadSanitizer, which would not see its locks).
  static constexpr int kMaxQueued = 4;  // steps not yet counted before AfterStep waits
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::vector<std::vector<int32_t>>> queued_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<std::vector<int32_t>>> spare_ ABSL_GUARDED_BY(mu_);  // reused buffers
  std::vector<CacheSwap> landed_ ABSL_GUARDED_BY(mu_);  // assigned on the GPU, not yet in cache_
  std::vector<CacheSwap> plan_ ABSL_GUARDED_BY(mu_);    // planned, not yet started
  bool working_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace pinfer
