// The store in one process (EmbeddedCluster), plus the daemons' operator surface: eviction
// under pressure, drain through the API, `kvbridge status`, config files, garbage on the
// master's port.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvbridge.grpc.pb.h"
#include "kvbridge/store.h"
#include "tests/common/test_util.h"
#include "tests/store/store_procs.h"
#include "util/checksum.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::ChildProcess;
using testing::Must;

constexpr uint64_t kObject = 128 * 1024;

const std::string kBin = KVBRIDGE_BIN_DIR "/kvbridge";

EmbeddedClusterOptions SmallCluster(int nodes, uint64_t dram, uint32_t replicas) {
  EmbeddedClusterOptions o;
  o.nodes = nodes;
  o.dram_bytes_per_node = dram;
  o.replica_num = replicas;
  o.engine.transports = {"tcp"};
  o.engine.progress_timeout_ms = 500;
  o.master.node_ttl_ms = 1000;
  o.master.lease_ms = 3000;
  return o;
}

std::string Key(size_t i) { return "obj-" + std::to_string(i); }

// Puts objects [first, first+n) of kObject bytes each from `arena` (slot i % slots).
std::vector<Status> PutObjects(StoreClient& c, Buffer& arena, size_t first, size_t n) {
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

int GetObjects(StoreClient& c, Buffer& arena, const std::vector<size_t>& ids) {
  const size_t slots = arena.size() / kObject;
  std::vector<std::string> keys;
  std::vector<std::vector<BufferRef>> bufs;
  for (size_t i : ids) {
    keys.push_back(Key(i));
    bufs.push_back({BufferRef{arena.data() + (i % slots) * kObject, kObject}});
  }
  int failed = 0;
  auto r = c.BatchGetInto(keys, bufs);
  for (size_t k = 0; k < ids.size(); ++k) {
    const size_t off = (ids[k] % slots) * kObject;
    if (!r[k].ok() || !arena.Matches(ids[k], off, kObject, off)) ++failed;
  }
  return failed;
}

TEST(EmbeddedStore, RoundTripInOneProcess) {
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(2, 32u << 20, 2)));
  Buffer src(64 * kObject), dst(64 * kObject);
  StoreClient& c = cluster->client();
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  for (const Status& st : PutObjects(c, src, 0, 64)) ASSERT_TRUE(st.ok()) << st.ToString();
  std::vector<size_t> ids(64);
  std::iota(ids.begin(), ids.end(), 0);
  EXPECT_EQ(GetObjects(c, dst, ids), 0);
  ClusterStatus s = Must(QueryClusterStatus(cluster->master_address()));
  EXPECT_EQ(s.objects, 64u);
  EXPECT_EQ(s.nodes.size(), 2u);
}

// A master daemon and a storage node of this process on it, for clients of this process
// (OwnNode::Client) whose puts the node takes.
struct OwnNode {
  std::string addr = "127.0.0.1:" + std::to_string(testing::FreePort());
  std::unique_ptr<testing::ChildProcess> master;
  std::unique_ptr<StorageNode> node;
  Buffer buf{kObject};

  void Start() {
    master = testing::StartMaster(addr, {"--node-ttl-ms", "900", "--lease-ms", "200"});
    ASSERT_TRUE(master);
    NodeOptions no;
    no.master_address = addr;
    no.dram_bytes = 16u << 20;
    no.engine.node_id = "lc-node";
    no.engine.transports = {"tcp"};
    node = Must(StorageNode::Start(no));
    ASSERT_TRUE(testing::WaitForActiveNodes(addr, 1));
  }
  std::unique_ptr<StoreClient> Client(const std::string& faults = "") {
    StoreOptions so;
    so.master_address = addr;
    so.engine.node_id = "lc-client";
    so.engine.transports = {"tcp"};
    so.faults = faults;
    auto c = Must(StoreClient::Create(so));
    EXPECT_TRUE(c->RegisterBuffer(buf.data(), buf.size()).ok());
    return c;
  }
  Status Put(StoreClient& c, const std::string& key) {
    std::vector<std::string> keys{key};
    std::vector<std::vector<BufferRef>> bufs{{BufferRef{buf.data(), kObject}}};
    return c.BatchPutFrom(keys, bufs)[0];
  }
};

