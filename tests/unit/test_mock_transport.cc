// The mock transport (plugins/testing/mock_transport.cc) driven through core::TransportInstance,
// the one wrapper of a transport's ops table: the engine and conformance tests rely on the mock
// behaving like a real transport, so its asynchrony, bounds checks, identity checks, deadlines,
// cancel and fault hooks are pinned here, and so is the wrapper's part: ABI statuses and error
// buffers mapped to Status, per-op codes, and the RAII Peer / Request handles.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/plugin_loader.h"
#include "core/transport_instance.h"
#include "util/clock.h"

namespace kvbridge::core {
namespace {

using Clock = std::chrono::steady_clock;
using SetFaultFn = int32_t (*)(const char*, int32_t, int32_t, uint32_t);
using PostCountFn = uint64_t (*)(const char*);
using Peer = TransportInstance::Peer;
using Request = TransportInstance::Request;

const std::string kMockPath =
    std::string(KVBRIDGE_TEST_PLUGIN_BUILD_DIR) + "/libkvb_transport_mock.so";

void CountCompletion(void* user) { static_cast<std::atomic<int>*>(user)->fetch_add(1); }

kvb_status_t Code(const Status& st) { return static_cast<kvb_status_t>(st.code()); }

// One mock instance with one registered region (segment 1).
struct Instance {
  std::string node_id;
  uint64_t incarnation = 0;
  std::unique_ptr<TransportInstance> t;
  std::vector<uint8_t> mem;
};

class MockTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_ = std::make_shared<PluginRegistry>();
    info_ = &registry_->LoadFile(kMockPath);
    ASSERT_EQ(info_->state, PluginState::kLoaded) << info_->reason;
    void* h = dlopen(kMockPath.c_str(), RTLD_NOW | RTLD_NOLOAD);
    ASSERT_NE(h, nullptr);
    set_fault_ = reinterpret_cast<SetFaultFn>(dlsym(h, "kvb_mock_set_fault"));
    post_count_ = reinterpret_cast<PostCountFn>(dlsym(h, "kvb_mock_post_count"));
    dlclose(h);  // drops only the reference NOLOAD added
    ASSERT_NE(set_fault_, nullptr);
    ASSERT_NE(post_count_, nullptr);
    a_ = Create("mt-a", 11);
    b_ = Create("mt-b", 22);
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    peer_b_ = AddPeer(*a_, *b_);
    ASSERT_NE(peer_b_, nullptr);
  }
  void TearDown() override {
    peer_b_.reset();     // handles before their instances
    instances_.clear();  // destroy
  }

  Result<std::unique_ptr<TransportInstance>> TryCreate(
      const std::string& node_id, uint64_t incarnation,
      std::map<std::string, std::string> config = {}) {
    TransportConfig c;
    c.node_id = node_id;
    c.incarnation = incarnation;
    c.plugin_config = std::move(config);
    return TransportInstance::Create(registry_, *info_, c);
  }
  Instance* Create(const std::string& node_id, uint64_t incarnation,
                   std::map<std::string, std::string> config = {}) {
    auto inst = std::make_unique<Instance>();
    inst->node_id = node_id;
    inst->incarnation = incarnation;
    inst->mem.assign(1 << 16, 0);
    auto t = TryCreate(node_id, incarnation, std::move(config));
    if (!t.ok()) {
      ADD_FAILURE() << "create failed: " << t.status().ToString();
      return nullptr;
    }
    inst->t = std::move(t).value();
    auto rkey = inst->t->RegisterMemory(1, inst->mem.data(), inst->mem.size(), KVB_MEM_HOST, -1);
    EXPECT_TRUE(rkey.ok()) << rkey.status().ToString();
    instances_.push_back(std::move(inst));
    return instances_.back().get();
  }
  void Destroy(Instance* inst) { inst->t.reset(); }
  std::unique_ptr<Peer> AddPeer(Instance& from, Instance& to) {
    EXPECT_FALSE(to.t->endpoints().empty());
    auto peer = from.t->AddPeer({.node_id = to.node_id,
                                 .incarnation = to.incarnation,
                                 .endpoints = to.t->endpoints(),
                                 .segments = {}});
    EXPECT_TRUE(peer.ok()) << peer.status().ToString();
    return peer.ok() ? std::move(peer).value() : nullptr;
  }

