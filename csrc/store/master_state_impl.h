// MasterState::Impl, the master's private state (store/master_state.h declares only its name),
// shared by the files that implement MasterState. The types, the data and the small helpers
// every part uses are defined here; the other members are declared here, grouped by the file
// that defines them (with their comments there):
//   master_state.cc      Create, Tick, Stats, Snapshot, CheckInvariants; replica bookkeeping
//   master_placement.cc  placement of new replicas and eviction
//   master_nodes.cc      the node table: registration, heartbeats, drain, departure, and the
//                        reactions to membership's events (who is a member, their leases and
//                        the directory are store/membership.h's)
//   master_tiers.cc      the SSD tier: demotions, promotions, DemoteDone
//   master_repair.cc     re-replication tasks, TaskDone/FinishTask, bad-replica reports
//   master_puts.cc       puts (PutStart/PutEnd/PutRevoke), GetReplicas, Exists, Remove
// Private to those files: nothing else includes it, and MasterState stays pure (no I/O).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "store/master_state.h"
#include "store/membership.h"
#include "util/range_allocator.h"

namespace kvbridge::store {

// Shared by the master's files only (this header is private to them).
constexpr uint64_t kNsPerMs = 1000000ull;

inline uint64_t MsToNs(uint64_t ms) { return ms * kNsPerMs; }
inline std::string Num(uint64_t v) { return std::to_string(v); }

// Task ids start at a random point so that a node reporting a task of a previous master
// incarnation gets NOT_FOUND, not another task that happens to have its id.
inline uint64_t RandomTaskIdBase() {
  std::random_device rd;
  return (((uint64_t{rd()} << 32) | rd()) >> 2) + 1;
}

struct MasterState::Impl {
  struct Object;

  struct Segment {
    Segment(const SegmentInfo& i, uint64_t alignment)
        : info(i),
          alloc(i.capacity, alignment, /*track_allocations=*/false),
          chunk_bytes(std::max<uint64_t>(
              1 << 20, (i.capacity / 64 + alignment - 1) / alignment * alignment)) {}
    SegmentInfo info;
    // Free ranges only: each range's holder (a replica, a demotion, a held range) knows its
    // length and frees with it (docs/performance.md, "Master memory per object").
    util::RangeAllocator alloc;
    std::vector<Object*> residents;  // objects with a replica here (at most one each)
    // MasterConfig::track_inflight (DRAM): when each chunk last had a range handed out to a
    // writer (or is kept for a predecessor's writers until), and what was last published.
    uint64_t chunk_bytes;
    std::array<uint64_t, 64> chunk_until_ns{};
    uint64_t published_chunks = 0;
  };

  // What the master keeps per member (Membership) for its objects. A node exists exactly while
  // its identity is a member: created by its kJoined event, dropped by the event that ends it
  // (ApplyMemberEvents, under the same lock as the membership change).
  struct Node {
    NodeIdentity identity;
    // As membership's events said (kJoined, kDraining): read by placement and repair on every
    // call, so kept here rather than looked up.
    NodeState state = NodeState::kActive;
    uint64_t drain_deadline_ns = 0;
    bool drained = false;
    std::map<uint64_t, Segment> segments;
    // Frees not yet acknowledged, by sequence number (increasing): resent in every heartbeat
    // reply until the node says it applied them (HeartbeatRequest.frees_acked).
    std::deque<std::pair<uint64_t, InventoryRecord>> frees;
    std::deque<uint64_t> task_queue;    // tasks to hand out (stale ids are skipped)
    size_t replicas = 0;                // replicas of any state on this node
    size_t held = 0;                    // held ranges on this node
    size_t source_tasks = 0;            // tasks with this node as source
    size_t demotions = 0;               // replicas here with a demotion pending
    uint64_t demote_not_before_ns = 0;  // after a failed demotion (disk full, ...)
    // No new DRAM allocation before this: the node registered again, and writers or readers of
    // its previous registration may still be at its memory (RegisterNode).
    uint64_t no_alloc_before_ns = 0;
    std::deque<std::pair<std::string, uint64_t>> demote_queue;  // (key, demote_id) to hand out
    double reads = 0;        // decaying count of reads handed out (load)
    double bad_reports = 0;  // decaying count of bad-replica reports (health)
    const NodeIdentity& id() const { return identity; }
  };

