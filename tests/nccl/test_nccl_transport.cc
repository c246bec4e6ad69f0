// The nccl transport (plugins/transport_nccl) with two or three instances in this process on a
// fake NCCL and CUDA (fake_nccl.h: host memory stands in for device memory), the real control
// channel over loopback TCP and the real host handshake (core::HostServices). Each failure the
// transport promises to handle is made to happen: refusals at the target, a hung send (deadline,
// progress timeout), an asynchronous NCCL error, a restarted peer, a wrong or missing cluster
// token, malformed frames, the in-flight bound.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "tests/common/raw_socket.h"
#include "tests/nccl/fake_nccl.h"
#include "tests/nccl/nccl_test_util.h"

namespace kvbridge::nccl::test {
namespace {

using kvbridge::testing::ClosedWithin;
using kvbridge::testing::ConnectLoopback;

constexpr size_t kBytes = 1 << 16;

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7 + (i >> 8));
  return v;
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

template <typename F>
bool Eventually(F&& f, int ms = 3000) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    if (f()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return f();
}

// Until the fake has seen more than `before` ncclSend calls: the hung send was issued.
bool SendIssued(uint64_t before) {
  return Eventually([&] { return fake::GetCounts().sends > before; });
}

Node::Options Opts(const std::string& id, uint64_t inc = 1, std::string token = "") {
  Node::Options o;
  o.node_id = id;
  o.incarnation = inc;
  o.token = std::move(token);
  o.config["nccl.connect_timeout_ms"] = "2000";
  return o;
}

// Two instances, each with one "device" buffer registered as segment 1.
class NcclPair : public ::testing::Test {
 protected:
  void SetUp() override {
    fake::ResetFaults();
    a_ = Node::Make(Opts("a", 11, token_));
    b_ = Node::Make(Opts("b", 21, token_));
    ASSERT_TRUE(a_ && b_);
    ASSERT_TRUE(a_->Register(1, abuf_.data(), abuf_.size()).ok());
    ASSERT_TRUE(b_->Register(1, bbuf_.data(), bbuf_.size()).ok());
    peer_ = a_->AddPeer(*b_);
    ASSERT_NE(peer_, nullptr);
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    c_.reset();
    fake::ResetFaults();
    EXPECT_EQ(fake::GetCounts().calls_after_abort, 0u) << "a communicator was used after abort";
    EXPECT_EQ(fake::GetCounts().calls_while_enqueuing, 0u);
  }

  std::string token_;
  std::vector<uint8_t> abuf_ = std::vector<uint8_t>(kBytes);
  std::vector<uint8_t> bbuf_ = std::vector<uint8_t>(kBytes);
  std::vector<uint8_t> cbuf_ = std::vector<uint8_t>(kBytes);
  std::unique_ptr<Node> a_, b_, c_;
  Peer* peer_ = nullptr;
};

// ---- 1. endpoints text and frames --------------------------------------------------------------

TEST(NcclEndpoints, RoundTrip) {
  const ControlAddress a{"127.0.0.1", 45123};
  const std::string text = FormatEndpoints(a);
  EXPECT_EQ(text, "nccl1;c=127.0.0.1:45123");
  auto back = ParseEndpoints(text);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->host, "127.0.0.1");
  EXPECT_EQ(back->port, 45123);
  auto v6 = ParseEndpoints(FormatEndpoints({"::1", 7}));
  ASSERT_TRUE(v6.ok()) << v6.status().message();
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(FormatEndpoints(*v6), "nccl1;c=[::1]:7");
  auto node = Node::Make(Opts("ep"));
  ASSERT_TRUE(node);
  auto own = ParseEndpoints(node->t().Endpoints());
  ASSERT_TRUE(own.ok()) << own.status().message();
  EXPECT_NE(own->port, 0);
}

TEST(NcclEndpoints, MalformedRefusedNamingWhy) {
  const std::pair<const char*, const char*> bad[] = {
      {"", "do not start with 'nccl1;c='"},
      {"tcp1;c=127.0.0.1:1", "do not start with 'nccl1;c='"},
      {"nccl1;c=127.0.0.1", "is not host:port"},
      {"nccl1;c=127.0.0.1:", "no port"},
      {"nccl1;c=127.0.0.1:70000", "no port"},
      {"nccl1;c=127.0.0.1:12x", "no port"},
      {"nccl1;c=127.0.0.1:0", "port 0"},
  };
  for (const auto& [text, why] : bad) {
    auto r = ParseEndpoints(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), KVB_ERR_INVALID_ARGUMENT) << text;
    EXPECT_TRUE(Contains(r.status().message(), why)) << text << ": " << r.status().message();
    EXPECT_TRUE(Contains(r.status().message(), text)) << r.status().message();
  }
  // add_peer refuses them the same way.
  auto a = Node::Make(Opts("a"));
  ASSERT_TRUE(a);
  kvb_peer_info_t info{};
  info.struct_size = sizeof(info);
  info.node_id = "b";
  info.incarnation = 1;
  info.endpoints = "nccl1;c=nowhere";
  auto p = a->t().AddPeer(sdk::PeerInfo::From(&info));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), KVB_ERR_INVALID_ARGUMENT);
}

