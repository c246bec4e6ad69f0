#include "ssd_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <utility>

#include "host_config.h"

namespace kvbridge::ssd {

static_assert(kMaxMetaBytes == KVB_STORAGE_META_MAX);

namespace {

constexpr const char* kName = "ssd";
constexpr const char* kLockFile = "LOCK";
constexpr const char* kJournalFile = Journal::kFileName;
constexpr size_t kMaxOpenFiles = 128;
constexpr uint64_t kMinBucketBytes = kMiB;
constexpr uint64_t kMaxBucketBytes = 1024 * kMiB;
constexpr uint64_t kMinInflightBytes = kMiB;
constexpr uint64_t kMaxInflightBytes = 16 * 1024 * kMiB;
constexpr uint64_t kBucketsPerCapacity = 8;  // a bucket is at most 1/8 of the capacity

using plugin::HostHas;
using plugin::ParseUnsigned;

bool ReadKey(const kvb_host_services_t* host, const char* key, std::string* value, bool* set,
             std::string* err) {
  return plugin::ReadConfigKey(host, kName, key, value, set, err);
}

// Rough size for the log: "61.7 GiB".
std::string About(uint64_t n) {
  char buf[32];
  if (n >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", static_cast<double>(n) / (1ull << 30));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(n) / (1ull << 20));
  }
  return buf;
}

}  // namespace

// --- helpers shared with ssd_recover.cc ---------------------------------------------------

std::string Err(int e) { return std::strerror(e); }

std::string Bytes(uint64_t n) {
  if (n >= (1ull << 30) && n % (1ull << 30) == 0) return std::to_string(n >> 30) + " GiB";
  if (n >= (1ull << 20) && n % (1ull << 20) == 0) return std::to_string(n >> 20) + " MiB";
  if (n >= (1ull << 10) && n % (1ull << 10) == 0) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " bytes";
}

// Keys are bytes: printable ones as they are, the rest as \xNN, long ones cut.
std::string KeyForLog(std::string_view key) {
  static const char* kHex = "0123456789abcdef";
  std::string out = "'";
  for (size_t i = 0; i < key.size() && i < 64; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (key.size() > 64) out += "...";
  return out + "'";
}

kvb_status_t StatusOf(int neg_errno) {
  if (neg_errno == 0) return KVB_OK;
  return neg_errno == -ENOSPC || neg_errno == -EDQUOT ? KVB_ERR_NO_SPACE : KVB_ERR_IO;
}

// --- configuration ------------------------------------------------------------------------

bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err) {
  std::string v;
  bool set = false;
  if (!ReadKey(host, "ssd.bucket_bytes", &v, &set, err)) return false;
  if (set) {
    uint64_t n = 0;
    if (!ParseUnsigned(v, &n) || n < kMinBucketBytes || n > kMaxBucketBytes ||
        n % kBlockBytes != 0) {
      *err =
          "ssd: ssd.bucket_bytes must be a multiple of 4096 from 1 MiB to 1 GiB, not '" + v + "'";
      return false;
    }
    out->bucket_bytes = n;
  }
  if (!ReadKey(host, "ssd.io", &v, &set, err)) return false;
  if (set) {
    if (v == "auto") {
      out->io = IoMode::kAuto;
    } else if (v == "uring") {
      out->io = IoMode::kUring;
    } else if (v == "sync") {
      out->io = IoMode::kSync;
    } else {
      *err = "ssd: ssd.io must be auto, uring or sync, not '" + v + "'";
      return false;
    }
  }
  if (!ReadKey(host, "ssd.test_sync_delay_ms", &v, &set, err)) return false;
  if (set) {
    uint64_t n = 0;
    if (!ParseUnsigned(v, &n) || n > 60000) {
      *err = "ssd: ssd.test_sync_delay_ms must be from 0 to 60000, not '" + v + "'";
      return false;
    }
    out->test_sync_delay_ms = static_cast<uint32_t>(n);
  }
  if (!ReadKey(host, "ssd.max_inflight_bytes", &v, &set, err)) return false;
  if (set) {
    uint64_t n = 0;
    if (!ParseUnsigned(v, &n) || n < kMinInflightBytes || n > kMaxInflightBytes) {
      *err = "ssd: ssd.max_inflight_bytes must be from 1 MiB to 16 GiB, not '" + v + "'";
      return false;
    }
    out->max_inflight_bytes = n;
  }
  return true;
}

// --- create and recovery --------------------------------------------------------------------

SsdStore::SsdStore(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                   const Config& config)
    : host_(host),
      dir_(params->path),
      capacity_(params->capacity_bytes),
      on_evict_(params->struct_size >= offsetof(kvb_storage_params_t, on_evict_user) +
                                           sizeof(params->on_evict_user)
                    ? params->on_evict
                    : nullptr),
      on_evict_user_(on_evict_ != nullptr ? params->on_evict_user : nullptr),
      config_(config) {}

kvb_status_t SsdStore::Create(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                              std::unique_ptr<SsdStore>* out, std::string* err) {
  if (params == nullptr || out == nullptr ||
      params->struct_size < offsetof(kvb_storage_params_t, path) + sizeof(params->path)) {
    *err = "ssd: create needs params (with capacity_bytes and path) and out";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (params->capacity_bytes == 0) {
    *err = "ssd: capacity_bytes must be > 0";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (params->path == nullptr || params->path[0] == '\0') {
    *err = "ssd: params.path must name the directory for the bucket files";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  Config config;
  if (!LoadConfig(host, &config, err)) return KVB_ERR_INVALID_ARGUMENT;
  std::unique_ptr<SsdStore> store(new SsdStore(host, params, config));
  const kvb_status_t st = store->Open(err);
  if (st != KVB_OK) return st;
  *out = std::move(store);
  return KVB_OK;
}

kvb_status_t SsdStore::Open(std::string* err) {
  const auto t0 = std::chrono::steady_clock::now();
  bucket_bytes_ = config_.bucket_bytes;
  const uint64_t most =
      std::max(kMinBucketBytes, capacity_ / kBucketsPerCapacity / kBlockBytes * kBlockBytes);
  if (bucket_bytes_ > most) {
    Log(KVB_LOG_INFO, "ssd.bucket_bytes " + Bytes(bucket_bytes_) + " is more than 1/" +
                          std::to_string(kBucketsPerCapacity) + " of the capacity (" +
                          Bytes(capacity_) + "); using " + Bytes(most) + " buckets");
    bucket_bytes_ = most;
  }
  if (kvb_status_t st = PrepareDirectory(err); st != KVB_OK) return st;

  std::string io_err;
  if (!IoEngine::Create(
          config_.io, config_.max_inflight_bytes,
          [this](int32_t level, const std::string& m) { Log(level, m); }, &io_, &io_err)) {
    *err = "ssd: " + dir_ + ": " + io_err;
    return KVB_ERR_UNAVAILABLE;
  }
  if (!io_->uses_uring() && config_.io == IoMode::kAuto) {
    Log(KVB_LOG_WARN, "using pread/pwrite: " + io_->Describe());
  }
  if (kvb_status_t st = Recover(err); st != KVB_OK) return st;

  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  std::string space;
  struct statvfs vfs;
  if (fstatvfs(dir_fd_, &vfs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    space = ", " + About(free_bytes) + " free on the file system";
    if (free_bytes + used_bytes_ < capacity_) {
      Log(KVB_LOG_WARN, dir_ + ": capacity " + Bytes(capacity_) +
                            " is more than the file system can hold (" + About(free_bytes) +
                            " free + " + Bytes(used_bytes_) +
                            " in use); puts will fail with NO_SPACE when it fills up");
    }
  }
  ready_ = true;
  Log(KVB_LOG_INFO, dir_ + ": " + std::to_string(object_count_) + " objects (" +
                        Bytes(used_bytes_) + " of " + Bytes(capacity_) + ") in " +
                        std::to_string(buckets_.size()) + " buckets, ready in " +
                        std::to_string(ms) + " ms; " + Bytes(bucket_bytes_) + " buckets, " +
                        (direct_ ? "O_DIRECT" : "buffered I/O") + ", " + io_->Describe() +
                        (on_evict_ != nullptr ? ", evicts whole buckets when full"
                                              : ", never evicts (no on_evict)") +
                        space);
  return KVB_OK;
}

kvb_status_t SsdStore::PrepareDirectory(std::string* err) {
  struct stat st;
  if (stat(dir_.c_str(), &st) != 0) {
    if (errno != ENOENT) {
      *err = "ssd: cannot use directory " + dir_ + ": " + Err(errno);
      return KVB_ERR_UNAVAILABLE;
    }
    // Only the last component is created: a mistyped parent should not grow a tree somewhere.
    if (mkdir(dir_.c_str(), 0755) != 0 && errno != EEXIST) {
      const int e = errno;
      *err = e == ENOENT ? "ssd: directory " + dir_ +
                               " does not exist and neither does its parent (only the last "
                               "component is created)"
                         : "ssd: cannot create directory " + dir_ + ": " + Err(e);
      return KVB_ERR_UNAVAILABLE;
    }
    Log(KVB_LOG_INFO, "created directory " + dir_);
  } else if (!S_ISDIR(st.st_mode)) {
    *err = "ssd: " + dir_ + " is not a directory";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  dir_fd_ = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd_ < 0) {
    *err = "ssd: cannot open directory " + dir_ + ": " + Err(errno);
    return KVB_ERR_UNAVAILABLE;
  }
  lock_fd_ = openat(dir_fd_, kLockFile, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) {
    *err = "ssd: directory " + dir_ + " is not writable: " + Err(errno);
    return KVB_ERR_UNAVAILABLE;
  }
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    *err = "ssd: directory " + dir_ + " is in use by another ssd storage instance (" + kLockFile +
           " is locked): " + Err(errno);
    return KVB_ERR_UNAVAILABLE;
  }
  // O_DIRECT where the file system takes it; tmpfs before Linux 6.6 and some FUSE ones do not.
  const int probe = openat(dir_fd_, kLockFile, O_RDWR | O_DIRECT | O_CLOEXEC);
  if (probe >= 0) {
    close(probe);
  } else if (errno == EINVAL) {
    direct_ = false;
    Log(KVB_LOG_WARN, dir_ + ": the file system does not support O_DIRECT (open: " + Err(EINVAL) +
                          "); using buffered I/O, made durable with fdatasync");
  } else {
    *err = "ssd: cannot open files in " + dir_ + " with O_DIRECT: " + Err(errno);
    return KVB_ERR_UNAVAILABLE;
  }
  return KVB_OK;
}

SsdStore::~SsdStore() {
  std::shared_ptr<Bucket> active;
  {
    std::lock_guard<std::mutex> lk(mu_);
    active = std::move(active_);
    if (active != nullptr) Mutate(active.get(), [&] { active->state = Bucket::State::kFull; });
  }
  if (active != nullptr) MaybeSeal(active);
  if (ready_) {
    const IoStats s = io_->stats();
    Log(KVB_LOG_INFO,
        "closing " + dir_ + ": " + std::to_string(puts_) + " puts, " + std::to_string(gets_) +
            " gets, " + std::to_string(removes_) + " removes, " + std::to_string(evicted_buckets_) +
            " buckets evicted, " + std::to_string(dropped_corrupt_) +
            " damaged records dropped; in flight at most " + std::to_string(s.peak_inflight_bytes) +
            " of " + std::to_string(io_->pool_bytes()) + " bytes, " +
            std::to_string(s.buffer_waits) + " waits for a staging buffer");
  }
  index_.clear();
  buckets_.clear();
  journal_.reset();
  io_.reset();
  if (lock_fd_ >= 0) close(lock_fd_);  // releases the directory lock
  if (dir_fd_ >= 0) close(dir_fd_);
}

// --- helpers ------------------------------------------------------------------------------

void SsdStore::Log(int32_t level, const std::string& msg) const {
  plugin::HostLog(host_, level, kName, msg);
}

uint64_t SsdStore::NowNs() const {
  if (HostHas(host_, offsetof(kvb_host_services_t, now_ns) + sizeof(host_->now_ns)) &&
      host_->now_ns != nullptr) {
    return host_->now_ns(host_->host_ctx);
  }
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

uint64_t SsdStore::FootprintOf(const Bucket& b) const {
  const uint64_t footer =
      b.state == Bucket::State::kSealed ? b.footer_bytes : FooterBytes(b.footer_entry_bytes);
  return b.alloc_end - b.reclaimed + footer;
}

template <typename Fn>
void SsdStore::Mutate(Bucket* b, Fn&& fn) {
  const bool counted = !b->gone;
  if (counted) used_bytes_ -= FootprintOf(*b);
  fn();
  if (counted) used_bytes_ += FootprintOf(*b);
}

std::shared_ptr<FileHandle> SsdStore::OpenBucketFile(const std::shared_ptr<Bucket>& b, bool create,
                                                     int* rc) {
  std::lock_guard<std::mutex> open_lk(b->open_mu);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (b->file != nullptr) return b->file;
  }
  const int flags = O_RDWR | O_CLOEXEC | (direct_ ? O_DIRECT : 0) | (create ? O_CREAT : 0);
  const int fd = openat(dir_fd_, b->name.c_str(), flags, 0644);
  if (fd < 0) {
    *rc = -errno;
    return nullptr;
  }
  // The new file's name must survive a crash as surely as the records written into it.
  if (create && fsync(dir_fd_) != 0) {
    *rc = -errno;
    close(fd);
    return nullptr;
  }
  auto fh = std::make_shared<FileHandle>(fd);
  std::lock_guard<std::mutex> lk(mu_);
  b->file = fh;
  open_files_.push_back(b);
  // Bound the open files: forget the oldest handles (users keep theirs until done).
  while (open_files_.size() > kMaxOpenFiles) {
    if (auto old = open_files_.front().lock()) old->file.reset();
    open_files_.erase(open_files_.begin());
  }
  return fh;
}

void SsdStore::DropBucketLocked(const std::shared_ptr<Bucket>& b) {
  used_bytes_ -= FootprintOf(*b);
  b->gone = true;
  buckets_.erase(b->id);
  if (active_ == b) active_.reset();
  journal_->NoteStale(b->kills.size());
}

void SsdStore::Unlink(const std::vector<std::shared_ptr<Bucket>>& buckets) {
  if (buckets.empty()) return;
  for (const auto& b : buckets) {
    if (unlinkat(dir_fd_, b->name.c_str(), 0) != 0 && errno != ENOENT) {
      Log(KVB_LOG_WARN, "cannot remove " + dir_ + "/" + b->name + ": " + Err(errno));
    }
  }
  fsync(dir_fd_);
}

bool SsdStore::MakeRoomLocked(uint64_t need, Evicted* evicted) {
  if (on_evict_ == nullptr) return false;
  std::vector<std::shared_ptr<Bucket>> candidates;
  for (const auto& [id, b] : buckets_) {
    if (b->state == Bucket::State::kSealed && !b->sealing && b->pending_writes == 0 &&
        b != active_) {
      candidates.push_back(b);
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const auto& x, const auto& y) {
    return x->last_read_ns != y->last_read_ns ? x->last_read_ns < y->last_read_ns : x->id < y->id;
  });
  uint64_t freed = 0;
  size_t take = 0;
  while (used_bytes_ - freed + need > capacity_ && take < candidates.size()) {
    freed += FootprintOf(*candidates[take++]);
  }
  if (used_bytes_ - freed + need > capacity_) return false;
  for (size_t i = 0; i < take; ++i) {
    const auto& b = candidates[i];
    for (const auto& [off, key] : b->live) {
      auto it = index_.find(key);
      if (it != index_.end() && it->second.bucket == b && it->second.offset == off) {
        index_.erase(it);
        --object_count_;
        evicted->keys.push_back(key);
      }
    }
    b->live.clear();
    DropBucketLocked(b);
    evicted->buckets.push_back(b);
    ++evicted_buckets_;
  }
  return true;
}

void SsdStore::ReportEvicted(const Evicted& evicted) {
  if (evicted.buckets.empty()) return;
  Log(KVB_LOG_INFO, "evicted " + std::to_string(evicted.buckets.size()) +
                        " least recently read buckets (" + std::to_string(evicted.keys.size()) +
                        " objects) to make room");
  for (const std::string& key : evicted.keys) {
    on_evict_(on_evict_user_, reinterpret_cast<const uint8_t*>(key.data()),
              static_cast<uint32_t>(key.size()));
  }
}

void SsdStore::MaybeSeal(const std::shared_ptr<Bucket>& b) {
  std::vector<IndexEntry> entries;
  uint64_t footer_at = 0;
  std::shared_ptr<FileHandle> fh;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (b->gone || b->state != Bucket::State::kFull || b->pending_writes != 0 || b->sealing) {
      return;
    }
    if (b->live.empty()) {
      DropBucketLocked(b);
    } else {
      b->sealing = true;
      for (const auto& [off, key] : b->live) {
        const Entry& e = index_.at(key);
        entries.push_back({off, e.record_bytes, e.data_len, e.seq, key, e.meta});
      }
      footer_at = b->alloc_end;
      fh = b->file;
    }
  }
  if (entries.empty()) {
    Unlink({b});
    return;
  }
  std::vector<uint8_t> footer;
  EncodeFooter(b->id, entries, &footer);
  int rc = 0;
  if (fh == nullptr) fh = OpenBucketFile(b, false, &rc);
  if (fh != nullptr) {
    BufferSource src(footer);
    rc = io_->Write(fh->fd(), footer_at, footer.size(), &src);
    if (rc == 0) rc = b->sync.Sync(fh->fd(), config_.test_sync_delay_ms);
  }
  if (rc != 0) {
    Log(KVB_LOG_WARN, dir_ + "/" + b->name + ": cannot write its index (" + Err(-rc) +
                          "); the next start scans it instead");
  }
  bool drop = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    b->sealing = false;
    Mutate(b.get(), [&] {
      b->state = Bucket::State::kSealed;
      b->footer_bytes = rc == 0 ? footer.size() : 0;
    });
    if (b->live.empty() && !b->gone) {  // everything was removed while the index was written
      DropBucketLocked(b);
      drop = true;
    }
  }
  if (drop) Unlink({b});
}

void SsdStore::Punch(const std::shared_ptr<Bucket>& b, uint64_t offset, uint64_t length) {
  std::shared_ptr<FileHandle> fh;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (b->gone) return;
    if (b->readers > 0) {  // a get may be reading these very blocks
      b->deferred_punches.emplace_back(offset, length);
      return;
    }
    fh = b->file;
  }
  int rc = 0;
  if (fh == nullptr) fh = OpenBucketFile(b, false, &rc);
  if (fh == nullptr) return;  // never created (its first write failed) or already gone
  if (fallocate(fh->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(length)) != 0) {
    rc = -errno;
  }
  bool log_unsupported = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (rc == 0) {
      Mutate(b.get(), [&] { b->reclaimed += length; });
    } else if (!punch_unsupported_logged_) {
      punch_unsupported_logged_ = true;
      log_unsupported = true;
    }
  }
  if (log_unsupported) {
    Log(KVB_LOG_WARN, dir_ + ": cannot punch holes (" + Err(-rc) +
                          "); space of removed objects comes back only when their whole bucket "
                          "is gone");
  }
}

