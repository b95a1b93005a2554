// See ffn_split.h.
#include "shared/service/ffn_split.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pinfer {

Placement Placement::FixedFraction(const ModelConfig& c, double hot_fraction) {
  Placement p;
  const double f = std::clamp(hot_fraction, 0.0, 1.0);
  const int k = static_cast<int>(std::lround(f * c.ffn_size));
  p.hot.resize(c.n_layers);
  for (auto& layer : p.hot) {
    layer.resize(k);
    for (int i = 0; i < k; ++i) layer[i] = i;
  }
  return p;
}

Placement Placement::FromBitmaps(const std::vector<const uint64_t*>& bitmaps, int ffn) {
  Placement p;
  for (const uint64_t* bm : bitmaps) {
    std::vector<int32_t> hot;
    for (int i = 0; i < ffn; ++i) {
      if ((bm[i >> 6] >> (i & 63)) & 1) hot.push_back(i);
    }
    p.hot.push_back(std::move(hot));
  }
  return p;
}

void Placement::ToBitmap(int layer, int ffn, uint64_t* bitmap) const {
  std::fill(bitmap, bitmap + (ffn + 63) / 64, 0);
  for (int32_t i : hot[layer]) bitmap[i >> 6] |= 1ull << (i & 63);
}

std::vector<int32_t> Placement::Cold(int layer, int ffn) const {
  std::vector<char> is_hot(ffn, 0);
  for (int32_t i : hot[layer]) is_hot[i] = 1;
  std::vector<int32_t> cold;
  for (int i = 0; i < ffn; ++i) {
    if (!is_hot[i]) cold.push_back(i);
  }
  return cold;
}

size_t Placement::hot_neurons() const {
  size_t n = 0;
  for (const auto& l : hot) n += l.size();
  return n;
}

namespace {
// FNV-1a, 64 bits.
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void Add(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  template <typename T>
  void Add(const T& v) {
    Add(&v, sizeof(v));
  }
};

// Drops the resident pages of `t` if it lies in one of the model's file mappings (never memory
// the process owns, which MADV_DONTNEED would zero): whole pages inside the tensor only. They
// stay in the page cache and fault back in if read again.
void ReleaseTensorPages(const Model& model, const TensorView& t) {
  if (t.data == nullptr) return;
  const auto* p = static_cast<const uint8_t*>(t.data);
  const size_t n = t.nbytes();
  for (const auto& f : model.files) {
    if (f == nullptr || p < f->data() || p + n > f->data() + f->size()) continue;
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
    if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
    return;
  }
}
}  // namespace

uint64_t ModelFingerprint(const Model& model) {
  const ModelConfig& c = model.config;
  Fnv f;
  for (int v : {c.vocab_size, c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                c.ffn_size, static_cast<int>(c.activation)}) {
    f.Add(v);
  }
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const LayerWeights& L = model.layers[l];
    const TensorView* down = L.down_t.data != nullptr ? &L.down_t : &L.down;
    for (const TensorView* t : {&L.gate, &L.up, down}) {
      f.Add(static_cast<uint8_t>(t->dtype));
      for (int64_t d : t->shape) f.Add(d);
      const size_t n = std::min<size_t>(64, t->nbytes());
      f.Add(t->data, n);
      f.Add(static_cast<const uint8_t*>(t->data) + t->nbytes() - n, n);
    }
  }
  return f.h;
}

NeuronBundles BundleRows(const TensorView& gate, const TensorView& up, const TensorView& down_t,
                         const std::vector<int32_t>& ids, ThreadPool* pool) {
  const size_t gb = gate.row_bytes(), ub = up.row_bytes(), db = down_t.row_bytes();
  const size_t stride = gb + ub + db;
  const int64_t k = static_cast<int64_t>(ids.size());
  NeuronBundles b;
  // Every byte but the rounding's tail is written below, so the storage is not zero-filled first
  // (that wrote the store twice): the copy is its first touch (the store below on two threads:
  // 0.11 s, against 0.13-0.14 s zero-filled first).
  size_t rounded = 0;
  b.storage = AllocateAlignedUnfilled(stride * k, &rounded);
  uint8_t* base = b.storage.get();
  std::memset(base + stride * k, 0, rounded - stride * k);
  // Both the fresh storage and the source (the model's file mapping) take page faults as they are
  // first touched: one thread did ~1 GB/s (a 70B cpu-worker spent 18 s on its 19.7 GB on the GPU
  // host). Threads take their faults in parallel (a 3-layer 70B-width store, 1.01 GB, on the dev
  // VM: 0.13-0.15 s on two threads against 0.21-2.32 s, median 0.49, on one; `cold_rows_bench
  // build_threads=1|2`).
  auto copy = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(base + i * stride, gate.row(ids[i]), gb);
      std::memcpy(base + i * stride + gb, up.row(ids[i]), ub);
      std::memcpy(base + i * stride + gb + ub, down_t.row(ids[i]), db);
    }
  };
  if (pool != nullptr) {
    pool->ParallelFor(k, 256, copy);
  } else {
    copy(0, k);
  }
  if (stride * k >= kHugePageBytes) (void)CollapseToHugePages(base, rounded);  // best effort
  b.gate = TensorView{gate.name, gate.dtype, {k, gate.cols()}, base, stride};
  b.up = TensorView{up.name, up.dtype, {k, up.cols()}, base + gb, stride};
  b.down_t = TensorView{down_t.name, down_t.dtype, {k, down_t.cols()}, base + gb + ub, stride};
  return b;
}

