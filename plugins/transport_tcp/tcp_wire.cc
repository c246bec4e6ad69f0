#include "tcp_wire.h"

#include <cstring>

#include "util/little_endian.h"

namespace kvbridge::tcp::wire {

void EncodeRequestHeader(const RequestHeader& h, uint8_t out[kRequestHeaderBytes]) {
  util::PutLe32(out, h.magic);
  util::PutLe16(out + 4, h.opcode);
  util::PutLe16(out + 6, h.flags);
  util::PutLe64(out + 8, h.request_id);
  util::PutLe64(out + 16, h.segment_id);
  util::PutLe64(out + 24, h.offset);
  util::PutLe64(out + 32, h.length);
}

bool DecodeRequestHeader(const uint8_t* buf, size_t len, RequestHeader* out) {
  if (len < kRequestHeaderBytes) return false;
  out->magic = util::GetLe32(buf);
  out->opcode = util::GetLe16(buf + 4);
  out->flags = util::GetLe16(buf + 6);
  out->request_id = util::GetLe64(buf + 8);
  out->segment_id = util::GetLe64(buf + 16);
  out->offset = util::GetLe64(buf + 24);
  out->length = util::GetLe64(buf + 32);
  return true;
}

void EncodeResponseHeader(const ResponseHeader& h, uint8_t out[kResponseHeaderBytes]) {
  util::PutLe32(out, h.magic);
  util::PutLe32(out + 4, static_cast<uint32_t>(h.status));
  util::PutLe64(out + 8, h.request_id);
  util::PutLe64(out + 16, h.length);
}

bool DecodeResponseHeader(const uint8_t* buf, size_t len, ResponseHeader* out) {
  if (len < kResponseHeaderBytes) return false;
  out->magic = util::GetLe32(buf);
  out->status = static_cast<int32_t>(util::GetLe32(buf + 4));
  out->request_id = util::GetLe64(buf + 8);
  out->length = util::GetLe64(buf + 16);
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
