// MasterState: the master's state machine — membership, placement, the object table, read
// leases, eviction, re-replication and drain — with no network, no threads and no clock of its
// own. Every method takes `now_ns` (util::MonoNs() in production, anything in tests) and does
// no I/O; the gRPC service (MasterServer) is a thin shell around it. Callers read the clock just
// before each call; small reorderings of now_ns between threads are tolerated. Who is in the
// cluster (joins, leases, leaving, the directory) is kept by a Membership (store/membership.h)
// inside it, whose events the object table follows.
//
// Where the master must talk to nodes before it may answer (committing inventory records after
// a put or a re-replication), the operation is split in two: Begin... returns a plan naming the
// records to send to each node; the caller sends them without holding any lock, marks each
// NodeCommit ok or not, and calls Finish... with the plan. Everything that may change in between
// (a revoke, a put timeout, a node death, a newer version) is checked again in Finish.
//
// Commands to nodes (inventory records to drop, replication tasks) are queued per node and
// handed out in Heartbeat replies. Frees are delivered until acknowledged: each has a sequence
// number, increasing across the master's life and (from first_free_seq) across restarts; a
// reply carries the unacknowledged ones (at most max_frees_per_reply) and the node names the
// highest it applied in its next heartbeat, so a lost reply (heartbeat or registration) only
// delays them. Tasks and demotions are at most once: a lost reply loses them (they time out
// after task_timeout_ms and are rescheduled).
//
// Thread-safety: every method may be called concurrently; one internal mutex, never held
// across anything but in-memory work.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::store {

enum class Tier : uint8_t { kDram = 1, kSsd = 2 };
enum class NodeState : uint8_t { kActive, kDraining, kDead };
enum class ObjectState : uint8_t {
  kPending,     // allocated by PutStart, being written by the client
  kCommitting,  // between BeginPutEnd and FinishPutEnd
  kComplete,    // readable
};
enum class ReplicaState : uint8_t {
  kWriting,     // a put's replica, being written by the client
  kCopying,     // a replication task's destination, being written by the source node
  kCommitting,  // written; its inventory record is being committed to its node
  kComplete,    // readable
};
const char* NodeStateName(NodeState s);  // "ACTIVE", "DRAINING", "DEAD"

struct NodeIdentity {
  std::string node_id;
  uint64_t incarnation = 0;
  bool operator==(const NodeIdentity&) const = default;
};
std::string ToString(const NodeIdentity& id);  // "<node_id>#<incarnation hex>"

struct SegmentInfo {
  uint64_t segment_id = 0;  // unique within its node
  uint64_t capacity = 0;    // bytes, > 0
  Tier tier = Tier::kDram;  // puts are placed in DRAM segments only
};

struct NodeRegistration {
  NodeIdentity identity;
  std::string engine_descriptor;  // opaque: the node's transfer-engine descriptor
  std::string control_endpoint;   // opaque: where its kvbridge.rpc.Node service listens
  std::vector<SegmentInfo> segments;
  // The node is leaving (it asked to drain, then the master restarted): it registers DRAINING.
  bool draining = false;
  // This incarnation was registered before (with this master or a predecessor): writes issued
  // then may still reach its memory (see MasterConfig::restart_hold_until_ns).
  bool registered_before = false;
};

struct ReplicaLocation {
  NodeIdentity node;
  uint64_t segment_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;  // the object's bytes (sum of its buffer sizes)
  Tier tier = Tier::kDram;
  bool operator==(const ReplicaLocation&) const = default;
};

// What a node keeps per replica it holds, and what the master sends it to commit or to drop.
// A node drops a record on a free only when its replica_id matches (the range may meanwhile
// hold a newer replica whose commit overtook the free).
struct InventoryRecord {
  std::string key;
  uint64_t version = 0;
  std::vector<uint64_t> sizes;
  uint32_t checksum = 0;  // CRC-32C of the concatenated buffers
  uint64_t segment_id = 0;
  uint64_t offset = 0;
  uint32_t replica_num = 0;  // the object's target replica count; 0 = unknown (taken as 1)
  // Master-assigned, unique per allocation and increasing (also across master restarts): of
  // two overlapping records the higher replica_id is the later allocation, the one whose bytes
  // the range holds. A record without one (0) is malformed.
  uint64_t replica_id = 0;
  bool hard_pin = false;         // PutOptions::pinned
  uint64_t soft_pin_ttl_ms = 0;  // the object's soft pin TTL when committed (0: none)
  bool operator==(const InventoryRecord&) const = default;
};

