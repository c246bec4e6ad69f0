#include "store/master_state.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <tuple>
#include <unordered_map>

#include "util/range_allocator.h"

namespace kvbridge::store {

namespace {

constexpr uint64_t kNsPerMs = 1000000ull;
constexpr size_t kDeadNodesKept = 32;

uint64_t MsToNs(uint64_t ms) { return ms * kNsPerMs; }
std::string Num(uint64_t v) { return std::to_string(v); }

// Task ids start at a random point so that a node reporting a task of a previous master
// incarnation gets NOT_FOUND, not another task that happens to have its id.
uint64_t RandomTaskIdBase() {
  std::random_device rd;
  return (((uint64_t{rd()} << 32) | rd()) >> 2) + 1;
}

}  // namespace

const char* NodeStateName(NodeState s) {
  switch (s) {
    case NodeState::kActive:
      return "ACTIVE";
    case NodeState::kDraining:
      return "DRAINING";
    case NodeState::kDead:
      return "DEAD";
  }
  return "UNKNOWN";
}

std::string ToString(const NodeIdentity& id) {
  char inc[17];
  snprintf(inc, sizeof(inc), "%016llx", static_cast<unsigned long long>(id.incarnation));
  return id.node_id + "#" + inc;
}

Status MasterConfig::Validate() const {
  auto bad = [](const std::string& what) {
    return Status::InvalidArgument("MasterConfig: " + what);
  };
  if (node_ttl_ms == 0) return bad("node_ttl_ms must be > 0");
  if (lease_ms == 0) return bad("lease_ms must be > 0");
  if (put_timeout_ms == 0) return bad("put_timeout_ms must be > 0");
  if (task_timeout_ms == 0) return bad("task_timeout_ms must be > 0");
  if (max_replicas == 0) return bad("max_replicas must be > 0");
  if (min_replicas == 0 || min_replicas > max_replicas) {
    return bad("min_replicas (" + Num(min_replicas) + ") must be in 1..max_replicas (" +
               Num(max_replicas) + ")");
  }
  if (!(low_watermark > 0 && low_watermark <= high_watermark && high_watermark <= 1)) {
    return bad("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1");
  }
  if (!(max_put_fill >= 0 && max_put_fill <= 1)) {
    return bad("max_put_fill must be 0 (= high_watermark) or a fraction up to 1");
  }
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return bad("alignment must be a power of two");
  }
  if (max_key_bytes == 0) return bad("max_key_bytes must be > 0");
  if (max_buffers == 0) return bad("max_buffers must be > 0");
  if (max_object_bytes == 0 || max_object_bytes > (1ull << 62)) {
    return bad("max_object_bytes must be in 1..2^62");
  }
  if (eviction_sample_size == 0) return bad("eviction_sample_size must be > 0");
  if (!(demote_low_watermark > 0 && demote_low_watermark <= demote_high_watermark &&
        demote_high_watermark <= 1)) {
    return bad("demote watermarks must satisfy 0 < demote_low_watermark <= "
               "demote_high_watermark <= 1");
  }
  if (max_demotions_per_node == 0) return bad("max_demotions_per_node must be > 0");
  if (max_tasks_per_node == 0) return bad("max_tasks_per_node must be > 0");
  if (max_frees_per_reply == 0) return bad("max_frees_per_reply must be > 0");
  if (max_tasks_per_reply == 0) return bad("max_tasks_per_reply must be > 0");
  if (max_demotions_per_reply == 0) return bad("max_demotions_per_reply must be > 0");
  if (health_half_life_ms == 0) return bad("health_half_life_ms must be > 0");
  return Status::OK();
}

struct MasterState::Impl {
  struct Object;

  struct Segment {
    Segment(const SegmentInfo& i, uint64_t alignment) : info(i), alloc(i.capacity, alignment) {}
    SegmentInfo info;
    util::RangeAllocator alloc;
    std::vector<Object*> residents;  // objects with a replica here (at most one each)
  };

  struct Node {
    NodeRegistration reg;
    NodeState state = NodeState::kActive;
    uint64_t last_seen_ns = 0;
    uint64_t drain_deadline_ns = 0;
    bool drained = false;
    std::map<uint64_t, Segment> segments;
    // Frees not yet acknowledged, by sequence number (increasing): resent in every heartbeat
    // reply until the node says it applied them (HeartbeatRequest.frees_acked).
    std::deque<std::pair<uint64_t, InventoryRecord>> frees;
    std::deque<uint64_t> task_queue;  // tasks to hand out (stale ids are skipped)
    size_t replicas = 0;              // replicas of any state on this node
    size_t held = 0;                  // held ranges on this node
    size_t source_tasks = 0;          // tasks with this node as source
    size_t demotions = 0;             // replicas here with a demotion pending
    uint64_t demote_not_before_ns = 0;  // after a failed demotion (disk full, ...)
    // No new DRAM allocation before this: the node registered again, and writers or readers of
    // its previous registration may still be at its memory (RegisterNode).
    uint64_t no_alloc_before_ns = 0;
    std::deque<std::pair<std::string, uint64_t>> demote_queue;  // (key, demote_id) to hand out
    double reads = 0;                 // decaying count of reads handed out (load)
    double bad_reports = 0;           // decaying count of bad-replica reports (health)
    const NodeIdentity& id() const { return reg.identity; }
  };

  struct Replica {
    Node* node = nullptr;
    Segment* segment = nullptr;
    uint64_t offset = 0;
    uint64_t replica_id = 0;
    ReplicaState state = ReplicaState::kWriting;
    uint64_t task_id = 0;         // nonzero: destination of this task
    size_t resident_index = 0;    // position in segment->residents
    bool record_on_node = false;  // a commit was sent: dropping it must tell the node
    // A pending move of this (DRAM) replica to the node's SSD segment: the SSD range is
    // allocated there (not a resident until DemoteDone), demote_id is its replica id.
    Segment* demote_segment = nullptr;
    uint64_t demote_offset = 0;
    uint64_t demote_id = 0;
    bool demote_issued = false;
    uint64_t demote_deadline_ns = 0;
  };

  struct Object {
    std::string key;
    uint64_t version = 0;
    std::vector<uint64_t> sizes;
    uint64_t bytes = 0;
    uint32_t checksum = 0;
    ObjectState state = ObjectState::kPending;
    uint32_t target = 1;
    bool pinned = false;
    std::vector<Replica> replicas;
    std::vector<ReplicaLocation> put_layout;  // as PutStart returned them, until complete
    uint64_t put_deadline_ns = 0;
    uint64_t lease_expiry_ns = 0;
    uint64_t last_access_ns = 0;
    uint32_t ssd_reads = 0;  // reads served from an SSD replica since the last promotion
    uint64_t repair_not_before_ns = 0;
    std::vector<std::string> failed_dests;  // node ids whose copy failed lately
  };

  enum class TaskState { kQueued, kIssued, kCommitting };

  struct Task {
    uint64_t id = 0;
    std::string key;
    uint64_t version = 0;
    Node* source = nullptr;
    uint64_t source_segment = 0;
    uint64_t source_offset = 0;
    Node* dest = nullptr;
    TaskState state = TaskState::kQueued;
    uint64_t deadline_ns = 0;
  };

  // Space of a dropped replica that someone may still read (a lease) or write (a put or task
  // whose writer has not reported): freed at release_at_ns.
  struct Held {
    Node* node = nullptr;
    Segment* segment = nullptr;
    uint64_t offset = 0;
    uint64_t length = 0;
    uint64_t release_at_ns = 0;
    std::optional<InventoryRecord> record;  // sent to the node as a free on release
  };

  explicit Impl(const MasterConfig& c)
      : cfg(c),
        rng(c.random_seed != 0 ? c.random_seed : std::random_device{}()),
        next_version(std::max<uint64_t>(1, c.first_version)),
        next_free_seq(std::max<uint64_t>(1, c.first_free_seq)) {}

  MasterConfig cfg;
  std::mt19937_64 rng;
  mutable std::mutex mu;
  std::map<std::string, Node> nodes;  // by node id: one incarnation each
  std::unordered_map<std::string, std::unique_ptr<Object>> objects;
  std::set<std::string> pending_keys;  // PENDING or COMMITTING objects
  std::set<std::string> repair_keys;   // objects to look at in the repair pass
  std::map<uint64_t, Task> tasks;
  std::vector<Held> held;
  std::deque<NodeStats> dead_nodes;
  // What a node that left held, by node id (see MasterConfig::departed_ttl_ms): for each
  // (key, version) it had a record of, whether the object left with it (true: its last copy,
  // so the node may bring it back) or not (false: it stayed elsewhere, or was being freed).
  // An entry turns false when the key is removed or put again; the whole node's entry is used
  // and dropped when that node id registers again.
  //
  // Kept for up to a day, so it is compact: a sorted array of (64-bit key hash, version, flag),
  // 24 bytes per copy, where a map of key strings cost about 200 (64-character keys). Versions are
  // unique across keys, so a lookup by (hash, version) finds only its own copy. A remove or a new
  // put clears every copy whose key hash matches; were two keys ever to share a hash, the other
  // key's copy would be freed when its node returns, not revived: a cache miss, never stale data.
  struct DepartedCopy {
    uint64_t key_hash = 0;
    uint64_t version = 0;
    bool comes_back = false;
    auto Order() const { return std::tie(key_hash, version); }
  };
  struct Departed {
    uint64_t since_ns = 0;
    // The incarnation that left, and when its memory was free of every writer and reader the
    // master knew of (leases, writer deadlines plus late_write_margin_ms, held ranges): if the
    // same incarnation comes back, nothing new is placed in its DRAM before then.
    uint64_t incarnation = 0;
    uint64_t reuse_after_ns = 0;
    std::vector<DepartedCopy> copies;  // sorted by (key_hash, version), one entry each

    // Entries go in with Note() in any order, the last word on a copy winning; Seal() sorts.
    void Note(uint64_t key_hash, uint64_t version, bool comes_back) {
      copies.push_back({key_hash, version, comes_back});
    }
    void Seal() {
      std::stable_sort(copies.begin(), copies.end(),
                       [](const auto& a, const auto& b) { return a.Order() < b.Order(); });
      size_t kept = 0;  // of each run of equal (hash, version), the last note
      for (const DepartedCopy& c : copies) {
        if (kept > 0 && copies[kept - 1].Order() == c.Order()) {
          copies[kept - 1] = c;
        } else {
          copies[kept++] = c;
        }
      }
      copies.resize(kept);
      copies.shrink_to_fit();
    }
    const DepartedCopy* Find(std::string_view key, uint64_t version) const {
      const DepartedCopy probe{KeyHash(key), version};
      auto it =
          std::lower_bound(copies.begin(), copies.end(), probe,
                           [](const auto& a, const auto& b) { return a.Order() < b.Order(); });
      return it != copies.end() && it->Order() == probe.Order() ? &*it : nullptr;
    }
    void Forget(uint64_t h) {
      auto it = std::lower_bound(copies.begin(), copies.end(), h,
                                 [](const DepartedCopy& a, uint64_t v) { return a.key_hash < v; });
      for (; it != copies.end() && it->key_hash == h; ++it) it->comes_back = false;
    }
    static uint64_t KeyHash(std::string_view key) { return std::hash<std::string_view>{}(key); }
  };
  std::unordered_map<std::string, Departed> departed;
  // Notes dropped before their time by the caps (CapDeparted), and the latest reuse_after_ns
  // among them: a node coming back without its note waits at least that long.
  uint64_t departed_dropped_total = 0;
  uint64_t departed_dropped_reuse_after_ns = 0;
  uint64_t next_version;
  uint64_t next_replica_id = 1;
  uint64_t next_free_seq;
  uint64_t next_task_id = RandomTaskIdBase();
  uint64_t directory_version = 1;
  uint64_t last_decay_ns = 0;
  uint64_t last_tick_ns = 0;
  uint64_t evictions_total = 0;
  uint64_t revokes_total = 0;
  uint64_t nodes_expired_total = 0;
  uint64_t bad_replicas_total = 0;
  uint64_t unreachable_reports_total = 0;
  uint64_t demotions_total = 0;
  uint64_t promotions_total = 0;
  // Heartbeat arrivals recorded without `mu` (Touch), so liveness never waits behind data-plane
  // work holding `mu`; Tick folds them in. node id -> (incarnation, last seen). Lock order:
  // mu, then live_mu.
  std::mutex live_mu;
  std::unordered_map<std::string, std::pair<uint64_t, uint64_t>> live;