std::vector<JournalEntry> SsdStore::LiveKillsLocked() const {
  std::vector<JournalEntry> out;
  for (const auto& [id, b] : buckets_) out.insert(out.end(), b->kills.begin(), b->kills.end());
  return out;
}

void SsdStore::DropCorrupt(std::string_view key, const std::shared_ptr<Bucket>& b, uint64_t offset,
                           uint64_t seq, const std::string& why) {
  const JournalEntry kill{b->id, offset, seq};
  uint64_t record_bytes = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(std::string(key));
    if (it == index_.end() || it->second.bucket != b || it->second.seq != seq) return;
    record_bytes = it->second.record_bytes;
    const uint64_t fe = FooterEntryBytes(key.size(), it->second.meta.size());
    index_.erase(it);
    --object_count_;
    ++dropped_corrupt_;
    b->live.erase(offset);
    Mutate(b.get(), [&] { b->footer_entry_bytes -= fe; });
    b->kills.push_back(kill);
  }
  Log(KVB_LOG_ERROR, dir_ + "/" + b->name + ": object " + KeyForLog(key) + " at offset " +
                         std::to_string(offset) + " dropped: " + why);
  if (int rc = journal_->Append(kill); rc != 0) {
    Log(KVB_LOG_WARN, "cannot record the drop in " + dir_ + "/" + kJournalFile + " (" + Err(-rc) +
                          "); the object is listed again after a restart");
  }
  Punch(b, offset, record_bytes);
}

