// Waiting on a 32-bit word in shared memory: spin briefly (the answer to a per-layer exchange
// usually arrives within microseconds, and a sleep/wake round trip costs more than that), then
// sleep in the kernel with futex(2) until the peer changes the word and wakes us. Never a
// sleep-poll loop: the sleeping side wakes only when woken or when a bounded slice elapses, and
// the slices exist only to re-check liveness and deadlines, so a dead peer cannot hang us.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"

namespace pinfer::shm {

// futex(FUTEX_WAIT) on a shared (not process-private) word: sleeps while *word == expected, at
// most timeout_ns. Returns on wake, timeout, signal or when the value already differs.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);
// Wakes every waiter on the word.
void FutexWakeAll(std::atomic<uint32_t>* word);

struct WaitOptions {
  // Busy-wait this long before sleeping.
  int64_t spin_ns = 20'000;
  // Sleep in slices of at most this long; between slices `check` runs.
  int64_t slice_ns = 20'000'000;
  // Give up after this long with DEADLINE_EXCEEDED (0: only `check` ends the wait).
  int64_t timeout_ns = 0;
};

// Waits until word->load() != `seen`, i.e. until the peer published something new. `check`
// (may be empty) runs between sleep slices: a non-OK status from it ends the wait with that
// status (peer dead, request cancelled, shutting down). Returns the spin/sleep split in
// *slept (true if it had to sleep), for metrics.
absl::Status WaitForChange(const std::atomic<uint32_t>* word, uint32_t seen,
                           const WaitOptions& options, const std::function<absl::Status()>& check,
                           bool* slept = nullptr);

}  // namespace pinfer::shm
