// Unit tests of the master's node table (store/master_nodes.cc): configuration checks,
// registration, heartbeats and liveness, frees delivered until acknowledged, nodes back from
// expiry or a master restart (late writes), new incarnations, deregistration and drain.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "tests/unit/master/master_fixture.h"

namespace kvbridge::store::master_test {
namespace {

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

// An HA leader (track_inflight) lists the chunks it hands out to writers, and they leave the
// list once the late-write window has passed.
TEST(MasterInflight, ChunksHandedOutArePublishedUntilTheWindowPasses) {
  MasterConfig cfg;
  cfg.track_inflight = true;
  cfg.inflight_window_ms = 5000;
  Cluster c(cfg);
  c.AddNode("n0", {64 << 20});  // 1 MiB chunks
  EXPECT_TRUE(c.m().InflightToPublish(c.now).empty());
  auto a = c.Start("k", {4096});
  ASSERT_TRUE(a.ok());
  auto maps = c.m().InflightToPublish(c.now, /*growth_only=*/true);
  ASSERT_EQ(maps.size(), 1u);
  ASSERT_EQ(maps[0].segments.size(), 1u);
  const uint64_t chunk = maps[0].segments[0].chunk_bytes;
  EXPECT_EQ(chunk, 1u << 20);
  EXPECT_EQ(maps[0].segments[0].chunks, uint64_t{1} << (a->replicas[0].offset / chunk));
  EXPECT_FALSE(c.m().InflightToPublish(c.now, true).empty()) << "unpublished: asked again";
  c.m().InflightPublished(maps, c.now);
  EXPECT_TRUE(c.m().InflightToPublish(c.now, true).empty());
  EXPECT_TRUE(c.m().InflightToPublish(c.now).empty());
  c.now += 5001 * kMs;
  maps = c.m().InflightToPublish(c.now);
  ASSERT_EQ(maps.size(), 1u);
  EXPECT_EQ(maps[0].segments[0].chunks, 0u);
}

// A new leader that inherits its predecessor's maps keeps new data off those chunks only, and
// only until the restart hold ends; the rest of a node that comes back takes data at once. The
// held chunks stay in its own published map meanwhile.
TEST(MasterInflight, InheritedChunksAreHeldAndTheRestTakesDataAtOnce) {
  MasterConfig cfg;
  cfg.track_inflight = true;
  cfg.inflight_window_ms = 5000;
  cfg.restart_hold_until_ns = 1000 * kMs + 12000 * kMs;
  cfg.inflight_authoritative = true;
  InflightMap inherited;
  inherited.node_id = "n0";
  inherited.incarnation = 5;
  inherited.segments.push_back({100, 1 << 20, 0x3});  // chunks 0 and 1: the first 2 MiB
  cfg.inherited_inflight = {inherited};
  Cluster c(cfg);
  c.AddNode("other", {1 << 20});
  FakeNode n;
  n.id = {"n0", 5};
  n.segments.push_back({100, 4 << 20});
  NodeRegistration reg = n.Registration();
  reg.registered_before = true;
  auto r = c.m().RegisterNode(reg, {}, c.now);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->no_alloc_ms, 0u) << "the whole node was held";
  // Fill n0: every allocation lands outside the first 2 MiB while the hold lasts.
  int on_n0 = 0;
  for (int i = 0; i < 3; ++i) {
    auto a = c.Start("k" + std::to_string(i), {1 << 19}, 1, "n0");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    if (a->replicas[0].node.node_id != "n0") continue;
    ++on_n0;
    EXPECT_GE(a->replicas[0].offset, 2u << 20) << "allocated in an inherited chunk";
  }
  EXPECT_GT(on_n0, 0) << "nothing went to the node that came back";
  auto maps = c.m().InflightToPublish(c.now);
  bool held_published = false;
  for (const auto& m : maps) {
    if (m.node_id == "n0") held_published = (m.segments[0].chunks & 0x3) == 0x3;
  }
  EXPECT_TRUE(held_published) << "the inherited chunks left this leader's own map";
  ExpectConsistent(c);
  // After the hold the chunks are free again.
  while (c.now < cfg.restart_hold_until_ns) {
    c.now += 1000 * kMs;
    ASSERT_TRUE(c.m().Heartbeat(n.id, 0, c.now).ok());
    c.HeartbeatAll();
    c.m().Tick(c.now);
  }
  bool low = false;
  for (int i = 0; i < 4 && !low; ++i) {
    auto a = c.Start("late" + std::to_string(i), {1 << 19}, 1, "n0");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    low = a->replicas[0].node.node_id == "n0" && a->replicas[0].offset < (2u << 20);
  }
  EXPECT_TRUE(low) << "the inherited chunks were never released";
  ExpectConsistent(c);
}

// Without a complete list (the first HA leader, or etcd did not answer) a node that comes back
// waits as after a master restart.
TEST(MasterInflight, WithoutAuthoritativeMapsTheWholeNodeWaits) {
  MasterConfig cfg;
  cfg.track_inflight = true;
  cfg.restart_hold_until_ns = 1000 * kMs + 12000 * kMs;
  Cluster c(cfg);
  FakeNode n;
  n.id = {"n0", 5};
  n.segments.push_back({100, 4 << 20});
  NodeRegistration reg = n.Registration();
  reg.registered_before = true;
  auto r = c.m().RegisterNode(reg, {}, c.now);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->no_alloc_ms, 12000u);
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

// A master frozen before its first tick (nodes registered, then SIGSTOP within one tick
// period) measures that first gap from its start time: a pause, not silent nodes.
TEST(MasterMembership, APauseBeforeTheFirstTickIsAPause) {
  MasterConfig cfg;
  cfg.pause_threshold_ms = 500;
  cfg.start_ns = 1000 * kMs;
  Cluster c(cfg);
  c.now = cfg.start_ns + 50 * kMs;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {1 << 20});
  c.now += 5000 * kMs;  // frozen before the first tick
  TickSummary t = c.m().Tick(c.now);
  EXPECT_EQ(t.paused_ms, 5050u);
  EXPECT_EQ(t.nodes_expired, 0u);
  // Without a start time the same first tick has no reference and both nodes expire.
  cfg.start_ns = 0;
  Cluster d(cfg);
  d.now = 1050 * kMs;
  d.AddNode("n0", {1 << 20});
  d.now += 5000 * kMs;
  t = d.m().Tick(d.now);
  EXPECT_EQ(t.paused_ms, 0u);
  EXPECT_EQ(t.nodes_expired, 1u);
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

}  // namespace
}  // namespace kvbridge::store::master_test
