// Unit tests of puts, reads and removes (store/master_puts.cc): PutStart, PutEnd in two phases,
// PutRevoke and the put timeout, GetReplicas and its leases, Remove and RemoveAll.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "tests/unit/master/master_fixture.h"

namespace kvbridge::store::master_test {
namespace {

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

// RemoveByRegex: ECMAScript, matched anywhere in the key (Mooncake's remove_by_regex: "a3"
// removes "rx/a3"); anchors restrict it; pending puts are kept; bad patterns are named and
// remove nothing; a leased object is removed from the namespace at once, freed at lease end.
TEST(MasterRemove, RemoveByRegexMatchesAnywhereAndKeepsPendingPuts) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  for (const char* k : {"rx/a0", "rx/a1", "rx/a2", "rx/a3", "rx/b1", "other", "xrx/a1"}) {
    ASSERT_TRUE(c.Put(k, 100).ok()) << k;
  }
  Result<PutAllocation> pending = c.Start("rx/a9", {100});
  ASSERT_TRUE(pending.ok());
  const uint64_t objects = c.m().Stats().objects;
  for (const std::string bad : {"", "([", "a{2,1}", "\\"}) {
    Result<size_t> r = c.m().RemoveByRegex(bad, c.now);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    if (!bad.empty()) {
      EXPECT_NE(r.status().message().find("'" + bad + "'"), std::string::npos)
          << r.status().ToString();
    }
  }
  EXPECT_EQ(c.m().Stats().objects, objects);
  EXPECT_EQ(c.m().RemoveByRegex("nomatch", c.now).value(), 0u);
  EXPECT_EQ(c.m().RemoveByRegex("^rx/a[0-2]$", c.now).value(), 3u);
  EXPECT_EQ(c.m().RemoveByRegex("a3", c.now).value(), 1u);  // anywhere in the key
  auto g = c.m().GetReplicas({"rx/b1"}, "", c.now);  // leased: still removed from the namespace
  ASSERT_TRUE(g[0].ok());
  EXPECT_EQ(c.m().RemoveByRegex("^(rx|xrx)/", c.now).value(), 2u);  // rx/b1, xrx/a1; not rx/a9
  auto ex = c.m().Exists({"rx/a0", "rx/a3", "rx/b1", "xrx/a1", "other", "rx/a9"});
  EXPECT_EQ(ex, (std::vector<bool>{false, false, false, false, true, false}));
  EXPECT_EQ(c.m().Stats().objects, 1u);
  EXPECT_EQ(c.m().Stats().pending, 1u);
  ASSERT_TRUE(c.End("rx/a9", *pending, {true}, 7).ok());  // the pending put completes untouched
  EXPECT_TRUE(c.m().Exists({"rx/a9"})[0]);
  ExpectConsistent(c);
}

}  // namespace
}  // namespace kvbridge::store::master_test
