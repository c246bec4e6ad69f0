// verbs::Transport (plugins/transport_verbs/verbs_transport.h): two instances in one process
// over the LoopbackFabric (tests/verbs/loopback_fabric.h), with the real TCP side channel on
// loopback and the real host services (core::HostServices with an auth::Identity): the wire
// formats, write/read on one and two rails, a rail failing mid-transfer, a restarted peer, the
// cluster token, malformed side-channel input, deadlines, the progress timeout, backpressure
// and deregistered remote memory. Each failure is made to happen and its outcome asserted.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/host_services.h"
#include "tests/common/raw_socket.h"
#include "tests/verbs/loopback_fabric.h"
#include "tests/verbs/verbs_nodes.h"
#include "verbs_transport.h"
#include "verbs_wire.h"

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;
using testing::Eventually;
using testing::FakeSysfsTree;
using testing::LoopbackFabric;
using testing::Node;
using testing::NodeSpec;
using testing::NowNs;
using testing::VerbsTransportTest;

// ---- 1. wire formats --------------------------------------------------------------------------

TEST(VerbsWire, EndpointsRoundTrip) {
  Endpoints e;
  e.cm_host = "10.0.0.7";
  e.cm_port = 4711;
  EndpointNic a{"mlx5_0", 1, 0, {}, true, 4096, 0};
  a.gid[0] = 0xfe;
  a.gid[15] = 0x42;
  EndpointNic b{"mlx5_1", 2, 17, {}, false, 2048, -1};
  e.nics = {a, b};
  const std::string text = FormatEndpoints(e);
  auto back = ParseEndpoints(text);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->cm_host, "10.0.0.7");
  EXPECT_EQ(back->cm_port, 4711);
  ASSERT_EQ(back->nics.size(), 2u);
  EXPECT_EQ(back->nics[0].device, "mlx5_0");
  EXPECT_EQ(back->nics[0].gid, a.gid);
  EXPECT_TRUE(back->nics[0].ethernet);
  EXPECT_EQ(back->nics[1].port, 2);
  EXPECT_EQ(back->nics[1].lid, 17);
  EXPECT_FALSE(back->nics[1].ethernet);
  EXPECT_EQ(back->nics[1].mtu, 2048u);
  EXPECT_EQ(back->nics[1].numa_node, -1);
  EXPECT_EQ(FormatEndpoints(*back), text);
}

TEST(VerbsWire, MalformedEndpointsAreRefusedWithANamedReason) {
  const std::string gid(32, '0');
  const std::string nic = ";nic=mlx5_0,1,0," + gid + ",roce,4096,0";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ucx1;cm=h:1" + nic, "does not start with 'verbs1'"},
      {"verbs1" + nic, "no cm="},
      {"verbs1;cm=h:1", "no nic="},
      {"verbs1;cm=h:0" + nic, "is not host:port"},
      {"verbs1;cm=h" + nic, "is not host:port"},
      {"verbs1;cm=h:1;nic=mlx5_0,1,0", "fields, not 7"},
      {"verbs1;cm=h:1;nic=mlx5_0,0,0," + gid + ",roce,4096,0", "port is not 1..255"},
      {"verbs1;cm=h:1;nic=mlx5_0,1,0,zz,roce,4096,0", "gid is not 32 hex digits"},
      {"verbs1;cm=h:1;nic=mlx5_0,1,0," + gid + ",eth,4096,0", "link layer"},
      {"verbs1;cm=h:1;nic=mlx5_0,1,0," + gid + ",roce,1000,0", "mtu is not"},
      {"verbs1;cm=h:1" + nic + ";qp=5", "unknown field"},
  };
  for (const auto& [text, why] : cases) {
    auto e = ParseEndpoints(text);
    ASSERT_FALSE(e.ok()) << text;
    EXPECT_EQ(e.status().code(), KVB_ERR_INVALID_ARGUMENT) << text;
    EXPECT_HAS(e.status().message(), why);
    EXPECT_HAS(e.status().message(), "malformed endpoints");
  }
}