// A put's inventory commit to a storage node of the client's own process comes back with the
// master's PutEnd answer and is applied by the client (store/local_nodes.h). The master has made
// the object complete by then, so another client can remove it and the node receive that free
// before the commit: the commit must then leave the record out. Checked across a master
// restart, which rebuilds the objects from the nodes' records: the removed object stays
// removed; the one committed this way before it is back.
TEST(EmbeddedStore, ALocalCommitOvertakenByAFreeDoesNotBringTheObjectBack) {
  OwnNode own;
  ASSERT_NO_FATAL_FAILURE(own.Start());
  auto fast = own.Client();
  auto slow = own.Client("put_stall_before_local_commit_ms=4000");
  auto& node = own.node;
  auto put = [&](StoreClient& c, const std::string& key) { return own.Put(c, key); };
  // Put first, so that its range is not the removed object's (a later put there would
  // overwrite a stale record and hide it).
  const std::vector<std::string> kept{"kept"};
  ASSERT_TRUE(put(*fast, kept[0]).ok());
  Status slow_put = Status::Internal("not run");
  std::thread writer([&] { slow_put = put(*slow, "removed"); });
  // Complete at the master (its PutEnd answered) while the slow client sleeps on the commit.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::vector<std::string> removed{"removed"};
  while (!Must(fast->BatchExists(removed))[0] && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(Must(fast->BatchExists(removed))[0]) << "the slow put never completed";
  ASSERT_TRUE(fast->BatchRemove(removed)[0].ok());
  // The node hears of the free in a heartbeat answer, before the slow client wakes.
  const auto removed_at = std::chrono::steady_clock::now();
  while (node->stats().frees_received == 0 &&
         std::chrono::steady_clock::now() - removed_at < std::chrono::seconds(3)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(node->stats().frees_received, 1u) << "the free never reached the node";
  // It found no record where this process's put was about to commit: remembered.
  EXPECT_EQ(node->stats().frees_remembered, 1u);
  writer.join();
  EXPECT_TRUE(slow_put.ok()) << slow_put.ToString();
  EXPECT_EQ(node->object_count(), 1u) << "the node should hold only the kept object's record";

  own.master.reset();  // killed: its successor knows only what the node's records say
  own.master = testing::StartMaster(own.addr, {"--node-ttl-ms", "900", "--lease-ms", "200"});
  ASSERT_TRUE(own.master);
  ASSERT_TRUE(testing::WaitForActiveNodes(own.addr, 1));
  EXPECT_FALSE(Must(fast->BatchExists(removed))[0])
      << "a remove was undone by a local commit that arrived after its free";
  EXPECT_TRUE(Must(fast->BatchExists(kept))[0])
      << "an object committed by its client was not rebuilt";
}

// A put takes a key's checksum from its copy into a node of the client's own process once the
// last put found its keys there; a key whose replica is elsewhere after all (here: the own node
// stopped and the next put placed on a node in another process) gets a pass over its bytes
// instead. Every object reads back verified against the checksum its put reported, by the
// client that put it and by another.
TEST(EmbeddedStore, PutChecksumsFromTheCopyOrFromAPassAreTheObjectsOwn) {
  OwnNode own;
  ASSERT_NO_FATAL_FAILURE(own.Start());
  auto client = own.Client();
  Buffer src(16 * kObject), dst(16 * kObject);
  ASSERT_TRUE(client->RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(client->RegisterBuffer(dst.data(), dst.size()).ok());
  std::vector<size_t> first(8), second(8);
  std::iota(first.begin(), first.end(), 0);
  std::iota(second.begin(), second.end(), 8);
  // The first put checksums in a pass; the second on its copy into the own node.
  for (size_t at : {0, 4}) {
    for (const Status& st : PutObjects(*client, src, at, 4)) ASSERT_TRUE(st.ok()) << st.ToString();
  }
  EXPECT_EQ(GetObjects(*client, dst, first), 0);

  auto far = testing::StartNode(own.addr, "far-node",
                                {"--dram-bytes", std::to_string(64u << 20), "--listen",
                                 "127.0.0.1:0", "--metrics-listen", "off"});
  ASSERT_TRUE(far);
  ASSERT_TRUE(testing::WaitForActiveNodes(own.addr, 2));
  own.node.reset();
  ASSERT_TRUE(testing::WaitForActiveNodes(own.addr, 1));
  // Expecting its copy to give the checksums, then placed on the far node: a pass after all.
  // Then a put that expects nothing from its copy.
  for (size_t at : {8, 12}) {
    for (const Status& st : PutObjects(*client, src, at, 4)) ASSERT_TRUE(st.ok()) << st.ToString();
  }
  EXPECT_EQ(GetObjects(*client, dst, second), 0);
  StoreOptions so;
  so.master_address = own.addr;
  so.engine.node_id = "lc-reader";
  so.engine.transports = {"tcp"};
  auto reader = Must(StoreClient::Create(so));
  std::memset(dst.data(), 0, dst.size());
  ASSERT_TRUE(reader->RegisterBuffer(dst.data(), dst.size()).ok());
  EXPECT_EQ(GetObjects(*reader, dst, second), 0);
}

// A node of the client's process that stops between the master's PutEnd answer and the
// client's commit: the put is not reported done (its record could not be kept), naming why.
TEST(EmbeddedStore, ALocalCommitToAStoppedNodeIsNotAcknowledged) {
  OwnNode own;
  ASSERT_NO_FATAL_FAILURE(own.Start());
  auto slow = own.Client("put_stall_before_local_commit_ms=3000");
  auto watcher = own.Client();
  Status put = Status::Internal("not run");
  std::thread writer([&] { put = own.Put(*slow, "k"); });
  // Stop the node once the master has made the object complete (its PutEnd answered), while
  // the writer sleeps before its commit.
  const std::vector<std::string> k{"k"};
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2500);
  while (!Must(watcher->BatchExists(k))[0] && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(Must(watcher->BatchExists(k))[0]) << "the put never completed at the master";
  own.node.reset();
  writer.join();
  EXPECT_TRUE(put.Is(StatusCode::kUnavailable)) << put.ToString();
  EXPECT_NE(put.message().find("not acknowledged"), std::string::npos) << put.ToString();
}

// Waits until `c` sees `key` complete at the master (a put's PutEnd answered).
void WaitComplete(StoreClient& c, const std::string& key) {
  const std::vector<std::string> k{key};
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!Must(c.BatchExists(k))[0] && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(Must(c.BatchExists(k))[0]) << "the put of " << key << " never completed";
}

// Waits until the node has received `n` frees, within `limit` of `since`.
void WaitFrees(StorageNode& node, uint64_t n, std::chrono::steady_clock::time_point since,
               std::chrono::milliseconds limit) {
  while (node.stats().frees_received < n && std::chrono::steady_clock::now() - since < limit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(node.stats().frees_received, n) << "the free never reached the node";
  ASSERT_LT(std::chrono::steady_clock::now() - since, limit) << "the free came too late";
}

// A node remembers for 10 s the frees that found no record of their replica (its commit may be
// on its way): a commit whose PutEnd was sent before the oldest such free it still remembers
// could be of a replica freed meanwhile, so it is refused and the put is not reported done.
// Here "gone" is removed while its own commit sleeps (its free finds no record: remembered,
// and its commit left out), and the commit of "k", whose PutEnd was sent before that free, is
// applied 12 s later, when the free is forgotten.
TEST(EmbeddedStore, ALocalCommitOlderThanTheRememberedFreesIsRefused) {
  OwnNode own;
  ASSERT_NO_FATAL_FAILURE(own.Start());
  auto fast = own.Client();
  auto slow = own.Client("put_stall_before_local_commit_ms=12000");
  auto stalled = own.Client("put_stall_before_local_commit_ms=3000");
  Status put = Status::Internal("not run"), gone_put = Status::Internal("not run");
  std::thread writer([&] { put = own.Put(*slow, "k"); });
  ASSERT_NO_FATAL_FAILURE(WaitComplete(*fast, "k"));
  const auto completed = std::chrono::steady_clock::now();
  std::thread gone_writer([&] { gone_put = own.Put(*stalled, "gone"); });
  ASSERT_NO_FATAL_FAILURE(WaitComplete(*fast, "gone"));
  ASSERT_TRUE(fast->BatchRemove(std::vector<std::string>{"gone"})[0].ok());
  // Received before "gone"'s commit (3 s), and early enough to be forgotten (10 s) at "k"'s.
  ASSERT_NO_FATAL_FAILURE(WaitFrees(*own.node, 1, completed, std::chrono::milliseconds(1900)));
  gone_writer.join();
  writer.join();
  EXPECT_TRUE(gone_put.ok()) << gone_put.ToString();
  EXPECT_TRUE(put.Is(StatusCode::kUnavailable)) << put.ToString();
  EXPECT_NE(put.message().find("cannot tell"), std::string::npos) << put.ToString();
  EXPECT_EQ(own.node->object_count(), 0u)
      << "a refused commit, or one overtaken by its free, kept a record";
  // "k" is complete at the master without a record here: its free finds none, where no
  // commit is expected any more, and is not remembered ("gone"'s was forgotten at k's commit).
  const auto removed = std::chrono::steady_clock::now();
  ASSERT_TRUE(fast->BatchRemove(std::vector<std::string>{"k"})[0].ok());
  ASSERT_NO_FATAL_FAILURE(WaitFrees(*own.node, 2, removed, std::chrono::milliseconds(5000)));
  EXPECT_EQ(own.node->stats().frees_remembered, 0u)
      << "a free where no commit was expected was remembered";
}

// A free that finds its replica's record came after that replica's commit, which the master
// sends once: the node does not remember it, so it neither costs memory nor refuses a slow
// commit of another object later (here "k"'s, applied 11.5 s after its PutEnd, with the free
// of "other", which was committed, received in between: remembered, it would be forgotten by
// then, and "k"'s commit refused as in the test above).
TEST(EmbeddedStore, FreesOfCommittedReplicasDoNotRefuseLaterCommits) {
  OwnNode own;
  ASSERT_NO_FATAL_FAILURE(own.Start());
  auto fast = own.Client();
  auto slow = own.Client("put_stall_before_local_commit_ms=11500");
  ASSERT_TRUE(own.Put(*fast, "other").ok());
  Status put = Status::Internal("not run");
  std::thread writer([&] { put = own.Put(*slow, "k"); });
  ASSERT_NO_FATAL_FAILURE(WaitComplete(*fast, "k"));
  const auto completed = std::chrono::steady_clock::now();
  ASSERT_TRUE(fast->BatchRemove(std::vector<std::string>{"other"})[0].ok());
  ASSERT_NO_FATAL_FAILURE(WaitFrees(*own.node, 1, completed, std::chrono::milliseconds(1400)));
  EXPECT_EQ(own.node->stats().frees_remembered, 0u);
  writer.join();
  EXPECT_TRUE(put.ok()) << put.ToString();
  EXPECT_EQ(own.node->object_count(), 1u) << "the node should hold \"k\"'s record alone";
  EXPECT_TRUE(Must(fast->BatchExists(std::vector<std::string>{"k"}))[0]);
}

TEST(EmbeddedStore, UpsertReplacesTheValueAndConcurrentUpsertsTakeTurns) {
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(2, 32u << 20, 2)));
  StoreClient& c = cluster->client();
  ASSERT_TRUE(c.Put("k", "first").ok());
  ASSERT_TRUE(c.Put("k", "ignored").ok());  // a put leaves an existing key alone
  EXPECT_EQ(Must(c.Get("k")), "first");
  ASSERT_TRUE(c.Upsert("k", "second, longer").ok());
  EXPECT_EQ(Must(c.Get("k")), "second, longer");
  ASSERT_TRUE(c.Upsert("absent", "put").ok());
  EXPECT_EQ(Must(c.Get("absent")), "put");

  Buffer src(2 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  src.Fill(7, 0, kObject);
  std::vector<std::string> keys = {"k", "absent"};
  std::vector<std::vector<BufferRef>> bufs = {{BufferRef{src.data(), 100}},
                                              {BufferRef{src.data(), kObject}}};
  for (const Status& st : c.BatchUpsertFrom(keys, bufs)) ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(Must(c.Get("k")), std::string(reinterpret_cast<const char*>(src.data()), 100));
  EXPECT_EQ(Must(c.Get("absent")).size(), kObject);

  // Upserts of one key from several threads all succeed (each waits for the one in flight),
  // and the key ends up holding one of their values, whole.
  std::vector<std::thread> writers;
  std::atomic<int> failed{0};
  for (int t = 0; t < 4; ++t) {
    writers.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) {
        if (!c.Upsert("contended", std::string(1000, static_cast<char>('a' + t))).ok()) ++failed;
      }
    });
  }
  for (auto& w : writers) w.join();
  EXPECT_EQ(failed.load(), 0);
  const std::string v = Must(c.Get("contended"));
  ASSERT_EQ(v.size(), 1000u);
  EXPECT_EQ(v, std::string(1000, v[0]));
  ClusterStatus s = Must(QueryClusterStatus(cluster->master_address()));
  EXPECT_EQ(s.objects, 3u);
}

