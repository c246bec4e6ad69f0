// MasterClient: a process's one way to call the master (kvbridge.rpc.Master), used by the store
// client and the storage node. It owns the channels to the master (the main one and, for a
// node, a heartbeat channel of its own), the cluster-token proof each call carries, the
// per-call deadline and the retry policy, and the conversion between the generated messages
// and kvbridge types; every failure names the RPC and the master's address, with the master as
// its origin(). PeerDirectory, on top of it, is the one way to learn a storage node's engine
// descriptor (from the master's directory, or from the node itself in "direct" discovery).
// Internal to the store (csrc/store); both classes are thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge.grpc.pb.h"
#include "kvbridge/engine.h"
#include "kvbridge/status.h"
#include "kvbridge/store.h"
#include "store/master_ha.h"
#include "store/master_state.h"  // the store's domain types (PutEndItem, InventoryRecord)
#include "store/master_types.h"
#include "store/rpc_auth.h"
#include "store/rpc_util.h"

namespace kvbridge::store {

namespace fast {
class Client;
enum class Method : uint16_t;
}  // namespace fast

// Retries of calls to the master, one policy for every caller, decided per method by one table
// (kMasterMethods in master_client.cc, MasterClient::Retryable). A retryable call (the
// idempotent reads: GetReplicas, Exists, GetNodeDescriptors, Stats) that fails with
// UNAVAILABLE (master down, restarting, connection lost) is sent again after first_backoff_ms
// (doubling to max_backoff_ms), each retry waiting for the channel to reconnect, until its
// total deadline: rpc_timeout_ms from the first attempt, the same bound a single attempt has.
// A master still down then is PEER_UNREACHABLE with the first attempt's reason. Every other
// code (a deadline, UNAUTHENTICATED, a refusal) ends the call at once. Calls that change state,
// or that their caller repeats itself (Heartbeat; TaskDone and DemoteDone have their own
// queue), are sent once and fail at once while the master is unreachable.
struct MasterRetryPolicy {
  uint32_t rpc_timeout_ms = 3000;  // total deadline of one call, all attempts together
  uint32_t first_backoff_ms = 50;
  uint32_t max_backoff_ms = 500;
  // The channels' reconnection backoff (gRPC's default grows to 120 s): a master restarted on
  // its address is reached again within about this much.
  uint32_t max_reconnect_backoff_ms = 1000;
};

// A storage node as the master's directory lists it.
struct NodeEntry {
  PeerId id;
  std::string engine_descriptor;
  std::string rpc_address;  // its kvbridge.rpc.Node service
};

// A replica (or a node's copy) that failed its reader.
struct BadReplica {
  std::string key;
  uint64_t version = 0;
  PeerId node;
  uint64_t segment_id = 0;
  uint64_t offset = 0;
  bool node_unreachable = false;  // the node as a whole failed the reader
};

// A storage node keeps its records in the Node service's wire form (rpc::InventoryRecord: what
// the master's Commit sends and what its SSD objects carry as metadata); these convert at its
// boundary with MasterClient, which takes and gives InventoryRecord.
InventoryRecord RecordFromProto(const rpc::InventoryRecord& r);
rpc::InventoryRecord RecordToProto(const InventoryRecord& r);

// The pins a put asks for (PutOptions::pinned, soft_pin, soft_pin_ttl_ms).
struct PutPins {
  bool hard_pin = false;
  SoftPin soft_pin = SoftPin::kPreserve;
  uint64_t soft_pin_ttl_ms = 0;
};

class MasterClient {
 public:
  struct Options {
    // The master's "host:port", or "etcd://host:port[,...][/prefix]": the leader elected
    // there (csrc/store/master_ha.h), asked again whenever a call finds it unavailable.
    std::string address;
    std::string cluster_token;
    uint32_t auth_skew_ms = kDefaultAuthSkewMs;
    MasterRetryPolicy retry;
    // A second channel for Heartbeat (a storage node): a slow or stuck call on the main
    // channel can never hold a heartbeat up behind it on one connection.
    bool heartbeat_channel = false;
    // PutStart, PutEnd, GetReplicas and Exists on the master's lean port when it has one
    // (store/fast_rpc.h), else over gRPC. KVBRIDGE_MASTER_FAST_PATH=off turns it off too.
    bool fast_path = true;
  };
  explicit MasterClient(Options options);

