// Prompt processing on the synthetic ReluLLaMA-13B-shape model (bench_common.h): a layer's cold
// rows computed on the CPU (the cold callback) against streamed to the GPU (every cold row pinned
// in host memory, copied in chunks through device slots while cuBLAS multiplies the previous
// chunk: gpu-worker/cuda/cold_stream.h) against the cost model's choice per layer
// (shared/sparse/cost_model.h, what the service's --cold-prefill runs), per batch size, at the
// same VRAM budget as decode. Issue 43's prompt-processing target. Prints the command, the
// calibration, and one table row per batch size.
//
//   cuda_prefill_bench --dtype=F16     # --prefill-batches=1,16,64,256,512 --stream-chunk=1024
//                                      # --stream-slots=2 --active=0.10, skew 20% (--skews' first)
//
// The hot rows of a batch go through cuBLAS either way. The CPU side computes, token by token,
// only that token's active cold rows (drawn from the same profile as decode), the best case for
// the CPU; the stream moves every cold row once per batch. The cost model's rates are measured
// here first: the stream's copy and product rates with CalibrateStreaming, the CPU's
// per-row-token cost by timing the cold callback on rotating layers at several batch sizes.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench/cuda/bench_common.h"
#include "gpu-worker/cuda/backend.h"
#include "shared/sparse/cost_model.h"
#include "shared/util/thread_pool.h"

namespace pinfer::cudabench {
namespace {

struct Options : BenchOptions {
  std::vector<int> prefill_batches = {1, 16, 64, 256, 512};
  int stream_chunk = 1024, stream_slots = 2;
};

// The cold callback for a batch: token t's own active cold rows, through CpuColdFfn (the
// cpu-worker's op, one call per token).
class BatchCpuCold : public cuda::ColdFfn {
 public:
  BatchCpuCold(CpuColdFfn& one, const SynthModel& m) : one_(one), m_(m) {}
  // per_token[t][layer]: token t's active cold neuron ids.
  void set_masks(const std::vector<std::vector<std::vector<int32_t>>>* per_token) {
    per_token_ = per_token;
  }
  cuda::BackendStatus Run(const cuda::ColdRequest& r) override {
    const int H = m_.config.hidden_size;
    for (int t = 0; t < r.n; ++t) {
      const std::vector<int32_t>& ids = (*per_token_)[t][r.layer];
      cuda::ColdRequest one = r;
      one.n = 1;
      one.x = r.x + static_cast<size_t>(t) * H;
      one.out = r.out + static_cast<size_t>(t) * H;
      one.active = ids.data();
      one.n_active = static_cast<int>(ids.size());
      cuda::BackendStatus st = one_.Run(one);
      if (!st.ok()) return st;
    }
    return {};
  }

