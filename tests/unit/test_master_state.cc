// Unit tests of the master's state machine (store/master_state.h). Time is driven through
// now_ns; nodes are simulated by FakeNode, which keeps the inventory records the master commits
// to it and drops the ones it frees, as a real node does.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "store/master_state.h"

namespace kvbridge::store {
namespace {

constexpr uint64_t kMs = 1000000ull;
constexpr uint64_t kKiB = 1024;

struct FakeNode {
  NodeIdentity id;
  std::vector<SegmentInfo> segments;
  std::map<std::pair<uint64_t, uint64_t>, InventoryRecord> records;  // (segment, offset)
  std::vector<ReplicationTask> tasks;
  bool drained = false;
  bool draining = false;
  bool partitioned = false;  // the master's commits do not reach it
  uint64_t frees_acked = 0;  // the highest free sequence number applied (acknowledged)

  NodeRegistration Registration() const {
    return {id, "desc-" + id.node_id, "ep-" + id.node_id, segments, draining};
  }
  std::vector<InventoryRecord> Inventory() const {
    std::vector<InventoryRecord> v;
    for (const auto& [k, r] : records) v.push_back(r);
    return v;
  }
  void ApplyFree(const InventoryRecord& f) {
    auto it = records.find({f.segment_id, f.offset});
    if (it != records.end() && it->second.replica_id == f.replica_id) records.erase(it);
  }
  void ApplyFrees(const std::vector<InventoryRecord>& frees, const std::vector<uint64_t>& seqs) {
    for (const auto& f : frees) ApplyFree(f);
    for (uint64_t seq : seqs) frees_acked = std::max(frees_acked, seq);
  }
  bool Holds(const std::string& key, uint64_t version) const {
    for (const auto& [k, r] : records) {
      if (r.key == key && r.version == version) return true;
    }
    return false;
  }
};

enum class Commit { kOk, kFail, kLostReply };

// A master plus simulated nodes.
class Cluster {
 public:
  explicit Cluster(MasterConfig cfg = {}) : cfg_(cfg) {
    if (cfg_.random_seed == 0) cfg_.random_seed = 12345;
    Restart();
  }

  MasterState& m() { return *master_; }
  const MasterConfig& cfg() const { return cfg_; }

  // A fresh master (the old state is lost); registered nodes re-register with inventories.
  std::vector<RegisterReply> Restart() {
    auto r = MasterState::Create(cfg_);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    master_ = std::move(r.value());
    std::vector<RegisterReply> replies;
    for (auto& [name, n] : nodes) {
      auto reply = Register(n);
      EXPECT_TRUE(reply.ok()) << reply.status().ToString();
      if (reply.ok()) replies.push_back(reply.value());
    }
    return replies;
  }

  FakeNode& AddNode(const std::string& name, std::vector<uint64_t> capacities,
                    uint64_t incarnation = 1) {
    FakeNode& n = nodes[name];
    n = FakeNode{};
    n.id = {name, incarnation};
    for (size_t i = 0; i < capacities.size(); ++i) n.segments.push_back({100 + i, capacities[i]});
    auto reply = Register(n);
    EXPECT_TRUE(reply.ok()) << reply.status().ToString();
    return n;
  }

  Result<RegisterReply> Register(FakeNode& n) {
    auto reply = master_->RegisterNode(n.Registration(), n.Inventory(), now);
    if (reply.ok()) n.ApplyFrees(reply->frees, reply->free_seqs);
    return reply;
  }

  Status Heartbeat(FakeNode& n) {
    auto c = master_->Heartbeat(n.id, n.frees_acked, now);
    if (!c.ok()) return c.status();
    n.ApplyFrees(c->frees, c->free_seqs);
    for (auto& t : c->tasks) n.tasks.push_back(t);
    n.drained = c->drained;
    return Status::OK();
  }

  void HeartbeatAll() {
    for (auto& [name, n] : nodes) EXPECT_TRUE(Heartbeat(n).ok()) << name;
  }

  // `seconds` pass one at a time: each, the nodes named in `alive` heartbeat (every node when
  // it is empty) and the master ticks.
  void PassSeconds(int seconds, const std::vector<std::string>& alive = {}) {
    for (int i = 0; i < seconds; ++i) {
      now += 1000 * kMs;
      if (alive.empty()) HeartbeatAll();
      for (const auto& name : alive) EXPECT_TRUE(Heartbeat(nodes[name]).ok()) << name;
      m().Tick(now);
    }
  }

  Result<PutAllocation> Start(const std::string& key, std::vector<uint64_t> sizes,
                              uint32_t replica_num = 1, const std::string& client = "",
                              bool pinned = false) {
    PutOptions o;
    o.replica_num = replica_num;
    o.client_node_id = client;
    o.pinned = pinned;
    auto r = master_->PutStart({{key, std::move(sizes)}}, o, now);
    return std::move(r[0]);
  }

  void Deliver(NodeCommit& c, Commit mode) {
    auto it = nodes.find(c.node.node_id);
    const bool reachable = it != nodes.end() && it->second.id == c.node && !it->second.partitioned;
    if (reachable && mode != Commit::kFail) {
      for (const auto& r : c.records) it->second.records[{r.segment_id, r.offset}] = r;
    }
    c.ok = reachable && mode == Commit::kOk;
  }

  // Put end of one key; `commit` decides each node's commit outcome.
  Status End(const std::string& key, const PutAllocation& a, std::vector<bool> flags,
             uint32_t checksum, std::function<Commit(const NodeIdentity&)> commit = nullptr) {
    PutEndPlan plan = master_->BeginPutEnd({{key, a.version, std::move(flags), checksum}}, now);
    for (auto& c : plan.commits) Deliver(c, commit ? commit(c.node) : Commit::kOk);
    return master_->FinishPutEnd(plan, now)[0];
  }

  Status Put(const std::string& key, uint64_t bytes, uint32_t replica_num = 1,
             const std::string& client = "", uint32_t checksum = 0xC0FFEE) {
    auto a = Start(key, {bytes}, replica_num, client);
    if (!a.ok()) return a.status();
    return End(key, a.value(), std::vector<bool>(a->replicas.size(), true), checksum);
  }

  // Runs a task as its source node would, then reports it.
  Status RunTask(const ReplicationTask& t, bool ok = true, Commit commit = Commit::kOk) {
    FakeNode& src = nodes.at(t.source.node.node_id);
    auto plan = master_->TaskDone(t.task_id, src.id, ok, now);
    if (!plan.ok()) return plan.status();
    for (auto& c : plan->commits) Deliver(c, commit);
    return master_->FinishTask(plan.value(), now);
  }

  // Runs every task the nodes were handed.
  size_t RunAllTasks() {
    size_t n = 0;
    for (auto& [name, node] : nodes) {
      auto tasks = std::move(node.tasks);
      node.tasks.clear();
      for (const auto& t : tasks) {
        EXPECT_TRUE(RunTask(t).ok());
        ++n;
      }
    }
    return n;
  }

  uint64_t Used(const std::string& node) {
    for (const auto& s : master_->Stats().nodes) {
      if (s.identity.node_id == node && s.state != NodeState::kDead) return s.used;
    }
    return 0;
  }

  std::vector<std::string> ReplicaNodes(const std::string& key) {
    auto r = master_->GetReplicas({key}, "", now);
    std::vector<std::string> v;
    if (r[0].ok()) {
      for (const auto& l : r[0]->replicas) v.push_back(l.node.node_id);
    }
    return v;
  }

  uint64_t now = 1000 * kMs;
  std::map<std::string, FakeNode> nodes;

 private:
  MasterConfig cfg_;
  std::unique_ptr<MasterState> master_;
};

// The invariants of the brief, checked from the outside on a snapshot.
::testing::AssertionResult SnapshotHolds(const MasterSnapshot& s) {
  auto round = [&](uint64_t n) { return (n + s.alignment - 1) / s.alignment * s.alignment; };
  std::map<std::pair<std::string, uint64_t>, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
  std::set<NodeIdentity, bool (*)(const NodeIdentity&, const NodeIdentity&)> live(
      [](const NodeIdentity& a, const NodeIdentity& b) {
        return std::tie(a.node_id, a.incarnation) < std::tie(b.node_id, b.incarnation);
      });
  for (const auto& seg : s.segments) live.insert(seg.node);
  for (const auto& o : s.objects) {
    std::set<std::string> holders;
    bool readable = false;
    for (const auto& r : o.replicas) {
      if (!holders.insert(r.location.node.node_id).second) {
        return ::testing::AssertionFailure() << o.key << " has two replicas on one node";
      }
      if (!live.count(r.location.node)) {
        return ::testing::AssertionFailure() << o.key << " has a replica on a dead node";
      }
      readable |= r.state == ReplicaState::kComplete;
      ranges[{r.location.node.node_id, r.location.segment_id}].push_back(
          {r.location.offset, r.location.offset + round(r.location.length)});
      if (r.demote_to) {
        ranges[{r.demote_to->node.node_id, r.demote_to->segment_id}].push_back(
            {r.demote_to->offset, r.demote_to->offset + round(r.demote_to->length)});
      }
    }
    if (o.state == ObjectState::kComplete && !readable) {
      return ::testing::AssertionFailure() << o.key << " is complete with no complete replica";
    }
  }
  for (const auto& h : s.held) {
    ranges[{h.location.node.node_id, h.location.segment_id}].push_back(
        {h.location.offset, h.location.offset + round(h.location.length)});
  }
  size_t segments_seen = 0;
  for (const auto& seg : s.segments) {
    auto it = ranges.find({seg.node.node_id, seg.segment_id});
    std::vector<std::pair<uint64_t, uint64_t>> v;
    if (it != ranges.end()) {
      v = it->second;
      ++segments_seen;
    }
    std::sort(v.begin(), v.end());
    uint64_t sum = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0 && v[i].first < v[i - 1].second) {
        return ::testing::AssertionFailure() << "overlap in " << seg.node.node_id << "/"
                                             << seg.segment_id << " at " << v[i].first;
      }
      if (v[i].second > round(seg.capacity)) {
        return ::testing::AssertionFailure() << "range past capacity in " << seg.node.node_id;
      }
      sum += v[i].second - v[i].first;
    }
    if (sum != seg.used || v.size() != seg.allocations) {
      return ::testing::AssertionFailure()
             << seg.node.node_id << "/" << seg.segment_id << ": allocator used " << seg.used
             << " in " << seg.allocations << ", replicas+held " << sum << " in " << v.size();
    }
  }
  if (segments_seen != ranges.size()) {
    return ::testing::AssertionFailure() << "a replica lies in an unregistered segment";
  }
  return ::testing::AssertionSuccess();
}

void ExpectConsistent(Cluster& c) {
  Status st = c.m().CheckInvariants();
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE(SnapshotHolds(c.m().Snapshot()));
}

const MasterSnapshot::Object* Find(const MasterSnapshot& s, const std::string& key) {
  for (const auto& o : s.objects) {
    if (o.key == key) return &o;
  }
  return nullptr;
}

// A node with one DRAM and one SSD segment (ids 100 and 200).
FakeNode& AddTieredNode(Cluster& c, const std::string& name, uint64_t dram, uint64_t ssd,
                        uint64_t incarnation = 1) {
  FakeNode& n = c.nodes[name];
  n = FakeNode{};
  n.id = {name, incarnation};
  n.segments = {{100, dram, Tier::kDram}, {200, ssd, Tier::kSsd}};
  EXPECT_TRUE(c.Register(n).ok());
  return n;
}

// The demotions handed to a node by one heartbeat (frees applied, tasks kept, as Heartbeat).
std::vector<Demotion> HeartbeatDemotions(Cluster& c, FakeNode& n) {
  auto cmds = c.m().Heartbeat(n.id, n.frees_acked, c.now);
  EXPECT_TRUE(cmds.ok());
  if (!cmds.ok()) return {};
  n.ApplyFrees(cmds->frees, cmds->free_seqs);
  for (auto& t : cmds->tasks) n.tasks.push_back(t);
  return cmds->demotions;
}

// A tiered node n0 (64 KiB DRAM, 256 KiB SSD) given 14 objects of 4 KiB, past its demote
// watermark; returns the demotions its next heartbeat hands out.
std::vector<Demotion> FillTieredNode(Cluster& c, FakeNode** node) {
  FakeNode& n = AddTieredNode(c, "n0", 64 * kKiB, 256 * kKiB);
  for (int i = 0; i < 14; ++i) EXPECT_TRUE(c.Put("k" + std::to_string(i), 4 * kKiB).ok());
  c.m().Tick(c.now);
  *node = &n;
  return HeartbeatDemotions(c, n);
}

// Runs a demotion as a node does: record the SSD copy, report it; drops the copy on NOT_FOUND.
Status RunDemotion(Cluster& c, FakeNode& n, const Demotion& d, bool ok = true) {
  if (ok) n.records[{d.dest.segment_id, d.dest.offset}] = d.dest;
  Status st = c.m().DemoteDone(n.id, d.source.key, d.source.version, d.dest.replica_id, ok, c.now);
  if (!st.ok() && ok) n.records.erase({d.dest.segment_id, d.dest.offset});
  return st;
}

// ------------------------------------------------------------------ config and membership

TEST(MasterConfig, DefaultsAreDocumentedAndValid) {
  MasterConfig c;
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.node_ttl_ms, 3000u);
  EXPECT_EQ(c.lease_ms, 5000u);
  EXPECT_EQ(c.put_timeout_ms, 10000u);
  EXPECT_EQ(c.min_replicas, 1u);
  EXPECT_EQ(c.max_replicas, 8u);
  EXPECT_DOUBLE_EQ(c.high_watermark, 0.9);
  EXPECT_DOUBLE_EQ(c.low_watermark, 0.8);
  EXPECT_EQ(c.max_key_bytes, 4096u);
  EXPECT_EQ(c.max_buffers, 16u);
  EXPECT_EQ(c.max_object_bytes, 1ull << 30);
  EXPECT_EQ(c.alignment, 64u);
  EXPECT_EQ(c.drain_timeout_ms, 30000u);
  EXPECT_EQ(c.max_departed_nodes, 4096u);
  EXPECT_EQ(c.max_departed_copies, 16ull << 20);
}

TEST(MasterConfig, RejectsInconsistentValues) {
  auto bad = [](auto mutate, const char* field) {
    MasterConfig c;
    mutate(c);
    auto r = MasterState::Create(c);
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().ToString();
  };
  bad([](MasterConfig& c) { c.min_replicas = 9; }, "min_replicas");
  bad([](MasterConfig& c) { c.min_replicas = 0; }, "min_replicas");
  bad([](MasterConfig& c) { c.low_watermark = 0.95; }, "watermark");
  bad([](MasterConfig& c) { c.high_watermark = 1.5; }, "watermark");
  bad([](MasterConfig& c) { c.alignment = 48; }, "alignment");
  bad([](MasterConfig& c) { c.node_ttl_ms = 0; }, "node_ttl_ms");
}

TEST(MasterMembership, RegisterValidatesTheRegistration) {
  Cluster c;
  NodeRegistration r{{"", 1}, "d", "e", {{1, 1024}}};
  auto check = [&](const NodeRegistration& reg, const char* what) {
    auto res = c.m().RegisterNode(reg, {}, c.now);
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(res.status().message().find(what), std::string::npos) << res.status().ToString();
  };
  check(r, "node id is empty");
  r.identity.node_id = "n0";
  r.segments.clear();
  check(r, "no segments");
  r.segments = {{1, 0}};
  check(r, "capacity 0");
  r.segments = {{1, 1024}, {1, 2048}};
  check(r, "appears twice");
  EXPECT_TRUE(c.m().Stats().nodes.empty());
}

TEST(MasterMembership, HeartbeatAnswersUnknownStaleAndKnown) {
  Cluster c;
  c.AddNode("n0", {1 << 20}, 7);
  auto unknown = c.m().Heartbeat({"nX", 1}, 0, c.now);
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  auto stale = c.m().Heartbeat({"n0", 8}, 0, c.now);
  EXPECT_EQ(stale.status().code(), StatusCode::kStalePeer);
  auto ok = c.m().Heartbeat({"n0", 7}, 0, c.now);
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(ok->drained);
  EXPECT_TRUE(ok->tasks.empty());
  // Registering the same incarnation twice changes nothing.
  auto again = c.m().RegisterNode(c.nodes["n0"].Registration(), {}, c.now);
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  auto reply = c.m().RegisterNode({{"n9", 1}, "d", "e", {{1, 3000}}}, {}, c.now);
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->heartbeat_interval_ms, 1000u);
}

