// The FFN split between the workers must add up to the dense FFN: for every layer, the hot side's
// contribution plus the cold side's equals DenseFfn's output (to fp32 rounding), for ReLU models
// (the gate decides which rows are computed) and SiLU models (every row), for any placement. Also
// checks that sparse masks restrict the work, that loading guessed rows ahead (Prefetch) stops
// when told and changes nothing, and that the row store's resident footprint is the selected
// rows only.
#include "shared/service/ffn_split.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shared/engine/ops.h"
#include "shared/engine/transformer.h"
#include "shared/model/model.h"
#include "shared/service/log.h"
#include "shared/util/aligned_buffer.h"
#include "shared/util/thread_pool.h"

namespace pinfer {
namespace {

std::unique_ptr<Model> Load(const std::string& rel) {
  auto m = LoadModel(std::string(PINFER_MODELS_DIR) + "/" + rel);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// Max |a - b| relative to max |b|.
double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
  }
  return err / scale;
}

void CheckSplitMatchesDense(const Model& m, double hot_fraction, Placement placement) {
  const ModelConfig& c = m.config;
  auto ops = NewSimdOps(nullptr);
  DenseFfn dense(m, *ops);
  std::vector<std::vector<int32_t>> cold(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) cold[l] = placement.Cold(l, c.ffn_size);
  auto hot_rows = FfnRowStore::Build(m, placement.hot);
  auto cold_rows = FfnRowStore::Build(m, cold);
  ASSERT_TRUE(hot_rows.ok() && cold_rows.ok());
  EXPECT_EQ((*hot_rows)->neurons() + (*cold_rows)->neurons(),
            static_cast<size_t>(c.n_layers) * c.ffn_size);
  PartialFfn hot(**hot_rows, c.activation, *ops), cold_side(**cold_rows, c.activation, *ops);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int n = 3, H = c.hidden_size;
  std::vector<float> x(n * H), want(n * H), got(n * H);
  for (int l = 0; l < c.n_layers; ++l) {
    for (float& v : x) v = nd(rng);
    ASSERT_TRUE(dense.Forward(l, x.data(), n, want.data()).ok());
    std::fill(got.begin(), got.end(), 0.f);
    const uint64_t a = hot.Accumulate(l, x.data(), n, nullptr, 0, got.data());
    const uint64_t b = cold_side.Accumulate(l, x.data(), n, nullptr, 0, got.data());
    EXPECT_LT(RelErr(got, want), 2e-5) << "layer " << l << " hot fraction " << hot_fraction;
    if (c.activation == Activation::kSilu) {
      EXPECT_EQ(a + b, static_cast<uint64_t>(n) * c.ffn_size);
    } else {
      // ReLU: roughly half the neurons of a random input are active, never all.
      EXPECT_GT(a + b, 0u);
      EXPECT_LT(a + b, static_cast<uint64_t>(n) * c.ffn_size);
    }
  }
}

TEST(FfnSplitTest, ReluSplitEqualsDenseForAnyPlacement) {
  auto m = Load("relu-llama-tiny");
  ASSERT_NE(m, nullptr);
  for (double f : {0.0, 0.3, 0.5, 1.0}) {
    CheckSplitMatchesDense(*m, f, Placement::FixedFraction(m->config, f));
  }
  // A scattered placement (every third neuron hot).
  Placement p;
  p.hot.resize(m->config.n_layers);
  for (auto& l : p.hot) {
    for (int i = 0; i < m->config.ffn_size; i += 3) l.push_back(i);
  }
  CheckSplitMatchesDense(*m, 1.0 / 3, p);
}

TEST(FfnSplitTest, SiluSplitEqualsDense) {
  auto m = Load("stories260K/stories260K.gguf");
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(m->config.activation, Activation::kSilu);
  CheckSplitMatchesDense(*m, 0.4, Placement::FixedFraction(m->config, 0.4));
}

TEST(FfnSplitTest, MasksRestrictTheComputedNeurons) {
  auto m = Load("relu-llama-tiny");
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  auto ops = NewSimdOps(nullptr);
  Placement all = Placement::FixedFraction(c, 1.0);
  auto rows = FfnRowStore::Build(*m, all.hot);
  ASSERT_TRUE(rows.ok());
  PartialFfn ffn(**rows, c.activation, *ops);
  const int H = c.hidden_size, W = (c.ffn_size + 63) / 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(2 * H), exact(2 * H, 0.f), masked(2 * H, 0.f), manual(2 * H, 0.f);
  for (float& v : x) v = nd(rng);
  ffn.Accumulate(2, x.data(), 2, nullptr, 0, exact.data());
  // All bits set: same as exact mode.
  std::vector<uint64_t> masks(2 * W, ~0ull);
  ffn.Accumulate(2, x.data(), 2, masks.data(), W, masked.data());
  EXPECT_LT(RelErr(masked, exact), 1e-6);
  // Token 0 keeps only neuron 5, token 1 none: the output is neuron 5's term for token 0.
  std::fill(masks.begin(), masks.end(), 0);
  masks[0] = 1ull << 5;
  std::fill(masked.begin(), masked.end(), 0.f);
  const uint64_t count = ffn.Accumulate(2, x.data(), 2, masks.data(), W, masked.data());
  const LayerWeights& L = m->layers[2];
  std::vector<float> g(1), u(1), row(c.ffn_size);
  int32_t five = 5;
  ops->MatMulRows(L.gate, &five, 1, x.data(), 1, g.data());
  ops->MatMulRows(L.up, &five, 1, x.data(), 1, u.data());
  const float a = std::max(g[0], 0.f) * u[0];
  for (int h = 0; h < H; ++h) {
    DequantizeRow(L.down.dtype, L.down.row(h), row.data(), c.ffn_size);
    manual[h] = a * row[5];
  }
  EXPECT_LT(RelErr(masked, manual), 1e-6);
  EXPECT_EQ(count, a != 0 ? 1u : 0u);
  for (int h = 0; h < H; ++h) EXPECT_EQ(masked[H + h], 0.f);
}

// On one side's subset of neurons, a token's mask selects the subset's rows by global id: the
// result must equal exact (gate-decides) mode on a store of just the subset's neurons the mask
// lists, since a ReLU row left out by the gate contributes nothing. Decode steps (one token at a
// time) and prompt batches (rows listed by any token, then zeroed per token) both; listed()
// counts each token's listed rows, and in exact mode every row.
TEST(FfnSplitTest, MasksOverASubsetSelectRowsByGlobalId) {
  auto m = Load("relu-llama-tiny");
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  auto ops = NewSimdOps(nullptr);
  const int H = c.hidden_size, F = c.ffn_size, W = (F + 63) / 64, layer = 1;
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> subset(c.n_layers);
  for (int j = 0; j < F; ++j) {
    if (rng() % 100 < 60) subset[layer].push_back(j);  // scattered, as a profiled cold set
  }
  auto rows = FfnRowStore::Build(*m, subset);
  ASSERT_TRUE(rows.ok());
  PartialFfn ffn(**rows, c.activation, *ops);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int n : {1, PartialFfn::kBatchInvariantTokens + 4}) {
    std::vector<float> x(static_cast<size_t>(n) * H), got(x.size(), 0.f);
    for (float& v : x) v = nd(rng);
    std::vector<uint64_t> masks(static_cast<size_t>(n) * W, 0);
    std::vector<std::vector<int32_t>> listed(n);
    for (int t = 0; t < n; ++t) {
      for (int j = 0; j < F; ++j) {
        if (rng() % 100 < 15) masks[static_cast<size_t>(t) * W + j / 64] |= 1ull << (j % 64);
      }
      for (int32_t j : subset[layer]) {
        if ((masks[static_cast<size_t>(t) * W + j / 64] >> (j % 64)) & 1) listed[t].push_back(j);
      }
    }
    const uint64_t listed_before = ffn.listed();
    ffn.Accumulate(layer, x.data(), n, masks.data(), W, got.data());
    // listed(): the (token, neuron) pairs the masks list among this side's neurons.
    size_t want_listed = 0;
    for (const auto& l : listed) want_listed += l.size();
    EXPECT_EQ(ffn.listed() - listed_before, want_listed) << "tokens " << n;
    for (int t = 0; t < n; ++t) {
      std::vector<std::vector<int32_t>> only(c.n_layers);
      only[layer] = listed[t];
      auto want_rows = FfnRowStore::Build(*m, only);
      ASSERT_TRUE(want_rows.ok());
      PartialFfn exact(**want_rows, c.activation, *ops);
      std::vector<float> want(H, 0.f);
      exact.Accumulate(layer, x.data() + static_cast<size_t>(t) * H, 1, nullptr, 0, want.data());
      EXPECT_EQ(exact.listed(), listed[t].size()) << "exact mode lists every neuron of its side";
      std::vector<float> got_t(got.begin() + static_cast<size_t>(t) * H,
                               got.begin() + static_cast<size_t>(t + 1) * H);
      EXPECT_LT(RelErr(got_t, want), 1e-5) << "tokens " << n << " token " << t;
    }
  }
}

