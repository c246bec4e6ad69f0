// The tcp transport's wire format: handshake messages, request/response frame headers, the
// HMAC-SHA256 proofs of the cluster-token handshake, and the check every incoming request
// passes before any registered memory is touched.
//
// Everything is little-endian with explicit byte packing (no struct overlays), and every
// decoder takes the number of bytes it may read. Decoders never trust a length field: a
// variable part longer than its bound is malformed, not "need more".
//
// Thread-safety: all functions are pure (RandomNonce uses OpenSSL's thread-safe RNG).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/plugin/transport.h"

namespace kvbridge::tcp::wire {

// 2: the proofs also cover the identity the client expected (Transcript::expected_*).
constexpr uint16_t kProtocolVersion = 2;

// Magics, chosen so that the bytes on the wire read "KVBH", "KVBA", ... in a capture.
constexpr uint32_t kHelloMagic = 0x4842564bu;       // client hello
constexpr uint32_t kHelloReplyMagic = 0x4142564bu;  // server answer
constexpr uint32_t kClientProofMagic = 0x5042564bu;
constexpr uint32_t kAuthDoneMagic = 0x4442564bu;
constexpr uint32_t kRequestMagic = 0x5142564bu;
constexpr uint32_t kResponseMagic = 0x5242564bu;

constexpr size_t kMaxNodeIdBytes = 255;
constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;  // HMAC-SHA256

using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

// Hello flags.
constexpr uint16_t kHelloFlagAuth = 1;  // the client holds a cluster token
// HelloReply flags.
constexpr uint16_t kReplyFlagProof = 1;  // server_proof is present

// Client -> server, the first bytes on a new connection.
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

// Server -> client. status is KVB_OK, KVB_ERR_STALE_PEER, KVB_ERR_UNAUTHENTICATED or
// KVB_ERR_PROTOCOL (version or format not understood).
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

// Client -> server, only when both sides hold a token. status is KVB_OK, or
// KVB_ERR_UNAUTHENTICATED when the server's proof did not verify (then proof is zero).
struct ClientProof {
  int32_t status = KVB_OK;
  Proof proof{};
};
constexpr size_t kClientProofBytes = 40;

// Server -> client, the last handshake message when authenticating.
struct AuthDone {
  int32_t status = KVB_OK;
};
constexpr size_t kAuthDoneBytes = 8;

// A READ or WRITE request. For WRITE, `length` payload bytes follow the header.
struct RequestHeader {
  uint32_t magic = kRequestMagic;
  uint16_t opcode = 0;  // kvb_opcode_t
  uint16_t flags = 0;   // must be 0
  uint64_t request_id = 0;
  uint64_t segment_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};
constexpr size_t kRequestHeaderBytes = 40;

// The answer to one request, in request order. For an OK READ, `length` payload bytes follow;
// every other response has length 0.
struct ResponseHeader {
  uint32_t magic = kResponseMagic;
  int32_t status = KVB_OK;
  uint64_t request_id = 0;
  uint64_t length = 0;
};
constexpr size_t kResponseHeaderBytes = 24;

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

void EncodeRequestHeader(const RequestHeader& h, uint8_t out[kRequestHeaderBytes]);
// Parses the fields only (false if len is short); CheckRequest judges them.
bool DecodeRequestHeader(const uint8_t* buf, size_t len, RequestHeader* out);
void EncodeResponseHeader(const ResponseHeader& h, uint8_t out[kResponseHeaderBytes]);
bool DecodeResponseHeader(const uint8_t* buf, size_t len, ResponseHeader* out);

// A registered region as the server sees it.
struct RegionRef {
  uint8_t* base = nullptr;
  uint64_t length = 0;
};

// What the server does with a request:
//  - KVB_OK: [base + offset, +length) lies inside the region; serve it.
//  - KVB_ERR_NOT_REGISTERED / KVB_ERR_OUT_OF_BOUNDS: answer with that status; for a WRITE,
//    first drain its `length` payload bytes (length is known to be <= max_frame_bytes).
//  - KVB_ERR_PROTOCOL: the frame is malformed; close the connection.
struct RequestCheck {
  kvb_status_t status = KVB_ERR_PROTOCOL;
  const char* reason = "";
};
// `region` is the registered region named by h.segment_id, or nullptr when there is none.
RequestCheck CheckRequest(const RequestHeader& h, const RegionRef* region,
                          uint64_t max_frame_bytes);

// Who is who in one handshake; both proofs are computed over all of it, so a proof cannot be
// replayed on another connection (fresh nonces) or reflected to the other role (role byte),
// and a Hello whose expected identity was rewritten on the way fails both proofs (the server
// proves what it was asked for, the client checks against what it asked for).
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

// HMAC-SHA256(token, "kvbridge-tcp-auth-v2" || role || transcript). Returns false only if
// libcrypto fails.
bool ComputeProof(std::string_view token, Role role, const Transcript& t, Proof* out);
// Constant-time check of `proof` against the expected one.
bool VerifyProof(std::string_view token, Role role, const Transcript& t, const Proof& proof);
// 16 bytes from the OpenSSL CSPRNG. Returns false if the RNG fails.
bool RandomNonce(Nonce* out);

}  // namespace kvbridge::tcp::wire
