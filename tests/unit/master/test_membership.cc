// Membership (store/membership.h) alone: joins, leases, leaving, the directory and its events,
// on an injected clock. What the master does with the events is tested through MasterState
// (test_master_nodes.cc).
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "store/membership.h"

namespace kvbridge::store {
namespace {

constexpr uint64_t kMs = 1000000ull;
using Kind = MemberEvent::Kind;

NodeRegistration Reg(const std::string& id, uint64_t incarnation = 1, bool draining = false) {
  NodeRegistration r;
  r.identity = {id, incarnation};
  r.engine_descriptor = "desc-" + id + "-" + std::to_string(incarnation);
  r.control_endpoint = "ep-" + id;
  r.segments = {{1, 1 << 20, Tier::kDram}};
  r.draining = draining;
  return r;
}

struct Seen {
  Kind kind;
  NodeIdentity node;
  bool operator==(const Seen&) const = default;
};

std::vector<Seen> Kinds(const std::vector<MemberEvent>& events) {
  std::vector<Seen> out;
  for (const MemberEvent& e : events) out.push_back({e.kind, e.node});
  return out;
}

MembershipOptions Ttl(uint64_t ttl_ms) {
  MembershipOptions o;
  o.ttl_ms = ttl_ms;
  return o;
}

TEST(Membership, JoinAddsAMemberToTheDirectory) {
  Membership m(Ttl(3000));
  const uint64_t v0 = m.version();
  EXPECT_EQ(m.Join(Reg("a"), 10 * kMs).kind, Membership::JoinKind::kNew);
  EXPECT_EQ(m.Join(Reg("b", 1, /*draining=*/true), 10 * kMs).kind, Membership::JoinKind::kNew);
  EXPECT_EQ(m.version(), v0 + 2);
  const NodeDirectory all = m.Directory({});
  EXPECT_EQ(all.directory_version, m.version());
  ASSERT_EQ(all.nodes.size(), 2u);
  EXPECT_EQ(all.nodes[0].identity, (NodeIdentity{"a", 1}));
  EXPECT_EQ(all.nodes[0].state, NodeState::kActive);
  EXPECT_EQ(all.nodes[0].engine_descriptor, "desc-a-1");
  EXPECT_EQ(all.nodes[0].control_endpoint, "ep-a");
  EXPECT_EQ(all.nodes[1].state, NodeState::kDraining);  // it registered draining
  const NodeDirectory some = m.Directory({"b", "unknown"});
  ASSERT_EQ(some.nodes.size(), 1u);
  EXPECT_EQ(some.nodes[0].identity.node_id, "b");
  EXPECT_EQ(Kinds(m.TakeEvents()),
            (std::vector<Seen>{{Kind::kJoined, {"a", 1}}, {Kind::kJoined, {"b", 1}}}));
  EXPECT_TRUE(m.TakeEvents().empty()) << "events are handed out once";
}

TEST(Membership, SameIncarnationAgainChangesNothing) {
  Membership m(Ttl(3000));
  m.Join(Reg("a"), 0);
  (void)m.TakeEvents();
  const uint64_t v = m.version();
  // Even its lease stays as it was: a retried registration is not a heartbeat.
  EXPECT_EQ(m.Join(Reg("a"), 2000 * kMs).kind, Membership::JoinKind::kAgain);
  EXPECT_EQ(m.version(), v);
  EXPECT_TRUE(m.TakeEvents().empty());
  EXPECT_EQ(m.Find({"a", 1})->last_seen_ns, 0u);
  EXPECT_EQ(m.Expire(3000 * kMs).expired, (std::vector<NodeIdentity>{{"a", 1}}));
}

TEST(Membership, NewIncarnationReplacesTheOld) {
  Membership m(Ttl(3000));
  m.Join(Reg("a", 1), 0);
  (void)m.TakeEvents();
  const uint64_t v = m.version();
  const Membership::Joined j = m.Join(Reg("a", 2), 5 * kMs);
  EXPECT_EQ(j.kind, Membership::JoinKind::kReplaced);
  EXPECT_EQ(j.replaced, (NodeIdentity{"a", 1}));
  EXPECT_EQ(m.version(), v + 2);  // the old one left, the new one joined
  EXPECT_EQ(Kinds(m.TakeEvents()),
            (std::vector<Seen>{{Kind::kReplaced, {"a", 1}}, {Kind::kJoined, {"a", 2}}}));
  EXPECT_EQ(m.Find({"a", 1}), nullptr);
  ASSERT_NE(m.Find({"a", 2}), nullptr);
  EXPECT_EQ(m.FindId("a")->id().incarnation, 2u);
  EXPECT_EQ(m.Directory({"a"}).nodes.at(0).engine_descriptor, "desc-a-2");
  // The old incarnation's heartbeats keep nothing alive.
  EXPECT_FALSE(m.KeepAlive({"a", 1}, 10 * kMs));
}

TEST(Membership, SilentMembersExpireAfterTheTtl) {
  Membership m(Ttl(3000));
  m.Join(Reg("a"), 0);
  m.Join(Reg("b"), 0);
  m.Join(Reg("c"), 0);
  (void)m.TakeEvents();
  EXPECT_TRUE(m.KeepAlive({"a", 1}, 2000 * kMs));  // under the caller's lock
  m.Touch({"b", 1}, 2500 * kMs);                   // without it: folded in by Expire
  m.Touch({"c", 7}, 2500 * kMs);                   // another incarnation: not c's
  EXPECT_TRUE(m.Expire(2999 * kMs).expired.empty());
  const uint64_t v = m.version();
  const Membership::Expiry e = m.Expire(3000 * kMs);
  EXPECT_EQ(e.expired, (std::vector<NodeIdentity>{{"c", 1}}));
  EXPECT_EQ(e.longest_silence_ms, 3000u);
  EXPECT_EQ(e.since_last_ms, 1u);
  EXPECT_EQ(m.version(), v + 1);
  const std::vector<MemberEvent> events = m.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kExpired);
  EXPECT_EQ(events[0].silent_ms, 3000u);
  EXPECT_EQ(events[0].at_ns, 3000 * kMs);
  // a heard at 2 s, b at 2.5 s: each expires a TTL later.
  EXPECT_EQ(m.Expire(5000 * kMs).expired, (std::vector<NodeIdentity>{{"a", 1}}));
  EXPECT_EQ(m.Expire(5500 * kMs).expired, (std::vector<NodeIdentity>{{"b", 1}}));
  EXPECT_TRUE(m.members().empty());
  EXPECT_FALSE(m.KeepAlive({"a", 1}, 6000 * kMs)) << "an expired member must join again";
}

TEST(Membership, TouchRecordsOfNonMembersAreDroppedByExpire) {
  Membership m(Ttl(3000));
  m.Join(Reg("a"), 0);
  for (int i = 0; i < 1000; ++i) m.Touch({"made-up-" + std::to_string(i), 1}, 1 * kMs);
  m.Touch({"a", 1}, 1 * kMs);
  EXPECT_EQ(m.live_records(), 1001u);
  m.Expire(2 * kMs);
  EXPECT_EQ(m.live_records(), 1u);
}

TEST(Membership, APausedMasterRestartsEveryLease) {
  MembershipOptions o = Ttl(3000);
  o.pause_threshold_ms = 1000;
  o.start_ns = 1 * kMs;
  Membership m(o);
  m.Join(Reg("a"), 1 * kMs);
  EXPECT_TRUE(m.Expire(500 * kMs).expired.empty());
  // Nothing ran for 10 s: the master's fault, not the member's.
  const Membership::Expiry e = m.Expire(10500 * kMs);
  EXPECT_EQ(e.paused_ms, 10000u);
  EXPECT_TRUE(e.expired.empty());
  for (uint64_t t = 11000; t < 13500; t += 500) {
    EXPECT_TRUE(m.Expire(t * kMs).expired.empty()) << t;
  }
  EXPECT_EQ(m.Expire(13500 * kMs).expired.size(), 1u);  // a TTL after the pause ended
}

TEST(Membership, DrainingAndLeaving) {
  Membership m(Ttl(3000));
  m.Join(Reg("a"), 0);
  m.Join(Reg("b"), 0);
  (void)m.TakeEvents();
  const uint64_t v = m.version();
  EXPECT_TRUE(m.SetDraining({"a", 1}, 1 * kMs));
  EXPECT_FALSE(m.SetDraining({"a", 1}, 2 * kMs)) << "already draining";
  EXPECT_FALSE(m.SetDraining({"b", 9}, 2 * kMs)) << "another incarnation";
  EXPECT_EQ(m.Directory({"a"}).nodes.at(0).state, NodeState::kDraining);
  EXPECT_FALSE(m.Leave({"a", 2}, 3 * kMs));
  EXPECT_TRUE(m.Leave({"a", 1}, 3 * kMs));
  EXPECT_FALSE(m.Leave({"a", 1}, 4 * kMs)) << "left already";
  EXPECT_EQ(m.version(), v + 2);
  EXPECT_EQ(Kinds(m.TakeEvents()),
            (std::vector<Seen>{{Kind::kDraining, {"a", 1}}, {Kind::kLeft, {"a", 1}}}));
  EXPECT_EQ(m.Directory({}).nodes.size(), 1u);
}

// Touch takes no lock of the caller's: heartbeat threads record liveness while the caller holds
// its own lock around Expire throughout, and every record counts.
TEST(Membership, TouchNeedsNotTheCallersLock) {
  constexpr int kNodes = 4;
  Membership m(Ttl(3000));
  for (int i = 0; i < kNodes; ++i) m.Join(Reg("n" + std::to_string(i)), 0);
  std::mutex callers_lock;  // what MasterState's `mu` is to it
  std::atomic<uint64_t> now_ms{0};
  std::atomic<bool> stop{false};
  std::vector<std::atomic<uint64_t>> touched_ms(kNodes);
  std::vector<std::thread> beats;
  for (int i = 0; i < kNodes; ++i) {
    beats.emplace_back([&, i] {
      while (!stop.load()) {
        const uint64_t t = now_ms.load();
        m.Touch({"n" + std::to_string(i), 1}, t * kMs);
        touched_ms[i].store(t);
      }
    });
  }
  {
    std::lock_guard<std::mutex> lock(callers_lock);
    for (uint64_t t = 1000; t <= 20000; t += 1000) {
      now_ms.store(t);
      for (int i = 0; i < kNodes; ++i) {
        while (touched_ms[i].load() < t) std::this_thread::yield();
      }
      EXPECT_TRUE(m.Expire((t + 2999) * kMs).expired.empty()) << t;
    }
  }
  stop.store(true);
  for (auto& b : beats) b.join();
  EXPECT_EQ(m.members().size(), static_cast<size_t>(kNodes));
  EXPECT_EQ(m.Expire(23000 * kMs).expired.size(), static_cast<size_t>(kNodes));
}

// A consumer that applies the events in order always ends with the same members as the
// membership itself, and sees each change once, numbered in order.
TEST(Membership, EventsComeInOrder) {
  Membership m(Ttl(3000));
  m.Join(Reg("a", 1), 0);
  m.Join(Reg("b", 1), 0);
  m.SetDraining({"b", 1}, 1 * kMs);
  m.Join(Reg("a", 2), 2 * kMs);
  m.Leave({"b", 1}, 3 * kMs);
  m.Join(Reg("c", 1), 4 * kMs);
  m.KeepAlive({"c", 1}, 4000 * kMs);
  m.Expire(5000 * kMs);  // a#2 (silent since 2 ms) expires, c does not
  const std::vector<MemberEvent> events = m.TakeEvents();
  EXPECT_EQ(Kinds(events), (std::vector<Seen>{{Kind::kJoined, {"a", 1}},
                                              {Kind::kJoined, {"b", 1}},
                                              {Kind::kDraining, {"b", 1}},
                                              {Kind::kReplaced, {"a", 1}},
                                              {Kind::kJoined, {"a", 2}},
                                              {Kind::kLeft, {"b", 1}},
                                              {Kind::kJoined, {"c", 1}},
                                              {Kind::kExpired, {"a", 2}}}));
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].seq, events[i - 1].seq + 1);
    EXPECT_GE(events[i].at_ns, events[i - 1].at_ns);
  }
  std::map<std::string, NodeIdentity> applied;
  for (const MemberEvent& e : events) {
    if (e.kind == Kind::kJoined) {
      applied[e.node.node_id] = e.node;
    } else if (e.kind != Kind::kDraining) {
      ASSERT_EQ(applied.at(e.node.node_id), e.node) << MemberEventName(e.kind);
      applied.erase(e.node.node_id);
    }
  }
  ASSERT_EQ(applied.size(), m.members().size());
  for (const auto& [id, member] : m.members()) EXPECT_EQ(applied.at(id), member.id());
}

}  // namespace
}  // namespace kvbridge::store
