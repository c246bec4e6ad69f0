// The peer handshake the host runs for every transport (core/peer_auth.h, served through the
// ABI 1.2 auth services): message codecs (round trips, every truncation, fuzzed decoders), the
// proofs, golden bytes recorded from the tcp plugin's protocol version 2 before the handshake
// moved into the host (so old and new tcp peers interoperate), and the client/server state
// machines through the C services table, including every refusal.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/host_services.h"
#include "core/peer_auth.h"

namespace kvbridge::core::auth {
namespace {

const std::string kLabel = ProofLabel("tcp");

Hello SampleHello() {
  Hello h;
  h.flags = kHelloFlagAuth;
  h.client_node_id = "client-node";
  h.client_incarnation = 0x1122334455667788ull;
  h.expected_node_id = "server-node";
  h.expected_incarnation = 0x99aabbccddeeff00ull;
  for (size_t i = 0; i < kNonceBytes; ++i) h.client_nonce[i] = static_cast<uint8_t>(i * 7);
  return h;
}

HelloReply SampleReply() {
  HelloReply r;
  r.flags = kReplyFlagProof;
  r.status = KVB_ERR_STALE_PEER;
  r.server_node_id = "server-node";
  r.server_incarnation = 42;
  for (size_t i = 0; i < kNonceBytes; ++i) r.server_nonce[i] = static_cast<uint8_t>(200 - i);
  for (size_t i = 0; i < kProofBytes; ++i) r.server_proof[i] = static_cast<uint8_t>(i);
  return r;
}

TEST(PeerAuthWire, HelloRoundTripAndEveryTruncation) {
  const Hello h = SampleHello();
  const std::string bytes = EncodeHello(h);
  ASSERT_EQ(bytes.size(), kHelloFixedBytes + h.client_node_id.size() + h.expected_node_id.size());
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> part(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(n));
    Hello out;
    const ParseResult pr = DecodeHello(part.data(), part.size(), &out);
    ASSERT_EQ(pr.result, Parse::kNeedMore) << "prefix " << n;
    ASSERT_GT(pr.bytes, n);
    ASSERT_LE(pr.bytes, bytes.size());
  }
  Hello out;
  const ParseResult pr =
      DecodeHello(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &out);
  ASSERT_EQ(pr.result, Parse::kOk);
  EXPECT_EQ(pr.bytes, bytes.size());
  EXPECT_EQ(out.version, kProtocolVersion);
  EXPECT_EQ(out.flags, h.flags);
  EXPECT_EQ(out.client_node_id, h.client_node_id);
  EXPECT_EQ(out.client_incarnation, h.client_incarnation);
  EXPECT_EQ(out.expected_node_id, h.expected_node_id);
  EXPECT_EQ(out.expected_incarnation, h.expected_incarnation);
  EXPECT_EQ(out.client_nonce, h.client_nonce);
}

TEST(PeerAuthWire, ReplyAndProofRoundTrip) {
  const HelloReply r = SampleReply();
  const std::string bytes = EncodeHelloReply(r);
  HelloReply out;
  ASSERT_EQ(
      DecodeHelloReply(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &out).result,
      Parse::kOk);
  EXPECT_EQ(out.status, r.status);
  EXPECT_EQ(out.server_node_id, r.server_node_id);
  EXPECT_EQ(out.server_incarnation, r.server_incarnation);
  EXPECT_EQ(out.server_nonce, r.server_nonce);
  EXPECT_EQ(out.server_proof, r.server_proof);
  EXPECT_EQ(out.flags, r.flags);

  ClientProof cp{KVB_ERR_UNAUTHENTICATED, r.server_proof};
  uint8_t pb[kClientProofBytes];
  EncodeClientProof(cp, pb);
  ClientProof cp2;
  ASSERT_TRUE(DecodeClientProof(pb, sizeof(pb), &cp2));
  EXPECT_EQ(cp2.status, cp.status);
  EXPECT_EQ(cp2.proof, cp.proof);
  EXPECT_FALSE(DecodeClientProof(pb, sizeof(pb) - 1, &cp2));
}

TEST(PeerAuthWire, OverlongNodeIdIsMalformedNotNeedMore) {
  Hello h = SampleHello();
  std::string bytes = EncodeHello(h);
  bytes[40] = '\xff';  // client node id length 0x..ff + the high byte below
  bytes[41] = '\x01';  // = 511 > 255
  Hello out;
  EXPECT_EQ(DecodeHello(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &out).result,
            Parse::kMalformed);
  bytes = EncodeHello(h);
  bytes[0] = 'X';
  EXPECT_EQ(DecodeHello(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &out).result,
            Parse::kMalformed);
}

TEST(PeerAuthWire, FuzzHandshakeDecoders) {
  std::mt19937_64 rng(7);
  const std::string hello = EncodeHello(SampleHello());
  const std::string reply = EncodeHelloReply(SampleReply());
  int ok = 0;
  for (int iter = 0; iter < 50000; ++iter) {
    std::string bytes = (iter % 2) ? hello : reply;
    switch (rng() % 4) {
      case 0:
        for (int k = 0; k < 3; ++k) bytes[rng() % bytes.size()] ^= static_cast<char>(rng());
        break;
      case 1:
        bytes.resize(rng() % bytes.size());
        break;
      case 2:  // fiddle the length fields
        bytes[(iter % 2) ? 40 + rng() % 4 : 72 + rng() % 2] = static_cast<char>(rng());
        break;
      default:
        bytes.assign(rng() % 600, '\0');
        for (auto& c : bytes) c = static_cast<char>(rng());
        break;
    }
    std::vector<uint8_t> exact(bytes.begin(), bytes.end());
    ParseResult pr;
    if (iter % 2) {
      Hello h;
      pr = DecodeHello(exact.data(), exact.size(), &h);
      if (pr.result == Parse::kOk) {
        ASSERT_LE(h.client_node_id.size(), kMaxNodeIdBytes);
        ASSERT_LE(h.expected_node_id.size(), kMaxNodeIdBytes);
      }
    } else {
      HelloReply r;
      pr = DecodeHelloReply(exact.data(), exact.size(), &r);
      if (pr.result == Parse::kOk) {
        ASSERT_LE(r.server_node_id.size(), kMaxNodeIdBytes);
      }
    }
    if (pr.result == Parse::kOk) {
      ++ok;
      ASSERT_LE(pr.bytes, exact.size());
    }
    if (pr.result == Parse::kNeedMore) {
      ASSERT_GT(pr.bytes, exact.size());
      ASSERT_LE(pr.bytes, kHelloReplyFixedBytes + 2 * kMaxNodeIdBytes);
    }
    ClientProof cp;
    AuthDone d;
    DecodeClientProof(exact.data(), exact.size(), &cp);
    DecodeAuthDone(exact.data(), exact.size(), &d);
  }
  EXPECT_GT(ok, 100);
}

TEST(PeerAuthWire, ProofsBindEveryTranscriptField) {
  Transcript t{"client", 1, "server", 2, "server", 2, {}, {}, KVB_OK};
  t.client_nonce[0] = 1;
  t.server_nonce[0] = 2;
  Proof p;
  ASSERT_TRUE(ComputeProof("token", kLabel, Role::kServer, t, &p));
  EXPECT_TRUE(VerifyProof("token", kLabel, Role::kServer, t, p));
  EXPECT_FALSE(VerifyProof("token2", kLabel, Role::kServer, t, p));
  EXPECT_FALSE(VerifyProof("token", kLabel, Role::kClient, t, p))
      << "a proof must not be reflectable";
  auto changed = [&](auto mutate) {
    Transcript u = t;
    mutate(u);
    return !VerifyProof("token", kLabel, Role::kServer, u, p);
  };
  EXPECT_TRUE(changed([](Transcript& u) { u.client_node_id = "clienT"; }));
  EXPECT_TRUE(changed([](Transcript& u) { u.client_incarnation = 3; }));
  EXPECT_TRUE(changed([](Transcript& u) { u.server_node_id = "serveR"; }));
  EXPECT_TRUE(changed([](Transcript& u) { u.server_incarnation = 3; }));
  EXPECT_TRUE(changed([](Transcript& u) { u.client_nonce[5] ^= 1; }));
  EXPECT_TRUE(changed([](Transcript& u) { u.server_nonce[15] ^= 1; }));
  EXPECT_TRUE(changed([](Transcript& u) { u.server_status = KVB_ERR_STALE_PEER; }));
  // Protocol 2: the identity the client expected is bound too, so a Hello whose expected
  // identity was rewritten on the way yields proofs that the other side does not accept.
  EXPECT_TRUE(changed([](Transcript& u) { u.expected_node_id = "serveR"; }));
  EXPECT_TRUE(changed([](Transcript& u) { u.expected_incarnation = 3; }));
  EXPECT_TRUE(changed([](Transcript& u) {
    u.expected_node_id = "";
    u.expected_incarnation = 0;
  }));
  // Field boundaries are length-prefixed: moving a byte between ids changes the proof.
  EXPECT_TRUE(changed([](Transcript& u) {
    u.client_node_id = "clients";
    u.server_node_id = "erver";
  }));
  Nonce a, b;
  ASSERT_TRUE(RandomNonce(&a));
  ASSERT_TRUE(RandomNonce(&b));
  EXPECT_NE(a, b);
}

std::string Hex(const void* p, size_t len) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < len; ++i) {
    const uint8_t b = static_cast<const uint8_t*>(p)[i];
    s.push_back(d[b >> 4]);
    s.push_back(d[b & 15]);
  }
  return s;
}

