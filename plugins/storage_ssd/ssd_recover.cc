#include <dirent.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <set>
#include <unordered_map>
#include <utility>

#include "ssd_store.h"

// SsdStore::Recover: rebuilding the index from the files in the directory at create. See
// README.md "Recovery".
namespace kvbridge::ssd {

namespace {

// What recovery learned about one bucket file.
struct BucketScan {
  uint64_t id = 0;
  std::string name;
  uint64_t data_end = 0;      // records end here (the footer starts here when there is one)
  uint64_t footer_bytes = 0;  // a valid footer; 0: the records were scanned
  std::vector<IndexEntry> entries;
  bool scanned = false;     // no valid footer: every record was read and checked
  std::string scan_reason;  // why there was no valid footer
  uint64_t dropped = 0;     // records found but not valid
  std::string first_problem;
  int read_errno = 0;  // the file could not be read: leave it alone
};

void NoteProblem(BucketScan* s, uint64_t offset, const std::string& why) {
  if (s->first_problem.empty()) s->first_problem = why + " at offset " + std::to_string(offset);
}

// Reads the footer if it is valid, else walks the records from the start.
void ScanBucket(int fd, BucketScan* s, uint64_t chunk_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    s->read_errno = errno;
    return;
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  AlignedBuffer block(kBlockBytes);
  std::string footer_problem = "its length is not a multiple of 4096 (cut short?)";
  if (size == 0) footer_problem = "empty (not sealed)";
  if (size >= kBlockBytes && size % kBlockBytes == 0) {
    if (int rc = ReadExact(fd, block.data(), kBlockBytes, size - kBlockBytes); rc != 0) {
      s->read_errno = -rc;
      return;
    }
    const uint64_t fb = FooterBytesFromTrailer(block.data(), s->id, &footer_problem);
    if (fb > size) {
      footer_problem = "bucket index is longer than the file";
    } else if (fb != 0) {
      AlignedBuffer footer(fb);
      if (int rc = ReadExact(fd, footer.data(), fb, size - fb); rc != 0) {
        s->read_errno = -rc;
        return;
      }
      if (DecodeFooter(footer.data(), fb, size - fb, &s->entries, &footer_problem)) {
        s->data_end = size - fb;
        s->footer_bytes = fb;
        return;
      }
      s->entries.clear();
    }
  }
  s->scanned = true;
  s->scan_reason = footer_problem;
  // No valid footer: the bucket was being written when the process stopped, or is damaged.
  AlignedBuffer buf(chunk_bytes);
  uint64_t off = 0;
  while (off + kBlockBytes <= size) {
    if (int rc = ReadExact(fd, block.data(), kBlockBytes, off); rc != 0) {
      s->read_errno = -rc;
      return;
    }
    RecordHeader h;
    std::string why;
    if (!ParseHeader(block.data(), s->id, off, size, &h, &why)) {
      if (std::any_of(block.data(), block.data() + kBlockBytes, [](uint8_t b) { return b != 0; })) {
        NoteProblem(s, off, why);
      }
      off += kBlockBytes;  // zeros (a hole, a removed record) or damage: look at the next block
      continue;
    }
    const uint64_t rb = RecordBytes(h.key_len, h.meta_len, h.data_len);
    RecordChecker check(s->id, off, size, {}, nullptr);
    bool ok = true;
    for (uint64_t pos = 0; pos < rb && ok;) {
      const uint64_t n = std::min(chunk_bytes, rb - pos);
      if (int rc = ReadExact(fd, buf.data(), n, off + pos); rc != 0) {
        s->read_errno = -rc;
        return;
      }
      ok = check.Consume(buf.data(), n);
      pos += n;
    }
    if (ok && check.Verify()) {
      IndexEntry e;
      e.offset = off;
      e.record_bytes = rb;
      e.data_len = h.data_len;
      e.seq = h.seq;
      e.key = std::move(check.key());
      e.meta = std::move(check.meta());
      s->entries.push_back(std::move(e));
    } else {
      ++s->dropped;
      NoteProblem(s, off, "record " + KeyForLog(check.key()) + " dropped: " + check.why());
    }
    off += rb;
  }
  s->data_end = AlignUp(size);
}

}  // namespace

kvb_status_t SsdStore::Recover(std::string* err) {
  journal_ = std::make_unique<Journal>(dir_fd_, config_.test_sync_delay_ms);
  std::vector<JournalEntry> journal;
  uint64_t torn_slots = 0;
  if (int rc = journal_->Load(&journal, &torn_slots); rc != 0) {
    *err = "ssd: cannot read " + dir_ + "/" + Journal::kFileName + ": " + Err(-rc);
    return rc == -EROFS || rc == -EACCES ? KVB_ERR_UNAVAILABLE : KVB_ERR_IO;
  }
  if (torn_slots != 0) {
    Log(KVB_LOG_WARN, dir_ + "/" + Journal::kFileName + ": ignored " + std::to_string(torn_slots) +
                          " torn entries (removes that never returned)");
  }
  std::map<std::pair<uint64_t, uint64_t>, std::set<uint64_t>> killed;  // (bucket, offset) -> seqs
  uint64_t max_seq = 0, max_id = 0;
  for (const JournalEntry& e : journal) {
    killed[{e.bucket_id, e.offset}].insert(e.seq);
    max_seq = std::max(max_seq, e.seq);
    max_id = std::max(max_id, e.bucket_id);
  }

  std::vector<BucketScan> scans;
  const int list_fd = dup(dir_fd_);
  DIR* d = list_fd >= 0 ? fdopendir(list_fd) : nullptr;
  if (d == nullptr) {
    *err = "ssd: cannot list " + dir_ + ": " + Err(errno);
    if (list_fd >= 0) close(list_fd);
    return KVB_ERR_IO;
  }
  while (struct dirent* de = readdir(d)) {
    uint64_t id = 0;
    if (ParseBucketFileName(de->d_name, &id)) {
      BucketScan s;
      s.id = id;
      s.name = de->d_name;
      scans.push_back(std::move(s));
    }
  }
  closedir(d);
  std::sort(scans.begin(), scans.end(),
            [](const BucketScan& a, const BucketScan& b) { return a.id < b.id; });

  for (BucketScan& s : scans) {
    max_id = std::max(max_id, s.id);
    const int fd = openat(dir_fd_, s.name.c_str(), O_RDONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0));
    if (fd < 0) {
      s.read_errno = errno;
    } else {
      ScanBucket(fd, &s, io_->chunk_bytes());
      close(fd);
    }
    for (const IndexEntry& e : s.entries) max_seq = std::max(max_seq, e.seq);
    if (s.read_errno != 0) {
      Log(KVB_LOG_ERROR, dir_ + "/" + s.name + ": cannot read it (" + Err(s.read_errno) +
                             "); its objects are not served and the file is left in place");
    } else if (s.scanned) {
      // Info for the bucket that was being written when the process stopped; damage is a warning.
      const bool damaged = s.dropped != 0 || !s.first_problem.empty() ||
                           s.scan_reason.find("not sealed") == std::string::npos;
      Log(damaged ? KVB_LOG_WARN : KVB_LOG_INFO,
          dir_ + "/" + s.name + ": " + s.scan_reason +
              "; scanned the records instead: " + std::to_string(s.entries.size()) + " kept, " +
              std::to_string(s.dropped) + " damaged records dropped" +
              (s.first_problem.empty() ? "" : " (first problem: " + s.first_problem + ")"));
      dropped_corrupt_ += s.dropped;
    }
  }
  next_seq_ = max_seq + 1;
  next_bucket_id_ = max_id + 1;

