// Unit tests of a master restart and of nodes coming back (store/master_nodes.cc, LoadInventory
// and the departed-node notes): inventories rebuild the table, conflicting records are resolved,
// and a returning node brings back only what left with it.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tests/unit/master/master_fixture.h"

namespace kvbridge::store::master_test {
namespace {

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

}  // namespace
}  // namespace kvbridge::store::master_test
