// The ssd plugin's on-disk format: CRC-32C, the record header, the bucket index (footer) and the
// removal journal's entries. Pure functions over byte buffers; no I/O. See README.md "On disk".
//
// All integers are little-endian (the plugin builds only on little-endian hosts). Thread-safe:
// nothing here has state, except Crc32c's one-time choice of the SSE4.2 instruction.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "util/checksum.h"

namespace kvbridge::ssd {

static_assert(std::endian::native == std::endian::little, "the ssd format is little-endian");

// Every record, footer and file offset is a multiple of this: the O_DIRECT alignment that every
// file system and device we meet accepts.
inline constexpr uint64_t kBlockBytes = 4096;
inline constexpr uint64_t AlignUp(uint64_t n) { return (n + kBlockBytes - 1) & ~(kBlockBytes - 1); }

inline constexpr uint32_t kMaxKeyBytes = 4096;
inline constexpr uint32_t kMaxMetaBytes = 256;  // KVB_STORAGE_META_MAX

// CRC-32C (Castagnoli), the iSCSI/ext4 polynomial: kvbridge's one checksum (util/checksum.h).
// Extend: Crc32c(Crc32c(0, a), b) is the CRC of a followed by b.
inline uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  return util::Crc32c(data, n, crc);
}
// The same with the portable table code, whatever the CPU offers (for tests).
inline uint32_t Crc32cSlow(uint32_t crc, const void* data, size_t n) {
  return util::Crc32cPortableForTest(data, n, crc);
}

inline constexpr uint32_t kRecordMagic = 0x4f42564b;  // "KVBO"
inline constexpr uint16_t kFormatVersion = 1;

// The first 64 bytes of every record. A record is
//   header | key | meta | data | u32 CRC-32C over (header, key, meta, data) | zeros to 4 KiB
// and starts on a 4 KiB boundary of its bucket file.
struct RecordHeader {
  uint32_t magic = kRecordMagic;
  uint16_t format = kFormatVersion;
  uint16_t header_bytes = 64;
  uint32_t key_len = 0;
  uint32_t meta_len = 0;
  uint64_t data_len = 0;
  uint64_t seq = 0;        // plugin-wide, increasing: the newest record of a key wins
  uint64_t key_hash = 0;   // KeyHash(key)
  uint64_t bucket_id = 0;  // where it was written (a record copied elsewhere is not valid)
  uint64_t offset = 0;     // its offset in that bucket file
  uint32_t reserved = 0;
  uint32_t header_crc = 0;  // CRC-32C of the 60 bytes above, so a scan can trust the lengths
};
static_assert(sizeof(RecordHeader) == 64);
inline constexpr uint64_t kRecordHeaderBytes = sizeof(RecordHeader);
inline constexpr uint64_t kRecordTrailerBytes = 4;

uint64_t KeyHash(std::string_view key);

// On-disk bytes of a record: always a multiple of 4 KiB.
inline uint64_t RecordBytes(uint64_t key_len, uint64_t meta_len, uint64_t data_len) {
  return AlignUp(kRecordHeaderBytes + key_len + meta_len + data_len + kRecordTrailerBytes);
}

// Fills header_crc.
void SealHeader(RecordHeader* h);
// True when `raw` holds a header with the magic, a matching header_crc and sane lengths for a
// record at `offset` of bucket `bucket_id` whose file has `file_bytes` bytes. `why` says what
// failed.
bool ParseHeader(const uint8_t* raw, uint64_t bucket_id, uint64_t offset, uint64_t file_bytes,
                 RecordHeader* out, std::string* why);

// One record as the bucket index lists it (and as recovery finds it).
struct IndexEntry {
  uint64_t offset = 0;
  uint64_t record_bytes = 0;
  uint64_t data_len = 0;
  uint64_t seq = 0;
  std::string key;
  std::string meta;
};

// The bucket index written when a bucket is sealed: the entries, zeros, and a 32-byte trailer
// ending the file. Its length is a multiple of 4 KiB.
inline constexpr uint32_t kFooterMagic = 0x4642564b;  // "KVBF"
inline constexpr uint64_t kFooterTrailerBytes = 32;
inline constexpr uint64_t kFooterEntryFixedBytes = 40;
// Bytes one entry takes in a footer (before the 4 KiB rounding of the whole footer).
inline uint64_t FooterEntryBytes(uint64_t key_len, uint64_t meta_len) {
  return (kFooterEntryFixedBytes + key_len + meta_len + 7) & ~uint64_t{7};
}
// Bytes of a footer whose entries take `entry_bytes` in total; 0 for no entries.
inline uint64_t FooterBytes(uint64_t entry_bytes) {
  return entry_bytes == 0 ? 0 : AlignUp(entry_bytes + kFooterTrailerBytes);
}
// Appends the footer for `entries` to `out` (which the caller then writes at the data end).
void EncodeFooter(uint64_t bucket_id, const std::vector<IndexEntry>& entries,
                  std::vector<uint8_t>* out);
// The trailer at the end of `last_block` (the file's final 4 KiB): the whole footer's length,
// or 0 with a reason when there is no valid trailer.
uint64_t FooterBytesFromTrailer(const uint8_t* last_block, uint64_t bucket_id, std::string* why);
// Decodes a whole footer (`bytes`, `n` bytes) whose records must end by `data_end`.
bool DecodeFooter(const uint8_t* bytes, uint64_t n, uint64_t data_end, std::vector<IndexEntry>* out,
                  std::string* why);

// One entry of the removal journal ("removed.log"): the record (bucket, offset, seq) is dead.
// Fixed 32-byte slots, so a torn slot never hides the ones after it.
inline constexpr uint32_t kJournalMagic = 0x4b52564b;  // "KVRK"
inline constexpr uint64_t kJournalEntryBytes = 32;
struct JournalEntry {
  uint64_t bucket_id = 0;
  uint64_t offset = 0;
  uint64_t seq = 0;
};
void EncodeJournalEntry(const JournalEntry& e, uint8_t out[kJournalEntryBytes]);
bool DecodeJournalEntry(const uint8_t in[kJournalEntryBytes], JournalEntry* out);

// "bucket-000000000000002a.kvb" <-> 42.
std::string BucketFileName(uint64_t id);
bool ParseBucketFileName(std::string_view name, uint64_t* id);

}  // namespace kvbridge::ssd
