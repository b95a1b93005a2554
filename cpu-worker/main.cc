// pinfer-cpu-worker: computes the cold FFN neurons of every layer for the gpu-worker. It attaches
// to the gpu-worker's shared-memory segment, reads the placement from it, copies only its cold
// rows out of the model (gate and up rows, down columns transposed into rows) and then drops the
// model mapping's pages, so its resident memory is the cold rows plus a little; the metric
// pinfer_worker_resident_bytes shows it. Activations arrive and leave through the segment; gRPC
// (CpuWorker service) is for control: info, health, drain.
//
// When the gpu-worker goes away (segment closed, or re-created by a restarted gpu-worker) this
// worker re-attaches; when it dies, its supervisor restarts it and the gpu-worker's requests fail
// with UNAVAILABLE in the meantime.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/flags.h"
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
#include "shared/util/status_macros.h"
#include "shared/util/thread_pool.h"

namespace pinfer::cpuworker {
namespace {

namespace wv1 = ::pinfer::worker::v1;

constexpr char kUsage[] =
    "usage: pinfer-cpu-worker --model PATH --segment NAME [--listen ADDR] [--port-file FILE]\n"
    "         [--metrics-port P] [--metrics-port-file FILE] [--threads N] [--liveness-ms MS]\n"
    "         [--spin-us US] [--exchange-spin-us US] [--prefetch-guess]\n"
    "  --segment: the gpu-worker's shared-memory segment (waited for until it exists)\n"
    "  --spin-us: how long the compute threads keep polling for the next layer's work before\n"
    "             they sleep (default 200; 0 sleeps at once): a decode step's layers follow each\n"
    "             other within tens of microseconds, less than waking a sleeping thread takes\n"
    "  --exchange-spin-us: how long the exchange thread polls the shared-memory segment for the\n"
    "             gpu-worker's next request before it sleeps on a futex (default 20)\n"
    "  --prefetch-guess: while the GPU computes a layer's attention, load the rows of the neurons\n"
    "             the gpu-worker guesses the layer will list (gpu-worker --cold-guess) into the\n"
    "             caches of the threads that will compute them; each thread then keeps the same\n"
    "             part of every layer's list\n";

struct Options {
  std::string model, segment, listen = "127.0.0.1:0", port_file, metrics_port, metrics_port_file;
  int threads = 1;
  int64_t liveness_ms = 2000;
  int64_t spin_us = 200;
  int64_t exchange_spin_us = 20;
  bool prefetch_guess = false;
};

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(cli::Flags f, cli::Flags::Parse(args,
                                                   {"model", "segment", "listen", "port-file",
                                                    "metrics-port", "metrics-port-file", "threads",
                                                    "liveness-ms", "spin-us", "exchange-spin-us"},
                                                   {"prefetch-guess"}));
  Options o;
  ASSIGN_OR_RETURN(o.model, f.Required("model"));
  ASSIGN_OR_RETURN(o.segment, f.Required("segment"));
  RETURN_IF_ERROR(shm::ValidateSegmentName(o.segment));
  if (auto v = f.Get("listen")) o.listen = *v;
  if (auto v = f.Get("port-file")) o.port_file = *v;
  if (auto v = f.Get("metrics-port")) o.metrics_port = *v;
  if (auto v = f.Get("metrics-port-file")) o.metrics_port_file = *v;
  ASSIGN_OR_RETURN(int64_t threads, f.Int("threads", 1));
  ASSIGN_OR_RETURN(o.liveness_ms, f.Int("liveness-ms", 2000));
  if (threads < 1 || threads > 1024) return absl::InvalidArgumentError("--threads out of range");
  if (o.liveness_ms < 1) return absl::InvalidArgumentError("--liveness-ms must be positive");
  ASSIGN_OR_RETURN(o.spin_us, f.Int("spin-us", 200));
  if (o.spin_us < 0 || o.spin_us > 1'000'000) {
    return absl::InvalidArgumentError("--spin-us must be in [0, 1000000]");
  }
  ASSIGN_OR_RETURN(o.exchange_spin_us, f.Int("exchange-spin-us", 20));
  if (o.exchange_spin_us < 0 || o.exchange_spin_us > 1'000'000) {
    return absl::InvalidArgumentError("--exchange-spin-us must be in [0, 1000000]");
  }
  o.threads = static_cast<int>(threads);
  o.prefetch_guess = f.Has("prefetch-guess");
  return o;
}

// Shared between the exchange thread and the gRPC handlers.
struct Status {
  std::mutex mu;
  wv1::WorkerState state = wv1::WORKER_STATE_LOADING;
  std::string error;
  uint64_t row_bytes = 0, neurons = 0;
  bool gpu_alive = false;
};

class CpuWorkerService final : public wv1::CpuWorker::Service {
 public:
  CpuWorkerService(const Options& o, const Model& m, Status* st, std::atomic<bool>* draining)
      : o_(o), m_(m), st_(st), draining_(draining) {}

