// The GpuWorker gRPC service (proto/pinfer/worker/v1/worker.proto) that the gateway drives: Load
// and GetInfo describe the model and the placement, Check and the worker state report whether the
// cpu-worker is attached, Run submits a sequence to the scheduler and streams its tokens back,
// Cancel and Drain stop sequences, Tokenize and Detokenize use the model's tokenizer. It serves a
// State that main.cc builds at start-up (model, placement, exchange, backend, scheduler) and
// never changes it.
#ifndef PINFER_GPU_WORKER_WORKER_SERVICE_H_
#define PINFER_GPU_WORKER_WORKER_SERVICE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "gpu-worker/backend.h"
#include "gpu-worker/options.h"
#include "gpu-worker/scheduler.h"
#include "pinfer/worker/v1/worker.grpc.pb.h"
#include "shared/chat/model_chat.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"
#include "shared/service/service_model.h"
#include "shared/shm/activation_channel.h"
#include "shared/sparse/placement.h"
#include "shared/util/thread_pool.h"

namespace pinfer::gpuworker {

// Whether a GPU can be used (ProbeGpu in startup.h): the CUDA module found and why or why not.
struct GpuProbe {
  bool available = false;
  std::string reason;
  std::string module;
};

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
  chat::ModelChat chat;  // the Chat RPC's template and special tokens (LoadChat in startup.cc)
};
// The model and placement as the public API describes them (ModelInfo).
v1::ModelInfo BuildModelInfo(const State& s);

class GpuWorkerService final : public ::pinfer::worker::v1::GpuWorker::Service {
 public:
  explicit GpuWorkerService(State* s) : s_(s) {}

  grpc::Status Load(grpc::ServerContext*, const ::pinfer::worker::v1::LoadRequest* req,
                    ::pinfer::worker::v1::LoadResponse* resp) override;
  grpc::Status GetInfo(grpc::ServerContext*, const ::pinfer::worker::v1::InfoRequest*,
                       ::pinfer::worker::v1::WorkerInfo* info) override;
  grpc::Status Check(grpc::ServerContext*, const ::pinfer::worker::v1::CheckRequest*,
                     ::pinfer::worker::v1::CheckResponse* resp) override;
  grpc::Status Run(grpc::ServerContext* ctx, const ::pinfer::worker::v1::RunRequest* req,
                   grpc::ServerWriter<::pinfer::worker::v1::RunEvent>* writer) override;
  grpc::Status Cancel(grpc::ServerContext*, const ::pinfer::worker::v1::CancelRequest* req,
                      ::pinfer::worker::v1::CancelResponse* resp) override;
  grpc::Status Drain(grpc::ServerContext*, const ::pinfer::worker::v1::DrainRequest*,
                     ::pinfer::worker::v1::DrainResponse* resp) override;
  grpc::Status Tokenize(grpc::ServerContext*, const v1::TokenizeRequest* req,
                        v1::TokenizeResponse* resp) override;
  grpc::Status Detokenize(grpc::ServerContext*, const v1::DetokenizeRequest* req,
                          v1::DetokenizeResponse* resp) override;

 private:
  ::pinfer::worker::v1::WorkerState CurrentState() const;
  void FillInfo(::pinfer::worker::v1::WorkerInfo* info);

  State* s_;
};

}  // namespace pinfer::gpuworker

#endif  // PINFER_GPU_WORKER_WORKER_SERVICE_H_