TEST(EmbeddedStore, UnregisteredMemoryFailsOnlyItsOwnKey) {
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(2, 32u << 20, 1)));
  Buffer src(4 * kObject), dst(4 * kObject), loose(kObject);
  StoreClient& c = cluster->client();
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  // Key 1's second buffer runs past the end of the registered buffer: NOT_REGISTERED for it.
  std::vector<std::string> keys = {"ok0", "straddles", "loose", "ok3"};
  std::vector<std::vector<BufferRef>> bufs = {
      {BufferRef{src.data(), kObject}},
      {BufferRef{src.data(), kObject}, BufferRef{src.data() + 3 * kObject + 1, kObject}},
      {BufferRef{loose.data(), kObject}},
      {BufferRef{src.data() + kObject, kObject}}};
  std::vector<Status> put = c.BatchPutFrom(keys, bufs);
  EXPECT_TRUE(put[0].ok()) << put[0].ToString();
  EXPECT_TRUE(put[1].Is(StatusCode::kNotRegistered)) << put[1].ToString();
  EXPECT_NE(put[1].message().find("buffer 1"), std::string::npos) << put[1].ToString();
  EXPECT_TRUE(put[2].Is(StatusCode::kNotRegistered)) << put[2].ToString();
  EXPECT_TRUE(put[3].ok()) << put[3].ToString();
  EXPECT_EQ(Must(c.BatchExists(keys)), (std::vector<bool>{true, false, false, true}));
  std::vector<std::vector<BufferRef>> out = {{BufferRef{dst.data(), kObject}},
                                             {BufferRef{loose.data(), kObject}},
                                             {BufferRef{dst.data() + kObject, kObject}}};
  std::vector<std::string> get_keys = {"ok0", "ok3", "ok3"};
  auto got = c.BatchGetInto(get_keys, out);
  EXPECT_TRUE(got[0].ok());
  EXPECT_TRUE(!got[1].ok() && got[1].status().Is(StatusCode::kNotRegistered));
  ASSERT_TRUE(got[2].ok()) << got[2].status().ToString();
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), kObject), 0);
  EXPECT_EQ(std::memcmp(dst.data() + kObject, src.data() + kObject, kObject), 0);
}

