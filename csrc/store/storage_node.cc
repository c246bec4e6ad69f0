#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/plugin_host.h"
#include "core/storage_instance.h"
#include "kvbridge.grpc.pb.h"
#include "kvbridge/store.h"
#include "obs/http_server.h"
#include "obs/metrics.h"
#include "store/local_nodes.h"
#include "store/master_client.h"
#include "store/master_ha.h"
#include "store/rpc_auth.h"
#include "store/rpc_util.h"
#include "util/checksum.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/logging.h"
#include "util/range_allocator.h"

namespace kvbridge {

NodeOptions NodeOptions::FromEnv() {
  using util::EnvNumber;
  using util::EnvString;
  NodeOptions o;
  o.engine = EngineOptions::FromEnv();
  EnvString("KVBRIDGE_MASTER", &o.master_address);
  EnvString("KVBRIDGE_NODE_STORAGE_PLUGIN", &o.storage_plugin);
  EnvString("KVBRIDGE_NODE_RPC_LISTEN", &o.rpc_listen);
  EnvNumber("KVBRIDGE_NODE_DRAM_BYTES", &o.dram_bytes);
  EnvNumber("KVBRIDGE_RPC_TIMEOUT_MS", &o.rpc_timeout_ms);
  EnvNumber("KVBRIDGE_DRAIN_TIMEOUT_MS", &o.drain_timeout_ms);
  EnvString("KVBRIDGE_NODE_SSD_PATH", &o.ssd_path);
  EnvString("KVBRIDGE_NODE_SSD_PLUGIN", &o.ssd_plugin);
  EnvNumber("KVBRIDGE_NODE_SSD_BYTES", &o.ssd_bytes);
  EnvNumber("KVBRIDGE_NODE_SSD_STAGING_BYTES", &o.ssd_staging_bytes);
  EnvString("KVBRIDGE_PEER_DISCOVERY", &o.peer_discovery);
  EnvNumber("KVBRIDGE_RPC_AUTH_SKEW_MS", &o.rpc_auth_skew_ms);
  EnvString("KVBRIDGE_NODE_FAULTS", &o.faults);
  EnvString("KVBRIDGE_METRICS_LISTEN", &o.metrics_listen);
  if (o.metrics_listen == "off") o.metrics_listen.clear();
  EnvString("KVBRIDGE_METRICS_TOKEN", &o.metrics_token);
  return o;
}

namespace {

using RangeKey = std::pair<uint64_t, uint64_t>;  // (segment id, offset)

// The storage nodes of this process by incarnation (store/local_nodes.h): listed once their
// service is up, unlisted first thing when they stop; an apply holds the lock shared, so the
// node outlives it.
struct LocalNode {
  std::string node_id;
  std::string cluster_token;
  std::function<Status(rpc::CommitRequest&, std::chrono::steady_clock::time_point)> apply;
  // ExpectLocalCommits: the ranges a put's commits will fill (true), or no longer (false).
  std::function<void(std::span<const std::pair<uint64_t, uint64_t>>, bool)> expect;
  std::function<void()> heartbeat_now;  // HeartbeatLocalNodesNow
};
std::shared_mutex& LocalNodesMu() {
  static auto* mu = new std::shared_mutex;  // never destroyed: nodes may outlive statics
  return *mu;
}
std::unordered_map<uint64_t, LocalNode>& LocalNodes() {
  static auto* nodes = new std::unordered_map<uint64_t, LocalNode>;
  return *nodes;
}

// The SSD tier's segment id: fixed, so the records of objects kept on SSD stay valid across
// node restarts (the DRAM pool's id is the engine's registration id, a small number).
constexpr uint64_t kSsdSegment = 0x5353440000000001ull;  // "SSD" ...
constexpr uint64_t kStagingAlign = 4096;
// The lease of a node's etcd key: a node that died drops out of the list a new leader waits
// for within this.
constexpr uint32_t kMembershipTtlS = 3;

uint64_t ObjectBytes(const rpc::InventoryRecord& r) {
  uint64_t n = 0;
  for (uint64_t s : r.sizes()) n += s;
  return n;
}

// What an SSD object carries besides its bytes: its inventory record without the key (the key
// is the object's key in the SSD plugin).
std::string MetaOf(const rpc::InventoryRecord& r) {
  rpc::InventoryRecord m = r;
  m.clear_key();
  return m.SerializeAsString();
}

// Reports to the master whose answer was lost (the call failed on the way, so the master may
// or may not have applied them), asked again in order: 200 ms after a first failure, then with
// the wait doubling to 5 s while the master does not answer. The master's handlers are
// idempotent, so a report that did arrive can safely arrive twice. One thread uses it.
template <typename Report>
class Unanswered {
 public:
  using Clock = std::chrono::steady_clock;
  bool empty() const { return q_.empty(); }
  Clock::time_point retry_at() const { return at_; }
  void Add(Report r) {
    q_.push_back(std::move(r));
    if (wait_ms_ == 0) Schedule();
  }
  // When due, sends the reports in order (`send` returns false while there is no answer),
  // stopping at the first that still gets none.
  template <typename Send>
  void RetryDue(Send send) {
    if (q_.empty() || Clock::now() < at_) return;
    while (!q_.empty() && send(q_.front())) q_.pop_front();
    Schedule();
  }

 private:
  void Schedule() {
    wait_ms_ = q_.empty() ? 0 : wait_ms_ == 0 ? 200 : std::min<uint32_t>(2 * wait_ms_, 5000);
    at_ = Clock::now() + std::chrono::milliseconds(wait_ms_);
  }
  std::deque<Report> q_;
  Clock::time_point at_;
  uint32_t wait_ms_ = 0;
};

}  // namespace

#define KVB_AUTH(ctx, method) KVB_RPC_AUTH(auth, ctx, method, "storage node")

struct StorageNode::Impl final : public rpc::Node::Service {
  NodeOptions options;
  std::atomic<uint32_t> task_delay_ms{0};  // NodeOptions::faults
  std::unique_ptr<TransferEngine> engine;
  std::unique_ptr<core::StorageInstance> storage;  // the DRAM pool's plugin
  char* pool = nullptr;
  uint64_t pool_bytes = 0;
  SegmentId segment = 0;

  std::unique_ptr<grpc::Server> server;
  std::string rpc_address;
  std::unique_ptr<store::RpcAuth> auth;  // checks calls to us (MasterClient signs ours)
  // From the master's RegisterNodeReply.node_secret (under mu): proves it is this node that
  // drains or deregisters itself.
  store::CallKey node_key;
  // Every call to the master; the heartbeat goes on a channel of its own (MasterClient).
  std::unique_ptr<store::MasterClient> master;
  std::atomic<uint32_t> heartbeat_interval_ms{1000};  // read by /health
  // The highest master term seen (RegisterNodeReply.term): replies and commits of a lower one
  // come from a master that was replaced, and are refused.
  std::atomic<uint64_t> master_term{0};
  // With an "etcd://" master: this node's key in etcd, which a new leader waits for.
  std::unique_ptr<store::NodeMembership> membership;
  std::unique_ptr<store::PeerDirectory> directory;  // task destinations' descriptors

  mutable std::mutex mu;
  std::condition_variable cv;
  std::map<RangeKey, rpc::InventoryRecord> inventory;
  // Tasks to run, each with its deadline: the master's, counted from before the heartbeat
  // that brought it was sent, so it is never later than the master's own.
  struct QueuedTask {
    store::NodeTask task;
    std::chrono::steady_clock::time_point deadline;
  };
  std::deque<QueuedTask> tasks;
  bool registered_once = false;  // a registration succeeded: later ones say registered_before
  bool stopping = false;
  bool draining = false;  // Drain() was called: say so when re-registering
  bool drained = false;
  bool superseded = false;
  bool heartbeat_now = false;  // the task loop wants more work without waiting an interval
  // The master has more queued for us (a reply said `more`) but what it sent is still being
  // applied (SSD frees): free_thread asks for the rest once its batch is done.
  bool more_after_frees = false;
  std::thread heartbeat_thread;
  std::thread task_thread;

  // --- SSD tier (ssd null: none) ---
  std::unique_ptr<core::StorageInstance> ssd;
  std::unique_ptr<char, void (*)(void*)> staging{nullptr, std::free};
  uint64_t staging_bytes = 0;
  SegmentId staging_segment = 0;
  std::mutex staging_mu;
  std::unique_ptr<util::RangeAllocator> staging_alloc;
  std::map<std::string, uint64_t> ssd_keys;  // key -> offset of its SSD record (under mu)
  // Changes of one SSD object (drop + plugin remove; drop + put + record) are serialized by its
  // key (KeyLock), since the plugin names objects by key alone; other keys go on meanwhile, so
  // a demotion writing one object holds up no free of another. Lock order: a key, then mu.
  std::mutex ssd_key_mu;
  std::condition_variable ssd_key_cv;
  std::set<std::string> ssd_busy_keys;  // under ssd_key_mu
  class KeyLock {
   public:
    KeyLock(Impl* im, std::string key) : im_(im), key_(std::move(key)) {
      std::unique_lock<std::mutex> l(im_->ssd_key_mu);
      im_->ssd_key_cv.wait(l, [&] { return im_->ssd_busy_keys.count(key_) == 0; });
      im_->ssd_busy_keys.insert(key_);
    }
    ~KeyLock() {
      {
        std::lock_guard<std::mutex> l(im_->ssd_key_mu);
        im_->ssd_busy_keys.erase(key_);
      }
      im_->ssd_key_cv.notify_all();
    }
    KeyLock(const KeyLock&) = delete;
    KeyLock& operator=(const KeyLock&) = delete;

   private:
    Impl* im_;
    std::string key_;
  };
  // SSD frees from the master, applied by free_thread: removing an object is a journal write and
  // an fdatasync, which the heartbeat thread must never wait for (a slow disk would cost the node
  // its TTL). Records queued here are no longer reported at registration (under mu).
  struct SsdFree {
    std::string key;
    uint64_t replica_id = 0;
    uint64_t seq = 0;  // the master's sequence number of the free
  };
  std::deque<SsdFree> ssd_frees;
  std::set<std::pair<std::string, uint64_t>> ssd_freeing;  // (key, replica_id) not yet applied
  std::thread free_thread;
  // Frees are acknowledged once applied (an SSD one once free_thread removed it): the master
  // sends each again until then (under mu). frees_received: the highest sequence number seen.
  uint64_t frees_received = 0;
  std::set<uint64_t> frees_unapplied;
  uint64_t FreesAcked() const {  // mu held
    return frees_unapplied.empty() ? frees_received
                                   : std::min(frees_received, *frees_unapplied.begin() - 1);
  }
  // Moves to run, with the time by which each must be reported (under mu).
  std::deque<std::pair<rpc::Demotion, std::chrono::steady_clock::time_point>> demotions;
  std::deque<std::string> evicted;  // keys the SSD plugin dropped (under mu)
  // SSD copies this node dropped after a read found them unreadable or damaged (under mu):
  // reported to the master by the demote loop, so it stops listing them at once rather than
  // at the next client read.
  std::deque<rpc::InventoryRecord> lost_ssd;
  std::thread demote_thread;
  Status ssd_status;  // OK: the tier runs; else why not