  // ---------------------------------------------------------------- small helpers

  uint64_t RoundUp(uint64_t n) const { return (n + cfg.alignment - 1) & ~(cfg.alignment - 1); }

  Status CheckKey(std::string_view key) const {
    if (key.empty()) return Status::InvalidArgument("key is empty");
    if (key.size() > cfg.max_key_bytes) {
      return Status::InvalidArgument("key is " + Num(key.size()) + " bytes; max_key_bytes is " +
                                     Num(cfg.max_key_bytes));
    }
    return Status::OK();
  }

  Status CheckSizes(const std::vector<uint64_t>& sizes, uint64_t* total) const {
    if (sizes.empty()) return Status::InvalidArgument("no buffers");
    if (sizes.size() > cfg.max_buffers) {
      return Status::InvalidArgument(Num(sizes.size()) + " buffers; max_buffers is " +
                                     Num(cfg.max_buffers));
    }
    uint64_t sum = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] == 0) return Status::InvalidArgument("buffer " + Num(i) + " has size 0");
      if (sizes[i] > cfg.max_object_bytes || sum > cfg.max_object_bytes - sizes[i]) {
        return Status::InvalidArgument("value is over max_object_bytes (" +
                                       Num(cfg.max_object_bytes) + ")");
      }
      sum += sizes[i];
    }
    *total = sum;
    return Status::OK();
  }

  // The registered node with exactly this identity, or null with NOT_FOUND / STALE_PEER.
  Node* FindNode(const NodeIdentity& id, Status* st) {
    auto it = nodes.find(id.node_id);
    if (it == nodes.end()) {
      *st = Status::NotFound("node " + id.node_id + " is not registered");
      return nullptr;
    }
    if (it->second.id().incarnation != id.incarnation) {
      *st = Status::StalePeer("node " + id.node_id + " is registered as " +
                              ToString(it->second.id()) + ", not " + ToString(id));
      return nullptr;
    }
    return &it->second;
  }

  Node* FindNodeExact(const NodeIdentity& id) {
    auto it = nodes.find(id.node_id);
    if (it == nodes.end() || it->second.id().incarnation != id.incarnation) return nullptr;
    return &it->second;
  }

  Object* FindObject(std::string_view key) {
    auto it = objects.find(std::string(key));
    return it == objects.end() ? nullptr : it->second.get();
  }

  static int ReplicaOn(const Object& o, const Node* n) {
    for (size_t i = 0; i < o.replicas.size(); ++i) {
      if (o.replicas[i].node == n) return static_cast<int>(i);
    }
    return -1;
  }

  static int ReplicaWithTask(const Object& o, uint64_t task_id) {
    for (size_t i = 0; i < o.replicas.size(); ++i) {
      if (o.replicas[i].task_id == task_id) return static_cast<int>(i);
    }
    return -1;
  }

  static size_t CompleteReplicas(const Object& o) {
    size_t n = 0;
    for (const Replica& r : o.replicas) n += r.state == ReplicaState::kComplete;
    return n;
  }

  ReplicaLocation Location(const Object& o, const Replica& r) const {
    return {r.node->id(), r.segment->info.segment_id, r.offset, o.bytes, r.segment->info.tier};
  }

  InventoryRecord Record(const Object& o, const Replica& r) const {
    return {o.key,    o.version, o.sizes,     o.checksum, r.segment->info.segment_id,
            r.offset, o.target,  r.replica_id};
  }

  // For a record a commit may have left on a node, unless it is (again) a live replica's: a
  // node that re-registered with it after the master dropped it.
  void QueueFreeIfRegistered(const NodeIdentity& id, const InventoryRecord& rec) {
    Node* n = FindNodeExact(id);
    if (!n) return;
    if (const Object* o = FindObject(rec.key); o && o->version == rec.version) {
      for (const Replica& r : o->replicas) {
        if (r.replica_id == rec.replica_id) return;
      }
    }
    QueueFree(n, rec);
  }

  void QueueFree(Node* n, const InventoryRecord& rec) { n->frees.emplace_back(next_free_seq++, rec); }

  // Drops the frees the node applied, then copies up to max_frees_per_reply of the rest.
  // True when some are left behind (the reply says `more`).
  bool TakeFrees(Node* n, uint64_t acked, std::vector<InventoryRecord>* out,
                 std::vector<uint64_t>* seqs) const {
    while (!n->frees.empty() && n->frees.front().first <= acked) n->frees.pop_front();
    for (const auto& [seq, rec] : n->frees) {
      if (out->size() >= cfg.max_frees_per_reply) return true;
      out->push_back(rec);
      seqs->push_back(seq);
    }
    return false;
  }

  void MarkRepair(Object* o, uint64_t not_before_ns) {
    repair_keys.insert(o->key);
    o->repair_not_before_ns = not_before_ns;
  }

  // Fewer COMPLETE replicas on ACTIVE nodes than the target, or any on a DRAINING node.
  bool NeedsRepair(const Object& o) const {
    size_t active = 0;
    for (const Replica& r : o.replicas) {
      if (r.node->state == NodeState::kDraining) return true;
      active += r.state == ReplicaState::kComplete;
    }
    return active < o.target;
  }

  // ---------------------------------------------------------------- replica bookkeeping

  // replica_id 0 = a new allocation: the next id.
  Replica& AddReplica(Object* o, Node* n, Segment* s, uint64_t offset, ReplicaState state,
                      uint64_t replica_id = 0) {
    Replica r;
    r.node = n;
    r.segment = s;
    r.offset = offset;
    r.replica_id = replica_id != 0 ? replica_id : next_replica_id++;
    r.state = state;
    r.resident_index = s->residents.size();
    s->residents.push_back(o);
    n->replicas++;
    o->replicas.push_back(r);
    return o->replicas.back();
  }

  // Forgets the replica without touching its space (the caller frees, holds, or the node is
  // going away with its allocators).
  // Releases the SSD range of a pending demotion (the node's late report then gets NOT_FOUND
  // and deletes its copy).
  // An issued move whose target is DRAM (a promotion) may still be written by its node until
  // its deadline: that range is held until then, never reused earlier. (An SSD target is the
  // plugin's business: the node deletes its copy when DemoteDone answers NOT_FOUND.)
  void CancelDemotion(Replica& r, uint64_t length = 0) {
    if (r.demote_segment == nullptr) return;
    if (r.demote_issued && r.demote_segment->info.tier == Tier::kDram && length > 0) {
      held.push_back({r.node, r.demote_segment, r.demote_offset, length,
                      r.demote_deadline_ns + MsToNs(cfg.task_timeout_ms), std::nullopt});
      r.node->held++;
    } else {
      r.demote_segment->alloc.Free(r.demote_offset);
    }
    r.demote_segment = nullptr;
    r.demote_offset = 0;
    r.demote_id = 0;
    r.demote_issued = false;
    r.demote_deadline_ns = 0;
    r.node->demotions--;
  }

  static Segment* SsdSegment(Node& n) {
    for (auto& [sid, s] : n.segments) {
      if (s.info.tier == Tier::kSsd) return &s;
    }
    return nullptr;
  }

  // Takes the replica out of its segment's residents (its index fixed up in the object moved
  // into its slot); the replica itself stays.
  void Unreside(Object* o, Replica& r) {
    auto& v = r.segment->residents;
    const size_t i = r.resident_index;
    Object* moved = v.back();
    v[i] = moved;
    v.pop_back();
    if (moved != o) {
      for (Replica& mr : moved->replicas) {
        if (mr.segment == r.segment) {
          mr.resident_index = i;
          break;
        }
      }
    }
  }

  void DetachReplica(Object* o, size_t idx) {
    CancelDemotion(o->replicas[idx], o->bytes);
    Replica& r = o->replicas[idx];
    Unreside(o, r);
    r.node->replicas--;
    o->replicas.erase(o->replicas.begin() + static_cast<std::ptrdiff_t>(idx));
  }

  // When the space of this replica may be reused: after the object's lease if readers may be
  // on it; if a writer may still be writing, after the writer's deadline plus
  // late_write_margin_ms, whether it reported failure, was revoked or is late: a writer that
  // gave up (or was given up on) may still have bytes on their way. A replica whose write
  // completed (COMMITTING: the writer's transfer was acknowledged) has no writer left.
  uint64_t HoldUntil(const Object& o, const Replica& r) const {
    const uint64_t margin = MsToNs(cfg.late_write_margin_ms);
    uint64_t h = 0;
    if (r.state == ReplicaState::kComplete) h = o.lease_expiry_ns;
    if (r.state == ReplicaState::kWriting) h = std::max(h, o.put_deadline_ns + margin);
    if (r.state == ReplicaState::kCopying && r.task_id != 0) {
      auto t = tasks.find(r.task_id);
      if (t != tasks.end() && t->second.state == TaskState::kIssued) {
        h = std::max(h, t->second.deadline_ns + margin);
      }
    }
    return h;
  }

  void FreeRange(Node* n, Segment* s, uint64_t offset, const std::optional<InventoryRecord>& rec) {
    s->alloc.Free(offset);
    if (rec) QueueFree(n, *rec);
  }

  // Detaches the replica and frees its space now, or holds it until hold_until_ns.
  void ReleaseReplica(Object* o, size_t idx, uint64_t now_ns, uint64_t hold_until_ns) {
    const Replica r = o->replicas[idx];
    std::optional<InventoryRecord> rec;
    if (r.record_on_node) rec = Record(*o, r);
    DetachReplica(o, idx);
    if (hold_until_ns > now_ns) {
      held.push_back({r.node, r.segment, r.offset, o->bytes, hold_until_ns, std::move(rec)});
      r.node->held++;
    } else {
      FreeRange(r.node, r.segment, r.offset, rec);
    }
  }

  void EraseTask(std::map<uint64_t, Task>::iterator it) {
    it->second.source->source_tasks--;
    tasks.erase(it);
  }

  // Drops a replica (cancelling its task, if it is a task's destination).
  void DropReplica(Object* o, size_t idx, uint64_t now_ns) {
    const uint64_t hold = HoldUntil(*o, o->replicas[idx]);
    if (uint64_t tid = o->replicas[idx].task_id; tid != 0) {
      auto t = tasks.find(tid);
      if (t != tasks.end()) EraseTask(t);
    }
    ReleaseReplica(o, idx, now_ns, hold);
  }

  void EraseObject(Object* o, uint64_t now_ns) {
    while (!o->replicas.empty()) DropReplica(o, o->replicas.size() - 1, now_ns);
    const std::string key = o->key;
    pending_keys.erase(key);
    repair_keys.erase(key);
    objects.erase(key);
  }

  // ---------------------------------------------------------------- placement and eviction

  // Bytes puts may fill a segment to (max_put_fill, by default the high watermark); the rest is
  // headroom that re-replication and drains may use, so repairs still find room in a full
  // cluster. Eviction brings a segment down to the low watermark.
  uint64_t HighLimit(const Segment& s) const {
    const double fill = cfg.max_put_fill > 0 ? cfg.max_put_fill : cfg.high_watermark;
    return static_cast<uint64_t>(fill * static_cast<double>(s.info.capacity));
  }
  uint64_t LowLimit(const Segment& s) const {
    return static_cast<uint64_t>(cfg.low_watermark * static_cast<double>(s.info.capacity));
  }

  // The DRAM segment of n with the most free bytes among those with a free range for `bytes`;
  // for a put (not a repair) the segment must also stay within HighLimit.
  Segment* FitSegment(Node& n, uint64_t bytes, bool repair) {
    const uint64_t need = RoundUp(bytes);
    Segment* best = nullptr;
    for (auto& [sid, s] : n.segments) {
      if (s.info.tier != Tier::kDram || s.alloc.largest_free() < need) continue;
      if (!repair && s.alloc.used_bytes() + need > HighLimit(s)) continue;
      if (!best || s.alloc.free_bytes() > best->alloc.free_bytes()) best = &s;
    }
    return best;
  }

  struct Choice {
    Node* node;
    Segment* segment;
  };

  // ACTIVE and not in its no-allocation window (a node back from expiry or a master restart
  // whose memory may still be written by writers of its previous registration).
  static bool Placeable(const Node& n, uint64_t now_ns) {
    return n.state == NodeState::kActive && now_ns >= n.no_alloc_before_ns;
  }

  // Up to `count` placeable nodes that can hold `bytes`, most free space first; `holder`
  // excludes nodes already holding a replica of it, `avoid` node ids to skip.
  std::vector<Choice> ChooseNodes(uint64_t now_ns, uint64_t bytes, size_t count,
                                  const Object* holder, const std::vector<std::string>* avoid,
                                  std::string_view preferred, bool repair = false) {
    struct Cand {
      Choice c;
      bool preferred;
      bool suspect;  // readers recently reported bad replicas there (dying, not yet expired)
      uint64_t free;
    };
    std::vector<Cand> cands;
    for (auto& [id, n] : nodes) {
      if (!Placeable(n, now_ns)) continue;
      if (holder && ReplicaOn(*holder, &n) >= 0) continue;
      if (avoid && std::find(avoid->begin(), avoid->end(), id) != avoid->end()) continue;
      Segment* s = FitSegment(n, bytes, repair);
      if (!s) continue;
      // bad_reports decays with health_half_life_ms: >= 0.5 means a report within about one
      // half-life.
      cands.push_back({{&n, s},
                       !preferred.empty() && id == preferred,
                       n.bad_reports >= 0.5,
                       s->alloc.free_bytes()});
    }
    std::sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) {
      if (a.suspect != b.suspect) return b.suspect;
      if (a.preferred != b.preferred) return a.preferred;
      if (a.free != b.free) return a.free > b.free;
      return a.c.node->id().node_id < b.c.node->id().node_id;
    });
    std::vector<Choice> out;
    for (size_t i = 0; i < cands.size() && i < count; ++i) out.push_back(cands[i].c);
    return out;
  }

  bool Evictable(const Object& o, uint64_t now_ns) const {
    if (o.state != ObjectState::kComplete || o.pinned || o.lease_expiry_ns > now_ns) return false;
    for (const Replica& r : o.replicas) {
      if (r.state != ReplicaState::kComplete) return false;  // a copy is in flight
    }
    return true;
  }

  // The least recently used evictable object among a sample of the segment's residents (all of
  // them when the sample finds none), or null.
  Object* PickVictim(Segment& s, uint64_t now_ns) {
    const auto& v = s.residents;
    Object* best = nullptr;
    auto consider = [&](Object* o) {
      if (Evictable(*o, now_ns) && (!best || o->last_access_ns < best->last_access_ns)) best = o;
    };
    if (v.size() > cfg.eviction_sample_size) {
      std::uniform_int_distribution<size_t> pick(0, v.size() - 1);
      for (uint32_t i = 0; i < cfg.eviction_sample_size; ++i) consider(v[pick(rng)]);
    }
    if (!best) {
      for (Object* o : v) consider(o);
    }
    return best;
  }

  template <typename Done>
  size_t EvictUntil(Segment& s, Done done, size_t budget, uint64_t now_ns) {
    size_t n = 0;
    while (n < budget && !done()) {
      Object* victim = PickVictim(s, now_ns);
      if (!victim) break;
      EraseObject(victim, now_ns);
      ++n;
      ++evictions_total;
    }
    return n;
  }

  // Evicts on ACTIVE nodes that cannot hold `bytes` until `count` nodes can (or the budget of
  // evictions is spent).
  void MakeRoom(uint64_t bytes, size_t count, std::string_view preferred, uint64_t now_ns) {
    const size_t have = ChooseNodes(now_ns, bytes, count, nullptr, nullptr, preferred).size();
    if (have >= count) return;
    size_t need = count - have;
    const uint64_t rb = RoundUp(bytes);
    std::vector<Segment*> cands;
    for (auto& [id, n] : nodes) {
      if (!Placeable(n, now_ns) || FitSegment(n, bytes, false)) continue;
      Segment* best = nullptr;
      for (auto& [sid, s] : n.segments) {
        if (s.info.tier != Tier::kDram || HighLimit(s) < rb) continue;
        if (!best || s.alloc.free_bytes() > best->alloc.free_bytes()) best = &s;
      }
      if (best) cands.push_back(best);
    }
    std::stable_sort(cands.begin(), cands.end(), [](const Segment* a, const Segment* b) {
      return a->alloc.free_bytes() > b->alloc.free_bytes();
    });
    // Evict down to the low watermark (not just enough for this object), so the next puts find
    // room without evicting one object each.
    size_t budget = cfg.max_evictions_per_put;
    for (Segment* s : cands) {
      if (need == 0 || budget == 0) break;
      budget -= EvictUntil(
          *s,
          [&] {
            return s->alloc.largest_free() >= rb && s->alloc.used_bytes() + rb <= LowLimit(*s);
          },
          budget, now_ns);
      if (s->alloc.largest_free() >= rb && s->alloc.used_bytes() + rb <= HighLimit(*s)) --need;
    }
  }

  // ---------------------------------------------------------------- node lifecycle

  // When nothing the master handed out may still read or write the node's memory: leases of
  // the objects on it, writers' deadlines (plus late_write_margin_ms) of ranges being written,
  // held ranges, promotions into its DRAM.
  uint64_t ReuseHorizon(const Node* n) const {
    uint64_t h = 0;
    for (const auto& [sid, s] : n->segments) {
      for (const Object* o : s.residents) {
        const Replica& r = o->replicas[ReplicaOn(*o, n)];
        h = std::max(h, HoldUntil(*o, r));
        if (r.demote_segment && r.demote_issued && r.demote_segment->info.tier == Tier::kDram) {
          h = std::max(h, r.demote_deadline_ns + MsToNs(cfg.task_timeout_ms));
        }
      }
    }
    for (const Held& held_range : held) {
      if (held_range.node == n) h = std::max(h, held_range.release_at_ns);
    }
    return h;
  }

  // Drops a node: its tasks, held ranges and replicas; objects left without a COMPLETE
  // replica are removed, the others queued for re-replication.
  void DropNode(Node* n, uint64_t now_ns, bool expired) {
    const uint64_t reuse_after_ns = ReuseHorizon(n);
    for (auto it = tasks.begin(); it != tasks.end();) {
      Task& t = it->second;
      if (t.dest != n && t.source != n) {
        ++it;
        continue;
      }
      Object* o = FindObject(t.key);
      const int idx = ReplicaWithTask(*o, t.id);
      if (t.dest == n) {
        o->replicas[idx].task_id = 0;  // detached below with the node's other replicas
        t.source->source_tasks--;
        it = tasks.erase(it);
      } else {
        // A source declared dead may only be cut off: it may write until the task deadline
        // (and its bytes land up to late_write_margin_ms later).
        const uint64_t hold =
            t.state == TaskState::kIssued ? t.deadline_ns + MsToNs(cfg.late_write_margin_ms) : 0;
        it = tasks.erase(it);
        ReleaseReplica(o, idx, now_ns, hold);
        MarkRepair(o, now_ns);
      }
    }
    // Every record the node may still hold, for when it comes back (departed).
    Departed& gone = departed[n->id().node_id];
    gone = Departed{};
    gone.since_ns = now_ns;
    gone.incarnation = n->id().incarnation;
    gone.reuse_after_ns = reuse_after_ns;
    for (const auto& [seq, rec] : n->frees) gone.Note(Departed::KeyHash(rec.key), rec.version, false);
    std::vector<Object*> affected;
    for (auto& [sid, s] : n->segments)
      affected.insert(affected.end(), s.residents.begin(), s.residents.end());
    for (Object* o : affected) {
      const size_t idx = ReplicaOn(*o, n);
      const bool recorded = o->replicas[idx].record_on_node;
      const uint64_t version = o->version;
      const uint64_t key_hash = Departed::KeyHash(o->key);
      DetachReplica(o, idx);
      bool left_with_it = false;
      if (o->state == ObjectState::kComplete) {
        if (CompleteReplicas(*o) == 0) {
          EraseObject(o, now_ns);
          left_with_it = true;
        } else {
          MarkRepair(o, now_ns);
        }
      } else if (o->replicas.empty()) {
        EraseObject(o, now_ns);  // a put that lost every replica
        ++revokes_total;
      }
      if (recorded) gone.Note(key_hash, version, left_with_it);
    }

    // Last: detaching above may have held ranges of this node (cancelled promotions).
    for (const Held& h : held) {
      if (h.node == n && h.record) {
        gone.Note(Departed::KeyHash(h.record->key), h.record->version, false);
      }
    }
    gone.Seal();
    CapDeparted();
    std::erase_if(held, [n](const Held& h) { return h.node == n; });
    if (expired) {
      NodeStats dead;
      dead.identity = n->id();
      dead.state = NodeState::kDead;
      dead.last_heartbeat_ns = now_ns;
      for (auto& [sid, s] : n->segments) dead.capacity += s.info.capacity;
      dead_nodes.push_front(std::move(dead));
      if (dead_nodes.size() > kDeadNodesKept) dead_nodes.pop_back();
      ++nodes_expired_total;
    }
    nodes.erase(n->id().node_id);
    ++directory_version;
  }

  bool DrainDone(const Node& n, uint64_t now_ns) const {
    return n.state == NodeState::kDraining &&
           (n.drained || (n.replicas == 0 && n.held == 0) || now_ns >= n.drain_deadline_ns);
  }

  // Past cfg.max_departed_nodes notes or cfg.max_departed_copies copies, drops the oldest notes
  // (the newest too, if it alone holds more than the copy cap) down to 7/8 of both caps, so that
  // a stream of nodes leaving pays the sort once per eighth of the cap, not on every one.
  void CapDeparted() {
    uint64_t copies = 0;
    for (const auto& [id, d] : departed) copies += d.copies.size();
    if (departed.size() <= cfg.max_departed_nodes && copies <= cfg.max_departed_copies) return;
    const size_t keep_nodes = cfg.max_departed_nodes - cfg.max_departed_nodes / 8;
    const uint64_t keep_copies = cfg.max_departed_copies - cfg.max_departed_copies / 8;
    std::vector<std::pair<uint64_t, const std::string*>> by_age;  // (since_ns, node id)
    by_age.reserve(departed.size());
    for (const auto& [id, d] : departed) by_age.emplace_back(d.since_ns, &id);
    std::sort(by_age.begin(), by_age.end(), [](const auto& a, const auto& b) {
      return std::tie(a.first, *a.second) < std::tie(b.first, *b.second);
    });
    std::vector<std::string> victims;
    size_t left = departed.size();
    for (const auto& [since, id] : by_age) {
      if (left <= keep_nodes && copies <= keep_copies) break;
      const Departed& d = departed.at(*id);
      copies -= d.copies.size();
      departed_dropped_reuse_after_ns =
          std::max(departed_dropped_reuse_after_ns, d.reuse_after_ns);
      victims.push_back(*id);
      --left;
    }
    for (const std::string& id : victims) departed.erase(id);
    departed_dropped_total += victims.size();
  }

  // A new put or a remove of `key`: no copy of an older version a departed node holds may come
  // back with it.
  void ForgetDepartedCopies(std::string_view key) {
    const uint64_t h = Departed::KeyHash(key);
    for (auto& [id, d] : departed) d.Forget(h);
  }

  // Rebuilds objects from a registering node's records; see RegisterNode.
  void LoadInventory(Node& n, const std::vector<InventoryRecord>& inventory, uint64_t now_ns,
                     RegisterReply& reply) {
    // 1. Well-formed records only; every version and replica id seen moves the counters.
    std::vector<size_t> cand;
    std::vector<uint64_t> bytes(inventory.size(), 0);
    for (size_t i = 0; i < inventory.size(); ++i) {
      const InventoryRecord& rec = inventory[i];
      if (!CheckKey(rec.key).ok() || !CheckSizes(rec.sizes, &bytes[i]).ok() || rec.version == 0 ||
          rec.replica_id == 0 || !n.segments.count(rec.segment_id)) {
        reply.frees.push_back(rec);
        continue;
      }
      next_version = std::max(next_version, rec.version + 1);
      next_replica_id = std::max(next_replica_id, rec.replica_id + 1);
      cand.push_back(i);
    }
    auto newer_version = [&](size_t a, size_t b) {
      return std::tie(inventory[a].version, inventory[a].replica_id) >
             std::tie(inventory[b].version, inventory[b].replica_id);
    };
    // 2. One record per key on this node: its newest version.
    std::stable_sort(cand.begin(), cand.end(), newer_version);
    std::set<std::string_view> seen;
    std::vector<size_t> keep;
    for (size_t i : cand) {
      if (seen.insert(inventory[i].key).second) {
        keep.push_back(i);
      } else {
        reply.frees.push_back(inventory[i]);
      }
    }
    // 3. Overlapping ranges: the later allocation holds the bytes.
    std::stable_sort(keep.begin(), keep.end(), [&](size_t a, size_t b) {
      return inventory[a].replica_id > inventory[b].replica_id;
    });
    std::vector<size_t> placed;
    for (size_t i : keep) {
      const InventoryRecord& rec = inventory[i];
      if (n.segments.at(rec.segment_id).alloc.Reserve(rec.offset, bytes[i])) {
        placed.push_back(i);
      } else {
        reply.frees.push_back(rec);
      }
    }
    // 4. Against the table, newest versions first. A node id that left before (departed):
    // a copy of an object that stayed on other nodes and is gone now (removed, evicted, put
    // again) is freed; one of an object that left with it comes back.
    const auto dep = departed.find(n.id().node_id);
    std::stable_sort(placed.begin(), placed.end(), newer_version);
    for (size_t i : placed) {
      const InventoryRecord& rec = inventory[i];
      Segment* seg = &n.segments.at(rec.segment_id);
      const uint32_t target = std::clamp<uint32_t>(rec.replica_num, 1, cfg.max_replicas);
      Object* o = FindObject(rec.key);
      bool accept;
      if (!o) {
        accept = true;
        if (dep != departed.end()) {
          if (const DepartedCopy* c = dep->second.Find(rec.key, rec.version)) {
            accept = c->comes_back;
          }
        }
      } else if (o->version > rec.version) {
        accept = false;
      } else if (o->version == rec.version) {
        size_t active = 0;
        for (const Replica& r : o->replicas) active += r.node->state == NodeState::kActive;
        // A draining node's copy is kept until the drain has moved it.
        accept = o->state == ObjectState::kComplete && o->sizes == rec.sizes &&
                 o->checksum == rec.checksum && ReplicaOn(*o, &n) < 0 &&
                 (n.state == NodeState::kDraining || active < std::max(o->target, target));
      } else {
        EraseObject(o, now_ns);  // this record's version wins
        o = nullptr;
        accept = true;
      }
      if (!accept) {
        seg->alloc.Free(rec.offset);
        reply.frees.push_back(rec);
        continue;
      }
      if (!o) {
        auto obj = std::make_unique<Object>();
        obj->key = rec.key;
        obj->version = rec.version;
        obj->sizes = rec.sizes;
        obj->bytes = bytes[i];
        obj->checksum = rec.checksum;
        obj->state = ObjectState::kComplete;
        obj->target = target;
        obj->last_access_ns = now_ns;
        o = obj.get();
        objects.emplace(rec.key, std::move(obj));
        // Let the other nodes re-register before judging the replica count.
        MarkRepair(o, now_ns + MsToNs(cfg.node_ttl_ms));
      }
      o->target = std::max(o->target, target);
      AddReplica(o, &n, seg, rec.offset, ReplicaState::kComplete, rec.replica_id).record_on_node =
          true;
      reply.records_accepted++;
    }
  }

  // ---------------------------------------------------------------- SSD tier

  bool Demotable(const Object& o, const Replica& r) const {
    if (o.state != ObjectState::kComplete || o.pinned) return false;
    for (const Replica& rr : o.replicas) {
      if (rr.state != ReplicaState::kComplete) return false;  // a copy is in flight
    }
    return r.segment->info.tier == Tier::kDram && r.demote_segment == nullptr;
  }

  // On ACTIVE nodes with an SSD segment: DRAM segments above demote_high_watermark get their
  // coldest replicas queued for demotion until demote_low_watermark (counting what is already
  // on its way out), at most max_demotions_per_node pending per node.
  void ScheduleDemotions(uint64_t now_ns, TickSummary& sum) {
    for (auto& [id, n] : nodes) {
      if (n.state != NodeState::kActive) continue;  // a draining node moves data off instead
      if (now_ns < n.demote_not_before_ns) continue;  // its SSD failed lately
      Segment* ssd = SsdSegment(n);
      if (!ssd) continue;
      for (auto& [sid, s] : n.segments) {
        if (s.info.tier != Tier::kDram || n.demotions >= cfg.max_demotions_per_node) continue;
        const double cap = static_cast<double>(s.info.capacity);
        uint64_t leaving = 0;
        for (Object* o : s.residents) {
          if (o->replicas[ReplicaOn(*o, &n)].demote_segment) leaving += RoundUp(o->bytes);
        }
        const uint64_t used = s.alloc.used_bytes() - std::min(leaving, s.alloc.used_bytes());
        if (static_cast<double>(used) <= cfg.demote_high_watermark * cap) continue;
        const uint64_t low = static_cast<uint64_t>(cfg.demote_low_watermark * cap);
        uint64_t want = used - std::min(used, low);
        // A full SSD drops its coldest objects to make room (before the candidates are
        // collected: eviction erases objects).
        const double ssd_cap = static_cast<double>(ssd->info.capacity);
        const uint64_t ssd_low = static_cast<uint64_t>(cfg.low_watermark * ssd_cap);
        if (ssd->alloc.free_bytes() < want) {
          sum.objects_evicted += EvictUntil(
              *ssd,
              [&] {
                return ssd->alloc.free_bytes() >= want || ssd->alloc.used_bytes() <= ssd_low;
              },
              cfg.max_evictions_per_put, now_ns);
        }
        std::vector<Object*> cands;
        for (Object* o : s.residents) {
          if (Demotable(*o, o->replicas[ReplicaOn(*o, &n)])) cands.push_back(o);
        }
        std::sort(cands.begin(), cands.end(), [](const Object* a, const Object* b) {
          return std::tie(a->last_access_ns, a->key) < std::tie(b->last_access_ns, b->key);
        });
        for (Object* o : cands) {
          if (want == 0 || n.demotions >= cfg.max_demotions_per_node) break;
          std::optional<uint64_t> off = ssd->alloc.Allocate(o->bytes);
          if (!off) break;  // the SSD is full of objects that cannot go yet
          Replica& r = o->replicas[ReplicaOn(*o, &n)];
          r.demote_segment = ssd;
          r.demote_offset = *off;
          r.demote_id = next_replica_id++;
          r.demote_issued = false;
          n.demotions++;
          n.demote_queue.emplace_back(o->key, r.demote_id);
          want -= std::min(want, RoundUp(o->bytes));
          ++sum.demotions_scheduled;
        }
      }
    }
  }

  // After promote_after_reads reads served from the SSD replica r (on node n) of o: queue its
  // move back to n's DRAM, if n is ACTIVE, has a move slot, and its DRAM stays under
  // demote_low_watermark with it (so the promoted object is not demoted right back).
  void MaybePromote(Object* o, Replica& r, uint64_t now_ns) {
    Node& n = *r.node;
    if (cfg.promote_after_reads == 0 || ++o->ssd_reads < cfg.promote_after_reads) return;
    if (!Placeable(n, now_ns) || now_ns < n.demote_not_before_ns ||
        n.demotions >= cfg.max_demotions_per_node || r.demote_segment != nullptr ||
        o->state != ObjectState::kComplete) {
      return;
    }
    for (const Replica& rr : o->replicas) {
      if (rr.state != ReplicaState::kComplete) return;  // a copy is in flight
    }
    Segment* dram = FitSegment(n, o->bytes, false);
    if (!dram) return;
    const double low = cfg.demote_low_watermark * static_cast<double>(dram->info.capacity);
    if (static_cast<double>(dram->alloc.used_bytes() + RoundUp(o->bytes)) > low) return;
    std::optional<uint64_t> off = dram->alloc.Allocate(o->bytes);
    if (!off) return;
    r.demote_segment = dram;
    r.demote_offset = *off;
    r.demote_id = next_replica_id++;
    r.demote_issued = false;
    n.demotions++;
    n.demote_queue.emplace_back(o->key, r.demote_id);
    o->ssd_reads = 0;
  }

  // Moves handed out and not reported by their deadline are cancelled.
  void ExpireDemotions(uint64_t now_ns, TickSummary& sum) {
    for (auto& [id, n] : nodes) {
      if (n.demotions == 0) continue;
      for (auto& [sid, s] : n.segments) {
        for (Object* o : s.residents) {
          Replica& r = o->replicas[ReplicaOn(*o, &n)];
          if (r.demote_segment && r.demote_issued && r.demote_deadline_ns <= now_ns) {
            CancelDemotion(r, o->bytes);
            ++sum.demotions_timed_out;
          }
        }
      }
    }
  }

  // ---------------------------------------------------------------- re-replication

  void FailTask(std::map<uint64_t, Task>::iterator it, uint64_t now_ns) {
    Object* o = FindObject(it->second.key);
    const int idx = ReplicaWithTask(*o, it->first);
    const uint64_t hold = HoldUntil(*o, o->replicas[idx]);
    const std::string dest = it->second.dest->id().node_id;
    EraseTask(it);
    ReleaseReplica(o, idx, now_ns, hold);
    if (std::find(o->failed_dests.begin(), o->failed_dests.end(), dest) == o->failed_dests.end()) {
      o->failed_dests.push_back(dest);
    }
    MarkRepair(o, now_ns + MsToNs(cfg.repair_backoff_ms));
  }

  // A COMPLETE replica to copy from: a DRAINING node's first (that is what drain means), then
  // the node with the fewest tasks; null if every source is at max_tasks_per_node.
  const Replica* ChooseSource(const Object& o) const {
    const Replica* best = nullptr;
    for (const Replica& r : o.replicas) {
      if (r.state != ReplicaState::kComplete) continue;
      if (r.node->source_tasks >= cfg.max_tasks_per_node) continue;
      // A replica being demoted may leave its range before a task's copy ends.
      if (r.demote_segment != nullptr) continue;
      if (!best) {
        best = &r;
        continue;
      }
      const bool rd = r.node->state == NodeState::kDraining;
      const bool bd = best->node->state == NodeState::kDraining;
      if (rd != bd) {
        if (rd) best = &r;
        continue;
      }
      if (r.node->source_tasks < best->node->source_tasks) best = &r;
    }
    return best;
  }

  void RepairOne(Object* o, uint64_t now_ns, TickSummary& summary) {
    size_t active = 0, inflight = 0, draining = 0;
    for (const Replica& r : o->replicas) {
      if (r.state != ReplicaState::kComplete) {
        ++inflight;
      } else if (r.node->state == NodeState::kDraining) {
        ++draining;
      } else {
        ++active;
      }
    }
    bool blocked = false;
    while (active + inflight < o->target) {
      const Replica* src = ChooseSource(*o);
      if (!src) break;  // sources busy: next tick
      std::vector<Choice> dest = ChooseNodes(now_ns, o->bytes, 1, o, &o->failed_dests, {}, true);
      if (dest.empty() && !o->failed_dests.empty()) {
        o->failed_dests.clear();  // no other choice: retry the ones that failed
        dest = ChooseNodes(now_ns, o->bytes, 1, o, nullptr, {}, true);
      }
      std::optional<uint64_t> off;
      if (!dest.empty()) off = dest[0].segment->alloc.Allocate(o->bytes);
      if (!off) {
        blocked = true;
        break;
      }
      Task t;
      t.id = next_task_id++;
      t.key = o->key;
      t.version = o->version;
      t.source = src->node;
      t.source_segment = src->segment->info.segment_id;
      t.source_offset = src->offset;
      t.dest = dest[0].node;
      t.source->source_tasks++;
      t.source->task_queue.push_back(t.id);
      // AddReplica may reallocate o->replicas: src is not used past this point.
      AddReplica(o, dest[0].node, dest[0].segment, *off, ReplicaState::kCopying).task_id = t.id;
      tasks.emplace(t.id, std::move(t));
      ++inflight;
      ++summary.tasks_created;
    }
    if (inflight == 0 && draining > 0 && active > 0 && (active >= o->target || blocked)) {
      for (size_t i = o->replicas.size(); i-- > 0;) {
        if (o->replicas[i].node->state == NodeState::kDraining) DropReplica(o, i, now_ns);
      }
      draining = 0;
    }
    if (inflight == 0 && draining == 0 && active >= o->target) {
      repair_keys.erase(o->key);
    } else if (inflight == 0) {
      o->repair_not_before_ns = now_ns + MsToNs(cfg.repair_backoff_ms);
    }
  }

  ReplicationTask TaskView(const Task& t) const {
    const Object& o = *objects.at(t.key);
    const Replica& dest = o.replicas[ReplicaWithTask(o, t.id)];
    ReplicationTask v;
    v.task_id = t.id;
    v.key = t.key;
    v.version = t.version;
    v.checksum = o.checksum;
    v.source = {t.source->id(), t.source_segment, t.source_offset, o.bytes,
                t.source->segments.at(t.source_segment).info.tier};
    v.dest = Location(o, dest);
    v.dest_descriptor = t.dest->reg.engine_descriptor;
    v.dest_control_endpoint = t.dest->reg.control_endpoint;
    v.deadline_ns = t.deadline_ns;
    return v;
  }

  // ---------------------------------------------------------------- operations

  Result<PutAllocation> AllocateObject(const PutItem& item, uint64_t bytes,
                                       const PutOptions& options, uint64_t now_ns) {
    const size_t count = options.replica_num;
    std::vector<Choice> picks =
        ChooseNodes(now_ns, bytes, count, nullptr, nullptr, options.client_node_id);
    if (picks.size() < count) {
      MakeRoom(bytes, count, options.client_node_id, now_ns);
      picks = ChooseNodes(now_ns, bytes, count, nullptr, nullptr, options.client_node_id);
    }
    size_t active = 0, waiting = 0;
    for (const auto& [id, n] : nodes) {
      active += n.state == NodeState::kActive;
      waiting += n.state == NodeState::kActive && !Placeable(n, now_ns);
    }
    if (picks.size() < count) {
      return Status::NoSpace(
          "need " + Num(count) + " ACTIVE nodes with a free range of " + Num(RoundUp(bytes)) +
          " bytes; " + Num(picks.size()) + " of " + Num(active) +
          " ACTIVE nodes have one, even after eviction" +
          (waiting == 0 ? std::string()
                        : " (" + Num(waiting) +
                              " registered again and take no new data until writes and leases "
                              "of their previous registration have run out)"));
    }
    std::vector<uint64_t> offsets;
    for (const Choice& c : picks) {
      std::optional<uint64_t> off = c.segment->alloc.Allocate(bytes);
      if (!off) {
        for (size_t i = 0; i < offsets.size(); ++i) picks[i].segment->alloc.Free(offsets[i]);
        return Status::NoSpace("allocation failed on " + c.node->id().node_id);
      }
      offsets.push_back(*off);
    }
    auto obj = std::make_unique<Object>();
    Object* o = obj.get();
    o->key = item.key;
    o->version = next_version++;
    o->sizes = item.sizes;
    o->bytes = bytes;
    o->state = ObjectState::kPending;
    o->target = options.replica_num;
    o->pinned = options.pinned;
    o->put_deadline_ns = now_ns + MsToNs(cfg.put_timeout_ms);
    o->last_access_ns = now_ns;
    objects.emplace(item.key, std::move(obj));
    pending_keys.insert(item.key);
    PutAllocation a;
    a.version = o->version;
    a.deadline_ns = o->put_deadline_ns;
    for (size_t i = 0; i < picks.size(); ++i) {
      Replica& r =
          AddReplica(o, picks[i].node, picks[i].segment, offsets[i], ReplicaState::kWriting);
      a.replicas.push_back(Location(*o, r));
    }
    o->put_layout = a.replicas;
    return a;
  }

  Status BeginPutEndOne(const PutEndItem& item, uint64_t now_ns, PutEndPlan& plan,
                        std::map<std::string, size_t>& commit_index) {
    KVB_RETURN_IF_ERROR(CheckKey(item.key));
    Object* o = FindObject(item.key);
    if (!o) return Status::NotFound("no such object: never put, revoked or timed out");
    if (o->version != item.version) {
      return Status::NotFound("version " + Num(item.version) + " is gone; the key now has " +
                              Num(o->version));
    }
    if (o->state == ObjectState::kComplete) return Status::AlreadyExists("already complete");
    if (o->state == ObjectState::kCommitting) {
      return Status::Unavailable("another put end of this version is in flight");
    }
    if (item.replica_ok.size() != o->put_layout.size()) {
      return Status::InvalidArgument(Num(item.replica_ok.size()) + " replica flags for " +
                                     Num(o->put_layout.size()) + " replicas");
    }
    size_t written = 0;
    for (size_t i = 0; i < o->put_layout.size(); ++i) {
      const ReplicaLocation& want = o->put_layout[i];
      int idx = -1;
      for (size_t j = 0; j < o->replicas.size(); ++j) {
        const Replica& r = o->replicas[j];
        if (r.state == ReplicaState::kWriting && r.node->id() == want.node &&
            r.segment->info.segment_id == want.segment_id && r.offset == want.offset) {
          idx = static_cast<int>(j);
          break;
        }
      }
      if (idx < 0) continue;  // lost with its node
      if (!item.replica_ok[i]) {
        DropReplica(o, idx, now_ns);
        continue;
      }
      o->replicas[idx].state = ReplicaState::kCommitting;
      o->replicas[idx].record_on_node = true;
      ++written;
    }
    if (written < cfg.min_replicas) {
      const size_t total = o->put_layout.size();
      EraseObject(o, now_ns);
      ++revokes_total;
      return Status::Unavailable(Num(written) + " of " + Num(total) +
                                 " replicas written; min_replicas is " + Num(cfg.min_replicas) +
                                 "; put revoked");
    }
    o->checksum = item.checksum;
    o->state = ObjectState::kCommitting;
    o->put_deadline_ns = now_ns + MsToNs(cfg.put_timeout_ms);
    for (const Replica& r : o->replicas) {
      if (r.state != ReplicaState::kCommitting) continue;
      auto [it, inserted] = commit_index.try_emplace(r.node->id().node_id, plan.commits.size());
      if (inserted) {
        NodeCommit c;
        c.node = r.node->id();
        c.control_endpoint = r.node->reg.control_endpoint;
        plan.commits.push_back(std::move(c));
      }
      plan.commits[it->second].records.push_back(Record(*o, r));
    }
    return Status::OK();
  }

  struct CommitEntry {
    const NodeCommit* commit;
    const InventoryRecord* record;
  };

  Status FinishPutEndOne(const KeyVersion& kv, const std::vector<CommitEntry>& entries,
                         uint64_t now_ns) {
    Object* o = FindObject(kv.key);
    if (!o || o->version != kv.version || o->state != ObjectState::kCommitting) {
      for (const CommitEntry& e : entries) {
        if (e.commit->ok) QueueFreeIfRegistered(e.commit->node, *e.record);
      }
      return Status::NotFound(
          "revoked while its inventory was being committed (put timeout, node death or a newer "
          "version)");
    }
    size_t complete = 0;
    for (const CommitEntry& e : entries) {
      int idx = -1;
      for (size_t j = 0; j < o->replicas.size(); ++j) {
        const Replica& r = o->replicas[j];
        if (r.state == ReplicaState::kCommitting && r.node->id() == e.commit->node &&
            r.segment->info.segment_id == e.record->segment_id && r.offset == e.record->offset) {
          idx = static_cast<int>(j);
          break;
        }
      }
      if (idx < 0) {
        if (e.commit->ok) QueueFreeIfRegistered(e.commit->node, *e.record);
        continue;
      }
      if (e.commit->ok) {
        o->replicas[idx].state = ReplicaState::kComplete;
        ++complete;
      } else {
        DropReplica(o, idx, now_ns);  // the node may have it: freed there
      }
    }
    for (size_t j = o->replicas.size(); j-- > 0;) {
      if (o->replicas[j].state != ReplicaState::kComplete) DropReplica(o, j, now_ns);
    }
    if (complete < cfg.min_replicas) {
      EraseObject(o, now_ns);
      ++revokes_total;
      return Status::Unavailable(Num(complete) + " replicas committed; min_replicas is " +
                                 Num(cfg.min_replicas) + "; put revoked");
    }
    o->state = ObjectState::kComplete;
    o->put_layout.clear();
    o->put_deadline_ns = 0;
    o->last_access_ns = now_ns;
    pending_keys.erase(o->key);
    if (NeedsRepair(*o)) MarkRepair(o, now_ns);
    return Status::OK();
  }
};

