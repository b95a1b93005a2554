// The kernels under a decode step, alone: what the roofline's bandwidths are on this machine
// (the GPU's copy and matrix-vector, the CPU's matrix-vector over all threads, host to GPU, a
// launch), the module's matrix-vector by layer shape and kernel choice, the cold side's row rate
// with 4 KB against 2 MB pages, and the cpu-worker's cold op (CpuColdFfn) by list length and
// thread count with its fixed costs: where a decode step of decode_bench loses its time (issue
// 43: scattered cold rows read at 79-85 GB/s against 96 for one matrix, the fixed costs of each
// layer's handoff). Prints the command, then a line or a table per section.
//
//   cuda_kernel_bench --dtype=F16                      # every section
//   cuda_kernel_bench --dtype=Q4_0 --sections=coldop   # the cold op alone (needs no GPU)
//
// Sections (--sections, default bandwidths,shapes,pages,coldop): the first three need a GPU and
// are skipped without one; coldop builds the synthetic model (bench_common.h) for its rows.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda/bench_common.h"
#include "gpu-worker/cuda/backend.h"
#include "gpu-worker/cuda/kernels.h"
#include "shared/engine/row_kernels.h"
#include "shared/util/thread_pool.h"

namespace pinfer::cudabench {
namespace {

// Section shapes: the module's matrix-vector throughput per layer shape of the 13B model and kernel
// choice (F16: one warp per row against one block per row; block formats: GGUF's layout against
// the split one the backend runs), then the default kernel 20 times back to back without and
// with programmatic dependent launch, to see where a decode step loses bandwidth.
// The K-quant product's launch shapes the shapes section compares (warps a block, blocks an SM
// by the registers of its one-token kernel; the first is the default).
struct KShape {
  int warps, min_blocks;
};
constexpr KShape kKShapes[] = {{8, 5}, {8, 1}, {8, 4}, {8, 6}, {4, 5}, {4, 6}};

void MeasureShapes(DType dtype, ThreadPool& pool) {
  struct Shape {
    const char* name;
    int64_t rows, cols;
  };
  const Shape shapes[] = {{"wqkv", 15360, 5120},
                          {"wo", 5120, 5120},
                          {"gate_up", 27648, 5120},
                          {"down", 5120, 13824},
                          {"output", 32000, 5120}};
  const int saved = cuda::MatVecWarpRowsMin();
  cudaEvent_t e0, e1;
  PINFER_BENCH_CUDA(cudaEventCreate(&e0));
  PINFER_BENCH_CUDA(cudaEventCreate(&e1));
  std::printf("matvec %s GB/s by shape:", DTypeName(dtype).data());
  for (const Shape& sh : shapes) {
    Buffer host(RowBytes(dtype, sh.cols) * sh.rows);
    FillRandom(dtype, host.p, host.n, 5, pool);
    void* w = nullptr;
    float *x = nullptr, *y = nullptr;
    PINFER_BENCH_CUDA(cudaMalloc(&w, host.n));
    PINFER_BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&x), sh.cols * 4));
    PINFER_BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&y), sh.rows * 4));
    PINFER_BENCH_CUDA(cudaMemcpy(w, host.p, host.n, cudaMemcpyHostToDevice));
    PINFER_BENCH_CUDA(cudaMemset(x, 0, sh.cols * 4));
    cuda::DeviceMatrix m{static_cast<cuda::WType>(dtype), sh.rows, sh.cols, w};
    std::printf(" %s", sh.name);
    // Block formats: GGUF's layout against the split one the backend uses. Then the default
    // kernel 20 times back to back on a stream, without and with programmatic dependent launch
    // (the next launch's start and weight prefetch overlap the previous one's tail).
    const bool quant = dtype == DType::kQ4_0 || dtype == DType::kQ8_0;
    void* ws = nullptr;
    cuda::DeviceMatrix sm = m;
    if (quant) {
      PINFER_BENCH_CUDA(cudaMalloc(&ws, host.n));
      sm.data = ws;
      sm.scales = static_cast<uint8_t*>(ws) + cuda::QuantRowBytes(sm.type, sh.cols) * sh.rows;
      PINFER_BENCH_CUDA(cuda::RepackSplit(m, sm, 0, nullptr));
    }
    cudaStream_t s;
    PINFER_BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const bool pdl = cuda::ProgrammaticLaunch();
    // One timing: the median over 20 passes of reps back-to-back products on stream st.
    auto time_gbs = [&](const cuda::DeviceMatrix& mv, int reps, cudaStream_t st, const void* qx) {
      std::vector<double> t;
      for (int i = 0; i < 25; ++i) {
        PINFER_BENCH_CUDA(cudaEventRecord(e0, st));
        for (int k = 0; k < reps; ++k) {
          PINFER_BENCH_CUDA(cuda::MatVecRows(mv, nullptr, static_cast<int>(sh.rows), nullptr, x, 1,
                                             y, static_cast<int>(sh.rows), st, qx));
        }
        PINFER_BENCH_CUDA(cudaEventRecord(e1, st));
        PINFER_BENCH_CUDA(cudaEventSynchronize(e1));
        float ms;
        PINFER_BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 5) t.push_back(ms * 1e-3 / reps);
      }
      return host.n / MedianOf(t) / 1e9;
    };
    if (IsKQuant(dtype)) {
      // K-quants: the launch shapes of SetKMatVecShape (kKShapes, printed as 8w5b: eight warps,
      // five blocks an SM), 20 products back to back with programmatic dependent launch, x
      // quantized by its producer (a norm) as in a decode step.
      void* qx = nullptr;
      float *ones = nullptr, *normed = nullptr;
      PINFER_BENCH_CUDA(cudaMalloc(&qx, cuda::QxBytes(sh.cols)));
      PINFER_BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&ones), sh.cols * 4));
      PINFER_BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&normed), sh.cols * 4));
      std::vector<float> hx(sh.cols);
      for (int64_t c = 0; c < sh.cols; ++c) hx[c] = std::sin(0.37 * c);
      PINFER_BENCH_CUDA(cudaMemcpy(x, hx.data(), sh.cols * 4, cudaMemcpyHostToDevice));
      std::fill(hx.begin(), hx.end(), 1.f);
      PINFER_BENCH_CUDA(cudaMemcpy(ones, hx.data(), sh.cols * 4, cudaMemcpyHostToDevice));
      PINFER_BENCH_CUDA(
          cuda::RmsNorm(x, ones, 1, static_cast<int>(sh.cols), 1e-5f, normed, nullptr, qx));
      PINFER_BENCH_CUDA(cudaDeviceSynchronize());
      cuda::SetProgrammaticLaunch(true);
      for (const KShape& k : kKShapes) {
        cuda::SetKMatVecShape(k.warps, k.min_blocks);
        std::printf(" %dw%db %.0f", k.warps, k.min_blocks, time_gbs(m, 20, s, qx));
      }
      cuda::SetKMatVecShape(8, 5);
      cudaFree(qx);
      cudaFree(ones);
      cudaFree(normed);
    } else {
      for (int variant = 0; variant < 4; ++variant) {
        const char* names[] = {quant ? "gguf" : "warp", quant ? "split" : "block", "chain",
                               "chain+pdl"};
        if (!quant)
          cuda::SetMatVecWarpRowsMin(variant == 0 ? 1 : 1 << 30);  // warp rows, block rows
        const cuda::DeviceMatrix& mv = quant && variant > 0 ? sm : m;
        cuda::SetProgrammaticLaunch(variant == 3);
        std::printf(" %s %.0f", names[variant],
                    time_gbs(mv, variant >= 2 ? 20 : 1, variant >= 2 ? s : nullptr, nullptr));
      }
    }
    cuda::SetProgrammaticLaunch(pdl);
    cudaStreamDestroy(s);
    if (ws != nullptr) cudaFree(ws);
    cudaFree(w);
    cudaFree(x);
    cudaFree(y);
  }
  std::printf("\n");
  cuda::SetMatVecWarpRowsMin(saved);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// Section pages: the cold side's row bandwidth on one layer-sized set of gate, up and down_t rows,
