// The FFN split between the two workers: which neurons each side computes (Placement), the rows
// of those neurons copied out of the model into private memory (FfnRowStore), and the exact
// computation of one side's share (PartialFfn). The gpu-worker and the cpu-worker run the same
// code on complementary neuron sets, and their outputs add up to the dense FFN.
//
// Why copy rows instead of computing from the model mapping: a neuron's gate and up weights are
// rows, but its down weights are a column of down: [hidden, ffn], which shares every page with
// all the other neurons. Each side therefore stores its neurons' down columns transposed into
// rows (PowerInfer's ffn_down_t), next to their gate and up rows, so that computing a neuron reads
// three contiguous rows and the process keeps only its own neurons resident. The cpu-worker then
// drops the model mapping's pages (ReleaseMappedPages): its resident memory is the cold rows.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"
#include "shared/util/aligned_buffer.h"
#include "shared/util/thread_pool.h"

namespace pinfer {

// Neurons computed by the gpu-worker ("hot"), per layer, ascending; the rest are cold. This is the
// interface a profiled placement (activation-locality work, PowerInfer's gpu_idx) plugs into.
struct Placement {
  std::vector<std::vector<int32_t>> hot;

  // The first round(fraction * ffn) neurons of every layer are hot. A stand-in until a profiled
  // placement is available; any split gives exact results, only the speed depends on it.
  static Placement FixedFraction(const ModelConfig& c, double hot_fraction);
  // From per-layer bitmaps (bit set = hot), as stored in the shared-memory segment.
  static Placement FromBitmaps(const std::vector<const uint64_t*>& bitmaps, int ffn);
  // Writes layer `l`'s hot set as a bitmap of (ffn + 63) / 64 words.
  void ToBitmap(int layer, int ffn, uint64_t* bitmap) const;
  std::vector<int32_t> Cold(int layer, int ffn) const;
  size_t hot_neurons() const;
};

// A hash of what both workers must agree on before exchanging activations: the configuration and
// the FFN weights' layout and a sample of their bytes (so two different checkpoints of one
// architecture do not match). A layer's stored transpose (LayerWeights::down_t) is hashed
// instead of down where the file has one.
uint64_t ModelFingerprint(const Model& model);

// Rows ids[i] of gate, up and down_t (matrices with the same rows) packed per neuron: its three
// rows side by side, so that a sparse step reads one contiguous stretch per active neuron
// (ffn_bench: 1.3-1.5x faster than three scattered rows for Q8_0/Q4_0 on one core,
// docs/benchmarks.md). The views, [ids.size(), cols] with row_stride = the bundle, point into
// storage. With a pool, its threads copy the rows (the same bytes).
struct NeuronBundles {
  AlignedBytes storage;
  TensorView gate, up, down_t;
};
NeuronBundles BundleRows(const TensorView& gate, const TensorView& up, const TensorView& down_t,
                         const std::vector<int32_t>& ids, ThreadPool* pool = nullptr);

// The FFN rows of a subset of neurons per layer, in private memory. gate/up keep the stored
// dtype; down_t is F16/BF16 when down is (exact copy), otherwise F32 (exact for quantized data).
// A neuron's three rows lie side by side (BundleRows).
class FfnRowStore {
 public:
  struct Layer {
    std::vector<int32_t> neurons;  // global neuron ids, ascending
    TensorView gate, up;           // [k, hidden], row_stride = the bundle
    TensorView down_t;             // [k, hidden], row_stride = the bundle
    // neurons as a bitmap over global ids ((ffn + 63) / 64 words), and the number of them below
    // each word: a request's mask is turned into local indices from its set bits, not by testing
    // every one of this side's neurons (a 70B layer's ~15,000 cold neurons took 19 us to test
    // for a list of ~450).
    std::vector<uint64_t> member;
    std::vector<int32_t> rank;

    // Appends to *local the local indices (into neurons) of this layer's neurons set in `mask`
    // (global ids, member.size() words), ascending.
    void Select(const uint64_t* mask, std::vector<int32_t>* local) const;
  };
  // neurons[l]: the subset of layer l. A layer whose file stores the transpose
  // (LayerWeights::down_t, a prepared model's ffn_down_t) gives its down rows from there (stored
  // dtype); otherwise down is transposed. Once a layer's rows are copied, its FFN tensors' whole
  // pages inside the model's file mappings are dropped from the resident set, so the peak is the
  // copy plus one layer of the file. With a pool, its threads fill and copy each layer's rows.
  static absl::StatusOr<std::unique_ptr<FfnRowStore>> Build(
      const Model& model, const std::vector<std::vector<int32_t>>& neurons,
      ThreadPool* pool = nullptr);

  const Layer& layer(int l) const { return layers_[l]; }
  int n_layers() const { return static_cast<int>(layers_.size()); }
  size_t bytes() const { return bytes_; }
  size_t neurons() const;

 private:
  std::vector<Layer> layers_;
  std::vector<AlignedBytes> storage_;  // page-aligned, huge pages where large
  size_t bytes_ = 0;
};

// Drops the model's mapped file pages from this process's resident set (they stay in the page
// cache). Called by the cpu-worker after building its row store, which is all it reads.
void ReleaseMappedPages(const Model& model);

// One side's share of a layer's FFN, exact: for ReLU-family models the gate decides (only rows
// whose gate is positive for some token get up and down computed); for SiLU every row is
// computed. In sparse mode `masks` ([n][words_per_mask] over global neuron ids, words_per_mask >=
// (ffn + 63) / 64) restricts the computation to the listed neurons per token.
class PartialFfn {
 public:
  // Batches of up to this many tokens are computed exactly as single tokens are (bit for bit).
  static constexpr int kBatchInvariantTokens = 16;

  PartialFfn(const FfnRowStore& rows, Activation act, const CpuOps& ops)
      : rows_(rows), act_(act), ops_(ops) {}
  // out: [n, hidden] += this side's contribution for x: [n, hidden]. Returns the number of
  // (token, neuron) pairs with a non-zero activation that were computed.
  uint64_t Accumulate(int layer, const float* x, int n, const uint64_t* masks, int words_per_mask,
                      float* out);
  // (token, neuron) pairs that Accumulate was asked to compute so far: the neurons a token's
  // mask lists on this side (sparse mode) or every neuron of this side (exact mode). Against
  // Accumulate's returns, it is what the predictor's misses of a zero activation cost here.
  uint64_t listed() const { return listed_; }
  // Loads the rows of this side's neurons set in `mask` (a guess at the next request's list for
  // `layer`) into the caches of the pool threads that will compute them: the list in the parts
  // a single token's Accumulate splits its list into, part i on pool thread i, which the pool's
  // pinned chunks (ThreadPool::set_pinned_chunks) keep so for both loops. Within a part the
  // neurons also set in `first` (may be null) go first: the request often comes before the whole
  // guess is loaded. Stops soon after stop() (called from one thread at a time) turns true.
  // Returns the neurons whose rows it loaded, and how many of them were in `first`.
  struct Loaded {
    uint64_t neurons = 0;
    uint64_t first = 0;
  };
  Loaded Prefetch(int layer, const uint64_t* mask, const uint64_t* first, ThreadPool* pool,
                  const std::function<bool()>& stop);

 private:
  const FfnRowStore& rows_;
  Activation act_;
  const CpuOps& ops_;
  std::vector<float> gate_, sel_gate_, up_, coef_;
  std::vector<int32_t> sel_, iota_, guess_;
  std::vector<uint8_t> guess_first_;
  std::vector<uint64_t> any_;
  uint64_t listed_ = 0;
};

}  // namespace pinfer
