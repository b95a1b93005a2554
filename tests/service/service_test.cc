// Integration tests of the service: real gateway, gpu-worker and cpu-worker processes on port 0
// with a fresh shared-memory segment. Outputs are checked against independent references (the
// transformers library's greedy tokens in reference.json, llama.cpp's continuations for
// stories260K) and against the in-process engine; failure behaviour (invalid requests, full
// queue, deadlines, cancellation, killed workers, drain on SIGTERM) is checked by status code
// and message.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "gmock/gmock.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shared/engine/generator.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"
#include "shared/sparse/prepared_model.h"
#include "shared/sparse/sparse_runtime.h"
#include "tests/service/deployment.h"

namespace pinfer::testing {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

const std::string kTiny = std::string(PINFER_MODELS_DIR) + "/relu-llama-tiny";

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Polls `pred` for up to two seconds.
bool Eventually(const std::function<bool()>& pred) {
  const auto t0 = Clock::now();
  while (Since(t0) < 2.0) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

v1::GenerateRequest GreedyRequest(const std::string& prompt, int n) {
  v1::GenerateRequest req;
  req.set_prompt(prompt);
  req.set_max_new_tokens(n);
  req.set_ignore_eos(true);
  return req;
}

std::vector<uint32_t> U32(const nlohmann::json& j) {
  std::vector<uint32_t> v;
  for (const auto& x : j) v.push_back(x.get<uint32_t>());
  return v;
}

// The in-process engine's greedy continuation (48 tokens, no EOS stop), the service's reference.
std::vector<uint32_t> EngineGreedy(const Model& m, const std::vector<int32_t>& prompt, int n) {
  auto ops = NewSimdOps(nullptr);
  Transformer t(m, *ops);
  GenerateOptions opts;
  opts.max_new_tokens = n;
  opts.stop_at_eos = false;
  auto r = Generate(t, *m.tokenizer, prompt, opts, nullptr);
  EXPECT_TRUE(r.ok()) << r.status();
  std::vector<uint32_t> out;
  if (r.ok()) {
    for (int32_t id : r->ids) out.push_back(static_cast<uint32_t>(id));
  }
  return out;
}

// One deployment shared by the non-destructive tests.
class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    DeploymentOptions o;
    o.model = kTiny;
    o.hot_fraction = 0.5;
    o.gateway_flags = {"--max-running", "32", "--max-queue", "64"};
    d_ = new Deployment(o);
    absl::Status st = d_->Start();
    ASSERT_TRUE(st.ok()) << st;
    ref_ = new nlohmann::json(ReadJson(kTiny + "/reference.json"));
  }
  static void TearDownTestSuite() {
    delete d_;
    delete ref_;
  }
  void SetUp() override {
    if (d_ == nullptr || d_->gateway_pid() <= 0) GTEST_SKIP() << "deployment did not start";
  }
  static Deployment* d_;
  static nlohmann::json* ref_;
};
Deployment* ServiceTest::d_ = nullptr;
nlohmann::json* ServiceTest::ref_ = nullptr;

TEST_F(ServiceTest, GreedyTokensMatchReferenceAndInProcessEngine) {
  auto model = LoadModel(kTiny);
  ASSERT_TRUE(model.ok());
  const auto& prompts = (*ref_)["prompts"];
  ASSERT_EQ(prompts.size(), 12u);
  for (const auto& p : prompts) {
    const std::string text = p["prompt"];
    SCOPED_TRACE(text);
    const std::vector<uint32_t> want = U32(p["greedy_ids"]);
    // The gateway tokenizes like transformers did (BOS + sentencepiece).
    grpc::ClientContext tctx;
    v1::TokenizeRequest treq;
    treq.set_text(text);
    treq.set_add_bos(true);
    v1::TokenizeResponse tresp;
    ASSERT_TRUE(d_->stub().Tokenize(&tctx, treq, &tresp).ok());
    EXPECT_EQ(std::vector<uint32_t>(tresp.ids().begin(), tresp.ids().end()), U32(p["input_ids"]));

    GenerateResult r = RunGenerate(d_->stub(), GreedyRequest(text, 48));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << d_->Logs();
    EXPECT_EQ(r.ids, want);
    std::vector<int32_t> prompt_ids;
    for (uint32_t id : U32(p["input_ids"])) prompt_ids.push_back(static_cast<int32_t>(id));
    EXPECT_EQ(r.ids, EngineGreedy(**model, prompt_ids, 48));
    // Streamed, not one message; the last one carries the summary.
    EXPECT_GT(r.messages, 1);
    EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(r.last.usage().prompt_tokens(), p["input_ids"].size());
    EXPECT_EQ(r.last.usage().generated_tokens(), 48u);
    EXPECT_GT(r.last.timings().time_to_first_token_seconds(), 0);
    EXPECT_GE(r.last.timings().total_seconds(), r.last.timings().time_to_first_token_seconds());
    // The streamed texts, appended to the prompt, are the detokenized prompt and output.
    grpc::ClientContext dctx;
    v1::DetokenizeRequest dreq;
    for (uint32_t id : U32(p["input_ids"])) dreq.add_ids(id);
    for (uint32_t id : r.ids) dreq.add_ids(id);
    v1::DetokenizeResponse dresp;
    ASSERT_TRUE(d_->stub().Detokenize(&dctx, dreq, &dresp).ok());
    EXPECT_EQ(text + r.text, dresp.text());
  }
}

TEST_F(ServiceTest, TokenIdInputAndStopStringsAndEos) {
  const auto& p = (*ref_)["prompts"][3];  // "Once upon a time": greedy output contains EOS
  v1::GenerateRequest req;
  for (uint32_t id : U32(p["input_ids"])) req.mutable_token_ids()->add_ids(id);
  req.set_max_new_tokens(48);
  GenerateResult r = RunGenerate(d_->stub(), req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  const std::vector<uint32_t> greedy = U32(p["greedy_ids"]);
  const auto eos_at = std::find(greedy.begin(), greedy.end(), 2u);
  ASSERT_NE(eos_at, greedy.end());
  // Without ignore_eos the stream ends at EOS, with the tokens before it.
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_EOS);
  EXPECT_EQ(r.ids, std::vector<uint32_t>(greedy.begin(), eos_at + 1));

  // A stop string taken from the reference text ends the stream before it.
  const std::string full = p["greedy_text"];
  v1::GenerateRequest sreq = GreedyRequest(p["prompt"], 48);
  const std::string stop = full.substr(10, 4);
  sreq.add_stop(stop);
  GenerateResult s = RunGenerate(d_->stub(), sreq);
  ASSERT_TRUE(s.status.ok());
  EXPECT_EQ(s.last.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(s.text.find(stop), std::string::npos);
  EXPECT_LT(s.ids.size(), 48u);
}

TEST_F(ServiceTest, SixteenConcurrentStreamsAreAllCorrect) {
  const auto& prompts = (*ref_)["prompts"];
  std::vector<GenerateResult> results(16);
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      results[i] = RunGenerate(d_->stub(), GreedyRequest(prompts[i % 12]["prompt"], 48));
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 16; ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(results[i].status.ok()) << results[i].status.error_message();
    EXPECT_EQ(results[i].ids, U32(prompts[i % 12]["greedy_ids"]));
  }
  // The streams' decode steps were batched (continuous batching), yet every output is exact.
  auto m = ScrapeMetrics(d_->gpu_metrics_port());
  ASSERT_TRUE(m.ok());
  const double batches = MetricSum(*m, "pinfer_worker_decode_batch_size_count");
  const double seqs = MetricSum(*m, "pinfer_worker_decode_batch_size_sum");
  EXPECT_GT(batches, 0);
  EXPECT_GT(seqs / batches, 1.5) << "decode steps were not batched";
}

