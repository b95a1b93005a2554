// `pinfer serve`: runs the whole service on one machine. It starts the gateway and the two
// workers as child processes with a private shared-memory segment (a fresh unique name) and
// private control sockets (unix sockets in a 0700 temporary directory), restarts any child that
// dies (with back-off), and on SIGTERM/SIGINT lets the gateway drain before stopping the workers,
// then removes the segment and the directory.
//
// The children are the same binaries users run separately in containers (pinfer-gateway,
// pinfer-gpu-worker, pinfer-cpu-worker); they are looked for in --bin-dir, beside this
// executable, in ../bin relative to it (the build tree), then on PATH. They get
// PR_SET_PDEATHSIG so that they never outlive a supervisor that was killed outright.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "shared/engine/ops.h"
#include "shared/service/log.h"
#include "shared/service/service_model.h"
#include "shared/shm/segment.h"
#include "shared/sparse/auto_prepare.h"
#include "shared/util/status_macros.h"
#include "shared/util/thread_pool.h"

namespace pinfer::cli {
namespace {

constexpr char kUsage[] =
    "usage: pinfer serve --model PATH [--port P] [--host H] [--metrics-port M]\n"
    "         [--gpu-metrics-port P] [--cpu-metrics-port P] [--threads N] [--cpu-threads N]\n"
    "         [--hot-fraction F] [--max-batch-tokens N] [--max-running N] [--max-queue N]\n"
    "         [--max-new-tokens-limit N] [--drain-timeout-ms MS] [--bin-dir DIR]\n"
    "         [--port-file FILE] [--metrics-port-file FILE] [--status-file FILE] [--sparse]\n"
    "         [--placement FILE.gpuidx | --vram-budget SIZE] [--cold-prefill auto|cpu|stream]\n"
    "         [--stream-chunk-rows N] [--stream-slots N] [--adaptive-cache-rows N]\n"
    "         [--adaptive-cache-thread] [--cold-gpu-share auto|off|F] [--decode-lanes N] "
    "[--cpu-spin-us US] [--cold-guess]\n"
    "         [--http-port P] [--http-port-file FILE] [--api-key KEY | --api-key-file FILE]\n"
    "         [--chat-template FILE] [--prefix-cache-entries N] [--prefix-cache-size SIZE]\n"
    "  --prefix-cache-entries / --prefix-cache-size: finished sequences' KV caches kept so that\n"
    "            a prompt starting with one's tokens (a chat's next turn) computes only the rest\n"
    "            (default 8 caches, at most 1GiB on the CPU; 0 entries: off)\n"
    "  --chat-template: the Jinja chat template Chat renders messages with, instead of the\n"
    "            model's own (GGUF tokenizer.chat_template, chat_template.jinja or\n"
    "            tokenizer_config.json)\n"
    "  --port: public gRPC port of the gateway (default 50051; 0 picks one, see --port-file)\n"
    "  --http-port: the gateway's OpenAI-compatible HTTP API and chat page (off unless given;\n"
    "            0 picks one, see --http-port-file); --api-key(-file) makes /v1/ ask for it\n"
    "  --metrics-port: the gateway's /metrics (off unless given); the workers default to M+1\n"
    "                  and M+2 (or 0 = any free port, when M is 0)\n"
    "  --threads / --cpu-threads: compute threads of the gpu-worker / cpu-worker (default 1)\n"
    "  --cpu-spin-us: how long the cpu-worker's threads poll for work before sleeping (default\n"
    "            200; see pinfer-cpu-worker --help)\n"
    "  --vram-budget: GPU memory for the gpu-worker (bytes or 8MiB, 24GiB); the most frequently\n"
    "                 active neurons that fit are hot (see pinfer-gpu-worker --help)\n"
    "  --cold-prefill: who computes prompt batches' cold FFN rows with a GPU: the cpu-worker,\n"
    "                 the GPU streaming them, or a measured cost model per layer (auto, the\n"
    "                 default); passed to the gpu-worker (see pinfer-gpu-worker --help)\n"
    "  --status-file: JSON with the children's pids and the segment name, rewritten on restart\n"
    "  --sparse: predictor-driven FFN sparsity; an unprepared model is prepared (and cached)\n"
    "            first, as `pinfer generate --sparse` does\n"
    "  --adaptive-cache-rows: with --sparse and a GPU, extra GPU rows per layer that follow the\n"
    "            cold neurons the text keeps activating (see pinfer-gpu-worker --help)\n"
    "  --adaptive-cache-thread: the cache's bookkeeping on a thread of its own (see\n"
    "            pinfer-gpu-worker --help)\n"
    "  --cold-gpu-share: with --sparse and a GPU, how much of the cold work the GPU takes over\n"
    "            PCIe (auto, the default; see pinfer-gpu-worker --help)\n"
    "  --decode-lanes: with a GPU, decode steps of up to N sequences in flight at once (default\n"
    "            2; see pinfer-gpu-worker --help)\n"
    "  --cold-guess: with --sparse and a GPU, the GPU guesses each layer's cold neurons before\n"
    "            its attention and the cpu-worker loads their rows meanwhile (gpu-worker\n"
    "            --cold-guess, cpu-worker --prefetch-guess)\n";

struct Child {
  std::string role;
  std::vector<std::string> argv;
  pid_t pid = -1;
  std::chrono::steady_clock::time_point started;
  int restarts = 0;
  int backoff_ms = 200;
  std::chrono::steady_clock::time_point restart_at;
  bool pending_restart = false;
};

std::string FindBinary(const std::string& bin_dir, const std::string& name) {
  std::vector<std::string> dirs;
  if (!bin_dir.empty()) dirs.push_back(bin_dir);
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len > 0) {
    std::string dir(self, static_cast<size_t>(len));
    dir = dir.substr(0, dir.rfind('/'));
    dirs.push_back(dir);
    dirs.push_back(dir + "/../bin");
  }
  for (const std::string& d : dirs) {
    const std::string p = d + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return name;  // execvp searches PATH
}

pid_t Spawn(const Child& c) {
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  // Child: die with the supervisor, get default signal handling back, then exec.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) ::_exit(1);
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGPIPE, SIG_DFL);
  // Each child in its own process group: a terminal's Ctrl-C goes to the supervisor, which
  // shuts the children down in order.
  ::setpgid(0, 0);
  std::vector<char*> argv;
  for (const std::string& a : c.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "pinfer serve: cannot run %s: %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

void WriteStatus(const std::string& path, const std::vector<Child>& children,
                 const std::string& segment) {
  if (path.empty()) return;
  std::vector<std::string> parts;
  for (const Child& c : children) {
    parts.push_back(absl::StrCat("\"", c.role, "\": ", c.pid));
    parts.push_back(absl::StrCat("\"", c.role, "_restarts\": ", c.restarts));
  }
  parts.push_back(absl::StrCat("\"segment\": \"", segment, "\""));
  (void)WriteFileAtomically(path, absl::StrCat("{", absl::StrJoin(parts, ", "), "}\n"));
}

// Waits up to `ms` for the given children to exit; returns whether all did.
bool WaitExit(std::vector<Child*> cs, int ms) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    bool all = true;
    for (Child* c : cs) {
      if (c->pid <= 0) continue;
      int status;
      if (::waitpid(c->pid, &status, WNOHANG) == c->pid) {
        c->pid = -1;
      } else {
        all = false;
      }
    }
    if (all) return true;
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

int ServeCommand(const std::vector<std::string>& args) {
  auto parsed = Flags::Parse(args,
                             {"model",
                              "port",
                              "host",
                              "metrics-port",
                              "gpu-metrics-port",
                              "cpu-metrics-port",
                              "threads",
                              "cpu-threads",
                              "hot-fraction",
                              "max-batch-tokens",
                              "max-running",
                              "max-queue",
                              "max-new-tokens-limit",
                              "drain-timeout-ms",
                              "bin-dir",
                              "port-file",
                              "metrics-port-file",
                              "status-file",
                              "placement",
                              "vram-budget",
                              "cold-prefill",
                              "stream-chunk-rows",
                              "stream-slots",
                              "adaptive-cache-rows",
                              "cold-gpu-share",
                              "decode-lanes",
                              "cpu-spin-us",
                              "http-port",
                              "http-port-file",
                              "api-key",
                              "api-key-file",
                              "chat-template",
                              "prefix-cache-entries",
                              "prefix-cache-size"},
                             {"sparse", "cold-guess", "adaptive-cache-thread"});
  if (!parsed.ok()) return UsageError(kUsage, parsed.status());
  const Flags& f = *parsed;
  auto model = f.Required("model");
  if (!model.ok()) return UsageError(kUsage, model.status());
  auto port = f.Int("port", 50051);
  auto drain = f.Int("drain-timeout-ms", 30000);
  if (!port.ok() || *port < 0 || *port > 65535) {
    return UsageError(kUsage, absl::InvalidArgumentError("--port must be in [0, 65535]"));
  }
  if (f.Has("vram-budget")) {
    auto budget = f.Size("vram-budget", 0);
    if (!budget.ok()) return UsageError(kUsage, budget.status());
    if (*budget == 0) {
      return UsageError(kUsage, absl::InvalidArgumentError("--vram-budget must be positive"));
    }
    if (f.Has("placement") || f.Has("hot-fraction")) {
      return UsageError(kUsage, absl::InvalidArgumentError(
                                    "--vram-budget excludes --placement and --hot-fraction"));
    }
  }
  // Checked here too, so that a typo stops serve at once instead of a gpu-worker restart loop.
  if (auto v = f.Get("cold-prefill"); v && *v != "auto" && *v != "cpu" && *v != "stream") {
    return UsageError(
        kUsage, absl::InvalidArgumentError(
                    absl::StrCat("--cold-prefill must be auto, cpu or stream (got \"", *v, "\")")));
  }
  // (The gpu-worker's limit, kMaxDecodeLanes.)
  if (auto lanes = f.Int("decode-lanes", 2); !lanes.ok() || *lanes < 1 || *lanes > 8) {
    return UsageError(kUsage, absl::InvalidArgumentError("--decode-lanes must be in [1, 8]"));
  }
  if (auto spin = f.Int("cpu-spin-us", 200); !spin.ok() || *spin < 0 || *spin > 1'000'000) {
    return UsageError(kUsage, absl::InvalidArgumentError("--cpu-spin-us must be in [0, 1000000]"));
  }
  if (auto v = f.Get("cold-gpu-share"); v && *v != "auto" && *v != "off") {
    double share = 0;
    if (!absl::SimpleAtod(*v, &share) || !(share > 0 && share <= 1)) {
      return UsageError(kUsage, absl::InvalidArgumentError(absl::StrCat(
                                    "--cold-gpu-share must be auto, off or a fraction in (0, 1] "
                                    "(got \"",
                                    *v, "\")")));
    }
  }
  if (f.Has("cold-guess") && !f.Has("sparse")) {
    return UsageError(kUsage, absl::InvalidArgumentError("--cold-guess needs --sparse"));
  }
  if (f.Has("adaptive-cache-rows") && !f.Has("sparse")) {
    return UsageError(kUsage, absl::InvalidArgumentError("--adaptive-cache-rows needs --sparse"));
  }
  if (f.Has("adaptive-cache-thread") && !f.Has("adaptive-cache-rows")) {
    return UsageError(
        kUsage, absl::InvalidArgumentError("--adaptive-cache-thread needs --adaptive-cache-rows"));
  }
  for (const char* flag : {"stream-chunk-rows", "stream-slots", "adaptive-cache-rows"}) {
    if (!f.Has(flag)) continue;
    auto v = f.Int(flag, 0);
    if (!v.ok()) return UsageError(kUsage, v.status());
    if (*v < 1) {
      return UsageError(kUsage,
                        absl::InvalidArgumentError(absl::StrCat("--", flag, " must be positive")));
    }
  }
  if (auto v = f.Int("prefix-cache-entries", 8); !v.ok() || *v < 0 || *v > 4096) {
    return UsageError(kUsage,
                      absl::InvalidArgumentError("--prefix-cache-entries must be in [0, 4096]"));
  }
  if (auto v = f.Size("prefix-cache-size", 1ull << 30); !v.ok()) {
    return UsageError(kUsage, v.status());
  }
  if (!drain.ok() || *drain < 0) {
    return UsageError(kUsage, absl::InvalidArgumentError("--drain-timeout-ms must be >= 0"));
  }
  if (!std::filesystem::exists(*model)) {
    return RuntimeError(absl::NotFoundError(absl::StrCat("model ", *model, " not found")));
  }
  SetLogRole("pinfer serve");
  InstallShutdownHandlers();

  // Private control sockets and a unique segment for this deployment.
  char dir_template[] = "/tmp/pinfer-serve-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    return RuntimeError(absl::InternalError("cannot create a runtime directory in /tmp"));
  }
  const std::string dir = dir_template;
  const std::string segment = shm::UniqueSegmentName();
  const std::string gpu_addr = absl::StrCat("unix:", dir, "/gpu-worker.sock");
  const std::string cpu_addr = absl::StrCat("unix:", dir, "/cpu-worker.sock");
  const std::string bin_dir = f.Get("bin-dir").value_or("");
  auto pass = [&](std::vector<std::string>* argv, const char* flag, const char* as = nullptr) {
    if (auto v = f.Get(flag)) {
      argv->push_back(absl::StrCat("--", as != nullptr ? as : flag));
      argv->push_back(*v);
    }
  };
  std::string gpu_metrics, cpu_metrics;
  if (auto m = f.Get("metrics-port")) {
    auto mp = f.Int("metrics-port", 0);
    if (!mp.ok() || *mp < 0 || *mp > 65533) {
      return UsageError(kUsage, absl::InvalidArgumentError("--metrics-port out of range"));
    }
    gpu_metrics = *mp == 0 ? "0" : absl::StrCat(*mp + 1);
    cpu_metrics = *mp == 0 ? "0" : absl::StrCat(*mp + 2);
  }
  if (auto v = f.Get("gpu-metrics-port")) gpu_metrics = *v;
  if (auto v = f.Get("cpu-metrics-port")) cpu_metrics = *v;

  // --sparse needs predictors: serve a prepared model, preparing (and caching) it first when the
  // given one is not, so that both workers load the same prepared file.
  std::string served_model = *model;
  if (f.Has("sparse") && !IsPreparedModelFile(served_model)) {
    ThreadPool pool(2);
    auto ops = NewSimdOps(&pool);
    auto prepared = EnsurePrepared(served_model, *ops,
                                   [](const std::string& line) { Log("%s", line.c_str()); });
    if (!prepared.ok()) return RuntimeError(prepared.status());
    served_model = *prepared;
    Log("serving the prepared model %s", served_model.c_str());
  }

  std::vector<Child> children(3);
  Child& gpu = children[0];
  Child& cpu = children[1];
  Child& gw = children[2];
  gpu.role = "gpu_worker";
  gpu.argv = {FindBinary(bin_dir, "pinfer-gpu-worker"),
              "--model",
              served_model,
              "--listen",
              gpu_addr,
              "--segment",
              segment};
  pass(&gpu.argv, "threads");
  pass(&gpu.argv, "hot-fraction");
  pass(&gpu.argv, "placement");
  pass(&gpu.argv, "vram-budget");
  pass(&gpu.argv, "max-batch-tokens");
  pass(&gpu.argv, "max-new-tokens-limit");
  pass(&gpu.argv, "cold-prefill");
  pass(&gpu.argv, "stream-chunk-rows");
  pass(&gpu.argv, "stream-slots");
  pass(&gpu.argv, "adaptive-cache-rows");
  pass(&gpu.argv, "cold-gpu-share");
  pass(&gpu.argv, "decode-lanes");
  pass(&gpu.argv, "chat-template");
  pass(&gpu.argv, "prefix-cache-entries");
  pass(&gpu.argv, "prefix-cache-size");
  if (f.Has("sparse")) gpu.argv.push_back("--sparse");
  if (f.Has("cold-guess")) gpu.argv.push_back("--cold-guess");
  if (f.Has("adaptive-cache-thread")) gpu.argv.push_back("--adaptive-cache-thread");
  if (!gpu_metrics.empty()) {
    gpu.argv.insert(gpu.argv.end(), {"--metrics-port", gpu_metrics, "--metrics-port-file",
                                     dir + "/gpu-worker.metrics-port"});
  }
  cpu.role = "cpu_worker";
  cpu.argv = {FindBinary(bin_dir, "pinfer-cpu-worker"),
              "--model",
              served_model,
              "--listen",
              cpu_addr,
              "--segment",
              segment};
  pass(&cpu.argv, "cpu-threads", "threads");
  pass(&cpu.argv, "cpu-spin-us", "spin-us");
  if (f.Has("cold-guess")) cpu.argv.push_back("--prefetch-guess");
  if (!cpu_metrics.empty()) {
    cpu.argv.insert(cpu.argv.end(), {"--metrics-port", cpu_metrics, "--metrics-port-file",
                                     dir + "/cpu-worker.metrics-port"});
  }
  gw.role = "gateway";
  gw.argv = {FindBinary(bin_dir, "pinfer-gateway"), "--workers", gpu_addr, "--listen",
             absl::StrCat(f.Get("host").value_or("0.0.0.0"), ":", *port)};
  pass(&gw.argv, "metrics-port");
  pass(&gw.argv, "port-file");
  pass(&gw.argv, "metrics-port-file");
  pass(&gw.argv, "http-port");
  pass(&gw.argv, "http-port-file");
  pass(&gw.argv, "api-key");
  pass(&gw.argv, "api-key-file");
  pass(&gw.argv, "max-running");
  pass(&gw.argv, "max-queue");
  pass(&gw.argv, "max-new-tokens-limit");
  pass(&gw.argv, "drain-timeout-ms");

  for (Child& c : children) {
    c.pid = Spawn(c);
    c.started = std::chrono::steady_clock::now();
    Log("started %s (pid %d): %s", c.role.c_str(), c.pid, absl::StrJoin(c.argv, " ").c_str());
  }
  const std::string status_file = f.Get("status-file").value_or("");
  WriteStatus(status_file, children, segment);
  Log("segment %s, control sockets in %s", segment.c_str(), dir.c_str());

  // Supervise until asked to stop.
  while (!ShutdownRequested()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    const auto now = std::chrono::steady_clock::now();
    if (pid > 0) {
      for (Child& c : children) {
        if (c.pid != pid) continue;
        c.pid = -1;
        const std::string how = WIFSIGNALED(status)
                                    ? absl::StrCat("was killed by signal ", WTERMSIG(status))
                                    : absl::StrCat("exited with status ", WEXITSTATUS(status));
        // A child that ran for a while gets a fresh back-off; a crash loop backs off to 5 s.
        if (now - c.started > std::chrono::seconds(30)) c.backoff_ms = 200;
        Log("%s (pid %d) %s; restarting in %d ms", c.role.c_str(), pid, how.c_str(), c.backoff_ms);
        if (&c == &gpu) {
          // The dead gpu-worker could not unlink its segment; free the name for its successor
          // (the cpu-worker notices the heartbeat stop and re-attaches to the new one).
          ::shm_unlink(segment.c_str());
        }
        c.pending_restart = true;
        c.restart_at = now + std::chrono::milliseconds(c.backoff_ms);
        c.backoff_ms = std::min(c.backoff_ms * 2, 5000);
      }
      continue;
    }
    for (Child& c : children) {
      if (c.pending_restart && now >= c.restart_at) {
        c.pending_restart = false;
        c.pid = Spawn(c);
        c.started = now;
        c.restarts += 1;
        Log("restarted %s (pid %d)", c.role.c_str(), c.pid);
        WriteStatus(status_file, children, segment);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  // Orderly shutdown: the gateway drains first, then the workers stop.
  Log("shutting down");
  if (gw.pid > 0) ::kill(gw.pid, SIGTERM);
  if (!WaitExit({&gw}, static_cast<int>(*drain) + 5000) && gw.pid > 0) ::kill(gw.pid, SIGKILL);
  for (Child* c : {&gpu, &cpu}) {
    if (c->pid > 0) ::kill(c->pid, SIGTERM);
  }
  if (!WaitExit({&gpu, &cpu}, 10000)) {
    for (Child* c : {&gpu, &cpu}) {
      if (c->pid > 0) ::kill(c->pid, SIGKILL);
    }
    WaitExit({&gpu, &cpu}, 2000);
  }
  WaitExit({&gw}, 1000);
  ::shm_unlink(segment.c_str());  // normally already gone with the gpu-worker
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  Log("stopped");
  return 0;
}

}  // namespace pinfer::cli
