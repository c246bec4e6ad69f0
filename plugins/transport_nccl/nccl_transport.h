// kvbridge::nccl::Transport: the NCCL transport plugin's class (docs/transports/nccl.md), written
// on the plugin SDK (nccl_plugin.cc turns it into the C ABI).
//
// One-sided READ/WRITE of CUDA device memory over NCCL point-to-point. For every (initiator,
// target) pair the initiator opens one control connection (nccl_wire.h) to the target's control
// listener, runs the host's handshake on it, makes an ncclUniqueId and sends it (COMM); both
// sides then make a 2-rank non-blocking communicator from it (initiator rank 0, target rank 1)
// and a stream for it. Per op the initiator sends REQ; the target checks it against its
// registered regions, queues its ncclRecv (WRITE) or ncclSend (READ) and answers ACCEPT (or
// REFUSE, touching nothing); the initiator then queues the matching ncclSend/ncclRecv. Both sides
// issue in the order of the frames on the one connection, which is the order NCCL pairs
// point-to-point calls in. Completion is a CUDA event recorded after each call; the target
// reports DONE when its side ended. An op is OK when both ended.
//
// Failures: a communicator whose op passed its deadline or stopped progressing, or that reports
// an asynchronous error, is aborted (ncclCommAbort) together with its control connection; the
// next op makes a new connection, handshake, unique id and communicator. A communicator is
// never used across incarnations: it lives exactly as long as its authenticated connection, and
// the handshake names the incarnation (STALE_PEER otherwise).
//
// Threads: one progress thread per instance owns every socket, communicator, stream and event
// after setup; one listener thread accepts inbound control connections and starts one
// short-lived handshake thread per connection (at most nccl.max_handshakes at once; past it a
// connection is closed at once), which authenticates it within nccl.connect_timeout_ms and hands
// it to the progress thread, so a silent or stopped client delays no other peer; one
// short-lived connector thread per outbound connection attempt does TCP connect + handshake +
// COMM. ABI calls validate on the caller's thread and hand the progress thread commands.
//
// Thread-safety: every public method may be called concurrently, except the destructor.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvbridge/plugin/sdk/transport.hpp"
#include "live_requests.h"
#include "nccl_cuda.h"
#include "nccl_loader.h"
#include "nccl_wire.h"