TEST_F(ServiceTest, InvalidRequestsGetInvalidArgument) {
  struct Case {
    std::string name;
    v1::GenerateRequest req;
    std::string message;
  };
  std::vector<Case> cases;
  {
    Case c{"empty prompt", GreedyRequest("", 8), "prompt is empty"};
    cases.push_back(c);
  }
  {
    Case c{"no input", v1::GenerateRequest(), "prompt is empty"};
    cases.push_back(c);
  }
  {
    Case c{"max_new_tokens over the limit", GreedyRequest("Hello", 5000), "over the limit of 4096"};
    cases.push_back(c);
  }
  {
    Case c{"negative temperature", GreedyRequest("Hello", 8), "temperature must not be negative"};
    c.req.mutable_sampling()->set_temperature(-0.5f);
    cases.push_back(c);
  }
  {
    Case c{"top_p out of range", GreedyRequest("Hello", 8), "top_p"};
    c.req.mutable_sampling()->set_top_p(1.5f);
    cases.push_back(c);
  }
  {
    Case c{"token ids longer than the context", v1::GenerateRequest(), "context length of 2048"};
    for (int i = 0; i < 2049; ++i) c.req.mutable_token_ids()->add_ids(100);
    c.req.set_max_new_tokens(1);
    cases.push_back(c);
  }
  {
    std::string longtext;
    for (int i = 0; i < 2100; ++i) longtext += "word ";
    Case c{"text prompt longer than the context", GreedyRequest(longtext, 8),
           "exceeds the context length of 2048"};
    cases.push_back(c);
  }
  {
    Case c{"token id outside the vocabulary", v1::GenerateRequest(), "outside the vocabulary"};
    c.req.mutable_token_ids()->add_ids(1);
    c.req.mutable_token_ids()->add_ids(4096);
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const auto t0 = Clock::now();
    GenerateResult r = RunGenerate(d_->stub(), c.req);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(r.status.error_message(), HasSubstr(c.message));
    EXPECT_TRUE(r.ids.empty());
    EXPECT_LT(Since(t0), 5.0);
  }
}