// Recorded with the tcp plugin's own codec and proof code (wire protocol 2) before they moved
// into the host. Changing a byte here breaks interoperability with deployed tcp peers.
TEST(PeerAuthWire, GoldenBytesOfTcpProtocolVersion2) {
  Hello h = SampleHello();
  EXPECT_EQ(Hex(EncodeHello(h).data(), EncodeHello(h).size()),
            "4b56424802000100887766554433221100ffeeddccbbaa9900070e151c232a31383f464d545b6269"
            "0b000b00636c69656e742d6e6f64657365727665722d6e6f6465");
  HelloReply r;
  r.flags = kReplyFlagProof;
  r.server_node_id = "server-node";
  r.server_incarnation = h.expected_incarnation;
  for (size_t i = 0; i < kNonceBytes; ++i) r.server_nonce[i] = static_cast<uint8_t>(200 - i);
  const Transcript t{h.client_node_id,     h.client_incarnation, r.server_node_id,
                     r.server_incarnation, h.expected_node_id,   h.expected_incarnation,
                     h.client_nonce,       r.server_nonce,       KVB_OK};
  EXPECT_EQ(kLabel, "kvbridge-tcp-auth-v2");
  ASSERT_TRUE(ComputeProof("secret-token", kLabel, Role::kServer, t, &r.server_proof));
  EXPECT_EQ(Hex(r.server_proof.data(), kProofBytes),
            "baf062952f5908433e9f5c5c975d6b559fdf4c9993b3a94e9d6d6faaf235bab9");
  const std::string rb = EncodeHelloReply(r);
  EXPECT_EQ(Hex(rb.data(), rb.size()),
            "4b56424102000100000000000000000000ffeeddccbbaa99c8c7c6c5c4c3c2c1c0bfbebdbcbbbab9"
            "baf062952f5908433e9f5c5c975d6b559fdf4c9993b3a94e9d6d6faaf235bab90b000000736572766572"
            "2d6e6f6465");
  Proof cp;
  ASSERT_TRUE(ComputeProof("secret-token", kLabel, Role::kClient, t, &cp));
  EXPECT_EQ(Hex(cp.data(), kProofBytes),
            "ed52e825daf756b9f9f3287309119266638689370687a720a8ef12c8f75f8ad1");
  // Another transport's label makes another proof: a tcp proof is no proof for ucx.
  Proof other;
  ASSERT_TRUE(ComputeProof("secret-token", ProofLabel("ucx"), Role::kServer, t, &other));
  EXPECT_NE(other, r.server_proof);
}