absl::StatusOr<std::unique_ptr<FfnRowStore>> FfnRowStore::Build(
    const Model& model, const std::vector<std::vector<int32_t>>& neurons, ThreadPool* pool) {
  const ModelConfig& c = model.config;
  if (static_cast<int>(neurons.size()) != c.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement has ", neurons.size(), " layers; the model has ", c.n_layers));
  }
  auto store = std::unique_ptr<FfnRowStore>(new FfnRowStore());
  const int H = c.hidden_size, F = c.ffn_size;
  std::vector<float> down_row(F);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model.layers[l];
    const std::vector<int32_t>& ids = neurons[l];
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= F || (i > 0 && ids[i] <= ids[i - 1])) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", l, ": neuron ids must be ascending and in [0, ", F, ")"));
      }
    }
    // down_t rows: a transposed tensor's as stored, or the selected columns of down: [hidden,
    // ffn] transposed here, exact: F16/BF16 as they are, anything else as F32 (only the selected
    // rows of the temporary are filled).
    const TensorView* src_t = L.down_t.data != nullptr ? &L.down_t : nullptr;
    if (src_t != nullptr && (src_t->rows() != F || src_t->cols() != H)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l, ": down_t must be [", F, ", ", H, "]"));
    }
    TensorView transposed;
    AlignedBytes transposed_storage;
    if (src_t == nullptr) {
      const DType dt = (L.down.dtype == DType::kF16 || L.down.dtype == DType::kBF16) ? L.down.dtype
                                                                                     : DType::kF32;
      const size_t rb = RowBytes(dt, H);
      transposed_storage = AllocateAligned(rb * F);
      transposed = TensorView{"", dt, {F, H}, transposed_storage.get()};
      std::vector<float> tmp(ids.size() * H);
      for (int h = 0; h < H; ++h) {
        DequantizeRow(L.down.dtype, L.down.row(h), down_row.data(), F);
        for (size_t i = 0; i < ids.size(); ++i) tmp[i * H + h] = down_row[ids[i]];
      }
      for (size_t i = 0; i < ids.size(); ++i) {
        QuantizeRow(dt, &tmp[i * H], transposed_storage.get() + rb * ids[i], H);
      }
      src_t = &transposed;
    }
    NeuronBundles b = BundleRows(L.gate, L.up, *src_t, ids, pool);
    Layer layer;
    layer.neurons = ids;
    layer.member.assign((F + 63) / 64, 0);
    layer.rank.assign(layer.member.size(), 0);
    for (int32_t j : ids) layer.member[j >> 6] |= uint64_t{1} << (j & 63);
    for (size_t w = 0, below = 0; w < layer.member.size(); ++w) {
      layer.rank[w] = static_cast<int32_t>(below);
      below += static_cast<size_t>(__builtin_popcountll(layer.member[w]));
    }
    layer.gate = b.gate;
    layer.up = b.up;
    layer.down_t = b.down_t;
    layer.down_t.name = absl::StrCat("blk.", l, ".ffn_down_t");
    store->bytes_ += b.gate.row_stride * ids.size();
    store->storage_.push_back(std::move(b.storage));
    store->layers_.push_back(std::move(layer));
    // The rows are copied: the file's pages of this layer need not stay resident while the next
    // layers are read (a 70B cpu-worker peaked at its 19.7 GB of rows plus as much again of the
    // file's pages before they were dropped only at the end).
    for (const TensorView* t : {&L.gate, &L.up, &L.down, &L.down_t}) ReleaseTensorPages(model, *t);
  }
  return store;
}

