// Several transports per peer (docs/transfer-engine.md "Several transports per peer"): path
// choice as a table, and failover between two in-process transports, "mock" and "mock_b" (the
// same plugin built twice, plugins/testing/CMakeLists.txt), each with its own fault hooks.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/descriptor.h"
#include "core/path_choice.h"
#include "kvbridge/engine.h"
#include "kvbridge/plugin/transport.h"
#include "tests/common/test_util.h"

namespace kvbridge {
namespace {

using core::ChoosePaths;
using core::PathChoice;
using core::PathView;
using testing::Buffer;
using testing::Must;
using Clock = std::chrono::steady_clock;

// --- Path choice, a pure function ------------------------------------------------------------

PathView Eligible(std::string_view name) {
  return {
      .transport = name, .remote_registered = true, .local_registered = true, .kinds_served = true};
}
PathView Refusing(std::string_view name, uint32_t failures, uint64_t retry_ms) {
  PathView v = Eligible(name);
  v.breaker_refuses = true;
  v.consecutive_failures = failures;
  v.retry_in_ms = retry_ms;
  return v;
}

struct ChoiceCase {
  const char* name;
  std::vector<PathView> paths;
  std::vector<uint32_t> order;
  uint32_t admitting;
  StatusCode code;
  std::vector<std::string> message_has;
};

class PathChoiceTable : public ::testing::TestWithParam<ChoiceCase> {};

TEST_P(PathChoiceTable, Case) {
  const ChoiceCase& c = GetParam();
  PathChoice got = ChoosePaths(c.paths, "peer@1");
  EXPECT_EQ(got.order, c.order);
  EXPECT_EQ(got.admitting, c.admitting);
  EXPECT_EQ(got.status.code(), c.code) << got.status.ToString();
  for (const auto& s : c.message_has) {
    EXPECT_NE(got.status.message().find(s), std::string::npos)
        << "'" << s << "' not in: " << got.status.ToString();
  }
}

PathView NoRemoteKey(std::string_view n) {
  PathView v = Eligible(n);
  v.remote_registered = false;
  return v;
}
PathView NotLocal(std::string_view n) {
  PathView v = Eligible(n);
  v.local_registered = false;
  return v;
}
PathView NoKinds(std::string_view n) {
  PathView v = Eligible(n);
  v.kinds_served = false;
  return v;
}
PathView Direct(std::string_view n) {
  PathView v = Eligible(n);
  v.device_direct = true;
  return v;
}

INSTANTIATE_TEST_SUITE_P(
    PathChoice, PathChoiceTable,
    ::testing::Values(
        ChoiceCase{
            "PreferenceOrderKept", {Eligible("a"), Eligible("b")}, {0, 1}, 2, StatusCode::kOk, {}},
        ChoiceCase{"SinglePath", {Eligible("a")}, {0}, 1, StatusCode::kOk, {}},
        ChoiceCase{"DeviceDirectPathGoesFirst",
                   {Eligible("tcp"), Direct("ucx"), Eligible("c")},
                   {1, 0, 2},
                   3,
                   StatusCode::kOk,
                   {}},
        ChoiceCase{"RefusingDeviceDirectPathStillGoesAfterAdmittingOnes",
                   {Eligible("tcp"),
                    [] {
                      PathView v = Refusing("ucx", 2, 50);
                      v.device_direct = true;
                      return v;
                    }(),
                    Refusing("c", 1, 5)},
                   {0, 1, 2},
                   1,
                   StatusCode::kOk,
                   {}},
        ChoiceCase{"RefusingBreakerGoesLast",
                   {Refusing("a", 3, 100), Eligible("b"), Eligible("c")},
                   {1, 2, 0},
                   2,
                   StatusCode::kOk,
                   {}},
        ChoiceCase{"TwoRefusingKeepTheirOrderAtTheEnd",
                   {Refusing("a", 3, 100), Eligible("b"), Refusing("c", 5, 7)},
                   {1, 0, 2},
                   1,
                   StatusCode::kOk,
                   {}},
        ChoiceCase{"MissingRemoteKeyIsIneligible",
                   {NoRemoteKey("a"), Eligible("b")},
                   {1},
                   1,
                   StatusCode::kOk,
                   {}},
        ChoiceCase{"LocalRegionNotRegisteredIsIneligible",
                   {Eligible("a"), NotLocal("b")},
                   {0},
                   1,
                   StatusCode::kOk,
                   {}},
        ChoiceCase{"KindsNotServedIsIneligible",
                   {NoKinds("a"), Eligible("b")},
                   {1},
                   1,
                   StatusCode::kOk,
                   {}},
        ChoiceCase{"OneRefusingPathKeepsTheSingleTransportMessage",
                   {Refusing("a", 3, 150)},
                   {0},
                   0,
                   StatusCode::kPeerUnreachable,
                   {"circuit open for peer peer@1 after 3 consecutive failures; next probe in "
                    "150 ms"}},
        ChoiceCase{"EveryPathRefusingNamesEach",
                   {Refusing("a", 3, 150), Refusing("b", 4, 90)},
                   {0, 1},
                   0,
                   StatusCode::kPeerUnreachable,
                   {"circuit open for peer peer@1 on every path",
                    "a after 3 consecutive failures, next probe in 150 ms",
                    "b after 4 consecutive failures, next probe in 90 ms"}},
        ChoiceCase{"IneligibleAndRefusingNamesOnlyTheRefusing",
                   {NoRemoteKey("a"), Refusing("b", 3, 10)},
                   {1},
                   0,
                   StatusCode::kPeerUnreachable,
                   {"peer@1 after 3 consecutive failures"}},
        ChoiceCase{"NoneEligibleIsUnsupportedNamingWhy",
                   {NoRemoteKey("a"), NotLocal("b"), NoKinds("c")},
                   {},
                   0,
                   StatusCode::kUnsupported,
                   {"no path to peer peer@1", "a: the remote segment has no key for it",
                    "b: the local region is not registered with it",
                    "c: it does not serve these memory kinds"}},
        ChoiceCase{"NoPathAtAll", {}, {}, 0, StatusCode::kUnsupported, {"the peer has no path"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(PathChoice, ServesKindsByCap) {
  const uint64_t host = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM;
  EXPECT_TRUE(core::ServesKinds(host, KVB_MEM_HOST, KVB_MEM_HOST));
  EXPECT_FALSE(core::ServesKinds(KVB_TCAP_READ | KVB_TCAP_WRITE, KVB_MEM_HOST, KVB_MEM_HOST));
  EXPECT_FALSE(core::ServesKinds(host, KVB_MEM_CUDA, KVB_MEM_HOST));
  EXPECT_FALSE(core::ServesKinds(host, KVB_MEM_HOST, KVB_MEM_CUDA));
  EXPECT_TRUE(core::ServesKinds(host | KVB_TCAP_CUDA_MEM, KVB_MEM_CUDA, KVB_MEM_HOST));
  EXPECT_TRUE(core::ServesKinds(host | KVB_TCAP_CUDA_MEM, KVB_MEM_HOST, KVB_MEM_CUDA));
  EXPECT_TRUE(core::ServesKinds(host | KVB_TCAP_CUDA_MEM, KVB_MEM_CUDA, KVB_MEM_CUDA));
  const uint64_t cuda_only = KVB_TCAP_READ | KVB_TCAP_CUDA_MEM;
  EXPECT_FALSE(core::ServesKinds(cuda_only, KVB_MEM_CUDA, KVB_MEM_HOST));
  EXPECT_FALSE(core::ServesKinds(cuda_only, 7, KVB_MEM_CUDA));
}

// --- Two engines, two paths ------------------------------------------------------------------

using SetFaultFn = int32_t (*)(const char*, int32_t, int32_t, uint32_t);
using PostCountFn = uint64_t (*)(const char*);
using SetPartialFaultFn = int32_t (*)(const char*, int32_t, int32_t, uint32_t);

struct MockHooks {
  SetFaultFn set_fault = nullptr;
  PostCountFn post_count = nullptr;
  SetPartialFaultFn set_partial_fault = nullptr;
};

MockHooks HooksOf(const std::string& path) {
  MockHooks h;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return h;
  h.set_fault = reinterpret_cast<SetFaultFn>(dlsym(lib, "kvb_mock_set_fault"));
  h.post_count = reinterpret_cast<PostCountFn>(dlsym(lib, "kvb_mock_post_count"));
  h.set_partial_fault =
      reinterpret_cast<SetPartialFaultFn>(dlsym(lib, "kvb_mock_set_partial_fault"));
  dlclose(lib);  // drops only the reference NOLOAD added
  return h;
}

EngineOptions TwoPathOptions(const std::string& node_id) {
  EngineOptions o;
  o.node_id = node_id;
  o.transports = {"mock", "mock_b"};
  o.plugin_path = std::string(KVBRIDGE_TEST_PLUGIN_BUILD_DIR) + ":" +
                  KVBRIDGE_TEST_PLUGIN_BUILD_DIR + "/multipath";
  o.breaker_failures = 3;
  o.breaker_backoff_ms = 5000;  // an open breaker stays open for the test's length
  o.breaker_max_backoff_ms = 5000;
  o.local_copy = false;  // the paths are under test, for peers in this process too
  return o;
}

class MultipathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions oa = TwoPathOptions("mp-a");
    Tweak(oa);
    a_ = Must(TransferEngine::Create(oa));
    b_ = Must(TransferEngine::Create(TwoPathOptions("mp-b")));
    ASSERT_EQ(a_->transports(), (std::vector<std::string>{"mock", "mock_b"}));
    Must(a_->RegisterMemory(mem_a_.data(), mem_a_.size()));
    seg_b_ = Must(b_->RegisterMemory(mem_b_.data(), mem_b_.size()));
    Must(a_->AddPeer(b_->LocalDescriptor()));
    mock_ = HooksOf(std::string(KVBRIDGE_TEST_PLUGIN_BUILD_DIR) + "/libkvb_transport_mock.so");
    mock_b_ = HooksOf(std::string(KVBRIDGE_TEST_PLUGIN_BUILD_DIR) +
                      "/multipath/libkvb_transport_mock_b.so");
    ASSERT_NE(mock_.set_fault, nullptr);
    ASSERT_NE(mock_b_.set_fault, nullptr);
    ASSERT_NE(mock_.post_count, mock_b_.post_count) << "mock_b is not a library of its own";
  }
  virtual void Tweak(EngineOptions&) {}

  TransferOp Op(OpCode code, size_t off = 0, uint64_t len = 4096) {
    return TransferOp{code, mem_a_.data() + off, len, "mp-b", seg_b_, off};
  }
  BatchResult Run(std::vector<TransferOp> ops, uint32_t deadline_ms = 0, uint32_t progress_ms = 0) {
    SubmitOptions so;
    so.deadline_ms = deadline_ms;
    so.progress_timeout_ms = progress_ms;
    Result<BatchId> id = a_->Submit(ops, so);
    if (!id.ok()) return BatchResult{id.status(), {}, {}};
    return a_->Wait(id.value());
  }
  PathHealth PathOf(size_t k) { return a_->GetPeerHealth("mp-b")->paths.at(k); }

  Buffer mem_a_{1 << 20}, mem_b_{1 << 20};
  std::unique_ptr<TransferEngine> a_, b_;
  SegmentId seg_b_ = 0;
  MockHooks mock_, mock_b_;
};

TEST_F(MultipathTest, PeerHasOnePathPerSharedTransportAndUsesThePreferredOne) {
  std::optional<PeerHealth> h = a_->GetPeerHealth("mp-b");
  ASSERT_TRUE(h.has_value());
  ASSERT_EQ(h->paths.size(), 2u);
  EXPECT_EQ(h->paths[0].transport, "mock");
  EXPECT_EQ(h->paths[1].transport, "mock_b");
  EXPECT_EQ(h->transport, "mock");
  const uint64_t b_posts = mock_b_.post_count("mp-a");
  mem_a_.Fill(11, 0, 4096);
  BatchResult r = Run({Op(OpCode::kWrite)});
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(r.op_path_history.empty());
  EXPECT_TRUE(mem_b_.Matches(11, 0, 4096, 0));
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts) << "a healthy preferred path was passed over";
  EXPECT_EQ(PathOf(0).ops_ok, 1u);
  EXPECT_EQ(PathOf(1).ops_ok, 0u);
}

// The acceptance test: threads of 64 KiB writes and read-backs for ~3 s; after 1 s the
// preferred path fails every request forever. Nothing may fail, every byte must verify.
TEST_F(MultipathTest, FailoverOnPathFaultLosesNoOp) {
  constexpr int kThreads = 4;
  constexpr size_t kSlot = 64 << 10;
  static_assert(2 * kThreads * kSlot <= (1 << 20));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ok_ops{0}, failed_ops{0}, bad_bytes{0};
  std::vector<std::string> first_error(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const size_t woff = 2 * t * kSlot, roff = woff + kSlot;  // in mem_a_; woff also in mem_b_
      for (uint64_t iter = 0; !stop.load(); ++iter) {
        const uint64_t seed = (static_cast<uint64_t>(t) << 32) | iter;
        mem_a_.Fill(seed, woff, kSlot);
        std::vector<TransferOp> w = {
            TransferOp{OpCode::kWrite, mem_a_.data() + woff, kSlot, "mp-b", seg_b_, woff}};
        std::vector<TransferOp> rd = {
            TransferOp{OpCode::kRead, mem_a_.data() + roff, kSlot, "mp-b", seg_b_, woff}};
        for (auto* ops : {&w, &rd}) {
          Status st = a_->Transfer(*ops);
          if (st.ok()) {
            ok_ops.fetch_add(1);
          } else if (failed_ops.fetch_add(1) == 0 || first_error[t].empty()) {
            first_error[t] = st.ToString();
          }
        }
        if (!mem_a_.Matches(seed, roff, kSlot, woff)) bad_bytes.fetch_add(1);
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const uint64_t ok_before = ok_ops.load();
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, -1, 0), KVB_OK);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  stop = true;
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(first_error[t], "") << "thread " << t;
  EXPECT_EQ(failed_ops.load(), 0u);
  EXPECT_EQ(bad_bytes.load(), 0u);
  EXPECT_GT(ok_before, 0u);
  EXPECT_GT(ok_ops.load(), ok_before + 100) << "little traffic after the fault";
  const PeerHealth h = *a_->GetPeerHealth("mp-b");
  EXPECT_EQ(h.paths[0].breaker, BreakerState::kOpen);
  EXPECT_GT(h.paths[0].failed_over_from, 0u);
  EXPECT_GT(h.paths[0].fast_failed, 0u) << "ops kept trying the open path first";
  EXPECT_EQ(h.paths[1].breaker, BreakerState::kClosed);
  EXPECT_GT(h.paths[1].ops_ok, 100u);
  EXPECT_EQ(h.fast_failed_ops, 0u);
}

// A request that partly succeeded on the preferred path: only its failed ops move, so the
// second path carries exactly their bytes.
TEST_F(MultipathTest, OnlyFailedOpsFailOver) {
  ASSERT_NE(mock_.set_partial_fault, nullptr);
  ASSERT_EQ(mock_.set_partial_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, 1, /*first_failing_op=*/2),
            KVB_OK);
  mem_a_.Fill(31, 0, 4 * 4096);
  const uint64_t b_written = Must(a_->GetTransportStats("mock_b")).bytes_written;
  BatchResult r = Run({Op(OpCode::kWrite, 0), Op(OpCode::kWrite, 4096), Op(OpCode::kWrite, 8192),
                       Op(OpCode::kWrite, 12288)});
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(mem_b_.Matches(31, 0, 4 * 4096, 0));
  EXPECT_EQ(Must(a_->GetTransportStats("mock_b")).bytes_written - b_written, 2u * 4096)
      << "ops that succeeded on the first path were sent again";
  ASSERT_EQ(r.op_path_history.size(), 4u);
  EXPECT_EQ(r.op_path_history[0], "");
  EXPECT_EQ(r.op_path_history[1], "");
  EXPECT_NE(r.op_path_history[2].find("then mock_b: OK"), std::string::npos);
  EXPECT_NE(r.op_path_history[3].find("then mock_b: OK"), std::string::npos);
  EXPECT_EQ(PathOf(0).ops_ok, 2u);
  EXPECT_EQ(PathOf(0).failed_over_from, 2u);
  EXPECT_EQ(PathOf(1).ops_ok, 2u);
}

TEST_F(MultipathTest, FrozenPathFailsOverAfterProgressTimeout) {
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_OK, 0, /*delay_ms=*/3000), KVB_OK);
  mem_a_.Fill(21, 0, 8192);
  // The read asks for its checksum: neither mock takes one (no KVB_TCAP_OP_CRC32C), so the
  // engine posts it without the ask on both paths and leaves it not computed.
  OpChecksum crc{.crc32c = 77, .computed = false};
  TransferOp read = Op(OpCode::kRead, 8192);
  read.checksum = &crc;
  const auto t0 = Clock::now();
  BatchResult r = Run({Op(OpCode::kWrite, 0), read}, /*deadline_ms=*/2000, /*progress_ms=*/100);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_GE(ms, 90);
  EXPECT_LT(ms, 1000) << "failover waited for more than the progress timeout";
  EXPECT_TRUE(mem_b_.Matches(21, 0, 4096, 0));
  EXPECT_EQ(std::memcmp(mem_a_.data() + 8192, mem_b_.data() + 8192, 4096), 0);
  EXPECT_FALSE(crc.computed);
  EXPECT_EQ(crc.crc32c, 77u);
  ASSERT_EQ(r.op_path_history.size(), 2u);
  for (const std::string& h : r.op_path_history) {
    EXPECT_NE(h.find("mock: PROGRESS_TIMEOUT"), std::string::npos) << h;
    EXPECT_NE(h.find("; then mock_b: OK"), std::string::npos) << h;
  }
  EXPECT_EQ(PathOf(0).failed_over_from, 2u);
  EXPECT_EQ(PathOf(0).consecutive_failures, 1u);
  EXPECT_EQ(PathOf(1).ops_ok, 2u);
}

