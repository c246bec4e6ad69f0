// CRC-32C (Castagnoli), the one checksum of kvbridge (descriptors now, stored objects later).
// Thread-safe (the table is built once, on first use).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvbridge::util {

// Extends `crc` (0 to start) over [data, data+len). The fastest way this CPU has, picked once:
// carry-less multiplication on 512-bit registers (AVX-512 VPCLMULQDQ) from 512 bytes, else
// the CRC32 instruction (SSE4.2) on three streams at once, else a table; all give the same
// value.
uint32_t Crc32c(const void* data, size_t len, uint32_t crc = 0);
// Which of those Crc32c uses here: "vpclmulqdq", "sse4.2" or "table" (benchmarks say it).
const char* Crc32cImplementation();
// The CRC-32C of A||B from crc_a = Crc32c(A) and crc_b = Crc32c(B), given only |B|: what lets
// pieces of one buffer be checksummed apart (on several threads) and joined. About 30
// carry-less multiplications of 32 bits, whatever the length.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
// The table version alone, so tests can check the two agree.
uint32_t Crc32cPortableForTest(const void* data, size_t len, uint32_t crc = 0);
// Every implementation this CPU can run, by name, and one of them called directly (0 for a
// name not among them), so that tests check each against the table.
std::vector<std::string> Crc32cImplementationsForTest();
uint32_t Crc32cWithForTest(const std::string& implementation, const void* data, size_t len,
                           uint32_t crc = 0);

}  // namespace kvbridge::util