  // --- Commits applied by a store client of this process (store/local_nodes.h) ---
  // The master returns such a commit with its PutEnd answer, after the object became complete
  // there, so a free of one of its replicas can reach this node before the record: the frees
  // of the last kFreedKeptMs (at most kFreedKept of them) that found no record of their
  // replica here are remembered, and a commit of a replica among them is left out (a free that
  // found its record came after the commit, which is sent once). freed_since: every such free
  // received since then is among them (under mu); a commit whose PutEnd was sent before it is
  // refused (a PutEnd that took over 10 s while this node received such frees, or more than
  // kFreedKept of them within it).
  static constexpr uint64_t kFreedKeptMs = 10000;
  static constexpr size_t kFreedKept = 1 << 17;
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> freed_order;
  std::unordered_set<std::string> freed;
  std::chrono::steady_clock::time_point freed_since = std::chrono::steady_clock::now();
  static std::string FreedId(const std::string& key, uint64_t replica_id) {
    return key + '\0' + std::to_string(replica_id);
  }
  void RememberFree(const std::string& key, uint64_t replica_id);  // mu held
  // Whether a free of that replica is among those remembered; mu held. No allocation per
  // call: a commit asks it for each of its records.
  bool WasFreed(const std::string& key, uint64_t replica_id) {
    if (freed.empty()) return false;
    freed_probe.assign(key);
    freed_probe.push_back('\0');
    freed_probe.append(std::to_string(replica_id));
    return freed.count(freed_probe) != 0;
  }
  std::string freed_probe;  // WasFreed's key, its capacity kept; mu held
  void ForgetOldFrees();    // mu held: those past kFreedKeptMs, and the oldest past kFreedKept
  // The ranges (segment id, offset) that puts of this process are about to commit here through
  // their PutEnd answers (store::ExpectLocalCommits), with a count each: a free that finds no
  // record of its replica needs remembering only at one of them (under mu).
  std::map<RangeKey, uint32_t> expected_commits;
  void ExpectCommits(std::span<const std::pair<uint64_t, uint64_t>> ranges, bool expect) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& r : ranges) {
      if (expect) {
        ++expected_commits[r];
      } else if (auto it = expected_commits.find(r);
                 it != expected_commits.end() && --it->second == 0) {
        expected_commits.erase(it);
      }
    }
  }

  ~Impl() override;
  // This registration's secret (Drain, Deregister of itself).
  store::CallKey NodeKey() const {
    std::lock_guard<std::mutex> lock(mu);
    return node_key;
  }
  rpc::NodeIdentity Identity() const {
    rpc::NodeIdentity id;
    id.set_node_id(engine->self().node_id);
    id.set_incarnation(engine->self().incarnation);
    return id;
  }
  // The Commit call's work: the master's term and this incarnation checked, then the records
  // moved into the inventory (`req` is consumed). `local`: applied by a client of this
  // process (store::ApplyLocalCommit), which leaves out records of replicas freed since `sent`.
  Status ApplyCommit(rpc::CommitRequest& req, bool local = false,
                     std::chrono::steady_clock::time_point sent = {});
  // With the master; `again`: from the heartbeat thread, on its channel.
  Status Register(bool again = false);
  void ApplyFrees(const std::vector<store::InventoryRecord>& frees,
                  const std::vector<uint64_t>& seqs);
  void HeartbeatLoop();
  void TaskLoop();
  // Copies a batch of tasks' replicas with one engine batch; one status per task. SSD sources
  // are staged within a budget (ssd_staging_bytes): the staging area, or one object larger
  // than it; a task over it is not run and (*deferred)[i] set, for the next batch.
  std::vector<Status> RunTasks(const std::vector<QueuedTask>& batch, std::vector<bool>* deferred);
  bool ReportTask(const store::TaskReport& done);
  // Tells the master this node's copy at (segment_id, offset) is bad or gone; best effort.
  void ReportBadCopy(const std::string& key, uint64_t version, uint64_t segment_id,
                     uint64_t offset);
  void Stop();

  // SSD tier.
  // The SSD tier's plugin comes from `plugins`, the engine's host (no second scan).
  Status StartSsd(core::PluginHost& plugins);
  void OnEvict(std::string_view key);
  void DemoteLoop();
  // Reports a finished move and acts on the answer (drops the copy when it is not wanted).
  // False when no answer came (the call failed on the way): the master may or may not have
  // applied it, so the caller asks again later; DemoteDone is idempotent.
  bool ReportMove(const rpc::Demotion& d, const store::MoveReport& done, bool made);
  Status Demote(const rpc::Demotion& d);
  Status Promote(const rpc::Demotion& d);
  void DropSsdObject(const std::string& key, uint64_t replica_id);        // record + plugin object
  void DropSsdObjectLocked(const std::string& key, uint64_t replica_id);  // its KeyLock held
  void FreeLoop();                                                        // applies ssd_frees
  // Registered memory an SSD object was read into: a range of the staging area, or, for an
  // object larger than the whole area, memory of its own registered for the occasion.
  struct Staged {
    char* data = nullptr;
    uint64_t offset = 0;         // in the staging area (when temp_segment == 0)
    SegmentId temp_segment = 0;  // its own registration, else 0
    uint64_t temp_bytes = 0;     // the size of that memory
    std::unique_ptr<char, void (*)(void*)> temp{nullptr, std::free};
  };
  // Memory held beyond the staging area for objects larger than it (ReadToStaging), now and
  // at most (StorageNode::stats()).
  std::atomic<uint64_t> temp_staging_bytes{0};
  std::atomic<uint64_t> temp_staging_bytes_peak{0};
  // Reads an SSD object into registered memory (caller frees it with FreeStaging); checks the
  // record's checksum.
  Result<std::unique_ptr<Staged>> ReadToStaging(const rpc::InventoryRecord& rec);
  // Whether a ReadSsd may write to `client`: not this node's engine, and not a storage node
  // (name and incarnation) by the master's directory (asked once per client incarnation a minute;
  // refused if it cannot be asked). INVALID_ARGUMENT or PERMISSION_DENIED naming why not.
  Status CheckReadClient(const rpc::NodeIdentity& client);
  // StorageNode::stats().
  std::atomic<uint64_t> ssd_read_requests{0};
  std::atomic<uint64_t> frees_counted{0};  // StorageNodeStats::frees_received
  std::atomic<uint64_t> ssd_read_objects{0};
  std::atomic<uint64_t> ssd_read_batches{0};
  std::atomic<uint64_t> ssd_served_bytes{0};   // bytes ReadSsd wrote to clients
  std::atomic<uint64_t> ssd_demoted_bytes{0};  // bytes demotions wrote to the SSD tier
  std::mutex clients_mu;
  std::map<std::pair<std::string, uint64_t>, std::chrono::steady_clock::time_point> checked_clients;

  // --- observability (docs/operations.md) ---
  obs::Registry metrics;
  obs::Counter* heartbeat_failures = nullptr;
  obs::Counter* tasks_ok = nullptr;      // re-replication tasks reported done
  obs::Counter* tasks_failed = nullptr;  // and reported failed
  // util::MonoNs() of the last registration or heartbeat the master answered OK.
  std::atomic<uint64_t> last_contact_ns{0};
  std::string last_contact_error;  // why the last heartbeat failed; empty when it did not (mu)
  uint64_t start_ns = 0;
  std::unique_ptr<obs::HttpServer> http;  // null: no endpoint
  std::string metrics_address;
  // Node ids this node's engine sent data to (task destinations, ReadSsd clients), whose
  // paths' breakers /metrics reports; at most kMaxPeersReported, the first ones seen.
  static constexpr size_t kMaxPeersReported = 256;
  std::mutex peers_mu;
  std::set<std::string> peers_seen;
  void NotePeer(const std::string& node_id) {
    std::lock_guard<std::mutex> lock(peers_mu);
    if (peers_seen.size() < kMaxPeersReported) peers_seen.insert(node_id);
  }
  void SetUpMetrics();
  void Collect(obs::MetricWriter& w);
  obs::HttpResponse Health();  // client identity -> when the directory said it is no node
  void FreeStaging(Staged& s);

  grpc::Status Commit(grpc::ServerContext*, const rpc::CommitRequest* req,
                      rpc::Status* reply) override;
  grpc::Status ReadSsd(grpc::ServerContext*, const rpc::ReadSsdRequest* req,
                       rpc::ReadSsdReply* reply) override;
  grpc::Status Holds(grpc::ServerContext* ctx, const rpc::HoldsRequest* req,
                     rpc::HoldsReply* reply) override;
  grpc::Status Describe(grpc::ServerContext* ctx, const rpc::Empty*,
                        rpc::NodeDescriptor* reply) override {
    KVB_AUTH(ctx, store::method::kDescribe);
    *reply->mutable_node() = Identity();
    reply->set_engine_descriptor(engine->LocalDescriptor());
    reply->set_rpc_address(rpc_address);
    std::lock_guard<std::mutex> lock(mu);
    reply->set_inventory_records(inventory.size());
    return grpc::Status::OK;
  }
};

StorageNode::Impl::~Impl() {
  Stop();
  if (segment != 0 && engine) (void)engine->DeregisterMemory(segment);
  if (staging_segment != 0 && engine) (void)engine->DeregisterMemory(staging_segment);
  engine.reset();
  storage.reset();
  ssd.reset();
}

grpc::Status StorageNode::Impl::Commit(grpc::ServerContext* ctx, const rpc::CommitRequest* req,
                                       rpc::Status* reply) {
  KVB_AUTH(ctx, store::method::kCommit);
  rpc::CommitRequest records = *req;
  store::ToProto(ApplyCommit(records), reply);
  return grpc::Status::OK;
}