// Frees are delivered until acknowledged: a heartbeat reply that is lost (the node never
// acknowledges) is followed by the same frees in the next one; once the node names the highest
// sequence number it applied, they stop. At most max_frees_per_reply go in one reply.
TEST(MasterFrees, FreesComeAgainUntilAcknowledgedAndAreCappedPerReply) {
  MasterConfig cfg;
  cfg.max_frees_per_reply = 2;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c.Put("k" + std::to_string(i), 4096).ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c.m().Remove("k" + std::to_string(i), c.now).ok());
  const NodeIdentity id = c.nodes["n0"].id;
  auto lost = c.m().Heartbeat(id, 0, c.now);  // this reply never arrives
  ASSERT_TRUE(lost.ok());
  ASSERT_EQ(lost->frees.size(), 2u);
  ASSERT_EQ(lost->free_seqs.size(), 2u);
  EXPECT_LT(lost->free_seqs[0], lost->free_seqs[1]);
  EXPECT_TRUE(lost->more) << "three more frees are queued";
  auto again = c.m().Heartbeat(id, 0, c.now);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->free_seqs, lost->free_seqs) << "lost frees must come again";
  EXPECT_EQ(again->frees, lost->frees);
  // The node applied the first two: the next three follow, two then one.
  auto next = c.m().Heartbeat(id, again->free_seqs.back(), c.now);
  ASSERT_TRUE(next.ok());
  ASSERT_EQ(next->frees.size(), 2u);
  EXPECT_TRUE(next->more);
  EXPECT_GT(next->free_seqs.front(), again->free_seqs.back());
  auto last = c.m().Heartbeat(id, next->free_seqs.back(), c.now);
  ASSERT_TRUE(last.ok());
  ASSERT_EQ(last->frees.size(), 1u);
  EXPECT_FALSE(last->more) << "the last free is in this reply";
  auto none = c.m().Heartbeat(id, last->free_seqs.back(), c.now);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->frees.empty());
  EXPECT_TRUE(c.m().UnackedFrees(id)->frees.empty());
}

// The frees of a registration (records the master rejected) are queued like any other: when
// the registration's reply is lost and the node registers again (ALREADY_EXISTS) or just
// heartbeats, they are still there until acknowledged.
TEST(MasterFrees, RegistrationFreesSurviveALostReply) {
  Cluster c;
  FakeNode& n = c.AddNode("n0", {1 << 20});
  InventoryRecord bad{"x", 3, {4096}, 1, 999, 0, 1, 7};  // names a segment n0 does not have
  NodeRegistration reg = n.Registration();
  reg.identity.incarnation = 2;  // a restart of the node
  auto r = c.m().RegisterNode(reg, {bad}, c.now);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->frees.size(), 1u);
  ASSERT_EQ(r->free_seqs.size(), 1u);
  // The reply is lost. A retried registration changes nothing, and the free is still queued.
  EXPECT_EQ(c.m().RegisterNode(reg, {bad}, c.now).status().code(), StatusCode::kAlreadyExists);
  auto queued = c.m().UnackedFrees(reg.identity);
  ASSERT_TRUE(queued.ok());
  ASSERT_EQ(queued->frees.size(), 1u);
  EXPECT_EQ(queued->frees[0], bad);
  EXPECT_EQ(queued->free_seqs, r->free_seqs);
  auto hb = c.m().Heartbeat(reg.identity, 0, c.now);
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->free_seqs, r->free_seqs);
  hb = c.m().Heartbeat(reg.identity, r->free_seqs[0], c.now);
  ASSERT_TRUE(hb.ok());
  EXPECT_TRUE(hb->frees.empty());
}

// A registration whose rejected records exceed max_frees_per_reply carries the first ones
// and says `more`; heartbeats bring the rest, each capped and saying `more` until the last.
TEST(MasterFrees, RegistrationWithManyFreesSaysMoreAndHeartbeatsBringTheRest) {
  MasterConfig cfg;
  cfg.max_frees_per_reply = 2;
  Cluster c(cfg);
  FakeNode& n = c.AddNode("n0", {1 << 20});
  std::vector<InventoryRecord> bad;
  for (uint64_t i = 0; i < 5; ++i) {  // each names a segment n0 does not have
    bad.push_back({"x" + std::to_string(i), 3, {4096}, 1, 999, i * 4096, 1, 7 + i});
  }
  NodeRegistration reg = n.Registration();
  reg.identity.incarnation = 2;
  auto r = c.m().RegisterNode(reg, bad, c.now);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->frees.size(), 2u);
  EXPECT_TRUE(r->more);
  std::set<std::string> freed;
  for (const auto& f : r->frees) freed.insert(f.key);
  uint64_t acked = r->free_seqs.back();
  int replies = 0;
  for (bool more = true; more && replies < 10; ++replies) {
    auto hb = c.m().Heartbeat(reg.identity, acked, c.now);
    ASSERT_TRUE(hb.ok());
    ASSERT_LE(hb->frees.size(), 2u);
    ASSERT_FALSE(hb->frees.empty());
    for (const auto& f : hb->frees) freed.insert(f.key);
    acked = hb->free_seqs.back();
    more = hb->more;
  }
  EXPECT_EQ(replies, 2);  // 2 + 2 + 1
  EXPECT_EQ(freed.size(), 5u);
  auto done = c.m().Heartbeat(reg.identity, acked, c.now);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(done->frees.empty());
  EXPECT_FALSE(done->more);
}

// Tasks are capped per heartbeat reply too (max_tasks_per_reply): a reply that leaves some
// queued says `more`, and asking again at once brings the next, until none is left.
TEST(MasterRepair, HeartbeatReplyCapsTasksAndSaysMore) {
  MasterConfig cfg;
  cfg.max_tasks_per_reply = 1;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(c.Put("k" + std::to_string(i), 4096, 2).ok());
  c.AddNode("n2", {1 << 20});
  // n1 goes silent: every object is left on n0 alone, which must copy all four to n2.
  c.nodes.erase("n1");
  for (int i = 0; i < 4; ++i) {
    c.now += 1000 * kMs;
    c.HeartbeatAll();
  }
  auto t = c.m().Tick(c.now);
  ASSERT_EQ(t.nodes_expired, 1u);
  ASSERT_EQ(t.tasks_created, 4u);
  FakeNode& n0 = c.nodes["n0"];
  std::set<std::string> keys;
  int replies = 0;
  for (bool more = true; more && replies < 10; ++replies) {
    auto hb = c.m().Heartbeat(n0.id, n0.frees_acked, c.now);
    ASSERT_TRUE(hb.ok());
    ASSERT_EQ(hb->tasks.size(), 1u) << "reply " << replies;
    keys.insert(hb->tasks[0].key);
    more = hb->more;
  }
  EXPECT_EQ(replies, 4);
  EXPECT_EQ(keys.size(), 4u);
  auto none = c.m().Heartbeat(n0.id, n0.frees_acked, c.now);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->tasks.empty());
  EXPECT_FALSE(none->more);
}

// Sequence numbers start at first_free_seq (the master service starts it at the wall clock
// in microseconds): a new master's frees are above anything a node acknowledged to the old.
TEST(MasterFrees, SequenceNumbersStartAtFirstFreeSeq) {
  MasterConfig cfg;
  cfg.first_free_seq = 1000000;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096).ok());
  ASSERT_TRUE(c.m().Remove("k", c.now).ok());
  auto hb = c.m().Heartbeat(c.nodes["n0"].id, 999999, c.now);
  ASSERT_TRUE(hb.ok());
  ASSERT_EQ(hb->free_seqs.size(), 1u);
  EXPECT_EQ(hb->free_seqs[0], 1000000u);
}

// A node this master declared dead that comes back (same incarnation) may still be read under
// leases the master granted, and written by writers whose deadline has not passed: nothing new
// is placed in its DRAM until then. Other nodes take the puts meanwhile.
TEST(MasterLateWrites, NodeBackFromExpiryTakesNoDataUntilItsLeasesEnd) {
  MasterConfig cfg;
  cfg.lease_ms = 5000;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096, 1, "n0").ok());
  ASSERT_EQ(c.ReplicaNodes("k"), std::vector<std::string>{"n0"});  // a read: leased 5 s
  const uint64_t lease_end = c.now + 5000 * kMs;
  c.PassSeconds(3, {"n1"});  // n0 silent: dead
  ASSERT_EQ(c.m().Heartbeat(c.nodes["n0"].id, 0, c.now).status().code(), StatusCode::kNotFound);
  auto back = c.Register(c.nodes["n0"]);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->no_alloc_ms, (lease_end - c.now) / kMs);
  for (int i = 0; i < 4; ++i) {
    auto a = c.Start("p" + std::to_string(i), {4096}, 1, "n0");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->replicas[0].node.node_id, "n1") << "placed on a node whose leases still run";
  }
  // Two replicas cannot be placed at all meanwhile, and the error says why.
  auto two = c.Start("two", {4096}, 2);
  ASSERT_EQ(two.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(two.status().message().find("registered again"), std::string::npos);
  c.now = lease_end;
  c.HeartbeatAll();
  auto later = c.Start("q", {4096}, 1, "n0");
  ASSERT_TRUE(later.ok());
  EXPECT_EQ(later->replicas[0].node.node_id, "n0");
  ExpectConsistent(c);
}

// After a master restart, a node that says it was registered before may still be written by
// the previous master's puts and tasks: it takes no new data until restart_hold_until_ns. A
// node registering for the first time (a fresh process) takes data at once.
TEST(MasterLateWrites, NodeRegisteredBeforeARestartWaitsForTheRestartHold) {
  MasterConfig cfg;
  cfg.restart_hold_until_ns = 1000 * kMs + 12000 * kMs;
  Cluster c(cfg);
  FakeNode& old = c.AddNode("n0", {1 << 20});
  NodeRegistration again = old.Registration();
  again.identity.incarnation = 5;
  again.registered_before = true;
  auto r = c.m().RegisterNode(again, {}, c.now);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->no_alloc_ms, 12000u);
  auto a = c.Start("k", {4096});
  EXPECT_EQ(a.status().code(), StatusCode::kNoSpace);
  c.AddNode("fresh", {1 << 20});
  a = c.Start("k", {4096});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->replicas[0].node.node_id, "fresh");
  c.now = cfg.restart_hold_until_ns;
  EXPECT_TRUE(c.m().Heartbeat(again.identity, 0, c.now).ok());
  auto b = c.Start("k2", {4096}, 2);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
}

TEST(MasterMembership, NodeSilentForTtlIsDeadAndMustReRegister) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.now += 2999 * kMs;
  EXPECT_EQ(c.m().Tick(c.now).nodes_expired, 0u);
  c.now += 1 * kMs;
  EXPECT_EQ(c.m().Tick(c.now).nodes_expired, 1u);
  EXPECT_EQ(c.m().Heartbeat(c.nodes["n0"].id, 0, c.now).status().code(), StatusCode::kNotFound);
  auto st = c.m().Stats();
  ASSERT_EQ(st.nodes.size(), 1u);
  EXPECT_EQ(st.nodes[0].state, NodeState::kDead);
  EXPECT_EQ(st.nodes_expired_total, 1u);
  ASSERT_TRUE(c.Register(c.nodes["n0"]).ok());
  EXPECT_TRUE(c.Heartbeat(c.nodes["n0"]).ok());
}

// Ticks further apart than pause_threshold_ms mean the master itself was not running: every
// node's TTL starts over there, so a node that stays silent is still found dead, one TTL
// later, and none is declared dead for the master's own pause.
TEST(MasterMembership, APausedMasterStartsEveryTtlOver) {
  MasterConfig cfg;
  cfg.pause_threshold_ms = 500;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  EXPECT_EQ(c.m().Tick(c.now).paused_ms, 0u);
  c.now += 400 * kMs;
  EXPECT_EQ(c.m().Tick(c.now).paused_ms, 0u);  // an ordinary gap
  c.now += 5000 * kMs;                         // the master was frozen
  TickSummary t = c.m().Tick(c.now);
  EXPECT_EQ(t.paused_ms, 5000u);
  EXPECT_EQ(t.nodes_expired, 0u);
  for (int i = 0; i < 14; ++i) {  // 2.8 s more: n1 heartbeats, n0 stays silent
    c.now += 200 * kMs;
    ASSERT_TRUE(c.Heartbeat(c.nodes["n1"]).ok());
    EXPECT_EQ(c.m().Tick(c.now).nodes_expired, 0u) << i;
  }
  c.now += 200 * kMs;  // 3 s after the pause ended
  ASSERT_TRUE(c.Heartbeat(c.nodes["n1"]).ok());
  t = c.m().Tick(c.now);
  EXPECT_EQ(t.nodes_expired, 1u);
  // The expiry says how long the node was silent and that the master was ticking meanwhile.
  EXPECT_EQ(t.expired_silence_ms, 3000u);
  EXPECT_EQ(t.since_last_tick_ms, 200u);
  EXPECT_EQ(c.m().Heartbeat(c.nodes["n0"].id, 0, c.now).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(c.Heartbeat(c.nodes["n1"]).ok());
}

// Liveness is recorded by Touch() without the table lock (a heartbeat that then waits behind
// data-plane work still counts); another incarnation's touch does not keep a node alive.
TEST(MasterMembership, TouchKeepsANodeAliveWithoutTheTableLock) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.now += 2500 * kMs;
  c.m().Touch(c.nodes["n0"].id, c.now);
  NodeIdentity impostor = c.nodes["n1"].id;
  impostor.incarnation += 1;
  c.m().Touch(impostor, c.now);
  c.now += 1000 * kMs;  // 3.5 s after registration, 1 s after the touch
  EXPECT_EQ(c.m().Tick(c.now).nodes_expired, 1u) << "only n1 (touched by another incarnation)";
  auto stats = c.m().Stats();
  for (const auto& n : stats.nodes) {
    EXPECT_EQ(n.state, n.identity.node_id == "n0" ? NodeState::kActive : NodeState::kDead)
        << n.identity.node_id;
  }
  c.now += 2000 * kMs;  // 3 s after the touch
  EXPECT_EQ(c.m().Tick(c.now).nodes_expired, 1u);
}

// Heartbeats naming ids that are not registered (any caller can send them) leave no record
// past the next tick: 100 000 made-up ids, then one tick, and the liveness map holds only the
// registered node's record, which still keeps that node alive.
TEST(MasterMembership, TouchesOfUnknownIdsArePrunedAtTheNextTick) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  for (int i = 0; i < 100000; ++i) {
    NodeIdentity made_up;
    made_up.node_id = "made-up-" + std::to_string(i);
    made_up.incarnation = 1;
    c.m().Touch(made_up, c.now);
  }
  c.m().Touch(c.nodes["n0"].id, c.now);
  EXPECT_EQ(c.m().liveness_records(), 100001u);
  c.now += 2500 * kMs;
  c.m().Touch(c.nodes["n0"].id, c.now);
  EXPECT_EQ(c.m().Tick(c.now).nodes_expired, 0u);
  EXPECT_EQ(c.m().liveness_records(), 1u);
  c.now += 1000 * kMs;  // 3.5 s after registration, 1 s after the touch: still alive
  EXPECT_EQ(c.m().Tick(c.now).nodes_expired, 0u);
}

// A node readers just reported bad (dying, not yet expired) gets no new data while another
// node has room, even if it has the most free space; once the reports age out, it does again.
TEST(MasterPlacement, SuspectNodeIsAvoidedUntilItsReportsAgeOut) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("big", {4 << 20});
  ASSERT_TRUE(c.Put("b", 4096).ok());
  const MasterSnapshot snap = c.m().Snapshot();
  const auto* b = Find(snap, "b");
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(b->replicas[0].location.node.node_id, "big") << "most free space first";
  ASSERT_TRUE(c.m().ReportBadReplica("b", b->version, c.nodes["big"].id, c.now).ok());
  ASSERT_TRUE(c.Put("c", 4096).ok());
  const MasterSnapshot after = c.m().Snapshot();
  EXPECT_EQ(Find(after, "c")->replicas[0].location.node.node_id, "n0")
      << "placed on a node readers just reported bad";
  c.PassSeconds(30);  // three half-lives of the report counter
  ASSERT_TRUE(c.Put("d", 4096).ok());
  const MasterSnapshot later = c.m().Snapshot();
  EXPECT_EQ(Find(later, "d")->replicas[0].location.node.node_id, "big");
}

