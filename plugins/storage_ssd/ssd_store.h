// kvbridge::ssd::SsdStore: the ssd storage plugin's backend. Keyed objects in append-only bucket
// files under one directory, an in-memory index rebuilt from the files at create, a removal
// journal, eviction of whole buckets when full. See README.md for the behaviour and the format.
//
// Durability: Put returns once the record's bytes and everything needed to read them back are
// on stable storage (O_DIRECT write, then fdatasync shared by the puts in flight on the same
// bucket); Remove returns once its journal entry is. A get never returns bytes whose checksum
// fails.
//
// Thread-safety: every method may be called concurrently, except the destructor (the ABI's
// destroy). One mutex guards the index and the bucket table; it is never held across file I/O
// or a call into the host (on_evict, log).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvbridge/plugin/storage.h"
#include "ssd_format.h"
#include "ssd_io.h"
#include "ssd_journal.h"
#include "ssd_record.h"

namespace kvbridge::ssd {

inline constexpr uint64_t kMiB = uint64_t{1} << 20;

// Every ssd.* configuration key; see README.md.
struct Config {
  uint64_t bucket_bytes = 64 * kMiB;        // a bucket is sealed when the next record won't fit
  IoMode io = IoMode::kAuto;                // io_uring, pread/pwrite, or io_uring when it works
  uint64_t max_inflight_bytes = 64 * kMiB;  // staging memory: bound on bytes moving to/from disk
  uint32_t test_sync_delay_ms = 0;          // tests only: every fdatasync waits this long first
};

// Reads the ssd.* keys through host->config_get; unset keys keep their defaults. Returns false
// with a message naming the key when a value is malformed or out of range.
bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err);

// An open file, closed when the last user lets go of it.
class FileHandle {
 public:
  explicit FileHandle(int fd) : fd_(fd) {}
  ~FileHandle() { close(fd_); }
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;
  int fd() const { return fd_; }

 private:
  const int fd_;
};

// One bucket file and what the store knows about it. The fields under "Guarded by" belong to
// SsdStore::mu_.
struct Bucket {
  enum class State { kActive, kFull, kSealed };

  Bucket(uint64_t bucket_id, std::string file_name) : id(bucket_id), name(std::move(file_name)) {}

  const uint64_t id;
  const std::string name;  // file name inside the directory
  std::mutex open_mu;      // one thread opens (or creates) the file at a time
  GroupSync sync;

  // Guarded by SsdStore::mu_.
  std::shared_ptr<FileHandle> file;
  State state = State::kActive;
  uint64_t alloc_end = 0;           // where the next record goes (the data end once full)
  uint64_t reclaimed = 0;           // bytes of dead records whose blocks were given back
  uint64_t footer_entry_bytes = 0;  // what the live records' footer entries take
  uint64_t footer_bytes = 0;        // the footer written at seal (0: none)
  uint32_t pending_writes = 0;
  uint32_t readers = 0;
  bool sealing = false;
  bool gone = false;  // out of the table; its file is (being) unlinked
  uint64_t last_read_ns = 0;
  std::map<uint64_t, std::string> live;  // offset -> key of every record in the index
  std::vector<std::pair<uint64_t, uint64_t>> deferred_punches;  // waiting for readers to leave
  std::vector<JournalEntry> kills;  // this bucket's entries in removed.log
};

// Small helpers shared by ssd_store.cc and ssd_recover.cc.
std::string Err(int e);                       // strerror
std::string Bytes(uint64_t n);                // "64 MiB", "4 KiB", "1000 bytes"
std::string KeyForLog(std::string_view key);  // printable, \xNN for the rest, cut at 64
kvb_status_t StatusOf(int neg_errno);         // 0 -> OK, ENOSPC/EDQUOT -> NO_SPACE, else IO

class SsdStore {
 public:
  // Validates params and configuration, prepares the directory (creating it when its parent
  // exists), takes its lock, sets up I/O and rebuilds the index from the files there. On
  // failure returns the code and a one-line reason naming the path in *err; *out is untouched.
  static kvb_status_t Create(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                             std::unique_ptr<SsdStore>* out, std::string* err);
  // Seals the bucket being written, so the next create reads its index instead of scanning it.
  ~SsdStore();
  SsdStore(const SsdStore&) = delete;
  SsdStore& operator=(const SsdStore&) = delete;