  kvb_xfer_op_t Op(uint32_t opcode, size_t local_off, size_t len, uint64_t remote_off,
                   uint64_t remote_segment = 1) {
    return {opcode, 0, 1, a_->mem.data() + local_off, len, remote_segment, remote_off, nullptr};
  }
  // Posts one op from a_ to b_'s region (local segment 1 of a_); the code post() returned.
  kvb_status_t Post(uint32_t opcode, size_t local_off, size_t len, uint64_t remote_off,
                    std::unique_ptr<Request>* req, uint64_t deadline_ns = 0,
                    uint64_t progress_ns = 0, uint64_t remote_segment = 1) {
    kvb_xfer_op_t op = Op(opcode, local_off, len, remote_off, remote_segment);
    auto r = a_->t->Post(*peer_b_, {&op, 1},
                         {.deadline_ns = deadline_ns,
                          .progress_timeout_ns = progress_ns,
                          .on_complete = CountCompletion,
                          .user = &completions_});
    err_ = r.status().message();
    if (r.ok()) *req = std::move(r).value();
    return Code(r.status());
  }
  // Polls until final (at most 5 s); returns the final code (message in err_).
  kvb_status_t Wait(TransportInstance& t, Request& req, kvb_status_t* op_status = nullptr) {
    auto until = Clock::now() + std::chrono::seconds(5);
    TransportInstance::PollResult r;
    while (!(r = t.Poll(req)).final && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    err_ = r.status.message();
    if (op_status != nullptr && !r.op_codes.empty()) *op_status = r.op_codes[0];
    return Code(r.status);
  }
  kvb_status_t Wait(Request& req, kvb_status_t* op_status = nullptr) {
    return Wait(*a_->t, req, op_status);
  }
  kvb_status_t PostAndWait(uint32_t opcode, size_t local_off, size_t len, uint64_t remote_off,
                           uint64_t remote_segment = 1) {
    std::unique_ptr<Request> req;
    kvb_status_t st = Post(opcode, local_off, len, remote_off, &req, 0, 0, remote_segment);
    if (st != KVB_OK) return st;
    return Wait(*req);  // released when req goes
  }
  // After a delayed write to b_[0..64) was cancelled: its one completion came, and the write
  // does not land later.
  void ExpectCancelledWriteNeverLands(const char* what) {
    EXPECT_EQ(completions_.load(), 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_EQ(b_->mem[0], 0) << what << " write landed";
    EXPECT_EQ(completions_.load(), 1);
  }
  TransportStats Stats(Instance& inst) {
    Result<TransportStats> s = inst.t->Stats();
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? s.value() : TransportStats{};
  }

  std::shared_ptr<PluginRegistry> registry_;
  const PluginInfo* info_ = nullptr;
  SetFaultFn set_fault_ = nullptr;
  PostCountFn post_count_ = nullptr;
  std::vector<std::unique_ptr<Instance>> instances_;
  Instance* a_ = nullptr;
  Instance* b_ = nullptr;
  std::unique_ptr<Peer> peer_b_;
  std::atomic<int> completions_{0};
  std::string err_;
};

TEST_F(MockTransportTest, WriteAndReadAreAsynchronousAndCompleteOnce) {
  for (size_t i = 0; i < 4096; ++i) a_->mem[i] = static_cast<uint8_t>(i * 7);
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/50), KVB_OK);
  std::unique_ptr<Request> req;
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 4096, 100, &req), KVB_OK) << err_;
  TransportInstance::PollResult early = a_->t->Poll(*req);
  EXPECT_FALSE(early.final);
  EXPECT_TRUE(early.status.Is(StatusCode::kInProgress));
  ASSERT_EQ(early.op_codes.size(), 1u);
  EXPECT_EQ(early.op_codes[0], KVB_IN_PROGRESS);
  kvb_status_t op_st = KVB_IN_PROGRESS;
  EXPECT_EQ(Wait(*req, &op_st), KVB_OK) << err_;
  EXPECT_EQ(op_st, KVB_OK);
  EXPECT_EQ(completions_.load(), 1);
  req.reset();
  EXPECT_EQ(0, std::memcmp(b_->mem.data() + 100, a_->mem.data(), 4096));
  EXPECT_EQ(b_->mem[99], 0);
  EXPECT_EQ(b_->mem[4196], 0);

  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, 0), KVB_OK);
  EXPECT_EQ(PostAndWait(KVB_OP_READ, 8192, 4096, 100), KVB_OK) << err_;
  EXPECT_EQ(0, std::memcmp(a_->mem.data() + 8192, a_->mem.data(), 4096));
  EXPECT_EQ(completions_.load(), 2);

  TransportStats stats = Stats(*a_);
  EXPECT_EQ(stats.name, "mock");
  EXPECT_EQ(stats.bytes_written, 4096u);
  EXPECT_EQ(stats.bytes_read, 4096u);
  EXPECT_EQ(stats.queued_bytes, 0u);
}