// Where a leader's writers may still write on one node: per DRAM segment, a bitmap of chunks
// (capacity / 64 each, at least 1 MiB, bit i = [i * chunk_bytes, (i + 1) * chunk_bytes)) that
// hold a range handed out to a put, task or promotion within MasterConfig::inflight_window_ms.
struct InflightMap {
  std::string node_id;
  uint64_t incarnation = 0;
  struct Segment {
    uint64_t segment_id = 0;
    uint64_t chunk_bytes = 0;
    uint64_t chunks = 0;
    bool operator==(const Segment&) const = default;
  };
  std::vector<Segment> segments;
};

struct MasterConfig {
  // --- Membership ---
  // A node silent this long is DEAD. Nodes should heartbeat every node_ttl_ms / 3.
  uint64_t node_ttl_ms = 3000;
  // Ticks further apart than this mean the master itself was not running (a frozen process, a
  // paused VM, a stalled host) and heard nothing meanwhile through no fault of the nodes: each
  // node's TTL starts over at that tick instead of every node being declared dead at once.
  // 0 = off (tests that drive Tick in big steps). The master service sets it from its tick
  // period.
  uint64_t pause_threshold_ms = 0;
  // When the master started, on Tick's clock: the first tick's gap is measured from here, so a
  // master frozen before it ever ticked is caught like any other pause. 0 = no start time (the
  // first tick only sets the reference).
  uint64_t start_ns = 0;
  // A DRAINING node is reported drained after this even if not everything moved.
  uint64_t drain_timeout_ms = 30000;

  // --- Objects ---
  // Read lease granted by GetReplicas; space under a live lease is never freed or reused.
  uint64_t lease_ms = 5000;
  // A put not ended within this is revoked; clients must bound their writes by it. The same
  // bound applies to the commit phase of a put end.
  uint64_t put_timeout_ms = 10000;
  // A soft pin's TTL when the put names none (PutOptions::soft_pin_ttl_ms 0).
  uint64_t soft_pin_ttl_ms = 30 * 60 * 1000;
  // Placements (Place) remembered for QueryPlacement; the oldest finished ones go first.
  size_t max_placements = 10000;
  // Replicas that must be written and committed for a put to complete.
  // REQUIRES: 1 <= min_replicas <= max_replicas.
  uint32_t min_replicas = 1;
  // Largest replica_num a put may ask for.
  uint32_t max_replicas = 8;
  size_t max_key_bytes = 4096;
  size_t max_buffers = 16;                 // per object
  uint64_t max_object_bytes = 1ull << 30;  // sum of an object's buffer sizes
  // Every allocation is rounded up to this. REQUIRES: a power of two.
  uint64_t alignment = 64;

  // --- Eviction ---
  // A segment used above high_watermark of its capacity is evicted down to low_watermark.
  // REQUIRES: 0 < low_watermark <= high_watermark <= 1.
  double high_watermark = 0.9;
  double low_watermark = 0.8;
  // Fraction of a segment that puts may fill; 0 = high_watermark. Above it a put evicts first
  // (down to low_watermark). The rest is headroom for re-replication and drains, which may fill
  // a segment completely (eviction then brings it back under the high watermark).
  double max_put_fill = 0;
  // Objects sampled per eviction choice (approximate LRU).
  uint32_t eviction_sample_size = 16;
  // Most objects one put key may evict to make room for itself.
  // (Bounds the master's time under its lock; 1024 evictions take about a millisecond. After a
  // node loss, repairs may have filled survivors to 100%, and a put must be able to evict down
  // to the high watermark in one go.)
  uint32_t max_evictions_per_put = 1024;

  // --- Re-replication ---
  // A handed-out task not reported done within this fails (and is rescheduled); also the bound
  // of its commit phase. Source nodes must bound their writes by it.
  uint64_t task_timeout_ms = 10000;
  // After a failed task, or when no destination is available, retry the object after this.
  uint64_t repair_backoff_ms = 1000;
  // Replication tasks in flight per source node.
  uint32_t max_tasks_per_node = 256;

