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
// Where CopyCrc32c's stores go. kStreaming bypasses the cache (non-temporal stores, where the
// CPU's fused copy has them): about 1.5x faster for copies that do not fit in the cache anyway
// (a batch of many 64 KiB objects), slower for small ones and for a copy read right after.
enum class CopyStores { kCached, kStreaming };
// memcpy(dst, src, len) and Crc32c(dst, len, crc) of the bytes copied, in one pass where the
// CPU allows (AVX-512 VPCLMULQDQ: each 256 bytes loaded once, stored and folded from the same
// registers, so the CRC is the one of exactly the bytes written); elsewhere the copy and then
// the CRC, 64 KiB at a time from the cache. dst and src must not overlap.
uint32_t CopyCrc32c(void* dst, const void* src, size_t len, uint32_t crc = 0,
                    CopyStores stores = CopyStores::kCached);
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
uint32_t CopyCrc32cWithForTest(const std::string& implementation, void* dst, const void* src,
                               size_t len, uint32_t crc, CopyStores stores);

}  // namespace kvbridge::util