// Polls the gpu-worker until it runs no sequence.
bool WaitWorkerIdle(Deployment* d, double seconds) {
  const auto t0 = Clock::now();
  while (Since(t0) < seconds) {
    grpc::ClientContext ctx;
    worker::v1::CheckResponse resp;
    if (d->gpu_stub().Check(&ctx, worker::v1::CheckRequest(), &resp).ok() &&
        resp.running_sequences() == 0) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

double WorkerTokens(Deployment* d) {
  auto m = ScrapeMetrics(d->gpu_metrics_port());
  return m.ok() ? MetricSum(*m, "pinfer_worker_tokens_total") : -1;
}

TEST_F(ServiceTest, CancellingTheStreamStopsTheWorker) {
  grpc::ClientContext ctx;
  auto reader = d_->stub().Generate(&ctx, GreedyRequest("The Python interpreter", 1500));
  v1::GenerateResponse resp;
  int got = 0;
  while (got < 3 && reader->Read(&resp)) got += resp.tokens_size();
  ASSERT_GE(got, 3);
  ctx.TryCancel();
  while (reader->Read(&resp)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The gpu-worker drops the sequence at its next step, far before 1500 tokens.
  ASSERT_TRUE(WaitWorkerIdle(d_, 5.0));
  const double a = WorkerTokens(d_);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(WorkerTokens(d_), a);
}

TEST_F(ServiceTest, ClientDeadlineIsHonoured) {
  const auto t0 = Clock::now();
  GenerateResult r = RunGenerate(d_->stub(), GreedyRequest("The Python interpreter", 1500),
                                 std::chrono::milliseconds(300));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(Since(t0), 3.0);
  EXPECT_LT(r.ids.size(), 1500u);
  EXPECT_TRUE(WaitWorkerIdle(d_, 5.0));
}

TEST_F(ServiceTest, ModelInfoHealthAndReflection) {
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(d_->stub().GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.architecture(), "llama");
  EXPECT_EQ(info.num_layers(), 6u);
  EXPECT_EQ(info.hidden_size(), 384u);
  EXPECT_EQ(info.ffn_size(), 1536u);
  EXPECT_EQ(info.context_length(), 2048u);
  EXPECT_EQ(info.activation(), "relu");
  EXPECT_EQ(info.weight_dtype(), "F16");
  EXPECT_EQ(info.max_new_tokens_limit(), 4096u);
  // Half of each layer's 1536 neurons on each side; rows: gate, up, down_t, 384 fp16 each.
  EXPECT_EQ(info.placement().gpu_neurons(), 6u * 768);
  EXPECT_EQ(info.placement().cpu_neurons(), 6u * 768);
  EXPECT_EQ(info.placement().gpu_bytes(), 6u * 768 * 3 * 384 * 2);
  EXPECT_EQ(info.placement().cpu_bytes(), 6u * 768 * 3 * 384 * 2);
  EXPECT_EQ(info.placement().gpu_backend(), "cpu");
  EXPECT_EQ(info.placement().mode(), "exact");

  EXPECT_EQ(d_->Health(""), "SERVING");
  EXPECT_EQ(d_->Health("pinfer.v1.Inference"), "SERVING");
  // The workers serve the standard health service as well (container and Kubernetes probes).
  // (It follows the worker's state every 100 ms.)
  EXPECT_TRUE(Eventually([&] { return d_->GpuWorkerHealth("") == "SERVING"; }));
  EXPECT_EQ(d_->GpuWorkerHealth("pinfer.worker.v1.GpuWorker"), "SERVING");

  auto refl = grpc::reflection::v1alpha::ServerReflection::NewStub(d_->channel());
  grpc::ClientContext rctx;
  auto stream = refl->ServerReflectionInfo(&rctx);
  grpc::reflection::v1alpha::ServerReflectionRequest rreq;
  rreq.set_list_services("");
  ASSERT_TRUE(stream->Write(rreq));
  grpc::reflection::v1alpha::ServerReflectionResponse rresp;
  ASSERT_TRUE(stream->Read(&rresp));
  std::vector<std::string> services;
  for (const auto& s : rresp.list_services_response().service()) services.push_back(s.name());
  EXPECT_THAT(services, ::testing::IsSupersetOf({"pinfer.v1.Inference", "grpc.health.v1.Health"}));
  rreq.set_file_containing_symbol("pinfer.v1.GenerateRequest");
  ASSERT_TRUE(stream->Write(rreq));
  ASSERT_TRUE(stream->Read(&rresp));
  EXPECT_GT(rresp.file_descriptor_response().file_descriptor_proto_size(), 0);
  stream->WritesDone();
}

TEST_F(ServiceTest, MetricsCountTheLoad) {
  auto before = ScrapeMetrics(d_->gateway_metrics_port());
  ASSERT_TRUE(before.ok()) << before.status();
  const auto& prompts = (*ref_)["prompts"];
  size_t prompt_tokens = 0;
  for (int i = 0; i < 3; ++i) {
    GenerateResult r = RunGenerate(d_->stub(), GreedyRequest(prompts[i]["prompt"], 10));
    ASSERT_TRUE(r.status.ok());
    prompt_tokens += prompts[i]["input_ids"].size();
  }
  ASSERT_EQ(RunGenerate(d_->stub(), GreedyRequest("", 10)).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  auto after = ScrapeMetrics(d_->gateway_metrics_port());
  ASSERT_TRUE(after.ok()) << after.status();
  auto delta = [&](const std::string& name, const std::string& filter = "") {
    return MetricSum(*after, name, filter) - MetricSum(*before, name, filter);
  };
  EXPECT_EQ(delta("pinfer_generation_tokens_total"), 30);
  EXPECT_EQ(delta("pinfer_prompt_tokens_total"), static_cast<double>(prompt_tokens));
  EXPECT_EQ(delta("pinfer_requests_total", "finish_reason=\"length\""), 3);
  EXPECT_EQ(delta("pinfer_request_failures_total", "code=\"INVALID_ARGUMENT\""), 1);
  EXPECT_EQ(delta("pinfer_time_to_first_token_seconds_count"), 3);
  EXPECT_EQ(delta("pinfer_request_duration_seconds_count"), 3);
  EXPECT_EQ(delta("pinfer_queue_time_seconds_count"), 3);
  EXPECT_EQ(delta("pinfer_inter_token_latency_seconds_count"), 27);
  EXPECT_EQ(MetricSum(*after, "pinfer_requests_running"), 0);
  EXPECT_EQ(MetricSum(*after, "pinfer_requests_waiting"), 0);
  EXPECT_GT(MetricSum(*after, "pinfer_request_duration_seconds_sum"), 0);
  // No request ids or other unbounded labels: every series of these families is known.
  for (const auto& [k, v] : *after) {
    if (k.rfind("pinfer_requests_total{", 0) == 0) {
      EXPECT_THAT(k, HasSubstr("finish_reason="));
    }
    EXPECT_EQ(k.find("request_id"), std::string::npos) << k;
  }

  auto gpu = ScrapeMetrics(d_->gpu_metrics_port());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_GT(MetricSum(*gpu, "pinfer_worker_neurons_computed_total", "side=\"gpu\""), 0);
  EXPECT_GT(MetricSum(*gpu, "pinfer_worker_neurons_computed_total", "side=\"cpu\""), 0);
  EXPECT_GT(MetricSum(*gpu, "pinfer_worker_compute_seconds_total", "kind=\"ffn\""), 0);
  EXPECT_GT(MetricSum(*gpu, "pinfer_worker_compute_seconds_total", "kind=\"dense\""), 0);
  EXPECT_GT(MetricSum(*gpu, "pinfer_worker_shm_wait_seconds_count"), 0);
  EXPECT_EQ(MetricSum(*gpu, "pinfer_worker_backend_info", "backend=\"cpu\""), 1);
  EXPECT_EQ(MetricSum(*gpu, "pinfer_worker_gpu_available"), 0);
  // The CPU backend has no GPU to take a share of the cold lists; the series is there, at 0.
  EXPECT_EQ(gpu->count("pinfer_worker_cold_gpu_share_neurons_total"), 1u);
  EXPECT_EQ(MetricSum(*gpu, "pinfer_worker_cold_gpu_share_neurons_total"), 0);
  EXPECT_GT(MetricSum(*gpu, "pinfer_worker_resident_bytes"), 0);
  EXPECT_EQ(MetricSum(*gpu, "pinfer_worker_peer_alive"), 1);
  // ReLU: most neurons are skipped (reference.json: 15-35% active per layer).
  const double sparsity = MetricSum(*gpu, "pinfer_worker_ffn_sparsity");
  EXPECT_GT(sparsity, 0.5);
  EXPECT_LT(sparsity, 0.95);

  auto cpu = ScrapeMetrics(d_->cpu_metrics_port());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const double computed = MetricSum(*cpu, "pinfer_worker_neurons_computed_total", "side=\"cpu\"");
  EXPECT_GT(computed, 0);
  // Every computed pair was listed, and none beyond the cold neurons of the requests' tokens.
  const double listed = MetricSum(*cpu, "pinfer_worker_neurons_listed_total", "side=\"cpu\"");
  EXPECT_GE(listed, computed);
  EXPECT_LE(listed, MetricSum(*cpu, "pinfer_worker_neuron_candidates_total", "side=\"cpu\""));
  EXPECT_GT(MetricSum(*cpu, "pinfer_worker_compute_seconds_total"), 0);
  EXPECT_EQ(MetricSum(*cpu, "pinfer_worker_ffn_row_bytes"), 6.0 * 768 * 3 * 384 * 2);
  EXPECT_GT(MetricSum(*cpu, "pinfer_worker_resident_bytes"), 0);
}

// Resident bytes of the mappings of `file` in process `pid`, and of everything else.
std::pair<uint64_t, uint64_t> ResidentSplit(pid_t pid, const std::string& file) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps");
  std::string line;
  bool in_file = false;
  uint64_t file_kb = 0, other_kb = 0;
  while (std::getline(in, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
        line.find('-') < line.find(' ')) {
      in_file = line.size() >= file.size() &&
                line.compare(line.size() - file.size(), file.size(), file) == 0;
      continue;
    }
    if (line.rfind("Rss:", 0) == 0) {
      const uint64_t kb = std::stoull(line.substr(4));
      (in_file ? file_kb : other_kb) += kb;
    }
  }
  return {file_kb * 1024, other_kb * 1024};
}

TEST_F(ServiceTest, CpuWorkerKeepsOnlyItsColdRowsResident) {
  // After serving (all cold rows in use), none of the model file's pages are resident in the
  // cpu-worker: it computes from its private copy of the cold rows only.
  ASSERT_TRUE(RunGenerate(d_->stub(), GreedyRequest("In the beginning", 16)).status.ok());
  const auto [file_bytes, other_bytes] = ResidentSplit(d_->cpu_pid(), "model.safetensors");
  const uint64_t cold_rows = 6ull * 768 * 3 * 384 * 2;
  const uint64_t model_bytes = 32259872;
  EXPECT_LT(file_bytes, 256u * 1024) << "the cpu-worker keeps model pages resident";
  EXPECT_GE(other_bytes, cold_rows);
  // Its whole resident set is below the model's size plus its code and libraries; the
  // gpu-worker, which also holds attention, embeddings and the output head, holds more.
  const auto [gfile, gother] = ResidentSplit(d_->gpu_pid(), "model.safetensors");
  EXPECT_LT(file_bytes + other_bytes, gfile + gother);
  EXPECT_LT(file_bytes + other_bytes - cold_rows, model_bytes);
}

// --- Tests with their own deployment -------------------------------------------------------

// Prefix caching through the service (the CPU backend, half the neurons on the cpu-worker): a
// second turn that re-sends the first turn's prompt and reply reuses the KV cache the first turn
// computed (usage and the worker's metrics say how much) and gives the in-process engine's
// tokens for the whole prompt computed from scratch; so does the same prompt sent again, and a
// deployment with the cache turned off.
TEST(ServicePrefixCacheTest, SecondTurnReusesTheFirstAndGivesTheEnginesTokens) {
  auto model = LoadModel(kTiny);
  ASSERT_TRUE(model.ok());
  const nlohmann::json ref = ReadJson(kTiny + "/reference.json");
  const std::vector<uint32_t> turn1 = U32(ref["prompts"][0]["input_ids"]);
  for (const bool cache : {true, false}) {
    SCOPED_TRACE(cache ? "cache on" : "cache off");
    DeploymentOptions o;
    o.model = kTiny;
    o.hot_fraction = 0.5;
    if (!cache) o.gpu_flags = {"--prefix-cache-entries", "0"};
    Deployment d(o);
    ASSERT_TRUE(d.Start().ok()) << d.Logs();
    auto run = [&](const std::vector<uint32_t>& prompt, int n) {
      v1::GenerateRequest req;
      for (uint32_t id : prompt) req.mutable_token_ids()->add_ids(id);
      req.set_max_new_tokens(n);
      req.set_ignore_eos(true);
      return RunGenerate(d.stub(), req);
    };
    auto engine = [&](const std::vector<uint32_t>& prompt, int n) {
      return EngineGreedy(**model, std::vector<int32_t>(prompt.begin(), prompt.end()), n);
    };
    auto before = ScrapeMetrics(d.gpu_metrics_port());
    ASSERT_TRUE(before.ok()) << before.status();
    const GenerateResult a = run(turn1, 32);
    ASSERT_TRUE(a.status.ok()) << a.status.error_message() << d.Logs();
    EXPECT_EQ(a.ids, engine(turn1, 32));
    EXPECT_EQ(a.last.usage().cached_prompt_tokens(), 0u);
    // Turn 2: the history plus a new user line (tokenized without BOS).
    grpc::ClientContext tctx;
    v1::TokenizeRequest treq;
    treq.set_text(" Then she asked the old man where the river began.");
    v1::TokenizeResponse tresp;
    ASSERT_TRUE(d.stub().Tokenize(&tctx, treq, &tresp).ok());
    std::vector<uint32_t> turn2 = turn1;
    turn2.insert(turn2.end(), a.ids.begin(), a.ids.end());
    turn2.insert(turn2.end(), tresp.ids().begin(), tresp.ids().end());
    const std::vector<uint32_t> want = engine(turn2, 24);
    const GenerateResult b = run(turn2, 24);
    ASSERT_TRUE(b.status.ok()) << b.status.error_message();
    EXPECT_EQ(b.ids, want);
    const uint32_t kept = static_cast<uint32_t>(turn1.size()) + 32 - 1;
    EXPECT_EQ(b.last.usage().cached_prompt_tokens(), cache ? kept : 0u);
    // The same prompt again: everything but its last token comes from the cache.
    const GenerateResult c = run(turn2, 24);
    ASSERT_TRUE(c.status.ok());
    EXPECT_EQ(c.ids, want);
    EXPECT_EQ(c.last.usage().cached_prompt_tokens(), cache ? turn2.size() - 1 : 0u);
    auto after = ScrapeMetrics(d.gpu_metrics_port());
    ASSERT_TRUE(after.ok()) << after.status();
    auto delta = [&](const std::string& name, const std::string& filter = "") {
      return MetricSum(*after, name, filter) - MetricSum(*before, name, filter);
    };
    EXPECT_EQ(delta("pinfer_worker_prefix_cache_lookups_total", "result=\"hit\""), cache ? 2 : 0);
    EXPECT_EQ(delta("pinfer_worker_prefix_cache_lookups_total", "result=\"miss\""), cache ? 1 : 0);
    EXPECT_EQ(delta("pinfer_worker_prefix_cache_reused_tokens_total"),
              cache ? static_cast<double>(kept + turn2.size() - 1) : 0);
    EXPECT_EQ(MetricSum(*after, "pinfer_worker_prefix_cache_size", "unit=\"entries\""),
              cache ? 1 : 0);
  }
}

TEST(ServiceFailureTest, KilledCpuWorkerFailsFastAndServiceRecovers) {
  DeploymentOptions o;
  o.model = kTiny;
  o.liveness_ms = 1000;
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  const auto ref = ReadJson(kTiny + "/reference.json");

  // A long stream is running when the cpu-worker dies.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = d.stub().Generate(&ctx, GreedyRequest("The Python interpreter", 1500));
  v1::GenerateResponse resp;
  int got = 0;
  while (got < 2 && reader->Read(&resp)) got += resp.tokens_size();
  ASSERT_GE(got, 2);
  const auto t0 = Clock::now();
  d.KillCpuWorker(SIGKILL);
  while (reader->Read(&resp)) {
  }
  grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("cpu-worker"));
  EXPECT_LT(Since(t0), 5.0);

  // New requests fail fast, and health says NOT_SERVING.
  const auto t1 = Clock::now();
  GenerateResult r = RunGenerate(d.stub(), GreedyRequest("Hello", 8));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_LT(Since(t1), 3.0);
  ASSERT_TRUE(d.WaitHealth("NOT_SERVING", std::chrono::seconds(5)).ok());
  EXPECT_TRUE(Eventually([&] { return d.GpuWorkerHealth("") == "NOT_SERVING"; }));

  // A restarted cpu-worker brings it back, with correct output.
  ASSERT_TRUE(d.StartCpuWorker().ok());
  ASSERT_TRUE(d.WaitHealth("SERVING", std::chrono::seconds(30)).ok()) << d.Logs();
  for (int i : {0, 5}) {
    const auto& p = ref["prompts"][i];
    GenerateResult ok = RunGenerate(d.stub(), GreedyRequest(p["prompt"], 48));
    ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
    EXPECT_EQ(ok.ids, U32(p["greedy_ids"]));
  }
}

TEST(ServiceFailureTest, RecoveredWorkerPairIsServedBeforeTheNextHealthCheck) {
  // The gateway's periodic check can catch a pair in the moment its restarted cpu-worker is
  // still loading; a request must not be refused on that stale answer. The interval is made
  // far longer than the test, so only a fresh check can let the last request through.
  DeploymentOptions o;
  o.model = kTiny;
  o.liveness_ms = 1000;
  o.gateway_flags = {"--health-interval-ms", "600000"};
  Deployment d(o);
  ASSERT_TRUE(d.StartGpuWorker().ok()) << d.Logs();
  ASSERT_TRUE(d.StartCpuWorker().ok()) << d.Logs();
  ASSERT_TRUE(Eventually([&] { return d.GpuWorkerHealth("") == "SERVING"; })) << d.Logs();
  ASSERT_TRUE(d.StartGateway().ok()) << d.Logs();
  ASSERT_TRUE(d.WaitHealth("SERVING", std::chrono::seconds(10)).ok()) << d.Logs();

  d.KillCpuWorker(SIGKILL);
  ASSERT_TRUE(Eventually([&] { return d.GpuWorkerHealth("") == "NOT_SERVING"; }));
  GenerateResult refused = RunGenerate(d.stub(), GreedyRequest("Hello", 8));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("cpu-worker"));
  ASSERT_TRUE(d.WaitHealth("NOT_SERVING", std::chrono::seconds(5)).ok());

  ASSERT_TRUE(d.StartCpuWorker().ok()) << d.Logs();
  ASSERT_TRUE(Eventually([&] { return d.GpuWorkerHealth("") == "SERVING"; })) << d.Logs();
  const auto ref = ReadJson(kTiny + "/reference.json");
  const auto& p = ref["prompts"][2];
  GenerateResult ok = RunGenerate(d.stub(), GreedyRequest(p["prompt"], 48));
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.ids, U32(p["greedy_ids"]));
  // The gateway's own health service follows the fresh check too.
  EXPECT_TRUE(d.WaitHealth("SERVING", std::chrono::seconds(2)).ok());
}