TEST(MasterMembership, NewIncarnationReplacesTheOld) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096, 2, "n0").ok());
  auto before = c.ReplicaNodes("k");
  ASSERT_EQ(before.size(), 2u);
  EXPECT_EQ(before[0], "n0");
  const uint64_t dir = c.m().Stats().directory_version;

  // n0 restarts: a new incarnation, its memory (and inventory) gone.
  FakeNode old = c.nodes["n0"];
  c.AddNode("n0", {1 << 20}, 2);
  EXPECT_EQ(c.m().Heartbeat(old.id, 0, c.now).status().code(), StatusCode::kStalePeer);
  EXPECT_GT(c.m().Stats().directory_version, dir);
  auto after = c.ReplicaNodes("k");
  ASSERT_EQ(after.size(), 1u);
  EXPECT_NE(after[0], "n0");
  EXPECT_EQ(c.Used("n0"), 0u);
  ExpectConsistent(c);
  // The copy that was lost is made again.
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 1u);
  c.HeartbeatAll();
  EXPECT_EQ(c.RunAllTasks(), 1u);
  EXPECT_EQ(c.ReplicaNodes("k").size(), 2u);
  ExpectConsistent(c);
}

TEST(MasterMembership, DeregisterDropsReplicasAtOnce) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  ASSERT_TRUE(c.Put("both", 100, 2).ok());
  ASSERT_TRUE(c.Put("only0", 100, 1, "n0").ok());
  EXPECT_EQ(c.m().Deregister({"n0", 2}, c.now).code(), StatusCode::kStalePeer);
  EXPECT_EQ(c.m().Deregister({"nX", 1}, c.now).code(), StatusCode::kNotFound);
  ASSERT_TRUE(c.m().Deregister(c.nodes["n0"].id, c.now).ok());
  EXPECT_EQ(c.ReplicaNodes("both"), std::vector<std::string>{"n1"});
  EXPECT_FALSE(c.m().Exists({"only0"})[0]);
  for (const auto& n : c.m().Stats().nodes) EXPECT_EQ(n.identity.node_id, "n1");
  ExpectConsistent(c);
}

// ------------------------------------------------------------------ put

TEST(MasterPut, HappyPathPlacesOnDistinctNodesThenCompletes) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  auto a = c.Start("k", {1000, 2000}, 3);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(a->replicas.size(), 3u);
  std::set<std::string> nodes;
  for (const auto& r : a->replicas) {
    nodes.insert(r.node.node_id);
    EXPECT_EQ(r.length, 3000u);
    EXPECT_EQ(r.offset % 64, 0u);
    EXPECT_EQ(r.tier, Tier::kDram);
  }
  EXPECT_EQ(nodes.size(), 3u);
  EXPECT_EQ(a->deadline_ns, c.now + 10000 * kMs);
  EXPECT_FALSE(c.m().Exists({"k"})[0]);
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0].status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c.m().Stats().pending, 1u);
  ExpectConsistent(c);

  ASSERT_TRUE(c.End("k", a.value(), {true, true, true}, 0xABCD).ok());
  EXPECT_TRUE(c.m().Exists({"k"})[0]);
  auto g = c.m().GetReplicas({"k"}, "", c.now);
  ASSERT_TRUE(g[0].ok());
  EXPECT_EQ(g[0]->version, a->version);
  EXPECT_EQ(g[0]->sizes, (std::vector<uint64_t>{1000, 2000}));
  EXPECT_EQ(g[0]->checksum, 0xABCDu);
  EXPECT_EQ(g[0]->replicas.size(), 3u);
  // Every node got the record before the put was acknowledged.
  for (const auto& n : nodes) EXPECT_TRUE(c.nodes[n].Holds("k", a->version)) << n;
  auto st = c.m().Stats();
  EXPECT_EQ(st.objects, 1u);
  EXPECT_EQ(st.pending, 0u);
  EXPECT_EQ(st.bytes, 3000u);
  EXPECT_EQ(st.replica_bytes, 9000u);
  ExpectConsistent(c);
}

TEST(MasterPut, BadInputFailsOnlyItsKey) {
  MasterConfig cfg;
  cfg.max_key_bytes = 8;
  cfg.max_buffers = 2;
  cfg.max_object_bytes = 4096;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  std::vector<PutItem> items = {
      {"", {10}},          {"123456789", {10}}, {"nobuf", {}},
      {"many", {1, 1, 1}}, {"zero", {10, 0}},   {"big", {4000, 97}},
      {"dup", {10}},       {"dup", {20}},       {"good", {10, 20}},
  };
  auto r = c.m().PutStart(items, {}, c.now);
  ASSERT_EQ(r.size(), items.size());
  const char* want[] = {"empty",  "max_key_bytes",    "no buffers", "max_buffers",
                        "size 0", "max_object_bytes", "2 times",    "2 times"};
  for (size_t i = 0; i < 8; ++i) {
    ASSERT_FALSE(r[i].ok()) << i;
    EXPECT_EQ(r[i].status().code(), StatusCode::kInvalidArgument) << i;
    EXPECT_NE(r[i].status().message().find(want[i]), std::string::npos) << r[i].status().ToString();
  }
  ASSERT_TRUE(r[8].ok()) << r[8].status().ToString();
  EXPECT_EQ(c.m().Stats().pending, 1u);
  ExpectConsistent(c);
}

TEST(MasterPut, ReplicaNumIsChecked) {
  MasterConfig cfg;
  cfg.min_replicas = 2;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  for (uint32_t n : {0u, 1u, 9u}) {
    PutOptions o;
    o.replica_num = n;
    auto r = c.m().PutStart({{"a", {10}}, {"b", {10}}}, o, c.now);
    for (auto& x : r) {
      EXPECT_EQ(x.status().code(), StatusCode::kInvalidArgument) << n;
      EXPECT_NE(x.status().message().find("replica_num"), std::string::npos);
    }
  }
  EXPECT_EQ(c.m().Stats().pending, 0u);
}

TEST(MasterPut, ExistingKeyIsAlreadyExistsWhetherCompleteOrPending) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("done", 100).ok());
  auto pending = c.Start("pending", {100});
  ASSERT_TRUE(pending.ok());
  auto r = c.m().PutStart({{"done", {100}}, {"pending", {50}}, {"new", {10}}}, {}, c.now);
  EXPECT_EQ(r[0].status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(r[1].status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(r[2].ok());
  EXPECT_EQ(c.m().Stats().pending, 2u);
}

TEST(MasterPut, NoSpaceLeavesNothingAllocated) {
  Cluster c;
  c.AddNode("n0", {64 * kKiB});
  c.AddNode("n1", {8 * kKiB});
  // Too few nodes for the replicas.
  auto r = c.Start("three", {100}, 3);
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(r.status().message().find("need 3"), std::string::npos) << r.status().ToString();
  // Fits on n0 but not on n1: nothing may stay behind on n0.
  r = c.Start("wide", {16 * kKiB}, 2);
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_EQ(c.Used("n0"), 0u);
  EXPECT_EQ(c.Used("n1"), 0u);
  EXPECT_FALSE(c.m().Exists({"wide"})[0]);
  EXPECT_EQ(c.m().Stats().pending, 0u);
  // The same key can be put once it fits.
  EXPECT_TRUE(c.Start("wide", {4 * kKiB}, 2).ok());
  ExpectConsistent(c);
}

TEST(MasterPut, PlacesOnMostFreeSpaceAndPrefersTheClientNode) {
  Cluster c;
  c.AddNode("small", {1 << 20});
  c.AddNode("medium", {2 << 20});
  c.AddNode("large", {3 << 20});
  auto a = c.Start("a", {4096}, 2);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->replicas[0].node.node_id, "large");
  EXPECT_EQ(a->replicas[1].node.node_id, "medium");
  auto b = c.Start("b", {4096}, 1, "small");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->replicas[0].node.node_id, "small");
  // Segments of one node: the one with more free space.
  c.AddNode("two", {1 << 20, 8 << 20});
  auto d = c.Start("d", {4096}, 1, "two");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->replicas[0].segment_id, 101u);
}

TEST(MasterPutEnd, PartialReplicaFailureKeepsTheRest) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  auto a = c.Start("k", {4096}, 3);
  ASSERT_TRUE(a.ok());
  const std::string failed = a->replicas[1].node.node_id;
  PutEndPlan plan = c.m().BeginPutEnd({{"k", a->version, {true, false, true}, 7}}, c.now);
  ASSERT_TRUE(plan.early[0].ok());
  ASSERT_EQ(plan.commits.size(), 2u);
  for (const auto& cm : plan.commits) {
    EXPECT_NE(cm.node.node_id, failed);
    EXPECT_EQ(cm.control_endpoint, "ep-" + cm.node.node_id);
    ASSERT_EQ(cm.records.size(), 1u);
    EXPECT_EQ(cm.records[0].key, "k");
    EXPECT_EQ(cm.records[0].checksum, 7u);
    EXPECT_EQ(cm.records[0].replica_num, 3u);
  }
  // Held, not freed: the client gave up on that write, but bytes it sent may still land.
  EXPECT_EQ(c.Used(failed), 4096u);
  for (auto& cm : plan.commits) c.Deliver(cm, Commit::kOk);
  auto fin = c.m().FinishPutEnd(plan, c.now);
  ASSERT_TRUE(fin[0].ok()) << fin[0].ToString();
  EXPECT_EQ(c.ReplicaNodes("k").size(), 2u);
  ExpectConsistent(c);
  // Back to its target of 3 by re-replication.
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 1u);
  c.HeartbeatAll();
  EXPECT_EQ(c.RunAllTasks(), 1u);
  EXPECT_EQ(c.ReplicaNodes("k").size(), 3u);
  EXPECT_TRUE(c.nodes[failed].Holds("k", a->version));
  ExpectConsistent(c);
}

TEST(MasterPutEnd, CommitFailureDropsThatReplica) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  auto a = c.Start("k", {4096}, 2);
  ASSERT_TRUE(a.ok());
  // n1 applied the commit but its reply was lost: the master drops the replica and tells n1.
  Status st = c.End("k", a.value(), {true, true}, 1, [](const NodeIdentity& n) {
    return n.node_id == "n1" ? Commit::kLostReply : Commit::kOk;
  });
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(c.ReplicaNodes("k"), std::vector<std::string>{"n0"});
  EXPECT_EQ(c.Used("n1"), 0u);
  EXPECT_TRUE(c.nodes["n1"].Holds("k", a->version));
  ASSERT_TRUE(c.Heartbeat(c.nodes["n1"]).ok());
  EXPECT_FALSE(c.nodes["n1"].Holds("k", a->version));
  ExpectConsistent(c);

  // Every commit fails: revoked, nothing left.
  auto b = c.Start("b", {4096}, 2);
  ASSERT_TRUE(b.ok());
  st = c.End("b", b.value(), {true, true}, 1, [](const NodeIdentity&) { return Commit::kFail; });
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_FALSE(c.m().Exists({"b"})[0]);
  EXPECT_EQ(c.Start("b", {4096}, 2).status().ok(), true);  // the key is free again
  ExpectConsistent(c);
}

TEST(MasterPutEnd, MinReplicasDecides) {
  MasterConfig cfg;
  cfg.min_replicas = 2;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  auto a = c.Start("two_of_three", {4096}, 3);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(c.End("two_of_three", a.value(), {true, false, true}, 1).ok());
  auto b = c.Start("one_of_three", {4096}, 3);
  ASSERT_TRUE(b.ok());
  PutEndPlan plan =
      c.m().BeginPutEnd({{"one_of_three", b->version, {false, true, false}, 1}}, c.now);
  EXPECT_EQ(plan.early[0].code(), StatusCode::kUnavailable);
  EXPECT_NE(plan.early[0].message().find("min_replicas"), std::string::npos);
  EXPECT_TRUE(plan.commits.empty());
  EXPECT_EQ(c.m().FinishPutEnd(plan, c.now)[0].code(), StatusCode::kUnavailable);
  EXPECT_FALSE(c.m().Exists({"one_of_three"})[0]);
  // Written twice but committed once: revoked too.
  auto d = c.Start("d", {4096}, 2);
  ASSERT_TRUE(d.ok());
  Status st = c.End("d", d.value(), {true, true}, 1, [&](const NodeIdentity& n) {
    return n == d->replicas[0].node ? Commit::kOk : Commit::kFail;
  });
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_FALSE(c.m().Exists({"d"})[0]);
  ExpectConsistent(c);
  // The failed writes' ranges are held to their writer's deadline plus the late-write margin;
  // d's were written (COMMITTING) and are freed at once.
  uint64_t used = 0;
  for (const auto& n : c.m().Stats().nodes) used += n.used;
  EXPECT_EQ(used, 2 * 4096u + 3 * 4096u);  // two_of_three's replicas, three failed writes
  EXPECT_EQ(c.m().Stats().held_bytes, 3 * 4096u);
  c.now = b->deadline_ns + c.cfg().late_write_margin_ms * kMs;
  c.HeartbeatAll();
  c.m().Tick(c.now);
  EXPECT_EQ(c.m().Stats().held_bytes, 0u);
}

TEST(MasterPutEnd, EarlyErrors) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  auto a = c.Start("k", {100});
  ASSERT_TRUE(a.ok());
  PutEndPlan plan = c.m().BeginPutEnd({{"", 1, {true}, 0},
                                       {"nokey", 1, {true}, 0},
                                       {"k", a->version + 1, {true}, 0},
                                       {"k", a->version, {true, true}, 0},
                                       {"k", a->version, {true}, 0},
                                       {"k", a->version, {true}, 0}},
                                      c.now);
  EXPECT_EQ(plan.early[0].code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.early[1].code(), StatusCode::kNotFound);
  EXPECT_EQ(plan.early[2].code(), StatusCode::kNotFound);
  EXPECT_NE(plan.early[2].message().find("version"), std::string::npos);
  EXPECT_EQ(plan.early[3].code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(plan.early[4].ok());
  EXPECT_EQ(plan.early[5].code(), StatusCode::kUnavailable);  // in flight
  for (auto& cm : plan.commits) c.Deliver(cm, Commit::kOk);
  auto fin = c.m().FinishPutEnd(plan, c.now);
  EXPECT_TRUE(fin[4].ok());
  EXPECT_EQ(fin[1].code(), StatusCode::kNotFound);
  auto again = c.m().BeginPutEnd({{"k", a->version, {true}, 0}}, c.now);
  EXPECT_EQ(again.early[0].code(), StatusCode::kAlreadyExists);
}

TEST(MasterPutEnd, RevokeBetweenThePhasesIsCaught) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  auto a = c.Start("k", {4096}, 2);
  ASSERT_TRUE(a.ok());
  PutEndPlan plan = c.m().BeginPutEnd({{"k", a->version, {true, true}, 1}}, c.now);
  ASSERT_TRUE(plan.early[0].ok());
  // The client may not revoke while its put end is in flight.
  EXPECT_EQ(c.m().PutRevoke({{"k", a->version}}, c.now)[0].code(), StatusCode::kUnavailable);
  EXPECT_EQ(c.m().Remove("k", c.now).code(), StatusCode::kUnavailable);
  // The commits stall past put_timeout_ms: the master revokes on its own.
  for (auto& cm : plan.commits) c.Deliver(cm, Commit::kOk);
  c.now += 10000 * kMs;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).puts_revoked, 1u);
  auto fin = c.m().FinishPutEnd(plan, c.now);
  EXPECT_EQ(fin[0].code(), StatusCode::kNotFound);
  EXPECT_FALSE(c.m().Exists({"k"})[0]);
  // The records the nodes took are freed there.
  c.HeartbeatAll();
  EXPECT_FALSE(c.nodes["n0"].Holds("k", a->version));
  EXPECT_FALSE(c.nodes["n1"].Holds("k", a->version));
  EXPECT_EQ(c.Used("n0") + c.Used("n1"), 0u);
  ExpectConsistent(c);
}

