// pinfer-gpu-worker: holds the sequences (KV caches, sampling) and computes everything except the
// cold FFN neurons: embeddings, attention, norms, the hot FFN rows and the output head. It creates
// the shared-memory segment that the cpu-worker attaches to, writes the placement into it, and
// serves the internal GpuWorker gRPC service (proto/pinfer/worker/v1/worker.proto) that the
// gateway drives.
//
// Without a usable GPU (no CUDA module, no device) the same role runs on the CPU; the log says so
// and the metric pinfer_worker_gpu_available is 0.
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/flags.h"
#include "gpu-worker/backend.h"
#include "gpu-worker/scheduler.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "pinfer/worker/v1/worker.grpc.pb.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "shared/engine/ops.h"
#include "shared/metrics/metrics.h"
#include "shared/model/model.h"
#include "shared/service/ffn_split.h"
#include "shared/service/grpc_convert.h"
#include "shared/service/log.h"
#include "shared/service/service_model.h"
#include "shared/shm/activation_channel.h"
#include "shared/sparse/auto_prepare.h"
#include "shared/sparse/placement.h"
#include "shared/sparse/prepared_model.h"
#include "shared/sparse/profiler.h"
#include "shared/util/status_macros.h"
#include "shared/util/thread_pool.h"

namespace pinfer::gpuworker {
namespace {

namespace wv1 = ::pinfer::worker::v1;

constexpr char kUsage[] =
    "usage: pinfer-gpu-worker --model PATH [--listen ADDR] [--port-file FILE] [--segment NAME]\n"
    "         [--metrics-port P] [--metrics-port-file FILE] [--threads N] [--hot-fraction F]\n"
    "         [--max-batch-tokens N] [--max-sequences N] [--max-new-tokens-limit N]\n"
    "         [--exchange-timeout-ms MS] [--liveness-ms MS] [--backend auto|cpu|cuda]\n"
    "         [--cuda-module PATH] [--gpu-slots N] [--max-context N] [--cuda-device N]\n"
    "         [--placement FILE.gpuidx | --vram-budget SIZE] [--sparse] [--gpu-timing]\n"
    "         [--drain-timeout-ms MS] [--cold-prefill auto|cpu|stream]\n"
    "         [--stream-chunk-rows N] [--stream-slots N] [--adaptive-cache-rows N]\n"
    "         [--adaptive-cache-thread] [--cold-gpu-share auto|off|F] [--decode-lanes N]\n"
    "         [--cold-guess]\n"
    "  --listen: host:port (port 0 picks one; see --port-file) or unix:/path\n"
    "  --segment: POSIX shared-memory name for the activation exchange (default: a fresh\n"
    "             unique name, printed in the log); give the cpu-worker the same name\n"
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

struct Options {
  std::string model, listen = "127.0.0.1:0", port_file, segment, metrics_port, metrics_port_file;
  std::string backend = "auto", cuda_module, placement;
  uint64_t vram_budget = 0;  // 0: not given
  bool hot_fraction_given = false;
  int threads = 1;
  double hot_fraction = 0.5;
  int max_batch_tokens = 128;
  int max_sequences = 64;
  int max_new_tokens_limit = 4096;
  int gpu_slots = 8, max_context = 0, cuda_device = 0;
  int64_t exchange_timeout_ms = 30000, liveness_ms = 2000, drain_timeout_ms = 30000;
  bool sparse = false;
  bool gpu_timing = false;
  ColdPrefill cold_prefill = ColdPrefill::kAuto;
  bool cold_prefill_given = false;
  int stream_chunk_rows = 1024, stream_slots = 2;
  int adaptive_cache_rows = 0;
  double cold_gpu_share = 0;
  bool cold_gpu_share_auto = true;
  int decode_lanes = 2;
  bool decode_lanes_given = false;
  bool cold_guess = false;
  bool adaptive_cache_thread = false;
};

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
                                                    "liveness-ms",
                                                    "backend",
                                                    "cuda-module",
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
                                                    "decode-lanes"},
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

// Decides whether a GPU can be used. The CUDA backend lives in a module loaded with dlopen
// (gpu-worker/cuda); when it or a device is missing the worker computes on the CPU.
struct GpuProbe {
  bool available = false;
  std::string reason;
  std::string module;
};

GpuProbe ProbeGpu(const Options& o) {
  GpuProbe p;
  if (o.backend == "cpu") {
    p.reason = "--backend cpu";
    return p;
  }
  std::vector<std::string> candidates;
  if (!o.cuda_module.empty()) candidates.push_back(o.cuda_module);
  if (const char* env = std::getenv("PINFER_CUDA_MODULE")) candidates.push_back(env);
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len > 0) {
    std::string dir(self, len);
    dir = dir.substr(0, dir.rfind('/'));
    candidates.push_back(dir + "/libpinfer_cuda.so");
    candidates.push_back(dir + "/../gpu-worker/cuda/libpinfer_cuda.so");
  }
  candidates.push_back("libpinfer_cuda.so");
  std::string errors;
  for (const std::string& path : candidates) {
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", ::dlerror());
      continue;
    }
    using CountFn = int (*)();
    auto count = reinterpret_cast<CountFn>(::dlsym(h, "pinfer_cuda_device_count"));
    const int n = count != nullptr ? count() : 0;
    if (n > 0) {
      p.available = true;
      p.module = path;
      p.reason = absl::StrCat(n, " CUDA device(s) via ", path);
    } else {
      p.reason = absl::StrCat(path, " loaded but reports no CUDA device");
    }
    ::dlclose(h);
    return p;
  }
  p.reason = absl::StrCat("no CUDA module could be loaded (", errors, ")");
  return p;
}