TEST(NcclFrames, RoundTripAndMalformed) {
  Frame f;
  f.type = FrameType::kReq;
  f.op_id = 7;
  f.opcode = KVB_OP_WRITE;
  f.segment = 3;
  f.offset = 100;
  f.length = 4096;
  const std::string bytes = EncodeFrame(f);
  Frame g;
  size_t used = 0;
  ASSERT_TRUE(DecodeFrame(bytes, &g, &used).ok());
  EXPECT_EQ(used, bytes.size());
  EXPECT_EQ(g.op_id, 7u);
  EXPECT_EQ(g.segment, 3u);
  EXPECT_EQ(g.offset, 100u);
  EXPECT_EQ(g.length, 4096u);
  ASSERT_TRUE(DecodeFrame(bytes.substr(0, 20), &g, &used).ok());
  EXPECT_EQ(used, 0u) << "a partial frame waits for more bytes";

  std::string bad_magic = bytes;
  bad_magic[0] ^= 1;
  EXPECT_EQ(DecodeFrame(bad_magic, &g, &used).code(), KVB_ERR_PROTOCOL);
  std::string bad_type = bytes;
  bad_type[4] = 9;
  EXPECT_TRUE(Contains(DecodeFrame(bad_type, &g, &used).message(), "unknown type 9"));
  std::string bad_len = bytes;
  bad_len[8] = 5;
  EXPECT_TRUE(Contains(DecodeFrame(bad_len, &g, &used).message(), "body of 5 bytes"));
}

// ---- 2. bytes move; host memory is refused -----------------------------------------------------

TEST_F(NcclPair, WriteThenReadBack) {
  const auto data = Pattern(kBytes / 2, 3);
  std::memcpy(abuf_.data(), data.data(), data.size());
  const auto before = fake::GetCounts();
  Outcome w = a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), data.size(), 1, 1000);
  ASSERT_EQ(w.status, KVB_OK) << w.msg;
  EXPECT_EQ(std::memcmp(bbuf_.data() + 1000, data.data(), data.size()), 0);

  std::memset(abuf_.data(), 0, abuf_.size());
  Outcome r = a_->Run(peer_, KVB_OP_READ, 1, abuf_.data() + 5, data.size(), 1, 1000);
  ASSERT_EQ(r.status, KVB_OK) << r.msg;
  EXPECT_EQ(std::memcmp(abuf_.data() + 5, data.data(), data.size()), 0);

  const auto after = fake::GetCounts();
  EXPECT_EQ(after.comms_created - before.comms_created, 2u) << "one 2-rank communicator";
  EXPECT_EQ(after.bytes_copied - before.bytes_copied, 2 * data.size());
  const auto st = a_->Stats();
  EXPECT_EQ(st.bytes_written, data.size());
  EXPECT_EQ(st.bytes_read, data.size());
  EXPECT_EQ(st.connections_open, 1u);
  EXPECT_EQ(b_->Stats().inbound_open, 1u);
  EXPECT_EQ(st.queued_bytes, 0u);
}

TEST_F(NcclPair, ManyOpsInOneRequestBothDirections) {
  const auto data = Pattern(kBytes, 9);
  std::memcpy(bbuf_.data(), data.data(), data.size());
  std::vector<kvb_xfer_op_t> ops;
  for (int i = 0; i < 16; ++i) {
    kvb_xfer_op_t op{};
    op.opcode = KVB_OP_READ;
    op.local_segment = 1;
    op.local_addr = abuf_.data() + i * 4096;
    op.length = 4096;
    op.remote_segment = 1;
    op.remote_offset = static_cast<uint64_t>(i) * 4096;
    ops.push_back(op);
  }
  auto req = a_->t().Post(peer_, sdk::Ops(ops.data(), ops.size(), sizeof(kvb_xfer_op_t)),
                          sdk::PostOptions{});
  ASSERT_TRUE(req.ok()) << req.status().message();
  Outcome o = a_->Wait(*req);
  a_->t().Release(*req);
  ASSERT_EQ(o.status, KVB_OK) << o.msg;
  EXPECT_EQ(std::memcmp(abuf_.data(), data.data(), 16 * 4096), 0);
}

TEST_F(NcclPair, NonBlockingEnqueueIsWaitedOutOnBothSides) {
  const auto data = Pattern(8192, 21);
  std::memcpy(abuf_.data(), data.data(), data.size());
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  // Four calls in a row answer ncclInProgress: the target's and the initiator's of two ops.
  fake::SlowEnqueueNext(4);
  std::vector<kvb_xfer_op_t> ops(2);
  for (int i = 0; i < 2; ++i) {
    ops[i].opcode = KVB_OP_WRITE;
    ops[i].local_segment = 1;
    ops[i].local_addr = abuf_.data() + i * 4096;
    ops[i].length = 4096;
    ops[i].remote_segment = 1;
    ops[i].remote_offset = 16384 + i * 4096;
  }
  auto req =
      a_->t().Post(peer_, sdk::Ops(ops.data(), 2, sizeof(kvb_xfer_op_t)), sdk::PostOptions{});
  ASSERT_TRUE(req.ok());
  Outcome o = a_->Wait(*req);
  a_->t().Release(*req);
  ASSERT_EQ(o.status, KVB_OK) << o.msg;
  EXPECT_EQ(std::memcmp(bbuf_.data() + 16384, data.data(), data.size()), 0);
  EXPECT_EQ(fake::GetCounts().calls_while_enqueuing, 0u);
}

