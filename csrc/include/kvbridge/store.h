// The KV-page store: StoreClient (what an inference engine links), StorageNode (a process's
// contribution of DRAM), MasterServer (the control plane, embeddable). docs/store.md has the
// design and the rules (replicas, leases, failure, drain, tiers).
//
// Keys are byte strings (1..4096 bytes). An object holds one or more buffers (K and V of a
// page) and is stored as `replica_num` replicas on distinct nodes. Every call takes batches;
// results come one per key, in order, and one bad key never fails the others.
//
// Thread-safety: every method of every class here may be called concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvbridge/engine.h"
#include "kvbridge/export.h"
#include "kvbridge/options.h"
#include "kvbridge/status.h"

namespace kvbridge {

// A piece of caller memory. For the zero-copy calls it must lie inside a buffer registered
// with RegisterBuffer() (host memory, or CUDA device memory registered as such).
struct BufferRef {
  void* addr = nullptr;
  uint64_t length = 0;
};

struct KVBRIDGE_API StoreOptions {
  // The master's gRPC address, or "etcd://host:port[,...][/prefix]": the leader elected in
  // that etcd (HaMaster), followed across elections. KVBRIDGE_MASTER.
  std::string master_address = "127.0.0.1:50051";
  // Replicas per object written by puts. KVBRIDGE_REPLICA_NUM.
  uint32_t replica_num = 1;
  // Deadline of one control-plane call, its retries included (docs/store.md "Talking to the
  // master"). KVBRIDGE_RPC_TIMEOUT_MS.
  uint32_t rpc_timeout_ms = 3000;
  // Deadline of the data transfers of one batch: a put's, and a get's over all its passes,
  // DRAM and SSD (each ReadSsd call's deadline is what is left of it).
  // KVBRIDGE_STORE_TRANSFER_DEADLINE_MS.
  uint32_t transfer_deadline_ms = 5000;
  // Ignored, kept so that configurations naming it still load: every get verifies every
  // object it returns against the object's CRC-32C (DRAM and SSD replicas, lease or not) and
  // moves on to the next replica on a mismatch. A lease only keeps the master from reusing the
  // range; it says nothing about a late writer or a node that answers without writing
  // (docs/store.md "Objects"). KVBRIDGE_VERIFY_CHECKSUMS is ignored likewise.
  bool verify_checksums = true;
  // Hedged reads. A get reads each storage node's share of a batch as its own transfer; one
  // that has not finished after hedge_after_ms plus its bytes at hedge_bandwidth_mbps (MB/s)
  // has its keys read again from their next DRAM replica on another node, into the same
  // buffers: whichever copy completes first serves the key and the other is cancelled. A
  // frozen or stalled holder then costs a get about that delay instead of the transfer's
  // progress timeout. A node's ReadSsd call (SSD replicas) late by the same measure has its
  // keys read from their next SSD replica on another node; the get then still waits for that
  // call's answer or deadline, as the node writes into the buffers itself (docs/store.md
  // "Tiers"). 0 turns hedging off. KVBRIDGE_HEDGE_AFTER_MS, KVBRIDGE_HEDGE_BANDWIDTH_MBPS (>= 1).
  uint32_t hedge_after_ms = 20;
  uint32_t hedge_bandwidth_mbps = 1000;
  // Reads while the master is away (docs/store.md "Reads while the master is away"). The
  // client remembers where the objects it last wrote or read are, up to location_cache_entries
  // keys (about 200 bytes each plus the key; 0 turns these reads off). A get whose every key
  // is remembered waits at most master_wait_ms for the master (one attempt, not retried); if
  // the master does not answer in that time (killed, frozen, an election in progress, a new
  // leader still gathering inventories), the get reads the remembered replicas their nodes
  // confirm they still hold, checked against the object's CRC-32C as every read is, and for
  // the next second such gets do not ask the master at all. A get with keys not remembered
  // asks the master as before (retried until rpc_timeout_ms); if it stays away, the keys that
  // are remembered are read so. BatchExists of remembered keys alone likewise answers from the
  // nodes. KVBRIDGE_LOCATION_CACHE_ENTRIES, KVBRIDGE_MASTER_WAIT_MS (>= 1).
  uint32_t location_cache_entries = 65536;
  uint32_t master_wait_ms = 500;
  // Pins of the objects this client puts (docs/store.md "Eviction"): hard_pin, never evicted;
  // soft_pin "enable" (evicted only when nothing else can be, for soft_pin_ttl_ms after the
  // put, 0: the master's default, renewed by reads), "disable", or "preserve" (an upsert
  // keeps the soft pin of the version it replaces; a new key gets none). A TTL without
  // "enable" is INVALID_ARGUMENT at Create, as is another soft_pin value.
  bool hard_pin = false;
  std::string soft_pin = "preserve";
  uint64_t soft_pin_ttl_ms = 0;
  // The client's transfer engine (its node id is the "local node" for replica ordering).
  EngineOptions engine;
  // Where storage nodes' engine descriptors come from: "master" (the master's directory) or
  // "direct" (each node's own Node service, found through the directory). KVBRIDGE_PEER_DISCOVERY.
  std::string peer_discovery = "master";
  // The cluster's admin token, for RemoveAll (docs/security.md); without it a cluster with a
  // token refuses RemoveAll PERMISSION_DENIED. Keep it off hosts that need only puts and gets.
  // KVBRIDGE_ADMIN_TOKEN.
  std::string admin_token;
  // Fault injection for tests; empty in production. A comma-separated list of name=value:
  //   put_stall_before_write_ms  every put sleeps this long between the master's PutStart
  //                              answer and its transfer (a client stalled, swapped out);
  //   put_ignore_deadline        1: the transfer starts, and runs for transfer_deadline_ms,
  //                              even past the put's deadline from the master (what a client
  //                              that ignored it would do: shows the master's hold of the
  //                              ranges is what keeps such late bytes off other objects);
  //   put_stall_before_local_commit_ms  every put sleeps this long between the master's
  //                              PutEnd answer and applying the commits it returned for
  //                              storage nodes of this process (a remove can reach the node
  //                              first).
  // An unknown name or a bad value makes Create fail naming it. KVBRIDGE_CLIENT_FAULTS.
  std::string faults;
  // Defaults, overridden by the KVBRIDGE_* variables named above and EngineOptions::FromEnv().
  static StoreOptions FromEnv();
};

// One complete replica of an object (StoreClient::BatchGetReplicaInfo).
struct ReplicaInfo {
  PeerId node;              // the storage node holding it
  bool on_ssd = false;      // in that node's SSD tier (else in its DRAM pool)
  uint64_t segment_id = 0;  // the node's segment, and the replica's offset in it
  uint64_t offset = 0;
  uint64_t bytes = 0;  // the object's size
};

// A copy or move of an object between storage nodes (StoreClient::CopyObject, MoveObject), as
// StoreClient::QueryTask finds it (docs/store.md "Copying and moving objects").
struct PlacementTask {
  std::string key;
  bool move = false;
  std::string state;    // "PROCESSING", "SUCCESS" or "FAILED"
  std::string message;  // why it failed
  std::string source;   // the node copying (node id)
  uint64_t created_unix_ms = 0;
  uint64_t updated_unix_ms = 0;
};

// The calls a StoreClient counts (StoreClientStats::ops): BatchGetInto (and Get), BatchPutFrom
// (and Put, BatchUpsertFrom, Upsert), BatchRemove, BatchExists.
enum class StoreOp : uint8_t { kGet = 0, kPut = 1, kRemove = 2, kExists = 3 };
inline constexpr size_t kStoreOpCount = 4;

// "get", "put", "remove", "exists".
KVBRIDGE_API const char* StoreOpName(StoreOp op);

// What one kind of call did (StoreClientStats::ops).
struct StoreOpStats {
  // Upper bounds, in seconds, of the latency buckets (the Prometheus defaults widened down to
  // 100 us, where a batch of DRAM gets ends); a call slower than the last bound falls in the
  // last bucket (+Inf).
  static constexpr std::array<double, 16> kLatencyBounds = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
  static constexpr size_t kLatencyBuckets = kLatencyBounds.size() + 1;