TEST(MasterPutEnd, NodeDeathBetweenThePhasesLosesOnlyItsReplica) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  auto a = c.Start("k", {4096}, 2);
  ASSERT_TRUE(a.ok());
  PutEndPlan plan = c.m().BeginPutEnd({{"k", a->version, {true, true}, 1}}, c.now);
  for (auto& cm : plan.commits) c.Deliver(cm, Commit::kOk);
  ASSERT_TRUE(c.m().Deregister(c.nodes["n1"].id, c.now).ok());
  auto fin = c.m().FinishPutEnd(plan, c.now);
  ASSERT_TRUE(fin[0].ok()) << fin[0].ToString();
  EXPECT_EQ(c.ReplicaNodes("k"), std::vector<std::string>{"n0"});
  ExpectConsistent(c);
}

TEST(MasterPutRevoke, RevokesPendingOnly) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  auto a = c.Start("p", {4096});
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c.Put("done", 100).ok());
  auto r = c.m().PutRevoke(
      {{"p", a->version + 5}, {"nokey", 1}, {"done", 2}, {"", 1}, {"p", a->version}}, c.now);
  EXPECT_EQ(r[0].code(), StatusCode::kNotFound);
  EXPECT_EQ(r[1].code(), StatusCode::kNotFound);
  EXPECT_EQ(r[2].code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(r[3].code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(r[4].ok());
  EXPECT_FALSE(c.m().Exists({"p"})[0]);
  EXPECT_EQ(c.m().Stats().pending, 0u);
  // A revoked put's range waits for its writer's deadline plus the late-write margin.
  EXPECT_EQ(c.Used("n0"), 128u + 4096u);
  c.now = a->deadline_ns + c.cfg().late_write_margin_ms * kMs - 1;
  c.HeartbeatAll();
  c.m().Tick(c.now);
  EXPECT_EQ(c.Used("n0"), 128u + 4096u);
  c.now += 1;
  c.HeartbeatAll();
  c.m().Tick(c.now);
  EXPECT_EQ(c.Used("n0"), 128u);  // "done" only
  ExpectConsistent(c);
}

TEST(MasterPutRevoke, TimeoutRevokesPendingPuts) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  auto a = c.Start("k", {4096});
  ASSERT_TRUE(a.ok());
  c.now = a->deadline_ns - 1;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).puts_revoked, 0u);
  c.now = a->deadline_ns;
  EXPECT_EQ(c.m().Tick(c.now).puts_revoked, 1u);
  // A late client may still be writing: the range is reused only a margin after its deadline.
  EXPECT_EQ(c.Used("n0"), 4096u);
  c.now = a->deadline_ns + c.cfg().late_write_margin_ms * kMs;
  c.HeartbeatAll();
  c.m().Tick(c.now);
  EXPECT_EQ(c.Used("n0"), 0u);
  EXPECT_EQ(c.End("k", a.value(), {true}, 0).code(), StatusCode::kNotFound);
  EXPECT_EQ(c.m().Stats().revokes_total, 1u);
  ExpectConsistent(c);
}

// ------------------------------------------------------------------ get, lease, remove

TEST(MasterGet, OrdersLocalFirstThenHealthyAndLeases) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  auto a = c.Start("k", {4096}, 3);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c.End("k", a.value(), {true, true, true}, 9).ok());
  auto g = c.m().GetReplicas({"k", "", "missing"}, "n2", c.now);
  ASSERT_TRUE(g[0].ok());
  EXPECT_EQ(g[0]->replicas[0].node.node_id, "n2");
  EXPECT_EQ(g[0]->lease_expiry_ns, c.now + 5000 * kMs);
  EXPECT_EQ(g[1].status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g[2].status().code(), StatusCode::kNotFound);
  // A node with bad reports comes last; a draining one after the healthy ones.
  ASSERT_TRUE(c.m().StartDrain(c.nodes["n0"].id, c.now).ok());
  auto h = c.m().GetReplicas({"k"}, "", c.now);
  ASSERT_TRUE(h[0].ok());
  EXPECT_EQ(h[0]->replicas.back().node.node_id, "n0");
  // Reads spread over the healthy replicas.
  std::set<std::string> firsts;
  for (int i = 0; i < 4; ++i) {
    firsts.insert(c.m().GetReplicas({"k"}, "", c.now)[0]->replicas[0].node.node_id);
  }
  EXPECT_EQ(firsts, (std::set<std::string>{"n1", "n2"}));
  // A later read extends the lease.
  c.now += 1000 * kMs;
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0]->lease_expiry_ns, c.now + 5000 * kMs);
}

TEST(MasterRemove, LeasedSpaceIsFreedOnlyWhenTheLeaseExpires) {
  MasterConfig cfg;
  cfg.max_put_fill = 1.0;  // this test is about leases: let one object fill the segment
  Cluster c(cfg);
  c.AddNode("n0", {4 * kKiB});
  ASSERT_TRUE(c.Put("k", 4 * kKiB).ok());
  auto g = c.m().GetReplicas({"k"}, "", c.now);
  ASSERT_TRUE(g[0].ok());
  ASSERT_TRUE(c.m().Remove("k", c.now).ok());
  EXPECT_FALSE(c.m().Exists({"k"})[0]);
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0].status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c.Used("n0"), 4 * kKiB);
  EXPECT_EQ(c.m().Stats().held_bytes, 4 * kKiB);
  ExpectConsistent(c);
  // The reader may still be reading: the space is not reused, not even by eviction.
  EXPECT_EQ(c.Start("other", {4 * kKiB}).status().code(), StatusCode::kNoSpace);
  c.now = g[0]->lease_expiry_ns - 1;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).ranges_released, 0u);
  EXPECT_TRUE(c.nodes["n0"].Holds("k", g[0]->version));
  c.now = g[0]->lease_expiry_ns;
  EXPECT_EQ(c.m().Tick(c.now).ranges_released, 1u);
  EXPECT_EQ(c.Used("n0"), 0u);
  c.HeartbeatAll();
  EXPECT_FALSE(c.nodes["n0"].Holds("k", g[0]->version));
  EXPECT_TRUE(c.Start("other", {4 * kKiB}).ok());
  ExpectConsistent(c);
}

TEST(MasterRemove, UnleasedIsFreedAtOnceAndErrorsAreNamed) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096).ok());
  ASSERT_TRUE(c.Start("p", {100}).ok());
  EXPECT_EQ(c.m().Remove("", c.now).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.m().Remove("nokey", c.now).code(), StatusCode::kNotFound);
  EXPECT_EQ(c.m().Remove("p", c.now).code(), StatusCode::kUnavailable);
  ASSERT_TRUE(c.m().Remove("k", c.now).ok());
  EXPECT_EQ(c.Used("n0"), 128u);  // "p"
  EXPECT_EQ(c.m().Remove("k", c.now).code(), StatusCode::kNotFound);
}

TEST(MasterRemove, RemoveAllKeepsPendingPuts) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c.Put("k" + std::to_string(i), 100).ok());
  ASSERT_TRUE(c.Start("p", {100}).ok());
  EXPECT_EQ(c.m().RemoveAll(c.now), 5u);
  auto ex = c.m().Exists({"k0", "k4", "p"});
  EXPECT_FALSE(ex[0]);
  EXPECT_FALSE(ex[1]);
  EXPECT_FALSE(ex[2]);  // pending: not visible, but kept
  EXPECT_EQ(c.m().Stats().pending, 1u);
  EXPECT_EQ(c.m().Stats().objects, 0u);
  ExpectConsistent(c);
}

// ------------------------------------------------------------------ eviction

TEST(MasterEviction, PutsStayUnderTheHighWatermarkAndRepairsMayUseTheHeadroom) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 1000;
  Cluster c(cfg);
  c.AddNode("n0", {100 * kKiB});
  for (int i = 0; i < 200; ++i) {
    c.now += kMs;
    ASSERT_TRUE(c.Put("k" + std::to_string(i), kKiB).ok()) << i;
    ASSERT_LE(c.Used("n0"), 90 * kKiB) << "a put filled past the high watermark";
  }
  EXPECT_GT(c.m().Stats().evictions_total, 0u);
  // Evictions went down to the low watermark, not one object at a time.
  EXPECT_LT(c.m().Stats().evictions_total, 200u - 90u + 20u);
  ExpectConsistent(c);
}

TEST(MasterEviction, EvictsLruToLowWatermarkSparingLeasedPinnedAndPending) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 1000;  // exact LRU for the check
  cfg.max_put_fill = 1.0;           // fill past the high watermark: Tick is what evicts here
  Cluster c(cfg);
  c.AddNode("n0", {100 * kKiB});
  for (int i = 0; i < 93; ++i) {
    c.now += kMs;
    ASSERT_TRUE(c.Put("k" + std::to_string(i), kKiB).ok());
  }
  auto pinned = c.Start("pinned", {kKiB}, 1, "", true);
  ASSERT_TRUE(pinned.ok());
  ASSERT_TRUE(c.End("pinned", pinned.value(), {true}, 0).ok());
  ASSERT_TRUE(c.Start("pending", {kKiB}).ok());
  // Read the five oldest: leased, and no longer least recently used.
  std::vector<std::string> leased;
  for (int i = 0; i < 5; ++i) leased.push_back("k" + std::to_string(i));
  ASSERT_TRUE(c.m().GetReplicas(leased, "", c.now)[0].ok());
  EXPECT_EQ(c.Used("n0"), 95 * kKiB);

  auto t = c.m().Tick(c.now);
  EXPECT_EQ(t.objects_evicted, 15u);
  EXPECT_LE(c.Used("n0"), 80 * kKiB);
  auto ex = c.m().Exists(leased);
  for (bool e : ex) EXPECT_TRUE(e);
  EXPECT_TRUE(c.m().Exists({"pinned"})[0]);
  auto snap = c.m().Snapshot();
  ASSERT_NE(Find(snap, "pending"), nullptr);
  for (int i = 5; i < 20; ++i) EXPECT_FALSE(c.m().Exists({"k" + std::to_string(i)})[0]) << i;
  for (int i = 20; i < 93; ++i) EXPECT_TRUE(c.m().Exists({"k" + std::to_string(i)})[0]) << i;
  EXPECT_EQ(c.m().Stats().evictions_total, 15u);
  ExpectConsistent(c);
}

TEST(MasterEviction, NothingEvictableMeansNothingEvicted) {
  MasterConfig cfg;
  cfg.max_put_fill = 1.0;
  Cluster c(cfg);
  c.AddNode("n0", {10 * kKiB});
  std::vector<std::string> keys;
  for (int i = 0; i < 10; ++i) {
    keys.push_back("k" + std::to_string(i));
    ASSERT_TRUE(c.Put(keys.back(), kKiB).ok());
  }
  ASSERT_TRUE(c.m().GetReplicas(keys, "", c.now)[0].ok());
  EXPECT_EQ(c.m().Tick(c.now).objects_evicted, 0u);
  EXPECT_EQ(c.Start("x", {kKiB}).status().code(), StatusCode::kNoSpace);
  c.now += 5000 * kMs;  // leases over
  c.HeartbeatAll();
  EXPECT_GT(c.m().Tick(c.now).objects_evicted, 0u);
  EXPECT_LE(c.Used("n0"), 8 * kKiB);
}

TEST(MasterEviction, PutStartEvictsWhenShort) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 1000;
  cfg.max_put_fill = 1.0;
  Cluster c(cfg);
  c.AddNode("n0", {8 * kKiB});
  c.AddNode("n1", {8 * kKiB});
  for (int i = 0; i < 8; ++i) {
    c.now += kMs;
    ASSERT_TRUE(c.Put("k" + std::to_string(i), kKiB, 2).ok());
  }
  ASSERT_TRUE(c.m().GetReplicas({"k0"}, "", c.now)[0].ok());  // k0 is leased
  auto a = c.Start("big", {2 * kKiB}, 2);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  // k0 is leased; the least recently used others go until the low watermark (0.8) leaves room.
  EXPECT_TRUE(c.m().Exists({"k0"})[0]);
  for (int i = 1; i <= 4; ++i) EXPECT_FALSE(c.m().Exists({"k" + std::to_string(i)})[0]) << i;
  EXPECT_TRUE(c.m().Exists({"k5"})[0]);
  ExpectConsistent(c);
}

// ------------------------------------------------------------------ failures and repair

TEST(MasterRepair, DeadNodeReplicasAreDroppedAndRestored) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  ASSERT_TRUE(c.Put("two", 4096, 2, "n0").ok());
  ASSERT_TRUE(c.Put("one", 4096, 1, "n0").ok());
  auto g = c.m().GetReplicas({"two"}, "", c.now);
  ASSERT_TRUE(g[0].ok());
  const uint64_t version = g[0]->version;
  std::string survivor;
  for (const auto& r : g[0]->replicas) {
    if (r.node.node_id != "n0") survivor = r.node.node_id;
  }
  // n0 goes silent; the others keep heartbeating.
  FakeNode n0 = c.nodes["n0"];
  c.nodes.erase("n0");
  for (int i = 0; i < 3; ++i) {
    c.now += 1000 * kMs;
    c.HeartbeatAll();
  }
  auto t = c.m().Tick(c.now);
  EXPECT_EQ(t.nodes_expired, 1u);
  EXPECT_EQ(t.tasks_created, 1u);
  EXPECT_FALSE(c.m().Exists({"one"})[0]);  // its only replica died
  EXPECT_EQ(c.ReplicaNodes("two"), std::vector<std::string>{survivor});
  ExpectConsistent(c);

  // The survivor gets the task in its next heartbeat; the destination is the third node.
  c.HeartbeatAll();
  FakeNode& src = c.nodes[survivor];
  ASSERT_EQ(src.tasks.size(), 1u);
  const ReplicationTask task = src.tasks[0];
  src.tasks.clear();
  EXPECT_EQ(task.key, "two");
  EXPECT_EQ(task.version, version);
  EXPECT_EQ(task.source.node, src.id);
  EXPECT_NE(task.dest.node.node_id, survivor);
  EXPECT_NE(task.dest.node.node_id, "n0");
  EXPECT_EQ(task.dest_descriptor, "desc-" + task.dest.node.node_id);
  EXPECT_EQ(task.dest.length, 4096u);
  EXPECT_EQ(task.deadline_ns, c.now + 10000 * kMs);
  // Not handed out twice; not readable before it is done.
  c.HeartbeatAll();
  EXPECT_TRUE(src.tasks.empty());
  EXPECT_EQ(c.ReplicaNodes("two").size(), 1u);
  EXPECT_EQ(c.m().Stats().tasks_in_flight, 1u);

  EXPECT_EQ(c.m().TaskDone(task.task_id, {survivor, 99}, true, c.now).status().code(),
            StatusCode::kStalePeer);
  EXPECT_EQ(c.m().TaskDone(12345, src.id, true, c.now).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(c.RunTask(task).ok());
  EXPECT_EQ(c.ReplicaNodes("two").size(), 2u);
  EXPECT_TRUE(c.nodes[task.dest.node.node_id].Holds("two", version));
  EXPECT_EQ(c.m().Stats().tasks_in_flight, 0u);
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 0u);
  EXPECT_EQ(c.m().Stats().under_replicated, 0u);
  ExpectConsistent(c);
}