// --- the ops ------------------------------------------------------------------------------

kvb_status_t SsdStore::Put(std::string_view key, const kvb_iovec_t* iov, uint32_t iov_count,
                           std::string_view meta) {
  if (key.empty() || key.size() > kMaxKeyBytes || meta.size() > kMaxMetaBytes ||
      (iov == nullptr && iov_count != 0)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  uint64_t data_len = 0;
  for (uint32_t i = 0; i < iov_count; ++i) {
    if (iov[i].base == nullptr && iov[i].length != 0) return KVB_ERR_INVALID_ARGUMENT;
    data_len += iov[i].length;
  }
  const uint64_t rb = RecordBytes(key.size(), meta.size(), data_len);
  const uint64_t fe = FooterEntryBytes(key.size(), meta.size());
  if (rb > capacity_) return KVB_ERR_NO_SPACE;

  std::string k(key);
  std::shared_ptr<Bucket> b, to_seal;
  std::shared_ptr<FileHandle> fh;
  Evicted evicted;
  uint64_t offset = 0, seq = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (index_.count(k) != 0) return KVB_ERR_ALREADY_EXISTS;
    // Into the bucket being written when it fits (an empty one takes any size), else a new one.
    const bool fits =
        active_ != nullptr &&
        (active_->alloc_end == 0 ||
         active_->alloc_end + rb + FooterBytes(active_->footer_entry_bytes + fe) <= bucket_bytes_);
    const uint64_t need = fits ? rb + FooterBytes(active_->footer_entry_bytes + fe) -
                                     FooterBytes(active_->footer_entry_bytes)
                               : rb + FooterBytes(fe);
    if (used_bytes_ + need > capacity_ && !MakeRoomLocked(need, &evicted)) {
      return KVB_ERR_NO_SPACE;
    }
    if (fits) {
      b = active_;
    } else {
      if (active_ != nullptr) {
        Mutate(active_.get(), [&] { active_->state = Bucket::State::kFull; });
        to_seal = active_;
      }
      const uint64_t id = next_bucket_id_++;
      b = std::make_shared<Bucket>(id, BucketFileName(id));
      b->last_read_ns = NowNs();
      buckets_[id] = b;
      active_ = b;
    }
    offset = b->alloc_end;
    seq = next_seq_++;
    Mutate(b.get(), [&] {
      b->alloc_end += rb;
      b->footer_entry_bytes += fe;
    });
    ++b->pending_writes;
    b->live[offset] = k;
    Entry& e = index_[k];
    e.bucket = b;
    e.offset = offset;
    e.record_bytes = rb;
    e.data_len = data_len;
    e.seq = seq;
    e.meta.assign(meta);
    e.pending = true;
    fh = b->file;
  }
  Unlink(evicted.buckets);
  ReportEvicted(evicted);
  if (to_seal != nullptr) MaybeSeal(to_seal);

  int rc = 0;
  if (fh == nullptr) fh = OpenBucketFile(b, true, &rc);
  if (fh != nullptr) {
    RecordHeader h;
    h.key_len = static_cast<uint32_t>(key.size());
    h.meta_len = static_cast<uint32_t>(meta.size());
    h.data_len = data_len;
    h.seq = seq;
    h.key_hash = KeyHash(key);
    h.bucket_id = b->id;
    h.offset = offset;
    SealHeader(&h);
    RecordWriter writer(h, key, meta, iov, iov_count);
    rc = io_->Write(fh->fd(), offset, rb, &writer);
    if (rc == 0) rc = b->sync.Sync(fh->fd(), config_.test_sync_delay_ms);
  }
  bool seal_now = false;
  const JournalEntry kill{b->id, offset, seq};
  {
    std::lock_guard<std::mutex> lk(mu_);
    --b->pending_writes;
    auto it = index_.find(k);
    if (rc == 0) {
      it->second.pending = false;
      ++object_count_;
      ++puts_;
    } else {
      index_.erase(it);
      b->live.erase(offset);
      Mutate(b.get(), [&] { b->footer_entry_bytes -= fe; });
      b->kills.push_back(kill);
    }
    seal_now = b->state == Bucket::State::kFull && b->pending_writes == 0;
  }
  if (rc != 0) {
    Log(rc == -ENOSPC ? KVB_LOG_WARN : KVB_LOG_ERROR,
        "put " + KeyForLog(key) + " (" + Bytes(data_len) + ") failed: writing " + dir_ + "/" +
            b->name + " at offset " + std::to_string(offset) + ": " + Err(-rc));
    // The record may be complete on disk (only its fdatasync failed): make sure it stays dead.
    (void)journal_->Append(kill);
    Punch(b, offset, rb);
  }
  if (seal_now) MaybeSeal(b);
  return StatusOf(rc);
}