// There is no background driver: a batch nobody polls fails over when it is next polled, as
// long as enough of its deadline is left.
TEST_F(MultipathTest, UnpolledBatchFailsOverWhenPolled) {
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_OK, 0, /*delay_ms=*/3000), KVB_OK);
  SubmitOptions so;
  so.deadline_ms = 2000;
  so.progress_timeout_ms = 100;
  const BatchId id = Must(a_->Submit(std::vector{Op(OpCode::kRead)}, so));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the first path timed out
  BatchResult r = a_->Wait(id);
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(PathOf(1).ops_ok, 1u);
}

// A cancelled batch never fails over, even when its failed request is found after the cancel.
TEST_F(MultipathTest, CancelledBatchNeverFailsOver) {
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_OK, 0, /*delay_ms=*/3000), KVB_OK);
  const uint64_t b_posts = mock_b_.post_count("mp-a");
  SubmitOptions so;
  so.deadline_ms = 2000;
  so.progress_timeout_ms = 100;
  const BatchId id = Must(a_->Submit(std::vector{Op(OpCode::kRead)}, so));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // final on mock, not yet polled
  a_->Cancel(id);
  BatchResult r = a_->Wait(id);
  EXPECT_EQ(r.status.code(), StatusCode::kProgressTimeout) << r.status.ToString();
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts) << "a cancelled batch failed over";
}