TEST(ServiceFailureTest, KilledGpuWorkerGivesUnavailableAndRestartRecovers) {
  DeploymentOptions o;
  o.model = kTiny;
  o.liveness_ms = 1000;
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  d.KillGpuWorker(SIGKILL);
  const auto t0 = Clock::now();
  GenerateResult r = RunGenerate(d.stub(), GreedyRequest("Hello", 8));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_LT(Since(t0), 5.0);
  ASSERT_TRUE(d.WaitHealth("NOT_SERVING", std::chrono::seconds(5)).ok());
  // The new gpu-worker takes over the dead one's segment name; the cpu-worker re-attaches.
  ASSERT_TRUE(d.StartGpuWorker().ok()) << d.Logs();
  // The gateway was given the old port; start a new gateway for the new worker.
  d.KillGateway(SIGKILL);
  ASSERT_TRUE(d.StartGateway().ok());
  ASSERT_TRUE(d.WaitHealth("SERVING", std::chrono::seconds(30)).ok()) << d.Logs();
  const auto ref = ReadJson(kTiny + "/reference.json");
  GenerateResult ok = RunGenerate(d.stub(), GreedyRequest(ref["prompts"][1]["prompt"], 48));
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.ids, U32(ref["prompts"][1]["greedy_ids"]));
}

