// The handshake port: a tiny TCP service that hands this engine's descriptor to whoever asks,
// so peers named only by "host:port" (Mooncake's P2PHANDSHAKE style) can learn the identity,
// endpoints and segments they need for AddPeer without any other exchange.
//
// Wire: the client sends the 8 bytes "KVBDESC1"; the server answers "KVBDESC1", a 4-byte
// little-endian length and the descriptor, then closes. Anything else is closed without an
// answer. One thread serves every connection at once (poll), each exchange bounded to 1 s in
// all: a client that stops talking, trickles bytes or scans the port holds its own connection
// for at most that long and delays no one else. At most 256 exchanges are open, 32 from one
// client address; past a bound the oldest (of that address, or of all) is closed.
//
// Thread-safety: Start/Stop from one thread; the describe callback runs on the service thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "kvbridge/status.h"

namespace kvbridge::core {

class HandshakeServer {
 public:
  // Listens on `listen` ("host:port"; port 0 picks one). UNAVAILABLE naming the address if it
  // cannot.
  static Result<std::unique_ptr<HandshakeServer>> Start(const std::string& listen,
                                                        std::function<std::string()> describe);
  ~HandshakeServer();
  const std::string& address() const { return address_; }  // with the port actually bound
  uint64_t served() const { return served_.load(); }
  uint64_t rejected() const { return rejected_.load(); }

 private:
  HandshakeServer() = default;
  void Loop();

  int fd_ = -1;
  int wake_[2] = {-1, -1};
  std::string address_;
  std::function<std::string()> describe_;
  std::thread thread_;
  std::atomic<uint64_t> served_{0}, rejected_{0};
};

// Asks the handshake service at "host:port" for its descriptor. PEER_UNREACHABLE when it
// cannot connect, DEADLINE_EXCEEDED after timeout_ms, PROTOCOL on a malformed answer.
Result<std::string> FetchDescriptor(const std::string& host_port, uint32_t timeout_ms);

}  // namespace kvbridge::core
