// kvbridge::ucx::Transport: the ucx transport plugin's backend (docs/transports/ucx.md).
//
// One ucp_context (RMA | AM) and one ucp_worker (UCS_THREAD_MODE_SINGLE) per
// instance, both owned by one progress thread (ucx_worker.cc). No other thread calls UCX: the
// ABI ops validate and admit on the caller's thread, then hand the progress thread a command
// (a mutex-guarded queue plus an eventfd) and, where the contract requires it (register,
// deregister, cancel, remove_peer, destroy), wait for its answer.
//
// Client side, per peer: a FIFO of slices (ops cut at ucx.slice_bytes) and one endpoint,
// created lazily on the first post. The endpoint first runs the host's identity handshake over
// active messages (the hello); only after it said OK are the peer's rkeys unpacked on it and
// RMA issued (ucp_put_nbx / ucp_get_nbx within ucx.max_inflight_bytes_per_ep). A WRITE slice
// ends when an endpoint flush issued after its put completes.
//
// Server side: the hello's server half runs in the progress thread's AM handler; RMA itself is
// one-sided and needs no server code (tcp's software RMA needs the worker progressed, which the
// same thread does).
//
// Thread-safety: every public method may be called concurrently, except that the destructor
// (the ABI's destroy) must not race with anything else. Request state is guarded by each
// request's mutex; on_complete runs on the progress thread with no lock held.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvbridge/plugin/transport.h"
#include "live_requests.h"

namespace kvbridge::ucx {

// Every ucx.* configuration key; docs/transports/ucx.md says what each one does.
struct Config {
  uint64_t slice_bytes = 4u << 20;
  uint64_t max_inflight_bytes_per_ep = 32u << 20;
  uint64_t max_queued_bytes_per_peer = 256u << 20;
  uint64_t max_queued_slices_per_peer = 65536;
  uint32_t connect_timeout_ms = 1000;   // the hello, from endpoint creation to OK
  uint32_t progress_timeout_ms = 2000;  // used when post opts give 0
  uint32_t cancel_drain_ms = 250;       // cancel/deadline: how long a live PEER-mode ep may drain
  uint32_t spin_us = 200;               // busy progress after the last activity before sleeping
  uint32_t idle_poll_ms = 1;            // longest sleep of the progress thread
  uint32_t max_handshakes = 256;        // inbound hellos in progress at once
  bool same_host_auto = true;           // ucx.same_host=auto|off
  std::string tls;                      // ucx.tls: UCX_TLS for this instance ("" = UCX's own)
};

bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err);

struct Request;
struct Peer;
struct Endpoint;

// What kvb_treq_t* points at.
struct RequestHandle {
  std::shared_ptr<Request> req;
};

struct OpState {
  uint16_t opcode = 0;
  uint64_t length = 0;
  uint32_t total_slices = 0;
  uint32_t ended_slices = 0;
  kvb_status_t error = KVB_OK;  // first error of any slice
  kvb_status_t status = KVB_IN_PROGRESS;
  std::string msg;
};

// One posted request. `mu` guards everything but the fields marked progress-thread-only.
struct Request {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<OpState> ops;
  uint32_t outstanding_slices = 0;
  bool final = false;
  uint32_t in_ucx = 0;  // UCX operations that may still touch this request's local memory
  uint64_t charged_bytes = 0;
  uint64_t charged_slices = 0;
  Peer* peer = nullptr;  // cleared when final (the charge is returned)
  uint64_t deadline_ns = 0;
  uint64_t progress_timeout_ns = 0;
  void (*on_complete)(void*) = nullptr;
  void* user = nullptr;
  Peer* target = nullptr;  // progress-thread-only: the peer it was posted to (never cleared)
};

// A piece of one op, at most slice_bytes long. Progress-thread-only.
struct Slice {
  std::shared_ptr<Request> req;
  uint32_t op = 0;
  uint16_t opcode = 0;
  uint8_t* local = nullptr;
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool local_cuda = false;  // the local memory is CUDA device memory (UCS_MEMORY_TYPE_CUDA)
  bool ended = false;
};
using SlicePtr = std::shared_ptr<Slice>;

// A remote segment as the peer published it: its length and [u64 LE base][packed rkey].
struct RemoteSegment {
  uint64_t length = 0;
  std::string rkey;
};

// What a peer published through get_endpoints.
struct PeerAddress {
  std::string worker_address;  // decoded ucp address
  std::string host_key;        // boot id + ipc and pid namespace inodes
  int pid = 0;
};