  uint64_t calls = 0;       // calls returned (a batch is one call; Put and Get are batches of one)
  uint64_t keys = 0;        // keys those calls carried
  uint64_t latency_ns = 0;  // their wall time, summed
  // latency_buckets[b]: calls that took at most kLatencyBounds[b] (and more than the bound
  // before it); the last: calls slower than every bound. Not cumulative.
  std::array<uint64_t, kLatencyBuckets> latency_buckets{};
  // Keys that failed, by status code, codes with a count only, in code order. A get's
  // NOT_FOUND is a miss (StoreClientStats::get_misses), not an error; a remove's NOT_FOUND (no
  // such key) is counted here. A call that failed as a whole (the master unreachable) fails
  // each of its keys.
  std::vector<std::pair<StatusCode, uint64_t>> errors;
};

// A StoreClient's counters since Create() or its last ResetStats() (StoreClient::stats()).
struct StoreClientStats {
  std::array<StoreOpStats, kStoreOpCount> ops;  // by StoreOp
  // Keys a get read and verified, by the tier of the replica that served them (a hedged
  // read's replica is of the same tier as the one it stands in for).
  uint64_t get_hits_dram = 0;
  uint64_t get_hits_ssd = 0;
  uint64_t get_misses = 0;  // keys a get found absent (NOT_FOUND)
  uint64_t bytes_read = 0;  // object bytes the hits returned
  // Keys a put wrote, and their object bytes: once per key, whatever replica_num (the bytes
  // sent are bytes_written x replicas).
  uint64_t puts_stored = 0;
  uint64_t bytes_written = 0;
  uint64_t puts_existing = 0;  // keys a put found stored already (success; nothing written)
  uint64_t removes = 0;        // keys removed
  // Keys gets read and verified without the master (StoreOptions::location_cache_entries):
  // also counted in get_hits_dram / get_hits_ssd.
  uint64_t gets_without_master = 0;

