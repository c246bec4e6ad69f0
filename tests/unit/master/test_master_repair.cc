// Unit tests of re-replication (store/master_repair.cc): replicas lost with a node are restored,
// failed tasks are retried elsewhere, and readers' reports of bad replicas or unreachable nodes
// are acted on.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/unit/master/master_fixture.h"

namespace kvbridge::store::master_test {
namespace {

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

// How long re-replication has been waiting (kvbridge_master_under_replicated_oldest_age_seconds):
// from the expiry that queued the object, through its task, to its completion.
TEST(MasterRepair, StatsSayWhenTheOldestRepairWasQueued) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.AddNode("n2", {1 << 20});
  ASSERT_TRUE(c.Put("two", 4096, 2, "n0").ok());
  EXPECT_EQ(c.m().Stats().oldest_repair_ns, 0u);
  c.nodes.erase("n0");
  for (int i = 0; i < 3; ++i) {
    c.now += 1000 * kMs;
    c.HeartbeatAll();
  }
  ASSERT_EQ(c.m().Tick(c.now).nodes_expired, 1u);
  const uint64_t queued = c.now;
  EXPECT_EQ(c.m().Stats().under_replicated, 1u);
  EXPECT_EQ(c.m().Stats().oldest_repair_ns, queued);
  c.now += 500 * kMs;
  c.HeartbeatAll();
  ReplicationTask task;
  for (auto& [id, n] : c.nodes) {
    if (!n.tasks.empty()) task = n.tasks[0];
    n.tasks.clear();
  }
  ASSERT_NE(task.task_id, 0u);
  c.m().Tick(c.now);
  EXPECT_EQ(c.m().Stats().oldest_repair_ns, queued);  // still waiting for its copy
  ASSERT_TRUE(c.RunTask(task).ok());
  c.m().Tick(c.now);
  EXPECT_EQ(c.m().Stats().under_replicated, 0u);
  EXPECT_EQ(c.m().Stats().oldest_repair_ns, 0u);
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

// --- Copying and moving objects (MasterState::Place; docs/store.md) ---

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// A copy to two nodes runs as two tasks and adds two replicas; the task is PROCESSING until both
// are committed, then SUCCESS. Asking again for a node that holds it already changes nothing.
TEST(MasterPlacements, CopyAddsReplicasOnTheNodesNamed) {
  Cluster c;
  for (const char* n : {"n0", "n1", "n2", "n3"}) c.AddNode(n, {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096, 1, "n0").ok());
  auto id = c.m().Place("k", {"n2", "n3"}, "", c.now);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto q = c.m().QueryPlacement(*id, c.now);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->state, PlacementState::kProcessing);
  EXPECT_EQ(q->source, "n0");
  EXPECT_FALSE(q->move);
  c.HeartbeatAll();
  ASSERT_EQ(c.RunAllTasks(), 2u);
  q = c.m().QueryPlacement(*id, c.now);
  EXPECT_EQ(q->state, PlacementState::kSuccess) << q->message;
  EXPECT_EQ(Sorted(c.ReplicaNodes("k")), (std::vector<std::string>{"n0", "n2", "n3"}));
  EXPECT_EQ(c.m().Tick(c.now).tasks_created, 0u);  // copies above the count are kept
  auto again = c.m().Place("k", {"n2"}, "", c.now);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(c.m().QueryPlacement(*again, c.now)->state, PlacementState::kSuccess);
  ExpectConsistent(c);
}

// A move copies to the target, then drops the source's replica: the count stays.
TEST(MasterPlacements, MoveDropsTheSourceOnceTheCopyIsCommitted) {
  Cluster c;
  for (const char* n : {"n0", "n1", "n2"}) c.AddNode(n, {1 << 20});
  ASSERT_TRUE(c.Put("k", 4096, 2, "n0").ok());
  const std::vector<std::string> before = Sorted(c.ReplicaNodes("k"));
  ASSERT_EQ(before.size(), 2u);
  const std::string from = before[0];
  std::string to;
  for (const char* n : {"n0", "n1", "n2"}) {
    if (std::find(before.begin(), before.end(), n) == before.end()) to = n;
  }
  auto id = c.m().Place("k", {to}, from, c.now);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_TRUE(c.m().QueryPlacement(*id, c.now)->move);
  c.HeartbeatAll();
  ASSERT_EQ(c.RunAllTasks(), 1u);
  c.m().Tick(c.now);
  auto q = c.m().QueryPlacement(*id, c.now);
  EXPECT_EQ(q->state, PlacementState::kSuccess) << q->message;
  auto after = Sorted(c.ReplicaNodes("k"));
  EXPECT_EQ(after.size(), 2u);
  EXPECT_EQ(std::count(after.begin(), after.end(), from), 0);
  EXPECT_EQ(std::count(after.begin(), after.end(), to), 1);
  ExpectConsistent(c);
}

// Refusals name what is wrong and start nothing; a failed copy or a removed object is FAILED.
TEST(MasterPlacements, BadRequestsAreRefusedAndFailuresAreReported) {
  MasterConfig cfg;
  cfg.max_put_fill = 1.0;
  Cluster c(cfg);
  for (const char* n : {"n0", "n1", "n2"}) c.AddNode(n, {64 * 1024});
  ASSERT_TRUE(c.Put("k", 4096, 1, "n0").ok());
  ASSERT_TRUE(c.Put("big", 62 * 1024, 1, "n1").ok());
  auto code = [&](const std::string& key, std::vector<std::string> to, const std::string& from) {
    return c.m().Place(key, to, from, c.now).status().code();
  };
  EXPECT_EQ(code("k", {}, ""), StatusCode::kInvalidArgument);
  EXPECT_EQ(code("k", {"n1", "n1"}, ""), StatusCode::kInvalidArgument);
  EXPECT_EQ(code("k", {"n1", "n2"}, "n0"), StatusCode::kInvalidArgument);  // a move: one target
  EXPECT_EQ(code("k", {"n0"}, "n0"), StatusCode::kInvalidArgument);
  EXPECT_EQ(code("absent", {"n1"}, ""), StatusCode::kNotFound);
  EXPECT_EQ(code("k", {"nobody"}, ""), StatusCode::kNotFound);
  EXPECT_EQ(code("k", {"n2"}, "n1"), StatusCode::kNotFound);       // n1 holds no replica of k
  EXPECT_EQ(code("big", {"n2", "n0"}, ""), StatusCode::kNoSpace);  // n0: 60 KiB free, n2 fits
  EXPECT_EQ(c.m().Stats().tasks_in_flight, 0u) << "a refused placement started a copy";
  EXPECT_EQ(c.m().QueryPlacement(424242, c.now).status().code(), StatusCode::kNotFound);
  // A copy whose task fails: FAILED, saying which target.
  auto id = c.m().Place("k", {"n2"}, "", c.now);
  ASSERT_TRUE(id.ok());
  c.HeartbeatAll();
  for (auto& t : c.nodes["n0"].tasks) ASSERT_TRUE(c.RunTask(t, /*ok=*/false).ok());
  c.nodes["n0"].tasks.clear();
  auto q = c.m().QueryPlacement(*id, c.now);
  EXPECT_EQ(q->state, PlacementState::kFailed);
  EXPECT_NE(q->message.find("n2"), std::string::npos) << q->message;
  // The object removed while its copy runs: FAILED, naming it.
  auto id2 = c.m().Place("k", {"n2"}, "", c.now);
  ASSERT_TRUE(id2.ok()) << id2.status().ToString();
  ASSERT_TRUE(c.m().Remove("k", c.now).ok());
  q = c.m().QueryPlacement(*id2, c.now);
  EXPECT_EQ(q->state, PlacementState::kFailed);
  EXPECT_NE(q->message.find("removed"), std::string::npos) << q->message;
  ExpectConsistent(c);
}

}  // namespace
}  // namespace kvbridge::store::master_test
