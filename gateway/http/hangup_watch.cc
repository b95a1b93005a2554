// See hangup_watch.h. Linux-only (POLLRDHUP, eventfd, /proc/self/fd), as the service is.
#include "gateway/http/hangup_watch.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <utility>

namespace pinfer::gateway {
namespace {

// The numeric host and port of a socket address, as httplib's getnameinfo(NI_NUMERICHOST) gives.
bool HostAndPort(const sockaddr_storage& ss, std::string* host, int* port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    if (inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf)) == nullptr) return false;
    *port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    if (inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf)) == nullptr) return false;
    *port = ntohs(a->sin6_port);
  } else {
    return false;
  }
  *host = buf;
  return true;
}

bool Matches(int fd, const std::string& local_addr, int local_port, const std::string& remote_addr,
             int remote_port) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  std::string host;
  int port = -1;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
      !HostAndPort(ss, &host, &port) || port != remote_port || host != remote_addr) {
    return false;
  }
  len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
      !HostAndPort(ss, &host, &port)) {
    return false;
  }
  return port == local_port && host == local_addr;
}

}  // namespace

std::optional<int> FindConnectedSocket(const std::string& local_addr, int local_port,
                                       const std::string& remote_addr, int remote_port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return std::nullopt;
  std::optional<int> found;
  const int dir_fd = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dir_fd) continue;
    if (Matches(static_cast<int>(fd), local_addr, local_port, remote_addr, remote_port)) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  return found;
}

HangupWatch::HangupWatch(int fd, std::function<void()> on_hangup) {
  wake_fd_ = eventfd(0, EFD_CLOEXEC);
  // Without an eventfd the watch could not be ended; watching nothing is the safe failure.
  if (wake_fd_ < 0) return;
  thread_ = std::thread([this, fd, on_hangup = std::move(on_hangup)] {
    pollfd fds[2] = {{fd, POLLRDHUP, 0}, {wake_fd_, POLLIN, 0}};
    while (true) {
      const int n = poll(fds, 2, -1);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 || (fds[1].revents & POLLIN) != 0) return;
      if ((fds[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        hung_up_.store(true);
        on_hangup();
        return;
      }
      if ((fds[0].revents & POLLNVAL) != 0) return;
    }
  });
}

HangupWatch::~HangupWatch() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  // A failed write would leave the thread blocked; eventfd writes of 1 fail only on overflow.
  (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  close(wake_fd_);
}

}  // namespace pinfer::gateway