  struct Replica {
    Node* node = nullptr;
    Segment* segment = nullptr;
    uint64_t offset = 0;
    uint64_t replica_id = 0;
    uint64_t task_id = 0;  // nonzero: destination of this task
    // Nonzero: a pending move of this replica to another tier of its node (a demotion to SSD
    // or a promotion to DRAM), under this new replica id; the move's range and state are in
    // Impl::moves under it (few replicas move at a time, so they are kept apart).
    uint64_t demote_id = 0;
    // Position in segment->residents. 32 bits: a segment of more than 4 G replicas would need
    // hundreds of GB of master memory first.
    uint32_t resident_index = 0;
    ReplicaState state = ReplicaState::kWriting;
    bool record_on_node = false;  // a commit was sent: dropping it must tell the node
  };

  static_assert(std::is_trivially_copyable_v<Replica>);

  // An object's replicas: a heap array grown one at a time (an object has one to a few, and
  // they change rarely), 16 bytes in the record where a std::vector took 24. The subset of
  // std::vector's interface the master uses, with its rules: growing may move the replicas.
  class ReplicaList {
   public:
    ReplicaList() = default;
    ~ReplicaList() { delete[] data_; }
    ReplicaList(const ReplicaList&) = delete;
    ReplicaList& operator=(const ReplicaList&) = delete;
    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }
    Replica& operator[](size_t i) { return data_[i]; }
    const Replica& operator[](size_t i) const { return data_[i]; }
    Replica& back() { return data_[size_ - 1]; }
    Replica* begin() { return data_; }
    Replica* end() { return data_ + size_; }
    const Replica* begin() const { return data_; }
    const Replica* end() const { return data_ + size_; }
    void push_back(const Replica& r) {
      if (size_ == capacity_) Reallocate(size_ + 1);
      data_[size_++] = r;
    }
    void reserve(size_t n) {
      if (n > capacity_) Reallocate(n);
    }
    Replica* erase(Replica* pos) {
      std::copy(pos + 1, end(), pos);
      --size_;
      return pos;
    }

   private:
    void Reallocate(size_t capacity) {
      auto* d = new Replica[capacity];
      std::copy(begin(), end(), d);
      delete[] data_;
      data_ = d;
      capacity_ = static_cast<uint32_t>(capacity);
    }
    Replica* data_ = nullptr;
    uint32_t size_ = 0;
    uint32_t capacity_ = 0;
  };

  // A pending move of a replica (Replica::demote_id): its new range is allocated (not a
  // resident until DemoteDone), issued once handed to the node, with the node's deadline.
  struct Move {
    Segment* segment = nullptr;
    uint64_t offset = 0;
    uint64_t deadline_ns = 0;
    bool issued = false;
  };

  // What an object needs only for a while: a put in flight (its layout and deadline), a
  // repair (its timing and the destinations that failed). Allocated when first set (Extra()),
  // dropped when the object settles (TrimExtra), so a settled object pays 8 bytes for it.
  struct ObjectExtra {
    std::vector<ReplicaLocation> put_layout;  // as PutStart returned them, until complete
    uint64_t put_deadline_ns = 0;
    uint64_t repair_not_before_ns = 0;
    uint64_t repair_since_ns = 0;           // when it last joined repair_keys
    std::vector<std::string> failed_dests;  // node ids whose copy failed lately
    // A soft pin (PutOptions::soft_pin): until then, renewed by reads for soft_pin_ttl_ns.
    uint64_t soft_pin_until_ns = 0;
    uint64_t soft_pin_ttl_ns = 0;
  };

  // One object's record. Its buffer sizes and its key are stored in the same allocation, after
  // the fixed fields (New/Delete; neither copied nor moved), so a key is held once, by its
  // record, and the object table indexes records by it (ObjectTable). docs/performance.md,
  // "Master memory per object".
  struct Object {
    static Object* New(std::string_view key, std::span<const uint64_t> sizes) {
      const size_t bytes = sizeof(Object) + sizes.size() * sizeof(uint64_t) + key.size();
      void* p = ::operator new(bytes);
      Object* o = new (p) Object();
      o->key_len = static_cast<uint32_t>(key.size());
      o->n_sizes = static_cast<uint32_t>(sizes.size());
      std::copy(sizes.begin(), sizes.end(), o->SizesData());
      std::copy(key.begin(), key.end(), o->KeyData());
      return o;
    }
    static void Delete(Object* o) {
      o->~Object();
      ::operator delete(static_cast<void*>(o));
    }
    Object(const Object&) = delete;
    Object& operator=(const Object&) = delete;

