// The peer handshake every transport runs on a new connection before moving a byte: who is
// who (node id, incarnation), whether the answering process is the incarnation the client
// asked for, and, with a cluster token, a mutual proof that both sides hold it. The host runs
// it (ABI 1.2 services auth_begin ... auth_end in kvbridge/plugin/abi.h, served by
// core::HostServices); a transport only carries the opaque messages, so transports never see
// the token and all of them authenticate alike.
//
// Four messages, little-endian with explicit packing, every decoder bounded by the bytes it is
// given and by kMaxNodeIdBytes (a length over the bound is malformed, never "need more"):
//   client -> server  Hello       (44 B + both node ids): identities, expected identity, nonce
//   server -> client  HelloReply  (76 B + node id): status, server identity, nonce, proof
//   client -> server  ClientProof (40 B, only with a token): the client's proof
//   server -> client  AuthDone    (8 B, only with a token): accepted or not
// These are, byte for byte, the tcp transport's wire protocol version 2, so tcp peers built
// before the handshake moved into the host interoperate with current ones.
//
// Proofs are HMAC-SHA256(token, "kvbridge-<transport>-auth-v2" || role || transcript): bound to
// the transport's name, to the role (no reflection), to fresh nonces (no replay) and to the
// identity the client expected (a Hello rewritten on the way fails both proofs).
//
// Thread-safety: the codecs and proof functions are pure; one Session is used by one thread
// at a time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kvbridge/plugin/abi.h"

