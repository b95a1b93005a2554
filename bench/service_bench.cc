// Decode speed through the full service (gateway -> gpu-worker <-shared memory-> cpu-worker)
// against the in-process engine on the same model and threads. Prints a markdown table.
//
//   service_bench --pinfer build/cli/pinfer --model models/relu-llama-tiny --tokens 256
//       --threads 1 --repeats 3 [--hot-fraction 0.5] [--streams 4]
//   service_bench --address HOST:PORT --reference models/relu-llama-tiny/reference.json
//       (an already running service: check its greedy tokens against the reference, then
//        measure it; no in-process rows)
//
// Decode tokens/s everywhere = (tokens - 1) / (time of the last token - time of the first), so
// prompt processing is excluded and every per-token cost is included. Rows:
//  - in-process dense: the engine's Generate with the dense FFN (what `pinfer generate` runs);
//  - in-process exact-sparse: the same with shared/sparse's GateSparseFfn (gate of every neuron,
//    up and down only for active ones): the work the two workers share in exact mode, in one
//    process: the baseline for the cost of the split;
//  - service: `pinfer serve --threads T --cpu-threads T`, timed on the client as tokens arrive,
//    one stream; and N concurrent streams (aggregate tokens/s while all are decoding).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/flags.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "pinfer/v1/inference.grpc.pb.h"
#include "shared/engine/generator.h"
#include "shared/engine/ops.h"
#include "shared/model/model.h"
#include "shared/sparse/sparse_ffn.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace pinfer;

const char* kPrompts[] = {"The Python interpreter", "Once upon a time", "import os\nimport sys\n",
                          "The garbage collector"};

