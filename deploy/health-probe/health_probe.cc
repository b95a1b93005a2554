// pinfer-health-probe: asks a gRPC server for its grpc.health.v1.Health status and exits 0 when it
// is SERVING, 1 otherwise. Container healthchecks (Dockerfile HEALTHCHECK, compose healthcheck)
// run it inside the image; Debian has no grpc_health_probe package, and the pinfer processes
// serve the standard health service, so a tiny client is all that is needed.
//
// With --drain it is the Kubernetes preStop hook of a worker pair instead: it asks the gpu-worker
// to drain (pinfer.worker.v1.GpuWorker/Drain: no new sequences) and waits until its running
// sequences reach zero (GpuWorker/Check), so the pod is stopped only after in-flight requests
// finished, within --timeout.
//
// The few messages involved are encoded by hand (at most one string field in, varint fields out)
// so the probe needs neither .proto files nor generated code: it links only grpc++.
//
// usage: pinfer-health-probe --addr HOST:PORT [--service NAME] [--timeout SECONDS] [--drain]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"

namespace {

constexpr char kUsage[] =
    "usage: pinfer-health-probe --addr HOST:PORT [--service NAME] [--timeout SECONDS] [--drain]\n"
    "exits 0 when the server's grpc.health.v1.Health/Check says SERVING, 1 otherwise\n"
    "--drain: drain the gpu-worker at HOST:PORT and wait (up to --timeout) until it runs no\n"
    "         sequence; exits 0 when drained, 1 on timeout or error\n";

// HealthCheckRequest { string service = 1; }: tag 0x0a, varint length, bytes.
std::string EncodeRequest(const std::string& service) {
  if (service.empty()) return "";
  std::string out = "\x0a";
  uint64_t n = service.size();
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out + service;
}

// Reads varint field `field` of a message made only of varint fields (HealthCheckResponse.status,
// CheckResponse.running_sequences...; CheckResponse's string field is skipped). Returns 0 when
// the field is absent (proto3 default) and -1 when the bytes cannot be parsed.
int64_t DecodeVarintField(const std::string& bytes, int field) {
  int64_t result = 0;
  size_t i = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift <= 63; shift += 7) {
      if (i >= bytes.size()) return false;
      uint8_t b = static_cast<uint8_t>(bytes[i++]);
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  while (i < bytes.size()) {
    uint64_t key = 0, v = 0;
    if (!varint(&key)) return -1;
    if ((key & 7) == 0) {
      if (!varint(&v)) return -1;
      if (static_cast<int>(key >> 3) == field) result = static_cast<int64_t>(v);
    } else if ((key & 7) == 2) {  // length-delimited: skip
      if (!varint(&v) || v > bytes.size() - i) return -1;
      i += v;
    } else {
      return -1;
    }
  }
  return result;
}

// One unary call with raw bytes in and out, waiting for the server to become reachable within
// the deadline (a server that is just starting is reported by its answer, not by a connect race).
grpc::Status Call(grpc::GenericStub* stub, const std::string& method, const std::string& request,
                  std::chrono::system_clock::time_point deadline, std::string* response) {
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  ctx.set_wait_for_ready(true);
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::CompletionQueue cq;
  auto call = stub->PrepareUnaryCall(&ctx, method, request_buffer, &cq);
  call->StartCall();
  grpc::ByteBuffer response_buffer;
  grpc::Status status;
  call->Finish(&response_buffer, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) {
    return grpc::Status(grpc::StatusCode::UNKNOWN, "call did not complete");
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) return status;
  std::vector<grpc::Slice> slices;
  response->clear();
  if (response_buffer.Dump(&slices).ok()) {
    for (const auto& sl : slices) {
      response->append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
  }
  return status;
}

const char* StatusName(int s) {
  switch (s) {
    case 0:
      return "UNKNOWN";
    case 1:
      return "SERVING";
    case 2:
      return "NOT_SERVING";
    case 3:
      return "SERVICE_UNKNOWN";
    default:
      return "INVALID";
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string addr, service;
  double timeout = 3;
  bool drain = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    size_t eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (a != "--help" && a != "-h" && a != "--drain") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "pinfer-health-probe: %s needs a value\n%s", a.c_str(), kUsage);
        return 2;
      }
      value = argv[++i];
    }
    if (a == "--addr") {
      addr = value;
    } else if (a == "--service") {
      service = value;
    } else if (a == "--drain") {
      drain = true;
    } else if (a == "--timeout") {
      timeout = std::atof(value.c_str());
    } else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      std::fprintf(stderr, "pinfer-health-probe: unknown flag %s\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if (addr.empty() || timeout <= 0) {
    std::fputs(kUsage, stderr);
    return 2;
  }

  auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
  std::string response;

  if (drain) {
    grpc::Status st = Call(&stub, "/pinfer.worker.v1.GpuWorker/Drain", "", deadline, &response);
    while (st.ok()) {
      st = Call(&stub, "/pinfer.worker.v1.GpuWorker/Check", "", deadline, &response);
      if (!st.ok()) break;
      const int64_t running = DecodeVarintField(response, 3);  // running_sequences
      if (running == 0) {
        std::printf("%s: drained\n", addr.c_str());
        return 0;
      }
      if (std::chrono::system_clock::now() >= deadline) {
        std::fprintf(stderr, "pinfer-health-probe: %s: %lld sequence(s) still running\n",
                     addr.c_str(), static_cast<long long>(running));
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    std::fprintf(stderr, "pinfer-health-probe: %s: drain failed: %d %s\n", addr.c_str(),
                 static_cast<int>(st.error_code()), st.error_message().c_str());
    return 1;
  }

  grpc::Status st =
      Call(&stub, "/grpc.health.v1.Health/Check", EncodeRequest(service), deadline, &response);
  if (!st.ok()) {
    std::fprintf(stderr, "pinfer-health-probe: %s: rpc failed: %d %s\n", addr.c_str(),
                 static_cast<int>(st.error_code()), st.error_message().c_str());
    return 1;
  }
  const int64_t serving = DecodeVarintField(response, 1);
  std::printf("%s%s%s: %s\n", addr.c_str(), service.empty() ? "" : " ", service.c_str(),
              StatusName(static_cast<int>(serving)));
  return serving == 1 ? 0 : 1;
}
