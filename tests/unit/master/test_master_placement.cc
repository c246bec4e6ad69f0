// Unit tests of placement and eviction (store/master_placement.cc): suspect nodes are avoided,
// puts stay under the high watermark, and eviction frees least recently used objects.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/unit/master/master_fixture.h"

namespace kvbridge::store::master_test {
namespace {

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

}  // namespace
}  // namespace kvbridge::store::master_test
