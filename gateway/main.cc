// pinfer-gateway: serves the public API (pinfer.v1.Inference, grpc.health.v1.Health, server
// reflection) and routes each Generate and Chat to a gpu-worker, which streams tokens back. The
// gateway holds no model: it validates requests, queues them (bounded), picks the least-loaded
// healthy worker pair, forwards the stream with the client's deadline and cancellation, and
// records the service metrics (Generate and Chat alike). It polls every worker's health; a worker
// whose process is gone, or whose cpu-worker is gone, takes no requests, and with none left the
// health service reports NOT_SERVING until one comes back. SIGTERM stops new requests, drains
// running ones (with a timeout) and exits.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cli/flags.h"
#include "gateway/http/openai_http.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "pinfer/v1/inference.grpc.pb.h"
#include "pinfer/worker/v1/worker.grpc.pb.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "shared/metrics/metrics.h"
#include "shared/service/grpc_convert.h"
#include "shared/service/log.h"
#include "shared/util/mapped_file.h"
#include "shared/util/status_macros.h"

namespace pinfer::gateway {
namespace {

namespace wv1 = ::pinfer::worker::v1;
using Clock = std::chrono::steady_clock;

constexpr char kUsage[] =
    "usage: pinfer-gateway --workers ADDR[,ADDR...] [--listen ADDR] [--port-file FILE]\n"
    "         [--metrics-port P] [--metrics-port-file FILE] [--max-running N] [--max-queue N]\n"
    "         [--max-new-tokens-limit N] [--default-max-new-tokens N] [--drain-timeout-ms MS]\n"
    "         [--health-interval-ms MS] [--http-port P] [--http-port-file FILE]\n"
    "         [--api-key KEY | --api-key-file FILE]\n"
    "  --workers: gpu-worker control addresses (host:port or unix:/path), one per worker pair\n"
    "  --listen: public address (default 0.0.0.0:50051; port 0 picks one, see --port-file)\n"
    "  --max-running: requests forwarded to each worker pair at once (default 16)\n"
    "  --http-port: the OpenAI-compatible HTTP API and chat page (off unless given; 0 picks one,\n"
    "               see --http-port-file); --api-key(-file): /v1/ asks for it as a Bearer token\n"
    "  --max-queue: requests allowed to wait beyond that; more get RESOURCE_EXHAUSTED (64)\n";

struct Options {
  std::vector<std::string> workers;
  std::string listen = "0.0.0.0:50051", port_file, metrics_port, metrics_port_file;
  int max_running = 16, max_queue = 64;
  int max_new_tokens_limit = 4096, default_max_new_tokens = 128;
  int64_t drain_timeout_ms = 30000, health_interval_ms = 200;
  int http_port = -1;  // -1: no HTTP API
  std::string http_port_file, api_key;
};

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(
      cli::Flags f,
      cli::Flags::Parse(args,
                        {"workers", "listen", "port-file", "metrics-port", "metrics-port-file",
                         "max-running", "max-queue", "max-new-tokens-limit",
                         "default-max-new-tokens", "drain-timeout-ms", "health-interval-ms", "http-port", "http-port-file", "api-key",
                         "api-key-file"},
                        {}));
  Options o;
  ASSIGN_OR_RETURN(std::string workers, f.Required("workers"));
  for (absl::string_view w : absl::StrSplit(workers, ',', absl::SkipEmpty())) {
    o.workers.emplace_back(w);
  }
  if (o.workers.empty()) return absl::InvalidArgumentError("--workers lists no address");
  if (auto v = f.Get("listen")) o.listen = *v;
  if (auto v = f.Get("port-file")) o.port_file = *v;
  if (auto v = f.Get("metrics-port")) o.metrics_port = *v;
  if (auto v = f.Get("metrics-port-file")) o.metrics_port_file = *v;
  ASSIGN_OR_RETURN(int64_t mr, f.Int("max-running", 16));
  ASSIGN_OR_RETURN(int64_t mq, f.Int("max-queue", 64));
  ASSIGN_OR_RETURN(int64_t lim, f.Int("max-new-tokens-limit", 4096));
  ASSIGN_OR_RETURN(int64_t def, f.Int("default-max-new-tokens", 128));
  ASSIGN_OR_RETURN(o.drain_timeout_ms, f.Int("drain-timeout-ms", 30000));
  ASSIGN_OR_RETURN(o.health_interval_ms, f.Int("health-interval-ms", 200));
  ASSIGN_OR_RETURN(int64_t http_port, f.Int("http-port", -1));
  if (http_port < -1 || http_port > 65535) {
    return absl::InvalidArgumentError("--http-port must be in [0, 65535]");
  }
  o.http_port = static_cast<int>(http_port);
  if (auto v = f.Get("http-port-file")) o.http_port_file = *v;
  if (auto v = f.Get("api-key")) o.api_key = *v;
  if (auto v = f.Get("api-key-file")) {
    // A file keeps the key out of the process list; surrounding white space is not part of it.
    ASSIGN_OR_RETURN(std::string key, ReadFileToString(*v));
    o.api_key = std::string(absl::StripAsciiWhitespace(key));
    if (o.api_key.empty()) return absl::InvalidArgumentError("--api-key-file holds no key");
  }
  if (mr < 1 || mr > 100000) return absl::InvalidArgumentError("--max-running out of range");
  if (mq < 0 || mq > 1000000) return absl::InvalidArgumentError("--max-queue out of range");
  if (lim < 1 || lim > (1 << 24))
    return absl::InvalidArgumentError("--max-new-tokens-limit out of range");
  if (def < 1 || def > lim)
    return absl::InvalidArgumentError("--default-max-new-tokens out of range");
  if (o.health_interval_ms < 10)
    return absl::InvalidArgumentError("--health-interval-ms too small");
  o.max_running = static_cast<int>(mr);
  o.max_queue = static_cast<int>(mq);
  o.max_new_tokens_limit = static_cast<int>(lim);
  o.default_max_new_tokens = static_cast<int>(def);
  return o;
}

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One gpu-worker (with its cpu-worker behind it).
struct Worker {
  std::string address;
  std::unique_ptr<wv1::GpuWorker::Stub> stub;
  // Guarded by Pool::mu_.
  bool healthy = false;
  std::string problem = "not checked yet";
  int running = 0;
  bool has_info = false;
  v1::ModelInfo info;
};

// The worker pairs, their health, and the admission queue in front of them.
class Pool {
 public:
  Pool(const Options& o) : o_(o) {
    for (const std::string& a : o.workers) {
      auto w = std::make_unique<Worker>();
      w->address = a;
      grpc::ChannelArguments args;
      // Reconnect quickly after a worker restarts.
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      w->stub = wv1::GpuWorker::NewStub(
          grpc::CreateCustomChannel(a, grpc::InsecureChannelCredentials(), args));
      workers_.push_back(std::move(w));
    }
  }