// ---- the state machines, through the host's C services table --------------------------------

// One side of a handshake driven through kvb_host_services_t, as a transport drives it.
struct Side {
  HostServices host;
  kvb_auth_t* a = nullptr;
  Side(Identity id, int32_t role, const char* transport, const char* expect, uint64_t expect_inc)
      : host({}, std::move(id)) {
    char err[256] = {0};
    const kvb_host_services_t* t = host.table();
    EXPECT_EQ(t->auth_begin(t->host_ctx, transport, role, expect, expect_inc, &a, err, sizeof(err)),
              KVB_OK)
        << err;
  }
  ~Side() {
    if (a != nullptr) host.table()->auth_end(host.table()->host_ctx, a);
  }
  // Feeds `in` (nullptr for a client's first step) and returns the status; out/err filled.
  // `well_formed`: check that auth_need asks for exactly this message's bytes.
  kvb_status_t Step(const std::string* in, std::string* out, std::string* err,
                    bool well_formed = true) {
    const kvb_host_services_t* t = host.table();
    if (in != nullptr && well_formed) {  // the transport reads exactly what auth_need asks for
      uint32_t have = 0;
      int32_t need = t->auth_need(t->host_ctx, a, reinterpret_cast<const uint8_t*>(in->data()), 0);
      while (need > static_cast<int32_t>(have) && static_cast<size_t>(need) <= in->size()) {
        have = static_cast<uint32_t>(need);
        need = t->auth_need(t->host_ctx, a, reinterpret_cast<const uint8_t*>(in->data()), have);
      }
      EXPECT_EQ(static_cast<size_t>(need), in->size()) << "auth_need disagrees with the message";
    }
    uint8_t buf[KVB_AUTH_MAX_MESSAGE];
    uint32_t len = 0;
    char e[512] = {0};
    const kvb_status_t st = t->auth_step(
        t->host_ctx, a, in ? reinterpret_cast<const uint8_t*>(in->data()) : nullptr,
        in ? static_cast<uint32_t>(in->size()) : 0, buf, sizeof(buf), &len, e, sizeof(e));
    out->assign(reinterpret_cast<const char*>(buf), len);
    *err = e;
    return st;
  }
  std::string Peer(uint64_t* inc) {
    char id[256] = {0};
    const kvb_host_services_t* t = host.table();
    if (t->auth_peer(t->host_ctx, a, id, sizeof(id), inc) != KVB_OK) return "<none>";
    return id;
  }
};