  // --- Nodes that left (expired, superseded by a restart, drained) ---
  // What such a node held is remembered this long, so that when the node id registers again
  // its copies of objects removed, evicted or rewritten meanwhile are freed instead of brought
  // back, while objects that left with it (their last copy) come back. After this, its records
  // are taken as a restarted master takes them (every key the table lacks comes back).
  uint64_t departed_ttl_ms = 24ull * 3600 * 1000;
  // Caps of those notes (any caller can register a made-up node id and leave, and each one
  // leaves a note): past either, the oldest notes are dropped first, down to 7/8 of both
  // caps (the sort is paid once per eighth of the cap). A node whose note was
  // dropped is taken as one back after departed_ttl_ms (every key the table lacks comes back),
  // and a node coming back without its note waits before taking new data for as long as the
  // longest wait of any dropped note (never less than its own would have been).
  // docs/store.md "Failure, drain, restart".
  size_t max_departed_nodes = 4096;
  uint64_t max_departed_copies = 16ull << 20;  // 24 bytes each: 384 MiB

  // --- Replica ordering ---
  // Half-life of the per-node read and bad-replica counters used to order replicas.
  uint64_t health_half_life_ms = 10000;

  // The first version handed out; inventories move it up. A master that starts it at the
  // wall clock in microseconds keeps versions increasing across restarts even for puts that no
  // node recorded (a stale put end then cannot match a new put's version).
  uint64_t first_version = 1;
  // The first free sequence number. Like first_version, a master that starts it at the wall
  // clock in microseconds keeps sequence numbers increasing across restarts, so a node's
  // acknowledgement of an earlier master's frees never covers this one's.
  uint64_t first_free_seq = 1;
  // Most frees one heartbeat (or registration) reply carries; the rest follow in the next.
  size_t max_frees_per_reply = 4096;
  // Most replication tasks and demotions/promotions one heartbeat reply carries (the
  // per-node limits max_tasks_per_node and max_demotions_per_node normally bind first). A
  // reply that leaves any of the three lists behind says so (NodeCommands::more), and the
  // node asks again at once: no reply nears the message size limit (docs/store.md).
  size_t max_tasks_per_reply = 1024;
  size_t max_demotions_per_reply = 256;

  // --- SSD tier (nodes that register an SSD segment) ---
  // DRAM of such a node used above demote_high_watermark is demoted (moved to its SSD) in the
  // background, coldest first, down to demote_low_watermark; puts evict (drop) only above
  // max_put_fill, so they normally find room without losing anything. A full SSD evicts its
  // coldest objects to make room for demotions.
  // REQUIRES: 0 < demote_low_watermark <= demote_high_watermark <= 1.
  double demote_high_watermark = 0.75;
  double demote_low_watermark = 0.6;
  // Demotions and promotions handed to one node and not yet reported.
  uint32_t max_demotions_per_node = 64;
  // An SSD replica read this many times (reads served from SSD, counted per object) is moved
  // back to its node's DRAM when that stays under demote_low_watermark; 0 = never promote.
  uint32_t promote_after_reads = 2;

  // --- Late writers (docs/store.md "Late writes") ---
  // A writer (a client's put, a task's source node) stops sending at its deadline, but bytes
  // already sent can still land afterwards (queued in a socket, retransmitted, or waiting for a
  // destination that stopped reading for a moment). A range such a writer may write is reused
  // only this long after the writer's deadline, whether it reported failure, was revoked or is
  // simply late. The master service sets node_ttl_ms + 1000.
  uint64_t late_write_margin_ms = 2000;
  // A node that registers again with registered_before and of whose previous registration this
  // master knows nothing (it registered with a predecessor, before a master restart) may still
  // be written by puts and tasks that master issued, and read under its leases: nothing new is
  // placed in its DRAM before this time. The master service sets its own start time plus
  // max(put_timeout_ms, 2 x task_timeout_ms, lease_ms) + late_write_margin_ms. 0 = no wait.
  // (A node this master dropped itself waits only for what it knew of: see RegisterNode.)
  uint64_t restart_hold_until_ns = 0;

  // --- HA leaders (docs/ha.md "Takeover without a pause for puts") ---
  // Track where writers this master hands ranges to may still write (InflightToPublish): an
  // elected leader publishes that to etcd before handing the ranges out.
  bool track_inflight = false;
  // How long a handed-out range counts as written to: a writer's deadline plus the late-write
  // margin, max(put_timeout_ms, 2 x task_timeout_ms) + late_write_margin_ms (the service).
  uint64_t inflight_window_ms = 0;
  // What the predecessor leader published, by node. With inflight_authoritative (there was a
  // predecessor, and it published before handing out), a node registering again with
  // registered_before keeps new data off only those chunks until restart_hold_until_ns, not
  // off its whole DRAM.
  std::vector<InflightMap> inherited_inflight;
  bool inflight_authoritative = false;