  // Polls every worker once; returns whether any is healthy.
  bool CheckAll() {
    bool any = false;
    for (auto& w : workers_) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1000));
      wv1::CheckResponse resp;
      grpc::Status st = w->stub->Check(&ctx, wv1::CheckRequest(), &resp);
      bool healthy = false;
      std::string problem;
      if (!st.ok()) {
        problem = absl::StrCat("gpu-worker ", w->address, " unreachable: ", st.error_message());
      } else if (resp.state() != wv1::WORKER_STATE_READY || !resp.peer_alive()) {
        problem = absl::StrCat("gpu-worker ", w->address,
                               " not ready: ", wv1::WorkerState_Name(resp.state()),
                               resp.message().empty() ? "" : ": ", resp.message());
      } else {
        healthy = true;
      }
      bool need_info = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (healthy != w->healthy || problem != w->problem) {
          Log("%s", healthy ? absl::StrCat("gpu-worker ", w->address, " is healthy").c_str()
                            : problem.c_str());
        }
        w->healthy = healthy;
        w->problem = problem;
        need_info = healthy && !w->has_info;
      }
      if (need_info) {
        grpc::ClientContext ictx;
        ictx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
        wv1::WorkerInfo info;
        if (w->stub->GetInfo(&ictx, wv1::InfoRequest(), &info).ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          w->info = info.model();
          w->has_info = true;
        }
      }
      any = any || healthy;
    }
    cv_.notify_all();
    return any;
  }

  std::string Problems() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> p;
    for (auto& w : workers_) p.push_back(w->problem);
    return absl::StrJoin(p, "; ");
  }

  // Waits for a slot on a healthy worker, in arrival order. Errors: RESOURCE_EXHAUSTED (queue
  // full), UNAVAILABLE (no healthy worker, draining), DEADLINE_EXCEEDED, CANCELLED.
  absl::StatusOr<Worker*> Acquire(grpc::ServerContext* ctx) {
    std::unique_lock<std::mutex> lock(mu_);
    if (draining_) return absl::UnavailableError("the server is shutting down");
    if (!AnyHealthyAfterRecheckLocked(lock)) {
      return absl::UnavailableError(absl::StrCat("no healthy worker: ", ProblemsLocked()));
    }
    Worker* w = PickLocked();
    if (w != nullptr && queue_.empty()) {
      w->running += 1;
      running_ += 1;
      return w;
    }
    if (static_cast<int>(queue_.size()) >= o_.max_queue) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the queue is full (", queue_.size(), " waiting, ", running_, " running)"));
    }
    const uint64_t ticket = next_ticket_++;
    queue_.push_back(ticket);
    auto leave = [&] { queue_.erase(std::find(queue_.begin(), queue_.end(), ticket)); };
    for (;;) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      if (ctx->IsCancelled()) {
        leave();
        cv_.notify_all();
        return absl::CancelledError("cancelled while queued");
      }
      if (ctx->deadline() < std::chrono::system_clock::now()) {
        leave();
        cv_.notify_all();
        return absl::DeadlineExceededError("deadline exceeded while queued");
      }
      if (draining_) {
        leave();
        return absl::UnavailableError("the server is shutting down");
      }
      if (!AnyHealthyAfterRecheckLocked(lock)) {
        leave();
        return absl::UnavailableError(absl::StrCat("no healthy worker: ", ProblemsLocked()));
      }
      if (queue_.front() != ticket) continue;
      w = PickLocked();
      if (w != nullptr) {
        leave();
        w->running += 1;
        running_ += 1;
        cv_.notify_all();  // the next in line may fit too
        return w;
      }
    }
  }

  void Release(Worker* w) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      w->running -= 1;
      running_ -= 1;
    }
    cv_.notify_all();
  }

  // A worker failed a request with UNAVAILABLE: re-check health now instead of at the next
  // interval, so that routing and the health service follow quickly.
  void RequestCheck() {
    {
      std::lock_guard<std::mutex> lock(check_mu_);
      check_requested_ = true;
    }
    check_cv_.notify_all();
  }
  // Sleeps until the next health check is due (or requested, or `stop`).
  void WaitForCheck(std::chrono::milliseconds interval, const std::atomic<bool>& stop) {
    std::unique_lock<std::mutex> lock(check_mu_);
    check_cv_.wait_for(lock, interval, [&] { return check_requested_ || stop.load(); });
    check_requested_ = false;
  }
  void WakeChecker() { check_cv_.notify_all(); }

  Worker* AnyHealthy() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : workers_) {
      if (w->healthy) return w.get();
    }
    return nullptr;
  }

  bool ModelInfo(v1::ModelInfo* info) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : workers_) {
      if (w->has_info) {
        *info = w->info;
        return true;
      }
    }
    return false;
  }

  void StartDraining() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      draining_ = true;
    }
    cv_.notify_all();
  }
  int running() {
    std::lock_guard<std::mutex> lock(mu_);
    return running_;
  }
  int waiting() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(queue_.size());
  }

 private:
  bool AnyHealthyLocked() {
    for (auto& w : workers_) {
      if (w->healthy) return true;
    }
    return false;
  }
  // The health a request is refused on must be current: the periodic check may have caught a
  // worker pair in the moment its restarted cpu-worker was still loading, and would refuse
  // requests until the next interval although the pair is ready. So a refusal first asks the
  // workers again (a Check is a local RPC of well under a millisecond).
  bool AnyHealthyAfterRecheckLocked(std::unique_lock<std::mutex>& lock) {
    if (AnyHealthyLocked()) return true;
    lock.unlock();
    if (CheckAll()) RequestCheck();  // the health service follows now, not at the interval
    lock.lock();
    return AnyHealthyLocked();
  }
  std::string ProblemsLocked() {
    std::vector<std::string> p;
    for (auto& w : workers_) p.push_back(w->problem);
    return absl::StrJoin(p, "; ");
  }
  // The healthy worker with the fewest running requests and a free slot.
  Worker* PickLocked() {
    Worker* best = nullptr;
    for (auto& w : workers_) {
      if (!w->healthy || w->running >= o_.max_running) continue;
      if (best == nullptr || w->running < best->running) best = w.get();
    }
    return best;
  }

  const Options& o_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<uint64_t> queue_;
  uint64_t next_ticket_ = 0;
  int running_ = 0;
  bool draining_ = false;
  std::mutex check_mu_;
  std::condition_variable check_cv_;
  bool check_requested_ = false;
};

