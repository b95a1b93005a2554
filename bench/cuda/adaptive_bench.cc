// The adaptive hot set on the synthetic ReluLLaMA-13B-shape model (bench_common.h): decode with
// the static placement against the same VRAM budget split into static hot rows and cache slots
// that follow the text (shared/sparse/hot_cache.h; the service's --adaptive-cache-rows), on two
// run-time profiles: "matched" (the run-time ranking is the calibration ranking the placement
// used) and "shifted" (the run-time hot tier is a different random 20% of each layer: text unlike
// the calibration text). Prints the command, a line per run, a table and, with --rounds, the
// medians.
//
//   cuda_adaptive_bench --dtype=F16 --warmup=48 --steps=64 --cache-fractions=1.0 --rounds=3
//
// The cache is run by the product's driver (AdaptiveHotSet, as the gpu-worker runs it), once
// counting on the decode thread and once on its own thread (--adaptive-cache-thread): after each
// step it commits the swaps whose copies have landed and every `cache_period` tokens plans new
// swaps whose rows are gathered on a copy stream while the next steps run. Before each step the
// bench splits every layer's drawn active set between the GPU's rows and the CPU from the slots
// as the driver assigned them (kGiven; the service's predicted mode makes this split on the GPU),
// and times the split and the driver apart.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/cuda/bench_common.h"
#include "gpu-worker/cuda/backend.h"
#include "gpu-worker/module_cache_slots.h"
#include "shared/sparse/hot_cache.h"
#include "shared/util/thread_pool.h"

