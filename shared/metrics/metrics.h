// Prometheus metrics plumbing shared by the gateway and the workers (prometheus-cpp): the /metrics
// HTTP endpoint, standard bucket layouts and process-level gauges computed at scrape time.
//
// The endpoint runs on civetweb, whose Debian build creates its threads with small stacks and can
// fail to start (port taken, address invalid); a process must keep serving inference when its
// metrics endpoint cannot start, so Start() logs and returns null instead of throwing.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}

namespace pinfer::metrics {

class Endpoint {
 public:
  // bind: "host:port" or a bare port ("9090", "0" for any free port). Returns null (after
  // logging why) when the endpoint cannot start.
  static std::unique_ptr<Endpoint> Start(const std::string& bind,
                                         std::shared_ptr<prometheus::Registry> registry);
  ~Endpoint();
  // The bound port (useful with port 0).
  int port() const { return port_; }
  // Serves another collectable on the same /metrics page.
  void Add(std::shared_ptr<prometheus::Collectable> c);

 private:
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::vector<std::shared_ptr<prometheus::Collectable>> extra_;
  int port_ = 0;
};

// Latency buckets in seconds, 1 ms to 60 s, roughly x2.5 apart.
prometheus::Histogram::BucketBoundaries LatencyBuckets();
// Finer buckets for per-layer waits, 1 us to 1 s.
prometheus::Histogram::BucketBoundaries ShortLatencyBuckets();

// A collectable whose gauges are computed at scrape time: name, help, and a function giving the
// current value (resident memory, queue depths read from elsewhere).
class ScrapeGauges : public prometheus::Collectable {
 public:
  struct Gauge {
    std::string name, help;
    std::map<std::string, std::string> labels;
    std::function<double()> value;
  };
  void Add(Gauge g) { gauges_.push_back(std::move(g)); }
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  std::vector<Gauge> gauges_;
};

}  // namespace pinfer::metrics