kvb_status_t SsdStore::Get(std::string_view key, const kvb_iovec_t* iov, uint32_t iov_count,
                           uint64_t* length) {
  if (key.empty() || key.size() > kMaxKeyBytes || (iov == nullptr && iov_count != 0)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  uint64_t room = 0;
  for (uint32_t i = 0; i < iov_count; ++i) room += iov[i].length;
  std::shared_ptr<Bucket> b;
  std::shared_ptr<FileHandle> fh;
  uint64_t offset, rb, data_len, seq;
  uint32_t meta_len;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(std::string(key));
    if (it == index_.end() || it->second.pending) return KVB_ERR_NOT_FOUND;
    const Entry& e = it->second;
    if (length != nullptr) *length = e.data_len;
    if (room < e.data_len) return KVB_ERR_INVALID_ARGUMENT;
    b = e.bucket;
    offset = e.offset;
    rb = e.record_bytes;
    data_len = e.data_len;
    seq = e.seq;
    meta_len = static_cast<uint32_t>(e.meta.size());
    ++b->readers;
    b->last_read_ns = NowNs();
    fh = b->file;
  }
  int rc = 0;
  if (fh == nullptr) fh = OpenBucketFile(b, false, &rc);
  IovCursor out(iov, iov_count);
  RecordChecker check(b->id, offset, UINT64_MAX, {true, key, seq, data_len, meta_len}, &out);
  bool bad_record = false;
  if (fh != nullptr) {
    rc = io_->Read(fh->fd(), offset, rb, &check);
    bad_record = rc == IoEngine::kStopped || (rc == 0 && !check.Verify());
  }
  std::vector<std::pair<uint64_t, uint64_t>> punches;
  bool still_indexed = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (--b->readers == 0) punches.swap(b->deferred_punches);
    ++gets_;
    auto it = index_.find(std::string(key));
    still_indexed = it != index_.end() && it->second.bucket == b && it->second.seq == seq;
  }
  for (const auto& [off, len] : punches) Punch(b, off, len);
  if (rc < 0) {
    Log(KVB_LOG_ERROR, "get " + KeyForLog(key) + ": reading " + dir_ + "/" + b->name +
                           " at offset " + std::to_string(offset) + ": " + Err(-rc));
    return KVB_ERR_IO;
  }
  if (bad_record) {
    if (!still_indexed) return KVB_ERR_NOT_FOUND;  // removed or evicted while we read
    DropCorrupt(key, b, offset, seq, check.why());
    return KVB_ERR_IO;
  }
  return KVB_OK;
}

