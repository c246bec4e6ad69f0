// CRC-32C (Castagnoli), the one checksum of kvbridge (descriptors now, stored objects later).
// Thread-safe (the table is built once, on first use).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvbridge::util {

// Extends `crc` (0 to start) over [data, data+len). Uses the CPU's CRC-32C instruction when
// it has one (SSE4.2), a table otherwise; both give the same value.
uint32_t Crc32c(const void* data, size_t len, uint32_t crc = 0);
// The table version alone, so tests can check the two agree.
uint32_t Crc32cPortableForTest(const void* data, size_t len, uint32_t crc = 0);

}  // namespace kvbridge::util
