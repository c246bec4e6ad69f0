// The SSD tier in the store: demotion under DRAM pressure, gets served from SSD through the
// owning node, nothing lost, and (with the persistent ssd plugin) objects surviving a node
// restart. Runs against each SSD-tier plugin that is built: plugins/storage_ssd, and the
// in-memory mock (every case when the ssd plugin is not built, else two basic ones;
// KVB_TIERS_MOCK_ALL=1 runs them all on the mock).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge.grpc.pb.h"
#include "kvbridge/engine.h"
#include "kvbridge/store.h"
#include "tests/common/test_util.h"

namespace kvbridge {
namespace {

namespace fs = std::filesystem;
using testing::Buffer;
using testing::Must;

constexpr uint64_t kObject = 128 * 1024;

struct TierCase {
  std::string plugin;      // the SSD tier's storage plugin
  std::string plugin_dir;  // where it is built
};

std::string CaseName(const ::testing::TestParamInfo<TierCase>& info) { return info.param.plugin; }
// How gtest (and so ctest's listing) prints a case: its plugin's name.
void PrintTo(const TierCase& c, std::ostream* os) { *os << c.plugin; }

bool SsdPluginBuilt() {
  return fs::exists(fs::path(KVBRIDGE_PLUGIN_BUILD_DIR_FOR_TESTS) / "libkvb_storage_ssd.so");
}

bool MockRunsEverything() {
  const char* v = std::getenv("KVB_TIERS_MOCK_ALL");
  return v != nullptr && std::string(v) == "1";
}

class StoreTiers : public ::testing::TestWithParam<TierCase> {
 protected:
  void SetUp() override {
    const fs::path so =
        fs::path(GetParam().plugin_dir) / ("libkvb_storage_" + GetParam().plugin + ".so");
    if (!fs::exists(so)) GTEST_SKIP() << so << " is not built";
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    if (GetParam().plugin == "mock" && SsdPluginBuilt() && !MockRunsEverything() &&
        name.rfind("DramPressureDemotesToSsd", 0) != 0 &&
        name.rfind("SsdKeysOfOneNodeAreRead", 0) != 0) {
      // The mock proves the tier seam is plugin-agnostic; with the ssd plugin built, the other
      // cases run against it alone (they cost ~85 s more per run on the mock).
      GTEST_SKIP() << "runs against the ssd plugin (KVB_TIERS_MOCK_ALL=1 runs it on the mock too)";
    }
    dir_ = fs::temp_directory_path() /
           ("kvb-tiers-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  EmbeddedClusterOptions Options(int nodes, uint64_t dram, uint64_t ssd, uint32_t replicas) {
    EmbeddedClusterOptions o;
    o.nodes = nodes;
    o.dram_bytes_per_node = dram;
    o.replica_num = replicas;
    o.ssd_dir = dir_.string();
    o.ssd_bytes_per_node = ssd;
    o.ssd_plugin = GetParam().plugin;
    o.engine.transports = {"tcp"};
    o.engine.plugin_path = GetParam().plugin_dir;
    o.engine.progress_timeout_ms = 1000;
    o.master.node_ttl_ms = 2000;
    o.master.lease_ms = 1000;
    return o;
  }

  fs::path dir_;
};

std::string Key(size_t i) { return "tier-" + std::to_string(i); }

std::vector<Status> Put(StoreClient& c, Buffer& arena, size_t first, size_t n) {
  const size_t slots = arena.size() / kObject;
  std::vector<std::string> keys;
  std::vector<std::vector<BufferRef>> bufs;
  for (size_t i = first; i < first + n; ++i) {
    arena.Fill(i, (i % slots) * kObject, kObject);
    keys.push_back(Key(i));
    bufs.push_back({BufferRef{arena.data() + (i % slots) * kObject, kObject}});
  }
  return c.BatchPutFrom(keys, bufs);
}

// Puts objects [0, n) in batches of `batch`, pausing `pause_ms` after each, then waiting (up to
// 30 s) until demotion, which runs in the background, has brought every node's DRAM back under
// the demote high watermark: a writer never outruns it, however slow a loaded machine makes the
// disk side (a fixed pace alone let eviction drop objects under load). `master` empty: the fixed
// pace alone, for tests where demotion cannot bring DRAM down (a full SSD, moves the master
// never applies). Returns the failed puts, the first one's error in *why.
int PutPaced(StoreClient& c, const std::string& master, Buffer& src, size_t n, size_t batch,
             int pause_ms, std::string* why) {
  int failed = 0;
  for (size_t first = 0; first < n; first += batch) {
    for (const Status& st : Put(c, src, first, batch)) {
      if (st.ok()) continue;
      if (failed++ == 0) *why = st.ToString();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!master.empty() && std::chrono::steady_clock::now() < until) {
      const ClusterStatus s = Must(QueryClusterStatus(master));
      const bool over = std::any_of(s.nodes.begin(), s.nodes.end(), [](const NodeStatus& node) {
        return node.used_bytes * 4 > node.capacity_bytes * 3;  // above 0.75, the default
      });
      if (!over) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return failed;
}

// Gets [first, first+n) into `out` and checks every byte; returns the failures. REQUIRES: the
// objects were put from an arena with as many slots as `out` has (Put's slot i % slots).
int GetAndCheck(StoreClient& c, Buffer& out, size_t first, size_t n, std::string* why) {
  const size_t slots = out.size() / kObject;
  std::vector<std::string> keys;
  std::vector<std::vector<BufferRef>> bufs;
  for (size_t i = first; i < first + n; ++i) {
    keys.push_back(Key(i));
    bufs.push_back({BufferRef{out.data() + (i - first) % slots * kObject, kObject}});
  }
  auto r = c.BatchGetInto(keys, bufs);
  int failed = 0;
  for (size_t k = 0; k < n; ++k) {
    const size_t off = k % slots * kObject;
    if (!r[k].ok()) {
      if (why->empty()) *why = Key(first + k) + ": " + r[k].status().ToString();
      ++failed;
    } else if (!out.Matches(first + k, off, kObject, (first + k) % slots * kObject)) {
      if (why->empty()) *why = Key(first + k) + ": wrong bytes";
      ++failed;
    }
  }
  return failed;
}

// Waits until the master reports no demotion left to do (DRAM at or under the demote
// watermark, or nothing demotable), up to `secs`.
ClusterStatus Settle(const std::string& master, int secs) {
  ClusterStatus s;
  uint64_t last = UINT64_MAX;
  for (int i = 0; i < secs * 10; ++i) {
    s = Must(QueryClusterStatus(master));
    if (s.demotions_total == last && i > 5) break;
    last = s.demotions_total;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  return s;
}

TEST_P(StoreTiers, DramPressureDemotesToSsdAndEveryObjectStaysReadable) {
  // 2 nodes x 8 MiB DRAM; 160 objects of 128 KiB = 20 MiB: well past what DRAM holds.
  auto cluster = Must(EmbeddedCluster::Start(Options(2, 8u << 20, 64u << 20, 1)));
  StoreClient& c = cluster->client();
  Buffer src(32 * kObject), dst(32 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  {
    std::string why;
    ASSERT_EQ(PutPaced(c, cluster->master_address(), src, 160, 16, 400, &why), 0) << why;
  }
  ClusterStatus s = Settle(cluster->master_address(), 10);
  EXPECT_EQ(s.objects, 160u);
  EXPECT_EQ(s.evictions_total, 0u) << "objects were dropped instead of demoted";
  EXPECT_GT(s.demotions_total, 40u);
  EXPECT_GT(s.ssd_replicas, 40u);
  for (const NodeStatus& n : s.nodes) {
    EXPECT_EQ(n.ssd_capacity_bytes, 64u << 20);
    EXPECT_GT(n.ssd_used_bytes, 0u);
    EXPECT_LE(n.used_bytes, n.capacity_bytes * 9 / 10) << n.id.node_id;
  }
  // Every object comes back with its bytes: the cold ones from SSD through their node.
  std::string why;
  for (size_t first = 0; first < 160; first += 32) {
    EXPECT_EQ(GetAndCheck(c, dst, first, 32, &why), 0) << why;
  }
  Must(c.BatchExists(std::vector<std::string>{Key(0), Key(159)}));
  // A removed SSD object is gone, and its space comes back.
  EXPECT_TRUE(c.BatchRemove(std::vector<std::string>{Key(0)})[0].ok());
  EXPECT_FALSE(Must(c.BatchExists(std::vector<std::string>{Key(0)}))[0]);
}

// Replica 2 on 3 nodes under DRAM pressure, then one node stops: every object is still read
// (from DRAM or SSD of the other replica), and re-replication, which copies SSD replicas too,
// restores two replicas.
void StopANodeOfATieredCluster(const EmbeddedClusterOptions& o) {
  auto cluster = Must(EmbeddedCluster::Start(o));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  {
    std::string why;
    ASSERT_EQ(PutPaced(c, cluster->master_address(), src, 80, 8, 400, &why), 0) << why;
  }
  ClusterStatus s = Settle(cluster->master_address(), 10);
  ASSERT_GT(s.ssd_replicas, 0u);
  ASSERT_EQ(s.evictions_total, 0u);
  ASSERT_EQ(s.objects, 80u);
  cluster->nodes()[0].reset();  // a node stops: its DRAM and SSD replicas are gone
  std::string why;
  for (size_t first = 0; first < 80; first += 16) {
    EXPECT_EQ(GetAndCheck(c, dst, first, 16, &why), 0) << why;
  }
  // Two replicas again on the two survivors (tasks from DRAM and from SSD sources).
  // (NodeStatus.replicas counts copies in flight too: wait for nothing left to repair.)
  uint64_t replicas = 0, under = 1;
  for (int i = 0; i < 100 && (replicas != 160 || under != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ClusterStatus now = Must(QueryClusterStatus(cluster->master_address()));
    replicas = 0;
    for (const NodeStatus& n : now.nodes) {
      if (n.state == "ACTIVE") replicas += n.replicas;
    }
    under = now.under_replicated;
  }
  ASSERT_EQ(replicas, 160u);
  ASSERT_EQ(under, 0u);
  cluster->nodes()[1].reset();  // and the copies made are good: read with one node left
  for (size_t first = 0; first < 80; first += 16) {
    EXPECT_EQ(GetAndCheck(c, dst, first, 16, &why), 0) << why;
  }
}

TEST_P(StoreTiers, SsdReplicaOfAStoppedNodeIsRestoredFromTheOther) {
  // 3 nodes x 6 MiB DRAM, 80 objects x 2 replicas = 20 MiB: part of them must go to SSD.
  StopANodeOfATieredCluster(Options(3, 6u << 20, 32u << 20, 2));
}

TEST_P(StoreTiers, SameWithDescriptorsExchangedDirectlyBetweenNodesAndClient) {
  EmbeddedClusterOptions o = Options(3, 6u << 20, 32u << 20, 2);
  o.peer_discovery = "direct";
  StopANodeOfATieredCluster(o);
}

TEST_P(StoreTiers, UnknownPeerDiscoveryModeIsANamedError) {
  EmbeddedClusterOptions o = Options(1, 4u << 20, 8u << 20, 1);
  o.peer_discovery = "gossip";
  auto r = EmbeddedCluster::Start(o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().Is(StatusCode::kInvalidArgument)) << r.status().ToString();
  EXPECT_NE(r.status().message().find("gossip"), std::string::npos);
}

// One node (4 MiB DRAM) filled with 48 objects at a pace demotion keeps up with.
ClusterStatus FillOneTieredNode(EmbeddedCluster& cluster, StoreClient& c, Buffer& src) {
  {
    std::string why;
    EXPECT_EQ(PutPaced(c, cluster.master_address(), src, 48, 4, 300, &why), 0) << why;
  }
  return Settle(cluster.master_address(), 10);
}

// Stops node 0 of the cluster and starts it again on the same SSD directory.
void RestartNode0(EmbeddedCluster& cluster, const TierCase& tier, const fs::path& dir,
                  const std::map<std::string, std::string>& plugin_config = {}) {
  const std::string node_id = "embedded-node0";  // EmbeddedCluster's name for node 0
  cluster.nodes()[0].reset();
  NodeOptions no;
  no.master_address = cluster.master_address();
  no.dram_bytes = 4u << 20;
  no.engine.node_id = node_id;
  no.engine.transports = {"tcp"};
  no.engine.plugin_path = tier.plugin_dir;
  no.ssd_path = (dir / "node0").string();
  no.ssd_bytes = 32u << 20;
  no.ssd_plugin = tier.plugin;
  no.engine.plugin_config = plugin_config;
  cluster.nodes()[0] = Must(StorageNode::Start(no));
  ASSERT_TRUE(cluster.nodes()[0]->ssd_status().ok()) << cluster.nodes()[0]->ssd_status().ToString();
}

// Writes garbage over the first 256 KiB of records of the node's first bucket file (the node
// must be down).
void CorruptFirstBucket(const fs::path& node_dir) {
  std::vector<fs::path> buckets;
  for (const auto& e : fs::directory_iterator(node_dir)) {
    if (e.path().filename().string().rfind("bucket-", 0) == 0) buckets.push_back(e.path());
  }
  ASSERT_FALSE(buckets.empty());
  std::sort(buckets.begin(), buckets.end());
  FILE* f = std::fopen(buckets[0].c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::vector<char> junk(256 * 1024, '\x5a');
  ASSERT_EQ(std::fwrite(junk.data(), 1, junk.size(), f), junk.size());
  std::fclose(f);
}

// Reads objects [0, 48) one by one: returns how many came back; each must have its bytes. A
// missing one must be NOT_FOUND, or IO when io_errors is given (counted there).
int ReadBackOneByOne(StoreClient& c, Buffer& dst, int* io_errors = nullptr) {
  int readable = 0;
  for (size_t i = 0; i < 48; ++i) {
    std::vector<std::string> key = {Key(i)};
    std::vector<std::vector<BufferRef>> buf = {{BufferRef{dst.data(), kObject}}};
    auto r = c.BatchGetInto(key, buf);
    if (r[0].ok()) {
      ++readable;
      EXPECT_TRUE(dst.Matches(i, 0, kObject, (i % 16) * kObject)) << Key(i);
    } else if (io_errors != nullptr && r[0].status().Is(StatusCode::kIoError)) {
      ++*io_errors;
    } else {
      EXPECT_TRUE(r[0].status().IsNotFound()) << r[0].status().ToString();
    }
  }
  return readable;
}

TEST_P(StoreTiers, RestartedNodeInTheSameProcessGetsItsSsdObjectsBack) {
  if (GetParam().plugin == "mock") GTEST_SKIP() << "the mock keeps objects in memory only";
  auto cluster = Must(EmbeddedCluster::Start(Options(1, 4u << 20, 32u << 20, 1)));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  ClusterStatus before = FillOneTieredNode(*cluster, c, src);
  ASSERT_EQ(before.evictions_total, 0u);
  ASSERT_GT(before.ssd_replicas, 10u);
  // The node stops (its DRAM replicas die with it) and starts again on the same SSD directory.
  RestartNode0(*cluster, GetParam(), dir_);
  ClusterStatus after = Must(QueryClusterStatus(cluster->master_address()));
  EXPECT_EQ(after.ssd_replicas, before.ssd_replicas);
  EXPECT_EQ(after.objects, before.ssd_replicas);  // the DRAM-only ones are gone
  EXPECT_EQ(static_cast<uint64_t>(ReadBackOneByOne(c, dst)), before.ssd_replicas);
}

// A slow disk never costs a node its heartbeat. Node 0 restarts on its SSD directory with
// every fdatasync of its tier delayed past the TTL (ssd.test_sync_delay_ms, 1.5 s against a
// 1 s TTL), then every object is removed: the frees reach the node in heartbeat replies, and
// each SSD one is a journal write and a sync. They are applied off the heartbeat thread, side
// by side so that one sync covers many, and the heartbeat never waits for them nor for the
// lock a write to the tier holds. (Before, the heartbeat thread removed them one by one, a
// delayed sync each, and the master declared the live node dead.) Every free is still applied.
TEST_P(StoreTiers, SlowSsdSyncsNeverCostTheNodeItsHeartbeat) {
  if (GetParam().plugin == "mock") GTEST_SKIP() << "the mock has no disk to be slow";
  EmbeddedClusterOptions o = Options(1, 4u << 20, 32u << 20, 1);
  o.master.node_ttl_ms = 1000;
  auto cluster = Must(EmbeddedCluster::Start(o));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  ClusterStatus before = FillOneTieredNode(*cluster, c, src);
  ASSERT_GT(before.ssd_replicas, 10u);
  RestartNode0(*cluster, GetParam(), dir_, {{"ssd.test_sync_delay_ms", "1500"}});
  const uint64_t on_ssd = Must(QueryClusterStatus(cluster->master_address())).ssd_replicas;
  ASSERT_EQ(on_ssd, before.ssd_replicas);
  std::vector<std::string> all;
  for (size_t i = 0; i < 48; ++i) all.push_back(Key(i));
  c.BatchRemove(all);  // the DRAM-only ones are gone already: NOT_FOUND for those
  const auto t0 = std::chrono::steady_clock::now();
  size_t left = cluster->nodes()[0]->object_count();
  while (left > 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    left = cluster->nodes()[0]->object_count();
    ASSERT_EQ(Must(QueryClusterStatus(cluster->master_address())).nodes_expired_total, 0u)
        << "the node was declared dead while its disk was slow";
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%llu SSD frees, 1.5 s syncs: records dropped in %.1f s, node ACTIVE\n",
              static_cast<unsigned long long>(on_ssd), secs);
  EXPECT_EQ(left, 0u) << "frees not applied";
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  ClusterStatus after = Must(QueryClusterStatus(cluster->master_address()));
  EXPECT_EQ(after.nodes_expired_total, 0u);
  EXPECT_EQ(after.objects, 0u);
  ASSERT_EQ(after.nodes.size(), 1u);
  EXPECT_EQ(after.nodes[0].state, "ACTIVE");
  // The removes reached the disk: a restart on the directory finds nothing to bring back.
  RestartNode0(*cluster, GetParam(), dir_);
  EXPECT_EQ(cluster->nodes()[0]->object_count(), 0u) << "removed objects are still on the SSD";
  EXPECT_EQ(Must(QueryClusterStatus(cluster->master_address())).objects, 0u);
}

TEST_P(StoreTiers, SsdObjectsLargerThanTheStagingAreaAreStillServed) {
  EmbeddedClusterOptions o = Options(1, 4u << 20, 32u << 20, 1);
  o.ssd_staging_bytes = 64 * 1024;  // smaller than one object: every SSD read needs its own
  auto cluster = Must(EmbeddedCluster::Start(o));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  ClusterStatus before = FillOneTieredNode(*cluster, c, src);
  ASSERT_GT(before.ssd_replicas, 8u);
  std::string why;
  for (size_t first = 0; first < 48; first += 16) {
    EXPECT_EQ(GetAndCheck(c, dst, first, 16, &why), 0) << why;
  }
  EXPECT_EQ(Must(QueryClusterStatus(cluster->master_address())).bad_replicas_total, 0u);
}

// A get of SSD-resident keys sends each node one ReadSsd with all the keys it reads there, and
// the node writes them with one transfer batch (docs/store.md "Tiers"). Before, each key was a
// call of its own, with its own deadline.
TEST_P(StoreTiers, SsdKeysOfOneNodeAreReadWithOneRequest) {
  auto cluster = Must(EmbeddedCluster::Start(Options(1, 4u << 20, 32u << 20, 1)));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  FillOneTieredNode(*cluster, c, src);
  std::vector<std::string> all;
  for (size_t i = 0; i < 48; ++i) all.push_back(Key(i));
  auto info = c.BatchGetReplicaInfo(all);
  std::vector<size_t> on_ssd;
  for (size_t i = 0; i < all.size() && on_ssd.size() < 16; ++i) {
    if (info[i].ok() && info[i]->size() == 1 && (*info[i])[0].on_ssd) on_ssd.push_back(i);
  }
  ASSERT_GE(on_ssd.size(), 8u);
  std::vector<std::string> keys;
  std::vector<std::vector<BufferRef>> bufs;
  for (size_t k = 0; k < on_ssd.size(); ++k) {
    keys.push_back(Key(on_ssd[k]));
    bufs.push_back({BufferRef{dst.data() + k * kObject, kObject}});
  }
  const StorageNodeStats before = cluster->nodes()[0]->stats();
  const auto got = c.BatchGetInto(keys, bufs);
  const StorageNodeStats after = cluster->nodes()[0]->stats();
  for (size_t k = 0; k < keys.size(); ++k) {
    ASSERT_TRUE(got[k].ok()) << keys[k] << ": " << got[k].status().ToString();
    EXPECT_TRUE(dst.Matches(on_ssd[k], k * kObject, kObject, on_ssd[k] % 16 * kObject)) << keys[k];
  }
  EXPECT_EQ(after.ssd_read_requests - before.ssd_read_requests, 1u)
      << keys.size() << " SSD keys on one node took more than one ReadSsd";
  // (A DRAM key demoted meanwhile would be read in the same call.)
  EXPECT_GE(after.ssd_read_objects - before.ssd_read_objects, keys.size());
  EXPECT_EQ(after.ssd_read_batches - before.ssd_read_batches, 1u)
      << "the node wrote a few objects that fit its staging area with more than one batch";
}

// A get of many SSD-resident keys, each also on the SSD of a second node, while the first
// holder is frozen (SIGSTOP, real processes). Its keys are read again from the other node
// after the hedge delay, and the get returns with every byte right within its deadline
// (transfer_deadline_ms, 2 s here), not after a deadline per key (the old cost: 5 s per key,
// minutes for this batch). Once it has returned, the frozen node, resumed, writes nothing
// into the caller's buffers, and it is reported once as unreachable (nothing dropped).
TEST_P(StoreTiers, FrozenSsdHolderCostsABatchGetAtMostItsDeadline) {
  const uint16_t mport = testing::FreePort();
  const std::string master = "127.0.0.1:" + std::to_string(mport);
  setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
  setenv("KVBRIDGE_PLUGIN_PATH", GetParam().plugin_dir.c_str(), 1);
  setenv("KVBRIDGE_NODE_SSD_PLUGIN", GetParam().plugin.c_str(), 1);
  setenv("KVBRIDGE_TRANSPORTS", "tcp", 1);
  auto m = testing::ChildProcess::Start({KVBRIDGE_BIN_DIR "/kvbridge", "master", "--listen", master,
                                         "--node-ttl-ms", "10000", "--lease-ms", "500"});
  ASSERT_NE(m->ReadLine(20000).find("listening"), std::string::npos);
  std::vector<std::unique_ptr<testing::ChildProcess>> nodes;
  for (int i = 0; i < 2; ++i) {
    const fs::path d = dir_ / ("d" + std::to_string(i));
    fs::create_directories(d);
    nodes.push_back(testing::ChildProcess::Start(
        {KVBRIDGE_BIN_DIR "/kvbridge", "node", "--master", master, "--node-id",
         "frozen-ssd" + std::to_string(i), "--dram-bytes", std::to_string(6u << 20), "--ssd-path",
         d.string(), "--ssd-bytes", std::to_string(64u << 20)}));
    ASSERT_NE(nodes.back()->ReadLine(20000).find("SSD tier at"), std::string::npos);
  }
  StoreOptions so;
  so.master_address = master;
  so.replica_num = 2;
  so.transfer_deadline_ms = 2000;
  so.engine.transports = {"tcp"};
  so.engine.node_id = "frozen-ssd-client";
  so.engine.progress_timeout_ms = 500;
  auto client = Must(StoreClient::Create(so));
  constexpr size_t kSlots = 96;
  Buffer src(16 * kObject), dst(kSlots * kObject);
  ASSERT_TRUE(client->RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(client->RegisterBuffer(dst.data(), dst.size()).ok());
  {
    std::string why;
    ASSERT_EQ(PutPaced(*client, master, src, 200, 16, 300, &why), 0) << why;
  }
  Settle(master, 15);
  // The keys with both replicas on SSD, on the two nodes.
  std::vector<std::string> all;
  for (size_t i = 0; i < 200; ++i) all.push_back(Key(i));
  auto info = client->BatchGetReplicaInfo(all);
  std::vector<size_t> picked;
  for (size_t i = 0; i < all.size() && picked.size() < kSlots; ++i) {
    if (!info[i].ok() || info[i]->size() != 2) continue;
    const auto& r = *info[i];
    if (r[0].on_ssd && r[1].on_ssd && r[0].node.node_id != r[1].node.node_id) picked.push_back(i);
  }
  ASSERT_GE(picked.size(), 64u) << "too few objects on both nodes' SSD";
  std::vector<std::string> keys;
  std::vector<std::vector<BufferRef>> bufs;
  for (size_t k = 0; k < picked.size(); ++k) {
    keys.push_back(Key(picked[k]));
    bufs.push_back({BufferRef{dst.data() + k * kObject, kObject}});
  }
  const uint64_t reports_before = Must(QueryClusterStatus(master)).unreachable_reports_total;
  nodes[0]->Signal(SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  const auto got = client->BatchGetInto(keys, bufs);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("get of %zu SSD objects with their first holder frozen: %.0f ms\n", keys.size(), ms);
  int bad = 0;
  for (size_t k = 0; k < keys.size(); ++k) {
    if (!got[k].ok()) {
      ADD_FAILURE() << keys[k] << ": " << got[k].status().ToString();
      ++bad;
    } else if (!dst.Matches(picked[k], k * kObject, kObject, picked[k] % 16 * kObject)) {
      ADD_FAILURE() << keys[k] << ": wrong bytes";
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_LT(ms, 3000) << "the get was not bounded by its deadline (2 s)";
  // Poison what the get filled, then let the frozen node answer what it was asked.
  std::memset(dst.data(), 0xEE, dst.size());
  nodes[0]->Signal(SIGCONT);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  size_t touched = 0;
  for (size_t b = 0; b < dst.size(); ++b) touched += static_cast<uint8_t>(dst.data()[b]) != 0xEE;
  EXPECT_EQ(touched, 0u) << "a node wrote into the caller's buffer after the get returned";
  EXPECT_GT(Must(QueryClusterStatus(master)).unreachable_reports_total, reports_before)
      << "the frozen holder was never asked (or never reported)";
  unsetenv("KVBRIDGE_PLUGIN_PATH");
  unsetenv("KVBRIDGE_NODE_SSD_PLUGIN");
  unsetenv("KVBRIDGE_TRANSPORTS");
}

// Re-replication of many SSD objects larger than the staging area (64 KiB here, objects of
// 128 KiB): a task batch stages one such object at a time and defers the others to the next
// batch. Before, every SSD source of a batch got full-size memory of its own at once (dozens
// of objects after a node loss). Every object still gets its two replicas back.
TEST_P(StoreTiers, TaskBatchesStageLargeSsdObjectsOneAtATime) {
  EmbeddedClusterOptions o = Options(3, 8u << 20, 64u << 20, 2);
  o.ssd_staging_bytes = 64 * 1024;
  auto cluster = Must(EmbeddedCluster::Start(o));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  {
    std::string why;
    ASSERT_EQ(PutPaced(c, cluster->master_address(), src, 120, 8, 400, &why), 0) << why;
  }
  ClusterStatus s = Settle(cluster->master_address(), 10);
  ASSERT_GT(s.ssd_replicas, 40u);
  ASSERT_EQ(s.evictions_total, 0u);
  ASSERT_EQ(s.objects, 120u);
  cluster->nodes()[0].reset();  // its replicas are re-made from the survivors' DRAM and SSD
  // (NodeStatus.replicas counts copies in flight too: wait for nothing left to repair.)
  uint64_t replicas = 0, under = 1;
  for (int i = 0; i < 150 && (replicas != 240 || under != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ClusterStatus now = Must(QueryClusterStatus(cluster->master_address()));
    replicas = 0;
    for (const NodeStatus& n : now.nodes) {
      if (n.state == "ACTIVE") replicas += n.replicas;
    }
    under = now.under_replicated;
  }
  ASSERT_EQ(replicas, 240u) << "re-replication did not finish";
  ASSERT_EQ(under, 0u);
  uint64_t peak = 0;
  for (size_t n = 1; n < 3; ++n) {
    const StorageNodeStats st = cluster->nodes()[n]->stats();
    EXPECT_LE(st.temp_staging_bytes_peak, o.ssd_staging_bytes + kObject)
        << "node " << n << " held more than one large SSD object beyond its staging area";
    std::printf("node %zu: at most %llu bytes staged beyond the staging area\n", n,
                static_cast<unsigned long long>(st.temp_staging_bytes_peak));
    peak = std::max(peak, st.temp_staging_bytes_peak);
  }
  EXPECT_GT(peak, 0u) << "no SSD source larger than the staging area was copied";
  std::string why;
  for (size_t first = 0; first < 120; first += 16) {
    EXPECT_EQ(GetAndCheck(c, dst, first, std::min<size_t>(16, 120 - first), &why), 0) << why;
  }
}

TEST_P(StoreTiers, SsdObjectsReadRepeatedlyArePromotedBackToDram) {
  auto cluster = Must(EmbeddedCluster::Start(Options(1, 4u << 20, 32u << 20, 1)));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  ClusterStatus before = FillOneTieredNode(*cluster, c, src);
  ASSERT_GT(before.ssd_replicas, 8u);  // the oldest objects, tier-0 on, went to SSD
  // Make room in DRAM, then read the oldest objects twice each (the second read promotes).
  std::vector<std::string> newest;
  for (size_t i = 24; i < 48; ++i) newest.push_back(Key(i));
  for (const Status& st : c.BatchRemove(newest)) ASSERT_TRUE(st.ok()) << st.ToString();
  std::string why;
  for (int round = 0; round < 2; ++round) EXPECT_EQ(GetAndCheck(c, dst, 0, 4, &why), 0) << why;
  ClusterStatus after;
  for (int i = 0; i < 50; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = Must(QueryClusterStatus(cluster->master_address()));
    if (after.promotions_total >= 4) break;
  }
  EXPECT_EQ(after.promotions_total, 4u);
  EXPECT_LE(after.ssd_replicas, before.ssd_replicas - 4);  // (a removed one may have been there)
  EXPECT_EQ(GetAndCheck(c, dst, 0, 16, &why), 0) << why;   // promoted and not, all intact
}

TEST_P(StoreTiers, CorruptedBucketLosesOnlyItsObjectsAcrossARestart) {
  if (GetParam().plugin == "mock") GTEST_SKIP() << "the mock keeps no files";
  // The two read passes below would also promote SSD objects (read twice) back to DRAM, in the
  // background, and the SSD count at the end would depend on how many promotions finished.
  EmbeddedClusterOptions opts = Options(1, 4u << 20, 32u << 20, 1);
  opts.master.promote_after_reads = 0;
  auto cluster = Must(EmbeddedCluster::Start(opts));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  ClusterStatus before = FillOneTieredNode(*cluster, c, src);
  ASSERT_GT(before.ssd_replicas, 10u);
  cluster->nodes()[0].reset();
  CorruptFirstBucket(dir_ / "node0");
  RestartNode0(*cluster, GetParam(), dir_);
  // Damaged objects fail their first read with IO (the node checks every SSD read against the
  // object's checksum) or are already gone; no read returns wrong bytes (ReadBackOneByOne).
  int io_errors = 0;
  const int first_pass = ReadBackOneByOne(c, dst, &io_errors);
  EXPECT_GT(io_errors, 0) << "the damage went unnoticed";
  EXPECT_GT(first_pass, 0);
  // The damaged replicas were dropped (the reader reported them): a second pass is clean.
  int io_again = 0;
  const int second_pass = ReadBackOneByOne(c, dst, &io_again);
  EXPECT_EQ(io_again, 0);
  EXPECT_EQ(second_pass, first_pass);
  ClusterStatus after = Must(QueryClusterStatus(cluster->master_address()));
  EXPECT_EQ(after.objects, static_cast<uint64_t>(first_pass));
  EXPECT_EQ(after.ssd_replicas, before.ssd_replicas - io_errors);
}

// A node that finds one of its SSD copies damaged while serving it drops the copy and tells
// the master itself: no client report is needed for the master to stop listing it. The reads
// here are raw ReadSsd calls to the node, so no StoreClient ever reports anything.
TEST_P(StoreTiers, NodeReportsTheSsdCopyItDropsAfterAFailedRead) {
  if (GetParam().plugin == "mock") GTEST_SKIP() << "the mock keeps no files";
  auto cluster = Must(EmbeddedCluster::Start(Options(1, 4u << 20, 32u << 20, 1)));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ClusterStatus before = FillOneTieredNode(*cluster, c, src);
  ASSERT_GT(before.ssd_replicas, 10u);
  cluster->nodes()[0].reset();
  CorruptFirstBucket(dir_ / "node0");
  RestartNode0(*cluster, GetParam(), dir_);
  ClusterStatus restarted = Must(QueryClusterStatus(cluster->master_address()));

  auto master = rpc::Master::NewStub(
      grpc::CreateChannel(cluster->master_address(), grpc::InsecureChannelCredentials()));
  rpc::NodeDescriptorsRequest dreq;
  dreq.add_node_ids("embedded-node0");
  rpc::NodeDescriptorsReply drep;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(master->GetNodeDescriptors(&ctx, dreq, &drep).ok());
  }
  ASSERT_EQ(drep.nodes_size(), 1);
  auto node = rpc::Node::NewStub(
      grpc::CreateChannel(drep.nodes(0).rpc_address(), grpc::InsecureChannelCredentials()));
  EngineOptions eo;
  eo.node_id = "raw-reader";
  eo.transports = {"tcp"};
  auto reader = Must(TransferEngine::Create(eo));
  Buffer dst(kObject);
  const SegmentId seg = Must(reader->RegisterMemory(dst.data(), dst.size()));
  int failed = 0, served = 0;
  for (size_t i = 0; i < 48; ++i) {
    rpc::GetReplicasRequest greq;
    greq.add_keys(Key(i));
    greq.set_sizes_only(true);  // no lease, no access counting: just where it is
    rpc::GetReplicasReply grep;
    {
      grpc::ClientContext ctx;
      ASSERT_TRUE(master->GetReplicas(&ctx, greq, &grep).ok());
    }
    if (grep.items(0).status().code() != 0 || grep.items(0).replicas_size() == 0) continue;
    const rpc::ReplicaLocation& loc = grep.items(0).replicas(0);
    if (loc.tier() != 2) continue;  // a DRAM replica
    rpc::ReadSsdRequest req;
    *req.mutable_node() = loc.node();
    req.set_key(Key(i));
    req.set_version(grep.items(0).version());
    req.set_client_descriptor(reader->LocalDescriptor());
    req.mutable_client()->set_node_id(reader->self().node_id);
    req.mutable_client()->set_incarnation(reader->self().incarnation);
    rpc::Piece* piece = req.add_dests();
    piece->set_segment_id(seg);
    piece->set_offset(0);
    piece->set_length(kObject);
    req.set_timeout_ms(3000);
    rpc::ReadSsdReply reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ASSERT_TRUE(node->ReadSsd(&ctx, req, &reply).ok());
    if (reply.status().code() == 0) {
      ++served;
      EXPECT_TRUE(dst.Matches(i, 0, kObject, (i % 16) * kObject)) << Key(i);
    } else {
      ++failed;
    }
  }
  ASSERT_GT(failed, 0) << "the damage went unnoticed";
  EXPECT_GT(served, 0);
  // The node reports in the background: the master drops exactly those copies, soon.
  ClusterStatus after;
  for (int i = 0; i < 50; ++i) {
    after = Must(QueryClusterStatus(cluster->master_address()));
    if (after.bad_replicas_total >= static_cast<uint64_t>(failed)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(after.bad_replicas_total, restarted.bad_replicas_total + failed)
      << "the master still lists SSD copies the node dropped";
  EXPECT_EQ(after.ssd_replicas, restarted.ssd_replicas - failed);
}

// DemoteDone answers lost on the way (the master's fault injection): four moves the master
// never saw, then four it applied but whose answer was lost. The node asks again: the first
// are applied then, the others answered OK again (not "no longer wanted", which would make
// the node delete the only copy the master lists). Nothing is lost, and once every give-up
// deadline has passed, the node holds exactly the copies the master lists (no orphan on SSD).
TEST_P(StoreTiers, LostDemoteDoneAnswersLoseNothingAndLeaveNoOrphan) {
  EmbeddedClusterOptions o = Options(1, 4u << 20, 32u << 20, 1);
  o.master.faults = "demote_done_lose_request=4, demote_done_lose_reply=4";
  o.master.task_timeout_ms = 1500;
  auto cluster = Must(EmbeddedCluster::Start(o));
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  ClusterStatus s = FillOneTieredNode(*cluster, c, src);
  // The first 4 calls were refused and the next 4 passed the refusal, so more than 4 applied
  // moves mean every injected fault fired.
  ASSERT_GT(s.demotions_total, 4u);
  ASSERT_EQ(s.evictions_total, 0u);
  // Past every deadline (1.5 s, plus 1.5 s more for a range the master gave up) and the read
  // leases (1 s), with heartbeats delivering the frees: the node's records match the master's.
  size_t held = 0;
  uint64_t listed = 0;
  for (int i = 0; i < 60; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    s = Must(QueryClusterStatus(cluster->master_address()));
    listed = s.nodes.at(0).replicas;
    held = cluster->nodes()[0]->object_count();
    if (i >= 35 && held == listed) break;
  }
  EXPECT_EQ(held, listed) << "the node keeps copies the master does not list (or lacks some)";
  EXPECT_EQ(s.objects, 48u);
  EXPECT_EQ(ReadBackOneByOne(c, dst), 48);
  EXPECT_EQ(Must(QueryClusterStatus(cluster->master_address())).bad_replicas_total, 0u);
}

TEST_P(StoreTiers, MissingSsdDirectoryLeavesTheNodeServingDram) {
  if (GetParam().plugin == "mock") GTEST_SKIP() << "the mock keeps no files";
  EmbeddedClusterOptions o = Options(1, 8u << 20, 32u << 20, 1);
  o.ssd_dir.clear();  // the node below gets a tier whose parent directory does not exist
  auto cluster = Must(EmbeddedCluster::Start(o));
  NodeOptions no;
  no.master_address = cluster->master_address();
  no.dram_bytes = 8u << 20;
  no.engine.node_id = "no-ssd-dir";
  no.engine.transports = {"tcp"};
  no.engine.plugin_path = GetParam().plugin_dir;
  no.ssd_path = (dir_ / "no" / "such" / "dir").string();
  no.ssd_plugin = GetParam().plugin;
  auto node = Must(StorageNode::Start(no));
  Status st = node->ssd_status();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(no.ssd_path), std::string::npos) << st.ToString();
  cluster->nodes()[0].reset();  // only the DRAM-only node is left
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  for (const Status& s : Put(c, src, 0, 16)) ASSERT_TRUE(s.ok()) << s.ToString();
  std::string why;
  EXPECT_EQ(GetAndCheck(c, dst, 0, 16, &why), 0) << why;
  for (const NodeStatus& n : Must(QueryClusterStatus(cluster->master_address())).nodes) {
    EXPECT_EQ(n.ssd_capacity_bytes, 0u);
  }
}

TEST_P(StoreTiers, FullSsdFileSystemKeepsObjectsInDram) {
  if (GetParam().plugin == "mock") GTEST_SKIP() << "the mock keeps no files";
  // The tier claims 64 MiB but lives on a 1 MiB tmpfs: demotions hit ENOSPC.
  const fs::path mnt = dir_ / "tiny";
  fs::create_directories(mnt);
  if (std::system(("mount -t tmpfs -o size=1m tmpfs " + mnt.string() + " 2>/dev/null").c_str()) !=
      0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  }
  struct Unmount {
    fs::path p;
    ~Unmount() { (void)!std::system(("umount -l " + p.string()).c_str()); }
  } unmount{mnt};
  EmbeddedClusterOptions o = Options(1, 8u << 20, 64u << 20, 1);
  o.ssd_dir = mnt.string();
  auto cluster = Must(EmbeddedCluster::Start(o));
  ASSERT_TRUE(cluster->nodes()[0]->ssd_status().ok());
  StoreClient& c = cluster->client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  {
    std::string why;
    ASSERT_EQ(PutPaced(c, "", src, 56, 4, 200, &why), 0) << why;
  }
  ClusterStatus s = Settle(cluster->master_address(), 6);
  // Some went to SSD before it filled; the rest stayed in DRAM; nothing was lost to the
  // failing demotions (objects only leave through counted evictions).
  EXPECT_GT(s.ssd_replicas, 0u);
  EXPECT_LE(s.nodes[0].ssd_used_bytes, 1u << 20);
  EXPECT_EQ(s.objects + s.evictions_total, 56u);
  std::string why;
  int missing = 0;
  for (size_t first = 0; first < 56; first += 8) {
    missing += GetAndCheck(c, dst, first, 8, &why);
  }
  EXPECT_EQ(static_cast<uint64_t>(missing), s.evictions_total) << why;
  EXPECT_EQ(Must(QueryClusterStatus(cluster->master_address())).nodes[0].state, "ACTIVE");
}

// The same with daemons: a standalone master process, nodes that publish two endpoints each
// (two "NICs") under node ids unrelated to their addresses, killed with -9 and restarted.
TEST_P(StoreTiers, DaemonsWithSeveralEndpointsDemoteServeAndSurviveKill9) {
  const uint16_t mport = testing::FreePort();
  const std::string master = "127.0.0.1:" + std::to_string(mport);
  setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
  setenv("KVBRIDGE_PLUGIN_PATH", GetParam().plugin_dir.c_str(), 1);
  setenv("KVBRIDGE_NODE_SSD_PLUGIN", GetParam().plugin.c_str(), 1);
  setenv("KVBRIDGE_TRANSPORTS", "tcp", 1);
  auto m = testing::ChildProcess::Start({KVBRIDGE_BIN_DIR "/kvbridge", "master", "--listen", master,
                                         "--node-ttl-ms", "1000", "--lease-ms", "500"});
  ASSERT_NE(m->ReadLine(20000).find("listening"), std::string::npos);
  auto start_node = [&](int i) {
    const std::string a = "127.0.0." + std::to_string(2 + 2 * i) + ":0";
    const std::string b = "127.0.0." + std::to_string(3 + 2 * i) + ":0";
    auto n = testing::ChildProcess::Start(
        {KVBRIDGE_BIN_DIR "/kvbridge", "node", "--master", master, "--node-id",
         "rack1-host" + std::to_string(i), "--dram-bytes", std::to_string(6u << 20), "--listen",
         a + "," + b, "--ssd-path", (dir_ / ("d" + std::to_string(i))).string(), "--ssd-bytes",
         std::to_string(64u << 20)});
    EXPECT_NE(n->ReadLine(20000).find("SSD tier at"), std::string::npos);
    return n;
  };
  fs::create_directories(dir_ / "d0");
  fs::create_directories(dir_ / "d1");
  std::vector<std::unique_ptr<testing::ChildProcess>> nodes;
  nodes.push_back(start_node(0));
  nodes.push_back(start_node(1));
  StoreOptions so;
  so.master_address = master;
  so.engine.transports = {"tcp"};
  so.engine.node_id = "tier-client";
  auto client = Must(StoreClient::Create(so));
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(client->RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(client->RegisterBuffer(dst.data(), dst.size()).ok());
  {
    std::string why;
    ASSERT_EQ(PutPaced(*client, master, src, 96, 8, 300, &why), 0) << why;
  }
  ClusterStatus before = Settle(master, 10);
  ASSERT_EQ(before.evictions_total, 0u);
  ASSERT_EQ(before.objects, 96u);
  ASSERT_GT(before.ssd_replicas, 20u);
  std::string why;
  for (size_t first = 0; first < 96; first += 16) {
    EXPECT_EQ(GetAndCheck(*client, dst, first, 16, &why), 0) << why;
  }
  if (GetParam().plugin == "mock") return;  // not persistent: the restart part needs ssd
  // kill -9 node 0; the master expires it; its SSD objects come back with the new process.
  uint64_t node0_ssd = 0, node0_replicas = 0;
  for (const NodeStatus& n : before.nodes) {
    if (n.id.node_id == "rack1-host0") {
      node0_replicas = n.replicas;
      node0_ssd = n.ssd_used_bytes / kObject;
    }
  }
  nodes[0]->Kill();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // past the TTL
  EXPECT_EQ(Must(QueryClusterStatus(master)).objects, 96u - node0_replicas);
  nodes[0] = start_node(0);
  ClusterStatus after = Must(QueryClusterStatus(master));
  EXPECT_EQ(after.objects, 96u - node0_replicas + node0_ssd);
  int readable = 0;
  for (size_t first = 0; first < 96; first += 16) {
    std::vector<std::string> keys;
    std::vector<std::vector<BufferRef>> bufs;
    for (size_t i = first; i < first + 16; ++i) {
      keys.push_back(Key(i));
      bufs.push_back({BufferRef{dst.data() + (i - first) * kObject, kObject}});
    }
    auto r = client->BatchGetInto(keys, bufs);
    for (size_t k = 0; k < 16; ++k) {
      if (!r[k].ok()) continue;
      ++readable;
      EXPECT_TRUE(dst.Matches(first + k, k * kObject, kObject, ((first + k) % 16) * kObject));
    }
  }
  EXPECT_EQ(static_cast<uint64_t>(readable), after.objects);
  unsetenv("KVBRIDGE_PLUGIN_PATH");
  unsetenv("KVBRIDGE_NODE_SSD_PLUGIN");
  unsetenv("KVBRIDGE_TRANSPORTS");
}

// A master restart while a node's moves are unanswered. The master daemon loses every
// DemoteDone request, so the node's demotions pile up unanswered, each keeping its SSD copy.
// Then the master is killed (-9) and started again on its port without faults: the node
// registers again with its inventory (DRAM and SSD records) and asks about every move again.
// Nothing is lost: every object reads back with its bytes, and the new master lists SSD
// replicas. (Whether a report reaches the new master before the registration is a race this
// test does not force; the answer then, UNAVAILABLE rather than "not wanted", is pinned by
// MasterTier.DemoteDoneFromANodeTheMasterDoesNotKnowIsAnsweredUnavailable.)
TEST_P(StoreTiers, MasterRestartWithMovesUnansweredLosesNothing) {
  const uint16_t mport = testing::FreePort();
  const std::string master = "127.0.0.1:" + std::to_string(mport);
  setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
  setenv("KVBRIDGE_PLUGIN_PATH", GetParam().plugin_dir.c_str(), 1);
  setenv("KVBRIDGE_NODE_SSD_PLUGIN", GetParam().plugin.c_str(), 1);
  setenv("KVBRIDGE_TRANSPORTS", "tcp", 1);
  auto start_master = [&](const char* faults) {
    if (faults != nullptr) {
      setenv("KVBRIDGE_MASTER_FAULTS", faults, 1);
    } else {
      unsetenv("KVBRIDGE_MASTER_FAULTS");
    }
    auto m = testing::ChildProcess::Start({KVBRIDGE_BIN_DIR "/kvbridge", "master", "--listen",
                                           master, "--node-ttl-ms", "3000", "--lease-ms", "500"});
    EXPECT_NE(m->ReadLine(20000).find("listening"), std::string::npos);
    return m;
  };
  auto m = start_master("demote_done_lose_request=1000000");
  fs::create_directories(dir_ / "d0");
  auto node = testing::ChildProcess::Start(
      {KVBRIDGE_BIN_DIR "/kvbridge", "node", "--master", master, "--node-id", "tiered0",
       "--dram-bytes", std::to_string(4u << 20), "--ssd-path", (dir_ / "d0").string(),
       "--ssd-bytes", std::to_string(32u << 20)});
  ASSERT_NE(node->ReadLine(20000).find("SSD tier at"), std::string::npos);
  StoreOptions so;
  so.master_address = master;
  so.engine.transports = {"tcp"};
  so.engine.node_id = "restart-client";
  auto client = Must(StoreClient::Create(so));
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(client->RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(client->RegisterBuffer(dst.data(), dst.size()).ok());
  // 26 x 128 KiB = 3.25 MiB of 4: above the demote watermark (0.75), below where puts evict.
  constexpr size_t kObjects = 26;
  {
    std::string why;
    ASSERT_EQ(PutPaced(*client, "", src, kObjects, 2, 100, &why), 0) << why;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // moves made, none answered
  ClusterStatus lost = Must(QueryClusterStatus(master));
  ASSERT_EQ(lost.demotions_total, 0u) << "a DemoteDone got through the fault injection";
  ASSERT_EQ(lost.objects, kObjects);
  m->Kill();
  m = start_master(nullptr);
  // The node registers again within a heartbeat (200 ms on a tiered node), and the new
  // master lists SSD replicas: adopted from its inventory, or moved anew.
  ClusterStatus after;
  for (int i = 0; i < 100 && after.ssd_replicas == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto st = QueryClusterStatus(master);  // the first call may meet the old connection
    if (st.ok()) after = *st;
  }
  EXPECT_GT(after.ssd_replicas, 0u) << "nothing on SSD after the restart";
  after = Settle(master, 10);
  EXPECT_EQ(after.objects, kObjects);
  EXPECT_EQ(after.evictions_total, 0u);
  std::string why;
  EXPECT_EQ(GetAndCheck(*client, dst, 0, 16, &why), 0) << why;
  EXPECT_EQ(GetAndCheck(*client, dst, 16, kObjects - 16, &why), 0) << why;
  EXPECT_EQ(Must(QueryClusterStatus(master)).bad_replicas_total, 0u);
  unsetenv("KVBRIDGE_PLUGIN_PATH");
  unsetenv("KVBRIDGE_NODE_SSD_PLUGIN");
  unsetenv("KVBRIDGE_TRANSPORTS");
}

INSTANTIATE_TEST_SUITE_P(Plugins, StoreTiers,
                         ::testing::Values(TierCase{"mock", KVBRIDGE_TEST_PLUGIN_BUILD_DIR},
                                           TierCase{"ssd", KVBRIDGE_PLUGIN_BUILD_DIR_FOR_TESTS}),
                         CaseName);

}  // namespace
}  // namespace kvbridge