  // INVALID_ARGUMENT for a malformed request, ALREADY_EXISTS, NO_SPACE (capacity or the file
  // system is full; nothing is left visible), IO.
  kvb_status_t Put(std::string_view key, const kvb_iovec_t* iov, uint32_t iov_count,
                   std::string_view meta);
  // NOT_FOUND, INVALID_ARGUMENT (iov too small; *length still set), IO (read error, or a checksum
  // mismatch: the object is then dropped for good).
  kvb_status_t Get(std::string_view key, const kvb_iovec_t* iov, uint32_t iov_count,
                   uint64_t* length);
  kvb_status_t Remove(std::string_view key);
  // Calls exactly one of the two visitors once per stored object, outside the store's lock.
  kvb_status_t ForEach(kvb_storage_visit_fn visit, kvb_storage_visit_meta_fn visit_meta,
                       void* user);
  kvb_status_t Usage(kvb_storage_usage_t* out);

 private:
  struct Entry {
    std::shared_ptr<Bucket> bucket;
    uint64_t offset = 0;
    uint64_t record_bytes = 0;
    uint64_t data_len = 0;
    uint64_t seq = 0;
    std::string meta;
    bool pending = true;  // being written: invisible to get, remove and for_each
  };
  struct Evicted {
    std::vector<std::shared_ptr<Bucket>> buckets;  // to unlink
    std::vector<std::string> keys;                 // to report through on_evict
  };

  SsdStore(const kvb_host_services_t* host, const kvb_storage_params_t* params,
           const Config& config);
  kvb_status_t Open(std::string* err);
  kvb_status_t PrepareDirectory(std::string* err);
  kvb_status_t Recover(std::string* err);

  void Log(int32_t level, const std::string& msg) const;
  uint64_t NowNs() const;
  uint64_t FootprintOf(const Bucket& b) const;
  template <typename Fn>
  void Mutate(Bucket* b, Fn&& fn);  // applies fn, keeping used_bytes_ in step; needs mu_

  // The bucket's file handle, opening it when it is not open (creating the file for a bucket
  // that has none yet). Null with -errno in *rc on failure.
  std::shared_ptr<FileHandle> OpenBucketFile(const std::shared_ptr<Bucket>& b, bool create,
                                             int* rc);
  // Picks buckets to evict (least recently read first) until `need` more bytes fit; false when
  // even evicting every candidate would not make room (then nothing changes). Needs mu_.
  bool MakeRoomLocked(uint64_t need, Evicted* evicted);
  // Takes a bucket with no live object out of the table (the caller unlinks it). Needs mu_.
  void DropBucketLocked(const std::shared_ptr<Bucket>& b);
  void Unlink(const std::vector<std::shared_ptr<Bucket>>& buckets);
  void ReportEvicted(const Evicted& evicted);
  // Writes the footer of a full bucket once nothing is in flight on it.
  void MaybeSeal(const std::shared_ptr<Bucket>& b);
  // Frees the disk blocks of a dead record (best effort); accounts for them.
  void Punch(const std::shared_ptr<Bucket>& b, uint64_t offset, uint64_t length);
  // Forgets an object whose record failed its checksum: index, journal, blocks.
  void DropCorrupt(std::string_view key, const std::shared_ptr<Bucket>& b, uint64_t offset,
                   uint64_t seq, const std::string& why);
  std::vector<JournalEntry> LiveKillsLocked() const;

  const kvb_host_services_t* host_;
  const std::string dir_;
  const uint64_t capacity_;
  const kvb_storage_evict_fn on_evict_;
  void* const on_evict_user_;
  Config config_;
  uint64_t bucket_bytes_ = 0;  // config_.bucket_bytes, or less for a small capacity
  bool direct_ = true;         // O_DIRECT works here
  bool ready_ = false;         // Open succeeded
  int dir_fd_ = -1;
  int lock_fd_ = -1;
  std::unique_ptr<IoEngine> io_;
  std::unique_ptr<Journal> journal_;

  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> index_;                   // guarded by mu_
  std::unordered_map<uint64_t, std::shared_ptr<Bucket>> buckets_;  // guarded by mu_
  std::shared_ptr<Bucket> active_;                                 // guarded by mu_
  std::vector<std::weak_ptr<Bucket>> open_files_;                  // guarded by mu_
  uint64_t used_bytes_ = 0;                                        // guarded by mu_
  uint64_t object_count_ = 0;                                      // guarded by mu_
  uint64_t next_seq_ = 1;                                          // guarded by mu_
  uint64_t next_bucket_id_ = 1;                                    // guarded by mu_
  bool punch_unsupported_logged_ = false;                          // guarded by mu_
  // Counters for the closing log line; guarded by mu_.
  uint64_t puts_ = 0, gets_ = 0, removes_ = 0, evicted_buckets_ = 0, dropped_corrupt_ = 0;
};

}  // namespace kvbridge::ssd