TEST(MasterRepair, FailedTaskIsRetriedLaterElsewhere) {
  MasterConfig cfg;
  cfg.repair_backoff_ms = 1000;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  c.AddNode("n3", {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096, 2, "n0").ok());
  ASSERT_TRUE(c.m().Deregister(c.nodes["n0"].id, c.now).ok());
  c.nodes.erase("n0");
  ASSERT_EQ(c.m().Tick(c.now).tasks_created, 1u);
  c.HeartbeatAll();
  ReplicationTask first;
  for (auto& [n, node] : c.nodes) {
    if (!node.tasks.empty()) first = node.tasks[0], node.tasks.clear();
  }
  ASSERT_NE(first.task_id, 0u);
  const uint64_t dest_used = c.Used(first.dest.node.node_id);
  EXPECT_EQ(dest_used, 4096u);
  auto plan = c.m().TaskDone(first.task_id, first.source.node, false, c.now);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->commits.empty());
  // The source gave up, but bytes it sent may still land: held to the task's deadline plus
  // the late-write margin.
  EXPECT_EQ(c.Used(first.dest.node.node_id), 4096u);
  EXPECT_EQ(c.m().TaskDone(first.task_id, first.source.node, true, c.now).status().code(),
            StatusCode::kNotFound);
  ExpectConsistent(c);
  c.now += 999 * kMs;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 0u);  // backing off
  c.now += 1 * kMs;
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 1u);
  c.HeartbeatAll();
  ReplicationTask second;
  for (auto& [n, node] : c.nodes) {
    if (!node.tasks.empty()) second = node.tasks[0], node.tasks.clear();
  }
  ASSERT_NE(second.task_id, 0u);
  EXPECT_NE(second.dest.node.node_id, first.dest.node.node_id);
  // This one times out instead.
  c.now += 10000 * kMs;
  c.HeartbeatAll();
  auto t = c.m().Tick(c.now);
  EXPECT_EQ(t.tasks_timed_out, 1u);
  ExpectConsistent(c);
  c.now += 1000 * kMs;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 1u);
  c.HeartbeatAll();
  EXPECT_EQ(c.RunAllTasks(), 1u);
  EXPECT_EQ(c.ReplicaNodes("k").size(), 2u);
  ExpectConsistent(c);
}

TEST(MasterRepair, CommitFailureOfATaskRetries) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096, 2, "n0").ok());
  ASSERT_TRUE(c.m().Deregister(c.nodes["n0"].id, c.now).ok());
  c.nodes.erase("n0");
  ASSERT_EQ(c.m().Tick(c.now).tasks_created, 1u);
  c.HeartbeatAll();
  ReplicationTask task;
  for (auto& [n, node] : c.nodes) {
    if (!node.tasks.empty()) task = node.tasks[0], node.tasks.clear();
  }
  EXPECT_EQ(c.RunTask(task, true, Commit::kLostReply).code(), StatusCode::kUnavailable);
  EXPECT_EQ(c.ReplicaNodes("k").size(), 1u);
  c.HeartbeatAll();  // the dest drops the record it took
  EXPECT_FALSE(c.nodes[task.dest.node.node_id].Holds("k", task.version));
  c.now += 1000 * kMs;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 1u);  // only one other node: the same one again
  c.HeartbeatAll();
  EXPECT_EQ(c.RunAllTasks(), 1u);
  EXPECT_EQ(c.ReplicaNodes("k").size(), 2u);
  EXPECT_TRUE(c.nodes[task.dest.node.node_id].Holds("k", task.version));
  ExpectConsistent(c);
}

TEST(MasterRepair, BadReplicaIsDroppedAndReplaced) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096, 2, "n0").ok());
  ASSERT_TRUE(c.Put("solo", 4096, 1, "n1").ok());
  auto g = c.m().GetReplicas({"k", "solo"}, "", c.now);
  const uint64_t v = g[0]->version;
  EXPECT_EQ(c.m().ReportBadReplica("k", v + 1, c.nodes["n0"].id, c.now).code(),
            StatusCode::kNotFound);
  EXPECT_EQ(c.m().ReportBadReplica("k", v, {"n0", 5}, c.now).code(), StatusCode::kNotFound);
  EXPECT_EQ(c.m().ReportBadReplica("nokey", 1, c.nodes["n0"].id, c.now).code(),
            StatusCode::kNotFound);
  ASSERT_TRUE(c.m().ReportBadReplica("k", v, c.nodes["n0"].id, c.now).ok());
  EXPECT_EQ(c.m().ReportBadReplica("k", v, c.nodes["n0"].id, c.now).code(),
            StatusCode::kNotFound);  // already handled
  auto after = c.ReplicaNodes("k");
  ASSERT_EQ(after.size(), 1u);
  EXPECT_NE(after[0], "n0");
  // Held under the reader's lease, then freed.
  EXPECT_GT(c.m().Stats().held_bytes, 0u);
  ExpectConsistent(c);
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 1u);
  c.HeartbeatAll();
  EXPECT_EQ(c.RunAllTasks(), 1u);
  EXPECT_EQ(c.ReplicaNodes("k").size(), 2u);
  // The last replica reported bad: the object is gone.
  ASSERT_TRUE(c.m().ReportBadReplica("solo", g[1]->version, c.nodes["n1"].id, c.now).ok());
  EXPECT_FALSE(c.m().Exists({"solo"})[0]);
  c.now += 5000 * kMs;
  c.HeartbeatAll();
  c.m().Tick(c.now);
  EXPECT_EQ(c.m().Stats().held_bytes, 0u);
  ExpectConsistent(c);
}

// A reader that cannot reach a node (unreachable, frozen, restarted) says nothing about the
// replicas there: the node is placed last for a while, and every replica stays, even the last
// one of an object. Only the node's own liveness (TTL, registration) drops them.
TEST(MasterRepair, UnreachableNodeReportsKeepEveryReplica) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("big", {4 << 20});
  ASSERT_TRUE(c.Put("solo", 4096, 1, "big").ok());
  ASSERT_EQ(c.ReplicaNodes("solo"), std::vector<std::string>{"big"});
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c.m().ReportUnreachableNode(c.nodes["big"].id, c.now).ok());
  }
  EXPECT_TRUE(c.m().Exists({"solo"})[0]) << "the last replica was dropped";
  EXPECT_EQ(c.ReplicaNodes("solo"), std::vector<std::string>{"big"});
  EXPECT_EQ(c.m().Stats().bad_replicas_total, 0u);
  EXPECT_EQ(c.m().Stats().unreachable_reports_total, 3u);
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 0u) << "nothing to repair";
  // Suspect: new data goes to the other node although "big" has more room.
  ASSERT_TRUE(c.Put("next", 4096).ok());
  EXPECT_EQ(c.ReplicaNodes("next"), std::vector<std::string>{"n0"});
  // Another incarnation of the node, or no such node: NOT_FOUND, nothing changes.
  EXPECT_EQ(c.m().ReportUnreachableNode({"big", c.nodes["big"].id.incarnation + 1}, c.now).code(),
            StatusCode::kNotFound);
  EXPECT_EQ(c.m().ReportUnreachableNode({"nobody", 1}, c.now).code(), StatusCode::kNotFound);
  EXPECT_EQ(c.m().Stats().unreachable_reports_total, 3u);
  ExpectConsistent(c);
}

// ------------------------------------------------------------------ drain

TEST(MasterDrain, MovesEverythingThenReportsDrained) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c.Put("solo" + std::to_string(i), 4096, 1, "n0").ok());
  ASSERT_TRUE(c.Put("pair", 4096, 2, "n0").ok());
  auto g = c.m().GetReplicas({"solo0"}, "", c.now);  // a reader holds a lease on n0's copy
  ASSERT_TRUE(g[0].ok());

  EXPECT_EQ(c.m().StartDrain({"n0", 9}, c.now).code(), StatusCode::kStalePeer);
  ASSERT_TRUE(c.m().StartDrain(c.nodes["n0"].id, c.now).ok());
  ASSERT_TRUE(c.m().StartDrain(c.nodes["n0"].id, c.now).ok());  // idempotent
  // No new allocations on n0, even for a client on n0.
  auto a = c.Start("new", {4096}, 2, "n0");
  ASSERT_TRUE(a.ok());
  for (const auto& r : a->replicas) EXPECT_NE(r.node.node_id, "n0");
  EXPECT_EQ(c.Start("three", {4096}, 3).status().code(), StatusCode::kNoSpace);

  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 6u);
  c.HeartbeatAll();
  EXPECT_FALSE(c.nodes["n0"].drained);
  EXPECT_EQ(c.nodes["n0"].tasks.size(), 6u);  // the draining node is the source
  EXPECT_EQ(c.RunAllTasks(), 6u);
  c.m().Tick(c.now);
  c.HeartbeatAll();
  EXPECT_FALSE(c.nodes["n0"].drained);  // solo0's old copy is still under a lease
  c.now = g[0]->lease_expiry_ns;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).drains_finished, 1u);
  c.HeartbeatAll();
  EXPECT_TRUE(c.nodes["n0"].drained);
  EXPECT_TRUE(c.nodes["n0"].records.empty());  // every record freed on the node
  ASSERT_TRUE(c.m().Deregister(c.nodes["n0"].id, c.now).ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(c.ReplicaNodes("solo" + std::to_string(i)).size(), 1u);
  EXPECT_EQ(c.ReplicaNodes("pair").size(), 2u);
  ExpectConsistent(c);
}

TEST(MasterDrain, TimesOutWhenNothingCanMove) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096).ok());
  ASSERT_TRUE(c.m().StartDrain(c.nodes["n0"].id, c.now).ok());
  const uint64_t start = c.now;
  for (int i = 0; i < 29; ++i) {
    c.now += 1000 * kMs;
    c.HeartbeatAll();
    c.m().Tick(c.now);
    c.HeartbeatAll();
    ASSERT_FALSE(c.nodes["n0"].drained) << i;
  }
  EXPECT_TRUE(c.m().Exists({"k"})[0]);  // kept readable to the end
  c.now = start + 30000 * kMs;
  c.HeartbeatAll();
  EXPECT_TRUE(c.nodes["n0"].drained);
  auto st = c.m().Stats();
  EXPECT_EQ(st.nodes[0].state, NodeState::kDraining);
  ExpectConsistent(c);
}

// ------------------------------------------------------------------ master restart

TEST(MasterRestart, InventoriesRebuildTheTable) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20, 1 << 20});
  c.AddNode("n2", {1 << 20});
  std::map<std::string, ReplicaSet> before;
  for (int i = 0; i < 20; ++i) {
    const std::string key = "k" + std::to_string(i);
    ASSERT_TRUE(c.Put(key, 1000 + 37 * i, 1 + i % 3, "", 0x1000 + i).ok());
  }
  ASSERT_TRUE(c.m().Remove("k3", c.now).ok());
  c.HeartbeatAll();                          // k3's frees reach the node
  auto pending = c.Start("pending", {100});  // never acknowledged: lost
  ASSERT_TRUE(pending.ok());
  for (int i = 0; i < 20; ++i) {
    const std::string key = "k" + std::to_string(i);
    auto g = c.m().GetReplicas({key}, "", c.now);
    if (g[0].ok()) before[key] = g[0].value();
  }
  uint64_t max_version = 0;
  for (const auto& [key, b] : before) max_version = std::max(max_version, b.version);

  auto replies = c.Restart();
  for (const auto& r : replies) EXPECT_TRUE(r.frees.empty());
  EXPECT_GE(c.m().Stats().next_version, max_version + 1);
  EXPECT_EQ(c.m().Stats().objects, before.size());
  EXPECT_FALSE(c.m().Exists({"k3"})[0]);
  EXPECT_FALSE(c.m().Exists({"pending"})[0]);
  for (const auto& [key, b] : before) {
    auto g = c.m().GetReplicas({key}, "", c.now);
    ASSERT_TRUE(g[0].ok()) << key;
    EXPECT_EQ(g[0]->version, b.version);
    EXPECT_EQ(g[0]->sizes, b.sizes);
    EXPECT_EQ(g[0]->checksum, b.checksum);
    auto sorted = [](std::vector<ReplicaLocation> v) {
      std::sort(v.begin(), v.end(),
                [](const auto& x, const auto& y) { return x.node.node_id < y.node.node_id; });
      return v;
    };
    EXPECT_EQ(sorted(g[0]->replicas), sorted(b.replicas)) << key;
    auto snap = c.m().Snapshot();
    EXPECT_EQ(Find(snap, key)->target_replicas, b.replicas.size());
  }
  ExpectConsistent(c);
  // Nothing needs copying once every node is back.
  c.now += 3000 * kMs;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 0u);
  // Versions continue upward.
  auto a = c.Start("fresh", {100});
  ASSERT_TRUE(a.ok());
  EXPECT_GT(a->version, max_version);
}

// A node that expired comes back (same incarnation, re-registering with everything it held).
// What left with it (its object's last copy) comes back; its copies of objects that stayed on
// other nodes and were then removed, or removed and put again, are freed, never revived;
// copies of objects still there count as replicas (up to the target).
TEST(MasterMembership, ExpiredNodeBringsBackOnlyWhatLeftWithIt) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  ASSERT_TRUE(c.Put("kept", 4096, 2).ok());
  ASSERT_TRUE(c.Put("removed", 4096, 2).ok());
  ASSERT_TRUE(c.Put("rewritten", 4096, 2).ok());
  ASSERT_TRUE(c.Put("only-n0", 4096, 1, "n0").ok());
  ASSERT_TRUE(c.Put("only-n0-removed", 4096, 1, "n0").ok());
  ASSERT_EQ(c.ReplicaNodes("only-n0"), std::vector<std::string>{"n0"});
  const uint64_t old_rewritten = c.m().GetReplicas({"rewritten"}, "", c.now)[0]->version;
  // n0 goes silent: after the TTL it is dead, "only-n0" and "only-n0-removed" went with it.
  c.PassSeconds(4, {"n1"});
  ASSERT_EQ(c.m().Heartbeat(c.nodes["n0"].id, 0, c.now).status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(c.m().Exists({"only-n0"})[0]);
  // Meanwhile: removes, and a key removed and put again.
  ASSERT_TRUE(c.m().Remove("removed", c.now).ok());
  ASSERT_TRUE(c.m().Remove("rewritten", c.now).ok());
  ASSERT_TRUE(c.Put("rewritten", 4096, 1).ok());
  EXPECT_EQ(c.m().Remove("only-n0-removed", c.now).code(), StatusCode::kNotFound);
  c.now += 5000 * kMs;  // leases over: the removed objects' space is freed on n1
  ASSERT_TRUE(c.Heartbeat(c.nodes["n1"]).ok());
  c.m().Tick(c.now);
  ASSERT_TRUE(c.Heartbeat(c.nodes["n1"]).ok());

  FakeNode& n0 = c.nodes["n0"];
  ASSERT_EQ(n0.records.size(), 5u) << "silent, n0 got no frees: it still holds every record";
  auto back = c.Register(n0);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const auto exists = c.m().Exists({"kept", "removed", "rewritten", "only-n0", "only-n0-removed"});
  EXPECT_TRUE(exists[0]);
  EXPECT_FALSE(exists[1]) << "a removed object came back with the node";
  EXPECT_TRUE(exists[2]);
  EXPECT_TRUE(exists[3]) << "the object that left with the node did not come back";
  EXPECT_FALSE(exists[4]) << "an object removed (while only the departed node held it) came back";
  auto rewritten = c.m().GetReplicas({"rewritten"}, "", c.now);
  ASSERT_TRUE(rewritten[0].ok());
  EXPECT_GT(rewritten[0]->version, old_rewritten);
  EXPECT_FALSE(n0.Holds("rewritten", old_rewritten)) << "the old version's copy was not freed";
  for (const auto& [at, r] : n0.records) {
    EXPECT_TRUE(r.key != "removed" && r.key != "only-n0-removed")
        << "n0's copy of removed " << r.key << " was not freed";
  }
  EXPECT_EQ(c.ReplicaNodes("kept").size(), 2u) << "n0's copy of a live object counts again";
  EXPECT_EQ(c.ReplicaNodes("only-n0"), std::vector<std::string>{"n0"});
  ExpectConsistent(c);
}

// What a departed node held is remembered for departed_ttl_ms; a node back after that is
// taken as a restarted master takes nodes: every record of a key the table lacks comes back.
TEST(MasterMembership, DepartedNodeIsRememberedForDepartedTtl) {
  MasterConfig cfg;
  cfg.departed_ttl_ms = 10000;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  ASSERT_TRUE(c.Put("removed", 4096, 2).ok());
  c.PassSeconds(4, {"n1"});
  ASSERT_TRUE(c.m().Remove("removed", c.now).ok());
  c.PassSeconds(11, {"n1"});
  ASSERT_TRUE(c.Register(c.nodes["n0"]).ok());
  EXPECT_TRUE(c.m().Exists({"removed"})[0]);
  ExpectConsistent(c);
}