std::string ActivationLabel(Activation a) {
  switch (a) {
    case Activation::kRelu:
      return "relu";
    case Activation::kSilu:
      return "silu";
    case Activation::kDRelu:
      return "drelu";
  }
  return "?";
}

// Everything the worker serves, built at start-up.
struct State {
  Options options;
  ServiceModel service_model;
  Model* model = nullptr;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<CpuOps> ops;
  std::unique_ptr<shm::ExchangeClient> exchange;
  std::unique_ptr<ComputeBackend> backend;
  std::unique_ptr<Scheduler> scheduler;
  Placement placement;
  GpuProbe gpu;
  uint64_t cold_bytes_estimate = 0;
  std::optional<PlacementPlan> vram_plan;        // with --vram-budget
  ColdPrefill cold_prefill = ColdPrefill::kCpu;  // in effect on the CUDA backend
};

v1::ModelInfo BuildModelInfo(const State& s) {
  const ModelConfig& c = s.model->config;
  v1::ModelInfo info;
  info.set_architecture(c.architecture);
  info.set_model_path(s.model->source_path);
  info.set_context_length(c.max_context);
  info.set_vocab_size(c.vocab_size);
  info.set_hidden_size(c.hidden_size);
  info.set_num_layers(c.n_layers);
  info.set_ffn_size(c.ffn_size);
  info.set_activation(ActivationLabel(c.activation));
  info.set_weight_dtype(std::string(DTypeName(s.model->layers[0].gate.dtype)));
  info.set_max_new_tokens_limit(s.options.max_new_tokens_limit);
  info.set_bos_id(c.bos_id);
  info.set_eos_id(c.eos_id);
  v1::PlacementSummary* p = info.mutable_placement();
  const uint64_t total = static_cast<uint64_t>(c.n_layers) * c.ffn_size;
  p->set_gpu_neurons(s.backend->ffn_neurons());
  p->set_cpu_neurons(total - s.backend->ffn_neurons());
  p->set_gpu_bytes(s.backend->ffn_bytes());
  p->set_cpu_bytes(s.cold_bytes_estimate);
  p->set_gpu_dense_bytes(s.backend->dense_bytes());
  p->set_gpu_backend(s.backend->name());
  p->set_mode(s.options.sparse ? "sparse" : "exact");
  return info;
}

class GpuWorkerService final : public wv1::GpuWorker::Service {
 public:
  explicit GpuWorkerService(State* s) : s_(s) {}

