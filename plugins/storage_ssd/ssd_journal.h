// Durability pieces shared by the ssd store: GroupSync (many writers, one fdatasync) and
// Journal, the removal journal "removed.log" (fixed 32-byte entries naming dead records).
//
// Thread-safety: both may be used from any number of threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "ssd_format.h"

namespace kvbridge::ssd {

// Group commit: Sync(fd) returns once every write to the file that completed before the call is
// durable. Callers that arrive while an fdatasync runs share the next one instead of each
// issuing their own. 0 or -errno of the fdatasync that covered the caller.
class GroupSync {
 public:
  // `delay_ms` (tests only, ssd.test_sync_delay_ms): the fdatasync waits this long first, as on
  // a slow disk; callers that arrive meanwhile share it as usual.
  int Sync(int fd, uint32_t delay_ms = 0);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t issued_ = 0, synced_ = 0, failed_upto_ = 0;  // tickets
  int failed_rc_ = 0;
  bool running_ = false;
};

// removed.log in a directory: appended with pwrite and made durable with a shared fdatasync.
// Blocks are preallocated ahead of the end, so a remove still works on a full file system.
class Journal {
 public:
  static constexpr const char* kFileName = "removed.log";
  // Rewritten at run time once this long and at least half stale.
  static constexpr uint64_t kCompactBytes = 64 * 1024;

  // `sync_delay_ms`: GroupSync::Sync's test delay, for the journal's syncs.
  explicit Journal(int dir_fd, uint32_t sync_delay_ms = 0)
      : dir_fd_(dir_fd), sync_delay_ms_(sync_delay_ms) {}
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Opens (creating) the file and returns every valid entry; *torn counts slots that fail their
  // CRC (appends that never returned). 0 or -errno.
  int Load(std::vector<JournalEntry>* out, uint64_t* torn);
  // Appends one entry and makes it durable. 0 or -errno.
  int Append(const JournalEntry& e);
  // Replaces the file with exactly what entries() returns: a new file, made durable, renamed
  // over the old. Appends wait meanwhile, and entries() runs once none is in progress, so an
  // entry is either in what it returns or appended to the new file afterwards. 0 or -errno.
  int Rewrite(const std::function<std::vector<JournalEntry>()>& entries);

  // `n` entries now name records of a bucket that is gone.
  void NoteStale(uint64_t n) { stale_.fetch_add(n, std::memory_order_relaxed); }
  bool WantsCompaction();

 private:
  void Preallocate();  // needs mu_ (or no other user yet)
  int RewriteLocked(const std::vector<JournalEntry>& entries);

  const int dir_fd_;
  const uint32_t sync_delay_ms_;
  std::mutex mu_;
  std::condition_variable idle_cv_;
  int appending_ = 0;                    // guarded by mu_
  bool compacting_ = false;              // guarded by mu_
  int fd_ = -1;                          // guarded by mu_
  uint64_t end_ = 0, prealloc_end_ = 0;  // guarded by mu_
  std::shared_ptr<GroupSync> sync_;      // guarded by mu_; one per file
  std::atomic<uint64_t> stale_{0};
};

}  // namespace kvbridge::ssd
