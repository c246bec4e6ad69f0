// Transfer-engine behaviour that does not need real sockets: circuit breaker, stale peers,
// deadlines, plugin selection. Uses the in-process mock transport (plugins/testing), loaded
// through the real loader, and its fault-injection hooks.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/descriptor.h"
#include "kvbridge/engine.h"
#include "tests/common/test_util.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::LoopbackOptions;
using testing::Must;
using Clock = std::chrono::steady_clock;

using SetFaultFn = int32_t (*)(const char*, int32_t, int32_t, uint32_t);
using PostCountFn = uint64_t (*)(const char*);

class EngineMockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions oa = LoopbackOptions("mock", "eng-a");
    oa.breaker_failures = 3;
    oa.breaker_backoff_ms = 100;
    oa.breaker_max_backoff_ms = 400;
    a_ = Must(TransferEngine::Create(oa));
    b_ = Must(TransferEngine::Create(LoopbackOptions("mock", "eng-b")));
    Must(a_->RegisterMemory(mem_a_.data(), mem_a_.size()));
    seg_b_ = Must(b_->RegisterMemory(mem_b_.data(), mem_b_.size()));
    Must(a_->AddPeer(b_->LocalDescriptor()));
    void* h =
        dlopen(KVBRIDGE_TEST_PLUGIN_BUILD_DIR "/libkvb_transport_mock.so", RTLD_NOW | RTLD_NOLOAD);
    ASSERT_NE(h, nullptr) << "mock transport not loaded by the engine";
    set_fault_ = reinterpret_cast<SetFaultFn>(dlsym(h, "kvb_mock_set_fault"));
    post_count_ = reinterpret_cast<PostCountFn>(dlsym(h, "kvb_mock_post_count"));
    ASSERT_NE(set_fault_, nullptr);
    ASSERT_NE(post_count_, nullptr);
    dlclose(h);  // drops only the reference NOLOAD added
  }

  Status WriteToB(uint32_t deadline_ms = 0) {
    SubmitOptions so;
    so.deadline_ms = deadline_ms;
    return a_->Transfer(
        std::vector{TransferOp{OpCode::kWrite, mem_a_.data(), 4096, "eng-b", seg_b_, 0}}, so);
  }

  Buffer mem_a_{1 << 20}, mem_b_{1 << 20};
  std::unique_ptr<TransferEngine> a_, b_;
  SegmentId seg_b_ = 0;
  SetFaultFn set_fault_ = nullptr;
  PostCountFn post_count_ = nullptr;
};

TEST_F(EngineMockTest, BreakerOpensFailsFastThenRecoversThroughProbe) {
  set_fault_("eng-a", KVB_ERR_PEER_UNREACHABLE, -1, 0);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(WriteToB().IsPeerUnreachable());
  const uint64_t posts_when_open = post_count_("eng-a");
  EXPECT_EQ(a_->GetPeerHealth("eng-b")->breaker, BreakerState::kOpen);
  // Open: ops fail at once and never reach the transport.
  for (int i = 0; i < 20; ++i) {
    Status st = WriteToB();
    EXPECT_TRUE(st.IsPeerUnreachable());
    EXPECT_NE(st.message().find("circuit open"), std::string::npos) << st.ToString();
  }
  EXPECT_EQ(post_count_("eng-a"), posts_when_open) << "breaker let ops through while open";
  EXPECT_EQ(a_->GetPeerHealth("eng-b")->fast_failed_ops, 20u);
  // After the backoff one probe goes through; it fails, so the breaker re-opens (longer).
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EXPECT_FALSE(WriteToB().ok());
  EXPECT_EQ(post_count_("eng-a"), posts_when_open + 1);
  EXPECT_FALSE(WriteToB().ok());
  EXPECT_EQ(post_count_("eng-a"), posts_when_open + 1);
  // Peer heals; the next probe succeeds and closes the breaker.
  set_fault_("eng-a", KVB_OK, 0, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(220));
  EXPECT_TRUE(WriteToB().ok());
  EXPECT_EQ(a_->GetPeerHealth("eng-b")->breaker, BreakerState::kClosed);
  EXPECT_TRUE(WriteToB().ok());
}

TEST_F(EngineMockTest, RefusalsByALivePeerDoNotOpenBreaker) {
  set_fault_("eng-a", KVB_ERR_OUT_OF_BOUNDS, -1, 0);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(WriteToB().code(), StatusCode::kOutOfBounds);
  EXPECT_EQ(a_->GetPeerHealth("eng-b")->breaker, BreakerState::kClosed);
}

TEST_F(EngineMockTest, DeadlineEndsASlowBatchWithNamedCode) {
  set_fault_("eng-a", KVB_OK, 0, /*delay_ms=*/2000);
  auto t0 = Clock::now();
  Status st = WriteToB(/*deadline_ms=*/150);
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_TRUE(st.IsDeadlineExceeded()) << st.ToString();
  EXPECT_LT(ms, 1000) << "batch outlived its deadline";
  EXPECT_GE(ms, 140);
}

