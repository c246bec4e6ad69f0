// One storage node holding more than 100 k objects, against the control plane's message size
// limits (docs/store.md "Message sizes"): its inventory (about 10 MiB of records) must reach a
// restarted master, in chunks; the frees of removing them all (25 heartbeat replies' worth)
// must reach the node promptly, through replies that say `more`; client batches far above
// the per-call key cap must work as one call. Real processes: a `kvbridge master` killed with
// SIGKILL and restarted, a `kvbridge node`, and an in-process StoreClient.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge.grpc.pb.h"
#include "kvbridge/store.h"
#include "store/rpc_util.h"
#include "tests/common/test_util.h"
#include "tests/store/store_procs.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::ChildProcess;
using testing::Must;
using Clock = std::chrono::steady_clock;

constexpr size_t kObjects = 102400;  // 100 Ki objects on one node
constexpr uint64_t kValue = 1024;    // 1 KiB each
constexpr size_t kBatch = 10240;     // keys per client call: more than the 4096 of one RPC
// A heartbeat every 2 s (TTL / 3): the 25 replies of frees that removing everything takes
// would need 50 s at that pace, unless each reply that leaves frees behind says `more`.
constexpr uint32_t kTtlMs = 6000;

// 64-byte keys.
std::string Key(size_t i) {
  char buf[65];
  std::snprintf(buf, sizeof buf, "scale-%058zu", i);
  return buf;
}

class StoreScale : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("KVBRIDGE_PROGRESS_TIMEOUT_MS", "500", 1);
    setenv("KVBRIDGE_DEADLINE_MS", "5000", 1);
    setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
    master_addr_ = "127.0.0.1:" + std::to_string(testing::FreePort());
    node_rpc_ = "127.0.0.1:" + std::to_string(testing::FreePort());
    StartMaster();
    ASSERT_TRUE(master_);
    node_ = testing::StartNode(master_addr_, "node0",
                               {"--dram-bytes", std::to_string(256u << 20), "--listen",
                                "127.0.0.1:0", "--rpc-listen", node_rpc_});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::WaitForActiveNodes(master_addr_, 1));
    StoreOptions so;
    so.master_address = master_addr_;
    so.replica_num = 1;
    so.transfer_deadline_ms = 10000;
    so.rpc_timeout_ms = 10000;
    so.engine.node_id = "client";
    so.engine.transports = {"tcp"};
    so.engine.progress_timeout_ms = 500;
    so.engine.default_deadline_ms = 10000;
    client_ = Must(StoreClient::Create(so));
    ASSERT_TRUE(client_->RegisterBuffer(src_.data(), src_.size()).ok());
    ASSERT_TRUE(client_->RegisterBuffer(dst_.data(), dst_.size()).ok());
    node_stub_ = rpc::Node::NewStub(store::NewChannel(node_rpc_));
  }

  void StartMaster() {
    master_ = testing::StartMaster(master_addr_,
                                   {"--node-ttl-ms", std::to_string(kTtlMs), "--lease-ms", "200"});
  }

  ClusterStatus View() { return Must(QueryClusterStatus(master_addr_)); }

  // The inventory records the node itself holds (its Describe), or -1 if it does not answer.
  int64_t NodeRecords() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    rpc::Empty req;
    rpc::NodeDescriptor reply;
    if (!node_stub_->Describe(&ctx, req, &reply).ok()) return -1;
    return static_cast<int64_t>(reply.inventory_records());
  }

  // Polls `fn` until it returns `want` or timeout_ms passes; the last value.
  template <typename Fn>
  auto WaitFor(Fn&& fn, decltype(fn()) want, int timeout_ms) {
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    auto v = fn();
    while (v != want && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      v = fn();
    }
    return v;
  }

  std::vector<std::vector<BufferRef>> Slots(Buffer& arena, size_t n) {
    std::vector<std::vector<BufferRef>> out;
    for (size_t j = 0; j < n; ++j) out.push_back({BufferRef{arena.data() + j * kValue, kValue}});
    return out;
  }

  // Objects [first, first + n) (n <= kBatch) in one call; the failures.
  size_t PutBatch(size_t first, size_t n) {
    std::vector<std::string> keys;
    for (size_t j = 0; j < n; ++j) {
      keys.push_back(Key(first + j));
      src_.Fill(first + j, j * kValue, kValue);
    }
    size_t failed = 0;
    for (const Status& st : client_->BatchPutFrom(keys, Slots(src_, n))) {
      if (!st.ok() && failed++ == 0) ADD_FAILURE() << "put: " << st.ToString();
    }
    return failed;
  }

  // Reads objects [first, first + n) (n <= kBatch) in one call; the ones missing or wrong.
  size_t WrongInBatch(size_t first, size_t n) {
    std::vector<std::string> keys;
    for (size_t j = 0; j < n; ++j) keys.push_back(Key(first + j));
    std::memset(dst_.data(), 0, n * kValue);
    auto got = client_->BatchGetInto(keys, Slots(dst_, n));
    size_t wrong = 0;
    for (size_t j = 0; j < n; ++j) {
      const bool ok = got[j].ok() && got[j].value() == kValue &&
                      dst_.Matches(first + j, j * kValue, kValue, j * kValue);
      if (!ok && wrong++ == 0) {
        ADD_FAILURE() << Key(first + j) << ": "
                      << (got[j].ok() ? "wrong bytes" : got[j].status().ToString());
      }
    }
    return wrong;
  }

  void TearDown() override {
    client_.reset();
    node_.reset();
    master_.reset();
  }

  std::string master_addr_, node_rpc_;
  std::unique_ptr<ChildProcess> master_, node_;
  std::unique_ptr<StoreClient> client_;
  std::unique_ptr<rpc::Node::Stub> node_stub_;
  Buffer src_{kBatch * kValue}, dst_{kBatch * kValue};
};