// 10% of the rows drawn at random per pass, computed as CpuColdFfn does (from three matrices
// rather than its bundles), with 4 KB and with 2 MB pages.
void MeasureColdRows(DType dtype, int hidden, int ffn, int threads, ThreadPool& fill_pool) {
  const RowKernels* k = BestRowKernels();
  const size_t rb = RowBytes(dtype, hidden), di = static_cast<size_t>(dtype);
  std::vector<float> x(hidden, 0.01f), partial(static_cast<size_t>(threads) * hidden);
  std::mt19937 rng(3);
  ThreadPool spin(threads, kColdSpin);
  std::printf("cold rows (%d threads, %d of %d rows):", threads, ffn / 10, ffn);
  for (bool huge : {false, true}) {
    Buffer gate(rb * ffn, huge), up(rb * ffn, huge), down(rb * ffn, huge);
    FillRandom(dtype, gate.p, gate.n, 11, fill_pool);
    FillRandom(dtype, up.p, up.n, 12, fill_pool);
    FillRandom(dtype, down.p, down.n, 13, fill_pool);
    std::vector<double> t;
    for (int rep = 0; rep < 24; ++rep) {
      std::vector<int32_t> ids(ffn);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(ffn / 10);
      std::sort(ids.begin(), ids.end());
      const int n_active = static_cast<int>(ids.size());
      const double t0 = Now();
      spin.ParallelFor(threads, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t part = p0; part < p1; ++part) {
          float* y = partial.data() + static_cast<size_t>(part) * hidden;
          std::fill(y, y + hidden, 0.f);
          const int i0 = static_cast<int>(static_cast<int64_t>(n_active) * part / threads);
          const int i1 = static_cast<int>(static_cast<int64_t>(n_active) * (part + 1) / threads);
          for (int i = i0; i < i1; ++i) {
            const int64_t j = ids[i];
            const float g = k->dot[di](gate.p + j * rb, x.data(), hidden);
            const float u = k->dot[di](up.p + j * rb, x.data(), hidden);
            k->axpy[di](g / (1.f + std::exp(-g)) * u, down.p + j * rb, y, hidden);
          }
        }
      });
      if (rep >= 4) t.push_back(Now() - t0);
    }
    std::sort(t.begin(), t.end());
    std::printf(" %s pages %.1f GB/s (%.0f us)", huge ? "2M" : "4K",
                3.0 * rb * (ffn / 10) / t[t.size() / 2] / 1e9, t[t.size() / 2] * 1e6);
  }
  std::printf("\n");
}