  // Seed of the eviction sampler; 0 = random.
  uint64_t random_seed = 0;

  Status Validate() const;
};

struct RegisterReply {
  std::vector<InventoryRecord> frees;  // inventory records the node must drop
  std::vector<uint64_t> free_seqs;     // their sequence numbers, to acknowledge
  bool more = false;                   // more frees are queued than `frees` carries
  size_t records_accepted = 0;
  uint64_t heartbeat_interval_ms = 0;  // node_ttl_ms / 3
  // Nothing new is placed in the node's DRAM for this long (0: placed at once): it registered
  // again, and writers or readers of its previous registration may still be at its memory.
  uint64_t no_alloc_ms = 0;
};

struct ReplicationTask {
  uint64_t task_id = 0;
  std::string key;
  uint64_t version = 0;
  uint32_t checksum = 0;
  ReplicaLocation source;  // on the node this task is handed to
  ReplicaLocation dest;
  std::string dest_descriptor;        // the destination node's engine descriptor
  std::string dest_control_endpoint;  // its Node service, to ask it directly instead
  uint64_t deadline_ns = 0;           // report TaskDone before this
};

// Move the DRAM replica `source` to the SSD replica `dest` on the same node, then DemoteDone.
struct Demotion {
  InventoryRecord source;
  InventoryRecord dest;
  uint64_t deadline_ns = 0;  // report DemoteDone before this
};

struct NodeCommands {
  std::vector<InventoryRecord> frees;  // records to drop (and their space to forget)
  std::vector<uint64_t> free_seqs;     // one per free, increasing: acknowledge the highest applied
  std::vector<ReplicationTask> tasks;  // copy source -> dest, then TaskDone
  std::vector<Demotion> demotions;     // DRAM -> SSD moves, then DemoteDone
  bool drained = false;                // a DRAINING node may now deregister and exit
  // More is queued than the lists carry (each capped by MasterConfig::max_*_per_reply): ask
  // again at once.
  bool more = false;
};

struct PutItem {
  std::string key;
  std::vector<uint64_t> sizes;  // one per buffer
};

// A put's soft pin (PutOptions::soft_pin): kPreserve keeps that of the version an overwrite
// replaces (a new key gets none), kEnable pins, kDisable does not.
enum class SoftPin : uint8_t { kPreserve = 0, kEnable = 1, kDisable = 2 };

struct PutOptions {
  uint32_t replica_num = 1;
  // Pinned objects are never evicted (Remove still removes them). An overwrite of a pinned
  // object is pinned too.
  bool pinned = false;
  // Soft-pinned objects are evicted only when no other object of the segment can be, until
  // soft_pin_ttl_ms (0: MasterConfig::soft_pin_ttl_ms) after the put, renewed by each read
  // grant. A TTL with an action other than kEnable is INVALID_ARGUMENT.
  SoftPin soft_pin = SoftPin::kPreserve;
  uint64_t soft_pin_ttl_ms = 0;
  // When it names an ACTIVE node with room, one replica goes there (local writes are cheapest).
  std::string client_node_id;
  // Put a new version of a key that exists (an upsert). The new version is written alongside
  // the old one, which readers keep getting until its put end; then it replaces the old one in
  // one step, and the old replicas are freed when the read leases granted on them end. A key
  // that is absent is put as without it.
  bool overwrite = false;
};

struct PutAllocation {
  uint64_t version = 0;
  std::vector<ReplicaLocation> replicas;  // write all; report each in PutEndItem.replica_ok
  uint64_t deadline_ns = 0;               // the put is revoked if not ended by then
};

struct PutEndItem {
  std::string key;
  uint64_t version = 0;
  std::vector<bool> replica_ok;  // one per PutAllocation.replicas, same order
  uint32_t checksum = 0;         // CRC-32C of the concatenated buffers
};

struct KeyVersion {
  std::string key;
  uint64_t version = 0;
};

// Records to commit to one node. The caller sends them (kvbridge.rpc.Node.Commit, addressed to
// exactly this incarnation) and sets `ok` to whether the node acknowledged.
struct NodeCommit {
  NodeIdentity node;
  std::string control_endpoint;
  std::vector<InventoryRecord> records;
  bool ok = false;
};

struct PutEndPlan {
  std::vector<KeyVersion> items;  // one per PutEndItem, in order
  std::vector<Status> early;      // per item; non-OK is already final
  std::vector<NodeCommit> commits;
};