// ------------------------------------------------------------------ MasterState

MasterState::MasterState(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MasterState::~MasterState() = default;

Result<std::unique_ptr<MasterState>> MasterState::Create(const MasterConfig& config) {
  KVB_RETURN_IF_ERROR(config.Validate());
  return std::unique_ptr<MasterState>(new MasterState(std::make_unique<Impl>(config)));
}

const MasterConfig& MasterState::config() const { return impl_->cfg; }

Result<RegisterReply> MasterState::RegisterNode(const NodeRegistration& registration,
                                                const std::vector<InventoryRecord>& inventory,
                                                uint64_t now_ns) {
  Impl& m = *impl_;
  const NodeIdentity& id = registration.identity;
  if (id.node_id.empty()) return Status::InvalidArgument("node id is empty");
  if (registration.segments.empty()) {
    return Status::InvalidArgument("node " + id.node_id + " registers no segments");
  }
  std::set<uint64_t> seg_ids;
  for (const SegmentInfo& s : registration.segments) {
    if (s.capacity == 0) {
      return Status::InvalidArgument("segment " + Num(s.segment_id) + " has capacity 0");
    }
    if (!seg_ids.insert(s.segment_id).second) {
      return Status::InvalidArgument("segment id " + Num(s.segment_id) + " appears twice");
    }
  }
  std::lock_guard<std::mutex> lock(m.mu);
  if (auto it = m.nodes.find(id.node_id); it != m.nodes.end()) {
    if (it->second.id().incarnation == id.incarnation) {
      return Status::AlreadyExists(ToString(id) + " is registered already");
    }
    m.DropNode(&it->second, now_ns, /*expired=*/false);  // superseded by a new incarnation
  }
  Impl::Node& n = m.nodes[id.node_id];
  n.reg = registration;
  n.last_seen_ns = now_ns;
  if (registration.draining) {
    n.state = NodeState::kDraining;
    n.drain_deadline_ns = now_ns + MsToNs(m.cfg.drain_timeout_ms);
  }
  for (const SegmentInfo& s : registration.segments) {
    n.segments.try_emplace(s.segment_id, s, m.cfg.alignment);
  }
  ++m.directory_version;
  RegisterReply reply;
  reply.heartbeat_interval_ms = std::max<uint64_t>(1, m.cfg.node_ttl_ms / 3);
  // The same incarnation coming back (it expired, or the master restarted): writers and readers
  // of its previous registration may still be at its memory. This master knows how long when
  // it dropped that registration itself; otherwise (a new master) it assumes the worst any
  // predecessor could have handed out (restart_hold_until_ns).
  if (auto dep = m.departed.find(id.node_id);
      dep != m.departed.end() && dep->second.incarnation == id.incarnation) {
    n.no_alloc_before_ns = dep->second.reuse_after_ns;
  } else if (registration.registered_before) {
    // Its note may have been dropped by the caps (CapDeparted): wait as long as any dropped one.
    n.no_alloc_before_ns =
        std::max(m.cfg.restart_hold_until_ns, m.departed_dropped_reuse_after_ns);
  }
  if (n.no_alloc_before_ns > now_ns) {
    reply.no_alloc_ms = (n.no_alloc_before_ns - now_ns + kNsPerMs - 1) / kNsPerMs;
  }
  m.LoadInventory(n, inventory, now_ns, reply);
  // Queued, and delivered (the first max_frees_per_reply in this reply, the rest with `more`)
  // until acknowledged: a lost reply loses none of them.
  std::vector<InventoryRecord> rejected;
  rejected.swap(reply.frees);
  for (const InventoryRecord& rec : rejected) m.QueueFree(&n, rec);
  reply.more = m.TakeFrees(&n, 0, &reply.frees, &reply.free_seqs);
  m.departed.erase(id.node_id);  // used up: what it holds now is in the table or freed
  if (n.state == NodeState::kDraining) {
    for (auto& [sid, s] : n.segments) {
      for (Impl::Object* o : s.residents) {
        if (!m.repair_keys.count(o->key)) m.MarkRepair(o, now_ns);
      }
    }
  }
  return reply;
}

Result<NodeCommands> MasterState::Heartbeat(const NodeIdentity& node, uint64_t frees_acked,
                                            uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n) return st;
  n->last_seen_ns = std::max(n->last_seen_ns, now_ns);
  NodeCommands cmds;
  cmds.more = m.TakeFrees(n, frees_acked, &cmds.frees, &cmds.free_seqs);
  while (!n->task_queue.empty() && cmds.tasks.size() < m.cfg.max_tasks_per_reply) {
    const uint64_t tid = n->task_queue.front();
    n->task_queue.pop_front();
    auto it = m.tasks.find(tid);
    if (it == m.tasks.end() || it->second.state != Impl::TaskState::kQueued) continue;
    it->second.state = Impl::TaskState::kIssued;
    it->second.deadline_ns = now_ns + MsToNs(m.cfg.task_timeout_ms);
    cmds.tasks.push_back(m.TaskView(it->second));
  }
  while (!n->demote_queue.empty() && cmds.demotions.size() < m.cfg.max_demotions_per_reply) {
    auto [key, demote_id] = std::move(n->demote_queue.front());
    n->demote_queue.pop_front();
    Impl::Object* o = m.FindObject(key);
    const int idx = o ? Impl::ReplicaOn(*o, n) : -1;
    if (idx < 0) continue;
    Impl::Replica& r = o->replicas[idx];
    if (r.demote_id != demote_id || r.demote_segment == nullptr || r.demote_issued) continue;
    r.demote_issued = true;
    r.demote_deadline_ns = now_ns + MsToNs(m.cfg.task_timeout_ms);
    Demotion d;
    d.source = m.Record(*o, r);
    d.dest = d.source;
    d.dest.segment_id = r.demote_segment->info.segment_id;
    d.dest.offset = r.demote_offset;
    d.dest.replica_id = r.demote_id;
    d.deadline_ns = r.demote_deadline_ns;
    cmds.demotions.push_back(std::move(d));
  }
  // (Stale entries left in a queue make `more` true once too many: the next reply skips them.)
  cmds.more = cmds.more || !n->task_queue.empty() || !n->demote_queue.empty();
  cmds.drained = m.DrainDone(*n, now_ns);
  return cmds;
}

