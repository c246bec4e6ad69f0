// Unit tests of overwrites (PutOptions::overwrite, store/master_puts.cc): a new version of an
// existing key is written beside the old one and replaces it at its put end, while readers that
// got the old replicas keep them under their lease.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "master_fixture.h"

namespace kvbridge::store::master_test {
namespace {

PutOptions Overwrite(uint32_t replica_num = 1) {
  PutOptions o;
  o.replica_num = replica_num;
  o.overwrite = true;
  return o;
}

Result<PutAllocation> StartOverwrite(Cluster& c, const std::string& key, uint64_t bytes) {
  auto r = c.m().PutStart({{key, {bytes}}}, Overwrite(), c.now);
  return std::move(r[0]);
}

Status EndAll(Cluster& c, const std::string& key, const PutAllocation& a, uint32_t checksum) {
  return c.End(key, a, std::vector<bool>(a.replicas.size(), true), checksum);
}

TEST(MasterOverwrite, NewVersionReplacesTheOldAtPutEndOnly) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 100, 1, "", 1).ok());
  const uint64_t v1 = c.m().GetReplicas({"k"}, "", c.now)[0]->version;

  auto a = StartOverwrite(c, "k", 200);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_GT(a->version, v1);
  // Until its put end, readers get the old version.
  auto before = c.m().GetReplicas({"k"}, "", c.now);
  ASSERT_TRUE(before[0].ok());
  EXPECT_EQ(before[0]->version, v1);
  EXPECT_EQ(before[0]->checksum, 1u);
  EXPECT_TRUE(c.m().Exists({"k"})[0]);
  EXPECT_EQ(c.m().Stats().pending, 1u);
  ExpectConsistent(c);

  ASSERT_TRUE(EndAll(c, "k", *a, 2).ok());
  auto after = c.m().GetReplicas({"k"}, "", c.now);
  ASSERT_TRUE(after[0].ok());
  EXPECT_EQ(after[0]->version, a->version);
  EXPECT_EQ(after[0]->sizes, std::vector<uint64_t>{200});
  EXPECT_EQ(after[0]->checksum, 2u);
  EXPECT_EQ(c.m().Stats().objects, 1u);
  EXPECT_EQ(c.m().Stats().pending, 0u);
  // The node keeps the new version's record; the old one is freed (after its lease).
  EXPECT_TRUE(c.nodes["n0"].Holds("k", a->version));
  ExpectConsistent(c);
}

TEST(MasterOverwrite, OfAnAbsentKeyIsAPut) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  auto a = StartOverwrite(c, "k", 100);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(EndAll(c, "k", *a, 5).ok());
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0]->version, a->version);
  ExpectConsistent(c);
}

TEST(MasterOverwrite, OldRangesAreFreedOnlyAfterTheReadLease) {
  MasterConfig cfg;
  cfg.max_put_fill = 1.0;
  Cluster c(cfg);
  c.AddNode("n0", {8 * kKiB});
  ASSERT_TRUE(c.Put("k", 4 * kKiB).ok());
  auto reader = c.m().GetReplicas({"k"}, "", c.now);  // a reader under a lease
  ASSERT_TRUE(reader[0].ok());
  const uint64_t v1 = reader[0]->version;

  auto a = StartOverwrite(c, "k", 4 * kKiB);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  // Written beside the old version, never over it.
  EXPECT_NE(a->replicas[0].offset, reader[0]->replicas[0].offset);
  ASSERT_TRUE(EndAll(c, "k", *a, 7).ok());
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0]->version, a->version);
  // The old range stays allocated and on the node while the reader's lease lasts.
  EXPECT_EQ(c.Used("n0"), 8 * kKiB);
  EXPECT_EQ(c.m().Stats().held_bytes, 4 * kKiB);
  c.now = reader[0]->lease_expiry_ns - 1;
  c.HeartbeatAll();
  EXPECT_EQ(c.m().Tick(c.now).ranges_released, 0u);
  EXPECT_TRUE(c.nodes["n0"].Holds("k", v1));
  ExpectConsistent(c);

  c.now = reader[0]->lease_expiry_ns;
  EXPECT_EQ(c.m().Tick(c.now).ranges_released, 1u);
  c.HeartbeatAll();
  EXPECT_FALSE(c.nodes["n0"].Holds("k", v1));
  EXPECT_TRUE(c.nodes["n0"].Holds("k", a->version));
  EXPECT_EQ(c.Used("n0"), 4 * kKiB);
  ExpectConsistent(c);
}

