// The shared-memory segment through which the gpu-worker and the cpu-worker exchange FFN
// activations, once per layer and step. gRPC carries control only; a per-layer round trip through
// gRPC would cost more than the cold neurons' compute, so activations go through memory.
//
// The gpu-worker creates the segment (POSIX shm, mode 0600, O_EXCL, a unique name per deployment),
// sizes it from the model and the largest token batch it will exchange, writes the placement into
// it and unlinks it when it exits. The cpu-worker attaches by name and checks the versioned header
// (magic, layout version, geometry, model fingerprint) before trusting anything in it.
//
// Layout, every region 64-byte aligned:
//   Header          control words (futexes, heartbeats) and geometry
//   hot bitmap      [n_layers][words_per_mask] u64: bit set = neuron computed by the gpu-worker
//   request x       [max_tokens, hidden] f32: FFN input of the current exchange
//   request masks   [max_tokens][words_per_mask] u64: sparse mode, predicted-active neurons
//   response        [max_tokens, hidden] f32: the cold neurons' contribution
//   guess mask      [2][words_per_mask] u64: a hint, the neurons the gpu-worker guesses the next
//                   request of layer guess_layer will list, then the subset to load first, the
//                   likelier ones (ExchangeClient::PostGuess)
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pinfer::shm {

inline constexpr uint64_t kMagic = 0x31764d4853464e50ull;  // "PNFSHMv1" little-endian
inline constexpr uint32_t kLayoutVersion = 3;  // 2: the guess mask and the doorbell; 3: its tier

// What both sides must agree on; the cpu-worker derives it from its own copy of the model and
// compares it with the header.
struct Geometry {
  int32_t n_layers = 0;
  int32_t hidden = 0;
  int32_t ffn = 0;
  int32_t max_tokens = 0;    // largest batch of tokens in one exchange
  uint64_t fingerprint = 0;  // hash of the model's configuration and FFN weight layout

  int32_t words_per_mask() const { return (ffn + 63) / 64; }
};

enum class SegmentState : uint32_t { kOpen = 1, kClosed = 2 };

// Request flags.
inline constexpr uint32_t kRequestSparse = 1u << 0;  // masks hold the neurons to compute

struct alignas(64) Header {
  // Identity, written once by the creator before anything else can see the segment... and
  // checked by the attacher.
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint64_t total_bytes;
  Geometry geometry;
  uint64_t instance_id;  // random per creation: tells a re-created segment from the old one
  uint64_t hot_bitmap_offset, request_x_offset, request_mask_offset, response_offset;
  uint64_t guess_mask_offset;
  int32_t creator_pid;
  std::atomic<uint32_t> state;  // SegmentState

  // gpu-worker -> cpu-worker. req_seq is the futex word the cpu-worker sleeps on; the request's
  // fields are written before req_seq is incremented (release) and read after (acquire).
  alignas(64) std::atomic<uint32_t> req_seq;
  int32_t req_layer;
  int32_t req_tokens;
  uint32_t req_flags;
  // A guess (a hint, never needed for a correct answer), under a sequence lock: guess_seq is odd
  // while the gpu-worker writes the guess mask and guess_layer and even once they are complete
  // (release); the reader drops a guess whose guess_seq was odd or changed while it read it. The
  // mask's words are accessed as relaxed atomics, since the two sides may touch them at once.
  std::atomic<uint32_t> guess_seq;
  std::atomic<int32_t> guess_layer;
  // The futex word the cpu-worker sleeps on: incremented after every request and every guess.
  std::atomic<uint32_t> doorbell;

  // cpu-worker -> gpu-worker. resp_seq equals the req_seq it answers; resp_status 0 is success,
  // otherwise an absl::StatusCode with resp_error holding the message.
  alignas(64) std::atomic<uint32_t> resp_seq;
  uint32_t resp_status;
  char resp_error[256];
  // Cold neurons the cpu-worker computed in the answered request (summed over tokens).
  uint64_t resp_neurons;
  uint64_t resp_compute_ns;

  // Liveness: CLOCK_MONOTONIC nanoseconds of each side's last heartbeat (0: never). A peer
  // whose heartbeat is older than the liveness timeout is treated as dead or stalled.
  alignas(64) std::atomic<uint64_t> gpu_heartbeat_ns;
  std::atomic<uint64_t> cpu_heartbeat_ns;
  // Incremented by every cpu-worker that attaches; a cpu-worker that finds a newer value than
  // its own has been replaced and must stop answering.
  std::atomic<uint32_t> cpu_owner;
  std::atomic<int32_t> cpu_pid;
  // Set by the cpu-worker once it has loaded the cold rows of the placement in this segment.
  std::atomic<uint32_t> cpu_ready;
  std::atomic<uint64_t> cpu_resident_bytes;
};

// Monotonic clock in nanoseconds, comparable across processes on one machine.
uint64_t MonotonicNanos();

// Validates a POSIX shared-memory name: "/" followed by 1..200 of [A-Za-z0-9._-].
absl::Status ValidateSegmentName(absl::string_view name);

// A fresh, unique segment name for one deployment: /pinfer-<pid>-<random>.
std::string UniqueSegmentName();

class Segment {
 public:
  // Creates the segment exclusively. If a segment of that name already exists and its creator is
  // gone (a crashed earlier gpu-worker), it is marked closed (so attached peers let go of it),
  // unlinked and created afresh; if its creator is still alive, that is an error.
  static absl::StatusOr<std::unique_ptr<Segment>> Create(const std::string& name,
                                                         const Geometry& geometry);
  // Attaches to an existing segment and checks its header against `expected` (geometry and
  // fingerprint; max_tokens is taken from the header).
  static absl::StatusOr<std::unique_ptr<Segment>> Attach(const std::string& name,
                                                         const Geometry& expected);
  // Unmaps; the creator also marks the segment closed and unlinks it.
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Header* header() const { return header_; }
  const Geometry& geometry() const { return header_->geometry; }
  uint64_t* hot_bitmap(int layer) const;
  float* request_x() const;
  uint64_t* request_mask(int token) const;
  uint64_t* guess_mask() const;  // [2][words_per_mask]: the guess, then its first tier
  float* response() const;
  const std::string& name() const { return name_; }
  size_t size() const { return size_; }
  bool creator() const { return creator_; }
  // True when the segment's name now refers to a different segment (or none): the creator has
  // gone and a new one may have taken the name. Attachers poll this while idle.
  bool Replaced() const;

  static size_t BytesFor(const Geometry& g);

 private:
  Segment(std::string name, void* base, size_t size, bool creator, uint64_t inode)
      : name_(std::move(name)),
        base_(base),
        size_(size),
        creator_(creator),
        inode_(inode),
        header_(static_cast<Header*>(base)) {}
  std::string name_;
  void* base_;
  size_t size_;
  bool creator_;
  uint64_t inode_;
  Header* header_;
};

}  // namespace pinfer::shm