struct Outcome {
  kvb_status_t client = KVB_IN_PROGRESS, server = KVB_IN_PROGRESS;
  std::string client_err, server_err;
  int messages = 0;
};

// Runs a whole exchange, message by message, until both sides have ended.
Outcome Exchange(Side& c, Side& s) {
  Outcome o;
  std::string msg, out;
  o.client = c.Step(nullptr, &msg, &o.client_err);
  bool to_server = true;
  while (!msg.empty() && o.messages < 8) {
    ++o.messages;
    Side& receiver = to_server ? s : c;
    kvb_status_t& st = to_server ? o.server : o.client;
    if (st != KVB_IN_PROGRESS) break;
    st = receiver.Step(&msg, &out, to_server ? &o.server_err : &o.client_err);
    msg = out;
    to_server = !to_server;
  }
  return o;
}

Identity Id(const std::string& node, uint64_t inc, const std::string& token = "") {
  return Identity{node, inc, token};
}

TEST(PeerAuth, WithoutTokenTwoMessagesAndBothSidesKnowEachOther) {
  Side c(Id("a", 1), KVB_AUTH_CLIENT, "tcp", "b", 2);
  Side s(Id("b", 2), KVB_AUTH_SERVER, "tcp", nullptr, 0);
  const Outcome o = Exchange(c, s);
  EXPECT_EQ(o.server, KVB_OK) << o.server_err;
  EXPECT_EQ(o.client, KVB_OK) << o.client_err;
  EXPECT_EQ(o.messages, 2);
  uint64_t inc = 0;
  EXPECT_EQ(c.Peer(&inc), "b");
  EXPECT_EQ(inc, 2u);
  EXPECT_EQ(s.Peer(&inc), "a");
  EXPECT_EQ(inc, 1u);
}

TEST(PeerAuth, WithTheSameTokenFourMessages) {
  Side c(Id("a", 1, "t0ken"), KVB_AUTH_CLIENT, "ucx", "b", 2);
  Side s(Id("b", 2, "t0ken"), KVB_AUTH_SERVER, "ucx", nullptr, 0);
  const Outcome o = Exchange(c, s);
  EXPECT_EQ(o.server, KVB_OK) << o.server_err;
  EXPECT_EQ(o.client, KVB_OK) << o.client_err;
  EXPECT_EQ(o.messages, 4);
}