  const StoreOpStats& op(StoreOp o) const { return ops[static_cast<size_t>(o)]; }
  uint64_t get_hits() const { return get_hits_dram + get_hits_ssd; }
};

class KVBRIDGE_API StoreClient {
 public:
  static Result<std::unique_ptr<StoreClient>> Create(const StoreOptions& options);
  ~StoreClient();

  // Registers [addr, addr+length) for zero-copy puts and gets. Overlap is ALREADY_EXISTS.
  // kind kCuda: CUDA device memory of device_id (-1: the pointer's device), checked by the
  // engine's registration (UNKNOWN_MEMORY, INVALID_ARGUMENT naming what was found). Its bytes
  // move between the device and the storage nodes through the engine; their CRC-32C is taken
  // from a copy in a pinned bounce buffer, never by the CPU reading device memory
  // (docs/store.md "Device buffers"). Without a CUDA driver: UNAVAILABLE naming it. kDetect:
  // what the memory is (TransferEngine::RegisterMemory). Another kind: INVALID_ARGUMENT.
  Status RegisterBuffer(void* addr, uint64_t length, MemoryKind kind = MemoryKind::kHost,
                        int device_id = -1);
  // NOT_FOUND unless addr is the start of a registered buffer.
  Status UnregisterBuffer(void* addr);