TEST_F(NcclPair, HostRegionRefusedUnsupported) {
  std::vector<uint8_t> host(4096);
  sdk::Status st = a_->Register(9, host.data(), host.size(), KVB_MEM_HOST, -1);
  EXPECT_EQ(st.code(), KVB_ERR_UNSUPPORTED);
  EXPECT_TRUE(Contains(st.message(), "host memory")) << st.message();
  EXPECT_TRUE(Contains(st.message(), "device memory only")) << st.message();
  st = a_->Register(10, host.data(), host.size(), KVB_MEM_CUDA, 3);
  EXPECT_EQ(st.code(), KVB_ERR_UNSUPPORTED);
  EXPECT_TRUE(Contains(st.message(), "nccl.device")) << st.message();
  EXPECT_EQ(a_->Register(1, abuf_.data(), 16).code(), KVB_ERR_ALREADY_EXISTS);
}

// ---- 3. the target checks every request before touching memory ---------------------------------

TEST_F(NcclPair, TargetRefusesUnregisteredAndOutOfRange) {
  // a believes b has segments 2 and a larger 1 (a stale or lying descriptor): the local checks
  // pass, the target's do not.
  Peer* liar = a_->AddPeer(*b_, {{1, kBytes * 4}, {2, kBytes}});
  ASSERT_NE(liar, nullptr);
  const auto data = Pattern(4096, 5);
  std::memcpy(abuf_.data(), data.data(), data.size());
  const std::vector<uint8_t> b_before = bbuf_;
  const auto before = fake::GetCounts();

  Outcome o = a_->Run(liar, KVB_OP_WRITE, 1, abuf_.data(), 4096, 2, 0);
  EXPECT_EQ(o.status, KVB_ERR_NOT_REGISTERED) << o.msg;
  EXPECT_TRUE(Contains(o.msg, "segment 2 is not registered at the target")) << o.msg;

  o = a_->Run(liar, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, kBytes * 2);
  EXPECT_EQ(o.status, KVB_ERR_OUT_OF_BOUNDS) << o.msg;
  EXPECT_TRUE(Contains(o.msg, "lies outside segment 1")) << o.msg;

  o = a_->Run(liar, KVB_OP_READ, 1, abuf_.data(), 4096, 1, kBytes - 100);
  EXPECT_EQ(o.status, KVB_ERR_OUT_OF_BOUNDS) << o.msg;

  EXPECT_EQ(bbuf_, b_before) << "no byte of the target was touched";
  EXPECT_EQ(std::memcmp(abuf_.data(), data.data(), data.size()), 0);
  const auto after = fake::GetCounts();
  EXPECT_EQ(after.sends, before.sends);
  EXPECT_EQ(after.recvs, before.recvs);
  EXPECT_GE(b_->Stats().frames_rejected, 3u);

  // The connection is still good for a valid op.
  o = a_->Run(liar, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0);
  EXPECT_EQ(o.status, KVB_OK) << o.msg;
}

TEST_F(NcclPair, LocalChecksRefuseAtPost) {
  Outcome o = a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 7, 0);
  EXPECT_EQ(o.status, KVB_ERR_NOT_REGISTERED) << o.msg;
  o = a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, kBytes);
  EXPECT_EQ(o.status, KVB_ERR_OUT_OF_BOUNDS) << o.msg;
  std::vector<uint8_t> other(64);
  o = a_->Run(peer_, KVB_OP_WRITE, 1, other.data(), 64, 1, 0);
  EXPECT_EQ(o.status, KVB_ERR_NOT_REGISTERED) << o.msg;
  o = a_->Run(peer_, 9, 1, abuf_.data(), 64, 1, 0);
  EXPECT_EQ(o.status, KVB_ERR_INVALID_ARGUMENT) << o.msg;
}

// ---- 4. hung send: deadline, abort, rebuild; other peers go on ---------------------------------

TEST_F(NcclPair, HungSendHitsDeadlineAbortsAndRebuilds) {
  c_ = Node::Make(Opts("c", 31));
  ASSERT_TRUE(c_);
  ASSERT_TRUE(c_->Register(1, cbuf_.data(), cbuf_.size()).ok());
  Peer* to_c = a_->AddPeer(*c_);
  ASSERT_NE(to_c, nullptr);
  // Both communicators exist before the fault.
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  ASSERT_EQ(a_->Run(to_c, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  const auto before = fake::GetCounts();
  const uint64_t aborted_before = a_->t().counters().comms_aborted;

  fake::HangNextSends(1);
  auto hung = a_->Post(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0, /*deadline_ms=*/400,
                       /*progress_ms=*/10000);
  ASSERT_TRUE(hung.ok()) << hung.status().message();
  // The hung send must be b's: c's ops start only once it was issued (else c's ACCEPT could
  // come first and c's send be the one that hangs).
  ASSERT_TRUE(SendIssued(before.sends));
  // Meanwhile c is served at full speed.
  const auto data = Pattern(4096, 77);
  std::memcpy(abuf_.data() + 8192, data.data(), data.size());
  for (int i = 0; i < 20; ++i) {
    Outcome o = a_->Run(to_c, KVB_OP_WRITE, 1, abuf_.data() + 8192, 4096, 1, 0);
    ASSERT_EQ(o.status, KVB_OK) << o.msg;
    EXPECT_LT(o.ms, 300) << "a peer unaffected by another's hung communicator";
  }
  EXPECT_EQ(std::memcmp(cbuf_.data(), data.data(), data.size()), 0);

  Outcome h = a_->Wait(*hung);
  a_->t().Release(*hung);
  EXPECT_EQ(h.status, KVB_ERR_DEADLINE_EXCEEDED) << h.msg;
  EXPECT_GT(h.ms, 100);
  EXPECT_LT(h.ms, 1500) << "final by its deadline (400 ms)";
  EXPECT_EQ(a_->t().counters().comms_aborted, aborted_before + 1);
  EXPECT_TRUE(a_->LogContains("passed its deadline")) << a_->Logs();

  // The next op to b runs on a new communicator (a new unique id, both ranks).
  std::memcpy(abuf_.data(), data.data(), data.size());
  Outcome next = a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 4096);
  ASSERT_EQ(next.status, KVB_OK) << next.msg;
  EXPECT_EQ(std::memcmp(bbuf_.data() + 4096, data.data(), data.size()), 0);
  const auto after = fake::GetCounts();
  EXPECT_EQ(after.comms_created - before.comms_created, 2u) << "rebuilt once, for b only";
  EXPECT_GE(after.comms_aborted - before.comms_aborted, 2u) << "both ranks of the old one";
}

TEST_F(NcclPair, HungSendHitsProgressTimeout) {
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  fake::HangNextSends(1);
  Outcome o = a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0, /*deadline_ms=*/0,
                      /*progress_ms=*/200);
  EXPECT_EQ(o.status, KVB_ERR_PROGRESS_TIMEOUT) << o.msg;
  EXPECT_LT(o.ms, 1500);
  EXPECT_TRUE(Contains(o.msg, "communicator was aborted")) << o.msg;
  EXPECT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
}

