// The adaptive hot set's bookkeeping (hot_cache.h).
#include "shared/sparse/hot_cache.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pinfer {

absl::StatusOr<AdaptiveHotCache> AdaptiveHotCache::Create(
    int ffn, std::vector<std::vector<int32_t>> static_hot, const HotCacheOptions& options) {
  if (ffn <= 0 || options.slots < 0 || options.decay <= 0 || options.decay > 1 ||
      options.max_swaps < 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad hot cache options: ffn ", ffn, ", slots ",
                                                   options.slots, ", decay ", options.decay));
  }
  AdaptiveHotCache c;
  c.ffn_ = ffn;
  c.options_ = options;
  c.layers_.resize(static_hot.size());
  for (size_t l = 0; l < static_hot.size(); ++l) {
    Layer& L = c.layers_[l];
    L.static_hot = std::move(static_hot[l]);
    L.static_local.assign(ffn, -1);
    for (size_t i = 0; i < L.static_hot.size(); ++i) {
      const int32_t j = L.static_hot[i];
      if (j < 0 || j >= ffn || (i > 0 && j <= L.static_hot[i - 1])) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", l, ": static hot ids must be ascending and below ", ffn));
      }
      L.static_local[j] = static_cast<int32_t>(i);
    }
    L.slot_of.assign(ffn, -1);
    L.slot_neuron.assign(options.slots, -1);
    L.pending.assign(options.slots, 0);
    L.pending_neuron.assign(options.slots, -1);
    L.is_pending.assign(ffn, 0);
    L.count.assign(ffn, 0.0);
  }
  return c;
}

void AdaptiveHotCache::Observe(int layer, const std::vector<int32_t>& active) {
  Layer& L = layers_[layer];
  for (int32_t j : active) L.count[j] += weight_;
}

void AdaptiveHotCache::EndToken() {
  weight_ /= options_.decay;
  if (weight_ > 1e100) {
    for (Layer& L : layers_) {
      for (double& v : L.count) v /= weight_;
    }
    weight_ = 1.0;
  }
}

double AdaptiveHotCache::Count(int layer, int32_t neuron) const {
  // The next observation would weigh weight_, so the last token's weighs weight_ * decay: a
  // count is in units of the latest token's weight.
  return layers_[layer].count[neuron] / (weight_ * options_.decay);
}

int32_t AdaptiveHotCache::SlotNeuron(int layer, int slot) const {
  const Layer& L = layers_[layer];
  return L.pending[slot] ? -1 : L.slot_neuron[slot];
}

std::vector<CacheSwap> AdaptiveHotCache::PlanSwaps() {
  std::vector<CacheSwap> swaps;
  const int slots = options_.slots;
  if (slots == 0 || options_.max_swaps == 0) return swaps;
  const double gain = options_.min_gain * weight_ * options_.decay;  // in stored units
  for (int l = 0; l < n_layers(); ++l) {
    Layer& L = layers_[l];
    // A candidate must beat the coldest slot it could take by the gain.
    double coldest = 1e300;
    for (int s = 0; s < slots; ++s) {
      if (L.pending[s]) continue;
      coldest = std::min(coldest, L.slot_neuron[s] < 0 ? 0.0 : L.count[L.slot_neuron[s]]);
    }
    if (coldest == 1e300) continue;  // every slot is being loaded
    const double floor = coldest + gain;
    // Candidates: cold neurons (not static, not loaded, not pending) by count, highest first.
    std::vector<int32_t>& cand = scratch_cand_;
    cand.clear();
    for (int32_t j = 0; j < ffn_; ++j) {
      if (L.count[j] > floor && L.static_local[j] < 0 && L.slot_of[j] < 0 && !L.is_pending[j]) {
        cand.push_back(j);
      }
    }
    if (cand.empty()) continue;
    const size_t top = std::min<size_t>(cand.size(), options_.max_swaps);
    std::partial_sort(cand.begin(), cand.begin() + top, cand.end(), [&](int32_t a, int32_t b) {
      return L.count[a] > L.count[b] || (L.count[a] == L.count[b] && a < b);
    });
    cand.resize(top);
    // Victims: empty slots first, then loaded ones by count, lowest first. Only slots that the
    // best candidate could take (count + gain below its count) need ordering: in a steady state
    // that is a few of them, and sorting all would cost more than the rest of the plan.
    const double best = L.count[cand[0]];
    std::vector<int>& victims = scratch_victims_;
    victims.clear();
    for (int s = 0; s < slots; ++s) {
      if (L.pending[s]) continue;
      if (L.slot_neuron[s] < 0 || L.count[L.slot_neuron[s]] + gain < best) victims.push_back(s);
    }
    auto colder = [&](int a, int b) {
      const double ca = L.slot_neuron[a] < 0 ? -1.0 : L.count[L.slot_neuron[a]];
      const double cb = L.slot_neuron[b] < 0 ? -1.0 : L.count[L.slot_neuron[b]];
      return ca < cb || (ca == cb && a < b);
    };
    const size_t vk = std::min(victims.size(), cand.size());
    std::partial_sort(victims.begin(), victims.begin() + vk, victims.end(), colder);
    size_t v = 0;
    for (int32_t j : cand) {
      if (v >= victims.size()) break;
      const int s = victims[v];
      const int32_t old = L.slot_neuron[s];
      if (old >= 0 && L.count[j] <= L.count[old] + gain) break;  // candidates only get colder
      ++v;
      CacheSwap sw;
      sw.layer = l;
      sw.slot = s;
      sw.neuron = j;
      sw.evicted = old;
      if (old >= 0) L.slot_of[old] = -1;  // cold from the next token on
      L.slot_neuron[s] = -1;
      L.pending[s] = 1;
      L.pending_neuron[s] = j;
      L.is_pending[j] = 1;
      swaps.push_back(sw);
    }
  }
  return swaps;
}

