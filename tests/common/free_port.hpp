// A loopback TCP port nothing listens on now, for tests that start a rendezvous: the
// kernel's pick for port 0, so tests running in parallel get different ones. 0 on failure.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace loom_test_common {

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&  // NOLINT
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {          // NOLINT
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

}  // namespace loom_test_common