// Section coldop (no GPU): a layer's cold rows as decode_bench's pinfer mode computes them
// (CpuColdFfn: the cpu-worker's op on spinning threads), by list length and thread count. Each call
// takes a fresh random set of n neurons of the next layer, so rows come from memory as in decode;
// medians over the calls. The last line is one thread on 16 neurons kept in cache: the kernels'
// compute ceiling.
int ColdRowsBench(const SynthModel& m, int threads) {
  const ModelConfig& c = m.config;
  const int H = c.hidden_size, F = c.ffn_size, L = c.n_layers;
  const double neuron_bytes = 3.0 * m.Rb(H);
  std::mt19937 rng(5);
  std::vector<float> x(H);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& v : x) v = u(rng);
  // n random neurons of a layer, sorted as the cpu-worker's lists are.
  auto draw = [&](int n) {
    std::vector<int32_t> all(F);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> ids(all.begin(), all.begin() + n);
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  std::vector<float> out(static_cast<size_t>(cuda::kMaxColdParts) * H);
  // Median seconds per call over `calls` calls after 4 unmeasured ones: n > 0 draws n neurons of
  // the next layer per call; n = 0 takes layer 0's first 16 neurons every time (kept in cache).
  // With parts, the calls alternate between the op that sums its threads' partials and the op
  // that leaves them to the GPU (ColdRequest::max_parts), whose median goes to *parts_s.
  auto time_calls = [&](CpuColdFfn& cold, int n, int calls, double* parts_s = nullptr) {
    std::vector<int32_t> ids(16);
    std::iota(ids.begin(), ids.end(), 0);
    std::vector<double> t, tp;
    for (int i = 0; i < calls; ++i) {
      for (int way = 0; way < (parts_s != nullptr ? 2 : 1); ++way) {
        if (n > 0) ids = draw(n);
        int n_parts = 0;
        cuda::ColdRequest r;
        r.layer = n > 0 ? i % L : 0;
        r.n = 1;
        r.x = x.data();
        r.out = out.data();
        r.active = ids.data();
        r.n_active = static_cast<int>(ids.size());
        if (way == 1) {
          r.max_parts = cuda::kMaxColdParts;
          r.parts = &n_parts;
        }
        const double t0 = Now();
        cold.Run(r);
        if (i >= 4) (way == 0 ? t : tp).push_back(Now() - t0);
      }
    }
    if (parts_s != nullptr) *parts_s = MedianOf(tp);
    return MedianOf(t);
  };
  auto row = [&](const char* what, int T, int n, double s) {
    const int rows = n > 0 ? n : 16;
    std::printf("| %s | %d | %d | %.1f | %.1f |\n", what, T, rows, s * 1e6,
                rows * neuron_bytes / s / 1e9);
  };
  std::printf(
      "\n| cold side (%s) | threads | neurons | us per call | GB/s |\n|---|---|---|---|---|\n",
      DTypeName(m.dtype).data());
  const int calls = 4 * L + 4;
  for (int T : {threads, threads - 1}) {
    if (T < 1) continue;
    ThreadPool spin(T, kColdSpin);
    CpuColdFfn cold(m, spin);
    for (int n : {64, 150, 295, 500, 838, 1382}) {
      if (n > F) break;    // a small --ffn: lists longer than a layer's neurons do not exist
      if (T == threads) {  // the two ways taking turns call by call
        double parts_s = 0;
        row("cpu-worker op", T, n, time_calls(cold, n, calls, &parts_s));
        row("op, partials left to the GPU", T, n, parts_s);
        continue;
      }
      row("cpu-worker op", T, n, time_calls(cold, n, calls));
    }
  }
  for (int T : {1, 2, 4, 8, 12}) {
    if (T >= threads) break;
    ThreadPool spin(T, kColdSpin);
    CpuColdFfn cold(m, spin);
    const int n = std::min(838, F);
    row("cpu-worker op", T, n, time_calls(cold, n, calls));
  }
  {
    ThreadPool spin(1);
    CpuColdFfn cold(m, spin);
    row("cpu-worker op, 16 neurons in cache", 1, 0, time_calls(cold, 0, 200));
  }
  // The op's fixed costs, each alone on the pool of all threads (medians of 400): the empty loop
  // over one part per thread (a wake-up of the polling threads and the wait for the last),
  // quantizing x for Q8_0 / Q4_0 rows (one thread), and the partial sums' traffic: each thread
  // writes a hidden-sized partial, then every thread adds its column range over all of them.
  {
    ThreadPool spin(threads, kColdSpin);
    const RowKernels* k = BestRowKernels();
    std::vector<float> partial(static_cast<size_t>(threads) * H);
    std::vector<int8_t> q(H);
    std::vector<float> d(H / 32);
    std::vector<int32_t> s8(H / 4);
    auto median_us = [&](const std::function<void()>& fn) {
      std::vector<double> t;
      for (int i = 0; i < 404; ++i) {
        const double t0 = Now();
        fn();
        if (i >= 4) t.push_back(Now() - t0);
      }
      return MedianOf(t) * 1e6;
    };
    const double loop = median_us([&] { spin.ParallelFor(threads, 1, [](int64_t, int64_t) {}); });
    const double quantize =
        median_us([&] { k->quantize_q8x(x.data(), H, q.data(), d.data(), s8.data()); });
    const double sums = median_us([&] {
      spin.ParallelFor(threads, 1, [&](int64_t b, int64_t e) {
        for (int64_t c = b; c < e; ++c) std::fill_n(partial.data() + c * H, H, 1.f + c);
      });
      const int64_t range = (H + threads - 1) / threads;
      spin.ParallelFor(H, range, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          float acc = out[i];
          for (int c = 0; c < threads; ++c) acc += partial[static_cast<size_t>(c) * H + i];
          out[i] = acc;
        }
      });
    });
    std::printf(
        "\nfixed costs per call (%d threads, us): empty loop %.1f, quantize x %.1f, "
        "partials written and summed (two loops) %.1f\n",
        threads, loop, quantize, sums);
  }
  return 0;
}