TEST_F(EngineMockTest, StalePeerFailsFastUntilNewDescriptor) {
  b_.reset();
  auto b2 = Must(TransferEngine::Create(LoopbackOptions("mock", "eng-b")));
  Buffer mem(1 << 20);
  mem.Fill(7);
  Must(b2->RegisterMemory(mem.data(), mem.size()));
  EXPECT_TRUE(WriteToB().IsStalePeer());
  const uint64_t posts = post_count_("eng-a");
  Status st = WriteToB();
  EXPECT_TRUE(st.IsStalePeer());
  EXPECT_NE(st.message().find("AddPeer"), std::string::npos) << st.ToString();
  EXPECT_EQ(post_count_("eng-a"), posts) << "stale peer was contacted again";
  EXPECT_TRUE(a_->GetPeerHealth("eng-b")->stale);
  Must(a_->AddPeer(b2->LocalDescriptor()));
  EXPECT_TRUE(WriteToB().ok());
  EXPECT_FALSE(mem.Matches(7, 0, 4096, 0));
}

TEST_F(EngineMockTest, RegistrationRules) {
  Buffer m(8192);
  SegmentId s = Must(a_->RegisterMemory(m.data(), 4096));
  EXPECT_EQ(a_->RegisterMemory(m.data() + 100, 10).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(a_->RegisterMemory(nullptr, 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->RegisterMemory(m.data(), 0).status().code(), StatusCode::kInvalidArgument);
  Must(a_->RegisterMemory(m.data() + 4096, 4096));  // adjacent is fine
  EXPECT_TRUE(a_->DeregisterMemory(s).ok());
  EXPECT_TRUE(a_->DeregisterMemory(s).IsNotFound());
}

TEST(EngineMemoryKinds, CudaMemoryWithoutACudaTransportIsANamedError) {
  // No transport built here handles device memory yet: registering it must say so, not
  // pretend. (The descriptor already carries the memory kind for when one does.)
  auto e = Must(TransferEngine::Create(LoopbackOptions("tcp", "cuda-kind")));
  Buffer m(4096);
  auto r = e->RegisterMemory(m.data(), m.size(), MemoryKind::kCuda, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(r.status().message().find("CUDA"), std::string::npos) << r.status().ToString();
}

TEST_F(EngineMockTest, MalformedDescriptorIsNamedError) {
  auto r = a_->AddPeer("not a descriptor at all");
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("descriptor"), std::string::npos);
}

// A descriptor of a known (node id, incarnation) may add segments but not move the peer to
// other endpoints: whoever hands this engine descriptors (a re-replication task, a read
// request, a directory) could otherwise re-route its traffic for that peer through another
// address. And a descriptor that is not the identity the caller expects is refused.
TEST_F(EngineMockTest, AddPeerRefusesToMoveAKnownPeer) {
  Buffer more(4096);
  const SegmentId seg2 = Must(b_->RegisterMemory(more.data(), more.size()));
  Must(a_->AddPeer(b_->LocalDescriptor()));  // one more segment: an update
  EXPECT_TRUE(
      a_->Transfer(std::vector{TransferOp{OpCode::kWrite, mem_a_.data(), 4096, "eng-b", seg2, 0}})
          .ok());
  core::Descriptor moved = Must(core::DecodeDescriptor(b_->LocalDescriptor()));
  ASSERT_FALSE(moved.transports.empty());
  for (auto& t : moved.transports) t.endpoints = "attacker:1";
  Result<PeerId> r = a_->AddPeer(core::EncodeDescriptor(moved));
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists) << r.status().ToString();
  EXPECT_NE(r.status().message().find("attacker:1"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(WriteToB().ok()) << "the refused descriptor changed the peer";

  const PeerId other{"eng-c", 1};
  AddPeerOptions expect;
  expect.expect = &other;
  r = a_->AddPeer(b_->LocalDescriptor(), expect);
  EXPECT_TRUE(r.status().IsStalePeer()) << r.status().ToString();
  const PeerId b = b_->self();
  expect.expect = &b;
  EXPECT_TRUE(a_->AddPeer(b_->LocalDescriptor(), expect).ok());
}

TEST_F(EngineMockTest, StructuralErrorsRefuseWholeBatch) {
  std::vector<TransferOp> ops = {
      TransferOp{OpCode::kWrite, mem_a_.data(), 4096, "eng-b", seg_b_, 0},
      TransferOp{OpCode::kWrite, mem_a_.data(), 0, "eng-b", seg_b_, 0}};
  auto r = a_->Submit(ops);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("op 1"), std::string::npos) << r.status().ToString();
  ops[1].length = 1;
  ops[1].opcode = static_cast<OpCode>(9);
  EXPECT_EQ(a_->Submit(ops).status().code(), StatusCode::kInvalidArgument);
}

TEST(EnginePlugins, ExplicitUnavailableTransportIsAnErrorWithReason) {
  EngineOptions o = LoopbackOptions("no_such_transport", "x");
  auto r = TransferEngine::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("no_such_transport"), std::string::npos);
}

TEST(EnginePlugins, AutoSelectionSkipsBrokenPluginsAndKeepsGoing) {
  EngineOptions o;
  o.node_id = "auto";
  o.plugin_path = KVBRIDGE_TEST_PLUGIN_BUILD_DIR;  // holds refused and unavailable plugins too
  auto e = Must(TransferEngine::Create(o));
  auto names = e->transports();
  EXPECT_NE(std::find(names.begin(), names.end(), "mock"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "tcp"), names.end());
}

}  // namespace
}  // namespace kvbridge
