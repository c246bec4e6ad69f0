#include "util/worker_pool.h"

#include <sched.h>

#include <algorithm>

#include "util/checksum.h"

namespace kvbridge::util {

WorkerPool::WorkerPool(unsigned threads) : threads_(std::max(threads, 1u)) {}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

unsigned WorkerPool::DefaultThreads() {
  cpu_set_t set;
  unsigned cpus = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = static_cast<unsigned>(CPU_COUNT(&set));
  if (cpus == 0) cpus = std::thread::hardware_concurrency();
  return std::clamp(cpus, 1u, 4u);
}

void WorkerPool::Run(size_t n, const std::function<void(size_t)>& fn) {
  std::unique_lock<std::mutex> run(run_mu_, std::defer_lock);
  if (threads_ == 1 || n < 2 || !run.try_lock()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (helpers_.size() + 1 < threads_) helpers_.emplace_back([this] { Helper(); });
    fn_ = &fn;
    n_ = n;
    ++job_;
    next_.store(0, std::memory_order_relaxed);
  }
  work_cv_.notify_all();
  for (size_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
  // Close the job: a helper that wakes from now on finds nothing to join; wait for those in it.
  std::unique_lock<std::mutex> lock(mu_);
  fn_ = nullptr;
  done_cv_.wait(lock, [&] { return active_ == 0; });
}

void WorkerPool::Helper() {
  uint64_t joined = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || (fn_ != nullptr && job_ != joined); });
    if (stop_) return;
    joined = job_;
    const std::function<void(size_t)>* fn = fn_;
    const size_t n = n_;
    ++active_;
    lock.unlock();
    for (size_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) (*fn)(i);
    lock.lock();
    if (--active_ == 0) done_cv_.notify_all();
  }
}

std::vector<uint32_t> CrcInParts(
    WorkerPool& pool, std::span<const uint64_t> lengths,
    const std::function<uint32_t(size_t item, uint64_t at, uint64_t len)>& fn) {
  constexpr uint64_t kParallelBytes = 1 << 20, kPartBytes = 256 << 10;
  std::vector<uint32_t> crcs(lengths.size(), 0);
  uint64_t total = 0;
  for (uint64_t n : lengths) total += n;
  if (total < kParallelBytes || pool.threads() == 1) {
    for (size_t i = 0; i < lengths.size(); ++i) crcs[i] = fn(i, 0, lengths[i]);
    return crcs;
  }
  struct Part {
    size_t item;
    uint64_t at, len;
    uint32_t crc;
  };
  std::vector<Part> parts;
  parts.reserve(lengths.size() + total / kPartBytes);
  for (size_t i = 0; i < lengths.size(); ++i) {
    for (uint64_t at = 0; at < lengths[i]; at += kPartBytes) {
      parts.push_back({i, at, std::min(kPartBytes, lengths[i] - at), 0});
    }
  }
  pool.Run(parts.size(),
           [&](size_t k) { parts[k].crc = fn(parts[k].item, parts[k].at, parts[k].len); });
  for (const Part& p : parts) {
    crcs[p.item] = p.at == 0 ? p.crc : Crc32cCombine(crcs[p.item], p.crc, p.len);
  }
  return crcs;
}

}  // namespace kvbridge::util