namespace kvbridge::core::auth {

// 2: the proofs also cover the identity the client expected (Transcript::expected_*).
constexpr uint16_t kProtocolVersion = 2;

// Magics, chosen so that the bytes on the wire read "KVBH", "KVBA", "KVBP", "KVBD".
constexpr uint32_t kHelloMagic = 0x4842564bu;
constexpr uint32_t kHelloReplyMagic = 0x4142564bu;
constexpr uint32_t kClientProofMagic = 0x5042564bu;
constexpr uint32_t kAuthDoneMagic = 0x4442564bu;

constexpr size_t kMaxNodeIdBytes = 255;
constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;  // HMAC-SHA256

using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

constexpr uint16_t kHelloFlagAuth = 1;   // Hello: the client holds a cluster token
constexpr uint16_t kReplyFlagProof = 1;  // HelloReply: server_proof is present

struct Hello {
  uint16_t version = kProtocolVersion;
  uint16_t flags = 0;
  std::string client_node_id;
  uint64_t client_incarnation = 0;
  std::string expected_node_id;  // who the client believes it is talking to
  uint64_t expected_incarnation = 0;
  Nonce client_nonce{};
};
constexpr size_t kHelloFixedBytes = 44;

// status is KVB_OK, KVB_ERR_STALE_PEER, KVB_ERR_UNAUTHENTICATED or KVB_ERR_PROTOCOL (version
// or format not understood).
struct HelloReply {
  uint16_t version = kProtocolVersion;
  uint16_t flags = 0;
  int32_t status = KVB_OK;
  std::string server_node_id;
  uint64_t server_incarnation = 0;
  Nonce server_nonce{};
  Proof server_proof{};
};
constexpr size_t kHelloReplyFixedBytes = 76;

// status is KVB_OK, or KVB_ERR_UNAUTHENTICATED when the server's proof did not verify (then
// proof is zero).
struct ClientProof {
  int32_t status = KVB_OK;
  Proof proof{};
};
constexpr size_t kClientProofBytes = 40;

struct AuthDone {
  int32_t status = KVB_OK;
};
constexpr size_t kAuthDoneBytes = 8;

// Result of parsing a variable-length message from a byte prefix.
enum class Parse { kOk, kNeedMore, kMalformed };
struct ParseResult {
  Parse result = Parse::kMalformed;
  size_t bytes = 0;         // kOk: bytes consumed; kNeedMore: total bytes needed
  const char* reason = "";  // kMalformed: why
};

std::string EncodeHello(const Hello& h);
ParseResult DecodeHello(const uint8_t* buf, size_t len, Hello* out);
std::string EncodeHelloReply(const HelloReply& r);
ParseResult DecodeHelloReply(const uint8_t* buf, size_t len, HelloReply* out);
void EncodeClientProof(const ClientProof& p, uint8_t out[kClientProofBytes]);
bool DecodeClientProof(const uint8_t* buf, size_t len, ClientProof* out);
void EncodeAuthDone(const AuthDone& d, uint8_t out[kAuthDoneBytes]);
bool DecodeAuthDone(const uint8_t* buf, size_t len, AuthDone* out);

// Who is who in one handshake; both proofs are computed over all of it.
struct Transcript {
  std::string_view client_node_id;
  uint64_t client_incarnation = 0;
  std::string_view server_node_id;
  uint64_t server_incarnation = 0;
  std::string_view expected_node_id;  // whom the client meant (its Hello)
  uint64_t expected_incarnation = 0;
  Nonce client_nonce{};
  Nonce server_nonce{};
  int32_t server_status = KVB_OK;
};
enum class Role : uint8_t { kServer = 'S', kClient = 'C' };

// "kvbridge-<transport>-auth-v2": the domain a proof is made for.
std::string ProofLabel(std::string_view transport);
// HMAC-SHA256(token, label || role || transcript). False only if libcrypto fails.
bool ComputeProof(std::string_view token, std::string_view label, Role role, const Transcript& t,
                  Proof* out);
// Constant-time check of `proof` against the expected one.
bool VerifyProof(std::string_view token, std::string_view label, Role role, const Transcript& t,
                 const Proof& proof);
// 16 bytes from the OpenSSL CSPRNG. False if the RNG fails.
bool RandomNonce(Nonce* out);

// This process as a handshake presents it.
struct Identity {
  std::string node_id;
  uint64_t incarnation = 0;
  std::string cluster_token;  // empty = no authentication
};

// One handshake, client or server side: the state machine behind auth_need/auth_step.
//  Client: Step(nullptr) -> Hello; Step(HelloReply) -> OK (no token) or ClientProof;
//          Step(AuthDone) -> OK.
//  Server: Step(Hello) -> HelloReply, then OK (no token) or Step(ClientProof) -> AuthDone, OK.
// Step returns KVB_IN_PROGRESS (send *out, then receive and step again), KVB_OK (send *out if
// any; done), or the error that ends the handshake with *err saying who and why (*out may hold
// a refusal worth sending). After an error or OK, further steps fail with KVB_ERR_PROTOCOL.
class Session {
 public:
  // `expected_*` name the peer a client means to reach; a server passes "" and 0.
  Session(Identity self, std::string_view transport, Role role, std::string expected_node_id,
          uint64_t expected_incarnation);

  // Total bytes of the next message given its first `have` bytes; -1 when malformed or when no
  // message is expected now.
  int32_t Need(const uint8_t* buf, size_t have) const;
  kvb_status_t Step(const uint8_t* in, size_t in_len, std::string* out, std::string* err);

  bool authenticated() const { return state_ == State::kDone; }
  const std::string& peer_node_id() const { return peer_node_id_; }
  uint64_t peer_incarnation() const { return peer_incarnation_; }

 private:
  enum class State { kStart, kAwaitReply, kAwaitDone, kAwaitHello, kAwaitProof, kDone, kFailed };
  kvb_status_t ClientReply(const uint8_t* in, size_t len, std::string* out, std::string* err);
  kvb_status_t ServerHello(const uint8_t* in, size_t len, std::string* out, std::string* err);
  kvb_status_t ServerProof(const uint8_t* in, size_t len, std::string* out, std::string* err);
  Transcript MakeTranscript(int32_t server_status) const;

  Identity self_;
  std::string label_;
  Role role_;
  State state_;
  Hello hello_;       // sent (client) or received (server)
  HelloReply reply_;  // received (client) or sent (server)
  std::string peer_node_id_;
  uint64_t peer_incarnation_ = 0;
};

}  // namespace kvbridge::core::auth
