// See log.h.
#include "shared/service/log.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <ctime>
#include <thread>

#include "absl/strings/str_cat.h"

namespace pinfer {
namespace {
const char* g_role = "pinfer";
volatile sig_atomic_t g_shutdown = 0;
void OnSignal(int) { g_shutdown = 1; }
}  // namespace

void SetLogRole(const char* role) { g_role = role; }

void Log(const char* fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  struct timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  ::gmtime_r(&ts.tv_sec, &tm);
  char when[32];
  std::strftime(when, sizeof(when), "%H:%M:%S", &tm);
  // One write per line, so lines of concurrent processes sharing stderr do not interleave.
  std::fprintf(stderr, "%s.%03ld %s[%d] %s\n", when, ts.tv_nsec / 1'000'000, g_role,
               static_cast<int>(::getpid()), msg);
}

uint64_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int got = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  if (got != 2) return 0;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

uint64_t HugePageBytes() {
  FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kb = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "AnonHugePages: %llu kB", &kb) == 1) break;
  }
  std::fclose(f);
  return static_cast<uint64_t>(kb) * 1024;
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& content) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  std::fwrite(content.data(), 1, content.size(), f);
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

void InstallShutdownHandlers() {
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

bool ShutdownRequested() { return g_shutdown != 0; }

void WaitForShutdown() {
  while (!ShutdownRequested()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

}  // namespace pinfer