namespace kvbridge::nccl {

// Every nccl.* configuration key (docs/transports/nccl.md lists them with their defaults).
struct Config {
  uint32_t max_inflight_ops_per_peer = 256;  // posted and not final, per peer; more: BACKPRESSURE
  uint32_t progress_timeout_ms = 2000;       // when post opts give 0
  uint32_t connect_timeout_ms = 5000;        // TCP connect + handshake + communicator init
  int32_t device = 0;                        // the CUDA device of every region and communicator
  uint32_t max_inbound = 64;                 // inbound control connections at once
  uint32_t max_handshakes = 64;              // inbound handshakes in progress at once
  uint32_t idle_poll_ms = 20;                // longest sleep of an idle progress thread
};
sdk::Result<Config> LoadConfig(const sdk::Host& host);

struct Peer;
struct Link;
struct ConnectState;
struct Inbound;

struct OpState {
  kvb_status_t status = KVB_IN_PROGRESS;
  std::string msg;
};

// One posted request; `mu` guards everything.
struct RequestState {
  std::mutex mu;
  std::vector<OpState> ops;
  uint32_t unfinished = 0;
  bool final = false;     // every op has its status
  bool reported = false;  // on_complete (if any) has returned: poll may say final
  void (*on_complete)(void*) = nullptr;
  void* user = nullptr;
};

// What kvb_treq_t* points at.
struct RequestHandle {
  std::shared_ptr<RequestState> req;
};

// One op as the progress thread drives it (initiator side).
struct Op {
  std::shared_ptr<RequestState> req;
  uint32_t index = 0;
  uint32_t opcode = 0;
  uint8_t* local = nullptr;
  uint64_t segment = 0, offset = 0, length = 0;
  uint64_t deadline_ns = 0;
  uint64_t progress_timeout_ns = 0;
  uint64_t id = 0;
  bool sent = false;    // REQ is on the wire
  bool resent = false;  // went back to the queue once after its connection closed
  bool issued = false;  // our ncclSend/ncclRecv is queued (event recorded)
  CudaEvent event = nullptr;
  bool local_done = false;
  bool remote_done = false;
};
using OpPtr = std::shared_ptr<Op>;

// A peer incarnation. `mu` guards address and segments; the rest is progress-thread-only
// (inflight_ops is an atomic the posting threads charge).
struct Peer {
  std::string node_id;
  uint64_t incarnation = 0;
  std::mutex mu;
  ControlAddress address;
  std::unordered_map<uint64_t, uint64_t> segments;  // id -> length
  std::atomic<uint32_t> inflight_ops{0};
  // Progress-thread-only.
  // add_peer learnt another incarnation of node_id: every op of this one ends STALE_PEER.
  bool superseded = false;
  std::deque<OpPtr> queued;
  std::map<uint64_t, OpPtr> sent;  // by op id: REQ sent, not final
  std::unique_ptr<Link> link;
};

struct Counters {
  std::atomic<uint64_t> connections_open{0};
  std::atomic<uint64_t> connections_opened{0};
  std::atomic<uint64_t> connections_evicted{0};
  std::atomic<uint64_t> inbound_open{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> frames_rejected{0};
  std::atomic<uint64_t> queued_bytes{0};
  std::atomic<uint64_t> comms_aborted{0};       // for tests: communicators aborted after a failure
  std::atomic<uint64_t> handshakes_active{0};   // inbound handshakes running now
  std::atomic<uint64_t> handshakes_refused{0};  // closed at once: nccl.max_handshakes running
  std::atomic<uint64_t> device_regions_direct{0};  // every region: NCCL moves device memory
};

class Transport {
 public:
  static constexpr const char* kName = "nccl";
  static constexpr const char* kVersion = "0.1.0";
  // Device memory only (host memory goes through tcp/ucx); opt-in: an engine uses it only when
  // named, since every communicator holds GPU memory and NCCL threads.
  static constexpr uint64_t kCaps =
      KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_CUDA_MEM | KVB_TCAP_CUDA_DIRECT | KVB_TCAP_OPT_IN;
  static constexpr uint16_t kMinHostMinor = 3;  // the handshake services of ABI 1.2
  using Peer = nccl::Peer;
  using Request = RequestHandle;

  // nccl_plugin.cc: LoadNcclOnce + ProbeNccl; Create also loads the CUDA driver.
  static sdk::Status Probe();
  static sdk::Result<std::unique_ptr<Transport>> Create(sdk::Host host,
                                                        const kvb_transport_params_t& params);
  // Create on the given NCCL and CUDA tables (tests hand fakes in).
  static sdk::Result<std::unique_ptr<Transport>> CreateWith(sdk::Host host,
                                                            const kvb_transport_params_t& params,
                                                            const Nccl* nccl, const CudaOps* cuda);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  std::string Endpoints();
  sdk::Status RegisterMemory(const sdk::Region& r, sdk::RkeyBuffer& key);
  sdk::Status DeregisterMemory(uint64_t segment_id);
  sdk::Result<Peer*> AddPeer(const sdk::PeerInfo& info);
  sdk::Status UpdatePeer(Peer* peer, const sdk::PeerInfo& info);
  void RemovePeer(Peer* peer);
  sdk::Result<Request*> Post(Peer* peer, const sdk::Ops& ops, const sdk::PostOptions& opts);
  sdk::Status Poll(Request* req, std::span<kvb_status_t> op_status);
  void Cancel(Request* req);
  void Release(Request* req);
  sdk::Status Stats(kvb_transport_stats_t& stats);

  const Counters& counters() const { return counters_; }
  const Config& config() const { return config_; }

 private:
  struct Region {
    uint8_t* base = nullptr;
    uint64_t length = 0;
  };
  struct Command;
  using Completions = std::vector<std::shared_ptr<RequestState>>;