 private:
  CpuColdFfn& one_;
  const SynthModel& m_;
  const std::vector<std::vector<std::vector<int32_t>>>* per_token_ = nullptr;
};

int PrefillBench(const Options& o, const SynthModel& m, ThreadPool& pool, int threads) {
  const ModelConfig& c = m.config;
  const int H = c.hidden_size, F = c.ffn_size;
  int max_n = 1;
  for (int n : o.prefill_batches) max_n = std::max(max_n, n);
  const int B = std::max(max_n, 16), max_ctx = max_n + 8;
  const size_t rb = m.Rb(H);
  const double budget = o.Budget(m.ModelBytes());
  // Fixed device bytes: as decode, plus the cuBLAS scratch of B-token batches (fp16 hi/lo
  // activations of the widest product; fp16 weights for block formats) and the stream slots.
  const int64_t widest =
      std::max<int64_t>({int64_t{H}, int64_t{2} * F, int64_t{c.q_dim()} + 2 * c.kv_dim(),
                         int64_t{c.vocab_size}, int64_t{m.pred_rank}});
  double w_half = 0;
  if (m.dtype != DType::kF16) {
    w_half = 2.0 *
             std::max<int64_t>(
                 {int64_t{c.vocab_size}, int64_t{c.q_dim()} + 2 * c.kv_dim(), int64_t{F}}) *
             H;
  }
  const double gemm_scratch = 2.0 * B * widest * 2 + w_half;
  const double slots = static_cast<double>(o.stream_slots) * 3 * std::min(o.stream_chunk, F) * rb;
  const double fixed =
      SplitFixedBytes(m, ScratchBytes(m, max_ctx, c.n_layers, B) + gemm_scratch + slots);
  const double per_neuron = 3.0 * rb + 4;
  const int n_hot = HotNeuronsInBudget(m, budget, fixed);
  const int n_cold = F - n_hot;
  cuda::ModelUpload u = BaseUpload(m, max_ctx);
  u.max_batch = B;
  u.stream_cold = true;
  u.stream_chunk_rows = o.stream_chunk;
  u.stream_slots = o.stream_slots;
  std::vector<std::vector<int32_t>> is_hot(c.n_layers, std::vector<int32_t>(F, 0));
  for (int l = 0; l < c.n_layers; ++l) {
    FillHotLayer(m, l, n_hot, &u.layers[l]);
    for (int32_t j : u.layers[l].hot_ids) is_hot[l][j] = 1;
  }
  const double plan = fixed + c.n_layers * (per_neuron * n_hot + 4.0 * n_cold);
  Backend be;
  double t0 = Now();
  if (!CreateBackend(u, "prefill", &be)) return 1;
  std::printf(
      "prefill: %d of %d FFN neurons per layer on the GPU (%.1f%%), %d cold streamed in "
      "chunks of %d through %d slots; created (upload + pinned cold rows) in %.1f s; "
      "VRAM plan %.2f GB, actual %.2f GB (%+.2f%%)\n",
      n_hot, F, 100.0 * n_hot / F, n_cold, o.stream_chunk, o.stream_slots, Now() - t0, plan / 1e9,
      be.b->DeviceBytes() / 1e9, 100.0 * (be.b->DeviceBytes() - plan) / plan);

  ThreadPool spin(threads, kColdSpin);
  CpuColdFfn one(m, spin);
  BatchCpuCold cold(one, m);
  // Per-token masks for the largest batch; smaller batches use its first tokens.
  const double skew = o.skews.empty() ? 0.2 : o.skews[0];
  Masks masks = DrawMasks(m, o.active, skew, max_n, pool);
  std::vector<std::vector<std::vector<int32_t>>> cold_tok(
      max_n, std::vector<std::vector<int32_t>>(c.n_layers));
  double cold_rows_per_token = 0;
  for (int t = 0; t < max_n; ++t) {
    for (int l = 0; l < c.n_layers; ++l) {
      for (int32_t j : masks[t][l]) {
        if (!is_hot[l][j]) cold_tok[t][l].push_back(j);
      }
      cold_rows_per_token += cold_tok[t][l].size();
    }
  }
  cold_rows_per_token /= static_cast<double>(max_n) * c.n_layers;
  cold.set_masks(&cold_tok);

  // --- Calibration (measured, on layer 0).
  ColdCostParams params;
  {
    std::vector<CpuSample> samples;
    // Each timed call on a different layer, as in a forward pass: a layer's rows are back in
    // DRAM by the time it comes round again (timing one layer repeatedly would measure the L3).
    std::vector<float> x(static_cast<size_t>(16) * H), out(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * static_cast<float>((i * 7919) % 201) - 1.f;
    int next_layer = 0;
    for (int n : {1, 2, 4, 8, 16}) {
      if (n > max_n) break;
      double rt = 0, sec = 0;
      for (int rep = 0; rep < 8; ++rep) {
        cuda::ColdRequest r;
        r.layer = next_layer;
        next_layer = (next_layer + 1) % c.n_layers;
        r.n = n;
        r.x = x.data();
        r.out = out.data();
        const double s0 = Now();
        cold.Run(r);
        const double dt = Now() - s0;
        double row_tokens = 0;
        for (int t = 0; t < n; ++t) row_tokens += cold_tok[t][r.layer].size();
        if (rep > 0) {  // the first call wakes the pool
          samples.push_back({row_tokens, dt});
          rt += row_tokens;
          sec += dt;
        }
      }
      std::printf(
          "calibration: CPU cold, %d tokens, %.0f row-tokens per layer: %.3f ms (mean of "
          "7 layers)\n",
          n, rt / 7, sec / 7 * 1e3);
    }
    if (absl::Status st = FitCpuCosts(samples, &params); !st.ok()) {
      std::fprintf(stderr, "CPU fit: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    const int cal_n = std::min(B, 256);
    cuda::StreamCalibration cal;
    cuda::BackendStatus bst = be.b->CalibrateStreaming(0, cal_n, &cal);
    if (!bst.ok()) {
      std::fprintf(stderr, "stream calibration: %s\n", bst.message.c_str());
      return 1;
    }
    if (absl::Status st = SetStreamCosts(cal.bytes, cal.copy_s, cal.flops, cal.compute_s,
                                         cal.overlapped_s, &params);
        !st.ok()) {
      std::fprintf(stderr, "stream fit: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    std::printf(
        "calibration: stream layer 0, %d tokens, %.1f MB: copy %.3f ms (%.1f GB/s), "
        "products %.3f ms (%.0f TFLOP/s), overlapped %.3f ms\n",
        cal_n, cal.bytes / 1e6, cal.copy_s * 1e3, params.h2d_bytes_per_s / 1e9, cal.compute_s * 1e3,
        params.gpu_flops_per_s / 1e12, cal.overlapped_s * 1e3);
    std::printf(
        "cost model: cpu %.3f ms + %.4f us per row-token; stream %.3f ms + max(bytes / "
        "%.1f GB/s, flops / %.0f TFLOP/s); %.1f active cold rows per token per layer; "
        "crossover at %d tokens\n",
        params.cpu_fixed_s * 1e3, params.cpu_s_per_row_token * 1e6, params.stream_fixed_s * 1e3,
        params.h2d_bytes_per_s / 1e9, params.gpu_flops_per_s / 1e12, cold_rows_per_token,
        StreamCrossover(params, n_cold, cal.bytes, H, cold_rows_per_token, B));
  }

  // --- Batches.
  struct Row {
    int n;
    double cpu_s = -1, stream_s = -1, pred_cpu_s = 0, pred_stream_s = 0, cold_cb_s = 0;
    double model_s = -1;
    int model_stream_layers = 0;
    bool choose_stream = false;
  };
  std::vector<Row> rows;
  std::vector<int32_t> tokens(max_n);
  for (int t = 0; t < max_n; ++t) tokens[t] = 1 + (t * 7919) % (c.vocab_size - 1);
  std::vector<float> logits(c.vocab_size);
  std::vector<std::vector<int32_t>> no_hot(c.n_layers), cold_union(c.n_layers);
  for (int n : o.prefill_batches) {
    Row row;
    row.n = n;
    ColdLayerWork w;
    w.tokens = n;
    w.cold_rows = n_cold;
    w.bytes = 3.0 * rb * n_cold;
    w.hidden = H;
    w.active_row_tokens = cold_rows_per_token * n;
    absl::StatusOr<ColdPathChoice> choice = ChooseColdPath(params, w);
    if (!choice.ok()) {
      std::fprintf(stderr, "cost model: %s\n", std::string(choice.status().message()).c_str());
      return 1;
    }
    // The model predicts per layer; times the layers for the whole batch.
    row.pred_cpu_s = choice->cpu_s * c.n_layers;
    row.pred_stream_s = choice->stream_s * c.n_layers;
    row.choose_stream = choice->stream && n > 8;
    std::printf("cost model, %d tokens, per layer: %s%s\n", n, choice->Describe().c_str(),
                n <= 8 && choice->stream ? " (matrix-vector batch: cpu)" : "");
    // given lists (kGiven): hot rows are all computed by cuBLAS for batches; cold = union.
    for (int l = 0; l < c.n_layers; ++l) {
      std::vector<char> seen(F, 0);
      cold_union[l].clear();
      no_hot[l].clear();
      for (int t = 0; t < n; ++t) {
        for (int32_t j : cold_tok[t][l]) seen[j] = 1;
      }
      for (int j = 0; j < F; ++j) {
        if (seen[j]) cold_union[l].push_back(j);
      }
    }
    // The model's choice, executed: per layer, from that layer's active cold rows in this batch.
    std::vector<cuda::ColdPath> chosen_paths(c.n_layers, cuda::ColdPath::kCallback);
    for (int l = 0; l < c.n_layers; ++l) {
      ColdLayerWork wl = w;
      wl.active_row_tokens = 0;
      for (int t = 0; t < n; ++t) wl.active_row_tokens += cold_tok[t][l].size();
      absl::StatusOr<ColdPathChoice> cl = ChooseColdPath(params, wl);
      if (cl.ok() && cl->stream && n > 8) {
        chosen_paths[l] = cuda::ColdPath::kStream;
        ++row.model_stream_layers;
      }
    }
    for (int pass = 0; pass < 3; ++pass) {
      const cuda::ColdPath path = pass == 1 ? cuda::ColdPath::kStream : cuda::ColdPath::kCallback;
      if (path == cuda::ColdPath::kStream && n <= 8) continue;
      const int reps = n >= 256 ? 1 : (n >= 64 ? 2 : 3);
      std::vector<double> ts;
      for (int rep = -1; rep < reps; ++rep) {
        if (rep < 0 && (pass != 1 && n >= 64)) continue;  // warm enough
        cuda::ForwardArgs a;
        a.tokens = tokens.data();
        a.n = n;
        a.pos0 = 0;
        a.mode = cuda::FfnMode::kGiven;
        a.given_hot = &no_hot;  // ignored by the cuBLAS path, which computes every hot row
        a.given_cold = &cold_union;
        a.run_predictors = true;
        a.cold = &cold;
        a.cold_path = path;
        if (pass == 2) a.cold_paths = &chosen_paths;
        a.logits = logits.data();
        const double s0 = Now();
        cuda::BackendStatus st = be.b->Forward(a);
        if (!st.ok()) {
          std::fprintf(stderr, "prefill forward (%d tokens): %s\n", n, st.message.c_str());
          return 1;
        }
        if (rep >= 0) ts.push_back(Now() - s0);
        if (pass == 0) row.cold_cb_s = be.b->last_stats().cold_callback;
        if (pass == 2 && be.b->last_stats().streamed_layers != row.model_stream_layers) {
          std::fprintf(stderr, "the backend streamed %d layers, the model chose %d\n",
                       be.b->last_stats().streamed_layers, row.model_stream_layers);
          return 1;
        }
      }
      (pass == 0 ? row.cpu_s : pass == 1 ? row.stream_s : row.model_s) = MedianOf(ts);
    }
    rows.push_back(row);
  }
  std::printf(
      "\n| dtype | tokens | CPU-cold tok/s | streamed-cold tok/s | model's choice "
      "(streamed layers) | model tok/s | predicted CPU cold ms | measured CPU cold ms | batch ms, "
      "CPU cold | predicted "
      "stream ms | batch ms, streamed |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    char st[32] = "-", sm[32] = "-";
    if (r.stream_s > 0) {
      std::snprintf(st, sizeof(st), "%.1f", r.n / r.stream_s);
      std::snprintf(sm, sizeof(sm), "%.1f", r.stream_s * 1e3);
    }
    const double best = r.stream_s > 0 ? std::min(r.stream_s, r.cpu_s) : r.cpu_s;
    const char* choice = r.model_stream_layers == c.n_layers ? "stream"
                         : r.model_stream_layers == 0        ? "cpu"
                                                             : "mixed";
    std::printf("| %s | %d | %.1f | %s | %s (%d)%s | %.1f | %.1f | %.1f | %.1f | %.1f | %s |\n",
                DTypeName(m.dtype).data(), r.n, r.n / r.cpu_s, st, choice, r.model_stream_layers,
                r.model_s > best * 1.05 ? ", slower than the best path" : "", r.n / r.model_s,
                r.pred_cpu_s * 1e3, r.cold_cb_s * 1e3, r.cpu_s * 1e3, r.pred_stream_s * 1e3, sm);
  }
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  const NumberFlags numbers = {
      {{"--stream-chunk=", &o.stream_chunk}, {"--stream-slots=", &o.stream_slots}}, {}};
  auto own = [&](const std::string& a) {
    const char* v = FlagValue(a, "--prefill-batches=");
    if (v == nullptr) return ParseNumberFlag(a, numbers);
    o.prefill_batches.clear();
    for (double n : CommaList(v)) o.prefill_batches.push_back(static_cast<int>(n));
    return true;
  };
  if (!ParseFlags(argc, argv, &o, own)) return 2;
  return WithModel(o, [&](const SynthModel& m, ThreadPool& pool, int threads) {
    return PrefillBench(o, m, pool, threads);
  });
}

}  // namespace
}  // namespace pinfer::cudabench

int main(int argc, char** argv) { return pinfer::cudabench::Main(argc, argv); }
