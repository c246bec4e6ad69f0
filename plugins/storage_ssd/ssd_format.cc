#include "ssd_format.h"

#include <array>
#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace kvbridge::ssd {
namespace {

void Put32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void Put64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t Get32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

uint64_t KeyHash(std::string_view key) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : key) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

void SealHeader(RecordHeader* h) {
  h->header_crc = Crc32c(0, h, offsetof(RecordHeader, header_crc));
}

bool ParseHeader(const uint8_t* raw, uint64_t bucket_id, uint64_t offset, uint64_t file_bytes,
                 RecordHeader* out, std::string* why) {
  RecordHeader h;
  std::memcpy(&h, raw, sizeof(h));
  if (h.magic != kRecordMagic) {
    *why = "no record header";
    return false;
  }
  if (h.header_crc != Crc32c(0, &h, offsetof(RecordHeader, header_crc))) {
    *why = "record header checksum mismatch";
    return false;
  }
  if (h.format != kFormatVersion || h.header_bytes != kRecordHeaderBytes) {
    *why =
        "record format " + std::to_string(h.format) + " is not " + std::to_string(kFormatVersion);
    return false;
  }
  if (h.bucket_id != bucket_id || h.offset != offset) {
    *why = "record header names another place (bucket " + std::to_string(h.bucket_id) +
           ", offset " + std::to_string(h.offset) + ")";
    return false;
  }
  if (h.key_len == 0 || h.key_len > kMaxKeyBytes || h.meta_len > kMaxMetaBytes ||
      h.data_len > (uint64_t{1} << 48) || h.data_len > file_bytes ||
      RecordBytes(h.key_len, h.meta_len, h.data_len) > file_bytes ||
      offset + RecordBytes(h.key_len, h.meta_len, h.data_len) > file_bytes) {
    *why = "record lengths run past the end of the file";
    return false;
  }
  *out = h;
  return true;
}

// Footer entry: u64 offset, u64 record_bytes, u64 data_len, u64 seq, u32 key_len, u32 meta_len,
// key, meta, zeros to 8. Trailer (the footer's last 32 bytes): u32 magic, u32 entry count,
// u64 footer bytes, u64 bucket id, u32 format, u32 CRC-32C of every footer byte before it.
void EncodeFooter(uint64_t bucket_id, const std::vector<IndexEntry>& entries,
                  std::vector<uint8_t>* out) {
  uint64_t entry_bytes = 0;
  for (const IndexEntry& e : entries) entry_bytes += FooterEntryBytes(e.key.size(), e.meta.size());
  const uint64_t total = FooterBytes(entry_bytes == 0 ? 8 : entry_bytes);
  const size_t start = out->size();
  out->resize(start + total, 0);
  uint8_t* p = out->data() + start;
  for (const IndexEntry& e : entries) {
    Put64(p, e.offset);
    Put64(p + 8, e.record_bytes);
    Put64(p + 16, e.data_len);
    Put64(p + 24, e.seq);
    Put32(p + 32, static_cast<uint32_t>(e.key.size()));
    Put32(p + 36, static_cast<uint32_t>(e.meta.size()));
    std::memcpy(p + kFooterEntryFixedBytes, e.key.data(), e.key.size());
    std::memcpy(p + kFooterEntryFixedBytes + e.key.size(), e.meta.data(), e.meta.size());
    p += FooterEntryBytes(e.key.size(), e.meta.size());
  }
  uint8_t* trailer = out->data() + start + total - kFooterTrailerBytes;
  Put32(trailer, kFooterMagic);
  Put32(trailer + 4, static_cast<uint32_t>(entries.size()));
  Put64(trailer + 8, total);
  Put64(trailer + 16, bucket_id);
  Put32(trailer + 24, kFormatVersion);
  Put32(trailer + 28, Crc32c(0, out->data() + start, total - 4));
}