// Pages of [p, p + n) in this process's resident set (/proc/self/pagemap's present bit, which
// unprivileged processes may read), or -1 where pagemap cannot be read.
int64_t PresentPages(const void* p, size_t n) {
  FILE* f = std::fopen("/proc/self/pagemap", "rb");
  if (f == nullptr) return -1;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  int64_t present = 0;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) / page;
       a * page < reinterpret_cast<uintptr_t>(p) + n; ++a) {
    uint64_t entry = 0;
    if (std::fseek(f, static_cast<long>(a * sizeof(entry)), SEEK_SET) != 0 ||
        std::fread(&entry, sizeof(entry), 1, f) != 1) {
      std::fclose(f);
      return -1;
    }
    present += (entry >> 63) & 1;
  }
  std::fclose(f);
  return present;
}

// Building the row store drops each layer's file pages once its rows are copied, so that a
// worker's peak memory is its copy plus one layer of the file, and the file's bytes still read
// back unchanged (they fault in again from the page cache).
TEST(FfnSplitTest, BuildDropsEachLayersFilePagesOnceCopied) {
  auto m = Load("relu-llama-tiny");
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<uint64_t> sums;
  for (const LayerWeights& L : m->layers) {
    const auto* b = static_cast<const uint8_t*>(L.gate.data);
    bool mapped = false;
    for (const auto& f : m->files)
      mapped |= b >= f->data() && b + L.gate.nbytes() <= f->data() + f->size();
    ASSERT_TRUE(mapped) << "the test needs weights that are views into the file";
    uint64_t sum = 0;
    for (size_t i = 0; i < L.gate.nbytes(); ++i) sum = sum * 31 + b[i];  // touches every page
    sums.push_back(sum);
    const int64_t present = PresentPages(b, L.gate.nbytes());
    if (present < 0) GTEST_SKIP() << "/proc/self/pagemap is not readable here";
    ASSERT_GE(present, static_cast<int64_t>(L.gate.nbytes() / page) - 1);
  }
  auto rows = FfnRowStore::Build(*m, Placement::FixedFraction(c, 1.0).hot);
  ASSERT_TRUE(rows.ok());
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = m->layers[l];
    for (const TensorView* t : {&L.gate, &L.up, &L.down}) {
      // At most the two partial pages at the tensor's ends stay (they hold neighbours' bytes).
      EXPECT_LE(PresentPages(t->data, t->nbytes()), 2) << "layer " << l << " " << t->name;
    }
    const auto* b = static_cast<const uint8_t*>(L.gate.data);
    uint64_t sum = 0;
    for (size_t i = 0; i < L.gate.nbytes(); ++i) sum = sum * 31 + b[i];
    EXPECT_EQ(sum, sums[l]) << "layer " << l;
  }
}

