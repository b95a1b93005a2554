// See metrics.h.
#include "shared/metrics/metrics.h"

#include <exception>

#include "prometheus/exposer.h"
#include "shared/service/log.h"

namespace pinfer::metrics {

std::unique_ptr<Endpoint> Endpoint::Start(const std::string& bind,
                                          std::shared_ptr<prometheus::Registry> registry) {
  std::string address = bind;
  if (address.find(':') == std::string::npos) address = "0.0.0.0:" + address;
  auto ep = std::unique_ptr<Endpoint>(new Endpoint());
  try {
    ep->exposer_ = std::make_unique<prometheus::Exposer>(address, 2);
    ep->exposer_->RegisterCollectable(registry);
    std::vector<int> ports = ep->exposer_->GetListeningPorts();
    ep->port_ = ports.empty() ? 0 : ports[0];
  } catch (const std::exception& e) {
    Log("metrics endpoint on %s could not start (%s); continuing without /metrics", address.c_str(),
        e.what());
    return nullptr;
  }
  return ep;
}

Endpoint::~Endpoint() = default;

void Endpoint::Add(std::shared_ptr<prometheus::Collectable> c) {
  exposer_->RegisterCollectable(c);
  extra_.push_back(std::move(c));
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

prometheus::Histogram::BucketBoundaries ShortLatencyBuckets() {
  return {1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 1};
}

std::vector<prometheus::MetricFamily> ScrapeGauges::Collect() const {
  std::vector<prometheus::MetricFamily> out;
  for (const Gauge& g : gauges_) {
    prometheus::MetricFamily* fam = nullptr;
    for (auto& f : out) {
      if (f.name == g.name) fam = &f;
    }
    if (fam == nullptr) {
      out.push_back({g.name, g.help, prometheus::MetricType::Gauge, {}});
      fam = &out.back();
    }
    prometheus::ClientMetric m;
    for (const auto& [k, v] : g.labels) m.label.push_back({k, v});
    m.gauge.value = g.value();
    fam->metric.push_back(std::move(m));
  }
  return out;
}

}  // namespace pinfer::metrics