Status StorageNode::Impl::ApplyCommit(rpc::CommitRequest& req, bool local,
                                      std::chrono::steady_clock::time_point sent) {
  if (const uint64_t seen = master_term.load(); req.term() < seen) {
    return Status::StalePeer("commit from a replaced master (term " + std::to_string(req.term()) +
                             ", this node follows term " + std::to_string(seen) + ")");
  }
  if (req.node().node_id() != engine->self().node_id ||
      req.node().incarnation() != engine->self().incarnation) {
    return Status::StalePeer("commit meant for another incarnation");
  }
  std::lock_guard<std::mutex> lock(mu);
  if (local) {
    if (stopping) return Status::Unavailable("storage node stopped");
    ForgetOldFrees();
    if (sent < freed_since) {
      return Status::Unavailable(
          "the commit's put was sent before the oldest free this node still remembers: it "
          "cannot tell whether one of its replicas was freed meanwhile");
    }
  }
  for (const auto& r : req.records()) {
    if (r.segment_id() != segment && !(ssd != nullptr && r.segment_id() == kSsdSegment)) {
      return Status::NotRegistered("commit names segment " + std::to_string(r.segment_id()) +
                                   ", not this node's");
    }
  }
  for (rpc::InventoryRecord& r : *req.mutable_records()) {
    if (local && WasFreed(r.key(), r.replica_id())) continue;  // removed since
    if (r.segment_id() == kSsdSegment) ssd_keys[r.key()] = r.offset();
    inventory[{r.segment_id(), r.offset()}] = std::move(r);
  }
  return Status::OK();
}

void StorageNode::Impl::ForgetOldFrees() {
  const auto now = std::chrono::steady_clock::now();
  const auto keep = std::chrono::milliseconds(kFreedKeptMs);
  while (!freed_order.empty() &&
         (now - freed_order.front().first > keep || freed_order.size() >= kFreedKept)) {
    freed_since = std::max(freed_since, freed_order.front().first);
    freed.erase(freed_order.front().second);
    freed_order.pop_front();
  }
}

void StorageNode::Impl::RememberFree(const std::string& key, uint64_t replica_id) {
  ForgetOldFrees();
  std::string id = FreedId(key, replica_id);
  if (freed.insert(id).second)
    freed_order.emplace_back(std::chrono::steady_clock::now(), std::move(id));
}

// A client reading without the master asks which of the replicas it remembers are still here:
// the record at the same place, of the same key and version, and not on its way out (an SSD
// free queued). Frees the master decided and this node has not heard of yet are not known
// here (docs/store.md "Reads while the master is away").
grpc::Status StorageNode::Impl::Holds(grpc::ServerContext* ctx, const rpc::HoldsRequest* req,
                                      rpc::HoldsReply* reply) {
  KVB_AUTH(ctx, store::method::kHolds);
  if (req->node().node_id() != engine->self().node_id ||
      req->node().incarnation() != engine->self().incarnation) {
    store::ToProto(Status::StalePeer("holds asked of another incarnation of this node"),
                   reply->mutable_status());
    return grpc::Status::OK;
  }
  std::lock_guard<std::mutex> lock(mu);
  for (const rpc::InventoryRecord& q : req->records()) {
    auto it = inventory.find({q.segment_id(), q.offset()});
    bool held =
        it != inventory.end() && it->second.key() == q.key() && it->second.version() == q.version();
    if (held && q.segment_id() == kSsdSegment) {
      held = ssd_freeing.count({q.key(), it->second.replica_id()}) == 0;
    }
    reply->add_held(held);
  }
  store::ToProto(Status::OK(), reply->mutable_status());
  return grpc::Status::OK;
}

Status StorageNode::Impl::Register(bool again) {
  store::NodeRegistration reg;
  std::vector<store::InventoryRecord> records;
  reg.identity = {engine->self().node_id, engine->self().incarnation};
  reg.engine_descriptor = engine->LocalDescriptor();
  reg.control_endpoint = rpc_address;
  reg.segments.push_back({segment, pool_bytes, store::Tier::kDram});
  if (ssd != nullptr) reg.segments.push_back({kSsdSegment, options.ssd_bytes, store::Tier::kSsd});
  {
    std::lock_guard<std::mutex> lock(mu);
    reg.draining = draining;
    reg.registered_before = registered_once;
    for (const auto& [k, r] : inventory) {
      // A free still on its way to the disk: the master dropped that record already.
      if (k.first == kSsdSegment && ssd_freeing.count({r.key(), r.replica_id()}) != 0) continue;
      records.push_back(store::RecordFromProto(r));
    }
  }
  Result<store::NodeRegistered> registered = master->Register(reg, records, again);
  if (!registered.ok()) return registered.status();
  const store::NodeRegistered& reply = *registered;
  if (const uint64_t seen = master_term.load(); reply.term < seen) {
    master->ForgetLeader(master->leader_address());
    return Status::Unavailable("RegisterNode answered by a replaced master (term " +
                               std::to_string(reply.term) + ", this node follows term " +
                               std::to_string(seen) + ")");
  }
  master_term.store(reply.term);
  {
    std::lock_guard<std::mutex> lock(mu);
    registered_once = true;
    last_contact_error.clear();
  }
  last_contact_ns.store(util::MonoNs());
  if (reply.heartbeat_interval_ms > 0) heartbeat_interval_ms = reply.heartbeat_interval_ms;
  {
    std::lock_guard<std::mutex> lock(mu);
    node_key = store::CallKey(reply.node_secret, store::kNodeKeyPurpose);
  }
  // Demotions are handed out in heartbeat replies: a node with an SSD tier asks often, so DRAM
  // pressure turns into SSD writes within a fraction of a second.
  if (ssd != nullptr) heartbeat_interval_ms = std::min<uint32_t>(heartbeat_interval_ms.load(), 200);
  ApplyFrees(reply.frees, reply.free_seqs);
  if (reply.more) {
    std::lock_guard<std::mutex> lock(mu);
    heartbeat_now = true;  // the rest of the frees come in heartbeat replies
  }
  return Status::OK();
}

// Runs on the heartbeat thread: memory only. SSD frees go to free_thread.
//
// A reply carries up to the master's max_frees_per_reply (4,096) frees, and emptying a large
// pool sends them back to back. They are applied kFreesPerLock at a time, `mu` released in
// between, so that a put's commit into this node (which needs `mu`) may take it between two
// slices rather than wait for a whole reply (std::mutex promises no turn, so this shortens the
// wait rather than bounding it): applying 4,096 at once held `mu` for about 10 ms on the
// project's test VM, and embedded puts in the second after a large remove waited up to that
// long. A
// commit that comes between two slices is ordered as one that came before the reply: a later
// free of its replica still erases it (the exact replica), an earlier one keeps it out.
void StorageNode::Impl::ApplyFrees(const std::vector<store::InventoryRecord>& frees,
                                   const std::vector<uint64_t>& seqs) {
  constexpr size_t kFreesPerLock = 256;
  std::unique_lock<std::mutex> lock(mu);
  bool queued = false;
  for (size_t i = 0; i < frees.size(); ++i) {
    if (i != 0 && i % kFreesPerLock == 0) {
      lock.unlock();
      lock.lock();
    }
    const store::InventoryRecord& f = frees[i];
    const uint64_t seq = i < seqs.size() ? seqs[i] : 0;
    if (seq != 0 && seq <= frees_received) continue;  // sent again before our ack arrived
    frees_received = std::max(frees_received, seq);
    frees_counted.fetch_add(1, std::memory_order_relaxed);
    if (f.segment_id == kSsdSegment) {
      RememberFree(f.key, f.replica_id);
      if (ssd == nullptr) continue;  // no tier: nothing of it here
      ssd_frees.push_back({f.key, f.replica_id, seq});
      ssd_freeing.emplace(f.key, f.replica_id);
      if (seq != 0) frees_unapplied.insert(seq);
      queued = true;
      continue;
    }
    // Only the exact record: the range may already hold a newer object whose commit
    // overtook this free. Found, its commit was applied, and the master sends a replica's
    // commit once (a PutEnd sent again finds no pending put): nothing to remember. Not found,
    // the commit may still be on its way with a PutEnd answer, and must be left out then;
    // it can be only where a put of this process expects to commit (expected_commits, set
    // before its PutEnd is sent, so before the master can free what it commits). Elsewhere
    // (a range already reused by a later object, a commit that was refused, a node whose
    // commits all come from the master) there is nothing to remember.
    auto it = inventory.find({f.segment_id, f.offset});
    if (it != inventory.end() && it->second.replica_id() == f.replica_id) {
      inventory.erase(it);
    } else if (expected_commits.count({f.segment_id, f.offset}) != 0) {
      RememberFree(f.key, f.replica_id);
    }
  }
  if (queued) cv.notify_all();
}

void StorageNode::Impl::FreeLoop() {
  // Up to this many removes run side by side: the SSD plugin's group commit then covers many
  // with one journal fdatasync, where one at a time would cost a sync each.
  constexpr size_t kWorkers = 64;
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    cv.wait(lock, [&] { return stopping || !ssd_frees.empty(); });
    if (stopping) return;
    std::vector<SsdFree> batch(std::make_move_iterator(ssd_frees.begin()),
                               std::make_move_iterator(ssd_frees.end()));
    ssd_frees.clear();
    lock.unlock();
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t k; (k = next++) < batch.size();) {
        DropSsdObject(batch[k].key, batch[k].replica_id);
      }
    };
    std::vector<std::thread> workers;
    for (size_t w = 1; w < std::min(kWorkers, batch.size()); ++w) workers.emplace_back(work);
    work();
    for (auto& t : workers) t.join();
    lock.lock();
    for (const SsdFree& f : batch) {
      ssd_freeing.erase({f.key, f.replica_id});
      frees_unapplied.erase(f.seq);
    }
    if (more_after_frees) {
      more_after_frees = false;
      heartbeat_now = true;
      cv.notify_all();
    }
  }
}

void StorageNode::Impl::DropSsdObject(const std::string& key, uint64_t replica_id) {
  KeyLock key_lock(this, key);
  DropSsdObjectLocked(key, replica_id);
}

void StorageNode::Impl::DropSsdObjectLocked(const std::string& key, uint64_t replica_id) {
  {
    std::lock_guard<std::mutex> lock(mu);
    auto k = ssd_keys.find(key);
    if (k == ssd_keys.end()) return;
    auto it = inventory.find({kSsdSegment, k->second});
    if (it == inventory.end() || it->second.key() != key ||
        (replica_id != 0 && it->second.replica_id() != replica_id)) {
      return;
    }
    inventory.erase(it);
    ssd_keys.erase(k);
  }
  Status st = ssd->Remove(key);
  if (!st.ok() && !st.IsNotFound()) {
    KVB_LOG(WARN) << "SSD tier: removing an object failed: " << st.ToString();
  }
}

