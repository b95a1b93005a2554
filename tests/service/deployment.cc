// See deployment.h.
#include "tests/service/deployment.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "shared/shm/segment.h"

namespace pinfer::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::string Bin(const std::string& name) { return std::string(PINFER_BINARY_DIR) + "/bin/" + name; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<MetricMap> ScrapeMetrics(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to metrics port ", port));
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!::write(fd, req.data(), req.size());
  std::string resp;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  const size_t body = resp.find("\r\n\r\n");
  if (resp.rfind("HTTP/1.", 0) != 0 || resp.find(" 200 ") == std::string::npos ||
      body == std::string::npos) {
    return absl::InternalError(absl::StrCat("bad /metrics response: ", resp.substr(0, 200)));
  }
  MetricMap m;
  std::istringstream lines(resp.substr(body + 4));
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) return absl::InternalError(absl::StrCat("bad line: ", line));
    double v;
    if (!absl::SimpleAtod(line.substr(sp + 1), &v)) {
      return absl::InternalError(absl::StrCat("bad value: ", line));
    }
    m[line.substr(0, sp)] = v;
  }
  return m;
}

double MetricSum(const MetricMap& m, const std::string& name, const std::string& label_filter) {
  double sum = 0;
  for (const auto& [k, v] : m) {
    const std::string base = k.substr(0, k.find('{'));
    if (base != name) continue;
    if (!label_filter.empty() && k.find(label_filter) == std::string::npos) continue;
    sum += v;
  }
  return sum;
}

Deployment::Deployment(DeploymentOptions o) : o_(std::move(o)) {
  char tmpl[] = "/tmp/pinfer-svc-test-XXXXXX";
  dir_ = ::mkdtemp(tmpl);
  segment_ = shm::UniqueSegmentName();
}