TEST_F(MultipathTest, NoFailoverPastDeadline) {
  // (1) Too little of the deadline left when the preferred path times out: no failover.
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_OK, 0, /*delay_ms=*/3000), KVB_OK);
  uint64_t b_posts = mock_b_.post_count("mp-a");
  auto t0 = Clock::now();
  BatchResult r = Run({Op(OpCode::kWrite)}, /*deadline_ms=*/150, /*progress_ms=*/148);
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_FALSE(r.status.ok());
  EXPECT_LE(ms, 150 + 50);
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts) << "failed over with under 5 ms left";

  // (2) Failed over, and the second path is frozen too: the batch still ends by its deadline,
  // with the history in the message.
  ASSERT_EQ(mock_b_.set_fault("mp-a", KVB_OK, 0, /*delay_ms=*/3000), KVB_OK);
  b_posts = mock_b_.post_count("mp-a");
  t0 = Clock::now();
  r = Run({Op(OpCode::kRead)}, /*deadline_ms=*/300, /*progress_ms=*/200);
  ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_EQ(r.status.code(), StatusCode::kDeadlineExceeded) << r.status.ToString();
  EXPECT_GE(ms, 290);
  EXPECT_LE(ms, 300 + 50);
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts + 1);
  EXPECT_NE(r.status.message().find("mock: PROGRESS_TIMEOUT"), std::string::npos)
      << r.status.ToString();
  EXPECT_NE(r.status.message().find("; then mock_b: DEADLINE_EXCEEDED"), std::string::npos)
      << r.status.ToString();
}