// Row stores allocate through AllocateAligned, which asks for transparent huge pages where an
// allocation spans them; HugePageBytes (the cpu-worker's log line) sees them arrive. Where the
// host has THP off there is nothing to see.
TEST(FfnSplitTest, LargeRowStorageArrivesInHugePagesWhereTheHostAllowsThem) {
  std::string mode;
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char buf[128] = {0};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) mode = buf;
    std::fclose(f);
  }
  if (mode.empty() || mode.find("[never]") != std::string::npos) {
    GTEST_SKIP() << "transparent huge pages are off here";
  }
  const uint64_t before = HugePageBytes();
  constexpr size_t kBytes = size_t{32} << 20;
  AlignedBytes rows = AllocateAligned(kBytes);
  std::memset(rows.get(), 1, kBytes);
  const uint64_t after = HugePageBytes();
  if (after < before + (size_t{2} << 20) && !CollapseToHugePages(rows.get(), kBytes)) {
    GTEST_SKIP() << "this host has no huge pages to give now (THP mode: " << mode << ")";
  }
  EXPECT_GE(after, before + (size_t{2} << 20)) << "THP mode: " << mode;
  EXPECT_LE(after, ResidentBytes());
}

// Memory first touched as 4 KiB pages (as on a host too fragmented to give huge pages at the
// first touch; MADV_NOHUGEPAGE stands in for that here) becomes huge pages when collapsed, its
// contents unchanged: what AllocateAligned does after zero-filling a large allocation.
// The cpu-worker copies its rows on its pool's threads: every neuron's gate and up rows are the
// file's bytes and its down_t row the file's down column, exactly (fp16 stays fp16), with lists
// long enough for the pool to split them and for chunk ends to fall inside a layer.
TEST(FfnSplitTest, RowsCopiedOnAPoolAreTheModelsRows) {
  auto m = Load("relu-llama-tiny");
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  const int H = c.hidden_size, F = c.ffn_size;
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> sets(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int j = 0; j < F; ++j) {
      if (rng() % 4 != 0) sets[l].push_back(j);  // ~1150 of 1536: several 256-neuron chunks
    }
  }
  ThreadPool pool(3);
  auto rows = FfnRowStore::Build(*m, sets, &pool);
  ASSERT_TRUE(rows.ok()) << rows.status();
  std::vector<float> column(F), got(H);
  for (int l = 0; l < c.n_layers; ++l) {
    SCOPED_TRACE(l);
    const LayerWeights& L = m->layers[l];
    const FfnRowStore::Layer& s = (*rows)->layer(l);
    ASSERT_EQ(s.neurons, sets[l]);
    std::vector<std::vector<float>> down(H, std::vector<float>(F));
    for (int h = 0; h < H; ++h) DequantizeRow(L.down.dtype, L.down.row(h), down[h].data(), F);
    for (size_t i = 0; i < sets[l].size(); ++i) {
      const int32_t j = sets[l][i];
      ASSERT_EQ(std::memcmp(s.gate.row(i), L.gate.row(j), L.gate.row_bytes()), 0) << "neuron " << j;
      ASSERT_EQ(std::memcmp(s.up.row(i), L.up.row(j), L.up.row_bytes()), 0) << "neuron " << j;
      DequantizeRow(s.down_t.dtype, s.down_t.row(i), got.data(), H);
      for (int h = 0; h < H; ++h) ASSERT_EQ(got[h], down[h][j]) << "neuron " << j << " col " << h;
    }
  }
}