void StorageNode::Impl::HeartbeatLoop() {
  std::unique_lock<std::mutex> lock(mu);
  while (!stopping) {
    cv.wait_for(lock, std::chrono::milliseconds(heartbeat_interval_ms.load()),
                [&] { return stopping || heartbeat_now; });
    if (stopping) break;
    heartbeat_now = false;
    const uint64_t frees_acked = FreesAcked();
    lock.unlock();
    // Deadlines in the reply count from when the master answered: from here they are never
    // later than the master's.
    const auto sent_at = std::chrono::steady_clock::now();
    Result<store::HeartbeatAnswer> beat = master->Heartbeat(engine->self(), frees_acked);
    if (beat.ok() && beat->term < master_term.load()) {
      // A replaced master answered (it was frozen and resumed): nothing it says is applied.
      beat = Status::Unavailable("heartbeat answered by a replaced master (term " +
                                 std::to_string(beat->term) + ", this node follows term " +
                                 std::to_string(master_term.load()) + ")");
      master->ForgetLeader(master->leader_address());
    }
    Status st = beat.status();
    const store::HeartbeatAnswer reply =
        beat.ok() ? std::move(beat).value() : store::HeartbeatAnswer();
    if (st.IsNotFound()) {
      // The master does not know us (it restarted): register again with our inventory.
      Status reg = Register(/*again=*/true);
      if (!reg.ok()) {
        KVB_LOG(WARN) << "re-registration failed: " << reg.ToString();
        heartbeat_failures->Inc();
        std::lock_guard<std::mutex> relock(mu);
        last_contact_error =
            "the master lost track of this node, and registering again failed: " + reg.ToString();
      } else
        KVB_LOG(INFO) << "re-registered with the master after it lost track of this node";
    } else if (st.IsStalePeer()) {
      KVB_LOG(ERROR) << "the master knows another incarnation of node " << engine->self().node_id
                     << "; this one stops serving";
      lock.lock();
      superseded = true;
      cv.notify_all();
      continue;
    } else if (!st.ok()) {
      KVB_LOG(WARN) << "heartbeat: " << st.ToString();
    } else {
      last_contact_ns.store(util::MonoNs());
      ApplyFrees(reply.frees, reply.free_seqs);
    }
    if (!st.ok() && !st.IsNotFound()) heartbeat_failures->Inc();
    lock.lock();
    if (st.ok()) {
      last_contact_error.clear();
    } else if (!st.IsNotFound()) {
      last_contact_error = st.ToString();
    }
    if (st.ok()) {
      for (const store::NodeTask& t : reply.tasks) {
        tasks.push_back({t, sent_at + std::chrono::milliseconds(t.timeout_ms)});
      }
      for (const store::NodeMove& m : reply.moves) {
        // Kept in the Node service's form: its records go into the inventory as they are.
        rpc::Demotion d;
        *d.mutable_source() = store::RecordToProto(m.source);
        *d.mutable_dest() = store::RecordToProto(m.dest);
        d.set_timeout_ms(m.timeout_ms);
        demotions.emplace_back(std::move(d), sent_at + std::chrono::milliseconds(m.timeout_ms));
      }
      if (reply.drained) drained = true;
      if (reply.more) {
        // The master holds more for us than one reply carries: ask at once if this reply
        // moved anything forward; frees still on their way to the SSD would only come again,
        // so then free_thread asks once it has applied them.
        if (FreesAcked() > frees_acked || !reply.tasks.empty() || !reply.moves.empty()) {
          heartbeat_now = true;
        } else {
          more_after_frees = true;
        }
      }
      cv.notify_all();
    }
  }
}

std::vector<Status> StorageNode::Impl::RunTasks(const std::vector<QueuedTask>& batch,
                                                std::vector<bool>* deferred) {
  using Clock = std::chrono::steady_clock;
  std::vector<Status> result(batch.size());
  deferred->assign(batch.size(), false);
  // Before, every SSD source of a batch was staged before the transfer, and each object larger
  // than the staging area got full-size memory of its own: a batch of such objects after a
  // node loss held all of them at once.
  bool staged_large = false;                    // an object larger than the staging area is staged
  std::vector<std::unique_ptr<Staged>> staged;  // SSD sources, freed when the batch ends
  struct FreeStaged {
    Impl* im;
    std::vector<std::unique_ptr<Staged>>* v;
    ~FreeStaged() {
      for (auto& s : *v) im->FreeStaging(*s);
    }
  } free_staged{this, &staged};
  std::vector<TransferOp> ops;
  std::vector<size_t> task_of_op;
  std::vector<std::string> dest_ids(batch.size());
  std::optional<Clock::time_point> deadline;  // the earliest of the batch's tasks
  // The task carries the master's entry for its destination; in direct discovery the
  // destination is asked once per batch (the answer, or the failure, is reused for its other
  // tasks), and not at all while it is backing off (PeerDirectory).
  std::map<std::pair<std::string, uint64_t>, Result<std::string>> described;
  for (size_t i = 0; i < batch.size(); ++i) {
    const store::NodeTask& task = batch[i].task;
    // Past its deadline the master has given the destination range up: write nothing there.
    if (Clock::now() >= batch[i].deadline) {
      result[i] = Status::DeadlineExceeded("task reached the node past its deadline; not run");
      continue;
    }
    std::string descriptor;
    {
      const store::NodeIdentity& dn = task.dest.node;
      auto d = described.find({dn.node_id, dn.incarnation});
      if (d == described.end()) {
        const store::NodeEntry listed{PeerId{dn.node_id, dn.incarnation}, task.dest_descriptor,
                                      task.dest_rpc_address};
        d = described.emplace(std::pair{dn.node_id, dn.incarnation}, directory->Descriptor(listed))
                .first;
      }
      if (!d->second.ok()) {
        result[i] = d->second.status().WithContext("asking the destination for its descriptor");
        continue;
      }
      descriptor = d->second.value();
    }
    // The destination must be the node the master named: a descriptor naming another
    // process (or moving a known one) would send the copy there.
    const PeerId named{task.dest.node.node_id, task.dest.node.incarnation};
    AddPeerOptions expect;
    expect.expect = &named;
    Result<PeerId> dest = engine->AddPeer(descriptor, expect);
    if (!dest.ok()) {
      result[i] = dest.status().WithContext("destination descriptor");
      continue;
    }
    const store::ReplicaLocation& src = task.source;
    char* local = nullptr;
    if (ssd != nullptr && src.segment_id == kSsdSegment) {
      // An SSD replica: read it into staging first, then write from there.
      rpc::InventoryRecord rec;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto it = inventory.find({kSsdSegment, src.offset});
        if (it != inventory.end()) rec = it->second;
      }
      if (rec.key() != task.key || rec.version() != task.version ||
          ObjectBytes(rec) != src.length) {
        result[i] = Status::NotFound("task source is not on this node's SSD tier");
        continue;
      }
      // Within the budget: an object larger than the staging area only alone, and the others
      // while the area has room; the rest waits for the next batch.
      const bool large = ObjectBytes(rec) > staging_bytes;
      if (staged_large || (large && !staged.empty())) {
        (*deferred)[i] = true;
        continue;
      }
      Result<std::unique_ptr<Staged>> got = ReadToStaging(rec);
      if (!got.ok()) {
        if (got.status().Is(StatusCode::kBackpressure) && !staged.empty()) {
          (*deferred)[i] = true;  // the area is full with this batch's sources
          continue;
        }
        result[i] = got.status();
        continue;
      }
      staged_large = large;
      local = got.value()->data;
      staged.push_back(std::move(got).value());
    } else if (src.segment_id != segment || src.offset > pool_bytes ||
               src.length > pool_bytes - src.offset) {
      result[i] = Status::OutOfBounds("task source range is not inside this node's pool");
      continue;
    } else {
      local = pool + src.offset;
      // A damaged DRAM source is reported, not spread: the copy would pass for good at the
      // destination until a reader checked it, and might be the last one left by then.
      if (util::Crc32c(local, src.length) != task.checksum) {
        result[i] = Status::IoError("task source does not match the object's checksum; not copied");
        ReportBadCopy(task.key, task.version, src.segment_id, src.offset);
        continue;
      }
    }
    if (src.length != task.dest.length) {
      result[i] = Status::InvalidArgument("task source and destination lengths differ");
      continue;
    }
    dest_ids[i] = dest->node_id;
    NotePeer(dest->node_id);
    if (!deadline || batch[i].deadline < *deadline) deadline = batch[i].deadline;
    ops.push_back(TransferOp{OpCode::kWrite, local, src.length, dest_ids[i], task.dest.segment_id,
                             task.dest.offset});
    task_of_op.push_back(i);
  }
  if (ops.empty()) return result;
  // The transfer ends by the earliest deadline of the batch (describing destinations and
  // reading SSD sources took some of it): nothing is sent after the master gave up.
  const int64_t left_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now()).count();
  if (left_ms <= 0) {
    for (size_t i : task_of_op) {
      result[i] = Status::DeadlineExceeded("task deadline passed before its transfer started");
    }
    return result;
  }
  SubmitOptions so;
  so.deadline_ms = static_cast<uint32_t>(std::min<int64_t>(left_ms, UINT32_MAX));
  Result<BatchId> id = engine->Submit(ops, so);
  if (!id.ok()) {
    for (size_t i : task_of_op) result[i] = id.status();
    return result;
  }
  BatchResult r = engine->Wait(id.value());
  for (size_t k = 0; k < ops.size(); ++k) result[task_of_op[k]] = r.op_status[k];
  return result;
}

void StorageNode::Impl::ReportBadCopy(const std::string& key, uint64_t version, uint64_t segment_id,
                                      uint64_t offset) {
  master->ReportBadReplica({key, version, engine->self(), segment_id, offset, false});
}

// False when no answer came (the call failed on the way): ask again later.
bool StorageNode::Impl::ReportTask(const store::TaskReport& done) {
  Status answer;
  Status call = master->TaskDone(done, &answer);
  if (call.ok()) (done.status.ok() ? tasks_ok : tasks_failed)->Inc();
  if (!call.ok()) {
    KVB_LOG(WARN) << call.ToString() << " (task " << done.task_id << "; asking again)";
  }
  // Any answer settles it (NOT_FOUND: the first report arrived, or the master gave the task up).
  return call.ok();
}

