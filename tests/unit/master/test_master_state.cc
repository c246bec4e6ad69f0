// Unit tests of the master as a whole (store/master_state.cc): Stats, calls from many threads,
// and thousands of random operations after each of which the invariants hold.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/unit/master/master_fixture.h"

namespace kvbridge::store::master_test {
namespace {

// ------------------------------------------------------------------ stats

TEST(MasterStats, ReportsNodesObjectsAndBytes) {
  Cluster c;
  c.AddNode("n0", {1 << 20});
  c.AddNode("n1", {2 << 20});
  ASSERT_TRUE(c.Put("a", 1000, 2).ok());
  ASSERT_TRUE(c.Start("p", {100}).ok());
  auto st = c.m().Stats();
  ASSERT_EQ(st.nodes.size(), 2u);
  EXPECT_EQ(st.nodes[0].identity.node_id, "n0");
  EXPECT_EQ(st.nodes[0].capacity, 1u << 20);
  EXPECT_EQ(st.nodes[1].capacity, 2u << 20);
  EXPECT_EQ(st.nodes[0].state, NodeState::kActive);
  EXPECT_EQ(st.nodes[0].used + st.nodes[1].used, 1024u + 1024u + 128u);
  EXPECT_EQ(st.objects, 1u);
  EXPECT_EQ(st.pending, 1u);
  EXPECT_EQ(st.bytes, 1000u);
  EXPECT_STREQ(NodeStateName(NodeState::kDraining), "DRAINING");
  auto dir = c.m().GetNodeDirectory({"n1", "nX"});
  ASSERT_EQ(dir.nodes.size(), 1u);
  EXPECT_EQ(dir.nodes[0].engine_descriptor, "desc-n1");
  EXPECT_EQ(dir.nodes[0].control_endpoint, "ep-n1");
  EXPECT_EQ(c.m().GetNodeDirectory({}).nodes.size(), 2u);
}

TEST(MasterConcurrency, CallsFromManyThreadsKeepTheTableConsistent) {
  Cluster c;
  for (int i = 0; i < 4; ++i) c.AddNode("n" + std::to_string(i), {256 * kKiB});
  MasterState& m = c.m();
  std::atomic<uint64_t> clock{c.now};
  std::atomic<int> puts_completed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 1500; ++i) {
        const uint64_t now = clock.fetch_add(kMs);
        const std::string key = "k" + std::to_string(rng() % 200);
        switch (rng() % 6) {
          case 0: {
            PutOptions o;
            o.replica_num = 1 + rng() % 3;
            auto a = m.PutStart({{key, {1 + rng() % 8192}}}, o, now);
            if (!a[0].ok()) break;
            auto plan = m.BeginPutEnd(
                {{key, a[0]->version, std::vector<bool>(a[0]->replicas.size(), true), 1}}, now);
            for (auto& cm : plan.commits) cm.ok = rng() % 10 != 0;
            puts_completed += m.FinishPutEnd(plan, now)[0].ok();
            break;
          }
          case 1:
          case 2:
            (void)m.GetReplicas({key}, "n" + std::to_string(t), now);
            break;
          case 3:
            (void)m.Remove(key, now);
            break;
          case 4:
            (void)m.Heartbeat({"n" + std::to_string(t), 1}, 0, now);
            break;
          default:
            m.Tick(now);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  ExpectConsistent(c);
  // (How many objects survive depends on the interleaving: a thread that finishes early stops
  // heartbeating its node while the shared clock runs on, so nodes may expire.)
  EXPECT_GT(puts_completed.load(), 0) << "the test exercised nothing";
}

// ------------------------------------------------------------------ randomized

// Thousands of random operations over four nodes with deaths, restarts, drains and master
// restarts; after every step the invariants hold, and every COMPLETE replica is known (has its
// inventory record) on its node.
class MasterRandomized : public ::testing::TestWithParam<uint64_t> {};

TEST_P(MasterRandomized, InvariantsHoldUnderRandomOperations) {
  MasterConfig cfg;
  cfg.eviction_sample_size = 4;
  cfg.max_tasks_per_node = 4;
  cfg.random_seed = GetParam();
  Cluster c(cfg);
  std::mt19937_64 rng(GetParam());
  auto chance = [&](double p) { return std::uniform_real_distribution<>(0, 1)(rng) < p; };
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  const std::vector<std::string> names = {"n0", "n1", "n2", "n3"};
  std::map<std::string, bool> silent;  // not heartbeating (dead or partitioned)
  uint64_t incarnation = 1;
  for (const auto& n : names) c.AddNode(n, {32 * kKiB, 8 * kKiB}, incarnation);

  struct Put {
    std::string key;
    PutAllocation alloc;
  };
  std::vector<Put> puts;
  std::vector<PutEndPlan> plans;
  std::vector<std::pair<TaskCommitPlan, Commit>> task_plans;
  auto key = [&] { return "key" + std::to_string(pick(120)); };
  auto commit_mode = [&] {
    return chance(0.85) ? Commit::kOk : (chance(0.5) ? Commit::kFail : Commit::kLostReply);
  };
  size_t completes = 0, task_oks = 0, restarts = 0, deaths = 0;
  uint64_t evicted_or_revoked = 0;  // by the masters before the last restart

  for (int step = 0; step < 5000; ++step) {
    c.now += pick(400) * kMs;
    const size_t op = pick(100);
    if (op < 25) {  // put start
      PutOptions o;
      o.replica_num = 1 + pick(3);
      o.client_node_id = chance(0.3) ? names[pick(4)] : "";
      o.pinned = chance(0.05);
      std::vector<PutItem> items;
      for (size_t i = 0, n = 1 + pick(3); i < n; ++i) {
        std::vector<uint64_t> sizes;
        for (size_t b = 0, nb = 1 + pick(2); b < nb; ++b) sizes.push_back(1 + pick(6 * kKiB));
        items.push_back({key(), sizes});
      }
      auto r = c.m().PutStart(items, o, c.now);
      for (size_t i = 0; i < r.size(); ++i) {
        if (r[i].ok()) puts.push_back({items[i].key, r[i].value()});
      }
    } else if (op < 45 && !puts.empty()) {  // put end, maybe left half-done for a while
      const size_t i = pick(puts.size());
      std::vector<bool> flags;
      for (size_t k = 0; k < puts[i].alloc.replicas.size(); ++k) flags.push_back(chance(0.9));
      plans.push_back(c.m().BeginPutEnd(
          {{puts[i].key, puts[i].alloc.version, flags, static_cast<uint32_t>(rng())}}, c.now));
      for (auto& cm : plans.back().commits) c.Deliver(cm, commit_mode());
      puts.erase(puts.begin() + i);
      if (chance(0.7)) {
        for (const Status& s : c.m().FinishPutEnd(plans.back(), c.now)) completes += s.ok();
        plans.pop_back();
      }
    } else if (op < 50 && !plans.empty()) {  // a delayed put end finishes
      const size_t i = pick(plans.size());
      for (const Status& s : c.m().FinishPutEnd(plans[i], c.now)) completes += s.ok();
      plans.erase(plans.begin() + i);
    } else if (op < 53 && !puts.empty()) {  // revoke
      const size_t i = pick(puts.size());
      (void)c.m().PutRevoke({{puts[i].key, puts[i].alloc.version}}, c.now);
      puts.erase(puts.begin() + i);
    } else if (op < 63) {  // get
      std::vector<std::string> keys = {key(), key()};
      auto g = c.m().GetReplicas(keys, names[pick(4)], c.now);
      if (g[0].ok() && chance(0.1)) {  // a reader reports a bad copy
        (void)c.m().ReportBadReplica(keys[0], g[0]->version,
                                     g[0]->replicas[pick(g[0]->replicas.size())].node, c.now);
      }
    } else if (op < 66) {
      (void)c.m().Remove(key(), c.now);
    } else if (op < 67 && chance(0.1)) {
      c.m().RemoveAll(c.now);
    } else if (op < 80) {  // heartbeats, and the tasks they bring are run
      for (auto& [name, n] : c.nodes) {
        if (silent[name]) continue;
        Status st = c.Heartbeat(n);
        if (st.IsNotFound()) {  // declared dead while partitioned: back with its inventory
          ASSERT_TRUE(c.Register(n).ok());
        }
        if (n.drained) {  // leaves, and comes back later as a fresh process
          ASSERT_TRUE(c.m().Deregister(n.id, c.now).ok());
          n.records.clear();
          n.tasks.clear();
          n.drained = false;
          n.draining = false;
          n.id.incarnation = ++incarnation;
          ASSERT_TRUE(c.Register(n).ok());
        }
      }
      for (auto& [name, n] : c.nodes) {
        auto tasks = std::move(n.tasks);
        n.tasks.clear();
        for (const auto& t : tasks) {
          if (silent[name] || chance(0.2)) continue;  // lost: times out
          auto plan = c.m().TaskDone(t.task_id, n.id, chance(0.9), c.now);
          if (!plan.ok()) continue;
          const Commit mode = commit_mode();
          for (auto& cm : plan->commits) c.Deliver(cm, mode);
          if (chance(0.8)) {
            task_oks += c.m().FinishTask(plan.value(), c.now).ok();
          } else {
            task_plans.push_back({plan.value(), mode});
          }
        }
      }
    } else if (op < 82 && !task_plans.empty()) {
      const size_t i = pick(task_plans.size());
      task_oks += c.m().FinishTask(task_plans[i].first, c.now).ok();
      task_plans.erase(task_plans.begin() + i);
    } else if (op < 85) {  // a node goes silent, or comes back
      const std::string& name = names[pick(4)];
      FakeNode& n = c.nodes[name];
      if (!silent[name]) {
        silent[name] = true;
        n.partitioned = true;
        ++deaths;
      } else {
        silent[name] = false;
        n.partitioned = false;
        if (chance(0.5)) {  // restarted process: new incarnation, memory lost
          n.records.clear();
          n.tasks.clear();
          n.draining = false;
          n.id.incarnation = ++incarnation;
        }
        auto reg = c.Register(n);
        ASSERT_TRUE(reg.ok() || reg.status().code() == StatusCode::kAlreadyExists)
            << reg.status().ToString();
      }
    } else if (op < 86) {
      const std::string& name = names[pick(4)];
      if (!silent[name] && c.m().StartDrain(c.nodes[name].id, c.now).ok()) {
        c.nodes[name].draining = true;
      }
    } else if (op < 87 && chance(0.2)) {  // master restart
      std::map<std::string, std::pair<uint64_t, uint32_t>> complete;
      for (const auto& o : c.m().Snapshot().objects) {
        bool known = false;
        for (const auto& r : o.replicas) {
          known |= r.state == ReplicaState::kComplete && !silent[r.location.node.node_id];
        }
        if (o.state == ObjectState::kComplete && known) complete[o.key] = {o.version, o.checksum};
      }
      // Live nodes re-register; silent ones stay away until they come back.
      std::map<std::string, FakeNode> away;
      for (const auto& [name, dead] : silent) {
        if (dead) away[name] = c.nodes[name], c.nodes.erase(name);
      }
      evicted_or_revoked += c.m().Stats().evictions_total + c.m().Stats().revokes_total;
      c.Restart();
      for (auto& [name, n] : away) c.nodes[name] = std::move(n);
      for (auto& [name, n] : c.nodes) n.tasks.clear();  // the new master knows none of them
      puts.clear();
      plans.clear();
      task_plans.clear();
      for (const auto& [k, vc] : complete) {
        auto g = c.m().GetReplicas({k}, "", c.now);
        ASSERT_TRUE(g[0].ok()) << k << " lost in a master restart";
        EXPECT_GE(g[0]->version, vc.first) << k;
        if (g[0]->version == vc.first) {
          EXPECT_EQ(g[0]->checksum, vc.second) << k;
        }
      }
      ++restarts;
    } else {
      c.m().Tick(c.now);
    }

    Status st = c.m().CheckInvariants();
    ASSERT_TRUE(st.ok()) << "step " << step << ": " << st.ToString();
    const MasterSnapshot snap = c.m().Snapshot();
    ASSERT_TRUE(SnapshotHolds(snap)) << "step " << step;
    for (const auto& o : snap.objects) {
      for (const auto& r : o.replicas) {
        if (r.state != ReplicaState::kComplete) continue;
        const FakeNode& n = c.nodes.at(r.location.node.node_id);
        auto rec = n.records.find({r.location.segment_id, r.location.offset});
        ASSERT_TRUE(rec != n.records.end() && rec->second.key == o.key &&
                    rec->second.version == o.version && rec->second.replica_id == r.replica_id)
            << "step " << step << ": " << o.key << " complete on " << r.location.node.node_id
            << " but the node has no record of it";
      }
    }
  }
  // The run exercised what it is meant to.
  EXPECT_GT(completes, 200u);
  EXPECT_GT(task_oks, 20u);
  EXPECT_GT(deaths, 10u);
  EXPECT_GT(restarts, 0u);
  // (Counted over every master of the run: pins come back with the inventories, so the last
  // master may have had nothing evictable.)
  evicted_or_revoked += c.m().Stats().evictions_total + c.m().Stats().revokes_total;
  EXPECT_GT(evicted_or_revoked, 0u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, MasterRandomized, ::testing::Range<uint64_t>(1, 9));

}  // namespace
}  // namespace kvbridge::store::master_test