TEST(VerbsWire, RkeysAndFramesRoundTripAndMalformedOnesAreRefused) {
  const std::vector<RegionKey> keys = {{0x1234, 0x7f0000001000}, {0x99, 42}};
  const auto blob = EncodeRkeys(keys);
  auto back = DecodeRkeys(sdk::Bytes(blob));
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[0].rkey, 0x1234u);
  EXPECT_EQ((*back)[0].base, 0x7f0000001000u);
  auto cut = blob;
  cut.pop_back();
  EXPECT_EQ(DecodeRkeys(sdk::Bytes(cut)).status().code(), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(DecodeRkeys({}).status().code(), KVB_ERR_INVALID_ARGUMENT);

  Frame f;
  f.type = FrameType::kConnect;
  QpInfo q{1, 0, 0x123, 0x456, 7, {}, 4096};
  q.gid[3] = 9;
  f.qps = {q};
  auto bytes = EncodeFrame(f);
  auto d = DecodeFrame(sdk::Bytes(bytes).subspan(4));
  ASSERT_TRUE(d.ok()) << d.status().message();
  ASSERT_EQ(d->qps.size(), 1u);
  EXPECT_EQ(d->qps[0].client_nic, 1);
  EXPECT_EQ(d->qps[0].qp_num, 0x123u);
  EXPECT_EQ(d->qps[0].gid, q.gid);
  Frame refuse{FrameType::kRefuse, {}, KVB_ERR_BACKPRESSURE, "full"};
  bytes = EncodeFrame(refuse);
  d = DecodeFrame(sdk::Bytes(bytes).subspan(4));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->code, KVB_ERR_BACKPRESSURE);
  EXPECT_EQ(d->reason, "full");

  const std::vector<uint8_t> bad_type = {9, 1};
  EXPECT_HAS(DecodeFrame(sdk::Bytes(bad_type)).status().message(), "unknown type 9");
  const std::vector<uint8_t> short_qp = {1, 1, 0, 0};
  EXPECT_EQ(DecodeFrame(sdk::Bytes(short_qp)).status().code(), KVB_ERR_PROTOCOL);
  f.qps[0].qp_num = 0;
  bytes = EncodeFrame(f);
  EXPECT_HAS(DecodeFrame(sdk::Bytes(bytes).subspan(4)).status().message(), "qp_num 0");
}

// ---- 2. write then read back ------------------------------------------------------------------

TEST_F(VerbsTransportTest, WriteThenReadBackOnOneRail) {
  auto a = Make({"node-a", 11, {"a0"}});
  auto b = Make({"node-b", 22, {"b0"}});
  ASSERT_TRUE(a && b);
  constexpr size_t kLen = 1 << 20;
  auto src = Pattern(kLen, 7);
  std::vector<uint8_t> remote(kLen + 8192, 0), back(kLen, 0);
  Register(*a, 1, src.data(), kLen);
  Register(*a, 2, back.data(), kLen);
  Register(*b, 9, remote.data(), remote.size());
  Peer* peer = AddPeer(*a, *b);
  ASSERT_NE(peer, nullptr);

  sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 4096 + 3)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(std::memcmp(remote.data() + 4096 + 3, src.data(), kLen), 0);
  EXPECT_EQ(remote[4096 + 2], 0) << "WRITE landed before its offset";
  st = Transfer(*a, peer, {Op(KVB_OP_READ, 2, back.data(), kLen, 9, 4096 + 3)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(back, src);

  kvb_transport_stats_t stats{};
  ASSERT_TRUE(a->t->Stats(stats).ok());
  EXPECT_EQ(stats.bytes_written, kLen);
  EXPECT_EQ(stats.bytes_read, kLen);
  EXPECT_EQ(stats.connections_open, 1u);
  EXPECT_EQ(stats.queued_bytes, 0u);
  kvb_transport_stats_t bstats{};
  ASSERT_TRUE(b->t->Stats(bstats).ok());
  EXPECT_EQ(bstats.inbound_open, 1u);
  // The fake's limits are below RcOptions' defaults: the QPs were sized to the device.
  EXPECT_TRUE(a->Logged("QPs of 64 work requests, 8/8 RDMA READs")) << a->AllLogs();
}

TEST_F(VerbsTransportTest, WriteThenReadBackStripedOverTwoRails) {
  const std::map<std::string, std::string> cfg = {{"verbs.stripe_min_bytes", "65536"},
                                                  {"verbs.max_wr_bytes", "65536"}};
  auto a = Make({"node-a", 11, {"a0", "a1"}, "", cfg});
  auto b = Make({"node-b", 22, {"b0", "b1"}, "", cfg});
  ASSERT_TRUE(a && b);
  EXPECT_HAS(a->t->Endpoints(), "nic=a0,1,");
  EXPECT_HAS(a->t->Endpoints(), "nic=a1,1,");
  constexpr size_t kLen = (4 << 20) + 4097;
  auto src = Pattern(kLen, 3);
  std::vector<uint8_t> remote(kLen, 0), back(kLen, 0);
  Register(*a, 1, src.data(), kLen);
  Register(*a, 2, back.data(), kLen);
  Register(*b, 9, remote.data(), kLen);
  Peer* peer = AddPeer(*a, *b);

  sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(remote, src);
  const uint64_t on_a0 = fabric_.WrsPosted("a0"), on_a1 = fabric_.WrsPosted("a1");
  EXPECT_GT(on_a0, 0u);
  EXPECT_GT(on_a1, 0u);
  EXPECT_NEAR(static_cast<double>(on_a0), static_cast<double>(on_a1), 1.0)
      << "the two stripes are nearly equal";
  st = Transfer(*a, peer, {Op(KVB_OP_READ, 2, back.data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(back, src);
  const VerbsCounters c = a->t->Counters();
  ASSERT_EQ(c.wrs_per_nic.size(), 2u);
  EXPECT_GT(c.wrs_per_nic[0], on_a0 / 2);
  EXPECT_GT(c.wrs_per_nic[1], on_a1 / 2);
  kvb_transport_stats_t stats{};
  ASSERT_TRUE(a->t->Stats(stats).ok());
  EXPECT_EQ(stats.connections_open, 2u);
}

TEST_F(VerbsTransportTest, RailsAreChosenByDistanceToTheMemory) {
  constexpr size_t kLen = 1 << 20;
  auto near1 = Pattern(kLen, 4), near0 = Pattern(kLen, 6);
  const uint64_t on_node1 = reinterpret_cast<uint64_t>(near1.data());
  NodeSpec sa{"node-a", 11, {"a0", "a1"}, "", {{"verbs.stripe_min_bytes", "4096"}}};
  sa.numa = {0, 1};
  sa.locate = [on_node1](uint64_t addr, bool, int) {
    Location l;
    l.numa_node = addr == on_node1 ? 1 : 0;
    return l;
  };
  auto a = Make(sa);
  auto b = Make({"node-b", 22, {"b0", "b1"}});
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> remote(kLen, 0);
  Register(*a, 1, near1.data(), kLen);
  Register(*a, 2, near0.data(), kLen);
  Register(*b, 9, remote.data(), kLen);
  Peer* peer = AddPeer(*a, *b);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, near1.data(), kLen, 9, 0)}).ok());
  EXPECT_EQ(remote, near1);
  EXPECT_EQ(fabric_.WrsPosted("a0"), 0u) << "a0 is on the other NUMA node";
  EXPECT_GT(fabric_.WrsPosted("a1"), 0u);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 2, near0.data(), kLen, 9, 0)}).ok());
  EXPECT_EQ(remote, near0);
  EXPECT_GT(fabric_.WrsPosted("a0"), 0u);
}