// 100 Ki objects of 1 KiB with 64-byte keys on one node survive a master killed with SIGKILL
// (the node's re-registration carries them all) and read back exactly; removing them all
// frees every record on the node within a few heartbeats' time, and a second master restart
// brings none back.
TEST_F(StoreScale, HundredThousandObjectsSurviveAMasterRestartAndAllFreesReachTheNode) {
  const auto t0 = Clock::now();
  auto secs = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  for (size_t at = 0; at < kObjects; at += kBatch) {
    ASSERT_EQ(PutBatch(at, std::min(kBatch, kObjects - at)), 0u) << "batch at " << at;
  }
  ASSERT_EQ(View().objects, kObjects);
  ASSERT_EQ(NodeRecords(), static_cast<int64_t>(kObjects));
  // One call of every key (25 RPCs): all exist.
  std::vector<std::string> all;
  for (size_t i = 0; i < kObjects; ++i) all.push_back(Key(i));
  auto exists = Must(client_->BatchExists(all));
  ASSERT_EQ(exists.size(), kObjects);
  EXPECT_EQ(std::count(exists.begin(), exists.end(), true), static_cast<long>(kObjects));
  std::printf("[ scale    ] %zu objects put in %.1f s\n", kObjects, secs());

  // The master dies without a word and comes back empty: the node's next heartbeat is
  // answered NOT_FOUND and it registers again with its whole inventory.
  master_->Kill();
  StartMaster();
  ASSERT_TRUE(master_);
  ASSERT_TRUE(testing::WaitForActiveNodes(master_addr_, 1, 3 * static_cast<int>(kTtlMs)));
  EXPECT_EQ(WaitFor([&] { return View().objects; }, uint64_t{kObjects}, 10000), kObjects)
      << "the re-registration did not bring the node's objects back";
  std::printf("[ scale    ] re-registered after the master restart at %.1f s\n", secs());
  size_t wrong = 0;
  for (size_t at = 0; at < kObjects; at += kBatch) {
    wrong += WrongInBatch(at, std::min(kBatch, kObjects - at));
  }
  EXPECT_EQ(wrong, 0u);
  std::printf("[ scale    ] read back at %.1f s\n", secs());

  // Remove half with one BatchRemove call (sliced into RPCs by the client), the rest with
  // RemoveAll: the master forgets them at once, the node once the frees reach it.
  std::vector<std::string> half(all.begin(), all.begin() + kObjects / 2);
  size_t failed = 0;
  for (const Status& st : client_->BatchRemove(half)) failed += !st.ok();
  EXPECT_EQ(failed, 0u);
  ASSERT_TRUE(client_->RemoveAll().ok());
  EXPECT_EQ(View().objects, 0u);
  const auto removed_at = Clock::now();
  // 25 replies of 4096 frees; at one heartbeat per 2 s that would be 50 s.
  const int64_t left = WaitFor([&] { return NodeRecords(); }, int64_t{0}, 15000);
  EXPECT_EQ(left, 0) << "frees did not reach the node in 15 s";
  std::printf("[ scale    ] the node held %lld records %.1f s after the removal\n",
              static_cast<long long>(left),
              std::chrono::duration<double>(Clock::now() - removed_at).count());

  // Nothing comes back with the node's next registration.
  master_->Kill();
  StartMaster();
  ASSERT_TRUE(master_);
  ASSERT_TRUE(testing::WaitForActiveNodes(master_addr_, 1, 3 * static_cast<int>(kTtlMs)));
  const ClusterStatus after = View();
  EXPECT_EQ(after.objects, 0u);
  ASSERT_EQ(after.nodes.size(), 1u);
  EXPECT_EQ(after.nodes[0].replicas, 0u);
  EXPECT_EQ(NodeRecords(), 0);
  exists = Must(client_->BatchExists(all));
  EXPECT_EQ(std::count(exists.begin(), exists.end(), true), 0);
  std::printf("[ scale    ] done at %.1f s\n", secs());
}

// Channels to storage nodes are cached by address with a bound (docs/store.md "Message sizes"
// and limits): a process that meets thousands of addresses keeps at most the capacity, the
// least recently used dropped first, and a stub a caller still holds stays usable.
TEST(NodeStubCache, KeepsAtMostItsCapacityLeastRecentlyUsedFirst) {
  store::NodeStubCache cache(4);
  auto held = cache.Get("127.0.0.1:1");
  auto kept = cache.Get("127.0.0.1:2");
  for (int port = 3; port < 5000; ++port) {
    cache.Get("127.0.0.1:" + std::to_string(port));
    if (port % 2 == 0) {
      EXPECT_EQ(cache.Get("127.0.0.1:2").get(), kept.get());  // in use: kept
    }
    ASSERT_LE(cache.size(), 4u);
  }
  EXPECT_EQ(cache.size(), 4u);
  EXPECT_EQ(cache.Get("127.0.0.1:2").get(), kept.get());
  EXPECT_NE(cache.Get("127.0.0.1:1").get(), held.get());  // dropped, then made anew
  // The dropped stub the caller held still makes calls (here: nobody listens on port 1).
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  rpc::Empty req;
  rpc::NodeDescriptor reply;
  EXPECT_FALSE(held->Describe(&ctx, req, &reply).ok());
  cache.Erase("127.0.0.1:2");
  EXPECT_NE(cache.Get("127.0.0.1:2").get(), kept.get());
  EXPECT_EQ(cache.size(), 4u);
}

}  // namespace
}  // namespace kvbridge