  // Stores each key's buffers (concatenated) as one object. A key that already exists (or is
  // being written by someone else) succeeds without rewriting. Per key: OK, INVALID_ARGUMENT,
  // NO_SPACE, NOT_REGISTERED (memory not registered), IO_ERROR (a copy of its CUDA buffers for
  // the checksum failed: nothing is stored), or the transfer error of its replicas.
  std::vector<Status> BatchPutFrom(std::span<const std::string> keys,
                                   std::span<const std::vector<BufferRef>> buffers);
  // BatchPutFrom that replaces keys that exist (an upsert). A key's new version is written
  // beside the old one, and at the end of its put replaces it for every reader at once; a
  // reader that got the old version keeps reading its bytes until its read lease ends, and
  // only then is the old space freed (docs/store.md "Overwrites"). A failed upsert leaves the
  // old version. While another put of the key is in flight the upsert waits for it (up to
  // rpc_timeout_ms, then UNAVAILABLE): of concurrent upserts of a key the last one to start
  // wins. An absent key is put. Per key as BatchPutFrom, UNAVAILABLE added.
  std::vector<Status> BatchUpsertFrom(std::span<const std::string> keys,
                                      std::span<const std::vector<BufferRef>> buffers);
  // Reads each key's object into its buffers, filled in order. Per key: the object's size, or
  // NOT_FOUND, INVALID_ARGUMENT (buffers smaller than the object), IO_ERROR (a copy of its CUDA
  // buffers for the checksum failed), or the error of the last replica tried. Replicas are
  // tried in order until one returns bytes whose checksum holds.
  std::vector<Result<uint64_t>> BatchGetInto(std::span<const std::string> keys,
                                             std::span<const std::vector<BufferRef>> buffers);
  Result<std::vector<bool>> BatchExists(std::span<const std::string> keys);
  // Per key: the object's size in bytes (the sum of its buffers), or NOT_FOUND /
  // INVALID_ARGUMENT. Reads no bytes (the master answers).
  std::vector<Result<uint64_t>> BatchGetSize(std::span<const std::string> keys);
  // Per key: where its complete replicas are, in the order a get tries them (DRAM before SSD,
  // this client's node first), or NOT_FOUND / INVALID_ARGUMENT. The master answers; no read
  // lease is taken and no access counted, so asking does not keep an object from eviction.
  std::vector<Result<std::vector<ReplicaInfo>>> BatchGetReplicaInfo(
      std::span<const std::string> keys);
  std::vector<Status> BatchRemove(std::span<const std::string> keys);
  // Removes every object. With a cluster token it needs StoreOptions::admin_token
  // (PERMISSION_DENIED without it).
  Status RemoveAll();
  // Removes every object whose key the regular expression matches (ECMAScript syntax, matched
  // anywhere in the key: "^req7/" for a prefix); returns how many. INVALID_ARGUMENT for an
  // empty or malformed pattern, naming it. Destructive like RemoveAll: with a cluster token it
  // needs StoreOptions::admin_token. Objects being put while it runs are not removed.
  Result<uint64_t> RemoveByRegex(std::string_view pattern);
  // Copies the object to the storage nodes named (node ids) that hold no replica of it, or
  // moves it from node `from` to node `to` (docs/store.md "Copying and moving objects"); the
  // copies run as the master's re-replication tasks. The task's id, for QueryTask.
  Result<uint64_t> CopyObject(std::string_view key, const std::vector<std::string>& to);
  Result<uint64_t> MoveObject(std::string_view key, const std::string& from, const std::string& to);
  Result<PlacementTask> QueryTask(uint64_t task_id);

  // Convenience forms over unregistered memory (one staging copy each way, through one
  // client-wide staging area, so concurrent calls take turns; use the batch forms for speed).
  Status Put(std::string_view key, std::string_view value);
  Status Upsert(std::string_view key, std::string_view value);
  Result<std::string> Get(std::string_view key);

  // The client's counters (StoreClientStats). Counting is a few relaxed atomic additions per
  // call; reading takes no lock and stops no call, so with calls in flight two fields of one
  // snapshot can be a call apart.
  StoreClientStats stats() const;
  // Zeroes the counters (to a Prometheus scrape, a counter reset).
  void ResetStats();

  TransferEngine& engine();

  struct KVBRIDGE_HIDDEN Impl;  // not exported

