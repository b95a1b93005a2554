// See wait.h.
#include "shared/shm/wait.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "shared/shm/segment.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PINFER_CPU_RELAX() _mm_pause()
#else
#define PINFER_CPU_RELAX() ((void)0)
#endif

namespace pinfer::shm {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "futex words must be plain lock-free 32-bit integers");

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1'000'000'000;
  ts.tv_nsec = timeout_ns % 1'000'000'000;
  // Not FUTEX_PRIVATE_FLAG: the word lives in memory shared between processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
            0);
}

absl::Status WaitForChange(const std::atomic<uint32_t>* word, uint32_t seen,
                           const WaitOptions& options, const std::function<absl::Status()>& check,
                           bool* slept) {
  if (slept != nullptr) *slept = false;
  const uint64_t start = MonotonicNanos();
  // Spin: check the clock only every 64 iterations, it costs more than a pause.
  for (int i = 0;; ++i) {
    if (word->load(std::memory_order_acquire) != seen) return absl::OkStatus();
    if ((i & 63) == 63 && MonotonicNanos() - start >= static_cast<uint64_t>(options.spin_ns)) break;
    PINFER_CPU_RELAX();
  }
  if (slept != nullptr) *slept = true;
  auto* w = const_cast<std::atomic<uint32_t>*>(word);
  for (;;) {
    if (check) {
      absl::Status st = check();
      if (!st.ok()) return st;
    }
    int64_t slice = options.slice_ns;
    if (options.timeout_ns > 0) {
      const int64_t waited = static_cast<int64_t>(MonotonicNanos() - start);
      if (waited >= options.timeout_ns) {
        return absl::DeadlineExceededError(
            absl::StrCat("no answer within ", options.timeout_ns / 1'000'000, " ms"));
      }
      slice = std::min(slice, options.timeout_ns - waited);
    }
    FutexWait(w, seen, slice);
    if (word->load(std::memory_order_acquire) != seen) return absl::OkStatus();
  }
}

}  // namespace pinfer::shm
