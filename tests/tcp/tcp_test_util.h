// Helpers for the tcp plugin tests: the plugin loaded with dlopen and driven through its ops
// table, a small host-services table, plugin instances as stand-ins for processes, patterned
// buffers, and raw sockets that speak (or abuse) the wire format through tcp_wire.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/host_services.h"
#include "core/peer_auth.h"
#include "kvbridge/plugin/transport.h"
#include "tcp_wire.h"

namespace kvbridge::tcp::test {
namespace auth = core::auth;

// The plugin's ops table (dlopen'ed once; aborts the test binary if it cannot be loaded).
const kvb_transport_ops_t* Ops();
const kvb_plugin_descriptor_t* Descriptor();

uint64_t NowNs();
double MsSince(uint64_t start_ns);

// Host services for one instance: config from a map, logs to stderr and captured.
class TestHost {
 public:
  // A real core::HostServices (identity, token and the peer handshake live in the host) whose
  // plugin log lines are captured here.
  TestHost(std::string name, std::map<std::string, std::string> config,
           core::auth::Identity identity);
  const kvb_host_services_t* services() const { return core_->table(); }
  bool LogContains(const std::string& needle) const;
  std::vector<std::string> Logs() const;
  // When (NowNs) each line containing `needle` was logged.
  std::vector<uint64_t> LogTimes(const std::string& needle) const;

 private:
  void Log(int32_t level, const char* plugin, const char* msg);

  std::string name_;
  std::unique_ptr<core::HostServices> core_;
  mutable std::mutex mu_;
  std::vector<std::string> logs_;
  std::vector<uint64_t> log_times_;
};

// Zeroed heap memory with a deterministic pattern helper.
class Buffer {
 public:
  explicit Buffer(size_t n);
  uint8_t* data() { return p_.get(); }
  const uint8_t* data() const { return p_.get(); }
  size_t size() const { return n_; }
  void Fill(uint64_t seed, size_t off = 0, size_t len = SIZE_MAX);
  uint64_t Checksum(size_t off = 0, size_t len = SIZE_MAX) const;

 private:
  std::unique_ptr<uint8_t[]> p_;
  size_t n_;
};

struct Result {
  kvb_status_t status = KVB_IN_PROGRESS;
  std::string msg;
  std::vector<kvb_status_t> op_status;
  double elapsed_ms = 0;
  int completions = 0;  // on_complete calls observed
};

// Waits for one posted request through on_complete; see Instance::PostAsync.
struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  uint64_t completed_ns = 0;
  uint64_t posted_ns = 0;
  kvb_treq_t* req = nullptr;
  uint32_t num_ops = 0;
};

// One plugin instance: a stand-in for one process.
class Instance {
 public:
  struct Options {
    std::string node_id = "node";
    uint64_t incarnation = 1;
    std::string listen = "127.0.0.1:0";
    std::string token;
    std::map<std::string, std::string> config;
  };
  // Fails the calling test (ADD_FAILURE) and returns null when create fails.
  static std::unique_ptr<Instance> Create(const Options& opts);
  // Returns create's status; *out is set on success.
  static kvb_status_t TryCreate(const Options& opts, std::unique_ptr<Instance>* out,
                                std::string* err);
  ~Instance();

  kvb_transport_t* t() const { return t_; }
  const Options& options() const { return opts_; }
  TestHost& host() { return *host_; }
  std::string Endpoints() const;
  uint16_t Port() const;  // of the first endpoint

  uint64_t Register(void* addr, size_t len);
  kvb_status_t Deregister(uint64_t segment);
  // Learns `other` (its endpoints unless overridden, its identity unless overridden).
  kvb_tpeer_t* AddPeer(const Instance& other, const std::string& endpoints = "",
                       uint64_t incarnation = 0, const std::string& node_id = "");
  kvb_tpeer_t* AddPeerRaw(const std::string& node_id, uint64_t incarnation,
                          const std::string& endpoints,
                          std::vector<kvb_peer_segment_t> segments = {});
  void RemovePeer(kvb_tpeer_t* peer);
  kvb_transport_stats_t Stats() const;

  kvb_xfer_op_t Op(uint32_t opcode, uint64_t local_segment, void* local, uint64_t len,
                   uint64_t remote_segment, uint64_t remote_offset) const;
  // post(); on success the returned Pending is signalled by on_complete.
  kvb_status_t PostAsync(kvb_tpeer_t* peer, const std::vector<kvb_xfer_op_t>& ops,
                         uint64_t deadline_ms, std::shared_ptr<Pending>* out,
                         std::string* err = nullptr, uint64_t progress_timeout_ms = 0);
  // Waits for on_complete (up to timeout_ms), polls the final state and releases the request.
  Result Finish(const std::shared_ptr<Pending>& p, int timeout_ms = 20000);
  Result Transfer(kvb_tpeer_t* peer, const std::vector<kvb_xfer_op_t>& ops,
                  uint64_t deadline_ms = 20000);

 private:
  Instance() = default;
  Options opts_;
  std::unique_ptr<TestHost> host_;
  kvb_transport_t* t_ = nullptr;
  std::atomic<uint64_t> next_segment_{100};
};

// A port on 127.0.0.1 with nothing listening (bound, then closed).
uint16_t DeadPort();

// A blocking TCP client for hand-made frames.
class RawClient {
 public:
  // Connects to 127.0.0.1:port, from `source` (an address on this host) when given.
  explicit RawClient(uint16_t port, const std::string& source = "");
  ~RawClient();
  bool connected() const { return fd_ >= 0; }
  bool SendAll(const void* data, size_t len);
  // Reads exactly len bytes within timeout_ms; false on EOF, error or timeout.
  bool RecvAll(void* buf, size_t len, int timeout_ms = 3000);
  // True if the peer closed the connection within timeout_ms (reading and discarding bytes).
  bool WaitClosed(int timeout_ms = 3000);
  // Runs the client side of the handshake; returns the server's status (or -1 on I/O error).
  int32_t Handshake(const std::string& my_node, uint64_t my_incarnation,
                    const std::string& expect_node, uint64_t expect_incarnation,
                    const std::string& token = "");
  bool SendRequest(const wire::RequestHeader& h, const void* payload = nullptr);
  bool RecvResponse(wire::ResponseHeader* h, int timeout_ms = 3000);

 private:
  int fd_ = -1;
};

// A listener that accepts and then never answers (or never accepts at all): a frozen peer.
class SilentServer {
 public:
  // accept=false leaves connections in the backlog: the kernel completes TCP, nothing reads.
  // answer_handshake=true completes the tcp handshake as `node_id`/`incarnation` first.
  SilentServer(bool accept, bool answer_handshake = false, std::string node_id = "",
               uint64_t incarnation = 0);
  ~SilentServer();
  uint16_t port() const { return port_; }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::vector<int> conns_;
};

}  // namespace kvbridge::tcp::test