void StorageNode::Impl::TaskLoop() {
  // A TaskDone without an answer is asked again; the master would otherwise give the task up
  // only at its deadline (task_timeout_ms) and copy the object once more.
  Unanswered<store::TaskReport> unanswered;
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    auto work = [&] { return stopping || !tasks.empty(); };
    if (unanswered.empty()) {
      cv.wait(lock, work);
    } else {
      cv.wait_until(lock, unanswered.retry_at(), work);
    }
    if (stopping) return;
    if (tasks.empty()) {  // only retries are due
      lock.unlock();
      unanswered.RetryDue([&](const store::TaskReport& d) { return ReportTask(d); });
      lock.lock();
      continue;
    }
    // Everything queued goes out as one transfer batch: re-replication after a node loss moves
    // thousands of objects, and one engine batch per object would serialize them.
    std::vector<QueuedTask> batch(std::make_move_iterator(tasks.begin()),
                                  std::make_move_iterator(tasks.end()));
    tasks.clear();
    lock.unlock();
    if (const uint32_t delay = task_delay_ms.load(); delay > 0) {
      KVB_LOG(WARN) << "fault injection: " << batch.size() << " task(s) wait " << delay << " ms";
      std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    }
    std::vector<bool> deferred;
    std::vector<Status> statuses = RunTasks(batch, &deferred);
    std::vector<QueuedTask> later;  // over the staging budget: first in the next batch
    for (size_t i = 0; i < batch.size(); ++i) {
      if (deferred[i]) {
        later.push_back(std::move(batch[i]));
        continue;
      }
      store::TaskReport done{engine->self(), batch[i].task.task_id, statuses[i]};
      if (!ReportTask(done)) unanswered.Add(std::move(done));
    }
    unanswered.RetryDue([&](const store::TaskReport& d) { return ReportTask(d); });
    lock.lock();
    tasks.insert(tasks.begin(), std::make_move_iterator(later.begin()),
                 std::make_move_iterator(later.end()));
    heartbeat_now = true;  // ask for the next tasks now, not an interval from now
    cv.notify_all();
  }
}

// ---------------------------------------------------------------- SSD tier

Status StorageNode::Impl::StartSsd(core::PluginHost& plugins) {
  core::StorageConfig config;
  config.node_id = engine->self().node_id;
  config.capacity_bytes = options.ssd_bytes;
  config.path = options.ssd_path;
  config.on_evict = [this](std::string_view key) { OnEvict(key); };
  config.plugin_config = options.engine.plugin_config;
  config.require_caps = KVB_SCAP_OBJECTS;
  config.require_meta = true;
  Result<std::unique_ptr<core::StorageInstance>> created =
      plugins.CreateStorage(options.ssd_plugin, config);
  if (!created.ok()) return created.status();
  ssd = std::move(created).value();
  // Staging: registered, aligned host memory that SSD reads land in before they are sent.
  staging_bytes = std::max<uint64_t>(options.ssd_staging_bytes, kStagingAlign);
  staging_bytes = (staging_bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
  staging.reset(static_cast<char*>(std::aligned_alloc(kStagingAlign, staging_bytes)));
  if (!staging) return Status::NoSpace("cannot allocate the SSD staging buffer");
  Result<SegmentId> seg = engine->RegisterMemory(staging.get(), staging_bytes);
  if (!seg.ok()) return seg.status().WithContext("registering the SSD staging buffer");
  staging_segment = seg.value();
  staging_alloc = std::make_unique<util::RangeAllocator>(staging_bytes, kStagingAlign);
  // What survived on SSD: its records go into the inventory the master will see.
  struct Ctx {
    Impl* im;
    size_t bad = 0;
  } ctx{this};
  auto visit = [&ctx](std::string_view key, uint64_t length, std::string_view meta) {
    rpc::InventoryRecord r;
    if (!r.ParseFromArray(meta.data(), static_cast<int>(meta.size())) || ObjectBytes(r) != length) {
      ++ctx.bad;
      return;
    }
    r.set_key(std::string(key));
    r.set_segment_id(kSsdSegment);
    ctx.im->inventory[{kSsdSegment, r.offset()}] = r;
    ctx.im->ssd_keys[r.key()] = r.offset();
  };
  Status listed;
  {
    std::lock_guard<std::mutex> lock(mu);
    listed = ssd->ForEachMeta(visit);
  }
  if (!listed.ok()) return listed.WithContext("listing the SSD tier's objects");
  if (ctx.bad > 0) {
    KVB_LOG(WARN) << "SSD tier: " << ctx.bad << " objects without a usable record were ignored";
  }
  KVB_LOG(INFO) << "SSD tier at " << options.ssd_path << ": " << ssd_keys.size()
                << " objects kept from before";
  return Status::OK();
}

void StorageNode::Impl::OnEvict(std::string_view key) {
  std::lock_guard<std::mutex> lock(mu);
  evicted.emplace_back(key);
  cv.notify_all();
}

Result<std::unique_ptr<StorageNode::Impl::Staged>> StorageNode::Impl::ReadToStaging(
    const rpc::InventoryRecord& rec) {
  const uint64_t bytes = ObjectBytes(rec);
  auto out = std::make_unique<Staged>();
  if (bytes > staging_bytes) {
    // Larger than the whole staging area: memory of its own, registered for this read.
    const uint64_t n = (bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
    out->temp.reset(static_cast<char*>(std::aligned_alloc(kStagingAlign, n)));
    if (!out->temp) return Status::NoSpace("cannot allocate " + std::to_string(n) + " bytes");
    Result<SegmentId> seg = engine->RegisterMemory(out->temp.get(), n);
    if (!seg.ok()) return seg.status().WithContext("registering a large SSD read");
    out->temp_segment = seg.value();
    out->temp_bytes = n;
    out->data = out->temp.get();
    const uint64_t now = temp_staging_bytes.fetch_add(n) + n;
    uint64_t peak = temp_staging_bytes_peak.load();
    while (now > peak && !temp_staging_bytes_peak.compare_exchange_weak(peak, now)) {
    }
  } else {
    std::optional<uint64_t> off;
    {
      std::lock_guard<std::mutex> lock(staging_mu);
      off = staging_alloc->Allocate(std::max<uint64_t>(bytes, 1));
    }
    if (!off) {
      return Status::Backpressure("SSD staging is full (" + std::to_string(staging_bytes) +
                                  " bytes; KVBRIDGE_NODE_SSD_STAGING_BYTES)");
    }
    out->offset = *off;
    out->data = staging.get() + *off;
  }
  kvb_iovec_t iov{out->data, bytes};
  uint64_t length = 0;
  Status st = ssd->Get(rec.key(), {&iov, 1}, &length);
  Status bad;
  if (!st.ok()) {
    bad = st.WithContext("SSD tier: SSD read");
  } else if (length != bytes || util::Crc32c(out->data, bytes) != rec.checksum()) {
    bad = Status::IoError("SSD copy does not match the object's checksum");
  }
  if (!bad.ok()) {
    FreeStaging(*out);
    if (!st.Is(StatusCode::kBackpressure)) {
      DropSsdObject(rec.key(), rec.replica_id());
      std::lock_guard<std::mutex> lock(mu);
      lost_ssd.push_back(rec);
      cv.notify_all();
    }
    return bad;
  }
  return out;
}

void StorageNode::Impl::FreeStaging(Staged& s) {
  if (s.temp_segment != 0) {
    (void)engine->DeregisterMemory(s.temp_segment);
    s.temp_segment = 0;
    s.temp.reset();
    temp_staging_bytes.fetch_sub(s.temp_bytes);
    s.temp_bytes = 0;
  } else if (s.data != nullptr) {
    std::lock_guard<std::mutex> lock(staging_mu);
    staging_alloc->Free(s.offset);
  }
  s.data = nullptr;
}

Status StorageNode::Impl::Demote(const rpc::Demotion& d) {
  const rpc::InventoryRecord& src = d.source();
  const uint64_t bytes = ObjectBytes(src);
  if (src.segment_id() == kSsdSegment) return Promote(d);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = inventory.find({src.segment_id(), src.offset()});
    if (src.segment_id() != segment || it == inventory.end() ||
        it->second.replica_id() != src.replica_id() || src.offset() > pool_bytes ||
        bytes > pool_bytes - src.offset()) {
      return Status::NotFound("the replica to demote is not in this node's pool");
    }
  }
  if (util::Crc32c(pool + src.offset(), bytes) != src.checksum()) {
    ReportBadCopy(src.key(), src.version(), src.segment_id(), src.offset());
    return Status::IoError("the DRAM replica does not match its checksum; not demoted");
  }
  KeyLock key_lock(this, src.key());
  DropSsdObjectLocked(src.key(), 0);  // an older copy of the key (one replica per node and key)
  const std::string meta = MetaOf(d.dest());
  kvb_iovec_t iov{pool + src.offset(), bytes};
  Status st = ssd->PutMeta(src.key(), {&iov, 1}, meta);
  if (!st.ok()) return st.WithContext("SSD tier: SSD write");
  ssd_demoted_bytes.fetch_add(bytes, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu);
  inventory[{kSsdSegment, d.dest().offset()}] = d.dest();
  ssd_keys[src.key()] = d.dest().offset();
  return Status::OK();
}

// A promotion: the SSD object is read straight into its new DRAM range and checked; the SSD
// copy stays until the master frees it (after the read leases on it end).
Status StorageNode::Impl::Promote(const rpc::Demotion& d) {
  const rpc::InventoryRecord& src = d.source();
  const rpc::InventoryRecord& dst = d.dest();
  const uint64_t bytes = ObjectBytes(src);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto k = ssd_keys.find(src.key());
    auto it = k == ssd_keys.end() ? inventory.end() : inventory.find({kSsdSegment, k->second});
    if (it == inventory.end() || it->second.replica_id() != src.replica_id()) {
      return Status::NotFound("the replica to promote is not on this node's SSD tier");
    }
  }
  if (dst.segment_id() != segment || dst.offset() > pool_bytes ||
      bytes > pool_bytes - dst.offset()) {
    return Status::OutOfBounds("promotion target is not inside this node's pool");
  }
  kvb_iovec_t iov{pool + dst.offset(), bytes};
  uint64_t length = 0;
  Status st = ssd->Get(src.key(), {&iov, 1}, &length);
  if (!st.ok()) return st.WithContext("SSD tier: SSD read");
  if (length != bytes || util::Crc32c(pool + dst.offset(), bytes) != src.checksum()) {
    return Status::IoError("SSD copy does not match the object's checksum; not promoted");
  }
  std::lock_guard<std::mutex> lock(mu);
  inventory[{segment, dst.offset()}] = dst;
  return Status::OK();
}

