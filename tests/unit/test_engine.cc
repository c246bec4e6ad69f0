// Transfer-engine behaviour that does not need real sockets: circuit breaker, stale peers,
// deadlines, plugin selection. Uses the in-process mock transport (plugins/testing), loaded
// through the real loader, and its fault-injection hooks.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/descriptor.h"
#include "kvbridge/engine.h"
#include "kvbridge/plugin/transport.h"
#include "tests/common/test_util.h"
#include "util/host_key.h"

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
    Tweak(oa);
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

  virtual void Tweak(EngineOptions&) {}

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

// An engine's descriptor (version 3) carries its host key and each transport's caps; with a
// cluster token it is sealed, and an engine with a token takes only descriptors sealed under
// the same token: an unsealed one (a process without the token) and one sealed under another
// token are UNAUTHENTICATED, and the peer is not added.
TEST(EngineDescriptor, CarriesHostKeyAndCapsAndIsSealedUnderTheToken) {
  auto make = [](const std::string& id, const std::string& token) {
    EngineOptions o = LoopbackOptions("mock", id);
    o.cluster_token = token;
    return Must(TransferEngine::Create(o));
  };
  auto a = make("seal-a", "token-1");
  auto b = make("seal-b", "token-1");
  auto open = make("seal-open", "");
  auto other = make("seal-other", "token-2");

  core::Descriptor d = Must(core::DecodeDescriptor(b->LocalDescriptor(), "token-1"));
  EXPECT_TRUE(d.sealed);
  EXPECT_EQ(d.host_key, util::HostKey());
  EXPECT_FALSE(d.host_key.empty());
  ASSERT_EQ(d.transports.size(), 1u);
  EXPECT_NE(d.transports[0].caps & KVB_TCAP_WRITE, 0u);

  EXPECT_TRUE(a->AddPeer(b->LocalDescriptor()).ok());
  Result<PeerId> r = a->AddPeer(open->LocalDescriptor());
  EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated) << r.status().ToString();
  EXPECT_NE(r.status().message().find("seal-open"), std::string::npos) << r.status().ToString();
  r = a->AddPeer(other->LocalDescriptor());
  EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated) << r.status().ToString();
  EXPECT_FALSE(a->GetPeerHealth("seal-open").has_value());
  EXPECT_FALSE(a->GetPeerHealth("seal-other").has_value());
  // An engine without a token cannot check a seal, and takes a sealed descriptor as it is.
  EXPECT_TRUE(open->AddPeer(b->LocalDescriptor()).ok());
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

// Small bounds, to push past them: engine-a keeps at most 4 batches in flight and 2 finished
// ones nobody polled, and takes at most 8 ops per batch.
class EngineBoundsTest : public EngineMockTest {
 protected:
  void Tweak(EngineOptions& o) override {
    o.max_inflight_batches = 4;
    o.max_unpolled_batches = 2;
    o.max_ops_per_batch = 8;
  }
  Result<BatchId> SubmitWrite(uint32_t deadline_ms = 10000) {
    SubmitOptions so;
    so.deadline_ms = deadline_ms;
    return a_->Submit(
        std::vector{TransferOp{OpCode::kWrite, mem_a_.data(), 4096, "eng-b", seg_b_, 0}}, so);
  }
};

TEST_F(EngineBoundsTest, SubmitPastMaxInflightBatchesIsBackpressureUntilOneEnds) {
  set_fault_("eng-a", KVB_OK, 0, /*delay_ms=*/1500);  // each batch takes 1.5 s
  std::vector<BatchId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(Must(SubmitWrite()));
  const uint64_t posts = post_count_("eng-a");
  Result<BatchId> fifth = SubmitWrite();
  ASSERT_FALSE(fifth.ok());
  EXPECT_EQ(fifth.status().code(), StatusCode::kBackpressure) << fifth.status().ToString();
  EXPECT_NE(fifth.status().message().find("4 batches are in flight (max_inflight_batches = 4)"),
            std::string::npos)
      << fifth.status().ToString();
  EXPECT_EQ(post_count_("eng-a"), posts) << "a refused batch reached the transport";
  // One cancelled (final, but not polled): the next Submit finds it final and is admitted.
  a_->Cancel(ids[0]);
  set_fault_("eng-a", KVB_OK, 0, 0);
  BatchId next = Must(SubmitWrite());
  EXPECT_TRUE(a_->Wait(next).status.ok());
  EXPECT_EQ(a_->Wait(ids[0]).status.code(), StatusCode::kCancelled) << "its result was lost";
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_TRUE(a_->Wait(ids[i]).status.ok());
}