void FfnRowStore::Layer::Select(const uint64_t* mask, std::vector<int32_t>* local) const {
  for (size_t w = 0; w < member.size(); ++w) {
    for (uint64_t b = mask[w] & member[w]; b != 0; b &= b - 1) {
      const uint64_t below = member[w] & ((b & -b) - 1);  // this side's neurons under the bit
      local->push_back(rank[w] + __builtin_popcountll(below));
    }
  }
}

size_t FfnRowStore::neurons() const {
  size_t n = 0;
  for (const Layer& l : layers_) n += l.neurons.size();
  return n;
}

void ReleaseMappedPages(const Model& model) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  for (const auto& f : model.files) {
    if (f == nullptr || f->size() == 0) continue;
    auto addr = reinterpret_cast<uintptr_t>(f->data());
    const uintptr_t aligned = addr / page * page;
    ::madvise(reinterpret_cast<void*>(aligned), f->size() + (addr - aligned), MADV_DONTNEED);
  }
}

PartialFfn::Loaded PartialFfn::Prefetch(int layer, const uint64_t* mask, const uint64_t* first,
                                        ThreadPool* pool, const std::function<bool()>& stop) {
  const FfnRowStore::Layer& L = rows_.layer(layer);
  guess_.clear();
  guess_first_.clear();
  auto bit = [](const uint64_t* m, int32_t j) { return (m[j >> 6] >> (j & 63)) & 1; };
  L.Select(mask, &guess_);
  for (int32_t i : guess_) guess_first_.push_back(first != nullptr && bit(first, L.neurons[i]));
  const int n = static_cast<int>(guess_.size());
  if (n == 0) return {};
  // The parts the op splits a list of this size into (CpuOps::SparseFfnParts).
  const int parts = pool == nullptr ? 1 : ops_.SparseFfnParts(n);
  const size_t row_bytes[3] = {L.gate.row_bytes(), L.up.row_bytes(), L.down_t.row_bytes()};
  std::atomic<bool> done{false};
  std::atomic<int> finished{0};
  std::atomic<uint64_t> loaded{0}, loaded_first{0};
  auto run_part = [&](int p) {
    const int i0 = SparseFfnPartBegin(n, parts, p), i1 = SparseFfnPartBegin(n, parts, p + 1);
    uint64_t count = 0, count_first = 0;
    // The part's first tier, then the rest: the loads may be cut short by the request.
    for (int pass = 0; pass < 2 && !done.load(std::memory_order_relaxed); ++pass) {
      for (int i = i0; i < i1; ++i) {
        if (guess_first_[i] != (pass == 0)) continue;
        if (p == 0 && stop()) done.store(true, std::memory_order_relaxed);
        if (done.load(std::memory_order_relaxed)) break;
        const uint8_t* rows[3] = {L.gate.row(guess_[i]), L.up.row(guess_[i]),
                                  L.down_t.row(guess_[i])};
        for (int r = 0; r < 3; ++r) {
          for (size_t o = 0; o < row_bytes[r]; o += 64) __builtin_prefetch(rows[r] + o, 0, 3);
        }
        ++count;
        count_first += pass == 0;
      }
    }
    loaded.fetch_add(count, std::memory_order_relaxed);
    loaded_first.fetch_add(count_first, std::memory_order_relaxed);
    if (p != 0) {
      finished.fetch_add(1, std::memory_order_release);
      return;
    }
    // Part 0 keeps watching, so that the other parts stop in time.
    while (!done.load(std::memory_order_relaxed) &&
           finished.load(std::memory_order_acquire) < parts - 1) {
      if (stop()) done.store(true, std::memory_order_relaxed);
    }
  };
  if (parts == 1) {
    run_part(0);
  } else {
    pool->ParallelFor(parts, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) run_part(static_cast<int>(p));
    });
  }
  return {loaded.load(), loaded_first.load()};
}