  grpc::Status Load(grpc::ServerContext*, const wv1::LoadRequest* req,
                    wv1::LoadResponse* resp) override {
    if (!req->model_path().empty() && req->model_path() != s_->options.model) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("this gpu-worker serves ", s_->options.model,
                                       "; start another worker for ", req->model_path()));
    }
    FillInfo(resp->mutable_info());
    return grpc::Status::OK;
  }

  grpc::Status GetInfo(grpc::ServerContext*, const wv1::InfoRequest*,
                       wv1::WorkerInfo* info) override {
    FillInfo(info);
    return grpc::Status::OK;
  }

  grpc::Status Check(grpc::ServerContext*, const wv1::CheckRequest*,
                     wv1::CheckResponse* resp) override {
    const std::string problem = s_->exchange->PeerProblem();
    resp->set_peer_alive(problem.empty());
    resp->set_state(CurrentState());
    resp->set_running_sequences(s_->scheduler->running());
    resp->set_message(problem);
    return grpc::Status::OK;
  }

  grpc::Status Run(grpc::ServerContext* ctx, const wv1::RunRequest* req,
                   grpc::ServerWriter<wv1::RunEvent>* writer) override {
    SequenceOptions opts;
    const ModelConfig& c = s_->model->config;
    if (req->has_token_ids()) {
      opts.prompt.assign(req->token_ids().ids().begin(), req->token_ids().ids().end());
    } else {
      if (req->prompt().empty()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty prompt");
      }
      auto ids = s_->model->tokenizer->Encode(req->prompt());
      if (!ids.ok()) return ToGrpcStatus(ids.status());
      if (c.add_bos) opts.prompt.push_back(c.bos_id);
      opts.prompt.insert(opts.prompt.end(), ids->begin(), ids->end());
    }
    opts.gen.max_new_tokens = static_cast<int>(
        std::min<uint32_t>(req->max_new_tokens(), static_cast<uint32_t>(INT32_MAX)));
    opts.gen.sampling = SamplingFromProto(req->sampling());
    opts.gen.stop.assign(req->stop().begin(), req->stop().end());
    opts.gen.stop_at_eos = !req->ignore_eos();
    opts.request_id = req->request_id();
    const auto deadline = ctx->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      opts.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         deadline - std::chrono::system_clock::now());
    }
    auto seq = s_->scheduler->Submit(std::move(opts));
    if (!seq.ok()) return ToGrpcStatus(seq.status());
    std::vector<SequenceEvent> events;
    for (;;) {
      events.clear();
      if (!(*seq)->WaitEvents(&events, std::chrono::milliseconds(50))) {
        if (ctx->IsCancelled()) {
          (*seq)->Cancel();
          return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller");
        }
        continue;
      }
      wv1::RunEvent out;
      bool final = false;
      for (SequenceEvent& e : events) {
        if (!e.status.ok()) return ToGrpcStatus(e.status);
        for (const GeneratedToken& t : e.tokens) {
          v1::Token* pt = out.add_tokens();
          pt->set_id(static_cast<uint32_t>(t.id));
          pt->set_text(t.text);
          pt->set_logprob(t.logprob);
        }
        if (e.prefill_seconds >= 0) out.set_prefill_seconds(e.prefill_seconds);
        out.set_prompt_tokens(e.prompt_tokens);
        out.set_generated_tokens(e.generated_tokens);
        if (e.final) {
          final = true;
          out.set_finish_reason(FinishReasonToProto(e.finish));
        }
      }
      if (!writer->Write(out)) {
        (*seq)->Cancel();
        return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
      }
      if (final) return grpc::Status::OK;
    }
  }

  grpc::Status Cancel(grpc::ServerContext*, const wv1::CancelRequest* req,
                      wv1::CancelResponse* resp) override {
    resp->set_found(s_->scheduler->CancelById(req->request_id()));
    return grpc::Status::OK;
  }

  grpc::Status Drain(grpc::ServerContext*, const wv1::DrainRequest*,
                     wv1::DrainResponse* resp) override {
    s_->scheduler->Drain();
    resp->set_running_sequences(s_->scheduler->running());
    return grpc::Status::OK;
  }

  grpc::Status Tokenize(grpc::ServerContext*, const v1::TokenizeRequest* req,
                        v1::TokenizeResponse* resp) override {
    const ModelConfig& c = s_->model->config;
    auto ids = s_->model->tokenizer->Encode(req->text());
    if (!ids.ok()) return ToGrpcStatus(ids.status());
    if (req->add_bos() && c.add_bos) {
      resp->add_ids(c.bos_id);
      resp->add_pieces(s_->model->tokenizer->TokenBytes(c.bos_id));
    }
    for (int32_t id : *ids) {
      resp->add_ids(static_cast<uint32_t>(id));
      resp->add_pieces(s_->model->tokenizer->TokenBytes(id));
    }
    return grpc::Status::OK;
  }

  grpc::Status Detokenize(grpc::ServerContext*, const v1::DetokenizeRequest* req,
                          v1::DetokenizeResponse* resp) override {
    std::vector<int32_t> ids;
    for (uint32_t id : req->ids()) {
      if (id >= static_cast<uint32_t>(s_->model->config.vocab_size)) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("token id ", id, " is outside the vocabulary"));
      }
      ids.push_back(static_cast<int32_t>(id));
    }
    resp->set_text(s_->model->tokenizer->Decode(ids));
    return grpc::Status::OK;
  }

 private:
  wv1::WorkerState CurrentState() const {
    if (s_->scheduler->draining()) return wv1::WORKER_STATE_DRAINING;
    if (!s_->exchange->PeerReady()) return wv1::WORKER_STATE_WAITING_FOR_PEER;
    return wv1::WORKER_STATE_READY;
  }

  void FillInfo(wv1::WorkerInfo* info) {
    info->set_role("gpu-worker");
    info->set_state(CurrentState());
    info->set_segment(s_->exchange->segment().name());
    *info->mutable_model() = BuildModelInfo(*s_);
    info->set_resident_bytes(ResidentBytes());
    info->set_ffn_row_bytes(s_->backend->ffn_bytes());
    info->set_ffn_neurons(s_->backend->ffn_neurons());
    info->set_backend(s_->backend->name());
    info->set_pid(static_cast<uint32_t>(::getpid()));
  }

  State* s_;
};