TEST_F(EngineBoundsTest, FinishedBatchesNobodyPollsAreReapedOldestFirst) {
  std::vector<BatchId> ids;
  for (int round = 0; round < 50; ++round) {
    // At the in-flight bound Submit sweeps for finished batches; on a loaded machine the mock
    // may not have finished any yet (BACKPRESSURE): then it is tried again a little later.
    Result<BatchId> id = SubmitWrite();
    for (int tries = 0; !id.ok() && tries < 1000; ++tries) {
      ASSERT_EQ(id.status().code(), StatusCode::kBackpressure) << id.status().ToString();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      id = SubmitWrite();
    }
    ids.push_back(Must(std::move(id)));
  }
  // 50 submitted and never polled: at most 4 in flight and 2 finished are kept; the rest,
  // oldest first, were reaped, and polling one says so by its id.
  std::optional<BatchResult> first = a_->Poll(ids[0]);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->status.code(), StatusCode::kNotFound);
  EXPECT_NE(first->status.message().find("batch " + std::to_string(ids[0]) + " was reaped"),
            std::string::npos)
      << first->status.ToString();
  EXPECT_NE(first->status.message().find("max_unpolled_batches (2)"), std::string::npos);
  size_t kept = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    BatchResult r = a_->Wait(ids[i]);
    if (r.status.ok()) {
      ++kept;
      EXPECT_GE(i, ids.size() - 6) << "batch " << ids[i] << " kept while newer ones were reaped";
    } else {
      EXPECT_EQ(r.status.code(), StatusCode::kNotFound) << r.status.ToString();
    }
  }
  EXPECT_LE(kept, 6u) << "more than max_inflight_batches + max_unpolled_batches kept";
  EXPECT_GE(kept, 3u);
  // An id never submitted is not said to be reaped.
  std::optional<BatchResult> never = a_->Poll(ids.back() + 1000);
  ASSERT_TRUE(never.has_value());
  EXPECT_NE(never->status.message().find("unknown batch"), std::string::npos);
}

TEST_F(EngineBoundsTest, MoreOpsThanMaxOpsPerBatchIsANamedError) {
  std::vector<TransferOp> ops(9, TransferOp{OpCode::kWrite, mem_a_.data(), 64, "eng-b", seg_b_, 0});
  const uint64_t posts = post_count_("eng-a");
  Result<BatchId> r = a_->Submit(ops);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("9 ops exceed max_ops_per_batch (8)"), std::string::npos)
      << r.status().ToString();
  EXPECT_EQ(post_count_("eng-a"), posts);
  ops.pop_back();
  EXPECT_TRUE(a_->Transfer(ops).ok());
}

TEST(EngineOptionsBounds, DefaultsAndVariables) {
  EngineOptions d;
  EXPECT_EQ(d.max_ops_per_batch, 1u << 20);
  EXPECT_EQ(d.max_inflight_batches, 65536u);
  EXPECT_EQ(d.max_unpolled_batches, 65536u);
  setenv("KVBRIDGE_MAX_OPS_PER_BATCH", "100", 1);
  setenv("KVBRIDGE_MAX_INFLIGHT_BATCHES", "7", 1);
  setenv("KVBRIDGE_MAX_UNPOLLED_BATCHES", "3", 1);
  EngineOptions e = EngineOptions::FromEnv();
  unsetenv("KVBRIDGE_MAX_OPS_PER_BATCH");
  unsetenv("KVBRIDGE_MAX_INFLIGHT_BATCHES");
  unsetenv("KVBRIDGE_MAX_UNPOLLED_BATCHES");
  EXPECT_EQ(e.max_ops_per_batch, 100u);
  EXPECT_EQ(e.max_inflight_batches, 7u);
  EXPECT_EQ(e.max_unpolled_batches, 3u);
}

}  // namespace
}  // namespace kvbridge