// The note kept for a departed node is one entry per copy (MasterStats::departed_copies), and
// with many copies it still answers for each one exactly: of 600 objects that left with the
// node, the 200 removed and the 200 put again while it was away stay gone (their copies are
// freed), the other 200 come back; the note is used up when the node returns.
TEST(MasterMembership, DepartedNoteOfManyCopiesAnswersForEachOne) {
  Cluster c;
  c.AddNode("n0", {64ull << 20});
  c.AddNode("n1", {64ull << 20});
  constexpr int kKeys = 600;
  auto key = [](int i) { return "page-" + std::to_string(i * 7919) + "-of-a-long-prefix"; };
  for (int i = 0; i < kKeys; ++i) ASSERT_TRUE(c.Put(key(i), 4096, 1, "n0").ok()) << i;
  ASSERT_TRUE(c.Put("stays", 4096, 2).ok());
  EXPECT_EQ(c.m().Stats().departed_copies, 0u);
  c.PassSeconds(4, {"n1"});
  MasterStats st = c.m().Stats();
  EXPECT_EQ(st.departed_nodes, 1u);
  EXPECT_EQ(st.departed_copies, kKeys + 1u) << "one entry per copy n0 held";
  for (int i = 0; i < kKeys; i += 3) {
    EXPECT_EQ(c.m().Remove(key(i), c.now).code(), StatusCode::kNotFound);
    ASSERT_TRUE(c.Put(key(i + 1), 4096, 1, "n1").ok());
  }
  FakeNode& n0 = c.nodes["n0"];
  ASSERT_EQ(n0.records.size(), kKeys + 1u);
  ASSERT_TRUE(c.Register(n0).ok());
  for (int i = 0; i < kKeys; ++i) {
    const bool back = c.m().Exists({key(i)})[0];
    if (i % 3 == 0) {
      EXPECT_FALSE(back) << key(i) << " was removed while n0 was away, yet came back";
    } else if (i % 3 == 1) {
      EXPECT_EQ(c.ReplicaNodes(key(i)), std::vector<std::string>{"n1"})
          << key(i) << ": the old copy on n0 came back over the new version";
    } else {
      EXPECT_EQ(c.ReplicaNodes(key(i)), std::vector<std::string>{"n0"})
          << key(i) << " left with n0 and did not come back";
    }
  }
  size_t held_by_n0 = 0;
  for (const auto& [at, r] : n0.records) {
    const int i = r.key == "stays" ? 2 : std::stoi(r.key.substr(5)) / 7919;
    EXPECT_EQ(i % 3, 2) << "n0 still holds " << r.key << ", which it should have freed";
    ++held_by_n0;
  }
  EXPECT_EQ(held_by_n0, kKeys / 3 + 1u) << "n0 freed copies it should have kept";
  st = c.m().Stats();
  EXPECT_EQ(st.departed_nodes, 0u);
  EXPECT_EQ(st.departed_copies, 0u);
  ExpectConsistent(c);
}

// Any caller can register a made-up node id and leave, and each one leaves a departed note:
// past max_departed_nodes the oldest notes are dropped. A node whose note was dropped is taken
// as one back after departed_ttl_ms (here: the object removed while it was away comes back),
// but still takes no new data until the leases it was under have ended.
TEST(MasterMembership, DepartedNotesOfMadeUpIdsAreCappedOldestFirst) {
  MasterConfig cfg;
  cfg.lease_ms = 60000;
  cfg.max_departed_nodes = 8;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  ASSERT_TRUE(c.Put("removed", 4096, 2).ok());
  ASSERT_EQ(c.ReplicaNodes("removed").size(), 2u);  // a read: leased 60 s on n0 too
  const uint64_t lease_end = c.now + cfg.lease_ms * kMs;
  c.PassSeconds(4, {"n1"});  // n0 silent: dead; its note is the oldest
  ASSERT_EQ(c.m().Heartbeat(c.nodes["n0"].id, 0, c.now).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(c.m().Remove("removed", c.now).ok());
  ASSERT_EQ(c.m().Stats().departed_nodes, 1u);
  constexpr int kMadeUp = 1000;
  for (int i = 0; i < kMadeUp; ++i) {
    FakeNode fake;
    fake.id = {"made-up-" + std::to_string(i), 1};
    fake.segments.push_back({100, 1 << 20});
    ASSERT_TRUE(c.Register(fake).ok());
    ASSERT_TRUE(c.m().Deregister(fake.id, c.now).ok());
    ASSERT_LE(c.m().Stats().departed_nodes, 8u) << "after " << i + 1 << " made-up ids left";
    c.now += kMs;  // each note a little younger than the last
  }
  ASSERT_TRUE(c.Heartbeat(c.nodes["n1"]).ok());
  MasterStats st = c.m().Stats();
  EXPECT_GE(st.departed_nodes, 7u) << "dropped below 7/8 of the cap";
  EXPECT_EQ(st.departed_dropped_total, kMadeUp + 1u - st.departed_nodes);

  NodeRegistration back = c.nodes["n0"].Registration();
  back.registered_before = true;
  auto r = c.m().RegisterNode(back, c.nodes["n0"].Inventory(), c.now);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->no_alloc_ms, (lease_end - c.now) / kMs)
      << "n0 came back without its note and took data while its old leases still ran";
  EXPECT_TRUE(c.m().Exists({"removed"})[0])
      << "n0's note (the oldest) was not the one dropped: its removed object stayed removed";
  ExpectConsistent(c);
}

// max_departed_copies bounds the copies all notes hold together: the oldest notes go first,
// and a note that alone holds more than the cap is not kept either.
TEST(MasterMembership, DepartedCopiesAreCappedOldestFirst) {
  MasterConfig cfg;
  cfg.max_departed_copies = 100;
  Cluster c(cfg);
  c.AddNode("a", {1 << 20});
  c.AddNode("b", {1 << 20});
  c.AddNode("big", {1 << 20});
  for (int i = 0; i < 60; ++i) {
    ASSERT_TRUE(c.Put("a-" + std::to_string(i), 4096, 1, "a").ok());
    ASSERT_TRUE(c.Put("b-" + std::to_string(i), 4096, 1, "b").ok());
  }
  for (int i = 0; i < 120; ++i) ASSERT_TRUE(c.Put("big-" + std::to_string(i), 4096, 1, "big").ok());
  ASSERT_TRUE(c.m().Deregister(c.nodes["a"].id, c.now).ok());
  EXPECT_EQ(c.m().Stats().departed_copies, 60u);
  c.now += kMs;
  ASSERT_TRUE(c.m().Deregister(c.nodes["b"].id, c.now).ok());
  MasterStats st = c.m().Stats();
  EXPECT_EQ(st.departed_nodes, 1u) << "120 copies kept over a cap of 100";
  EXPECT_EQ(st.departed_copies, 60u);
  EXPECT_EQ(st.departed_dropped_total, 1u);
  // Which note stayed: b's (the newer). b's records of its own objects come back with it.
  FakeNode& b = c.nodes["b"];
  ASSERT_TRUE(c.m().Remove("b-0", c.now).code() == StatusCode::kNotFound);
  ASSERT_TRUE(c.Register(b).ok());
  EXPECT_FALSE(c.m().Exists({"b-0"})[0]) << "b's note was dropped instead of a's (the older)";
  EXPECT_TRUE(c.m().Exists({"b-1"})[0]);
  c.now += kMs;
  ASSERT_TRUE(c.m().Deregister(c.nodes["big"].id, c.now).ok());
  st = c.m().Stats();
  EXPECT_EQ(st.departed_copies, 0u) << "a note of 120 copies kept over a cap of 100";
  EXPECT_EQ(st.departed_dropped_total, 2u);
}

TEST(MasterRestart, FirstVersionComesFromTheConfig) {
  MasterConfig cfg;
  cfg.first_version = 1700000000000000ull;
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  auto a = c.Start("k", {100});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->version, cfg.first_version);
}

TEST(MasterRestart, ConflictingRecordsAreResolvedAndFreed) {
  Cluster c;
  c.AddNode("n0", {64 * kKiB});
  c.AddNode("n1", {64 * kKiB});
  const std::vector<uint64_t> sz = {1000};
  auto rec = [&](std::string key, uint64_t v, uint64_t seg, uint64_t off, uint64_t id,
                 uint32_t crc = 1) { return InventoryRecord{key, v, sz, crc, seg, off, 2, id}; };
  // Fed by hand to a fresh master.
  auto r = MasterState::Create(c.cfg());
  ASSERT_TRUE(r.ok());
  MasterState& m = *r.value();
  std::vector<InventoryRecord> inv0 = {
      rec("a", 5, 100, 0, 10),          // a@5
      rec("a", 3, 100, 1024, 11),       // an older a on the same node
      rec("b", 7, 100, 2048, 20),       // b@7, allocated after...
      rec("c", 8, 100, 2048, 12),       // ...c@8 was freed there (its free never arrived)
      rec("d", 2, 999, 0, 13),          // unknown segment
      rec("e", 2, 100, 64 * kKiB, 14),  // past the segment
      rec("f", 2, 100, 10, 15),         // misaligned
      rec("", 2, 100, 8192, 16),        // malformed key
      InventoryRecord{"g", 2, {}, 0, 100, 8192, 1, 17},  // no buffers
      rec("i", 2, 100, 16384, 0),                        // no replica id
      rec("h", 40, 100, 12288, 18),
  };
  auto r0 = m.RegisterNode(c.nodes["n0"].Registration(), inv0, c.now);
  ASSERT_TRUE(r0.ok());
  EXPECT_EQ(r0->records_accepted, 3u);
  std::set<std::string> freed0;
  for (const auto& f : r0->frees) freed0.insert(f.key + "@" + std::to_string(f.version));
  EXPECT_EQ(freed0, (std::set<std::string>{"a@3", "c@8", "d@2", "e@2", "f@2", "@2", "g@2", "i@2"}));

  std::vector<InventoryRecord> inv1 = {
      rec("a", 5, 100, 0, 30),           // a second replica of a@5
      rec("b", 9, 100, 4096, 31),        // newer b: replaces b@7 (freed on n0)
      rec("h", 40, 100, 8192, 32, 999),  // same version, other checksum: inconsistent
      rec("z", 1, 100, 12288, 33),
  };
  auto r1 = m.RegisterNode(c.nodes["n1"].Registration(), inv1, c.now);
  ASSERT_TRUE(r1.ok());
  ASSERT_EQ(r1->frees.size(), 1u);
  EXPECT_EQ(r1->frees[0].key, "h");
  auto hb = m.Heartbeat(c.nodes["n0"].id, r0->free_seqs.back(), c.now);
  ASSERT_TRUE(hb.ok());
  ASSERT_EQ(hb->frees.size(), 1u);
  EXPECT_EQ(hb->frees[0].key, "b");
  EXPECT_EQ(hb->frees[0].version, 7u);
  EXPECT_EQ(hb->frees[0].replica_id, 20u);

  auto g = m.GetReplicas({"a", "b", "c", "h", "z"}, "", c.now);
  ASSERT_TRUE(g[0].ok());
  EXPECT_EQ(g[0]->version, 5u);
  EXPECT_EQ(g[0]->replicas.size(), 2u);
  ASSERT_TRUE(g[1].ok());
  EXPECT_EQ(g[1]->version, 9u);
  EXPECT_EQ(g[1]->replicas.size(), 1u);
  EXPECT_EQ(g[1]->replicas[0].node.node_id, "n1");
  EXPECT_EQ(g[2].status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(g[3].ok());
  EXPECT_EQ(g[3]->version, 40u);
  EXPECT_EQ(g[3]->checksum, 1u);
  ASSERT_TRUE(g[4].ok());
  EXPECT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants().ToString();
  EXPECT_TRUE(SnapshotHolds(m.Snapshot()));
  // Versions and replica ids resume above the highest reported, even freed ones.
  auto a = m.PutStart({{"new", {10}}}, {}, c.now);
  ASSERT_TRUE(a[0].ok());
  EXPECT_EQ(a[0]->version, 41u);
  // An old replica arriving after the object is at its target is surplus...
  auto r2 =
      m.RegisterNode({{"n2", 1}, "d", "e", {{100, 64 * kKiB}}}, {rec("a", 5, 100, 0, 40)}, c.now);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->frees.size(), 1u);
  // ...unless it is on a draining node, which keeps it until the drain moves it.
  auto r3 = m.RegisterNode({{"n3", 1}, "d", "e", {{100, 64 * kKiB}}, /*draining=*/true},
                           {rec("a", 5, 100, 0, 41)}, c.now);
  ASSERT_TRUE(r3.ok());
  EXPECT_TRUE(r3->frees.empty());
  EXPECT_EQ(m.Stats().nodes.back().state, NodeState::kDraining);
  EXPECT_EQ(m.GetReplicas({"a"}, "", c.now)[0]->replicas.size(), 3u);
  auto snap = m.Snapshot();
  const auto* fresh = Find(snap, "new");
  ASSERT_NE(fresh, nullptr);
  EXPECT_TRUE(m.CheckInvariants().ok());
}

// ------------------------------------------------------------------ stats

TEST(MasterStats, ReportsNodesObjectsAndBytes) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {2 << 20});
  ASSERT_TRUE(c.Put("a", 1000, 2).ok());
  ASSERT_TRUE(c.Start("p", {100}).ok());
  auto st = c.m().Stats();
  ASSERT_EQ(st.nodes.size(), 2u);
  EXPECT_EQ(st.nodes[0].identity.node_id, "n0");
  EXPECT_EQ(st.nodes[0].capacity, 1u << 20);
  EXPECT_EQ(st.nodes[1].capacity, 2u << 20);
  EXPECT_EQ(st.nodes[0].state, NodeState::kActive);
  EXPECT_EQ(st.nodes[0].used + st.nodes[1].used, 1024u + 1024u + 128u);
  EXPECT_EQ(st.objects, 1u);
  EXPECT_EQ(st.pending, 1u);
  EXPECT_EQ(st.bytes, 1000u);
  EXPECT_STREQ(NodeStateName(NodeState::kDraining), "DRAINING");
  auto dir = c.m().GetNodeDirectory({"n1", "nX"});
  ASSERT_EQ(dir.nodes.size(), 1u);
  EXPECT_EQ(dir.nodes[0].engine_descriptor, "desc-n1");
  EXPECT_EQ(dir.nodes[0].control_endpoint, "ep-n1");
  EXPECT_EQ(c.m().GetNodeDirectory({}).nodes.size(), 2u);
}

