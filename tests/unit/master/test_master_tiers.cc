// Unit tests of the SSD tier (store/master_tiers.cc): demotion of cold DRAM replicas to SSD,
// DemoteDone and its repeats, promotion back to DRAM, and eviction on a full SSD.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/unit/master/master_fixture.h"

namespace kvbridge::store::master_test {
namespace {

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
  ASSERT_TRUE(c.m().Remove("k1", c.now).ok());                  // cancels the promotion
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
  EXPECT_EQ(c.m()
                .ReportBadReplica(d.source.key, d.source.version, n.id, c.now, d.source.segment_id,
                                  d.source.offset)
                .code(),
            StatusCode::kNotFound);
  EXPECT_TRUE(c.m().Exists({d.source.key})[0]);
  // A report naming the current copy drops it (the last one: the object goes).
  EXPECT_TRUE(c.m()
                  .ReportBadReplica(d.source.key, d.source.version, n.id, c.now, d.dest.segment_id,
                                    d.dest.offset)
                  .ok());
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
  for (const Demotion& d : HeartbeatDemotions(c, tiered))
    ASSERT_TRUE(RunDemotion(c, tiered, d).ok());
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

}  // namespace
}  // namespace kvbridge::store::master_test