TEST_F(MockTransportTest, EndpointsNameTheNode) {
  EXPECT_EQ(b_->t->endpoints(), "mock:mt-b");
  EXPECT_EQ(b_->t->name(), "mock");
  EXPECT_EQ(b_->t->caps(), info_->caps);
}

TEST_F(MockTransportTest, RemoteBoundsAreChecked) {
  const uint64_t size = b_->mem.size();
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 16, 0, /*remote_segment=*/9), KVB_ERR_NOT_REGISTERED);
  EXPECT_NE(std::string(err_).find("not registered"), std::string::npos) << err_;
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 16, size - 8), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(PostAndWait(KVB_OP_READ, 0, 16, UINT64_MAX - 4), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 16, size - 16), KVB_OK);
  EXPECT_EQ(Stats(*b_).frames_rejected, 3u);
  ASSERT_TRUE(b_->t->DeregisterMemory(1).ok());
  EXPECT_TRUE(b_->t->DeregisterMemory(1).IsNotFound());
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 16, 0), KVB_ERR_NOT_REGISTERED);
}

TEST_F(MockTransportTest, BadPostsQueueNothing) {
  std::unique_ptr<Request> req;
  std::vector<uint8_t> unregistered(64);
  kvb_xfer_op_t op{KVB_OP_WRITE, 0, 1, unregistered.data(), 64, 1, 0, nullptr};
  auto bad = a_->t->Post(*peer_b_, {&op, 1}, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(bad.status().Is(StatusCode::kNotRegistered)) << bad.status().ToString();
  EXPECT_FALSE(bad.status().message().empty()) << "the plugin's message is kept";
  // Runs past the end of the local region.
  EXPECT_EQ(Post(KVB_OP_WRITE, a_->mem.size() - 8, 16, 0, &req), KVB_ERR_NOT_REGISTERED);
  EXPECT_EQ(Post(KVB_OP_WRITE, 0, 0, 0, &req), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(Post(7, 0, 16, 0, &req), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(req, nullptr);
  EXPECT_EQ(completions_.load(), 0);
}

TEST_F(MockTransportTest, ReplacedIncarnationIsStaleAndUntouched) {
  Destroy(b_);
  Instance* b2 = Create("mt-b", 23);
  ASSERT_NE(b2, nullptr);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_ERR_STALE_PEER);
  EXPECT_NE(std::string(err_).find("incarnation 23"), std::string::npos) << err_;
  for (uint8_t byte : b2->mem) ASSERT_EQ(byte, 0);
  Destroy(b2);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_ERR_PEER_UNREACHABLE);
}

TEST_F(MockTransportTest, SecondLiveInstanceWithSameNodeIdIsRefused) {
  auto t = TryCreate("mt-b", 99);
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(t.status().Is(StatusCode::kAlreadyExists)) << t.status().ToString();
  EXPECT_NE(t.status().message().find("transport 'mock' (" + kMockPath + ") failed to start"),
            std::string::npos)
      << t.status().ToString();
}

TEST_F(MockTransportTest, DeadlineEndsADelayedRequest) {
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/2000), KVB_OK);
  std::unique_ptr<Request> req;
  auto t0 = Clock::now();
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req, util::MonoNs() + util::MsToNs(100)), KVB_OK);
  EXPECT_EQ(Wait(*req), KVB_ERR_DEADLINE_EXCEEDED);
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_GE(ms, 95);
  EXPECT_LT(ms, 1000);
  EXPECT_EQ(completions_.load(), 1);
}