TEST_F(MultipathTest, StaleNeverFailsOver) {
  b_.reset();
  auto b2 = Must(TransferEngine::Create(TwoPathOptions("mp-b")));
  Buffer mem(1 << 20);
  mem.Fill(7);
  const SegmentId seg2 = Must(b2->RegisterMemory(mem.data(), mem.size()));
  ASSERT_EQ(seg2, seg_b_);
  const uint64_t b_posts = mock_b_.post_count("mp-a");
  BatchResult r = Run({Op(OpCode::kWrite)});
  EXPECT_TRUE(r.status.IsStalePeer()) << r.status.ToString();
  EXPECT_TRUE(r.op_path_history.empty());
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts) << "a stale peer was tried on another path";
  EXPECT_TRUE(mem.Matches(7, 0, 4096, 0)) << "bytes landed in the new incarnation";
  EXPECT_TRUE(a_->GetPeerHealth("mp-b")->stale);
  EXPECT_TRUE(Run({Op(OpCode::kWrite)}).status.IsStalePeer());
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts);
  // The new incarnation replaces every path (fresh breakers and counters).
  Must(a_->AddPeer(b2->LocalDescriptor()));
  const PeerHealth h = *a_->GetPeerHealth("mp-b");
  EXPECT_FALSE(h.stale);
  ASSERT_EQ(h.paths.size(), 2u);
  EXPECT_EQ(h.paths[0].ops_failed, 0u);
  EXPECT_TRUE(Run({Op(OpCode::kWrite)}).status.ok());
}