  Transport(sdk::Host host, Config config, const Nccl* nccl, const CudaOps* cuda);
  sdk::Status Start(const ControlAddress& listen);

  // Caller threads.
  void Submit(std::shared_ptr<Command> cmd, bool wait);
  void Wake();

  // Listener thread.
  void ListenLoop();
  struct Handshaker {
    std::thread thread;
    int fd = -1;
    std::string from;
    bool handed_off = false;  // the progress thread owns fd (guarded by handshakes_mu_)
    std::atomic<bool> done{false};
  };
  // A handshake thread: authenticates h's connection, then hands it to the progress thread.
  void ServeHandshake(Handshaker* h);
  // Joins (and closes the connection of) handshake threads that ended; all of them when `all`
  // (their sockets are shut down first, so each ends at once).
  void ReapHandshakes(bool all);
  // Progress thread.
  void ProgressLoop(std::promise<void>* device_checked);
  void RunCommands(Completions* done);
  void DriveLink(Peer& p, uint64_t now, Completions* done);
  void StartConnect(Peer& p);
  void OnConnected(Peer& p, Completions* done);
  void ReadLink(Peer& p, Completions* done);
  void OnFrame(Peer& p, const Frame& f, Completions* done);
  // Queues the ncclSend/ncclRecv of accepted ops in ACCEPT order, one NCCL call at a time while
  // a non-blocking communicator is still enqueueing (async: its ncclCommGetAsyncError). False
  // when the link was torn down.
  bool IssueAccepted(Peer& p, ncclResult_t async, Completions* done);
  void CheckOps(Peer& p, uint64_t now, Completions* done);
  // Aborts the link's communicator and closes its connection. Its ops in `sent` end with
  // (code, msg), except, when `requeue`, those whose deadline has not passed: they go back to
  // the front of the queue for the next communicator.
  void Teardown(Peer& p, kvb_status_t code, const std::string& msg, bool requeue,
                Completions* done);
  void DriveInbound(Inbound& in, Completions* done);
  bool ReadInbound(Inbound& in);
  // The target's side of IssueAccepted. False when the connection was closed.
  bool IssueInbound(Inbound& in);
  void OnInboundFrame(Inbound& in, const Frame& f);
  void CloseInbound(Inbound& in, const std::string& why);
  void FailQueued(Peer& p, kvb_status_t code, const std::string& msg, Completions* done);
  void Finish(Op& op, kvb_status_t code, const std::string& msg, Completions* done);
  void RunCompletions(Completions* done);
  bool FlushOut(int fd, std::string* out);
  void ChargeSegment(uint64_t segment, int delta);
  void DropEverything();
  struct Connector {
    std::thread thread;
    std::shared_ptr<ConnectState> state;
  };
  // Joins a dropped link's connector once it ended (now, when `wait`); closes what it opened.
  bool ReapConnector(Connector& c, bool wait);

  // Requests handed out and not yet released; first, so it goes last (it frees what is left).
  plugin::LiveRequests<RequestHandle> handles_;
  sdk::Host host_;
  Config config_;
  const Nccl* nccl_;
  const CudaOps* cuda_;
  Counters counters_;
  ControlAddress bound_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;         // eventfd: the progress thread's
  int listen_wake_fd_ = -1;  // eventfd: the listener's
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> next_op_id_{1};

  std::mutex regions_mu_;
  std::condition_variable regions_cv_;
  std::unordered_map<uint64_t, Region> regions_;
  std::unordered_map<uint64_t, uint32_t> segment_busy_;  // inbound ops using a segment

  std::mutex cmd_mu_;
  std::condition_variable cmd_cv_;
  std::deque<std::shared_ptr<Command>> commands_;

  // Progress-thread-only.
  std::vector<Peer*> peers_;
  std::vector<std::unique_ptr<Inbound>> inbound_;
  std::vector<Connector> finished_connectors_;
  bool device_ready_ = false;
  std::string device_error_;

  std::mutex handshakes_mu_;
  std::vector<std::unique_ptr<Handshaker>> handshakes_;  // listener-thread-owned list

  std::thread listener_;
  std::thread progress_;
};

}  // namespace kvbridge::nccl