// A pool's threads zero-fill a large allocation in 2 MiB blocks: every page of it is touched
// (resident, as the single-threaded fill leaves it) and every byte is zero, for a size that is no
// multiple of the pool's share.
TEST(FfnSplitTest, AllocationFilledOnAPoolIsResidentAndZero) {
  constexpr size_t kBytes = (size_t{37} << 20) + 12345;
  ThreadPool pool(3);
  AlignedBytes b = AllocateAligned(kBytes, &pool);
  ASSERT_NE(b.get(), nullptr);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t pages = (kBytes + page - 1) / page;
  std::vector<unsigned char> resident(pages);
  ASSERT_EQ(mincore(b.get(), pages * page, resident.data()), 0) << std::strerror(errno);
  size_t absent = 0;
  for (unsigned char r : resident) absent += (r & 1) == 0;
  EXPECT_EQ(absent, 0u);
  size_t nonzero = 0;
  for (size_t i = 0; i < kBytes; ++i) nonzero += b[i] != 0;
  EXPECT_EQ(nonzero, 0u);
}

TEST(FfnSplitTest, CollapseToHugePagesTurnsSmallPagesIntoHugeOnesKeepingTheBytes) {
  constexpr size_t kBytes = size_t{32} << 20, kHuge = size_t{2} << 20;
  void* raw = std::aligned_alloc(kHuge, kBytes);
  ASSERT_NE(raw, nullptr);
  AlignedBytes owner(static_cast<uint8_t*>(raw));
  uint8_t* p = owner.get();
  madvise(p, kBytes, MADV_NOHUGEPAGE);
  const uint64_t before = HugePageBytes();
  for (size_t i = 0; i < kBytes; ++i) p[i] = static_cast<uint8_t>(i * 7 + (i >> 12));
  EXPECT_LT(HugePageBytes(), before + kHuge) << "the fill should have made small pages";
  errno = 0;
  if (!CollapseToHugePages(p, kBytes)) {
    GTEST_SKIP() << "no collapse here (errno " << errno << ": kernel before 6.1, THP off, or no "
                 << "memory to compact)";
  }
  EXPECT_GE(HugePageBytes(), before + kBytes / 2);
  size_t wrong = 0;
  for (size_t i = 0; i < kBytes; ++i) wrong += p[i] != static_cast<uint8_t>(i * 7 + (i >> 12));
  EXPECT_EQ(wrong, 0u);
}