TEST_F(MultipathTest, AKnownIncarnationMovesOnNoPath) {
  core::Descriptor moved = Must(core::DecodeDescriptor(b_->LocalDescriptor()));
  for (auto& t : moved.transports) {
    if (t.name == "mock_b") t.endpoints = "mock_b:attacker";
  }
  Result<PeerId> r = a_->AddPeer(core::EncodeDescriptor(moved));
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists) << r.status().ToString();
  EXPECT_NE(r.status().message().find("mock_b mock_b:attacker"), std::string::npos)
      << r.status().ToString();
  Must(a_->AddPeer(b_->LocalDescriptor()));  // the same routes: an update
}

// A region a transport registered KVB_REG_LOCAL_ONLY (ABI 1.5; the verbs transport does this
// with CUDA memory it stages through host buffers) is the local memory of its own engine's ops
// over that transport, but its key stays out of the descriptor: peers reach it over another
// path, and a peer with no other path is told so before anything is posted.
TEST(MultipathLocalOnly, LocalOnlyKeysStayOutOfTheDescriptor) {
  EngineOptions oa = TwoPathOptions("lo-a");
  oa.plugin_config["mock.local_only"] = "1";
  auto a = Must(TransferEngine::Create(oa));
  auto b = Must(TransferEngine::Create(TwoPathOptions("lo-b")));
  EngineOptions oc = TwoPathOptions("lo-c");
  oc.transports = {"mock"};
  auto c = Must(TransferEngine::Create(oc));
  Buffer mem_a(1 << 16), mem_b(1 << 16), mem_c(1 << 16);
  const SegmentId seg_a = Must(a->RegisterMemory(mem_a.data(), mem_a.size()));
  const SegmentId seg_b = Must(b->RegisterMemory(mem_b.data(), mem_b.size()));
  Must(c->RegisterMemory(mem_c.data(), mem_c.size()));

  const core::Descriptor da = Must(core::DecodeDescriptor(a->LocalDescriptor()));
  ASSERT_EQ(da.segments.size(), 1u);
  EXPECT_EQ(da.segments[0].rkeys.count("mock"), 0u) << "a local-only key was published";
  EXPECT_EQ(da.segments[0].rkeys.count("mock_b"), 1u);
  const core::Descriptor db = Must(core::DecodeDescriptor(b->LocalDescriptor()));
  EXPECT_EQ(db.segments.at(0).rkeys.count("mock"), 1u);

  Must(a->AddPeer(b->LocalDescriptor()));
  Must(b->AddPeer(a->LocalDescriptor()));
  Must(c->AddPeer(a->LocalDescriptor()));

  // A's own op: its local-only region is the local memory of a WRITE over mock.
  mem_a.Fill(21, 0, 4096);
  Status st =
      a->Transfer(std::vector<TransferOp>{{OpCode::kWrite, mem_a.data(), 4096, "lo-b", seg_b, 0}});
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(mem_b.Matches(21, 0, 4096, 0));
  EXPECT_EQ(a->GetPeerHealth("lo-b")->paths.at(0).transport, "mock");
  EXPECT_EQ(a->GetPeerHealth("lo-b")->paths.at(0).ops_ok, 1u);

  // B's ops to A's region: not over mock (no key for it), over mock_b, READ and WRITE.
  mem_b.Fill(22, 0, 4096);
  st = b->Transfer(
      std::vector<TransferOp>{{OpCode::kWrite, mem_b.data(), 4096, "lo-a", seg_a, 4096},
                              {OpCode::kRead, mem_b.data() + 8192, 4096, "lo-a", seg_a, 0}});
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(mem_a.Matches(22, 4096, 4096, 0));
  EXPECT_TRUE(mem_b.Matches(21, 8192, 4096, 0));
  const PeerHealth hb = *b->GetPeerHealth("lo-a");
  ASSERT_EQ(hb.paths.size(), 2u);
  EXPECT_EQ(hb.paths[0].ops_ok + hb.paths[0].ops_failed, 0u) << "mock was tried";
  EXPECT_EQ(hb.paths[1].ops_ok, 2u);

  // C speaks only mock: no path reaches A's region, and C says so without posting.
  st = c->Transfer(std::vector<TransferOp>{{OpCode::kWrite, mem_c.data(), 4096, "lo-a", seg_a, 0}});
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.ToString();
  EXPECT_EQ(c->GetPeerHealth("lo-a")->paths.at(0).ops_failed, 0u);
  EXPECT_TRUE(mem_a.Matches(21, 0, 4096, 0)) << "bytes reached a local-only region";
}