  // As configured: a master's "host:port" or "etcd://..." (then leader_address() is the
  // leader's, "" while none is known).
  const std::string& address() const { return options_.address; }
  std::string leader_address();
  // `address` failed as the leader (e.g. it answered with a replaced term): the next call
  // asks etcd again. Nothing without an "etcd://" address.
  void ForgetLeader(const std::string& address) const;
  const RpcAuth& auth() const { return auth_; }
  uint32_t rpc_timeout_ms() const { return options_.retry.rpc_timeout_ms; }
  // Whether calls of `method` (a store::method name) are retried under MasterRetryPolicy: the
  // one table in master_client.cc, which lists every method this client calls. A method not in
  // it is sent once.
  static bool Retryable(std::string_view method);
  // Attempts sent so far, every call and retry counted (tests check what was retried).
  uint64_t attempts() const { return attempts_.load(std::memory_order_relaxed); }
  // Calls answered on the master's lean port, and those sent there that fell back to gRPC
  // (nothing reached the master: no lean port, or a connection found closed).
  uint64_t fast_calls() const { return fast_calls_.load(std::memory_order_relaxed); }
  uint64_t fast_fallbacks() const { return fast_fallbacks_.load(std::memory_order_relaxed); }

  // --- store client ---
  // PutStart for keys whose buffers have these sizes, sent at once; Wait() gives the answer
  // (one grant per key; PROTOCOL error otherwise). Not retried.
  class PendingPutStart {
   public:
    // One grant per key, in order.
    Result<std::vector<PutGrant>> Wait();

   private:
    friend class MasterClient;
    struct State;
    std::shared_ptr<State> state_;
  };
  // overwrite: new versions of existing keys (PutOptions::overwrite); pins: PutOptions's.
  PendingPutStart PutStart(std::span<const std::string> keys,
                           std::span<const std::vector<uint64_t>> sizes, uint32_t replica_num,
                           const std::string& client_node_id, bool overwrite = false,
                           const PutPins& pins = {});
  // One status per item, in order. Not retried.
  // `local_nodes`: storage nodes of this process; their commits come back in *local_commits
  // (PutEndRequest.local_nodes) for the caller to apply (store::ApplyLocalCommit).
  Result<std::vector<Status>> PutEnd(std::span<const PutEndItem> items,
                                     std::span<const NodeIdentity> local_nodes = {},
                                     std::vector<rpc::CommitRequest>* local_commits = nullptr);
  // The master's replicas (and sizes, read leases) of each key, one grant per key. Retried;
  // with single_attempt_ms != 0, sent once with that deadline instead (a get that can be
  // served without the master: StoreOptions::master_wait_ms).
  Result<std::vector<ReadGrant>> GetReplicas(std::span<const std::string> keys,
                                             const std::string& client_node_id, bool sizes_only,
                                             uint32_t single_attempt_ms = 0);
  // Retried; single_attempt_ms as GetReplicas.
  Result<std::vector<bool>> Exists(std::span<const std::string> keys,
                                   uint32_t single_attempt_ms = 0);
  Result<std::vector<Status>> Remove(std::span<const std::string> keys);
  // MasterState::Place and QueryPlacement. Place is not retried; QueryPlacement is.
  Result<uint64_t> Place(std::string_view key, const std::vector<std::string>& targets,
                         const std::string& move_from);
  Result<PlacementTask> QueryPlacement(uint64_t task_id);
  // Signed with `admin_key` too (StoreOptions::admin_token).
  Status RemoveAll(const CallKey& admin_key);
  // MasterState::RemoveByRegex: how many objects were removed. Signed with `admin_key` too.
  Result<uint64_t> RemoveByRegex(std::string_view pattern, const CallKey& admin_key);
  // Best effort: the answer, or its absence, is ignored.
  void ReportBadReplica(const BadReplica& bad);
  // The directory's entries of these nodes (all live nodes for none). Retried.
  Result<std::vector<NodeEntry>> NodeDescriptors(std::span<const std::string> node_ids);
  Result<ClusterStatus> Stats();  // retried

  // --- storage node ---
  // One RegisterNodeStream call: `registration`, then `records` in chunks
  // (kInventoryChunkRecords / kInventoryChunkBytes), with 1 ms more deadline per 100 records;
  // a master without the stream gets one RegisterNode. The master's refusal is the status
  // (with "RegisterNode" as context). `on_heartbeat_channel`: a registration again from the
  // heartbeat thread, which must not wait behind the main channel's calls.
  Result<NodeRegistered> Register(const NodeRegistration& registration,
                                  const std::vector<InventoryRecord>& records,
                                  bool on_heartbeat_channel = false);
  // On the heartbeat channel. The master's status is the call's status (NOT_FOUND: register
  // again; STALE_PEER: superseded).
  Result<HeartbeatAnswer> Heartbeat(const PeerId& node, uint64_t frees_acked);
  // The call's failure (the master may or may not have the report); on OK, *answer is the
  // master's answer.
  Status TaskDone(const TaskReport& done, Status* answer);
  Status DemoteDone(const MoveReport& done, Status* answer);
  // Signed with `node_key` too (this registration's secret). The master's answer included.
  Status Drain(const PeerId& node, const CallKey& node_key);
  Status Deregister(const PeerId& node, const CallKey& node_key);

