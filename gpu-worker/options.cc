// Parsing and checking the gpu-worker's flags (options.h says what each part is for); the usage
// text below is the one place the flags are documented for the command line.
#include "gpu-worker/options.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cli/flags.h"
#include "gpu-worker/backend.h"
#include "shared/util/status_macros.h"

namespace pinfer::gpuworker {

extern const char kUsage[] =
    "usage: pinfer-gpu-worker --model PATH [--listen ADDR] [--port-file FILE] [--segment NAME]\n"
    "         [--metrics-port P] [--metrics-port-file FILE] [--threads N] [--hot-fraction F]\n"
    "         [--max-batch-tokens N] [--max-sequences N] [--max-new-tokens-limit N]\n"
    "         [--exchange-timeout-ms MS] [--exchange-spin-us US] [--liveness-ms MS]\n"
    "         [--backend auto|cpu|cuda]\n"
    "         [--cuda-module PATH] [--gpu-slots N] [--max-context N] [--cuda-device N]\n"
    "         [--placement FILE.gpuidx | --vram-budget SIZE] [--sparse] [--gpu-timing]\n"
    "         [--drain-timeout-ms MS] [--cold-prefill auto|cpu|stream]\n"
    "         [--stream-chunk-rows N] [--stream-slots N] [--adaptive-cache-rows N]\n"
    "         [--adaptive-cache-thread] [--cold-gpu-share auto|off|F] [--decode-lanes N]\n"
    "         [--cold-guess] [--chat-template FILE] [--prefix-cache-entries N]\n"
    "         [--prefix-cache-size SIZE] [--prefix-cache-min-tokens N]\n"
    "  --prefix-cache-entries: finished sequences' KV caches kept so that a prompt starting with\n"
    "               one's tokens (a chat's next turn) computes only the rest (default 8; 0: off);\n"
    "               on the GPU a kept cache holds one of the --gpu-slots until a new sequence\n"
    "               needs it, least recently used first\n"
    "  --prefix-cache-size: the most memory the kept caches hold on the CPU backend (default\n"
    "               1GiB; GPU slots are allocated up front)\n"
    "  --prefix-cache-min-tokens: the shortest shared prefix worth reusing (default 16)\n"
    "  --chat-template: the Jinja chat template the Chat RPC renders messages with, instead of\n"
    "               the model's own (GGUF tokenizer.chat_template, chat_template.jinja or\n"
    "               tokenizer_config.json); a model with neither answers Chat FAILED_PRECONDITION\n"
    "  --listen: host:port (port 0 picks one; see --port-file) or unix:/path\n"
    "  --segment: POSIX shared-memory name for the activation exchange (default: a fresh\n"
    "             unique name, printed in the log); give the cpu-worker the same name\n"
    "  --exchange-spin-us: how long a wait for the cpu-worker's answer to a layer polls the\n"
    "             segment before it sleeps on a futex (default 20)\n"
    "  --gpu-slots / --max-context: KV cache slots and positions per slot on the GPU\n"
    "  --placement: PowerInfer GPU index (FILE.gpuidx) choosing the hot neurons; by default\n"
    "               MODEL.generated.gpuidx when it exists, else --hot-fraction (0.5)\n"
    "  --vram-budget: GPU memory for this worker (bytes or 8MiB, 24GiB): the hot neurons are\n"
    "               the most frequently active ones (profile of a prepared model, else of the\n"
    "               bundled calibration text) that fit beside what the backend holds anyway\n"
    "  --cold-prefill: who computes a prompt batch's cold FFN rows on the CUDA backend: the\n"
    "               cpu-worker (cpu), the GPU streaming them from pinned host memory (stream),\n"
    "               or per layer and batch by a cost model measured at run time (auto, the\n"
    "               default); ignored on the CPU backend\n"
    "  --stream-chunk-rows / --stream-slots: neurons per streamed chunk (1024) and device\n"
    "               buffers for chunks in flight (2); they count against --vram-budget\n"
    "  --adaptive-cache-rows: with --sparse on the CUDA backend, N extra GPU rows per layer\n"
    "               that decoding refills with the cold neurons the current text keeps\n"
    "               activating (the adaptive hot set; 0, the default: static placement only);\n"
    "               they count against --vram-budget\n"
    "  --adaptive-cache-thread: count the activations and plan the cache's swaps on a thread of\n"
    "               their own instead of between decode steps; pays only where the cpu-worker's\n"
    "               threads leave a core free (docs/benchmarks.md, the adaptive hot set)\n"
    "  --cold-gpu-share: with --sparse on the CUDA backend, the share of each layer's active cold\n"
    "               neurons that the GPU computes itself from a pinned host copy over PCIe while\n"
    "               the cpu-worker computes the rest: auto (the default) balances the two sides\n"
    "               step by step, off gives every cold neuron to the cpu-worker, F in (0, 1] fixes "
    "it\n"
    "  --decode-lanes: on the CUDA backend, decode steps of up to N sequences in flight at once\n"
    "               (default 2, at most 8; 1: one at a time), so that one sequence's cold rows on "
    "the\n"
    "               cpu-worker overlap another's GPU work; each lane adds its own scratch on the\n"
    "               GPU (counted in --vram-budget); not with --adaptive-cache-rows\n"
    "  --cold-guess: with --sparse on the CUDA backend, the GPU guesses each decode layer's\n"
    "               active cold neurons ahead of the layer's attention (the layer's predictor on\n"
    "               the previous layer's residual) and posts the guess through the segment, for a\n"
    "               cpu-worker with --prefetch-guess to load their rows meanwhile; it counts how\n"
    "               much of the actual list each guess held "
    "(pinfer_worker_cold_guess_neurons_total)\n";
absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(cli::Flags f, cli::Flags::Parse(args,
                                                   {"model",
                                                    "listen",
                                                    "port-file",
                                                    "segment",
                                                    "metrics-port",
                                                    "metrics-port-file",
                                                    "threads",
                                                    "hot-fraction",
                                                    "max-batch-tokens",
                                                    "max-sequences",
                                                    "max-new-tokens-limit",
                                                    "exchange-timeout-ms",
                                                    "exchange-spin-us",
                                                    "liveness-ms",
                                                    "backend",
                                                    "cuda-module",
                                                    "chat-template",
                                                    "drain-timeout-ms",
                                                    "gpu-slots",
                                                    "max-context",
                                                    "cuda-device",
                                                    "placement",
                                                    "vram-budget",
                                                    "cold-prefill",
                                                    "stream-chunk-rows",
                                                    "stream-slots",
                                                    "adaptive-cache-rows",
                                                    "cold-gpu-share",
                                                    "decode-lanes",
                                                    "prefix-cache-entries",
                                                    "prefix-cache-size",
                                                    "prefix-cache-min-tokens"},
                                                   {"sparse", "gpu-timing", "cold-guess",
                                                    "adaptive-cache-thread"}));
  Options o;
  ASSIGN_OR_RETURN(o.model, f.Required("model"));
  if (auto v = f.Get("listen")) o.listen = *v;
  if (auto v = f.Get("port-file")) o.port_file = *v;
  if (auto v = f.Get("segment")) o.segment = *v;
  if (auto v = f.Get("metrics-port")) o.metrics_port = *v;
  if (auto v = f.Get("metrics-port-file")) o.metrics_port_file = *v;
  if (auto v = f.Get("backend")) o.backend = *v;
  if (auto v = f.Get("cuda-module")) o.cuda_module = *v;
  if (auto v = f.Get("chat-template")) o.chat_template = *v;
  if (auto v = f.Get("placement")) o.placement = *v;
  o.hot_fraction_given = f.Has("hot-fraction");
  if (f.Has("vram-budget")) {
    ASSIGN_OR_RETURN(o.vram_budget, f.Size("vram-budget", 0));
    if (o.vram_budget == 0) return absl::InvalidArgumentError("--vram-budget must be positive");
    if (o.hot_fraction_given || !o.placement.empty()) {
      return absl::InvalidArgumentError(
          "--vram-budget decides the placement: it excludes --placement and --hot-fraction");
    }
  }
  if (o.hot_fraction_given && !o.placement.empty()) {
    return absl::InvalidArgumentError("--placement and --hot-fraction exclude each other");
  }
  ASSIGN_OR_RETURN(int64_t threads, f.Int("threads", 1));
  ASSIGN_OR_RETURN(o.hot_fraction, f.Double("hot-fraction", 0.5));
  ASSIGN_OR_RETURN(int64_t mbt, f.Int("max-batch-tokens", 128));
  ASSIGN_OR_RETURN(int64_t ms, f.Int("max-sequences", 64));
  ASSIGN_OR_RETURN(int64_t mnt, f.Int("max-new-tokens-limit", 4096));
  ASSIGN_OR_RETURN(o.exchange_timeout_ms, f.Int("exchange-timeout-ms", 30000));
  ASSIGN_OR_RETURN(o.liveness_ms, f.Int("liveness-ms", 2000));
  ASSIGN_OR_RETURN(o.exchange_spin_us, f.Int("exchange-spin-us", 20));
  if (o.exchange_spin_us < 0 || o.exchange_spin_us > 1'000'000) {
    return absl::InvalidArgumentError("--exchange-spin-us must be in [0, 1000000]");
  }
  ASSIGN_OR_RETURN(o.drain_timeout_ms, f.Int("drain-timeout-ms", 30000));
  ASSIGN_OR_RETURN(int64_t slots, f.Int("gpu-slots", 8));
  ASSIGN_OR_RETURN(int64_t max_context, f.Int("max-context", 0));
  ASSIGN_OR_RETURN(int64_t device, f.Int("cuda-device", 0));
  if (slots < 1 || slots > 4096) return absl::InvalidArgumentError("--gpu-slots out of range");
  if (max_context < 0 || max_context > (1 << 24)) {
    return absl::InvalidArgumentError("--max-context out of range");
  }
  o.gpu_slots = static_cast<int>(slots);
  o.max_context = static_cast<int>(max_context);
  o.cuda_device = static_cast<int>(device);
  if (threads < 1 || threads > 1024) return absl::InvalidArgumentError("--threads out of range");
  if (!(o.hot_fraction >= 0 && o.hot_fraction <= 1)) {
    return absl::InvalidArgumentError("--hot-fraction must be in [0, 1]");
  }
  if (mbt < 1 || mbt > 65536) return absl::InvalidArgumentError("--max-batch-tokens out of range");
  if (ms < 1 || ms > 100000) return absl::InvalidArgumentError("--max-sequences out of range");
  if (mnt < 1 || mnt > (1 << 24))
    return absl::InvalidArgumentError("--max-new-tokens-limit out of range");
  if (o.exchange_timeout_ms < 1 || o.liveness_ms < 1) {
    return absl::InvalidArgumentError("timeouts must be positive");
  }
  if (o.backend != "auto" && o.backend != "cpu" && o.backend != "cuda") {
    return absl::InvalidArgumentError("--backend must be auto, cpu or cuda");
  }
  o.threads = static_cast<int>(threads);
  o.max_batch_tokens = static_cast<int>(mbt);
  o.max_sequences = static_cast<int>(ms);
  o.max_new_tokens_limit = static_cast<int>(mnt);
  o.sparse = f.Has("sparse");
  o.cold_guess = f.Has("cold-guess");
  if (o.cold_guess && !o.sparse) {
    return absl::InvalidArgumentError(
        "--cold-guess needs --sparse: the guess is made with the predictors");
  }
  o.gpu_timing = f.Has("gpu-timing");
  if (auto v = f.Get("cold-prefill")) {
    ASSIGN_OR_RETURN(o.cold_prefill, ParseColdPrefill(*v));
    o.cold_prefill_given = true;
  }
  ASSIGN_OR_RETURN(int64_t chunk, f.Int("stream-chunk-rows", 1024));
  ASSIGN_OR_RETURN(int64_t stream_slots, f.Int("stream-slots", 2));
  if (chunk < 1 || chunk > (1 << 20)) {
    return absl::InvalidArgumentError("--stream-chunk-rows must be in [1, 1048576]");
  }
  if (stream_slots < 1 || stream_slots > 16) {
    return absl::InvalidArgumentError("--stream-slots must be in [1, 16]");
  }
  o.stream_chunk_rows = static_cast<int>(chunk);
  o.stream_slots = static_cast<int>(stream_slots);
  ASSIGN_OR_RETURN(int64_t cache_rows, f.Int("adaptive-cache-rows", 0));
  if (cache_rows < 0 || cache_rows > (1 << 20)) {
    return absl::InvalidArgumentError("--adaptive-cache-rows must be in [0, 1048576]");
  }
  if (cache_rows > 0 && !o.sparse) {
    return absl::InvalidArgumentError(
        "--adaptive-cache-rows needs --sparse: in exact mode the cpu-worker decides its neurons "
        "with its own gate rows");
  }
  o.adaptive_cache_rows = static_cast<int>(cache_rows);
  o.adaptive_cache_thread = f.Has("adaptive-cache-thread");
  if (o.adaptive_cache_thread && cache_rows == 0) {
    return absl::InvalidArgumentError(
        "--adaptive-cache-thread needs --adaptive-cache-rows: it runs the cache's bookkeeping");
  }
  ASSIGN_OR_RETURN(int64_t lanes, f.Int("decode-lanes", 2));
  if (lanes < 1 || lanes > kMaxDecodeLanes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode-lanes must be in [1, ", kMaxDecodeLanes, "]"));
  }
  o.decode_lanes = static_cast<int>(lanes);
  o.decode_lanes_given = f.Has("decode-lanes");
  ASSIGN_OR_RETURN(int64_t prefix_entries, f.Int("prefix-cache-entries", 8));
  if (prefix_entries < 0 || prefix_entries > 4096) {
    return absl::InvalidArgumentError("--prefix-cache-entries must be in [0, 4096]");
  }
  o.prefix_cache_entries = static_cast<int>(prefix_entries);
  ASSIGN_OR_RETURN(o.prefix_cache_bytes, f.Size("prefix-cache-size", 1ull << 30));
  ASSIGN_OR_RETURN(int64_t prefix_min, f.Int("prefix-cache-min-tokens", 16));
  if (prefix_min < 1 || prefix_min > (1 << 24)) {
    return absl::InvalidArgumentError("--prefix-cache-min-tokens must be positive");
  }
  o.prefix_cache_min_tokens = static_cast<int>(prefix_min);
  if (auto v = f.Get("cold-gpu-share")) {
    double share = 0;
    if (*v == "auto") {
      o.cold_gpu_share_auto = true;
    } else if (*v == "off") {
      o.cold_gpu_share_auto = false;
    } else if (absl::SimpleAtod(*v, &share) && share > 0 && share <= 1) {
      o.cold_gpu_share_auto = false;
      o.cold_gpu_share = share;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--cold-gpu-share must be auto, off or a fraction in (0, 1] (got \"", *v, "\")"));
    }
  }
  return o;
}
}  // namespace pinfer::gpuworker