struct TaskCommitPlan {
  uint64_t task_id = 0;
  std::vector<NodeCommit> commits;  // empty: nothing to commit, no FinishTask needed
};

struct ReplicaSet {
  uint64_t version = 0;
  std::vector<uint64_t> sizes;
  uint32_t checksum = 0;
  // COMPLETE replicas: the client's own node first, then ACTIVE before DRAINING, fewer recent
  // bad-replica reports, fewer recent reads handed out.
  std::vector<ReplicaLocation> replicas;
  uint64_t lease_expiry_ns = 0;
};

struct SegmentStats {
  uint64_t segment_id = 0;
  Tier tier = Tier::kDram;
  uint64_t capacity = 0;
  uint64_t used = 0;  // allocated bytes, including held ranges
  size_t replicas = 0;
};

struct NodeStats {
  NodeIdentity identity;
  NodeState state = NodeState::kActive;
  bool drained = false;
  uint64_t capacity = 0;  // DRAM segments
  uint64_t used = 0;
  uint64_t ssd_capacity = 0;  // SSD segments
  uint64_t ssd_used = 0;
  size_t replicas = 0;
  uint64_t last_heartbeat_ns = 0;  // for a DEAD node: when it was declared dead
  std::vector<SegmentStats> segments;
};

struct MasterStats {
  std::vector<NodeStats> nodes;  // registered nodes, then the most recent dead ones
  size_t objects = 0;            // COMPLETE
  size_t pending = 0;            // PENDING or COMMITTING
  uint64_t bytes = 0;            // logical bytes of COMPLETE objects
  uint64_t replica_bytes = 0;    // bytes of all their COMPLETE replicas
  uint64_t held_bytes = 0;       // space of dropped replicas waiting for a lease or a writer
  size_t tasks_in_flight = 0;
  size_t under_replicated = 0;    // objects queued for re-replication
  uint64_t oldest_repair_ns = 0;  // when the one queued longest was queued; 0: none queued
  uint64_t next_version = 0;
  uint64_t directory_version = 0;  // bumped on every membership change
  uint64_t evictions_total = 0;
  uint64_t revokes_total = 0;
  uint64_t nodes_expired_total = 0;
  uint64_t bad_replicas_total = 0;         // replicas dropped on a reader's report
  uint64_t unreachable_reports_total = 0;  // readers that could not reach a node
  uint64_t demotions_total = 0;            // replicas moved from DRAM to SSD
  uint64_t promotions_total = 0;           // replicas moved from SSD back to DRAM
  size_t ssd_replicas = 0;                 // COMPLETE replicas on SSD segments
  size_t demotions_in_flight = 0;
  size_t departed_nodes = 0;            // node ids whose copies are remembered (departed_ttl_ms)
  size_t departed_copies = 0;           // copies remembered for them, 24 bytes each
  uint64_t departed_dropped_total = 0;  // notes dropped early by max_departed_nodes/_copies
};

struct NodeDirectoryEntry {
  NodeIdentity identity;
  NodeState state = NodeState::kActive;
  std::string engine_descriptor;
  std::string control_endpoint;
};

struct NodeDirectory {
  uint64_t directory_version = 0;
  std::vector<NodeDirectoryEntry> nodes;
};

// A copy or move the master was asked for (MasterState::Place), as QueryPlacement sees it.
enum class PlacementState : uint8_t { kProcessing = 0, kSuccess = 1, kFailed = 2 };
struct PlacementStatus {
  std::string key;
  bool move = false;
  PlacementState state = PlacementState::kProcessing;
  std::string message;  // why it failed
  std::string source;   // the node copying (the first task's source), "" before any
  uint64_t created_ns = 0;
  uint64_t updated_ns = 0;
};

struct TickSummary {
  size_t nodes_expired = 0;
  size_t puts_revoked = 0;
  size_t tasks_timed_out = 0;
  size_t tasks_created = 0;
  size_t ranges_released = 0;
  size_t objects_evicted = 0;
  size_t drains_finished = 0;
  size_t demotions_scheduled = 0;
  size_t demotions_timed_out = 0;
  uint64_t paused_ms = 0;  // the master did not tick for this long (pause_threshold_ms); 0 if not
  // With nodes_expired: the longest silence among them and the time since the previous tick,
  // so that an expiry says whether the nodes or the master stopped.
  uint64_t expired_silence_ms = 0;
  uint64_t since_last_tick_ms = 0;
};