Result<NodeCommands> MasterState::UnackedFrees(const NodeIdentity& node) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n) return st;
  NodeCommands cmds;
  cmds.more = m.TakeFrees(n, 0, &cmds.frees, &cmds.free_seqs);
  return cmds;
}

Status MasterState::StartDrain(const NodeIdentity& node, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n) return st;
  if (n->state == NodeState::kDraining) return Status::OK();
  n->state = NodeState::kDraining;
  n->drain_deadline_ns = now_ns + MsToNs(m.cfg.drain_timeout_ms);
  ++m.directory_version;
  for (auto& [sid, s] : n->segments) {
    for (Impl::Object* o : s.residents) m.MarkRepair(o, now_ns);
  }
  return Status::OK();
}

Status MasterState::Deregister(const NodeIdentity& node, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n) return st;
  m.DropNode(n, now_ns, /*expired=*/false);
  return Status::OK();
}

NodeDirectory MasterState::GetNodeDirectory(const std::vector<std::string>& node_ids) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  NodeDirectory dir;
  dir.directory_version = m.directory_version;
  auto add = [&](const Impl::Node& n) {
    dir.nodes.push_back({n.id(), n.state, n.reg.engine_descriptor, n.reg.control_endpoint});
  };
  if (node_ids.empty()) {
    for (const auto& [id, n] : m.nodes) add(n);
  } else {
    for (const std::string& id : node_ids) {
      if (auto it = m.nodes.find(id); it != m.nodes.end()) add(it->second);
    }
  }
  return dir;
}

