// kvbridge::verbs::Transport: the verbs transport plugin's backend (docs/transports/verbs.md),
// written against VerbsApi (verbs_api.h) and Registrar (verbs_mr_cache.h) so that the same code
// runs on libibverbs (verbs_plugin.cc) and on the tests' loopback fabric (tests/verbs).
//
// - NICs: every ACTIVE port of the RDMA devices under <sysfs>/class/infiniband (verbs.devices
//   narrows them) is one local NIC, opened once with its PD, Registrar and MrCache.
// - Side channel: a TCP listener (the connection manager) whose host:port the Endpoints text
//   names. A client connects, runs the host's identity handshake (auth_*, transport "verbs"),
//   sends a kConnect frame with one QP info per (client NIC, server NIC) pair and reads the
//   server's kAccept; both sides then move their RC QPs to RTS. One exchange per connection.
// - Rails: per peer incarnation one RcConnection per local NIC, to remote NIC (i mod n). An op
//   goes over the rails closest to its local memory (ChooseRails), striped (PlanStripes) when
//   longer than verbs.stripe_min_bytes, in work requests of at most verbs.max_wr_bytes. A rail
//   whose QP errs is closed at once and its unfinished work requests are retried on the
//   op's other rails within its deadline; the rail reconnects lazily (a new QP through the side
//   channel) after verbs.rail_retry_ms, if its port is ACTIVE.
// - Host staging: CUDA memory that no GPUDirect path registers (no dma-buf, no nvidia-peermem,
//   or both refused it) is registered KVB_REG_LOCAL_ONLY, without an MR. This process's ops
//   move its bytes through the pinned bounce buffers of the peer's staging ring (the host's
//   dev_copy_* services copy device <-> bounce, the NIC bounce <-> peer); peers reach such a
//   region over another transport. verbs.host_staging=0 refuses the memory instead.
// - One progress thread polls every CQ, posts queued work within each QP's max_outstanding,
//   and enforces deadlines and progress timeouts; connection setup runs on a short-lived thread
//   per peer, and each inbound side-channel exchange on its own (at most
//   verbs.max_handshakes at once), so that a dead or slow peer never stalls the others.
//
// Thread-safety: every public method may be called concurrently, except the destructor. One
// mutex guards peers, requests and connections; on_complete runs with no lock held.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kvbridge/plugin/sdk/transport.hpp"
#include "live_requests.h"
#include "verbs_api.h"
#include "verbs_mr_cache.h"
#include "verbs_qp.h"
#include "verbs_topology.h"
#include "verbs_wire.h"