uint64_t Errors(const StoreOpStats& o, StatusCode code) {
  for (const auto& [c, n] : o.errors) {
    if (c == code) return n;
  }
  return 0;
}

// A call is counted once, however it is split: into slices of kMaxKeysPerCall keys, or around
// its keys whose memory is not registered. Threads' counts add up exactly.
TEST(EmbeddedStore, StatsCountEachCallOnceWithItsKeysBytesAndLatency) {
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(2, 64u << 20, 1)));
  StoreClient& c = cluster->client();
  constexpr size_t kKeys = 4100;  // two slices
  constexpr uint64_t kSmall = 256;
  Buffer src(kKeys * kSmall), dst(kKeys * kSmall), loose(kSmall);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  std::vector<std::string> keys;
  std::vector<std::vector<BufferRef>> in, out;
  for (size_t i = 0; i < kKeys; ++i) {
    keys.push_back("stats-" + std::to_string(i));
    in.push_back({BufferRef{src.data() + i * kSmall, kSmall}});
    out.push_back({BufferRef{dst.data() + i * kSmall, kSmall}});
  }
  in.back() = {BufferRef{loose.data(), kSmall}};  // NOT_REGISTERED, the others go on
  std::vector<Status> put = c.BatchPutFrom(keys, in);
  ASSERT_TRUE(put.front().ok()) << put.front().ToString();
  ASSERT_TRUE(put.back().Is(StatusCode::kNotRegistered));
  auto got = c.BatchGetInto(keys, out);  // the last key is absent: a miss
  ASSERT_TRUE(got.front().ok());
  ASSERT_TRUE(got.back().status().IsNotFound());

  StoreClientStats s = c.stats();
  const StoreOpStats& p = s.op(StoreOp::kPut);
  const StoreOpStats& g = s.op(StoreOp::kGet);
  EXPECT_EQ(p.calls, 1u);
  EXPECT_EQ(p.keys, kKeys);
  EXPECT_EQ(Errors(p, StatusCode::kNotRegistered), 1u);
  EXPECT_EQ(s.puts_stored, kKeys - 1);
  EXPECT_EQ(s.bytes_written, (kKeys - 1) * kSmall);
  EXPECT_EQ(g.calls, 1u);
  EXPECT_EQ(g.keys, kKeys);
  EXPECT_TRUE(g.errors.empty());
  EXPECT_EQ(s.get_hits(), kKeys - 1);
  EXPECT_EQ(s.get_hits_dram, kKeys - 1);
  EXPECT_EQ(s.get_misses, 1u);
  EXPECT_EQ(s.bytes_read, (kKeys - 1) * kSmall);
  for (const StoreOpStats* o : {&p, &g}) {
    EXPECT_EQ(std::accumulate(o->latency_buckets.begin(), o->latency_buckets.end(), uint64_t{0}),
              o->calls);
    EXPECT_GT(o->latency_ns, 0u);
  }

  c.ResetStats();
  constexpr int kThreads = 4, kGetsEach = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kGetsEach; ++i) {
        const size_t k = static_cast<size_t>(t * kGetsEach + i);
        (void)c.BatchGetInto(std::span(&keys[k], 1), std::span(&out[k], 1));
      }
    });
  }
  for (auto& th : threads) th.join();
  s = c.stats();
  EXPECT_EQ(s.op(StoreOp::kGet).calls, uint64_t{kThreads * kGetsEach});
  EXPECT_EQ(s.get_hits(), uint64_t{kThreads * kGetsEach});
  EXPECT_EQ(s.op(StoreOp::kPut).calls, 0u);
  EXPECT_EQ(std::string(StoreOpName(StoreOp::kExists)), "exists");
}

TEST(EmbeddedStore, EvictionKeepsUsageUnderTheWatermarkAndSparesRecentlyReadObjects) {
  // 3 nodes x 8 MiB, 128 KiB objects: the cluster holds ~190 of them; we put 600.
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(3, 8u << 20, 1)));
  StoreClient& c = cluster->client();
  Buffer src(64 * kObject), dst(64 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  for (const Status& st : PutObjects(c, src, 0, 20)) ASSERT_TRUE(st.ok());
  std::vector<size_t> hot(20);
  std::iota(hot.begin(), hot.end(), 0);
  double max_fill = 0;
  int put_failures = 0;
  for (size_t at = 20; at < 600; at += 20) {
    ASSERT_EQ(GetObjects(c, dst, hot), 0) << "a recently read object was evicted";
    for (const Status& st : PutObjects(c, src, at, 20)) put_failures += !st.ok();
    for (const auto& n : Must(QueryClusterStatus(cluster->master_address())).nodes) {
      max_fill = std::max(max_fill, double(n.used_bytes) / double(n.capacity_bytes));
    }
  }
  std::printf("eviction: max node fill %.3f, %d puts refused\n", max_fill, put_failures);
  EXPECT_EQ(put_failures, 0) << "eviction did not make room";
  EXPECT_LE(max_fill, 0.9) << "usage passed the high watermark";
  ClusterStatus s = Must(QueryClusterStatus(cluster->master_address()));
  EXPECT_LT(s.objects, 600u) << "nothing was evicted";
  EXPECT_EQ(GetObjects(c, dst, hot), 0);
}