Deployment::~Deployment() {
  Reap(&gateway_pid_, SIGKILL);
  Reap(&gpu_pid_, SIGKILL);
  Reap(&cpu_pid_, SIGKILL);
  ::shm_unlink(segment_.c_str());
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

void Deployment::Reap(pid_t* pid, int sig) {
  if (*pid <= 0) return;
  ::kill(*pid, sig);
  ::waitpid(*pid, nullptr, 0);
  *pid = -1;
}

pid_t Deployment::Spawn(const std::string& name, std::vector<std::string> argv) {
  const std::string log = absl::StrCat(dir_, "/", name, ".log");
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  ::dup2(fd, 1);
  ::dup2(fd, 2);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  ::execv(args[0], args.data());
  ::_exit(127);
}

absl::StatusOr<int> Deployment::WaitPortFile(const std::string& path, pid_t pid) {
  const auto end = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < end) {
    int port;
    if (absl::SimpleAtoi(ReadFile(path), &port) && port > 0) return port;
    int status;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      return absl::InternalError(
          absl::StrCat("process exited before writing ", path, "\n", Logs()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("no ", path, "\n", Logs()));
}

absl::Status Deployment::StartGpuWorker() {
  const std::string port_file = absl::StrCat(dir_, "/gpu.port", restarts_);
  const std::string mport_file = absl::StrCat(dir_, "/gpu.mport", restarts_++);
  std::vector<std::string> argv = {Bin("pinfer-gpu-worker"),
                                   "--model",
                                   o_.model,
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--port-file",
                                   port_file,
                                   "--segment",
                                   segment_,
                                   "--metrics-port",
                                   "127.0.0.1:0",
                                   "--metrics-port-file",
                                   mport_file,
                                   "--liveness-ms",
                                   absl::StrCat(o_.liveness_ms)};
  if (o_.hot_fraction >= 0) {
    argv.insert(argv.end(), {"--hot-fraction", absl::StrCat(o_.hot_fraction)});
  }
  argv.insert(argv.end(), o_.gpu_flags.begin(), o_.gpu_flags.end());
  gpu_pid_ = Spawn("gpu-worker", argv);
  auto port = WaitPortFile(port_file, gpu_pid_);
  if (!port.ok()) return port.status();
  gpu_port_ = *port;
  auto mport = WaitPortFile(mport_file, gpu_pid_);
  if (!mport.ok()) return mport.status();
  gpu_metrics_port_ = *mport;
  gpu_stub_ = worker::v1::GpuWorker::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", gpu_port_), grpc::InsecureChannelCredentials()));
  return absl::OkStatus();
}

absl::Status Deployment::StartCpuWorker() {
  const std::string mport_file = absl::StrCat(dir_, "/cpu.mport", restarts_++);
  std::vector<std::string> argv = {Bin("pinfer-cpu-worker"),
                                   "--model",
                                   o_.model,
                                   "--segment",
                                   segment_,
                                   "--metrics-port",
                                   "127.0.0.1:0",
                                   "--metrics-port-file",
                                   mport_file,
                                   "--liveness-ms",
                                   absl::StrCat(o_.liveness_ms)};
  argv.insert(argv.end(), o_.cpu_flags.begin(), o_.cpu_flags.end());
  cpu_pid_ = Spawn("cpu-worker", argv);
  auto mport = WaitPortFile(mport_file, cpu_pid_);
  if (!mport.ok()) return mport.status();
  cpu_metrics_port_ = *mport;
  return absl::OkStatus();
}

absl::Status Deployment::StartGateway() {
  const std::string port_file = absl::StrCat(dir_, "/gateway.port", restarts_);
  const std::string mport_file = absl::StrCat(dir_, "/gateway.mport", restarts_++);
  std::vector<std::string> argv = {Bin("pinfer-gateway"),
                                   "--workers",
                                   absl::StrCat("127.0.0.1:", gpu_port_),
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--port-file",
                                   port_file,
                                   "--metrics-port",
                                   "127.0.0.1:0",
                                   "--metrics-port-file",
                                   mport_file,
                                   "--health-interval-ms",
                                   "100"};
  argv.insert(argv.end(), o_.gateway_flags.begin(), o_.gateway_flags.end());
  gateway_pid_ = Spawn("gateway", argv);
  auto port = WaitPortFile(port_file, gateway_pid_);
  if (!port.ok()) return port.status();
  gateway_port_ = *port;
  auto mport = WaitPortFile(mport_file, gateway_pid_);
  if (!mport.ok()) return mport.status();
  gateway_metrics_port_ = *mport;
  channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", gateway_port_),
                                 grpc::InsecureChannelCredentials());
  stub_ = v1::Inference::NewStub(channel_);
  return absl::OkStatus();
}

absl::Status Deployment::Start() {
  if (absl::Status st = StartGpuWorker(); !st.ok()) return st;
  if (absl::Status st = StartCpuWorker(); !st.ok()) return st;
  if (absl::Status st = StartGateway(); !st.ok()) return st;
  return WaitHealth("SERVING", std::chrono::seconds(60));
}

void Deployment::KillGpuWorker(int sig) { Reap(&gpu_pid_, sig); }
void Deployment::KillCpuWorker(int sig) { Reap(&cpu_pid_, sig); }
void Deployment::KillGateway(int sig) { Reap(&gateway_pid_, sig); }

int Deployment::WaitGateway(std::chrono::milliseconds timeout) {
  const auto end = Clock::now() + timeout;
  while (Clock::now() < end) {
    int status;
    if (::waitpid(gateway_pid_, &status, WNOHANG) == gateway_pid_) {
      gateway_pid_ = -1;
      return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

std::string Deployment::Health(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, req, &resp).ok()) return "";
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
}

std::string Deployment::GpuWorkerHealth(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", gpu_port_), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, req, &resp).ok()) return "";
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
}

absl::Status Deployment::WaitHealth(const std::string& want, std::chrono::milliseconds timeout) {
  const auto end = Clock::now() + timeout;
  std::string got;
  while (Clock::now() < end) {
    got = Health();
    if (got == want) return absl::OkStatus();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("health is '", got, "', wanted ", want, "\n", Logs()));
}

std::string Deployment::Logs() const {
  std::string out;
  for (const char* name : {"gateway", "gpu-worker", "cpu-worker"}) {
    std::string log = ReadFile(absl::StrCat(dir_, "/", name, ".log"));
    if (log.size() > 3000) log = "..." + log.substr(log.size() - 3000);
    absl::StrAppend(&out, "--- ", name, " ---\n", log);
  }
  return out;
}

GenerateResult RunGenerate(v1::Inference::Stub& stub, const v1::GenerateRequest& req,
                           std::chrono::milliseconds timeout) {
  GenerateResult r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    for (const auto& t : resp.tokens()) {
      r.ids.push_back(t.id());
      r.text += t.text();
    }
    r.last = resp;
    r.messages += 1;
  }
  r.status = reader->Finish();
  return r;
}

}  // namespace pinfer::testing