  // The newest record of each key wins; records a journal entry killed are dead.
  struct Pick {
    size_t scan, entry;
    uint64_t seq;
  };
  std::unordered_map<std::string, Pick> best;
  std::vector<JournalEntry> new_kills;  // older copies of a key: kill them so none comes back
  for (size_t i = 0; i < scans.size(); ++i) {
    if (scans[i].read_errno != 0) continue;
    for (size_t j = 0; j < scans[i].entries.size(); ++j) {
      const IndexEntry& e = scans[i].entries[j];
      auto k = killed.find({scans[i].id, e.offset});
      if (k != killed.end() && k->second.count(e.seq) != 0) continue;
      auto [it, inserted] = best.try_emplace(e.key, Pick{i, j, e.seq});
      if (inserted) continue;
      const Pick older = e.seq > it->second.seq ? it->second : Pick{i, j, e.seq};
      if (e.seq > it->second.seq) it->second = Pick{i, j, e.seq};
      const IndexEntry& o = scans[older.scan].entries[older.entry];
      new_kills.push_back({scans[older.scan].id, o.offset, o.seq});
    }
  }
  std::vector<std::vector<bool>> keep(scans.size());
  for (size_t i = 0; i < scans.size(); ++i) keep[i].assign(scans[i].entries.size(), false);
  for (const auto& [key, p] : best) keep[p.scan][p.entry] = true;