std::vector<Result<PutAllocation>> MasterState::PutStart(const std::vector<PutItem>& items,
                                                         const PutOptions& options,
                                                         uint64_t now_ns) {
  Impl& m = *impl_;
  std::vector<Result<PutAllocation>> out;
  out.reserve(items.size());
  Status batch;
  if (options.replica_num == 0 || options.replica_num > m.cfg.max_replicas) {
    batch =
        Status::InvalidArgument("replica_num " + Num(options.replica_num) +
                                " is outside 1..max_replicas (" + Num(m.cfg.max_replicas) + ")");
  } else if (options.replica_num < m.cfg.min_replicas) {
    batch = Status::InvalidArgument("replica_num " + Num(options.replica_num) +
                                    " is below min_replicas (" + Num(m.cfg.min_replicas) +
                                    "): such a put could never complete");
  }
  std::unordered_map<std::string_view, size_t> seen;
  for (const PutItem& item : items) seen[item.key]++;

  std::lock_guard<std::mutex> lock(m.mu);
  for (const PutItem& item : items) {
    if (!batch.ok()) {
      out.push_back(batch);
      continue;
    }
    Status st = m.CheckKey(item.key);
    uint64_t bytes = 0;
    if (st.ok()) st = m.CheckSizes(item.sizes, &bytes);
    if (st.ok() && seen[item.key] > 1) {
      st = Status::InvalidArgument("key appears " + Num(seen[item.key]) + " times in the batch");
    }
    if (st.ok()) {
      if (const Impl::Object* o = m.FindObject(item.key)) {
        st = Status::AlreadyExists(o->state == ObjectState::kComplete
                                       ? "object exists (version " + Num(o->version) + ")"
                                       : "object is being written (version " + Num(o->version) +
                                             ")");
      }
    }
    if (!st.ok()) {
      out.push_back(std::move(st));
      continue;
    }
    if (!m.departed.empty()) m.ForgetDepartedCopies(item.key);  // a new version from here on
    out.push_back(m.AllocateObject(item, bytes, options, now_ns));
  }
  return out;
}