// The fixture with one of engine A's boolean options turned off.
template <bool EngineOptions::*kOff>
class MultipathWithout : public MultipathTest {
 protected:
  void Tweak(EngineOptions& o) override { o.*kOff = false; }
};
using MultipathNoWriteFailoverTest = MultipathWithout<&EngineOptions::path_failover_writes>;
using MultipathNoFailoverTest = MultipathWithout<&EngineOptions::path_failover>;

TEST_F(MultipathNoWriteFailoverTest, WritesDoNotFailOverWhenDisabled) {
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, 1, 0), KVB_OK);
  const uint64_t b_posts = mock_b_.post_count("mp-a");
  BatchResult w = Run({Op(OpCode::kWrite)});
  EXPECT_TRUE(w.status.IsPeerUnreachable()) << w.status.ToString();
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts) << "a WRITE failed over";
  // READs still fail over.
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, 1, 0), KVB_OK);
  BatchResult rd = Run({Op(OpCode::kRead)});
  EXPECT_TRUE(rd.status.ok()) << rd.status.ToString();
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts + 1);
  // In a mixed batch only the READ moves.
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, 1, 0), KVB_OK);
  BatchResult mixed = Run({Op(OpCode::kWrite, 0), Op(OpCode::kRead, 8192)});
  ASSERT_EQ(mixed.op_status.size(), 2u);
  EXPECT_TRUE(mixed.op_status[0].IsPeerUnreachable()) << mixed.op_status[0].ToString();
  EXPECT_TRUE(mixed.op_status[1].ok()) << mixed.op_status[1].ToString();
}