TEST_F(NcclPair, AsyncErrorAbortsAndTheNextOpRebuilds) {
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  const uint64_t sends_before = fake::GetCounts().sends;
  fake::HangNextSends(1);
  auto req = a_->Post(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0, 0, 10000);
  ASSERT_TRUE(req.ok());
  ASSERT_TRUE(SendIssued(sends_before));
  fake::FailNextAsyncQuery(6);  // ncclRemoteError
  Outcome o = a_->Wait(*req, 3000);
  a_->t().Release(*req);
  EXPECT_EQ(o.status, KVB_ERR_PEER_UNREACHABLE) << o.msg;
  EXPECT_LT(o.ms, 2000);
  EXPECT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
}

TEST_F(NcclPair, CancelOfAnIssuedOpAbortsOnlyThatCommunicator) {
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  const uint64_t sends_before = fake::GetCounts().sends;
  fake::HangNextSends(1);
  auto req = a_->Post(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0, 0, 10000);
  ASSERT_TRUE(req.ok());
  ASSERT_TRUE(SendIssued(sends_before));
  a_->t().Cancel(*req);
  std::vector<kvb_status_t> st(1);
  EXPECT_EQ(a_->t().Poll(*req, st).code(), KVB_ERR_CANCELLED);
  a_->t().Release(*req);
  EXPECT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
}

TEST_F(NcclPair, RemovePeerCancelsItsOps) {
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  const uint64_t sends_before = fake::GetCounts().sends;
  fake::HangNextSends(1);
  auto req = a_->Post(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0, 0, 10000);
  ASSERT_TRUE(req.ok());
  ASSERT_TRUE(SendIssued(sends_before));
  a_->t().RemovePeer(peer_);
  peer_ = nullptr;
  Outcome o = a_->Wait(*req, 1000);
  a_->t().Release(*req);
  EXPECT_EQ(o.status, KVB_ERR_CANCELLED) << o.msg;
  EXPECT_EQ(a_->Stats().connections_open, 0u);
}

// destroy with a request the host never released, its send hung: destroy aborts the
// communicator and returns (the ABI's destroy frees the request too; `make asan` runs this
// binary with LeakSanitizer on).
TEST_F(NcclPair, DestroyEndsARequestNeverReleased) {
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  const uint64_t sends_before = fake::GetCounts().sends;
  fake::HangNextSends(1);
  auto req = a_->Post(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0, 0, 10000);
  ASSERT_TRUE(req.ok()) << req.status().message();
  ASSERT_TRUE(SendIssued(sends_before));
  const auto t0 = std::chrono::steady_clock::now();
  a_.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3))
      << "destroy waited on the hung send";
}

TEST(NcclDeregister, WaitsForTheTargetsQueuedCallThenClosesItsConnection) {
  fake::ResetFaults();
  auto a = Node::Make(Opts("a", 1));
  Node::Options bo = Opts("b", 2);
  bo.config["nccl.progress_timeout_ms"] = "300";
  auto b = Node::Make(bo);
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> abuf(4096), bbuf(4096);
  ASSERT_TRUE(a->Register(1, abuf.data(), abuf.size()).ok());
  ASSERT_TRUE(b->Register(1, bbuf.data(), bbuf.size()).ok());
  Peer* p = a->AddPeer(*b);
  ASSERT_EQ(a->Run(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 0).status, KVB_OK);
  const uint64_t sends_before = fake::GetCounts().sends;
  fake::HangNextSends(1);  // b's ncclRecv into its region stays queued
  auto req = a->Post(p, KVB_OP_WRITE, 1, abuf.data(), 4096, 1, 0, 0, 10000);
  ASSERT_TRUE(req.ok());
  ASSERT_TRUE(SendIssued(sends_before));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(b->t().DeregisterMemory(1).ok());
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(ms, 250) << "it waited for the queued call";
  EXPECT_LT(ms, 2000);
  EXPECT_TRUE(b->LogContains("is being deregistered")) << b->Logs();
  Outcome o = a->Wait(*req, 3000);
  a->t().Release(*req);
  EXPECT_EQ(o.status, KVB_ERR_PEER_UNREACHABLE) << o.msg;
  // The region is gone: the next op is refused by the target.
  Outcome n = a->Run(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 0);
  EXPECT_EQ(n.status, KVB_ERR_NOT_REGISTERED) << n.msg;
  EXPECT_EQ(b->t().DeregisterMemory(1).code(), KVB_ERR_NOT_FOUND);
}

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// ---- 5. restarted peer -------------------------------------------------------------------------