    std::string_view key() const { return {KeyData(), key_len}; }
    std::span<const uint64_t> sizes() const { return {SizesData(), n_sizes}; }
    std::vector<uint64_t> SizesVector() const { return {SizesData(), SizesData() + n_sizes}; }
    // The key without its first n bytes (an overwrite taking its key's place). REQUIRES: not
    // in the object table while it changes.
    void DropKeyPrefix(size_t n) {
      std::copy(KeyData() + n, KeyData() + key_len, KeyData());
      key_len -= static_cast<uint32_t>(n);
    }

    ObjectExtra& Extra() {
      if (!extra) extra = std::make_unique<ObjectExtra>();
      return *extra;
    }
    uint64_t put_deadline_ns() const { return extra ? extra->put_deadline_ns : 0; }
    uint64_t repair_not_before_ns() const { return extra ? extra->repair_not_before_ns : 0; }
    uint64_t repair_since_ns() const { return extra ? extra->repair_since_ns : 0; }
    bool soft_pinned(uint64_t now_ns) const { return extra && extra->soft_pin_until_ns > now_ns; }
    uint64_t soft_pin_ttl_ns() const { return extra ? extra->soft_pin_ttl_ns : 0; }
    // Soft-pins it for ttl_ns from now (0: no soft pin).
    void SoftPinFor(uint64_t ttl_ns, uint64_t now_ns) {
      if (ttl_ns == 0) {
        if (extra) extra->soft_pin_until_ns = extra->soft_pin_ttl_ns = 0;
        return;
      }
      Extra().soft_pin_ttl_ns = ttl_ns;
      extra->soft_pin_until_ns = now_ns + ttl_ns;
    }
    // Drops the extra record once nothing in it is in use.
    void TrimExtra() {
      if (extra && extra->put_layout.empty() && extra->put_deadline_ns == 0 &&
          extra->repair_not_before_ns == 0 && extra->repair_since_ns == 0 &&
          extra->failed_dests.empty() && extra->soft_pin_ttl_ns == 0) {
        extra.reset();
      }
    }

    // The object's size: its buffers' sum (what each replica's range holds, rounded up).
    uint64_t bytes() const {
      uint64_t b = 0;
      for (uint64_t s : sizes()) b += s;
      return b;
    }

    uint64_t version = 0;
    uint64_t lease_expiry_ns = 0;
    uint64_t last_access_ns = 0;
    ReplicaList replicas;
    std::unique_ptr<ObjectExtra> extra;
    uint32_t checksum = 0;
    uint32_t ssd_reads = 0;  // reads served from an SSD replica since the last promotion
    uint32_t target = 1;
    ObjectState state = ObjectState::kPending;
    bool pinned = false;
    uint32_t key_len = 0;
    uint32_t n_sizes = 0;

   private:
    Object() = default;
    ~Object() = default;
    uint64_t* SizesData() { return reinterpret_cast<uint64_t*>(this + 1); }
    const uint64_t* SizesData() const { return reinterpret_cast<const uint64_t*>(this + 1); }
    char* KeyData() { return reinterpret_cast<char*>(SizesData() + n_sizes); }
    const char* KeyData() const { return reinterpret_cast<const char*>(SizesData() + n_sizes); }
  };
  static_assert(sizeof(Object) % alignof(uint64_t) == 0);