TEST(MasterConcurrency, CallsFromManyThreadsKeepTheTableConsistent) {
  Cluster c;
  for (int i = 0; i < 4; ++i) c.AddNode("n" + std::to_string(i), {256 * kKiB});
  MasterState& m = c.m();
  std::atomic<uint64_t> clock{c.now};
  std::atomic<int> puts_completed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 1500; ++i) {
        const uint64_t now = clock.fetch_add(kMs);
        const std::string key = "k" + std::to_string(rng() % 200);
        switch (rng() % 6) {
          case 0: {
            PutOptions o;
            o.replica_num = 1 + rng() % 3;
            auto a = m.PutStart({{key, {1 + rng() % 8192}}}, o, now);
            if (!a[0].ok()) break;
            auto plan = m.BeginPutEnd(
                {{key, a[0]->version, std::vector<bool>(a[0]->replicas.size(), true), 1}}, now);
            for (auto& cm : plan.commits) cm.ok = rng() % 10 != 0;
            puts_completed += m.FinishPutEnd(plan, now)[0].ok();
            break;
          }
          case 1:
          case 2:
            (void)m.GetReplicas({key}, "n" + std::to_string(t), now);
            break;
          case 3:
            (void)m.Remove(key, now);
            break;
          case 4:
            (void)m.Heartbeat({"n" + std::to_string(t), 1}, 0, now);
            break;
          default:
            m.Tick(now);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  ExpectConsistent(c);
  // (How many objects survive depends on the interleaving: a thread that finishes early stops
  // heartbeating its node while the shared clock runs on, so nodes may expire.)
  EXPECT_GT(puts_completed.load(), 0) << "the test exercised nothing";
}

// ------------------------------------------------------------------ randomized

// Thousands of random operations over four nodes with deaths, restarts, drains and master
// restarts; after every step the invariants hold, and every COMPLETE replica is known (has its
// inventory record) on its node.
class MasterRandomized : public ::testing::TestWithParam<uint64_t> {};

TEST_P(MasterRandomized, InvariantsHoldUnderRandomOperations) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 4;
  cfg.max_tasks_per_node = 4;
  cfg.random_seed = GetParam();
  Cluster c(cfg);
  std::mt19937_64 rng(GetParam());
  auto chance = [&](double p) { return std::uniform_real_distribution<>(0, 1)(rng) < p; };
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  const std::vector<std::string> names = {"n0", "n1", "n2", "n3"};
  std::map<std::string, bool> silent;  // not heartbeating (dead or partitioned)
  uint64_t incarnation = 1;
  for (const auto& n : names) c.AddNode(n, {32 * kKiB, 8 * kKiB}, incarnation);

  struct Put {
    std::string key;
    PutAllocation alloc;
  };
  std::vector<Put> puts;
  std::vector<PutEndPlan> plans;
  std::vector<std::pair<TaskCommitPlan, Commit>> task_plans;
  auto key = [&] { return "key" + std::to_string(pick(120)); };
  auto commit_mode = [&] {
    return chance(0.85) ? Commit::kOk : (chance(0.5) ? Commit::kFail : Commit::kLostReply);
  };
  size_t completes = 0, task_oks = 0, restarts = 0, deaths = 0;

  for (int step = 0; step < 5000; ++step) {
    c.now += pick(400) * kMs;
    const size_t op = pick(100);
    if (op < 25) {  // put start
      PutOptions o;
      o.replica_num = 1 + pick(3);
      o.client_node_id = chance(0.3) ? names[pick(4)] : "";
      o.pinned = chance(0.05);
      std::vector<PutItem> items;
      for (size_t i = 0, n = 1 + pick(3); i < n; ++i) {
        std::vector<uint64_t> sizes;
        for (size_t b = 0, nb = 1 + pick(2); b < nb; ++b) sizes.push_back(1 + pick(6 * kKiB));
        items.push_back({key(), sizes});
      }
      auto r = c.m().PutStart(items, o, c.now);
      for (size_t i = 0; i < r.size(); ++i) {
        if (r[i].ok()) puts.push_back({items[i].key, r[i].value()});
      }
    } else if (op < 45 && !puts.empty()) {  // put end, maybe left half-done for a while
      const size_t i = pick(puts.size());
      std::vector<bool> flags;
      for (size_t k = 0; k < puts[i].alloc.replicas.size(); ++k) flags.push_back(chance(0.9));
      plans.push_back(c.m().BeginPutEnd(
          {{puts[i].key, puts[i].alloc.version, flags, static_cast<uint32_t>(rng())}}, c.now));
      for (auto& cm : plans.back().commits) c.Deliver(cm, commit_mode());
      puts.erase(puts.begin() + i);
      if (chance(0.7)) {
        for (const Status& s : c.m().FinishPutEnd(plans.back(), c.now)) completes += s.ok();
        plans.pop_back();
      }
    } else if (op < 50 && !plans.empty()) {  // a delayed put end finishes
      const size_t i = pick(plans.size());
      for (const Status& s : c.m().FinishPutEnd(plans[i], c.now)) completes += s.ok();
      plans.erase(plans.begin() + i);
    } else if (op < 53 && !puts.empty()) {  // revoke
      const size_t i = pick(puts.size());
      (void)c.m().PutRevoke({{puts[i].key, puts[i].alloc.version}}, c.now);
      puts.erase(puts.begin() + i);
    } else if (op < 63) {  // get
      std::vector<std::string> keys = {key(), key()};
      auto g = c.m().GetReplicas(keys, names[pick(4)], c.now);
      if (g[0].ok() && chance(0.1)) {  // a reader reports a bad copy
        (void)c.m().ReportBadReplica(keys[0], g[0]->version,
                                     g[0]->replicas[pick(g[0]->replicas.size())].node, c.now);
      }
    } else if (op < 66) {
      (void)c.m().Remove(key(), c.now);
    } else if (op < 67 && chance(0.1)) {
      c.m().RemoveAll(c.now);
    } else if (op < 80) {  // heartbeats, and the tasks they bring are run
      for (auto& [name, n] : c.nodes) {
        if (silent[name]) continue;
        Status st = c.Heartbeat(n);
        if (st.IsNotFound()) {  // declared dead while partitioned: back with its inventory
          ASSERT_TRUE(c.Register(n).ok());
        }
        if (n.drained) {  // leaves, and comes back later as a fresh process
          ASSERT_TRUE(c.m().Deregister(n.id, c.now).ok());
          n.records.clear();
          n.tasks.clear();
          n.drained = false;
          n.draining = false;
          n.id.incarnation = ++incarnation;
          ASSERT_TRUE(c.Register(n).ok());
        }
      }
      for (auto& [name, n] : c.nodes) {
        auto tasks = std::move(n.tasks);
        n.tasks.clear();
        for (const auto& t : tasks) {
          if (silent[name] || chance(0.2)) continue;  // lost: times out
          auto plan = c.m().TaskDone(t.task_id, n.id, chance(0.9), c.now);
          if (!plan.ok()) continue;
          const Commit mode = commit_mode();
          for (auto& cm : plan->commits) c.Deliver(cm, mode);
          if (chance(0.8)) {
            task_oks += c.m().FinishTask(plan.value(), c.now).ok();
          } else {
            task_plans.push_back({plan.value(), mode});
          }
        }
      }
    } else if (op < 82 && !task_plans.empty()) {
      const size_t i = pick(task_plans.size());
      task_oks += c.m().FinishTask(task_plans[i].first, c.now).ok();
      task_plans.erase(task_plans.begin() + i);
    } else if (op < 85) {  // a node goes silent, or comes back
      const std::string& name = names[pick(4)];
      FakeNode& n = c.nodes[name];
      if (!silent[name]) {
        silent[name] = true;
        n.partitioned = true;
        ++deaths;
      } else {
        silent[name] = false;
        n.partitioned = false;
        if (chance(0.5)) {  // restarted process: new incarnation, memory lost
          n.records.clear();
          n.tasks.clear();
          n.draining = false;
          n.id.incarnation = ++incarnation;
        }
        auto reg = c.Register(n);
        ASSERT_TRUE(reg.ok() || reg.status().code() == StatusCode::kAlreadyExists)
            << reg.status().ToString();
      }
    } else if (op < 86) {
      const std::string& name = names[pick(4)];
      if (!silent[name] && c.m().StartDrain(c.nodes[name].id, c.now).ok()) {
        c.nodes[name].draining = true;
      }
    } else if (op < 87 && chance(0.2)) {  // master restart
      std::map<std::string, std::pair<uint64_t, uint32_t>> complete;
      for (const auto& o : c.m().Snapshot().objects) {
        bool known = false;
        for (const auto& r : o.replicas) {
          known |= r.state == ReplicaState::kComplete && !silent[r.location.node.node_id];
        }
        if (o.state == ObjectState::kComplete && known) complete[o.key] = {o.version, o.checksum};
      }
      // Live nodes re-register; silent ones stay away until they come back.
      std::map<std::string, FakeNode> away;
      for (const auto& [name, dead] : silent) {
        if (dead) away[name] = c.nodes[name], c.nodes.erase(name);
      }
      c.Restart();
      for (auto& [name, n] : away) c.nodes[name] = std::move(n);
      for (auto& [name, n] : c.nodes) n.tasks.clear();  // the new master knows none of them
      puts.clear();
      plans.clear();
      task_plans.clear();
      for (const auto& [k, vc] : complete) {
        auto g = c.m().GetReplicas({k}, "", c.now);
        ASSERT_TRUE(g[0].ok()) << k << " lost in a master restart";
        EXPECT_GE(g[0]->version, vc.first) << k;
        if (g[0]->version == vc.first) {
          EXPECT_EQ(g[0]->checksum, vc.second) << k;
        }
      }
      ++restarts;
    } else {
      c.m().Tick(c.now);
    }

    Status st = c.m().CheckInvariants();
    ASSERT_TRUE(st.ok()) << "step " << step << ": " << st.ToString();
    const MasterSnapshot snap = c.m().Snapshot();
    ASSERT_TRUE(SnapshotHolds(snap)) << "step " << step;
    for (const auto& o : snap.objects) {
      for (const auto& r : o.replicas) {
        if (r.state != ReplicaState::kComplete) continue;
        const FakeNode& n = c.nodes.at(r.location.node.node_id);
        auto rec = n.records.find({r.location.segment_id, r.location.offset});
        ASSERT_TRUE(rec != n.records.end() && rec->second.key == o.key &&
                    rec->second.version == o.version && rec->second.replica_id == r.replica_id)
            << "step " << step << ": " << o.key << " complete on " << r.location.node.node_id
            << " but the node has no record of it";
      }
    }
  }
  // The run exercised what it is meant to.
  EXPECT_GT(completes, 200u);
  EXPECT_GT(task_oks, 20u);
  EXPECT_GT(deaths, 10u);
  EXPECT_GT(restarts, 0u);
  EXPECT_GT(c.m().Stats().evictions_total + c.m().Stats().revokes_total, 0u);
}

// ------------------------------------------------------------------ SSD tier

TEST(MasterTier, DramAboveTheDemoteWatermarkMovesToSsdAndDramIsFreedAfterTheLease) {
  Cluster c;
  FakeNode& n = AddTieredNode(c, "n0", 64 * kKiB, 256 * kKiB);
  for (int i = 0; i < 14; ++i) {  // 56 KiB of 64: above 0.75
    ASSERT_TRUE(c.Put("k" + std::to_string(i), 4 * kKiB).ok());
    c.now += kMs;  // k0 is the coldest
  }
  auto g = c.m().GetReplicas({"k13"}, "", c.now);  // the newest is leased and hot
  TickSummary t = c.m().Tick(c.now);
  EXPECT_GT(t.demotions_scheduled, 0u);
  EXPECT_EQ(t.objects_evicted, 0u);
  ExpectConsistent(c);
  std::vector<Demotion> ds = HeartbeatDemotions(c, n);
  ASSERT_EQ(ds.size(), t.demotions_scheduled);
  // Coldest first, down to the low watermark: 56 KiB -> at most 0.6 * 64 = 38.4 KiB.
  EXPECT_EQ(ds[0].source.key, "k0");
  EXPECT_EQ(ds.size(), 5u);
  for (const Demotion& d : ds) {
    EXPECT_EQ(d.source.segment_id, 100u);
    EXPECT_EQ(d.dest.segment_id, 200u);
    EXPECT_NE(d.dest.replica_id, d.source.replica_id);
    EXPECT_EQ(d.dest.version, d.source.version);
    EXPECT_GT(d.deadline_ns, c.now);
  }
  // Until reported, the object is read from DRAM; once reported, from SSD.
  auto before = c.m().GetReplicas({"k0"}, "", c.now);
  ASSERT_TRUE(before[0].ok());
  EXPECT_EQ(before[0]->replicas[0].tier, Tier::kDram);
  for (const Demotion& d : ds) ASSERT_TRUE(RunDemotion(c, n, d).ok());
  ExpectConsistent(c);
  auto after = c.m().GetReplicas({"k1"}, "", c.now);
  ASSERT_TRUE(after[0].ok());
  EXPECT_EQ(after[0]->replicas[0].tier, Tier::kSsd);
  EXPECT_EQ(after[0]->replicas[0].segment_id, 200u);
  MasterStats st = c.m().Stats();
  EXPECT_EQ(st.demotions_total, 5u);
  EXPECT_EQ(st.ssd_replicas, 5u);
  EXPECT_EQ(st.objects, 14u);
  EXPECT_EQ(st.evictions_total, 0u);
  // k0 was leased by the read above: its DRAM range is held until then; the others are free.
  EXPECT_EQ(st.held_bytes, 4 * kKiB);
  EXPECT_EQ(c.Used("n0"), 40 * kKiB);
  while (c.now < before[0]->lease_expiry_ns) {  // heartbeating, as a live node does
    c.now = std::min(c.now + 500 * kMs, before[0]->lease_expiry_ns);
    EXPECT_TRUE(HeartbeatDemotions(c, n).empty());
    c.m().Tick(c.now);
  }
  HeartbeatDemotions(c, n);
  EXPECT_EQ(c.Used("n0"), 36 * kKiB);
  // The node dropped every DRAM record and keeps the SSD ones.
  for (const Demotion& d : ds) {
    EXPECT_FALSE(n.records.count({d.source.segment_id, d.source.offset}) &&
                 n.records.at({d.source.segment_id, d.source.offset}).replica_id ==
                     d.source.replica_id);
    EXPECT_TRUE(n.records.count({d.dest.segment_id, d.dest.offset}));
  }
  ExpectConsistent(c);
  (void)g;
}

TEST(MasterTier, LeasesProtectSsdReplicasLikeDramOnes) {
  Cluster c;
  FakeNode* node = nullptr;
  std::vector<Demotion> ds = FillTieredNode(c, &node);
  FakeNode& n = *node;
  ASSERT_FALSE(ds.empty());
  for (const Demotion& d : ds) ASSERT_TRUE(RunDemotion(c, n, d).ok());
  const Demotion& d = ds[0];
  auto g = c.m().GetReplicas({d.source.key}, "", c.now);  // a reader holds a lease on SSD
  ASSERT_TRUE(g[0].ok());
  ASSERT_EQ(g[0]->replicas[0].tier, Tier::kSsd);
  const uint64_t ssd_used = c.m().Stats().nodes[0].ssd_used;
  ASSERT_TRUE(c.m().Remove(d.source.key, c.now).ok());
  // The SSD range is held, and the node keeps the object, until the lease ends.
  EXPECT_EQ(c.m().Stats().nodes[0].ssd_used, ssd_used);
  HeartbeatDemotions(c, n);
  EXPECT_TRUE(n.records.count({d.dest.segment_id, d.dest.offset}));
  while (c.now < g[0]->lease_expiry_ns) {
    c.now = std::min(c.now + 500 * kMs, g[0]->lease_expiry_ns);
    HeartbeatDemotions(c, n);
    c.m().Tick(c.now);
  }
  HeartbeatDemotions(c, n);
  EXPECT_EQ(c.m().Stats().nodes[0].ssd_used, ssd_used - 4 * kKiB);
  EXPECT_FALSE(n.records.count({d.dest.segment_id, d.dest.offset}));
  ExpectConsistent(c);
}

TEST(MasterTier, FailedLateOrUnwantedDemotionsReleaseTheSsdRange) {
  Cluster c;
  FakeNode* node = nullptr;
  std::vector<Demotion> ds = FillTieredNode(c, &node);
  FakeNode& n = *node;
  ASSERT_GE(ds.size(), 3u);
  // 1. The node could not write: the replica stays in DRAM, the SSD range is released.
  ASSERT_TRUE(RunDemotion(c, n, ds[0], /*ok=*/false).ok());
  // 2. The object was removed meanwhile: NOT_FOUND, the node drops its copy.
  ASSERT_TRUE(c.m().Remove(ds[1].source.key, c.now).ok());
  EXPECT_EQ(RunDemotion(c, n, ds[1]).code(), StatusCode::kNotFound);
  EXPECT_FALSE(n.records.count({ds[1].dest.segment_id, ds[1].dest.offset}));
  ExpectConsistent(c);
  // 3. Not reported in time: cancelled; a late report is NOT_FOUND.
  size_t timed_out = 0;
  while (c.now < ds[2].deadline_ns) {
    c.now = std::min(c.now + 500 * kMs, ds[2].deadline_ns);
    for (const Demotion& d : HeartbeatDemotions(c, n)) ASSERT_TRUE(RunDemotion(c, n, d).ok());
    timed_out += c.m().Tick(c.now).demotions_timed_out;
  }
  EXPECT_GE(timed_out, 1u);
  EXPECT_EQ(RunDemotion(c, n, ds[2]).code(), StatusCode::kNotFound);
  ExpectConsistent(c);
  auto g = c.m().GetReplicas({ds[0].source.key, ds[2].source.key}, "", c.now);
  for (const auto& r : g) {
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->replicas[0].tier, Tier::kDram);
  }
  // They are demoted again later, with new SSD ranges.
  c.now += 10 * kMs;
  c.m().Tick(c.now);
  std::vector<Demotion> again = HeartbeatDemotions(c, n);
  EXPECT_FALSE(again.empty());
  for (const Demotion& d : again) ASSERT_TRUE(RunDemotion(c, n, d).ok());
  ExpectConsistent(c);
  EXPECT_EQ(c.m().Stats().evictions_total, 0u);
}