uint64_t PartialFfn::Accumulate(int layer, const float* x, int n, const uint64_t* masks,
                                int words_per_mask, float* out) {
  const FfnRowStore::Layer& L = rows_.layer(layer);
  const int k = static_cast<int>(L.neurons.size());
  if (k == 0 || n == 0) return 0;
  const bool gate_decides = act_ == Activation::kRelu || act_ == Activation::kDRelu;
  auto bit = [&](int t, int32_t neuron) {
    return (masks[static_cast<size_t>(t) * words_per_mask + (neuron >> 6)] >> (neuron & 63)) & 1;
  };

  if (n <= kBatchInvariantTokens) {
    // Decode steps: token by token through the fused per-neuron op (each neuron's three rows read
    // back to back), so a sequence's result never depends on what else is in the batch.
    const float* gate = nullptr;  // exact mode: gate: [n, k], every row's gate
    if (masks == nullptr && gate_decides) {
      if (static_cast<int>(iota_.size()) < k) {
        iota_.resize(k);
        for (int i = 0; i < k; ++i) iota_[i] = i;
      }
      gate_.resize(static_cast<size_t>(n) * k);
      ops_.MatMulRows(L.gate, iota_.data(), k, x, n, gate_.data());
      gate = gate_.data();
    }
    uint64_t active = 0;
    for (int t = 0; t < n; ++t) {
      sel_.clear();
      sel_gate_.clear();
      if (gate != nullptr) {
        for (int i = 0; i < k; ++i) {
          if (gate[static_cast<size_t>(t) * k + i] > 0) {
            sel_.push_back(i);
            sel_gate_.push_back(gate[static_cast<size_t>(t) * k + i]);
          }
        }
      } else if (masks != nullptr) {
        L.Select(masks + static_cast<size_t>(t) * words_per_mask, &sel_);
      } else {
        for (int i = 0; i < k; ++i) sel_.push_back(i);
      }
      listed_ += gate != nullptr ? static_cast<uint64_t>(k) : sel_.size();
      const int m = static_cast<int>(sel_.size());
      coef_.resize(std::max(m, 1));
      const size_t H = L.down_t.cols();
      ops_.SparseFfnToken(L.gate, L.up, L.down_t, sel_.data(), m, act_, x + t * L.gate.cols(),
                          gate != nullptr ? sel_gate_.data() : nullptr, coef_.data(),
                          out + t * H);  // out[t]: [hidden]
      for (int i = 0; i < m; ++i) active += coef_[i] != 0;
    }
    return active;
  }

  // Prompt batches. sel: the local rows computed for at least one token; g: [n, |sel|] their
  // gate values.
  sel_.clear();
  if (masks == nullptr && gate_decides) {
    // Exact mode: the gate of every row (the tiled MatMul), then keep rows positive for some
    // token.
    gate_.resize(static_cast<size_t>(n) * k);
    ops_.MatMul(L.gate, x, n, gate_.data());  // gate: [n, k]
    for (int i = 0; i < k; ++i) {
      for (int t = 0; t < n; ++t) {
        if (gate_[static_cast<size_t>(t) * k + i] > 0) {
          sel_.push_back(i);
          break;
        }
      }
    }
    sel_gate_.resize(static_cast<size_t>(n) * sel_.size());
    for (int t = 0; t < n; ++t) {
      for (size_t j = 0; j < sel_.size(); ++j) {
        sel_gate_[t * sel_.size() + j] = gate_[static_cast<size_t>(t) * k + sel_[j]];
      }
    }
  } else {
    if (masks == nullptr) {
      for (int i = 0; i < k; ++i) sel_.push_back(i);
    } else {
      // The rows listed for at least one token of the batch.
      any_.assign(L.member.size(), 0);
      for (int t = 0; t < n; ++t) {
        const uint64_t* mask = masks + static_cast<size_t>(t) * words_per_mask;
        for (size_t w = 0; w < any_.size(); ++w) any_[w] |= mask[w];
      }
      L.Select(any_.data(), &sel_);
    }
    sel_gate_.resize(static_cast<size_t>(n) * sel_.size());
    if (!sel_.empty()) {
      ops_.MatMulRows(L.gate, sel_.data(), static_cast<int>(sel_.size()), x, n, sel_gate_.data());
    }
  }
  const int m = static_cast<int>(sel_.size());
  if (masks == nullptr) listed_ += static_cast<uint64_t>(n) * k;
  if (m == 0) return 0;
  up_.resize(static_cast<size_t>(n) * m);
  ops_.MatMulRows(L.up, sel_.data(), m, x, n, up_.data());  // up: [n, m]
  ops_.GatedActivation(act_, sel_gate_.data(), up_.data(), static_cast<int64_t>(n) * m);
  if (masks != nullptr) {
    // A row computed for one token of the batch contributes only to the tokens that listed it.
    for (int t = 0; t < n; ++t) {
      for (int j = 0; j < m; ++j) {
        if (!bit(t, L.neurons[sel_[j]])) {
          sel_gate_[static_cast<size_t>(t) * m + j] = 0;
        } else {
          ++listed_;
        }
      }
    }
  }
  uint64_t active = 0;
  for (size_t i = 0; i < static_cast<size_t>(n) * m; ++i) active += sel_gate_[i] != 0;
  ops_.AccumulateRows(L.down_t, sel_.data(), m, sel_gate_.data(), n, out);  // out: [n, hidden]
  return active;
}

}  // namespace pinfer