namespace pinfer::cudabench {
namespace {

struct Options : BenchOptions {
  std::vector<double> cache_fractions = {0.5};
  double cache_decay = 0.95, cache_gain = 2.0;
  int cache_swaps = 256, cache_period = 4;
};

// The adaptive bench's GPU side for the product's driver (AdaptiveHotSet): the module's calls as
// the gpu-worker makes them (ModuleCacheSlots), plus a copy of what each slot serves, from which
// the bench splits a step's drawn active neurons for kGiven. In the service the module's
// predicted mode makes that split on the GPU, from the same slot tables.
class BenchSlots : public CacheSlotTarget {
 public:
  BenchSlots(cuda::Backend* b, int F, const std::vector<std::vector<int32_t>>& static_hot,
             int slots)
      : module_(b), n_slots_(slots) {
    for (const std::vector<int32_t>& hot : static_hot) {
      Layer& L = layers_.emplace_back();
      L.n_static = static_cast<int32_t>(hot.size());
      L.static_local.assign(F, -1);
      for (size_t i = 0; i < hot.size(); ++i) L.static_local[hot[i]] = static_cast<int32_t>(i);
      L.slot_of.assign(F, -1);
      L.neuron_of.assign(slots, -1);
    }
  }
  absl::Status LoadRows(int layer, const std::vector<int32_t>& slots,
                        const std::vector<int32_t>& neurons) override {
    return module_.LoadRows(layer, slots, neurons);
  }
  absl::StatusOr<bool> RowsLanded() override { return module_.RowsLanded(); }
  absl::Status AssignSlots(int layer, const std::vector<int32_t>& slots,
                           const std::vector<int32_t>& neurons) override {
    absl::Status st = module_.AssignSlots(layer, slots, neurons);
    if (!st.ok()) return st;
    Layer& L = layers_[layer];
    for (size_t i = 0; i < slots.size(); ++i) {
      if (L.neuron_of[slots[i]] >= 0) L.slot_of[L.neuron_of[slots[i]]] = -1;
      L.neuron_of[slots[i]] = neurons[i];
      if (neurons[i] >= 0) L.slot_of[neurons[i]] = slots[i];
    }
    return absl::OkStatus();
  }
  // Every slot serves nobody again (the module's tables too), for the next run on this backend.
  absl::Status Clear() {
    std::vector<int32_t> all(n_slots_), none(n_slots_, -1);
    std::iota(all.begin(), all.end(), 0);
    for (int l = 0; l < static_cast<int>(layers_.size()) && n_slots_ > 0; ++l) {
      absl::Status st = AssignSlots(l, all, none);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }
  // The step's split as the module would make it from the slots assigned so far.
  void Split(int layer, const std::vector<int32_t>& active, std::vector<int32_t>* hot,
             std::vector<int32_t>* cold) const {
    const Layer& L = layers_[layer];
    SplitActive(active, L.static_local, L.slot_of, L.n_static, n_slots_, hot, cold, &marks_);
  }

 private:
  struct Layer {
    int32_t n_static = 0;
    std::vector<int32_t> static_local, slot_of, neuron_of;
  };
  gpuworker::ModuleCacheSlots module_;
  int n_slots_;
  std::vector<Layer> layers_;
  mutable std::vector<char> marks_;
};

int AdaptiveBench(const Options& o, const SynthModel& m, ThreadPool& pool, int threads) {
  const ModelConfig& c = m.config;
  const int H = c.hidden_size, F = c.ffn_size;
  const int max_ctx = o.warmup + o.steps + 8, total = o.warmup + o.steps;
  const size_t rb = m.Rb(H);
  const double budget = o.Budget(m.ModelBytes());
  const double fixed = SplitFixedBytes(m, ScratchBytes(m, max_ctx, c.n_layers, 8));
  const double per_neuron = 3.0 * rb + 4;
  const int n_gpu = HotNeuronsInBudget(m, budget, fixed);
  const double skew = o.skews.empty() ? 0.2 : o.skews[0];
  std::vector<std::vector<int32_t>> calib_rank(c.n_layers), shifted_rank(c.n_layers);
  std::mt19937 rng(4242);
  for (int l = 0; l < c.n_layers; ++l) {
    calib_rank[l] = m.layers[l].rank_of;
    std::vector<int32_t> perm(F);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    shifted_rank[l].resize(F);
    for (int r = 0; r < F; ++r) shifted_rank[l][perm[r]] = r;
  }
  ThreadPool spin(threads, kColdSpin);
  CpuColdFfn cold(m, spin);
  std::printf(
      "adaptive: %d GPU FFN rows per layer in the budget; skew %.0f%%; %d warm-up + %d "
      "measured tokens; decay %.2f, gain %.1f, up to %d swaps per layer every %d tokens\n",
      n_gpu, skew * 100, o.warmup, o.steps, o.cache_decay, o.cache_gain, o.cache_swaps,
      o.cache_period);
  struct Row {
    std::string profile;
    double fraction = 0;
    double tok_s = 0, gpu_share = 0, gpu_share_last = 0, plan = 0, actual = 0;
    double tok_s_unsplit = 0;  // the same time less the bench's split (the service's GPU splits)
    std::string driver;        // where AdaptiveHotSet counts: "foreground", "background"; "" static
    double split_s = 0;   // the bench's kGiven split per measured token (the GPU's, in the service)
    double driver_s = 0;  // AdaptiveHotSet::AfterStep per measured token (the product's)
    int64_t swaps = 0;
  };
  std::vector<Row> rows;
  cuda::GreedyResult pick;
  std::vector<double> fractions = {0.0};
  for (double f : o.cache_fractions) fractions.push_back(std::min(1.0, std::max(0.0, f)));
  for (double fraction : fractions) {
    const int slots = static_cast<int>(fraction * n_gpu);
    const int n_static = n_gpu - slots;
    cuda::ModelUpload u = BaseUpload(m, max_ctx);
    std::vector<std::vector<int32_t>> static_hot(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      cuda::LayerUpload& lu = u.layers[l];
      FillHotLayer(m, l, n_static, &lu);
      lu.cache_rows = slots;
      static_hot[l] = lu.hot_ids;
    }
    // Slots cost the rows' bytes but no id (the bookkeeping stays on the host).
    const double plan =
        fixed + c.n_layers * (per_neuron * n_static + 3.0 * rb * slots + 4.0 * (F - n_static));
    Backend be;
    const double t0 = Now();
    if (!CreateBackend(u, "adaptive", &be)) return 1;
    std::printf("cache fraction %.2f: %d static + %d cache rows per layer, created in %.1f s\n",
                fraction, n_static, slots, Now() - t0);
    be.b->set_use_graphs(o.graphs);
    // The static placement runs once per profile; the cache with the product's driver counting
    // on the decode thread between steps, and on its own thread.
    // --rounds=N: the list N times over, taking turns, for medians.
    std::vector<bool> drivers;
    for (int round = 0; round < std::max(1, o.rounds); ++round) {
      drivers.push_back(false);
      if (slots > 0) drivers.push_back(true);
    }
    for (const char* profile : {"shifted", "matched"}) {
      const auto& ranks = std::string(profile) == "shifted" ? shifted_rank : calib_rank;
      Masks masks = DrawMasksRanked(ranks, F, o.active, skew, total, 77, pool);
      for (bool background : drivers) {
        HotCacheOptions ho;
        ho.slots = slots;
        ho.decay = o.cache_decay;
        ho.min_gain = o.cache_gain;
        ho.max_swaps = o.cache_swaps;
        absl::StatusOr<AdaptiveHotCache> cache = AdaptiveHotCache::Create(F, static_hot, ho);
        if (!cache.ok()) {
          std::fprintf(stderr, "%s\n", std::string(cache.status().message()).c_str());
          return 1;
        }
        BenchSlots target(be.b, F, static_hot, slots);
        auto set = std::make_unique<AdaptiveHotSet>(std::move(*cache), &target, o.cache_period,
                                                    background);
        std::vector<std::vector<int32_t>> hot(c.n_layers), cold_ids(c.n_layers);
        Row row;
        row.profile = profile;
        row.fraction = fraction;
        row.driver = slots == 0 ? "" : background ? "background" : "foreground";
        row.plan = plan;
        row.actual = static_cast<double>(be.b->DeviceBytes());
        double hot_rows = 0, all_rows = 0, hot_last = 0, all_last = 0, start = 0;
        int32_t token = 1;
        for (int s = 0; s < total; ++s) {
          if (s == o.warmup) start = Now();
          const double h0 = Now();
          for (int l = 0; l < c.n_layers; ++l) {
            target.Split(l, masks[s][l], &hot[l], &cold_ids[l]);
            if (s >= o.warmup) {
              hot_rows += hot[l].size();
              all_rows += masks[s][l].size();
              if (s >= total - 8) {
                hot_last += hot[l].size();
                all_last += masks[s][l].size();
              }
            }
          }
          if (s >= o.warmup) row.split_s += Now() - h0;
          cuda::ForwardArgs a = DecodeStep(&token, s, cuda::FfnMode::kGiven);
          a.given_hot = &hot;
          a.given_cold = &cold_ids;
          a.run_predictors = true;
          a.cold = &cold;
          AskForPick(&a, &pick);
          cuda::BackendStatus st = be.b->Forward(a);
          if (!st.ok()) {
            std::fprintf(stderr, "adaptive forward: %s\n", st.message.c_str());
            return 1;
          }
          token = pick.token;
          if (slots > 0) {
            const double h1 = Now();
            const uint64_t before = set->swaps_committed();
            if (absl::Status ast = set->AfterStep(masks[s]); !ast.ok()) {
              std::fprintf(stderr, "adaptive hot set: %s\n", ast.ToString().c_str());
              return 1;
            }
            if (s >= o.warmup) row.driver_s += Now() - h1;
            row.swaps += static_cast<int64_t>(set->swaps_committed() - before);
          }
        }
        const double elapsed = Now() - start;
        row.tok_s = o.steps / elapsed;
        row.tok_s_unsplit = o.steps / (elapsed - row.split_s);
        row.split_s /= o.steps;
        row.driver_s /= o.steps;
        row.gpu_share = hot_rows / all_rows;
        row.gpu_share_last = hot_last / all_last;
        std::printf(
            "%s, cache fraction %.2f%s%s: %.2f tokens/s, GPU share of activations %.1f%% (last 8 "
            "tokens %.1f%%), %lld swaps, split %.3f ms/token, driver %.3f ms/token\n",
            profile, fraction, row.driver.empty() ? "" : ", counting in the ", row.driver.c_str(),
            row.tok_s, 100 * row.gpu_share, 100 * row.gpu_share_last,
            static_cast<long long>(row.swaps), row.split_s * 1e3, row.driver_s * 1e3);
        rows.push_back(row);
        set.reset();
        bool landed = false;
        be.b->CacheRowsLanded(/*wait=*/true, &landed);
        if (absl::Status cst = target.Clear(); !cst.ok()) {
          std::fprintf(stderr, "clearing the slots: %s\n", cst.ToString().c_str());
          return 1;
        }
      }
    }
  }
  const char* const header =
      "\n| dtype | run-time profile | placement | counting | tokens/s | vs static | less the "
      "split: tokens/s | vs static | GPU share of activations | last 8 tokens | swaps | split "
      "ms/token | driver ms/token | VRAM plan GB | VRAM actual GB |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  std::fputs(header, stdout);
  // Against the static placement's median on the same profile.
  auto median = [&](const std::string& profile, double fraction, const std::string& driver,
                    double Row::*field) {
    std::vector<double> v;
    for (const Row& q : rows) {
      if (q.profile == profile && q.fraction == fraction && q.driver == driver)
        v.push_back(q.*field);
    }
    return MedianOf(v);
  };
  auto print = [&](const Row& r, double tok_s, double tok_s_unsplit) {
    const double base = median(r.profile, 0, "", &Row::tok_s);
    const double base_unsplit = median(r.profile, 0, "", &Row::tok_s_unsplit);
    char pl[64];
    if (r.fraction == 0) {
      std::snprintf(pl, sizeof(pl), "static (%d hot rows)", n_gpu);
    } else {
      std::snprintf(pl, sizeof(pl), "adaptive (%.0f%% of them as cache)", 100 * r.fraction);
    }
    std::printf(
        "| %s | %s | %s | %s | %.2f | %.2fx | %.2f | %.2fx | %.1f%% | %.1f%% | %lld | %.3f | "
        "%.3f | %.2f | %.2f |\n",
        DTypeName(m.dtype).data(), r.profile.c_str(), pl, r.driver.empty() ? "-" : r.driver.c_str(),
        tok_s, tok_s / base, tok_s_unsplit, tok_s_unsplit / base_unsplit, 100 * r.gpu_share,
        100 * r.gpu_share_last, static_cast<long long>(r.swaps), r.split_s * 1e3, r.driver_s * 1e3,
        r.plan / 1e9, r.actual / 1e9);
  };
  for (const Row& r : rows) print(r, r.tok_s, r.tok_s_unsplit);
  if (o.rounds > 1) {
    std::printf("\nMedians of the %d rounds (the other columns: the first round's):\n", o.rounds);
    std::fputs(header, stdout);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      bool first = true;
      for (size_t k = 0; k < i; ++k) {
        const Row& q = rows[k];
        if (q.profile == r.profile && q.fraction == r.fraction && q.driver == r.driver)
          first = false;
      }
      if (!first) continue;
      print(r, median(r.profile, r.fraction, r.driver, &Row::tok_s),
            median(r.profile, r.fraction, r.driver, &Row::tok_s_unsplit));
    }
  }
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  const NumberFlags numbers = {
      {{"--cache-swaps=", &o.cache_swaps}, {"--cache-period=", &o.cache_period}},
      {{"--cache-decay=", &o.cache_decay}, {"--cache-gain=", &o.cache_gain}}};
  auto own = [&](const std::string& a) {
    const char* v = FlagValue(a, "--cache-fractions=");
    if (v != nullptr) o.cache_fractions = CommaList(v);
    return v != nullptr || ParseNumberFlag(a, numbers);
  };
  if (!ParseFlags(argc, argv, &o, own)) return 2;
  o.cache_period = std::max(1, o.cache_period);
  return WithModel(o, [&](const SynthModel& m, ThreadPool& pool, int threads) {
    return AdaptiveBench(o, m, pool, threads);
  });
}

}  // namespace
}  // namespace pinfer::cudabench

int main(int argc, char** argv) { return pinfer::cudabench::Main(argc, argv); }