 private:
  explicit StoreClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct KVBRIDGE_API NodeOptions {
  // The master's gRPC address, or "etcd://host:port[,...][/prefix]": the leader elected in
  // that etcd (HaMaster), followed across elections. KVBRIDGE_MASTER.
  std::string master_address = "127.0.0.1:50051";
  // DRAM this node contributes to the pool. KVBRIDGE_NODE_DRAM_BYTES.
  uint64_t dram_bytes = 1ull << 30;
  // Storage plugin holding the DRAM pool. KVBRIDGE_NODE_STORAGE_PLUGIN.
  std::string storage_plugin = "dram";
  // Where the node's control service (kvbridge.rpc.Node) listens; port 0 picks one.
  // KVBRIDGE_NODE_RPC_LISTEN.
  std::string rpc_listen = "127.0.0.1:0";
  // Deadline of one control-plane call, its retries included (docs/store.md "Talking to the
  // master"). KVBRIDGE_RPC_TIMEOUT_MS.
  uint32_t rpc_timeout_ms = 3000;
  // Upper bound of Drain(). KVBRIDGE_DRAIN_TIMEOUT_MS.
  uint32_t drain_timeout_ms = 30000;
  // --- SSD tier (docs/store.md "Tiers") ---
  // Directory of the node's SSD tier; empty = no SSD tier. Objects there survive a node
  // restart (the node re-reports them). KVBRIDGE_NODE_SSD_PATH.
  std::string ssd_path;
  // Capacity of the SSD tier. KVBRIDGE_NODE_SSD_BYTES.
  uint64_t ssd_bytes = 16ull << 30;
  // Storage plugin of the SSD tier. KVBRIDGE_NODE_SSD_PLUGIN.
  std::string ssd_plugin = "ssd";
  // Registered staging memory for reads from SSD (gets, re-replication); bounds the SSD bytes
  // being served at once. KVBRIDGE_NODE_SSD_STAGING_BYTES.
  uint64_t ssd_staging_bytes = 64ull << 20;
  // Where a re-replication task's destination descriptor comes from: "master" (in the task)
  // or "direct" (asked from the destination's Node service). KVBRIDGE_PEER_DISCOVERY.
  std::string peer_discovery = "master";
  // How far a call's proof of the cluster token (engine.cluster_token, docs/security.md) may
  // be from this node's wall clock. KVBRIDGE_RPC_AUTH_SKEW_MS.
  uint32_t rpc_auth_skew_ms = 60000;
  // Fault injection for tests; empty in production. A comma-separated list of name=value:
  //   task_delay_ms  every batch of re-replication tasks waits this long before it runs (a
  //                  node that gets round to its tasks late: it must then run none whose
  //                  deadline from the master has passed).
  // An unknown name or a bad value makes Start fail naming it. KVBRIDGE_NODE_FAULTS.
  std::string faults;
  // --- HTTP endpoint: /metrics, /health (docs/operations.md) ---
  // "HOST:PORT" of the node's HTTP endpoint; empty: none (the default of an in-process node;
  // the `kvbridge node` daemon serves 0.0.0.0:9481 unless told otherwise). An address that
  // cannot be bound makes Start fail naming it, unless metrics_listen_best_effort.
  // KVBRIDGE_METRICS_LISTEN ("off": none).
  std::string metrics_listen;
  // An address that cannot be bound is a warning and the node runs without the endpoint (what
  // the daemons do with their default port: several nodes on one host).
  bool metrics_listen_best_effort = false;
  // The bearer token the endpoint asks for (all but /health); empty: the cluster token
  // (engine.cluster_token), if any. KVBRIDGE_METRICS_TOKEN.
  std::string metrics_token;
  EngineOptions engine;
  static NodeOptions FromEnv();
};

// Counters of one storage node since it started (StorageNode::stats()).
struct StorageNodeStats {
  uint64_t ssd_read_requests = 0;  // ReadSsd calls answered (one per client get and node)
  uint64_t ssd_read_objects = 0;   // objects those calls asked for
  uint64_t ssd_read_batches = 0;   // transfer batches they wrote the objects with
  // The most memory held at once beyond the staging area (ssd_staging_bytes), for SSD objects
  // larger than it: a batch of re-replication tasks stages one such object at a time.
  uint64_t temp_staging_bytes_peak = 0;
  uint64_t frees_received = 0;  // frees of replicas the master sent (each counted once)
  // Frees remembered now (for up to 10 s): those that found no record of their replica where
  // a put of this process was about to commit (docs/store.md, "Commits to a node in the
  // caller's own process").
  uint64_t frees_remembered = 0;
};

// A storage node: a transfer engine whose registered DRAM pool holds replicas, registered with
// the master, heartbeating on its own thread and gRPC channel (never behind data-plane work),
// executing the master's re-replication tasks.
class KVBRIDGE_API StorageNode {
 public:
  static Result<std::unique_ptr<StorageNode>> Start(const NodeOptions& options);
  // Stops at once, without draining (what a crash looks like to the cluster, minus the TTL:
  // the node deregisters if the master is reachable).
  ~StorageNode();
  const PeerId& id() const;
  // Graceful leave: the master stops placing data here and re-replicates every object this
  // node holds elsewhere; then the node deregisters. Blocks at most drain_timeout_ms;
  // DEADLINE_EXCEEDED if the master did not confirm in time (the node deregisters anyway).
  Status Drain();
  // Objects this node currently holds (its inventory).
  size_t object_count() const;
  // OK when the SSD tier runs; NOT_FOUND when none is configured; else why it could not start
  // (the node then serves its DRAM pool only).
  Status ssd_status() const;
  StorageNodeStats stats() const;
  // The HTTP endpoint's "host:port" (port bound); empty when it has none.
  const std::string& metrics_address() const;

  struct KVBRIDGE_HIDDEN Impl;  // not exported

