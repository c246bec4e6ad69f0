// The tcp plugin through its ABI: two instances in one process stand in for two processes and
// talk over real loopback sockets; raw sockets built with tcp_wire play misbehaving peers.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "tests/tcp/tcp_test_util.h"
#include "util/checksum.h"

namespace kvbridge::tcp::test {
namespace {

constexpr uint64_t kMiB = 1u << 20;
using Config = std::map<std::string, std::string>;

std::unique_ptr<Instance> Make(const std::string& node, uint64_t incarnation, Config config = {},
                               const std::string& token = "",
                               const std::string& listen = "127.0.0.1:0") {
  Instance::Options o;
  o.node_id = node;
  o.incarnation = incarnation;
  o.config = std::move(config);
  o.token = token;
  o.listen = listen;
  return Instance::Create(o);
}

// A serving instance with one registered region.
// The memory is declared first so the instance (which may still be serving it) goes first.
struct Server {
  std::unique_ptr<Buffer> mem;
  std::unique_ptr<Instance> inst;
  uint64_t seg = 0;
  Server(const std::string& node, uint64_t incarnation, size_t bytes, Config config = {},
         const std::string& token = "", const std::string& listen = "127.0.0.1:0")
      : mem(std::make_unique<Buffer>(bytes)),
        inst(Make(node, incarnation, std::move(config), token, listen)) {
    if (inst) seg = inst->Register(mem->data(), mem->size());
  }
};

// A client instance with one registered region.
struct Client {
  std::unique_ptr<Buffer> mem;
  std::unique_ptr<Instance> inst;
  uint64_t seg = 0;
  Client(const std::string& node, size_t bytes, Config config = {}, const std::string& token = "")
      : mem(std::make_unique<Buffer>(bytes)), inst(Make(node, 0xc0ffee, std::move(config), token)) {
    if (inst) seg = inst->Register(mem->data(), mem->size());
  }
  kvb_xfer_op_t Write(size_t local_off, uint64_t len, uint64_t remote_seg, uint64_t remote_off) {
    return inst->Op(KVB_OP_WRITE, seg, mem->data() + local_off, len, remote_seg, remote_off);
  }
  kvb_xfer_op_t Read(size_t local_off, uint64_t len, uint64_t remote_seg, uint64_t remote_off) {
    return inst->Op(KVB_OP_READ, seg, mem->data() + local_off, len, remote_seg, remote_off);
  }
};

TEST(TcpTransport, DescriptorAndEndpoints) {
  const kvb_plugin_descriptor_t* d = Descriptor();
  EXPECT_STREQ(d->name, "tcp");
  EXPECT_EQ(d->kind, KVB_PLUGIN_TRANSPORT);
  EXPECT_EQ(d->caps, KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM | KVB_TCAP_CUDA_MEM |
                         KVB_TCAP_STATS | KVB_TCAP_OP_CRC32C);
  char reason[64];
  EXPECT_EQ(d->probe(reason, sizeof(reason)), KVB_OK);
  auto a = Make("a", 1, {}, "", "127.0.0.1:0,127.0.0.1:0");
  ASSERT_TRUE(a);
  const std::string eps = a->Endpoints();
  EXPECT_EQ(eps.find(":0,"), std::string::npos) << eps;
  EXPECT_NE(eps.find(','), std::string::npos) << "two listeners, two endpoints: " << eps;
  EXPECT_NE(a->Port(), 0);
  char tiny[4];
  EXPECT_EQ(Ops()->get_endpoints(a->t(), tiny, sizeof(tiny)), -2);
}

TEST(TcpTransport, MalformedConfigNamesTheKey) {
  for (const auto& [key, value] : Config{{"tcp.lanes_per_peer", "four"},
                                         {"tcp.slice_bytes", "0"},
                                         {"tcp.idle_timeout_ms", "-5"},
                                         {"tcp.max_frame_bytes", "99999999999999999999999"}}) {
    Instance::Options o;
    o.config = {{key, value}};
    std::unique_ptr<Instance> inst;
    std::string err;
    EXPECT_EQ(Instance::TryCreate(o, &inst, &err), KVB_ERR_INVALID_ARGUMENT) << key;
    EXPECT_NE(err.find(key), std::string::npos) << err;
  }
}

TEST(TcpTransport, ReadWriteRoundTripsAcrossSizes) {
  Server b("b", 0xb1, 64 * kMiB + 4096);
  Client a("a", 64 * kMiB + 4096);
  ASSERT_TRUE(b.inst && a.inst);
  kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
  uint64_t moved = 0, seed = 1;
  for (uint64_t len : {uint64_t{1}, uint64_t{4097}, kMiB, 64 * kMiB}) {
    SCOPED_TRACE("length " + std::to_string(len));
    const uint64_t roff = 13;  // unaligned on purpose
    a.mem->Fill(seed++, 0, len);
    Result w = a.inst->Transfer(peer, {a.Write(0, len, b.seg, roff)});
    ASSERT_EQ(w.status, KVB_OK) << w.msg;
    EXPECT_EQ(w.completions, 1);
    ASSERT_EQ(std::memcmp(b.mem->data() + roff, a.mem->data(), len), 0) << "WRITE landed wrong";
    EXPECT_EQ(b.mem->data()[roff - 1], 0);
    EXPECT_EQ(b.mem->data()[roff + len], 0) << "WRITE ran past its range";
    std::memset(a.mem->data(), 0, len + 2);
    Result r = a.inst->Transfer(peer, {a.Read(1, len, b.seg, roff)});
    ASSERT_EQ(r.status, KVB_OK) << r.msg;
    ASSERT_EQ(std::memcmp(a.mem->data() + 1, b.mem->data() + roff, len), 0) << "READ wrong";
    EXPECT_EQ(a.mem->data()[0], 0);
    EXPECT_EQ(a.mem->data()[len + 1], 0) << "READ ran past its buffer";
    moved += len;
  }
  const kvb_transport_stats_t s = a.inst->Stats();
  EXPECT_EQ(s.bytes_written, moved);
  EXPECT_EQ(s.bytes_read, moved);
  EXPECT_EQ(s.queued_bytes, 0u);
  EXPECT_GE(s.connections_opened, 2u) << "64 MiB should have been spread over several lanes";
  EXPECT_LE(s.connections_open, 4u);
  EXPECT_EQ(s.connections_evicted, 0u);
  EXPECT_EQ(b.inst->Stats().frames_rejected, 0u);
  EXPECT_EQ(b.inst->Stats().inbound_open, s.connections_open);
}

TEST(TcpTransport, PerOpStatusesInOneRequest) {
  Server b("b", 0xb5, 64 * 1024);
  Client a("a", 64 * 1024);
  ASSERT_TRUE(b.inst && a.inst);
  // The descriptor publishes the segment's length, so an op past it fails without any I/O;
  // an unknown segment is left to the peer, which answers NOT_REGISTERED.
  kvb_peer_segment_t seg{.struct_size = sizeof(kvb_peer_segment_t),
                         .mem_kind = KVB_MEM_HOST,
                         .segment_id = b.seg,
                         .length = b.mem->size(),
                         .rkey = nullptr,
                         .rkey_len = 0};
  kvb_tpeer_t* peer = a.inst->AddPeerRaw("b", 0xb5, b.inst->Endpoints(), {seg});
  a.mem->Fill(3);
  Result r = a.inst->Transfer(
      peer, {a.Write(0, 4096, b.seg, 0), a.Write(0, 4096, b.seg + 77, 0),
             a.Write(0, 4096, b.seg, 64 * 1024 - 100), a.Read(8192, 100, b.seg, 0)});
  EXPECT_EQ(r.status, KVB_ERR_NOT_REGISTERED) << "first failing op wins: " << r.msg;
  ASSERT_EQ(r.op_status.size(), 4u);
  EXPECT_EQ(r.op_status[0], KVB_OK);
  EXPECT_EQ(r.op_status[1], KVB_ERR_NOT_REGISTERED);
  EXPECT_EQ(r.op_status[2], KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(r.op_status[3], KVB_OK);
  EXPECT_EQ(std::memcmp(b.mem->data(), a.mem->data(), 4096), 0);
  EXPECT_EQ(b.mem->data()[64 * 1024 - 1], 0);
  EXPECT_EQ(b.inst->Stats().frames_rejected, 1u);
  // Local memory outside any registered region is refused at post, nothing queued.
  std::vector<uint8_t> stray(64);
  std::shared_ptr<Pending> p;
  EXPECT_EQ(a.inst->PostAsync(peer, {a.inst->Op(KVB_OP_READ, a.seg, stray.data(), 64, b.seg, 0)},
                              1000, &p),
            KVB_ERR_NOT_REGISTERED);
  EXPECT_EQ(a.inst->Stats().queued_bytes, 0u);
}

TEST(TcpTransport, MalformedFramesAreRefusedAndTouchNoMemory) {
  Server b("b", 0xb2, 64 * 1024, {{"tcp.max_frame_bytes", std::to_string(kMiB)}});
  ASSERT_TRUE(b.inst);
  b.mem->Fill(7);
  const uint64_t before = b.mem->Checksum();
  std::vector<uint8_t> payload(4096, 0xEE);
  uint64_t expected_rejects = 0;

  {  // Refused requests with sane lengths: an error reply, and the connection stays usable.
    RawClient c(b.inst->Port());
    ASSERT_EQ(c.Handshake("raw", 1, "b", 0xb2), KVB_OK);
    struct Case {
      uint64_t seg, off, len;
      kvb_status_t want;
    };
    const Case cases[] = {{b.seg + 1, 0, 100, KVB_ERR_NOT_REGISTERED},
                          {b.seg, 64 * 1024 - 10, 100, KVB_ERR_OUT_OF_BOUNDS},
                          {b.seg, UINT64_MAX - 5, 10, KVB_ERR_OUT_OF_BOUNDS},
                          {b.seg, 64 * 1024, 1, KVB_ERR_OUT_OF_BOUNDS},
                          {b.seg, 0, 64 * 1024 + 1, KVB_ERR_OUT_OF_BOUNDS}};
    uint64_t id = 10;
    for (const Case& k : cases) {
      for (uint16_t opcode : {uint16_t{KVB_OP_WRITE}, uint16_t{KVB_OP_READ}}) {
        std::vector<uint8_t> body(opcode == KVB_OP_WRITE ? k.len : 0, 0xEE);
        wire::RequestHeader h{wire::kRequestMagic, opcode, 0, ++id, k.seg, k.off, k.len};
        ASSERT_TRUE(c.SendRequest(h, opcode == KVB_OP_WRITE ? body.data() : nullptr));
        wire::ResponseHeader resp;
        ASSERT_TRUE(c.RecvResponse(&resp)) << "seg " << k.seg << " off " << k.off;
        EXPECT_EQ(resp.magic, wire::kResponseMagic);
        EXPECT_EQ(resp.request_id, id);
        EXPECT_EQ(resp.status, k.want);
        EXPECT_EQ(resp.length, 0u);
        ++expected_rejects;
      }
    }
    // Still in sync: a valid READ is served.
    wire::RequestHeader h{wire::kRequestMagic, KVB_OP_READ, 0, 999, b.seg, 100, 64};
    ASSERT_TRUE(c.SendRequest(h));
    wire::ResponseHeader resp;
    ASSERT_TRUE(c.RecvResponse(&resp));
    EXPECT_EQ(resp.status, KVB_OK);
    ASSERT_EQ(resp.length, 64u);
    uint8_t data[64];
    ASSERT_TRUE(c.RecvAll(data, sizeof(data)));
    EXPECT_EQ(std::memcmp(data, b.mem->data() + 100, 64), 0);
  }

  // Malformed frames: the connection is closed and nothing is touched.
  std::mt19937_64 rng(5);
  struct Bad {
    const char* what;
    wire::RequestHeader h;
  };
  const Bad bad[] = {
      {"bad magic", {0xdeadbeef, KVB_OP_WRITE, 0, 1, b.seg, 0, 16}},
      {"huge length", {wire::kRequestMagic, KVB_OP_WRITE, 0, 1, b.seg, 0, kMiB + 1}},
      {"huge length, bad segment", {wire::kRequestMagic, KVB_OP_WRITE, 0, 1, 12345, 0, ~0ull}},
      {"unknown opcode", {wire::kRequestMagic, 7, 0, 1, b.seg, 0, 16}},
      {"reserved flags", {wire::kRequestMagic, KVB_OP_WRITE, 1, 1, b.seg, 0, 16}},
      {"zero length", {wire::kRequestMagic, KVB_OP_WRITE, 0, 1, b.seg, 0, 0}},
  };
  for (const Bad& k : bad) {
    RawClient c(b.inst->Port());
    ASSERT_EQ(c.Handshake("raw", 1, "b", 0xb2), KVB_OK);
    ASSERT_TRUE(c.SendRequest(k.h));
    c.SendAll(payload.data(), 16);  // what a WRITE payload would have been
    EXPECT_TRUE(c.WaitClosed()) << k.what << ": connection left open";
    ++expected_rejects;
  }
  for (int i = 0; i < 20; ++i) {  // random garbage after a valid handshake
    RawClient c(b.inst->Port());
    ASSERT_EQ(c.Handshake("raw", 1, "b", 0xb2), KVB_OK);
    uint8_t junk[wire::kRequestHeaderBytes];
    for (auto& j : junk) j = static_cast<uint8_t>(rng());
    junk[0] ^= 0x40;  // never the request magic
    ASSERT_TRUE(c.SendAll(junk, sizeof(junk)));
    EXPECT_TRUE(c.WaitClosed()) << "garbage frame left the connection open";
    ++expected_rejects;
  }
  {  // Garbage instead of a handshake, and a frame before any handshake.
    RawClient c(b.inst->Port());
    std::vector<uint8_t> junk(100, 0x41);
    ASSERT_TRUE(c.SendAll(junk.data(), junk.size()));
    EXPECT_TRUE(c.WaitClosed());
    ++expected_rejects;
    RawClient d(b.inst->Port());
    wire::RequestHeader h{wire::kRequestMagic, KVB_OP_WRITE, 0, 1, b.seg, 0, 16};
    ASSERT_TRUE(d.SendRequest(h, payload.data()));
    EXPECT_TRUE(d.WaitClosed());
    ++expected_rejects;
  }
  {  // A header cut short, then the peer goes away: nothing to refuse, nothing written.
    RawClient c(b.inst->Port());
    ASSERT_EQ(c.Handshake("raw", 1, "b", 0xb2), KVB_OK);
    uint8_t hb[wire::kRequestHeaderBytes];
    wire::EncodeRequestHeader({wire::kRequestMagic, KVB_OP_WRITE, 0, 1, b.seg, 0, 16}, hb);
    ASSERT_TRUE(c.SendAll(hb, 20));
  }
  EXPECT_EQ(b.mem->Checksum(), before) << "a refused frame changed registered memory";
  EXPECT_EQ(b.inst->Stats().frames_rejected, expected_rejects);
  EXPECT_TRUE(b.inst->host().LogContains("bad request magic"));

  // The instance still serves a normal client.
  Client a("a", 64 * 1024);
  kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
  Result r = a.inst->Transfer(peer, {a.Read(0, 64 * 1024, b.seg, 0)});
  ASSERT_EQ(r.status, KVB_OK) << r.msg;
  EXPECT_EQ(std::memcmp(a.mem->data(), b.mem->data(), 64 * 1024), 0);
}

// The server reads pipelined request headers ahead (several per recv) and gathers responses
// into one send: a burst written in one piece, mixing READs, a refused WRITE whose payload
// starts inside the read-ahead, an accepted WRITE longer than the read-ahead and more READs
// than one gathered send holds, is answered completely, in order, with the right bytes.
TEST(TcpTransport, PipelinedBurstIsServedInOrderWithTheRightBytes) {
  Server b("b", 0xb5, 64 * 1024);
  ASSERT_TRUE(b.inst);
  b.mem->Fill(3);
  std::vector<uint8_t> burst;
  auto add = [&](uint16_t opcode, uint64_t id, uint64_t seg, uint64_t off, uint64_t len,
                 const uint8_t* payload) {
    uint8_t hb[wire::kRequestHeaderBytes];
    wire::EncodeRequestHeader({wire::kRequestMagic, opcode, 0, id, seg, off, len}, hb);
    burst.insert(burst.end(), hb, hb + sizeof(hb));
    if (payload != nullptr) burst.insert(burst.end(), payload, payload + len);
  };
  std::vector<uint8_t> refused(3000, 0xAB), written(9000);
  for (size_t i = 0; i < written.size(); ++i) written[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<uint8_t> expect_mem(b.mem->data(), b.mem->data() + b.mem->size());
  std::memcpy(expect_mem.data() + 1000, written.data(), written.size());
  struct Want {
    uint64_t id;
    kvb_status_t status;
    uint64_t off, len;  // READ payload expected from expect_mem
  };
  std::vector<Want> want;
  add(KVB_OP_READ, 1, b.seg, 5, 100, nullptr);
  want.push_back({1, KVB_OK, 5, 100});
  add(KVB_OP_WRITE, 2, b.seg + 1, 0, refused.size(), refused.data());
  want.push_back({2, KVB_ERR_NOT_REGISTERED, 0, 0});
  add(KVB_OP_WRITE, 3, b.seg, 1000, written.size(), written.data());
  want.push_back({3, KVB_OK, 0, 0});
  add(KVB_OP_READ, 4, b.seg, 1000, written.size(), nullptr);
  want.push_back({4, KVB_OK, 1000, written.size()});
  for (uint64_t i = 0; i < 70; ++i) {  // more than one gathered send (32 responses) holds
    const uint64_t off = (i * 911) % (60 * 1024);
    add(KVB_OP_READ, 100 + i, b.seg, off, 1 + i * 37, nullptr);
    want.push_back({100 + i, KVB_OK, off, 1 + i * 37});
  }
  add(KVB_OP_READ, 500, b.seg, 64 * 1024 - 4, 8, nullptr);  // out of bounds
  want.push_back({500, KVB_ERR_OUT_OF_BOUNDS, 0, 0});
  add(KVB_OP_READ, 501, b.seg, 0, 64 * 1024, nullptr);
  want.push_back({501, KVB_OK, 0, 64 * 1024});

  // Pass 0 sends the burst in one piece; the others cut it at random points (headers and
  // payloads split across reads, the read-ahead refilled mid-header) with short pauses.
  for (uint32_t pass = 0; pass < 4; ++pass) {
    SCOPED_TRACE("pass " + std::to_string(pass));
    RawClient c(b.inst->Port());
    ASSERT_EQ(c.Handshake("raw", 1, "b", 0xb5), KVB_OK);
    std::atomic<bool> sent_ok{true};
    std::thread sender([&] {
      if (pass == 0) {
        sent_ok = c.SendAll(burst.data(), burst.size());
        return;
      }
      std::mt19937 rng(pass);
      for (size_t at = 0; at < burst.size() && sent_ok;) {
        const size_t n = std::min<size_t>(burst.size() - at, 1 + rng() % 5000);
        sent_ok = c.SendAll(burst.data() + at, n);
        at += n;
        if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
    });
    std::vector<uint8_t> got;
    for (const Want& w : want) {
      SCOPED_TRACE("request " + std::to_string(w.id));
      wire::ResponseHeader resp;
      ASSERT_TRUE(c.RecvResponse(&resp));
      ASSERT_EQ(resp.magic, wire::kResponseMagic);
      ASSERT_EQ(resp.request_id, w.id);
      ASSERT_EQ(resp.status, w.status);
      ASSERT_EQ(resp.length, w.len);
      got.assign(w.len, 0);
      if (w.len > 0) {
        ASSERT_TRUE(c.RecvAll(got.data(), got.size()));
      }
      EXPECT_EQ(std::memcmp(got.data(), expect_mem.data() + w.off, w.len), 0) << "wrong bytes";
    }
    sender.join();
    EXPECT_TRUE(sent_ok.load());
    EXPECT_EQ(std::memcmp(b.mem->data(), expect_mem.data(), expect_mem.size()), 0)
        << "registered memory differs from what the accepted WRITE alone should have made it";
    EXPECT_EQ(b.inst->Stats().frames_rejected, 2u * (pass + 1));
  }
}

// A request header cut short on an otherwise live connection: the server waits for the rest
// no longer than tcp.progress_timeout_ms, then closes the connection and says why.
TEST(TcpTransport, StalledRequestHeaderClosesTheConnection) {
  Server b("b", 0xb6, 4096, {{"tcp.progress_timeout_ms", "300"}});
  ASSERT_TRUE(b.inst);
  RawClient c(b.inst->Port());
  ASSERT_EQ(c.Handshake("raw", 1, "b", 0xb6), KVB_OK);
  uint8_t hb[wire::kRequestHeaderBytes];
  wire::EncodeRequestHeader({wire::kRequestMagic, KVB_OP_READ, 0, 1, b.seg, 0, 16}, hb);
  const uint64_t start = NowNs();
  ASSERT_TRUE(c.SendAll(hb, 25));
  EXPECT_TRUE(c.WaitClosed(3000)) << "a half-sent header kept the connection open";
  EXPECT_GE(MsSince(start), 250.0);
  EXPECT_TRUE(b.inst->host().LogContains("request header stalled"));
}

// Many small READs and WRITEs interleaved in one request over a single lane with a deep
// window: every byte lands where it belongs, whatever the server batched.
TEST(TcpTransport, InterleavedSmallOpsOnOneLaneMoveTheRightBytes) {
  Server b("b", 0xb7, 4 * kMiB);
  Client a("a", 4 * kMiB, {{"tcp.lanes_per_peer", "1"}, {"tcp.window_slices", "64"}});
  ASSERT_TRUE(b.inst && a.inst);
  kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
  b.mem->Fill(11);
  a.mem->Fill(12);
  std::vector<uint8_t> remote_before(b.mem->data(), b.mem->data() + b.mem->size());
  std::vector<kvb_xfer_op_t> ops;
  // Even slots: WRITE local [2 MiB + i*8 KiB) to remote [i*8 KiB); odd slots: READ remote
  // [2 MiB + i*8 KiB) into local [i*8 KiB). The ranges are disjoint, so order cannot matter.
  for (uint64_t i = 0; i < 200; ++i) {
    const uint64_t len = 1 + (i * 997) % 8192;
    if (i % 2 == 0) {
      ops.push_back(a.Write(2 * kMiB + i * 8192, len, b.seg, i * 8192));
    } else {
      ops.push_back(a.Read(i * 8192, len, b.seg, 2 * kMiB + i * 8192));
    }
  }
  Result r = a.inst->Transfer(peer, ops);
  ASSERT_EQ(r.status, KVB_OK) << r.msg;
  for (uint64_t i = 0; i < 200; ++i) {
    SCOPED_TRACE("op " + std::to_string(i));
    const uint64_t len = 1 + (i * 997) % 8192;
    if (i % 2 == 0) {
      ASSERT_EQ(std::memcmp(b.mem->data() + i * 8192, a.mem->data() + 2 * kMiB + i * 8192, len), 0);
      // Past the written range the remote bytes are what they were.
      ASSERT_EQ(std::memcmp(b.mem->data() + i * 8192 + len, remote_before.data() + i * 8192 + len,
                            8192 - len),
                0);
    } else {
      ASSERT_EQ(std::memcmp(a.mem->data() + i * 8192, b.mem->data() + 2 * kMiB + i * 8192, len), 0);
    }
  }
  EXPECT_EQ(a.inst->Stats().connections_opened, 1u);
  EXPECT_EQ(a.inst->Stats().connections_evicted, 0u);
}

TEST(TcpTransport, WrongIncarnationIsStalePeerAndWritesNothing) {
  Server b("b", 0xb3, 64 * 1024);
  Client a("a", 64 * 1024);
  ASSERT_TRUE(b.inst && a.inst);
  b.mem->Fill(11);
  const uint64_t before = b.mem->Checksum();
  kvb_tpeer_t* stale = a.inst->AddPeer(*b.inst, "", /*incarnation=*/0xdead);
  a.mem->Fill(12);
  Result r = a.inst->Transfer(stale, {a.Write(0, 64 * 1024, b.seg, 0)});
  EXPECT_EQ(r.status, KVB_ERR_STALE_PEER) << r.msg;
  EXPECT_NE(r.msg.find("0xdead"), std::string::npos) << r.msg;
  EXPECT_NE(r.msg.find("0xb3"), std::string::npos) << r.msg;
  EXPECT_LT(r.elapsed_ms, 500);
  EXPECT_EQ(b.mem->Checksum(), before);
  // The server counts and logs the refusal after sending it: give its thread a moment.
  for (int i = 0; i < 500 && (b.inst->Stats().frames_rejected < 1 ||
                              !b.inst->host().LogContains("STALE_PEER"));
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(b.inst->Stats().frames_rejected, 1u);
  EXPECT_TRUE(b.inst->host().LogContains("STALE_PEER"));
  // A client that ignores the refusal and sends a WRITE anyway is not served.
  RawClient c(b.inst->Port());
  ASSERT_EQ(c.Handshake("raw", 1, "b", 0x1234), KVB_ERR_STALE_PEER);
  std::vector<uint8_t> payload(64, 0xEE);
  c.SendRequest({wire::kRequestMagic, KVB_OP_WRITE, 0, 1, b.seg, 0, 64}, payload.data());
  EXPECT_TRUE(c.WaitClosed());
  EXPECT_EQ(b.mem->Checksum(), before);
  // The right incarnation works.
  kvb_tpeer_t* good = a.inst->AddPeer(*b.inst);
  EXPECT_EQ(a.inst->Transfer(good, {a.Write(0, 64 * 1024, b.seg, 0)}).status, KVB_OK);
}

TEST(TcpTransport, ClusterTokenMustMatchOnBothSides) {
  struct Case {
    std::string server_token, client_token;
    kvb_status_t want;
  };
  const Case cases[] = {{"secret", "secret", KVB_OK},
                        {"secret", "wrong", KVB_ERR_UNAUTHENTICATED},
                        {"secret", "", KVB_ERR_UNAUTHENTICATED},
                        {"", "secret", KVB_ERR_UNAUTHENTICATED}};
  for (const Case& k : cases) {
    SCOPED_TRACE("server '" + k.server_token + "' client '" + k.client_token + "'");
    Server b("b", 0xb4, 4096, {}, k.server_token);
    Client a("a", 4096, {}, k.client_token);
    ASSERT_TRUE(b.inst && a.inst);
    b.mem->Fill(1);
    const uint64_t before = b.mem->Checksum();
    kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
    a.mem->Fill(2);
    Result r = a.inst->Transfer(peer, {a.Write(0, 4096, b.seg, 0)});
    EXPECT_EQ(r.status, k.want) << r.msg;
    if (k.want != KVB_OK) {
      EXPECT_EQ(b.mem->Checksum(), before);
      EXPECT_TRUE(a.inst->host().LogContains("UNAUTHENTICATED")) << "client must log it";
      // The server logs the refusal once its side of the handshake ends.
      for (int i = 0; i < 100 && !b.inst->host().LogContains("UNAUTHENTICATED"); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      EXPECT_TRUE(b.inst->host().LogContains("UNAUTHENTICATED")) << "server must log it";
      EXPECT_GE(b.inst->Stats().frames_rejected, 1u);
    } else {
      EXPECT_EQ(std::memcmp(b.mem->data(), a.mem->data(), 4096), 0);
    }
  }
  // A raw client: the right token passes mutual proof; a wrong one cannot verify the server.
  Server b("b", 0xb4, 4096, {}, "secret");
  RawClient good(b.inst->Port());
  EXPECT_EQ(good.Handshake("raw", 1, "b", 0xb4, "secret"), KVB_OK);
  RawClient bad(b.inst->Port());
  EXPECT_EQ(bad.Handshake("raw", 1, "b", 0xb4, "guess"), -2);
}

TEST(TcpTransport, BackpressureRefusesWithoutQueueing) {
  SilentServer frozen(/*accept=*/false);  // the handshake never gets an answer
  Server b("b", 0xb6, 4 * kMiB);
  Client a("a", 8 * kMiB,
           {{"tcp.max_queued_bytes_per_peer", std::to_string(kMiB)},
            {"tcp.connect_timeout_ms", "3000"}});
  ASSERT_TRUE(b.inst && a.inst);
  kvb_tpeer_t* stuck = a.inst->AddPeerRaw("frozen", 9, frozen.endpoint());
  std::shared_ptr<Pending> first;
  // Bigger than the bound, but the queue is empty: admitted.
  ASSERT_EQ(a.inst->PostAsync(stuck, {a.Write(0, 4 * kMiB, 1, 0)}, 0, &first), KVB_OK);
  EXPECT_EQ(a.inst->Stats().queued_bytes, 4 * kMiB);
  std::shared_ptr<Pending> second;
  std::string err;
  const uint64_t t0 = NowNs();
  EXPECT_EQ(a.inst->PostAsync(stuck, {a.Write(0, 4096, 1, 0)}, 0, &second, &err),
            KVB_ERR_BACKPRESSURE);
  EXPECT_LT(MsSince(t0), 200) << "post must not block";
  EXPECT_NE(err.find("max_queued_bytes_per_peer"), std::string::npos) << err;
  EXPECT_EQ(a.inst->Stats().queued_bytes, 4 * kMiB) << "a refused post queued something";
  // Another peer is not affected by the stuck one.
  kvb_tpeer_t* healthy = a.inst->AddPeer(*b.inst);
  Result ok = a.inst->Transfer(healthy, {a.Write(0, 4 * kMiB, b.seg, 0)});
  EXPECT_EQ(ok.status, KVB_OK) << ok.msg;
  EXPECT_LT(ok.elapsed_ms, 2000);
  // Cancelling frees the budget at once.
  Ops()->cancel(a.inst->t(), first->req);
  EXPECT_EQ(a.inst->Stats().queued_bytes, 0u);
  Result fr = a.inst->Finish(first);
  EXPECT_EQ(fr.status, KVB_ERR_CANCELLED);
  EXPECT_EQ(fr.completions, 1);
  ASSERT_EQ(a.inst->PostAsync(stuck, {a.Write(0, 4096, 1, 0)}, 0, &second), KVB_OK);
  a.inst->RemovePeer(stuck);  // fails it CANCELLED and joins its lane
  Result sr = a.inst->Finish(second);
  EXPECT_EQ(sr.status, KVB_ERR_CANCELLED);
  EXPECT_EQ(sr.completions, 1);
}

// Resident memory of this process, from /proc/self/statm.
uint64_t RssBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  unsigned long long size = 0, resident = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%llu %llu", &size, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// A million one-byte ops never reach the byte bound (256 MiB), and each slice costs the
// transport memory: tcp.max_queued_slices_per_peer (65536) bounds them like bytes.
TEST(TcpTransport, TinySlicesAreBoundedPerPeerLikeBytes) {
  SilentServer frozen(/*accept=*/false);  // the handshake never gets an answer
  Client a("a", kMiB, {{"tcp.connect_timeout_ms", "30000"}});
  ASSERT_TRUE(a.inst);
  kvb_tpeer_t* stuck = a.inst->AddPeerRaw("frozen", 9, frozen.endpoint());
  constexpr uint64_t kMaxSlices = 65536;
  constexpr int kOpsPerPost = 4096, kPosts = 256;  // 1,048,576 ops in all
  std::vector<kvb_xfer_op_t> ops;
  for (int i = 0; i < kOpsPerPost; ++i) ops.push_back(a.Write(i, 1, 1, i));
  const uint64_t rss_before = RssBytes();
  std::vector<std::shared_ptr<Pending>> admitted;
  int refused = 0;
  std::string err;
  const uint64_t t0 = NowNs();
  for (int p = 0; p < kPosts; ++p) {
    std::shared_ptr<Pending> pending;
    std::string e;
    const kvb_status_t st = a.inst->PostAsync(stuck, ops, 0, &pending, &e);
    if (st == KVB_OK) {
      admitted.push_back(pending);
      continue;
    }
    ASSERT_EQ(st, KVB_ERR_BACKPRESSURE) << "post " << p << ": " << e;
    ++refused;
    err = e;
  }
  const double ms = MsSince(t0);
  const uint64_t rss_growth = RssBytes() - std::min(RssBytes(), rss_before);
  EXPECT_EQ(admitted.size() * kOpsPerPost, kMaxSlices) << "slices admitted past the bound";
  EXPECT_EQ(refused, kPosts - static_cast<int>(kMaxSlices / kOpsPerPost));
  EXPECT_NE(err.find("tcp.max_queued_slices_per_peer (65536)"), std::string::npos) << err;
  EXPECT_EQ(a.inst->Stats().queued_bytes, kMaxSlices) << "one byte per admitted op";
  // Admitted: 65536 slices and ops, a few MiB. Unbounded, the million would take ~200 MiB.
  EXPECT_LT(rss_growth, 48 * kMiB) << "resident memory grew by " << rss_growth / kMiB << " MiB";
  EXPECT_LT(ms, 5000) << "refused posts must be cheap";
  std::printf("1M one-byte ops: %zu posts admitted, %d refused, RSS +%.1f MiB, %.0f ms\n",
              admitted.size(), refused, rss_growth / double(kMiB), ms);
  // A request that ends gives its slices back: the next post is admitted.
  Ops()->cancel(a.inst->t(), admitted.front()->req);
  EXPECT_EQ(a.inst->Finish(admitted.front()).status, KVB_ERR_CANCELLED);
  admitted.erase(admitted.begin());
  std::shared_ptr<Pending> again;
  ASSERT_EQ(a.inst->PostAsync(stuck, ops, 0, &again, &err), KVB_OK) << err;
  admitted.push_back(again);
  a.inst->RemovePeer(stuck);  // fails every request CANCELLED and joins its lane
  for (auto& p : admitted) EXPECT_EQ(a.inst->Finish(p).status, KVB_ERR_CANCELLED);
  EXPECT_EQ(a.inst->Stats().queued_bytes, 0u);

  // Like the byte bound, a single request larger than the bound goes into an empty queue only.
  Client c("c", kMiB,
           {{"tcp.max_queued_slices_per_peer", "1000"}, {"tcp.connect_timeout_ms", "30000"}});
  ASSERT_TRUE(c.inst);
  kvb_tpeer_t* stuck2 = c.inst->AddPeerRaw("frozen", 9, frozen.endpoint());
  std::vector<kvb_xfer_op_t> many;
  for (int i = 0; i < 1500; ++i) many.push_back(c.Write(i, 1, 1, i));
  std::shared_ptr<Pending> big, small;
  ASSERT_EQ(c.inst->PostAsync(stuck2, many, 0, &big, &err), KVB_OK) << err;
  EXPECT_EQ(c.inst->PostAsync(stuck2, {c.Write(0, 1, 1, 0)}, 0, &small, &err),
            KVB_ERR_BACKPRESSURE);
  EXPECT_NE(err.find("has 1500 slices queued; 1 more exceed tcp.max_queued_slices_per_peer (1000)"),
            std::string::npos)
      << err;
  c.inst->RemovePeer(stuck2);
  EXPECT_EQ(c.inst->Finish(big).status, KVB_ERR_CANCELLED);
}

TEST(TcpTransport, DeadEndpointFailsFastAndTheNextEndpointIsTried) {
  Server b("b", 0xb7, 4096);
  Client a("a", 4096);
  ASSERT_TRUE(b.inst && a.inst);
  const std::string dead = "127.0.0.1:" + std::to_string(DeadPort());
  kvb_tpeer_t* ghost = a.inst->AddPeerRaw("ghost", 5, dead);
  for (int i = 0; i < 3; ++i) {
    Result r = a.inst->Transfer(ghost, {a.Read(0, 4096, 1, 0)});
    EXPECT_EQ(r.status, KVB_ERR_PEER_UNREACHABLE) << r.msg;
    EXPECT_LT(r.elapsed_ms, 300) << "a refused connection must fail at once";
    EXPECT_NE(r.msg.find(dead), std::string::npos) << r.msg;
  }
  b.mem->Fill(4);
  kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst, dead + "," + b.inst->Endpoints());
  for (int i = 0; i < 2; ++i) {
    Result r = a.inst->Transfer(peer, {a.Read(0, 4096, b.seg, 0)});
    ASSERT_EQ(r.status, KVB_OK) << r.msg;
    EXPECT_EQ(std::memcmp(a.mem->data(), b.mem->data(), 4096), 0);
  }
}

// With KVB_XOP_CRC32C an op's CRC-32C is taken as its bytes move (a READ's as they land, a
// WRITE's as they are sent), slices joined in order: ops of one byte, of exactly one slice, one
// byte over, and many slices spread over the lanes. Only ops that ask and end OK get one; an
// op that does not ask and an op that fails leave the slot as posted.
TEST(TcpTransport, OpsThatAskGetTheChecksumOfTheBytesTheyMoved) {
  constexpr uint64_t kSlice = 64 * 1024;
  Server b("b", 0xc1, 8 * kMiB);
  Client a("a", 8 * kMiB, {{"tcp.slice_bytes", std::to_string(kSlice)}});
  ASSERT_TRUE(b.inst && a.inst);
  EXPECT_NE(Descriptor()->caps & KVB_TCAP_OP_CRC32C, 0u);
  EXPECT_NE(Ops()->instance_caps(a.inst->t()) & KVB_TCAP_OP_CRC32C, 0u);
  b.mem->Fill(0xc1);
  kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
  const std::vector<uint64_t> lengths = {1, kSlice, kSlice + 1, 3 * kMiB + 13};
  const size_t n = lengths.size();
  // Slots: the n READs', the READ that does not ask, the one that fails, the n WRITEs'.
  std::vector<kvb_op_crc_t> slots(2 * n + 2, kvb_op_crc_t{0xdead, 0});
  std::vector<kvb_xfer_op_t> ops;
  uint64_t at = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    ops.push_back(a.Read(at + 1, lengths[i], b.seg, 7 + i));  // unaligned on both sides
    ops.back().flags = KVB_XOP_CRC32C;
    ops.back().crc = &slots[i];
    at += lengths[i] + 64;
  }
  ops.push_back(a.Read(at + 8192, 4096, b.seg, 0));  // a slot but no ask
  ops.back().crc = &slots[n];
  ops.push_back(a.Read(at + 16384, 4096, b.seg + 77, 0));  // fails: no such segment there
  ops.back().flags = KVB_XOP_CRC32C;
  ops.back().crc = &slots[n + 1];
  ops.push_back(a.Read(at + 24576, 4096, b.seg, 0));  // asks, but the flag without a slot
  ops.back().flags = KVB_XOP_CRC32C;
  // WRITEs from past the reads' buffers to past the bytes they read.
  const uint64_t write_from = at + 32768, write_to = 4 * kMiB;
  a.mem->Fill(0xc5, write_from, 4 * kMiB - 4096);
  at = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    ops.push_back(a.Write(write_from + at, lengths[i], b.seg, write_to + at + 3));
    ops.back().flags = KVB_XOP_CRC32C;
    ops.back().crc = &slots[n + 2 + i];
    at += lengths[i];
  }
  Result r = a.inst->Transfer(peer, ops);
  ASSERT_EQ(r.op_status.size(), ops.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    SCOPED_TRACE("length " + std::to_string(lengths[i]));
    ASSERT_EQ(r.op_status[i], KVB_OK) << r.msg;
    const auto* got = static_cast<const uint8_t*>(ops[i].local_addr);
    ASSERT_EQ(std::memcmp(got, b.mem->data() + 7 + i, lengths[i]), 0);
    EXPECT_EQ(slots[i].computed, 1u);
    EXPECT_EQ(slots[i].crc32c, util::Crc32c(b.mem->data() + 7 + i, lengths[i]));
  }
  EXPECT_EQ(r.op_status[n], KVB_OK);
  EXPECT_EQ(r.op_status[n + 1], KVB_ERR_NOT_REGISTERED);
  EXPECT_EQ(r.op_status[n + 2], KVB_OK);
  for (size_t k = n; k < n + 2; ++k) {
    EXPECT_EQ(slots[k].computed, 0u) << "slot " << k;
    EXPECT_EQ(slots[k].crc32c, 0xdeadu) << "slot " << k;
  }
  at = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    SCOPED_TRACE("WRITE of " + std::to_string(lengths[i]));
    ASSERT_EQ(r.op_status[n + 3 + i], KVB_OK) << r.msg;
    const uint8_t* sent = a.mem->data() + write_from + at;
    ASSERT_EQ(std::memcmp(b.mem->data() + write_to + at + 3, sent, lengths[i]), 0);
    EXPECT_EQ(slots[n + 2 + i].computed, 1u);
    EXPECT_EQ(slots[n + 2 + i].crc32c, util::Crc32c(sent, lengths[i]));
    at += lengths[i];
  }

  // A host of ABI 1.0-1.3 passes shorter ops, with no slot: nothing past them is read.
  std::vector<uint8_t> short_ops(2 * KVB_XFER_OP_SIZE_1_0);
  for (size_t i = 0; i < 2; ++i) {
    kvb_xfer_op_t op = a.Read(i * 4096, 4096, b.seg, i * 4096);
    op.flags = KVB_XOP_CRC32C;  // a 1.3 host never sets it; a stray bit must not matter either
    std::memcpy(short_ops.data() + i * KVB_XFER_OP_SIZE_1_0, &op, KVB_XFER_OP_SIZE_1_0);
  }
  auto p = std::make_shared<Pending>();
  p->num_ops = 2;
  char err[256] = "";
  kvb_post_opts_t opts{.struct_size = sizeof(kvb_post_opts_t),
                       .on_complete =
                           [](void* u) {
                             auto* pending = static_cast<Pending*>(u);
                             std::lock_guard<std::mutex> lock(pending->mu);
                             ++pending->calls;
                             pending->cv.notify_all();
                           },
                       .user = p.get()};
  ASSERT_EQ(Ops()->post(a.inst->t(), peer, reinterpret_cast<kvb_xfer_op_t*>(short_ops.data()),
                        KVB_XFER_OP_SIZE_1_0, 2, &opts, &p->req, err, sizeof(err)),
            KVB_OK)
      << err;
  Result old = a.inst->Finish(p);
  EXPECT_EQ(old.status, KVB_OK) << old.msg;
  EXPECT_EQ(std::memcmp(a.mem->data(), b.mem->data(), 8192), 0);
}

// An op that asks, on a peer that freezes (a READ waiting for its payload, a WRITE whose bytes
// the peer never reads) or whose request is cancelled, leaves its slot untouched;
// tcp.op_checksums=0 drops the cap and takes no checksum at all.
TEST(TcpTransport, OpsThatFailOrAreCancelledGetNoChecksum) {
  {
    SilentServer frozen(/*accept=*/true, /*answer_handshake=*/true, "frozen", 9);
    Client a("a", 16 * kMiB);
    ASSERT_TRUE(a.inst);
    kvb_tpeer_t* peer = a.inst->AddPeerRaw("frozen", 9, frozen.endpoint());
    kvb_op_crc_t slots[2] = {{0xdead, 0}, {0xdead, 0}};
    std::vector<kvb_xfer_op_t> ops = {a.Read(0, kMiB, 1, 0), a.Write(kMiB, 15 * kMiB, 1, 0)};
    for (int i = 0; i < 2; ++i) {
      ops[i].flags = KVB_XOP_CRC32C;
      ops[i].crc = &slots[i];
    }
    std::shared_ptr<Pending> p;
    ASSERT_EQ(a.inst->PostAsync(peer, ops, 10000, &p, nullptr, /*progress_timeout_ms=*/300),
              KVB_OK);
    Result r = a.inst->Finish(p);
    EXPECT_EQ(r.status, KVB_ERR_PROGRESS_TIMEOUT) << r.msg;
    for (const kvb_op_crc_t& slot : slots) {
      EXPECT_EQ(slot.computed, 0u);
      EXPECT_EQ(slot.crc32c, 0xdeadu);
    }
  }
  {
    Server b("b", 0xc2, 64 * kMiB);
    Client a("a", 64 * kMiB);
    ASSERT_TRUE(b.inst && a.inst);
    b.mem->Fill(0xc2);
    a.mem->Fill(0xc4);
    kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
    for (uint32_t opcode : {KVB_OP_READ, KVB_OP_WRITE}) {
      SCOPED_TRACE(opcode == KVB_OP_READ ? "a READ" : "a WRITE");
      // The bytes a whole op would have moved: b's for a READ, a's for a WRITE.
      const uint32_t whole =
          util::Crc32c((opcode == KVB_OP_READ ? b.mem->data() : a.mem->data()), 64 * kMiB);
      kvb_op_crc_t slot{0xdead, 0};
      kvb_xfer_op_t op = a.inst->Op(opcode, a.seg, a.mem->data(), 64 * kMiB, b.seg, 0);
      op.flags = KVB_XOP_CRC32C;
      op.crc = &slot;
      std::shared_ptr<Pending> p;
      ASSERT_EQ(a.inst->PostAsync(peer, {op}, 20000, &p), KVB_OK);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      Ops()->cancel(a.inst->t(), p->req);
      Result r = a.inst->Finish(p);
      if (r.status == KVB_OK) {  // it beat the cancel: then its checksum is whole
        EXPECT_EQ(slot.computed, 1u);
        EXPECT_EQ(slot.crc32c, whole);
      } else {
        EXPECT_EQ(r.status, KVB_ERR_CANCELLED) << r.msg;
        EXPECT_EQ(slot.computed, 0u);
        EXPECT_EQ(slot.crc32c, 0xdeadu);
      }
    }
  }
  {
    Server b("b", 0xc3, kMiB);
    Client a("a", kMiB, {{"tcp.op_checksums", "0"}});
    ASSERT_TRUE(b.inst && a.inst);
    EXPECT_EQ(Ops()->instance_caps(a.inst->t()) & KVB_TCAP_OP_CRC32C, 0u);
    kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
    kvb_op_crc_t slot{0xdead, 0};
    kvb_xfer_op_t op = a.Read(0, 4096, b.seg, 0);
    op.flags = KVB_XOP_CRC32C;
    op.crc = &slot;
    ASSERT_EQ(a.inst->Transfer(peer, {op}).status, KVB_OK);
    EXPECT_EQ(slot.computed, 0u);
  }
  Instance::Options o;
  o.config = {{"tcp.op_checksums", "2"}};
  std::unique_ptr<Instance> bad;
  std::string err;
  EXPECT_EQ(Instance::TryCreate(o, &bad, &err), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_NE(err.find("tcp.op_checksums: 2 is outside [0, 1]"), std::string::npos) << err;
}

TEST(TcpTransport, FrozenPeerFailsWithProgressTimeout) {
  SilentServer frozen(/*accept=*/true, /*answer_handshake=*/true, "frozen", 9);
  Client a("a", kMiB);
  ASSERT_TRUE(a.inst);
  kvb_tpeer_t* peer = a.inst->AddPeerRaw("frozen", 9, frozen.endpoint());
  std::shared_ptr<Pending> p;
  ASSERT_EQ(a.inst->PostAsync(peer, {a.Read(0, kMiB, 1, 0)}, 10000, &p, nullptr,
                              /*progress_timeout_ms=*/300),
            KVB_OK);
  Result r = a.inst->Finish(p);
  EXPECT_EQ(r.status, KVB_ERR_PROGRESS_TIMEOUT) << r.msg;
  EXPECT_GE(r.elapsed_ms, 250);
  EXPECT_LT(r.elapsed_ms, 1500);
  EXPECT_EQ(a.inst->Stats().connections_evicted, 1u);
}

TEST(TcpTransport, DeadlinesEndRequestsWithoutPolling) {
  Client a("a", kMiB, {{"tcp.connect_timeout_ms", "5000"}});
  ASSERT_TRUE(a.inst);
  {  // Queued behind a handshake that never completes.
    SilentServer frozen(/*accept=*/false);
    kvb_tpeer_t* peer = a.inst->AddPeerRaw("frozen", 9, frozen.endpoint());
    std::shared_ptr<Pending> p;
    ASSERT_EQ(a.inst->PostAsync(peer, {a.Write(0, 4096, 1, 0)}, 150, &p), KVB_OK);
    Result r = a.inst->Finish(p);
    EXPECT_EQ(r.status, KVB_ERR_DEADLINE_EXCEEDED) << r.msg;
    EXPECT_GE(r.elapsed_ms, 140);
    EXPECT_LT(r.elapsed_ms, 1000);
    a.inst->RemovePeer(peer);
  }
  {  // In flight on a lane whose peer stopped answering.
    SilentServer frozen(/*accept=*/true, /*answer_handshake=*/true, "frozen", 9);
    kvb_tpeer_t* peer = a.inst->AddPeerRaw("frozen", 9, frozen.endpoint());
    std::shared_ptr<Pending> p;
    ASSERT_EQ(a.inst->PostAsync(peer, {a.Read(0, 4096, 1, 0)}, 200, &p, nullptr, 5000), KVB_OK);
    Result r = a.inst->Finish(p);
    EXPECT_EQ(r.status, KVB_ERR_DEADLINE_EXCEEDED) << r.msg;
    EXPECT_GE(r.elapsed_ms, 190);
    EXPECT_LT(r.elapsed_ms, 1000);
    a.inst->RemovePeer(peer);
  }
}

TEST(TcpTransport, CancelOfALargeReadStopsTouchingTheBuffer) {
  Server b("b", 0xb8, 64 * kMiB);
  Client a("a", 64 * kMiB);
  ASSERT_TRUE(b.inst && a.inst);
  b.mem->Fill(8);
  kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
  ASSERT_EQ(a.inst->Transfer(peer, {a.Read(0, 4096, b.seg, 0)}).status, KVB_OK);  // warm lane
  for (int delay_us : {0, 2000, 10000}) {
    SCOPED_TRACE("cancel after " + std::to_string(delay_us) + " us");
    std::shared_ptr<Pending> p;
    ASSERT_EQ(a.inst->PostAsync(peer, {a.Read(0, 64 * kMiB, b.seg, 0)}, 20000, &p), KVB_OK);
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    const uint64_t t0 = NowNs();
    Ops()->cancel(a.inst->t(), p->req);
    EXPECT_LT(MsSince(t0), 250) << "cancel must return promptly";
    std::memset(a.mem->data(), 0xEE, 64 * kMiB);
    Result r = a.inst->Finish(p);
    EXPECT_TRUE(r.status == KVB_ERR_CANCELLED || r.status == KVB_OK) << r.msg;
    EXPECT_EQ(r.completions, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const uint8_t* m = a.mem->data();
    ASSERT_EQ(std::count(m, m + 64 * kMiB, uint8_t{0xEE}), static_cast<ptrdiff_t>(64 * kMiB))
        << "the buffer was written after cancel returned";
  }
  // The peer is still usable after cancels (lanes drained or were replaced).
  Result r = a.inst->Transfer(peer, {a.Read(0, 8 * kMiB, b.seg, 0)});
  ASSERT_EQ(r.status, KVB_OK) << r.msg;
  EXPECT_EQ(std::memcmp(a.mem->data(), b.mem->data(), 8 * kMiB), 0);
  EXPECT_EQ(a.inst->Stats().queued_bytes, 0u);
}

TEST(TcpTransport, LanesStayBoundedAndIdleLanesCloseGradually) {
  constexpr int kThreads = 16;
  constexpr uint64_t kLen = 256 * 1024;
  Server b("b", 0xb9, kThreads * kLen);
  Client a("a", kThreads * kLen,
           {{"tcp.lanes_per_peer", "4"},
            {"tcp.window_slices", "2"},
            {"tcp.slice_bytes", "65536"},
            {"tcp.idle_timeout_ms", "300"},
            {"tcp.idle_close_per_sec", "2"}});
  ASSERT_TRUE(b.inst && a.inst);
  kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0}, transfers{0};
  std::atomic<uint64_t> max_open{0}, max_inbound{0};
  std::thread sampler([&] {
    while (!stop.load()) {
      const uint64_t o = a.inst->Stats().connections_open;
      const uint64_t in = b.inst->Stats().inbound_open;
      max_open.store(std::max(max_open.load(), o));
      max_inbound.store(std::max(max_inbound.load(), in));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  std::vector<std::thread> workers;
  const uint64_t end = NowNs() + 1500 * 1000000ull;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      while (NowNs() < end) {
        const uint32_t opcode = (transfers.load() % 2) ? KVB_OP_READ : KVB_OP_WRITE;
        Result r = a.inst->Transfer(
            peer, {a.inst->Op(opcode, a.seg, a.mem->data() + t * kLen, kLen, b.seg, t * kLen)});
        if (r.status != KVB_OK) ++failures;
        ++transfers;
      }
    });
  }
  for (auto& w : workers) w.join();
  stop.store(true);
  sampler.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(transfers.load(), 16);
  EXPECT_LE(max_open.load(), 4u) << "outbound lanes exceeded lanes_per_peer";
  EXPECT_LE(max_inbound.load(), 4u) << "the server saw more connections than lanes_per_peer";
  EXPECT_GE(max_open.load(), 2u) << "16 busy threads should have used several lanes";
  EXPECT_EQ(a.inst->Stats().connections_evicted, 0u);

  // Idle close: one lane at a time, no faster than idle_close_per_sec (2/s). The plugin logs
  // each idle close; the log's timestamps are the close times.
  const uint64_t open_at_end = a.inst->Stats().connections_open;
  const uint64_t load_end = NowNs();
  while (a.inst->Stats().connections_open > 0 && MsSince(load_end) < 5000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(a.inst->Stats().connections_open, 0u);
  EXPECT_EQ(a.inst->Stats().connections_closed_idle, open_at_end);
  const std::vector<uint64_t> closes = a.inst->host().LogTimes("closing idle lane");
  ASSERT_EQ(closes.size(), open_at_end);
  EXPECT_GE(static_cast<double>(closes.front() - load_end) / 1e6, 250)
      << "closed before idle_timeout_ms";
  for (size_t i = 1; i < closes.size(); ++i) {
    EXPECT_GE(static_cast<double>(closes[i] - closes[i - 1]) / 1e6, 400)
        << "idle closes came in a burst";
  }
}

TEST(TcpTransport, RestartOnTheSamePortIsStaleThenHeals) {
  auto b1 = std::make_unique<Server>("b", 0x1111, 4096);
  ASSERT_TRUE(b1->inst);
  const uint16_t port = b1->inst->Port();
  Client a("a", 4096);
  kvb_tpeer_t* old_peer = a.inst->AddPeer(*b1->inst);
  ASSERT_EQ(a.inst->Transfer(old_peer, {a.Write(0, 4096, b1->seg, 0)}).status, KVB_OK);
  b1.reset();  // the process dies; a's pooled lane sees the close
  Server b2("b", 0x2222, 4096, {}, "", "127.0.0.1:" + std::to_string(port));
  ASSERT_TRUE(b2.inst) << "SO_REUSEADDR should allow rebinding the port at once";
  b2.mem->Fill(5);
  const uint64_t before = b2.mem->Checksum();
  Result r = a.inst->Transfer(old_peer, {a.Write(0, 4096, b2.seg, 0)});
  if (r.status == KVB_ERR_PEER_UNREACHABLE) {
    // The write raced the close: it went out on the pooled lane before its thread saw the
    // socket die. The next one opens a lane and meets the new incarnation.
    EXPECT_NE(r.msg.find("closed the connection"), std::string::npos) << r.msg;
    r = a.inst->Transfer(old_peer, {a.Write(0, 4096, b2.seg, 0)});
  }
  EXPECT_EQ(r.status, KVB_ERR_STALE_PEER) << r.msg;
  EXPECT_NE(r.msg.find("0x1111"), std::string::npos) << r.msg;
  EXPECT_NE(r.msg.find("0x2222"), std::string::npos) << r.msg;
  EXPECT_EQ(b2.mem->Checksum(), before) << "bytes landed in the new incarnation";
  a.inst->RemovePeer(old_peer);
  kvb_tpeer_t* new_peer = a.inst->AddPeer(*b2.inst);
  a.mem->Fill(6);
  ASSERT_EQ(a.inst->Transfer(new_peer, {a.Write(0, 4096, b2.seg, 0)}).status, KVB_OK);
  EXPECT_EQ(std::memcmp(b2.mem->data(), a.mem->data(), 4096), 0);
}

TEST(TcpTransport, DeregisteredMemoryIsRefused) {
  Server b("b", 0xba, 4096);
  Client a("a", 4096);
  ASSERT_TRUE(b.inst && a.inst);
  Buffer extra(8192);
  extra.Fill(3);
  const uint64_t seg = b.inst->Register(extra.data(), extra.size());
  kvb_tpeer_t* peer = a.inst->AddPeer(*b.inst);
  ASSERT_EQ(a.inst->Transfer(peer, {a.Read(0, 4096, seg, 0)}).status, KVB_OK);
  EXPECT_EQ(b.inst->Deregister(seg), KVB_OK);
  EXPECT_EQ(b.inst->Deregister(seg), KVB_ERR_NOT_FOUND);
  const uint64_t before = extra.Checksum();
  a.mem->Fill(4);
  Result r = a.inst->Transfer(peer, {a.Write(0, 4096, seg, 0)});
  EXPECT_EQ(r.status, KVB_ERR_NOT_REGISTERED) << r.msg;
  EXPECT_EQ(extra.Checksum(), before);
}

TEST(TcpTransport, InboundConnectionsAreBounded) {
  Server b("b", 0xbb, 4096, {{"tcp.max_inbound", "2"}});
  ASSERT_TRUE(b.inst);
  RawClient c1(b.inst->Port()), c2(b.inst->Port());
  ASSERT_EQ(c1.Handshake("raw", 1, "b", 0xbb), KVB_OK);
  ASSERT_EQ(c2.Handshake("raw", 2, "b", 0xbb), KVB_OK);
  RawClient c3(b.inst->Port());
  EXPECT_TRUE(c3.WaitClosed()) << "a third inbound connection was kept";
  EXPECT_TRUE(b.inst->host().LogContains("tcp.max_inbound"));
  EXPECT_EQ(b.inst->Stats().inbound_open, 2u);
}

// A WRITE whose payload is trickled (a byte every 100 ms: always within the progress timeout)
// is cut at its absolute bound, progress timeout + length / tcp.min_inbound_bytes_per_sec,
// instead of holding the region for as long as the peer likes.
TEST(TcpTransport, TrickledWriteIsCutAtItsAbsoluteBound) {
  Server b("b", 0xc1, 1 << 20,
           {{"tcp.progress_timeout_ms", "1000"}, {"tcp.min_inbound_bytes_per_sec", "1048576"}});
  ASSERT_TRUE(b.inst);
  RawClient c(b.inst->Port());
  ASSERT_EQ(c.Handshake("raw", 1, "b", 0xc1), KVB_OK);
  uint8_t hb[wire::kRequestHeaderBytes];
  wire::EncodeRequestHeader({wire::kRequestMagic, KVB_OP_WRITE, 0, 1, b.seg, 0, 65536}, hb);
  ASSERT_TRUE(c.SendAll(hb, sizeof(hb)));
  const uint64_t start = NowNs();
  std::atomic<bool> stop{false};
  std::thread drip([&] {
    const uint8_t x = 0x5a;
    for (int i = 0; i < 60 && !stop.load() && c.SendAll(&x, 1); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  // Bound: 1000 ms + 65536 B at 1 MiB/s (62 ms).
  const bool closed = c.WaitClosed(4000);
  const double ms = MsSince(start);
  stop = true;
  drip.join();
  EXPECT_TRUE(closed) << "a trickled WRITE held its connection (and region) for 4 s";
  EXPECT_GE(ms, 950.0);
  EXPECT_LT(ms, 2500.0);
  EXPECT_TRUE(b.inst->host().LogContains("tcp.min_inbound_bytes_per_sec"));
  EXPECT_EQ(b.inst->Deregister(b.seg), KVB_OK);
}

// DeregisterMemory while a peer trickles a WRITE into the region (its absolute bound far off):
// the call cuts that connection and returns at once; nothing lands in the memory afterwards.
TEST(TcpTransport, DeregisterCutsAConnectionStillInsideTheRegion) {
  Server b("b", 0xc2, 1 << 20,
           {{"tcp.progress_timeout_ms", "5000"}, {"tcp.min_inbound_bytes_per_sec", "1"}});
  ASSERT_TRUE(b.inst);
  b.mem->Fill(3);
  RawClient c(b.inst->Port());
  ASSERT_EQ(c.Handshake("raw", 1, "b", 0xc2), KVB_OK);
  uint8_t hb[wire::kRequestHeaderBytes];
  wire::EncodeRequestHeader({wire::kRequestMagic, KVB_OP_WRITE, 0, 1, b.seg, 0, 65536}, hb);
  ASSERT_TRUE(c.SendAll(hb, sizeof(hb)));
  std::atomic<bool> stop{false};
  std::thread drip([&] {
    const uint8_t x = 0x5a;
    for (int i = 0; i < 30 && !stop.load() && c.SendAll(&x, 1); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the server is inside it
  const uint64_t start = NowNs();
  EXPECT_EQ(b.inst->Deregister(b.seg), KVB_OK);
  EXPECT_LT(MsSince(start), 500.0) << "deregister waited for the trickling peer";
  const uint64_t after = b.mem->Checksum(4096);  // past the first bytes the trickle reached
  EXPECT_TRUE(c.WaitClosed(2000)) << "the connection inside the region was not cut";
  stop = true;
  drip.join();
  EXPECT_EQ(b.mem->Checksum(4096), after);
  EXPECT_TRUE(b.inst->host().LogContains("still using it"));
}

// One client address cannot take every inbound slot: past tcp.max_inbound_per_source its new
// connections are closed at once, while another address is still served.
TEST(TcpTransport, InboundConnectionsPerSourceAreBounded) {
  Server b("b", 0xc3, 4096, {{"tcp.max_inbound_per_source", "2"}, {"tcp.max_inbound", "16"}});
  ASSERT_TRUE(b.inst);
  RawClient c1(b.inst->Port()), c2(b.inst->Port());
  ASSERT_EQ(c1.Handshake("raw", 1, "b", 0xc3), KVB_OK);
  ASSERT_EQ(c2.Handshake("raw", 2, "b", 0xc3), KVB_OK);
  RawClient c3(b.inst->Port());
  EXPECT_TRUE(c3.WaitClosed()) << "a third connection from 127.0.0.1 was kept";
  EXPECT_TRUE(b.inst->host().LogContains("tcp.max_inbound_per_source"));
  RawClient other(b.inst->Port(), "127.0.0.2");  // another address on loopback
  ASSERT_TRUE(other.connected());
  EXPECT_EQ(other.Handshake("raw", 3, "b", 0xc3), KVB_OK);
  EXPECT_EQ(b.inst->Stats().inbound_open, 3u);
}

// An authenticated connection that sends no request for tcp.inbound_idle_timeout_ms is closed.
TEST(TcpTransport, IdleInboundConnectionIsClosed) {
  Server b("b", 0xc4, 4096, {{"tcp.inbound_idle_timeout_ms", "300"}});
  ASSERT_TRUE(b.inst);
  RawClient c(b.inst->Port());
  ASSERT_EQ(c.Handshake("raw", 1, "b", 0xc4), KVB_OK);
  const uint64_t start = NowNs();
  EXPECT_TRUE(c.WaitClosed(3000)) << "an idle inbound connection was kept";
  EXPECT_GE(MsSince(start), 250.0);
  EXPECT_TRUE(b.inst->host().LogContains("tcp.inbound_idle_timeout_ms"));
}

}  // namespace
}  // namespace kvbridge::tcp::test
