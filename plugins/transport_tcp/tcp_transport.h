// kvbridge::tcp::Transport: the tcp transport plugin's backend.
//
// Server side: one accept thread for all listeners and one thread per inbound connection,
// which runs the handshake and then serves that connection's READ/WRITE requests in order,
// straight between the socket and registered memory after CheckRequest (tcp_wire.h).
//
// Client side: per peer, a FIFO of slices (ops cut at slice_bytes) and at most lanes_per_peer
// lanes, opened lazily. Each lane is one thread driving one nonblocking socket with poll(2):
// it pipelines up to window_slices request frames and reads the FIFO of responses on the same
// thread, so a lane never needs a second thread to tear it down. A housekeeper thread fails
// queued slices at their deadline and joins finished lane threads.
//
// Thread-safety: every public method may be called concurrently, except that the destructor
// (the ABI's destroy) must not race with anything else. No lock is held across a socket call
// that can block, nor across on_complete.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvbridge/plugin/transport.h"
#include "live_requests.h"

namespace kvbridge::tcp {

// Every tcp.* configuration key; see README.md for what each one bounds.
struct Config {
  uint32_t lanes_per_peer = 4;
  uint64_t slice_bytes = 1u << 20;
  uint64_t max_queued_bytes_per_peer = 256u << 20;
  uint64_t max_queued_slices_per_peer = 65536;  // however small each one is
  uint32_t window_slices = 8;
  uint32_t connect_timeout_ms = 1000;   // connect + handshake, per endpoint tried
  uint32_t progress_timeout_ms = 2000;  // used when post opts give 0; also the server's
  uint32_t idle_timeout_ms = 30000;
  uint32_t idle_close_per_sec = 4;
  uint32_t max_inbound = 1024;
  uint32_t max_inbound_per_source = 64;            // open inbound connections from one IP address
  uint64_t min_inbound_bytes_per_sec = 64u << 20;  // an inbound payload's absolute bound
  uint32_t inbound_idle_timeout_ms = 300000;       // an authenticated connection with no request
  uint64_t max_frame_bytes = 16u << 20;
  // Device (CUDA) regions: bytes pass through pinned bounce buffers of this size, this many per
  // lane and per inbound connection (README.md "Device memory").
  uint64_t staging_slice_bytes = 256u << 10;
  uint32_t staging_buffers = 4;
  // 1: an op that asks for its checksum (KVB_XOP_CRC32C) gets it taken by the lane as its
  // bytes land or leave; 0: the instance drops KVB_TCAP_OP_CRC32C and the host checks the
  // bytes itself.
  uint32_t op_checksums = 1;
};

// Reads the tcp.* keys through host->config_get; unset keys keep their defaults. Returns false
// with a message naming the key when a value is malformed or out of range.
bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err);

struct Peer;
struct Request;
struct Slice;
class Lane;

// What kvb_treq_t* points at: the host's reference to one request.
struct RequestHandle {
  std::shared_ptr<Request> req;
};

// Callbacks to run once no lock is held.
struct Completion {
  void (*fn)(void*) = nullptr;
  void* user = nullptr;
};
using Completions = std::vector<Completion>;

// Instance-wide counters behind get_stats.
struct Counters {
  std::atomic<uint64_t> connections_open{0};
  std::atomic<uint64_t> connections_opened{0};
  std::atomic<uint64_t> connections_closed_idle{0};
  std::atomic<uint64_t> connections_evicted{0};
  std::atomic<uint64_t> inbound_open{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> frames_rejected{0};
  std::atomic<uint64_t> queued_bytes{0};
  std::atomic<uint64_t> device_regions_staged{0};  // CUDA regions registered (all are staged)
  std::atomic<uint64_t> device_bytes_staged{0};    // bytes of device copies queued
};

// At most one log line per second per limiter; reports how many were suppressed.
class LogLimiter {
 public:
  // True if a line may be logged now; *suppressed gets the count dropped since the last one.
  bool Allow(uint64_t now_ns, uint64_t* suppressed);

 private:
  std::mutex mu_;
  uint64_t next_ns_ = 0;
  uint64_t suppressed_ = 0;
};

// Instance-wide idle-close budget: capacity 1, refilled at `rate` per second, so idle lanes
// close one at a time and never in a burst.
class TokenBucket {
 public:
  explicit TokenBucket(uint32_t per_sec) : per_sec_(per_sec) {}
  // Takes a token if one is available; otherwise *next_ns says when the next one will be.
  bool TryTake(uint64_t now_ns, uint64_t* next_ns);