 private:
  explicit StorageNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct KVBRIDGE_API MasterOptions {
  // Where the master's gRPC service listens; port 0 picks one. KVBRIDGE_MASTER_LISTEN.
  std::string listen = "127.0.0.1:50051";
  // A node silent this long is dead. KVBRIDGE_NODE_TTL_MS.
  uint32_t node_ttl_ms = 3000;
  // Read lease granted by GetReplicas. KVBRIDGE_LEASE_MS.
  uint32_t lease_ms = 5000;
  // A put not ended within this is revoked. KVBRIDGE_PUT_TIMEOUT_MS.
  uint32_t put_timeout_ms = 10000;
  // A soft pin's TTL when the put names none (docs/store.md "Eviction"): 30 minutes, as
  // Mooncake's default. KVBRIDGE_SOFT_PIN_TTL_MS.
  uint32_t soft_pin_ttl_ms = 30 * 60 * 1000;
  // Replicas that must succeed for a put to count. KVBRIDGE_MIN_REPLICAS.
  uint32_t min_replicas = 1;
  // Eviction starts above high and stops below low (fractions of a segment).
  // KVBRIDGE_HIGH_WATERMARK, KVBRIDGE_LOW_WATERMARK.
  double high_watermark = 0.9;
  double low_watermark = 0.8;
  // DRAM of a node with an SSD tier is demoted to SSD above demote_high_watermark, down to
  // demote_low_watermark. KVBRIDGE_DEMOTE_HIGH_WATERMARK, KVBRIDGE_DEMOTE_LOW_WATERMARK.
  double demote_high_watermark = 0.75;
  double demote_low_watermark = 0.6;
  // An SSD replica read this many times goes back to DRAM (if that stays under the demote low
  // watermark); 0 = never. KVBRIDGE_PROMOTE_AFTER_READS.
  uint32_t promote_after_reads = 2;
  // A draining node is let go after this even if not everything moved.
  // KVBRIDGE_DRAIN_TIMEOUT_MS.
  uint32_t drain_timeout_ms = 30000;
  // Deadline of the master's calls to nodes (inventory commits). KVBRIDGE_RPC_TIMEOUT_MS.
  uint32_t rpc_timeout_ms = 3000;
  // A re-replication task or a DRAM<->SSD move not reported done within this is given up and
  // its target range freed (a move's node drops a copy reported late). KVBRIDGE_TASK_TIMEOUT_MS.
  uint32_t task_timeout_ms = 10000;
  // A node that left (expired, restarted, drained) is remembered this long: when its node id
  // registers again, its copies of objects removed, evicted or put again meanwhile are freed,
  // and objects that left with it come back. A node back later is taken as after a master
  // restart (every key the master lacks comes back). KVBRIDGE_DEPARTED_NODE_TTL_MS.
  uint64_t departed_node_ttl_ms = 24ull * 3600 * 1000;
  // Caps of what is remembered for nodes that left (any caller can register a made-up id and
  // leave): past either, the oldest notes are dropped first, and their node ids are taken as
  // back after departed_node_ttl_ms. KVBRIDGE_MAX_DEPARTED_NODES, KVBRIDGE_MAX_DEPARTED_COPIES.
  uint64_t max_departed_nodes = 4096;
  uint64_t max_departed_copies = 16ull << 20;  // 24 bytes each: 384 MiB
  // Fault injection for tests; empty in production. A comma-separated list of name=count:
  //   demote_done_lose_request  the next `count` DemoteDone calls are answered UNAVAILABLE
  //                             without being applied (a request lost on the way);
  //   demote_done_lose_reply    the next `count` are applied, then answered UNAVAILABLE (a
  //                             reply lost on the way);
  //   task_done_lose_request, task_done_lose_reply   the same for TaskDone;
  //   heartbeat_lose_reply      the next `count` Heartbeat replies that carry frees are
  //                             answered UNAVAILABLE after the master handed them out;
  //   register_lose_reply       the next `count` RegisterNode calls with an inventory (a
  //                             node coming back) are applied, then answered UNAVAILABLE.
  // An unknown name or a bad count makes Start fail naming it. KVBRIDGE_MASTER_FAULTS.
  std::string faults;
  // The cluster's shared secret (docs/security.md): every call to the master, and from it to
  // the nodes, must prove it; calls without a valid proof are refused UNAUTHENTICATED. Empty:
  // the control plane accepts anyone (logged as a SECURITY warning at start).
  // KVBRIDGE_CLUSTER_TOKEN (what the engines read).
  std::string cluster_token;
  // Needed, besides the cluster token, for the destructive calls: RemoveAll, and Drain or
  // Deregister of a node by anyone but that node itself. With a cluster token and no admin
  // token these calls are refused PERMISSION_DENIED. KVBRIDGE_ADMIN_TOKEN.
  std::string admin_token;
  // How far a call's proof may be from the master's wall clock (either way); it is good
  // once within it. KVBRIDGE_RPC_AUTH_SKEW_MS.
  uint32_t rpc_auth_skew_ms = 60000;
  // High availability (HaMaster, docs/operations.md "High availability"): the etcd cluster in
  // which masters elect a leader, "host:port[,host:port...]" or "etcd://host:port,.../prefix"
  // (the prefix, default "kvbridge", separates kvbridge clusters sharing one etcd). Empty: a
  // single master with no election (MasterServer). KVBRIDGE_MASTER_ETCD.
  std::string etcd;
  // The address clients and nodes are told to call while this master leads; empty: the
  // address it listens on (which must then not be a wildcard). KVBRIDGE_MASTER_ADVERTISE.
  std::string advertise;
  // The leader's etcd lease: a leader that cannot renew it within this stops acting, and a
  // standby takes over about this long after a leader died. etcd grants whole seconds, at
  // least 2. KVBRIDGE_HA_LEASE_MS.
  uint32_t ha_lease_ms = 3000;
  // A new leader knows the objects of a node only once that node has registered with it (with
  // its inventory). Until every node listed in etcd has, or this long, it answers client calls
  // UNAVAILABLE (clients retry reads) rather than report a miss it cannot be sure of.
  // KVBRIDGE_HA_TAKEOVER_WAIT_MS.
  uint32_t ha_takeover_wait_ms = 5000;
  // The master's lean port (docs/store.md "The master's lean port"): PutStart, PutEnd,
  // GetReplicas and Exists over plain TCP frames, on the host of `listen`; clients ask where it
  // is over gRPC and use it instead. 0: any free port; -1: none (clients use gRPC for every
  // call). KVBRIDGE_MASTER_FAST_PORT ("off": -1).
  int32_t fast_port = 0;
  // --- HTTP endpoint: /metrics, /health, the status page (docs/operations.md) ---
  // "HOST:PORT" of the master's HTTP endpoint; empty: none (the default of an in-process
  // master; the `kvbridge master` daemon serves 0.0.0.0:9480 unless told otherwise). An address
  // that cannot be bound makes Start fail naming it, unless metrics_listen_best_effort.
  // KVBRIDGE_METRICS_LISTEN ("off": none).
  std::string metrics_listen;
  // An address that cannot be bound is a warning and the master runs without the endpoint.
  bool metrics_listen_best_effort = false;
  // The bearer token the endpoint asks for (all but /health and the page itself); empty: the
  // cluster token, if any. KVBRIDGE_METRICS_TOKEN.
  std::string metrics_token;
  static MasterOptions FromEnv();
};

// The control plane, as a gRPC server (the `kvbridge master` daemon, or embedded in-process).
class KVBRIDGE_API MasterServer {
 public:
  static Result<std::unique_ptr<MasterServer>> Start(const MasterOptions& options);
  ~MasterServer();
  // "host:port" with the port actually bound.
  const std::string& address() const;
  // The lean port bound (MasterOptions::fast_port), 0 when there is none.
  uint16_t fast_port() const;
  // The HTTP endpoint's "host:port" (port bound); empty when it has none.
  const std::string& metrics_address() const;
  // Whether this master leads its cluster (true from Start). A master that does not answers
  // /health 503 naming `why`, its gRPC health NOT_SERVING, and kvbridge_master_is_leader 0:
  // the hook for a replicated control plane.
  void SetLeader(bool is_leader, const std::string& why = "");