int Main(int argc, char** argv) {
  BenchOptions o;
  std::string sections = "bandwidths,shapes,pages,coldop";
  auto own = [&](const std::string& a) {
    const char* v = FlagValue(a, "--sections=");
    if (v != nullptr) sections = v;
    return v != nullptr;
  };
  if (!ParseFlags(argc, argv, &o, own)) return 2;
  auto has = [&](const char* name) { return sections.find(name) != std::string::npos; };
  const int threads = o.Threads();
  const DType dtype = o.dtype == "Q4_0"   ? DType::kQ4_0
                      : o.dtype == "Q4_K" ? DType::kQ4_K
                      : o.dtype == "Q6_K" ? DType::kQ6_K
                                          : DType::kF16;
  ThreadPool pool(threads);
  if (has("bandwidths") || has("shapes") || has("pages")) {
    if (OpenDevice(threads)) {
      if (has("bandwidths")) PrintBandwidths("", dtype, threads, MeasureBandwidths(dtype, pool));
      if (has("shapes")) MeasureShapes(dtype, pool);
      if (has("pages")) MeasureColdRows(dtype, o.hidden, o.ffn, threads, pool);
    } else {
      std::printf("no CUDA device: sections bandwidths, shapes and pages skipped\n");
    }
  }
  if (has("coldop")) {
    const double t0 = Now();
    std::unique_ptr<SynthModel> model = BuildModel(o, pool);
    PrintModel(o, *model, Now() - t0);
    return ColdRowsBench(*model, threads);
  }
  return 0;
}

}  // namespace
}  // namespace pinfer::cudabench

int main(int argc, char** argv) { return pinfer::cudabench::Main(argc, argv); }
