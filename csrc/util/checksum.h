// CRC-32C (Castagnoli), the one checksum of kvbridge (descriptors now, stored objects later).
// Thread-safe (the table is built once, on first use).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvbridge::util {

// Extends `crc` (0 to start) over [data, data+len). Uses the CPU's CRC-32C instruction when
// it has one (SSE4.2), a table otherwise; both give the same value.
uint32_t Crc32c(const void* data, size_t len, uint32_t crc = 0);
// The CRC-32C of A||B from crc_a = Crc32c(A) and crc_b = Crc32c(B), given only |B|: what lets
// pieces of one buffer be checksummed apart (on several threads) and joined. About 30
// carry-less multiplications of 32 bits, whatever the length.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
// The table version alone, so tests can check the two agree.
uint32_t Crc32cPortableForTest(const void* data, size_t len, uint32_t crc = 0);

}  // namespace kvbridge::util
