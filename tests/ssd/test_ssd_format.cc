// The ssd plugin's on-disk format (plugins/storage_ssd/ssd_format.cc, compiled into this test):
// CRC-32C against the standard and the portable code, and every decoder refusing what it must.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ssd_format.h"

namespace kvbridge::ssd {
namespace {

TEST(SsdFormat, Crc32cIsTheCastagnoliCrc) {
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xe3069283u);  // the standard check value
  EXPECT_EQ(Crc32cSlow(0, "123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32c(0, "", 0), 0u);
  // Every length around the 3 KiB blocks of the interleaved code, every split point: the fast
  // code and the portable code agree, and extending equals one pass.
  std::mt19937 rng(1);
  std::vector<uint8_t> buf(20000);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t n : {1ul, 7ul, 8ul, 3071ul, 3072ul, 3073ul, 6144ul, 9999ul, 20000ul}) {
    SCOPED_TRACE(n);
    const uint32_t whole = Crc32c(0, buf.data(), n);
    EXPECT_EQ(whole, Crc32cSlow(0, buf.data(), n));
    for (size_t cut : {size_t{0}, n / 3, n / 2, n - 1}) {
      EXPECT_EQ(Crc32c(Crc32c(0, buf.data(), cut), buf.data() + cut, n - cut), whole);
    }
  }
}

TEST(SsdFormat, HeaderChecksAndPlace) {
  RecordHeader h;
  h.key_len = 3;
  h.data_len = 10000;
  h.seq = 7;
  h.bucket_id = 5;
  h.offset = 8192;
  SealHeader(&h);
  uint8_t raw[64];
  std::memcpy(raw, &h, sizeof(h));
  RecordHeader out;
  std::string why;
  ASSERT_TRUE(ParseHeader(raw, 5, 8192, 1 << 20, &out, &why)) << why;
  EXPECT_EQ(out.seq, 7u);
  EXPECT_FALSE(ParseHeader(raw, 6, 8192, 1 << 20, &out, &why)) << "another bucket";
  EXPECT_NE(why.find("another place"), std::string::npos) << why;
  EXPECT_FALSE(ParseHeader(raw, 5, 4096, 1 << 20, &out, &why)) << "another offset";
  EXPECT_FALSE(ParseHeader(raw, 5, 8192, 16384, &out, &why)) << "runs past the file";
  EXPECT_NE(why.find("past the end"), std::string::npos) << why;
  raw[20] ^= 1;
  EXPECT_FALSE(ParseHeader(raw, 5, 8192, 1 << 20, &out, &why));
  EXPECT_NE(why.find("header checksum"), std::string::npos) << why;
  std::memset(raw, 0, sizeof(raw));
  EXPECT_FALSE(ParseHeader(raw, 5, 8192, 1 << 20, &out, &why));
  EXPECT_EQ(RecordBytes(3, 0, 10000), 12288u);
  EXPECT_EQ(RecordBytes(1, 0, 4096 - 64 - 1 - 4), 4096u);
  EXPECT_EQ(RecordBytes(1, 0, 4096 - 64 - 1 - 3), 8192u) << "the CRC needs its 4 bytes";
}

TEST(SsdFormat, FooterRoundTripsAndRefusesDamage) {
  std::vector<IndexEntry> entries = {{0, 8192, 5000, 1, "alpha", "m1"},
                                     {8192, 4096, 10, 2, std::string("b\0c", 3), ""},
                                     {12288, 1 << 20, (1 << 20) - 200, 9, "gamma", "meta"}};
  std::vector<uint8_t> f;
  EncodeFooter(42, entries, &f);
  ASSERT_EQ(f.size() % 4096, 0u);
  const uint64_t data_end = 12288 + (1 << 20);
  std::string why;
  EXPECT_EQ(FooterBytesFromTrailer(f.data() + f.size() - 4096, 42, &why), f.size()) << why;
  EXPECT_EQ(FooterBytesFromTrailer(f.data() + f.size() - 4096, 43, &why), 0u) << "other bucket";
  std::vector<IndexEntry> out;
  ASSERT_TRUE(DecodeFooter(f.data(), f.size(), data_end, &out, &why)) << why;
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[1].key, std::string("b\0c", 3));
  EXPECT_EQ(out[2].meta, "meta");
  EXPECT_EQ(out[2].seq, 9u);
  EXPECT_FALSE(DecodeFooter(f.data(), f.size(), data_end - 4096, &out, &why))
      << "an entry past the data end";
  for (size_t at : {size_t{0}, size_t{45}, f.size() - 5}) {
    std::vector<uint8_t> bad = f;
    bad[at] ^= 0x10;
    EXPECT_FALSE(DecodeFooter(bad.data(), bad.size(), data_end, &out, &why)) << at;
    EXPECT_NE(why.find("checksum mismatch"), std::string::npos) << why;
  }
}

TEST(SsdFormat, JournalEntriesAndBucketNames) {
  uint8_t slot[kJournalEntryBytes];
  EncodeJournalEntry({3, 4096, 77}, slot);
  JournalEntry e;
  ASSERT_TRUE(DecodeJournalEntry(slot, &e));
  EXPECT_EQ(e.bucket_id, 3u);
  EXPECT_EQ(e.offset, 4096u);
  EXPECT_EQ(e.seq, 77u);
  for (size_t i = 0; i < kJournalEntryBytes; ++i) {
    uint8_t bad[kJournalEntryBytes];
    std::memcpy(bad, slot, sizeof(bad));
    bad[i] ^= 0x01;
    EXPECT_FALSE(DecodeJournalEntry(bad, &e)) << "byte " << i;
  }
  uint8_t zeros[kJournalEntryBytes] = {};
  EXPECT_FALSE(DecodeJournalEntry(zeros, &e));

  EXPECT_EQ(BucketFileName(42), "bucket-000000000000002a.kvb");
  uint64_t id = 0;
  EXPECT_TRUE(ParseBucketFileName("bucket-000000000000002a.kvb", &id));
  EXPECT_EQ(id, 42u);
  for (const char* bad : {"bucket-2a.kvb", "bucket-000000000000002A.kvb",
                          "bucket-000000000000002a.kvb.tmp", "LOCK", "removed.log"}) {
    EXPECT_FALSE(ParseBucketFileName(bad, &id)) << bad;
  }
}

}  // namespace
}  // namespace kvbridge::ssd