kvb_status_t SsdStore::Remove(std::string_view key) {
  if (key.empty() || key.size() > kMaxKeyBytes) return KVB_ERR_INVALID_ARGUMENT;
  std::string k(key);
  Entry removed;
  JournalEntry kill;
  uint64_t fe;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(k);
    if (it == index_.end() || it->second.pending) return KVB_ERR_NOT_FOUND;
    removed = std::move(it->second);
    index_.erase(it);
    --object_count_;
    Bucket* b = removed.bucket.get();
    fe = FooterEntryBytes(k.size(), removed.meta.size());
    b->live.erase(removed.offset);
    Mutate(b, [&] { b->footer_entry_bytes -= fe; });
    kill = {b->id, removed.offset, removed.seq};
    b->kills.push_back(kill);
  }
  const std::shared_ptr<Bucket>& b = removed.bucket;
  if (int rc = journal_->Append(kill); rc != 0) {
    // Not durable: put the object back, unless its bucket went meanwhile or the key was reused.
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!b->gone && index_.count(k) == 0) {
        b->live[removed.offset] = k;
        Mutate(b.get(), [&] { b->footer_entry_bytes += fe; });
        index_.emplace(k, std::move(removed));
        ++object_count_;
      }
      auto& kills = b->kills;
      for (auto it = kills.begin(); it != kills.end(); ++it) {
        if (it->offset == kill.offset && it->seq == kill.seq) {
          kills.erase(it);
          break;
        }
      }
    }
    Log(KVB_LOG_ERROR, "remove " + KeyForLog(key) + ": cannot write " + dir_ + "/" + kJournalFile +
                           ": " + Err(-rc));
    return KVB_ERR_IO;
  }
  Punch(b, removed.offset, removed.record_bytes);
  bool drop = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++removes_;
    if (b->live.empty() && !b->gone && b->state == Bucket::State::kSealed && !b->sealing) {
      DropBucketLocked(b);
      drop = true;
    }
  }
  if (drop) Unlink({b});
  if (journal_->WantsCompaction()) {
    // Lock order: the journal's mutex, then mu_ (inside the callback); never the other way.
    const int rc = journal_->Rewrite([this] {
      std::lock_guard<std::mutex> lk(mu_);
      return LiveKillsLocked();
    });
    if (rc != 0) Log(KVB_LOG_WARN, "cannot compact " + dir_ + "/" + kJournalFile + ": " + Err(-rc));
  }
  return KVB_OK;
}