TEST(VerbsTransportNuma, HostNumaNodeOfMappedMemoryIsANodeOrUnknown) {
  std::vector<uint8_t> v(4096, 1);
  const int node = HostNumaNodeOf(reinterpret_cast<uint64_t>(v.data()));
  EXPECT_GE(node, -1);
  EXPECT_LT(node, 1024);
}

// ---- 3. a rail fails mid-transfer -------------------------------------------------------------

TEST_F(VerbsTransportTest, ARailFailingMidTransferMovesItsWorkToTheOtherRail) {
  const std::map<std::string, std::string> cfg = {{"verbs.stripe_min_bytes", "65536"},
                                                  {"verbs.max_wr_bytes", "65536"},
                                                  {"verbs.max_outstanding_wr", "4"}};
  auto a = Make({"node-a", 11, {"a0", "a1"}, "", cfg});
  auto b = Make({"node-b", 22, {"b0", "b1"}, "", cfg});
  ASSERT_TRUE(a && b);
  constexpr size_t kLen = 2 << 20;
  auto src = Pattern(kLen, 9);
  std::vector<uint8_t> remote(kLen, 0);
  Register(*a, 1, src.data(), kLen);
  Register(*b, 9, remote.data(), kLen);
  Peer* peer = AddPeer(*a, *b);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)}).ok());

  // The third work request on a0's QP fails as a dead link does; its QP is evicted.
  fabric_.FailNextWrs("a0", WcStatus::kRetryExcErr);
  std::fill(remote.begin(), remote.end(), 0);
  const sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(remote, src);
  kvb_transport_stats_t stats{};
  ASSERT_TRUE(a->t->Stats(stats).ok());
  EXPECT_EQ(stats.connections_evicted, 1u);
  const VerbsCounters c = a->t->Counters();
  EXPECT_GE(c.rails_failed, 1u);
  EXPECT_GE(c.wrs_retried, 1u) << "the failed rail's work went to the other one";
  EXPECT_TRUE(a->Logged("evicted")) << a->AllLogs();
}

TEST_F(VerbsTransportTest, ARailWhosePortIsDownIsLeftOut) {
  const std::map<std::string, std::string> cfg = {{"verbs.stripe_min_bytes", "65536"}};
  auto a = Make({"node-a", 11, {"a0", "a1"}, "", cfg});
  auto b = Make({"node-b", 22, {"b0", "b1"}, "", cfg});
  ASSERT_TRUE(a && b);
  constexpr size_t kLen = 1 << 20;
  auto src = Pattern(kLen, 1);
  std::vector<uint8_t> remote(kLen, 0);
  Register(*a, 1, src.data(), kLen);
  Register(*b, 9, remote.data(), kLen);
  Peer* peer = AddPeer(*a, *b);
  fabric_.SetPortState("a0", 1, PortState::kDown);
  const sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(remote, src);
  EXPECT_EQ(fabric_.WrsPosted("a0"), 0u);
  EXPECT_GT(fabric_.WrsPosted("a1"), 0u);
  EXPECT_GE(a->t->Counters().rails_failed, 1u);
  EXPECT_TRUE(a->Logged("is not ACTIVE")) << a->AllLogs();
}