  // The object table: records indexed by their own key (no second copy of it), looked up by
  // string_view. It owns the records (Impl's destructor deletes what is left).
  struct ObjectKeyHash {
    using is_transparent = void;
    // Not noexcept, so the table caches each hash and a lookup hashes no other key.
    size_t operator()(std::string_view k) const { return std::hash<std::string_view>{}(k); }
    size_t operator()(const Object* o) const { return (*this)(o->key()); }
  };
  struct ObjectKeyEq {
    using is_transparent = void;
    static std::string_view K(std::string_view k) { return k; }
    static std::string_view K(const Object* o) { return o->key(); }
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      return K(a) == K(b);
    }
  };
  using ObjectTable = std::unordered_set<Object*, ObjectKeyHash, ObjectKeyEq>;

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

  // A Place call: what it asked, and what became of it (AdvancePlacement).
  struct Placement {
    std::string key;
    uint64_t version = 0;
    std::vector<std::string> targets;
    std::string move_from;
    PlacementStatus status;
  };

  explicit Impl(const MasterConfig& c)
      : cfg(c),
        rng(c.random_seed != 0 ? c.random_seed : std::random_device{}()),
        next_version(std::max<uint64_t>(1, c.first_version)),
        next_free_seq(std::max<uint64_t>(1, c.first_free_seq)),
        members(MembershipOptions{c.node_ttl_ms, c.pause_threshold_ms, c.start_ns}) {}
  ~Impl() {
    for (Object* o : objects) Object::Delete(o);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  MasterConfig cfg;
  std::mt19937_64 rng;
  mutable std::mutex mu;
  std::map<std::string, Node> nodes;  // by node id: one incarnation each
  ObjectTable objects;
  std::set<std::string, std::less<>> pending_keys;  // PENDING or COMMITTING objects
  std::set<std::string, std::less<>> repair_keys;   // objects to look at in the repair pass
  std::map<uint64_t, Task> tasks;
  std::vector<Held> held;
  std::unordered_map<uint64_t, Move> moves;  // by Replica::demote_id (fresh ids, never reused)
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
  // The key hashes of every departed copy as a Bloom filter (two bits of 16 per copy): a put
  // or remove of a key no departed node holds, nearly every one, skips the per-node searches,
  // which cost a put batch ~10 us per key with a dozen departed nodes of 50 k copies each.
  // Rebuilt whenever copies are added (DropNode) and when notes are dropped; a bit left by a
  // dropped note only costs a search. Empty: no departed copy.
  std::vector<uint64_t> departed_filter;
  void RebuildDepartedFilter();
  bool MayBeDeparted(uint64_t key_hash) const;
  // Notes dropped before their time by the caps (CapDeparted), and the latest reuse_after_ns
  // among them: a node coming back without its note waits at least that long.
  uint64_t departed_dropped_total = 0;
  uint64_t departed_dropped_reuse_after_ns = 0;
  uint64_t next_version;
  uint64_t next_replica_id = 1;
  uint64_t next_free_seq;
  uint64_t next_task_id = RandomTaskIdBase();
  std::map<uint64_t, Placement> placements;  // by id (Place)
  uint64_t next_placement_id = 1;
  uint64_t last_decay_ns = 0;
  uint64_t evictions_total = 0;
  uint64_t revokes_total = 0;
  uint64_t nodes_expired_total = 0;
  uint64_t bad_replicas_total = 0;
  uint64_t unreachable_reports_total = 0;
  uint64_t demotions_total = 0;
  uint64_t promotions_total = 0;
  // Who is in the cluster, their leases and the directory. Under `mu`, except Touch, which
  // records heartbeats under a lock of its own so that liveness never waits behind data-plane
  // work holding `mu` (Tick folds them in through Expire).
  Membership members;

  // ---------------------------------------------------------------- small helpers

  uint64_t RoundUp(uint64_t n) const { return (n + cfg.alignment - 1) & ~(cfg.alignment - 1); }

  Status CheckKey(std::string_view key) const {
    if (key.empty()) return Status::InvalidArgument("key is empty");
    if (key.front() == '\0') {
      return Status::InvalidArgument("key begins with a NUL byte (reserved for the master)");
    }
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

  // A live node's registration (its descriptor, control endpoint), from membership.
  const NodeRegistration& Registration(const Node& n) const {
    return members.Find(n.id())->registration;
  }

  Node* FindNodeExact(const NodeIdentity& id) {
    auto it = nodes.find(id.node_id);
    if (it == nodes.end() || it->second.id().incarnation != id.incarnation) return nullptr;
    return &it->second;
  }

  Object* FindObject(std::string_view key) const {
    auto it = objects.find(key);
    return it == objects.end() ? nullptr : *it;
  }
  // Puts a new record in the table. REQUIRES: no record has its key.
  Object* InsertObject(Object* o) {
    objects.insert(o);
    overwrites_in_table += o->key().starts_with(kOverwritePrefix);
    return o;
  }
  // Takes a record out of the table (the caller deletes or re-inserts it).
  void RemoveFromTable(Object* o) {
    objects.erase(objects.find(o->key()));
    overwrites_in_table -= o->key().starts_with(kOverwritePrefix);
  }
  // Records under an overwrite key (kOverwritePrefix): while there are none, a put need not
  // build and look up the overwrite key of every key it is given (FindOverwrite).
  size_t overwrites_in_table = 0;

  // An overwrite in flight (PutOptions::overwrite) is an object of its own in the table, under
  // its key behind this prefix, until its put end swaps it in under the key: every rule for
  // pending puts (deadlines, node deaths, revokes) applies to it unchanged while the old
  // version stays readable. CheckKey refuses keys that begin with a NUL byte, so no caller's
  // key can be one of these; the records nodes keep name the key itself (Record).
  static constexpr std::string_view kOverwritePrefix{"\0overwrite\0", 11};
  static std::string OverwriteKey(std::string_view key) {
    return std::string(kOverwritePrefix) + std::string(key);
  }
  static std::string_view PublicKey(std::string_view table_key) {
    return table_key.starts_with(kOverwritePrefix) ? table_key.substr(kOverwritePrefix.size())
                                                   : table_key;
  }
  // The object a put end or revoke of (key, version) is about: the key's overwrite in flight
  // when it has that version, else the key's object (whatever its version).
  Object* FindOverwrite(std::string_view key) const {
    return overwrites_in_table == 0 ? nullptr : FindObject(OverwriteKey(key));
  }
  Object* FindPut(std::string_view key, uint64_t version) {
    Object* o = FindObject(key);
    Object* w = FindOverwrite(key);
    return w && (!o || w->version == version) ? w : o;
  }

  // The pending move of r. REQUIRES: r.demote_id != 0.
  Move& MoveOf(const Replica& r) { return moves.at(r.demote_id); }
  const Move& MoveOf(const Replica& r) const { return moves.at(r.demote_id); }
  // Starts a move of r to [offset, ...) of `to` under a new replica id.
  void StartMove(Replica& r, Segment* to, uint64_t offset) {
    r.demote_id = next_replica_id++;
    moves[r.demote_id] = Move{to, offset, 0, false};
  }
  void EndMove(Replica& r) {
    moves.erase(r.demote_id);
    r.demote_id = 0;
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
    return {r.node->id(), r.segment->info.segment_id, r.offset, o.bytes(), r.segment->info.tier};
  }

  InventoryRecord Record(const Object& o, const Replica& r) const {
    return {std::string(PublicKey(o.key())),
            o.version,
            o.SizesVector(),
            o.checksum,
            r.segment->info.segment_id,
            r.offset,
            o.target,
            r.replica_id,
            o.pinned,
            o.soft_pin_ttl_ns() / 1'000'000};
  }

  // For a record a commit may have left on a node, unless it is (again) a live replica's: a
  // node that re-registered with it after the master dropped it.
  void QueueFreeIfRegistered(const NodeIdentity& id, const InventoryRecord& rec) {
    Node* n = FindNodeExact(id);
    if (!n) return;
    if (const Object* o = FindPut(rec.key, rec.version); o && o->version == rec.version) {
      for (const Replica& r : o->replicas) {
        if (r.replica_id == rec.replica_id) return;
      }
    }
    QueueFree(n, rec);
  }

  void QueueFree(Node* n, const InventoryRecord& rec) {
    n->frees.emplace_back(next_free_seq++, rec);
  }

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

  // Queues `o` for the repair pass, to be looked at `delay_ns` from now_ns.
  void MarkRepair(Object* o, uint64_t now_ns, uint64_t delay_ns = 0) {
    ObjectExtra& x = o->Extra();
    if (repair_keys.emplace(o->key()).second) x.repair_since_ns = now_ns;
    x.repair_not_before_ns = now_ns + delay_ns;
  }

  // Takes `o` out of the repair pass (its repair timing goes with it).
  void UnmarkRepair(Object* o) {
    if (auto it = repair_keys.find(o->key()); it != repair_keys.end()) repair_keys.erase(it);
    if (o->extra) {
      o->extra->repair_not_before_ns = 0;
      o->extra->repair_since_ns = 0;
      o->TrimExtra();
    }
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

  // ------------------------------------------------------ replica bookkeeping (master_state.cc)

  Replica& AddReplica(Object* o, Node* n, Segment* s, uint64_t offset, ReplicaState state,
                      uint64_t replica_id = 0);
  void CancelDemotion(Replica& r, uint64_t length, bool may_hold = true);
  static Segment* SsdSegment(Node& n);
  void Unreside(Object* o, Replica& r);
  void DetachReplica(Object* o, size_t idx);
  uint64_t HoldUntil(const Object& o, const Replica& r) const;
  void FreeRange(Node* n, Segment* s, uint64_t offset, uint64_t length,
                 const std::optional<InventoryRecord>& rec);
  void ReleaseReplica(Object* o, size_t idx, uint64_t now_ns, uint64_t hold_until_ns);
  void EraseTask(std::map<uint64_t, Task>::iterator it);
  void DropReplica(Object* o, size_t idx, uint64_t now_ns);
  // A copy task of `o` from `src` to [offset of] `dest`, whose range is allocated: the replica
  // (COPYING) and the task the source node gets with its next heartbeat.
  void CreateTask(Object* o, const Replica& src, Node* dest, Segment* segment, uint64_t offset,
                  uint64_t now_ns);
  // Moves a placement on: success once every target holds a complete replica (a move then
  // drops its source's), failure when the object is gone or a target's copy failed.
  void AdvancePlacement(Placement& p, uint64_t now_ns);
  void EraseObject(Object* o, uint64_t now_ns);

  // ----------------------------------------------- placement and eviction (master_placement.cc)

  uint64_t HighLimit(const Segment& s) const;
  uint64_t LowLimit(const Segment& s) const;
  Segment* FitSegment(Node& n, uint64_t bytes, bool repair);
  struct Choice {
    Node* node;
    Segment* segment;
  };
  static bool Placeable(const Node& n, uint64_t now_ns);
  std::vector<Choice> ChooseNodes(uint64_t now_ns, uint64_t bytes, size_t count,
                                  const Object* holder, const std::vector<std::string>* avoid,
                                  std::string_view preferred, bool repair = false);
  bool Evictable(const Object& o, uint64_t now_ns) const;
  Object* PickVictim(Segment& s, uint64_t now_ns);
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
  void MakeRoom(uint64_t bytes, size_t count, std::string_view preferred, uint64_t now_ns);

  // A range of `s` handed out to a writer at now_ns (MasterConfig::track_inflight): its chunks
  // stay in the published map for inflight_window_ms.
  void MarkInflight(Segment* s, uint64_t offset, uint64_t length, uint64_t now_ns) {
    if (!cfg.track_inflight || s->info.tier != Tier::kDram || length == 0) return;
    const uint64_t until = now_ns + MsToNs(cfg.inflight_window_ms);
    for (uint64_t c = offset / s->chunk_bytes;
         c <= (offset + length - 1) / s->chunk_bytes && c < 64; ++c) {
      s->chunk_until_ns[c] = std::max(s->chunk_until_ns[c], until);
      if ((s->published_chunks >> c & 1) == 0) inflight_grown = true;
    }
  }
  // A chunk was marked that the published maps lack (InflightToPublish(growth_only)).
  bool inflight_grown = false;

  // ----------------------------------------------------------- node lifecycle (master_nodes.cc)

  uint64_t ReuseHorizon(const Node* n) const;
  void ApplyMemberEvents(uint64_t now_ns);
  void DropNode(Node* n, uint64_t now_ns, bool expired);
  bool DrainDone(const Node& n, uint64_t now_ns) const;
  void CapDeparted();
  void ForgetDepartedCopies(std::string_view key);
  void ReserveInherited(Node& n, uint64_t now_ns);
  void LoadInventory(Node& n, const std::vector<InventoryRecord>& inventory, uint64_t now_ns,
                     RegisterReply& reply);

  // ----------------------------------------------------------------- SSD tier (master_tiers.cc)

  bool Demotable(const Object& o, const Replica& r) const;
  void ScheduleDemotions(uint64_t now_ns, TickSummary& sum);
  void MaybePromote(Object* o, Replica& r, uint64_t now_ns);
  void ExpireDemotions(uint64_t now_ns, TickSummary& sum);

  // ---------------------------------------------------------- re-replication (master_repair.cc)

  void FailTask(std::map<uint64_t, Task>::iterator it, uint64_t now_ns);
  const Replica* ChooseSource(const Object& o) const;
  void RepairOne(Object* o, uint64_t now_ns, TickSummary& summary);
  ReplicationTask TaskView(const Task& t) const;

  // ---------------------------------------------------------------- operations (master_puts.cc)

  // `replaces`: the complete version an overwrite replaces (its pins carry over).
  Result<PutAllocation> AllocateObject(const PutItem& item, uint64_t bytes,
                                       const PutOptions& options, uint64_t now_ns,
                                       const Object* replaces = nullptr);
  Status BeginPutEndOne(const PutEndItem& item, uint64_t now_ns, PutEndPlan& plan,
                        std::map<std::string, size_t>& commit_index);
  struct CommitEntry {
    const NodeCommit* commit;
    const InventoryRecord* record;
  };
  Status FinishPutEndOne(const KeyVersion& kv, const std::vector<CommitEntry>& entries,
                         uint64_t now_ns);
  void SwapInOverwrite(Object* w, uint64_t now_ns);
};

}  // namespace kvbridge::store
