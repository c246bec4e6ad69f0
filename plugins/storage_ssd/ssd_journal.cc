#include "ssd_journal.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>

#include "ssd_io.h"

namespace kvbridge::ssd {
namespace {

constexpr const char* kTmpFileName = "removed.log.tmp";
constexpr uint64_t kPreallocBytes = 64 * 1024;

}  // namespace

int GroupSync::Sync(int fd, uint32_t delay_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  const uint64_t ticket = ++issued_;
  for (;;) {
    if (synced_ >= ticket) return 0;
    if (failed_upto_ >= ticket) return failed_rc_;
    if (!running_) break;
    cv_.wait(lk);
  }
  // Every write that completed before any ticket up to `target` was taken is covered.
  running_ = true;
  const uint64_t target = issued_;
  lk.unlock();
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  const int rc = fdatasync(fd) == 0 ? 0 : -errno;
  lk.lock();
  running_ = false;
  if (rc == 0) {
    synced_ = std::max(synced_, target);
  } else {
    failed_upto_ = std::max(failed_upto_, target);
    failed_rc_ = rc;
  }
  cv_.notify_all();
  return rc;
}

Journal::~Journal() {
  if (fd_ >= 0) close(fd_);
}

int Journal::Load(std::vector<JournalEntry>* out, uint64_t* torn) {
  std::lock_guard<std::mutex> lk(mu_);
  fd_ = openat(dir_fd_, kFileName, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) return -errno;
  struct stat st;
  if (fstat(fd_, &st) != 0) return -errno;
  const auto size = static_cast<uint64_t>(st.st_size);
  std::vector<uint8_t> bytes(size);
  if (int rc = ReadExact(fd_, bytes.data(), size, 0); rc != 0) return rc;
  *torn = 0;
  // Every slot is read: concurrent appends may leave a torn one before good ones.
  for (uint64_t off = 0; off + kJournalEntryBytes <= size; off += kJournalEntryBytes) {
    JournalEntry e;
    if (DecodeJournalEntry(bytes.data() + off, &e)) {
      out->push_back(e);
    } else if (std::any_of(bytes.begin() + off, bytes.begin() + off + kJournalEntryBytes,
                           [](uint8_t b) { return b != 0; })) {
      ++*torn;
    }
  }
  end_ = (size + kJournalEntryBytes - 1) / kJournalEntryBytes * kJournalEntryBytes;
  Preallocate();
  sync_ = std::make_shared<GroupSync>();
  return 0;
}

int Journal::Append(const JournalEntry& e) {
  int fd;
  uint64_t off, pre_from = 0, pre_len = 0;
  std::shared_ptr<GroupSync> sync;
  {
    std::unique_lock<std::mutex> lk(mu_);
    idle_cv_.wait(lk, [&] { return !compacting_; });
    off = end_;
    end_ += kJournalEntryBytes;
    if (end_ > prealloc_end_) {
      pre_from = prealloc_end_;
      prealloc_end_ = end_ + kPreallocBytes;
      pre_len = prealloc_end_ - pre_from;
    }
    ++appending_;
    fd = fd_;
    sync = sync_;
  }
  if (pre_len != 0) {
    (void)fallocate(fd, FALLOC_FL_KEEP_SIZE, static_cast<off_t>(pre_from),
                    static_cast<off_t>(pre_len));
  }
  uint8_t slot[kJournalEntryBytes];
  EncodeJournalEntry(e, slot);
  int rc = WriteExact(fd, slot, sizeof(slot), off);
  if (rc == 0) rc = sync->Sync(fd, sync_delay_ms_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    --appending_;
  }
  idle_cv_.notify_all();
  return rc;
}

int Journal::Rewrite(const std::function<std::vector<JournalEntry>()>& entries) {
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return !compacting_; });
  compacting_ = true;
  idle_cv_.wait(lk, [&] { return appending_ == 0; });
  const int rc = RewriteLocked(entries());
  compacting_ = false;
  idle_cv_.notify_all();
  return rc;
}

bool Journal::WantsCompaction() {
  std::lock_guard<std::mutex> lk(mu_);
  return end_ >= kCompactBytes &&
         stale_.load(std::memory_order_relaxed) * kJournalEntryBytes * 2 >= end_;
}

// Reserves blocks past the end now, so that removes still have room once the disk is full.
// Best effort: some file systems (ramfs) cannot.
void Journal::Preallocate() {
  prealloc_end_ = end_ + kPreallocBytes;
  (void)fallocate(fd_, FALLOC_FL_KEEP_SIZE, static_cast<off_t>(end_),
                  static_cast<off_t>(kPreallocBytes));
}

int Journal::RewriteLocked(const std::vector<JournalEntry>& entries) {
  const int tmp = openat(dir_fd_, kTmpFileName, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (tmp < 0) return -errno;
  std::vector<uint8_t> bytes(entries.size() * kJournalEntryBytes);
  for (size_t i = 0; i < entries.size(); ++i) {
    EncodeJournalEntry(entries[i], bytes.data() + i * kJournalEntryBytes);
  }
  int rc = WriteExact(tmp, bytes.data(), bytes.size(), 0);
  if (rc == 0 && fdatasync(tmp) != 0) rc = -errno;
  close(tmp);
  if (rc == 0 && renameat(dir_fd_, kTmpFileName, dir_fd_, kFileName) != 0) rc = -errno;
  if (rc == 0 && fsync(dir_fd_) != 0) rc = -errno;
  if (rc != 0) {
    unlinkat(dir_fd_, kTmpFileName, 0);
    return rc;
  }
  const int fd = openat(dir_fd_, kFileName, O_RDWR | O_CLOEXEC);
  if (fd < 0) return -errno;
  if (fd_ >= 0) close(fd_);
  fd_ = fd;
  end_ = bytes.size();
  Preallocate();
  stale_.store(0, std::memory_order_relaxed);
  sync_ = std::make_shared<GroupSync>();
  return 0;
}

}  // namespace kvbridge::ssd