bool StorageNode::Impl::ReportMove(const rpc::Demotion& d, const store::MoveReport& done,
                                   bool made) {
  Status answer;
  if (Status call = master->DemoteDone(done, &answer); !call.ok()) {
    KVB_LOG(WARN) << call.ToString() << " (move of " << d.source().key() << "; asking again)";
    return false;
  }
  if (answer.Is(StatusCode::kUnavailable)) {
    // The master does not know this node (it restarted; the heartbeat registers us again).
    KVB_LOG(INFO) << "DemoteDone: " << answer.ToString() << " (move of " << d.source().key()
                  << "; asking again)";
    return false;
  }
  if (made && (answer.IsNotFound() || answer.IsStalePeer())) {
    // Not wanted any more: drop the copy just made (an SSD object, or a DRAM record).
    if (d.dest().segment_id() == kSsdSegment) {
      DropSsdObject(d.source().key(), d.dest().replica_id());
    } else {
      std::lock_guard<std::mutex> l(mu);
      auto it = inventory.find({d.dest().segment_id(), d.dest().offset()});
      if (it != inventory.end() && it->second.replica_id() == d.dest().replica_id()) {
        inventory.erase(it);
      }
    }
  } else if (!answer.ok()) {
    KVB_LOG(WARN) << "DemoteDone: " << answer.ToString();
  }
  return true;
}

void StorageNode::Impl::DemoteLoop() {
  // Until answered, a copy made stays: if the master applied the move, it lists that copy.
  struct Move {
    rpc::Demotion d;
    store::MoveReport done;
    bool made = false;
  };
  Unanswered<Move> unanswered;
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    auto work = [&] {
      return stopping || !demotions.empty() || !evicted.empty() || !lost_ssd.empty();
    };
    if (unanswered.empty()) {
      cv.wait(lock, work);
    } else {
      cv.wait_until(lock, unanswered.retry_at(), work);
    }
    if (stopping) return;
    std::deque<std::string> gone;
    gone.swap(evicted);
    std::deque<rpc::InventoryRecord> lost;
    lost.swap(lost_ssd);
    std::deque<std::pair<rpc::Demotion, std::chrono::steady_clock::time_point>> batch;
    batch.swap(demotions);
    lock.unlock();
    // SSD copies that are gone: the master drops those replicas (re-replicating objects that
    // still have copies elsewhere).
    auto report_gone = [&](const std::string& key, uint64_t version, uint64_t offset) {
      ReportBadCopy(key, version, kSsdSegment, offset);
    };
    // Copies dropped after a failed read (ReadToStaging) are already out of the inventory.
    for (const rpc::InventoryRecord& rec : lost)
      report_gone(rec.key(), rec.version(), rec.offset());
    // Objects the SSD plugin evicted on its own: their records go too.
    for (const std::string& key : gone) {
      rpc::InventoryRecord rec;
      {
        std::lock_guard<std::mutex> l(mu);
        auto k = ssd_keys.find(key);
        if (k == ssd_keys.end()) continue;
        auto it = inventory.find({kSsdSegment, k->second});
        if (it != inventory.end()) {
          rec = it->second;
          inventory.erase(it);
        }
        ssd_keys.erase(k);
      }
      report_gone(key, rec.version(), rec.offset());
    }
    for (const auto& [d, deadline] : batch) {
      // Past its deadline the master has given the target range up (a DRAM one may hold new
      // data by now): do nothing, just say so.
      Status st = std::chrono::steady_clock::now() >= deadline
                      ? Status::DeadlineExceeded("move arrived past its deadline; not done")
                      : Demote(d);
      const store::MoveReport done{engine->self(), d.source().key(), d.source().version(),
                                   d.dest().replica_id(), st};
      if (!ReportMove(d, done, st.ok())) unanswered.Add({d, done, st.ok()});
    }
    unanswered.RetryDue([&](const Move& m) { return ReportMove(m.d, m.done, m.made); });
    lock.lock();
    if (!batch.empty()) {
      heartbeat_now = true;  // ask for the next demotions now, not an interval from now
      cv.notify_all();
    }
  }
}

grpc::Status StorageNode::Impl::ReadSsd(grpc::ServerContext* ctx, const rpc::ReadSsdRequest* req,
                                        rpc::ReadSsdReply* reply) {
  KVB_AUTH(ctx, store::method::kReadSsd);
  ssd_read_requests.fetch_add(1, std::memory_order_relaxed);
  auto done = [&](const Status& st) {
    store::ToProto(st, reply->mutable_status());
    return grpc::Status::OK;
  };
  if (req->node().node_id() != engine->self().node_id ||
      req->node().incarnation() != engine->self().incarnation) {
    return done(Status::StalePeer("read meant for another incarnation of this node"));
  }
  // The bytes go to the client's memory only: the descriptor must be the client's own (its
  // stated identity), and the client no storage node, so that no request makes this node
  // write into another node's pool (or its own).
  if (Status st = CheckReadClient(req->client()); !st.ok()) {
    KVB_LOG(WARN) << "refused ReadSsd from " << ctx->peer() << ": " << st.ToString();
    return done(st);
  }
  const PeerId claimed{req->client().node_id(), req->client().incarnation()};
  AddPeerOptions expect;
  expect.expect = &claimed;
  Result<PeerId> client = engine->AddPeer(req->client_descriptor(), expect);
  if (!client.ok()) {
    KVB_LOG(WARN) << "refused ReadSsd from " << ctx->peer() << ": " << client.status().ToString();
    return done(client.status().WithContext("client descriptor"));
  }
  NotePeer(client->node_id);
  if (ssd == nullptr) return done(Status::NotFound("this node has no SSD tier"));
  // The objects asked for: `items`, or the single object of the request's own fields.
  const bool batch = req->items_size() > 0;
  google::protobuf::RepeatedPtrField<rpc::ReadSsdItem> single;
  if (!batch) {
    rpc::ReadSsdItem* one = single.Add();
    one->set_key(req->key());
    one->set_version(req->version());
    *one->mutable_dests() = req->dests();
  }
  const auto& items = batch ? req->items() : single;
  const size_t n = static_cast<size_t>(items.size());
  ssd_read_objects.fetch_add(n, std::memory_order_relaxed);
  std::vector<Status> item_status(n);
  std::vector<uint64_t> item_size(n, 0);
  // Write only while the client still waits for the answer: never into buffers it has already
  // given up on (the call's deadline, less a margin for the reply). The deadline is fixed
  // here, so staging and earlier rounds count against it.
  const auto write_deadline = ctx->deadline() - std::chrono::milliseconds(50);
  size_t next = 0;
  while (next < n) {
    // One round: as many objects as the staging area holds (one larger than the whole area
    // alone), read from SSD, then written to the client with one transfer batch.
    std::vector<std::unique_ptr<Staged>> staged;
    std::vector<TransferOp> ops;
    std::vector<size_t> item_of_op;
    for (; next < n; ++next) {
      const rpc::ReadSsdItem& item = items[static_cast<int>(next)];
      rpc::InventoryRecord rec;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto k = ssd_keys.find(item.key());
        if (k != ssd_keys.end()) {
          auto it = inventory.find({kSsdSegment, k->second});
          if (it != inventory.end()) rec = it->second;
        }
      }
      if (rec.key() != item.key() || rec.version() != item.version()) {
        item_status[next] =
            Status::NotFound("object (this version) is not on this node's SSD tier");
        continue;
      }
      const uint64_t bytes = ObjectBytes(rec);
      uint64_t room = 0;
      for (const auto& p : item.dests()) room += p.length();
      if (room < bytes) {
        item_status[next] =
            Status::InvalidArgument("destination holds " + std::to_string(room) +
                                    " bytes; the object has " + std::to_string(bytes));
        continue;
      }
      if (bytes > staging_bytes && !staged.empty()) break;  // it goes alone, next round
      Result<std::unique_ptr<Staged>> got = ReadToStaging(rec);
      if (!got.ok()) {
        // Staging full with this round's objects: send them, then this one.
        if (got.status().Is(StatusCode::kBackpressure) && !staged.empty()) break;
        item_status[next] = got.status();
        continue;
      }
      Staged& s = *got.value();
      uint64_t pos = 0;
      for (const auto& p : item.dests()) {
        if (pos == bytes) break;
        const uint64_t len = std::min(p.length(), bytes - pos);
        ops.push_back(TransferOp{OpCode::kWrite, s.data + pos, len, client->node_id, p.segment_id(),
                                 p.offset()});
        item_of_op.push_back(next);
        pos += len;
      }
      item_size[next] = bytes;
      const bool large = s.temp_segment != 0;
      staged.push_back(std::move(got).value());
      if (large) {
        ++next;
        break;
      }
    }
    struct FreeRound {
      Impl* im;
      std::vector<std::unique_ptr<Staged>>* v;
      ~FreeRound() {
        for (auto& s : *v) im->FreeStaging(*s);
      }
    } free_round{this, &staged};
    if (ops.empty()) continue;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        write_deadline - std::chrono::system_clock::now());
    if (ctx->IsCancelled() || left.count() <= 0) {
      // This round's objects and every one not yet read: nothing more is written.
      const Status late = Status::DeadlineExceeded("the client's call expired during the SSD read");
      for (size_t i : item_of_op) item_status[i] = late;
      for (; next < n; ++next) item_status[next] = late;
      break;
    }
    SubmitOptions so;
    so.deadline_ms = static_cast<uint32_t>(std::min<int64_t>(
        left.count(), req->timeout_ms() > 0 ? req->timeout_ms() : options.rpc_timeout_ms));
    ssd_read_batches.fetch_add(1, std::memory_order_relaxed);
    Result<BatchId> id = engine->Submit(ops, so);
    BatchResult r;
    if (id.ok()) {
      r = engine->Wait(id.value());
    } else {
      r.status = id.status();
    }
    for (size_t k = 0; k < ops.size(); ++k) {
      const Status& st = k < r.op_status.size() ? r.op_status[k] : r.status;
      Status& is = item_status[item_of_op[k]];
      // Not the replica's fault: the client must not report it (UNAVAILABLE is not reported).
      if (!st.ok() && is.ok()) is = Status::Unavailable("writing to the client: " + st.ToString());
      if (st.ok()) ssd_served_bytes.fetch_add(ops[k].length, std::memory_order_relaxed);
    }
  }
  if (!batch) {
    if (item_status[0].ok()) reply->set_size(item_size[0]);
    return done(item_status[0]);
  }
  for (size_t i = 0; i < n; ++i) {
    rpc::ReadSsdItemReply* out = reply->add_items();
    store::ToProto(item_status[i], out->mutable_status());
    if (item_status[i].ok()) out->set_size(item_size[i]);
  }
  return done(Status::OK());
}

