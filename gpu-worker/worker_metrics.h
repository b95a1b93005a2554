// Registers the gpu-worker's Prometheus metrics (worker_metrics.cc lists them) in the process's
// registry and returns the scheduler hooks that update them; the scrape-time gauges go to the
// metrics endpoint when there is one. Called once, after the backend is built (the gauges name it).
#ifndef PINFER_GPU_WORKER_WORKER_METRICS_H_
#define PINFER_GPU_WORKER_WORKER_METRICS_H_

#include "gpu-worker/scheduler.h"
#include "gpu-worker/worker_service.h"
#include "prometheus/registry.h"
#include "shared/metrics/metrics.h"

namespace pinfer::gpuworker {

// `s` must outlive the returned hooks and the endpoint (a gauge reads s.exchange at scrape time).
SchedulerHooks RegisterWorkerMetrics(const State& s, prometheus::Registry& registry,
                                     metrics::Endpoint* endpoint);

}  // namespace pinfer::gpuworker

#endif  // PINFER_GPU_WORKER_WORKER_METRICS_H_
