// pinfer-health-probe: asks a gRPC server for its grpc.health.v1.Health status and exits 0 when it
// is SERVING, 1 otherwise. Container healthchecks (Dockerfile HEALTHCHECK, compose healthcheck)
// run it inside the image; Debian has no grpc_health_probe package, and the pinfer processes
// serve the standard health service, so a tiny client is all that is needed.
//
// The two health messages are encoded by hand (one string field in, one enum field out) so the
// probe needs neither health.proto nor generated code: it links only grpc++.
//
// usage: pinfer-health-probe --addr HOST:PORT [--service NAME] [--timeout SECONDS]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"

namespace {

constexpr char kUsage[] =
    "usage: pinfer-health-probe --addr HOST:PORT [--service NAME] [--timeout SECONDS]\n"
    "exits 0 when the server's grpc.health.v1.Health/Check says SERVING, 1 otherwise\n";

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

// HealthCheckResponse { ServingStatus status = 1; }: returns the status (0 when absent, which is
// UNKNOWN), or -1 when the bytes are not that message.
int DecodeStatus(const std::string& bytes) {
  int status = 0;
  size_t i = 0;
  while (i < bytes.size()) {
    uint8_t key = static_cast<uint8_t>(bytes[i++]);
    if ((key & 7) != 0) return -1;  // Only varint fields are expected.
    uint64_t v = 0;
    int shift = 0;
    while (true) {
      if (i >= bytes.size() || shift > 63) return -1;
      uint8_t b = static_cast<uint8_t>(bytes[i++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      shift += 7;
      if ((b & 0x80) == 0) break;
    }
    if ((key >> 3) == 1) status = static_cast<int>(v);
  }
  return status;
}

const char* StatusName(int s) {
  switch (s) {
    case 0: return "UNKNOWN";
    case 1: return "SERVING";
    case 2: return "NOT_SERVING";
    case 3: return "SERVICE_UNKNOWN";
    default: return "INVALID";
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string addr, service;
  double timeout = 3;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    size_t eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (a != "--help" && a != "-h") {
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
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
  // Wait for the connection within the deadline instead of failing on the first refused attempt,
  // so a server that is just starting is reported by its status, not by a connect race.
  ctx.set_wait_for_ready(true);

  std::string request = EncodeRequest(service);
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request_buffer, &cq);
  call->StartCall();
  grpc::ByteBuffer response_buffer;
  grpc::Status status;
  call->Finish(&response_buffer, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) {
    std::fprintf(stderr, "pinfer-health-probe: %s: call did not complete\n", addr.c_str());
    return 1;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "pinfer-health-probe: %s: rpc failed: %d %s\n", addr.c_str(),
                 static_cast<int>(status.error_code()), status.error_message().c_str());
    return 1;
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response_buffer.Dump(&slices).ok()) {
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  int serving = DecodeStatus(bytes);
  std::printf("%s%s%s: %s\n", addr.c_str(), service.empty() ? "" : " ", service.c_str(),
              StatusName(serving));
  return serving == 1 ? 0 : 1;
}