void AdaptiveHotCache::Commit(const std::vector<CacheSwap>& swaps) {
  for (const CacheSwap& sw : swaps) {
    Layer& L = layers_[sw.layer];
    if (!L.pending[sw.slot] || L.pending_neuron[sw.slot] != sw.neuron) continue;
    L.pending[sw.slot] = 0;
    L.pending_neuron[sw.slot] = -1;
    L.is_pending[sw.neuron] = 0;
    L.slot_neuron[sw.slot] = sw.neuron;
    L.slot_of[sw.neuron] = sw.slot;
  }
}

void SplitActive(const std::vector<int32_t>& active, const std::vector<int32_t>& static_local,
                 const std::vector<int32_t>& slot_of, int32_t n_static, int n_slots,
                 std::vector<int32_t>* hot_local, std::vector<int32_t>* cold,
                 std::vector<char>* marks) {
  hot_local->clear();
  cold->clear();
  // Static locals grow with the neuron id, so for an ascending active list only the slot part
  // needs sorting, then one merge; the cold ids come out in the order given.
  std::vector<int32_t> slot_part;
  slot_part.reserve(64);
  for (int32_t j : active) {
    if (static_local[j] >= 0) {
      hot_local->push_back(static_local[j]);
    } else if (slot_of[j] >= 0) {
      slot_part.push_back(n_static + slot_of[j]);
    } else {
      cold->push_back(j);
    }
  }
  if (!std::is_sorted(hot_local->begin(), hot_local->end())) {
    std::sort(hot_local->begin(), hot_local->end());
  }
  if (slot_part.size() > 64) {
    // Many slots: order them by marking (one pass over the slots) rather than sorting.
    marks->assign(n_slots, 0);
    for (int32_t x : slot_part) (*marks)[x - n_static] = 1;
    for (int s = 0; s < n_slots; ++s) {
      if ((*marks)[s]) hot_local->push_back(n_static + s);
    }
  } else {
    std::sort(slot_part.begin(), slot_part.end());
    hot_local->insert(hot_local->end(), slot_part.begin(), slot_part.end());  // all >= n_static
  }
  if (!std::is_sorted(cold->begin(), cold->end())) std::sort(cold->begin(), cold->end());
}

void AdaptiveHotCache::Split(int layer, const std::vector<int32_t>& active,
                             std::vector<int32_t>* hot_local, std::vector<int32_t>* cold) const {
  const Layer& L = layers_[layer];
  SplitActive(active, L.static_local, L.slot_of, static_cast<int32_t>(L.static_hot.size()),
              static_cast<int>(L.slot_neuron.size()), hot_local, cold, &scratch_marks_);
}

