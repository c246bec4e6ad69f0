// The handshake port: a tiny TCP service that hands this engine's descriptor to whoever asks,
// so peers named only by "host:port" (Mooncake's P2PHANDSHAKE style) can learn the identity,
// endpoints and segments they need for AddPeer without any other exchange.
//
// Wire: the client sends the 8 bytes "KVBDESC1"; the server answers "KVBDESC1", a 4-byte
// little-endian length and the descriptor, then closes. Anything else is closed without an
// answer. Served by a RequestServer (below): every exchange bounded to 1 s in all, at most 256
// open, 32 from one client address.
//
// Thread-safety: Start/destroy from one thread; handlers run on the service thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "core/export_internal.h"
#include "kvbridge/status.h"

namespace kvbridge::core {

// A small request/answer service over TCP: each connection sends one request and gets one
// answer, then the connection is closed. One thread serves every connection at once (poll),
// each exchange bounded in all by `exchange_timeout_ms`: a client that stops talking, trickles
// bytes or scans the port holds its own connection for at most that long and delays no one
// else. At most `max_open` exchanges are open, `max_per_source` from one client address; past a
// bound the oldest (of that address, or of all) is closed. The handler runs on the service
// thread, never on a caller's: a process whose other threads are busy (or hold an
// interpreter's lock) still answers.
class KVBRIDGE_INTERNAL_API RequestServer {
 public:
  // What the handler makes of the bytes a connection has sent so far.
  struct Answer {
    enum Kind { kMore, kReply, kClose };
    Kind kind = kMore;
    std::string out;  // kReply: sent in full, then the connection is closed
  };
  using Handler = std::function<Answer(std::string_view request)>;
  struct Limits {
    size_t max_request_bytes = 64 << 10;  // a request still incomplete at this size is closed
    int exchange_timeout_ms = 1000;
    size_t max_open = 256;
    size_t max_per_source = 32;
  };

  // Listens on `listen` ("host:port"; port 0 picks one). UNAVAILABLE naming the address if it
  // cannot. `what` names the service in errors ("handshake port", ...).
  static Result<std::unique_ptr<RequestServer>> Start(const std::string& listen,
                                                      const std::string& what, Handler handler,
                                                      Limits limits);
  ~RequestServer();
  const std::string& address() const { return address_; }  // with the port actually bound
  uint64_t served() const { return served_.load(); }
  uint64_t rejected() const { return rejected_.load(); }

 private:
  RequestServer() = default;
  void Loop();

  int fd_ = -1;
  int wake_[2] = {-1, -1};
  std::string address_;
  Handler handler_;
  Limits limits_;
  std::thread thread_;
  std::atomic<uint64_t> served_{0}, rejected_{0};
};

// The engine's handshake port: answers "KVBDESC1" with describe()'s descriptor (wire above).
Result<std::unique_ptr<RequestServer>> StartHandshakeServer(const std::string& listen,
                                                            std::function<std::string()> describe);

// Asks the handshake service at "host:port" for its descriptor. PEER_UNREACHABLE when it
// cannot connect, DEADLINE_EXCEEDED after timeout_ms, PROTOCOL on a malformed answer.
Result<std::string> FetchDescriptor(const std::string& host_port, uint32_t timeout_ms);

}  // namespace kvbridge::core