struct Metrics {
  explicit Metrics(prometheus::Registry& r)
      : ttft(prometheus::BuildHistogram()
                 .Name("pinfer_time_to_first_token_seconds")
                 .Help("From arrival at the gateway to the first generated token")
                 .Register(r)
                 .Add({}, metrics::LatencyBuckets())),
        itl(prometheus::BuildHistogram()
                .Name("pinfer_inter_token_latency_seconds")
                .Help("Time between consecutive generated tokens of a stream")
                .Register(r)
                .Add({}, metrics::LatencyBuckets())),
        duration(prometheus::BuildHistogram()
                     .Name("pinfer_request_duration_seconds")
                     .Help("From arrival at the gateway to the end of the response")
                     .Register(r)
                     .Add({}, metrics::LatencyBuckets())),
        queue(prometheus::BuildHistogram()
                  .Name("pinfer_queue_time_seconds")
                  .Help("Time a Generate request waited for a worker slot")
                  .Register(r)
                  .Add({}, metrics::LatencyBuckets())),
        prompt_tokens(prometheus::BuildCounter()
                          .Name("pinfer_prompt_tokens_total")
                          .Help("Prompt tokens of completed requests")
                          .Register(r)
                          .Add({})),
        generation_tokens(prometheus::BuildCounter()
                              .Name("pinfer_generation_tokens_total")
                              .Help("Tokens generated and streamed to clients")
                              .Register(r)
                              .Add({})),
        requests(prometheus::BuildCounter()
                     .Name("pinfer_requests_total")
                     .Help("Completed Generate requests by finish reason")
                     .Register(r)),
        failures(prometheus::BuildCounter()
                     .Name("pinfer_request_failures_total")
                     .Help("Generate requests that ended with an error, by gRPC status code")
                     .Register(r)),
        running(prometheus::BuildGauge()
                    .Name("pinfer_requests_running")
                    .Help("Generate requests being served by a worker")
                    .Register(r)
                    .Add({})),
        waiting(prometheus::BuildGauge()
                    .Name("pinfer_requests_waiting")
                    .Help("Generate requests waiting in the gateway's queue")
                    .Register(r)
                    .Add({})) {
    // Pre-create the label values so that every series exists from the start (dashboards and
    // alert rules see 0 rather than nothing).
    for (const char* reason : {"length", "eos", "stop", "cancelled"}) {
      requests.Add({{"finish_reason", reason}});
    }
    for (auto code : {grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::RESOURCE_EXHAUSTED,
                      grpc::StatusCode::DEADLINE_EXCEEDED, grpc::StatusCode::UNAVAILABLE,
                      grpc::StatusCode::CANCELLED, grpc::StatusCode::INTERNAL}) {
      failures.Add({{"code", StatusCodeLabel(code)}});
    }
  }
  prometheus::Histogram& ttft;
  prometheus::Histogram& itl;
  prometheus::Histogram& duration;
  prometheus::Histogram& queue;
  prometheus::Counter& prompt_tokens;
  prometheus::Counter& generation_tokens;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Family<prometheus::Counter>& failures;
  prometheus::Gauge& running;
  prometheus::Gauge& waiting;
};