TEST_F(MockTransportTest, DelayLongerThanProgressTimeoutIsAFrozenPeer) {
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/2000), KVB_OK);
  std::unique_ptr<Request> req;
  ASSERT_EQ(
      Post(KVB_OP_WRITE, 0, 64, 0, &req, util::MonoNs() + util::MsToNs(1500), util::MsToNs(50)),
      KVB_OK);
  EXPECT_EQ(Wait(*req), KVB_ERR_PROGRESS_TIMEOUT);
}

TEST_F(MockTransportTest, CancelIsFinalAtOnceAndTouchesNothingAfter) {
  for (size_t i = 0; i < 64; ++i) a_->mem[i] = 0xee;
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/100), KVB_OK);
  std::unique_ptr<Request> req;
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req), KVB_OK);
  a_->t->Cancel(*req);
  a_->t->Cancel(*req);  // idempotent
  EXPECT_TRUE(req->final());
  TransportInstance::PollResult r = a_->t->Poll(*req);
  EXPECT_TRUE(r.final);
  EXPECT_TRUE(r.status.Is(StatusCode::kCancelled)) << r.status.ToString();
  ASSERT_EQ(r.op_codes.size(), 1u);
  EXPECT_EQ(r.op_codes[0], KVB_ERR_CANCELLED);
  ExpectCancelledWriteNeverLands("a cancelled");
}

TEST_F(MockTransportTest, RemovePeerAndDestroyCancelOutstanding) {
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/5000), KVB_OK);
  std::unique_ptr<Request> r1;
  std::unique_ptr<Request> r2;
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &r1), KVB_OK);
  peer_b_.reset();  // remove_peer
  EXPECT_TRUE(a_->t->Poll(*r1).status.Is(StatusCode::kCancelled));
  r1.reset();
  peer_b_ = AddPeer(*a_, *b_);
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &r2), KVB_OK);
  auto t0 = Clock::now();
  Destroy(a_);  // r2 (and the peer) are cancelled and freed with the instance
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2)) << "destroy waited for a delayed request";
  EXPECT_EQ(completions_.load(), 2);
  r2.reset();       // inert: its instance is gone
  peer_b_.reset();  // likewise
}