 private:
  // The stubs of one master address: the main channel and, for a node, the heartbeat one.
  struct FastLink;  // the lean port of one master, once asked (master_client.cc)
  struct Channels {
    std::string address;
    std::shared_ptr<FastLink> fast;
    std::unique_ptr<rpc::Master::Stub> main;
    std::unique_ptr<rpc::Master::Stub> heartbeat;  // none: main carries heartbeats
    rpc::Master::Stub& Pick(bool heartbeat_channel) const {
      return heartbeat_channel && heartbeat ? *heartbeat : *main;
    }
  };
  std::shared_ptr<const Channels> Connect(const std::string& address) const;
  // The channels to call now: the fixed master's, or those of the leader etcd names.
  Result<std::shared_ptr<const Channels>> Current();
  // The lean port of the master behind `ch` (asked over gRPC the first time), or null: none,
  // turned off, or asked less than a few seconds ago without an answer.
  std::shared_ptr<fast::Client> Fast(const Channels& ch) const;
  // `client` failed to connect: asked for again before the next call uses it.
  void DropFast(const Channels& ch, const std::shared_ptr<fast::Client>& client) const;
  // `method` on the lean port when the master has one, with the deadline of `ctx`; false when
  // the call must go over gRPC instead (then *status is untouched).
  bool CallFast(const Channels& ch, fast::Method method, const grpc::ClientContext& ctx,
                const google::protobuf::MessageLite& request, google::protobuf::MessageLite* reply,
                grpc::Status* status) const;

  // Runs `attempt(ctx)` under the policy: one context per attempt with the proof of `method`,
  // `sign` (extra proofs) and the deadline left; retried if Retryable(method). The failure as
  // a Status naming `name` and the master's address.
  Status Run(std::string_view name, std::string_view method,
             const std::function<grpc::Status(grpc::ClientContext*, const Channels&)>& attempt,
             const std::function<void(grpc::ClientContext*)>& sign = {},
             uint32_t extra_deadline_ms = 0, uint32_t single_attempt_ms = 0);
  // `address`: the master that was called (empty: options().address).
  Status Failed(const grpc::Status& gs, std::string_view name,
                const std::string& address = {}) const;

  const Options options_;
  RpcAuth auth_;
  std::shared_ptr<const Channels> fixed_;     // a master address
  std::unique_ptr<LeaderResolver> resolver_;  // an "etcd://" address
  Status bad_address_;                        // an "etcd://" address that does not parse
  std::mutex leader_mu_;
  std::shared_ptr<const Channels> leader_;  // the leader's, while etcd names it
  bool fast_enabled_ = true;
  mutable std::atomic<uint64_t> fast_calls_{0};
  mutable std::atomic<uint64_t> fast_fallbacks_{0};
  std::atomic<uint64_t> attempts_{0};
};

// Where the engine descriptor of a storage node comes from (StoreOptions::peer_discovery,
// NodeOptions::peer_discovery): "master", the master's directory entry (GetNodeDescriptors, or
// the copy a replication task carries); "direct", the node's own answer to Describe, checked to
// be the incarnation the master named. A node whose Describe failed is not asked again until a
// backoff has passed (DescribeBackoff).
class PeerDirectory {
 public:
  PeerDirectory(MasterClient* master, std::string peer_discovery)
      : master_(master), direct_(peer_discovery == "direct") {}

  // The entries of these node incarnations, with the descriptor to use; nodes backing off
  // are left out (their keys use other replicas), as are nodes whose Describe failed (logged).
  // A failed GetNodeDescriptors is the status.
  Result<std::vector<NodeEntry>> Lookup(std::span<const PeerId> nodes);
  // The descriptor to use for `listed` (an entry the master handed out, e.g. in a task).
  Result<std::string> Descriptor(const NodeEntry& listed);
  // Whether this incarnation is backing off after a failed Describe.
  bool BackingOff(const PeerId& node) const;

 private:
  MasterClient* master_;
  const bool direct_;
  DescribeBackoff backoff_;
};

}  // namespace kvbridge::store
