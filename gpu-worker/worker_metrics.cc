// The gpu-worker's Prometheus metrics: the counters and histograms the scheduler's hooks feed
// (compute time, exchange waits, neurons computed per side, prompt layers by cold path, adaptive
// cache swaps, cold guesses, decode lanes, tokens, batch sizes, the prefix cache), the gauges
// describing the backend and its VRAM plan, and the gauges computed at scrape time (resident
// memory, peer alive, FFN sparsity). docs/operations.md lists them; this is the one place they are
// registered.
#include "gpu-worker/worker_metrics.h"

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "shared/service/log.h"

namespace pinfer::gpuworker {

SchedulerHooks RegisterWorkerMetrics(const State& s, prometheus::Registry& registry,
                                     metrics::Endpoint* endpoint) {
  const Options& o = s.options;
  auto* compute = &prometheus::BuildCounter()
                       .Name("pinfer_worker_compute_seconds_total")
                       .Help(
                           "Compute time by kind of layer work: ffn (this worker's FFN neurons), "
                           "dense (attention, norms, embeddings, output head)")
                       .Register(registry);
  auto* compute_ffn = &compute->Add({{"kind", "ffn"}});
  auto* compute_dense = &compute->Add({{"kind", "dense"}});
  auto* wait_hist = &prometheus::BuildHistogram()
                         .Name("pinfer_worker_shm_wait_seconds")
                         .Help(
                             "Time waiting for the cpu-worker's share of a layer after the "
                             "hot share was done")
                         .Register(registry)
                         .Add({}, metrics::ShortLatencyBuckets());
  auto* neurons = &prometheus::BuildCounter()
                       .Name("pinfer_worker_neurons_computed_total")
                       .Help("(token, neuron) pairs computed, by side of the split")
                       .Register(registry);
  auto* neurons_gpu = &neurons->Add({{"side", "gpu"}});
  auto* neurons_cpu = &neurons->Add({{"side", "cpu"}});
  auto* candidates = &prometheus::BuildCounter()
                          .Name("pinfer_worker_neuron_candidates_total")
                          .Help("(token, neuron) pairs that could have been computed, by side")
                          .Register(registry);
  auto* cand_gpu = &candidates->Add({{"side", "gpu"}});
  auto* cand_cpu = &candidates->Add({{"side", "cpu"}});
  auto* tokens = &prometheus::BuildCounter()
                      .Name("pinfer_worker_tokens_total")
                      .Help("Tokens sampled by this gpu-worker")
                      .Register(registry)
                      .Add({});
  auto* batch_hist = &prometheus::BuildHistogram()
                          .Name("pinfer_worker_decode_batch_size")
                          .Help("Sequences whose decode steps ran together in one forward pass")
                          .Register(registry)
                          .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64});
  auto* prefill_layers = &prometheus::BuildCounter()
                              .Name("pinfer_worker_prefill_cold_layers_total")
                              .Help(
                                  "Layers of prompt batches by who computed their cold FFN rows: "
                                  "the cpu-worker (cpu) or the GPU streaming them (stream); CUDA "
                                  "backend")
                              .Register(registry);
  auto* prefill_cpu = &prefill_layers->Add({{"path", "cpu"}});
  auto* prefill_stream = &prefill_layers->Add({{"path", "stream"}});
  auto* streamed_bytes = &prometheus::BuildCounter()
                              .Name("pinfer_worker_streamed_cold_bytes_total")
                              .Help("Bytes of cold FFN rows streamed host->GPU for prompt batches")
                              .Register(registry)
                              .Add({});
  auto* cache_swaps = &prometheus::BuildCounter()
                           .Name("pinfer_worker_adaptive_cache_swaps_total")
                           .Help(
                               "Cold neurons moved into the GPU's adaptive cache slots "
                               "(--adaptive-cache-rows; CUDA backend)")
                           .Register(registry)
                           .Add({});
  auto* guess = &prometheus::BuildCounter()
                     .Name("pinfer_worker_cold_guess_neurons_total")
                     .Help(
                         "Decode layers' cold neurons: in the GPU's guesses made ahead of each "
                         "attention (guessed), of those, in their first tiers, loaded first "
                         "(first), in the actual lists of those layers (actual), and of those, in "
                         "the guess (held) (--cold-guess; CUDA backend)")
                     .Register(registry);
  auto* guess_neurons = &guess->Add({{"kind", "guessed"}});
  auto* guess_actual = &guess->Add({{"kind", "actual"}});
  auto* guess_hits = &guess->Add({{"kind", "held"}});
  auto* guess_first = &guess->Add({{"kind", "first"}});
  auto* cold_gpu = &prometheus::BuildCounter()
                        .Name("pinfer_worker_cold_gpu_share_neurons_total")
                        .Help(
                            "(token, neuron) pairs of the decode layers' predicted cold lists that "
                            "the GPU computed itself from pinned host rows over PCIe "
                            "(--cold-gpu-share; CUDA backend); counted in "
                            "pinfer_worker_neurons_computed_total{side=\"gpu\"} too")
                        .Register(registry)
                        .Add({});
  auto* lane_steps = &prometheus::BuildCounter()
                          .Name("pinfer_worker_decode_lane_steps_total")
                          .Help(
                              "Decode steps run on a second or later lane, in flight beside "
                              "another sequence's (--decode-lanes; CUDA backend)")
                          .Register(registry)
                          .Add({});
  auto* prefix_lookups = &prometheus::BuildCounter()
                              .Name("pinfer_worker_prefix_cache_lookups_total")
                              .Help(
                                  "Sequences that found a kept KV cache holding a prefix of their "
                                  "prompt (hit) or did not (miss)")
                              .Register(registry);
  auto* prefix_hits = &prefix_lookups->Add({{"result", "hit"}});
  auto* prefix_misses = &prefix_lookups->Add({{"result", "miss"}});
  auto* prefix_tokens = &prometheus::BuildCounter()
                             .Name("pinfer_worker_prefix_cache_reused_tokens_total")
                             .Help("Prompt tokens whose KV came from the prefix cache")
                             .Register(registry)
                             .Add({});
  auto* prefix_evictions = &prometheus::BuildCounter()
                                .Name("pinfer_worker_prefix_cache_evictions_total")
                                .Help(
                                    "Kept KV caches given up: over the budget, least recently "
                                    "used first, or to free a slot for a new sequence")
                                .Register(registry)
                                .Add({});
  auto* prefix_size = &prometheus::BuildGauge()
                           .Name("pinfer_worker_prefix_cache_size")
                           .Help("The prefix cache's kept KV caches (entries) and their bytes")
                           .Register(registry);
  auto* prefix_entries = &prefix_size->Add({{"unit", "entries"}});
  auto* prefix_bytes = &prefix_size->Add({{"unit", "bytes"}});
  auto* running = &prometheus::BuildGauge()
                       .Name("pinfer_worker_sequences_running")
                       .Help("Sequences in the gpu-worker's schedule")
                       .Register(registry)
                       .Add({});
  prometheus::BuildGauge()
      .Name("pinfer_worker_backend_info")
      .Help("The backend computing this worker's share (value 1)")
      .Register(registry)
      .Add({{"role", "gpu-worker"}, {"backend", s.backend->name()}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("pinfer_worker_gpu_available")
      .Help("1 if the gpu-worker computes on a GPU, 0 if it runs its share on the CPU")
      .Register(registry)
      .Add({})
      .Set(s.backend->name() == "cuda" ? 1 : 0);
  prometheus::BuildGauge()
      .Name("pinfer_worker_ffn_row_bytes")
      .Help("Bytes of FFN rows this worker holds")
      .Register(registry)
      .Add({{"side", "gpu"}})
      .Set(static_cast<double>(s.backend->ffn_bytes()));
  if (s.vram_plan.has_value()) {
    auto* vram = &prometheus::BuildGauge()
                      .Name("pinfer_worker_vram_bytes")
                      .Help(
                          "GPU memory by kind: budget (--vram-budget), planned (the placement's "
                          "byte accounting) and allocated (what the backend holds)")
                      .Register(registry);
    vram->Add({{"kind", "budget"}}).Set(static_cast<double>(o.vram_budget));
    vram->Add({{"kind", "planned"}}).Set(static_cast<double>(s.vram_plan->gpu_bytes()));
    vram->Add({{"kind", "allocated"}}).Set(static_cast<double>(s.backend->device_bytes()));
  }
  auto gauges = std::make_shared<metrics::ScrapeGauges>();
  gauges->Add({"pinfer_worker_resident_bytes",
               "Resident memory of this worker process",
               {{"role", "gpu-worker"}},
               [] { return static_cast<double>(ResidentBytes()); }});
  gauges->Add({"pinfer_worker_peer_alive",
               "1 while the cpu-worker is attached, loaded and its heartbeat is fresh",
               {},
               [ps = &s] { return ps->exchange->PeerReady() ? 1.0 : 0.0; }});
  gauges->Add({"pinfer_worker_ffn_sparsity",
               "Fraction of (token, neuron) pairs skipped because their activation was zero "
               "(exact mode) or predicted zero (sparse mode), over the worker's lifetime",
               {},
               [=] {
                 const double cand = cand_gpu->Value() + cand_cpu->Value();
                 return cand > 0 ? 1.0 - (neurons_gpu->Value() + neurons_cpu->Value()) / cand : 0.0;
               }});
  if (endpoint != nullptr) endpoint->Add(gauges);

  SchedulerHooks hooks;
  hooks.on_stats = [=](const BackendStats& st) {
    compute_ffn->Increment(st.hot_ffn_ns * 1e-9);
    compute_dense->Increment((st.forward_ns > st.hot_ffn_ns + st.exchange_wait_ns
                                  ? st.forward_ns - st.hot_ffn_ns - st.exchange_wait_ns
                                  : 0) *
                             1e-9);
    for (double w : st.wait_samples) wait_hist->Observe(w);
    neurons_gpu->Increment(static_cast<double>(st.hot_neurons));
    neurons_cpu->Increment(static_cast<double>(st.cold_neurons));
    cand_gpu->Increment(static_cast<double>(st.hot_candidates));
    cand_cpu->Increment(static_cast<double>(st.cold_candidates));
    prefill_cpu->Increment(static_cast<double>(st.prefill_cold_layers_cpu));
    prefill_stream->Increment(static_cast<double>(st.prefill_cold_layers_stream));
    streamed_bytes->Increment(st.streamed_bytes);
    cache_swaps->Increment(static_cast<double>(st.cache_swaps));
    lane_steps->Increment(static_cast<double>(st.lane_steps));
    cold_gpu->Increment(static_cast<double>(st.cold_gpu_neurons));
    guess_neurons->Increment(static_cast<double>(st.guess_neurons));
    guess_actual->Increment(static_cast<double>(st.guess_actual));
    guess_hits->Increment(static_cast<double>(st.guess_hits));
    guess_first->Increment(static_cast<double>(st.guess_first));
  };
  hooks.on_running = [=](int n) { running->Set(n); };
  hooks.on_tokens = [=](int n) { tokens->Increment(n); };
  hooks.on_decode_batch = [=](int n) { batch_hist->Observe(n); };
  hooks.on_prefix_lookup = [=](bool hit, int reused) {
    (hit ? prefix_hits : prefix_misses)->Increment();
    prefix_tokens->Increment(reused);
  };
  hooks.on_prefix_cache = [=](int evicted, int entries, uint64_t bytes) {
    prefix_evictions->Increment(evicted);
    prefix_entries->Set(entries);
    prefix_bytes->Set(static_cast<double>(bytes));
  };
  return hooks;
}

}  // namespace pinfer::gpuworker
