// OpenAiHttpServer: an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
// /v1/models), a health check and a web chat page on the gateway. It holds no scheduler of its
// own: every request becomes a call on the gateway's public gRPC API through the channel it is
// given (the gateway's in-process channel), so HTTP clients share the admission queue, limits,
// routing and metrics of gRPC clients. Errors come back as OpenAI's error object with the HTTP
// status a gRPC code maps to (429 for RESOURCE_EXHAUSTED, 503 for UNAVAILABLE, ...).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/channel.h"
#include "pinfer/v1/inference.grpc.pb.h"
#include "prometheus/registry.h"

namespace httplib {
class Server;
}

namespace pinfer::gateway {

struct HttpOptions {
  // "host" to bind and the port; 0 picks a free one (see OpenAiHttpServer::port()).
  std::string host = "0.0.0.0";
  int port = 0;
  // When set, every /v1/ request needs "Authorization: Bearer <api_key>". The page and /health
  // stay open so that probes work and the page can ask for the key.
  std::string api_key;
  // Request bodies over this get 413; chat histories are text, 1 MiB is generous.
  size_t max_body_bytes = 1 << 20;
};

class OpenAiHttpServer {
 public:
  // Binds and starts serving on a thread of its own. `channel` leads to the gateway's public
  // API; `registry` (may be null) receives the HTTP metrics.
  static absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> Start(
      const HttpOptions& options, std::shared_ptr<grpc::Channel> channel,
      prometheus::Registry* registry);
  ~OpenAiHttpServer();  // Stops.

  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  int port() const { return port_; }
  // Stops accepting connections; streams in progress end at their next write. Idempotent.
  void Stop();

  struct Impl;

 private:
  OpenAiHttpServer() = default;

  std::unique_ptr<Impl> impl_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<bool> stopped_{false};
};

}  // namespace pinfer::gateway
