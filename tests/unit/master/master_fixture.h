// Shared by the unit tests of the master's state machine (store/master_state.h) in
// tests/unit/master/: a Cluster is a MasterState plus simulated nodes (FakeNode, which keeps the
// inventory records the master commits to it and drops the ones it frees, as a real node does),
// driven through its own clock (Cluster::now); SnapshotHolds and ExpectConsistent check the
// master's invariants from the outside.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "store/master_state.h"

namespace kvbridge::store::master_test {

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

// The master's invariants (docs/store.md), checked from the outside on a snapshot.
inline ::testing::AssertionResult SnapshotHolds(const MasterSnapshot& s) {
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

inline void ExpectConsistent(Cluster& c) {
  Status st = c.m().CheckInvariants();
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE(SnapshotHolds(c.m().Snapshot()));
}

inline const MasterSnapshot::Object* Find(const MasterSnapshot& s, const std::string& key) {
  for (const auto& o : s.objects) {
    if (o.key == key) return &o;
  }
  return nullptr;
}

}  // namespace kvbridge::store::master_test