TEST(EmbeddedStore, DrainThroughTheApiMovesEveryObject) {
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(3, 32u << 20, 2)));
  StoreClient& c = cluster->client();
  Buffer src(128 * kObject), dst(128 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  for (const Status& st : PutObjects(c, src, 0, 128)) ASSERT_TRUE(st.ok());
  StorageNode& leaving = *cluster->nodes()[0];
  ASSERT_GT(leaving.object_count(), 0u);
  Status st = leaving.Drain();
  ASSERT_TRUE(st.ok()) << st.ToString();
  cluster->nodes().erase(cluster->nodes().begin());  // deregisters
  std::vector<size_t> ids(128);
  std::iota(ids.begin(), ids.end(), 0);
  EXPECT_EQ(GetObjects(c, dst, ids), 0);
  ClusterStatus s = Must(QueryClusterStatus(cluster->master_address()));
  uint64_t replicas = 0;
  for (const auto& n : s.nodes) replicas += n.state == "ACTIVE" ? n.replicas : 0;
  EXPECT_EQ(s.objects, 128u);
  EXPECT_EQ(replicas, 256u) << "drained objects lost a replica";
}

// TaskDone answers lost on the way (the master's fault injection: 4 requests lost, then 4
// replies): the node asks again, so those re-replication tasks complete within a retry
// instead of at their deadline (task_timeout_ms, 6 s here), and a drain that waits on them
// ends in about its usual time. Nothing is lost or left with one replica.
TEST(EmbeddedStore, LostTaskDoneAnswersDoNotHoldUpADrain) {
  EmbeddedClusterOptions o = SmallCluster(3, 32u << 20, 2);
  o.master.faults = "task_done_lose_request=4,task_done_lose_reply=4";
  o.master.task_timeout_ms = 6000;
  auto cluster = Must(EmbeddedCluster::Start(o));
  StoreClient& c = cluster->client();
  Buffer src(64 * kObject), dst(64 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  for (const Status& st : PutObjects(c, src, 0, 64)) ASSERT_TRUE(st.ok());
  StorageNode& leaving = *cluster->nodes()[0];
  ASSERT_GT(leaving.object_count(), 8u) << "too few tasks for every injected fault to fire";
  const auto t0 = std::chrono::steady_clock::now();
  Status st = leaving.Drain();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::printf("drain with 8 TaskDone answers lost: %.0f ms\n", ms);
  EXPECT_LT(ms, 4000) << "the lost reports were settled by the task deadline, not by asking again";
  cluster->nodes().erase(cluster->nodes().begin());  // deregisters
  std::vector<size_t> ids(64);
  std::iota(ids.begin(), ids.end(), 0);
  EXPECT_EQ(GetObjects(c, dst, ids), 0);
  ClusterStatus s = Must(QueryClusterStatus(cluster->master_address()));
  uint64_t replicas = 0;
  for (const auto& n : s.nodes) replicas += n.state == "ACTIVE" ? n.replicas : 0;
  EXPECT_EQ(s.objects, 64u);
  EXPECT_EQ(replicas, 128u);
}

TEST(EmbeddedStore, InvalidOptionsAreNamedErrors) {
  auto r = EmbeddedCluster::Start(SmallCluster(2, 8u << 20, 3));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  StoreOptions so;
  so.replica_num = 0;
  EXPECT_EQ(StoreClient::Create(so).status().code(), StatusCode::kInvalidArgument);
  so.replica_num = 1;
  so.hedge_bandwidth_mbps = 0;  // hedging on (20 ms) with no bandwidth to scale its delay by
  auto hedge = StoreClient::Create(so);
  EXPECT_EQ(hedge.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(hedge.status().message().find("hedge_bandwidth_mbps"), std::string::npos)
      << hedge.status().ToString();
  // Fault-injection specs: an unknown fault or a missing or bad count is named.
  for (const auto& [spec, named] : std::vector<std::pair<std::string, std::string>>{
           {"demote_done_drop=1", "demote_done_drop"},
           {"demote_done_lose_reply", "demote_done_lose_reply"},
           {"demote_done_lose_reply=-1", "demote_done_lose_reply=-1"},
           {"demote_done_lose_request=2,x=1", "'x'"},
           {"task_done_lose=3", "task_done_lose_reply"}}) {
    MasterOptions mo;
    mo.listen = "127.0.0.1:0";
    mo.faults = spec;
    auto m = MasterServer::Start(mo);
    ASSERT_FALSE(m.ok()) << spec;
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(m.status().message().find(named), std::string::npos) << m.status().ToString();
  }
  MasterOptions mo;
  mo.listen = "127.0.0.1:0";
  mo.faults = " demote_done_lose_request=0 ,";
  EXPECT_TRUE(MasterServer::Start(mo).ok());
  // The client's and the node's fault specs likewise.
  StoreOptions bad_client;
  bad_client.faults = "put_stall_before_write_ms=10,put_stall=1";
  auto c = StoreClient::Create(bad_client);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("'put_stall'"), std::string::npos) << c.status().ToString();
  NodeOptions bad_node;
  bad_node.faults = "task_delay_ms=x";
  auto n = StorageNode::Start(bad_node);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(n.status().message().find("task_delay_ms=x"), std::string::npos)
      << n.status().ToString();
}

// Where the replicas of `key` live, through the master's own protocol (this takes a lease).
rpc::GetItem ReplicasOf(const std::string& master, const std::string& key) {
  auto stub = rpc::Master::NewStub(grpc::CreateChannel(master, grpc::InsecureChannelCredentials()));
  rpc::GetReplicasRequest greq;
  greq.add_keys(key);
  rpc::GetReplicasReply grep;
  grpc::ClientContext ctx;
  EXPECT_TRUE(stub->GetReplicas(&ctx, greq, &grep).ok());
  return grep.items_size() == 1 ? grep.items(0) : rpc::GetItem{};
}

// Scribbles over a replica with a one-sided WRITE from an outside engine (what a late writer,
// or memory gone bad, looks like to the store).
void Scribble(const std::string& master, const rpc::ReplicaLocation& victim) {
  auto stub = rpc::Master::NewStub(grpc::CreateChannel(master, grpc::InsecureChannelCredentials()));
  rpc::NodeDescriptorsRequest dreq;
  dreq.add_node_ids(victim.node().node_id());
  rpc::NodeDescriptorsReply drep;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->GetNodeDescriptors(&ctx, dreq, &drep).ok());
  }
  ASSERT_EQ(drep.nodes_size(), 1);
  EngineOptions eo;
  eo.node_id = "vandal";
  eo.transports = {"tcp"};
  auto vandal = Must(TransferEngine::Create(eo));
  Buffer junk(kObject);
  junk.Fill(424242);
  Must(vandal->RegisterMemory(junk.data(), junk.size()));
  Must(vandal->AddPeer(drep.nodes(0).engine_descriptor()));
  TransferOp op{OpCode::kWrite,          junk.data(),         kObject,
                victim.node().node_id(), victim.segment_id(), victim.offset()};
  ASSERT_TRUE(vandal->Transfer(std::span(&op, 1)).ok());
}