namespace kvbridge::verbs {

// Every verbs.* configuration key; docs/transports/verbs.md says what each one does.
struct Config {
  std::string devices;     // comma-separated allow-list of device names; empty = all
  std::string cm_listen;   // the side channel's host:port; empty = listen's host, port 0
  uint32_t max_rails = 0;  // rails per op (0 = every rail of the closest distance)
  uint64_t stripe_min_bytes = 256u << 10;
  uint64_t max_wr_bytes = 1u << 20;
  uint32_t max_outstanding_wr = 128;  // per QP
  uint64_t max_queued_bytes_per_peer = 256u << 20;
  uint64_t max_queued_ops_per_peer = 65536;
  uint32_t progress_timeout_ms = 2000;       // used when post opts give 0
  uint32_t connect_timeout_ms = 2000;        // the side-channel exchange, connect to RTS
  uint32_t gid_index = 0;                    // RoCE source GID index
  uint32_t rail_retry_ms = 1000;             // a failed rail stays out this long, then reconnects
  uint32_t max_inbound_qps = 4096;           // server-side QPs kept, all peers
  uint32_t max_handshakes = 64;              // side-channel exchanges served at once
  uint32_t host_staging = 1;                 // 1: stage CUDA memory no GPUDirect path registers
  uint64_t staging_buffer_bytes = 1u << 20;  // one bounce buffer (and the largest staged WR)
  uint32_t staging_buffers = 8;              // bounce buffers per peer
};

plugin::sdk::Result<Config> LoadConfig(const plugin::sdk::Host& host);

// What the transport runs on: the verbs calls, registration, and the sysfs tree NICs are read
// from. make_registrar is called once per local NIC with its opened device and PD.
struct Fabric {
  VerbsApi* api = nullptr;  // outlives the transport
  std::string sysfs_root = "/sys";
  std::function<std::unique_ptr<Registrar>(const std::string& device, DeviceHandle, PdHandle)>
      make_registrar;
  bool cuda_direct = false;  // device memory is registrable (dma-buf or nvidia-peermem)
  // Where a region's bytes live, for choosing its rails: the NUMA node of host memory, the PCI
  // bus id of a CUDA device. Unset: HostNumaNodeOf for host memory, unknown for device memory.
  std::function<Location(uint64_t addr, bool cuda, int device_id)> locate;
};

// The NUMA node holding the page at `addr` (get_mempolicy), -1 when the kernel does not say.
int HostNumaNodeOf(uint64_t addr);

// Counters beyond kvb_transport_stats_t, for tests and logs.
struct VerbsCounters {
  uint64_t rails_failed = 0;  // rails taken out (QP error, port down, failed connect)
  uint64_t wrs_retried = 0;   // work requests re-posted on another rail
  uint64_t side_channel_refused = 0;
  std::array<uint64_t, kRegPathCount> registrations{};  // by RegPath
  std::vector<uint64_t> wrs_per_nic;                    // work requests posted, by local NIC
  uint64_t staging_copies = 0;                          // device <-> bounce copies that ended OK
  uint64_t staging_copy_failures = 0;  // ... that failed (the slice's op failed IO_ERROR)
  uint64_t staging_rings = 0;          // per-peer staging rings made
  uint64_t staging_buffers_busy = 0;   // bounce buffers not free now, over every peer's ring
};

struct Request;
struct Peer;
struct Slice;
struct ConnectJob;
struct StagingRing;

class Transport {
 public:
  using Peer = verbs::Peer;
  using Request = verbs::Request;

  static plugin::sdk::Result<std::unique_ptr<Transport>> Create(
      plugin::sdk::Host host, const kvb_transport_params_t& params, Fabric fabric);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  std::string Endpoints() const { return endpoints_text_; }
  plugin::sdk::Status RegisterMemory(const plugin::sdk::Region& r, plugin::sdk::RkeyBuffer& key);
  plugin::sdk::Status DeregisterMemory(uint64_t segment_id);
  plugin::sdk::Result<Peer*> AddPeer(const plugin::sdk::PeerInfo& info);
  plugin::sdk::Status UpdatePeer(Peer* peer, const plugin::sdk::PeerInfo& info);
  void RemovePeer(Peer* peer);
  plugin::sdk::Result<Request*> Post(Peer* peer, const plugin::sdk::Ops& ops,
                                     const plugin::sdk::PostOptions& opts);
  plugin::sdk::Status Poll(Request* req, std::span<kvb_status_t> op_status);
  void Cancel(Request* req);
  void Release(Request* req);
  plugin::sdk::Status Stats(kvb_transport_stats_t& stats);
  uint64_t InstanceCaps() const;

  VerbsCounters Counters();
  uint16_t cm_port() const { return endpoints_.cm_port; }

 private:
  struct DeviceCtx;
  struct LocalNic;
  struct Region;

  Transport(plugin::sdk::Host host, Config config, Fabric fabric);
  plugin::sdk::Status OpenNics();
  plugin::sdk::Status Listen(const char* listen);
  void ListenerLoop();
  void ServeOne(int fd, const std::string& from);
  void RunConnect(ConnectJob& job);
  void ProgressLoop();
  void Wake();