  grpc::Status Load(grpc::ServerContext*, const wv1::LoadRequest* req,
                    wv1::LoadResponse* resp) override {
    if (!req->model_path().empty() && req->model_path() != o_.model) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("this cpu-worker serves ", o_.model));
    }
    if (!req->segment().empty() && req->segment() != o_.segment) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("this cpu-worker is bound to segment ", o_.segment));
    }
    Fill(resp->mutable_info());
    return grpc::Status::OK;
  }

  grpc::Status GetInfo(grpc::ServerContext*, const wv1::InfoRequest*,
                       wv1::WorkerInfo* info) override {
    Fill(info);
    return grpc::Status::OK;
  }

  grpc::Status Check(grpc::ServerContext*, const wv1::CheckRequest*,
                     wv1::CheckResponse* resp) override {
    std::lock_guard<std::mutex> lock(st_->mu);
    resp->set_state(draining_->load() ? wv1::WORKER_STATE_DRAINING : st_->state);
    resp->set_peer_alive(st_->gpu_alive);
    resp->set_message(st_->error);
    return grpc::Status::OK;
  }

  grpc::Status Drain(grpc::ServerContext*, const wv1::DrainRequest*, wv1::DrainResponse*) override {
    // The cpu-worker holds no sequences; draining means finishing the exchange in progress and
    // stopping, which the supervisor or the orchestrator triggers with SIGTERM.
    draining_->store(true);
    return grpc::Status::OK;
  }

 private:
  void Fill(wv1::WorkerInfo* info) {
    std::lock_guard<std::mutex> lock(st_->mu);
    info->set_role("cpu-worker");
    info->set_state(st_->state);
    info->set_segment(o_.segment);
    info->mutable_model()->set_architecture(m_.config.architecture);
    info->mutable_model()->set_model_path(m_.source_path);
    info->set_resident_bytes(ResidentBytes());
    info->set_ffn_row_bytes(st_->row_bytes);
    info->set_ffn_neurons(st_->neurons);
    info->set_backend("cpu");
    info->set_pid(static_cast<uint32_t>(::getpid()));
    info->set_error(st_->error);
  }

  const Options& o_;
  const Model& m_;
  Status* st_;
  std::atomic<bool>* draining_;
};