TEST(PeerAuth, EveryRefusalIsNamedOnBothSides) {
  struct Case {
    const char* what;
    Identity client, server;
    const char* client_transport = "tcp";
    const char* server_transport = "tcp";
    uint64_t expect_inc = 2;
    kvb_status_t client_st, server_st;
    const char* client_says;
    const char* server_says;
  };
  const Case cases[] = {
      {"restarted server (another incarnation)", Id("a", 1), Id("b", 3), "tcp", "tcp", 2,
       KVB_ERR_STALE_PEER, KVB_ERR_STALE_PEER, "STALE_PEER", "STALE_PEER"},
      // The client refuses the server's proof and says so; the server fails on that message.
      {"wrong token", Id("a", 1, "one"), Id("b", 2, "two"), "tcp", "tcp", 2,
       KVB_ERR_UNAUTHENTICATED, KVB_ERR_UNAUTHENTICATED, "proof is wrong", "could not verify"},
      {"client without token", Id("a", 1), Id("b", 2, "two"), "tcp", "tcp", 2,
       KVB_ERR_UNAUTHENTICATED, KVB_ERR_UNAUTHENTICATED, "requires a cluster token",
       "has no cluster token"},
      {"server without token", Id("a", 1, "one"), Id("b", 2), "tcp", "tcp", 2,
       KVB_ERR_UNAUTHENTICATED, KVB_ERR_UNAUTHENTICATED, "UNAUTHENTICATED", "this node has none"},
      {"proof made for another transport", Id("a", 1, "one"), Id("b", 2, "one"), "tcp", "ucx", 2,
       KVB_ERR_UNAUTHENTICATED, KVB_ERR_UNAUTHENTICATED, "proof is wrong", "could not verify"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    Side c(k.client, KVB_AUTH_CLIENT, k.client_transport, "b", k.expect_inc);
    Side s(k.server, KVB_AUTH_SERVER, k.server_transport, nullptr, 0);
    const Outcome o = Exchange(c, s);
    EXPECT_EQ(o.client, k.client_st) << o.client_err;
    EXPECT_NE(o.client_err.find(k.client_says), std::string::npos) << o.client_err;
    EXPECT_EQ(o.server, k.server_st) << o.server_err;
    EXPECT_NE(o.server_err.find(k.server_says), std::string::npos) << o.server_err;
    uint64_t inc = 0;
    EXPECT_EQ(c.Peer(&inc), "<none>") << "a refused handshake names no peer";
  }
}

TEST(PeerAuth, MalformedAndOutOfOrderMessagesEndTheHandshake) {
  Side s(Id("b", 2), KVB_AUTH_SERVER, "tcp", nullptr, 0);
  const kvb_host_services_t* t = s.host.table();
  const std::string junk(64, 'x');
  EXPECT_EQ(t->auth_need(t->host_ctx, s.a, reinterpret_cast<const uint8_t*>(junk.data()), 8), -1);
  std::string out, err;
  EXPECT_EQ(s.Step(&junk, &out, &err, false), KVB_ERR_PROTOCOL);
  EXPECT_NE(err.find("malformed"), std::string::npos) << err;
  EXPECT_EQ(s.Step(&junk, &out, &err, false), KVB_ERR_PROTOCOL) << "no step after the end";
  EXPECT_NE(err.find("after the handshake ended"), std::string::npos) << err;

  Side c(Id("a", 1), KVB_AUTH_CLIENT, "tcp", "b", 2);
  std::string hello;
  ASSERT_EQ(c.Step(nullptr, &hello, &err), KVB_IN_PROGRESS);
  // The client's own hello reflected back is not a reply.
  EXPECT_EQ(c.Step(&hello, &out, &err, false), KVB_ERR_PROTOCOL);
  EXPECT_NE(err.find("malformed handshake reply"), std::string::npos) << err;
}

TEST(PeerAuth, ServicesRefuseBadArgumentsAndAHostWithoutIdentity) {
  HostServices storage_host({});  // as a storage node builds it: no identity
  const kvb_host_services_t* t = storage_host.table();
  kvb_auth_t* a = nullptr;
  char err[256] = {0};
  EXPECT_EQ(t->auth_begin(t->host_ctx, "tcp", KVB_AUTH_CLIENT, "b", 1, &a, err, sizeof(err)),
            KVB_ERR_UNAVAILABLE);
  EXPECT_NE(std::string(err).find("no identity"), std::string::npos) << err;
  EXPECT_STREQ(t->node_id(t->host_ctx), "");

  HostServices host({}, Id("a", 7));
  t = host.table();
  EXPECT_STREQ(t->node_id(t->host_ctx), "a");
  EXPECT_EQ(t->incarnation(t->host_ctx), 7u);
  EXPECT_EQ(t->auth_begin(t->host_ctx, "tcp", KVB_AUTH_CLIENT, "", 1, &a, err, sizeof(err)),
            KVB_ERR_INVALID_ARGUMENT)
      << "a client must name whom it expects";
  EXPECT_EQ(t->auth_begin(t->host_ctx, "", KVB_AUTH_SERVER, nullptr, 0, &a, err, sizeof(err)),
            KVB_ERR_INVALID_ARGUMENT)
      << "the proofs need the transport's name";
  EXPECT_EQ(t->auth_begin(t->host_ctx, "tcp", 3, nullptr, 0, &a, err, sizeof(err)),
            KVB_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(t->auth_begin(t->host_ctx, "tcp", KVB_AUTH_CLIENT, "b", 1, &a, err, sizeof(err)),
            KVB_OK);
  uint8_t small[8];
  uint32_t len = 0;
  EXPECT_EQ(t->auth_step(t->host_ctx, a, nullptr, 0, small, sizeof(small), &len, err, sizeof(err)),
            KVB_ERR_INVALID_ARGUMENT)
      << "a hello does not fit in 8 bytes";
  EXPECT_EQ(t->auth_peer(t->host_ctx, a, err, sizeof(err), nullptr), KVB_ERR_UNAUTHENTICATED);
  t->auth_end(t->host_ctx, a);
}

}  // namespace
}  // namespace kvbridge::core::auth