TEST(ServiceQueueTest, FullQueueGivesResourceExhaustedAndSigtermDrains) {
  DeploymentOptions o;
  o.model = kTiny;
  o.gateway_flags = {"--max-running", "1", "--max-queue", "1", "--drain-timeout-ms", "20000"};
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();

  // A occupies the only slot; B waits in the queue; C finds the queue full.
  grpc::ClientContext actx;
  auto a = d.stub().Generate(&actx, GreedyRequest("The Python interpreter", 1500));
  v1::GenerateResponse resp;
  ASSERT_TRUE(a->Read(&resp));
  GenerateResult b;
  std::thread bt([&] { b = RunGenerate(d.stub(), GreedyRequest("Once upon a time", 20)); });
  // Wait until B is queued.
  const auto t0 = Clock::now();
  while (Since(t0) < 10) {
    auto m = ScrapeMetrics(d.gateway_metrics_port());
    if (m.ok() && MetricSum(*m, "pinfer_requests_waiting") == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  GenerateResult c = RunGenerate(d.stub(), GreedyRequest("In the beginning", 20));
  EXPECT_EQ(c.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(c.status.error_message(), HasSubstr("queue is full"));
  // Freeing the slot lets B run.
  actx.TryCancel();
  while (a->Read(&resp)) {
  }
  (void)a->Finish();
  bt.join();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(b.ids.size(), 20u);
  EXPECT_GT(b.last.timings().queue_seconds(), 0);

  // SIGTERM while a request runs: it completes, new ones are refused, then the gateway exits.
  grpc::ClientContext dctx;
  auto running = d.stub().Generate(&dctx, GreedyRequest("The meaning of life is", 800));
  ASSERT_TRUE(running->Read(&resp));
  int tokens = resp.tokens_size();
  ::kill(d.gateway_pid(), SIGTERM);
  const auto t1 = Clock::now();
  std::string health = "SERVING";
  while (health == "SERVING" && Since(t1) < 5) health = d.Health("");
  EXPECT_EQ(health, "NOT_SERVING");
  GenerateResult refused = RunGenerate(d.stub(), GreedyRequest("Hello", 5));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  while (running->Read(&resp)) tokens += resp.tokens_size();
  EXPECT_TRUE(running->Finish().ok());
  EXPECT_EQ(tokens, 800);
  const int status = d.WaitGateway(std::chrono::seconds(10));
  ASSERT_NE(status, -1) << "the gateway did not exit after draining";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(ServiceModelFamilyTest, SiluGgufModelMatchesLlamaCpp) {
  // Another model of the family: SiLU activation (every neuron computed, split between the
  // workers), GGUF F32, interleaved RoPE. Reference: llama.cpp's greedy continuations.
  const std::string dir = std::string(PINFER_MODELS_DIR) + "/stories260K";
  DeploymentOptions o;
  o.model = dir + "/stories260K.gguf";
  o.hot_fraction = 0.3;
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  const auto ref = ReadJson(dir + "/reference.json");
  for (const auto& r : ref["references"]) {
    const std::string prompt = r["prompt"];
    SCOPED_TRACE(prompt);
    GenerateResult g = RunGenerate(d.stub(), GreedyRequest(prompt, r["n_predict"].get<int>()));
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_EQ(g.ids.size(), 64u);
    EXPECT_EQ(g.text + "\n\n", r["greedy_continuation"].get<std::string>());
  }
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(d.stub().GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.activation(), "silu");
  EXPECT_EQ(info.weight_dtype(), "F32");
}

TEST(ServicePlacementTest, GpuIndexPlacementIsUsedAndExact) {
  // A PowerInfer GPU index with a scattered, uneven hot set per layer (layer l: every (l+2)-th
  // neuron): the workers follow it and the output stays exact.
  const int layers = 6, ffn = 1536;
  GpuIndex index;
  index.vram_capacity = 1 << 20;
  size_t hot = 0;
  for (int l = 0; l < layers; ++l) {
    std::vector<int32_t> idx(ffn, 0), bucket;
    for (int j = 0; j < ffn; j += l + 2) {
      idx[j] = 1;
      bucket.push_back(j);
    }
    hot += bucket.size();
    index.gpu_idx.push_back(idx);
    index.gpu_bucket.push_back(bucket);
  }
  char dir[] = "/tmp/pinfer-gpuidx-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/tiny.gpuidx";
  ASSERT_TRUE(WriteGpuIndex(index, path).ok());
  DeploymentOptions o;
  o.model = kTiny;
  o.hot_fraction = -1;  // no --hot-fraction
  o.gpu_flags = {"--placement", path};
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(d.stub().GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.placement().gpu_neurons(), hot);
  EXPECT_EQ(info.placement().cpu_neurons(), 6u * ffn - hot);
  const auto ref = ReadJson(kTiny + "/reference.json");
  for (int i : {2, 7, 11}) {
    const auto& p = ref["prompts"][i];
    GenerateResult r = RunGenerate(d.stub(), GreedyRequest(p["prompt"], 48));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.ids, U32(p["greedy_ids"]));
  }
  auto cpu = ScrapeMetrics(d.cpu_metrics_port());
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(MetricSum(*cpu, "pinfer_worker_ffn_row_bytes"), (6.0 * ffn - hot) * 3 * 384 * 2);
  std::remove(path.c_str());
  ::rmdir(dir);
}

TEST(ServicePlacementTest, VramBudgetHotSetIsWhatFitsByHand) {
  // Without a GPU the gpu-worker plans with placement.h's generic accounting. relu-llama-tiny is
  // F16: hidden 384, 6 layers, 6 heads of 64, 2 KV heads (kv_dim 128), FFN 1536, vocab 4096.
  //   dense   = 6 * (768 + 294912 + 98304 + 98304 + 294912 + 768) + 768 + 4096*384*2 = 7874304
  //   KV      = 2 * 6 * (256 positions * 2 slots) * 128 * 2 bytes                   = 1572864
  //   scratch = 4 * 16 tokens * (3*384 + 384 + 2*128 + 3*1536 + 4096 + 6*512)        =  868352
  //   one hot neuron = gate + up + down_t rows = 3 * 384 * 2                          =    2304
  // so a budget of 10315520 + 1000 * 2304 + 1000 bytes holds exactly 1000 hot neurons.
  ::setenv("PINFER_AUTO_PREPARE_MAX_TOKENS", "2048", 1);  // quick profile of the calibration text
  DeploymentOptions o;
  o.model = kTiny;
  o.hot_fraction = -1;
  o.gpu_flags = {"--vram-budget",      std::to_string(10315520 + 1000 * 2304 + 1000),
                 "--max-context",      "256",
                 "--gpu-slots",        "2",
                 "--max-batch-tokens", "16",
                 "--backend",          "cpu"};
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(d.stub().GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.placement().gpu_neurons(), 1000u);
  EXPECT_EQ(info.placement().cpu_neurons(), 6u * 1536 - 1000);
  // The most active neurons go first: the hot set serves far more than its 11% share.
  EXPECT_THAT(d.Logs(), ::testing::HasSubstr("activations served by the GPU"));
  const auto ref = ReadJson(kTiny + "/reference.json");
  const auto& p = ref["prompts"][4];
  GenerateResult r = RunGenerate(d.stub(), GreedyRequest(p["prompt"], 48));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, U32(p["greedy_ids"]));
  ::unsetenv("PINFER_AUTO_PREPARE_MAX_TOKENS");
}

// Runs a command line with stdout and stderr into a file; returns the exit code and the output.
std::pair<int, std::string> RunCommand(const std::string& cmd, const std::string& name) {
  const std::string out = ::testing::TempDir() + "/" + name + ".txt";
  const int rc = std::system((cmd + " > " + out + " 2>&1").c_str());
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  return {WEXITSTATUS(rc), text.str()};
}

TEST(ServicePlacementTest, VramBudgetFlagErrors) {
  auto run = [&](const std::string& flags) {
    return RunCommand(std::string(PINFER_BINARY_DIR) + "/bin/pinfer-gpu-worker --model " + kTiny +
                          " --backend cpu " + flags,
                      "vram-budget-err");
  };
  auto [rc1, err1] = run("--vram-budget 1GiB --hot-fraction 0.3");
  EXPECT_EQ(rc1, 2);
  EXPECT_THAT(err1, ::testing::HasSubstr("excludes --placement and --hot-fraction"));
  auto [rc2, err2] = run("--vram-budget 12XB");
  EXPECT_EQ(rc2, 2);
  EXPECT_THAT(err2, ::testing::HasSubstr("vram-budget"));
  auto [rc3, err3] = run("--vram-budget 0");
  EXPECT_EQ(rc3, 2);
  EXPECT_THAT(err3, ::testing::HasSubstr("--vram-budget must be positive"));
  // Below the dense parts: a clear start-up error naming both sizes, not a crash.
  ::setenv("PINFER_AUTO_PREPARE_MAX_TOKENS", "512", 1);
  auto [rc4, err4] = run("--vram-budget 1MiB --max-context 256");
  ::unsetenv("PINFER_AUTO_PREPARE_MAX_TOKENS");
  EXPECT_EQ(rc4, 1);
  EXPECT_THAT(err4, ::testing::HasSubstr("cannot place the model in a VRAM budget of 1.0 MiB"));
  EXPECT_THAT(err4, ::testing::HasSubstr("bytes the dense tensors, KV cache"));
}

TEST(ServiceColdPrefillTest, GpuWorkerFlagErrors) {
  const std::string worker = std::string(PINFER_BINARY_DIR) + "/bin/pinfer-gpu-worker --model " +
                             kTiny + " --backend cpu ";
  auto [rc1, err1] = RunCommand(worker + "--cold-prefill gpu", "cold-prefill-1");
  EXPECT_EQ(rc1, 2);
  EXPECT_THAT(err1, HasSubstr("--cold-prefill must be auto, cpu or stream (got \"gpu\")"));
  EXPECT_THAT(err1, HasSubstr("usage: pinfer-gpu-worker"));
  auto [rc2, err2] = RunCommand(worker + "--stream-slots 0", "cold-prefill-2");
  EXPECT_EQ(rc2, 2);
  EXPECT_THAT(err2, HasSubstr("--stream-slots must be in [1, 16]"));
  auto [rc3, err3] = RunCommand(worker + "--stream-chunk-rows many", "cold-prefill-3");
  EXPECT_EQ(rc3, 2);
  EXPECT_THAT(err3, HasSubstr("stream-chunk-rows"));
  auto [rc4, err4] = RunCommand(std::string(PINFER_BINARY_DIR) + "/cli/pinfer serve --model " +
                                    kTiny + " --port 0 --cold-prefill fast",
                                "cold-prefill-4");
  EXPECT_EQ(rc4, 2);
  EXPECT_THAT(err4, HasSubstr("--cold-prefill must be auto, cpu or stream (got \"fast\")"));
}

// The adaptive hot set and the cold guess follow the predictors' choices, so they need --sparse;
// the rest of their behaviour needs a GPU (CudaBackendTest.AdaptiveCacheInPredictedModeMatches-
// CpuReference, CudaBackendTest.ColdGuess*).
TEST(ServiceAdaptiveCacheTest, FlagErrors) {
  const std::string worker = std::string(PINFER_BINARY_DIR) + "/bin/pinfer-gpu-worker --model " +
                             kTiny + " --backend cpu ";
  auto [rc1, err1] = RunCommand(worker + "--adaptive-cache-rows 64", "adaptive-1");
  EXPECT_EQ(rc1, 2);
  EXPECT_THAT(err1, HasSubstr("--adaptive-cache-rows needs --sparse"));
  auto [rc2, err2] = RunCommand(worker + "--sparse --adaptive-cache-rows -3", "adaptive-2");
  EXPECT_EQ(rc2, 2);
  EXPECT_THAT(err2, HasSubstr("--adaptive-cache-rows must be in [0, 1048576]"));
  auto [rc3, err3] = RunCommand(std::string(PINFER_BINARY_DIR) + "/cli/pinfer serve --model " +
                                    kTiny + " --port 0 --adaptive-cache-rows 64",
                                "adaptive-3");
  EXPECT_EQ(rc3, 2);
  EXPECT_THAT(err3, HasSubstr("--adaptive-cache-rows needs --sparse"));
  auto [rc8, err8] = RunCommand(worker + "--sparse --adaptive-cache-thread", "adaptive-8");
  EXPECT_EQ(rc8, 2);
  EXPECT_THAT(err8, HasSubstr("--adaptive-cache-thread needs --adaptive-cache-rows"));
  auto [rc9, err9] = RunCommand(std::string(PINFER_BINARY_DIR) + "/cli/pinfer serve --model " +
                                    kTiny + " --port 0 --sparse --adaptive-cache-thread",
                                "adaptive-9");
  EXPECT_EQ(rc9, 2);
  EXPECT_THAT(err9, HasSubstr("--adaptive-cache-thread needs --adaptive-cache-rows"));
  auto [rc6, err6] = RunCommand(worker + "--cold-guess", "adaptive-6");
  EXPECT_EQ(rc6, 2);
  EXPECT_THAT(err6,
              HasSubstr("--cold-guess needs --sparse: the guess is made with the predictors"));
  auto [rc7, err7] = RunCommand(std::string(PINFER_BINARY_DIR) + "/cli/pinfer serve --model " +
                                    kTiny + " --port 0 --cold-guess",
                                "adaptive-7");
  EXPECT_EQ(rc7, 2);
  EXPECT_THAT(err7, HasSubstr("--cold-guess needs --sparse"));
  auto [rc4, err4] = RunCommand(worker + "--cold-gpu-share 1.5", "adaptive-4");
  EXPECT_EQ(rc4, 2);
  EXPECT_THAT(err4, HasSubstr("--cold-gpu-share must be auto, off or a fraction in (0, 1] (got "
                              "\"1.5\")"));
  auto [rc5, err5] = RunCommand(std::string(PINFER_BINARY_DIR) + "/cli/pinfer serve --model " +
                                    kTiny + " --port 0 --cold-gpu-share half",
                                "adaptive-5");
  EXPECT_EQ(rc5, 2);
  EXPECT_THAT(err5, HasSubstr("--cold-gpu-share must be auto, off or a fraction in (0, 1] (got "
                              "\"half\")"));
}

// Decode lanes (the CUDA backend's concurrent sequences; CudaBackendTest.LanesRunTwoSequencesAtOnce
// and bench/device_service_run.sh's concurrent reference check cover their behaviour on a GPU):
// the count is checked by the gpu-worker and, before any child starts, by serve.
TEST(ServiceDecodeLanesTest, FlagErrors) {
  const std::string worker = std::string(PINFER_BINARY_DIR) + "/bin/pinfer-gpu-worker --model " +
                             kTiny + " --backend cpu ";
  auto [rc1, err1] = RunCommand(worker + "--decode-lanes 0", "lanes-1");
  EXPECT_EQ(rc1, 2);
  EXPECT_THAT(err1, HasSubstr("--decode-lanes must be in [1, 8]"));
  auto [rc2, err2] = RunCommand(std::string(PINFER_BINARY_DIR) + "/cli/pinfer serve --model " +
                                    kTiny + " --port 0 --decode-lanes 99",
                                "lanes-2");
  EXPECT_EQ(rc2, 2);
  EXPECT_THAT(err2, HasSubstr("--decode-lanes must be in [1, 8]"));
  auto [rc3, err3] = RunCommand(worker + "--decode-lanes two", "lanes-3");
  EXPECT_EQ(rc3, 2);
  EXPECT_THAT(err3, HasSubstr("decode-lanes"));
}

TEST(ServiceDecodeLanesTest, CpuBackendIgnoresTheFlagAndStaysExact) {
  DeploymentOptions o;
  o.model = kTiny;
  o.gpu_flags = {"--backend", "cpu", "--decode-lanes", "4"};
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  // Without a GPU the flag changes nothing: a log line says so, and two requests at once get
  // the reference's tokens with no step counted on a lane.
  EXPECT_THAT(d.Logs(), HasSubstr("--decode-lanes 4 ignored: the CPU backend"));
  const auto ref = ReadJson(kTiny + "/reference.json");
  GenerateResult r0, r1;
  std::thread other(
      [&] { r1 = RunGenerate(d.stub(), GreedyRequest(ref["prompts"][1]["prompt"], 48)); });
  r0 = RunGenerate(d.stub(), GreedyRequest(ref["prompts"][0]["prompt"], 48));
  other.join();
  ASSERT_TRUE(r0.status.ok()) << r0.status.error_message();
  ASSERT_TRUE(r1.status.ok()) << r1.status.error_message();
  EXPECT_EQ(r0.ids, U32(ref["prompts"][0]["greedy_ids"]));
  EXPECT_EQ(r1.ids, U32(ref["prompts"][1]["greedy_ids"]));
  auto m = ScrapeMetrics(d.gpu_metrics_port());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->count("pinfer_worker_decode_lane_steps_total"), 1u);
  EXPECT_EQ(MetricSum(*m, "pinfer_worker_decode_lane_steps_total"), 0);
}

// The cpu-worker's spin time: checked by the cpu-worker and, before any child starts, by serve.
TEST(ServiceCpuSpinTest, FlagErrors) {
  auto [rc1, err1] = RunCommand(std::string(PINFER_BINARY_DIR) + "/bin/pinfer-cpu-worker --model " +
                                    kTiny + " --segment /pinfer-spin-flag --spin-us -5",
                                "spin-1");
  EXPECT_EQ(rc1, 2);
  EXPECT_THAT(err1, HasSubstr("--spin-us must be in [0, 1000000]"));
  auto [rc2, err2] = RunCommand(std::string(PINFER_BINARY_DIR) + "/cli/pinfer serve --model " +
                                    kTiny + " --port 0 --cpu-spin-us 2000000",
                                "spin-2");
  EXPECT_EQ(rc2, 2);
  EXPECT_THAT(err2, HasSubstr("--cpu-spin-us must be in [0, 1000000]"));
  // The exchange's polling time, on both sides of the segment.
  for (const char* worker : {"pinfer-cpu-worker", "pinfer-gpu-worker"}) {
    auto [rc, err] = RunCommand(std::string(PINFER_BINARY_DIR) + "/bin/" + worker + " --model " +
                                    kTiny + " --segment /pinfer-spin-flag --exchange-spin-us -1",
                                std::string("spin-") + worker);
    EXPECT_EQ(rc, 2) << worker;
    EXPECT_THAT(err, HasSubstr("--exchange-spin-us must be in [0, 1000000]")) << worker;
  }
}

// Two compute threads in the cpu-worker, once sleeping between layers (--spin-us 0) and once
// polling (--spin-us 2000, longer than any gap between a step's layers here): the cold rows split
// over both threads give the reference's tokens either way, for two requests at once.
TEST(ServiceCpuSpinTest, TwoThreadsGiveReferenceTokensSpinningOrNot) {
  const auto ref = ReadJson(kTiny + "/reference.json");
  for (const char* spin : {"0", "2000"}) {
    SCOPED_TRACE(spin);
    DeploymentOptions o;
    o.model = kTiny;
    o.hot_fraction = 0.25;
    // Polling the segment too (both workers' --exchange-spin-us) when the threads poll.
    o.cpu_flags = {"--threads", "2", "--spin-us", spin, "--exchange-spin-us", spin};
    o.gpu_flags = {"--exchange-spin-us", spin};
    Deployment d(o);
    ASSERT_TRUE(d.Start().ok()) << d.Logs();
    GenerateResult r0, r1;
    std::thread other(
        [&] { r1 = RunGenerate(d.stub(), GreedyRequest(ref["prompts"][3]["prompt"], 48)); });
    r0 = RunGenerate(d.stub(), GreedyRequest(ref["prompts"][2]["prompt"], 48));
    other.join();
    ASSERT_TRUE(r0.status.ok()) << r0.status.error_message();
    ASSERT_TRUE(r1.status.ok()) << r1.status.error_message();
    EXPECT_EQ(r0.ids, U32(ref["prompts"][2]["greedy_ids"]));
    EXPECT_EQ(r1.ids, U32(ref["prompts"][3]["greedy_ids"]));
    auto cm = ScrapeMetrics(d.cpu_metrics_port());
    ASSERT_TRUE(cm.ok()) << cm.status();
    EXPECT_GT(MetricSum(*cm, "pinfer_worker_neurons_computed_total"), 0);
  }
}

TEST(ServiceColdPrefillTest, CpuBackendIgnoresTheFlagAndStaysExact) {
  // Without a GPU the flag changes nothing: a log line says so, the tokens are the reference's
  // and no prompt layer is counted as streamed.
  DeploymentOptions o;
  o.model = kTiny;
  o.gpu_flags = {"--backend", "cpu", "--cold-prefill", "stream"};
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  EXPECT_THAT(d.Logs(), HasSubstr("--cold-prefill stream ignored: the CPU backend"));
  const auto ref = ReadJson(kTiny + "/reference.json");
  const auto& p = ref["prompts"][10];  // 14 tokens: a batch past the matrix-vector size
  GenerateResult r = RunGenerate(d.stub(), GreedyRequest(p["prompt"], 48));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, U32(p["greedy_ids"]));
  auto m = ScrapeMetrics(d.gpu_metrics_port());
  ASSERT_TRUE(m.ok()) << m.status();
  // Exported (so that dashboards see the series) and zero.
  EXPECT_EQ(m->count("pinfer_worker_prefill_cold_layers_total{path=\"stream\"}"), 1u);
  EXPECT_EQ(MetricSum(*m, "pinfer_worker_prefill_cold_layers_total", "stream"), 0);
  EXPECT_EQ(MetricSum(*m, "pinfer_worker_streamed_cold_bytes_total"), 0);
}