uint64_t FooterBytesFromTrailer(const uint8_t* last_block, uint64_t bucket_id, std::string* why) {
  const uint8_t* t = last_block + kBlockBytes - kFooterTrailerBytes;
  if (Get32(t) != kFooterMagic) {
    *why = "no bucket index at the end of the file (not sealed)";
    return 0;
  }
  const uint64_t bytes = Get64(t + 8);
  if (Get64(t + 16) != bucket_id || Get32(t + 24) != kFormatVersion || bytes == 0 ||
      bytes % kBlockBytes != 0) {
    *why = "bucket index trailer is malformed";
    return 0;
  }
  return bytes;
}

bool DecodeFooter(const uint8_t* bytes, uint64_t n, uint64_t data_end, std::vector<IndexEntry>* out,
                  std::string* why) {
  const uint8_t* t = bytes + n - kFooterTrailerBytes;
  if (Get32(t + 28) != Crc32c(0, bytes, n - 4)) {
    *why = "bucket index checksum mismatch";
    return false;
  }
  const uint32_t count = Get32(t + 4);
  const uint8_t* p = bytes;
  const uint8_t* end = t;
  out->clear();
  for (uint32_t i = 0; i < count; ++i) {
    if (end - p < static_cast<ptrdiff_t>(kFooterEntryFixedBytes)) {
      *why = "bucket index entries run past its end";
      return false;
    }
    IndexEntry e;
    e.offset = Get64(p);
    e.record_bytes = Get64(p + 8);
    e.data_len = Get64(p + 16);
    e.seq = Get64(p + 24);
    const uint32_t key_len = Get32(p + 32), meta_len = Get32(p + 36);
    if (key_len == 0 || key_len > kMaxKeyBytes || meta_len > kMaxMetaBytes ||
        static_cast<uint64_t>(end - p) < FooterEntryBytes(key_len, meta_len) ||
        e.offset % kBlockBytes != 0 ||
        e.record_bytes != RecordBytes(key_len, meta_len, e.data_len) || e.offset > data_end ||
        e.record_bytes > data_end - e.offset) {
      *why = "bucket index entry " + std::to_string(i) + " is malformed";
      return false;
    }
    e.key.assign(reinterpret_cast<const char*>(p + kFooterEntryFixedBytes), key_len);
    e.meta.assign(reinterpret_cast<const char*>(p + kFooterEntryFixedBytes + key_len), meta_len);
    p += FooterEntryBytes(key_len, meta_len);
    out->push_back(std::move(e));
  }
  return true;
}

void EncodeJournalEntry(const JournalEntry& e, uint8_t out[kJournalEntryBytes]) {
  Put32(out, kJournalMagic);
  Put64(out + 8, e.bucket_id);
  Put64(out + 16, e.offset);
  Put64(out + 24, e.seq);
  Put32(out + 4, Crc32c(Crc32c(0, out, 4), out + 8, 24));
}

bool DecodeJournalEntry(const uint8_t in[kJournalEntryBytes], JournalEntry* out) {
  if (Get32(in) != kJournalMagic) return false;
  if (Get32(in + 4) != Crc32c(Crc32c(0, in, 4), in + 8, 24)) return false;
  out->bucket_id = Get64(in + 8);
  out->offset = Get64(in + 16);
  out->seq = Get64(in + 24);
  return true;
}

std::string BucketFileName(uint64_t id) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "bucket-%016" PRIx64 ".kvb", id);
  return buf;
}

bool ParseBucketFileName(std::string_view name, uint64_t* id) {
  constexpr std::string_view kPrefix = "bucket-", kSuffix = ".kvb";
  if (name.size() != kPrefix.size() + 16 + kSuffix.size() || !name.starts_with(kPrefix) ||
      !name.ends_with(kSuffix)) {
    return false;
  }
  uint64_t v = 0;
  for (char c : name.substr(kPrefix.size(), 16)) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return false;
    }
    v = v << 4 | static_cast<uint64_t>(d);
  }
  *id = v;
  return true;
}

}  // namespace kvbridge::ssd