// Prefetch (the cpu-worker's --prefetch-guess) loads the rows of the guessed neurons that this
// side holds, every one of them when nothing stops it, and none on part 0 when stop() is true
// from the start. Within a part the guess's first tier goes first: stopped early, a single part
// has loaded only first-tier neurons. It changes nothing Accumulate computes: with the pool's
// pinned chunks the result is the same bits as without.
TEST(FfnSplitTest, PrefetchLoadsThisSidesGuessedNeuronsUntilStopped) {
  auto m = Load("relu-llama-tiny");
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  Placement p = Placement::FixedFraction(c, 0.5);
  std::vector<std::vector<int32_t>> cold(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) cold[l] = p.Cold(l, c.ffn_size);
  auto rows = FfnRowStore::Build(*m, cold);
  ASSERT_TRUE(rows.ok());
  ThreadPool pinned_pool(4), plain_pool(4);
  pinned_pool.set_pinned_chunks(true);
  auto pinned_ops = NewSimdOps(&pinned_pool), plain_ops = NewSimdOps(&plain_pool);
  PartialFfn ffn(**rows, c.activation, *pinned_ops), plain(**rows, c.activation, *plain_ops);
  const int W = (c.ffn_size + 63) / 64;
  std::vector<uint64_t> mask(W, 0), first(W, 0), none(W, 0);
  uint64_t want = 0, want_first = 0;
  for (int j = 0; j < c.ffn_size; j += 3) mask[j >> 6] |= 1ull << (j & 63);
  for (int j = 0; j < c.ffn_size; j += 6) first[j >> 6] |= 1ull << (j & 63);
  for (int32_t j : cold[1]) {
    want += j % 3 == 0;
    want_first += j % 6 == 0;
  }
  ASSERT_GT(want, 64u);  // several parts
  ASSERT_GT(want_first, 10u);
  auto never = [] { return false; };
  PartialFfn::Loaded got = ffn.Prefetch(1, mask.data(), first.data(), &pinned_pool, never);
  EXPECT_EQ(got.neurons, want);
  EXPECT_EQ(got.first, want_first);
  got = ffn.Prefetch(1, mask.data(), nullptr, &pinned_pool, never);
  EXPECT_EQ(got.neurons, want);
  EXPECT_EQ(got.first, 0u);
  EXPECT_LT(ffn.Prefetch(1, mask.data(), first.data(), &pinned_pool, [] { return true; }).neurons,
            want);
  EXPECT_EQ(ffn.Prefetch(1, none.data(), first.data(), &pinned_pool, never).neurons, 0u);
  // One part (no pool), stopped after 10 neurons: all of them from the first tier.
  int polls = 0;
  got = ffn.Prefetch(1, mask.data(), first.data(), nullptr, [&] { return ++polls > 10; });
  EXPECT_EQ(got.neurons, 10u);
  EXPECT_EQ(got.first, 10u);

  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(c.hidden_size), a(c.hidden_size, 0.f), b(c.hidden_size, 0.f);
  for (float& v : x) v = nd(rng);
  ffn.Accumulate(1, x.data(), 1, mask.data(), W, a.data());
  plain.Accumulate(1, x.data(), 1, mask.data(), W, b.data());
  EXPECT_EQ(a, b);
}