TEST_F(VerbsTransportTest, APortGoingDownEvictsItsRailWhichReconnectsLazilyOnceUp) {
  const std::map<std::string, std::string> cfg = {{"verbs.stripe_min_bytes", "65536"},
                                                  {"verbs.rail_retry_ms", "0"}};
  auto a = Make({"node-a", 11, {"a0", "a1"}, "", cfg});
  auto b = Make({"node-b", 22, {"b0", "b1"}, "", cfg});
  ASSERT_TRUE(a && b);
  constexpr size_t kLen = 1 << 20;
  auto src = Pattern(kLen, 2);
  std::vector<uint8_t> remote(kLen, 0);
  Register(*a, 1, src.data(), kLen);
  Register(*b, 9, remote.data(), kLen);
  Peer* peer = AddPeer(*a, *b);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)}).ok());
  ASSERT_EQ(fabric_.LiveQps("a0"), 1u);

  // a0's link goes down under an established QP: its work requests fail RETRY_EXC, the QP is
  // evicted, the stripe goes to a1, and a0 is not reconnected while its port is DOWN.
  fabric_.SetPortState("a0", 1, PortState::kDown);
  std::fill(remote.begin(), remote.end(), 0);
  sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(remote, src);
  EXPECT_EQ(fabric_.LiveQps("a0"), 0u);
  EXPECT_TRUE(a->Logged("is not ACTIVE")) << a->AllLogs();
  kvb_transport_stats_t stats{};
  ASSERT_TRUE(a->t->Stats(stats).ok());
  EXPECT_EQ(stats.connections_evicted, 1u);
  EXPECT_EQ(stats.connections_open, 1u);

  // Up again: once the port is asked again (after rail_retry_ms, at least 1 ms), the next op
  // reconnects a0 through the side channel, with a new QP.
  fabric_.SetPortState("a0", 1, PortState::kActive);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const uint64_t before = fabric_.WrsPosted("a0");
  st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_GT(fabric_.WrsPosted("a0"), before);
  ASSERT_TRUE(a->t->Stats(stats).ok());
  EXPECT_EQ(stats.connections_open, 2u);
  EXPECT_EQ(stats.connections_opened, 3u);
}

// ---- 4. restarted peer ------------------------------------------------------------------------