  // Build the buckets. Every recovered bucket is read-only from now on; new records go to new
  // buckets. Dead records and damaged ranges give their blocks back.
  std::vector<std::string> empty_files;
  std::vector<std::shared_ptr<Bucket>> to_reseal;
  std::set<uint64_t> live_ids;
  for (size_t i = 0; i < scans.size(); ++i) {
    BucketScan& s = scans[i];
    if (s.read_errno != 0) continue;
    auto b = std::make_shared<Bucket>(s.id, s.name);
    b->state = Bucket::State::kSealed;
    b->alloc_end = s.data_end;
    b->footer_bytes = s.footer_bytes;
    std::vector<std::pair<uint64_t, uint64_t>> dead;  // ranges between live records
    uint64_t cursor = 0;
    for (size_t j = 0; j < s.entries.size(); ++j) {
      if (!keep[i][j]) continue;
      IndexEntry& e = s.entries[j];
      if (e.offset > cursor) dead.emplace_back(cursor, e.offset - cursor);
      cursor = e.offset + e.record_bytes;
      b->live[e.offset] = e.key;
      b->footer_entry_bytes += FooterEntryBytes(e.key.size(), e.meta.size());
      Entry entry;
      entry.bucket = b;
      entry.offset = e.offset;
      entry.record_bytes = e.record_bytes;
      entry.data_len = e.data_len;
      entry.seq = e.seq;
      entry.meta = std::move(e.meta);
      entry.pending = false;
      index_.emplace(std::move(e.key), std::move(entry));
      ++object_count_;
    }
    if (b->live.empty()) {
      empty_files.push_back(s.name);
      continue;
    }
    if (s.data_end > cursor) dead.emplace_back(cursor, s.data_end - cursor);
    uint64_t live_bytes = 0;
    for (const auto& [off, key] : b->live) live_bytes += index_.at(key).record_bytes;
    b->reclaimed = b->alloc_end - live_bytes;
    // Dead ranges were punched when they died, unless the process stopped first: punch again
    // (a no-op on holes). Without hole punching they keep their blocks until the bucket goes.
    if (!dead.empty()) {
      const int fd = openat(dir_fd_, s.name.c_str(), O_RDWR | O_CLOEXEC);
      bool punched = fd >= 0;
      for (const auto& [off, len] : dead) {
        if (punched && fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                 static_cast<off_t>(off), static_cast<off_t>(len)) != 0) {
          punched = false;
        }
      }
      if (fd >= 0) close(fd);
      if (!punched) b->reclaimed = 0;
    }
    if (s.footer_bytes == 0) to_reseal.push_back(b);
    buckets_[b->id] = b;
    live_ids.insert(b->id);
  }
  for (const std::string& name : empty_files) {
    if (unlinkat(dir_fd_, name.c_str(), 0) != 0) {
      Log(KVB_LOG_WARN, "cannot remove " + dir_ + "/" + name + " (no live objects): " + Err(errno));
    }
  }
  if (!empty_files.empty()) fsync(dir_fd_);

  // A scanned bucket gets its index now, so the next start reads it instead of scanning.
  for (const auto& b : to_reseal) {
    std::vector<IndexEntry> entries;
    for (const auto& [off, key] : b->live) {
      const Entry& e = index_.at(key);
      entries.push_back({off, e.record_bytes, e.data_len, e.seq, key, e.meta});
    }
    std::vector<uint8_t> footer;
    EncodeFooter(b->id, entries, &footer);
    const int fd = openat(dir_fd_, b->name.c_str(), O_RDWR | O_CLOEXEC | (direct_ ? O_DIRECT : 0));
    int rc = fd < 0 ? -errno : 0;
    if (rc == 0) {
      BufferSource src(footer);
      rc = io_->Write(fd, b->alloc_end, footer.size(), &src);
      if (rc == 0 && fdatasync(fd) != 0) rc = -errno;
      close(fd);
    }
    if (rc == 0) {
      b->footer_bytes = footer.size();
    } else {
      Log(KVB_LOG_WARN, dir_ + "/" + b->name + ": cannot write its index (" + Err(-rc) +
                            "); the next start scans it again");
    }
  }

  // The journal keeps what still matters: entries of buckets that exist, and the new kills.
  std::vector<JournalEntry> kept;
  for (const JournalEntry& e : journal) {
    if (live_ids.count(e.bucket_id) != 0) kept.push_back(e);
  }
  kept.insert(kept.end(), new_kills.begin(), new_kills.end());
  for (const JournalEntry& e : kept) {
    if (auto it = buckets_.find(e.bucket_id); it != buckets_.end()) it->second->kills.push_back(e);
  }
  if (kept.size() != journal.size() || torn_slots != 0) {
    if (int rc = journal_->Rewrite([&] { return kept; }); rc != 0) {
      // The old journal is still whole (a rewrite only replaces it once complete); a full disk
      // must not keep the plugin from starting. The new kills go in its preallocated room.
      Log(KVB_LOG_WARN, "cannot rewrite " + dir_ + "/" + Journal::kFileName + " (" + Err(-rc) +
                            "); keeping it as it is");
      for (const JournalEntry& e : new_kills) {
        if (int arc = journal_->Append(e); arc != 0) {
          Log(KVB_LOG_WARN, "cannot record an older copy as dead (" + Err(-arc) +
                                "); it is resolved again at the next start");
          break;
        }
      }
    }
  }
  for (const auto& [id, b] : buckets_) used_bytes_ += FootprintOf(*b);
  if (used_bytes_ > capacity_) {
    Log(KVB_LOG_WARN,
        dir_ + ": the objects found take " + Bytes(used_bytes_) + ", more than the capacity of " +
            Bytes(capacity_) +
            (on_evict_ != nullptr ? "; puts evict buckets until it fits"
                                  : "; puts fail with NO_SPACE until removes make room"));
  }
  return KVB_OK;
}

}  // namespace kvbridge::ssd