class InferenceService final : public v1::Inference::Service {
 public:
  InferenceService(const Options& o, Pool* pool, Metrics* m) : o_(o), pool_(pool), m_(m) {}

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    const Clock::time_point arrival = Clock::now();
    grpc::Status st = Validate(*req);
    if (st.ok()) {
      wv1::RunRequest run;
      if (req->input_case() == v1::GenerateRequest::kTokenIds) {
        *run.mutable_token_ids() = req->token_ids();
      } else {
        run.set_prompt(req->prompt());
      }
      SetRunOptions(*req, &run);
      st = Serve(ctx, run, writer, arrival);
    }
    if (!st.ok()) m_->failures.Add({{"code", StatusCodeLabel(st.error_code())}}).Increment();
    return st;
  }

  // Like Generate, with the prompt rendered by the worker from the messages with the model's
  // chat template; the gateway checks only what needs no template (the messages and roles).
  grpc::Status Chat(grpc::ServerContext* ctx, const v1::ChatRequest* req,
                    grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    const Clock::time_point arrival = Clock::now();
    grpc::Status st = ValidateChat(*req);
    if (st.ok()) {
      wv1::RunRequest run;
      wv1::ChatInput* chat = run.mutable_chat();
      *chat->mutable_messages() = req->messages();
      chat->set_add_generation_prompt(true);
      SetRunOptions(*req, &run);
      st = Serve(ctx, run, writer, arrival);
    }
    if (!st.ok()) m_->failures.Add({{"code", StatusCodeLabel(st.error_code())}}).Increment();
    return st;
  }

  grpc::Status Tokenize(grpc::ServerContext* ctx, const v1::TokenizeRequest* req,
                        v1::TokenizeResponse* resp) override {
    Worker* w = pool_->AnyHealthy();
    if (w == nullptr) return NoWorker();
    auto cctx = grpc::ClientContext::FromServerContext(*ctx);
    return w->stub->Tokenize(cctx.get(), *req, resp);
  }

  grpc::Status Detokenize(grpc::ServerContext* ctx, const v1::DetokenizeRequest* req,
                          v1::DetokenizeResponse* resp) override {
    Worker* w = pool_->AnyHealthy();
    if (w == nullptr) return NoWorker();
    auto cctx = grpc::ClientContext::FromServerContext(*ctx);
    return w->stub->Detokenize(cctx.get(), *req, resp);
  }

  grpc::Status GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                            v1::ModelInfo* info) override {
    if (!pool_->ModelInfo(info)) return NoWorker();
    info->set_max_new_tokens_limit(
        std::min<uint32_t>(info->max_new_tokens_limit(), o_.max_new_tokens_limit));
    return grpc::Status::OK;
  }

 private:
  grpc::Status NoWorker() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("no healthy worker: ", pool_->Problems()));
  }

  // The checks that Generate and Chat share: the token limit and the sampling parameters.
  template <typename Request>
  grpc::Status ValidateOptions(const Request& req) {
    if (req.max_new_tokens() > static_cast<uint32_t>(o_.max_new_tokens_limit)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("max_new_tokens ", req.max_new_tokens(),
                                       " is over the limit of ", o_.max_new_tokens_limit));
    }
    if (req.sampling().temperature() < 0) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("temperature must not be negative, got ", req.sampling().temperature()));
    }
    if (absl::Status st = SamplingFromProto(req.sampling()).Validate(); !st.ok()) {
      return ToGrpcStatus(st);
    }
    return grpc::Status::OK;
  }

  // The generation options that GenerateRequest and ChatRequest have alike.
  template <typename Request>
  void SetRunOptions(const Request& req, wv1::RunRequest* run) {
    run->set_max_new_tokens(req.max_new_tokens() == 0 ? o_.default_max_new_tokens
                                                      : req.max_new_tokens());
    *run->mutable_sampling() = req.sampling();
    *run->mutable_stop() = req.stop();
    run->set_request_id(req.request_id());
    run->set_ignore_eos(req.ignore_eos());
  }

  // The prompt's length is known only after the worker renders it, so the worker checks it
  // against the context length.
  grpc::Status ValidateChat(const v1::ChatRequest& req) {
    if (req.messages().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the conversation has no messages");
    }
    for (int i = 0; i < req.messages_size(); ++i) {
      const std::string& role = req.messages(i).role();
      if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("message ", i, " has the unknown role \"", role,
                                         "\" (system, user, assistant or tool)"));
      }
    }
    return ValidateOptions(req);
  }

  grpc::Status Validate(const v1::GenerateRequest& req) {
    const bool has_ids = req.input_case() == v1::GenerateRequest::kTokenIds;
    if ((has_ids && req.token_ids().ids().empty()) || (!has_ids && req.prompt().empty())) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the prompt is empty");
    }
    if (grpc::Status st = ValidateOptions(req); !st.ok()) return st;
    v1::ModelInfo info;
    if (has_ids && pool_->ModelInfo(&info)) {
      const size_t n = static_cast<size_t>(req.token_ids().ids().size());
      const size_t want =
          n + (req.max_new_tokens() == 0 ? o_.default_max_new_tokens : req.max_new_tokens());
      if (want > info.context_length()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("prompt (", n,
                                         " tokens) plus max_new_tokens exceeds "
                                         "the context length of ",
                                         info.context_length()));
      }
      for (uint32_t id : req.token_ids().ids()) {
        if (id >= info.vocab_size()) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              absl::StrCat("token id ", id, " is outside the vocabulary"));
        }
      }
    }
    return grpc::Status::OK;
  }

  // Queues a validated request for a worker slot and forwards it: the part of Generate and
  // Chat after their requests became a RunRequest.
  grpc::Status Serve(grpc::ServerContext* ctx, const wv1::RunRequest& run,
                     grpc::ServerWriter<v1::GenerateResponse>* writer, Clock::time_point arrival) {
    m_->waiting.Set(pool_->waiting() + 1);
    absl::StatusOr<Worker*> acquired = pool_->Acquire(ctx);
    m_->waiting.Set(pool_->waiting());
    if (!acquired.ok()) return ToGrpcStatus(acquired.status());
    Worker* w = *acquired;
    m_->running.Set(pool_->running());
    const double queue_seconds = Since(arrival);
    m_->queue.Observe(queue_seconds);
    grpc::Status st = Forward(ctx, run, writer, w, arrival, queue_seconds);
    pool_->Release(w);
    m_->running.Set(pool_->running());
    return st;
  }

  grpc::Status Forward(grpc::ServerContext* ctx, const wv1::RunRequest& run,
                       grpc::ServerWriter<v1::GenerateResponse>* writer, Worker* w,
                       Clock::time_point arrival, double queue_seconds) {
    // Carries the client's deadline, and cancels the worker's call when the client cancels.
    std::unique_ptr<grpc::ClientContext> cctx = grpc::ClientContext::FromServerContext(*ctx);
    std::unique_ptr<grpc::ClientReader<wv1::RunEvent>> reader = w->stub->Run(cctx.get(), run);
    wv1::RunEvent ev;
    Clock::time_point last_token, first_token;
    bool first = true;
    uint32_t generated = 0, prompt_tokens = 0, cached_prompt_tokens = 0;
    v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
    while (reader->Read(&ev)) {
      v1::GenerateResponse out;
      out.set_request_id(run.request_id());
      for (const v1::Token& t : ev.tokens()) *out.add_tokens() = t;
      const int k = ev.tokens_size();
      if (k > 0) {
        const Clock::time_point now = Clock::now();
        if (first) {
          m_->ttft.Observe(std::chrono::duration<double>(now - arrival).count());
          first = false;
          first_token = now;
          for (int i = 1; i < k; ++i) m_->itl.Observe(0);
        } else {
          const double gap = std::chrono::duration<double>(now - last_token).count() / k;
          for (int i = 0; i < k; ++i) m_->itl.Observe(gap);
        }
        last_token = now;
        m_->generation_tokens.Increment(k);
      }
      generated = ev.generated_tokens();
      prompt_tokens = ev.prompt_tokens();
      cached_prompt_tokens = ev.cached_prompt_tokens();
      if (ev.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
        finish = ev.finish_reason();
        out.set_finish_reason(finish);
        out.mutable_usage()->set_prompt_tokens(prompt_tokens);
        out.mutable_usage()->set_generated_tokens(generated);
        out.mutable_usage()->set_cached_prompt_tokens(cached_prompt_tokens);
        v1::Timings* t = out.mutable_timings();
        t->set_queue_seconds(queue_seconds);
        t->set_time_to_first_token_seconds(
            first ? 0 : std::chrono::duration<double>(first_token - arrival).count());
        t->set_total_seconds(Since(arrival));
      }
      if (!writer->Write(out)) {
        cctx->TryCancel();
        (void)reader->Finish();
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      }
    }
    grpc::Status st = reader->Finish();
    if (!st.ok()) {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      if (st.error_code() == grpc::StatusCode::UNAVAILABLE) pool_->RequestCheck();
      return st;
    }
    if (finish == v1::FINISH_REASON_UNSPECIFIED) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "the worker ended the stream early");
    }
    m_->requests.Add({{"finish_reason", FinishReasonLabel(finish)}}).Increment();
    m_->prompt_tokens.Increment(prompt_tokens);
    m_->duration.Observe(Since(arrival));
    return grpc::Status::OK;
  }

  const Options& o_;
  Pool* pool_;
  Metrics* m_;
};

