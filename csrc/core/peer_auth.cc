#include "core/peer_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "util/little_endian.h"

namespace kvbridge::core::auth {
namespace {
ParseResult Malformed(const char* reason) { return {Parse::kMalformed, 0, reason}; }

// Appends a length-prefixed field to the HMAC input, so no two transcripts serialize alike.
void AppendField(std::string* s, const void* data, size_t len) {
  uint8_t n[4];
  util::PutLe32(n, static_cast<uint32_t>(len));
  s->append(reinterpret_cast<const char*>(n), 4);
  s->append(static_cast<const char*>(data), len);
}
void AppendU64(std::string* s, uint64_t v) {
  uint8_t b[8];
  util::PutLe64(b, v);
  AppendField(s, b, 8);
}

std::string Fmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Fmt(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

}  // namespace

std::string EncodeHello(const Hello& h) {
  std::string out(kHelloFixedBytes + h.client_node_id.size() + h.expected_node_id.size(), '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  util::PutLe32(p, kHelloMagic);
  util::PutLe16(p + 4, h.version);
  util::PutLe16(p + 6, h.flags);
  util::PutLe64(p + 8, h.client_incarnation);
  util::PutLe64(p + 16, h.expected_incarnation);
  std::memcpy(p + 24, h.client_nonce.data(), kNonceBytes);
  util::PutLe16(p + 40, static_cast<uint16_t>(h.client_node_id.size()));
  util::PutLe16(p + 42, static_cast<uint16_t>(h.expected_node_id.size()));
  std::memcpy(p + kHelloFixedBytes, h.client_node_id.data(), h.client_node_id.size());
  std::memcpy(p + kHelloFixedBytes + h.client_node_id.size(), h.expected_node_id.data(),
              h.expected_node_id.size());
  return out;
}

ParseResult DecodeHello(const uint8_t* buf, size_t len, Hello* out) {
  if (len < 4) return {Parse::kNeedMore, kHelloFixedBytes, ""};
  if (util::GetLe32(buf) != kHelloMagic) return Malformed("bad hello magic");
  if (len < kHelloFixedBytes) return {Parse::kNeedMore, kHelloFixedBytes, ""};
  const size_t client_len = util::GetLe16(buf + 40);
  const size_t expected_len = util::GetLe16(buf + 42);
  if (client_len > kMaxNodeIdBytes || expected_len > kMaxNodeIdBytes) {
    return Malformed("node id longer than 255 bytes");
  }
  const size_t total = kHelloFixedBytes + client_len + expected_len;
  if (len < total) return {Parse::kNeedMore, total, ""};
  out->version = util::GetLe16(buf + 4);
  out->flags = util::GetLe16(buf + 6);
  out->client_incarnation = util::GetLe64(buf + 8);
  out->expected_incarnation = util::GetLe64(buf + 16);
  std::memcpy(out->client_nonce.data(), buf + 24, kNonceBytes);
  const char* ids = reinterpret_cast<const char*>(buf + kHelloFixedBytes);
  out->client_node_id.assign(ids, client_len);
  out->expected_node_id.assign(ids + client_len, expected_len);
  return {Parse::kOk, total, ""};
}

std::string EncodeHelloReply(const HelloReply& r) {
  std::string out(kHelloReplyFixedBytes + r.server_node_id.size(), '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  util::PutLe32(p, kHelloReplyMagic);
  util::PutLe16(p + 4, r.version);
  util::PutLe16(p + 6, r.flags);
  util::PutLe32(p + 8, static_cast<uint32_t>(r.status));
  util::PutLe32(p + 12, 0);
  util::PutLe64(p + 16, r.server_incarnation);
  std::memcpy(p + 24, r.server_nonce.data(), kNonceBytes);
  std::memcpy(p + 40, r.server_proof.data(), kProofBytes);
  util::PutLe16(p + 72, static_cast<uint16_t>(r.server_node_id.size()));
  util::PutLe16(p + 74, 0);
  std::memcpy(p + kHelloReplyFixedBytes, r.server_node_id.data(), r.server_node_id.size());
  return out;
}

ParseResult DecodeHelloReply(const uint8_t* buf, size_t len, HelloReply* out) {
  if (len < 4) return {Parse::kNeedMore, kHelloReplyFixedBytes, ""};
  if (util::GetLe32(buf) != kHelloReplyMagic) return Malformed("bad hello-reply magic");
  if (len < kHelloReplyFixedBytes) return {Parse::kNeedMore, kHelloReplyFixedBytes, ""};
  const size_t id_len = util::GetLe16(buf + 72);
  if (id_len > kMaxNodeIdBytes) return Malformed("node id longer than 255 bytes");
  const size_t total = kHelloReplyFixedBytes + id_len;
  if (len < total) return {Parse::kNeedMore, total, ""};
  out->version = util::GetLe16(buf + 4);
  out->flags = util::GetLe16(buf + 6);
  out->status = static_cast<int32_t>(util::GetLe32(buf + 8));
  out->server_incarnation = util::GetLe64(buf + 16);
  std::memcpy(out->server_nonce.data(), buf + 24, kNonceBytes);
  std::memcpy(out->server_proof.data(), buf + 40, kProofBytes);
  out->server_node_id.assign(reinterpret_cast<const char*>(buf + kHelloReplyFixedBytes), id_len);
  return {Parse::kOk, total, ""};
}

void EncodeClientProof(const ClientProof& p, uint8_t out[kClientProofBytes]) {
  util::PutLe32(out, kClientProofMagic);
  util::PutLe32(out + 4, static_cast<uint32_t>(p.status));
  std::memcpy(out + 8, p.proof.data(), kProofBytes);
}

bool DecodeClientProof(const uint8_t* buf, size_t len, ClientProof* out) {
  if (len < kClientProofBytes || util::GetLe32(buf) != kClientProofMagic) return false;
  out->status = static_cast<int32_t>(util::GetLe32(buf + 4));
  std::memcpy(out->proof.data(), buf + 8, kProofBytes);
  return true;
}

void EncodeAuthDone(const AuthDone& d, uint8_t out[kAuthDoneBytes]) {
  util::PutLe32(out, kAuthDoneMagic);
  util::PutLe32(out + 4, static_cast<uint32_t>(d.status));
}

bool DecodeAuthDone(const uint8_t* buf, size_t len, AuthDone* out) {
  if (len < kAuthDoneBytes || util::GetLe32(buf) != kAuthDoneMagic) return false;
  out->status = static_cast<int32_t>(util::GetLe32(buf + 4));
  return true;
}

std::string ProofLabel(std::string_view transport) {
  return "kvbridge-" + std::string(transport) + "-auth-v2";
}

bool ComputeProof(std::string_view token, std::string_view label, Role role, const Transcript& t,
                  Proof* out) {
  std::string msg(label);
  const uint8_t r = static_cast<uint8_t>(role);
  AppendField(&msg, &r, 1);
  AppendField(&msg, t.client_node_id.data(), t.client_node_id.size());
  AppendU64(&msg, t.client_incarnation);
  AppendField(&msg, t.server_node_id.data(), t.server_node_id.size());
  AppendU64(&msg, t.server_incarnation);
  AppendField(&msg, t.expected_node_id.data(), t.expected_node_id.size());
  AppendU64(&msg, t.expected_incarnation);
  AppendField(&msg, t.client_nonce.data(), kNonceBytes);
  AppendField(&msg, t.server_nonce.data(), kNonceBytes);
  AppendU64(&msg, static_cast<uint32_t>(t.server_status));
  unsigned int out_len = 0;
  const unsigned char* mac =
      HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
           reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out->data(), &out_len);
  return mac != nullptr && out_len == kProofBytes;
}

bool VerifyProof(std::string_view token, std::string_view label, Role role, const Transcript& t,
                 const Proof& proof) {
  Proof expected{};
  if (!ComputeProof(token, label, role, t, &expected)) return false;
  return CRYPTO_memcmp(expected.data(), proof.data(), kProofBytes) == 0;
}

bool RandomNonce(Nonce* out) { return RAND_bytes(out->data(), kNonceBytes) == 1; }

// ---- Session ------------------------------------------------------------------------------

Session::Session(Identity self, std::string_view transport, Role role, std::string expected_node_id,
                 uint64_t expected_incarnation)
    : self_(std::move(self)),
      label_(ProofLabel(transport)),
      role_(role),
      state_(role == Role::kClient ? State::kStart : State::kAwaitHello) {
  hello_.expected_node_id = std::move(expected_node_id);
  hello_.expected_incarnation = expected_incarnation;
}

Transcript Session::MakeTranscript(int32_t server_status) const {
  // The client's view: the identity it asked for (its own Hello), not what the server claims,
  // so a Hello rewritten on the way fails the server's proof. The server's view: the Hello as
  // received, so the client's proof holds only if that is what it sent.
  return Transcript{
      hello_.client_node_id,     hello_.client_incarnation, reply_.server_node_id,
      reply_.server_incarnation, hello_.expected_node_id,   hello_.expected_incarnation,
      hello_.client_nonce,       reply_.server_nonce,       server_status};
}

int32_t Session::Need(const uint8_t* buf, size_t have) const {
  ParseResult pr;
  switch (state_) {
    case State::kAwaitHello: {
      Hello h;
      pr = DecodeHello(buf, have, &h);
      break;
    }
    case State::kAwaitReply: {
      HelloReply r;
      pr = DecodeHelloReply(buf, have, &r);
      break;
    }
    case State::kAwaitProof:
      return static_cast<int32_t>(kClientProofBytes);
    case State::kAwaitDone:
      return static_cast<int32_t>(kAuthDoneBytes);
    default:
      return -1;
  }
  if (pr.result == Parse::kMalformed || pr.bytes > KVB_AUTH_MAX_MESSAGE) return -1;
  return static_cast<int32_t>(pr.bytes);
}

kvb_status_t Session::Step(const uint8_t* in, size_t in_len, std::string* out, std::string* err) {
  out->clear();
  const State was = state_;
  state_ = State::kFailed;  // unless the step below says otherwise
  switch (was) {
    case State::kStart: {
      hello_.flags = self_.cluster_token.empty() ? 0 : kHelloFlagAuth;
      hello_.client_node_id = self_.node_id;
      hello_.client_incarnation = self_.incarnation;
      if (!RandomNonce(&hello_.client_nonce)) {
        *err = "random number generator failed";
        return KVB_ERR_INTERNAL;
      }
      *out = EncodeHello(hello_);
      state_ = State::kAwaitReply;
      return KVB_IN_PROGRESS;
    }
    case State::kAwaitReply:
      return ClientReply(in, in_len, out, err);
    case State::kAwaitDone: {
      AuthDone done;
      if (in == nullptr || !DecodeAuthDone(in, in_len, &done)) {
        *err = "malformed handshake confirmation";
        return KVB_ERR_PROTOCOL;
      }
      if (done.status != KVB_OK) {
        *err = "refused: the peer rejected our cluster token proof (UNAUTHENTICATED)";
        return KVB_ERR_UNAUTHENTICATED;
      }
      state_ = State::kDone;
      return KVB_OK;
    }
    case State::kAwaitHello:
      return ServerHello(in, in_len, out, err);
    case State::kAwaitProof:
      return ServerProof(in, in_len, out, err);
    case State::kDone:
    case State::kFailed:
      break;
  }
  *err = "handshake step after the handshake ended";
  return KVB_ERR_PROTOCOL;
}

kvb_status_t Session::ClientReply(const uint8_t* in, size_t len, std::string* out,
                                  std::string* err) {
  const ParseResult pr = in == nullptr ? ParseResult{} : DecodeHelloReply(in, len, &reply_);
  if (pr.result != Parse::kOk) {
    *err = Fmt("malformed handshake reply: %s", in == nullptr ? "no bytes" : pr.reason);
    return KVB_ERR_PROTOCOL;
  }
  if (reply_.version != kProtocolVersion) {
    *err = Fmt("peer speaks handshake version %u, this build speaks %u", reply_.version,
               kProtocolVersion);
    return KVB_ERR_PROTOCOL;
  }
  const std::string& token = self_.cluster_token;
  const Transcript tr = MakeTranscript(reply_.status);
  if (!token.empty()) {
    if ((reply_.flags & kReplyFlagProof) == 0) {
      *err = reply_.status == KVB_ERR_UNAUTHENTICATED
                 ? "refused: the peer has no cluster token (UNAUTHENTICATED)"
                 : "refused: the peer did not prove the cluster token (UNAUTHENTICATED)";
      return KVB_ERR_UNAUTHENTICATED;
    }
    if (!VerifyProof(token, label_, Role::kServer, tr, reply_.server_proof)) {
      uint8_t pb[kClientProofBytes];
      EncodeClientProof({KVB_ERR_UNAUTHENTICATED, {}}, pb);
      out->assign(reinterpret_cast<const char*>(pb), sizeof(pb));
      *err = "refused: the peer's cluster token proof is wrong (UNAUTHENTICATED)";
      return KVB_ERR_UNAUTHENTICATED;
    }
  } else if (reply_.status == KVB_ERR_UNAUTHENTICATED) {
    *err = "the peer requires a cluster token and this instance has none (UNAUTHENTICATED)";
    return KVB_ERR_UNAUTHENTICATED;
  }
  if (reply_.status == KVB_ERR_STALE_PEER || reply_.server_node_id != hello_.expected_node_id ||
      reply_.server_incarnation != hello_.expected_incarnation) {
    *err = Fmt("STALE_PEER: expected node '%s' incarnation %#" PRIx64
               ", but the peer is node '%s' incarnation %#" PRIx64,
               hello_.expected_node_id.c_str(), hello_.expected_incarnation,
               reply_.server_node_id.c_str(), reply_.server_incarnation);
    return KVB_ERR_STALE_PEER;
  }
  if (reply_.status != KVB_OK) {
    *err = Fmt("the peer refused the handshake with status %d", reply_.status);
    return reply_.status == KVB_ERR_UNAUTHENTICATED ? KVB_ERR_UNAUTHENTICATED : KVB_ERR_PROTOCOL;
  }
  peer_node_id_ = reply_.server_node_id;
  peer_incarnation_ = reply_.server_incarnation;
  if (token.empty()) {
    state_ = State::kDone;
    return KVB_OK;
  }
  ClientProof cp;
  if (!ComputeProof(token, label_, Role::kClient, tr, &cp.proof)) {
    *err = "HMAC failed";
    return KVB_ERR_INTERNAL;
  }
  uint8_t pb[kClientProofBytes];
  EncodeClientProof(cp, pb);
  out->assign(reinterpret_cast<const char*>(pb), sizeof(pb));
  state_ = State::kAwaitDone;
  return KVB_IN_PROGRESS;
}

kvb_status_t Session::ServerHello(const uint8_t* in, size_t len, std::string* out,
                                  std::string* err) {
  const ParseResult pr = in == nullptr ? ParseResult{} : DecodeHello(in, len, &hello_);
  if (pr.result != Parse::kOk) {
    *err = Fmt("malformed handshake (%s)", in == nullptr ? "no bytes" : pr.reason);
    return KVB_ERR_PROTOCOL;
  }
  reply_.server_node_id = self_.node_id;
  reply_.server_incarnation = self_.incarnation;
  if (!RandomNonce(&reply_.server_nonce)) {
    *err = "random number generator failed";
    return KVB_ERR_INTERNAL;
  }
  const std::string& token = self_.cluster_token;
  const bool client_auth = (hello_.flags & kHelloFlagAuth) != 0;
  const std::string who = Fmt("node '%s' incarnation %#" PRIx64, hello_.client_node_id.c_str(),
                              hello_.client_incarnation);
  if (hello_.version != kProtocolVersion) {
    reply_.status = KVB_ERR_PROTOCOL;
    *err = Fmt("refused %s: it speaks handshake version %u, this build speaks %u", who.c_str(),
               hello_.version, kProtocolVersion);
  } else if (!token.empty() && !client_auth) {
    reply_.status = KVB_ERR_UNAUTHENTICATED;
    *err = Fmt("refused %s: it has no cluster token (UNAUTHENTICATED)", who.c_str());
  } else if (token.empty() && client_auth) {
    reply_.status = KVB_ERR_UNAUTHENTICATED;
    *err = Fmt("refused %s: it presents a cluster token but this node has none (UNAUTHENTICATED)",
               who.c_str());
  } else if (hello_.expected_node_id != self_.node_id ||
             hello_.expected_incarnation != self_.incarnation) {
    reply_.status = KVB_ERR_STALE_PEER;
    *err = Fmt("refused %s: it expects node '%s' incarnation %#" PRIx64
               ", this is node '%s' incarnation %#" PRIx64 " (STALE_PEER)",
               who.c_str(), hello_.expected_node_id.c_str(), hello_.expected_incarnation,
               self_.node_id.c_str(), self_.incarnation);
  }
  const bool authenticating = !token.empty() && client_auth && hello_.version == kProtocolVersion;
  if (authenticating) {
    if (!ComputeProof(token, label_, Role::kServer, MakeTranscript(reply_.status),
                      &reply_.server_proof)) {
      *err = "HMAC failed";
      return KVB_ERR_INTERNAL;
    }
    reply_.flags |= kReplyFlagProof;
  }
  *out = EncodeHelloReply(reply_);
  if (reply_.status != KVB_OK) return reply_.status;
  peer_node_id_ = hello_.client_node_id;
  peer_incarnation_ = hello_.client_incarnation;
  state_ = authenticating ? State::kAwaitProof : State::kDone;
  return authenticating ? KVB_IN_PROGRESS : KVB_OK;
}

kvb_status_t Session::ServerProof(const uint8_t* in, size_t len, std::string* out,
                                  std::string* err) {
  const std::string who = Fmt("node '%s' incarnation %#" PRIx64, hello_.client_node_id.c_str(),
                              hello_.client_incarnation);
  ClientProof cp;
  if (in == nullptr || !DecodeClientProof(in, len, &cp)) {
    *err = Fmt("closing %s: malformed handshake proof", who.c_str());
    return KVB_ERR_PROTOCOL;
  }
  if (cp.status != KVB_OK) {
    *err =
        Fmt("refused %s: it could not verify this node's cluster token proof (token mismatch, "
            "UNAUTHENTICATED)",
            who.c_str());
    return KVB_ERR_UNAUTHENTICATED;
  }
  const bool ok = VerifyProof(self_.cluster_token, label_, Role::kClient,
                              MakeTranscript(reply_.status), cp.proof);
  uint8_t db[kAuthDoneBytes];
  EncodeAuthDone({ok ? KVB_OK : KVB_ERR_UNAUTHENTICATED}, db);
  out->assign(reinterpret_cast<const char*>(db), sizeof(db));
  if (!ok) {
    *err = Fmt("refused %s: wrong cluster token proof (UNAUTHENTICATED)", who.c_str());
    return KVB_ERR_UNAUTHENTICATED;
  }
  state_ = State::kDone;
  return KVB_OK;
}

}  // namespace kvbridge::core::auth