// A full copy of the table, for tests, debugging and invariant checks. O(objects).
struct MasterSnapshot {
  struct Replica {
    ReplicaLocation location;
    ReplicaState state = ReplicaState::kComplete;
    uint64_t task_id = 0;  // nonzero for a task's destination
    uint64_t replica_id = 0;
    std::optional<ReplicaLocation> demote_to;  // the SSD range of a pending demotion
  };
  struct Object {
    std::string key;
    uint64_t version = 0;
    ObjectState state = ObjectState::kPending;
    std::vector<uint64_t> sizes;
    uint32_t checksum = 0;
    uint32_t target_replicas = 0;
    bool pinned = false;
    uint64_t lease_expiry_ns = 0;
    std::vector<Replica> replicas;
  };
  struct HeldRange {
    ReplicaLocation location;
    uint64_t release_at_ns = 0;
  };
  struct Segment {
    NodeIdentity node;
    NodeState state = NodeState::kActive;
    uint64_t segment_id = 0;
    uint64_t capacity = 0;
    uint64_t used = 0;
    size_t allocations = 0;
  };
  struct Task {
    uint64_t task_id = 0;
    std::string key;
    uint64_t version = 0;
    NodeIdentity source;
    NodeIdentity dest;
    bool issued = false;
  };
  std::vector<Object> objects;  // sorted by key
  std::vector<HeldRange> held;
  std::vector<Segment> segments;
  std::vector<Task> tasks;
  uint64_t alignment = 0;
};

class MasterState {
 public:
  // INVALID_ARGUMENT naming the field if the config is inconsistent.
  static Result<std::unique_ptr<MasterState>> Create(const MasterConfig& config);
  ~MasterState();
  MasterState(const MasterState&) = delete;
  MasterState& operator=(const MasterState&) = delete;

  const MasterConfig& config() const;

  // --- Membership ---

  // Registers a node with the records it holds (empty for a fresh node; its whole inventory
  // after the master restarted or declared it dead). A node id held by another incarnation is
  // taken over: the old incarnation is dropped as if dead. A record comes back in `frees` when
  // it is malformed, names an unknown segment or runs past it, overlaps a later allocation
  // (higher replica_id), is older than another version of its key (on this node or in the
  // table), or is surplus to its object's replica count. A newer version replaces the table's
  // object. Versions and replica ids handed out later exceed every one seen.
  // An incarnation this master dropped (expired, deregistered) that registers again gets no new
  // DRAM allocation until every lease and writer deadline (plus late_write_margin_ms) of its
  // previous registration has passed; one that says registered_before and that this master
  // never knew, none before restart_hold_until_ns (RegisterReply::no_alloc_ms).
  // INVALID_ARGUMENT (bad registration), ALREADY_EXISTS (this incarnation is registered
  // already: nothing changes, treat as success).
  Result<RegisterReply> RegisterNode(const NodeRegistration& registration,
                                     const std::vector<InventoryRecord>& inventory,
                                     uint64_t now_ns);
  // NOT_FOUND: unknown (register again, with the inventory); STALE_PEER: another incarnation
  // holds that id (stop serving). Otherwise the commands queued for the node. `frees_acked`:
  // the highest free sequence number the node has applied (every lower one too); those are
  // dropped, and the frees still unacknowledged come again.
  Result<NodeCommands> Heartbeat(const NodeIdentity& node, uint64_t frees_acked, uint64_t now_ns);
  // The frees not yet acknowledged by the node (at most max_frees_per_reply), nothing else:
  // for a registration retried after its reply was lost (ALREADY_EXISTS). NOT_FOUND /
  // STALE_PEER as Heartbeat.
  Result<NodeCommands> UnackedFrees(const NodeIdentity& node);
  // Records that a heartbeat from `node` arrived, under a lock of its own that no data-plane
  // operation takes: call it first in the heartbeat handler, so a heartbeat that then waits for
  // the table lock still counts as liveness (Tick reads it). Never fails; unknown nodes and
  // other incarnations are ignored when Tick folds the records in.
  void Touch(const NodeIdentity& node, uint64_t now_ns);
  // Heartbeat records held (for tests): Tick drops those of ids that are not registered nodes.
  size_t liveness_records() const;
  // No new allocations on the node; everything on it is re-replicated elsewhere (with it as the
  // source); Heartbeat says drained when nothing is left or drain_timeout_ms has passed.
  // Idempotent. NOT_FOUND / STALE_PEER as Heartbeat.
  Status StartDrain(const NodeIdentity& node, uint64_t now_ns);
  // Drops the node at once, as a death without the TTL wait. NOT_FOUND / STALE_PEER.
  Status Deregister(const NodeIdentity& node, uint64_t now_ns);
  // Live nodes named (all when empty), for clients resolving ReplicaLocation.node.
  NodeDirectory GetNodeDirectory(const std::vector<std::string>& node_ids) const;

