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

// --- Pins (docs/store.md "Eviction") ---

// A put with the given pins of one 1 KiB object, ended.
Status PinnedPut(Cluster& c, const std::string& key, SoftPin soft, uint64_t ttl_ms = 0,
                 bool hard = false, bool overwrite = false) {
  PutOptions o;
  o.soft_pin = soft;
  o.soft_pin_ttl_ms = ttl_ms;
  o.pinned = hard;
  o.overwrite = overwrite;
  auto r = c.m().PutStart({{key, {kKiB}}}, o, c.now);
  if (!r[0].ok()) return r[0].status();
  return c.End(key, r[0].value(), {true}, 0);
}

// Soft-pinned objects go after every unpinned one, even older ones; hard-pinned never.
TEST(MasterPins, SoftPinnedObjectsAreEvictedLastAndHardPinnedNever) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 4;  // a sample that mostly finds soft-pinned objects
  cfg.max_put_fill = 1.0;
  Cluster c(cfg);
  c.AddNode("n0", {100 * kKiB});
  // The oldest 60 are soft-pinned (and one hard-pinned): by LRU alone they would go first.
  for (int i = 0; i < 60; ++i) {
    c.now += kMs;
    ASSERT_TRUE(PinnedPut(c, "soft" + std::to_string(i), SoftPin::kEnable).ok()) << i;
  }
  ASSERT_TRUE(PinnedPut(c, "hard", SoftPin::kDisable, 0, true).ok());
  for (int i = 0; i < 34; ++i) {
    c.now += kMs;
    ASSERT_TRUE(c.Put("plain" + std::to_string(i), kKiB).ok()) << i;
  }
  EXPECT_EQ(c.Used("n0"), 95 * kKiB);
  EXPECT_EQ(c.m().Tick(c.now).objects_evicted, 15u);  // down to the low watermark (80)
  for (int i = 0; i < 60; ++i) EXPECT_TRUE(c.m().Exists({"soft" + std::to_string(i)})[0]) << i;
  int plain_left = 0;  // (sampled LRU: which 15 of them is not exact)
  for (int i = 0; i < 34; ++i) plain_left += c.m().Exists({"plain" + std::to_string(i)})[0];
  EXPECT_EQ(plain_left, 34 - 15);
  // Only soft-pinned ones left to evict: they go, oldest first; the hard-pinned one stays.
  for (int i = 0; i < 35; ++i) {
    c.now += kMs;
    ASSERT_TRUE(PinnedPut(c, "more" + std::to_string(i), SoftPin::kEnable).ok()) << i;
  }
  EXPECT_GT(c.m().Tick(c.now).objects_evicted, 0u);
  EXPECT_FALSE(c.m().Exists({"soft0"})[0]);
  EXPECT_TRUE(c.m().Exists({"hard"})[0]);
  EXPECT_TRUE(c.m().Exists({"more34"})[0]);
  ExpectConsistent(c);
}

// A soft pin ends after its TTL unless reads renew it; then the object is evicted in LRU order.
TEST(MasterPins, SoftPinLastsItsTtlAndReadsRenewIt) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 1000;
  cfg.max_put_fill = 1.0;
  cfg.soft_pin_ttl_ms = 60000;  // the default, for "read"
  Cluster c(cfg);
  c.AddNode("n0", {10 * kKiB});
  ASSERT_TRUE(PinnedPut(c, "short", SoftPin::kEnable, 2000).ok());
  ASSERT_TRUE(PinnedPut(c, "read", SoftPin::kEnable).ok());
  for (int i = 0; i < 8; ++i) {
    c.now += kMs;
    ASSERT_TRUE(c.Put("p" + std::to_string(i), kKiB).ok());
  }
  c.PassSeconds(1);  // its tick evicts 10 -> 8 KiB: two unpinned ones
  int plain_left = 0;
  for (int i = 0; i < 8; ++i) plain_left += c.m().Exists({"p" + std::to_string(i)})[0];
  EXPECT_EQ(plain_left, 6);
  EXPECT_TRUE(c.m().Exists({"short"})[0]);
  c.PassSeconds(2);     // "short" is past its 2 s; "read" is pinned for 60 s
  c.now += 6000 * kMs;  // every lease is over
  c.HeartbeatAll();
  ASSERT_TRUE(PinnedPut(c, "x0", SoftPin::kDisable).ok());
  ASSERT_TRUE(PinnedPut(c, "x1", SoftPin::kDisable).ok());
  // Over the high watermark again: "short" is the least recently used, unpinned now.
  EXPECT_GT(c.m().Tick(c.now).objects_evicted, 0u);
  EXPECT_FALSE(c.m().Exists({"short"})[0]);
  EXPECT_TRUE(c.m().Exists({"read"})[0]);
  // 50 s later a read renews "read" for 60 s from then; then every other object is read, so
  // that "read" is the least recently used: 70 s after its put only the renewed pin keeps it.
  c.now += 50000 * kMs;
  c.HeartbeatAll();
  ASSERT_TRUE(c.m().GetReplicas({"read"}, "", c.now)[0].ok());
  c.now += 1000 * kMs;
  for (const auto& [k, rec] : c.nodes["n0"].records) {
    if (rec.key != "read") (void)c.m().GetReplicas({rec.key}, "", c.now);
  }
  c.now += 19000 * kMs;  // leases over
  c.HeartbeatAll();
  for (int i = 0; i < 4; ++i) {
    c.now += kMs;
    ASSERT_TRUE(c.Put("q" + std::to_string(i), kKiB).ok()) << i;
  }
  c.m().Tick(c.now);
  EXPECT_TRUE(c.m().Exists({"read"})[0]);
  ExpectConsistent(c);
}