TEST_F(NcclPair, RestartedPeerIsStaleAndItsCommunicatorIsNeverReused) {
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  const uint16_t port = ParseEndpoints(b_->t().Endpoints())->port;
  b_.reset();  // b exits; a sees its control connection close and drops that communicator
  ASSERT_TRUE(Eventually([&] { return a_->Stats().connections_open == 0; }));
  Node::Options o = Opts("b", 22);
  o.listen = "127.0.0.1:" + std::to_string(port);
  b_ = Node::Make(o);
  ASSERT_TRUE(b_);
  ASSERT_TRUE(b_->Register(1, bbuf_.data(), bbuf_.size()).ok());
  const auto before = fake::GetCounts();
  const std::vector<uint8_t> b_before = bbuf_;

  Outcome stale = a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0);
  EXPECT_EQ(stale.status, KVB_ERR_STALE_PEER) << stale.msg;
  const auto after = fake::GetCounts();
  EXPECT_EQ(after.sends, before.sends) << "nothing issued to the old incarnation";
  EXPECT_EQ(after.comms_created, before.comms_created);
  EXPECT_EQ(after.calls_after_abort, 0u);
  EXPECT_EQ(bbuf_, b_before);

  // The new incarnation, learnt as such, gets a new communicator.
  Peer* fresh = a_->AddPeer(*b_);
  ASSERT_NE(fresh, nullptr);
  Outcome ok = a_->Run(fresh, KVB_OP_WRITE, 1, abuf_.data(), 4096, 1, 0);
  EXPECT_EQ(ok.status, KVB_OK) << ok.msg;
  EXPECT_EQ(fake::GetCounts().comms_created, before.comms_created + 2);
}

// The peer info for node `node`, incarnation `inc`, at 127.0.0.1:port with segment 1.
struct Info {
  Info(const std::string& node, uint64_t inc, uint16_t port) {
    node_ = node;
    ep_ = "nccl1;c=127.0.0.1:" + std::to_string(port);
    seg_.struct_size = sizeof(seg_);
    seg_.mem_kind = KVB_MEM_CUDA;
    seg_.segment_id = 1;
    seg_.length = kBytes;
    info_.struct_size = sizeof(info_);
    info_.node_id = node_.c_str();
    info_.incarnation = inc;
    info_.endpoints = ep_.c_str();
    info_.segments = &seg_;
    info_.num_segments = 1;
    info_.segment_size = sizeof(seg_);
  }
  sdk::PeerInfo view() const { return sdk::PeerInfo::From(&info_); }
  std::string node_, ep_;
  kvb_peer_segment_t seg_{};
  kvb_peer_info_t info_{};
};

// Reads one whole frame (blocking) from fd.
bool ReadFrame(int fd, const sdk::Host& host, Frame* f) {
  std::string buf(kHeaderBytes, '\0');
  const uint64_t deadline = host.NowNs() + 3000000000ull;
  if (!RecvAll(fd, buf.data(), buf.size(), deadline, host).ok()) return false;
  uint32_t body = 0;
  std::memcpy(&body, buf.data() + 8, 4);
  buf.resize(kHeaderBytes + body);
  if (!RecvAll(fd, buf.data() + kHeaderBytes, body, deadline, host).ok()) return false;
  size_t used = 0;
  return DecodeFrame(buf, f, &used).ok() && used == buf.size();
}

// The race the brief names: the old incarnation takes the REQ and dies before answering, and
// its successor is already listening at the same port when the initiator sees the connection
// close. The op (never issued: no byte can have moved) goes back to the queue once, and the
// new connection's handshake answers STALE_PEER; before, it ended PEER_UNREACHABLE. The old
// incarnation is played by this test (handshake as b#21, COMM, rank 1 of the fake
// communicator) so that the REQ is on the wire, unanswered, when it dies.
TEST(NcclRestart, AnOpCaughtByTheOldIncarnationsDeathEndsStalePeer) {
  fake::ResetFaults();
  auto a = Node::Make(Opts("a", 11));
  ASSERT_TRUE(a);
  std::vector<uint8_t> abuf = Pattern(kBytes, 9), bbuf(kBytes);
  ASSERT_TRUE(a->Register(1, abuf.data(), abuf.size()).ok());

  const int lfd = socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(listen(lfd, 4), 0);
  socklen_t len = sizeof(sa);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  const uint16_t port = ntohs(sa.sin_port);
  const Info old_b("b", 21, port);
  auto p = a->t().AddPeer(old_b.view());
  ASSERT_TRUE(p.ok()) << p.status().message();

  auto req = a->Post(*p, KVB_OP_WRITE, 1, abuf.data(), 4096, 1, 0, 0, 10000);
  ASSERT_TRUE(req.ok()) << req.status().message();
  // The old b: handshake, COMM (join rank 1), the REQ read and never answered.
  const int conn = accept(lfd, nullptr, nullptr);
  ASSERT_GE(conn, 0);
  core::HostServices old_host({}, core::auth::Identity{"b", 21, ""});
  const sdk::Host host(old_host.table(), "nccl");
  auto who = Handshake(host, conn, KVB_AUTH_SERVER, {}, 0, host.NowNs() + 3000000000ull);
  ASSERT_TRUE(who.ok()) << who.status().message();
  Frame comm_frame, req_frame;
  ASSERT_TRUE(ReadFrame(conn, host, &comm_frame));
  ASSERT_EQ(comm_frame.type, FrameType::kComm);
  ncclComm_t rank1 = nullptr;
  ASSERT_EQ(fake::FakeNccl()->ncclCommInitRank(&rank1, 2, comm_frame.id, 1), ncclSuccess);
  ASSERT_TRUE(ReadFrame(conn, host, &req_frame));
  ASSERT_EQ(req_frame.type, FrameType::kReq);
  const auto before = fake::GetCounts();

  // b restarts on the same port (incarnation 22), then the old process's socket closes.
  close(lfd);
  Node::Options o = Opts("b", 22);
  o.listen = "127.0.0.1:" + std::to_string(port);
  auto b = Node::Make(o);
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->Register(1, bbuf.data(), bbuf.size()).ok());
  close(conn);

  Outcome out = a->Wait(*req);
  a->t().Release(*req);
  EXPECT_EQ(out.status, KVB_ERR_STALE_PEER) << out.msg;
  EXPECT_EQ(fake::GetCounts().sends, before.sends) << "the op was issued";
  EXPECT_EQ(bbuf, std::vector<uint8_t>(kBytes)) << "bytes landed in the new incarnation";
  // Once, not forever: the next op to the old incarnation is refused by the handshake too.
  EXPECT_EQ(a->Run(*p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 0).status, KVB_ERR_STALE_PEER);
  fake::FakeNccl()->ncclCommAbort(rank1);
  a.reset();
  b.reset();
  EXPECT_EQ(fake::GetCounts().calls_after_abort, 0u);
}

