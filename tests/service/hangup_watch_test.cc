// The HTTP gateway's hang-up watch (gateway/http/hangup_watch.h) on real loopback TCP
// connections: it finds the server's end of a connection by the four addresses httplib reports,
// fires when the client closes or resets, and not for pipelined bytes or a watch that simply
// ends. Plain sockets, no HTTP and no gRPC, so that it also runs under TSan.
#include "gateway/http/hangup_watch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace pinfer::gateway {
namespace {

using namespace std::chrono_literals;

// A connected pair over 127.0.0.1: `client` and the server's accepted `server`.
struct Connection {
  int listener = -1, client = -1, server = -1;
  int server_port = -1, client_port = -1;
  ~Connection() {
    for (int fd : {listener, client, server}) {
      if (fd >= 0) close(fd);
    }
  }
};

int Port(int fd, bool peer) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (peer) {
    getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len);
  } else {
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  }
  return ntohs(a.sin_port);
}

void Connect(Connection* c) {
  c->listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(c->listener, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;  // any free port
  ASSERT_EQ(bind(c->listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(c->listener, 1), 0);
  c->server_port = Port(c->listener, /*peer=*/false);
  c->client = socket(AF_INET, SOCK_STREAM, 0);
  a.sin_port = htons(c->server_port);
  ASSERT_EQ(connect(c->client, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  c->server = accept(c->listener, nullptr, nullptr);
  ASSERT_GE(c->server, 0);
  c->client_port = Port(c->client, /*peer=*/false);
}

bool WaitFor(const std::atomic<bool>& flag) {
  for (int i = 0; i < 200 && !flag.load(); ++i) std::this_thread::sleep_for(10ms);
  return flag.load();
}

TEST(HangupWatchTest, FindsTheServersEndOfAConnection) {
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(&c));
  std::optional<int> fd =
      FindConnectedSocket("127.0.0.1", c.server_port, "127.0.0.1", c.client_port);
  ASSERT_TRUE(fd.has_value());
  EXPECT_EQ(*fd, c.server);
  // The client's end has the addresses the other way round.
  EXPECT_EQ(FindConnectedSocket("127.0.0.1", c.client_port, "127.0.0.1", c.server_port), c.client);
  // A port no connection has, or another host: nothing.
  EXPECT_FALSE(
      FindConnectedSocket("127.0.0.1", c.server_port, "127.0.0.1", c.server_port).has_value());
  EXPECT_FALSE(
      FindConnectedSocket("127.0.0.2", c.server_port, "127.0.0.1", c.client_port).has_value());
}

TEST(HangupWatchTest, FiresWhenTheClientCloses) {
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(&c));
  std::atomic<bool> fired{false};
  HangupWatch watch(c.server, [&] { fired.store(true); });
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(fired.load());
  close(c.client);
  c.client = -1;
  EXPECT_TRUE(WaitFor(fired));
  EXPECT_TRUE(watch.hung_up());
}

TEST(HangupWatchTest, FiresWhenTheClientResets) {
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(&c));
  std::atomic<bool> fired{false};
  HangupWatch watch(c.server, [&] { fired.store(true); });
  linger l{1, 0};  // close with RST, as a killed client's kernel may
  ASSERT_EQ(setsockopt(c.client, SOL_SOCKET, SO_LINGER, &l, sizeof(l)), 0);
  close(c.client);
  c.client = -1;
  EXPECT_TRUE(WaitFor(fired));
}

TEST(HangupWatchTest, PipelinedBytesAreNotAHangup) {
  Connection c;
  ASSERT_NO_FATAL_FAILURE(Connect(&c));
  std::atomic<bool> fired{false};
  {
    HangupWatch watch(c.server, [&] { fired.store(true); });
    ASSERT_EQ(write(c.client, "GET / HTTP/1.1\r\n", 16), 16);
    std::this_thread::sleep_for(100ms);
    EXPECT_FALSE(watch.hung_up());
  }
  // The watch ended: a later close calls nobody.
  close(c.client);
  c.client = -1;
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(fired.load());
  // The pipelined bytes are still there for the server to read.
  char buf[16];
  EXPECT_EQ(read(c.server, buf, sizeof(buf)), 16);
}

}  // namespace
}  // namespace pinfer::gateway