TEST(ServiceColdPrefillTest, ServePassesTheFlagsToTheGpuWorker) {
  const std::string dir = ::testing::TempDir() + "/serve-cold-prefill";
  std::filesystem::create_directories(dir);
  const std::string log = dir + "/serve.log";
  std::filesystem::remove(log);  // before the child starts: never read an earlier run's log
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    const std::string bin = std::string(PINFER_BINARY_DIR) + "/cli/pinfer";
    ::execl(bin.c_str(), bin.c_str(), "serve", "--model", kTiny.c_str(), "--port", "0", "--bin-dir",
            (std::string(PINFER_BINARY_DIR) + "/bin").c_str(), "--cold-prefill", "stream",
            "--stream-slots", "3", "--stream-chunk-rows", "256", nullptr);
    ::_exit(127);
  }
  ASSERT_GT(pid, 0);
  auto read_log = [&] {
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  // The gpu-worker got the flags (serve's log prints each child's command line) and, on this
  // machine's CPU backend, says it ignores them.
  const auto t0 = Clock::now();
  while (Since(t0) < 30 && read_log().find("ignored: the CPU backend") == std::string::npos) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const std::string text = read_log();
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_THAT(text, HasSubstr("--cold-prefill stream --stream-chunk-rows 256 --stream-slots 3"));
  EXPECT_THAT(text, HasSubstr("--cold-prefill stream ignored: the CPU backend"));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status << "\n"
                                                             << text;
}