// Upserts: PRESERVE keeps the replaced version's soft pin (and a hard pin stays); DISABLE drops
// it; a TTL without ENABLE is refused, naming it.
TEST(MasterPins, UpsertsKeepOrDropPinsAndATtlNeedsEnable) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 1000;
  cfg.max_put_fill = 1.0;
  Cluster c(cfg);
  c.AddNode("n0", {10 * kKiB});
  ASSERT_TRUE(PinnedPut(c, "kept", SoftPin::kEnable).ok());
  ASSERT_TRUE(PinnedPut(c, "dropped", SoftPin::kEnable).ok());
  ASSERT_TRUE(PinnedPut(c, "hard", SoftPin::kPreserve, 0, true).ok());
  c.now += kMs;
  ASSERT_TRUE(PinnedPut(c, "kept", SoftPin::kPreserve, 0, false, true).ok());
  ASSERT_TRUE(PinnedPut(c, "dropped", SoftPin::kDisable, 0, false, true).ok());
  ASSERT_TRUE(PinnedPut(c, "hard", SoftPin::kPreserve, 0, false, true).ok());
  PutOptions bad;
  bad.soft_pin_ttl_ms = 1000;  // with PRESERVE
  auto r = c.m().PutStart({{"bad", {kKiB}}}, bad, c.now);
  ASSERT_EQ(r[0].status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r[0].status().message().find("soft_pin_ttl_ms"), std::string::npos);
  for (int i = 0; i < 7; ++i) {
    c.now += kMs;
    ASSERT_TRUE(c.Put("p" + std::to_string(i), kKiB).ok());
  }
  c.now += 6000 * kMs;  // leases of the replaced versions over
  c.HeartbeatAll();
  // Full: of the 10, the unpinned 7 and "dropped" are the candidates; the oldest of them,
  // "dropped", goes first.
  c.m().Tick(c.now);
  EXPECT_FALSE(c.m().Exists({"dropped"})[0]);
  EXPECT_TRUE(c.m().Exists({"kept"})[0]);
  EXPECT_TRUE(c.m().Exists({"hard"})[0]);
  ExpectConsistent(c);
}

// A master rebuilt from the nodes' inventories keeps hard pins and soft-pins again.
TEST(MasterPins, PinsComeBackWithTheInventories) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 1000;
  cfg.max_put_fill = 1.0;
  Cluster c(cfg);
  c.AddNode("n0", {10 * kKiB});
  ASSERT_TRUE(PinnedPut(c, "hard", SoftPin::kDisable, 0, true).ok());
  ASSERT_TRUE(PinnedPut(c, "soft", SoftPin::kEnable, 600000).ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(c.Put("p" + std::to_string(i), kKiB).ok());
  bool hard_seen = false, soft_seen = false;
  for (const auto& [k, rec] : c.nodes["n0"].records) {
    if (rec.key == "hard") hard_seen = rec.hard_pin && rec.soft_pin_ttl_ms == 0;
    if (rec.key == "soft") soft_seen = !rec.hard_pin && rec.soft_pin_ttl_ms == 600000;
  }
  EXPECT_TRUE(hard_seen && soft_seen) << "the committed records carry no pins";
  c.Restart();
  c.now += 60000 * kMs;  // past every wait of a restart (late writes, leases)
  c.HeartbeatAll();
  c.m().Tick(c.now);
  // Fill it: only unpinned objects go.
  for (int i = 0; i < 10; ++i) {
    c.now += kMs;
    (void)c.Put("after" + std::to_string(i), kKiB);
    c.m().Tick(c.now);
  }
  EXPECT_TRUE(c.m().Exists({"hard"})[0]);
  EXPECT_TRUE(c.m().Exists({"soft"})[0]);
  for (int i = 0; i < 8; ++i) EXPECT_FALSE(c.m().Exists({"p" + std::to_string(i)})[0]) << i;
  ExpectConsistent(c);
}

}  // namespace
}  // namespace kvbridge::store::master_test
