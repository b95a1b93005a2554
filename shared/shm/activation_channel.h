// The per-layer exchange protocol over a Segment: the gpu-worker (ExchangeClient) publishes a
// layer's FFN input, computes its hot neurons meanwhile, then waits for the cpu-worker
// (ExchangeServer) to publish the cold neurons' contribution.
//
// One exchange is in flight at a time (the gpu-worker's scheduler runs one batched step at a
// time); sequence numbers pair each answer with its request so that a late answer to an abandoned
// request is never taken for the current one. Every wait is bounded: a peer whose heartbeat stops
// (dead, or stopped by a debugger or SIGSTOP) fails the exchange with UNAVAILABLE after
// `liveness_ns`; a live peer that does not answer within `exchange_timeout_ns` fails it with
// DEADLINE_EXCEEDED. Neither ever hangs the caller.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shared/shm/segment.h"
#include "shared/shm/wait.h"

namespace pinfer::shm {

struct ChannelOptions {
  int64_t heartbeat_interval_ns = 100'000'000;   // 100 ms
  int64_t liveness_ns = 2'000'000'000;           // a heartbeat older than this: peer is gone
  int64_t exchange_timeout_ns = 30'000'000'000;  // a live peer must answer within this
  int64_t spin_ns = 20'000;
};

// Writes this side's heartbeat into the segment every interval, from its own thread, so that the
// peer can tell "busy" from "dead or stopped".
class Heartbeat {
 public:
  Heartbeat(std::atomic<uint64_t>* word, int64_t interval_ns);
  ~Heartbeat();

 private:
  std::atomic<uint64_t>* word_;
  int64_t interval_ns_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

struct ExchangeStats {
  uint64_t wait_ns = 0;  // time spent waiting for the answer after the hot part was done
  uint64_t cold_neurons = 0;
  uint64_t cold_compute_ns = 0;
};

// The gpu-worker's side. Owns the segment it created.
class ExchangeClient {
 public:
  ExchangeClient(std::unique_ptr<Segment> segment, const ChannelOptions& options);
  ~ExchangeClient();

  Segment& segment() { return *segment_; }
  // The cpu-worker has attached, loaded its rows and its heartbeat is fresh.
  bool PeerReady() const;
  // Why the peer is not ready, for errors and logs.
  std::string PeerProblem() const;

  // Publishes x: [n, hidden] for `layer`. masks: [n][words_per_mask] (sparse mode) or null
  // (exact mode: the cpu-worker's gate decides). Fails fast with UNAVAILABLE if the peer is not
  // ready. Returns the request's sequence number.
  absl::StatusOr<uint32_t> Post(int layer, const float* x, int n, const uint64_t* masks);
  // Publishes a guess at the neurons (global ids, n of them) that the next request for `layer`
  // will list, so that the cpu-worker can load their rows while this side computes the layer's
  // attention; first[i] != 0 (first may be null: none) marks ids[i] as likelier, to be loaded
  // before the others. A hint only: the request is answered the same with or without it. Fails
  // fast with UNAVAILABLE if the peer is not ready, and with INVALID_ARGUMENT for a bad layer or
  // id.
  absl::Status PostGuess(int layer, const int32_t* ids, int n, const uint8_t* first = nullptr);
  // Waits for the answer to `seq` and adds the cold contribution into out: [n, hidden].
  absl::Status AwaitAndAdd(uint32_t seq, int n, float* out, ExchangeStats* stats);

 private:
  std::unique_ptr<Segment> segment_;
  ChannelOptions options_;
  Heartbeat heartbeat_;
  std::vector<uint64_t> guess_;  // PostGuess's two masks, built here before they are published
};

// What the cpu-worker computes per request: out: [n, hidden] = the contribution of its cold
// neurons for x: [n, hidden]; masks as in Post. Returns the neurons computed (summed over tokens).
using ColdHandler = std::function<absl::StatusOr<uint64_t>(int layer, const float* x, int n,
                                                           const uint64_t* masks, float* out)>;
// What the cpu-worker does with a guess (ExchangeClient::PostGuess) while no request is pending:
// mask: [words_per_mask], the guessed neurons of `layer`; first: [words_per_mask], those of them
// to load first (copies, valid during the call). It should return soon after stop() turns true
// (a request arrived, or the server is stopping).
using GuessHandler = std::function<void(int layer, const uint64_t* mask, const uint64_t* first,
                                        const std::function<bool()>& stop)>;

// The cpu-worker's side, attached to an existing segment.
class ExchangeServer {
 public:
  ExchangeServer(std::unique_ptr<Segment> segment, const ChannelOptions& options);
  ~ExchangeServer();

  Segment& segment() { return *segment_; }
  // Declares this worker the segment's cpu-worker (replacing a previous one) and, once the rows
  // are loaded, ready. Any request left unanswered by a predecessor is failed with UNAVAILABLE.
  void MarkReady(uint64_t resident_bytes);
  bool GpuAlive() const;

  // Serves requests until `stop` becomes true, the segment is closed or replaced (returns
  // UNAVAILABLE: re-attach), or another cpu-worker takes over (FAILED_PRECONDITION).
  // Guesses go to guess_handler when one is given, else they are dropped.
  absl::Status Serve(const ColdHandler& handler, const std::atomic<bool>& stop,
                     const GuessHandler& guess_handler = nullptr);
  void set_resident_bytes(uint64_t b) { segment_->header()->cpu_resident_bytes.store(b); }

 private:
  std::unique_ptr<Segment> segment_;
  ChannelOptions options_;
  uint32_t owner_ = 0;
  Heartbeat heartbeat_;
};

}  // namespace pinfer::shm