  // Under mu_.
  void PumpPeer(Peer& p, uint64_t now, std::vector<std::function<void()>>* done);
  void StartConnect(Peer& p, uint64_t now);
  void FinishConnect(Peer& p, uint64_t now, std::vector<std::function<void()>>* done);
  void HandleEnds(Peer& p, uint32_t rail, std::vector<OpEnd>& ends, uint64_t now,
                  std::vector<std::function<void()>>* done);
  void FailRail(Peer& p, uint32_t rail, plugin::sdk::Status why, uint64_t now,
                std::vector<std::function<void()>>* done);
  void FailPeer(Peer& p, const plugin::sdk::Status& why, std::vector<std::function<void()>>* done);
  void EndSlice(Slice& s, const plugin::sdk::Status& st, std::vector<std::function<void()>>* done);
  void FailRequest(Request& r, const plugin::sdk::Status& why,
                   std::vector<std::function<void()>>* done);
  void Finalize(Request& r, std::vector<std::function<void()>>* done);
  // Host staging. A staging ring for the peer `who` (no lock needed: it reads only what Create
  // set). Under mu_: whether a staged slice is ready to post (a WRITE's bytes are in its
  // bounce buffer), starting its copy if not; the READ copy-out of a slice whose RDMA
  // completed; the copies-out that ended; giving a slice's bounce buffer back (no copy may
  // still use it).
  plugin::sdk::Result<std::unique_ptr<StagingRing>> MakeStagingRing(const std::string& who);
  bool StageReady(Peer& p, Slice& s, uint64_t now, std::vector<std::function<void()>>* done);
  void StartCopyOut(Peer& p, Slice& s, std::vector<std::function<void()>>* done);
  void PollCopiesOut(Peer& p, uint64_t now, std::vector<std::function<void()>>* done);
  // A failed request's slices whose device copy still ran (Peer::draining): the copies that
  // ended give their buffers back, and a request whose last one ended becomes final. Polled by
  // the progress thread; DrainAll waits for every one of a peer that left peers_ (remove_peer,
  // destroy), without mu_, then takes it.
  void DrainCopies(Peer& p, uint64_t now, std::vector<std::function<void()>>* done);
  void DrainAll(Peer& p, std::vector<std::function<void()>>* done);
  void EndDrain(Slice& s, std::vector<std::function<void()>>* done);
  void DropBounce(Slice& s);
  plugin::sdk::Status RegisterStaged(const plugin::sdk::Region& r, const std::string& why_direct);
  static void Run(std::vector<std::function<void()>>& done);

  // Requests handed out and not yet released; first, so it goes last (it frees what is left).
  plugin::LiveRequests<Request> requests_;
  plugin::sdk::Host host_;
  const Config config_;
  Fabric fabric_;
  std::string node_id_;
  uint64_t incarnation_ = 0;
  std::vector<std::unique_ptr<DeviceCtx>> devices_;
  std::vector<std::unique_ptr<LocalNic>> nics_;
  std::vector<Nic> topology_;  // the local NICs as ChooseRails takes them
  verbs::Endpoints endpoints_;
  std::string endpoints_text_;

  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  std::thread listener_;
  std::thread progress_;
  // Side-channel exchanges in progress, one thread each (listener-thread-only).
  struct Exchange {
    int fd = -1;
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Exchange> exchanges_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool work_ = false;
  std::unordered_map<uint64_t, std::unique_ptr<Region>> regions_;
  std::set<Peer*> peers_;
  // Connect threads of removed peers, joined by the progress thread once their job is done.
  struct Orphan {
    std::thread thread;
    std::shared_ptr<ConnectJob> job;
  };
  std::vector<Orphan> orphans_;
  VerbsCounters counters_;
  kvb_transport_stats_t stats_{};
  bool staging_possible_ = false;  // host_staging on and the host has device services

  std::mutex inbound_mu_;
  std::map<std::tuple<std::string, uint64_t, uint8_t, uint8_t>, std::unique_ptr<RcConnection>>
      inbound_;
};

}  // namespace kvbridge::verbs