TEST(MasterOverwrite, OneNewVersionAtATime) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 100).ok());
  auto first = StartOverwrite(c, "k", 100);
  ASSERT_TRUE(first.ok());
  // A second overwrite waits for the first; a plain put of the key is satisfied by it.
  EXPECT_EQ(StartOverwrite(c, "k", 100).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(c.Start("k", {100}).status().code(), StatusCode::kAlreadyExists);
  ASSERT_TRUE(EndAll(c, "k", *first, 1).ok());
  auto second = StartOverwrite(c, "k", 300);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(EndAll(c, "k", *second, 2).ok());
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0]->version, second->version);
  // A key whose plain put is in flight is not overwritten either.
  ASSERT_TRUE(c.Start("p", {100}).ok());
  EXPECT_EQ(StartOverwrite(c, "p", 100).status().code(), StatusCode::kUnavailable);
  ExpectConsistent(c);
}

TEST(MasterOverwrite, FailedRevokedOrTimedOutOverwriteKeepsTheOldVersion) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 100, 1, "", 1).ok());
  const uint64_t v1 = c.m().GetReplicas({"k"}, "", c.now)[0]->version;
  auto expect_old = [&] {
    auto g = c.m().GetReplicas({"k"}, "", c.now);
    ASSERT_TRUE(g[0].ok());
    EXPECT_EQ(g[0]->version, v1);
    EXPECT_EQ(c.m().Stats().pending, 0u);
    ExpectConsistent(c);
  };

  auto failed = StartOverwrite(c, "k", 100);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(c.End("k", *failed, {false}, 2).code(), StatusCode::kUnavailable);
  expect_old();

  auto not_committed = StartOverwrite(c, "k", 100);
  ASSERT_TRUE(not_committed.ok());
  EXPECT_EQ(c.End("k", *not_committed, {true}, 2, [](const NodeIdentity&) { return Commit::kFail; })
                .code(),
            StatusCode::kUnavailable);
  expect_old();

  auto revoked = StartOverwrite(c, "k", 100);
  ASSERT_TRUE(revoked.ok());
  EXPECT_TRUE(c.m().PutRevoke({{"k", revoked->version}}, c.now)[0].ok());
  // The old version is complete: revoking it is refused.
  EXPECT_EQ(c.m().PutRevoke({{"k", v1}}, c.now)[0].code(), StatusCode::kAlreadyExists);
  expect_old();

  auto late = StartOverwrite(c, "k", 100);
  ASSERT_TRUE(late.ok());
  c.PassSeconds(static_cast<int>(c.cfg().put_timeout_ms / 1000) + 1);
  EXPECT_EQ(EndAll(c, "k", *late, 2).code(), StatusCode::kNotFound);
  expect_old();
}

TEST(MasterOverwrite, RemoveDuringAnOverwriteLeavesTheNewVersion) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 100).ok());
  auto a = StartOverwrite(c, "k", 100);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c.m().Remove("k", c.now).ok());
  EXPECT_FALSE(c.m().Exists({"k"})[0]);
  ASSERT_TRUE(EndAll(c, "k", *a, 3).ok());
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0]->version, a->version);
  ExpectConsistent(c);
}