// A replica whose bytes changed under the reader (what a late writer or a lapsed lease and
// reused space look like) is caught by the CRC-32C, reported, and the read is served by the
// other replica. `lease_ms` is the master's read lease. `local_copy` off: the reader reaches
// the nodes of this process over tcp, whose lanes take the checksum as the bytes land.
void CorruptOneReplicaThenRead(uint32_t lease_ms, bool local_copy = true) {
  EmbeddedClusterOptions o = SmallCluster(2, 32u << 20, 2);
  o.master.lease_ms = lease_ms;
  auto cluster = Must(EmbeddedCluster::Start(o));
  StoreClient& c = cluster->client();
  Buffer src(8 * kObject), dst(8 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  for (const Status& st : PutObjects(c, src, 0, 1)) ASSERT_TRUE(st.ok());

  const rpc::GetItem item = ReplicasOf(cluster->master_address(), Key(0));
  ASSERT_EQ(item.replicas_size(), 2);
  Scribble(cluster->master_address(), item.replicas(0));

  // Another client gets the right bytes from the other replica, even one that asks not to
  // verify (the option is ignored).
  StoreOptions so;
  so.master_address = cluster->master_address();
  so.engine.transports = {"tcp"};
  so.engine.node_id = "verifier";
  so.engine.local_copy = local_copy;
  so.verify_checksums = false;
  auto verifier = Must(StoreClient::Create(so));
  ASSERT_TRUE(verifier->RegisterBuffer(dst.data(), dst.size()).ok());
  // Reads rotate over replicas, so a few reads are sure to hit the corrupted one first.
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(GetObjects(*verifier, dst, {0}), 0) << "corrupted bytes were returned";
  }
  EXPECT_EQ(Must(QueryClusterStatus(cluster->master_address())).bad_replicas_total, 1u)
      << "the corrupted replica was never detected";
  // The bad replica was reported and dropped; re-replication restores two good copies.
  bool restored = false;
  for (int i = 0; i < 100 && !restored; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    uint64_t replicas = 0;
    for (const auto& n : Must(QueryClusterStatus(cluster->master_address())).nodes) {
      replicas += n.replicas;
    }
    restored = replicas == 2;
  }
  EXPECT_TRUE(restored);
  EXPECT_EQ(GetObjects(*verifier, dst, {0}), 0);
}

// The reads finish well inside their 3 s lease. A lease keeps the master from reusing the
// range; it does not make the bytes right. (Before, reads inside their lease skipped the
// checksum unless verify_checksums was set, and this test got the scribbled bytes back.)
TEST(EmbeddedStore, CorruptedReplicaUnderALiveLeaseIsCaught) {
  CorruptOneReplicaThenRead(/*lease_ms=*/3000);
}

// With a lease shorter than any read, every read has outlived it.
TEST(EmbeddedStore, ReadsThatOutliveTheirLeaseAreVerified) {
  CorruptOneReplicaThenRead(/*lease_ms=*/1);
}

// Read over a transport, the checksum is the one the tcp lane took as the bytes landed
// (KVB_TCAP_OP_CRC32C): it catches the corrupted replica as the client's own pass did.
TEST(EmbeddedStore, ACorruptedReplicaReadOverTcpIsCaught) {
  CorruptOneReplicaThenRead(/*lease_ms=*/3000, /*local_copy=*/false);
}

