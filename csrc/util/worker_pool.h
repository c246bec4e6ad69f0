// A few threads that help the calling thread through one large piece of CPU work: the engine's
// in-process copies, the store client's checksums of a put. On a host whose memory one core
// cannot saturate (this project's test VM copies 8-9 GB/s from one core and 13-16 GB/s from
// two), a 16 MiB batch copied by two threads takes a little over half as long.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace kvbridge::util {

class WorkerPool {
 public:
  // `threads` counts the caller: 1 (or 0) runs everything on the calling thread. Helpers are
  // started by the first Run that can use them, not here.
  explicit WorkerPool(unsigned threads);
  ~WorkerPool();  // joins the helpers; no Run may be in progress
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  unsigned threads() const { return threads_; }

  // Calls fn(i) once for every i in [0, n), on the calling thread and the helpers, indices
  // handed out in order as threads come free, and returns when every call has returned. One
  // Run at a time uses the helpers: a Run that finds another in progress does all of its work
  // on its own thread (it never waits for the pool). `fn` must not throw.
  void Run(size_t n, const std::function<void(size_t)>& fn);

  // The default for "as many threads as help": the CPUs this process may run on, at most 4
  // (past that a copy is bound by memory, not by cores).
  static unsigned DefaultThreads();

 private:
  void Helper();

  const unsigned threads_;
  std::mutex run_mu_;  // held by the Run that uses the helpers
  std::mutex mu_;      // guards what follows but next_
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<std::thread> helpers_;
  const std::function<void(size_t)>* fn_ = nullptr;  // the open job; null between jobs
  size_t n_ = 0;
  uint64_t job_ = 0;     // counts jobs, so that a helper joins each at most once
  unsigned active_ = 0;  // helpers inside the open job
  bool stop_ = false;
  std::atomic<size_t> next_{0};  // the next index to hand out
};

// A pass over the bytes of `lengths.size()` items (copies, checksums) that returns each item's
// CRC-32C: fn(item, at, len) handles bytes [at, at+len) of an item and returns their CRC (any
// value when the caller does not use an item's CRC). From 1 MiB in all, items are cut into
// 256 KiB parts that the pool's threads take in turn and each item's CRC is joined from its
// parts' (Crc32cCombine); below, fn(item, 0, length) runs for each item on the calling
// thread, where waking a helper would cost about as much as the work.
std::vector<uint32_t> CrcInParts(
    WorkerPool& pool, std::span<const uint64_t> lengths,
    const std::function<uint32_t(size_t item, uint64_t at, uint64_t len)>& fn);

}  // namespace kvbridge::util