TEST(MasterOverwrite, KeysBeginningWithNulAreRefused) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 100).ok());
  ASSERT_TRUE(StartOverwrite(c, "k", 100).ok());
  // Not even the master's own name for the overwrite in flight can be reached.
  const std::string internal = std::string("\0overwrite\0", 11) + "k";
  EXPECT_EQ(c.Start(internal, {100}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.m().GetReplicas({internal}, "", c.now)[0].status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c.m().Remove(internal, c.now).code(), StatusCode::kInvalidArgument);
}

TEST(MasterOverwrite, NodeDeathDuringAnOverwriteKeepsTheOldVersionElsewhere) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  ASSERT_TRUE(c.Put("k", 100, 1, "n0").ok());
  const uint64_t v1 = c.m().GetReplicas({"k"}, "", c.now)[0]->version;
  PutOptions o = Overwrite();
  o.client_node_id = "n1";
  auto a = c.m().PutStart({{"k", {100}}}, o, c.now);
  ASSERT_TRUE(a[0].ok());
  ASSERT_EQ(a[0]->replicas[0].node.node_id, "n1");
  c.PassSeconds(static_cast<int>(c.cfg().node_ttl_ms / 1000) + 1, {"n0"});  // n1 dies
  // The new version lost its only replica with n1, and went with it.
  EXPECT_EQ(EndAll(c, "k", *a[0], 2).code(), StatusCode::kNotFound);
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0]->version, v1);
  ExpectConsistent(c);
}

TEST(MasterOverwrite, RestartKeepsTheNewestVersionANodeHolds) {
  MasterConfig cfg;
  cfg.lease_ms = 60000;  // the old version's records stay on the node through the restart
  Cluster c(cfg);
  c.AddNode("n0", {1 << 20});
  ASSERT_TRUE(c.Put("k", 100, 1, "", 1).ok());
  auto g = c.m().GetReplicas({"k"}, "", c.now);
  const uint64_t v1 = g[0]->version;
  auto a = StartOverwrite(c, "k", 200);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(EndAll(c, "k", *a, 2).ok());
  ASSERT_TRUE(c.nodes["n0"].Holds("k", v1));
  ASSERT_TRUE(c.nodes["n0"].Holds("k", a->version));

  c.Restart();  // the node registers both versions with a new master
  auto after = c.m().GetReplicas({"k"}, "", c.now);
  ASSERT_TRUE(after[0].ok());
  EXPECT_EQ(after[0]->version, a->version);
  EXPECT_EQ(after[0]->checksum, 2u);
  EXPECT_FALSE(c.nodes["n0"].Holds("k", v1));
  ExpectConsistent(c);
}

TEST(MasterOverwrite, AnInFlightVersionIsNotTakenFromAReturningNode) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  ASSERT_TRUE(c.Put("k", 100, 1, "n0").ok());
  const uint64_t v1 = c.m().GetReplicas({"k"}, "", c.now)[0]->version;
  PutOptions o = Overwrite(2);
  auto a = c.m().PutStart({{"k", {100}}}, o, c.now);
  ASSERT_TRUE(a[0].ok());
  // Its records reach both nodes, then n1 re-registers (a new master would see the same).
  PutEndPlan plan = c.m().BeginPutEnd({{"k", a[0]->version, {true, true}, 2}}, c.now);
  for (auto& commit : plan.commits) c.Deliver(commit, Commit::kOk);
  ASSERT_TRUE(c.m().Deregister(c.nodes["n1"].id, c.now).ok());
  c.nodes["n1"].id.incarnation = 2;
  ASSERT_TRUE(c.Register(c.nodes["n1"]).ok());
  EXPECT_FALSE(c.nodes["n1"].Holds("k", a[0]->version));  // refused: not complete
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0]->version, v1);
  ASSERT_TRUE(c.m().FinishPutEnd(plan, c.now)[0].ok());
  EXPECT_EQ(c.m().GetReplicas({"k"}, "", c.now)[0]->version, a[0]->version);
  ExpectConsistent(c);
}

}  // namespace
}  // namespace kvbridge::store::master_test