TEST_F(VerbsTransportTest, ARestartedPeerIsStaleAndGetsNoByte) {
  const std::map<std::string, std::string> cfg = {{"verbs.rail_retry_ms", "0"}};
  auto a = Make({"node-a", 11, {"a0"}, "", cfg});
  auto b1 = Make({"node-b", 100, {"b0"}});
  ASSERT_TRUE(a && b1);
  constexpr size_t kLen = 256 << 10;
  auto src = Pattern(kLen, 5);
  std::vector<uint8_t> old_mem(kLen, 0), new_mem(kLen, 0);
  Register(*a, 1, src.data(), kLen);
  Register(*b1, 9, old_mem.data(), kLen);
  Peer* old_peer = AddPeer(*a, *b1);
  ASSERT_TRUE(Transfer(*a, old_peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)}).ok());
  EXPECT_EQ(old_mem, src);

  // node-b restarts on the same side-channel port, registering the same segment id.
  const std::string port = std::to_string(b1->t->cm_port());
  b1.reset();
  auto b2 = Make({"node-b", 200, {"b0"}, "", {{"verbs.cm_listen", "127.0.0.1:" + port}}});
  ASSERT_TRUE(b2);
  Register(*b2, 9, new_mem.data(), kLen);
  const uint64_t posted_before = fabric_.WrsPosted("a0");

  sdk::Status st = Transfer(*a, old_peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_STALE_PEER) << st.message();
  EXPECT_HAS(st.message(), "incarnation");
  EXPECT_EQ(new_mem, std::vector<uint8_t>(kLen, 0)) << "a byte landed in the new process";
  EXPECT_EQ(fabric_.LiveQps("a0"), 0u) << "the old incarnation's QPs are closed";
  // From now on nothing is posted to the old incarnation: it fails at once.
  const uint64_t posted_after = fabric_.WrsPosted("a0");
  EXPECT_LE(posted_after - posted_before, 1u) << "at most the one WR that found the old QP dead";
  st = Transfer(*a, old_peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_STALE_PEER);
  EXPECT_EQ(fabric_.WrsPosted("a0"), posted_after);

  // The new incarnation, added as a new peer, works.
  Peer* new_peer = AddPeer(*a, *b2);
  st = Transfer(*a, new_peer, {Op(KVB_OP_WRITE, 1, src.data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(new_mem, src);
  a->t->RemovePeer(old_peer);
}

TEST_F(VerbsTransportTest, APeerRestartedBeforeTheFirstConnectIsStale) {
  auto a = Make({"node-a", 11, {"a0"}});
  auto b1 = Make({"node-b", 100, {"b0"}});
  ASSERT_TRUE(a && b1);
  std::vector<uint8_t> src(4096, 1), old_mem(4096, 0), new_mem(4096, 0);
  Register(*a, 1, src.data(), src.size());
  Register(*b1, 9, old_mem.data(), old_mem.size());
  Peer* old_peer = AddPeer(*a, *b1);
  const std::string port = std::to_string(b1->t->cm_port());
  b1.reset();
  auto b2 = Make({"node-b", 200, {"b0"}, "", {{"verbs.cm_listen", "127.0.0.1:" + port}}});
  ASSERT_TRUE(b2);
  Register(*b2, 9, new_mem.data(), new_mem.size());
  const sdk::Status st = Transfer(*a, old_peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_STALE_PEER) << st.message();
  EXPECT_EQ(fabric_.WrsPosted("a0"), 0u);
  EXPECT_EQ(new_mem, std::vector<uint8_t>(4096, 0));
}

// ---- 5. cluster token and malformed side-channel input ----------------------------------------

TEST_F(VerbsTransportTest, AWrongOrMissingClusterTokenIsUnauthenticatedAndMovesNothing) {
  auto b = Make({"node-b", 22, {"b0"}, "right-token"});
  auto wrong = Make({"node-a", 11, {"a0"}, "wrong-token"});
  auto none = Make({"node-c", 33, {"c0"}, ""});
  ASSERT_TRUE(b && wrong && none);
  std::vector<uint8_t> src(4096, 7), remote(4096, 0);
  Register(*b, 9, remote.data(), remote.size());
  for (Node* a : {wrong.get(), none.get()}) {
    SCOPED_TRACE(a->node_id);
    Register(*a, 1, src.data(), src.size());
    Peer* peer = AddPeer(*a, *b);
    const sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)});
    EXPECT_EQ(st.code(), KVB_ERR_UNAUTHENTICATED) << st.message();
    EXPECT_EQ(remote, std::vector<uint8_t>(4096, 0));
  }
  EXPECT_EQ(fabric_.WrsPosted("a0") + fabric_.WrsPosted("c0"), 0u);
  kvb_transport_stats_t stats{};
  // The server counts a refusal after sending it: the client may have its answer first.
  EXPECT_TRUE(Eventually([&] { return b->t->Stats(stats).ok() && stats.frames_rejected >= 2; }))
      << stats.frames_rejected;
  EXPECT_EQ(stats.inbound_open, 0u) << "no QP was made for an unauthenticated client";
  EXPECT_TRUE(b->Logged("handshake refused")) << b->AllLogs();

  // With the right token it works.
  auto good = Make({"node-d", 44, {"d0"}, "right-token"});
  ASSERT_TRUE(good);
  Register(*good, 1, src.data(), src.size());
  Peer* peer = AddPeer(*good, *b);
  const sdk::Status st = Transfer(*good, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(remote, src);
}

