// Late writers, with real processes (a `kvbridge master` and `kvbridge node` daemons, in-process
// clients): a write that arrives after the master gave its range up must never become another
// object's bytes (docs/store.md "Late writes"). Each test forces one way a write comes late:
// a client stalled between PutStart and its transfer, a task whose destination was frozen
// past the task's deadline, a put issued by a master that was then killed and restarted. Small
// nodes, so freed ranges are reused at once by the next puts. Then every object is read back
// and its bytes compared: none may be wrong (the client checks each object's CRC-32C, so a
// late write could only cost a miss), and with the master's hold and the deadlines honoured
// none may be missing either, and no replica reported bad.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/store.h"
#include "tests/common/test_util.h"
#include "tests/store/store_procs.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::ChildProcess;
using testing::Must;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kPage = 64 * 1024;  // one buffer (K or V); an object is two
constexpr size_t kSlots = 64;          // objects an arena holds (a batch uses distinct slots)

class StoreFencing : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("KVBRIDGE_PROGRESS_TIMEOUT_MS", "500", 1);
    setenv("KVBRIDGE_DEADLINE_MS", "3000", 1);
    setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
    master_addr_ = "127.0.0.1:" + std::to_string(testing::FreePort());
  }
  void TearDown() override {
    for (const auto& [var, value] : master_env_) unsetenv(var.c_str());
  }

  // The master daemon, with these variables (KVBRIDGE_PUT_TIMEOUT_MS, ...) set for it.
  void StartMaster(uint32_t ttl_ms) {
    for (const auto& [var, value] : master_env_) setenv(var.c_str(), value.c_str(), 1);
    master_ = testing::StartMaster(master_addr_,
                                   {"--node-ttl-ms", std::to_string(ttl_ms), "--lease-ms", "200"});
    ASSERT_TRUE(master_);
  }

  // Node i gets dram[i] bytes and, when given, faults[i] as KVBRIDGE_NODE_FAULTS.
  void StartNodes(const std::vector<uint64_t>& dram, const std::vector<std::string>& faults = {}) {
    for (size_t i = 0; i < dram.size(); ++i) {
      const std::string id = "node" + std::to_string(i);
      if (i < faults.size() && !faults[i].empty()) {
        setenv("KVBRIDGE_NODE_FAULTS", faults[i].c_str(), 1);
      } else {
        unsetenv("KVBRIDGE_NODE_FAULTS");
      }
      auto node = testing::StartNode(
          master_addr_, id,
          {"--dram-bytes", std::to_string(dram[i]), "--drain-timeout-ms", "20000"});
      ASSERT_TRUE(node);
      nodes_.push_back(std::move(node));
    }
    unsetenv("KVBRIDGE_NODE_FAULTS");
    WaitForActiveNodes(static_cast<int>(dram.size()));
  }

  void WaitForActiveNodes(int n) { ASSERT_TRUE(testing::WaitForActiveNodes(master_addr_, n)); }

  ClusterStatus View() { return Must(QueryClusterStatus(master_addr_)); }

  // A client with its own arenas; `faults` is StoreOptions::faults.
  struct Client {
    std::unique_ptr<StoreClient> store;
    Buffer src{kSlots * 2 * kPage}, dst{kSlots * 2 * kPage};
  };
  std::unique_ptr<Client> NewClient(const std::string& node_id, const std::string& faults = "",
                                    uint32_t progress_timeout_ms = 500) {
    StoreOptions so;
    so.master_address = master_addr_;
    so.replica_num = 2;
    so.transfer_deadline_ms = 5000;
    so.engine.node_id = node_id;
    so.engine.transports = {"tcp"};
    so.engine.progress_timeout_ms = progress_timeout_ms;
    so.engine.default_deadline_ms = 5000;
    so.faults = faults;
    auto c = std::make_unique<Client>();
    c->store = Must(StoreClient::Create(so));
    EXPECT_TRUE(c->store->RegisterBuffer(c->src.data(), c->src.size()).ok());
    EXPECT_TRUE(c->store->RegisterBuffer(c->dst.data(), c->dst.size()).ok());
    return c;
  }

  // Object `seed` as two buffers in slot `seed % kSlots` of an arena.
  static std::vector<BufferRef> Slot(Buffer& arena, size_t seed) {
    uint8_t* base = arena.data() + (seed % kSlots) * 2 * kPage;
    return {BufferRef{base, kPage}, BufferRef{base + kPage, kPage}};
  }

  // Puts objects with these seeds (keys "obj-<seed>", bytes from the seed); one status each.
  static std::vector<Status> Put(Client& c, const std::vector<size_t>& seeds) {
    std::vector<std::string> keys;
    std::vector<std::vector<BufferRef>> bufs;
    for (size_t s : seeds) {
      c.src.Fill(s, (s % kSlots) * 2 * kPage, 2 * kPage);
      keys.push_back("obj-" + std::to_string(s));
      bufs.push_back(Slot(c.src, s));
    }
    return c.store->BatchPutFrom(keys, bufs);
  }

  static std::vector<size_t> Seeds(size_t first, size_t n) {
    std::vector<size_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = first + i;
    return v;
  }

  struct Readback {
    int missing = 0;  // not returned (an error, NOT_FOUND)
    int wrong = 0;    // returned with bytes that are not the object's
    std::string first_miss;
  };
  // Reads every object back (in batches of up to kSlots) and compares its bytes.
  static Readback ReadAll(Client& c, const std::vector<size_t>& seeds) {
    Readback r;
    for (size_t at = 0; at < seeds.size(); at += kSlots) {
      const size_t end = std::min(seeds.size(), at + kSlots);
      std::vector<std::string> keys;
      std::vector<std::vector<BufferRef>> bufs;
      for (size_t k = at; k < end; ++k) {
        keys.push_back("obj-" + std::to_string(seeds[k]));
        bufs.push_back(Slot(c.dst, seeds[k]));
      }
      auto got = c.store->BatchGetInto(keys, bufs);
      for (size_t k = at; k < end; ++k) {
        const size_t off = (seeds[k] % kSlots) * 2 * kPage;
        if (!got[k - at].ok()) {
          if (r.missing++ == 0)
            r.first_miss = keys[k - at] + ": " + got[k - at].status().ToString();
        } else if (!c.dst.Matches(seeds[k], off, 2 * kPage, off)) {
          ++r.wrong;
        }
      }
    }
    return r;
  }

  std::string master_addr_;
  std::map<std::string, std::string> master_env_;
  std::unique_ptr<ChildProcess> master_;
  std::vector<std::unique_ptr<ChildProcess>> nodes_;
};