TEST_F(MultipathNoFailoverTest, PathFailoverOffKeepsTheFirstError) {
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, 1, 0), KVB_OK);
  const uint64_t b_posts = mock_b_.post_count("mp-a");
  EXPECT_TRUE(Run({Op(OpCode::kRead)}).status.IsPeerUnreachable());
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts);
}

TEST_F(MultipathTest, BackpressureAtPostMovesToTheNextPath) {
  // Refused by post() itself: nothing was queued, so even a WRITE moves at once.
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_ERR_BACKPRESSURE, 1, 0), KVB_OK);
  BatchResult r = Run({Op(OpCode::kWrite)});
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.op_path_history.size(), 1u);
  EXPECT_NE(r.op_path_history[0].find("mock: BACKPRESSURE"), std::string::npos);
  EXPECT_NE(r.op_path_history[0].find("then mock_b: OK"), std::string::npos);
}

TEST_F(MultipathTest, BreakerPerPath) {
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, -1, 0), KVB_OK);
  for (int i = 0; i < 3; ++i) {
    BatchResult r = Run({Op(OpCode::kRead)});
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  }
  EXPECT_EQ(PathOf(0).breaker, BreakerState::kOpen);
  EXPECT_EQ(PathOf(1).breaker, BreakerState::kClosed);
  // The open path is skipped without a post; the other serves.
  const uint64_t a_posts = mock_.post_count("mp-a");
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(Run({Op(OpCode::kRead)}).status.ok());
  EXPECT_EQ(mock_.post_count("mp-a"), a_posts) << "an open breaker let ops through";
  EXPECT_EQ(PathOf(0).fast_failed, 5u);
  EXPECT_EQ(a_->GetPeerHealth("mp-b")->fast_failed_ops, 0u);

  // Now the second path fails too: failing ops say where they went.
  ASSERT_EQ(mock_b_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, -1, 0), KVB_OK);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(Run({Op(OpCode::kRead)}).status.IsPeerUnreachable());
  EXPECT_EQ(PathOf(1).breaker, BreakerState::kOpen);
  // Both open: fail fast, naming both paths, touching neither.
  const uint64_t b_posts = mock_b_.post_count("mp-a");
  Status st = Run({Op(OpCode::kRead)}).status;
  EXPECT_TRUE(st.IsPeerUnreachable()) << st.ToString();
  EXPECT_NE(st.message().find("on every path: mock after"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("; mock_b after 3 consecutive failures"), std::string::npos)
      << st.ToString();
  EXPECT_EQ(mock_b_.post_count("mp-a"), b_posts);
  EXPECT_EQ(mock_.post_count("mp-a"), a_posts);
  EXPECT_EQ(a_->GetPeerHealth("mp-b")->fast_failed_ops, 1u);
}