// A peer incarnation. `mu` guards segments and the flags; counters are atomics; the rest is
// progress-thread-only.
struct Peer {
  std::mutex mu;
  std::string node_id;
  uint64_t incarnation = 0;
  PeerAddress address;
  std::unordered_map<uint64_t, RemoteSegment> segments;
  uint64_t segments_version = 0;
  std::atomic<uint64_t> queued_bytes{0};
  std::atomic<uint64_t> queued_slices{0};
  bool same_host = false;
  // Progress-thread-only.
  std::deque<SlicePtr> queue;
  std::unique_ptr<Endpoint> ep;
  int pidfd = -1;       // same-host peers: readable once the peer process has exited
  bool exited = false;  // the pidfd said so: every op fails PEER_UNREACHABLE
};

// Callbacks to run once no lock is held.
struct Completion {
  void (*fn)(void*) = nullptr;
  void* user = nullptr;
};
using Completions = std::vector<Completion>;

struct Counters {
  std::atomic<uint64_t> connections_open{0};
  std::atomic<uint64_t> connections_opened{0};
  std::atomic<uint64_t> connections_evicted{0};
  std::atomic<uint64_t> inbound_open{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> frames_rejected{0};
  std::atomic<uint64_t> queued_bytes{0};
  std::atomic<uint64_t> device_regions_direct{0};  // CUDA regions mapped (UCX moves them itself)
};

class Worker;

class Transport {
 public:
  static kvb_status_t Create(const kvb_host_services_t* host, const kvb_transport_params_t* params,
                             std::unique_ptr<Transport>* out, std::string* err);
  ~Transport();

  // What get_endpoints returns: "ucx1;a=<base64 worker address>;h=<host key>;p=<pid>".
  std::string EndpointsText() const;
  // Maps the region; *rkey gets [u64 LE base][packed rkey] (at most rkey_cap bytes).
  kvb_status_t RegisterMemory(const kvb_region_t* region, uint32_t rkey_cap, std::string* rkey,
                              std::string* err);
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

  // Used by the worker.
  const Config& config() const { return config_; }
  const kvb_host_services_t* host() const { return host_; }
  Counters& counters() { return counters_; }
  uint64_t Now() const { return host_->now_ns(host_->host_ctx); }
  void Log(int32_t level, const std::string& msg) const;
  const std::string& host_key() const { return host_key_; }
  // Whether the loaded UCX moves CUDA device memory here (ucp_context memory types, read at
  // create): false for a UCX built without CUDA, or with no GPU or driver on the machine.
  bool cuda_memory() const;
  // Whether a same-host peer is reached through shared memory or cma (KVB_TCAP_LOCAL_SHM): not
  // with ucx.same_host=off, nor when the transports this context may use (ucx.tls, else the
  // UCX_TLS variable) name none of them.
  bool same_host_shm() const;
  // "host, cuda, ..." from the same query, for messages.
  std::string memory_types() const;
  // Ends one slice; finalizes its request when it was the last one.
  void EndSlice(Slice& s, kvb_status_t code, const std::string& msg, Completions* done);
  // Makes a request final with `code` for its unfinished ops (cancel, deadline).
  void FailRequest(Request& r, kvb_status_t code, const std::string& msg, Completions* done);
  static void RunCompletions(const Completions& done);

 private:
  Transport(const kvb_host_services_t* host, const Config& config);
  // Same host: opens a pidfd on the peer's process (NONE-mode endpoints rely on it).
  void WatchLiveness(const std::string& node_id, const PeerAddress& address, bool* same_host,
                     int* pidfd, bool* exited) const;
  void Finalize(Request& r, Completions* done);

  // Requests handed out and not yet released; first, so it goes last (it frees what is left).
  plugin::LiveRequests<RequestHandle> handles_;
  const kvb_host_services_t* host_;
  Config config_;
  std::string host_key_;
  Counters counters_;
  std::unique_ptr<Worker> worker_;

  struct Region {
    uint8_t* base = nullptr;
    uint64_t length = 0;
    ucp_mem_h memh = nullptr;
    bool cuda = false;
  };
  mutable std::mutex regions_mu_;
  std::unordered_map<uint64_t, Region> regions_;

  std::mutex peers_mu_;
  std::unordered_set<Peer*> peers_;
};

// Base64 (RFC 4648, with padding) for the worker address in the endpoints text.
std::string Base64Encode(const std::string& in);
bool Base64Decode(const std::string& in, std::string* out);

// "ucx1;a=<base64 address>;h=<host key>;p=<pid>" and back.
std::string FormatEndpoints(const std::string& address, const std::string& host_key, int pid);
bool ParseEndpoints(const std::string& text, PeerAddress* out, std::string* err);

}  // namespace kvbridge::ucx