// A client stalls between the master's PutStart answer and its transfer for three times the
// put timeout (the client's fault injection). The master revokes the put at its deadline; its
// ranges are reused only after the writer's deadline plus the late-write margin (here 2 s), and
// the client, which got the deadline with its allocation, writes nothing after it: it fails the
// put instead. Meanwhile another client's puts take the space. `ignore_deadline`: the stalled
// client writes anyway (put_ignore_deadline), so only the master's hold keeps its bytes off the
// new objects. (Before, the revoked ranges were free at once and the late bytes overwrote the
// next objects put there.)
class StalledPut : public StoreFencing, public ::testing::WithParamInterface<bool> {};

TEST_P(StalledPut, CannotLandOnObjectsPutAfterItsRevoke) {
  const bool ignore_deadline = GetParam();
  master_env_ = {{"KVBRIDGE_PUT_TIMEOUT_MS", "500"}};
  StartMaster(/*ttl_ms=*/1000);  // late-write margin: 1 s TTL + 1 s
  StartNodes({8u << 20, 8u << 20, 8u << 20});
  auto main_client = NewClient("main");
  auto stalled =
      NewClient("stalled", "put_stall_before_write_ms=1500" +
                               std::string(ignore_deadline ? ",put_ignore_deadline=1" : ""));
  std::vector<Status> late;
  std::thread writer([&] { late = Put(*stalled, Seeds(1000, 16)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(800));  // revoked at 500 ms
  EXPECT_EQ(View().pending_puts, 0u) << "the stalled put was not revoked at its deadline";
  const std::vector<size_t> objects = Seeds(0, 48);
  for (const Status& st : Put(*main_client, objects)) ASSERT_TRUE(st.ok()) << st.ToString();
  writer.join();  // the stalled client has written (or refused to) by now
  for (const Status& st : late) {
    EXPECT_FALSE(st.ok()) << "a put written after its revoke was acknowledged";
    if (!ignore_deadline) {
      EXPECT_NE(st.ToString().find("DEADLINE_EXCEEDED"), std::string::npos) << st.ToString();
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const Readback r = ReadAll(*main_client, objects);
  EXPECT_EQ(r.wrong, 0) << "wrong bytes returned";
  EXPECT_EQ(r.missing, 0) << "first: " << r.first_miss;
  EXPECT_EQ(View().bad_replicas_total, 0u) << "a late write corrupted replicas of new objects";
  // The space comes back after the hold.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(View().pending_puts, 0u);
  for (const Status& st : Put(*main_client, Seeds(100, 24))) EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(ReadAll(*main_client, Seeds(100, 24)).missing, 0);
}

INSTANTIATE_TEST_SUITE_P(ClientHonoursDeadline, StalledPut, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("ClientIgnoresIt")
                                             : std::string("ClientHonoursIt");
                         });

// Re-replication into a frozen destination. Node 2 has the most room, so it is the
// destination of most copies. Node 1 is killed first: its objects are copied again, from
// nodes 0 and 3 to node 2, which leaves their engines with open connections to node 2. Then
// node 2 is frozen (SIGSTOP) and node 3 drains: its copies to node 2 go into those
// connections, the bytes wait in node 2's socket buffers, the tasks pass their 500 ms deadline
// and fail, and the master gives their destination ranges up. Puts into node 2 go on meanwhile
// (they wait: their client's progress timeout is 3 s), and node 2 resumes within its TTL: the
// late task bytes and the new objects' bytes land side by side. The ranges of the failed tasks
// are held until the task deadline plus the late-write margin (5 s: a 4 s TTL + 1 s), so no
// new object was placed in them. (Before, they were free at once.)
TEST_F(StoreFencing, LateTaskBytesOfAFrozenDestinationLandOnNoNewObject) {
  master_env_ = {{"KVBRIDGE_TASK_TIMEOUT_MS", "500"}};
  StartMaster(/*ttl_ms=*/4000);
  StartNodes({16u << 20, 8u << 20, 32u << 20, 8u << 20});
  auto main_client = NewClient("main", "", /*progress_timeout_ms=*/3000);
  const std::vector<size_t> first = Seeds(0, 40);
  for (const Status& st : Put(*main_client, first)) ASSERT_TRUE(st.ok()) << st.ToString();
  nodes_[1]->Kill();
  for (int i = 0; i < 150; ++i) {  // expired after 4 s, then its objects copied again
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const ClusterStatus s = View();
    if (s.nodes_expired_total == 1 && s.under_replicated == 0) break;
  }
  ASSERT_EQ(View().under_replicated, 0u);
  ASSERT_EQ(View().objects, first.size());
  nodes_[2]->Signal(SIGSTOP);
  const auto frozen = Clock::now();
  nodes_[3]->Signal(SIGTERM);  // drain: its objects are copied elsewhere, mostly to node 2
  // Node 3 gets its tasks with its next heartbeat (every 1.33 s), and they fail 500 ms later.
  std::this_thread::sleep_for(std::chrono::milliseconds(1900));
  std::vector<Status> during;
  std::thread putter([&] { during = Put(*main_client, Seeds(40, 24)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  nodes_[2]->Signal(SIGCONT);
  // Its last heartbeat was at most 1.33 s before the freeze: still inside its 4 s TTL.
  EXPECT_LT(Clock::now() - frozen, std::chrono::milliseconds(2600)) << "frozen too long";
  putter.join();
  std::vector<size_t> all = first;
  for (size_t i = 0; i < during.size(); ++i) {
    if (during[i].ok()) all.push_back(40 + i);
  }
  EXPECT_GT(all.size(), first.size()) << "no put went through while node 2 was frozen";
  EXPECT_EQ(nodes_[3]->Wait(25000), 0) << "the drain did not finish";
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const Readback r = ReadAll(*main_client, all);
  EXPECT_EQ(r.wrong, 0) << "wrong bytes returned";
  EXPECT_EQ(r.missing, 0) << "first: " << r.first_miss;
  EXPECT_EQ(View().bad_replicas_total, 0u) << "late task bytes corrupted new objects";
  EXPECT_EQ(View().nodes_expired_total, 1u) << "node 2 was declared dead while frozen";
  EXPECT_EQ(View().evictions_total, 0u) << "nodes too small for this test";
}

// A node that gets round to its re-replication tasks late (its fault injection delays each
// batch 1.5 s; the task timeout is 800 ms). Node 2 is killed, so node 0 becomes the source of
// the copies of the objects it shared with node 2, to node 1. The master gives those tasks up
// at their deadline; meanwhile new puts go to nodes 0 and 1. The task deadline counts from when
// the master handed the task out, so node 0 runs none of them when it gets to them (before, it
// counted from when the node started the transfer, and the copies were written 1.5 s late into
// ranges the master had freed and given to new objects), and the master holds the ranges past
// the deadline anyway.
TEST_F(StoreFencing, TaskRunLateByItsSourceWritesNothing) {
  master_env_ = {{"KVBRIDGE_TASK_TIMEOUT_MS", "800"}};
  StartMaster(/*ttl_ms=*/1000);
  StartNodes({16u << 20, 16u << 20, 16u << 20}, {"task_delay_ms=1500"});
  auto main_client = NewClient("main");
  const std::vector<size_t> first = Seeds(0, 40);
  for (const Status& st : Put(*main_client, first)) ASSERT_TRUE(st.ok()) << st.ToString();
  nodes_[2]->Kill();
  const auto killed = Clock::now();
  while (View().nodes_expired_total == 0 && Clock::now() - killed < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(View().nodes_expired_total, 1u);
  // New objects for the next 3 s, in small batches: they take the ranges the master frees.
  std::vector<size_t> all = first;
  for (size_t next = 40; next < 64; next += 4) {
    const std::vector<size_t> batch = Seeds(next, 4);
    auto r = Put(*main_client, batch);
    for (size_t i = 0; i < r.size(); ++i) {
      EXPECT_TRUE(r[i].ok()) << r[i].ToString();
      if (r[i].ok()) all.push_back(batch[i]);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const Readback r = ReadAll(*main_client, all);
  EXPECT_EQ(r.wrong, 0) << "wrong bytes returned";
  EXPECT_EQ(r.missing, 0) << "first: " << r.first_miss;
  EXPECT_EQ(View().bad_replicas_total, 0u) << "a late task's copy corrupted new objects";
}

// A put in flight across a master restart. A client gets its allocation from the master and
// stalls for 2 s (its put deadline is 3 s); the master is killed (-9) and started again on its
// port. The new master knows nothing of that allocation: every range not in the nodes'
// inventories looks free. The nodes register again saying they were registered before, and
// the new master places nothing in their DRAM until any put or task of its predecessor could
// have ended (max(3 s put, 2 x 1 s task) + 2 s margin = 5 s after its start): the stalled
// client's bytes land in space nobody uses, and its put end fails at the new master. Puts
// before that get NO_SPACE; after it, they are stored and read back intact. (Before, the new
// master placed new objects in those ranges at once and the late bytes overwrote them.)
TEST_F(StoreFencing, PutInFlightAcrossAMasterRestartLandsOnNoNewObject) {
  master_env_ = {{"KVBRIDGE_PUT_TIMEOUT_MS", "3000"}, {"KVBRIDGE_TASK_TIMEOUT_MS", "1000"}};
  StartMaster(/*ttl_ms=*/1000);
  StartNodes({8u << 20, 8u << 20, 8u << 20});
  auto main_client = NewClient("main");
  auto stalled = NewClient("stalled", "put_stall_before_write_ms=2000");
  std::vector<Status> late;
  std::thread writer([&] { late = Put(*stalled, Seeds(1000, 16)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // allocated, stalling
  master_->Kill();
  const auto restarted = Clock::now();
  StartMaster(/*ttl_ms=*/1000);
  WaitForActiveNodes(3);
  // Puts from now on: refused while the nodes wait, then stored.
  const std::vector<size_t> objects = Seeds(0, 48);
  bool stored = false;
  int refused = 0;
  while (!stored && Clock::now() - restarted < std::chrono::seconds(20)) {
    auto r = Put(*main_client, objects);
    stored = std::all_of(r.begin(), r.end(), [](const Status& st) { return st.ok(); });
    if (!stored) {
      ++refused;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  writer.join();
  ASSERT_TRUE(stored);
  EXPECT_GT(refused, 0) << "new data was placed before the predecessor's puts could have ended";
  EXPECT_GE(Clock::now() - restarted, std::chrono::milliseconds(4500));
  for (const Status& st : late)
    EXPECT_FALSE(st.ok()) << "the new master acknowledged a put it never started";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const Readback r = ReadAll(*main_client, objects);
  EXPECT_EQ(r.wrong, 0) << "wrong bytes returned";
  EXPECT_EQ(r.missing, 0) << "first: " << r.first_miss;
  EXPECT_EQ(View().bad_replicas_total, 0u) << "the stalled put's bytes corrupted new objects";
}

}  // namespace
}  // namespace kvbridge