  // --- Objects ---

  // Per item: INVALID_ARGUMENT (what is wrong), ALREADY_EXISTS (the key is complete or being
  // written: the caller writes nothing and treats it as success), NO_SPACE (not enough ACTIVE
  // nodes with room, even after eviction; nothing stays allocated), or the allocation.
  // With options.overwrite, a complete key is not ALREADY_EXISTS: its new version is allocated
  // beside it (PutOptions::overwrite); a key being written (by a put or another overwrite) is
  // UNAVAILABLE, and the caller may try again once that put has ended or timed out.
  std::vector<Result<PutAllocation>> PutStart(const std::vector<PutItem>& items,
                                              const PutOptions& options, uint64_t now_ns);
  // Phase one of put end. Failed replicas are freed at once; a put left with fewer than
  // min_replicas written is revoked (UNAVAILABLE). Per item an early status: INVALID_ARGUMENT,
  // NOT_FOUND (absent, revoked, or another version), ALREADY_EXISTS (already complete),
  // UNAVAILABLE (another put end is in flight, or revoked here); OK = awaiting FinishPutEnd.
  PutEndPlan BeginPutEnd(const std::vector<PutEndItem>& items, uint64_t now_ns);
  // Phase two, after the caller sent plan.commits and set their `ok`. Per item, in order: OK
  // (COMPLETE: at least min_replicas replicas written and committed; the others freed; an
  // overwrite's version replaces the key's old one, whose space is held until its read lease
  // ends), the
  // early status, UNAVAILABLE (too few replicas committed: revoked, key absent), or NOT_FOUND
  // (revoked in between: put timeout, node death or a newer version).
  std::vector<Status> FinishPutEnd(const PutEndPlan& plan, uint64_t now_ns);
  // Revokes PENDING puts: all space freed, key absent (an overwrite's old version stays). Per item
  // OK, INVALID_ARGUMENT, NOT_FOUND (absent or another version), ALREADY_EXISTS (complete: use
  // Remove), UNAVAILABLE (its put end is in flight).
  std::vector<Status> PutRevoke(const std::vector<KeyVersion>& items, uint64_t now_ns);
  // Per key: INVALID_ARGUMENT, NOT_FOUND (absent or not complete), or the replicas under a read
  // lease of lease_ms from now. Counts as an access for eviction (and SSD promotion) unless
  // sizes_only: then no lease is granted and nothing is counted (a size query reads nothing).
  std::vector<Result<ReplicaSet>> GetReplicas(const std::vector<std::string>& keys,
                                              std::string_view client_node_id, uint64_t now_ns,
                                              bool sizes_only = false);
  // True for COMPLETE keys only.
  std::vector<bool> Exists(const std::vector<std::string>& keys) const;
  // Removes a COMPLETE object from the namespace at once; its space is freed when its lease
  // expires. INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE (a put is in progress).
  Status Remove(std::string_view key, uint64_t now_ns);
  // Removes every COMPLETE object; returns how many.
  size_t RemoveAll(uint64_t now_ns);
  // Removes every COMPLETE object whose key `pattern` matches (store/key_pattern.h: ECMAScript,
  // anywhere in the key) as Remove does; returns how many. The keys are listed under the lock
  // and matched outside it, so a long scan never holds up other calls; an object completed
  // after the listing is not removed. INVALID_ARGUMENT: empty or malformed pattern.
  Result<size_t> RemoveByRegex(std::string_view pattern, uint64_t now_ns);
  // A reader could not read (or verify) this replica: it is dropped, and the object is
  // re-replicated if now under its target (removed if it was the last replica). NOT_FOUND if
  // the object, version or replica is not there (already handled).
  // `segment_id` (non-zero) and `offset` name the copy that was bad: a replica that has moved
  // (demotion, promotion) since is not touched (NOT_FOUND).
  Status ReportBadReplica(std::string_view key, uint64_t version, const NodeIdentity& node,
                          uint64_t now_ns, uint64_t segment_id = 0, uint64_t offset = 0);
  // A reader could not reach `node` at all (unreachable, frozen, restarted): the node counts
  // as suspect (placed last, like a node with bad replicas) and keeps every replica. Whether
  // it is gone is for its heartbeats (TTL) and registration to say: one reader's view of the
  // network must not drop data other readers can still reach. NOT_FOUND for an unknown node.
  Status ReportUnreachableNode(const NodeIdentity& node, uint64_t now_ns);