 private:
  std::mutex mu_;
  uint32_t per_sec_;
  uint64_t last_ns_ = 0;  // when the bucket last became full or a token was taken
  bool primed_ = false;
  double tokens_ = 1.0;
};

class Transport {
 public:
  // Creates an instance and binds its listeners. On failure returns the error with *err set.
  static kvb_status_t Create(const kvb_host_services_t* host, const kvb_transport_params_t* params,
                             std::unique_ptr<Transport>* out, std::string* err);
  // destroy(): stops all threads, fails outstanding requests CANCELLED, closes every socket.
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  int32_t GetEndpoints(char* buf, uint32_t buf_len) const;
  kvb_status_t RegisterMemory(const kvb_region_t* region, uint8_t* rkey, uint32_t rkey_cap,
                              uint32_t* rkey_len, std::string* err = nullptr);
  kvb_status_t DeregisterMemory(uint64_t segment_id);
  kvb_status_t AddPeer(const kvb_peer_info_t* info, Peer** out, std::string* err);
  kvb_status_t UpdatePeer(Peer* peer, const kvb_peer_info_t* info, std::string* err);
  void RemovePeer(Peer* peer);
  kvb_status_t Post(Peer* peer, const kvb_xfer_op_t* ops, uint32_t op_size, uint32_t count,
                    const kvb_post_opts_t* opts, RequestHandle** out, std::string* err);
  kvb_status_t Poll(RequestHandle* h, kvb_status_t* op_status, uint32_t op_status_len, char* err,
                    uint32_t err_len);
  void Cancel(RequestHandle* h);
  void Release(RequestHandle* h);
  kvb_status_t GetStats(kvb_transport_stats_t* stats) const;

  // For lanes and the server threads (internal to the plugin).
  const Config& config() const { return config_; }
  uint64_t Now() const { return host_->now_ns(host_->host_ctx); }
  void Log(int32_t level, const char* fmt, ...) const __attribute__((format(printf, 3, 4)));
  Counters& counters() const { return counters_; }
  TokenBucket& idle_bucket() { return idle_bucket_; }
  const std::string& node_id() const { return node_id_; }
  uint64_t incarnation() const { return incarnation_; }
  const kvb_host_services_t* host() const { return host_; }
  // The host offers the ABI 1.2 device services: CUDA regions can be registered.
  bool device_services() const { return device_services_; }
  bool stopping() const { return stopping_.load(); }
  // Ends one slice; adds the request's on_complete to *done when that made it final.
  void EndSlice(Slice& s, kvb_status_t code, const std::string& msg, Completions* done);
  // Starts a lane for `peer` if queued work needs one. REQUIRES: peer->mu held.
  void MaybeSpawnLanes(Peer& peer);
  // Hands a finished lane over for joining. Called by the lane's own thread, last thing.
  void Bury(std::unique_ptr<Lane> lane);
  static void RunCompletions(const Completions& done);

 private:
  struct Region {
    uint8_t* base = nullptr;
    uint64_t length = 0;
    int device = -1;         // KVB_MEM_CUDA: the region's device; -1 for host memory
    uint32_t in_use = 0;     // server threads inside the region (under regions_mu_)
    std::vector<int> users;  // their connections, one entry per use (under regions_mu_)
  };
  struct Inbound {
    int fd = -1;
    std::string addr;
    std::string source;  // the client's IP address (addr without the port)
    std::thread thread;
    std::atomic<bool> done{false};
  };
  struct Listener {
    int fd = -1;
    std::string endpoint;  // host:bound_port
  };
  struct PrefailedOp {
    std::unique_ptr<Slice> slice;
    kvb_status_t code;
    std::string msg;
  };

  Transport(const kvb_host_services_t* host, const Config& config);
  kvb_status_t Listen(const std::string& spec, std::string* err);
  void AcceptLoop();
  void ReapInbound(bool all);
  void ServeInbound(Inbound* conn);
  bool ServerHandshake(int fd, const std::string& addr);
  void ServeRequests(int fd, const std::string& addr);
  // A server thread enters / leaves a region on behalf of connection `fd` (DeregisterMemory
  // shuts those connections down rather than wait for a stalled peer).
  std::shared_ptr<Region> AcquireRegion(uint64_t segment_id, int fd);
  void ReleaseRegion(const std::shared_ptr<Region>& region, int fd);
  void HousekeeperLoop();
  void JoinGraveyard();
  void WakeHousekeeper(uint64_t deadline_ns);
  void CancelRequest(const std::shared_ptr<Request>& req);
  void Finalize(Request& req, Completions* done);

  // Requests handed out and not yet released; first, so it goes last (it frees what is left).
  plugin::LiveRequests<RequestHandle> handles_;
  const kvb_host_services_t* host_;
  const Config config_;
  std::string node_id_;
  uint64_t incarnation_ = 0;
  bool device_services_ = false;
  std::atomic<bool> stopping_{false};
  mutable Counters counters_;  // atomics; DevStaging counts its copies through a const Transport
  TokenBucket idle_bucket_;
  mutable LogLimiter inbound_refusal_log_;
  mutable LogLimiter reject_log_;

  std::vector<Listener> listeners_;
  std::string endpoints_;
  int accept_wake_fd_ = -1;
  std::thread accept_thread_;

  std::mutex inbound_mu_;
  std::list<std::unique_ptr<Inbound>> inbound_;

  std::mutex regions_mu_;
  std::condition_variable regions_cv_;
  std::unordered_map<uint64_t, std::shared_ptr<Region>> regions_;

  std::mutex peers_mu_;
  std::unordered_set<Peer*> peers_;

  std::mutex graveyard_mu_;
  std::vector<std::unique_ptr<Lane>> graveyard_;

  std::mutex hk_mu_;
  std::condition_variable hk_cv_;
  uint64_t hk_next_wake_ns_ = 0;
  std::vector<PrefailedOp> prefailed_;
  std::thread housekeeper_;
};

}  // namespace kvbridge::tcp