PutEndPlan MasterState::BeginPutEnd(const std::vector<PutEndItem>& items, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  PutEndPlan plan;
  std::map<std::string, size_t> commit_index;
  for (const PutEndItem& item : items) {
    plan.items.push_back({item.key, item.version});
    plan.early.push_back(m.BeginPutEndOne(item, now_ns, plan, commit_index));
  }
  return plan;
}

std::vector<Status> MasterState::FinishPutEnd(const PutEndPlan& plan, uint64_t now_ns) {
  Impl& m = *impl_;
  std::map<std::pair<std::string_view, uint64_t>, std::vector<Impl::CommitEntry>> by_key;
  for (const NodeCommit& c : plan.commits) {
    for (const InventoryRecord& r : c.records) by_key[{r.key, r.version}].push_back({&c, &r});
  }
  static const std::vector<Impl::CommitEntry> kNone;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Status> out;
  out.reserve(plan.items.size());
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const Status early = i < plan.early.size() ? plan.early[i] : Status::Internal("bad plan");
    if (!early.ok()) {
      out.push_back(early);
      continue;
    }
    const KeyVersion& kv = plan.items[i];
    auto it = by_key.find({kv.key, kv.version});
    out.push_back(m.FinishPutEndOne(kv, it == by_key.end() ? kNone : it->second, now_ns));
  }
  return out;
}

std::vector<Status> MasterState::PutRevoke(const std::vector<KeyVersion>& items, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Status> out;
  out.reserve(items.size());
  for (const KeyVersion& kv : items) {
    Status st = m.CheckKey(kv.key);
    Impl::Object* o = st.ok() ? m.FindObject(kv.key) : nullptr;
    if (!st.ok()) {
    } else if (!o || o->version != kv.version) {
      st = Status::NotFound("no pending put of this key and version");
    } else if (o->state == ObjectState::kComplete) {
      st = Status::AlreadyExists("object is complete; use Remove");
    } else if (o->state == ObjectState::kCommitting) {
      st = Status::Unavailable("its put end is in flight");
    } else {
      m.EraseObject(o, now_ns);
      ++m.revokes_total;
    }
    out.push_back(std::move(st));
  }
  return out;
}

std::vector<Result<ReplicaSet>> MasterState::GetReplicas(const std::vector<std::string>& keys,
                                                         std::string_view client_node_id,
                                                         uint64_t now_ns, bool sizes_only) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Result<ReplicaSet>> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) {
    Status st = m.CheckKey(key);
    if (!st.ok()) {
      out.push_back(std::move(st));
      continue;
    }
    Impl::Object* o = m.FindObject(key);
    if (!o || o->state != ObjectState::kComplete || Impl::CompleteReplicas(*o) == 0) {
      out.push_back(Status::NotFound(o ? "object is being written" : "no such object"));
      continue;
    }
    std::vector<const Impl::Replica*> reps;
    for (const Impl::Replica& r : o->replicas) {
      if (r.state == ReplicaState::kComplete) reps.push_back(&r);
    }
    auto rank = [&](const Impl::Replica* r) {
      const Impl::Node& n = *r->node;
      // DRAM before SSD (an SSD replica is read through its node), then the client's own
      // node, healthy and lightly loaded nodes first.
      return std::make_tuple(r->segment->info.tier != Tier::kDram,
                             n.id().node_id != client_node_id, n.state != NodeState::kActive,
                             n.bad_reports, n.reads, n.id().node_id);
    };
    std::sort(reps.begin(), reps.end(),
              [&](const Impl::Replica* a, const Impl::Replica* b) { return rank(a) < rank(b); });
    if (!sizes_only) {
      reps.front()->node->reads += 1;
      o->lease_expiry_ns = std::max(o->lease_expiry_ns, now_ns + MsToNs(m.cfg.lease_ms));
      o->last_access_ns = now_ns;
      if (reps.front()->segment->info.tier == Tier::kSsd) {
        m.MaybePromote(o, o->replicas[Impl::ReplicaOn(*o, reps.front()->node)], now_ns);
      }
    }
    ReplicaSet rs;
    rs.version = o->version;
    rs.sizes = o->sizes;
    rs.checksum = o->checksum;
    rs.lease_expiry_ns = o->lease_expiry_ns;
    for (const Impl::Replica* r : reps) rs.replicas.push_back(m.Location(*o, *r));
    out.push_back(std::move(rs));
  }
  return out;
}