Status StorageNode::Impl::CheckReadClient(const rpc::NodeIdentity& client) {
  if (client.node_id().empty()) {
    return Status::InvalidArgument("ReadSsd names no client (ReadSsdRequest.client)");
  }
  if (client.node_id() == engine->self().node_id &&
      client.incarnation() == engine->self().incarnation) {
    return Status::PermissionDenied("ReadSsd names this node itself as the client");
  }
  const auto now = std::chrono::steady_clock::now();
  const std::pair<std::string, uint64_t> key{client.node_id(), client.incarnation()};
  {
    std::lock_guard<std::mutex> lock(clients_mu);
    auto it = checked_clients.find(key);
    if (it != checked_clients.end() && now - it->second < std::chrono::minutes(1)) {
      return Status::OK();
    }
  }
  const std::string ids[] = {client.node_id()};
  Result<std::vector<store::NodeEntry>> listed = master->NodeDescriptors(ids);
  if (!listed.ok()) {
    return listed.status().WithContext("cannot tell whether ReadSsd client " + client.node_id() +
                                       " is a storage node");
  }
  // A storage node is the (name, incarnation) the master lists. A client may carry a node's
  // name under an incarnation of its own: an embedded client that shares its node's name, so
  // that the master places its puts there (the Mooncake drop-in's). Its descriptor is then
  // another engine's (the handshake checks the incarnation), never the pool's.
  for (const store::NodeEntry& n : *listed) {
    if (n.id.node_id == client.node_id() && n.id.incarnation == client.incarnation()) {
      return Status::PermissionDenied("ReadSsd client " + client.node_id() +
                                      " is a storage node: a node never writes into another "
                                      "node's pool on a read request");
    }
  }
  std::lock_guard<std::mutex> lock(clients_mu);
  if (checked_clients.size() >= 4096) checked_clients.clear();  // bounded; asked again
  checked_clients[key] = now;
  return Status::OK();
}

void StorageNode::Impl::SetUpMetrics() {
  heartbeat_failures =
      metrics.Counter("kvbridge_node_heartbeat_failures_total",
                      "Heartbeats to the master that failed (unreachable, refused, timed out).");
  const std::string task_help = "Re-replication tasks this node ran and reported, by result.";
  tasks_ok =
      metrics.Counter("kvbridge_node_replication_tasks_total", task_help, {{"result", "ok"}});
  tasks_failed =
      metrics.Counter("kvbridge_node_replication_tasks_total", task_help, {{"result", "failed"}});
  metrics.AddCollector([this](obs::MetricWriter& w) { Collect(w); });
}

void StorageNode::Impl::Collect(obs::MetricWriter& w) {
  uint64_t used[2] = {0, 0}, objects[2] = {0, 0};
  bool is_draining;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [k, r] : inventory) {
      const int t = k.first == kSsdSegment ? 1 : 0;
      used[t] += ObjectBytes(r);
      ++objects[t];
    }
    is_draining = draining;
  }
  const uint64_t now = util::MonoNs();
  const char* tiers[2] = {"dram", "ssd"};
  const uint64_t capacity[2] = {pool_bytes, ssd != nullptr ? options.ssd_bytes : 0};
  for (int t = 0; t < 2; ++t) {
    if (t == 1 && ssd == nullptr) continue;
    w.Gauge("kvbridge_node_capacity_bytes", "Capacity of a tier of this node.",
            {{"tier", tiers[t]}}, capacity[t]);
    w.Gauge("kvbridge_node_used_bytes", "Bytes of the objects this node holds, by tier.",
            {{"tier", tiers[t]}}, used[t]);
    w.Gauge("kvbridge_node_objects", "Objects (replicas) this node holds, by tier.",
            {{"tier", tiers[t]}}, objects[t]);
  }
  const uint64_t contact = last_contact_ns.load();
  w.Gauge("kvbridge_node_heartbeat_age_seconds",
          "Seconds since the master last answered this node's heartbeat or registration.", {},
          contact && now > contact ? (now - contact) / 1e9 : 0);
  w.Gauge("kvbridge_node_registered",
          "1 while the node is registered with a master and heartbeating (what /health says).", {},
          Health().status == 200 ? 1 : 0);
  w.Gauge("kvbridge_node_draining", "1 once the node was asked to drain.", {}, is_draining);
  w.Gauge("kvbridge_node_uptime_seconds", "Seconds since the node started.", {},
          (now - start_ns) / 1e9);
  w.Counter("kvbridge_node_ssd_read_requests_total", "ReadSsd calls answered.", {},
            ssd_read_requests.load(std::memory_order_relaxed));
  w.Counter("kvbridge_node_ssd_read_objects_total", "Objects ReadSsd calls asked for.", {},
            ssd_read_objects.load(std::memory_order_relaxed));
  w.Counter("kvbridge_node_ssd_demoted_bytes_total",
            "Bytes demotions copied from the DRAM pool to the SSD tier.", {},
            ssd_demoted_bytes.load(std::memory_order_relaxed));
  w.Counter("kvbridge_node_ssd_served_bytes_total",
            "Bytes read from the SSD tier and written to clients.", {},
            ssd_served_bytes.load(std::memory_order_relaxed));
  std::vector<std::string> peers;
  {
    std::lock_guard<std::mutex> lock(peers_mu);
    peers.assign(peers_seen.begin(), peers_seen.end());
  }
  for (const std::string& peer : peers) {
    std::optional<PeerHealth> h = engine->GetPeerHealth(peer);
    if (!h) continue;  // forgotten by the engine
    for (const PathHealth& p : h->paths) {
      const obs::Labels l = {{"peer", peer}, {"transport", p.transport}};
      w.Gauge("kvbridge_node_peer_breaker_state",
              "Breaker of a path to a peer this node sent data to: 0 closed, 1 half-open, 2 open.",
              l,
              p.breaker == BreakerState::kClosed     ? 0
              : p.breaker == BreakerState::kHalfOpen ? 1
                                                     : 2);
      w.Counter("kvbridge_node_peer_ops_failed_total",
                "Transfer ops to a peer that failed on a path (failed over or not).", l,
                p.ops_failed);
    }
  }
  for (const char* name : {"tcp", "ucx", "verbs", "nccl"}) {
    Result<TransportStats> t = engine->GetTransportStats(name);
    if (!t.ok()) continue;  // not loaded, or reports no stats
    const obs::Labels l = {{"transport", name}};
    w.Counter("kvbridge_node_transport_bytes_total",
              "Bytes this node's engine moved over a transport, by direction.",
              {{"transport", name}, {"direction", "written"}}, t->bytes_written);
    w.Counter("kvbridge_node_transport_bytes_total",
              "Bytes this node's engine moved over a transport, by direction.",
              {{"transport", name}, {"direction", "read"}}, t->bytes_read);
    w.Counter("kvbridge_node_transport_frames_rejected_total",
              "Frames a transport refused (malformed, unauthenticated, out of bounds).", l,
              t->frames_rejected);
    w.Gauge("kvbridge_node_transport_connections", "Open connections of a transport.", l,
            t->connections_open);
    w.Gauge("kvbridge_node_transport_queued_bytes", "Bytes queued on a transport to be sent.", l,
            t->queued_bytes);
    for (const auto& [path, n] : {std::pair{"direct", t->device_regions_direct},
                                  std::pair{"staged", t->device_regions_staged}}) {
      w.Counter("kvbridge_node_transport_device_regions_total",
                "CUDA regions a transport registered, by how it moves them (direct: no host "
                "copy; staged: through host buffers).",
                {{"transport", name}, {"path", path}}, n);
    }
    w.Counter("kvbridge_node_transport_device_bytes_staged_total",
              "Bytes a transport copied between CUDA memory and host staging buffers.", l,
              t->device_bytes_staged);
  }
}

obs::HttpResponse StorageNode::Impl::Health() {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) {
      why = "the node is stopping";
    } else if (superseded) {
      why = "another incarnation of node " + engine->self().node_id + " took its place";
    } else if (drained) {
      why = "the node is drained";
    } else if (!last_contact_error.empty()) {
      why = "not registered with the master at " + options.master_address +
            ": the last heartbeat failed: " + last_contact_error;
    }
  }
  // A heartbeat stuck in its retries says nothing yet: silence past what the master allows
  // (three intervals) is already death to it.
  const uint64_t contact = last_contact_ns.load(), now = util::MonoNs();
  const uint64_t silence_ms = now > contact ? (now - contact) / 1000000 : 0;
  if (why.empty() && silence_ms > 3ull * heartbeat_interval_ms + 1000) {
    why = "not registered with the master at " + options.master_address + ": no answer to a " +
          "heartbeat for " + std::to_string(silence_ms) + " ms";
  }
  if (why.empty()) return {200, "text/plain; charset=utf-8", "ok\n"};
  return {503, "text/plain; charset=utf-8", "not serving: " + why + "\n"};
}

void StorageNode::Impl::Stop() {
  if (engine) {  // no client of this process applies a commit here from now on
    std::unique_lock<std::shared_mutex> lock(LocalNodesMu());
    LocalNodes().erase(engine->self().incarnation);
  }
  http.reset();  // its handlers read what Stop tears down
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) return;
    stopping = true;
  }
  cv.notify_all();
  membership.reset();  // leaves the etcd list at once
  if (heartbeat_thread.joinable()) heartbeat_thread.join();
  if (task_thread.joinable()) task_thread.join();
  if (demote_thread.joinable()) demote_thread.join();
  if (free_thread.joinable()) free_thread.join();
  if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
}

StorageNode::StorageNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StorageNode::~StorageNode() {
  if (!impl_) return;
  bool superseded;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    superseded = impl_->superseded;
  }
  impl_->Stop();
  if (!superseded && impl_->master) {
    (void)impl_->master->Deregister(impl_->engine->self(), impl_->NodeKey());
  }
}

const PeerId& StorageNode::id() const { return impl_->engine->self(); }

Status StorageNode::ssd_status() const { return impl_->ssd_status; }

const std::string& StorageNode::metrics_address() const { return impl_->metrics_address; }