std::string MiB(uint64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

CudaBackendOptions CudaOptions(const State& s) {
  CudaBackendOptions cbo;
  cbo.slots = s.options.gpu_slots;
  cbo.max_ctx = s.model->config.max_context;
  cbo.device = s.options.cuda_device;
  cbo.gpu_timing = s.options.gpu_timing;
  if (s.options.sparse) cbo.predictors = s.service_model.predictors();
  cbo.cold_prefill = s.cold_prefill;
  cbo.stream_chunk_rows = s.options.stream_chunk_rows;
  cbo.stream_slots = s.options.stream_slots;
  cbo.adaptive_cache_rows = s.options.adaptive_cache_rows;
  cbo.cache_background = s.options.adaptive_cache_thread;
  cbo.cold_gpu_share = s.options.cold_gpu_share;
  cbo.cold_gpu_share_auto = s.options.cold_gpu_share_auto;
  cbo.decode_lanes = s.options.decode_lanes;
  cbo.cold_guess = s.options.cold_guess;
  return cbo;
}

// The placement for --vram-budget: the activation profile of a prepared model, else one measured
// now on the bundled calibration text; with a GPU, the CUDA module's own footprint (measured by
// creating it once without FFN rows) replaces the generic byte formulas, so that the plan is what
// this process allocates. Without a GPU the generic accounting decides which neurons the CPU
// backend computes here, as they would be on a GPU of that size.
absl::StatusOr<PlacementPlan> PlanForBudget(const State& s) {
  const Options& o = s.options;
  const Model& model = *s.model;
  ActivationProfile profile;
  if (s.service_model.prepared != nullptr &&
      !s.service_model.prepared->activation_frequency.empty()) {
    ASSIGN_OR_RETURN(profile, StoredProfile(*s.service_model.prepared));
    Log("placement from the prepared model's activation profile (%lld tokens)",
        static_cast<long long>(profile.tokens));
  } else {
    ASSIGN_OR_RETURN(std::vector<int32_t> tokens,
                     TokenizeCalibrationText(model, BundledCalibrationText()));
    ProfileOptions po;
    po.window = std::min(512, model.config.max_context);
    po.keep_inputs = false;
    po.max_tokens = 16384;  // plenty for a frequency ranking, bounded start-up time
    if (const char* env = std::getenv("PINFER_AUTO_PREPARE_MAX_TOKENS")) {
      po.max_tokens = std::max(1, std::atoi(env));
    }
    Log("profiling up to %lld tokens of the bundled calibration text for the placement (prepare "
        "the model with `pinfer prepare` to skip this)",
        static_cast<long long>(std::min<int64_t>(po.max_tokens, tokens.size())));
    ASSIGN_OR_RETURN(ProfileResult r, ProfileActivations(model, *s.ops, tokens, po));
    profile = std::move(r.profile);
  }
  PlacementOptions po;
  po.vram_budget = o.vram_budget;
  po.context = model.config.max_context * o.gpu_slots;
  po.max_batch = o.max_batch_tokens;
  if (s.gpu.available) {
    ASSIGN_OR_RETURN(CudaFootprint f,
                     MeasureCudaFootprint(model, o.max_batch_tokens, s.gpu.module, CudaOptions(s)));
    Log("the CUDA backend holds %s before any FFN row", MiB(f.fixed_bytes).c_str());
    po.measured_fixed_bytes = f.fixed_bytes;
    po.backend_neuron_bytes = std::move(f.neuron_bytes);
    po.cache_bytes = AdaptiveCacheBytes(model, o.adaptive_cache_rows);
  }
  return PlanPlacement(model, profile, s.options.sparse ? s.service_model.predictors() : nullptr,
                       po);
}

int Main(const std::vector<std::string>& args) {
  SetLogRole("gpu-worker");
  InstallShutdownHandlers();
  auto parsed = ParseOptions(args);
  if (!parsed.ok()) {
    std::fprintf(stderr, "pinfer-gpu-worker: %s\n%s",
                 std::string(parsed.status().message()).c_str(), kUsage);
    return 2;
  }
  State s;
  s.options = *parsed;
  const Options& o = s.options;

  auto registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<metrics::Endpoint> endpoint;
  if (!o.metrics_port.empty()) {
    endpoint = metrics::Endpoint::Start(o.metrics_port, registry);
    if (endpoint != nullptr) {
      Log("metrics on port %d", endpoint->port());
      if (!o.metrics_port_file.empty()) {
        (void)WriteFileAtomically(o.metrics_port_file, absl::StrCat(endpoint->port(), "\n"));
      }
    }
  }

  auto model = LoadServiceModel(o.model);
  if (!model.ok()) {
    Log("cannot load %s: %s", o.model.c_str(), model.status().ToString().c_str());
    return 1;
  }
  s.service_model = std::move(*model);
  s.model = &s.service_model.mutable_model();
  if (o.sparse && s.service_model.predictors() == nullptr) {
    Log("--sparse needs a prepared model with predictors (pinfer prepare --model %s ..., then "
        "serve the prepared file; pinfer serve --sparse prepares it automatically)",
        o.model.c_str());
    return 2;
  }
  const ModelConfig& c = s.model->config;
  if (s.model->tokenizer == nullptr) {
    Log("%s has no tokenizer", o.model.c_str());
    return 1;
  }
  s.gpu = ProbeGpu(o);
  if (o.backend == "cuda" && !s.gpu.available) {
    Log("--backend cuda but no usable GPU: %s", s.gpu.reason.c_str());
    return 1;
  }
  if (o.max_context > 0) s.model->config.max_context = std::min(c.max_context, o.max_context);
  // Streamed cold rows for prompt batches (CUDA only; decided before the VRAM plan, which counts
  // the stream's device buffers).
  s.cold_prefill = o.cold_prefill;
  if (s.gpu.available && s.cold_prefill != ColdPrefill::kCpu) {
    const std::string problem = ColdStreamingProblem(*s.model);
    if (!problem.empty()) {
      if (o.cold_prefill_given && o.cold_prefill == ColdPrefill::kStream) {
        Log("--cold-prefill stream: cannot stream this model's cold rows: %s", problem.c_str());
        return 1;
      }
      Log("cold prefill: the cpu-worker computes every cold row (%s)", problem.c_str());
      s.cold_prefill = ColdPrefill::kCpu;
    }
  }

  // Placement: a PowerInfer GPU index (given, or beside the model as `pinfer prepare` and
  // PowerInfer write it), else a fixed fraction of every layer.
  std::string index_path = o.placement;
  if (index_path.empty() && !o.hot_fraction_given && o.vram_budget == 0) {
    const std::string beside = GpuIndexPath(o.model);
    if (::access(beside.c_str(), R_OK) == 0) index_path = beside;
  }
  s.pool = std::make_unique<ThreadPool>(o.threads);
  s.ops = NewSimdOps(s.pool.get());
  if (o.vram_budget > 0) {
    absl::StatusOr<PlacementPlan> plan = PlanForBudget(s);
    if (!plan.ok()) {
      Log("cannot place the model in a VRAM budget of %s: %s", MiB(o.vram_budget).c_str(),
          plan.status().ToString().c_str());
      return 1;
    }
    s.vram_plan = std::move(*plan);
    s.placement.hot = s.vram_plan->hot;
    for (absl::string_view line : absl::StrSplit(s.vram_plan->Summary(), '\n')) {
      if (!line.empty()) Log("placement: %s", std::string(line).c_str());
    }
  } else if (!index_path.empty()) {
    auto index = ReadGpuIndex(index_path, c.n_layers, c.ffn_size);
    if (!index.ok()) {
      Log("cannot use the placement %s: %s", index_path.c_str(), index.status().ToString().c_str());
      return 1;
    }
    s.placement.hot = index->gpu_bucket;
    Log("placement from %s", index_path.c_str());
  } else {
    s.placement = Placement::FixedFraction(c, o.hot_fraction);
  }
  shm::Geometry g;
  g.n_layers = c.n_layers;
  g.hidden = c.hidden_size;
  g.ffn = c.ffn_size;
  g.max_tokens = o.max_batch_tokens;
  g.fingerprint = ModelFingerprint(*s.model, s.service_model.down_t());
  const std::string segment_name = o.segment.empty() ? shm::UniqueSegmentName() : o.segment;
  auto segment = shm::Segment::Create(segment_name, g);
  if (!segment.ok()) {
    Log("cannot create the activation segment: %s", segment.status().ToString().c_str());
    return 1;
  }
  for (int l = 0; l < c.n_layers; ++l) {
    s.placement.ToBitmap(l, c.ffn_size, (*segment)->hot_bitmap(l));
  }
  shm::ChannelOptions co;
  co.exchange_timeout_ns = o.exchange_timeout_ms * 1'000'000;
  co.liveness_ns = o.liveness_ms * 1'000'000;
  s.exchange = std::make_unique<shm::ExchangeClient>(std::move(*segment), co);
  Log("activation segment %s (%zu bytes, up to %d tokens per exchange)", segment_name.c_str(),
      s.exchange->segment().size(), o.max_batch_tokens);

  if (s.gpu.available) {
    auto cuda =
        NewCudaBackend(*s.model, s.placement, s.exchange.get(), s.gpu.module, CudaOptions(s));
    if (cuda.ok()) {
      s.backend = std::move(*cuda);
      Log("computing the gpu-worker's share on the GPU (%s)", s.gpu.reason.c_str());
    } else if (o.backend == "cuda") {
      Log("cannot start the CUDA backend: %s", cuda.status().ToString().c_str());
      return 1;
    } else {
      s.gpu.available = false;
      s.gpu.reason = absl::StrCat("the CUDA backend failed: ", cuda.status().ToString());
    }
  }
  if (s.backend == nullptr) {
    Log("no usable GPU (%s): computing the gpu-worker's share on the CPU with %d thread(s)",
        s.gpu.reason.c_str(), o.threads);
    if (o.cold_prefill_given) {
      Log("--cold-prefill %s ignored: the CPU backend sends every cold row to the cpu-worker",
          ColdPrefillName(o.cold_prefill));
    }
    if (o.adaptive_cache_rows > 0) {
      Log("--adaptive-cache-rows %d ignored: the CPU backend has no device memory to cache in",
          o.adaptive_cache_rows);
    }
    if (o.decode_lanes_given) {
      Log("--decode-lanes %d ignored: the CPU backend computes a decode batch in one pass",
          o.decode_lanes);
    }
    auto backend =
        NewCpuBackend(*s.model, *s.ops, s.placement, s.exchange.get(), s.service_model.down_t(),
                      o.sparse ? s.service_model.predictors() : nullptr);
    if (!backend.ok()) {
      Log("cannot build the backend: %s", backend.status().ToString().c_str());
      return 1;
    }
    s.backend = std::move(*backend);
  }
  if (s.vram_plan.has_value() && s.backend->device_bytes() > 0) {
    const double plan = static_cast<double>(s.vram_plan->gpu_bytes());
    const double actual = static_cast<double>(s.backend->device_bytes());
    Log("VRAM: planned %s, allocated %s (%+.2f%%)%s", MiB(s.vram_plan->gpu_bytes()).c_str(),
        MiB(s.backend->device_bytes()).c_str(), 100 * (actual / plan - 1),
        std::abs(actual / plan - 1) > 0.05 ? ": more than 5% off the plan" : "");
  }
  // Building the hot rows read the whole down matrices; drop those pages, what we use comes back.
  DropRebuiltDown(&s.service_model);
  ReleaseMappedPages(*s.model);
  {
    const uint64_t total = static_cast<uint64_t>(c.n_layers) * c.ffn_size;
    const uint64_t per_neuron = s.backend->ffn_neurons() > 0
                                    ? s.backend->ffn_bytes() / s.backend->ffn_neurons()
                                    : 3 * RowBytes(s.model->layers[0].gate.dtype, c.hidden_size);
    s.cold_bytes_estimate = (total - s.backend->ffn_neurons()) * per_neuron;
  }
  Log("placement: %zu of %zu FFN neurons hot (%.1f MiB of rows here), %s mode",
      static_cast<size_t>(s.backend->ffn_neurons()), static_cast<size_t>(c.n_layers) * c.ffn_size,
      s.backend->ffn_bytes() / 1048576.0, o.sparse ? "sparse (predictors)" : "exact");

  // Metrics.
  auto& compute = prometheus::BuildCounter()
                      .Name("pinfer_worker_compute_seconds_total")
                      .Help(
                          "Compute time by kind of layer work: ffn (this worker's FFN neurons), "
                          "dense (attention, norms, embeddings, output head)")
                      .Register(*registry);
  auto& compute_ffn = compute.Add({{"kind", "ffn"}});
  auto& compute_dense = compute.Add({{"kind", "dense"}});
  auto& wait_hist = prometheus::BuildHistogram()
                        .Name("pinfer_worker_shm_wait_seconds")
                        .Help(
                            "Time waiting for the cpu-worker's share of a layer after the "
                            "hot share was done")
                        .Register(*registry)
                        .Add({}, metrics::ShortLatencyBuckets());
  auto& neurons = prometheus::BuildCounter()
                      .Name("pinfer_worker_neurons_computed_total")
                      .Help("(token, neuron) pairs computed, by side of the split")
                      .Register(*registry);
  auto& neurons_gpu = neurons.Add({{"side", "gpu"}});
  auto& neurons_cpu = neurons.Add({{"side", "cpu"}});
  auto& candidates = prometheus::BuildCounter()
                         .Name("pinfer_worker_neuron_candidates_total")
                         .Help("(token, neuron) pairs that could have been computed, by side")
                         .Register(*registry);
  auto& cand_gpu = candidates.Add({{"side", "gpu"}});
  auto& cand_cpu = candidates.Add({{"side", "cpu"}});
  auto& tokens = prometheus::BuildCounter()
                     .Name("pinfer_worker_tokens_total")
                     .Help("Tokens sampled by this gpu-worker")
                     .Register(*registry)
                     .Add({});
  auto& batch_hist = prometheus::BuildHistogram()
                         .Name("pinfer_worker_decode_batch_size")
                         .Help("Sequences whose decode steps ran together in one forward pass")
                         .Register(*registry)
                         .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64});
  auto& prefill_layers = prometheus::BuildCounter()
                             .Name("pinfer_worker_prefill_cold_layers_total")
                             .Help(
                                 "Layers of prompt batches by who computed their cold FFN rows: "
                                 "the cpu-worker (cpu) or the GPU streaming them (stream); CUDA "
                                 "backend")
                             .Register(*registry);
  auto& prefill_cpu = prefill_layers.Add({{"path", "cpu"}});
  auto& prefill_stream = prefill_layers.Add({{"path", "stream"}});
  auto& streamed_bytes = prometheus::BuildCounter()
                             .Name("pinfer_worker_streamed_cold_bytes_total")
                             .Help("Bytes of cold FFN rows streamed host->GPU for prompt batches")
                             .Register(*registry)
                             .Add({});
  auto& cache_swaps = prometheus::BuildCounter()
                          .Name("pinfer_worker_adaptive_cache_swaps_total")
                          .Help(
                              "Cold neurons moved into the GPU's adaptive cache slots "
                              "(--adaptive-cache-rows; CUDA backend)")
                          .Register(*registry)
                          .Add({});
  auto& guess = prometheus::BuildCounter()
                    .Name("pinfer_worker_cold_guess_neurons_total")
                    .Help(
                        "Decode layers' cold neurons: in the GPU's guesses made ahead of each "
                        "attention (guessed), of those, in their first tiers, loaded first "
                        "(first), in the actual lists of those layers (actual), and of those, in "
                        "the guess (held) (--cold-guess; CUDA backend)")
                    .Register(*registry);
  auto& guess_neurons = guess.Add({{"kind", "guessed"}});
  auto& guess_actual = guess.Add({{"kind", "actual"}});
  auto& guess_hits = guess.Add({{"kind", "held"}});
  auto& guess_first = guess.Add({{"kind", "first"}});
  auto& lane_steps = prometheus::BuildCounter()
                         .Name("pinfer_worker_decode_lane_steps_total")
                         .Help(
                             "Decode steps run on a second or later lane, in flight beside "
                             "another sequence's (--decode-lanes; CUDA backend)")
                         .Register(*registry)
                         .Add({});
  auto& running = prometheus::BuildGauge()
                      .Name("pinfer_worker_sequences_running")
                      .Help("Sequences in the gpu-worker's schedule")
                      .Register(*registry)
                      .Add({});
  prometheus::BuildGauge()
      .Name("pinfer_worker_backend_info")
      .Help("The backend computing this worker's share (value 1)")
      .Register(*registry)
      .Add({{"role", "gpu-worker"}, {"backend", s.backend->name()}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("pinfer_worker_gpu_available")
      .Help("1 if the gpu-worker computes on a GPU, 0 if it runs its share on the CPU")
      .Register(*registry)
      .Add({})
      .Set(s.backend->name() == "cuda" ? 1 : 0);
  prometheus::BuildGauge()
      .Name("pinfer_worker_ffn_row_bytes")
      .Help("Bytes of FFN rows this worker holds")
      .Register(*registry)
      .Add({{"side", "gpu"}})
      .Set(static_cast<double>(s.backend->ffn_bytes()));
  if (s.vram_plan.has_value()) {
    auto& vram = prometheus::BuildGauge()
                     .Name("pinfer_worker_vram_bytes")
                     .Help(
                         "GPU memory by kind: budget (--vram-budget), planned (the placement's "
                         "byte accounting) and allocated (what the backend holds)")
                     .Register(*registry);
    vram.Add({{"kind", "budget"}}).Set(static_cast<double>(o.vram_budget));
    vram.Add({{"kind", "planned"}}).Set(static_cast<double>(s.vram_plan->gpu_bytes()));
    vram.Add({{"kind", "allocated"}}).Set(static_cast<double>(s.backend->device_bytes()));
  }
  auto gauges = std::make_shared<metrics::ScrapeGauges>();
  gauges->Add({"pinfer_worker_resident_bytes",
               "Resident memory of this worker process",
               {{"role", "gpu-worker"}},
               [] { return static_cast<double>(ResidentBytes()); }});
  gauges->Add({"pinfer_worker_peer_alive",
               "1 while the cpu-worker is attached, loaded and its heartbeat is fresh",
               {},
               [&s] { return s.exchange->PeerReady() ? 1.0 : 0.0; }});
  gauges->Add({"pinfer_worker_ffn_sparsity",
               "Fraction of (token, neuron) pairs skipped because their activation was zero "
               "(exact mode) or predicted zero (sparse mode), over the worker's lifetime",
               {},
               [&] {
                 const double cand = cand_gpu.Value() + cand_cpu.Value();
                 return cand > 0 ? 1.0 - (neurons_gpu.Value() + neurons_cpu.Value()) / cand : 0.0;
               }});
  if (endpoint != nullptr) endpoint->Add(gauges);

  SchedulerOptions so;
  so.max_sequences = o.max_sequences;
  so.prefill_chunk = o.max_batch_tokens;
  so.max_new_tokens_limit = o.max_new_tokens_limit;
  SchedulerHooks hooks;
  hooks.on_stats = [&](const BackendStats& st) {
    compute_ffn.Increment(st.hot_ffn_ns * 1e-9);
    compute_dense.Increment((st.forward_ns > st.hot_ffn_ns + st.exchange_wait_ns
                                 ? st.forward_ns - st.hot_ffn_ns - st.exchange_wait_ns
                                 : 0) *
                            1e-9);
    for (double w : st.wait_samples) wait_hist.Observe(w);
    neurons_gpu.Increment(static_cast<double>(st.hot_neurons));
    neurons_cpu.Increment(static_cast<double>(st.cold_neurons));
    cand_gpu.Increment(static_cast<double>(st.hot_candidates));
    cand_cpu.Increment(static_cast<double>(st.cold_candidates));
    prefill_cpu.Increment(static_cast<double>(st.prefill_cold_layers_cpu));
    prefill_stream.Increment(static_cast<double>(st.prefill_cold_layers_stream));
    streamed_bytes.Increment(st.streamed_bytes);
    cache_swaps.Increment(static_cast<double>(st.cache_swaps));
    lane_steps.Increment(static_cast<double>(st.lane_steps));
    guess_neurons.Increment(static_cast<double>(st.guess_neurons));
    guess_actual.Increment(static_cast<double>(st.guess_actual));
    guess_hits.Increment(static_cast<double>(st.guess_hits));
    guess_first.Increment(static_cast<double>(st.guess_first));
  };
  hooks.on_running = [&](int n) { running.Set(n); };
  hooks.on_tokens = [&](int n) { tokens.Increment(n); };
  hooks.on_decode_batch = [&](int n) { batch_hist.Observe(n); };
  s.scheduler = std::make_unique<Scheduler>(
      s.backend.get(), *s.model, so, [&s] { return s.exchange->PeerProblem(); }, hooks);

  GpuWorkerService service(&s);
  // The standard health service too, for container healthchecks and Kubernetes gRPC probes:
  // SERVING while the worker can take sequences (its cpu-worker attached and alive).
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(o.listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    Log("cannot listen on %s", o.listen.c_str());
    return 1;
  }
  Log("serving pinfer.worker.v1.GpuWorker on %s (port %d)", o.listen.c_str(), port);
  if (!o.port_file.empty()) {
    if (absl::Status st = WriteFileAtomically(o.port_file, absl::StrCat(port, "\n")); !st.ok()) {
      Log("%s", st.ToString().c_str());
    }
  }

  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  bool last_serving = false;
  health->SetServingStatus("", false);
  health->SetServingStatus("pinfer.worker.v1.GpuWorker", false);
  while (!ShutdownRequested()) {
    const bool serving = s.exchange->PeerReady() && !s.scheduler->draining();
    if (serving != last_serving) {
      health->SetServingStatus("", serving);
      health->SetServingStatus("pinfer.worker.v1.GpuWorker", serving);
      last_serving = serving;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  health->SetServingStatus("", false);
  health->SetServingStatus("pinfer.worker.v1.GpuWorker", false);
  Log("shutting down: draining %d running sequence(s)", s.scheduler->running());
  s.scheduler->Drain();
  const auto drain_end = Clock::now() + std::chrono::milliseconds(o.drain_timeout_ms);
  while (s.scheduler->running() > 0 && Clock::now() < drain_end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  s.scheduler.reset();
  Log("stopped");
  return 0;  // the segment is closed and unlinked as s.exchange goes
}

}  // namespace
}  // namespace pinfer::gpuworker

int main(int argc, char** argv) {
  return pinfer::gpuworker::Main(std::vector<std::string>(argv + 1, argv + argc));
}