int Main(const std::vector<std::string>& args) {
  SetLogRole("gateway");
  InstallShutdownHandlers();
  auto parsed = ParseOptions(args);
  if (!parsed.ok()) {
    std::fprintf(stderr, "pinfer-gateway: %s\n%s", std::string(parsed.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  const Options o = *parsed;
  auto registry = std::make_shared<prometheus::Registry>();
  Metrics m(*registry);
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
  Pool pool(o);
  auto gauges = std::make_shared<metrics::ScrapeGauges>();
  gauges->Add({"pinfer_gateway_resident_bytes", "Resident memory of the gateway process", {}, [] {
                 return static_cast<double>(ResidentBytes());
               }});
  if (endpoint != nullptr) endpoint->Add(gauges);

  InferenceService service(o, &pool, &m);
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
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  auto set_serving = [&](bool serving) {
    health->SetServingStatus("", serving);
    health->SetServingStatus("pinfer.v1.Inference", serving);
  };
  set_serving(pool.CheckAll());
  Log("serving pinfer.v1.Inference on %s (port %d) for %zu worker pair(s)", o.listen.c_str(), port,
      o.workers.size());
  if (!o.port_file.empty()) (void)WriteFileAtomically(o.port_file, absl::StrCat(port, "\n"));
  // The HTTP API calls this server in-process, so it shares the queue, limits and metrics.
  std::unique_ptr<OpenAiHttpServer> http;
  if (o.http_port >= 0) {
    HttpOptions ho;
    ho.port = o.http_port;
    // The same interface as the gRPC port (--listen 127.0.0.1:P keeps HTTP local too).
    if (const size_t colon = o.listen.rfind(':');
        colon != std::string::npos && colon > 0 && o.listen.rfind("unix:", 0) != 0) {
      const std::string host = o.listen.substr(0, colon);
      ho.host = std::string(absl::StripSuffix(absl::StripPrefix(host, "["), "]"));
    }
    ho.api_key = o.api_key;
    auto started = OpenAiHttpServer::Start(
        ho, server->InProcessChannel(grpc::ChannelArguments()), registry.get());
    if (!started.ok()) {
      Log("%s", std::string(started.status().message()).c_str());
      return 1;
    }
    http = *std::move(started);
    Log("OpenAI-compatible HTTP API on port %d%s", http->port(),
        o.api_key.empty() ? "" : " (API key required)");
    if (!o.http_port_file.empty()) {
      (void)WriteFileAtomically(o.http_port_file, absl::StrCat(http->port(), "\n"));
    }
  }

  std::atomic<bool> stop_health{false};
  std::thread health_thread([&] {
    bool last = false;
    while (!stop_health.load()) {
      const bool serving = pool.CheckAll();
      if (!stop_health.load()) set_serving(serving);
      if (serving != last) Log("health: %s", serving ? "SERVING" : "NOT_SERVING");
      last = serving;
      pool.WaitForCheck(std::chrono::milliseconds(o.health_interval_ms), stop_health);
    }
  });

  WaitForShutdown();
  Log("shutting down: draining %d running and %d waiting request(s) (up to %lld ms)",
      pool.running(), pool.waiting(), static_cast<long long>(o.drain_timeout_ms));
  stop_health.store(true);
  pool.WakeChecker();
  health_thread.join();
  set_serving(false);
  pool.StartDraining();
  const auto end = Clock::now() + std::chrono::milliseconds(o.drain_timeout_ms);
  while ((pool.running() > 0 || pool.waiting() > 0) && Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (pool.running() > 0) Log("drain timeout: cancelling %d request(s)", pool.running());
  if (http != nullptr) http->Stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  Log("stopped");
  return 0;
}

}  // namespace
}  // namespace pinfer::gateway

int main(int argc, char** argv) {
  return pinfer::gateway::Main(std::vector<std::string>(argv + 1, argv + argc));
}