StorageNodeStats StorageNode::stats() const {
  StorageNodeStats s;
  s.ssd_read_requests = impl_->ssd_read_requests.load(std::memory_order_relaxed);
  s.ssd_read_objects = impl_->ssd_read_objects.load(std::memory_order_relaxed);
  s.ssd_read_batches = impl_->ssd_read_batches.load(std::memory_order_relaxed);
  s.temp_staging_bytes_peak = impl_->temp_staging_bytes_peak.load();
  s.frees_received = impl_->frees_counted.load(std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    s.frees_remembered = impl_->freed.size();
  }
  return s;
}

size_t StorageNode::object_count() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->inventory.size();
}

Result<std::unique_ptr<StorageNode>> StorageNode::Start(const NodeOptions& options) {
  KVB_RETURN_IF_ERROR(store::CheckPeerDiscovery(options.peer_discovery));
  store::PreferCallerPolling();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->auth =
      std::make_unique<store::RpcAuth>(options.engine.cluster_token, options.rpc_auth_skew_ms);
  KVB_RETURN_IF_ERROR(store::ParseFaults(options.faults, "NodeOptions::faults",
                                         {{"task_delay_ms", &impl->task_delay_ms}}));
  auto engine = TransferEngine::Create(options.engine);
  if (!engine.ok()) return engine.status().WithContext("storage node");
  impl->engine = std::move(engine).value();

  // The engine's plugin host (same search path, held alive by the engine): no second scan.
  std::shared_ptr<core::PluginHost> plugins = core::PluginHost::Acquire(
      core::PluginRegistry::DefaultSearchPath(options.engine.plugin_path));
  core::StorageConfig config;
  config.node_id = impl->engine->self().node_id;
  config.capacity_bytes = options.dram_bytes;
  config.require_caps = KVB_SCAP_POOL;
  // Storage nodes touch their whole pool up front unless told otherwise: page faults in the
  // first pass over a fresh pool halve its transfer rate for seconds.
  config.plugin_config = options.engine.plugin_config;
  if (!config.plugin_config.count("dram.prefault") && !std::getenv("KVBRIDGE_DRAM_PREFAULT")) {
    config.plugin_config["dram.prefault"] = "1";
  }
  Result<std::unique_ptr<core::StorageInstance>> storage =
      plugins->CreateStorage(options.storage_plugin, config);
  if (!storage.ok()) return storage.status();
  impl->storage = std::move(storage).value();
  Result<core::StorageInstance::Segment> pool_segment = impl->storage->GetSegment();
  if (!pool_segment.ok()) return pool_segment.status().WithContext("storage plugin has no segment");
  void* addr = pool_segment.value().addr;
  impl->pool_bytes = pool_segment.value().length;
  impl->pool = static_cast<char*>(addr);
  Result<SegmentId> seg = impl->engine->RegisterMemory(addr, impl->pool_bytes);
  if (!seg.ok()) return seg.status().WithContext("registering the DRAM pool");
  impl->segment = seg.value();

  auto server =
      store::StartServer(options.rpc_listen, impl.get(), "the node service", &impl->rpc_address);
  if (!server.ok()) return server.status();
  impl->server = std::move(server).value();
  {
    Impl* raw = impl.get();
    std::unique_lock<std::shared_mutex> lock(LocalNodesMu());
    LocalNodes()[raw->engine->self().incarnation] =
        LocalNode{raw->engine->self().node_id, options.engine.cluster_token,
                  [raw](rpc::CommitRequest& c, std::chrono::steady_clock::time_point sent) {
                    return raw->ApplyCommit(c, /*local=*/true, sent);
                  },
                  [raw](std::span<const std::pair<uint64_t, uint64_t>> ranges, bool expect) {
                    raw->ExpectCommits(ranges, expect);
                  },
                  [raw] {
                    std::lock_guard<std::mutex> lock(raw->mu);
                    raw->heartbeat_now = true;
                    raw->cv.notify_all();
                  }};
  }
  impl->auth->WarnIfDisabled("storage node " + impl->engine->self().node_id + "'s control service",
                             impl->rpc_address);

  store::MasterClient::Options mo;
  mo.address = options.master_address;
  mo.cluster_token = options.engine.cluster_token;
  mo.auth_skew_ms = options.rpc_auth_skew_ms;
  mo.retry.rpc_timeout_ms = options.rpc_timeout_ms;
  mo.heartbeat_channel = true;
  impl->master = std::make_unique<store::MasterClient>(std::move(mo));
  impl->directory =
      std::make_unique<store::PeerDirectory>(impl->master.get(), options.peer_discovery);
  if (!options.ssd_path.empty()) {
    // A tier that cannot start (missing or read-only directory, plugin not found, ...) costs
    // the tier, not the node: it serves its DRAM pool and says why (ssd_status()).
    Status ssd = impl->StartSsd(*plugins);
    if (!ssd.ok()) {
      impl->ssd_status = ssd.WithContext("SSD tier at " + options.ssd_path);
      KVB_LOG(ERROR) << impl->ssd_status.ToString() << "; serving DRAM only";
      impl->ssd.reset();
      if (impl->staging_segment != 0) (void)impl->engine->DeregisterMemory(impl->staging_segment);
      impl->staging_segment = 0;
      impl->staging.reset();
      std::lock_guard<std::mutex> lock(impl->mu);
      std::erase_if(impl->inventory, [](const auto& e) { return e.first.first == kSsdSegment; });
      impl->ssd_keys.clear();
    }
  } else {
    impl->ssd_status = Status::NotFound("no SSD tier configured (ssd_path is empty)");
  }
  Status reg = impl->Register();
  if (!reg.ok()) return reg;
  KVB_LOG(INFO) << "storage node " << impl->engine->self().ToString() << " registered "
                << impl->pool_bytes << " bytes with " << options.master_address;
  if (store::IsEtcdAddress(options.master_address)) {
    // Listed in etcd for as long as this node lives (its lease), so that a newly elected
    // leader knows to wait for it (csrc/store/master_ha.h).
    auto etcd = store::ParseEtcdAddress(options.master_address);
    if (etcd.ok()) {
      char incarnation[17];
      std::snprintf(incarnation, sizeof(incarnation), "%016llx",
                    static_cast<unsigned long long>(impl->engine->self().incarnation));
      impl->membership = std::make_unique<store::NodeMembership>(
          std::move(etcd).value(), impl->engine->self().node_id,
          std::string(incarnation) + " " + impl->rpc_address, kMembershipTtlS);
    }
  }
  if (grpc::HealthCheckServiceInterface* h = impl->server->GetHealthCheckService()) {
    h->SetServingStatus(rpc::Node::service_full_name(), true);
  }
  impl->start_ns = util::MonoNs();
  impl->SetUpMetrics();
  std::map<std::string, obs::HttpRoute> routes;
  Impl* raw = impl.get();
  routes["/metrics"] = {[raw] {
    return obs::HttpResponse{200, obs::kExpositionContentType, raw->metrics.Render()};
  }};
  routes["/health"] = {[raw] { return raw->Health(); }, /*is_public=*/true};
  auto http = obs::StartEndpoint(
      options.metrics_listen, options.metrics_listen_best_effort, std::move(routes),
      options.metrics_token.empty() ? options.engine.cluster_token : options.metrics_token,
      "storage node " + impl->engine->self().node_id);
  if (!http.ok()) return http.status();
  impl->http = std::move(http).value();
  if (impl->http) impl->metrics_address = impl->http->address();
  impl->heartbeat_thread = std::thread([raw] { raw->HeartbeatLoop(); });
  impl->task_thread = std::thread([raw] { raw->TaskLoop(); });
  if (impl->ssd != nullptr) {
    impl->demote_thread = std::thread([raw] { raw->DemoteLoop(); });
    impl->free_thread = std::thread([raw] { raw->FreeLoop(); });
  }
  return std::unique_ptr<StorageNode>(new StorageNode(std::move(impl)));
}

Status StorageNode::Drain() {
  Impl& im = *impl_;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    im.draining = true;
  }
  KVB_RETURN_IF_ERROR(im.master->Drain(im.engine->self(), im.NodeKey()));
  std::unique_lock<std::mutex> lock(im.mu);
  const bool done = im.cv.wait_for(lock, std::chrono::milliseconds(im.options.drain_timeout_ms),
                                   [&] { return im.drained || im.stopping || im.superseded; });
  const bool drained = im.drained;
  lock.unlock();
  if (!done || !drained) {
    return Status::DeadlineExceeded("drain not confirmed by the master within " +
                                    std::to_string(im.options.drain_timeout_ms) + " ms");
  }
  return Status::OK();
}

namespace store {

std::vector<NodeIdentity> LocalNodesAmong(const std::set<std::pair<std::string, uint64_t>>& nodes,
                                          const std::string& cluster_token) {
  std::vector<NodeIdentity> out;
  std::shared_lock<std::shared_mutex> lock(LocalNodesMu());
  if (LocalNodes().empty()) return out;
  for (const auto& [node_id, incarnation] : nodes) {
    auto it = LocalNodes().find(incarnation);
    if (it != LocalNodes().end() && it->second.node_id == node_id &&
        it->second.cluster_token == cluster_token) {
      out.push_back({node_id, incarnation});
    }
  }
  return out;
}

void ExpectLocalCommits(const NodeIdentity& node,
                        std::span<const std::pair<uint64_t, uint64_t>> ranges, bool expect) {
  std::shared_lock<std::shared_mutex> lock(LocalNodesMu());
  auto it = LocalNodes().find(node.incarnation);
  if (it == LocalNodes().end() || it->second.node_id != node.node_id) return;  // stopped
  it->second.expect(ranges, expect);
}

void HeartbeatLocalNodesNow(const std::string& cluster_token) {
  std::shared_lock<std::shared_mutex> lock(LocalNodesMu());
  for (auto& [incarnation, node] : LocalNodes()) {
    if (node.cluster_token == cluster_token) node.heartbeat_now();
  }
}

Status ApplyLocalCommit(rpc::CommitRequest& commit, std::chrono::steady_clock::time_point sent) {
  std::shared_lock<std::shared_mutex> lock(LocalNodesMu());
  auto it = LocalNodes().find(commit.node().incarnation());
  if (it == LocalNodes().end() || it->second.node_id != commit.node().node_id()) {
    return Status::Unavailable("storage node " + commit.node().node_id() +
                               " of this process has stopped");
  }
  return it->second.apply(commit, sent);
}

}  // namespace store

}  // namespace kvbridge
