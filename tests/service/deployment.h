// Test harness for the service: starts real pinfer-gateway, pinfer-gpu-worker and
// pinfer-cpu-worker processes (ports 0, learned through port files; a fresh segment name; a
// temporary folder for logs), lets tests kill and restart them, scrapes /metrics, and checks
// health. Everything is torn down (processes killed, segment unlinked) in the destructor.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "pinfer/v1/inference.grpc.pb.h"
#include "pinfer/worker/v1/worker.grpc.pb.h"

namespace pinfer::testing {

struct DeploymentOptions {
  std::string model;          // path
  double hot_fraction = 0.5;  // negative: no --hot-fraction flag
  std::vector<std::string> gateway_flags, gpu_flags, cpu_flags;
  int liveness_ms = 1000;
};

// Prometheus text format, flattened: "name{label="v",...}" (labels as printed) -> value.
using MetricMap = std::map<std::string, double>;
absl::StatusOr<MetricMap> ScrapeMetrics(int port);
// Sum of all series of a metric name whose label text contains `label_filter`.
double MetricSum(const MetricMap& m, const std::string& name, const std::string& label_filter = "");

class Deployment {
 public:
  explicit Deployment(DeploymentOptions o);
  ~Deployment();

  // Starts all three and waits until the gateway reports SERVING.
  absl::Status Start();
  absl::Status StartGpuWorker();
  absl::Status StartCpuWorker();
  absl::Status StartGateway();
  void KillGpuWorker(int sig = 9);
  void KillCpuWorker(int sig = 9);
  void KillGateway(int sig = 9);
  // Waits for the given process to exit; returns its wait status or -1 on timeout.
  int WaitGateway(std::chrono::milliseconds timeout);

  // SERVING / NOT_SERVING / "" (unreachable) of the gateway's health service for `service`.
  std::string Health(const std::string& service = "");
  // The same, asked of the gpu-worker's own health service.
  std::string GpuWorkerHealth(const std::string& service = "");
  absl::Status WaitHealth(const std::string& want, std::chrono::milliseconds timeout);

  pinfer::v1::Inference::Stub& stub() { return *stub_; }
  pinfer::worker::v1::GpuWorker::Stub& gpu_stub() { return *gpu_stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  int gateway_metrics_port() const { return gateway_metrics_port_; }
  int gpu_metrics_port() const { return gpu_metrics_port_; }
  int cpu_metrics_port() const { return cpu_metrics_port_; }
  pid_t gpu_pid() const { return gpu_pid_; }
  pid_t cpu_pid() const { return cpu_pid_; }
  pid_t gateway_pid() const { return gateway_pid_; }
  const std::string& segment() const { return segment_; }
  // The tail of every process's log, for failure messages.
  std::string Logs() const;

 private:
  pid_t Spawn(const std::string& name, std::vector<std::string> argv);
  absl::StatusOr<int> WaitPortFile(const std::string& path, pid_t pid);
  void Reap(pid_t* pid, int sig);

  DeploymentOptions o_;
  std::string dir_, segment_;
  pid_t gpu_pid_ = -1, cpu_pid_ = -1, gateway_pid_ = -1;
  int gpu_port_ = 0, gateway_port_ = 0;
  int gateway_metrics_port_ = 0, gpu_metrics_port_ = 0, cpu_metrics_port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pinfer::v1::Inference::Stub> stub_;
  std::unique_ptr<pinfer::worker::v1::GpuWorker::Stub> gpu_stub_;
  int restarts_ = 0;
};

// A streamed Generate's result.
struct GenerateResult {
  grpc::Status status;
  std::vector<uint32_t> ids;
  std::string text;
  pinfer::v1::GenerateResponse last;
  int messages = 0;
};

GenerateResult RunGenerate(pinfer::v1::Inference::Stub& stub,
                           const pinfer::v1::GenerateRequest& req,
                           std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace pinfer::testing
