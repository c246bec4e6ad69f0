// Descriptor: what one process publishes so peers can reach it — identity, per-transport
// endpoints and registered segments (with each transport's remote key). Encoded as a compact,
// versioned, checksummed binary blob; decoding checks every length and count, so a corrupt or
// hostile blob is an INVALID_ARGUMENT naming what was wrong, never a crash.
// Plain value types; not synchronized.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/export_internal.h"
#include "kvbridge/status.h"

namespace kvbridge::core {

struct SegmentDesc {
  uint64_t id = 0;
  uint64_t base = 0;  // the registering process's address of byte 0 (version 2; 0 from v1)
  uint64_t length = 0;
  uint32_t mem_kind = 1;                     // kvb_mem_kind_t
  int32_t device_id = -1;                    // KVB_MEM_CUDA: its device (version 3; -1 before)
  std::map<std::string, std::string> rkeys;  // transport name -> remote key bytes
};

struct TransportDesc {
  std::string name;       // "tcp"
  std::string endpoints;  // "10.0.0.1:4000,10.0.1.1:4000"
  uint64_t caps = 0;      // the instance's KVB_TCAP_* (version 3; 0, unknown, before)
};

struct Descriptor {
  std::string node_id;
  uint64_t incarnation = 0;
  // Which processes share this one's machine, shared memory and pid space (HostKey(),
  // util/host_key.h); empty when unknown or from a version 1/2 blob: never the same host.
  std::string host_key;
  std::vector<TransportDesc> transports;
  std::vector<SegmentDesc> segments;
  bool sealed = false;  // decoded: the blob carried a seal (checked when a token was given)
};

// Limits enforced by Decode (and asserted by Encode's callers).
inline constexpr size_t kMaxDescriptorString = 4096;
inline constexpr size_t kMaxDescriptorRkey = 4096;
inline constexpr uint32_t kMaxDescriptorTransports = 32;
inline constexpr uint32_t kMaxDescriptorSegments = 1u << 16;

// Version 3. With a non-empty cluster token the blob is sealed: an HMAC-SHA256 of its body under
// the token, so a peer holding the token knows a token holder wrote every endpoint, segment
// address and remote key in it.
KVBRIDGE_INTERNAL_API std::string EncodeDescriptor(const Descriptor& d,
                                                   std::string_view cluster_token = {});

// Reads versions 1 to 3. With a non-empty cluster token the blob must be sealed under that
// token (UNAUTHENTICATED otherwise: unsealed, or sealed under another token); without one a
// seal is not checked (there is nothing to check it with).
KVBRIDGE_INTERNAL_API Result<Descriptor> DecodeDescriptor(std::string_view blob,
                                                          std::string_view cluster_token = {});

}  // namespace kvbridge::core
