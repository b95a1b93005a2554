// Tests of the shared-memory activation channel: segment creation and header checks, the
// spin-then-futex wait, the per-layer exchange, and bounded failure when the peer dies, stalls or
// is replaced (run against a real second process made with fork()).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shared/shm/activation_channel.h"
#include "shared/shm/segment.h"
#include "shared/shm/wait.h"

namespace pinfer::shm {
namespace {

using ::testing::HasSubstr;

Geometry TestGeometry() {
  Geometry g;
  g.n_layers = 3;
  g.hidden = 8;
  g.ffn = 100;
  g.max_tokens = 4;
  g.fingerprint = 0x1234;
  return g;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

TEST(SegmentTest, CreateAttachCheckAndUnlink) {
  const std::string name = UniqueSegmentName();
  {
    auto created = Segment::Create(name, TestGeometry());
    ASSERT_TRUE(created.ok()) << created.status();
    struct stat st;
    ASSERT_EQ(::stat(("/dev/shm" + name).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(static_cast<size_t>(st.st_size), Segment::BytesFor(TestGeometry()));
    // x: 4*8 floats, masks: 4*2 words, response 4*8 floats, hot bitmap 3*2 words.
    EXPECT_GE((*created)->size(), sizeof(Header) + 2 * 4 * 8 * 4 + 4 * 2 * 8 + 3 * 2 * 8);

    auto attached = Segment::Attach(name, TestGeometry());
    ASSERT_TRUE(attached.ok()) << attached.status();
    (*created)->request_x()[5] = 42.f;
    EXPECT_EQ((*attached)->request_x()[5], 42.f);
    EXPECT_EQ((*attached)->geometry().max_tokens, 4);
    EXPECT_FALSE((*attached)->Replaced());

    Geometry other = TestGeometry();
    other.fingerprint = 0x9999;
    auto wrong = Segment::Attach(name, other);
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(wrong.status().message(), HasSubstr("made for another model"));

    // A second gpu-worker may not take the name of a live one.
    auto dup = Segment::Create(name, TestGeometry());
    EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  }
  // The creator unlinked the name on destruction.
  EXPECT_EQ(::shm_open(name.c_str(), O_RDONLY, 0), -1);
  EXPECT_EQ(errno, ENOENT);
  auto gone = Segment::Attach(name, TestGeometry());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
}

TEST(SegmentTest, RejectsBadNamesVersionsAndGeometry) {
  EXPECT_EQ(Segment::Create("no-slash", TestGeometry()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Segment::Create("/a/b", TestGeometry()).status().code(),
            absl::StatusCode::kInvalidArgument);
  Geometry bad = TestGeometry();
  bad.max_tokens = 0;
  EXPECT_THAT(Segment::Create(UniqueSegmentName(), bad).status().message(),
              HasSubstr("bad segment geometry"));

  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(seg.ok());
  (*seg)->header()->version = kLayoutVersion + 1;
  auto attached = Segment::Attach(name, TestGeometry());
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(attached.status().message(), HasSubstr("layout version"));
  (*seg)->header()->version = kLayoutVersion;
  (*seg)->header()->magic = 0x42;
  EXPECT_THAT(Segment::Attach(name, TestGeometry()).status().message(), HasSubstr("bad magic"));
  (*seg)->header()->magic = kMagic;
}

TEST(SegmentTest, StaleSegmentOfDeadCreatorIsReplacedAndAttachersNotice) {
  const std::string name = UniqueSegmentName();
  auto old = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(old.ok());
  auto attached = Segment::Attach(name, TestGeometry());
  ASSERT_TRUE(attached.ok());
  // Pretend the creator died 10 s ago without unlinking.
  (*old)->header()->gpu_heartbeat_ns.store(MonotonicNanos() - 10'000'000'000ull);
  auto fresh = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE((*attached)->Replaced());
  EXPECT_EQ((*attached)->header()->state.load(), static_cast<uint32_t>(SegmentState::kClosed));
  auto reattached = Segment::Attach(name, TestGeometry());
  ASSERT_TRUE(reattached.ok());
  EXPECT_EQ((*reattached)->header()->instance_id, (*fresh)->header()->instance_id);
  old->reset();  // must not unlink the new segment's name
  EXPECT_TRUE(Segment::Attach(name, TestGeometry()).ok());
}

TEST(WaitTest, WakesOnChangeAndTimesOut) {
  std::atomic<uint32_t> word{7};
  std::thread waker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    word.store(8);
    FutexWakeAll(&word);
  });
  bool slept = false;
  WaitOptions wo;
  wo.timeout_ns = 5'000'000'000;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(WaitForChange(&word, 7, wo, nullptr, &slept).ok());
  EXPECT_TRUE(slept);
  EXPECT_LT(Seconds(t0), 1.0);
  waker.join();

  wo.timeout_ns = 100'000'000;
  const auto t1 = std::chrono::steady_clock::now();
  absl::Status st = WaitForChange(&word, 8, wo, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(Seconds(t1), 0.09);
  EXPECT_LT(Seconds(t1), 1.0);

  // A failing check ends the wait with its status.
  wo.timeout_ns = 0;
  st = WaitForChange(&word, 8, wo, [] { return absl::UnavailableError("peer gone"); });
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
}

ChannelOptions FastOptions() {
  ChannelOptions o;
  o.heartbeat_interval_ns = 20'000'000;
  // Well above the heartbeat: a heartbeat thread starved by a loaded CI machine (ASan, 2 cores)
  // must not read as a dead peer.
  o.liveness_ns = 1'000'000'000;
  o.exchange_timeout_ns = 5'000'000'000;
  return o;
}

// The cold side of the tests: out[t, h] = x[t, h] * (layer + 1); every token "computes" 3
// neurons, or as many as its mask lists.
absl::StatusOr<uint64_t> TestHandler(int layer, const float* x, int n, const uint64_t* masks,
                                     float* out, int hidden) {
  for (int i = 0; i < n * hidden; ++i) out[i] = x[i] * (layer + 1);
  if (masks == nullptr) return 3ull * n;
  uint64_t count = 0;
  for (int t = 0; t < n; ++t)
    count += __builtin_popcountll(masks[t * 2]) + __builtin_popcountll(masks[t * 2 + 1]);
  return count;
}

TEST(ExchangeTest, RoundTripsAndPairsAnswersWithRequests) {
  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(seg.ok());
  ExchangeClient client(std::move(*seg), FastOptions());
  EXPECT_FALSE(client.PeerReady());
  float x[16], out[16];
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(i);
  // No cpu-worker yet: fail fast, don't wait.
  auto early = client.Post(0, x, 2, nullptr);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(early.status().message(), HasSubstr("has not attached"));

  std::atomic<bool> stop{false};
  std::thread server([&] {
    auto att = Segment::Attach(name, TestGeometry());
    ASSERT_TRUE(att.ok());
    ExchangeServer s(std::move(*att), FastOptions());
    s.MarkReady(1234);
    absl::Status st = s.Serve([](int layer, const float* x, int n, const uint64_t* masks,
                                 float* out) { return TestHandler(layer, x, n, masks, out, 8); },
                              stop);
    EXPECT_TRUE(st.ok()) << st;
  });
  while (!client.PeerReady()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(client.segment().header()->cpu_resident_bytes.load(), 1234u);
  for (int layer = 0; layer < 3; ++layer) {
    auto seq = client.Post(layer, x, 2, nullptr);
    ASSERT_TRUE(seq.ok()) << seq.status();
    for (int i = 0; i < 16; ++i) out[i] = 1.f;  // the answer is added to what is there
    ExchangeStats stats;
    ASSERT_TRUE(client.AwaitAndAdd(*seq, 2, out, &stats).ok());
    for (int i = 0; i < 16; ++i) EXPECT_EQ(out[i], 1.f + x[i] * (layer + 1));
    EXPECT_EQ(stats.cold_neurons, 6u);
  }
  // A guess to a server without a guess handler is dropped; the request is answered as before.
  const int32_t guessed[] = {0, 1, 3};
  ASSERT_TRUE(client.PostGuess(1, guessed, 3).ok());
  uint64_t masks[4 * 2] = {0b1011, 0, 0, 1ull << 63};
  auto seq = client.Post(1, x, 2, masks);
  ASSERT_TRUE(seq.ok());
  ExchangeStats stats;
  std::fill(out, out + 16, 0.f);
  ASSERT_TRUE(client.AwaitAndAdd(*seq, 2, out, &stats).ok());
  EXPECT_EQ(stats.cold_neurons, 4u);
  EXPECT_EQ(client.Post(0, x, 5, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  stop = true;
  server.join();
}

// A guess (ExchangeClient::PostGuess) reaches the cpu-worker's guess handler as a mask of the
// guessed neurons for its layer, with a mask of its first tier, while no request is pending; a
// guess without a tier comes with an empty one. The handler's stop() turns true
// once the request arrives, which is then answered as usual. Bad guesses are refused.
TEST(ExchangeTest, GuessesReachTheGuessHandlerUntilTheRequestComes) {
  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(seg.ok());
  ExchangeClient client(std::move(*seg), FastOptions());
  const int32_t guessed[] = {1, 5, 64, 99};
  EXPECT_EQ(client.PostGuess(2, guessed, 4).code(), absl::StatusCode::kUnavailable);

  std::atomic<bool> stop{false}, in_handler{false};
  std::atomic<int> guesses{0};
  // What the handler saw, under a mutex: the two sides' ordering through the segment is invisible
  // to TSan (each maps it at its own address).
  std::mutex seen_mu;
  int guess_layer = -1;
  std::vector<uint64_t> guess_mask, first_mask;
  bool stopped_by_request = false;
  std::thread server([&] {
    auto att = Segment::Attach(name, TestGeometry());
    ASSERT_TRUE(att.ok());
    ExchangeServer s(std::move(*att), FastOptions());
    s.MarkReady(1);
    absl::Status st =
        s.Serve([](int layer, const float* x, int n, const uint64_t* masks,
                   float* out) { return TestHandler(layer, x, n, masks, out, 8); },
                stop,
                [&](int layer, const uint64_t* mask, const uint64_t* first,
                    const std::function<bool()>& stop_guess) {
                  {
                    std::lock_guard<std::mutex> lock(seen_mu);
                    guess_layer = layer;
                    guess_mask.assign(mask, mask + 2);
                    first_mask.assign(first, first + 2);
                  }
                  in_handler = true;
                  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
                  while (!stop_guess() && std::chrono::steady_clock::now() < deadline) {
                  }
                  const bool by_request = stop_guess() && !stop.load();
                  {
                    std::lock_guard<std::mutex> lock(seen_mu);
                    stopped_by_request = by_request;
                  }
                  ++guesses;
                });
    EXPECT_TRUE(st.ok()) << st;
  });
  while (!client.PeerReady()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const uint8_t first[] = {0, 1, 0, 1};
  ASSERT_TRUE(client.PostGuess(2, guessed, 4, first).ok());
  while (!in_handler) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  float x[8], out[8] = {0};
  for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(i);
  uint64_t masks[2] = {0b10, 0};
  auto seq = client.Post(2, x, 1, masks);
  ASSERT_TRUE(seq.ok()) << seq.status();
  ExchangeStats stats;
  ASSERT_TRUE(client.AwaitAndAdd(*seq, 1, out, &stats).ok());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], x[i] * 3);
  EXPECT_EQ(stats.cold_neurons, 1u);
  EXPECT_EQ(guesses.load(), 1);
  {
    std::lock_guard<std::mutex> lock(seen_mu);
    EXPECT_EQ(guess_layer, 2);
    EXPECT_EQ(guess_mask, (std::vector<uint64_t>{(1ull << 1) | (1ull << 5), 1ull | (1ull << 35)}));
    EXPECT_EQ(first_mask, (std::vector<uint64_t>{1ull << 5, 1ull << 35}));
    EXPECT_TRUE(stopped_by_request);
  }

  // Without a tier: the same guess, an empty first mask.
  in_handler = false;
  ASSERT_TRUE(client.PostGuess(1, guessed, 4).ok());
  while (!in_handler) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  seq = client.Post(1, x, 1, masks);
  ASSERT_TRUE(seq.ok()) << seq.status();
  ASSERT_TRUE(client.AwaitAndAdd(*seq, 1, out, &stats).ok());
  EXPECT_EQ(guesses.load(), 2);
  {
    std::lock_guard<std::mutex> lock(seen_mu);
    EXPECT_EQ(guess_layer, 1);
    EXPECT_EQ(guess_mask, (std::vector<uint64_t>{(1ull << 1) | (1ull << 5), 1ull | (1ull << 35)}));
    EXPECT_EQ(first_mask, (std::vector<uint64_t>{0, 0}));
  }

  const int32_t bad_id[] = {100};  // ffn 100
  EXPECT_EQ(client.PostGuess(2, bad_id, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.PostGuess(9, guessed, 4).code(), absl::StatusCode::kInvalidArgument);
  stop = true;
  server.join();
}

TEST(ExchangeTest, HandlerErrorsTravelBack) {
  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(seg.ok());
  ExchangeClient client(std::move(*seg), FastOptions());
  std::atomic<bool> stop{false};
  std::thread server([&] {
    auto att = Segment::Attach(name, TestGeometry());
    ASSERT_TRUE(att.ok());
    ExchangeServer s(std::move(*att), FastOptions());
    s.MarkReady(0);
    (void)s.Serve(
        [](int, const float*, int, const uint64_t*, float*) -> absl::StatusOr<uint64_t> {
          return absl::ResourceExhaustedError("out of scratch");
        },
        stop);
  });
  while (!client.PeerReady()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  float x[8] = {}, out[8] = {};
  auto seq = client.Post(0, x, 1, nullptr);
  ASSERT_TRUE(seq.ok());
  absl::Status st = client.AwaitAndAdd(*seq, 1, out, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("out of scratch"));
  stop = true;
  server.join();
}

// Runs a cpu-worker stand-in in a child process; `hang_on_layer` makes it block forever (in the
// handler) on requests for that layer.
pid_t ForkServer(const std::string& name, int hang_on_layer) {
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  auto att = Segment::Attach(name, TestGeometry());
  if (!att.ok()) ::_exit(3);
  ExchangeServer s(std::move(*att), FastOptions());
  s.MarkReady(0);
  std::atomic<bool> stop{false};
  (void)s.Serve(
      [&](int layer, const float* x, int n, const uint64_t* masks, float* out) {
        if (layer == hang_on_layer) {
          for (;;) ::pause();
        }
        return TestHandler(layer, x, n, masks, out, 8);
      },
      stop);
  ::_exit(0);
}

void WaitReady(ExchangeClient& client) {
  const auto t0 = std::chrono::steady_clock::now();
  while (!client.PeerReady() && Seconds(t0) < 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(client.PeerReady()) << client.PeerProblem();
}

TEST(ExchangeTest, KilledPeerFailsWithinBoundedTimeAndRestartRecovers) {
  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(seg.ok());
  ExchangeClient client(std::move(*seg), FastOptions());
  pid_t child = ForkServer(name, /*hang_on_layer=*/2);
  WaitReady(client);
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, out[8] = {};
  auto seq = client.Post(0, x, 1, nullptr);
  ASSERT_TRUE(seq.ok());
  ASSERT_TRUE(client.AwaitAndAdd(*seq, 1, out, nullptr).ok());
  EXPECT_EQ(out[7], 8.f);

  // The child blocks in layer 2; kill it mid-exchange.
  seq = client.Post(2, x, 1, nullptr);
  ASSERT_TRUE(seq.ok());
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ::kill(child, SIGKILL);
  });
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = client.AwaitAndAdd(*seq, 1, out, nullptr);
  killer.join();
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(st.message(), HasSubstr("stopped responding"));
  EXPECT_LT(Seconds(t0), 3.0);  // liveness 1 s + slices
  // While no cpu-worker is there, new exchanges fail at once.
  EXPECT_EQ(client.Post(0, x, 1, nullptr).status().code(), absl::StatusCode::kUnavailable);

  // A restarted cpu-worker takes over and answers the next request (not the abandoned one).
  child = ForkServer(name, /*hang_on_layer=*/-1);
  WaitReady(client);
  seq = client.Post(1, x, 1, nullptr);
  ASSERT_TRUE(seq.ok());
  std::fill(out, out + 8, 0.f);
  st = client.AwaitAndAdd(*seq, 1, out, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(out[7], 16.f);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

TEST(ExchangeTest, RestartedPeerIsNotReadyBeforeItHasLoaded) {
  // A killed cpu-worker leaves `ready` set; its successor's fresh heartbeat must not make the
  // gpu-worker post before the successor has loaded its rows and called MarkReady.
  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(seg.ok());
  ExchangeClient client(std::move(*seg), FastOptions());
  Header* h = client.segment().header();
  h->cpu_ready.store(1);
  h->cpu_heartbeat_ns.store(MonotonicNanos() - 10'000'000'000ull);
  EXPECT_FALSE(client.PeerReady());
  auto att = Segment::Attach(name, TestGeometry());
  ASSERT_TRUE(att.ok());
  ExchangeServer successor(std::move(*att), FastOptions());
  EXPECT_FALSE(client.PeerReady());
  EXPECT_THAT(client.PeerProblem(), HasSubstr("still loading"));
  successor.MarkReady(0);
  EXPECT_TRUE(client.PeerReady());
}

TEST(ExchangeTest, StalledPeerFailsWithUnavailableAndLivePeerTimesOut) {
  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(seg.ok());
  ChannelOptions opts = FastOptions();
  opts.exchange_timeout_ns = 400'000'000;
  // Liveness well above the timeout: on a loaded 2-core CI machine under ASan the child's 20 ms
  // heartbeat once went 305 ms without a beat, which the old 300 ms liveness took for a stop.
  opts.liveness_ns = 1'500'000'000;
  ExchangeClient client(std::move(*seg), opts);
  pid_t child = ForkServer(name, /*hang_on_layer=*/2);
  WaitReady(client);
  float x[8] = {}, out[8] = {};
  // Live but not answering (its heartbeat thread runs): DEADLINE_EXCEEDED at the timeout.
  auto seq = client.Post(2, x, 1, nullptr);
  ASSERT_TRUE(seq.ok());
  auto t0 = std::chrono::steady_clock::now();
  absl::Status st = client.AwaitAndAdd(*seq, 1, out, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_THAT(st.message(), HasSubstr("did not answer layer 2"));
  EXPECT_GE(Seconds(t0), 0.39);
  EXPECT_LT(Seconds(t0), 2.0);
  // Stopped (SIGSTOP): its heartbeat stops too, so UNAVAILABLE.
  ::kill(child, SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));  // past the liveness
  t0 = std::chrono::steady_clock::now();
  st = client.Post(0, x, 1, nullptr).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(st.message(), HasSubstr("not responding"));
  EXPECT_LT(Seconds(t0), 0.1);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

TEST(ExchangeTest, ServerLetsGoWhenTheGpuWorkerGoes) {
  const std::string name = UniqueSegmentName();
  auto seg = Segment::Create(name, TestGeometry());
  ASSERT_TRUE(seg.ok());
  auto client = std::make_unique<ExchangeClient>(std::move(*seg), FastOptions());
  auto att = Segment::Attach(name, TestGeometry());
  ASSERT_TRUE(att.ok());
  ExchangeServer server(std::move(*att), FastOptions());
  server.MarkReady(0);
  std::atomic<bool> stop{false};
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    client.reset();  // closes and unlinks
  });
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = server.Serve(
      [](int, const float*, int, const uint64_t*, float*) -> absl::StatusOr<uint64_t> { return 0; },
      stop);
  closer.join();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(Seconds(t0), 2.0);
}

}  // namespace
}  // namespace pinfer::shm
