// The master's lean port (docs/store.md "The master's lean port"): the four calls every put and
// get makes (PutStart, PutEnd, GetReplicas, Exists) as plain TCP frames carrying the same
// protobuf messages as their gRPC methods, one call at a time per connection, a thread per
// connection on the master. gRPC's HTTP/2 path cost a call 2-3 thread switches and tens of
// microseconds of CPU on each side; here the thread that sends waits on its own socket and the
// master's connection thread answers it. Internal to the store.
//
// Frames (integers little-endian):
//   server hello   "KVBH" u16 version (1), u16 flags (bit 0: a cluster token is required),
//                  16-byte nonce
//   client hello   "KVBA" u16 version, u16 proof length, proof: the x-kvb-auth value
//                  (store/rpc_auth.h) for the method ConnectMethod(nonce), "" without a token
//   request        "KVBQ" u16 method (Method), u16 0, u32 payload length, payload
//   reply          "KVBR" i32 code (grpc::StatusCode), u32 message length, u32 payload length,
//                  message, payload (only with code 0)
// The server answers the client hello with a reply (code 0, or UNAUTHENTICATED and the
// connection closed): a connection proves the cluster token once, bound to the server's nonce,
// and its calls then go unsigned. A frame that does not parse (magic, length, a truncated
// frame) closes the connection; an unknown method is answered UNIMPLEMENTED.
//
// Thread-safety: a Server's methods, and a Client's, may be called concurrently.
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "kvbridge/status.h"
#include "store/rpc_auth.h"

namespace google::protobuf {
class MessageLite;
}

namespace kvbridge::store::fast {

using Clock = std::chrono::steady_clock;

enum class Method : uint16_t { kPutStart = 1, kPutEnd = 2, kGetReplicas = 3, kExists = 4 };

// The method a connection's proof is for: bound to the server's nonce, so that it is good for
// that connection only.
std::string ConnectMethod(const std::array<uint8_t, 16>& nonce);

class Server {
 public:
  // Answers one call: the request's bytes, the reply's bytes to fill (sent only with OK).
  using Handler = std::function<grpc::Status(Method, std::string_view request, std::string* reply)>;
  // Listens on host:port (port 0: any free one). `auth` checks each connection's proof (it
  // must outlive the server); `who` names this side in log lines ("master").
  static Result<std::unique_ptr<Server>> Start(const std::string& host, uint16_t port,
                                               RpcAuth* auth, std::string who, Handler handler);
  ~Server();  // stops accepting, closes every connection and waits for their threads
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  uint16_t port() const { return port_; }
  // Calls answered so far, and connections refused (a proof missing or wrong, a frame that
  // did not parse): for tests and metrics.
  uint64_t calls() const { return calls_.load(); }
  uint64_t refused() const { return refused_.load(); }
  size_t connections() const;

  // At most this many connections at once; more are closed at once (their clients use gRPC).
  static constexpr size_t kMaxConnections = 4096;

 private:
  Server(RpcAuth* auth, std::string who, Handler handler);
  void AcceptLoop();
  void Serve(int fd, std::string peer);
  void Refuse(const std::string& peer, const std::string& why);

  RpcAuth* auth_;
  const std::string who_;
  const Handler handler_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::thread acceptor_;
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  std::unordered_set<int> open_;  // connections being served
  size_t threads_ = 0;            // connection threads not yet finished
  bool stopping_ = false;
  std::atomic<uint64_t> calls_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<int64_t> last_warn_ms_{0};
};

// One connection to a master's lean port, owned by one call at a time.
class Connection {
 public:
  explicit Connection(int fd) : fd_(fd) {}
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

class Client {
 public:
  // The lean port at host:port of a master; calls prove `auth`'s token once per connection.
  Client(std::string host, uint16_t port, const RpcAuth& auth);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends a request on an idle connection, or a new one. Null when it could not be sent; then
  // *fallback says whether the call may go over gRPC instead (nothing reached the master: no
  // connection, or a pooled one found closed) or must fail with *error (the master refused the
  // connection's proof, or the deadline passed).
  std::unique_ptr<Connection> Send(Method method, const google::protobuf::MessageLite& request,
                                   Clock::time_point deadline, grpc::Status* error, bool* fallback);
  // The answer to the request sent on `conn`, parsed into *reply. After OK the connection
  // goes back to the pool; after a failure it is closed (the master's answer, if it comes, is
  // never read as another call's).
  grpc::Status Receive(std::unique_ptr<Connection> conn, google::protobuf::MessageLite* reply,
                       Clock::time_point deadline);
  // Send and Receive; false (and nothing in *status) when the call should go over gRPC.
  bool Call(Method method, const google::protobuf::MessageLite& request,
            google::protobuf::MessageLite* reply, Clock::time_point deadline, grpc::Status* status);

  const std::string& address() const { return address_; }

  static constexpr size_t kMaxIdle = 16;  // idle connections kept

 private:
  std::unique_ptr<Connection> Connect(Clock::time_point deadline, grpc::Status* error,
                                      bool* fallback);
  std::unique_ptr<Connection> TakeIdle();
  void PutIdle(std::unique_ptr<Connection> conn);

  const std::string host_;
  const uint16_t port_;
  const std::string address_;  // host:port, for messages
  const RpcAuth& auth_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Connection>> idle_;
  pid_t pid_;  // the process the idle connections belong to
};

}  // namespace kvbridge::store::fast