// A node whose DemoteDone answer was lost asks again: a move already applied answers OK (the
// node keeps the copy the master lists), every time, and changes nothing; a repeat for a move
// that was not applied, or a failure report for an applied one, changes nothing either.
TEST(MasterTier, RepeatedDemoteDoneForAnAppliedMoveAnswersOkAndChangesNothing) {
  Cluster c;
  FakeNode* node = nullptr;
  std::vector<Demotion> ds = FillTieredNode(c, &node);
  FakeNode& n = *node;
  ASSERT_GE(ds.size(), 2u);
  ASSERT_TRUE(RunDemotion(c, n, ds[0]).ok());
  const MasterStats before = c.m().Stats();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(c.m()
                    .DemoteDone(n.id, ds[0].source.key, ds[0].source.version, ds[0].dest.replica_id,
                                true, c.now)
                    .ok());
  }
  const MasterStats after = c.m().Stats();
  EXPECT_EQ(after.demotions_total, before.demotions_total) << "a repeat counted as a new move";
  EXPECT_EQ(after.ssd_replicas, before.ssd_replicas);
  EXPECT_EQ(after.nodes[0].ssd_used, before.nodes[0].ssd_used);
  EXPECT_EQ(after.nodes[0].used, before.nodes[0].used);
  // A failure report naming the applied move does not undo it (NOT_FOUND: no move pending).
  EXPECT_EQ(c.m()
                .DemoteDone(n.id, ds[0].source.key, ds[0].source.version, ds[0].dest.replica_id,
                            false, c.now)
                .code(),
            StatusCode::kNotFound);
  auto g = c.m().GetReplicas({ds[0].source.key}, "", c.now);
  ASSERT_TRUE(g[0].ok());
  EXPECT_EQ(g[0]->replicas[0].tier, Tier::kSsd);
  EXPECT_EQ(g[0]->replicas[0].offset, ds[0].dest.offset);
  // The source replica id is not the applied move: NOT_FOUND, as for any move not wanted.
  EXPECT_EQ(c.m()
                .DemoteDone(n.id, ds[0].source.key, ds[0].source.version, ds[0].source.replica_id,
                            true, c.now)
                .code(),
            StatusCode::kNotFound);
  // Another object's pending move is untouched by all this and still applies once.
  EXPECT_TRUE(RunDemotion(c, n, ds[1]).ok());
  EXPECT_EQ(c.m().Stats().demotions_total, before.demotions_total + 1);
  ExpectConsistent(c);
}

// After a master restart a node may report a move before its registration is in: the answer
// is UNAVAILABLE (ask again), never NOT_FOUND, which would make it drop a copy its
// registration is about to list.
TEST(MasterTier, DemoteDoneFromANodeTheMasterDoesNotKnowIsAnsweredUnavailable) {
  Cluster c;
  FakeNode* node = nullptr;
  std::vector<Demotion> ds = FillTieredNode(c, &node);
  ASSERT_FALSE(ds.empty());
  Cluster restarted;  // a new master: empty state
  const Status st = restarted.m().DemoteDone(node->id, ds[0].source.key, ds[0].source.version,
                                             ds[0].dest.replica_id, true, restarted.now);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find(node->id.node_id), std::string::npos) << st.ToString();
  // Another incarnation of a known node is still STALE_PEER.
  NodeIdentity other = node->id;
  other.incarnation += 1;
  EXPECT_EQ(c.m()
                .DemoteDone(other, ds[0].source.key, ds[0].source.version, ds[0].dest.replica_id,
                            true, c.now)
                .code(),
            StatusCode::kStalePeer);
}

TEST(MasterTier, SsdReplicaReadTwiceIsPromotedBackToDramWhenThereIsRoom) {
  Cluster c;
  FakeNode& n = AddTieredNode(c, "n0", 64 * kKiB, 256 * kKiB);
  for (int i = 0; i < 14; ++i) {
    ASSERT_TRUE(c.Put("k" + std::to_string(i), 4 * kKiB).ok());
    c.now += kMs;
  }
  c.m().Tick(c.now);
  for (const Demotion& d : HeartbeatDemotions(c, n)) ASSERT_TRUE(RunDemotion(c, n, d).ok());
  ASSERT_EQ(c.m().Stats().ssd_replicas, 5u);  // k0..k4
  // DRAM at 36 KiB: no promotion would fit under the demote low watermark (38.4 KiB).
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(c.m().GetReplicas({"k0"}, "", c.now)[0].ok());
  c.m().Tick(c.now);
  EXPECT_TRUE(HeartbeatDemotions(c, n).empty());
  // Room again: k1 read twice from SSD is promoted.
  for (int i = 6; i < 12; ++i) ASSERT_TRUE(c.m().Remove("k" + std::to_string(i), c.now).ok());
  auto first = c.m().GetReplicas({"k1"}, "", c.now);
  ASSERT_EQ(first[0]->replicas[0].tier, Tier::kSsd);
  EXPECT_TRUE(HeartbeatDemotions(c, n).empty());  // one read is not enough
  auto second = c.m().GetReplicas({"k1"}, "", c.now);
  std::vector<Demotion> ps = HeartbeatDemotions(c, n);
  ASSERT_EQ(ps.size(), 1u);
  EXPECT_EQ(ps[0].source.key, "k1");
  EXPECT_EQ(ps[0].source.segment_id, 200u);
  EXPECT_EQ(ps[0].dest.segment_id, 100u);
  ExpectConsistent(c);
  // Until reported, reads go to SSD; then to DRAM. The SSD range waits for the leases.
  EXPECT_EQ(c.m().GetReplicas({"k1"}, "", c.now)[0]->replicas[0].tier, Tier::kSsd);
  ASSERT_TRUE(RunDemotion(c, n, ps[0]).ok());
  auto third = c.m().GetReplicas({"k1"}, "", c.now);
  EXPECT_EQ(third[0]->replicas[0].tier, Tier::kDram);
  MasterStats st = c.m().Stats();
  EXPECT_EQ(st.promotions_total, 1u);
  EXPECT_EQ(st.ssd_replicas, 4u);
  EXPECT_EQ(st.held_bytes, 4 * kKiB);  // the SSD range, under k1's read lease
  ExpectConsistent(c);
  while (c.now < third[0]->lease_expiry_ns) {
    c.now = std::min(c.now + 500 * kMs, third[0]->lease_expiry_ns);
    HeartbeatDemotions(c, n);
    c.m().Tick(c.now);
  }
  HeartbeatDemotions(c, n);
  EXPECT_EQ(c.m().Stats().held_bytes, 0u);
  EXPECT_FALSE(n.records.count({ps[0].source.segment_id, ps[0].source.offset}));
  EXPECT_TRUE(n.records.count({ps[0].dest.segment_id, ps[0].dest.offset}));
  ExpectConsistent(c);
}

TEST(MasterTier, CancelledPromotionHoldsItsDramRangeUntilItsDeadline) {
  // The node may still be copying into the promotion's DRAM range after the master cancelled
  // it (the object was removed): that range must not be handed to a new put before then.
  Cluster c;
  FakeNode& n = AddTieredNode(c, "n0", 64 * kKiB, 256 * kKiB);
  for (int i = 0; i < 14; ++i) {
    ASSERT_TRUE(c.Put("k" + std::to_string(i), 4 * kKiB).ok());
    c.now += kMs;
  }
  c.m().Tick(c.now);
  for (const Demotion& d : HeartbeatDemotions(c, n)) ASSERT_TRUE(RunDemotion(c, n, d).ok());
  for (int i = 6; i < 14; ++i) ASSERT_TRUE(c.m().Remove("k" + std::to_string(i), c.now).ok());
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(c.m().GetReplicas({"k1"}, "", c.now)[0].ok());
  std::vector<Demotion> ps = HeartbeatDemotions(c, n);  // issued
  ASSERT_EQ(ps.size(), 1u);
  ASSERT_EQ(ps[0].dest.segment_id, 100u);
  const uint64_t held_before = c.m().Stats().held_bytes;
  ASSERT_TRUE(c.m().Remove("k1", c.now).ok());  // cancels the promotion
  EXPECT_GE(c.m().Stats().held_bytes, held_before + 4 * kKiB);  // its DRAM range is held
  ExpectConsistent(c);
  EXPECT_EQ(RunDemotion(c, n, ps[0]).code(), StatusCode::kNotFound);  // a late report
  ExpectConsistent(c);
}

TEST(MasterTier, BadReplicaReportForACopyThatMovedDropsNothing) {
  Cluster c;
  FakeNode* node = nullptr;
  std::vector<Demotion> ds = FillTieredNode(c, &node);
  FakeNode& n = *node;
  ASSERT_FALSE(ds.empty());
  ASSERT_TRUE(RunDemotion(c, n, ds[0]).ok());  // now on SSD
  const Demotion& d = ds[0];
  // A reader that still had the DRAM location reports it: the SSD replica stays.
  EXPECT_EQ(c.m().ReportBadReplica(d.source.key, d.source.version, n.id, c.now,
                                   d.source.segment_id, d.source.offset).code(),
            StatusCode::kNotFound);
  EXPECT_TRUE(c.m().Exists({d.source.key})[0]);
  // A report naming the current copy drops it (the last one: the object goes).
  EXPECT_TRUE(c.m().ReportBadReplica(d.source.key, d.source.version, n.id, c.now,
                                     d.dest.segment_id, d.dest.offset).ok());
  EXPECT_FALSE(c.m().Exists({d.source.key})[0]);
  ExpectConsistent(c);
}

TEST(MasterTier, SizeQueriesGrantNoLeaseAndPromoteNothing) {
  Cluster c;
  FakeNode* node = nullptr;
  std::vector<Demotion> ds = FillTieredNode(c, &node);
  FakeNode& n = *node;
  ASSERT_FALSE(ds.empty());
  ASSERT_TRUE(RunDemotion(c, n, ds[0]).ok());
  for (int i = 6; i < 14; ++i) ASSERT_TRUE(c.m().Remove("k" + std::to_string(i), c.now).ok());
  const std::string& key = ds[0].source.key;
  for (int r = 0; r < 3; ++r) {
    auto s = c.m().GetReplicas({key}, "", c.now, /*sizes_only=*/true);
    ASSERT_TRUE(s[0].ok());
    EXPECT_EQ(s[0]->sizes, std::vector<uint64_t>{4 * kKiB});
  }
  EXPECT_TRUE(HeartbeatDemotions(c, n).empty());  // three size queries promote nothing
  const MasterSnapshot snap = c.m().Snapshot();
  EXPECT_EQ(Find(snap, key)->lease_expiry_ns, 0u);  // and lease nothing: removable at once
  ASSERT_TRUE(c.m().Remove(key, c.now).ok());
  EXPECT_EQ(c.m().Stats().held_bytes, 0u);
  ExpectConsistent(c);
}

TEST(MasterTier, FailedDemotionsBackOffThatNode) {
  Cluster c;
  FakeNode* node = nullptr;
  std::vector<Demotion> ds = FillTieredNode(c, &node);
  FakeNode& n = *node;
  ASSERT_FALSE(ds.empty());
  for (const Demotion& d : ds) ASSERT_TRUE(RunDemotion(c, n, d, /*ok=*/false).ok());
  // A failing SSD (disk full) is not hammered: nothing new until repair_backoff_ms passed.
  EXPECT_EQ(c.m().Tick(c.now).demotions_scheduled, 0u);
  c.now += c.cfg().repair_backoff_ms * kMs;
  EXPECT_EQ(c.m().Tick(c.now).demotions_scheduled, ds.size());
  ExpectConsistent(c);
}

TEST(MasterTier, FullSsdEvictsItsColdestToTakeDemotions) {
  Cluster c;
  FakeNode& n = AddTieredNode(c, "n0", 64 * kKiB, 32 * kKiB);
  // A steady stream of puts, the background demoting as it goes: DRAM never needs a put-time
  // eviction; the SSD (8 objects) fills and drops its coldest.
  for (int round = 0; round < 6; ++round) {
    for (int i = 0; i < 6; ++i) {
      ASSERT_TRUE(c.Put("r" + std::to_string(round) + "k" + std::to_string(i), 4 * kKiB).ok())
          << round << "/" << i;
      c.now += kMs;
      c.m().Tick(c.now);
      for (const Demotion& d : HeartbeatDemotions(c, n)) ASSERT_TRUE(RunDemotion(c, n, d).ok());
    }
    ExpectConsistent(c);
  }
  MasterStats st = c.m().Stats();
  EXPECT_GT(st.demotions_total, 8u);
  EXPECT_GT(st.evictions_total, 0u);  // the SSD filled up: its coldest objects went
  EXPECT_LE(st.ssd_replicas, 8u);
  // The oldest objects are gone, the newest are still there.
  EXPECT_FALSE(c.m().Exists({"r0k0"})[0]);
  EXPECT_TRUE(c.m().Exists({"r5k5"})[0]);
  for (const auto& s : st.nodes) EXPECT_LE(s.ssd_used, 32 * kKiB);
}

TEST(MasterTier, RestartedNodeBringsItsSsdObjectsBack) {
  Cluster c;
  FakeNode* node = nullptr;
  std::vector<Demotion> ds = FillTieredNode(c, &node);
  FakeNode& n = *node;
  for (const Demotion& d : ds) ASSERT_TRUE(RunDemotion(c, n, d).ok());
  // The process restarts: DRAM records are lost, SSD records come back from the SSD.
  std::vector<InventoryRecord> ssd;
  for (const auto& [k, r] : n.records) {
    if (r.segment_id == 200) ssd.push_back(r);
  }
  ASSERT_EQ(ssd.size(), ds.size());
  FakeNode& again = AddTieredNode(c, "n0", 64 * kKiB, 256 * kKiB, /*incarnation=*/2);
  for (const auto& r : ssd) again.records[{r.segment_id, r.offset}] = r;
  auto reply = c.m().RegisterNode(again.Registration(), again.Inventory(), c.now);
  ASSERT_EQ(reply.status().code(), StatusCode::kAlreadyExists);  // AddTieredNode registered it
  // Register from scratch as a new incarnation would (records first).
  FakeNode& third = c.nodes["n0"];
  third.id.incarnation = 3;
  auto r3 = c.Register(third);
  ASSERT_TRUE(r3.ok()) << r3.status().ToString();
  EXPECT_EQ(r3->records_accepted, ssd.size());
  for (const auto& r : ssd) {
    auto g = c.m().GetReplicas({r.key}, "", c.now);
    ASSERT_TRUE(g[0].ok()) << r.key;
    EXPECT_EQ(g[0]->replicas[0].tier, Tier::kSsd);
  }
  EXPECT_FALSE(c.m().Exists({"k13"})[0]);  // it was only in DRAM
  ExpectConsistent(c);
}

TEST(MasterTier, DrainingNodeCopiesSsdReplicasOffAndNodesWithoutSsdStillEvict) {
  Cluster c;
  FakeNode& tiered = AddTieredNode(c, "t0", 64 * kKiB, 256 * kKiB);
  c.AddNode("plain", {64 * kKiB});
  for (int i = 0; i < 14; ++i) {
    ASSERT_TRUE(c.Put("k" + std::to_string(i), 4 * kKiB, 1, "t0").ok());
  }
  c.m().Tick(c.now);
  for (const Demotion& d : HeartbeatDemotions(c, tiered)) ASSERT_TRUE(RunDemotion(c, tiered, d).ok());
  ASSERT_GT(c.m().Stats().ssd_replicas, 0u);
  ASSERT_TRUE(c.m().StartDrain(tiered.id, c.now).ok());
  for (int round = 0; round < 10 && !tiered.drained; ++round) {
    c.m().Tick(c.now);
    c.HeartbeatAll();
    for (const auto& t : tiered.tasks) {
      if (t.source.tier == Tier::kSsd) {
        EXPECT_EQ(t.source.segment_id, 200u);
      }
    }
    c.RunAllTasks();
    c.now += 10 * kMs;
  }
  c.m().Tick(c.now);
  c.HeartbeatAll();
  EXPECT_TRUE(tiered.drained);
  for (int i = 0; i < 14; ++i) {
    EXPECT_EQ(c.ReplicaNodes("k" + std::to_string(i)), std::vector<std::string>{"plain"});
  }
  ExpectConsistent(c);
}

INSTANTIATE_TEST_SUITE_P(Seeds, MasterRandomized, ::testing::Range<uint64_t>(1, 9));

}  // namespace
}  // namespace kvbridge::store