template <typename Fn>
absl::Status AdaptiveHotSet::ByLayer(const std::vector<CacheSwap>& swaps, bool neurons, Fn fn) {
  std::vector<int32_t> slots, ids;
  for (size_t i = 0; i < swaps.size();) {
    const int layer = swaps[i].layer;
    slots.clear();
    ids.clear();
    for (; i < swaps.size() && swaps[i].layer == layer; ++i) {
      slots.push_back(swaps[i].slot);
      ids.push_back(neurons ? swaps[i].neuron : -1);
    }
    absl::Status st = fn(layer, slots, ids);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

AdaptiveHotSet::AdaptiveHotSet(AdaptiveHotCache cache, CacheSlotTarget* target, int plan_every,
                               bool background)
    : target_(target),
      plan_every_(std::max(1, plan_every)),
      background_(background),
      n_layers_(cache.n_layers()),
      cache_(std::move(cache)) {
  if (background_) worker_ = std::thread([this] { Work(); });
}

AdaptiveHotSet::~AdaptiveHotSet() {
  if (!background_) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = true;
    work_cv_.notify_one();
  }
  worker_.join();
}

void AdaptiveHotSet::Count(const std::vector<std::vector<int32_t>>& active) {
  for (int l = 0; l < n_layers_; ++l) cache_.Observe(l, active[l]);
  cache_.EndToken();
  counted_ += 1;
}

std::vector<CacheSwap> AdaptiveHotSet::MaybePlan() {
  // A plan while copies are in flight would race them, so none before the last one's Commit.
  if (plan_outstanding_ || counted_ % plan_every_ != 0) return {};
  std::vector<CacheSwap> swaps = cache_.PlanSwaps();  // grouped by layer, ascending
  plan_outstanding_ = !swaps.empty();
  return swaps;
}

absl::Status AdaptiveHotSet::CommitIfLanded() {
  if (pending_.empty()) return absl::OkStatus();
  absl::StatusOr<bool> landed = target_->RowsLanded();
  if (!landed.ok()) return landed.status();
  if (!*landed) return absl::OkStatus();
  std::vector<CacheSwap> done = std::move(pending_);
  pending_.clear();
  absl::Status st =
      ByLayer(done, /*neurons=*/true,
              [&](int l, const std::vector<int32_t>& s, const std::vector<int32_t>& n) {
                return target_->AssignSlots(l, s, n);
              });
  if (!st.ok()) return st;
  swaps_committed_ += done.size();
  if (!background_) {
    cache_.Commit(done);
    plan_outstanding_ = false;
    return absl::OkStatus();
  }
  std::unique_lock<std::mutex> lock(mu_);
  landed_.insert(landed_.end(), done.begin(), done.end());
  work_cv_.notify_one();
  return absl::OkStatus();
}

absl::Status AdaptiveHotSet::Start(std::vector<CacheSwap> swaps) {
  if (swaps.empty()) return absl::OkStatus();
  pending_ = std::move(swaps);
  // The slots stop serving their old neurons before new rows overwrite them.
  absl::Status st =
      ByLayer(pending_, /*neurons=*/false,
              [&](int l, const std::vector<int32_t>& s, const std::vector<int32_t>& n) {
                return target_->AssignSlots(l, s, n);
              });
  if (!st.ok()) return st;
  return ByLayer(pending_, /*neurons=*/true,
                 [&](int l, const std::vector<int32_t>& s, const std::vector<int32_t>& n) {
                   return target_->LoadRows(l, s, n);
                 });
}

absl::Status AdaptiveHotSet::AfterStep(const std::vector<std::vector<int32_t>>& active) {
  if (static_cast<int>(active.size()) != n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("active neurons of ", active.size(), " layers for a cache of ", n_layers_));
  }
  steps_ += 1;
  if (!background_) {
    Count(active);
    absl::Status st = CommitIfLanded();
    if (!st.ok()) return st;
    return Start(MaybePlan());
  }
  absl::Status st = CommitIfLanded();
  if (!st.ok()) return st;
  std::vector<CacheSwap> plan;
  std::vector<std::vector<int32_t>> buffer;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (pending_.empty()) plan.swap(plan_);
    // Only when the worker falls this far behind does a step wait for the counting.
    while (static_cast<int>(queued_.size()) >= kMaxQueued) done_cv_.wait(lock);
    if (!spare_.empty()) {
      buffer = std::move(spare_.back());
      spare_.pop_back();
    }
  }
  buffer.resize(active.size());
  for (size_t l = 0; l < active.size(); ++l) buffer[l].assign(active[l].begin(), active[l].end());
  {
    std::unique_lock<std::mutex> lock(mu_);
    queued_.push_back(std::move(buffer));
    work_cv_.notify_one();
  }
  return Start(std::move(plan));
}

void AdaptiveHotSet::Flush() {
  if (!background_) return;
  std::unique_lock<std::mutex> lock(mu_);
  while (!queued_.empty() || !landed_.empty() || working_) done_cv_.wait(lock);
}

void AdaptiveHotSet::Work() {
  std::vector<std::vector<std::vector<int32_t>>> steps;
  std::vector<CacheSwap> landed;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (auto& b : steps) spare_.push_back(std::move(b));
      steps.clear();
      working_ = false;
      done_cv_.notify_all();
      while (!stop_ && queued_.empty() && landed_.empty()) work_cv_.wait(lock);
      if (stop_) return;
      steps.swap(queued_);
      landed.swap(landed_);
      working_ = true;
      done_cv_.notify_all();  // room in the queue
    }
    if (!landed.empty()) {
      cache_.Commit(landed);
      plan_outstanding_ = false;
      landed.clear();
    }
    std::vector<CacheSwap> plan;
    for (const auto& active : steps) {
      Count(active);
      std::vector<CacheSwap> swaps = MaybePlan();
      if (!swaps.empty()) plan = std::move(swaps);
    }
    if (!plan.empty()) {
      std::unique_lock<std::mutex> lock(mu_);
      plan_ = std::move(plan);
    }
  }
}

}  // namespace pinfer
