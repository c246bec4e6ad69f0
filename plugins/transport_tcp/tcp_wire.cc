#include "tcp_wire.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

namespace kvbridge::tcp::wire {
namespace {

void Put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
void Put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t Get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t Get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

ParseResult Malformed(const char* reason) { return {Parse::kMalformed, 0, reason}; }

// Appends a length-prefixed field to the HMAC input, so no two transcripts serialize alike.
void AppendField(std::string* s, const void* data, size_t len) {
  uint8_t n[4];
  Put32(n, static_cast<uint32_t>(len));
  s->append(reinterpret_cast<const char*>(n), 4);
  s->append(static_cast<const char*>(data), len);
}
void AppendU64(std::string* s, uint64_t v) {
  uint8_t b[8];
  Put64(b, v);
  AppendField(s, b, 8);
}

}  // namespace

std::string EncodeHello(const Hello& h) {
  std::string out(kHelloFixedBytes + h.client_node_id.size() + h.expected_node_id.size(), '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  Put32(p, kHelloMagic);
  Put16(p + 4, h.version);
  Put16(p + 6, h.flags);
  Put64(p + 8, h.client_incarnation);
  Put64(p + 16, h.expected_incarnation);
  std::memcpy(p + 24, h.client_nonce.data(), kNonceBytes);
  Put16(p + 40, static_cast<uint16_t>(h.client_node_id.size()));
  Put16(p + 42, static_cast<uint16_t>(h.expected_node_id.size()));
  std::memcpy(p + kHelloFixedBytes, h.client_node_id.data(), h.client_node_id.size());
  std::memcpy(p + kHelloFixedBytes + h.client_node_id.size(), h.expected_node_id.data(),
              h.expected_node_id.size());
  return out;
}

ParseResult DecodeHello(const uint8_t* buf, size_t len, Hello* out) {
  if (len < 4) return {Parse::kNeedMore, kHelloFixedBytes, ""};
  if (Get32(buf) != kHelloMagic) return Malformed("bad hello magic");
  if (len < kHelloFixedBytes) return {Parse::kNeedMore, kHelloFixedBytes, ""};
  const size_t client_len = Get16(buf + 40);
  const size_t expected_len = Get16(buf + 42);
  if (client_len > kMaxNodeIdBytes || expected_len > kMaxNodeIdBytes) {
    return Malformed("node id longer than 255 bytes");
  }
  const size_t total = kHelloFixedBytes + client_len + expected_len;
  if (len < total) return {Parse::kNeedMore, total, ""};
  out->version = Get16(buf + 4);
  out->flags = Get16(buf + 6);
  out->client_incarnation = Get64(buf + 8);
  out->expected_incarnation = Get64(buf + 16);
  std::memcpy(out->client_nonce.data(), buf + 24, kNonceBytes);
  const char* ids = reinterpret_cast<const char*>(buf + kHelloFixedBytes);
  out->client_node_id.assign(ids, client_len);
  out->expected_node_id.assign(ids + client_len, expected_len);
  return {Parse::kOk, total, ""};
}

std::string EncodeHelloReply(const HelloReply& r) {
  std::string out(kHelloReplyFixedBytes + r.server_node_id.size(), '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  Put32(p, kHelloReplyMagic);
  Put16(p + 4, r.version);
  Put16(p + 6, r.flags);
  Put32(p + 8, static_cast<uint32_t>(r.status));
  Put32(p + 12, 0);
  Put64(p + 16, r.server_incarnation);
  std::memcpy(p + 24, r.server_nonce.data(), kNonceBytes);
  std::memcpy(p + 40, r.server_proof.data(), kProofBytes);
  Put16(p + 72, static_cast<uint16_t>(r.server_node_id.size()));
  Put16(p + 74, 0);
  std::memcpy(p + kHelloReplyFixedBytes, r.server_node_id.data(), r.server_node_id.size());
  return out;
}

ParseResult DecodeHelloReply(const uint8_t* buf, size_t len, HelloReply* out) {
  if (len < 4) return {Parse::kNeedMore, kHelloReplyFixedBytes, ""};
  if (Get32(buf) != kHelloReplyMagic) return Malformed("bad hello-reply magic");
  if (len < kHelloReplyFixedBytes) return {Parse::kNeedMore, kHelloReplyFixedBytes, ""};
  const size_t id_len = Get16(buf + 72);
  if (id_len > kMaxNodeIdBytes) return Malformed("node id longer than 255 bytes");
  const size_t total = kHelloReplyFixedBytes + id_len;
  if (len < total) return {Parse::kNeedMore, total, ""};
  out->version = Get16(buf + 4);
  out->flags = Get16(buf + 6);
  out->status = static_cast<int32_t>(Get32(buf + 8));
  out->server_incarnation = Get64(buf + 16);
  std::memcpy(out->server_nonce.data(), buf + 24, kNonceBytes);
  std::memcpy(out->server_proof.data(), buf + 40, kProofBytes);
  out->server_node_id.assign(reinterpret_cast<const char*>(buf + kHelloReplyFixedBytes), id_len);
  return {Parse::kOk, total, ""};
}

void EncodeClientProof(const ClientProof& p, uint8_t out[kClientProofBytes]) {
  Put32(out, kClientProofMagic);
  Put32(out + 4, static_cast<uint32_t>(p.status));
  std::memcpy(out + 8, p.proof.data(), kProofBytes);
}

bool DecodeClientProof(const uint8_t* buf, size_t len, ClientProof* out) {
  if (len < kClientProofBytes || Get32(buf) != kClientProofMagic) return false;
  out->status = static_cast<int32_t>(Get32(buf + 4));
  std::memcpy(out->proof.data(), buf + 8, kProofBytes);
  return true;
}

void EncodeAuthDone(const AuthDone& d, uint8_t out[kAuthDoneBytes]) {
  Put32(out, kAuthDoneMagic);
  Put32(out + 4, static_cast<uint32_t>(d.status));
}

bool DecodeAuthDone(const uint8_t* buf, size_t len, AuthDone* out) {
  if (len < kAuthDoneBytes || Get32(buf) != kAuthDoneMagic) return false;
  out->status = static_cast<int32_t>(Get32(buf + 4));
  return true;
}

void EncodeRequestHeader(const RequestHeader& h, uint8_t out[kRequestHeaderBytes]) {
  Put32(out, h.magic);
  Put16(out + 4, h.opcode);
  Put16(out + 6, h.flags);
  Put64(out + 8, h.request_id);
  Put64(out + 16, h.segment_id);
  Put64(out + 24, h.offset);
  Put64(out + 32, h.length);
}

bool DecodeRequestHeader(const uint8_t* buf, size_t len, RequestHeader* out) {
  if (len < kRequestHeaderBytes) return false;
  out->magic = Get32(buf);
  out->opcode = Get16(buf + 4);
  out->flags = Get16(buf + 6);
  out->request_id = Get64(buf + 8);
  out->segment_id = Get64(buf + 16);
  out->offset = Get64(buf + 24);
  out->length = Get64(buf + 32);
  return true;
}

void EncodeResponseHeader(const ResponseHeader& h, uint8_t out[kResponseHeaderBytes]) {
  Put32(out, h.magic);
  Put32(out + 4, static_cast<uint32_t>(h.status));
  Put64(out + 8, h.request_id);
  Put64(out + 16, h.length);
}

bool DecodeResponseHeader(const uint8_t* buf, size_t len, ResponseHeader* out) {
  if (len < kResponseHeaderBytes) return false;
  out->magic = Get32(buf);
  out->status = static_cast<int32_t>(Get32(buf + 4));
  out->request_id = Get64(buf + 8);
  out->length = Get64(buf + 16);
  return true;
}

RequestCheck CheckRequest(const RequestHeader& h, const RegionRef* region,
                          uint64_t max_frame_bytes) {
  if (h.magic != kRequestMagic) return {KVB_ERR_PROTOCOL, "bad request magic"};
  if (h.opcode != KVB_OP_READ && h.opcode != KVB_OP_WRITE) {
    return {KVB_ERR_PROTOCOL, "unknown opcode"};
  }
  if (h.flags != 0) return {KVB_ERR_PROTOCOL, "reserved flags set"};
  if (h.length == 0) return {KVB_ERR_PROTOCOL, "zero-length request"};
  if (h.length > max_frame_bytes) return {KVB_ERR_PROTOCOL, "length exceeds max_frame_bytes"};
  if (region == nullptr) return {KVB_ERR_NOT_REGISTERED, "segment not registered"};
  // Overflow-safe: offset + length <= region length, without computing offset + length.
  if (h.offset > region->length || h.length > region->length - h.offset) {
    return {KVB_ERR_OUT_OF_BOUNDS, "range outside the registered region"};
  }
  return {KVB_OK, ""};
}

bool ComputeProof(std::string_view token, Role role, const Transcript& t, Proof* out) {
  std::string msg = "kvbridge-tcp-auth-v2";
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

bool VerifyProof(std::string_view token, Role role, const Transcript& t, const Proof& proof) {
  Proof expected{};
  if (!ComputeProof(token, role, t, &expected)) return false;
  return CRYPTO_memcmp(expected.data(), proof.data(), kProofBytes) == 0;
}

bool RandomNonce(Nonce* out) { return RAND_bytes(out->data(), kNonceBytes) == 1; }

}  // namespace kvbridge::tcp::wire