TEST_F(VerbsTransportTest, MalformedSideChannelInputClosesThatConnectionAndTheListenerGoesOn) {
  auto a = Make({"node-a", 11, {"a0"}});
  auto b = Make({"node-b", 22, {"b0"}});
  ASSERT_TRUE(a && b);

  // Garbage instead of a handshake.
  int fd = kvbridge::testing::ConnectLoopback(b->t->cm_port());
  ASSERT_GE(fd, 0);
  const char junk[] = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_GT(send(fd, junk, sizeof(junk), 0), 0);
  EXPECT_TRUE(kvbridge::testing::ClosedWithin(fd, 5000));
  close(fd);

  // A proper handshake, then a frame of an unknown type.
  core::HostServices mallory_host({}, core::auth::Identity{"mallory", 5, ""});
  const sdk::Host mallory(mallory_host.table(), "verbs");
  fd = kvbridge::testing::ConnectLoopback(b->t->cm_port());
  ASSERT_GE(fd, 0);
  auto auth = mallory.BeginAuth(KVB_AUTH_CLIENT, "node-b", 22);
  ASSERT_TRUE(auth.ok());
  std::vector<uint8_t> out, in;
  sdk::Status st = auth->Step({}, &out);
  while (st.code() == KVB_IN_PROGRESS) {
    ASSERT_EQ(send(fd, out.data(), out.size(), 0), static_cast<ssize_t>(out.size()));
    in.clear();
    auto need = auth->Need(sdk::Bytes(in));
    while (need.ok() && *need > in.size()) {
      const size_t have = in.size();
      in.resize(*need);
      ASSERT_EQ(recv(fd, in.data() + have, *need - have, MSG_WAITALL),
                static_cast<ssize_t>(*need - have));
      need = auth->Need(sdk::Bytes(in));
    }
    st = auth->Step(sdk::Bytes(in), &out);
  }
  ASSERT_TRUE(st.ok()) << st.message();
  if (!out.empty()) send(fd, out.data(), out.size(), 0);
  const uint8_t bad_frame[] = {2, 0, 0, 0, 7, 1};
  ASSERT_EQ(send(fd, bad_frame, sizeof(bad_frame), 0), static_cast<ssize_t>(sizeof(bad_frame)));
  EXPECT_TRUE(kvbridge::testing::ClosedWithin(fd, 5000));
  close(fd);

  EXPECT_TRUE(b->Logged("malformed handshake message")) << b->AllLogs();
  EXPECT_TRUE(b->Logged("unknown type 7")) << b->AllLogs();
  EXPECT_TRUE(b->Logged("connection closed")) << b->AllLogs();
  kvb_transport_stats_t stats{};
  ASSERT_TRUE(b->t->Stats(stats).ok());
  EXPECT_EQ(stats.frames_rejected, 2u);
  EXPECT_EQ(stats.inbound_open, 0u);

  // The listener goes on.
  std::vector<uint8_t> src(8192, 3), remote(8192, 0);
  Register(*a, 1, src.data(), src.size());
  Register(*b, 9, remote.data(), remote.size());
  Peer* peer = AddPeer(*a, *b);
  st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), src.size(), 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(remote, src);
}

TEST_F(VerbsTransportTest, ASilentSideChannelClientDelaysNoOtherAndExchangesAreBounded) {
  auto a = Make({"node-a", 11, {"a0"}});
  auto b = Make({"node-b", 22, {"b0"}, "", {{"verbs.connect_timeout_ms", "5000"}}});
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> src(4096, 8), remote(4096, 0);
  Register(*a, 1, src.data(), src.size());
  Register(*b, 9, remote.data(), remote.size());
  const int silent = kvbridge::testing::ConnectLoopback(b->t->cm_port());
  ASSERT_GE(silent, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  Peer* peer = AddPeer(*a, *b);
  const auto start = std::chrono::steady_clock::now();
  sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), src.size(), 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2))
      << "the exchange waited behind the silent client";
  EXPECT_EQ(remote, src);
  close(silent);

  // With one exchange allowed at a time, a second client is turned away while one is silent.
  auto c = Make({"node-c", 33, {"c0"}, "", {{"verbs.max_handshakes", "1"}}});
  ASSERT_TRUE(c);
  Register(*c, 9, remote.data(), remote.size());
  const int hog = kvbridge::testing::ConnectLoopback(c->t->cm_port());
  ASSERT_GE(hog, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  Peer* to_c = AddPeer(*a, *c);
  st = Transfer(*a, to_c, {Op(KVB_OP_WRITE, 1, src.data(), src.size(), 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_PEER_UNREACHABLE) << st.message();
  EXPECT_TRUE(c->Logged("verbs.max_handshakes")) << c->AllLogs();
  close(hog);
}

TEST_F(VerbsTransportTest, RemovingAPeerWhoseConnectHangsReturnsAtOnceAndCancels) {
  auto a = Make({"node-a", 11, {"a0"}, "", {{"verbs.connect_timeout_ms", "3000"}}});
  auto b = Make({"node-b", 22, {"b0"}});
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> src(4096, 1), remote(4096, 0);
  Register(*a, 1, src.data(), src.size());
  Register(*b, 9, remote.data(), remote.size());
  // A side channel that takes connections and never answers: b's NICs behind a black hole.
  const int hole = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(hole, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(listen(hole, 4), 0);
  socklen_t len = sizeof(sa);
  getsockname(hole, reinterpret_cast<sockaddr*>(&sa), &len);
  std::string ep;
  std::vector<kvb_peer_segment_t> segs;
  kvb_peer_info_t info = Info(*b, &ep, &segs);
  const std::string cm = "cm=127.0.0.1:" + std::to_string(b->t->cm_port());
  ep.replace(ep.find(cm), cm.size(), "cm=127.0.0.1:" + std::to_string(ntohs(sa.sin_port)));
  info.endpoints = ep.c_str();
  auto peer = a->t->AddPeer(sdk::PeerInfo::From(&info));
  ASSERT_TRUE(peer.ok()) << peer.status().message();
  Request* r = nullptr;
  ASSERT_TRUE(Post(*a, *peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)}, 0, 0, &r).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  a->t->RemovePeer(*peer);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500))
      << "remove_peer waited for the hanging connect";
  EXPECT_EQ(a->t->Poll(r, {}).code(), KVB_ERR_CANCELLED);
  a->t->Release(r);
  EXPECT_EQ(remote, std::vector<uint8_t>(4096, 0));
  close(hole);
}