  struct KVBRIDGE_HIDDEN Impl;  // not exported

 private:
  explicit MasterServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A master in a group of masters that elect one leader in etcd (MasterOptions::etcd). Each
// process campaigns; the one elected starts a MasterServer on options.listen and publishes
// options.advertise; the others wait as standbys, watching the leader key, and the first to
// see it gone takes over. A leader stops acting the moment its lease may have run out (on its
// own monotonic clock, so a frozen leader resumed later refuses every call before it learns
// it was replaced), stops its server, and campaigns again. Clients and nodes given
// "etcd://..." as the master address follow the leader (docs/operations.md).
class KVBRIDGE_API HaMaster {
 public:
  // INVALID_ARGUMENT for a bad etcd address, no advertise address with a wildcard listen, or
  // an HA lease under 2 s. Returns at once; the election runs on a thread of its own.
  static Result<std::unique_ptr<HaMaster>> Start(const MasterOptions& options);
  // Steps down (removes its leader key and lease, so a standby takes over at once) and stops.
  ~HaMaster();
  bool is_leader() const;
  // The leader's address as last seen in etcd ("" when none is known).
  std::string leader() const;
  // This process's term while it leads (0 otherwise): increases with each election.
  uint64_t epoch() const;
  // The address its server is bound to while leading ("" otherwise).
  std::string address() const;