TEST(FfnSplitTest, StoreHoldsOnlyItsRowsAndRejectsBadPlacements) {
  auto m = Load("relu-llama-tiny");
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  Placement p = Placement::FixedFraction(c, 0.25);
  EXPECT_EQ(p.hot[0].size(), static_cast<size_t>(c.ffn_size / 4));
  auto rows = FfnRowStore::Build(*m, p.hot);
  ASSERT_TRUE(rows.ok());
  // fp16 weights: gate, up and down_t rows of hidden * 2 bytes per neuron.
  EXPECT_EQ((*rows)->bytes(), p.hot_neurons() * 3 * c.hidden_size * 2);
  EXPECT_EQ((*rows)->layer(0).down_t.dtype, DType::kF16);
  // Each neuron's gate, up and down rows lie back to back, the next neuron right after.
  const FfnRowStore::Layer& L1 = (*rows)->layer(1);
  const size_t rb = c.hidden_size * 2;
  for (int i : {0, 1, static_cast<int>(L1.neurons.size()) - 1}) {
    EXPECT_EQ(L1.up.row(i), L1.gate.row(i) + rb);
    EXPECT_EQ(L1.down_t.row(i), L1.gate.row(i) + 2 * rb);
    if (i > 0) {
      EXPECT_EQ(L1.gate.row(i), L1.down_t.row(i - 1) + rb);
    }
    EXPECT_EQ(std::memcmp(L1.gate.row(i), m->layers[1].gate.row(L1.neurons[i]), rb), 0);
    EXPECT_EQ(std::memcmp(L1.up.row(i), m->layers[1].up.row(L1.neurons[i]), rb), 0);
  }

  std::vector<uint64_t> bm((c.ffn_size + 63) / 64);
  p.ToBitmap(1, c.ffn_size, bm.data());
  std::vector<const uint64_t*> maps(c.n_layers, bm.data());
  Placement back = Placement::FromBitmaps(maps, c.ffn_size);
  EXPECT_EQ(back.hot[3], p.hot[1]);

  std::vector<std::vector<int32_t>> bad(c.n_layers);
  bad[1] = {3, 2};
  EXPECT_THAT(FfnRowStore::Build(*m, bad).status().message(), ::testing::HasSubstr("ascending"));
  EXPECT_EQ(FfnRowStore::Build(*m, {{1}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ModelFingerprint(*m), 0u);
}

}  // namespace
}  // namespace pinfer