double Rate(const std::vector<Clock::time_point>& t) {
  if (t.size() < 2) return 0;
  return (t.size() - 1) / std::chrono::duration<double>(t.back() - t.front()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::vector<Clock::time_point> Stream(v1::Inference::Stub& stub, const std::string& prompt,
                                      int tokens) {
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.set_prompt(prompt);
  req.set_max_new_tokens(tokens);
  req.set_ignore_eos(true);
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  std::vector<Clock::time_point> times;
  while (reader->Read(&resp)) {
    const auto now = Clock::now();
    for (int i = 0; i < resp.tokens_size(); ++i) times.push_back(now);
  }
  grpc::Status st = reader->Finish();
  if (!st.ok()) std::fprintf(stderr, "stream failed: %s\n", st.error_message().c_str());
  return times;
}

}  // namespace

int main(int argc, char** argv) {
  auto f = cli::Flags::Parse(std::vector<std::string>(argv + 1, argv + argc),
                             {"pinfer", "model", "tokens", "threads", "repeats", "hot-fraction",
                              "streams", "address", "reference", "write-greedy"},
                             {});
  if (!f.ok()) {
    std::fprintf(stderr, "%s\n", std::string(f.status().message()).c_str());
    return 2;
  }
  const std::string pinfer = f->Get("pinfer").value_or("build/cli/pinfer");
  const std::string path = f->Get("model").value_or("models/relu-llama-tiny");
  const int tokens = static_cast<int>(*f->Int("tokens", 256));
  const int threads = static_cast<int>(*f->Int("threads", 1));
  const int repeats = static_cast<int>(*f->Int("repeats", 3));
  const int streams = static_cast<int>(*f->Int("streams", 4));
  const std::string hot = f->Get("hot-fraction").value_or("0.5");
  const std::string address = f->Get("address").value_or("");
  const std::string reference = f->Get("reference").value_or("");
  // The service's own greedy tokens for the reference prompts, in reference.json's layout, so that
  // a run on one backend can be the reference of a run on another.
  const std::string write_greedy = f->Get("write-greedy").value_or("");

  // In-process baselines.
  auto model = LoadModel(path);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const Model& m = **model;
  ThreadPool pool(threads);
  auto ops = NewSimdOps(&pool);
  auto down_t = TransposeDownProjections(m);
  auto sparse = GateSparseFfn::Create(m, *ops, down_t->layers);
  if (!down_t.ok() || !sparse.ok()) return 1;
  std::vector<double> dense, exact;
  for (int r = 0; r < (address.empty() ? repeats : 0); ++r) {
    for (const char* p : kPrompts) {
      std::vector<int32_t> prompt;
      if (m.config.add_bos) prompt.push_back(m.config.bos_id);
      auto ids = m.tokenizer->Encode(p);
      prompt.insert(prompt.end(), ids->begin(), ids->end());
      for (int mode = 0; mode < 2; ++mode) {
        Transformer t(m, *ops);
        if (mode == 1) t.set_ffn(sparse->get());
        GenerateOptions opts;
        opts.max_new_tokens = tokens;
        opts.stop_at_eos = false;
        std::vector<Clock::time_point> times;
        (void)Generate(t, *m.tokenizer, prompt, opts, [&](const GeneratedToken&) {
          times.push_back(Clock::now());
          return true;
        });
        (mode == 0 ? dense : exact).push_back(Rate(times));
      }
    }
  }

  // The service: the given one, or `pinfer serve` started here.
  pid_t pid = -1;
  std::string target = address;
  if (target.empty()) {
    char dir[] = "/tmp/pinfer-bench-XXXXXX";
    ::mkdtemp(dir);
    const std::string port_file = std::string(dir) + "/port";
    const std::string log = std::string(dir) + "/serve.log";
    pid = ::fork();
    if (pid == 0) {
      FILE* lf = std::fopen(log.c_str(), "w");
      ::dup2(fileno(lf), 1);
      ::dup2(fileno(lf), 2);
      const std::string t = std::to_string(threads);
      ::execl(pinfer.c_str(), pinfer.c_str(), "serve", "--model", path.c_str(), "--host",
              "127.0.0.1", "--port", "0", "--port-file", port_file.c_str(), "--threads", t.c_str(),
              "--cpu-threads", t.c_str(), "--hot-fraction", hot.c_str(), nullptr);
      ::_exit(127);
    }
    std::string port;
    for (int i = 0; i < 600 && port.empty(); ++i) {
      std::ifstream in(port_file);
      std::getline(in, port);
      if (port.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    target = "127.0.0.1:" + port;
  }
  auto stub =
      v1::Inference::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 200 && Stream(*stub, "warm up", 4).size() != 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!reference.empty()) {
    // Greedy tokens through the service against the reference (reference.json's greedy_ids).
    std::ifstream in(reference);
    const nlohmann::json ref = nlohmann::json::parse(in);
    int match = 0, total = 0;
    nlohmann::json written;
    written["prompts"] = nlohmann::json::array();
    // One prompt's greedy tokens through the service.
    auto generate = [&stub](const nlohmann::json& p, grpc::Status* st) {
      grpc::ClientContext ctx;
      v1::GenerateRequest req;
      req.set_prompt(p["prompt"].get<std::string>());
      req.set_max_new_tokens(static_cast<uint32_t>(p["greedy_ids"].size()));
      req.set_ignore_eos(true);
      auto reader = stub->Generate(&ctx, req);
      v1::GenerateResponse resp;
      std::vector<int> ids;
      while (reader->Read(&resp)) {
        for (const auto& t : resp.tokens()) ids.push_back(static_cast<int>(t.id()));
      }
      *st = reader->Finish();
      return ids;
    };
    for (const auto& p : ref["prompts"]) {
      grpc::Status st;
      const std::vector<int> ids = generate(p, &st);
      const bool ok = st.ok() && ids == p["greedy_ids"].get<std::vector<int>>();
      match += ok;
      total += 1;
      written["prompts"].push_back({{"prompt", p["prompt"]}, {"greedy_ids", ids}});
      if (!ok) {
        std::printf("MISMATCH %s (%s)\n", p["prompt"].get<std::string>().c_str(),
                    st.error_message().c_str());
      }
    }
    std::printf("reference: %d/%d prompts match greedy_ids\n", match, total);
    if (!write_greedy.empty()) std::ofstream(write_greedy) << written.dump(1) << "\n";
    // Again with every prompt at once, so that their decode steps share batches (and, on the
    // CUDA backend, run on several lanes).
    const size_t n = ref["prompts"].size();
    std::vector<std::vector<int>> ids(n);
    std::vector<grpc::Status> status(n);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < n; ++i) {
      threads.emplace_back([&, i] { ids[i] = generate(ref["prompts"][i], &status[i]); });
    }
    for (auto& t : threads) t.join();
    int concurrent_match = 0;
    for (size_t i = 0; i < n; ++i) {
      const auto& p = ref["prompts"][i];
      if (status[i].ok() && ids[i] == p["greedy_ids"].get<std::vector<int>>()) {
        ++concurrent_match;
      } else {
        std::printf("MISMATCH (concurrent) %s (%s)\n", p["prompt"].get<std::string>().c_str(),
                    status[i].error_message().c_str());
      }
    }
    std::printf("reference, all prompts at once: %d/%zu prompts match greedy_ids\n",
                concurrent_match, n);
  }
  std::vector<double> single, concurrent;
  for (int r = 0; r < repeats; ++r) {
    for (const char* p : kPrompts) single.push_back(Rate(Stream(*stub, p, tokens)));
    std::vector<std::vector<Clock::time_point>> ts(streams);
    std::vector<std::thread> th;
    for (int i = 0; i < streams; ++i) {
      th.emplace_back([&, i] { ts[i] = Stream(*stub, kPrompts[i % 4], tokens); });
    }
    for (auto& t : th) t.join();
    if (std::any_of(ts.begin(), ts.end(), [](const auto& t) { return t.size() < 2; })) {
      std::fprintf(stderr, "a concurrent stream failed\n");
      return 1;
    }
    Clock::time_point start = ts[0].front(), end = ts[0].back();
    for (auto& t : ts) {
      start = std::max(start, t.front());
      end = std::min(end, t.back());
    }
    size_t n = 0;
    for (auto& t : ts)
      n += std::count_if(t.begin(), t.end(), [&](auto x) { return x > start && x <= end; });
    concurrent.push_back(n / std::chrono::duration<double>(end - start).count());
  }
  if (pid > 0) {
    ::kill(pid, SIGTERM);
    ::waitpid(pid, nullptr, 0);
  }

  const double d = dense.empty() ? Median(single) : Median(dense);
  auto row = [&](const char* name, const std::vector<double>& v) {
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    std::printf("| %s | %.1f (%.1f-%.1f) | %.2f |\n", name, Median(v), *lo, *hi, Median(v) / d);
  };
  std::printf(
      "model %s, %d new tokens, %d thread(s) per process, hot fraction %s, %d x 4 "
      "prompts; median (min-max)\n\n",
      path.c_str(), tokens, threads, hot.c_str(), repeats);
  std::printf("| path | decode tokens/s | vs in-process dense |\n|---|---|---|\n");
  if (!dense.empty()) {
    row("in-process, dense FFN (`pinfer generate`)", dense);
    row("in-process, exact gate-sparse FFN", exact);
  }
  row("service, 1 stream", single);
  row(absl::StrCat("service, ", streams, " concurrent streams (aggregate)").c_str(), concurrent);
  if (!exact.empty()) {
    std::printf("\nservice / in-process exact-sparse, 1 stream: %.3f\n",
                Median(single) / Median(exact));
  }
  return 0;
}