TEST_F(MultipathTest, BothPathsFailingGiveTheWholeHistory) {
  ASSERT_EQ(mock_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, 1, 0), KVB_OK);
  ASSERT_EQ(mock_b_.set_fault("mp-a", KVB_ERR_PEER_UNREACHABLE, 1, 0), KVB_OK);
  Status st = Run({Op(OpCode::kRead)}).status;
  EXPECT_TRUE(st.IsPeerUnreachable()) << st.ToString();
  EXPECT_NE(st.message().find("peer mp-b@"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("mock: PEER_UNREACHABLE (mock: injected fault PEER_UNREACHABLE); "
                              "then mock_b: PEER_UNREACHABLE (mock_b: injected fault"),
            std::string::npos)
      << st.ToString();
}

TEST(MultipathOptions, DefaultsAndVariables) {
  EngineOptions d;
  EXPECT_TRUE(d.path_failover);
  EXPECT_TRUE(d.path_failover_writes);
  EXPECT_EQ(d.failover_min_budget_ms, 5u);
  const std::vector<std::pair<const char*, const char*>> vars = {
      {"KVBRIDGE_PATH_FAILOVER", "0"},
      {"KVBRIDGE_PATH_FAILOVER_WRITES", "false"},
      {"KVBRIDGE_FAILOVER_MIN_BUDGET_MS", "17"}};
  for (const auto& [name, value] : vars) setenv(name, value, 1);
  EngineOptions e = EngineOptions::FromEnv();
  for (const auto& [name, value] : vars) unsetenv(name);
  EXPECT_FALSE(e.path_failover);
  EXPECT_FALSE(e.path_failover_writes);
  EXPECT_EQ(e.failover_min_budget_ms, 17u);
}

}  // namespace
}  // namespace kvbridge
