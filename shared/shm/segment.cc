// See segment.h.
#include "shared/shm/segment.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "shared/shm/wait.h"

namespace pinfer::shm {
namespace {

constexpr size_t kAlign = 64;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A creator whose heartbeat is older than this is gone (crashed without unlinking).
constexpr uint64_t kStaleCreatorNs = 3'000'000'000ull;

struct Offsets {
  size_t hot_bitmap, request_x, request_mask, response, guess_mask, total;
};

Offsets ComputeOffsets(const Geometry& g) {
  Offsets o;
  const size_t mask_bytes = static_cast<size_t>(g.words_per_mask()) * 8;
  const size_t act_bytes = static_cast<size_t>(g.max_tokens) * g.hidden * sizeof(float);
  o.hot_bitmap = AlignUp(sizeof(Header));
  o.request_x = AlignUp(o.hot_bitmap + static_cast<size_t>(g.n_layers) * mask_bytes);
  o.request_mask = AlignUp(o.request_x + act_bytes);
  o.response = AlignUp(o.request_mask + static_cast<size_t>(g.max_tokens) * mask_bytes);
  o.guess_mask = AlignUp(o.response + act_bytes);
  o.total = AlignUp(o.guess_mask + 2 * mask_bytes);  // the guess, then its first tier
  return o;
}

std::string Errno(const char* what, const std::string& name) {
  return absl::StrCat(what, " ", name, ": ", std::strerror(errno));
}

absl::Status CheckGeometry(const Geometry& g) {
  if (g.n_layers <= 0 || g.hidden <= 0 || g.ffn <= 0 || g.max_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bad segment geometry: layers %d hidden %d ffn %d max_tokens %d",
                        g.n_layers, g.hidden, g.ffn, g.max_tokens));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t MonotonicNanos() {
  struct timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

absl::Status ValidateSegmentName(absl::string_view name) {
  if (name.size() < 2 || name.size() > 201 || name[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("segment name '", name, "' must be '/' followed by 1 to 200 characters"));
  }
  for (char c : name.substr(1)) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("segment name '", name, "' may only contain [A-Za-z0-9._-] after '/'"));
    }
  }
  return absl::OkStatus();
}

std::string UniqueSegmentName() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return absl::StrFormat("/pinfer-%d-%016x", static_cast<int>(::getpid()), r);
}

size_t Segment::BytesFor(const Geometry& g) { return ComputeOffsets(g).total; }

absl::StatusOr<std::unique_ptr<Segment>> Segment::Create(const std::string& name,
                                                         const Geometry& geometry) {
  if (absl::Status st = ValidateSegmentName(name); !st.ok()) return st;
  if (absl::Status st = CheckGeometry(geometry); !st.ok()) return st;
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EEXIST) {
    // Left behind by a creator that died without unlinking? Only then may we take the name.
    int old = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (old >= 0) {
      struct stat st;
      bool stale = false;
      if (::fstat(old, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(Header)) {
        void* p = ::mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, old, 0);
        if (p != MAP_FAILED) {
          auto* h = static_cast<Header*>(p);
          if (h->magic == kMagic && h->version == kLayoutVersion) {
            const uint64_t hb = h->gpu_heartbeat_ns.load();
            // Gone: no heartbeat for a while, or (same PID namespace) no such process any more.
            stale = hb == 0 || MonotonicNanos() - hb > kStaleCreatorNs ||
                    (h->creator_pid > 0 && ::kill(h->creator_pid, 0) != 0 && errno == ESRCH);
            if (stale) {
              // Attached cpu-workers see this and let go of the old segment.
              h->state.store(static_cast<uint32_t>(SegmentState::kClosed));
              FutexWakeAll(&h->req_seq);
              FutexWakeAll(&h->doorbell);
            }
          }
          ::munmap(p, sizeof(Header));
        }
      }
      ::close(old);
      if (!stale) {
        return absl::AlreadyExistsError(absl::StrCat(
            "shared-memory segment ", name,
            " already exists and belongs to a live gpu-worker (or is not a pinfer segment)"));
      }
      ::shm_unlink(name.c_str());
    }
    fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  }
  if (fd < 0) return absl::InternalError(Errno("shm_open", name));
  const Offsets o = ComputeOffsets(geometry);
  if (::ftruncate(fd, static_cast<off_t>(o.total)) != 0) {
    std::string msg = Errno("ftruncate", name);
    ::close(fd);
    ::shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(msg);
  }
  struct stat st;
  ::fstat(fd, &st);
  void* base = ::mmap(nullptr, o.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    return absl::InternalError(Errno("mmap", name));
  }
  // A fresh shm object is zero-filled, so the atomics start at 0.
  auto* h = static_cast<Header*>(base);
  h->version = kLayoutVersion;
  h->header_bytes = sizeof(Header);
  h->total_bytes = o.total;
  h->geometry = geometry;
  std::random_device rd;
  h->instance_id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  h->hot_bitmap_offset = o.hot_bitmap;
  h->request_x_offset = o.request_x;
  h->request_mask_offset = o.request_mask;
  h->response_offset = o.response;
  h->guess_mask_offset = o.guess_mask;
  h->creator_pid = static_cast<int32_t>(::getpid());
  h->gpu_heartbeat_ns.store(MonotonicNanos());
  h->state.store(static_cast<uint32_t>(SegmentState::kOpen));
  // The magic goes last: an attacher that sees it sees a complete header.
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return std::unique_ptr<Segment>(new Segment(name, base, o.total, true, st.st_ino));
}