std::vector<bool> MasterState::Exists(const std::vector<std::string>& keys) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<bool> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) {
    auto it = m.objects.find(key);
    out.push_back(it != m.objects.end() && it->second->state == ObjectState::kComplete);
  }
  return out;
}

Status MasterState::Remove(std::string_view key, uint64_t now_ns) {
  Impl& m = *impl_;
  KVB_RETURN_IF_ERROR(m.CheckKey(key));
  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Object* o = m.FindObject(key);
  m.ForgetDepartedCopies(key);  // even if absent here: a departed node may hold it
  if (!o) return Status::NotFound("no such object");
  if (o->state != ObjectState::kComplete) {
    return Status::Unavailable("a put of this key is in progress");
  }
  m.EraseObject(o, now_ns);
  return Status::OK();
}

size_t MasterState::RemoveAll(uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Impl::Object*> victims;
  for (auto& [key, o] : m.objects) {
    if (o->state == ObjectState::kComplete) victims.push_back(o.get());
  }
  for (Impl::Object* o : victims) m.EraseObject(o, now_ns);
  for (auto& [id, d] : m.departed) {
    for (Impl::DepartedCopy& c : d.copies) c.comes_back = false;
  }
  return victims.size();
}

Status MasterState::ReportBadReplica(std::string_view key, uint64_t version,
                                     const NodeIdentity& node, uint64_t now_ns,
                                     uint64_t segment_id, uint64_t offset) {
  Impl& m = *impl_;
  KVB_RETURN_IF_ERROR(m.CheckKey(key));
  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Object* o = m.FindObject(key);
  if (!o || o->version != version || o->state != ObjectState::kComplete) {
    return Status::NotFound("no complete object of this key and version");
  }
  Impl::Node* n = m.FindNodeExact(node);
  const int idx = n ? Impl::ReplicaOn(*o, n) : -1;
  if (idx < 0 || o->replicas[idx].state != ReplicaState::kComplete) {
    return Status::NotFound("no complete replica on " + ToString(node));
  }
  if (segment_id != 0 && (o->replicas[idx].segment->info.segment_id != segment_id ||
                          o->replicas[idx].offset != offset)) {
    return Status::NotFound("the replica on " + ToString(node) + " has moved since");
  }
  n->bad_reports += 1;
  ++m.bad_replicas_total;
  if (std::find(o->failed_dests.begin(), o->failed_dests.end(), node.node_id) ==
      o->failed_dests.end()) {
    o->failed_dests.push_back(node.node_id);  // not the first choice for its new copy
  }
  // Copies reading from the bad replica are cancelled (their destinations freed later).
  std::vector<uint64_t> cancel;
  for (const auto& r : o->replicas) {
    if (r.task_id != 0 && m.tasks.at(r.task_id).source == n) cancel.push_back(r.task_id);
  }
  for (uint64_t tid : cancel) m.DropReplica(o, Impl::ReplicaWithTask(*o, tid), now_ns);
  m.DropReplica(o, Impl::ReplicaOn(*o, n), now_ns);
  if (Impl::CompleteReplicas(*o) == 0) {
    m.EraseObject(o, now_ns);
  } else {
    m.MarkRepair(o, now_ns);
  }
  return Status::OK();
}

Status MasterState::ReportUnreachableNode(const NodeIdentity& node, uint64_t /*now_ns*/) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Node* n = m.FindNodeExact(node);
  if (!n) return Status::NotFound("no node " + ToString(node));
  n->bad_reports += 1;
  ++m.unreachable_reports_total;
  return Status::OK();
}

Result<TaskCommitPlan> MasterState::TaskDone(uint64_t task_id, const NodeIdentity& source, bool ok,
                                             uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.tasks.find(task_id);
  if (it == m.tasks.end()) return Status::NotFound("task " + Num(task_id) + " is not running");
  Impl::Task& t = it->second;
  if (!(t.source->id() == source)) {
    return Status::StalePeer("task " + Num(task_id) + " belongs to " + ToString(t.source->id()));
  }
  if (t.state == Impl::TaskState::kCommitting) {
    return Status::Unavailable("task " + Num(task_id) + " was reported already");
  }
  TaskCommitPlan plan;
  plan.task_id = task_id;
  if (!ok) {
    m.FailTask(it, now_ns);
    return plan;
  }
  Impl::Object* o = m.FindObject(t.key);
  Impl::Replica& r = o->replicas[Impl::ReplicaWithTask(*o, task_id)];
  r.state = ReplicaState::kCommitting;
  r.record_on_node = true;
  t.state = Impl::TaskState::kCommitting;
  t.deadline_ns = now_ns + MsToNs(m.cfg.task_timeout_ms);
  NodeCommit c;
  c.node = t.dest->id();
  c.control_endpoint = t.dest->reg.control_endpoint;
  c.records.push_back(m.Record(*o, r));
  plan.commits.push_back(std::move(c));
  return plan;
}

Status MasterState::FinishTask(const TaskCommitPlan& plan, uint64_t now_ns) {
  if (plan.commits.empty()) return Status::OK();
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const NodeCommit& c = plan.commits.front();
  auto it = m.tasks.find(plan.task_id);
  if (it == m.tasks.end() || it->second.state != Impl::TaskState::kCommitting) {
    if (c.ok) {
      for (const InventoryRecord& r : c.records) m.QueueFreeIfRegistered(c.node, r);
    }
    return Status::NotFound("task " + Num(plan.task_id) + " was cancelled while committing");
  }
  if (!c.ok) {
    m.FailTask(it, now_ns);
    return Status::Unavailable("commit to " + ToString(c.node) + " failed; retried later");
  }
  Impl::Object* o = m.FindObject(it->second.key);
  Impl::Replica& r = o->replicas[Impl::ReplicaWithTask(*o, plan.task_id)];
  r.state = ReplicaState::kComplete;
  r.task_id = 0;
  m.EraseTask(it);
  o->failed_dests.clear();
  if (m.NeedsRepair(*o)) m.MarkRepair(o, now_ns);
  return Status::OK();
}

Status MasterState::DemoteDone(const NodeIdentity& node, std::string_view key, uint64_t version,
                               uint64_t dest_replica_id, bool ok, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n && st.IsNotFound()) {
    // Not NOT_FOUND, which tells the node to drop its copy: after a master restart the node's
    // registration (with that copy in its inventory) may be on its way.
    return Status::Unavailable(st.message() + "; report the move again once registered");
  }
  if (!n) return st;
  Impl::Object* o = m.FindObject(key);
  // Asked again after an answer was lost on the way: a move already applied answers OK again,
  // or the node would drop the copy the master now lists.
  if (ok && o && o->version == version) {
    for (const Impl::Replica& r : o->replicas) {
      if (r.node == n && r.replica_id == dest_replica_id) return Status::OK();
    }
  }
  const int idx = o && o->version == version ? Impl::ReplicaOn(*o, n) : -1;
  if (idx < 0 || o->replicas[idx].demote_id != dest_replica_id ||
      o->replicas[idx].demote_segment == nullptr) {
    return Status::NotFound("demotion of " + std::string(key) + " is no longer wanted");
  }
  Impl::Replica& r = o->replicas[idx];
  if (!ok) {
    m.CancelDemotion(r);
    n->demote_not_before_ns = now_ns + MsToNs(m.cfg.repair_backoff_ms);
    return Status::OK();
  }
  // The replica moves to its new range; the old one stays readable until the read leases end.
  Impl::Segment* old_segment = r.segment;
  const uint64_t old_offset = r.offset;
  std::optional<InventoryRecord> old_record;
  if (r.record_on_node) old_record = m.Record(*o, r);
  m.Unreside(o, r);
  r.segment = r.demote_segment;
  r.offset = r.demote_offset;
  r.replica_id = r.demote_id;
  r.record_on_node = true;
  r.resident_index = r.segment->residents.size();
  r.segment->residents.push_back(o);
  r.demote_segment = nullptr;
  r.demote_offset = 0;
  r.demote_id = 0;
  r.demote_issued = false;
  r.demote_deadline_ns = 0;
  n->demotions--;
  if (r.segment->info.tier == Tier::kSsd) {
    ++m.demotions_total;
  } else {
    ++m.promotions_total;
  }
  if (o->lease_expiry_ns > now_ns) {
    m.held.push_back({n, old_segment, old_offset, o->bytes, o->lease_expiry_ns, std::move(old_record)});
    n->held++;
  } else {
    m.FreeRange(n, old_segment, old_offset, old_record);
  }
  return Status::OK();
}

size_t MasterState::liveness_records() const {
  std::lock_guard<std::mutex> lock(impl_->live_mu);
  return impl_->live.size();
}

void MasterState::Touch(const NodeIdentity& node, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.live_mu);
  auto& seen = m.live[node.node_id];
  if (seen.first != node.incarnation) seen = {node.incarnation, 0};
  seen.second = std::max(seen.second, now_ns);
}