// add_peer of another incarnation of a known node: every op of the old one ends STALE_PEER at
// once, one hung on its communicator included (aborted), and later posts to it end STALE_PEER
// without a connection; update_peer naming another incarnation is refused, as tcp and ucx do.
TEST_F(NcclPair, AddPeerOfANewIncarnationEndsTheOldOnesOpsStale) {
  ASSERT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
  fake::HangNextSends(1);
  auto hung = a_->Post(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0, 0, 10000);
  ASSERT_TRUE(hung.ok());
  ASSERT_TRUE(Eventually([&] { return fake::GetCounts().sends >= 2; }));
  const uint16_t port = ParseEndpoints(b_->t().Endpoints())->port;

  const Info newer("b", 22, port);
  const auto aborted = a_->t().counters().comms_aborted.load();
  const auto t0 = std::chrono::steady_clock::now();
  auto fresh = a_->t().AddPeer(newer.view());
  ASSERT_TRUE(fresh.ok());
  Outcome o = a_->Wait(*hung, 3000);
  a_->t().Release(*hung);
  EXPECT_EQ(o.status, KVB_ERR_STALE_PEER) << o.msg;
  EXPECT_TRUE(Contains(o.msg, "b#21 was replaced by incarnation 22")) << o.msg;
  EXPECT_LT(MsSince(t0), 1000.0);
  EXPECT_EQ(a_->t().counters().comms_aborted, aborted + 1);

  const uint64_t opened = a_->Stats().connections_opened;
  Outcome later = a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0);
  EXPECT_EQ(later.status, KVB_ERR_STALE_PEER) << later.msg;
  EXPECT_EQ(a_->Stats().connections_opened, opened) << "a replaced incarnation was connected to";

  const sdk::Status up = a_->t().UpdatePeer(peer_, newer.view());
  EXPECT_EQ(up.code(), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(up.message(), "use add_peer")) << up.message();
  a_->t().RemovePeer(*fresh);
}

// ---- 6. authentication and malformed frames ----------------------------------------------------

class NcclAuth : public NcclPair {
 protected:
  NcclAuth() { token_ = "cluster-secret"; }
};

TEST_F(NcclAuth, WrongOrMissingTokenIsUnauthenticated) {
  for (const std::string token : {"wrong-secret", ""}) {
    auto x = Node::Make(Opts("x", 5, token));
    ASSERT_TRUE(x);
    std::vector<uint8_t> xbuf(4096);
    ASSERT_TRUE(x->Register(1, xbuf.data(), xbuf.size()).ok());
    Peer* p = x->AddPeer(*b_);
    ASSERT_NE(p, nullptr);
    const std::vector<uint8_t> b_before = bbuf_;
    Outcome o = x->Run(p, KVB_OP_WRITE, 1, xbuf.data(), 4096, 1, 0);
    EXPECT_EQ(o.status, KVB_ERR_UNAUTHENTICATED) << "token '" << token << "': " << o.msg;
    EXPECT_EQ(bbuf_, b_before);
  }
  EXPECT_TRUE(b_->LogContains("refused control connection")) << b_->Logs();
  // The right token still works.
  EXPECT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
}