  // --- Placing objects on chosen nodes (docs/store.md "Copying and moving objects") ---

  // Copies a COMPLETE object to each node of `targets` (node ids) that holds no replica of it,
  // or, with `move_from`, to the one node of `targets` and then drops the replica on
  // `move_from`. The copies are re-replication tasks, run and committed as those are; a copy
  // adds replicas beyond the object's replica count, a move keeps the count. Returns the id to
  // query. INVALID_ARGUMENT (no target, a move with more than one, a move to its source, a
  // target twice), NOT_FOUND (no such complete object; a node not registered; a move from a
  // node without a complete replica), UNAVAILABLE (a node not ACTIVE; every source busy),
  // NO_SPACE (a target without room).
  Result<uint64_t> Place(std::string_view key, const std::vector<std::string>& targets,
                         const std::string& move_from, uint64_t now_ns);
  // The state of a placement, advanced to now. NOT_FOUND for an id this master did not hand
  // out (or forgot: it keeps the last max_placements, and a restarted master none).
  Result<PlacementStatus> QueryPlacement(uint64_t id, uint64_t now_ns);

  // --- Re-replication ---

  // The source node reports a task. ok = false: the destination is freed and the object
  // retried later elsewhere; the plan has no commits. ok = true: the plan holds the record to
  // commit to the destination node; then call FinishTask. NOT_FOUND (unknown or cancelled
  // task), STALE_PEER (reported by another incarnation than its source), UNAVAILABLE (already
  // reported).
  Result<TaskCommitPlan> TaskDone(uint64_t task_id, const NodeIdentity& source, bool ok,
                                  uint64_t now_ns);
  // OK: the destination replica is COMPLETE. NOT_FOUND: the task was cancelled in between;
  // UNAVAILABLE: the commit failed (the object is retried later).
  Status FinishTask(const TaskCommitPlan& plan, uint64_t now_ns);

  // --- SSD tier ---

  // The node reports a move (dest_replica_id names it): a demotion (DRAM -> SSD) or a
  // promotion (SSD -> DRAM, scheduled by GetReplicas after promote_after_reads SSD reads).
  // ok: the copy is durable (SSD) or written (DRAM) and on the node's inventory; the replica
  // now lives there and its old range is freed after the read leases (a free record is
  // queued). Not ok: the new range is released, the replica stays where it was, and the
  // node's moves pause for repair_backoff_ms. NOT_FOUND: the move is no longer wanted (the
  // object or replica changed, or it timed out): the node must drop its copy. Idempotent: a
  // node that lost the answer asks again, and a move already applied answers OK again.
  // UNAVAILABLE from a node the master does not know (it restarted): the node asks again after
  // registering. STALE_PEER as Heartbeat.
  Status DemoteDone(const NodeIdentity& node, std::string_view key, uint64_t version,
                    uint64_t dest_replica_id, bool ok, uint64_t now_ns);

  // --- Time ---

  // Expires silent nodes, revokes overdue puts, times out tasks, releases held space whose
  // lease or writer deadline passed, evicts segments above the high watermark, schedules
  // re-replication and finishes drains. Call every few hundred milliseconds.
  TickSummary Tick(uint64_t now_ns);

  // With MasterConfig::track_inflight: the nodes whose published map differs from what is in
  // flight at now_ns (chunks handed out within inflight_window_ms, and chunks kept for a
  // predecessor's writers). The caller publishes them, then reports it with
  // InflightPublished; until then they are returned again. Callers serialize the two.
  // growth_only: nothing unless a chunk was marked that the published maps lack (the cheap
  // check of every PutStart; shrinking is left to the periodic call).
  std::vector<InflightMap> InflightToPublish(uint64_t now_ns, bool growth_only = false) const;
  void InflightPublished(const std::vector<InflightMap>& maps, uint64_t now_ns);

  // --- Inspection ---
  MasterStats Stats() const;
  MasterSnapshot Snapshot() const;
  // Cross-checks every internal index (allocators against replicas and held ranges, replica
  // counts, tasks). INTERNAL naming the first inconsistency. O(objects); for tests.
  Status CheckInvariants() const;

 private:
  struct Impl;
  explicit MasterState(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge::store
