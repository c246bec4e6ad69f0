// One record's bytes on their way to and from a bucket file: RecordWriter produces them for
// IoEngine::Write (header, key, metadata, the caller's iovecs, the CRC, zeros), RecordChecker
// checks them as IoEngine::Read hands them over (header, key, CRC) and copies the data out.
// Plus the small buffers both need. See README.md "On disk" for the layout.
//
// Thread-safety: none of these objects is shared; each serves one operation.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/plugin/storage.h"
#include "ssd_format.h"
#include "ssd_io.h"

namespace kvbridge::ssd {

// A 4 KiB-aligned heap buffer, as O_DIRECT needs.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(uint64_t n)
      : p_(static_cast<uint8_t*>(std::aligned_alloc(kBlockBytes, AlignUp(n)))) {
    if (p_ == nullptr) throw std::bad_alloc();
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data() const { return p_; }

 private:
  uint8_t* p_;
};

// Writes consecutive bytes into a caller's iovecs; what does not fit is dropped.
class IovCursor {
 public:
  IovCursor(const kvb_iovec_t* iov, uint32_t n) : iov_(iov), n_(n) {}
  void Write(const uint8_t* src, uint64_t len);

 private:
  const kvb_iovec_t* iov_;
  uint32_t n_;
  uint32_t i_ = 0;
  uint64_t off_ = 0;
};

// The bytes of one record, produced chunk by chunk: the header (sealed by the caller), key,
// metadata, the caller's iovecs, the CRC-32C of all of them, zeros to the 4 KiB boundary.
class RecordWriter final : public WriteSource {
 public:
  RecordWriter(const RecordHeader& h, std::string_view key, std::string_view meta,
               const kvb_iovec_t* iov, uint32_t iov_count);
  void Fill(uint8_t* dst, uint64_t n) override;

 private:
  struct Part {
    const uint8_t* ptr;
    uint64_t len;
  };
  RecordHeader header_;
  std::vector<Part> parts_;
  size_t part_ = 0;
  uint64_t pos_ = 0;
  uint32_t crc_ = 0;
  uint8_t trailer_[kRecordTrailerBytes] = {};
  uint64_t trailer_pos_ = 0;
};

// Writes a prepared buffer (a bucket index).
class BufferSource final : public WriteSource {
 public:
  explicit BufferSource(const std::vector<uint8_t>& b) : b_(b) {}
  void Fill(uint8_t* dst, uint64_t n) override {
    std::memcpy(dst, b_.data() + pos_, n);
    pos_ += n;
  }

 private:
  const std::vector<uint8_t>& b_;
  uint64_t pos_ = 0;
};

// Checks one record as its bytes arrive in order: the header (against what the index says, for
// a get), the key, and, in Verify, the CRC. Copies the data to `out` when given; keeps the key
// and metadata for a recovery scan (which expects nothing in particular).
class RecordChecker final : public ReadSink {
 public:
  struct Expect {
    bool known = false;  // false: a recovery scan; any valid record is welcome
    std::string_view key;
    uint64_t seq = 0, data_len = 0;
    uint32_t meta_len = 0;
  };

  RecordChecker(uint64_t bucket_id, uint64_t offset, uint64_t file_bytes, Expect expect,
                IovCursor* out)
      : bucket_id_(bucket_id),
        offset_(offset),
        file_bytes_(file_bytes),
        expect_(expect),
        out_(out) {}

  // False stops the read: the header or the key is not what it must be (see why()).
  bool Consume(const uint8_t* src, uint64_t n) override;
  // After the whole record went through Consume: true when its CRC matches.
  bool Verify();

  const RecordHeader& header() const { return h_; }
  std::string& key() { return key_; }
  std::string& meta() { return meta_; }
  const std::string& why() const { return why_; }

 private:
  bool Fail(const char* why) {
    why_ = why;
    return false;
  }

  const uint64_t bucket_id_, offset_, file_bytes_;
  const Expect expect_;
  IovCursor* out_;
  RecordHeader h_;
  uint64_t pos_ = 0, key_off_ = 0, meta_off_ = 0, data_off_ = 0, body_end_ = 0;
  uint32_t crc_ = 0;
  uint8_t trailer_[kRecordTrailerBytes] = {};
  std::string key_, meta_, why_;
};

}  // namespace kvbridge::ssd