TEST_F(NcclAuth, MalformedFramesCloseTheConnectionAndTheListenerGoesOn) {
  const uint16_t port = ParseEndpoints(b_->t().Endpoints())->port;
  // Garbage instead of a handshake.
  int fd = ConnectLoopback(port);
  ASSERT_GE(fd, 0);
  const char junk[] = "GET / HTTP/1.0\r\n\r\n";
  ASSERT_GT(send(fd, junk, sizeof(junk), MSG_NOSIGNAL), 0);
  EXPECT_TRUE(ClosedWithin(fd, 3000));
  close(fd);

  // Authenticated (this test holds the token), then frames that break the protocol.
  core::HostServices attacker({}, core::auth::Identity{"mallory", 99, token_});
  const sdk::Host host(attacker.table(), "nccl");
  const std::vector<std::string> bad = {
      std::string("\x01\x02\x03\x04 not a frame at all", 22),
      [] {  // a REQ before COMM
        Frame f;
        f.type = FrameType::kReq;
        f.op_id = 1;
        f.opcode = KVB_OP_WRITE;
        f.segment = 1;
        f.length = 16;
        return EncodeFrame(f);
      }(),
      [] {  // an ACCEPT, which only a target sends
        Frame f;
        f.type = FrameType::kAccept;
        return EncodeFrame(f);
      }(),
  };
  const uint64_t rejected = b_->Stats().frames_rejected;
  for (const std::string& frame : bad) {
    fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    auto who = Handshake(host, fd, KVB_AUTH_CLIENT, "b", 21, host.NowNs() + 2000000000ull);
    ASSERT_TRUE(who.ok()) << who.status().message();
    ASSERT_GT(send(fd, frame.data(), frame.size(), MSG_NOSIGNAL), 0);
    EXPECT_TRUE(ClosedWithin(fd, 3000)) << "the target must close a connection sending junk";
    close(fd);
  }
  EXPECT_TRUE(Eventually([&] { return b_->Stats().frames_rejected >= rejected + 3; }));
  EXPECT_TRUE(b_->LogContains("malformed control frame")) << b_->Logs();
  EXPECT_TRUE(b_->LogContains("REQ before COMM")) << b_->Logs();
  // And the listener serves the next, well-behaved initiator.
  EXPECT_EQ(a_->Run(peer_, KVB_OP_WRITE, 1, abuf_.data(), 64, 1, 0).status, KVB_OK);
}

// ---- 6b. inbound handshakes are isolated from each other --------------------------------------

// The first half of a real client hello: a handshake frame cut in two.
std::string HalfAHello(const std::string& token) {
  core::HostServices client({}, core::auth::Identity{"half", 7, token});
  const sdk::Host host(client.table(), "nccl");
  auto session = host.BeginAuth(KVB_AUTH_CLIENT, "b", 21);
  EXPECT_TRUE(session.ok());
  std::vector<uint8_t> out;
  (void)session->Step({}, &out);
  EXPECT_GT(out.size(), 2u);
  return std::string(out.begin(), out.begin() + out.size() / 2);
}

