// Notices that an HTTP client closed its connection while its handler is still working on the
// reply. cpp-httplib 0.11 (Debian 12's) tells a handler nothing about the connection, and a
// non-streaming reply writes nothing until the generation ends, so without this a client that
// gives up (a closed browser tab, a timed-out SDK call) would keep its worker slot busy until
// max_tokens. The handler's socket is found among the process's descriptors by the connection's
// four addresses, which httplib does give, and watched by a thread for the peer's hang-up.
#ifndef PINFER_GATEWAY_HTTP_HANGUP_WATCH_H_
#define PINFER_GATEWAY_HTTP_HANGUP_WATCH_H_

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <thread>

namespace pinfer::gateway {

// The open socket descriptor whose local and peer addresses are these (numeric host strings as
// getnameinfo writes them), or nullopt if none is (the connection is gone already).
std::optional<int> FindConnectedSocket(const std::string& local_addr, int local_port,
                                       const std::string& remote_addr, int remote_port);

// Calls `on_hangup` once, from its own thread, if the peer of socket `fd` closes or resets the
// connection before this object is destroyed. `fd` must stay open for the object's lifetime
// (the handler's connection does: httplib closes it after the handler returns). Pipelined
// bytes from the client are not a hang-up.
class HangupWatch {
 public:
  HangupWatch(int fd, std::function<void()> on_hangup);
  ~HangupWatch();
  HangupWatch(const HangupWatch&) = delete;
  HangupWatch& operator=(const HangupWatch&) = delete;

  // Whether the peer hung up (and `on_hangup` ran).
  bool hung_up() const { return hung_up_.load(); }

 private:
  int wake_fd_ = -1;  // an eventfd the destructor signals to end the watch
  std::atomic<bool> hung_up_{false};
  std::thread thread_;
};

}  // namespace pinfer::gateway

#endif  // PINFER_GATEWAY_HTTP_HANGUP_WATCH_H_