TEST_F(MockTransportTest, RunTimeFaultsFailTheNextPostsAndAreCounted) {
  const uint64_t before = post_count_("mt-a");
  ASSERT_EQ(set_fault_("mt-a", KVB_ERR_PEER_UNREACHABLE, 2, 0), KVB_OK);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_ERR_PEER_UNREACHABLE);
  EXPECT_NE(std::string(err_).find("injected"), std::string::npos) << err_;
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_ERR_PEER_UNREACHABLE);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_OK);
  EXPECT_EQ(post_count_("mt-a"), before + 3);

  // Queue-bound errors fail post() itself: nothing queued, no completion.
  ASSERT_EQ(set_fault_("mt-a", KVB_ERR_BACKPRESSURE, -1, 0), KVB_OK);
  const int completions = completions_.load();
  std::unique_ptr<Request> req;
  EXPECT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req), KVB_ERR_BACKPRESSURE);
  EXPECT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req), KVB_ERR_BACKPRESSURE);
  EXPECT_EQ(req, nullptr);
  EXPECT_EQ(completions_.load(), completions);
  EXPECT_EQ(post_count_("mt-a"), before + 5);

  EXPECT_EQ(set_fault_("nobody", KVB_ERR_IO, 1, 0), KVB_ERR_NOT_FOUND);
  EXPECT_EQ(post_count_("nobody"), UINT64_MAX);
}

TEST_F(MockTransportTest, FaultsFromConfigAtCreate) {
  Instance* c = Create("mt-c", 33, {{"mock.fail_code", "STALE_PEER"}, {"mock.fail_count", "1"}});
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Peer> peer = AddPeer(*c, *b_);
  kvb_xfer_op_t op{KVB_OP_WRITE, 0, 1, c->mem.data(), 64, 1, 0, nullptr};
  for (kvb_status_t want : {KVB_ERR_STALE_PEER, KVB_OK}) {
    auto req = c->t->Post(*peer, {&op, 1}, {});
    ASSERT_TRUE(req.ok()) << req.status().ToString();
    EXPECT_EQ(Wait(*c->t, *req.value()), want);
  }
  peer.reset();
  auto bad = TryCreate("mt-bad", 1, {{"mock.fail_code", "NOT_A_CODE"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(bad.status().Is(StatusCode::kInvalidArgument)) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("mock.fail_code"), std::string::npos)
      << bad.status().ToString();
}

TEST_F(MockTransportTest, ConcurrentPostsFromManyThreads) {
  constexpr int kThreads = 4, kPerThread = 200;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        kvb_xfer_op_t op{
            KVB_OP_WRITE, 0, 1, a_->mem.data() + t * 1024, 1024, 1, static_cast<uint64_t>(t) * 1024,
            nullptr};
        auto req = a_->t->Post(*peer_b_, {&op, 1}, {});
        if (!req.ok()) continue;
        TransportInstance::PollResult r;
        while (!(r = a_->t->Poll(*req.value())).final) std::this_thread::yield();
        if (r.status.ok()) ok.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads * kPerThread);
}

// --- the wrapper's own part ---------------------------------------------------------------

TEST_F(MockTransportTest, PollGivesPerOpCodesAndTheFailedOpsMessage) {
  const std::vector<kvb_xfer_op_t> ops = {Op(KVB_OP_WRITE, 0, 64, 0),
                                          Op(KVB_OP_WRITE, 64, 64, 0, /*remote_segment=*/9),
                                          Op(KVB_OP_WRITE, 128, 64, b_->mem.size() - 8)};
  auto req = a_->t->Post(*peer_b_, ops, {});
  ASSERT_TRUE(req.ok()) << req.status().ToString();
  EXPECT_EQ(req.value()->num_ops(), 3u);
  TransportInstance::PollResult r;
  for (auto until = Clock::now() + std::chrono::seconds(5);
       !(r = a_->t->Poll(*req.value())).final && Clock::now() < until;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(r.final);
  ASSERT_EQ(r.op_codes.size(), 3u);
  EXPECT_EQ(r.op_codes[0], KVB_OK);
  EXPECT_EQ(r.op_codes[1], KVB_ERR_NOT_REGISTERED);
  EXPECT_EQ(r.op_codes[2], KVB_ERR_OUT_OF_BOUNDS);
  // The request's status is the lowest failed op's, with the plugin's message.
  EXPECT_TRUE(r.status.Is(StatusCode::kNotRegistered)) << r.status.ToString();
  EXPECT_NE(r.status.message().find("not registered"), std::string::npos) << r.status.ToString();
}

TEST_F(MockTransportTest, ARequestDroppedUnpolledIsCancelledAndReleased) {
  for (size_t i = 0; i < 64; ++i) a_->mem[i] = 0xee;
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/100), KVB_OK);
  std::unique_ptr<Request> req;
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req), KVB_OK);
  EXPECT_FALSE(req->final());
  req.reset();  // cancel + release: nothing outstanding, nothing lands later
  EXPECT_EQ(Stats(*a_).queued_bytes, 0u);
  ExpectCancelledWriteNeverLands("a dropped request's");
}

