// Process-level helpers shared by the gateway, the workers and `pinfer serve`: one-line log
// records on stderr tagged with the process role (the supervisor and container runtimes collect
// stderr), resident memory, and port files through which tests and the supervisor learn the port
// a process bound when asked for port 0.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace pinfer {

// Sets the tag of this process's log lines ("gateway", "gpu-worker", ...).
void SetLogRole(const char* role);
// printf-style; appends a newline.
void Log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Resident set size of this process in bytes, from /proc/self/statm.
uint64_t ResidentBytes();
// Of this process's anonymous memory, the bytes in transparent huge pages (AnonHugePages of
// /proc/self/smaps_rollup; 0 where it cannot be read). Row stores ask for huge pages (madvise)
// because a layer's randomly chosen rows need the TLB reach; a fragmented host may refuse them.
uint64_t HugePageBytes();

// Writes `content` to `path` atomically (temporary file + rename), so a reader polling for the
// file never sees it half-written.
absl::Status WriteFileAtomically(const std::string& path, const std::string& content);

// Installs SIGTERM/SIGINT handlers that only set a flag (checked by ShutdownRequested), so the
// process can drain in an orderly way from its main thread. Also ignores SIGPIPE.
void InstallShutdownHandlers();
bool ShutdownRequested();
// Blocks until a shutdown signal arrives (checked every 50 ms).
void WaitForShutdown();

}  // namespace pinfer
