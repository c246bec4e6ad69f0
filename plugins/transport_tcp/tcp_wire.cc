#include "tcp_wire.h"

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

}  // namespace

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

}  // namespace kvbridge::tcp::wire
