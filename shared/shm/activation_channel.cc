// See activation_channel.h.
#include "shared/shm/activation_channel.h"

#include <unistd.h>

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pinfer::shm {

Heartbeat::Heartbeat(std::atomic<uint64_t>* word, int64_t interval_ns)
    : word_(word), interval_ns_(interval_ns) {
  word_->store(MonotonicNanos());
  thread_ = std::thread([this] {
    while (!stop_.load()) {
      word_->store(MonotonicNanos());
      // A plain sleep is right here: nothing waits on this thread, it only proves liveness.
      std::this_thread::sleep_for(std::chrono::nanoseconds(interval_ns_));
    }
  });
}

Heartbeat::~Heartbeat() {
  stop_.store(true);
  thread_.join();
}

// ---------------------------------------------------------------------------------------------
// gpu-worker side.

ExchangeClient::ExchangeClient(std::unique_ptr<Segment> segment, const ChannelOptions& options)
    : segment_(std::move(segment)),
      options_(options),
      heartbeat_(&segment_->header()->gpu_heartbeat_ns, options.heartbeat_interval_ns) {}

ExchangeClient::~ExchangeClient() = default;

bool ExchangeClient::PeerReady() const { return PeerProblem().empty(); }

std::string ExchangeClient::PeerProblem() const {
  const Header* h = segment_->header();
  const uint64_t hb = h->cpu_heartbeat_ns.load();
  if (hb == 0) return "the cpu-worker has not attached to the shared-memory segment yet";
  const uint64_t now = MonotonicNanos();
  if (now > hb && now - hb > static_cast<uint64_t>(options_.liveness_ns)) {
    return absl::StrCat("the cpu-worker is not responding (no heartbeat for ",
                        (now - hb) / 1'000'000, " ms)");
  }
  if (h->cpu_ready.load() == 0) return "the cpu-worker is still loading its rows";
  return "";
}

absl::StatusOr<uint32_t> ExchangeClient::Post(int layer, const float* x, int n,
                                              const uint64_t* masks) {
  Header* h = segment_->header();
  const Geometry& g = h->geometry;
  if (n <= 0 || n > g.max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("exchange of ", n, " tokens; the segment holds at most ", g.max_tokens));
  }
  if (std::string problem = PeerProblem(); !problem.empty()) {
    return absl::UnavailableError(problem);
  }
  std::memcpy(segment_->request_x(), x, sizeof(float) * static_cast<size_t>(n) * g.hidden);
  if (masks != nullptr) {
    std::memcpy(segment_->request_mask(0), masks,
                sizeof(uint64_t) * static_cast<size_t>(n) * g.words_per_mask());
  }
  h->req_layer = layer;
  h->req_tokens = n;
  h->req_flags = masks != nullptr ? kRequestSparse : 0;
  const uint32_t seq = h->req_seq.load(std::memory_order_relaxed) + 1;
  h->req_seq.store(seq, std::memory_order_release);
  h->doorbell.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&h->doorbell);
  return seq;
}

absl::Status ExchangeClient::PostGuess(int layer, const int32_t* ids, int n, const uint8_t* first) {
  Header* h = segment_->header();
  const Geometry& g = h->geometry;
  if (layer < 0 || layer >= g.n_layers || n < 0) {
    return absl::InvalidArgumentError(absl::StrCat("guess for layer ", layer, " of ", g.n_layers));
  }
  if (std::string problem = PeerProblem(); !problem.empty()) {
    return absl::UnavailableError(problem);
  }
  const size_t words = static_cast<size_t>(g.words_per_mask());
  guess_.assign(2 * words, 0);  // the guess, then its first tier
  for (int i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= g.ffn) {
      return absl::InvalidArgumentError(absl::StrCat("guessed neuron ", ids[i], " of ", g.ffn));
    }
    const uint64_t bit = 1ull << (ids[i] & 63);
    guess_[ids[i] >> 6] |= bit;
    if (first != nullptr && first[i] != 0) guess_[words + (ids[i] >> 6)] |= bit;
  }
  // Sequence lock (segment.h): odd while writing.
  const uint32_t s = h->guess_seq.load(std::memory_order_relaxed);
  h->guess_seq.store(s + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  uint64_t* mask = segment_->guess_mask();
  for (size_t w = 0; w < guess_.size(); ++w) {
    std::atomic_ref<uint64_t>(mask[w]).store(guess_[w], std::memory_order_relaxed);
  }
  h->guess_layer.store(layer, std::memory_order_relaxed);
  h->guess_seq.store(s + 2, std::memory_order_release);
  h->doorbell.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&h->doorbell);
  return absl::OkStatus();
}