  struct KVBRIDGE_HIDDEN Impl;  // not exported

 private:
  explicit HaMaster(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct NodeStatus {
  PeerId id;
  std::string state;            // ACTIVE, DRAINING, DEAD
  uint64_t capacity_bytes = 0;  // DRAM pool
  uint64_t used_bytes = 0;
  uint64_t replicas = 0;
  uint64_t ssd_capacity_bytes = 0;  // SSD tier (0: none)
  uint64_t ssd_used_bytes = 0;
};

struct ClusterStatus {
  std::vector<NodeStatus> nodes;
  uint64_t objects = 0;
  uint64_t pending_puts = 0;
  uint64_t stored_bytes = 0;
  uint64_t evictions_total = 0;
  uint64_t bad_replicas_total = 0;         // replicas dropped because a reader found them bad
  uint64_t unreachable_reports_total = 0;  // reads that could not reach a node (replicas kept)
  uint64_t nodes_expired_total = 0;
  uint64_t under_replicated = 0;  // objects waiting for re-replication
  uint64_t demotions_total = 0;   // replicas moved from DRAM to an SSD tier
  uint64_t ssd_replicas = 0;      // replicas on SSD tiers now
  uint64_t promotions_total = 0;  // replicas moved from SSD back to DRAM after repeated reads
  // Copies held by nodes that left (expired, restarted, drained), remembered for
  // departed_node_ttl_ms so that a node coming back revives only what left with it; the
  // master spends 24 bytes on each.
  uint64_t departed_copies = 0;
};

// Asks a master for its view (what `kvbridge status` prints). `cluster_token`: the
// cluster's, when it has one (KVBRIDGE_CLUSTER_TOKEN; else UNAUTHENTICATED). A master that is
// unreachable (down, restarting) is asked again until timeout_ms has passed.
KVBRIDGE_API Result<ClusterStatus> QueryClusterStatus(const std::string& master_address,
                                                      uint32_t timeout_ms = 3000,
                                                      const std::string& cluster_token = "");

// Master + storage nodes + client in one process, on loopback: the default for one-machine
// use and for tests. Nodes get node ids "<prefix>-node<i>".
struct EmbeddedClusterOptions {
  int nodes = 3;
  uint64_t dram_bytes_per_node = 256ull << 20;
  uint32_t replica_num = 1;
  std::string node_id_prefix = "embedded";
  // "master" or "direct" for the nodes and the client (StoreOptions::peer_discovery).
  std::string peer_discovery = "master";
  // SSD tier: empty = none; else node i keeps its tier in <ssd_dir>/node<i> (made if absent).
  std::string ssd_dir;
  uint64_t ssd_bytes_per_node = 1ull << 30;
  std::string ssd_plugin = "ssd";
  uint64_t ssd_staging_bytes = 64ull << 20;  // NodeOptions::ssd_staging_bytes of each node
  // listen defaults to a free loopback port here; cluster_token is engine.cluster_token.
  MasterOptions master;
  EngineOptions engine;  // template for the nodes' and the client's engines
};

class KVBRIDGE_API EmbeddedCluster {
 public:
  static Result<std::unique_ptr<EmbeddedCluster>> Start(const EmbeddedClusterOptions& options);
  ~EmbeddedCluster();
  const std::string& master_address() const;
  // The cluster's client (owned by the cluster).
  StoreClient& client();
  // The nodes, to drain or stop one (destroying a node is a stop).
  std::vector<std::unique_ptr<StorageNode>>& nodes();

  struct KVBRIDGE_HIDDEN Impl;  // not exported

 private:
  explicit EmbeddedCluster(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