// After a large remove the client asks the storage nodes of its process to heartbeat at once:
// the frees reach them now, not at their next heartbeat (10 s apart here), where they would
// have landed in the middle of the client's next puts and gets. Both a RemoveAll and a
// BatchRemove of 256 objects or more.
TEST(EmbeddedStore, ALargeRemoveReachesTheNodesOfThisProcessAtOnce) {
  EmbeddedClusterOptions o = SmallCluster(2, 32u << 20, 1);
  o.master.node_ttl_ms = 30000;  // heartbeats every 10 s
  auto cluster = Must(EmbeddedCluster::Start(o));
  StoreClient& c = cluster->client();
  Buffer src(64 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  auto frees = [&] {
    uint64_t n = 0;
    for (const auto& node : cluster->nodes()) n += node->stats().frees_received;
    return n;
  };
  auto records = [&] {
    uint64_t n = 0;
    for (const auto& node : cluster->nodes()) n += node->object_count();
    return n;
  };
  auto within_a_second = [&](uint64_t want_frees) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while ((frees() < want_frees || records() != 0) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return frees() == want_frees && records() == 0;
  };
  for (const Status& st : PutObjects(c, src, 0, 300)) ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(records(), 300u);
  ASSERT_TRUE(c.RemoveAll().ok());
  EXPECT_TRUE(within_a_second(300))
      << frees() << " frees received, " << records() << " records left a second after RemoveAll";
  for (const Status& st : PutObjects(c, src, 300, 300)) ASSERT_TRUE(st.ok()) << st.ToString();
  std::vector<std::string> keys;
  for (size_t i = 300; i < 600; ++i) keys.push_back(Key(i));
  for (const Status& st : c.BatchRemove(keys)) ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(within_a_second(600)) << frees() << " frees received, " << records()
                                    << " records left a second after removing 300 objects";
}

// A put over tcp records the checksum its writes took as the bytes left (KVB_TCAP_OP_CRC32C)
// instead of a pass over the caller's bytes; a reader that checks with its own pass
// (tcp.op_checksums=0) and one that takes the lane's agree with it, for objects of one slice
// and of several (tcp.slice_bytes 64 KiB against 128 KiB objects), replicas on both nodes.
TEST(EmbeddedStore, APutOverTcpRecordsTheChecksumItsWritesTook) {
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(2, 32u << 20, 2)));
  auto client = [&](const std::string& name, std::map<std::string, std::string> config) {
    StoreOptions so;
    so.master_address = cluster->master_address();
    so.engine.transports = {"tcp"};
    so.engine.node_id = name;
    so.engine.local_copy = false;
    so.engine.plugin_config = std::move(config);
    so.replica_num = 2;
    return Must(StoreClient::Create(so));
  };
  auto writer = client("writer", {{"tcp.slice_bytes", "65536"}});
  auto own_pass = client("own-pass", {{"tcp.op_checksums", "0"}});
  auto lane_crc = client("lane-crc", {});
  Buffer src(16 * kObject), dst(16 * kObject);
  for (StoreClient* c : {writer.get(), own_pass.get(), lane_crc.get()}) {
    ASSERT_TRUE(c->RegisterBuffer(src.data(), src.size()).ok());
    ASSERT_TRUE(c->RegisterBuffer(dst.data(), dst.size()).ok());
  }
  // Twice: the first put finds out where its writes take checksums, the second relies on it.
  for (size_t first : {size_t{0}, size_t{8}}) {
    for (const Status& st : PutObjects(*writer, src, first, 8))
      ASSERT_TRUE(st.ok()) << st.ToString();
  }
  std::vector<size_t> ids(16);
  std::iota(ids.begin(), ids.end(), 0);
  for (StoreClient* c : {own_pass.get(), lane_crc.get(), writer.get()}) {
    for (int round = 0; round < 2; ++round) {  // reads rotate over the two replicas
      EXPECT_EQ(GetObjects(*c, dst, ids), 0) << "a recorded checksum differs from the bytes";
    }
  }
  EXPECT_EQ(Must(QueryClusterStatus(cluster->master_address())).bad_replicas_total, 0u);
}

// Re-replication checks its DRAM source against the object's CRC-32C before it copies: a
// damaged source is reported by its own node (bad_replicas_total) and the object, with no good
// copy left, is lost, rather than restored on another node with wrong bytes that would pass
// for a healthy replica until a reader checked them.
TEST(EmbeddedStore, ReReplicationDoesNotSpreadADamagedSource) {
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(3, 32u << 20, 2)));
  StoreClient& c = cluster->client();
  Buffer src(8 * kObject), dst(8 * kObject);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
  for (const Status& st : PutObjects(c, src, 0, 8)) ASSERT_TRUE(st.ok());
  const rpc::GetItem item = ReplicasOf(cluster->master_address(), Key(0));
  ASSERT_EQ(item.replicas_size(), 2);
  Scribble(cluster->master_address(), item.replicas(0));
  // The other holder of object 0 stops: object 0 is re-replicated from the damaged copy only.
  const std::string other = item.replicas(1).node().node_id();
  bool stopped = false;
  for (auto& n : cluster->nodes()) {
    if (n && n->id().node_id == other) {
      n.reset();
      stopped = true;
    }
  }
  ASSERT_TRUE(stopped);
  ClusterStatus s;
  for (int i = 0; i < 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    s = Must(QueryClusterStatus(cluster->master_address()));
    if (s.under_replicated == 0 && s.bad_replicas_total > 0) break;
  }
  EXPECT_EQ(s.bad_replicas_total, 1u) << "the damaged source was copied, not reported";
  EXPECT_EQ(s.under_replicated, 0u);
  EXPECT_EQ(s.objects, 7u) << "object 0 still listed: its damaged copy was spread";
  auto got = c.BatchGetInto(std::vector<std::string>{Key(0)},
                            std::vector<std::vector<BufferRef>>{{BufferRef{dst.data(), kObject}}});
  EXPECT_TRUE(!got[0].ok() && got[0].status().IsNotFound()) << "object 0 must be a miss";
  std::vector<size_t> rest = {1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(GetObjects(c, dst, rest), 0);
}

