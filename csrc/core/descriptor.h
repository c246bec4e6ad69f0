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
  std::map<std::string, std::string> rkeys;  // transport name -> remote key bytes
};

struct TransportDesc {
  std::string name;       // "tcp"
  std::string endpoints;  // "10.0.0.1:4000,10.0.1.1:4000"
};

struct Descriptor {
  std::string node_id;
  uint64_t incarnation = 0;
  std::vector<TransportDesc> transports;
  std::vector<SegmentDesc> segments;
};

// Limits enforced by Decode (and asserted by Encode's callers).
inline constexpr size_t kMaxDescriptorString = 4096;
inline constexpr size_t kMaxDescriptorRkey = 4096;
inline constexpr uint32_t kMaxDescriptorTransports = 32;
inline constexpr uint32_t kMaxDescriptorSegments = 1u << 16;

KVBRIDGE_INTERNAL_API std::string EncodeDescriptor(const Descriptor& d);
KVBRIDGE_INTERNAL_API Result<Descriptor> DecodeDescriptor(std::string_view blob);

}  // namespace kvbridge::core