// Greedy tokens of the in-process engine with a given FFN block, the prompt fed one token at a
// time (so every matrix product takes the single-token path, as the service's decode does).
std::vector<uint32_t> GreedyOneByOne(const Model& m, FfnBlock* ffn, std::vector<int32_t> ids,
                                     int n) {
  auto ops = NewSimdOps(nullptr);
  Transformer t(m, *ops);
  t.set_ffn(ffn);
  const size_t prompt = ids.size();
  KvCache cache(m.config, static_cast<int>(prompt) + n);
  std::vector<float> logits(m.config.vocab_size);
  std::vector<uint32_t> out;
  for (size_t i = 0; i + 1 < prompt + n; ++i) {
    const int32_t tok = ids[i];
    EXPECT_TRUE(
        t.Forward({&tok, 1}, static_cast<int>(i), &cache, LogitsMode::kLast, logits.data()).ok());
    if (i + 1 >= prompt) {
      const int32_t next =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      ids.push_back(next);
      out.push_back(static_cast<uint32_t>(next));
    }
  }
  return out;
}

TEST(ServiceSparseTest, PreparedModelServesExactAndPredictorSparse) {
  // A quickly prepared relu-llama-tiny (small calibration, rank-16 predictors): PWRI file with
  // renumbered neurons, predictors and ffn_down_t.
  char dir[] = "/tmp/pinfer-prepared-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string cal = std::string(dir) + "/cal.txt", prepared = std::string(dir) + "/tiny.gguf";
  {
    std::ifstream in(kTiny + "/calibration.txt");
    std::string text(20000, '\0');
    in.read(text.data(), text.size());
    std::ofstream(cal) << text.substr(0, in.gcount());
  }
  const std::string cmd = std::string(PINFER_BINARY_DIR) + "/cli/pinfer prepare --model " + kTiny +
                          " --calibration " + cal + " --out " + prepared +
                          " --max-tokens 4000 --epochs 1 --ranks 16 --threads 2 > " + dir +
                          "/prepare.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto ref = ReadJson(kTiny + "/reference.json");

  // Exact mode on the prepared file: the neuron permutation and the stored ffn_down_t change
  // nothing, so the tokens are transformers' again.
  double exact_sparsity = 0;
  {
    DeploymentOptions o;
    o.model = prepared;
    Deployment d(o);
    ASSERT_TRUE(d.Start().ok()) << d.Logs();
    for (int i : {0, 4, 9}) {
      const auto& p = ref["prompts"][i];
      GenerateResult r = RunGenerate(d.stub(), GreedyRequest(p["prompt"], 48));
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      EXPECT_EQ(r.ids, U32(p["greedy_ids"]));
    }
    auto m = ScrapeMetrics(d.gpu_metrics_port());
    ASSERT_TRUE(m.ok());
    exact_sparsity = MetricSum(*m, "pinfer_worker_ffn_sparsity");
  }

  // Sparse mode: the predictors pick the neurons on both workers. Same tokens as the in-process
  // engine with shared/sparse's PredictedSparseFfn, and more neurons skipped than exact mode.
  DeploymentOptions o;
  o.model = prepared;
  o.gpu_flags = {"--sparse"};
  Deployment d(o);
  ASSERT_TRUE(d.Start().ok()) << d.Logs();
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(d.stub().GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.placement().mode(), "sparse");
  auto ops = NewSimdOps(nullptr);
  auto session = OpenSparseSession(prepared, SparseMode::kPredicted, *ops);
  ASSERT_TRUE(session.ok()) << session.status();
  for (int i : {0, 4, 9}) {
    const auto& p = ref["prompts"][i];
    SCOPED_TRACE(p["prompt"].get<std::string>());
    GenerateResult r = RunGenerate(d.stub(), GreedyRequest(p["prompt"], 24));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    std::vector<int32_t> ids;
    for (uint32_t id : U32(p["input_ids"])) ids.push_back(static_cast<int32_t>(id));
    EXPECT_EQ(r.ids, GreedyOneByOne((*session)->model(), (*session)->ffn(), ids, 24));
  }
  auto m = ScrapeMetrics(d.gpu_metrics_port());
  ASSERT_TRUE(m.ok());
  EXPECT_GT(MetricSum(*m, "pinfer_worker_ffn_sparsity"), exact_sparsity);
  auto cm = ScrapeMetrics(d.cpu_metrics_port());
  ASSERT_TRUE(cm.ok());
  EXPECT_GT(MetricSum(*cm, "pinfer_worker_neurons_computed_total"), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pinfer::testing
