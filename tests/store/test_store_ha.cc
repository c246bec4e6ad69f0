// The HA control plane with real processes on loopback: a 3-member etcd cluster (Debian's
// etcd-server, started by the test on free ports), three `kvbridge master --etcd` daemons of
// which one is elected leader, three storage nodes and an in-process client that finds the
// leader through "etcd://". The leader is killed, frozen, etcd members are killed, the whole
// control plane is restarted; under a put/get load with byte checks, no acknowledged object
// may be lost and a replaced leader must never act again.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "kvbridge.grpc.pb.h"
#include "kvbridge/store.h"
#include "store/etcd_client.h"
#include "store/local_nodes.h"
#include "store/master_client.h"
#include "store/master_ha.h"
#include "store/rpc_util.h"
#include "tests/common/http_get.h"
#include "tests/common/test_util.h"
#include "tests/store/store_procs.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::ChildProcess;
using testing::Must;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kObj = 64 * 1024;  // one object: one 64 KiB buffer
constexpr uint32_t kHaLeaseMs = 2000;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string EtcdBinary() {
  for (const char* p : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// n etcd members on loopback, each with its own data directory (kept across restarts).
class EtcdCluster {
 public:
  explicit EtcdCluster(int n) {
    std::string tmpl = "/tmp/kvb-etcd-XXXXXX";
    if (mkdtemp(tmpl.data()) != nullptr) dir_ = tmpl;
    for (int i = 0; i < n; ++i) {
      client_ports_.push_back(testing::FreePort());
      peer_ports_.push_back(testing::FreePort());
    }
    for (int i = 0; i < n; ++i) {
      initial_ += (i ? "," : "") + Name(i) + "=http://127.0.0.1:" + std::to_string(peer_ports_[i]);
    }
    members_.resize(n);
  }
  ~EtcdCluster() {
    members_.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  void StartAll() {
    for (size_t i = 0; i < members_.size(); ++i) Start(i);
  }
  void Start(size_t i) {
    const std::string client = "http://127.0.0.1:" + std::to_string(client_ports_[i]);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_ports_[i]);
    members_[i] = ChildProcess::Start({EtcdBinary(),
                                       "--name",
                                       Name(i),
                                       "--data-dir",
                                       dir_ + "/" + Name(i),
                                       "--listen-client-urls",
                                       client,
                                       "--advertise-client-urls",
                                       client,
                                       "--listen-peer-urls",
                                       peer,
                                       "--initial-advertise-peer-urls",
                                       peer,
                                       "--initial-cluster",
                                       initial_,
                                       "--initial-cluster-state",
                                       "new",
                                       "--initial-cluster-token",
                                       "kvb-test",
                                       "--logger=zap",
                                       "--log-level=error",
                                       "--heartbeat-interval",
                                       "50",
                                       "--election-timeout",
                                       "500"});
  }
  void Kill(size_t i) { members_[i].reset(); }  // ChildProcess: kill -9 and reap

  // Waits until a write goes through (a quorum has a leader).
  bool WaitReady(int timeout_ms = 20000) {
    store::EtcdClient c(Endpoints(), 500);
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < until) {
      auto put = c.Put("kvb-test/ready", "1");
      if (put.ok()) return true;
      last_error_ = put.status().ToString();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
  const std::string& last_error() const { return last_error_; }
  std::vector<std::string> Endpoints() const {
    std::vector<std::string> out;
    for (uint16_t p : client_ports_) out.push_back("127.0.0.1:" + std::to_string(p));
    return out;
  }
  std::string Joined() const {
    std::string s;
    for (const auto& e : Endpoints()) s += (s.empty() ? "" : ",") + e;
    return s;
  }

 private:
  static std::string Name(size_t i) { return "e" + std::to_string(i); }
  std::string dir_, initial_, last_error_;
  std::vector<uint16_t> client_ports_, peer_ports_;
  std::vector<std::unique_ptr<ChildProcess>> members_;
};

class StoreHa : public ::testing::Test {
 protected:
  void SetUp() override {
    if (EtcdBinary().empty()) GTEST_SKIP() << "etcd is not installed (Debian etcd-server)";
    setenv("KVBRIDGE_PROGRESS_TIMEOUT_MS", "500", 1);
    setenv("KVBRIDGE_DEADLINE_MS", "3000", 1);
    setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
    // A put or task issued by a leader just before it died may still be writing: a new leader
    // keeps new data off the nodes for max(put, 2 x task, lease) + TTL + 1 s (docs/store.md
    // "Late writes"); short budgets keep that within the test's time.
    setenv("KVBRIDGE_PUT_TIMEOUT_MS", "2000", 1);
    setenv("KVBRIDGE_TASK_TIMEOUT_MS", "1000", 1);
    etcd_.StartAll();
    ASSERT_TRUE(etcd_.WaitReady()) << "etcd did not come up: " << etcd_.last_error();
    etcd_address_ = "etcd://" + etcd_.Joined() + "/" + prefix_;
    for (int i = 0; i < 3; ++i) {
      master_ports_.push_back(testing::FreePort());
      http_ports_.push_back(testing::FreePort());
      masters_.push_back(nullptr);
      StartMaster(i);
    }
    ASSERT_FALSE(WaitForLeader("", 15000).empty());
    for (int i = 0; i < 3; ++i) {
      nodes_.push_back(testing::StartNode(
          etcd_address_, "node" + std::to_string(i),
          {"--dram-bytes", std::to_string(128u << 20), "--listen", "127.0.0.1:0"}));
      ASSERT_TRUE(nodes_.back());
    }
    ASSERT_TRUE(testing::WaitForActiveNodes(etcd_address_, 3));
    StoreOptions so;
    so.master_address = etcd_address_;
    so.replica_num = 2;
    // Reads are retried while no leader answers: this covers an election and a takeover.
    so.rpc_timeout_ms = 10000;
    so.transfer_deadline_ms = 3000;
    so.engine.node_id = "client";
    so.engine.transports = {"tcp"};
    so.engine.progress_timeout_ms = 500;
    so.engine.default_deadline_ms = 3000;
    client_ = Must(StoreClient::Create(so));
  }

  void TearDown() override {
    unsetenv("KVBRIDGE_PUT_TIMEOUT_MS");
    unsetenv("KVBRIDGE_TASK_TIMEOUT_MS");
  }

  void StartMaster(int i) {
    const std::string listen = "127.0.0.1:" + std::to_string(master_ports_[i]);
    masters_[i] = ChildProcess::Start(
        {testing::KvbridgeBin(), "master", "--listen", listen, "--etcd",
         etcd_.Joined() + "/" + prefix_, "--ha-lease-ms", std::to_string(kHaLeaseMs),
         "--ha-takeover-wait-ms", "5000", "--node-ttl-ms", "1000", "--lease-ms", "200",
         "--metrics-listen", "127.0.0.1:" + std::to_string(http_ports_[i])});
    const std::string line = masters_[i]->ReadLine(10000);
    ASSERT_NE(line.find("campaigning"), std::string::npos) << "master said: " << line;
  }

  // The leader etcd names, once it is not `not_this` ("" after timeout_ms).
  std::string WaitForLeader(const std::string& not_this, int timeout_ms) {
    store::EtcdClient c(etcd_.Endpoints(), 500);
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < until) {
      auto kv = c.Get(prefix_ + "/leader");
      if (kv.ok() && kv->has_value() && (*kv)->value != not_this) return (*kv)->value;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return "";
  }
  int MasterIndex(const std::string& address) {
    for (int i = 0; i < 3; ++i) {
      if (address == "127.0.0.1:" + std::to_string(master_ports_[i])) return i;
    }
    return -1;
  }

  // Objects with bytes derived from their id, put and read back through client_.
  struct Load {
    std::atomic<bool> stop{false};
    std::mutex mu;
    std::vector<uint64_t> acked;                // ids whose put was acknowledged
    std::vector<std::pair<double, bool>> puts;  // (seconds since start, ok) per batch
    std::atomic<int> puts_ok{0}, puts_failed{0}, gets_ok{0}, gets_failed{0};
    std::string first_get_error, first_put_error;
    Clock::time_point start = Clock::now();
  };

  static std::string Key(uint64_t id) { return "ha-" + std::to_string(id); }

  // Puts `ids` from `src` (one object per slot); returns the acknowledged ones.
  std::vector<uint64_t> PutIds(const std::vector<uint64_t>& ids, Buffer& src, Load* load) {
    std::vector<std::string> keys;
    std::vector<std::vector<BufferRef>> bufs;
    for (size_t k = 0; k < ids.size(); ++k) {
      for (size_t b = 0; b < kObj; ++b) src.data()[k * kObj + b] = testing::PatternByte(ids[k], b);
      keys.push_back(Key(ids[k]));
      bufs.push_back({BufferRef{src.data() + k * kObj, kObj}});
    }
    std::vector<uint64_t> ok;
    auto res = client_->BatchPutFrom(keys, bufs);
    for (size_t k = 0; k < res.size(); ++k) {
      if (res[k].ok()) {
        ok.push_back(ids[k]);
      } else if (load) {
        std::lock_guard<std::mutex> lock(load->mu);
        if (load->first_put_error.empty()) load->first_put_error = res[k].ToString();
      }
    }
    return ok;
  }

  // Gets `ids` into `dst` and checks every byte; returns the failures (first error in *why).
  int GetIds(const std::vector<uint64_t>& ids, Buffer& dst, std::string* why) {
    std::vector<std::string> keys;
    std::vector<std::vector<BufferRef>> bufs;
    for (size_t k = 0; k < ids.size(); ++k) {
      keys.push_back(Key(ids[k]));
      bufs.push_back({BufferRef{dst.data() + k * kObj, kObj}});
    }
    int failed = 0;
    auto res = client_->BatchGetInto(keys, bufs);
    for (size_t k = 0; k < res.size(); ++k) {
      bool ok = res[k].ok() && res[k].value() == kObj;
      for (size_t b = 0; ok && b < kObj; ++b) {
        ok = dst.data()[k * kObj + b] == testing::PatternByte(ids[k], b);
      }
      if (!ok) {
        ++failed;
        if (why && why->empty()) {
          *why = keys[k] + ": " + (res[k].ok() ? "wrong bytes" : res[k].status().ToString());
        }
      }
    }
    return failed;
  }

  // One thread: every ~50 ms a batch of 8 new objects, then 8 random acknowledged ones read
  // back and checked.
  void RunLoad(Load* load) {
    constexpr size_t kBatch = 8;
    Buffer src(kBatch * kObj), dst(kBatch * kObj);
    if (!client_->RegisterBuffer(src.data(), src.size()).ok() ||
        !client_->RegisterBuffer(dst.data(), dst.size()).ok()) {
      ++load->puts_failed;
      return;
    }
    std::mt19937_64 rng(7);
    for (uint64_t n = 0; !load->stop.load(); ++n) {
      std::vector<uint64_t> ids;
      for (size_t k = 0; k < kBatch; ++k) ids.push_back(1000000 + n * kBatch + k);
      auto ok = PutIds(ids, src, load);
      load->puts_ok += static_cast<int>(ok.size());
      load->puts_failed += static_cast<int>(ids.size() - ok.size());
      std::vector<uint64_t> reads;
      {
        std::lock_guard<std::mutex> lock(load->mu);
        load->puts.push_back({SecondsSince(load->start), ok.size() == ids.size()});
        load->acked.insert(load->acked.end(), ok.begin(), ok.end());
        for (size_t k = 0; k < kBatch && !load->acked.empty(); ++k) {
          reads.push_back(load->acked[rng() % load->acked.size()]);
        }
      }
      if (!reads.empty()) {
        std::string why;
        const int failed = GetIds(reads, dst, &why);
        load->gets_failed += failed;
        load->gets_ok += static_cast<int>(reads.size()) - failed;
        if (failed) {
          std::lock_guard<std::mutex> lock(load->mu);
          if (load->first_get_error.empty()) load->first_get_error = why;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    (void)client_->UnregisterBuffer(src.data());
    (void)client_->UnregisterBuffer(dst.data());
  }

  // Every acknowledged object, read back now; returns how many are missing or wrong.
  int VerifyAll(const std::vector<uint64_t>& acked, std::string* why) {
    constexpr size_t kBatch = 64;
    Buffer dst(kBatch * kObj);
    EXPECT_TRUE(client_->RegisterBuffer(dst.data(), dst.size()).ok());
    int failed = 0;
    for (size_t at = 0; at < acked.size(); at += kBatch) {
      std::vector<uint64_t> ids(acked.begin() + at,
                                acked.begin() + std::min(acked.size(), at + kBatch));
      failed += GetIds(ids, dst, why);
    }
    (void)client_->UnregisterBuffer(dst.data());
    return failed;
  }

  // How every failure test ends: no get failed, every acknowledged object (seeded, and put
  // under the load) reads back with its bytes, and all three nodes serve.
  void ExpectNothingLost(const std::vector<uint64_t>& seeded, Load& load) {
    EXPECT_EQ(load.gets_failed.load(), 0) << load.first_get_error;
    std::vector<uint64_t> all = seeded;
    all.insert(all.end(), load.acked.begin(), load.acked.end());
    std::string why;
    EXPECT_EQ(VerifyAll(all, &why), 0) << "lost or wrong acknowledged objects, first: " << why;
    EXPECT_EQ(testing::ActiveNodes(etcd_address_), 3);
  }

  // Seconds from `t` until the first fully acknowledged put batch after it (-1: none).
  static double PutsResumeAfter(Load& load, double t) {
    std::lock_guard<std::mutex> lock(load.mu);
    for (const auto& [at, ok] : load.puts) {
      if (at > t && ok) return at - t;
    }
    return -1;
  }

  std::vector<uint64_t> Seed(size_t n) {
    Buffer src(n * kObj);
    EXPECT_TRUE(client_->RegisterBuffer(src.data(), src.size()).ok());
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < n; ++i) ids.push_back(i);
    auto ok = PutIds(ids, src, nullptr);
    (void)client_->UnregisterBuffer(src.data());
    EXPECT_EQ(ok.size(), n);
    return ok;
  }

  const std::string prefix_ = "kvbha";
  EtcdCluster etcd_{3};
  std::string etcd_address_;
  std::vector<uint16_t> master_ports_, http_ports_;
  std::vector<std::unique_ptr<ChildProcess>> masters_;
  std::vector<std::unique_ptr<ChildProcess>> nodes_;
  std::unique_ptr<StoreClient> client_;
};

// kill -9 of the leader under load: a standby takes over; every acknowledged object is still
// there with its bytes, and puts resume once the new leader's late-write hold is over. A
// second thread reads seeded objects (which the client remembers from putting them) all along:
// those gets go on while no leader exists, read from the nodes without the master (docs/store.md
// "Reads while the master is away").
TEST_F(StoreHa, KilledLeaderIsReplacedWithoutLosingAnAcknowledgedObject) {
  std::vector<uint64_t> seeded = Seed(64);
  const std::string old_leader = WaitForLeader("", 1000);
  const int old = MasterIndex(old_leader);
  ASSERT_GE(old, 0) << old_leader;
  Load load;
  std::thread driver([&] { RunLoad(&load); });
  // (seconds since load.start at its end, failed keys) per get of 8 seeded objects.
  std::mutex reads_mu;
  std::vector<std::pair<double, int>> reads;
  std::string first_read_error;
  std::thread reader([&] {
    Buffer dst(8 * kObj);
    ASSERT_TRUE(client_->RegisterBuffer(dst.data(), dst.size()).ok());
    std::mt19937_64 rng(11);
    while (!load.stop.load()) {
      std::vector<uint64_t> ids;
      for (int k = 0; k < 8; ++k) ids.push_back(seeded[rng() % seeded.size()]);
      std::string why;
      const int failed = GetIds(ids, dst, &why);
      {
        std::lock_guard<std::mutex> lock(reads_mu);
        reads.push_back({SecondsSince(load.start), failed});
        if (failed && first_read_error.empty()) first_read_error = why;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    (void)client_->UnregisterBuffer(dst.data());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  const uint64_t away_before = client_->stats().gets_without_master;
  const double killed_at = SecondsSince(load.start);
  const auto killed = Clock::now();
  masters_[old]->Kill();
  const std::string new_leader = WaitForLeader(old_leader, 15000);
  const double elected_s = SecondsSince(killed);
  const double elected_at = SecondsSince(load.start);
  if (new_leader.empty()) {
    load.stop = true;
    driver.join();
    reader.join();
  }
  ASSERT_FALSE(new_leader.empty()) << "no standby took over";
  // Run until puts have resumed for a second (or 20 s).
  const auto until = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < until && PutsResumeAfter(load, killed_at) < 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  load.stop = true;
  driver.join();
  reader.join();
  const double resumed_s = PutsResumeAfter(load, killed_at);
  int reads_in_gap = 0, read_keys_failed = 0;
  for (const auto& [at, failed] : reads) {
    read_keys_failed += failed;
    if (at > killed_at && at < elected_at) ++reads_in_gap;
  }
  const uint64_t away = client_->stats().gets_without_master - away_before;
  std::printf(
      "leader %s killed: %s elected after %.2f s, puts resumed after %.2f s; puts %d ok / %d "
      "failed, gets %d ok / %d failed; reader: %zu gets, %d done while no leader existed, %d "
      "keys failed, %llu keys read without the master\n",
      old_leader.c_str(), new_leader.c_str(), elected_s, resumed_s, load.puts_ok.load(),
      load.puts_failed.load(), load.gets_ok.load(), load.gets_failed.load(), reads.size(),
      reads_in_gap, read_keys_failed, static_cast<unsigned long long>(away));
  EXPECT_GT(resumed_s, 0) << "puts never resumed";
  EXPECT_EQ(read_keys_failed, 0) << first_read_error;
  // A get every 50 ms while the election takes about 2 s: without reads from the nodes alone,
  // the reader waits for the new leader and at most one of its gets ends in the gap.
  EXPECT_GE(reads_in_gap, 3) << "gets waited for the new leader";
  EXPECT_GT(away, 0u);
  std::printf("first put error: %s\n", load.first_put_error.c_str());
  ExpectNothingLost(seeded, load);
}

// SIGSTOP of the leader: it loses its lease while frozen, a standby takes over, and once
// resumed the old leader refuses every call at once (its lease ran out on its own clock) and
// never answers as leader again: no split brain.
TEST_F(StoreHa, FrozenLeaderIsReplacedAndNeverActsAgain) {
  std::vector<uint64_t> seeded = Seed(64);
  const std::string old_leader = WaitForLeader("", 1000);
  const int old = MasterIndex(old_leader);
  ASSERT_GE(old, 0) << old_leader;
  Load load;
  std::thread driver([&] { RunLoad(&load); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  masters_[old]->Signal(SIGSTOP);
  const std::string new_leader = WaitForLeader(old_leader, 15000);
  ASSERT_FALSE(new_leader.empty()) << "no standby took over from the frozen leader";
  std::this_thread::sleep_for(std::chrono::seconds(1));
  masters_[old]->Signal(SIGCONT);
  // The first call after the resume must not be served as leader.
  store::MasterClient::Options mo;
  mo.address = old_leader;
  mo.retry.rpc_timeout_ms = 1000;
  store::MasterClient direct(mo);
  auto stats = direct.Stats();
  EXPECT_FALSE(stats.ok()) << "the replaced leader answered Stats after its resume";
  if (!stats.ok())
    std::printf("replaced leader after SIGCONT: %s\n", stats.status().ToString().c_str());
  std::this_thread::sleep_for(std::chrono::seconds(2));
  load.stop = true;
  driver.join();
  EXPECT_EQ(WaitForLeader("", 1000), new_leader) << "leadership moved back to the frozen master";
  EXPECT_FALSE(store::MasterClient(mo).Stats().ok()) << "the replaced leader serves again";
  std::printf("frozen leader: puts %d ok / %d failed, gets %d ok / %d failed\n",
              load.puts_ok.load(), load.puts_failed.load(), load.gets_ok.load(),
              load.gets_failed.load());
  ExpectNothingLost(seeded, load);
}

// A commit of one record to (node_id, incarnation) with term 0, older than any elected
// leader's (1 or more): what a replaced leader that resumed would send.
rpc::CommitRequest StaleCommit(const std::string& node_id, uint64_t incarnation) {
  rpc::CommitRequest req;
  req.mutable_node()->set_node_id(node_id);
  req.mutable_node()->set_incarnation(incarnation);
  req.set_term(0);
  auto* rec = req.add_records();
  rec->set_key("planted-by-a-stale-leader");
  rec->set_version(1);
  rec->add_sizes(kObj);
  rec->set_replica_id(1);
  return req;
}

// The nodes follow the leader's term: a commit (or a reply) carrying an older term, as a
// replaced leader that resumed would send, is refused and changes nothing.
TEST_F(StoreHa, NodesRefuseCommitsOfAReplacedLeader) {
  store::MasterClient::Options mo;
  mo.address = etcd_address_;
  store::MasterClient master(mo);
  auto nodes = Must(master.NodeDescriptors({}));
  ASSERT_EQ(nodes.size(), 3u);
  auto channel = store::NewChannel(nodes[0].rpc_address);
  auto stub = rpc::Node::NewStub(channel);
  auto describe = [&] {
    grpc::ClientContext ctx;
    rpc::Empty req;
    rpc::NodeDescriptor reply;
    EXPECT_TRUE(stub->Describe(&ctx, req, &reply).ok());
    return reply.inventory_records();
  };
  const uint64_t before = describe();
  grpc::ClientContext ctx;
  rpc::CommitRequest req = StaleCommit(nodes[0].id.node_id, nodes[0].id.incarnation);
  rpc::Status reply;
  ASSERT_TRUE(stub->Commit(&ctx, req, &reply).ok());
  EXPECT_EQ(reply.code(), KVB_ERR_STALE_PEER) << reply.message();
  EXPECT_NE(reply.message().find("replaced master"), std::string::npos) << reply.message();
  EXPECT_EQ(describe(), before) << "the stale commit reached the inventory";
}

// The same for a commit a client of the node's own process applies (store::ApplyLocalCommit,
// what a PutEnd answer carries back in the embedded deployment): a term older than the one the
// node follows is refused and the put it belongs to is not reported done.
TEST_F(StoreHa, NodesRefuseLocalCommitsOfAReplacedLeader) {
  NodeOptions no;
  no.master_address = etcd_address_;
  no.dram_bytes = 16u << 20;
  no.engine.node_id = "own-node";
  no.engine.transports = {"tcp"};
  auto node = Must(StorageNode::Start(no));
  ASSERT_TRUE(testing::WaitForActiveNodes(etcd_address_, 4));
  rpc::CommitRequest req = StaleCommit(node->id().node_id, node->id().incarnation);
  const Status st = store::ApplyLocalCommit(req, std::chrono::steady_clock::now());
  EXPECT_TRUE(st.Is(StatusCode::kStalePeer)) << st.ToString();
  EXPECT_NE(st.message().find("replaced master"), std::string::npos) << st.ToString();
  EXPECT_EQ(node->object_count(), 0u) << "the stale commit reached the inventory";
  // Another incarnation of this node id is not this node.
  req.mutable_node()->set_incarnation(node->id().incarnation + 1);
  EXPECT_TRUE(
      store::ApplyLocalCommit(req, std::chrono::steady_clock::now()).Is(StatusCode::kUnavailable));
}

// SIGTERM of the leader (an upgrade): it steps down at once, a standby takes over well within
// the lease a dead leader would cost, and puts go on.
TEST_F(StoreHa, SigtermedLeaderHandsOverAtOnce) {
  const std::string old_leader = WaitForLeader("", 1000);
  const int old = MasterIndex(old_leader);
  ASSERT_GE(old, 0);
  Load load;
  std::thread driver([&] { RunLoad(&load); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double stopped_at = SecondsSince(load.start);
  const auto t0 = Clock::now();
  masters_[old]->Signal(SIGTERM);
  const std::string next = WaitForLeader(old_leader, 10000);
  const double handover_s = SecondsSince(t0);
  ASSERT_FALSE(next.empty());
  EXPECT_EQ(masters_[old]->Wait(5000), 0) << "the old leader did not exit cleanly";
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < until && PutsResumeAfter(load, stopped_at) < 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  load.stop = true;
  driver.join();
  std::printf(
      "leader SIGTERMed: %s took over after %.2f s, puts resumed after %.2f s; puts %d ok "
      "/ %d failed, gets %d ok / %d failed\n",
      next.c_str(), handover_s, PutsResumeAfter(load, stopped_at), load.puts_ok.load(),
      load.puts_failed.load(), load.gets_ok.load(), load.gets_failed.load());
  EXPECT_LT(handover_s, 1.5) << "the leader did not step down: a standby waited for its lease";
  EXPECT_EQ(load.gets_failed.load(), 0) << load.first_get_error;
  std::string why;
  EXPECT_EQ(VerifyAll(load.acked, &why), 0) << why;
}

// Every master's /health says what it is: the leader 200, each standby 503 naming the leader;
// after the leader dies, the new one says 200 and its metrics say it leads.
TEST_F(StoreHa, HealthSaysWhoLeads) {
  const std::string leader = WaitForLeader("", 1000);
  const int li = MasterIndex(leader);
  ASSERT_GE(li, 0);
  for (int i = 0; i < 3; ++i) {
    testing::HttpReply h = testing::HttpGet(http_ports_[i], "/health");
    if (i == li) {
      EXPECT_EQ(h.status, 200) << h.body;
    } else {
      EXPECT_EQ(h.status, 503) << h.body;
      EXPECT_NE(h.body.find("standby; the leader is " + leader), std::string::npos) << h.body;
      auto m = testing::ParseSamples(testing::HttpGet(http_ports_[i], "/metrics").body);
      EXPECT_EQ(m["kvbridge_master_is_leader"], 0);
    }
  }
  masters_[li]->Kill();
  const std::string next = WaitForLeader(leader, 15000);
  const int ni = MasterIndex(next);
  ASSERT_GE(ni, 0);
  // The new leader's server takes its endpoint over from its standby one.
  int status = 0;
  for (int t = 0; t < 50 && status != 200; ++t) {
    status = testing::HttpGet(http_ports_[ni], "/health").status;
    if (status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(status, 200);
  auto m = testing::ParseSamples(testing::HttpGet(http_ports_[ni], "/metrics").body);
  EXPECT_EQ(m["kvbridge_master_is_leader"], 1);
}

// One etcd member killed (the first one, which every client asks first): the leader keeps its
// lease through the others, nothing fails over, the load sees no failure.
TEST_F(StoreHa, LosingOneEtcdMemberCostsNothing) {
  const std::string leader = WaitForLeader("", 1000);
  Load load;
  std::thread driver([&] { RunLoad(&load); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  etcd_.Kill(0);
  std::this_thread::sleep_for(std::chrono::seconds(3 * kHaLeaseMs / 1000));
  load.stop = true;
  driver.join();
  std::printf("etcd member killed: puts %d ok / %d failed, gets %d ok / %d failed\n",
              load.puts_ok.load(), load.puts_failed.load(), load.gets_ok.load(),
              load.gets_failed.load());
  EXPECT_EQ(WaitForLeader("", 1000), leader) << "the leader changed";
  EXPECT_EQ(load.puts_failed.load(), 0) << load.first_put_error;
  EXPECT_EQ(load.gets_failed.load(), 0) << load.first_get_error;
  std::string why;
  EXPECT_EQ(VerifyAll(load.acked, &why), 0) << why;
}

// Every master and every etcd member killed at once, then started again (same ports, etcd's
// data kept): the nodes keep their data, register with the new leader, and every acknowledged
// object is back.
TEST_F(StoreHa, WholeControlPlaneRestartLosesNothing) {
  std::vector<uint64_t> seeded = Seed(128);
  for (auto& m : masters_) m->Kill();
  for (int i = 0; i < 3; ++i) etcd_.Kill(i);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  etcd_.StartAll();
  ASSERT_TRUE(etcd_.WaitReady());
  for (int i = 0; i < 3; ++i) StartMaster(i);
  ASSERT_FALSE(WaitForLeader("", 15000).empty());
  ASSERT_TRUE(testing::WaitForActiveNodes(etcd_address_, 3, 20000));
  std::string why;
  EXPECT_EQ(VerifyAll(seeded, &why), 0) << why;
}

// Every master starts with its next three writes of the in-flight maps failing, as when etcd
// does not answer in time (KVBRIDGE_MASTER_FAULTS=inflight_publish_fail=3).
class StoreHaPublishFaults : public StoreHa {
 protected:
  void SetUp() override {
    setenv("KVBRIDGE_MASTER_FAULTS", "inflight_publish_fail=3", 1);
    StoreHa::SetUp();
    unsetenv("KVBRIDGE_MASTER_FAULTS");
  }
};

// A PutStart whose in-flight map could not be written to etcd hands nothing out: it is revoked
// and answered UNAVAILABLE, the client (HA masters) puts the batch again, and once a write goes
// through every object is stored once, nothing is left pending, and all read back.
TEST_F(StoreHaPublishFaults, AFailedInflightPublishHandsNothingOut) {
  const std::string leader = WaitForLeader("", 1000);
  const int li = MasterIndex(leader);
  ASSERT_GE(li, 0);
  std::vector<uint64_t> seeded = Seed(64);
  ASSERT_EQ(seeded.size(), 64u) << "a put failed: the client did not ride through the refusal";
  auto m = testing::ParseSamples(testing::HttpGet(http_ports_[li], "/metrics").body);
  EXPECT_EQ(m["kvbridge_master_inflight_publish_failures_total"], 3)
      << "the injected publish failures did not all happen";
  const ClusterStatus st = Must(QueryClusterStatus(etcd_address_));
  EXPECT_EQ(st.objects, 64u);
  EXPECT_EQ(st.pending_puts, 0u) << "a refused PutStart left a put pending";
  std::string why;
  EXPECT_EQ(VerifyAll(seeded, &why), 0) << why;
}

// Bad addresses are refused with errors that say what is wrong.
TEST(EtcdAddress, BadAddressesAreNamed) {
  EXPECT_TRUE(store::ParseEtcdAddress("etcd://").status().Is(StatusCode::kInvalidArgument));
  auto no_port = store::ParseEtcdAddress("etcd://host");
  ASSERT_FALSE(no_port.ok());
  EXPECT_NE(no_port.status().message().find("'host' is not host:port"), std::string::npos)
      << no_port.status().ToString();
  EXPECT_FALSE(store::ParseEtcdAddress("etcd://h:1/").ok());
  EXPECT_FALSE(store::ParseEtcdAddress("etcd://h:1/a/b").ok());
  auto ok = Must(store::ParseEtcdAddress("etcd://a:1,b:2/pfx"));
  EXPECT_EQ(ok.endpoints, (std::vector<std::string>{"a:1", "b:2"}));
  EXPECT_EQ(ok.prefix, "pfx");
  EXPECT_EQ(Must(store::ParseEtcdAddress("a:1")).prefix, "kvbridge");
  MasterOptions o;
  o.etcd = "127.0.0.1:1";
  o.listen = "0.0.0.0:5000";
  auto wildcard = HaMaster::Start(o);
  ASSERT_FALSE(wildcard.ok());
  EXPECT_NE(wildcard.status().message().find("advertise"), std::string::npos)
      << wildcard.status().ToString();
  o.listen = "127.0.0.1:5000";
  o.ha_lease_ms = 500;
  EXPECT_TRUE(HaMaster::Start(o).status().Is(StatusCode::kInvalidArgument));
}

// The in-flight maps as etcd keeps them: round trip, and a value that does not parse is named.
TEST(EtcdAddress, InflightMapsRoundTripAndBadValuesAreNamed) {
  store::InflightMap m;
  m.node_id = "n0";
  m.incarnation = 0xabcdef0123456789ull;
  m.segments.push_back({7, 1 << 20, 0x8000000000000001ull});
  m.segments.push_back({9, 4 << 20, 0});
  auto back = Must(store::DecodeInflight("n0", store::EncodeInflight(m)));
  EXPECT_EQ(back.incarnation, m.incarnation);
  EXPECT_EQ(back.segments, m.segments);
  auto bad = store::DecodeInflight("n1", "abc 7:1:x?");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("n1"), std::string::npos) << bad.status().ToString();
}

// No etcd to reach: a client's call fails within its deadline naming etcd, not hangs.
TEST(EtcdAddress, UnreachableEtcdIsNamed) {
  store::MasterClient::Options mo;
  mo.address = "etcd://127.0.0.1:" + std::to_string(testing::FreePort()) + "/x";
  mo.retry.rpc_timeout_ms = 1500;
  const auto t0 = Clock::now();
  auto st = store::MasterClient(mo).Stats();
  ASSERT_FALSE(st.ok());
  EXPECT_LT(SecondsSince(t0), 5.0);
  EXPECT_NE(st.status().message().find("etcd"), std::string::npos) << st.status().ToString();
}

// The etcd calls themselves against one real member: create-if-absent elects one winner,
// a lease's keys go with it.
TEST(EtcdClientReal, CreateIfAbsentAndLeases) {
  if (EtcdBinary().empty()) GTEST_SKIP() << "etcd is not installed (Debian etcd-server)";
  EtcdCluster one(1);
  one.StartAll();
  ASSERT_TRUE(one.WaitReady()) << one.last_error();
  store::EtcdClient c(one.Endpoints(), 1000);
  auto lease = Must(c.GrantLease(2));
  EXPECT_GE(lease.ttl_s, 2);
  auto first = Must(c.CreateIfAbsent("t/leader", "a", lease.id));
  EXPECT_TRUE(first.created);
  auto second = Must(c.CreateIfAbsent("t/leader", "b", 0));
  EXPECT_FALSE(second.created);
  EXPECT_EQ(second.current.value, "a");
  EXPECT_EQ(second.current.create_revision, first.revision);
  EXPECT_GE(Must(c.KeepAlive(lease.id)), 1);
  EXPECT_TRUE(c.DeleteIfCreatedAt("t/leader", first.revision + 1000).ok());  // not ours: kept
  EXPECT_TRUE(Must(c.Get("t/leader")).has_value());
  EXPECT_TRUE(c.RevokeLease(lease.id).ok());
  EXPECT_FALSE(Must(c.Get("t/leader")).has_value()) << "the lease's key outlived it";
  EXPECT_TRUE(c.KeepAlive(lease.id).status().Is(StatusCode::kNotFound));
  EXPECT_FALSE(Must(c.PutIfUnchanged("t/epoch", 12345, "x")));
  EXPECT_TRUE(Must(c.PutIfUnchanged("t/epoch", 0, "1 1")));
  EXPECT_EQ(Must(c.GetPrefix("t/")).size(), 1u);
}

}  // namespace
}  // namespace kvbridge