absl::StatusOr<std::unique_ptr<Segment>> Segment::Attach(const std::string& name,
                                                         const Geometry& expected) {
  if (absl::Status st = ValidateSegmentName(name); !st.ok()) return st;
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("shared-memory segment ", name, " does not exist"));
    }
    return absl::PermissionDeniedError(Errno("shm_open", name));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(Errno("fstat", name));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < sizeof(Header)) {
    ::close(fd);
    // Possibly caught between shm_open and ftruncate of the creator: callers retry.
    return absl::UnavailableError(absl::StrCat("segment ", name, " is not initialised yet"));
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) return absl::InternalError(Errno("mmap", name));
  auto fail = [&](absl::Status s) {
    ::munmap(base, size);
    return s;
  };
  const auto* h = static_cast<const Header*>(base);
  if (h->magic != kMagic) {
    if (h->magic == 0) {
      return fail(
          absl::UnavailableError(absl::StrCat("segment ", name, " is not initialised yet")));
    }
    return fail(absl::FailedPreconditionError(
        absl::StrCat("segment ", name, " is not a pinfer activation segment (bad magic)")));
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  if (h->version != kLayoutVersion || h->header_bytes != sizeof(Header)) {
    return fail(absl::FailedPreconditionError(absl::StrFormat(
        "segment %s has layout version %d (header %d bytes); this build speaks version %d "
        "(header %d bytes)",
        name, h->version, h->header_bytes, kLayoutVersion, sizeof(Header))));
  }
  const Geometry& g = h->geometry;
  if (g.n_layers != expected.n_layers || g.hidden != expected.hidden || g.ffn != expected.ffn ||
      g.fingerprint != expected.fingerprint) {
    return fail(absl::FailedPreconditionError(absl::StrFormat(
        "segment %s was made for another model (layers %d hidden %d ffn %d fingerprint %016x; "
        "this worker loaded layers %d hidden %d ffn %d fingerprint %016x)",
        name, g.n_layers, g.hidden, g.ffn, g.fingerprint, expected.n_layers, expected.hidden,
        expected.ffn, expected.fingerprint)));
  }
  const Offsets o = ComputeOffsets(g);
  if (h->total_bytes != o.total || size < o.total || h->response_offset != o.response ||
      h->request_x_offset != o.request_x || h->request_mask_offset != o.request_mask ||
      h->hot_bitmap_offset != o.hot_bitmap || h->guess_mask_offset != o.guess_mask) {
    return fail(absl::FailedPreconditionError(
        absl::StrCat("segment ", name, " has an inconsistent layout (size ", size, ")")));
  }
  if (h->state.load() != static_cast<uint32_t>(SegmentState::kOpen)) {
    return fail(absl::UnavailableError(absl::StrCat("segment ", name, " is closed")));
  }
  return std::unique_ptr<Segment>(new Segment(name, base, size, false, st.st_ino));
}

Segment::~Segment() {
  if (creator_) {
    header_->state.store(static_cast<uint32_t>(SegmentState::kClosed));
    FutexWakeAll(&header_->req_seq);
    FutexWakeAll(&header_->doorbell);
    FutexWakeAll(&header_->resp_seq);
    // Only unlink the name if it still refers to our segment.
    if (!Replaced()) ::shm_unlink(name_.c_str());
  }
  ::munmap(base_, size_);
}

bool Segment::Replaced() const {
  if (!creator_ && header_->state.load() != static_cast<uint32_t>(SegmentState::kOpen)) return true;
  int fd = ::shm_open(name_.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return true;
  struct stat st;
  const bool same = ::fstat(fd, &st) == 0 && st.st_ino == inode_;
  ::close(fd);
  return !same;
}

uint64_t* Segment::hot_bitmap(int layer) const {
  return reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(base_) + header_->hot_bitmap_offset) +
         static_cast<size_t>(layer) * header_->geometry.words_per_mask();
}

float* Segment::request_x() const {
  return reinterpret_cast<float*>(static_cast<uint8_t*>(base_) + header_->request_x_offset);
}

uint64_t* Segment::request_mask(int token) const {
  return reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(base_) + header_->request_mask_offset) +
         static_cast<size_t>(token) * header_->geometry.words_per_mask();
}

uint64_t* Segment::guess_mask() const {
  return reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(base_) + header_->guess_mask_offset);
}

float* Segment::response() const {
  return reinterpret_cast<float*>(static_cast<uint8_t*>(base_) + header_->response_offset);
}

}  // namespace pinfer::shm