// A node that answers a ReadSsd "OK" without writing the bytes (a bug, a node that lost its
// memory, a stale answer) cannot make a get return whatever the caller's buffer held: the
// client checks SSD-served objects like DRAM ones, inside the lease too. The liar here is a
// registered engine with a Node service of its own, listing one object on its SSD tier.
TEST(EmbeddedStore, SsdReadAnsweredWithoutTheBytesIsCaught) {
  MasterOptions mo;
  mo.listen = "127.0.0.1:0";
  mo.node_ttl_ms = 30000;  // the liar never heartbeats
  mo.lease_ms = 5000;
  auto master = Must(MasterServer::Start(mo));
  EngineOptions eo;
  eo.node_id = "liar";
  eo.transports = {"tcp"};
  auto engine = Must(TransferEngine::Create(eo));
  Buffer pool(1 << 20);
  const SegmentId seg = Must(engine->RegisterMemory(pool.data(), pool.size()));
  struct Liar : rpc::Node::Service {
    std::atomic<int> reads{0};
    grpc::Status ReadSsd(grpc::ServerContext*, const rpc::ReadSsdRequest* req,
                         rpc::ReadSsdReply* reply) override {
      ++reads;
      reply->mutable_status()->set_code(0);
      reply->set_size(kObject);
      for (int i = 0; i < req->items_size(); ++i) {  // "served", every object asked for
        rpc::ReadSsdItemReply* item = reply->add_items();
        item->mutable_status()->set_code(0);
        item->set_size(kObject);
      }
      return grpc::Status::OK;
    }
  } liar;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&liar);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_GT(port, 0);

  Buffer src(kObject), dst(kObject);
  src.Fill(7);
  constexpr uint64_t kSsdSegment = 0x5353440000000001ull;  // the SSD tier's segment id
  rpc::RegisterNodeRequest reg;
  reg.mutable_node()->set_node_id("liar");
  reg.mutable_node()->set_incarnation(engine->self().incarnation);
  reg.set_engine_descriptor(engine->LocalDescriptor());
  reg.set_rpc_address("127.0.0.1:" + std::to_string(port));
  auto* dram = reg.add_segments();
  dram->set_segment_id(seg);
  dram->set_capacity(pool.size());
  dram->set_tier(1);
  auto* ssd = reg.add_segments();
  ssd->set_segment_id(kSsdSegment);
  ssd->set_capacity(64u << 20);
  ssd->set_tier(2);
  auto* rec = reg.add_inventory();
  rec->set_key("on-ssd");
  rec->set_version(1);
  rec->add_sizes(kObject);
  rec->set_checksum(util::Crc32c(src.data(), kObject));
  rec->set_segment_id(kSsdSegment);
  rec->set_offset(0);
  rec->set_replica_num(1);
  rec->set_replica_id(1);
  auto stub = rpc::Master::NewStub(
      grpc::CreateChannel(master->address(), grpc::InsecureChannelCredentials()));
  rpc::RegisterNodeReply rep;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->RegisterNode(&ctx, reg, &rep).ok());
  }
  ASSERT_EQ(rep.status().code(), 0) << rep.status().message();
  ASSERT_EQ(rep.frees_size(), 0);

  StoreOptions so;
  so.master_address = master->address();
  so.engine.transports = {"tcp"};
  so.engine.node_id = "reader";
  so.verify_checksums = false;  // ignored
  auto reader = Must(StoreClient::Create(so));
  ASSERT_TRUE(reader->RegisterBuffer(dst.data(), dst.size()).ok());
  auto got =
      reader->BatchGetInto(std::vector<std::string>{"on-ssd"},
                           std::vector<std::vector<BufferRef>>{{BufferRef{dst.data(), kObject}}});
  EXPECT_GE(liar.reads.load(), 1) << "the read never went to the liar";
  ASSERT_FALSE(got[0].ok()) << "a ReadSsd that wrote nothing was returned as the object";
  EXPECT_TRUE(got[0].status().Is(StatusCode::kIoError)) << got[0].status().ToString();
  EXPECT_EQ(Must(QueryClusterStatus(master->address())).bad_replicas_total, 1u);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
}

// The daemons' operator surface.
class Daemons : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = testing::FreePort();
    addr_ = "127.0.0.1:" + std::to_string(port_);
    master_ = ChildProcess::Start({kBin, "master", "--listen", addr_});
    ASSERT_TRUE(master_);
    ASSERT_NE(master_->ReadLine(20000).find("listening on"), std::string::npos);
  }
  std::string Run(const std::vector<std::string>& args, int* code) {
    std::vector<std::string> argv = {kBin};
    argv.insert(argv.end(), args.begin(), args.end());
    auto p = ChildProcess::Start(argv);
    std::string out = p->ReadAll(10000);
    *code = p->Wait(10000);
    return out;
  }
  uint16_t port_ = 0;
  std::string addr_;
  std::unique_ptr<ChildProcess> master_;
};

TEST_F(Daemons, ConfigFileStatusTableAndJson) {
  char path[] = "/tmp/kvb-node-conf-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream f(path);
    f << "# a node's config\nmaster = " << addr_ << "\nnode_dram_bytes = 33554432\n"
      << "node_id = conf-node\n";
  }
  auto node = ChildProcess::Start({kBin, "node", "--config", path});
  ASSERT_TRUE(node);
  ASSERT_NE(node->ReadLine(20000).find("serving 33554432 bytes"), std::string::npos);
  int code = -1;
  std::string table = Run({"status", "--master", addr_}, &code);
  EXPECT_EQ(code, 0) << table;
  EXPECT_NE(table.find("conf-node"), std::string::npos) << table;
  EXPECT_NE(table.find("ACTIVE"), std::string::npos) << table;
  EXPECT_NE(table.find("32.0 MiB"), std::string::npos) << table;
  std::string json = Run({"status", "--master", addr_, "--json"}, &code);
  EXPECT_EQ(code, 0);
  EXPECT_NE(json.find("\"node_id\": \"conf-node\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"capacity_bytes\": 33554432"), std::string::npos) << json;
  EXPECT_NE(json.find("\"departed_copies\": 0,"), std::string::npos) << json;
  EXPECT_NE(table.find("copies remembered for nodes that left: 0"), std::string::npos) << table;
  // Bad flags and files are named errors.
  std::string bad = Run({"node", "--dram-bytes", "lots"}, &code);
  EXPECT_EQ(code, 2);
  Run({"node", "--config", "/nonexistent/kvb.conf"}, &code);
  EXPECT_EQ(code, 2);
  Run({"frobnicate"}, &code);
  EXPECT_EQ(code, 2);
  unlink(path);
}

TEST_F(Daemons, StatusOfAnUnreachableMasterIsANamedError) {
  int code = -1;
  master_->Kill();
  Run({"status", "--master", addr_}, &code);
  EXPECT_EQ(code, 1);
}

TEST_F(Daemons, GarbageOnTheMasterPortHurtsNobody) {
  auto node = ChildProcess::Start(
      {kBin, "node", "--master", addr_, "--node-id", "g-node", "--dram-bytes", "16777216"});
  ASSERT_NE(node->ReadLine(20000).find("serving"), std::string::npos);
  std::mt19937 rng(3);
  for (int i = 0; i < 20; ++i) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port_);
    ASSERT_EQ(connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    std::string junk(1 + rng() % 4096, '\0');
    for (auto& ch : junk) ch = static_cast<char>(rng());
    if (i % 2) junk.replace(0, 3, "PRI");  // looks like an HTTP/2 preface, then nonsense
    (void)!write(s, junk.data(), junk.size());
    close(s);
  }
  StoreOptions so;
  so.master_address = addr_;
  so.engine.transports = {"tcp"};
  so.engine.node_id = "g-client";
  auto client = Must(StoreClient::Create(so));
  ASSERT_TRUE(client->Put("after-garbage", "still fine").ok());
  EXPECT_EQ(Must(client->Get("after-garbage")), "still fine");
}

}  // namespace
}  // namespace kvbridge
