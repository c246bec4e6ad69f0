// kvbridge::ssd::IoEngine: moves record bytes between memory and bucket files through a pool of
// aligned staging buffers, with io_uring or with pread/pwrite.
//
// Every byte read or written passes through a staging buffer (chunk_bytes each, 4 KiB-aligned,
// registered with io_uring when the kernel lets us), so file I/O is always aligned for O_DIRECT
// whatever the caller's memory looks like. The pool holds max_inflight_bytes in all: that is
// the bound on bytes in flight to or from the disk across every concurrent operation. An
// operation that finds the pool empty waits; one that holds a buffer never waits for another,
// so operations cannot deadlock on the pool.
//
// With io_uring each operation takes a ring of its own from a small pool (created on demand) and
// keeps up to kMaxChunksPerOp chunks in flight on it; with pread/pwrite it moves one chunk at a
// time in the calling thread.
//
// Thread-safety: Write and Read may be called concurrently from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kvbridge::ssd {

enum class IoMode { kAuto, kUring, kSync };

// Produces the bytes of a write, in order: consecutive calls cover consecutive ranges.
class WriteSource {
 public:
  virtual ~WriteSource() = default;
  virtual void Fill(uint8_t* dst, uint64_t n) = 0;
};

// Takes the bytes of a read, in order. Returning false stops the read (Read returns kStopped).
class ReadSink {
 public:
  virtual ~ReadSink() = default;
  virtual bool Consume(const uint8_t* src, uint64_t n) = 0;
};

struct IoStats {
  uint64_t peak_inflight_bytes = 0;  // most bytes in flight at once
  uint64_t buffer_waits = 0;         // times an operation waited for a staging buffer
};

using LogFn = std::function<void(int32_t level, const std::string& msg)>;

// pread/pwrite of exactly n bytes, retrying short transfers and EINTR. 0, or -errno (-EIO when
// the file ends first).
int ReadExact(int fd, void* buf, uint64_t n, uint64_t off);
int WriteExact(int fd, const void* buf, uint64_t n, uint64_t off);

class IoEngine {
 public:
  // A 1 MiB object's record (data, 4 KiB of header and key) fits one chunk: one I/O.
  static constexpr uint64_t kDefaultChunkBytes = (1u << 20) + (64u << 10);
  static constexpr int kMaxChunksPerOp = 8;
  static constexpr int kStopped = 1;  // Read: the sink stopped it

  // Maps the staging pool (max_inflight_bytes, rounded down to whole chunks of
  // min(kDefaultChunkBytes, max_inflight_bytes)) and, for kUring/kAuto, sets up the first ring.
  // kAuto falls back to pread/pwrite when io_uring is unavailable, logging why; kUring fails
  // instead (false, reason in *err). Buffer registration failing is logged, and rings then use
  // unregistered buffers.
  static bool Create(IoMode mode, uint64_t max_inflight_bytes, LogFn log,
                     std::unique_ptr<IoEngine>* out, std::string* err);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Writes `length` bytes (a multiple of 4 KiB) at `offset` of `fd`, asking `src` for them in
  // order. Returns 0, or -errno of the first failure (the range's content is then unknown).
  int Write(int fd, uint64_t offset, uint64_t length, WriteSource* src);
  // Reads `length` bytes (a multiple of 4 KiB) at `offset` of `fd`, handing them to `sink` in
  // order. Returns 0, kStopped, or -errno (-EIO for a file shorter than the range).
  int Read(int fd, uint64_t offset, uint64_t length, ReadSink* sink);

  bool uses_uring() const { return uring_; }
  bool buffers_registered() const { return registered_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t pool_bytes() const { return chunk_bytes_ * buffers_.size(); }
  // One phrase for the log: "io_uring, 64 registered staging buffers of 1 MiB" or the like.
  std::string Describe() const;
  IoStats stats() const;

 private:
  struct Ring;

  IoEngine() = default;
  int AcquireBuffer(bool wait);
  void ReleaseBuffer(int index);
  void AddInflight(uint64_t n);
  void SubInflight(uint64_t n) { inflight_bytes_.fetch_sub(n, std::memory_order_relaxed); }
  Ring* AcquireRing(int* err);
  void ReleaseRing(Ring* r, bool broken);
  bool NewRing(std::unique_ptr<Ring>* out, std::string* err);
  int WriteSync(int fd, uint64_t offset, uint64_t length, WriteSource* src);
  int ReadSync(int fd, uint64_t offset, uint64_t length, ReadSink* sink);
  int WriteUring(int fd, uint64_t offset, uint64_t length, WriteSource* src);
  int ReadUring(int fd, uint64_t offset, uint64_t length, ReadSink* sink);
  int RunUring(int fd, uint64_t offset, uint64_t length, WriteSource* src, ReadSink* sink);

  LogFn log_;
  bool uring_ = false;
  bool registered_ = false;
  std::string why_sync_;  // when io_uring is not used: why
  uint64_t chunk_bytes_ = kDefaultChunkBytes;
  uint8_t* pool_ = nullptr;
  uint64_t pool_map_bytes_ = 0;
  std::vector<uint8_t*> buffers_;

  std::mutex buf_mu_;
  std::condition_variable buf_cv_;
  std::vector<int> free_buffers_;  // guarded by buf_mu_
  uint64_t buffer_waits_ = 0;      // guarded by buf_mu_

  std::atomic<uint64_t> inflight_bytes_{0};
  std::atomic<uint64_t> peak_inflight_bytes_{0};

  std::mutex ring_mu_;
  std::condition_variable ring_cv_;
  std::vector<std::unique_ptr<Ring>> rings_;  // guarded by ring_mu_
  std::vector<Ring*> free_rings_;             // guarded by ring_mu_
  size_t max_rings_ = 1;
};

}  // namespace kvbridge::ssd