absl::Status ExchangeClient::AwaitAndAdd(uint32_t seq, int n, float* out, ExchangeStats* stats) {
  Header* h = segment_->header();
  const uint64_t start = MonotonicNanos();
  WaitOptions wo;
  wo.spin_ns = options_.spin_ns;
  wo.slice_ns = std::min<int64_t>(options_.liveness_ns / 4, 50'000'000);
  auto check = [&]() -> absl::Status {
    const uint64_t hb = h->cpu_heartbeat_ns.load();
    const uint64_t now = MonotonicNanos();
    if (now > hb && now - hb > static_cast<uint64_t>(options_.liveness_ns)) {
      return absl::UnavailableError(absl::StrCat("the cpu-worker stopped responding during layer ",
                                                 h->req_layer, " (no heartbeat for ",
                                                 (now - hb) / 1'000'000, " ms)"));
    }
    return absl::OkStatus();
  };
  for (;;) {
    const uint32_t cur = h->resp_seq.load(std::memory_order_acquire);
    if (cur == seq) break;
    const int64_t waited = static_cast<int64_t>(MonotonicNanos() - start);
    if (waited >= options_.exchange_timeout_ns) {
      return absl::DeadlineExceededError(
          absl::StrCat("the cpu-worker did not answer layer ", h->req_layer, " within ",
                       options_.exchange_timeout_ns / 1'000'000, " ms"));
    }
    wo.timeout_ns = options_.exchange_timeout_ns - waited;
    absl::Status st = WaitForChange(&h->resp_seq, cur, wo, check);
    if (absl::IsDeadlineExceeded(st)) continue;  // re-checked above with the full message
    if (!st.ok()) return st;
  }
  if (stats != nullptr) {
    stats->wait_ns += MonotonicNanos() - start;
    stats->cold_neurons += h->resp_neurons;
    stats->cold_compute_ns += h->resp_compute_ns;
  }
  if (h->resp_status != 0) {
    const size_t len = strnlen(h->resp_error, sizeof(h->resp_error));
    return absl::Status(static_cast<absl::StatusCode>(h->resp_status),
                        absl::StrCat("cpu-worker: ", absl::string_view(h->resp_error, len)));
  }
  const float* r = segment_->response();
  const size_t count = static_cast<size_t>(n) * h->geometry.hidden;
  for (size_t i = 0; i < count; ++i) out[i] += r[i];
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// cpu-worker side.

namespace {
// Takes the segment over for a new cpu-worker. Runs before its heartbeat starts: a fresh
// heartbeat next to the `ready` flag a dead predecessor left set would let the gpu-worker post
// a request before this worker has loaded its rows.
uint32_t ClaimSegment(Header* h) {
  h->cpu_ready.store(0);
  h->cpu_pid.store(static_cast<int32_t>(::getpid()));
  return h->cpu_owner.fetch_add(1) + 1;
}
}  // namespace

ExchangeServer::ExchangeServer(std::unique_ptr<Segment> segment, const ChannelOptions& options)
    : segment_(std::move(segment)),
      options_(options),
      owner_(ClaimSegment(segment_->header())),
      heartbeat_(&segment_->header()->cpu_heartbeat_ns, options.heartbeat_interval_ns) {}

ExchangeServer::~ExchangeServer() {
  Header* h = segment_->header();
  if (h->cpu_owner.load() == owner_) {
    h->cpu_ready.store(0);
    // Tell the gpu-worker right away instead of letting the heartbeat go stale.
    h->cpu_heartbeat_ns.store(1);
  }
}

void ExchangeServer::MarkReady(uint64_t resident_bytes) {
  Header* h = segment_->header();
  h->cpu_resident_bytes.store(resident_bytes);
  const uint32_t pending = h->req_seq.load(std::memory_order_acquire);
  if (h->resp_seq.load() != pending) {
    // A request the previous cpu-worker never answered: its sender has given up or is about to
    // (heartbeat loss); answer it with an error so that it does not wait for the timeout.
    const char msg[] = "the cpu-worker restarted during this exchange";
    std::memcpy(h->resp_error, msg, sizeof(msg));
    h->resp_status = static_cast<uint32_t>(absl::StatusCode::kUnavailable);
    h->resp_neurons = 0;
    h->resp_compute_ns = 0;
    h->resp_seq.store(pending, std::memory_order_release);
    FutexWakeAll(&h->resp_seq);
  }
  h->cpu_ready.store(1);
}

bool ExchangeServer::GpuAlive() const {
  const Header* h = segment_->header();
  const uint64_t hb = h->gpu_heartbeat_ns.load();
  const uint64_t now = MonotonicNanos();
  return h->state.load() == static_cast<uint32_t>(SegmentState::kOpen) &&
         !(now > hb && now - hb > static_cast<uint64_t>(options_.liveness_ns));
}

absl::Status ExchangeServer::Serve(const ColdHandler& handler, const std::atomic<bool>& stop,
                                   const GuessHandler& guess_handler) {
  Header* h = segment_->header();
  const Geometry& g = h->geometry;
  // Everything past the last answer is pending, including a request posted between MarkReady
  // and here.
  uint32_t seen = h->resp_seq.load(std::memory_order_acquire);
  WaitOptions wo;
  wo.spin_ns = options_.spin_ns;
  wo.slice_ns = 100'000'000;
  uint64_t last_replaced_check = MonotonicNanos();
  auto check = [&]() -> absl::Status {
    if (stop.load()) return absl::CancelledError("stopping");
    if (h->state.load() != static_cast<uint32_t>(SegmentState::kOpen)) {
      return absl::UnavailableError("the gpu-worker closed the segment");
    }
    if (h->cpu_owner.load() != owner_) {
      return absl::FailedPreconditionError("another cpu-worker took over the segment");
    }
    // While the gpu-worker looks dead, check (at most once a second) whether a new one has
    // re-created the segment under the same name.
    const uint64_t now = MonotonicNanos();
    if (!GpuAlive() && now - last_replaced_check > 1'000'000'000ull) {
      last_replaced_check = now;
      if (segment_->Replaced()) return absl::UnavailableError("the segment was re-created");
    }
    return absl::OkStatus();
  };
  uint32_t seen_guess = h->guess_seq.load(std::memory_order_acquire);
  std::vector<uint64_t> guess(2 * static_cast<size_t>(g.words_per_mask()));
  for (;;) {
    // The doorbell first: a request or guess posted after this load changes it, so the wait
    // below cannot miss one.
    const uint32_t bell = h->doorbell.load(std::memory_order_acquire);
    if (h->req_seq.load(std::memory_order_acquire) == seen) {
      const uint32_t gs = h->guess_seq.load(std::memory_order_acquire);
      if (gs != seen_guess) {
        seen_guess = gs;
        if (guess_handler && gs % 2 == 0) {  // odd: being written, its doorbell still to come
          const int layer = h->guess_layer.load(std::memory_order_relaxed);
          uint64_t* mask = segment_->guess_mask();
          for (size_t w = 0; w < guess.size(); ++w) {
            guess[w] = std::atomic_ref<uint64_t>(mask[w]).load(std::memory_order_relaxed);
          }
          // A guess overwritten while it was copied is dropped (the next one is pending).
          std::atomic_thread_fence(std::memory_order_acquire);
          if (h->guess_seq.load(std::memory_order_relaxed) == gs && layer >= 0 &&
              layer < g.n_layers) {
            guess_handler(layer, guess.data(), guess.data() + g.words_per_mask(), [&] {
              return h->req_seq.load(std::memory_order_acquire) != seen || stop.load() ||
                     !GpuAlive();
            });
          }
        }
        continue;
      }
      absl::Status st = WaitForChange(&h->doorbell, bell, wo, check);
      if (absl::IsCancelled(st)) return absl::OkStatus();
      if (!st.ok()) return st;
      continue;
    }
    const uint32_t seq = h->req_seq.load(std::memory_order_acquire);
    seen = seq;
    const int n = h->req_tokens;
    const uint64_t t0 = MonotonicNanos();
    absl::StatusOr<uint64_t> neurons;
    if (n <= 0 || n > g.max_tokens || h->req_layer < 0 || h->req_layer >= g.n_layers) {
      neurons = absl::InvalidArgumentError(
          absl::StrCat("bad request: layer ", h->req_layer, ", ", n, " tokens"));
    } else {
      std::memset(segment_->response(), 0, sizeof(float) * static_cast<size_t>(n) * g.hidden);
      neurons = handler(h->req_layer, segment_->request_x(), n,
                        (h->req_flags & kRequestSparse) ? segment_->request_mask(0) : nullptr,
                        segment_->response());
    }
    if (h->cpu_owner.load() != owner_) {
      return absl::FailedPreconditionError("another cpu-worker took over the segment");
    }
    if (neurons.ok()) {
      h->resp_status = 0;
      h->resp_neurons = *neurons;
    } else {
      const std::string msg(neurons.status().message());
      const size_t len = std::min(msg.size(), sizeof(h->resp_error) - 1);
      std::memcpy(h->resp_error, msg.data(), len);
      h->resp_error[len] = '\0';
      h->resp_status = static_cast<uint32_t>(neurons.status().code());
      h->resp_neurons = 0;
    }
    h->resp_compute_ns = MonotonicNanos() - t0;
    h->resp_seq.store(seq, std::memory_order_release);
    FutexWakeAll(&h->resp_seq);
  }
}

}  // namespace pinfer::shm