// ---- 6. deadline, progress timeout, backpressure ----------------------------------------------

TEST_F(VerbsTransportTest, AStalledTransferEndsDeadlineExceededByItsDeadline) {
  const std::map<std::string, std::string> cfg = {{"verbs.progress_timeout_ms", "60000"},
                                                  {"verbs.rail_retry_ms", "0"}};
  auto a = Make({"node-a", 11, {"a0"}, "", cfg});
  auto b = Make({"node-b", 22, {"b0"}});
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> src(65536, 1), remote(65536, 0);
  Register(*a, 1, src.data(), src.size());
  Register(*b, 9, remote.data(), remote.size());
  Peer* peer = AddPeer(*a, *b);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)}).ok());
  std::fill(remote.begin(), remote.end(), 0);

  fabric_.Stall();
  const uint64_t deadline = NowNs() + 150 * 1000000ull;
  const sdk::Status st =
      Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), src.size(), 9, 0)}, deadline);
  const uint64_t ended = NowNs();
  EXPECT_EQ(st.code(), KVB_ERR_DEADLINE_EXCEEDED) << st.message();
  EXPECT_GE(ended, deadline);
  EXPECT_LT(ended, deadline + 500 * 1000000ull) << "ended well after its deadline";
  fabric_.Unstall();
  EXPECT_EQ(remote, std::vector<uint8_t>(65536, 0)) << "the stalled WRITE landed after all";

  // The rail was closed to stop the NIC; the next transfer reconnects.
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), src.size(), 9, 0)}).ok());
  EXPECT_EQ(remote, src);
}

TEST_F(VerbsTransportTest, AStalledTransferEndsProgressTimeout) {
  const std::map<std::string, std::string> cfg = {{"verbs.rail_retry_ms", "0"}};
  auto a = Make({"node-a", 11, {"a0"}, "", cfg});
  auto b = Make({"node-b", 22, {"b0"}});
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> src(65536, 1), remote(65536, 0);
  Register(*a, 1, src.data(), src.size());
  Register(*b, 9, remote.data(), remote.size());
  Peer* peer = AddPeer(*a, *b);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)}).ok());

  fabric_.Stall();
  const uint64_t start = NowNs();
  const sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), src.size(), 9, 0)},
                                  /*deadline_ns=*/0, /*progress_timeout_ns=*/100 * 1000000ull);
  const uint64_t took_ms = (NowNs() - start) / 1000000;
  EXPECT_EQ(st.code(), KVB_ERR_PROGRESS_TIMEOUT) << st.message();
  EXPECT_GE(took_ms, 100u);
  EXPECT_LT(took_ms, 1000u);
  fabric_.Unstall();
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), src.size(), 9, 0)}).ok());
}

TEST_F(VerbsTransportTest, PostsPastTheQueuedBoundAreBackpressure) {
  const std::map<std::string, std::string> cfg = {{"verbs.max_queued_bytes_per_peer", "65536"},
                                                  {"verbs.max_queued_ops_per_peer", "4"}};
  auto a = Make({"node-a", 11, {"a0"}, "", cfg});
  auto b = Make({"node-b", 22, {"b0"}});
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> src(65536, 1), remote(65536, 0);
  Register(*a, 1, src.data(), src.size());
  Register(*b, 9, remote.data(), remote.size());
  Peer* peer = AddPeer(*a, *b);
  fabric_.Stall();
  Request* first = nullptr;
  ASSERT_TRUE(Post(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 49152, 9, 0)}, 0, 0, &first).ok());
  Request* second = nullptr;
  sdk::Status st = Post(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 32768, 9, 0)}, 0, 0, &second);
  EXPECT_EQ(st.code(), KVB_ERR_BACKPRESSURE) << st.message();
  EXPECT_HAS(st.message(), "verbs.max_queued_bytes_per_peer");
  EXPECT_EQ(second, nullptr);
  std::vector<kvb_xfer_op_t> many(4, Op(KVB_OP_WRITE, 1, src.data(), 16, 9, 0));
  st = Post(*a, peer, many, 0, 0, &second);
  EXPECT_EQ(st.code(), KVB_ERR_BACKPRESSURE) << "the ops bound: " << st.message();
  kvb_transport_stats_t stats{};
  ASSERT_TRUE(a->t->Stats(stats).ok());
  EXPECT_EQ(stats.queued_bytes, 49152u);

  a->t->Cancel(first);
  std::vector<kvb_status_t> op(1);
  EXPECT_EQ(a->t->Poll(first, op).code(), KVB_ERR_CANCELLED);
  EXPECT_EQ(op[0], KVB_ERR_CANCELLED);
  a->t->Release(first);
  fabric_.Unstall();
  ASSERT_TRUE(a->t->Stats(stats).ok());
  EXPECT_EQ(stats.queued_bytes, 0u);
}

