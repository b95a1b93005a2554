// pinfer-gpu-worker: holds the sequences (KV caches, sampling) and computes everything except the
// cold FFN neurons: embeddings, attention, norms, the hot FFN rows and the output head. It creates
// the shared-memory segment that the cpu-worker attaches to, writes the placement into it, and
// serves the internal GpuWorker gRPC service (proto/pinfer/worker/v1/worker.proto) that the
// gateway drives.
//
// Without a usable GPU (no CUDA module, no device) the same role runs on the CPU; the log says so
// and the metric pinfer_worker_gpu_available is 0.
//
// This file is the start-up read top to bottom: options.h parses the flags, startup.h holds the
// steps that build the State (placement, segment, backend), worker_metrics.h registers the metrics,
// worker_service.h is the gRPC service; Main() then serves until a shutdown signal and drains.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu-worker/options.h"
#include "gpu-worker/scheduler.h"
#include "gpu-worker/startup.h"
#include "gpu-worker/worker_metrics.h"
#include "gpu-worker/worker_service.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "shared/engine/ops.h"
#include "shared/metrics/metrics.h"
#include "shared/service/log.h"
#include "shared/service/service_model.h"
#include "shared/util/thread_pool.h"

namespace pinfer::gpuworker {
namespace {

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
  if (!DecideColdPrefill(s)) return 1;
  s.pool = std::make_unique<ThreadPool>(o.threads);
  s.ops = NewSimdOps(s.pool.get());
  if (!ChoosePlacement(s)) return 1;
  if (!CreateExchange(s)) return 1;
  if (!CreateBackend(s)) return 1;

  SchedulerOptions so;
  so.max_sequences = o.max_sequences;
  so.prefill_chunk = o.max_batch_tokens;
  so.max_new_tokens_limit = o.max_new_tokens_limit;
  so.prefix_cache.max_entries = o.prefix_cache_entries;
  so.prefix_cache.max_bytes = o.prefix_cache_bytes;
  so.prefix_cache.min_tokens = o.prefix_cache_min_tokens;
  SchedulerHooks hooks = RegisterWorkerMetrics(s, *registry, endpoint.get());
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