kvb_status_t SsdStore::ForEach(kvb_storage_visit_fn visit, kvb_storage_visit_meta_fn visit_meta,
                               void* user) {
  struct Item {
    std::string key;
    uint64_t length;
    std::string meta;
  };
  std::vector<Item> items;
  {
    std::lock_guard<std::mutex> lk(mu_);
    items.reserve(object_count_);
    for (const auto& [key, e] : index_) {
      if (!e.pending) items.push_back({key, e.data_len, visit_meta != nullptr ? e.meta : ""});
    }
  }
  for (const Item& it : items) {
    const auto* k = reinterpret_cast<const uint8_t*>(it.key.data());
    const auto kl = static_cast<uint32_t>(it.key.size());
    if (visit_meta != nullptr) {
      visit_meta(user, k, kl, it.length, reinterpret_cast<const uint8_t*>(it.meta.data()),
                 static_cast<uint32_t>(it.meta.size()));
    } else {
      visit(user, k, kl, it.length);
    }
  }
  return KVB_OK;
}

kvb_status_t SsdStore::Usage(kvb_storage_usage_t* out) {
  if (out == nullptr ||
      out->struct_size < offsetof(kvb_storage_usage_t, object_count) + sizeof(out->object_count)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lk(mu_);
  out->capacity_bytes = capacity_;
  out->used_bytes = used_bytes_;
  out->object_count = object_count_;
  return KVB_OK;
}

}  // namespace kvbridge::ssd