namespace pinfer {
namespace {

// The service's FFN as one block: hot and cold PartialFfn contributions summed, as the two
// workers do.
class SplitBlock : public FfnBlock {
 public:
  SplitBlock(const Model& m, const CpuOps& ops, double hot_fraction) {
    Placement p = Placement::FixedFraction(m.config, hot_fraction);
    std::vector<std::vector<int32_t>> cold(m.config.n_layers);
    for (int l = 0; l < m.config.n_layers; ++l) cold[l] = p.Cold(l, m.config.ffn_size);
    hot_rows_ = std::move(*FfnRowStore::Build(m, p.hot));
    cold_rows_ = std::move(*FfnRowStore::Build(m, cold));
    hot_ = std::make_unique<PartialFfn>(*hot_rows_, m.config.activation, ops);
    cold_ = std::make_unique<PartialFfn>(*cold_rows_, m.config.activation, ops);
    hidden_ = m.config.hidden_size;
  }
  absl::Status Forward(int layer, const float* x, int n, float* out) override {
    std::fill(out, out + static_cast<size_t>(n) * hidden_, 0.f);
    hot_->Accumulate(layer, x, n, nullptr, 0, out);
    cold_->Accumulate(layer, x, n, nullptr, 0, out);
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<FfnRowStore> hot_rows_, cold_rows_;
  std::unique_ptr<PartialFfn> hot_, cold_;
  int hidden_ = 0;
};

// Continuous batching must not change any sequence's output: a batched decode step gives
// bit-identical logits to each sequence's own one-token Forward.
TEST(DecodeBatchTest, BatchedDecodeIsBitIdenticalToSingleSteps) {
  auto m = Load("relu-llama-tiny");
  ASSERT_NE(m, nullptr);
  ThreadPool pool(2);
  auto ops = NewSimdOps(&pool);
  SplitBlock ffn_a(*m, *ops, 0.5), ffn_b(*m, *ops, 0.5);
  Transformer single(*m, *ops), batched(*m, *ops);
  single.set_ffn(&ffn_a);
  batched.set_ffn(&ffn_b);
  const int V = m->config.vocab_size;
  const std::vector<std::vector<int32_t>> prompts = {{1, 385, 753, 2587}, {1, 9, 27}, {1, 600}};
  const int S = static_cast<int>(prompts.size());
  std::vector<std::unique_ptr<KvCache>> ca, cb;
  std::vector<std::vector<float>> la(S, std::vector<float>(V)), lb(S, std::vector<float>(V));
  std::vector<int32_t> next(S);
  std::vector<int> pos(S);
  for (int s = 0; s < S; ++s) {
    ca.push_back(std::make_unique<KvCache>(m->config, 64));
    cb.push_back(std::make_unique<KvCache>(m->config, 64));
    ASSERT_TRUE(single.Forward(prompts[s], 0, ca[s].get(), LogitsMode::kLast, la[s].data()).ok());
    ASSERT_TRUE(batched.Forward(prompts[s], 0, cb[s].get(), LogitsMode::kLast, lb[s].data()).ok());
    pos[s] = static_cast<int>(prompts[s].size());
  }
  for (int step = 0; step < 12; ++step) {
    std::vector<Transformer::DecodeStep> batch;
    for (int s = 0; s < S; ++s) {
      ASSERT_EQ(la[s], lb[s]) << "sequence " << s << " step " << step;
      next[s] = static_cast<int32_t>(std::max_element(la[s].begin(), la[s].end()) - la[s].begin());
      ASSERT_TRUE(
          single.Forward({&next[s], 1}, pos[s], ca[s].get(), LogitsMode::kLast, la[s].data()).ok());
      batch.push_back({next[s], pos[s], cb[s].get(), lb[s].data()});
      pos[s] += 1;
    }
    // Sequences join and leave: the batch is every sequence, or all but the first on odd steps.
    std::span<const Transformer::DecodeStep> span(batch);
    if (step % 2 == 1) {
      ASSERT_TRUE(batched.ForwardDecodeBatch(span.subspan(0, 1)).ok());
      span = span.subspan(1);
    }
    ASSERT_TRUE(batched.ForwardDecodeBatch(span).ok());
  }
  for (int s = 0; s < S; ++s) EXPECT_EQ(la[s], lb[s]);
  std::vector<Transformer::DecodeStep> bad = {{4096, 0, cb[0].get(), nullptr}};
  EXPECT_EQ(batched.ForwardDecodeBatch(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = {{5, 64, cb[0].get(), nullptr}};
  EXPECT_EQ(batched.ForwardDecodeBatch(bad).code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace pinfer