int Main(const std::vector<std::string>& args) {
  SetLogRole("cpu-worker");
  InstallShutdownHandlers();
  auto parsed = ParseOptions(args);
  if (!parsed.ok()) {
    std::fprintf(stderr, "pinfer-cpu-worker: %s\n%s",
                 std::string(parsed.status().message()).c_str(), kUsage);
    return 2;
  }
  const Options o = *parsed;

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
  auto& compute = prometheus::BuildCounter()
                      .Name("pinfer_worker_compute_seconds_total")
                      .Help(
                          "Compute time by kind of layer work: ffn (this worker's cold FFN "
                          "neurons)")
                      .Register(*registry)
                      .Add({{"kind", "ffn"}});
  auto& exchanges = prometheus::BuildHistogram()
                        .Name("pinfer_worker_exchange_compute_seconds")
                        .Help("Time to compute the cold share of one layer exchange")
                        .Register(*registry)
                        .Add({}, metrics::ShortLatencyBuckets());
  auto& idle_wait = prometheus::BuildCounter()
                        .Name("pinfer_worker_shm_wait_seconds_total")
                        .Help("Time spent waiting for the next exchange request")
                        .Register(*registry)
                        .Add({});
  auto& neurons = prometheus::BuildCounter()
                      .Name("pinfer_worker_neurons_computed_total")
                      .Help("(token, neuron) pairs computed, by side of the split")
                      .Register(*registry)
                      .Add({{"side", "cpu"}});
  auto& guessed_loaded_family =
      prometheus::BuildCounter()
          .Name("pinfer_worker_guessed_neurons_loaded_total")
          .Help(
              "Cold neurons whose rows were loaded into the compute threads' caches ahead of "
              "their layer's request, from the gpu-worker's guesses (--prefetch-guess): all of "
              "them (kind=all), and those in the guesses' first tiers (kind=first), which are "
              "loaded first")
          .Register(*registry);
  auto& guessed_loaded = guessed_loaded_family.Add({{"kind", "all"}});
  auto& guessed_loaded_first = guessed_loaded_family.Add({{"kind", "first"}});
  auto& listed = prometheus::BuildCounter()
                     .Name("pinfer_worker_neurons_listed_total")
                     .Help(
                         "(token, neuron) pairs the gpu-worker's requests listed for this worker "
                         "(sparse mode: the predictors' choice; exact mode: every cold neuron); "
                         "those with a zero activation cost a gate row each")
                     .Register(*registry)
                     .Add({{"side", "cpu"}});
  auto& candidates = prometheus::BuildCounter()
                         .Name("pinfer_worker_neuron_candidates_total")
                         .Help("(token, neuron) pairs that could have been computed, by side")
                         .Register(*registry)
                         .Add({{"side", "cpu"}});
  prometheus::BuildGauge()
      .Name("pinfer_worker_backend_info")
      .Help("The backend computing this worker's share (value 1)")
      .Register(*registry)
      .Add({{"role", "cpu-worker"}, {"backend", "cpu"}})
      .Set(1);
  auto& row_bytes_gauge = prometheus::BuildGauge()
                              .Name("pinfer_worker_ffn_row_bytes")
                              .Help("Bytes of FFN rows this worker holds")
                              .Register(*registry)
                              .Add({{"side", "cpu"}});
  Status status;
  auto gauges = std::make_shared<metrics::ScrapeGauges>();
  gauges->Add({"pinfer_worker_resident_bytes",
               "Resident memory of this worker process",
               {{"role", "cpu-worker"}},
               [] { return static_cast<double>(ResidentBytes()); }});
  gauges->Add({"pinfer_worker_peer_alive",
               "1 while attached to a live gpu-worker's segment",
               {},
               [&status] {
                 std::lock_guard<std::mutex> lock(status.mu);
                 return status.gpu_alive ? 1.0 : 0.0;
               }});
  gauges->Add({"pinfer_worker_ffn_sparsity",
               "Fraction of this worker's (token, neuron) pairs skipped because their "
               "activation was zero, over the worker's lifetime",
               {},
               [&] {
                 const double c = candidates.Value();
                 return c > 0 ? 1.0 - neurons.Value() / c : 0.0;
               }});
  if (endpoint != nullptr) endpoint->Add(gauges);

  auto model = LoadServiceModel(o.model);
  if (!model.ok()) {
    Log("cannot load %s: %s", o.model.c_str(), model.status().ToString().c_str());
    return 1;
  }
  ServiceModel sm = std::move(*model);
  const Model& m = sm.model();
  const ModelConfig& c = m.config;
  shm::Geometry expected;
  expected.n_layers = c.n_layers;
  expected.hidden = c.hidden_size;
  expected.ffn = c.ffn_size;
  expected.fingerprint = ModelFingerprint(m);
  // Only the cold rows are used from here on (copied out of the file's mapping).
  ReleaseMappedPages(m);

  std::atomic<bool> draining{false};
  CpuWorkerService service(o, m, &status, &draining);
  // The standard health service too (container healthchecks, Kubernetes gRPC probes): SERVING
  // while attached to a live gpu-worker with the cold rows loaded.
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
  Log("serving pinfer.worker.v1.CpuWorker on %s (port %d)", o.listen.c_str(), port);
  if (!o.port_file.empty()) (void)WriteFileAtomically(o.port_file, absl::StrCat(port, "\n"));

  ThreadPool pool(o.threads, std::chrono::microseconds(o.spin_us));
  // --prefetch-guess: the loads and the compute meet in one core's caches only if each part of a
  // layer's list stays on one thread.
  pool.set_pinned_chunks(o.prefetch_guess);
  std::unique_ptr<CpuOps> ops = NewSimdOps(&pool);
  std::atomic<bool> stop{false};
  int exit_code = 0;
  std::thread exchange_thread([&] {
    std::unique_ptr<FfnRowStore> rows;
    Placement current;
    bool waiting_logged = false;
    shm::ChannelOptions co;
    co.liveness_ns = o.liveness_ms * 1'000'000;
    co.spin_ns = o.exchange_spin_us * 1'000;
    while (!stop.load()) {
      auto seg = shm::Segment::Attach(o.segment, expected);
      if (!seg.ok()) {
        if (absl::IsFailedPrecondition(seg.status()) || absl::IsInvalidArgument(seg.status())) {
          // Another model or an incompatible version: waiting will not fix it.
          Log("cannot use segment %s: %s", o.segment.c_str(), seg.status().ToString().c_str());
          std::lock_guard<std::mutex> lock(status.mu);
          status.state = wv1::WORKER_STATE_FAILED;
          status.error = std::string(seg.status().message());
        } else if (!waiting_logged) {
          Log("waiting for the gpu-worker's segment %s (%s)", o.segment.c_str(),
              std::string(seg.status().message()).c_str());
          waiting_logged = true;
          std::lock_guard<std::mutex> lock(status.mu);
          status.state = wv1::WORKER_STATE_WAITING_FOR_PEER;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      waiting_logged = false;
      // The placement is the gpu-worker's decision; the cold rows are its complement.
      std::vector<const uint64_t*> maps;
      for (int l = 0; l < c.n_layers; ++l) maps.push_back((*seg)->hot_bitmap(l));
      Placement placement = Placement::FromBitmaps(maps, c.ffn_size);
      if (rows == nullptr || placement.hot != current.hot) {
        {
          std::lock_guard<std::mutex> lock(status.mu);
          status.state = wv1::WORKER_STATE_LOADING;
        }
        std::vector<std::vector<int32_t>> cold(c.n_layers);
        for (int l = 0; l < c.n_layers; ++l) cold[l] = placement.Cold(l, c.ffn_size);
        rows.reset();
        const auto t_build = std::chrono::steady_clock::now();
        auto built = FfnRowStore::Build(m, cold, &pool);  // the pool is idle until attached
        if (!built.ok()) {
          Log("cannot build the cold rows: %s", built.status().ToString().c_str());
          exit_code = 1;
          stop.store(true);
          break;
        }
        rows = std::move(*built);
        current = placement;
        // Build dropped each layer's FFN pages as it went; drop whatever else of the file was
        // touched, so that only our copies stay resident.
        ReleaseMappedPages(m);
        row_bytes_gauge.Set(static_cast<double>(rows->bytes()));
        Log("cold rows: %zu neurons, %.1f MiB copied in %.2f s (%d threads); resident %.1f MiB, "
            "%.1f MiB in huge pages",
            static_cast<size_t>(rows->neurons()), rows->bytes() / 1048576.0,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t_build).count(),
            pool.size(), ResidentBytes() / 1048576.0, HugePageBytes() / 1048576.0);
      }
      shm::ExchangeServer xs(std::move(*seg), co);
      xs.MarkReady(ResidentBytes());
      {
        std::lock_guard<std::mutex> lock(status.mu);
        status.state = wv1::WORKER_STATE_READY;
        status.error.clear();
        status.row_bytes = rows->bytes();
        status.neurons = rows->neurons();
        status.gpu_alive = true;
      }
      Log("attached to segment %s; serving cold FFN neurons", o.segment.c_str());
      PartialFfn ffn(*rows, c.activation, *ops);
      const int words = xs.segment().geometry().words_per_mask();
      uint64_t last_end = shm::MonotonicNanos();
      absl::Status st = xs.Serve(
          [&](int layer, const float* x, int n, const uint64_t* masks,
              float* out) -> absl::StatusOr<uint64_t> {
            const uint64_t t0 = shm::MonotonicNanos();
            idle_wait.Increment((t0 - last_end) * 1e-9);
            const uint64_t listed_before = ffn.listed();
            const uint64_t count = ffn.Accumulate(layer, x, n, masks, words, out);
            listed.Increment(static_cast<double>(ffn.listed() - listed_before));
            last_end = shm::MonotonicNanos();
            compute.Increment((last_end - t0) * 1e-9);
            exchanges.Observe((last_end - t0) * 1e-9);
            neurons.Increment(static_cast<double>(count));
            candidates.Increment(static_cast<double>(rows->layer(layer).neurons.size()) * n);
            return count;
          },
          stop,
          o.prefetch_guess
              ? shm::GuessHandler([&](int layer, const uint64_t* mask, const uint64_t* first,
                                      const std::function<bool()>& stop_guess) {
                  const PartialFfn::Loaded loaded =
                      ffn.Prefetch(layer, mask, first, &pool, stop_guess);
                  guessed_loaded.Increment(static_cast<double>(loaded.neurons));
                  guessed_loaded_first.Increment(static_cast<double>(loaded.first));
                })
              : shm::GuessHandler());
      {
        std::lock_guard<std::mutex> lock(status.mu);
        status.gpu_alive = false;
        status.state = wv1::WORKER_STATE_WAITING_FOR_PEER;
      }
      if (absl::IsFailedPrecondition(st)) {
        Log("%s; exiting", std::string(st.message()).c_str());
        exit_code = 1;
        stop.store(true);
        break;
      }
      if (!st.ok()) Log("%s; re-attaching", std::string(st.message()).c_str());
    }
  });

  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  bool last_serving = true;
  while (!ShutdownRequested() && !stop.load() && !draining.load()) {
    bool serving;
    {
      std::lock_guard<std::mutex> lock(status.mu);
      serving = status.state == wv1::WORKER_STATE_READY;
    }
    if (serving != last_serving) {
      health->SetServingStatus("", serving);
      health->SetServingStatus("pinfer.worker.v1.CpuWorker", serving);
      last_serving = serving;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  health->SetServingStatus("", false);
  health->SetServingStatus("pinfer.worker.v1.CpuWorker", false);
  Log("shutting down");
  stop.store(true);
  exchange_thread.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  Log("stopped");
  return exit_code;
}

}  // namespace
}  // namespace pinfer::cpuworker

int main(int argc, char** argv) {
  return pinfer::cpuworker::Main(std::vector<std::string>(argv + 1, argv + argc));
}
