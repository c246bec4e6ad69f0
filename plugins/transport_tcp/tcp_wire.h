// The tcp transport's wire format after the handshake: request/response frame headers and the
// check every incoming request passes before any registered memory is touched. The handshake
// itself (identity, incarnation, cluster-token proofs) is the host's (core/peer_auth.h, reached
// through the ABI 1.2 auth services); this plugin only carries its messages.
//
// Everything is little-endian with explicit byte packing (no struct overlays), and every
// decoder takes the number of bytes it may read. Decoders never trust a length field: a
// variable part longer than its bound is malformed, not "need more".
//
// Thread-safety: all functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvbridge/plugin/transport.h"

namespace kvbridge::tcp::wire {

// Magics, chosen so that the bytes on the wire read "KVBQ" and "KVBR" in a capture.
constexpr uint32_t kRequestMagic = 0x5142564bu;
constexpr uint32_t kResponseMagic = 0x5242564bu;

constexpr size_t kMaxNodeIdBytes = 255;

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

}  // namespace kvbridge::tcp::wire