// A client that connects and sends nothing, and one that stops half-way through its hello, hold
// one handshake slot each until nccl.connect_timeout_ms; a real initiator connecting meanwhile
// is served at once (before: the listener ran handshakes one at a time, so it waited for both).
TEST(NcclIsolation, SilentAndHalfHelloClientsDelayNoOtherPeer) {
  fake::ResetFaults();
  constexpr int kTimeoutMs = 2500;
  Node::Options bo = Opts("b", 21);
  bo.config["nccl.connect_timeout_ms"] = std::to_string(kTimeoutMs);
  auto b = Node::Make(bo);
  Node::Options ao = Opts("a", 11);
  ao.config["nccl.connect_timeout_ms"] = "1500";  // shorter than b's: serial handshakes fail it
  auto a = Node::Make(ao);
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> abuf = Pattern(kBytes, 3), bbuf(kBytes);
  ASSERT_TRUE(a->Register(1, abuf.data(), abuf.size()).ok());
  ASSERT_TRUE(b->Register(1, bbuf.data(), bbuf.size()).ok());
  Peer* p = a->AddPeer(*b);
  ASSERT_NE(p, nullptr);
  const uint16_t port = ParseEndpoints(b->t().Endpoints())->port;

  const auto t0 = std::chrono::steady_clock::now();
  const int silent = ConnectLoopback(port);
  const int half = ConnectLoopback(port);
  ASSERT_GE(silent, 0);
  ASSERT_GE(half, 0);
  const std::string hello = HalfAHello("");
  ASSERT_EQ(send(half, hello.data(), hello.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(hello.size()));
  ASSERT_TRUE(Eventually([&] { return b->t().counters().handshakes_active == 2; }));

  const auto w0 = std::chrono::steady_clock::now();
  Outcome o = a->Run(p, KVB_OP_WRITE, 1, abuf.data(), 4096, 1, 0);
  const double write_ms = MsSince(w0);
  EXPECT_EQ(o.status, KVB_OK) << o.msg;
  EXPECT_LT(write_ms, kTimeoutMs / 2.0) << "a stalled handshake delayed another peer's connect";
  EXPECT_TRUE(std::equal(abuf.begin(), abuf.begin() + 4096, bbuf.begin()));
  EXPECT_EQ(b->t().counters().handshakes_active, 2u) << "both stalled clients still hold a slot";

  // Each stalled connection is closed by b once nccl.connect_timeout_ms passed, not before.
  EXPECT_TRUE(ClosedWithin(silent, kTimeoutMs + 2000));
  const double silent_ms = MsSince(t0);
  EXPECT_TRUE(ClosedWithin(half, 2000));
  EXPECT_GE(silent_ms, kTimeoutMs - 100);
  EXPECT_LT(silent_ms, kTimeoutMs + 2000);
  close(silent);
  close(half);
  EXPECT_TRUE(Eventually([&] { return b->t().counters().handshakes_active == 0; }));
  EXPECT_TRUE(b->LogContains("nccl.connect_timeout_ms")) << b->Logs();
}

// Past nccl.max_handshakes in progress, a new connection is closed at once, counted and logged;
// a slot freed serves the next initiator; destroying an instance does not wait out a handshake.
TEST(NcclIsolation, HandshakesPastTheBoundAreClosedAtOnce) {
  fake::ResetFaults();
  Node::Options bo = Opts("b", 21);
  bo.config["nccl.max_handshakes"] = "2";
  bo.config["nccl.connect_timeout_ms"] = "10000";
  auto b = Node::Make(bo);
  auto a = Node::Make(Opts("a", 11));
  ASSERT_TRUE(a && b);
  EXPECT_EQ(b->t().config().max_handshakes, 2u);
  std::vector<uint8_t> abuf(kBytes), bbuf(kBytes);
  ASSERT_TRUE(a->Register(1, abuf.data(), abuf.size()).ok());
  ASSERT_TRUE(b->Register(1, bbuf.data(), bbuf.size()).ok());
  Peer* p = a->AddPeer(*b);
  ASSERT_NE(p, nullptr);
  const uint16_t port = ParseEndpoints(b->t().Endpoints())->port;

  const int s1 = ConnectLoopback(port);
  const int s2 = ConnectLoopback(port);
  ASSERT_GE(s1, 0);
  ASSERT_GE(s2, 0);
  ASSERT_TRUE(Eventually([&] { return b->t().counters().handshakes_active == 2; }));
  const int s3 = ConnectLoopback(port);
  ASSERT_GE(s3, 0);
  EXPECT_TRUE(ClosedWithin(s3, 1000)) << "the third handshake must be refused at once";
  close(s3);
  EXPECT_EQ(b->t().counters().handshakes_refused, 1u);
  EXPECT_TRUE(b->LogContains("(nccl.max_handshakes)")) << b->Logs();
  // An initiator is refused too while both slots are held (its connect fails, not hangs).
  Outcome refused = a->Run(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 0);
  EXPECT_NE(refused.status, KVB_OK);
  EXPECT_EQ(b->t().counters().handshakes_refused, 2u);
  // Refusals are logged at most once a second: the second one, right after, is not.
  const std::string logs = b->Logs();
  size_t logged = 0;
  for (size_t at = logs.find("(nccl.max_handshakes)"); at != std::string::npos;
       at = logs.find("(nccl.max_handshakes)", at + 1)) {
    ++logged;
  }
  EXPECT_EQ(logged, 1u) << logs;

  close(s1);  // its handshake ends (EOF), freeing a slot
  ASSERT_TRUE(Eventually([&] { return b->t().counters().handshakes_active == 1; }));
  EXPECT_EQ(a->Run(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 0).status, KVB_OK);

  // s2 is still in its handshake (10 s timeout): destroying b ends it at once.
  const auto d0 = std::chrono::steady_clock::now();
  b.reset();
  EXPECT_LT(MsSince(d0), 3000.0);
  EXPECT_TRUE(ClosedWithin(s2, 1000));
  close(s2);
}

// ---- 7. the in-flight bound
// ----------------------------------------------------------------------

TEST(NcclBounds, BackpressurePastMaxInflightOpsPerPeer) {
  fake::ResetFaults();
  Node::Options ao = Opts("a", 1);
  ao.config["nccl.max_inflight_ops_per_peer"] = "2";
  auto a = Node::Make(ao);
  auto b = Node::Make(Opts("b", 2));
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> abuf(kBytes), bbuf(kBytes);
  ASSERT_TRUE(a->Register(1, abuf.data(), abuf.size()).ok());
  ASSERT_TRUE(b->Register(1, bbuf.data(), bbuf.size()).ok());
  Peer* p = a->AddPeer(*b);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(a->Run(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 0).status, KVB_OK);
  fake::HangNextSends(1);  // the first op never ends, and blocks the second
  auto r1 = a->Post(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 0, 0, 10000);
  auto r2 = a->Post(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 64, 0, 10000);
  ASSERT_TRUE(r1.ok() && r2.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // both are on the communicator
  auto r3 = a->Post(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 128);
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r3.status().code(), KVB_ERR_BACKPRESSURE);
  EXPECT_TRUE(Contains(r3.status().message(), "nccl.max_inflight_ops_per_peer (2)"))
      << r3.status().message();
  a->t().Cancel(*r1);
  a->t().Release(*r1);
  Outcome o2 = a->Wait(*r2);
  a->t().Release(*r2);
  EXPECT_EQ(o2.status, KVB_OK) << "re-issued on a new communicator: " << o2.msg;
  EXPECT_EQ(a->Run(p, KVB_OP_WRITE, 1, abuf.data(), 64, 1, 128).status, KVB_OK);
}

TEST(NcclConfig, BadValueNamesTheKey) {
  Node::Options o = Opts("a");
  o.config["nccl.max_inflight_ops_per_peer"] = "lots";
  sdk::Status err;
  EXPECT_EQ(Node::Make(o, &err), nullptr);
  EXPECT_EQ(err.code(), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(err.message(), "nccl.max_inflight_ops_per_peer")) << err.message();
}

TEST(NcclDevice, UnusableDeviceFailsCreateNamingIt) {
  fake::ResetFaults();
  fake::SetUseDeviceResult(100);
  sdk::Status err;
  auto a = Node::Make(Opts("a", 1), &err);
  fake::ResetFaults();
  EXPECT_EQ(a, nullptr);
  EXPECT_EQ(err.code(), KVB_ERR_UNAVAILABLE);
  EXPECT_TRUE(Contains(err.message(), "CUDA_ERROR_NO_DEVICE")) << err.message();
  EXPECT_TRUE(Contains(err.message(), "nccl.device")) << err.message();
}

}  // namespace
}  // namespace kvbridge::nccl::test