TickSummary MasterState::Tick(uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  TickSummary sum;

  // Silent nodes. Heartbeats that arrived while this lock was busy were recorded by Touch().
  const uint64_t ttl = MsToNs(m.cfg.node_ttl_ms);
  {
    std::lock_guard<std::mutex> live_lock(m.live_mu);
    for (auto& [id, n] : m.nodes) {
      auto it = m.live.find(id);
      if (it != m.live.end() && it->second.first == n.id().incarnation) {
        n.last_seen_ns = std::max(n.last_seen_ns, it->second.second);
      }
    }
    // Records of ids that are not registered nodes (any caller can send a heartbeat naming
    // anything) are dropped here: the map stays as large as the node table between ticks' worth
    // of heartbeats.
    for (auto it = m.live.begin(); it != m.live.end();) {
      it = m.nodes.count(it->first) == 0 ? m.live.erase(it) : std::next(it);
    }
  }
  if (m.last_tick_ns != 0 && now_ns > m.last_tick_ns) {
    sum.since_last_tick_ms = (now_ns - m.last_tick_ns) / MsToNs(1);
  }
  if (m.cfg.pause_threshold_ms != 0 && m.last_tick_ns != 0 && now_ns > m.last_tick_ns &&
      now_ns - m.last_tick_ns > MsToNs(m.cfg.pause_threshold_ms)) {
    sum.paused_ms = (now_ns - m.last_tick_ns) / MsToNs(1);
    for (auto& [id, n] : m.nodes) n.last_seen_ns = std::max(n.last_seen_ns, now_ns);
  }
  m.last_tick_ns = std::max(m.last_tick_ns, now_ns);
  std::vector<Impl::Node*> dead;
  for (auto& [id, n] : m.nodes) {
    if (now_ns >= n.last_seen_ns && now_ns - n.last_seen_ns >= ttl) {
      dead.push_back(&n);
      sum.expired_silence_ms =
          std::max<uint64_t>(sum.expired_silence_ms, (now_ns - n.last_seen_ns) / MsToNs(1));
    }
  }
  std::erase_if(m.departed, [&](const auto& d) {
    return now_ns >= d.second.since_ns &&
           now_ns - d.second.since_ns >= MsToNs(m.cfg.departed_ttl_ms);
  });
  for (Impl::Node* n : dead) m.DropNode(n, now_ns, /*expired=*/true);
  sum.nodes_expired = dead.size();

  // Overdue puts (also those whose put end stalled in its commit phase).
  std::vector<Impl::Object*> overdue;
  for (const std::string& key : m.pending_keys) {
    Impl::Object* o = m.FindObject(key);
    if (o->put_deadline_ns <= now_ns) overdue.push_back(o);
  }
  for (Impl::Object* o : overdue) m.EraseObject(o, now_ns);
  sum.puts_revoked = overdue.size();
  m.revokes_total += overdue.size();

  // Tasks not reported (or not committed) in time.
  std::vector<uint64_t> late;
  for (const auto& [tid, t] : m.tasks) {
    if (t.state != Impl::TaskState::kQueued && t.deadline_ns <= now_ns) late.push_back(tid);
  }
  for (uint64_t tid : late) m.FailTask(m.tasks.find(tid), now_ns);
  sum.tasks_timed_out = late.size();

  // Held space whose lease or writer deadline passed.
  std::erase_if(m.held, [&](const Impl::Held& h) {
    if (h.release_at_ns > now_ns) return false;
    m.FreeRange(h.node, h.segment, h.offset, h.record);
    h.node->held--;
    ++sum.ranges_released;
    return true;
  });

  // Demotions: late ones cancelled, new ones queued.
  m.ExpireDemotions(now_ns, sum);
  m.ScheduleDemotions(now_ns, sum);

  // Segments above the high watermark (DRAM of a node with an SSD tier is demoted instead;
  // only puts that find no room evict there).
  for (auto& [id, n] : m.nodes) {
    const bool tiered = n.state == NodeState::kActive && Impl::SsdSegment(n) != nullptr;
    for (auto& [sid, s] : n.segments) {
      if (tiered && s.info.tier == Tier::kDram) continue;
      const double cap = static_cast<double>(s.info.capacity);
      if (static_cast<double>(s.alloc.used_bytes()) <= m.cfg.high_watermark * cap) continue;
      const double low = m.cfg.low_watermark * cap;
      sum.objects_evicted += m.EvictUntil(
          s, [&] { return static_cast<double>(s.alloc.used_bytes()) <= low; }, SIZE_MAX, now_ns);
    }
  }

  // Re-replication and drains.
  const std::vector<std::string> keys(m.repair_keys.begin(), m.repair_keys.end());
  for (const std::string& key : keys) {
    Impl::Object* o = m.FindObject(key);
    if (!o || o->state != ObjectState::kComplete) {
      m.repair_keys.erase(key);  // gone, or a put: its put end re-queues it if needed
      continue;
    }
    if (now_ns < o->repair_not_before_ns) continue;
    m.RepairOne(o, now_ns, sum);
  }
  for (auto& [id, n] : m.nodes) {
    if (!n.drained && m.DrainDone(n, now_ns)) {
      n.drained = true;
      ++sum.drains_finished;
    }
  }

  // Health counters decay.
  if (m.last_decay_ns == 0 || now_ns < m.last_decay_ns) m.last_decay_ns = now_ns;
  const uint64_t elapsed = now_ns - m.last_decay_ns;
  if (elapsed >= MsToNs(100)) {
    const double f = std::exp2(-static_cast<double>(elapsed) /
                               static_cast<double>(MsToNs(m.cfg.health_half_life_ms)));
    for (auto& [id, n] : m.nodes) {
      n.reads *= f;
      n.bad_reports *= f;
    }
    m.last_decay_ns = now_ns;
  }
  return sum;
}

MasterStats MasterState::Stats() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  MasterStats st;
  for (const auto& [id, n] : m.nodes) {
    NodeStats ns;
    ns.identity = n.id();
    ns.state = n.state;
    ns.drained = n.drained;
    ns.replicas = n.replicas;
    ns.last_heartbeat_ns = n.last_seen_ns;
    for (const auto& [sid, s] : n.segments) {
      if (s.info.tier == Tier::kDram) {
        ns.capacity += s.info.capacity;
        ns.used += s.alloc.used_bytes();
      } else {
        ns.ssd_capacity += s.info.capacity;
        ns.ssd_used += s.alloc.used_bytes();
        st.ssd_replicas += s.residents.size();
      }
      ns.segments.push_back(
          {sid, s.info.tier, s.info.capacity, s.alloc.used_bytes(), s.residents.size()});
    }
    st.nodes.push_back(std::move(ns));
  }
  for (const NodeStats& d : m.dead_nodes) st.nodes.push_back(d);
  for (const auto& [key, o] : m.objects) {
    if (o->state != ObjectState::kComplete) continue;
    ++st.objects;
    st.bytes += o->bytes;
    st.replica_bytes += o->bytes * Impl::CompleteReplicas(*o);
  }
  st.pending = m.pending_keys.size();
  for (const Impl::Held& h : m.held) st.held_bytes += m.RoundUp(h.length);
  st.tasks_in_flight = m.tasks.size();
  st.under_replicated = m.repair_keys.size();
  st.next_version = m.next_version;
  st.directory_version = m.directory_version;
  st.evictions_total = m.evictions_total;
  st.revokes_total = m.revokes_total;
  st.nodes_expired_total = m.nodes_expired_total;
  st.bad_replicas_total = m.bad_replicas_total;
  st.unreachable_reports_total = m.unreachable_reports_total;
  st.demotions_total = m.demotions_total;
  st.promotions_total = m.promotions_total;
  for (const auto& [id, n] : m.nodes) st.demotions_in_flight += n.demotions;
  st.departed_nodes = m.departed.size();
  for (const auto& [id, d] : m.departed) st.departed_copies += d.copies.size();
  st.departed_dropped_total = m.departed_dropped_total;
  return st;
}

MasterSnapshot MasterState::Snapshot() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  MasterSnapshot snap;
  snap.alignment = m.cfg.alignment;
  for (const auto& [key, o] : m.objects) {
    MasterSnapshot::Object so;
    so.key = o->key;
    so.version = o->version;
    so.state = o->state;
    so.sizes = o->sizes;
    so.checksum = o->checksum;
    so.target_replicas = o->target;
    so.pinned = o->pinned;
    so.lease_expiry_ns = o->lease_expiry_ns;
    for (const Impl::Replica& r : o->replicas) {
      so.replicas.push_back({m.Location(*o, r), r.state, r.task_id, r.replica_id, std::nullopt});
      if (r.demote_segment) {
        so.replicas.back().demote_to = ReplicaLocation{
            r.node->id(), r.demote_segment->info.segment_id, r.demote_offset, o->bytes,
            r.demote_segment->info.tier};
      }
    }
    snap.objects.push_back(std::move(so));
  }
  std::sort(snap.objects.begin(), snap.objects.end(),
            [](const auto& a, const auto& b) { return a.key < b.key; });
  for (const Impl::Held& h : m.held) {
    snap.held.push_back(
        {{h.node->id(), h.segment->info.segment_id, h.offset, h.length, h.segment->info.tier},
         h.release_at_ns});
  }
  for (const auto& [id, n] : m.nodes) {
    for (const auto& [sid, s] : n.segments) {
      snap.segments.push_back({n.id(), n.state, sid, s.info.capacity, s.alloc.used_bytes(),
                               s.alloc.allocation_count()});
    }
  }
  for (const auto& [tid, t] : m.tasks) {
    snap.tasks.push_back(
        {tid, t.key, t.version, t.source->id(), t.dest->id(), t.state != Impl::TaskState::kQueued});
  }
  return snap;
}

Status MasterState::CheckInvariants() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto fail = [](const std::string& what) { return Status::Internal("invariant: " + what); };
  for (const auto& [id, n] : m.nodes) {
    size_t replicas = 0, held = 0, source_tasks = 0;
    for (const auto& [sid, s] : n.segments) {
      uint64_t used = 0;
      size_t allocs = 0;
      for (size_t i = 0; i < s.residents.size(); ++i) {
        const Impl::Object* o = s.residents[i];
        const int idx = Impl::ReplicaOn(*o, &n);
        if (idx < 0) return fail(o->key + " is resident on " + id + " without a replica there");
        const Impl::Replica& r = o->replicas[idx];
        if (r.segment != &s || r.resident_index != i) {
          return fail(o->key + ": resident index of its replica on " + id + " is wrong");
        }
        if (s.alloc.AllocationLength(r.offset) != m.RoundUp(o->bytes)) {
          return fail(o->key + ": replica on " + id + " at " + Num(r.offset) +
                      " does not match an allocation");
        }
        used += m.RoundUp(o->bytes);
        ++allocs;
      }
      for (const auto& [sid2, s2] : n.segments) {
        for (const Impl::Object* o : s2.residents) {
          const Impl::Replica& r = o->replicas[Impl::ReplicaOn(*o, &n)];
          if (r.demote_segment != &s) continue;
          if (s.alloc.AllocationLength(r.demote_offset) != m.RoundUp(o->bytes)) {
            return fail(o->key + ": demotion range on " + id + " is not allocated");
          }
          used += m.RoundUp(o->bytes);
          ++allocs;
        }
      }
      for (const Impl::Held& h : m.held) {
        if (h.segment != &s) continue;
        if (s.alloc.AllocationLength(h.offset) != m.RoundUp(h.length)) {
          return fail("held range at " + Num(h.offset) + " on " + id + " is not allocated");
        }
        used += m.RoundUp(h.length);
        ++allocs;
        ++held;
      }
      if (used != s.alloc.used_bytes() || allocs != s.alloc.allocation_count()) {
        return fail("segment " + Num(sid) + " of " + id + ": allocator holds " +
                    Num(s.alloc.used_bytes()) + " bytes in " + Num(s.alloc.allocation_count()) +
                    " ranges; replicas and held ranges account for " + Num(used) + " in " +
                    Num(allocs));
      }
      replicas += s.residents.size();
    }
    for (const auto& [tid, t] : m.tasks) source_tasks += t.source == &n;
    if (replicas != n.replicas || held != n.held || source_tasks != n.source_tasks) {
      return fail("counters of " + id + " are off");
    }
  }
  size_t pending = 0;
  for (const auto& [key, o] : m.objects) {
    std::set<const Impl::Node*> holders;
    size_t complete = 0;
    for (const Impl::Replica& r : o->replicas) {
      auto nit = m.nodes.find(r.node->id().node_id);
      if (nit == m.nodes.end() || &nit->second != r.node) {
        return fail(key + " has a replica on an unregistered node");
      }
      if (!holders.insert(r.node).second) return fail(key + " has two replicas on one node");
      complete += r.state == ReplicaState::kComplete;
      if (r.task_id != 0) {
        auto t = m.tasks.find(r.task_id);
        if (t == m.tasks.end() || t->second.dest != r.node || t->second.key != key) {
          return fail(key + ": replica names a task that does not match");
        }
      } else if (r.state == ReplicaState::kCopying) {
        return fail(key + ": a copying replica without a task");
      }
      if (o->state == ObjectState::kComplete && r.state == ReplicaState::kWriting) {
        return fail(key + ": complete object with a replica being written");
      }
    }
    if (o->state == ObjectState::kComplete && complete == 0) {
      return fail(key + " is complete without a complete replica");
    }
    if (o->state != ObjectState::kComplete) {
      ++pending;
      if (!m.pending_keys.count(key)) return fail(key + " is pending but not indexed");
    }
  }
  if (pending != m.pending_keys.size()) return fail("pending index is off");
  for (const auto& [tid, t] : m.tasks) {
    auto it = m.objects.find(t.key);
    if (it == m.objects.end() || it->second->version != t.version ||
        Impl::ReplicaWithTask(*it->second, tid) < 0) {
      return fail("task " + Num(tid) + " has no destination replica");
    }
    const int src = Impl::ReplicaOn(*it->second, t.source);
    if (src < 0 || it->second->replicas[src].state != ReplicaState::kComplete) {
      return fail("task " + Num(tid) + " has no complete source replica");
    }
  }
  return Status::OK();
}

}  // namespace kvbridge::store
