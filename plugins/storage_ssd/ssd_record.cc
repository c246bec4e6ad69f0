#include "ssd_record.h"

#include <algorithm>

namespace kvbridge::ssd {

void IovCursor::Write(const uint8_t* src, uint64_t len) {
  while (len > 0 && i_ < n_) {
    const uint64_t room = iov_[i_].length - off_;
    if (room == 0) {
      ++i_;
      off_ = 0;
      continue;
    }
    const uint64_t k = std::min(room, len);
    std::memcpy(static_cast<uint8_t*>(iov_[i_].base) + off_, src, k);
    src += k;
    len -= k;
    off_ += k;
  }
}

RecordWriter::RecordWriter(const RecordHeader& h, std::string_view key, std::string_view meta,
                           const kvb_iovec_t* iov, uint32_t iov_count)
    : header_(h) {
  parts_.push_back({reinterpret_cast<const uint8_t*>(&header_), sizeof(header_)});
  parts_.push_back({reinterpret_cast<const uint8_t*>(key.data()), key.size()});
  if (!meta.empty()) {
    parts_.push_back({reinterpret_cast<const uint8_t*>(meta.data()), meta.size()});
  }
  for (uint32_t i = 0; i < iov_count; ++i) {
    if (iov[i].length != 0) {
      parts_.push_back({static_cast<const uint8_t*>(iov[i].base), iov[i].length});
    }
  }
}

void RecordWriter::Fill(uint8_t* dst, uint64_t n) {
  while (n > 0) {
    if (part_ < parts_.size()) {
      // The CRC is taken over the staging copy, which is what goes to the disk.
      const Part& p = parts_[part_];
      const uint64_t k = std::min(n, p.len - pos_);
      std::memcpy(dst, p.ptr + pos_, k);
      crc_ = Crc32c(crc_, dst, k);
      dst += k;
      n -= k;
      pos_ += k;
      if (pos_ == p.len) {
        ++part_;
        pos_ = 0;
        if (part_ == parts_.size()) std::memcpy(trailer_, &crc_, sizeof(trailer_));
      }
    } else if (trailer_pos_ < sizeof(trailer_)) {
      const uint64_t k = std::min<uint64_t>(n, sizeof(trailer_) - trailer_pos_);
      std::memcpy(dst, trailer_ + trailer_pos_, k);
      dst += k;
      n -= k;
      trailer_pos_ += k;
    } else {
      std::memset(dst, 0, n);
      return;
    }
  }
}

bool RecordChecker::Consume(const uint8_t* src, uint64_t n) {
  if (pos_ == 0) {
    if (n < kRecordHeaderBytes) return Fail("short read of the record header");
    if (!ParseHeader(src, bucket_id_, offset_, file_bytes_, &h_, &why_)) return false;
    if (expect_.known && (h_.seq != expect_.seq || h_.key_len != expect_.key.size() ||
                          h_.meta_len != expect_.meta_len || h_.data_len != expect_.data_len)) {
      return Fail("record header does not match the index");
    }
    key_off_ = kRecordHeaderBytes;
    meta_off_ = key_off_ + h_.key_len;
    data_off_ = meta_off_ + h_.meta_len;
    body_end_ = data_off_ + h_.data_len;
  }
  const uint64_t start = pos_, end = pos_ + n;
  pos_ = end;
  // [lo, hi): the part of [a, b) (record offsets) that this piece holds.
  uint64_t lo, hi;
  auto overlap = [&](uint64_t a, uint64_t b) {
    lo = std::max(a, start);
    hi = std::min(b, end);
    return lo < hi;
  };
  if (overlap(0, body_end_)) crc_ = Crc32c(crc_, src + (lo - start), hi - lo);
  if (overlap(key_off_, meta_off_)) {
    const auto* p = reinterpret_cast<const char*>(src + (lo - start));
    if (expect_.known) {
      if (std::memcmp(p, expect_.key.data() + (lo - key_off_), hi - lo) != 0) {
        return Fail("record holds another key");
      }
    } else {
      key_.append(p, hi - lo);
    }
  }
  if (!expect_.known && overlap(meta_off_, data_off_)) {
    meta_.append(reinterpret_cast<const char*>(src + (lo - start)), hi - lo);
  }
  if (out_ != nullptr && overlap(data_off_, body_end_)) out_->Write(src + (lo - start), hi - lo);
  if (overlap(body_end_, body_end_ + kRecordTrailerBytes)) {
    std::memcpy(trailer_ + (lo - body_end_), src + (lo - start), hi - lo);
  }
  return true;
}

bool RecordChecker::Verify() {
  if (!why_.empty()) return false;
  if (pos_ < body_end_ + kRecordTrailerBytes) return Fail("record is cut short");
  uint32_t stored;
  std::memcpy(&stored, trailer_, sizeof(stored));
  if (stored != crc_) return Fail("checksum mismatch");
  return true;
}

}  // namespace kvbridge::ssd