// ---- 7. deregistered remote memory ------------------------------------------------------------

TEST_F(VerbsTransportTest, DeregisteredRemoteMemoryIsNotRegistered) {
  auto a = Make({"node-a", 11, {"a0"}});
  auto b = Make({"node-b", 22, {"b0"}});
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> src(8192, 4), remote(8192, 0);
  Register(*a, 1, src.data(), src.size());
  Register(*b, 9, remote.data(), remote.size());
  Peer* peer = AddPeer(*a, *b);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)}).ok());
  std::fill(remote.begin(), remote.end(), 0);

  // The peer deregisters; before A hears of it the NIC refuses the rkey.
  ASSERT_TRUE(b->t->DeregisterMemory(9).ok());
  b->segments.erase(9);
  sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_NOT_REGISTERED) << st.message();
  EXPECT_HAS(st.message(), "remote access error");
  EXPECT_EQ(remote, std::vector<uint8_t>(8192, 0));

  // Once the descriptor says so, the post itself is refused before anything is posted.
  ASSERT_TRUE(UpdatePeer(*a, peer, *b).ok());
  const uint64_t posted = fabric_.WrsPosted("a0");
  st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_NOT_REGISTERED) << st.message();
  EXPECT_HAS(st.message(), "segment 9 is not registered at node-b");
  EXPECT_EQ(fabric_.WrsPosted("a0"), posted);
  // Out of bounds of a registered segment is refused too.
  Register(*b, 10, remote.data(), 4096);
  ASSERT_TRUE(UpdatePeer(*a, peer, *b).ok());
  st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, src.data(), 4096, 10, 1)});
  EXPECT_EQ(st.code(), KVB_ERR_OUT_OF_BOUNDS) << st.message();
  EXPECT_EQ(b->t->DeregisterMemory(9).code(), KVB_ERR_NOT_FOUND);
}

TEST_F(VerbsTransportTest, TheSideChannelTakesTheListenHostOnAPortOfItsOwn) {
  // The engine's listen port belongs to tcp; verbs binds the same host on a free port.
  const int busy = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(busy, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(listen(busy, 1), 0);
  socklen_t len = sizeof(sa);
  getsockname(busy, reinterpret_cast<sockaddr*>(&sa), &len);
  const std::string taken = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  auto a = Make({"node-a", 11, {"a0"}, "", {}, taken});
  ASSERT_TRUE(a);
  EXPECT_NE(a->t->cm_port(), ntohs(sa.sin_port));
  EXPECT_HAS(a->t->Endpoints(), "cm=127.0.0.1:");
  close(busy);
  auto bad = Make({"node-b", 22, {"b0"}, "", {{"verbs.cm_listen", "nonsense"}}}, nullptr, false);
  EXPECT_EQ(bad, nullptr);
}

TEST_F(VerbsTransportTest, NoDeviceInTheTreeIsUnavailableNamingIt) {
  FakeSysfsTree empty({});
  core::HostServices host({}, core::auth::Identity{"n", 1, ""});
  Fabric f;
  f.api = &fabric_;
  f.sysfs_root = empty.root();
  f.make_registrar = [this](const std::string& d, DeviceHandle, PdHandle) {
    return fabric_.MakeRegistrar(d);
  };
  kvb_transport_params_t params{sizeof(params), "n", 1, "127.0.0.1:0", ""};
  auto t = Transport::Create(sdk::Host(host.table(), "verbs"), params, f);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), KVB_ERR_UNAVAILABLE);
  EXPECT_HAS(t.status().message(), "no RDMA device (");
}

TEST_F(VerbsTransportTest, ConfigValuesOutOfRangeAreRefusedNamingTheKey) {
  sdk::Status why;
  FakeSysfsTree tree({"z0"});
  fabric_.AddDevice("z0");
  core::HostServices host({{"verbs.max_outstanding_wr", "0"}}, core::auth::Identity{"n", 1, ""});
  Fabric f;
  f.api = &fabric_;
  f.sysfs_root = tree.root();
  f.make_registrar = [this](const std::string& d, DeviceHandle, PdHandle) {
    return fabric_.MakeRegistrar(d);
  };
  kvb_transport_params_t params{sizeof(params), "n", 1, "127.0.0.1:0", ""};
  auto t = Transport::Create(sdk::Host(host.table(), "verbs"), params, f);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_HAS(t.status().message(), "verbs.max_outstanding_wr");
}

}  // namespace
}  // namespace kvbridge::verbs