TEST_F(MockTransportTest, DroppingThePeerCancelsItsRequests) {
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/5000), KVB_OK);
  std::unique_ptr<Request> req;
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req), KVB_OK);
  peer_b_.reset();  // remove_peer
  TransportInstance::PollResult r = a_->t->Poll(*req);
  EXPECT_TRUE(r.final);
  EXPECT_TRUE(r.status.Is(StatusCode::kCancelled)) << r.status.ToString();
  EXPECT_EQ(r.op_codes, std::vector<kvb_status_t>{KVB_ERR_CANCELLED});
}

TEST_F(MockTransportTest, UpdatePeerKeepsTheHandle) {
  const TransportInstance::PeerSegment seg{
      .id = 1, .mem_kind = KVB_MEM_HOST, .length = 4096, .rkey = {}};
  EXPECT_TRUE(a_->t
                  ->UpdatePeer(*peer_b_, {.node_id = b_->node_id,
                                          .incarnation = b_->incarnation,
                                          .endpoints = b_->t->endpoints(),
                                          .segments = {&seg, 1}})
                  .ok());
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_OK) << err_;
}

// mock.local_only=1 (ABI 1.5): the wrapper reports the registration local-only; a peer's op into
// such a region is refused NOT_REGISTERED and lands nothing, while the owner's own op from it
// goes through.
TEST_F(MockTransportTest, LocalOnlyRegionsServeTheirOwnerOnly) {
  Instance* c = Create("mt-lo", 33, {{"mock.local_only", "1"}});
  ASSERT_NE(c, nullptr);
  auto reg = c->t->RegisterMemory(2, c->mem.data() + 4096, 4096, KVB_MEM_HOST, -1);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_TRUE(reg->local_only);
  auto plain = a_->t->RegisterMemory(2, a_->mem.data(), 64, KVB_MEM_HOST, -1);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_FALSE(plain->local_only);

  std::unique_ptr<Peer> to_c = AddPeer(*a_, *c);
  ASSERT_NE(to_c, nullptr);
  std::memset(a_->mem.data(), 7, 64);
  kvb_xfer_op_t into_c = Op(KVB_OP_WRITE, 0, 64, 0, 1);
  auto r = a_->t->Post(*to_c, {&into_c, 1}, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Wait(**r), KVB_ERR_NOT_REGISTERED) << err_;
  EXPECT_EQ(c->mem[0], 0) << "a peer's WRITE landed in a local-only region";

  std::unique_ptr<Peer> to_b = AddPeer(*c, *b_);
  ASSERT_NE(to_b, nullptr);
  std::memset(c->mem.data(), 9, 64);
  kvb_xfer_op_t from_c = {KVB_OP_WRITE, 0, 1, c->mem.data(), 64, 1, 128, nullptr};
  auto w = c->t->Post(*to_b, {&from_c, 1}, {});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(Wait(*c->t, **w), KVB_OK) << err_;
  EXPECT_EQ(b_->mem[128], 9);
}

TEST_F(MockTransportTest, RegisterRefusalIsAStatusNamingTheTransport) {
  // Segment 1 is registered already: the mock refuses it again.
  auto again = a_->t->RegisterMemory(1, a_->mem.data(), 64, KVB_MEM_HOST, -1);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("transport 'mock'"), std::string::npos)
      << again.status().ToString();
}

}  // namespace
}  // namespace kvbridge::core
